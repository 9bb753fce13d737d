// SPDX-License-Identifier: Apache-2.0
// Probe: which load instruction reads scattered, sorted 512 B host rows fastest. The rows of a
// uniform 1M-key batch over 10M rows (about 951,600 distinct, ascending), read from pinned host
// memory into consecutive device rows by one warp per row (16 B per lane, U rows in flight per
// warp) with each load flavour below, at 2, 4 and 8 blocks of 256 per multiprocessor. Every run
// takes another row set (12 sets), so rows that an L2-caching flavour left behind are rarely
// asked for again (L2 holds 1% of the 5 GB table). Floor: pinned H2D cudaMemcpyAsync of 1 GiB.
//
// Standalone, not in CMake:
//   nvcc -std=c++20 -O3 -arch=sm_90 bench/probes/host_rows_load_probe.cu -o probe
//
// Results and what they mean: bench/NOTES.md, "Host gathers: the split plan and the load flavours".
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "../keys.hpp"
#include "check.cuh"

namespace {

constexpr std::size_t row_bytes = 512;

enum flavour : int { cv, nc, nc256, ca256, cg, cs, sys, cg256, bulk_prefetch_cg, count };
char const* const names[count] = {"ld.cv",          "ld.nc",          "ld.nc.L2::256B",
                                  "ld.L2::256B",    "ld.cg",          "ld.cs",
                                  "ld.relaxed.sys", "ld.cg.L2::256B", "prefetch+cg"};

template <int F>
__device__ __forceinline__ uint4 load(uint4 const* p) {
  uint4 v;
#define WM_LD(op)                                           \
  asm volatile(op " {%0,%1,%2,%3}, [%4];"                   \
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) \
               : "l"(p)                                     \
               : "memory")
  if constexpr (F == cv) {
    WM_LD("ld.global.cv.v4.u32");
  } else if constexpr (F == nc) {
    WM_LD("ld.global.nc.v4.u32");
  } else if constexpr (F == nc256) {
    WM_LD("ld.global.nc.L2::256B.v4.u32");
  } else if constexpr (F == ca256) {
    WM_LD("ld.global.L2::256B.v4.u32");
  } else if constexpr (F == cg || F == bulk_prefetch_cg) {
    WM_LD("ld.global.cg.v4.u32");
  } else if constexpr (F == cs) {
    WM_LD("ld.global.cs.v4.u32");
  } else if constexpr (F == sys) {
    WM_LD("ld.relaxed.sys.global.v4.u32");
  } else {
    WM_LD("ld.global.cg.L2::256B.v4.u32");
  }
#undef WM_LD
  return v;
}

template <int F, int U>
__global__ void __launch_bounds__(256)
    read_rows(uint4 const* __restrict__ host, uint4* __restrict__ out,
              std::uint32_t const* __restrict__ idx, std::size_t n) {
  int const lane       = threadIdx.x % 32;
  std::size_t const w  = (blockIdx.x * std::size_t{blockDim.x} + threadIdx.x) / 32;
  std::size_t const nw = std::size_t{gridDim.x} * blockDim.x / 32;
  for (std::size_t r0 = w * U; r0 < n; r0 += nw * U) {
    if constexpr (F == bulk_prefetch_cg) {
      std::size_t const next = r0 + nw * U + lane;
      if (lane < U && next < n) {
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(
                         host + std::size_t{idx[next]} * (row_bytes / 16)),
                     "r"(static_cast<unsigned>(row_bytes))
                     : "memory");
      }
    }
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (r0 + u < n) { v[u] = load<F>(host + std::size_t{idx[r0 + u]} * (row_bytes / 16) + lane); }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (r0 + u < n) { out[(r0 + u) * (row_bytes / 16) + lane] = v[u]; }
    }
  }
}

__global__ void check_rows(std::uint32_t const* out, std::uint32_t const* idx, std::size_t n,
                           unsigned long long* bad) {
  std::size_t const words = row_bytes / 4;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n * words;
       i += std::size_t{gridDim.x} * blockDim.x) {
    auto const want =
        static_cast<std::uint32_t>((std::size_t{idx[i / words]} * words + i % words) * 2654435761u);
    if (out[i] != want) { atomicAdd(bad, 1ull); }
  }
}

}  // namespace

int main() {
  std::size_t const rows = 10'000'000, keys = 1'000'000;
  int constexpr sets = 12;
  std::byte* host    = nullptr;
  CK(cudaHostAlloc(reinterpret_cast<void**>(&host), rows * row_bytes, cudaHostAllocDefault));
  {
    auto* w = reinterpret_cast<std::uint32_t*>(host);
    for (std::size_t i = 0; i < rows * row_bytes / 4; ++i) {
      w[i] = static_cast<std::uint32_t>(i * 2654435761u);
    }
  }
  std::vector<std::uint32_t*> idx(sets);
  std::vector<std::size_t> n(sets);
  std::size_t max_n = 0;
  for (int s = 0; s < sets; ++s) {
    std::vector<std::int64_t> k(keys);
    wm_bench::uniform_keys(k, rows, 100 + s);
    std::sort(k.begin(), k.end());
    k.erase(std::unique(k.begin(), k.end()), k.end());
    std::vector<std::uint32_t> k32(k.begin(), k.end());
    n[s]  = k32.size();
    max_n = std::max(max_n, n[s]);
    CK(cudaMalloc(&idx[s], n[s] * sizeof(std::uint32_t)));
    CK(cudaMemcpy(idx[s], k32.data(), n[s] * 4, cudaMemcpyHostToDevice));
  }
  std::byte* out          = nullptr;
  std::byte* gib          = nullptr;
  unsigned long long* bad = nullptr;
  CK(cudaMalloc(&out, max_n * row_bytes));
  CK(cudaMalloc(&gib, std::size_t{1} << 30));
  CK(cudaMalloc(&bad, sizeof *bad));
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaEvent_t a{}, b{};
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  auto const time = [&](auto&& f) {  // f(set): median of 12 runs, each on its own set
    f(0);
    CK(cudaDeviceSynchronize());
    std::vector<float> t;
    for (int s = 0; s < sets; ++s) {
      CK(cudaEventRecord(a));
      f(s);
      CK(cudaEventRecord(b));
      CK(cudaEventSynchronize(b));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, a, b));
      t.push_back(ms / float(n[s]) * 1e6f);  // ns per row
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  float ce_ns = 0;  // ns per 512 B of the 1 GiB copy, median of 5
  {
    std::vector<float> t;
    for (int r = 0; r < 6; ++r) {
      CK(cudaEventRecord(a));
      CK(cudaMemcpyAsync(gib, host, std::size_t{1} << 30, cudaMemcpyHostToDevice));
      CK(cudaEventRecord(b));
      CK(cudaEventSynchronize(b));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, a, b));
      if (r > 0) { t.push_back(ms * 1e6f / float((std::size_t{1} << 30) / row_bytes)); }
    }
    std::sort(t.begin(), t.end());
    ce_ns = t[t.size() / 2];
  }
  std::printf(
      "load probe: %d SMs, %zu-%zu sorted distinct rows of %zu B out of %zu; pinned H2D "
      "1 GiB %.2f GB/s (%.3f ns per row)\n",
      sms, *std::min_element(n.begin(), n.end()), max_n, row_bytes, rows, row_bytes / ce_ns, ce_ns);
  std::printf("%-16s %3s %4s %9s %7s %8s\n", "load", "U", "b/SM", "ns/row", "GB/s", "t/floor");
  bool ok        = true;
  auto const run = [&]<int F, int U>(int bps) {
    auto const kernel = read_rows<F, U>;
    auto const go     = [&](int s) {
      kernel<<<sms * bps, 256>>>(reinterpret_cast<uint4 const*>(host),
                                 reinterpret_cast<uint4*>(out), idx[s], n[s]);
    };
    go(1);
    CK(cudaMemset(bad, 0, sizeof *bad));
    check_rows<<<sms * 8, 256>>>(reinterpret_cast<std::uint32_t const*>(out), idx[1], n[1], bad);
    unsigned long long nbad = 0;
    CK(cudaMemcpy(&nbad, bad, sizeof nbad, cudaMemcpyDeviceToHost));
    if (nbad != 0) {
      std::printf("CHECK FAILED %s U %d: %llu words\n", names[F], U, nbad);
      ok = false;
    }
    float const ns = time(go);
    std::printf("%-16s %3d %4d %9.3f %7.2f %8.3f\n", names[F], U, bps, ns, row_bytes / ns,
                ns / ce_ns);
  };
  auto const sweep = [&]<int F>() {
    for (int bps : {2, 4, 8}) {
      run.template operator()<F, 1>(bps);
      run.template operator()<F, 2>(bps);
    }
  };
  sweep.template operator()<cv>();
  sweep.template operator()<nc>();
  sweep.template operator()<nc256>();
  sweep.template operator()<ca256>();
  sweep.template operator()<cg>();
  sweep.template operator()<cs>();
  sweep.template operator()<sys>();
  sweep.template operator()<cg256>();
  sweep.template operator()<bulk_prefetch_cg>();
  std::printf(ok ? "checks passed\n" : "CHECKS FAILED\n");
  return ok ? 0 : 1;
}
