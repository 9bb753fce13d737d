// SPDX-License-Identifier: Apache-2.0
// Helpers shared by the swap_test program's tests of wm::swap_scope (scope_test.cu and
// blocks_test.cu): a pattern written and checked by kernels, counters of wrong words, streams, the
// fixture of the single-GPU cases. codec_test.cu needs none of them, nor <wm/swap.cuh>.
#pragma once

#include <wm/swap.cuh>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <random>
#include <thread>
#include <vector>

#include "catch.hpp"

namespace swap_tests {

inline constexpr std::size_t kib = std::size_t{1} << 10;
inline constexpr std::size_t mib = std::size_t{1} << 20;

__host__ __device__ inline std::uint32_t pattern(std::size_t i, std::uint64_t seed) {
  std::uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull ^ (seed * 0xbf58476d1ce4e5b9ull);
  z ^= z >> 31;
  z *= 0x94d049bb133111ebull;
  z ^= z >> 29;
  return static_cast<std::uint32_t>(z);
}

template <class = void>
__global__ void fill_kernel(std::uint32_t* p, std::size_t n, std::uint64_t seed) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    p[i] = pattern(i, seed);
  }
}

template <class = void>
__global__ void check_kernel(std::uint32_t const* p, std::size_t n, std::uint64_t seed,
                             unsigned long long* bad) {
  unsigned long long wrong = 0;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    wrong += p[i] != pattern(i, seed) ? 1 : 0;
  }
  if (wrong != 0) { atomicAdd(bad, wrong); }
}

// Keeps @p stream busy for about @p ns nanoseconds (so that a page-out waits on it).
template <class = void>
__global__ void spin_kernel(std::uint64_t ns) {
  std::uint64_t start = 0;
  std::uint64_t now   = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

// Keeps its stream busy until the host sets @p *flag (host-mapped memory), or for @p max_ns at
// most, so that a test that never sets it still lets the process end.
template <class = void>
__global__ void spin_until_kernel(unsigned const volatile* flag, std::uint64_t max_ns) {
  std::uint64_t start = 0;
  std::uint64_t now   = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (*flag == 0 && now - start < max_ns);
}

// A flag in host-mapped pinned memory that a spin_until_kernel waits for: work queued behind it
// does not complete until release() (or the destructor, which also waits for the device).
struct gate {
  unsigned* host{nullptr};
  unsigned* dev{nullptr};
  gate() {
    WM_CUDA_TRY(
        cudaHostAlloc(reinterpret_cast<void**>(&host), sizeof(unsigned), cudaHostAllocMapped));
    *host = 0;
    WM_CUDA_TRY(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev), host, 0));
    // Loaded now (lazy loading): a kernel's first launch may synchronize the context.
    unsigned* const open = dev;
    *host                = 1;
    spin_until_kernel<><<<1, 1>>>(open, 0);
    WM_CHECK_LAUNCH();
    WM_CUDA_TRY(cudaDeviceSynchronize());
    *host = 0;
  }
  gate(gate const&)            = delete;
  gate& operator=(gate const&) = delete;
  ~gate() {
    release();
    (void)cudaDeviceSynchronize();
    (void)cudaFreeHost(host);
  }
  // Holds @p s until release(), five minutes at most.
  void hold(cuda::stream_ref s) {
    spin_until_kernel<><<<1, 1, 0, s.get()>>>(dev, std::uint64_t{300} * 1'000'000'000);
    WM_CHECK_LAUNCH();
  }
  void release() { __atomic_store_n(host, 1u, __ATOMIC_SEQ_CST); }
};

inline void fill(std::uint32_t* p, std::size_t n, std::uint64_t seed, cuda::stream_ref s) {
  fill_kernel<><<<256, 256, 0, s.get()>>>(p, n, seed);
  WM_CHECK_LAUNCH();
}

inline void spin(std::uint64_t ms, cuda::stream_ref s) {
  spin_kernel<><<<1, 1, 0, s.get()>>>(ms * 1'000'000);
  WM_CHECK_LAUNCH();
}

// Loads the test's kernels now. With lazy loading (the default since CUDA 12.2) the first launch
// of a kernel may synchronize the context: a test whose read must race a copy held back by a
// spin passes if that read is the kernel's first launch, since the launch waits for the spin.
// Tests of a missing stream wait call this first, so that they fail without the wait.
inline void load_kernels() {
  fill_kernel<><<<1, 1>>>(nullptr, 0, 0);
  WM_CHECK_LAUNCH();
  check_kernel<><<<1, 1>>>(nullptr, 0, 0, nullptr);
  WM_CHECK_LAUNCH();
  spin_kernel<><<<1, 1>>>(0);
  WM_CHECK_LAUNCH();
  WM_CUDA_TRY(cudaDeviceSynchronize());
}

// Device counters of wrong words, one per check.
struct checker {
  unsigned long long* bad{nullptr};
  std::size_t used{0};
  std::size_t capacity;
  explicit checker(std::size_t n) : capacity{n} {
    WM_CUDA_TRY(cudaMalloc(&bad, n * sizeof(unsigned long long)));
    WM_CUDA_TRY(cudaMemset(bad, 0, n * sizeof(unsigned long long)));
    WM_CUDA_TRY(cudaDeviceSynchronize());  // before check kernels on non-blocking streams count
  }
  ~checker() { (void)cudaFree(bad); }
  void check(std::uint32_t const* p, std::size_t n, std::uint64_t seed, cuda::stream_ref s) {
    REQUIRE(used < capacity);
    check_kernel<><<<256, 256, 0, s.get()>>>(p, n, seed, bad + used++);
    WM_CHECK_LAUNCH();
  }
  // Wrong words per check so far (synchronizes the device).
  [[nodiscard]] std::vector<unsigned long long> counts() const {
    WM_CUDA_TRY(cudaDeviceSynchronize());
    std::vector<unsigned long long> h(used);
    WM_CUDA_TRY(
        cudaMemcpy(h.data(), bad, used * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
    return h;
  }
  // Every check so far found nothing wrong (synchronizes the device).
  [[nodiscard]] std::size_t wrong_checks() const {
    WM_CUDA_TRY(cudaDeviceSynchronize());
    std::vector<unsigned long long> h(used);
    WM_CUDA_TRY(
        cudaMemcpy(h.data(), bad, used * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
    return static_cast<std::size_t>(
        std::count_if(h.begin(), h.end(), [](auto v) { return v != 0; }));
  }
};

struct streams {
  std::vector<cudaStream_t> s;
  explicit streams(int n) : s(n) {
    for (auto& x : s) { WM_CUDA_TRY(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking)); }
  }
  ~streams() {
    for (auto x : s) {
      (void)cudaStreamSynchronize(x);
      (void)cudaStreamDestroy(x);
    }
  }
};

// Orders @p to after the work queued so far on @p from (what a user does between streams).
inline void order(cudaStream_t from, cudaStream_t to) {
  if (from == to) { return; }
  cudaEvent_t ev{};
  WM_CUDA_TRY(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  WM_CUDA_TRY(cudaEventRecord(ev, from));
  WM_CUDA_TRY(cudaStreamWaitEvent(to, ev, 0));
  WM_CUDA_TRY(cudaEventDestroy(ev));
}

// The whole buffer, copied back on @p s, compared on the host with the pattern of @p seed.
inline std::size_t wrong_on_host(std::uint32_t const* d, std::size_t n, std::uint64_t seed,
                                 cuda::stream_ref s) {
  std::vector<std::uint32_t> h(n, 0);
  WM_CUDA_TRY(cudaMemcpyAsync(h.data(), d, n * 4, cudaMemcpyDeviceToHost, s.get()));
  WM_CUDA_TRY(cudaStreamSynchronize(s.get()));
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < n; ++i) { wrong += h[i] != pattern(i, seed) ? 1 : 0; }
  return wrong;
}

inline wm::swap_options small_scope(std::size_t budget) {
  wm::swap_options o;
  o.device_budget = budget;
  o.host_bytes    = std::size_t{1} << 30;
  o.timeout       = std::chrono::milliseconds{30'000};
  return o;
}

// What the single-GPU cases start from: fresh random seeds, four streams (s0 to s3 refer to
// st.s[0] to st.s[3]) and a checker.
struct swap_fixture {
  std::mt19937_64 rng{std::random_device{}()};
  streams st{4};
  cuda::stream_ref const s0{st.s[0]};
  cuda::stream_ref const s1{st.s[1]};
  cuda::stream_ref const s2{st.s[2]};
  cuda::stream_ref const s3{st.s[3]};
  checker chk{128};
};

// A new buffer of @p words from @p scope, written on @p s with the pattern of @p seed.
inline wm::swappable<std::uint32_t> filled(wm::swap_scope& scope, std::size_t words,
                                           std::uint64_t seed, cuda::stream_ref s) {
  auto b = scope.allocate<std::uint32_t>(words, s);
  fill(b.data(s), words, seed, s);
  return b;
}

// Polls @p done every @p poll until it holds or five seconds have passed (the workers issue and
// book the copies a moment after they were asked for or the GPU finished them).
template <class Done>
void wait_until(Done const& done, std::chrono::microseconds poll = std::chrono::microseconds{100}) {
  auto const until = std::chrono::steady_clock::now() + std::chrono::seconds{5};
  while (!done() && std::chrono::steady_clock::now() < until) { std::this_thread::sleep_for(poll); }
}

}  // namespace swap_tests
