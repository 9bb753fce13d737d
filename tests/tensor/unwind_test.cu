// SPDX-License-Identifier: Apache-2.0
// GPU tests of errors that unwind past work still running: an exchange scratch whose last call
// returned (or threw half-way), and a tensor whose gather_async still runs when another tensor's
// bad index throws past it.
#include <wm/launch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <numeric>
#include <random>
#include <string_view>
#include <thread>
#include <vector>

#include "catch.hpp"
#include "gather_common.cuh"
#include "rank_check.hpp"

using namespace gather_tests;

namespace {

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
    device_array<std::int64_t> const long_keys{order};
    device_bytes const long_out{long_rows * long_rb};
    // The small tensor, its bad index and its output: made (and used once) before the long
    // gather starts, so that nothing below synchronizes the device while it runs.
    using dist = wm::tensor<float, wm::device, wm::distributed>;
    std::mt19937_64 rng{std::random_device{}()};
    std::size_t const small_rows = 100, small_rb = 4 * sizeof(float);
    auto const small_table = random_bytes(rng, small_rows * small_rb);
    device_array<std::int64_t> const good{std::vector<std::int64_t>{0, 1, 99}};
    device_array<std::int64_t> const bad{std::vector<std::int64_t>{3, 100, 7}};
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
