// SPDX-License-Identifier: Apache-2.0
// Probe: scattered 512 B rows read from pinned host memory into device memory, by (a) the copy
// engine on one contiguous range (the floor's rate), (b) SM loads (a warp per row, 16 B per lane,
// U rows in flight per warp), (c) TMA bulk copies (cp.async.bulk global->shared, mbarrier
// complete_tx), S stages per warp, then shared->device stores.
//
// Standalone, not in CMake:
//   nvcc -std=c++20 -O3 -arch=sm_90 bench/probes/host_rows_tma_probe.cu -o probe
//
// Results and what they mean: bench/NOTES.md, "Host rows by TMA bulk copies".
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "check.cuh"

constexpr int ROW = 512;

template <int U>
__global__ void __launch_bounds__(256)
    ld_rows(uint4 const* __restrict__ host, uint4* __restrict__ out, int const* __restrict__ idx,
            int n) {
  int lane = threadIdx.x % 32;
  int w = (blockIdx.x * blockDim.x + threadIdx.x) / 32, nw = gridDim.x * blockDim.x / 32;
  for (int r0 = w * U; r0 < n; r0 += nw * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (r0 + u < n) v[u] = __ldcv(host + size_t(idx[r0 + u]) * 32 + lane);
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (r0 + u < n) out[size_t(r0 + u) * 32 + lane] = v[u];
  }
}

__device__ __forceinline__ uint32_t sa(void const* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

template <int S>
__global__ void __launch_bounds__(256)
    tma_rows(char const* __restrict__ host, uint4* __restrict__ out, int const* __restrict__ idx,
             int n) {
  extern __shared__ __align__(128) char smem[];
  int lane = threadIdx.x % 32, wib = threadIdx.x / 32;
  int w = (blockIdx.x * blockDim.x + threadIdx.x) / 32, nw = gridDim.x * blockDim.x / 32;
  char* buf = smem + wib * S * ROW;
  __shared__ __align__(8) uint64_t bars[8][S];
  if (lane == 0)
    for (int s = 0; s < S; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sa(&bars[wib][s])));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncwarp();
  // rows of this warp: r = w + k * nw, k = 0, 1, ...
  int count  = n > w ? (n - 1 - w) / nw + 1 : 0;
  auto issue = [&](int k) {
    int s = k % S;
    int r = w + k * nw;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(&bars[wib][s])),
                 "r"(ROW)
                 : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
            "r"(sa(buf + s * ROW)),
        "l"(host + size_t(idx[r]) * ROW), "r"(ROW), "r"(sa(&bars[wib][s]))
        : "memory");
  };
  if (lane == 0)
    for (int k = 0; k < S && k < count; ++k) issue(k);
  for (int k = 0; k < count; ++k) {
    int s           = k % S;
    uint32_t parity = (k / S) & 1;
    uint32_t done   = 0;
    while (!done)
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, "
          "0, p; }"
          : "=r"(done)
          : "r"(sa(&bars[wib][s])), "r"(parity)
          : "memory");
    uint4 v = reinterpret_cast<uint4 const*>(buf + s * ROW)[lane];
    __syncwarp();
    if (lane == 0 && k + S < count) issue(k + S);
    out[size_t(w + k * nw) * 32 + lane] = v;
  }
}

int main() {
  size_t const rows = 10'000'000, keys = 1'000'000;
  char* host;
  CK(cudaHostAlloc(&host, rows * ROW, cudaHostAllocDefault));
  for (size_t r = 0; r < rows; ++r) {
    int* p = reinterpret_cast<int*>(host + r * ROW);
    for (int j = 0; j < ROW / 4; ++j) p[j] = int(r) ^ (j << 24);
  }
  std::mt19937_64 g{42};
  std::uniform_int_distribution<int> d(0, int(rows) - 1);
  std::vector<int> k(keys);
  for (auto& x : k) x = d(g);
  std::sort(k.begin(), k.end());
  k.erase(std::unique(k.begin(), k.end()), k.end());
  int n = int(k.size());
  int* idx;
  CK(cudaMalloc(&idx, n * sizeof(int)));
  CK(cudaMemcpy(idx, k.data(), n * sizeof(int), cudaMemcpyHostToDevice));
  uint4* out;
  CK(cudaMalloc(&out, size_t(n) * ROW));
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  int sms;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  double bytes = double(n) * ROW;
  auto time    = [&](auto f) {
    f();
    CK(cudaDeviceSynchronize());
    std::vector<float> t;
    for (int i = 0; i < 7; ++i) {
      cudaEventRecord(a);
      f();
      cudaEventRecord(b);
      CK(cudaEventSynchronize(b));
      float ms;
      cudaEventElapsedTime(&ms, a, b);
      t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    return t[3];
  };
  float ce = time([&] { CK(cudaMemcpyAsync(out, host, size_t(n) * ROW, cudaMemcpyHostToDevice)); });
  std::printf("%d distinct rows of %d B (%.1f MB); CE contiguous %.3f ms = %.1f GB/s (floor)\n", n,
              ROW, bytes / 1e6, ce, bytes / ce / 1e6);
  auto report = [&](char const* name, float ms) {
    std::printf("%-28s %.3f ms %6.1f GB/s  %.3f of floor time\n", name, ms, bytes / ms / 1e6,
                ms / ce);
  };
  for (int bps : {2, 4, 8}) {
    report((std::string("ld U=1 blocks/SM=") + std::to_string(bps)).c_str(),
           time([&] { ld_rows<1><<<sms * bps, 256>>>((uint4 const*)host, out, idx, n); }));
    report((std::string("ld U=4 blocks/SM=") + std::to_string(bps)).c_str(),
           time([&] { ld_rows<4><<<sms * bps, 256>>>((uint4 const*)host, out, idx, n); }));
  }
  auto tma = [&](auto kernel, int S, int bps, char const* name) {
    size_t sm = size_t(8) * S * ROW;
    CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(sm)));
    report(name, time([&] {
             kernel<<<sms * bps, 256, sm>>>(host, out, idx, n);
             CK(cudaGetLastError());
           }));
  };
  tma(tma_rows<4>, 4, 2, "tma S=4 blocks/SM=2");
  tma(tma_rows<8>, 8, 2, "tma S=8 blocks/SM=2");
  tma(tma_rows<8>, 8, 4, "tma S=8 blocks/SM=4");
  tma(tma_rows<16>, 16, 2, "tma S=16 blocks/SM=2");
  tma(tma_rows<16>, 16, 3, "tma S=16 blocks/SM=3");
  // check: last variant's output equals the rows
  std::vector<int> o(size_t(n) * ROW / 4);
  CK(cudaMemcpy(o.data(), out, o.size() * 4, cudaMemcpyDeviceToHost));
  size_t bad = 0;
  for (size_t r = 0; r < size_t(n); ++r)
    for (int j = 0; j < ROW / 4; ++j) bad += o[r * ROW / 4 + j] != (k[r] ^ (j << 24));
  std::printf("check (last tma variant): %zu bad words\n", bad);
  return 0;
}
