// SPDX-License-Identifier: Apache-2.0
// Test main shared by every test program.
//   --gpus N    report "skipped" (exit code 77, ctest's SKIP_RETURN_CODE) when fewer than N GPUs
//               are present. The GPUs are counted in a child process, so this process never
//               initializes CUDA and can still fork ranks. A CUDA stack that cannot count them
//               (wm::local_device_count throws) fails the run (exit code 1), never skips it.
//   --ranks N   fork N ranks (`all`: one per GPU) and run the [ranked] cases inside every rank
//               (see ranks.hpp). Without it, the [ranked] cases are left out.
// Without a filter the [other_user] cases are left out as well (they need root; the ctest entry
// host_other_user names them). A case that calls wm_test::skip (skip.hpp) makes the run exit 77
// ("skipped") unless a case failed.
#define CATCH_CONFIG_RUNNER
#include <wm/launch.hpp>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <sys/mman.h>
#include <unistd.h>
#include <vector>

#include "catch.hpp"
#include "ranks.hpp"
#include "skip.hpp"

// Catch2 v2's single header defines CATCH_VERSION_MAJOR; v3 defines it in its own header, which
// only catch_all.hpp includes. What this main uses of v3 (session, listeners) is included here,
// so it builds whichever v3 headers catch.hpp chose.
#if !defined(CATCH_VERSION_MAJOR) && __has_include(<catch2/catch_version_macros.hpp>)
#include <catch2/catch_version_macros.hpp>
#endif
#if !defined(CATCH_VERSION_MAJOR)
#error "tests/support/main.cpp: cannot tell the Catch2 version (CATCH_VERSION_MAJOR)"
#endif
#if CATCH_VERSION_MAJOR >= 3
#include <catch2/catch_session.hpp>
#include <catch2/catch_test_case_info.hpp>
#include <catch2/reporters/catch_reporter_event_listener.hpp>
#include <catch2/reporters/catch_reporter_registrars.hpp>
#endif

namespace {

wm::communicator* this_rank_comm = nullptr;

#if CATCH_VERSION_MAJOR >= 3
using listener_base = Catch::EventListenerBase;
// Exit code 3 when a test spec matches no case (v3 also fails a run in which no case ran).
char const* const unmatched_filter_fails = "UnmatchedTestSpec";
#else
using listener_base = Catch::TestEventListenerBase;
// Exit code 2 when a test spec matches no case; v2 has no other guard.
char const* const unmatched_filter_fails = "NoTests";
#endif

// Catch2 v3 holds the case's info by pointer, v2 by value.
[[maybe_unused]] std::string const& case_name(Catch::TestCaseInfo const* info) {
  return info->name;
}
[[maybe_unused]] std::string const& case_name(Catch::TestCaseInfo const& info) {
  return info.name;
}

// Every rank learns which ranks failed the case that just ended (a host all-gather, with the
// communicator's deadline); rank 0 names them.
struct rank_agreement : listener_base {
  using listener_base::listener_base;
  void testCaseEnded(Catch::TestCaseStats const& stats) override {
    if (this_rank_comm == nullptr) { return; }
    int const mine    = stats.totals.assertions.failed > 0 ? 1 : 0;
    auto const failed = this_rank_comm->all_gather(mine);
    std::string ranks;
    for (std::size_t r = 0; r < failed.size(); ++r) {
      if (failed[r] != 0) { ranks += (ranks.empty() ? "" : ", ") + std::to_string(r); }
    }
    if (!ranks.empty()) {
      any_failed = true;
      if (this_rank_comm->rank() == 0) {
        std::cout << "FAILED on rank(s) " << ranks << " of " << failed.size() << ": "
                  << case_name(stats.testInfo) << std::endl;
      }
    }
  }
  static inline bool any_failed = false;
};

// The skip record: a shared anonymous page made before any rank is forked, so that a skip in a
// rank is seen by the launcher's main (a process-local flag where the page cannot be mapped).
std::atomic<int> local_skips{0};
std::atomic<int>* skips = &local_skips;
static_assert(std::atomic<int>::is_always_lock_free, "a lock-free counter in a shared page");

void share_skip_record() {
  void* const page = ::mmap(nullptr, sizeof(std::atomic<int>), PROT_READ | PROT_WRITE,
                            MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (page != MAP_FAILED) { skips = new (page) std::atomic<int>{0}; }
}

// The name of the case that is running, for skip()'s message.
std::string running_case;

struct case_name_keeper : listener_base {
  using listener_base::listener_base;
  void testCaseStarting(Catch::TestCaseInfo const& info) override { running_case = info.name; }
};

// Catch's exit code, or 77 where it reports success and some case skipped.
int with_skips(int catch_result) {
  return catch_result == 0 && wm_test::skipped() ? 77 : catch_result;
}

}  // namespace

CATCH_REGISTER_LISTENER(rank_agreement)
CATCH_REGISTER_LISTENER(case_name_keeper)

void wm_test::skip(std::string const& reason) {
  skips->fetch_add(1);
  std::cout << "SKIPPED: " << running_case << ": " << reason << std::endl;
}

bool wm_test::skipped() noexcept {
  return skips->load() > 0;
}

wm::communicator& wm_test::comm() {
  if (this_rank_comm == nullptr) {
    throw std::logic_error{"wm_test::comm(): only inside a [ranked] case run with --ranks"};
  }
  return *this_rank_comm;
}

int main(int argc, char** argv) {
  share_skip_record();
  std::vector<char*> args;
  int need  = 0;
  int ranks = 0;  // 0: not ranked; -1: one per GPU
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--gpus") == 0 && i + 1 < argc) {
      need = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--ranks") == 0 && i + 1 < argc) {
      ++i;
      ranks = std::strcmp(argv[i], "all") == 0 ? -1 : std::atoi(argv[i]);
    } else {
      args.push_back(argv[i]);
    }
  }
  // A filter that matches no case fails the run (a misspelt name, or a comma, which Catch reads
  // as "or", must not pass as an empty success).
  std::string const warn = "--warn", unmatched = unmatched_filter_fails;
  if (std::any_of(args.begin() + 1, args.end(), [](char const* a) { return a[0] != '-'; })) {
    args.push_back(const_cast<char*>(warn.c_str()));
    args.push_back(const_cast<char*>(unmatched.c_str()));
  }
  int have = 0;
  if (need > 0 || ranks < 0) {
    try {
      have = wm::local_device_count();  // 0 only when there is no GPU (or no driver at all)
    } catch (std::exception const& e) {
      // A CUDA stack that is present but broken fails the run: it must not pass as "skipped".
      std::printf("FAILED: cannot count the GPUs: %s\n", e.what());
      return 1;
    }
  }
  if (need > 0 && have < need) {
    std::printf("SKIPPED: this test needs %d GPU(s); %d found\n", need, have);
    return 77;
  }
  if (ranks == 0) {
    // The [ranked] cases need a rank's communicator: leave them out unless a filter names them.
    bool const filtered =
        std::any_of(args.begin() + 1, args.end(), [](char const* a) { return a[0] != '-'; });
    // Likewise the [other_user] cases: without root they end the program with 77 at once. (One
    // argument: Catch joins separate test specs with "or".)
    std::string const left_out = "~[ranked]~[other_user]";
    if (!filtered) { args.push_back(const_cast<char*>(left_out.c_str())); }
    return with_skips(Catch::Session().run(static_cast<int>(args.size()), args.data()));
  }
  if (ranks < 0) { ranks = have; }
  std::string const order = "--order", decl = "decl";
  args.push_back(const_cast<char*>(order.c_str()));  // the same cases in the same order everywhere
  args.push_back(const_cast<char*>(decl.c_str()));
  try {
    wm::launch(ranks, [&](wm::communicator& comm) {
      this_rank_comm = &comm;
      // Ranks other than 0 write to a file, shown only if that rank failed.
      std::string const log = "/tmp/wm-test-rank-" + std::to_string(::getpid()) + ".log";
      int saved             = -1;
      if (comm.rank() != 0) {
        std::fflush(nullptr);
        saved = ::dup(1);
        if (std::FILE* f = std::freopen(log.c_str(), "w", stdout); f == nullptr) { saved = -1; }
      }
      int const failed = Catch::Session().run(static_cast<int>(args.size()), args.data());
      bool const bad   = failed != 0 || rank_agreement::any_failed;
      if (saved >= 0) {
        std::fflush(nullptr);
        std::cout.flush();
        if (bad && comm.rank() != 0) {
          std::ifstream in{log};
          std::stringstream text;
          text << in.rdbuf();
          std::string const head = "---- rank " + std::to_string(comm.rank()) + "'s output ----\n";
          (void)!::write(saved, head.data(), head.size());
          std::string const body = text.str();
          (void)!::write(saved, body.data(), body.size());
        }
        std::remove(log.c_str());
      }
      this_rank_comm = nullptr;
      if (bad) {
        throw std::runtime_error{std::to_string(failed) + " Catch case(s) failed on this rank"};
      }
    });
  } catch (std::exception const& e) {
    std::cout << e.what() << std::endl;
    return 1;
  }
  return with_skips(0);
}
