// SPDX-License-Identifier: Apache-2.0
// GPU tests of wm::tensor gather/scatter: every layout x location x element type x index type
// (block mapping), every kind with the cyclic mapping, each combination a [ranked] case or
// section run inside every rank (one rank, and one rank per GPU). Tables hold fresh random
// bytes; results are compared byte for byte with a host reference; outputs are poisoned first;
// batches have duplicates, empty batches, bad indices. The [gpu] and [multi_gpu] cases check one
// scenario each (paths, grouping, unwinding, long gathers).
// The cases' per-kind bodies are in gather_kinds.cuh, compiled in kind_<location>_<layout>_test.cu
// (gather_common.cuh says why); the [ranked] cases of tensor_test are in ranked_test.cu.
#include <wm/launch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <memory>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>

#include "catch.hpp"
#include "gather_common.cuh"
#include "rank_check.hpp"
#include "ranks.hpp"

using namespace gather_tests;

namespace {

// A seed drawn on rank 0, the same on every rank.
std::uint64_t shared_seed(wm::communicator& comm) {
  return comm.all_gather(static_cast<std::uint64_t>(std::random_device{}()))[0];
}

// Every element type, a section each: 16-byte rows, odd rows, padded rows, 1D, one row (the other
// ranks own nothing); row counts not divisible by the rank count.
template <class L, class Y, class M, class Index>
void element_type_sections(wm::communicator& comm, std::uint64_t seed) {
  SECTION("float, 16-byte rows: 1001 x 128") {
    exercise<float, L, Y, M, Index>(comm, seed + 1, 1001, 128, 0);
  }
  SECTION("float, padded rows: 777 x 33, stride 36") {
    exercise<float, L, Y, M, Index>(comm, seed + 2, 777, 33, 36);
  }
  SECTION("half, odd rows: 513 x 7") {
    exercise<__half, L, Y, M, Index>(comm, seed + 3, 513, 7, 0);
  }
  SECTION("bfloat16, padded rows: 300 x 64, stride 72") {
    exercise<__nv_bfloat16, L, Y, M, Index>(comm, seed + 4, 300, 64, 72);
  }
  SECTION("int32, 1D: 1003 rows") {
    exercise<std::int32_t, L, Y, M, Index>(comm, seed + 5, 1003, 1, 0);
  }
  SECTION("int64, odd rows: 99 x 5") {
    exercise<std::int64_t, L, Y, M, Index>(comm, seed + 6, 99, 5, 0);
  }
  SECTION("float, one row: the other ranks own nothing") {
    exercise<float, L, Y, M, Index>(comm, seed + 7, 1, 4, 0);
  }
}

// Sets WM_DISPATCH_ROWS in this rank's process for a scope; unsets it at the end, also when a
// check throws.
struct dispatch_rows_setting {
  explicit dispatch_rows_setting(char const* how) {
    RANK_REQUIRE(::setenv("WM_DISPATCH_ROWS", how, 1) == 0);
  }
  dispatch_rows_setting(dispatch_rows_setting const&) = delete;
  ~dispatch_rows_setting() { ::unsetenv("WM_DISPATCH_ROWS"); }
};

static_assert(wm::mapping<wm::block> && wm::mapping<wm::cyclic>);

// Whether every pair of this node's GPUs has peer access (the mailboxes need it).
bool peers_reach_each_other() {
  int n = 0;
  WM_CUDA_TRY(cudaGetDeviceCount(&n));
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      int can = 1;
      if (i != j) { WM_CUDA_TRY(cudaDeviceCanAccessPeer(&can, i, j)); }
      if (can == 0) { return false; }
    }
  }
  return true;
}

// The path a fresh distributed tensor takes under this process's WM_DISPATCH_ROWS: undecided
// until its first gather (here of every row, so rows cross), then what every rank agreed on.
wm::row_path path_of_fresh_tensor(wm::communicator& comm) {
  std::size_t const rows = 1000;
  wm::tensor<float, wm::device, wm::distributed> t{comm, rows, 4};
  RANK_REQUIRE(t.gather_path() == wm::row_path::undecided);
  std::vector<std::int32_t> all(rows);
  std::iota(all.begin(), all.end(), 0);
  device_indices<std::int32_t> const di{all};
  device_bytes const out{rows * t.cols() * sizeof(float)};
  t.gather(di.span(), reinterpret_cast<float*>(out.ptr), cuda::stream_ref{cudaStream_t{}});
  return t.gather_path();
}

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

// Spins until *flag is nonzero (host-mapped memory the test sets), or 20 s of clock cycles.
__global__ void wait_for_flag(unsigned const volatile* flag) {
  long long const start = clock64();
  while (*flag == 0 && clock64() - start < 40'000'000'000LL) { __nanosleep(1000); }
}

// A flag in mapped host memory that a kernel waits for (wait_for_flag) and a thread sets later.
struct host_flag {
  unsigned* host{};
  unsigned* device{};
  std::thread setter;
  host_flag() {
    WM_CUDA_TRY(cudaHostAlloc(&host, sizeof(unsigned), cudaHostAllocMapped));
    *host = 0;
    WM_CUDA_TRY(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device), host, 0));
  }
  host_flag(host_flag const&) = delete;
  ~host_flag() {
    release_after(std::chrono::milliseconds{0});
    setter.join();
    (void)cudaFreeHost(host);
  }
  // Sets the flag @p delay from now, on another thread.
  void release_after(std::chrono::milliseconds delay) {
    if (setter.joinable()) { return; }
    setter = std::thread{[this, delay] {
      std::this_thread::sleep_for(delay);
      std::atomic_ref<unsigned>{*host}.store(1);
    }};
  }
};

}  // namespace

// ---- cases run inside every rank (--ranks; tests/support/ranks.hpp) ----------------------------

// Block mapping: every location x layout x index type a case, every element type a section.
TEMPLATE_TEST_CASE(
    "ranked: gather/scatter on a kind (block mapping) and index type on every element type",
    "[ranked]", WM_TENSOR_EVERY_LAYOUT(wm::block, std::int32_t),
    WM_TENSOR_EVERY_LAYOUT(wm::block, std::int64_t)) {
  using L    = std::tuple_element_t<0, TestType>;
  using Y    = std::tuple_element_t<1, TestType>;
  using M    = std::tuple_element_t<2, TestType>;
  using I    = std::tuple_element_t<3, TestType>;
  auto& comm = wm_test::comm();
  element_type_sections<L, Y, M, I>(comm, shared_seed(comm));
}

// Cyclic mapping: every location x layout a case; float rows with int32 indices, int64 rows with
// int64 indices.
TEMPLATE_TEST_CASE("ranked: gather/scatter on a kind (cyclic mapping)", "[ranked]",
                   WM_TENSOR_EVERY_LAYOUT(wm::cyclic)) {
  using L                  = std::tuple_element_t<0, TestType>;
  using Y                  = std::tuple_element_t<1, TestType>;
  auto& comm               = wm_test::comm();
  std::uint64_t const seed = shared_seed(comm);
  SECTION("float rows, int32 indices: 1001 x 32") {
    exercise<float, L, Y, wm::cyclic, std::int32_t>(comm, seed + 1, 1001, 32, 0);
  }
  SECTION("int64 rows, int64 indices: 5 x 3") {
    exercise<std::int64_t, L, Y, wm::cyclic, std::int64_t>(comm, seed + 2, 5, 3, 0);
  }
}

TEMPLATE_TEST_CASE("ranked: scatter from and gather to half values not aligned to 16 bytes",
                   "[ranked]", WM_TENSOR_EVERY_KIND) {
  using L                  = std::tuple_element_t<0, TestType>;
  using Y                  = std::tuple_element_t<1, TestType>;
  using M                  = std::tuple_element_t<2, TestType>;
  auto& comm               = wm_test::comm();
  std::uint64_t const seed = shared_seed(comm);
  SECTION("32-byte rows: 1003 x 16") {
    misaligned_values<L, Y, M>(comm, seed + 1, 1003, 16);
  }
  SECTION("18-byte rows: 517 x 9") {
    misaligned_values<L, Y, M>(comm, seed + 2, 517, 9);
  }
}

// The kinds WM_TENSOR_BACK_TO_BACK instantiates (kind_*_test.cu).
TEMPLATE_TEST_CASE("ranked: async gathers back to back on one stream and on several", "[ranked]",
                   (std::tuple<wm::device, wm::distributed, wm::block>),
                   (std::tuple<wm::device, wm::distributed, wm::cyclic>),
                   (std::tuple<wm::device, wm::chunked, wm::block>),
                   (std::tuple<wm::host, wm::continuous, wm::block>),
                   (std::tuple<wm::host, wm::chunked, wm::block>),
                   (std::tuple<wm::host, wm::chunked, wm::cyclic>)) {
  using L    = std::tuple_element_t<0, TestType>;
  using Y    = std::tuple_element_t<1, TestType>;
  using M    = std::tuple_element_t<2, TestType>;
  auto& comm = wm_test::comm();
  back_to_back<L, Y, M>(comm, shared_seed(comm));
}

// The same on each path rows of a distributed gather can take between ranks.
TEMPLATE_TEST_CASE("ranked: async distributed gathers back to back on each path", "[ranked][multi]",
                   wm::block, wm::cyclic) {
  auto& comm               = wm_test::comm();
  std::uint64_t const seed = shared_seed(comm);
  for (char const* how : {"put", "copy", "nccl"}) {
    DYNAMIC_SECTION("WM_DISPATCH_ROWS=" << how) {
      dispatch_rows_setting const setting{how};
      back_to_back<wm::device, wm::distributed, TestType>(comm, seed);
    }
  }
}

// On one node the distributed gather's owners gather rows locally and the copy engines move them
// into the asking rank's mailbox (the default). With WM_DISPATCH_ROWS=put their gather kernels
// store the rows into the mailbox; across nodes, without peer access, or with
// WM_DISPATCH_ROWS=nccl the rows cross through NCCL instead: the same gathers, on each path.
TEST_CASE("ranked: distributed gathers with rows put by kernels or through NCCL",
          "[ranked][multi]") {
  auto& comm               = wm_test::comm();
  std::uint64_t const seed = shared_seed(comm);
  bool const peers         = peers_reach_each_other();
  for (char const* how : {"put", "nccl"}) {
    DYNAMIC_SECTION("WM_DISPATCH_ROWS=" << how) {
      dispatch_rows_setting const setting{how};  // this rank's process only
      auto const want =
          peers && std::string_view{how} == "put" ? wm::row_path::put : wm::row_path::nccl;
      RANK_REQUIRE(path_of_fresh_tensor(comm) == want);  // the sections below run on that path
      SECTION("device.distributed.block, float rows, int64 indices: 140,001 x 256") {
        exercise<float, wm::device, wm::distributed, wm::block, std::int64_t>(comm, seed, 140'001,
                                                                              256, 0);
      }
      SECTION("host.distributed.cyclic, float rows, int32 indices: 70,003 x 512, stride 520") {
        exercise<float, wm::host, wm::distributed, wm::cyclic, std::int32_t>(comm, seed + 1, 70'003,
                                                                             512, 520);
      }
      SECTION("device.distributed.block, int32 indices") {
        element_type_sections<wm::device, wm::distributed, wm::block, std::int32_t>(comm,
                                                                                    seed + 10);
      }
    }
  }
}

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

// The distributed gather sends each peer's rows in pieces (one per started 32 MiB, at most 6,
// the first and last smaller from three on) while it gathers the next piece: a gather of every
// row of a 140 MB table moves 70 MB per peer on 2 ranks (three pieces) and 35 MB on 4 (two),
// with row counts that do not divide evenly.
// From 5 ranks on each peer's share fits one piece and this test no longer pipelines.
TEST_CASE("ranks: long distributed gathers cross in pieces", "[multi_gpu]") {
  std::uint64_t const seed = std::random_device{}();
  wm::launch(wm::local_device_count(), [&](wm::communicator& comm) {
    exercise<float, wm::device, wm::distributed, wm::block, std::int64_t>(comm, seed, 140'001, 256,
                                                                          0);
    exercise<float, wm::device, wm::distributed, wm::cyclic, std::int32_t>(comm, seed + 1, 70'003,
                                                                           512, 520);
    // ... with the rows copied into the mailboxes (the default on one node with peer access).
    RANK_REQUIRE(path_of_fresh_tensor(comm) ==
                 (peers_reach_each_other() ? wm::row_path::copy : wm::row_path::nccl));
  });
}

// An error of this rank alone (a bad index on another object, documented as recoverable) that
// unwinds past an exchange scratch whose last call returned, with that call's work still
// running, waits for the work (with the deadline) and leaves the communicator usable; the work
// of a call that threw half-way still aborts the communicator while the stack unwinds (it may
// wait for peers that wait for the rest of that call). The pending work is a kernel that waits
// for a flag set 200 ms later, so the scratch is busy when the error unwinds past it.
TEST_CASE("one rank: unwinding past a scratch waits for a returned call's work, aborts a torn one",
          "[gpu]") {
  using namespace std::chrono_literals;
  for (bool const call_threw : {false, true}) {
    wm::launch(1, [&](wm::communicator& comm) {
      host_flag flag;
      auto const s = wm::detail::unique_stream::make();
      bool threw   = false;
      try {
        auto sc         = std::make_unique<wm::detail::exchange_scratch>(comm, true);
        auto const call = [&] {
          wm::detail::scratch_use const use{*sc, s.get()};
          wait_for_flag<<<1, 1, 0, s.get()>>>(flag.device);
          WM_CHECK_LAUNCH();
          if (call_threw) { throw wm::comm_error{"wm: a call that failed half-way"}; }
        };
        if (call_threw) { flag.release_after(200ms); }  // the call throws: released before
        call();
        RANK_REQUIRE(!sc->idle());
        flag.release_after(200ms);
        throw wm::logic_error{"wm: gather: an index was negative or not below the row count"};
      } catch (wm::logic_error const&) { threw = !call_threw; } catch (wm::comm_error const&) {
        threw = call_threw;
      }
      RANK_REQUIRE(threw);
      WM_CUDA_TRY(cudaStreamSynchronize(s.get()));
      bool usable = true;
      try {
        comm.barrier();
      } catch (wm::comm_error const&) { usable = false; }
      RANK_REQUIRE_MSG(usable == !call_threw,
                       (call_threw ? "a torn call's work did not abort the communicator"
                                   : "a returned call's work aborted the communicator"));
    });
  }
}

// The same through tensors: a gather_async of long rows is still running (one block moves them)
// when a bad index in another tensor's gather throws wm::logic_error past the first tensor, which
// is destroyed by the unwinding. Its gather completes with the right rows and the communicator
// stays usable (a barrier, another gather).
TEST_CASE("one rank: a bad index thrown past a running gather_async keeps its rows and the group",
          "[gpu]") {
  wm::launch(1, [&](wm::communicator& comm) {
    std::size_t const long_rows = 16, long_cols = std::size_t{8} << 20;  // 32 MiB rows
    std::size_t const long_rb = long_cols * sizeof(float);
    std::vector<std::int64_t> order(long_rows);
    std::iota(order.rbegin(), order.rend(), std::int64_t{0});  // 15, 14, ..., 0
    device_indices<std::int64_t> const long_keys{order};
    device_bytes const long_out{long_rows * long_rb};
    // The small tensor, its bad index and its output: made (and used once) before the long
    // gather starts, so that nothing below synchronizes the device while it runs.
    using dist = wm::tensor<float, wm::device, wm::distributed>;
    std::mt19937_64 rng{std::random_device{}()};
    std::size_t const small_rows = 100, small_rb = 4 * sizeof(float);
    auto const small_table = random_bytes(rng, small_rows * small_rb);
    device_indices<std::int64_t> const good{std::vector<std::int64_t>{0, 1, 99}};
    device_indices<std::int64_t> const bad{std::vector<std::int64_t>{3, 100, 7}};
    device_bytes const small_out{3 * small_rb};
    auto const s_long  = wm::detail::unique_stream::make();
    auto const s_small = wm::detail::unique_stream::make();
    auto const done    = wm::detail::unique_event::make();
    bool threw = false, pending = false;
    {
      dist small{comm, small_rows, 4};
      fill_local_rows<wm::block>(comm, small, small_table, small_rb);
      small.gather(good.span(), reinterpret_cast<float*>(small_out.ptr),
                   cuda::stream_ref{s_small.get()});
      try {
        dist big{comm, long_rows, long_cols};
        auto const lv = big.local_view();  // one rank: every row
        for (std::size_t r = 0; r < long_rows; ++r) {
          WM_CUDA_TRY(cudaMemset(lv.row(r), static_cast<int>(r + 1), long_rb));
        }
        WM_CUDA_TRY(cudaDeviceSynchronize());
        big.gather_async(long_keys.span(), reinterpret_cast<float*>(long_out.ptr),
                         cuda::stream_ref{s_long.get()});
        WM_CUDA_TRY(cudaEventRecord(done.get(), s_long.get()));
        // Destroyed first while the stack unwinds: whether the long gather still ran then.
        struct probe {
          cudaEvent_t e;
          bool& pending;
          ~probe() { pending = cudaEventQuery(e) == cudaErrorNotReady; }
        } const p{done.get(), pending};
        small.gather(bad.span(), reinterpret_cast<float*>(small_out.ptr),
                     cuda::stream_ref{s_small.get()});
      } catch (wm::logic_error const& e) {
        threw =
            std::string_view{e.what()}.find("not below the row count") != std::string_view::npos;
      }
      RANK_REQUIRE(threw);
      if (!pending) { WARN("the long gather ended before the error unwound past its tensor"); }
      bool usable = true;
      try {
        comm.barrier();
      } catch (wm::comm_error const&) { usable = false; }
      RANK_REQUIRE_MSG(usable, "a bad index on another tensor aborted the communicator");
      gather_checks(small, small_table, small_rb, rng(), "a gather after the bad index");
    }
    WM_CUDA_TRY(cudaStreamSynchronize(s_long.get()));
    auto const got    = long_out.to_host();
    std::size_t wrong = 0;
    for (std::size_t j = 0; j < long_rows; ++j) {
      auto const want = static_cast<std::byte>(order[j] + 1);
      auto const* row = got.data() + j * long_rb;
      wrong += std::any_of(row, row + long_rb, [&](std::byte b) { return b != want; });
    }
    RANK_REQUIRE_MSG(wrong == 0, wrong << " of " << long_rows << " long rows differ");
  });
}
