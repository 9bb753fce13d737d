#include <wm/wm.cuh>

#include <cstdio>

int main()
{
  // Only compiled and linked by the install test; running it needs GPUs.
  wm::launch(wm::local_device_count(), [](wm::communicator& comm) {
    auto const ranks = comm.all_gather(comm.rank());
    std::printf("rank %d of %d sees %zu ranks\n", comm.rank(), comm.size(), ranks.size());
  });
  return 0;
}
