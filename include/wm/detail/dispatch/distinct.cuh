// Each distinct row of a batch once: sort the keys with their positions, find the runs of equal
// keys, read each run's row once (host rows: fresh, in ascending key order), then copy it from
// the run's first output row to the run's other output rows on the device. Used by the host
// gathers (mapped layouts, the distributed owner side) and the caches' misses.
#pragma once

#include <wm/detail/cuda/utility.cuh>
#include <wm/detail/dispatch/kernels.cuh>
#include <wm/detail/dispatch/scratch.cuh>
#include <wm/error.hpp>

#include <cub/device/device_for.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_select.cuh>
#include <thrust/iterator/counting_iterator.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace wm::detail {

/// A batch sorted by key with its positions, and its runs of equal keys (all on the device).
template <class Index>
struct distinct_batch {
  Index const* keys;             ///< n keys, ascending (stable sort)
  std::size_t const* positions;  ///< positions[i]: where sorted key i stood in the batch
  std::size_t const* run_begin;  ///< run_begin[r]: first sorted element of run r, r < runs;
                                 ///< run_begin[runs] == n
  std::size_t const* runs;  ///< device: the number of runs (distinct keys, invalid ones included)
  std::size_t n;            ///< batch size (host)
};

/// Selects the first sorted element of each run of equal keys (full equality).
template <class Index>
struct run_head_op {
  Index const* keys;
  [[nodiscard]] __device__ bool operator()(std::size_t i) const {
    return i == 0 || keys[i] != keys[i - 1];
  }
};

/// Closes the run list: run_begin[runs] = n.
struct close_runs_op {
  std::size_t* run_begin;
  std::size_t const* runs;
  std::size_t n;
  __device__ void operator()(std::size_t) const { run_begin[*runs] = n; }
};

/**
 * Sorts @p idx (n keys) on the low @p bits bits with positions, finds runs of EQUAL keys (full
 * equality, so invalid keys that share low bits with valid ones only split runs), all in @p ws on
 * @p s, no host synchronization. The batch's arrays live in @p ws until its next use.
 */
template <class Index>
distinct_batch<Index> plan_distinct(Index const* idx, std::size_t n, int bits, workspace& ws,
                                    cudaStream_t s) {
  bits                    = std::clamp(bits, 1, int{sizeof(Index) * 8});
  std::size_t const items = std::max<std::size_t>(n, 1);
  std::size_t cub_sort    = 0;
  std::size_t cub_select  = 0;
  thrust::counting_iterator<std::size_t> const first{0};
  WM_CUDA_TRY(cub::DeviceRadixSort::SortPairs(
      nullptr, cub_sort, static_cast<Index const*>(nullptr), static_cast<Index*>(nullptr),
      static_cast<std::size_t const*>(nullptr), static_cast<std::size_t*>(nullptr), items, 0, bits,
      s));
  WM_CUDA_TRY(cub::DeviceSelect::If(nullptr, cub_select, first, static_cast<std::size_t*>(nullptr),
                                    static_cast<std::size_t*>(nullptr),
                                    static_cast<std::int64_t>(items), run_head_op<Index>{nullptr},
                                    s));
  carver c;
  auto const o_pos   = c.add<std::size_t>(n);
  auto const o_keys  = c.add<Index>(n);
  auto const o_spos  = c.add<std::size_t>(n);
  auto const o_begin = c.add<std::size_t>(n + 1);
  auto const o_runs  = c.add<std::size_t>(1);
  auto const o_cub   = c.add<std::byte>(std::max(cub_sort, cub_select));
  std::byte* base    = ws.reserve(c.total(), s);
  auto* pos          = c.take<std::size_t>(base, o_pos);
  auto* keys         = c.take<Index>(base, o_keys);
  auto* spos         = c.take<std::size_t>(base, o_spos);
  auto* run_begin    = c.take<std::size_t>(base, o_begin);
  auto* runs         = c.take<std::size_t>(base, o_runs);
  auto* temp         = c.take<std::byte>(base, o_cub);
  distinct_batch<Index> const b{keys, spos, run_begin, runs, n};
  if (n == 0) {
    WM_CUDA_TRY(cudaMemsetAsync(runs, 0, sizeof(std::size_t), s));
    WM_CUDA_TRY(cudaMemsetAsync(run_begin, 0, sizeof(std::size_t), s));
    return b;
  }
  iota_async(pos, n, 0, s);
  WM_CUDA_TRY(cub::DeviceRadixSort::SortPairs(temp, cub_sort, idx, keys, pos, spos, n, 0, bits, s));
  WM_CUDA_TRY(cub::DeviceSelect::If(temp, cub_select, first, run_begin, runs,
                                    static_cast<std::int64_t>(n), run_head_op<Index>{keys}, s));
  WM_CUDA_TRY(cub::DeviceFor::Bulk(1, close_runs_op{run_begin, runs, n}, s));
  return b;
}

/// The run of sorted element @p i: the last r with run_begin[r] <= i (binary search).
template <class Index>
[[nodiscard]] __device__ inline std::size_t run_of(distinct_batch<Index> const& b, std::size_t i) {
  std::size_t lo = 0, hi = *b.runs;  // run_begin[lo] <= i < run_begin[hi]
  while (hi - lo > 1) {
    std::size_t const mid = lo + (hi - lo) / 2;
    if (b.run_begin[mid] <= i) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

/// Replication: out row positions[i] = out row positions[first of i's run], for non-first i.
template <class Index>
struct replicate_moves {
  distinct_batch<Index> b;
  packed_rows out;
  [[nodiscard]] __device__ row_move operator()(std::size_t i, int) const {
    std::size_t const head = b.run_begin[run_of(b, i)];
    if (head == i) { return {nullptr, nullptr}; }
    return {out.row(b.positions[head]), out.row(b.positions[i])};
  }
};

/**
 * For every sorted element i that is not its run's first: row positions[i] of @p out =
 * row positions[run_begin[run of i]] of @p out (rows of @p row_bytes, packed). The run heads'
 * rows must already be in @p out. Device-to-device, L2-friendly: one group of lanes per element
 * (long runs of hot keys spread over the whole grid), the head found by a binary search in
 * run_begin. @p blocks_per_sm: see plan_row_launch.
 */
template <class Index>
void replicate_runs(distinct_batch<Index> const& b, std::byte* out, std::size_t row_bytes,
                    cudaStream_t s, int blocks_per_sm = 8) {
  launch_rows(
      b.n, row_bytes, {row_bytes, reinterpret_cast<std::uintptr_t>(out)},
      [&]<class Vec>(row_launch const& l) {
        using M = replicate_moves<Index>;
        move_rows_kernel<Vec, false, false, M>
            <<<l.blocks, 256, 0, s>>>(M{b, packed_rows{out, row_bytes}}, b.n, l.row_vecs, l.group);
      },
      blocks_per_sm);
}

/// The distinct read: run r's row rows.row(keys[run_begin[r]]) to out row
/// positions[run_begin[r]]; invalid keys write a zero row and set *err. Runs past the count
/// (the grid is sized from n) do nothing.
template <class Rows, class Index>
struct distinct_moves {
  Rows rows;
  distinct_batch<Index> b;
  packed_rows out;
  unsigned* err;
  [[nodiscard]] __device__ row_move operator()(std::size_t r, int lane) const {
    if (r >= *b.runs) { return {nullptr, nullptr}; }
    std::size_t const i = b.run_begin[r];
    Index const k       = b.keys[i];
    row_move m{nullptr, out.row(b.positions[i])};
    if (valid_index(k, rows.rows())) {
      m.src = rows.row(static_cast<std::size_t>(k));
    } else if (lane == 0) {
      atomicOr(err, 1u);
    }
    return m;
  }
};

/**
 * Reads each run's row of @p b once from @p rows (ascending keys: the rows in flight sit on few
 * pages) into the run's first output row of @p out (packed rows of @p row_bytes), then copies it
 * to the run's other output rows (replicate_runs). @p fresh: ld.cv loads, for host rows other
 * GPUs may have written (each is read once here, so nothing is lost by skipping L2). Invalid
 * keys: zero rows, *err set. @p rows_alignment: the source rows' stride.
 */
template <class Rows, class Index>
void read_distinct(Rows rows, distinct_batch<Index> const& b, std::byte* out, std::size_t row_bytes,
                   std::uintptr_t rows_alignment, unsigned* err, cudaStream_t s, bool fresh,
                   int blocks_per_sm = 8) {
  launch_rows(
      b.n, row_bytes, {row_bytes, rows_alignment, reinterpret_cast<std::uintptr_t>(out)},
      [&]<class Vec>(row_launch const& l) {
        using M = distinct_moves<Rows, Index>;
        auto* const kernel =
            fresh ? move_rows_kernel<Vec, true, false, M> : move_rows_kernel<Vec, false, false, M>;
        kernel<<<l.blocks, 256, 0, s>>>(M{rows, b, packed_rows{out, row_bytes}, err}, b.n,
                                        l.row_vecs, l.group);
      },
      blocks_per_sm);
  replicate_runs(b, out, row_bytes, s, blocks_per_sm);
}

/**
 * A gather that reads each distinct row once: out row i = rows.row(idx[i]) for i < n (@p out:
 * packed rows of @p row_bytes). @p bits: the key bits that order every valid key (row_bits);
 * @p ws: the plan's room. See plan_distinct and read_distinct.
 */
template <class Rows, class Index>
void gather_distinct(Rows rows, Index const* idx, std::size_t n, int bits, workspace& ws,
                     std::byte* out, std::size_t row_bytes, std::uintptr_t rows_alignment,
                     unsigned* err, cudaStream_t s, bool fresh, int blocks_per_sm = 8) {
  if (n == 0) { return; }
  auto const b = plan_distinct(idx, n, bits, ws, s);
  read_distinct(rows, b, out, row_bytes, rows_alignment, err, s, fresh, blocks_per_sm);
}

}  // namespace wm::detail
