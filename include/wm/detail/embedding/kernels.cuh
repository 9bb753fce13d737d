// SPDX-License-Identifier: Apache-2.0
// Kernels of wm::embedding: initialization, the owner-side run description, the long-run
// segment sums and the fused optimizer update.
#pragma once

#include <wm/detail/base/cuda.cuh>
#include <wm/detail/rows/views.cuh>
#include <wm/detail/tensor/table_rows.cuh>
#include <wm/embedding.cuh>
#include <wm/optimizer.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace wm::detail {

template <class T>
[[nodiscard]] __device__ inline float to_float(T x) {
  return static_cast<float>(x);
}
template <class T>
[[nodiscard]] __device__ inline T from_float(float x) {
  if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(x);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(x);
  } else {
    return static_cast<T>(x);
  }
}

/// Initial values of this rank's rows: every global row k in [0, rows) that @p map gives to
/// @p rank is written at its local row (any mapping: no inverse of the mapping is needed).
template <class T, class MapRef>
__global__ void init_rows_kernel(matrix_view<T> w, embedding_init init, MapRef map, int rank,
                                 std::size_t rows) {
  std::size_t const n = rows * w.cols;
  for (std::size_t i = grid_thread(); i < n; i += grid_threads()) {
    std::size_t const k = i / w.cols;
    if (map.owner(k) != rank) { continue; }
    std::size_t const j = i % w.cols;
    w(map.local(k), j)  = from_float<T>(init.value(k, j, w.cols));
  }
}

template <class T>
__global__ void fill_rows_kernel(matrix_view<T> v, T value) {
  std::size_t const n = v.rows * v.cols;
  for (std::size_t i = grid_thread(); i < n; i += grid_threads()) {
    v(i / v.cols, i % v.cols) = value;
  }
}

/**
 * Gradient sums of long runs of equal keys (skewed batches: one hot row can collect most of a
 * batch). A run longer than `long_run` is cut into segments of at most `segment` sorted
 * gradients; each segment is summed by one block, and the run's update sums its segments in
 * order. Sums depend only on the sorted order, never on timing.
 */
struct long_runs {
  int long_run;       // runs longer than this use segments
  int segment;        // gradients per segment
  int* count;         // segments made (device)
  int* first;         // first segment of run u (long runs only)
  int* seg_begin;     // segment -> first sorted position
  int* seg_len;       // segment -> gradients in it
  float* sums;        // segment -> dim floats
  std::size_t bound;  // most segments a batch can make
  [[nodiscard]] WM_HOST_DEVICE int segments(int len) const { return (len + segment - 1) / segment; }
};

/// Runs of equal sorted keys: run u is [offsets[u], offsets[u + 1]), the last one ends at m.
struct runs_view {
  int const* offsets;
  int const* count;  // device
  int m;
  [[nodiscard]] __device__ int end(int u, int runs) const {
    return u + 1 < runs ? offsets[u + 1] : m;
  }
};

/// Selects the first position of each run of equal sorted keys.
struct run_head {
  std::uint32_t const* keys;
  [[nodiscard]] __device__ bool operator()(int i) const { return i == 0 || keys[i] != keys[i - 1]; }
};

/// One run of equal sorted keys, as the update reads it: one 16-byte load per row.
struct alignas(16) run_desc {
  std::uint32_t key;  // local row
  int pos0;           // position of its first gradient in the caller's batch
  int off;            // first sorted position
  int len;            // gradients in the run (0: no run)
};

/// Describes every run and cuts the long ones into segments (the order of runs in the segment
/// list does not matter). A template only so that every translation unit may define it.
template <class Runs>
__global__ void describe_runs_kernel(long_runs lr, Runs rv, std::uint32_t const* sorted_keys,
                                     int const* sorted_pos, run_desc* desc) {
  int const runs     = *rv.count;
  int const* offsets = rv.offsets;
  for (int u = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); u < runs;
       u += static_cast<int>(gridDim.x * blockDim.x)) {
    int const off = offsets[u];
    int const len = rv.end(u, runs) - off;
    desc[u]       = {sorted_keys[off], sorted_pos[off], off, len};
    if (len <= lr.long_run) { continue; }
    int const n    = lr.segments(len);
    int const base = atomicAdd(lr.count, n);
    lr.first[u]    = base;
    for (int q = 0; q < n; ++q) {
      lr.seg_begin[base + q] = off + q * lr.segment;
      lr.seg_len[base + q]   = min(lr.segment, len - q * lr.segment);
    }
  }
}

/// One block per segment: rows r, r + R, ... are summed by row group r; groups combine in order.
template <class T, int V>
__global__ void __launch_bounds__(256)
    sum_segments_kernel(long_runs lr, int const* sorted_pos, T const* grads, std::size_t dim,
                        int group) {
  __shared__ float part[256 * V];
  int const lane = static_cast<int>(threadIdx.x) % group;
  int const r    = static_cast<int>(threadIdx.x) / group;
  int const R    = static_cast<int>(blockDim.x) / group;
  int const segs = *lr.count;
  for (int seg = static_cast<int>(blockIdx.x); seg < segs; seg += static_cast<int>(gridDim.x)) {
    int const begin = lr.seg_begin[seg];
    int const len   = lr.seg_len[seg];
    for (std::size_t c0 = 0; c0 < dim; c0 += static_cast<std::size_t>(group) * V) {
      std::size_t const j = c0 + static_cast<std::size_t>(lane) * V;
      float acc[V]        = {};
      if (j < dim) {
        for (int q = r; q < len; q += R) {
          auto const g = *reinterpret_cast<vec_of<T, V> const*>(
              grads + static_cast<std::size_t>(sorted_pos[begin + q]) * dim + j);
#pragma unroll
          for (int e = 0; e < V; ++e) { acc[e] += to_float(g.v[e]); }
        }
      }
#pragma unroll
      for (int e = 0; e < V; ++e) { part[threadIdx.x * V + e] = acc[e]; }
      __syncthreads();
      if (r == 0 && j < dim) {
        for (int q = 1; q < R; ++q) {
#pragma unroll
          for (int e = 0; e < V; ++e) { acc[e] += part[(q * group + lane) * V + e]; }
        }
#pragma unroll
        for (int e = 0; e < V; ++e) {
          lr.sums[static_cast<std::size_t>(seg) * dim + j + static_cast<std::size_t>(e)] = acc[e];
        }
      }
      __syncthreads();
    }
  }
}

/**
 * One group of lanes per unique row, U rows per group at a time: sums each row's gradients
 * (float), reads its weight and state once, applies the optimizer, writes them once; each lane
 * moves V values per access. A row's loads wait on its run descriptor (one 16-byte load); the
 * next round's descriptors are loaded before this round's rows, so a row's weight, state and
 * first gradient wait on no index load of their own (Adam's per-row step count and the
 * positions of further duplicates still do). The run count is read from device memory (no host
 * round trip). Nothing is written when *abort is set (an invalid index was found).
 *
 * Rows are found through @p loc (table_rows: the table; a cache's line_locator: the row's line
 * when it has one, else the table), so the arithmetic is the same code wherever a row lives.
 */
template <class T, int V, class Opt, class Loc>
__global__ void __launch_bounds__(256, Opt::states >= 1 ? 4 : 3)
    update_rows_kernel(Opt opt, Loc loc, std::size_t dim, std::int64_t global_step,
                       run_desc const* desc, int const* run_count, int const* sorted_pos,
                       T const* grads, long_runs lr, float lr_rate, int group,
                       unsigned const* abort) {
  if (*abort != 0) { return; }
  constexpr int S = Opt::states > 0 ? Opt::states : 1;
  // Rows per group in flight: two for stateless SGD; one where state rows fill the registers
  // (two made Adam 8% slower; with the next descriptors held, two spilled for AdaGrad).
  constexpr int U          = Opt::states >= 1 ? 1 : 2;
  using place_type         = typename Loc::place_type;
  std::size_t const tid    = grid_thread();
  std::size_t const groups = grid_threads() / static_cast<std::size_t>(group);
  std::size_t const round  = groups * U;  // runs one round of the grid covers
  int const lane           = static_cast<int>(tid % static_cast<std::size_t>(group));
  unsigned const lane_base =
      (threadIdx.x % 32) / static_cast<unsigned>(group) * static_cast<unsigned>(group);
  unsigned const mask = (group == 32 ? 0xffffffffu : ((1u << group) - 1u)) << lane_base;
  auto const runs     = static_cast<std::size_t>(*run_count);
  using wvec          = vec_of<T, V>;
  using fvec          = vec_of<float, V>;
  auto desc_of        = [&](std::size_t u) { return u < runs ? desc[u] : run_desc{0u, 0, 0, 0}; };
  std::size_t const u_first = tid / static_cast<std::size_t>(group);
  run_desc cur[U];
#pragma unroll
  for (int r = 0; r < U; ++r) { cur[r] = desc_of(u_first + static_cast<std::size_t>(r) * groups); }
  for (std::size_t u0 = u_first; u0 < runs; u0 += round) {
    run_desc next[U];
#pragma unroll
    for (int r = 0; r < U; ++r) {
      next[r] = desc_of(u0 + round + static_cast<std::size_t>(r) * groups);
    }
    place_type at[U];
    std::int64_t t[U];
#pragma unroll
    for (int r = 0; r < U; ++r) {
      at[r] = cur[r].len > 0 ? loc.locate(cur[r].key) : place_type{};
      t[r]  = at[r].step != nullptr ? *at[r].step + 1 : global_step;
    }
    for (std::size_t j = static_cast<std::size_t>(lane) * V; j < dim;
         j += static_cast<std::size_t>(group) * V) {
      wvec wv[U];
      fvec s[U][S];
      float g[U][V];
#pragma unroll
      for (int r = 0; r < U; ++r) {
#pragma unroll
        for (int e = 0; e < V; ++e) { g[r][e] = 0.0f; }
        if (cur[r].len > 0) {
          wv[r] = *reinterpret_cast<wvec const*>(at[r].w + j);
#pragma unroll
          for (int k = 0; k < Opt::states; ++k) {
            s[r][k] =
                *reinterpret_cast<fvec const*>(at[r].st + static_cast<std::size_t>(k) * dim + j);
          }
        }
      }
      // The first gradient of every short run first (most runs have one), then the rest.
#pragma unroll
      for (int r = 0; r < U; ++r) {
        if (cur[r].len > 0 && cur[r].len <= lr.long_run) {
          auto const p = *reinterpret_cast<wvec const*>(
              grads + static_cast<std::size_t>(cur[r].pos0) * dim + j);
#pragma unroll
          for (int e = 0; e < V; ++e) { g[r][e] += to_float(p.v[e]); }
        }
      }
#pragma unroll
      for (int r = 0; r < U; ++r) {
        if (cur[r].len > lr.long_run) {
          int const first = lr.first[u0 + static_cast<std::size_t>(r) * groups];
          int const segs  = lr.segments(cur[r].len);
          // Independent loads in flight (the adds keep their order: same sums).
#pragma unroll 4
          for (int q = 0; q < segs; ++q) {
            auto const p = *reinterpret_cast<fvec const*>(
                lr.sums + static_cast<std::size_t>(first + q) * dim + j);
#pragma unroll
            for (int e = 0; e < V; ++e) { g[r][e] += p.v[e]; }
          }
        } else {
#pragma unroll 4
          for (int q = 1; q < cur[r].len; ++q) {
            auto const p = *reinterpret_cast<wvec const*>(
                grads + static_cast<std::size_t>(sorted_pos[cur[r].off + q]) * dim + j);
#pragma unroll
            for (int e = 0; e < V; ++e) { g[r][e] += to_float(p.v[e]); }
          }
        }
      }
#pragma unroll
      for (int r = 0; r < U; ++r) {
        if (cur[r].len == 0) { continue; }
#pragma unroll
        for (int e = 0; e < V; ++e) {
          float x = to_float(wv[r].v[e]);
          float se[S];
#pragma unroll
          for (int k = 0; k < Opt::states; ++k) { se[k] = s[r][k].v[e]; }
          opt.update(x, g[r][e], se, update_step<float>{lr_rate, t[r]});
          wv[r].v[e] = from_float<T>(x);
#pragma unroll
          for (int k = 0; k < Opt::states; ++k) { s[r][k].v[e] = se[k]; }
        }
        *reinterpret_cast<wvec*>(at[r].w + j) = wv[r];
#pragma unroll
        for (int k = 0; k < Opt::states; ++k) {
          *reinterpret_cast<fvec*>(at[r].st + static_cast<std::size_t>(k) * dim + j) = s[r][k];
        }
      }
    }
    __syncwarp(mask);  // every lane of the group has read the row's step
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < U; ++r) {
        if (cur[r].len == 0) { continue; }
        if (at[r].step != nullptr) { *at[r].step = t[r]; }
        loc.written(at[r]);
      }
    }
#pragma unroll
    for (int r = 0; r < U; ++r) { cur[r] = next[r]; }
  }
}

/// The arguments of the two owner-side kernels, launched with V values per access.
template <class T, class Opt, class Loc>
struct update_launch {
  Opt opt;
  Loc loc;
  std::size_t dim;
  std::int64_t step;
  run_desc const* desc;
  int const* run_count;
  int const* sorted_pos;
  T const* grads;
  long_runs longs;
  float lr;
  int group;
  int blocks;
  unsigned const* abort;
  template <int V>
  void run(cudaStream_t s) const {
    int const sms = sm_count();
    sum_segments_kernel<T, V><<<sms * 4, 256, 0, s>>>(longs, sorted_pos, grads, dim, group);
    WM_CHECK_LAUNCH();
    // As many blocks as fit at once: the loop strides over the runs (no second wave).
    static per_device_value resident_blocks;
    int const resident = resident_blocks.get([](int) {
      int per_sm = 0;
      WM_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          &per_sm, update_rows_kernel<T, V, Opt, Loc>, 256, 0));
      return std::max(per_sm, 1) * sm_count();
    });
    int const grid     = std::max(1, std::min(blocks, resident));
    update_rows_kernel<T, V, Opt, Loc><<<grid, 256, 0, s>>>(
        opt, loc, dim, step, desc, run_count, sorted_pos, grads, longs, lr, group, abort);
    WM_CHECK_LAUNCH();
  }
};

/// Keys as 32-bit local rows (the sort moves half the bytes of 64-bit ones) and positions
/// 0..n-1; sets *err if a key is negative or not below @p rows (its 32-bit key is then 0).
template <class Index>
__global__ void positions_kernel(Index const* keys, std::size_t n, std::size_t rows,
                                 std::uint32_t* keys32, int* pos, unsigned* err) {
  for (std::size_t j = grid_thread(); j < n; j += grid_threads()) {
    Index const k = keys[j];
    bool const ok = valid_index(k, rows);
    keys32[j]     = ok ? static_cast<std::uint32_t>(k) : 0u;
    pos[j]        = static_cast<int>(j);
    if (!ok) { atomicOr(err, 1u); }
  }
}

}  // namespace wm::detail
