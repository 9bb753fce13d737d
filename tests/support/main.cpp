// Test main shared by every test program. `--gpus N` makes the program report "skipped" (exit
// code 77, ctest's SKIP_RETURN_CODE) when fewer than N GPUs are present. The GPUs are counted
// in a child process so that this process never initializes CUDA and can still fork ranks.
#define CATCH_CONFIG_RUNNER
#include "catch.hpp"

#include <wm/launch.hpp>

#include <cstdio>
#include <cstring>
#include <vector>

int main(int argc, char** argv)
{
  std::vector<char*> args;
  int need = 0;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--gpus") == 0 && i + 1 < argc) {
      need = std::atoi(argv[++i]);
    } else {
      args.push_back(argv[i]);
    }
  }
  if (need > 0) {
    int const have = wm::local_device_count();
    if (have < need) {
      std::printf("SKIPPED: this test needs %d GPU(s); %d found\n", need, have);
      return 77;
    }
  }
  return Catch::Session().run(static_cast<int>(args.size()), args.data());
}
