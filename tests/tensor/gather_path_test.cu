// SPDX-License-Identifier: Apache-2.0
// GPU tests of the path rows of a distributed wm::tensor gather take between ranks: the path
// reported and its setting (WM_DISPATCH_ROWS) checked, ranks that disagree on it, gathers long
// enough to cross in pieces, and the kernel that groups indices by owner without a sort.
#include <wm/launch.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <numeric>
#include <optional>
#include <random>
#include <string_view>
#include <vector>

#include "catch.hpp"
#include "gather_common.cuh"
#include "gather_paths.cuh"
#include "rank_check.hpp"
#include "ranks.hpp"

using namespace gather_tests;

namespace {

// Every rank's first distributed gather throws when some rank's WM_DISPATCH_ROWS is unknown.
void bad_path_setting_throws_everywhere(wm::communicator& comm, int bad_rank) {
  if (comm.rank() == bad_rank) { RANK_REQUIRE(::setenv("WM_DISPATCH_ROWS", "Copy", 1) == 0); }
  bool threw = false;
  try {
    (void)path_of_fresh_tensor(comm);
  } catch (wm::logic_error const& e) {
    threw = std::string_view{e.what()}.find("WM_DISPATCH_ROWS") != std::string_view::npos;
  }
  RANK_REQUIRE(threw);
  RANK_REQUIRE(::unsetenv("WM_DISPATCH_ROWS") == 0);
  RANK_REQUIRE(path_of_fresh_tensor(comm) != wm::row_path::undecided);  // the group still works
}

}  // namespace

// ---- cases run inside every rank (--ranks; tests/support/ranks.hpp) ----------------------------

TEST_CASE("ranked: ranks that disagree on WM_DISPATCH_ROWS agree on a path or all throw",
          "[ranked][multi]") {
  auto& comm       = wm_test::comm();
  bool const peers = peers_reach_each_other();
  RANK_REQUIRE(::unsetenv("WM_DISPATCH_ROWS") == 0);
  SECTION("copy here, put there: put where any rank asks for it (copy needs every rank)") {
    dispatch_rows_setting const setting{comm.rank() == 0 ? "copy" : "put"};
    RANK_REQUIRE(path_of_fresh_tensor(comm) == (peers ? wm::row_path::put : wm::row_path::nccl));
  }
  SECTION("put on one rank, unset on the others: put") {
    std::optional<dispatch_rows_setting> setting;
    if (comm.rank() == 0) { setting.emplace("put"); }
    RANK_REQUIRE(path_of_fresh_tensor(comm) == (peers ? wm::row_path::put : wm::row_path::nccl));
  }
  SECTION("an unknown setting on the last rank: every rank throws, the group still works") {
    bad_path_setting_throws_everywhere(comm, comm.size() - 1);
  }
}

// The distributed gather sends each peer's rows in pieces (one per started 32 MiB, at most 6,
// the first and last smaller from three on) while it gathers the next piece: a gather of every
// row of a 140 MB table moves 70 MB per peer on 2 ranks (three pieces) and 35 MB on 4 (two),
// with row counts that do not divide evenly.
// From 5 ranks on each peer's share fits one piece and this test no longer pipelines.
TEST_CASE("ranked: long distributed gathers cross in pieces", "[ranked][multi]") {
  auto& comm               = wm_test::comm();
  std::uint64_t const seed = shared_seed(comm);
  SECTION("device.distributed.block, float rows, int64 indices: 140,001 x 256") {
    exercise<float, wm::device, wm::distributed, wm::block, std::int64_t>(comm, seed, 140'001, 256,
                                                                          0);
  }
  SECTION("device.distributed.cyclic, float rows, int32 indices: 70,003 x 512, stride 520") {
    exercise<float, wm::device, wm::distributed, wm::cyclic, std::int32_t>(comm, seed + 1, 70'003,
                                                                           512, 520);
  }
  // ... with the rows copied into the mailboxes (the default on one node with peer access).
  RANK_REQUIRE(path_of_fresh_tensor(comm) ==
               (peers_reach_each_other() ? wm::row_path::copy : wm::row_path::nccl));
}

// ---- one rank ([gpu]) ------------------------------------------------------------------------

TEST_CASE("one rank: the gather path is reported and its setting checked", "[gpu]") {
  wm::launch(1, [&](wm::communicator& comm) {
    RANK_REQUIRE(::unsetenv("WM_DISPATCH_ROWS") == 0);
    RANK_REQUIRE(path_of_fresh_tensor(comm) == wm::row_path::nccl);  // one rank: no mailbox
    RANK_REQUIRE(::setenv("WM_DISPATCH_ROWS", "copy", 1) == 0);
    RANK_REQUIRE(path_of_fresh_tensor(comm) == wm::row_path::nccl);
    RANK_REQUIRE(::unsetenv("WM_DISPATCH_ROWS") == 0);
    wm::tensor<float, wm::device, wm::chunked> const mapped{comm, 10, 4};
    RANK_REQUIRE(mapped.gather_path() == wm::row_path::direct);
    bad_path_setting_throws_everywhere(comm, 0);
  });
}

TEST_CASE("one rank: grouping by owner without a sort puts each index in its owner's group once",
          "[gpu]") {
  std::uint64_t const seed = std::random_device{}();
  wm::launch(1, [&](wm::communicator&) {
    std::mt19937_64 rng{seed};
    for (int const world : {1, 2, 3, 7, wm::detail::place_shared_ranks - 1}) {
      for (std::size_t const n : {std::size_t{0}, std::size_t{1}, std::size_t{31},
                                  std::size_t{2048}, std::size_t{2049}, std::size_t{100'003}}) {
        for (int const max_blocks :
             {1, 3, 1000}) {  // one block taking every tile, a few, one per tile
          // Owners in [0, world], world meaning invalid; some owners get nothing when world is
          // large.
          std::vector<int> owner(n);
          std::vector<std::int64_t> local(n);
          for (auto& o : owner) {
            o = static_cast<int>(rng() % (static_cast<std::uint64_t>(world) + 1));
          }
          for (auto& l : local) {
            l = static_cast<std::int64_t>(rng() >> 1);
          }  // huge values travel intact
          std::vector<unsigned long long> starts(static_cast<std::size_t>(world) + 2, 0);
          for (int o : owner) { ++starts[static_cast<std::size_t>(o) + 1]; }
          std::partial_sum(starts.begin(), starts.end(), starts.begin());
          std::vector<unsigned long long> next(starts.begin(), starts.end() - 1);
          device_bytes d_owner{n * sizeof(int)}, d_local{n * sizeof(std::int64_t)};
          device_bytes d_next{next.size() * sizeof(unsigned long long)};
          device_bytes d_order{n * sizeof(std::size_t)},
              d_keys{n * sizeof(std::int64_t)};  // poisoned
          WM_CUDA_TRY(
              cudaMemcpy(d_owner.ptr, owner.data(), n * sizeof(int), cudaMemcpyHostToDevice));
          WM_CUDA_TRY(cudaMemcpy(d_local.ptr, local.data(), n * sizeof(std::int64_t),
                                 cudaMemcpyHostToDevice));
          WM_CUDA_TRY(cudaMemcpy(d_next.ptr, next.data(), next.size() * sizeof(unsigned long long),
                                 cudaMemcpyHostToDevice));
          wm::detail::launch_place_by_owner(
              reinterpret_cast<int const*>(d_owner.ptr),
              reinterpret_cast<std::int64_t const*>(d_local.ptr), n, world,
              reinterpret_cast<unsigned long long*>(d_next.ptr),
              reinterpret_cast<std::size_t*>(d_order.ptr),
              reinterpret_cast<std::int64_t*>(d_keys.ptr), nullptr, max_blocks);
          WM_CUDA_TRY(cudaDeviceSynchronize());
          std::vector<std::size_t> order(n);
          std::vector<std::int64_t> keys(n);
          WM_CUDA_TRY(cudaMemcpy(order.data(), d_order.ptr, n * sizeof(std::size_t),
                                 cudaMemcpyDeviceToHost));
          WM_CUDA_TRY(cudaMemcpy(keys.data(), d_keys.ptr, n * sizeof(std::int64_t),
                                 cudaMemcpyDeviceToHost));
          WM_CUDA_TRY(cudaMemcpy(next.data(), d_next.ptr, next.size() * sizeof(unsigned long long),
                                 cudaMemcpyDeviceToHost));
          std::vector<char> seen(n, 0);
          std::size_t wrong = 0;
          for (std::size_t r = 0; r <= static_cast<std::size_t>(world); ++r) {
            wrong += next[r] != starts[r + 1];  // every counter moved exactly past its group
            for (auto slot = starts[r]; slot < starts[r + 1]; ++slot) {
              std::size_t const i = order[slot];
              if (i >= n || seen[i] != 0 || static_cast<std::size_t>(owner[i]) != r ||
                  keys[slot] != local[i]) {
                ++wrong;
                continue;
              }
              seen[i] = 1;
            }
          }
          auto const placed = std::count(seen.begin(), seen.end(), 1);
          RANK_REQUIRE_MSG(wrong == 0 && placed == static_cast<std::ptrdiff_t>(n),
                           wrong << " wrong slots, " << placed << " of " << n << " placed; world "
                                 << world << ", at most " << max_blocks << " blocks, seed "
                                 << seed);
        }
      }
    }
  });
}
