// SPDX-License-Identifier: Apache-2.0
// The typed device collectives' first calls (docs/design.md, "Process model"): NCCL connects a
// collective's algorithm on the host at its first use, so the first call of each shape meets
// every rank with the communicator's deadline first. [gpu]: one rank; [multi_gpu]: one rank per
// GPU (at least 2), forked by wm::launch; checks inside ranks throw (RANK_REQUIRE).
#include <wm/comm.hpp>
#include <wm/launch.hpp>

#include <chrono>
#include <cstdlib>
#include <poll.h>
#include <string>
#include <unistd.h>
#include <vector>

#include "catch.hpp"
#include "rank_check.hpp"

using namespace std::chrono_literals;

namespace {

using clock_type = std::chrono::steady_clock;

/// @p n floats on the device, value(i) each (synchronized).
template <class F>
float* device_floats(std::size_t n, F value) {
  std::vector<float> h(n);
  for (std::size_t i = 0; i < n; ++i) { h[i] = value(i); }
  float* d = nullptr;
  WM_CUDA_TRY(cudaMalloc(&d, n * sizeof(float)));
  WM_CUDA_TRY(cudaMemcpy(d, h.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  return d;
}

std::vector<float> host_floats(float const* d, std::size_t n) {
  std::vector<float> h(n);
  WM_CUDA_TRY(cudaMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost));
  return h;
}

/// Sets WM_TIMEOUT_S for the ranks forked in its scope.
struct timeout_env {
  explicit timeout_env(char const* seconds) { ::setenv("WM_TIMEOUT_S", seconds, 1); }
  ~timeout_env() { ::unsetenv("WM_TIMEOUT_S"); }
  timeout_env(timeout_env const&)            = delete;
  timeout_env& operator=(timeout_env const&) = delete;
};

}  // namespace

TEST_CASE("one rank: the typed collectives' first and later calls return the right values",
          "[gpu]") {
  wm::launch(1, [&](wm::communicator& comm) {
    cudaStream_t const s = nullptr;
    std::size_t const n  = 37;
    float* a = device_floats(n, [](std::size_t i) { return 0.5f + static_cast<float>(i); });
    float* b = device_floats(n, [](std::size_t) { return -7.0f; });
    for (int round = 0; round < 2; ++round) {  // the first call of each shape, then a known one
      comm.all_reduce(a, b, n, cuda::stream_ref{s});
      comm.synchronize(cuda::stream_ref{s});
      auto h = host_floats(b, n);
      for (std::size_t i = 0; i < n; ++i) { RANK_REQUIRE(h[i] == 0.5f + static_cast<float>(i)); }
      WM_CUDA_TRY(cudaMemset(b, 0, n * sizeof(float)));
      comm.all_gather(static_cast<float const*>(a), b, n, cuda::stream_ref{s});
      comm.reduce_scatter(static_cast<float const*>(a), b + 1, n - 1, cuda::stream_ref{s},
                          wm::reduce_op::max);
      comm.broadcast(static_cast<float const*>(a), b, 1, 0, cuda::stream_ref{s});
      comm.synchronize(cuda::stream_ref{s});
      h = host_floats(b, n);
      for (std::size_t i = 0; i < n; ++i) {
        float const want = i == 0 ? 0.5f : 0.5f + static_cast<float>(i - 1);
        RANK_REQUIRE_MSG(h[i] == want, "element " << i << ": " << h[i] << ", not " << want);
      }
    }
    comm.barrier();  // the host-side collectives are still in step
    WM_CUDA_TRY(cudaFree(a));
    WM_CUDA_TRY(cudaFree(b));
  });
}

TEST_CASE(
    "ranks: a peer that sleeps before its first all-reduce makes it a comm_error after the "
    "timeout, not a wait for the peer",
    "[multi_gpu]") {
  int const n = wm::local_device_count();
  timeout_env const env{"5"};
  double const timeout_s = 5.0, slack_s = 10.0;
  int done[2];  // rank 0 writes a byte here once its all-reduce has returned or thrown
  REQUIRE(::pipe(done) == 0);
  wm::launch(n,
             [&](wm::communicator& comm) {
               cudaStream_t const s    = nullptr;
               std::size_t const count = 1 << 16;
               float* x                = device_floats(count, [&](std::size_t) { return 1.0f; });
               comm.barrier();  // every rank is set up; from here on the others are elsewhere
               if (comm.rank() == 0) {
                 auto const start = clock_type::now();
                 bool threw       = false;
                 std::string msg;
                 try {
                   comm.all_reduce(x, x, count, cuda::stream_ref{s});
                   comm.synchronize(cuda::stream_ref{s});
                 } catch (wm::comm_error const& e) {
                   threw = true;
                   msg   = e.what();
                 }
                 double const took =
                     std::chrono::duration<double>(clock_type::now() - start).count();
                 char const byte = 1;
                 RANK_REQUIRE(::write(done[1], &byte, 1) == 1);
                 RANK_REQUIRE_MSG(threw, "the all-reduce returned after " << took << " s");
                 RANK_REQUIRE_MSG(took < timeout_s + slack_s, "the error took " << took << " s");
                 RANK_REQUIRE_MSG(msg.find("timed out") != std::string::npos, msg);
                 return;  // the communicator was aborted
               }
               // 60 s elsewhere, or until rank 0 is done: then rank 0 has given up and this one
               // leaves too. Rank 0 still waiting after 60 s (blocked on the host for this rank)
               // gets its peer.
               pollfd p{done[0], POLLIN, 0};
               if (::poll(&p, 1, 60'000) == 1) {
                 comm.abort();
                 return;
               }
               comm.all_reduce(x, x, count, cuda::stream_ref{s});
               comm.synchronize(cuda::stream_ref{s});
             },
             {std::chrono::seconds{180}, std::chrono::seconds{30}});
  ::close(done[0]);
  ::close(done[1]);
}

TEST_CASE(
    "ranks: first typed collectives that differ in count are errors on every rank, and the "
    "group stays in step",
    "[multi_gpu]") {
  int const n = wm::local_device_count();
  wm::launch(n,
             [&](wm::communicator& comm) {
               cudaStream_t const s = nullptr;
               std::size_t const m  = 64;
               float* x             = device_floats(2 * m, [&](std::size_t i) {
                 return static_cast<float>(comm.rank() + 1) * static_cast<float>(i % 5 + 1);
               });
               float* y             = device_floats(2 * m, [](std::size_t) { return 0.0f; });
               bool threw           = false;
               std::string msg;
               auto const start = clock_type::now();
               try {
                 comm.all_reduce(static_cast<float const*>(x), y, comm.rank() == 0 ? m : 2 * m,
                                 cuda::stream_ref{s});
                 comm.synchronize(cuda::stream_ref{s});
               } catch (wm::comm_error const& e) {
                 threw = true;
                 msg   = e.what();
               }
               double const took = std::chrono::duration<double>(clock_type::now() - start).count();
               RANK_REQUIRE_MSG(threw, "the all-reduces of different counts returned");
               RANK_REQUIRE_MSG(msg.find("mismatched collective") != std::string::npos, msg);
               RANK_REQUIRE_MSG(took < 10.0, "the error took " << took << " s");
               // The same call on every rank now: the sum over the ranks.
               comm.all_reduce(static_cast<float const*>(x), y, m, cuda::stream_ref{s});
               comm.synchronize(cuda::stream_ref{s});
               auto const h      = host_floats(y, m);
               float const ranks = static_cast<float>(comm.size() * (comm.size() + 1) / 2);
               for (std::size_t i = 0; i < m; ++i) {
                 RANK_REQUIRE(h[i] == ranks * static_cast<float>(i % 5 + 1));
               }
               comm.barrier();
               WM_CUDA_TRY(cudaFree(x));
               WM_CUDA_TRY(cudaFree(y));
             },
             {std::chrono::seconds{120}, std::chrono::seconds{30}});
}
