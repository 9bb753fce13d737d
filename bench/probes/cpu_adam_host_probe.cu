// SPDX-License-Identifier: Apache-2.0
// Probe (issue 20): why the offload's CPU Adam runs 10-30% slower inside a step than alone.
// zero_bench times the CPU Adam alone on malloc'd arrays in one call; inside the step it runs on
// cudaMallocHost memory, chunk by chunk, beside the step's copies and the forward's host thread.
// This times the production update (wm::detail::zero::cpu_adam_update, bf16 gradients and bf16
// copy: 28 bytes per parameter, in place) over the same elements with one thing changed at a time:
//   malloc          aligned_alloc (what zero_bench's "alone" uses)
//   malloc+THP      aligned_alloc + madvise(MADV_HUGEPAGE)
//   cudaMallocHost  pinned by the driver (what zero_optimizer allocates)
//   mmap+THP+reg    mmap + madvise(MADV_HUGEPAGE) + cudaHostRegister (pinned, 2 MiB pages)
//   ... chunks      the same in 16M-element calls (the pipeline's chunks)
//   ... + DMA       while two streams copy 256 MiB buffers D2H and H2D in a loop (the step's
//                   gradients down and weights up; their GB/s printed)
//   ... + busy      while one more host thread spins (the forward's launches and polls)
// Prints ms per update (median of --reps after two warm-ups), Gparams/s, and the ratio to the
// malloc row; the kernel's THP mode and AnonHugePages before and after each allocation.
//
// Standalone, not in CMake:
//   nvcc -std=c++20 -O3 -arch=sm_90 -Iinclude -o x bench/probes/cpu_adam_host_probe.cu
//   ./x [--n 268435456] [--reps 5]
// Results and what they mean: bench/NOTES.md, "CPU Adam inside the step".
#include <wm/detail/zero/cpu_adam.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <sys/mman.h>
#include <thread>
#include <vector>

#include "../host_timing.hpp"
#include "check.cuh"

namespace z = wm::detail::zero;

namespace {

std::string first_line(char const* path) {
  std::ifstream f{path};
  std::string s;
  std::getline(f, s);
  return s;
}

long anon_huge_kib() {
  std::ifstream f{"/proc/meminfo"};
  std::string key;
  long value = 0;
  std::string unit;
  while (f >> key >> value >> unit) {
    if (key == "AnonHugePages:") { return value; }
  }
  return -1;
}

enum class kind { malloc_4k, malloc_thp, cuda_host, mmap_thp_registered };

char const* name_of(kind k) {
  switch (k) {
    case kind::malloc_4k: return "malloc";
    case kind::malloc_thp: return "malloc+THP";
    case kind::cuda_host: return "cudaMallocHost";
    default: return "mmap+THP+reg";
  }
}

/// One allocation of @p bytes of @p k; freed by the destructor.
struct region {
  kind k;
  std::size_t bytes;
  void* p{};
  region(kind k_, std::size_t b) : k{k_}, bytes{(b + (std::size_t{2} << 20) - 1) >> 21 << 21} {
    switch (k) {
      case kind::malloc_4k: p = std::aligned_alloc(4096, bytes); break;
      case kind::malloc_thp:
        p = std::aligned_alloc(std::size_t{2} << 20, bytes);
        if (p != nullptr) { (void)madvise(p, bytes, MADV_HUGEPAGE); }
        break;
      case kind::cuda_host: CK(cudaMallocHost(&p, bytes)); break;
      case kind::mmap_thp_registered: {
        p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) {
          p = nullptr;
          break;
        }
        (void)madvise(p, bytes, MADV_HUGEPAGE);
        std::memset(p, 0, bytes);  // fault the pages in (huge where the kernel can) before pinning
        CK(cudaHostRegister(p, bytes, cudaHostRegisterPortable));
        break;
      }
    }
    if (p == nullptr) {
      std::printf("FAIL: cannot allocate %zu bytes (%s)\n", bytes, name_of(k));
      std::exit(1);
    }
  }
  region(region const&)            = delete;
  region& operator=(region const&) = delete;
  ~region() {
    switch (k) {
      case kind::cuda_host: cudaFreeHost(p); break;
      case kind::mmap_thp_registered:
        cudaHostUnregister(p);
        munmap(p, bytes);
        break;
      default: std::free(p);
    }
  }
};

/// The update's arrays carved from one region: master, m, v (fp32), gradient and copy (bf16).
struct arrays {
  region r;
  z::cpu_adam_arrays<z::bf16_bits> a;
  arrays(kind k, std::size_t n, z::thread_pool& pool) : r{k, n * 16 + 4096 * 5} {
    auto* base = static_cast<std::byte*>(r.p);
    auto carve = [&](std::size_t bytes) {
      auto* q = base;
      base += (bytes + 4095) / 4096 * 4096;
      return q;
    };
    a.master                = reinterpret_cast<float*>(carve(n * 4));
    a.m                     = reinterpret_cast<float*>(carve(n * 4));
    a.v                     = reinterpret_cast<float*>(carve(n * 4));
    a.grad                  = reinterpret_cast<z::bf16_bits const*>(carve(n * 2));
    a.bf16_out              = reinterpret_cast<z::bf16_bits*>(carve(n * 2));
    a.n                     = n;
    auto* grad              = const_cast<z::bf16_bits*>(a.grad);
    std::size_t const parts = pool.size();
    pool.run(parts, [&](std::size_t t) {  // first touch spread over the threads
      std::size_t const first = n * t / parts, last = n * (t + 1) / parts;
      for (std::size_t i = first; i < last; ++i) {
        a.master[i]   = 0.5f;
        a.m[i]        = 0.0f;
        a.v[i]        = 0.0f;
        grad[i]       = 0x3c00;  // bf16 0.0078125
        a.bf16_out[i] = 0;
      }
    });
  }
};

/// Copies 256 MiB D2H and H2D on two streams in a loop until stopped (buffers allocated and the
/// first round done before start() returns); counts the bytes moved while running.
struct dma_load {
  static constexpr std::size_t b = std::size_t{256} << 20;
  void *d1{}, *d2{}, *h1{}, *h2{};
  cudaStream_t s1{}, s2{};
  std::atomic<bool> stop{false};
  std::atomic<std::size_t> bytes{0};
  std::thread t;
  dma_load() {
    CK(cudaMalloc(&d1, b));
    CK(cudaMalloc(&d2, b));
    CK(cudaMallocHost(&h1, b));
    CK(cudaMallocHost(&h2, b));
    CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  }
  ~dma_load() {
    cudaStreamDestroy(s1);
    cudaStreamDestroy(s2);
    cudaFree(d1);
    cudaFree(d2);
    cudaFreeHost(h1);
    cudaFreeHost(h2);
  }
  void round() {
    CK(cudaMemcpyAsync(h1, d1, b, cudaMemcpyDeviceToHost, s1));
    CK(cudaMemcpyAsync(d2, h2, b, cudaMemcpyHostToDevice, s2));
    CK(cudaStreamSynchronize(s1));
    CK(cudaStreamSynchronize(s2));
  }
  void start() {
    round();  // warm
    stop  = false;
    bytes = 0;
    t     = std::thread{[this] {
      CK(cudaSetDevice(0));
      while (!stop.load()) {
        round();
        bytes += 2 * b;
      }
    }};
  }
  void end() {
    stop = true;
    t.join();
  }
};

}  // namespace

int main(int argc, char** argv) {
  std::size_t n = std::size_t{1} << 28;
  int reps      = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--n") == 0) { n = std::strtoull(argv[i + 1], nullptr, 10); }
    if (std::strcmp(argv[i], "--reps") == 0) { reps = std::atoi(argv[i + 1]); }
  }
  CK(cudaSetDevice(0));
  CK(cudaFree(nullptr));
  z::thread_pool pool;
  std::printf(
      "cpu_adam_host_probe: %zu parameters (%.2f GB moved per update), %u threads, %s; THP: %s\n",
      n, 28.0 * static_cast<double>(n) / 1e9, pool.size(), z::name_of(z::best_cpu_isa()),
      first_line("/sys/kernel/mm/transparent_hugepage/enabled").c_str());
  z::cpu_adam_options const opt;
  long step       = 0;
  double baseline = 0;
  auto report     = [&](std::string const& what, double ms, std::string const& extra = {}) {
    double const gps = static_cast<double>(n) / (ms * 1e-3) / 1e9;
    if (baseline == 0) { baseline = ms; }
    std::printf("%-34s %9.2f ms %7.3f Gparams/s  x%.3f of malloc%s\n", what.c_str(), ms, gps,
                    ms / baseline, extra.c_str());
    std::fflush(stdout);
  };
  std::size_t const chunk = std::size_t{1} << 24;
  for (kind k : {kind::malloc_4k, kind::malloc_thp, kind::cuda_host, kind::mmap_thp_registered}) {
    long const huge0 = anon_huge_kib();
    arrays x{k, n, pool};
    long const huge1 = anon_huge_kib();
    std::printf("## %s: AnonHugePages %+ld MiB\n", name_of(k), (huge1 - huge0) / 1024);
    auto whole = [&] { z::cpu_adam_update(opt, z::cpu_adam_step{1e-4f, ++step, 1.0f}, x.a, pool); };
    auto chunks = [&] {
      ++step;
      for (std::size_t at = 0; at < n; at += chunk) {
        auto a     = x.a;
        a.master   = x.a.master + at;
        a.m        = x.a.m + at;
        a.v        = x.a.v + at;
        a.grad     = x.a.grad + at;
        a.bf16_out = x.a.bf16_out + at;
        a.n        = std::min(chunk, n - at);
        z::cpu_adam_update(opt, z::cpu_adam_step{1e-4f, step, 1.0f}, a, pool);
      }
    };
    report(std::string{name_of(k)}, wm_bench::median_ms(reps, whole));
    report(std::string{name_of(k)} + ", 16M chunks", wm_bench::median_ms(reps, chunks));
    {
      static dma_load d;  // allocated once, before the first measurement with it
      d.start();
      auto const t0   = std::chrono::steady_clock::now();
      double const ms = wm_bench::median_ms(reps, whole);
      double const s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      d.end();
      char buf[64];
      std::snprintf(buf, sizeof buf, "  (DMA %.1f GB/s both ways)",
                    static_cast<double>(d.bytes.load()) / s / 1e9);
      report(std::string{name_of(k)} + " + DMA", ms, buf);
    }
    {
      std::atomic<bool> stop{false};
      std::thread busy{[&] {
        while (!stop.load(std::memory_order_relaxed)) {}
      }};
      report(std::string{name_of(k)} + " + busy thread", wm_bench::median_ms(reps, whole));
      stop = true;
      busy.join();
    }
    // Every element was updated: finite and moved from 0.5, the first and the last.
    for (std::size_t i : {std::size_t{0}, n / 2, n - 1}) {
      float const w = x.a.master[i];
      if (!(w == w) || w >= 0.5f) {
        std::printf("CHECK FAILED: master[%zu] = %g after the updates (%s)\n", i, w, name_of(k));
        return 1;
      }
    }
  }
  std::printf("checks passed\n");
  return 0;
}
