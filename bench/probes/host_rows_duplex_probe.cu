// SPDX-License-Identifier: Apache-2.0
// Probe (issue 18): scattered rows of pinned host memory read by GPU warps while other warps write
// other scattered rows. host_pages_bench timed reads and writes only apart (~34-36 ns per row
// either way). Do the two directions add up (each near its alone rate) or share one limit in rows
// per second (address translation, IOMMU, host memory controller)? Measured, 1M rows of 1536 B
// (weight + Adam m, v) by default, a warp per row and 16 B per lane as host_pages_bench's
// rows_kernel:
//  1. copy engine, contiguous: H2D alone, D2H alone, both at once on two streams (the link);
//  2. random distinct rows read alone, written alone (full grid, and half the grid);
//  3. both at once, disjoint row sets: (a) one kernel, even warps read, odd warps write;
//     (b) two kernels on two streams, half the grid each; 2 and 3 again with sorted rows.
// Prints ms, M rows/s, GB/s per direction and summed, ns per row moved, and both / (read alone +
// write alone): 1.0 = no overlap, 0.5 = perfect overlap. Every read row is checked on the GPU,
// 4096 written rows per run on the host; a wrong row fails the run (exit 1).
//
// Standalone, not in CMake:
//   nvcc -std=c++20 -O3 -arch=sm_90 -o x bench/probes/host_rows_duplex_probe.cu
//   ./x [--rows 10000000] [--row-bytes 1536] [--n 1000000] [--reps 5] [--bps 8] [--split 0]
//   --split 1: the table as wm keeps it: 512 B rows (weights), 1024 B rows (m, v) and, past 1536
//   row bytes, the rest (a step) in a third array
// Results and what they mean: bench/NOTES.md, "Scattered host rows read and written at once".
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "check.cuh"

using u32 = uint32_t;
using u64 = unsigned long long;

// vector v of row `row` after a write of `stamp` (0: the table as filled)
__host__ __device__ inline uint4 pattern(u32 row, u32 v, u32 stamp) {
  return make_uint4(row, v, stamp, ~row ^ (v << 20));
}
__host__ __device__ inline bool same(uint4 a, uint4 b) {
  return a.x == b.x && a.y == b.y && a.z == b.z && a.w == b.w;
}

// The host table: one array of rows (split 0), or a row's vectors 0-31 (512 B, a weight row) in
// one array, 32-95 (1024 B, Adam's m and v) in a second and the rest (a step) in a third, as
// wm's host tables keep them (split 1).
struct table_layout {
  uint4 *a, *b, *c;
  int vecs, split;
  __host__ __device__ uint4* at(size_t row, int v) const {
    if (!split) return a + row * vecs + v;
    if (v < 32) return a + row * 32 + v;
    if (v < 96) return b + row * 64 + (v - 32);
    return c + row * (vecs - 96) + (v - 96);
  }
};
__global__ void fill_table(table_layout t, size_t rows, int vecs) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < rows * vecs;
       i += size_t(gridDim.x) * blockDim.x)
    *t.at(i / vecs, int(i % vecs)) = pattern(u32(i / vecs), u32(i % vecs), 0);
}
__global__ void fill_src(uint4* d, u32 const* idx, u32 n, int vecs, u32 stamp) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < size_t(n) * vecs;
       i += size_t(gridDim.x) * blockDim.x)
    d[i] = pattern(idx[i / vecs], u32(i % vecs), stamp);
}
__global__ void check_reads(uint4 const* d, u32 const* idx, u32 n, int vecs, u64* bad) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < size_t(n) * vecs;
       i += size_t(gridDim.x) * blockDim.x)
    if (!same(d[i], pattern(idx[i / vecs], u32(i % vecs), 0))) atomicAdd(bad, 1ull);
}

// rows w, w + nw, ... of idx: host row idx[r] <-> dev row r, a warp per row, 16 B per lane
template <bool write>
__device__ __forceinline__ void move_rows(table_layout host, uint4* __restrict__ dev,
                                          u32 const* __restrict__ idx, u32 n, int vecs, u32 w,
                                          u32 nw, int lane) {
  for (u32 r = w; r < n; r += nw) {
    size_t const hr = idx[r];
    uint4* d        = dev + size_t(r) * vecs;
#pragma unroll 3  // a 1536 B row: 3 vectors per lane in flight; no spills at 32 registers
    for (int v = lane; v < vecs; v += 32) {
      if (write)
        *host.at(hr, v) = d[v];
      else
        d[v] = *host.at(hr, v);
    }
  }
}
// at most 32 registers: 8 blocks of 256 per SM resident, so both halves of (b) fit at once
template <bool write>
__global__ void __launch_bounds__(256, 8)
    rows_kernel(table_layout host, uint4* dev, u32 const* idx, u32 n, int vecs) {
  u32 w = (blockIdx.x * blockDim.x + threadIdx.x) / 32, nw = gridDim.x * blockDim.x / 32;
  move_rows<write>(host, dev, idx, n, vecs, w, nw, threadIdx.x % 32);
}
// even warps read ridx's rows into din, odd warps write dout to widx's rows
__global__ void __launch_bounds__(256, 8)
    duplex_kernel(table_layout host, uint4* din, u32 const* ridx, uint4 const* dout,
                  u32 const* widx, u32 n, int vecs) {
  u32 w = (blockIdx.x * blockDim.x + threadIdx.x) / 32, nw = gridDim.x * blockDim.x / 32;
  if (w % 2 == 0)
    move_rows<false>(host, din, ridx, n, vecs, w / 2, nw / 2, threadIdx.x % 32);
  else
    move_rows<true>(host, const_cast<uint4*>(dout), widx, n, vecs, w / 2, nw / 2, threadIdx.x % 32);
}

struct times {
  float ms, ms0, ms1;  // total (start to both streams' end), stream 0's end, stream 1's end
};

int main(int argc, char** argv) {
  size_t rows = 10'000'000, n = 1'000'000;
  int rowb = 1536, reps = 5, bps = 8, split = 0;
  for (int i = 1; i < argc; i += 2) {
    std::string a = argv[i];
    if (i + 1 == argc) {
      std::printf("flag %s needs a value\n", a.c_str());
      return 2;
    }
    size_t v = std::stoull(argv[i + 1]);
    if (a == "--rows")
      rows = v;
    else if (a == "--row-bytes")
      rowb = int(v);
    else if (a == "--n")
      n = v;
    else if (a == "--reps")
      reps = int(v);
    else if (a == "--bps")
      bps = int(v);
    else if (a == "--split")
      split = int(v);
    else {
      std::printf("unknown flag %s\n", a.c_str());
      return 2;
    }
  }
  if (rowb % 16 != 0 || rowb <= 0 || 2 * n > rows || rows >= (size_t(1) << 32) || reps < 1 ||
      bps < 2 || (split && rowb < 1536)) {
    std::printf("need row-bytes a multiple of 16, 2 n <= rows < 2^32, reps >= 1, bps >= 2\n");
    return 2;
  }
  int const vecs     = rowb / 16;
  double const bytes = double(n) * rowb;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  int const sms = prop.multiProcessorCount, full = sms * bps, half = full / 2;
  std::printf(
      "%s, %d SMs; table %zu rows x %d B (%.2f GiB, cudaMallocHost); %zu rows moved per "
      "direction (%.1f MB); blocks of 256, full grid %d, half %d; median of %d\n",
      prop.name, sms, rows, rowb, rows * double(rowb) / (1 << 30), n, bytes / 1e6, full, half,
      reps);

  uint4 *ce_host, *din, *dout;
  table_layout table{nullptr, nullptr, nullptr, vecs, split};
  if (split) {
    CK(cudaMallocHost(&table.a, rows * 512));
    CK(cudaMallocHost(&table.b, rows * 1024));
    if (rowb > 1536) CK(cudaMallocHost(&table.c, rows * (rowb - 1536)));
  } else {
    CK(cudaMallocHost(&table.a, rows * rowb));
  }
  if (split)
    std::printf("split table: 512 B + 1024 B + %d B rows in %d arrays\n", rowb - 1536,
                rowb > 1536 ? 3 : 2);
  CK(cudaMallocHost(&ce_host, n * rowb));
  CK(cudaMalloc(&din, n * rowb));
  CK(cudaMalloc(&dout, n * rowb));
  fill_table<<<full, 256>>>(table, rows, vecs);
  CK(cudaGetLastError());
  // 2n distinct random rows: the first n are read, the others written
  std::vector<u32> ids;
  {
    std::vector<uint8_t> used(rows);
    std::mt19937_64 g{42};
    while (ids.size() < 2 * n) {
      u32 r = u32(g() % rows);
      if (!used[r]) used[r] = 1, ids.push_back(r);
    }
  }
  std::vector<u32> rd(ids.begin(), ids.begin() + n), wr(ids.begin() + n, ids.end());
  std::vector<u32> rd_s = rd, wr_s = wr;
  std::sort(rd_s.begin(), rd_s.end());
  std::sort(wr_s.begin(), wr_s.end());
  u32* didx[4];  // read random, write random, read sorted, write sorted
  for (int i = 0; i < 4; ++i) {
    auto const& h = i == 0 ? rd : i == 1 ? wr : i == 2 ? rd_s : wr_s;
    CK(cudaMalloc(&didx[i], n * sizeof(u32)));
    CK(cudaMemcpy(didx[i], h.data(), n * sizeof(u32), cudaMemcpyHostToDevice));
  }
  u64* dbad;
  CK(cudaMalloc(&dbad, sizeof(u64)));
  CK(cudaDeviceSynchronize());

  cudaStream_t s0, s1;
  CK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  cudaEvent_t e0, e1, e2;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaEventCreate(&e2));
  // launch(s0, s1) after one event on s0 that s1 waits on; median of reps after a warm-up
  auto time = [&](auto&& launch) {
    auto once = [&] {
      CK(cudaEventRecord(e0, s0));
      CK(cudaStreamWaitEvent(s1, e0));
      launch(s0, s1);
      CK(cudaGetLastError());
      CK(cudaEventRecord(e1, s0));
      CK(cudaEventRecord(e2, s1));
      CK(cudaEventSynchronize(e1));
      CK(cudaEventSynchronize(e2));
      times t;
      CK(cudaEventElapsedTime(&t.ms0, e0, e1));
      CK(cudaEventElapsedTime(&t.ms1, e0, e2));
      t.ms = std::max(t.ms0, t.ms1);
      return t;
    };
    once();
    std::vector<times> v;
    for (int i = 0; i < reps; ++i) v.push_back(once());
    auto med = [&](float times::*f) {
      std::vector<float> x;
      for (auto& t : v) x.push_back(t.*f);
      std::sort(x.begin(), x.end());
      return x[x.size() / 2];
    };
    return times{med(&times::ms), med(&times::ms0), med(&times::ms1)};
  };
  std::printf("%-40s %9s %8s %8s %8s %8s %8s %s\n", "case", "ms", "Mrows/s", "in GB/s", "out GB/s",
              "sum GB/s", "ns/row", "both/(in+out alone)");
  std::printf("(both/(in+out alone): 1.0 = the directions share one limit, 0.5 = they add up)\n");
  // in_ms / out_ms: each direction's own time (0: direction not moved); ref: alone sum (0: none)
  auto line = [&](std::string const& name, float ms, float in_ms, float out_ms, double ref,
                  std::string const& extra = "") {
    double moved = double(n) * ((in_ms > 0) + (out_ms > 0));
    char r[16]   = "-";
    if (ref > 0) std::snprintf(r, sizeof r, "%.3f", ms / ref);
    std::printf("%-40s %9.3f %8.1f %8.1f %8.1f %8.1f %8.2f %s%s\n", name.c_str(), ms,
                moved / ms / 1e3, in_ms > 0 ? bytes / in_ms / 1e6 : 0.0,
                out_ms > 0 ? bytes / out_ms / 1e6 : 0.0, moved * rowb / ms / 1e6, ms * 1e6 / moved,
                r, extra.c_str());
  };

  // 1. copy engines, contiguous
  times h2d = time([&](auto a, auto) {
    CK(cudaMemcpyAsync(din, table.a, n * rowb, cudaMemcpyHostToDevice, a));
  });
  times d2h = time([&](auto a, auto) {
    CK(cudaMemcpyAsync(ce_host, dout, n * rowb, cudaMemcpyDeviceToHost, a));
  });
  times ce2 = time([&](auto a, auto b) {
    CK(cudaMemcpyAsync(din, table.a, n * rowb, cudaMemcpyHostToDevice, a));
    CK(cudaMemcpyAsync(ce_host, dout, n * rowb, cudaMemcpyDeviceToHost, b));
  });
  line("CE contiguous H2D alone", h2d.ms, h2d.ms, 0, 0);
  line("CE contiguous D2H alone", d2h.ms, 0, d2h.ms, 0);
  line("CE contiguous both (2 streams)", ce2.ms, ce2.ms0, ce2.ms1, h2d.ms + d2h.ms);

  // 2 and 3: SM loads and stores; prepare (poison din, stamp dout), time, check
  bool failed  = false;
  u32 stamp    = 0;
  auto sm_case = [&](bool in, bool out, u32 const* ri, u32 const* wi, auto&& launch) {
    ++stamp;
    if (in) CK(cudaMemset(din, 0xff, n * rowb));
    if (out) fill_src<<<full, 256>>>(dout, wi, u32(n), vecs, stamp);
    CK(cudaDeviceSynchronize());
    times t      = time(launch);
    u64 bad      = 0;
    size_t bad_w = 0;
    if (in) {
      CK(cudaMemset(dbad, 0, sizeof(u64)));
      check_reads<<<full, 256>>>(din, ri, u32(n), vecs, dbad);
      CK(cudaMemcpy(&bad, dbad, sizeof(u64), cudaMemcpyDeviceToHost));
    }
    if (out) {  // the written set is the same in either order
      std::mt19937 g{stamp};
      for (int k = 0; k < 4096; ++k) {
        u32 r = wr[g() % n];
        for (int v = 0; v < vecs; ++v) bad_w += !same(*table.at(r, v), pattern(r, v, stamp));
      }
    }
    if (bad || bad_w) {
      std::printf("CHECK FAILED (next line): %llu bad read vectors, %zu bad written vectors\n", bad,
                  bad_w);
      failed = true;
    }
    return t;
  };
  for (int sorted = 0; sorted < 2; ++sorted) {
    u32 const* ri = didx[2 * sorted];
    u32 const* wi = didx[2 * sorted + 1];
    std::string o = sorted ? "sorted " : "random ";
    auto rows_on  = [&](int grid, bool write) {
      return [=](cudaStream_t a, cudaStream_t) {
        if (write)
          rows_kernel<true><<<grid, 256, 0, a>>>(table, dout, wi, u32(n), vecs);
        else
          rows_kernel<false><<<grid, 256, 0, a>>>(table, din, ri, u32(n), vecs);
      };
    };
    times r = sm_case(true, false, ri, wi, rows_on(full, false));
    line(o + "read alone", r.ms, r.ms, 0, 0);
    times w = sm_case(false, true, ri, wi, rows_on(full, true));
    line(o + "write alone", w.ms, 0, w.ms, 0);
    times rh = sm_case(true, false, ri, wi, rows_on(half, false));
    line(o + "read alone, half grid", rh.ms, rh.ms, 0, 0);
    times wh = sm_case(false, true, ri, wi, rows_on(half, true));
    line(o + "write alone, half grid", wh.ms, 0, wh.ms, 0);
    times a = sm_case(true, true, ri, wi, [&](cudaStream_t s, cudaStream_t) {
      duplex_kernel<<<full, 256, 0, s>>>(table, din, ri, dout, wi, u32(n), vecs);
    });
    line(o + "both (a) one kernel, warps split", a.ms, a.ms, a.ms, r.ms + w.ms);
    times b = sm_case(true, true, ri, wi, [&](cudaStream_t s, cudaStream_t t) {
      rows_kernel<false><<<half, 256, 0, s>>>(table, din, ri, u32(n), vecs);
      rows_kernel<true><<<half, 256, 0, t>>>(table, dout, wi, u32(n), vecs);
    });
    char extra[96];
    std::snprintf(extra, sizeof extra, "  (vs half-grid alones %.3f: <1 = concurrent)",
                  b.ms / (rh.ms + wh.ms));
    line(o + "both (b) two kernels, 2 streams", b.ms, b.ms0, b.ms1, r.ms + w.ms, extra);
  }
  std::printf("%s\n", failed ? "CHECKS FAILED"
                             : "checks passed (all read rows, 4096 written rows "
                               "per case)");
  return failed ? 1 : 0;
}
