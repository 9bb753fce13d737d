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
#include <cub/device/device_scan.cuh>
#include <cub/device/device_select.cuh>
#include <cuda/functional>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/transform_iterator.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace wm::detail {

/// Host batches at least this long read each distinct row once. The distinct path costs about
/// ten launches (iota, radix sort passes, run select, read, replicate): some 30-50 us of GPU
/// time. A plain read of 4096 rows of 512 bytes over PCIe takes about as long (2 MiB at
/// ~50 GB/s), and keys repeat more in longer batches; below this the plain kernel reads every
/// occurrence (repeats of short batches cost little).
inline constexpr std::size_t host_distinct_threshold = std::size_t{1} << 12;

/// A batch sorted by key with its positions, and its runs of equal keys (all on the device).
template <class Index>
struct distinct_batch {
  Index const* keys;             ///< n keys, ascending (stable sort)
  std::size_t const* positions;  ///< positions[i]: where sorted key i stood in the batch
  std::size_t const* run_begin;  ///< run_begin[r]: first sorted element of run r, r < runs;
                                 ///< run_begin[runs] == n
  std::size_t const* runs;  ///< device: the number of runs (distinct keys, invalid ones included)
  std::size_t n;            ///< batch size (host)
  std::size_t const* heads{};  ///< heads[i]: the first sorted element of i's run (n entries)
};

/// Selects the first sorted element of each run of equal keys (full equality).
template <class Index>
struct run_head_op {
  Index const* keys;
  [[nodiscard]] __device__ bool operator()(std::size_t i) const {
    return i == 0 || keys[i] != keys[i - 1];
  }
};

/// i where sorted element i starts a run, else 0: its running maximum is i's run head.
template <class Index>
struct head_index_op {
  Index const* keys;
  [[nodiscard]] __device__ std::size_t operator()(std::size_t i) const {
    return i == 0 || keys[i] != keys[i - 1] ? i : 0;
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
  auto const head_index = thrust::make_transform_iterator(first, head_index_op<Index>{nullptr});
  std::size_t cub_scan  = 0;
  WM_CUDA_TRY(cub::DeviceScan::InclusiveScan(nullptr, cub_scan, head_index,
                                             static_cast<std::size_t*>(nullptr), cuda::maximum<>{},
                                             items, s));
  carver c;
  auto const o_pos   = c.add<std::size_t>(n);
  auto const o_keys  = c.add<Index>(n);
  auto const o_spos  = c.add<std::size_t>(n);
  auto const o_begin = c.add<std::size_t>(n + 1);
  auto const o_runs  = c.add<std::size_t>(1);
  auto const o_cub   = c.add<std::byte>(std::max({cub_sort, cub_select, cub_scan}));
  std::byte* base    = ws.reserve(c.total(), s);
  auto* pos          = c.take<std::size_t>(base, o_pos);
  auto* keys         = c.take<Index>(base, o_keys);
  auto* spos         = c.take<std::size_t>(base, o_spos);
  auto* run_begin    = c.take<std::size_t>(base, o_begin);
  auto* runs         = c.take<std::size_t>(base, o_runs);
  auto* temp         = c.take<std::byte>(base, o_cub);
  // pos (the sort's input) becomes heads once the sort has read it.
  distinct_batch<Index> const b{keys, spos, run_begin, runs, n, pos};
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
  WM_CUDA_TRY(cub::DeviceScan::InclusiveScan(
      temp, cub_scan, thrust::make_transform_iterator(first, head_index_op<Index>{keys}), pos,
      cuda::maximum<>{}, n, s));
  return b;
}

/// Output row of sorted element i: out row order[positions[i]] (positions[i] when order is null).
template <class Index>
[[nodiscard]] __device__ inline std::byte* output_row(distinct_batch<Index> const& b,
                                                      std::size_t const* order, packed_rows out,
                                                      std::size_t i) {
  std::size_t const p = b.positions[i];
  return out.row(order != nullptr ? order[p] : p);
}

/// Replication: the output row of sorted element i = that of the first of i's run, for the
/// elements at least `written` past their run's first (those before are in place); the first
/// comes from heads (one load, no search).
template <class Index>
struct replicate_moves {
  distinct_batch<Index> b;
  std::size_t const* order;
  packed_rows out;
  std::size_t written;  // >= 1
  [[nodiscard]] __device__ row_move operator()(std::size_t i, int) const {
    std::size_t const head = b.heads[i];
    if (i - head < written) { return {nullptr, nullptr}; }
    return {output_row(b, order, out, head), output_row(b, order, out, i)};
  }
};

/// As replicate_runs, with output rows out.row(order[positions[i]]) (@p order may be null) of
/// @p row_bytes at a stride of out.stride_bytes, for the elements at least @p written (>= 1)
/// past their run's first (those before must be in place).
template <class Index>
void replicate_runs_to(distinct_batch<Index> const& b, std::size_t const* order, packed_rows out,
                       std::size_t row_bytes, std::size_t written, cudaStream_t s,
                       int blocks_per_sm = 8) {
  launch_rows(
      b.n, row_bytes, {row_bytes, reinterpret_cast<std::uintptr_t>(out.base), out.stride_bytes},
      [&]<class Vec>(row_launch const& l) {
        using M = replicate_moves<Index>;
        move_rows_kernel<Vec, false, false, M><<<l.blocks, 256, 0, s>>>(
            M{b, order, out, std::max<std::size_t>(written, 1)}, b.n, l.row_vecs, l.group);
      },
      blocks_per_sm);
}

/**
 * For every sorted element i that is not its run's first: row positions[i] of @p out =
 * row positions[run_begin[run of i]] of @p out (rows of @p row_bytes, packed). The run heads'
 * rows must already be in @p out. Device-to-device, L2-friendly: one group of lanes per element
 * (long runs of hot keys spread over the whole grid), the head read from heads. @p blocks_per_sm:
 * see plan_row_launch.
 */
template <class Index>
void replicate_runs(distinct_batch<Index> const& b, std::byte* out, std::size_t row_bytes,
                    cudaStream_t s, int blocks_per_sm = 8) {
  replicate_runs_to(b, static_cast<std::size_t const*>(nullptr), packed_rows{out, row_bytes},
                    row_bytes, 1, s, blocks_per_sm);
}

/// Output rows of each run that the distinct read writes itself, from the registers that hold
/// the row (these writes overlap the reads of other rows); replicate_runs copies the rest.
inline constexpr std::size_t fused_copies = 16;

/// Which runs a distinct read takes, by length: [shortest, longest].
struct run_lengths {
  std::size_t shortest{1};
  std::size_t longest{~std::size_t{0}};
};

/**
 * The distinct read: for each run r whose length is in @p take, run r's row
 * rows.row(keys[run_begin[r]]) to the output rows (see output_row) of the run's first
 * min(run length, fused_copies) elements; invalid keys write zero rows and set *err. A group of
 * `group` lanes takes a row in vectors of Vec, `unroll` runs in flight (loads issued before the
 * first store), runs in ascending key order across the grid; the grid is sized from n and the
 * groups past the run count exit at once.
 */
template <class Vec, bool Fresh, class Rows, class Index>
__global__ void __launch_bounds__(256)
    read_runs_kernel(Rows rows, distinct_batch<Index> b, std::size_t const* order, packed_rows out,
                     unsigned* err, run_lengths take, std::size_t row_vecs, int group) {
  std::size_t const tid    = grid_thread();
  std::size_t const groups = grid_threads() / static_cast<std::size_t>(group);
  std::size_t const g      = tid / static_cast<std::size_t>(group);
  int const lane           = static_cast<int>(tid % static_cast<std::size_t>(group));
  std::size_t const runs   = *b.runs;
  for (std::size_t r0 = g; r0 < runs; r0 += groups * unroll) {
    Vec const* src[unroll];
    std::size_t first[unroll];
    std::size_t copies[unroll];
#pragma unroll
    for (int u = 0; u < unroll; ++u) {
      std::size_t const r   = r0 + static_cast<std::size_t>(u) * groups;
      src[u]                = nullptr;
      first[u]              = 0;
      copies[u]             = 0;
      std::size_t const at  = r < runs ? b.run_begin[r] : 0;
      std::size_t const len = r < runs ? b.run_begin[r + 1] - at : 0;
      if (len >= take.shortest && len <= take.longest) {
        first[u]      = at;
        copies[u]     = len < fused_copies ? len : fused_copies;
        Index const k = b.keys[at];
        if (valid_index(k, rows.rows())) {
          src[u] = reinterpret_cast<Vec const*>(rows.row(static_cast<std::size_t>(k)));
        } else if (lane == 0) {
          atomicOr(err, 1u);
        }
      }
    }
    for (std::size_t c = static_cast<std::size_t>(lane); c < row_vecs;
         c += static_cast<std::size_t>(group)) {
      Vec v[unroll];
#pragma unroll
      for (int u = 0; u < unroll; ++u) {
        if (src[u] != nullptr) { v[u] = load_vec<Fresh>(src[u] + c); }
      }
#pragma unroll
      for (int u = 0; u < unroll; ++u) {
        for (std::size_t j = 0; j < copies[u]; ++j) {
          auto* const dst = reinterpret_cast<Vec*>(output_row(b, order, out, first[u] + j));
          store_vec<false>(dst + c, src[u] != nullptr ? v[u] : Vec{});
        }
      }
    }
  }
}

/// Launches read_runs_kernel over the runs of @p b whose lengths are in @p take.
template <class Rows, class Index>
void launch_read_runs(Rows rows, distinct_batch<Index> const& b, std::size_t const* order,
                      packed_rows out, std::size_t row_bytes, std::uintptr_t rows_alignment,
                      unsigned* err, run_lengths take, cudaStream_t s, bool fresh,
                      int blocks_per_sm) {
  launch_rows(
      b.n, row_bytes,
      {row_bytes, rows_alignment, reinterpret_cast<std::uintptr_t>(out.base), out.stride_bytes},
      [&]<class Vec>(row_launch const& l) {
        auto* const kernel = fresh ? read_runs_kernel<Vec, true, Rows, Index>
                                   : read_runs_kernel<Vec, false, Rows, Index>;
        kernel<<<l.blocks, 256, 0, s>>>(rows, b, order, out, err, take, l.row_vecs, l.group);
      },
      blocks_per_sm);
}

/**
 * Reads each run's row of @p b once from @p rows (ascending keys: the rows in flight sit on few
 * pages) into the output rows of the run's first elements (fused_copies of them), then copies
 * it to the output rows of the run's other elements (as replicate_runs). Output rows:
 * out.row(order[positions[i]]), or out.row(positions[i]) when @p order is null, @p row_bytes
 * each. @p fresh: ld.cv loads, for host rows other GPUs may have written (each is read once
 * here, so nothing is lost by skipping L2). Invalid keys: zero rows, *err set.
 * @p rows_alignment: the source rows' stride.
 */
template <class Rows, class Index>
void read_distinct(Rows rows, distinct_batch<Index> const& b, std::size_t const* order,
                   packed_rows out, std::size_t row_bytes, std::uintptr_t rows_alignment,
                   unsigned* err, cudaStream_t s, bool fresh, int blocks_per_sm = 8) {
  launch_read_runs(rows, b, order, out, row_bytes, rows_alignment, err, run_lengths{}, s, fresh,
                   blocks_per_sm);
  replicate_runs_to(b, order, out, row_bytes, fused_copies, s, blocks_per_sm);
}

/**
 * As read_distinct, with the device copies of long runs beside the reads of the short ones: the
 * runs longer than fused_copies (hot keys: few rows, most of the copies) are read first; then
 * @p side copies them to the rest of their output rows while @p s reads the short runs (which
 * need no copies), each kernel on part of every multiprocessor. @p fork, @p join: events this
 * call may record (the side stream starts after the long runs are read; @p s waits for it at
 * the end). Skewed batches copy a large share of their rows; this hides that behind PCIe.
 */
template <class Rows, class Index>
void read_distinct_beside(Rows rows, distinct_batch<Index> const& b, std::size_t const* order,
                          packed_rows out, std::size_t row_bytes, std::uintptr_t rows_alignment,
                          unsigned* err, cudaStream_t s, bool fresh, cudaStream_t side,
                          cudaEvent_t fork, cudaEvent_t join) {
  if (b.n == 0) { return; }
  // Grids small enough to be resident together (both kernels take 40-70 registers a thread, so
  // a multiprocessor holds 4-6 of their blocks): a late block of a grid-stride kernel would
  // finish its share late. The copies are launched first; 2 blocks per multiprocessor of reads
  // keep some 4 MB of rows in flight, far beyond what PCIe needs.
  int const copy_blocks = 2, read_blocks = 2;
  launch_read_runs(rows, b, order, out, row_bytes, rows_alignment, err,
                   run_lengths{fused_copies + 1, ~std::size_t{0}}, s, fresh, 8);
  WM_CUDA_TRY(cudaEventRecord(fork, s));
  WM_CUDA_TRY(cudaStreamWaitEvent(side, fork, 0));
  replicate_runs_to(b, order, out, row_bytes, fused_copies, side, copy_blocks);
  WM_CUDA_TRY(cudaEventRecord(join, side));
  launch_read_runs(rows, b, order, out, row_bytes, rows_alignment, err,
                   run_lengths{1, fused_copies}, s, fresh, read_blocks);
  WM_CUDA_TRY(cudaStreamWaitEvent(s, join, 0));
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
  read_distinct(rows, b, static_cast<std::size_t const*>(nullptr), packed_rows{out, row_bytes},
                row_bytes, rows_alignment, err, s, fresh, blocks_per_sm);
}

}  // namespace wm::detail
