// SPDX-License-Identifier: Apache-2.0
// Each distinct row of a batch once: sort the keys with their positions, find the runs of equal
// keys, read each run's row once (host rows: fresh, in ascending key order), then copy it from
// the run's first output row to the run's other output rows on the device. Used by the host
// gathers (mapped layouts, the distributed owner side) and the caches' misses.
#pragma once

#include <wm/detail/base/cuda.cuh>
#include <wm/detail/base/workspace.cuh>
#include <wm/detail/rows/move.cuh>
#include <wm/error.hpp>

#include <cub/device/device_for.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>
#include <cub/device/device_select.cuh>
#include <cuda/atomic>
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

/// Output rows of each run that the distinct read writes itself, from the registers that hold
/// the row (these writes overlap the reads of other rows); replicate_runs copies the rest.
inline constexpr std::size_t fused_copies = 16;

/// A batch sorted by key with its positions, and its runs of equal keys (all on the device).
/// Pos: the type of positions and element indices (std::uint32_t when the batch is shorter than
/// 2^32 and the keys were narrowed, see plan_distinct_narrow).
template <class Index, class Pos = std::size_t>
struct distinct_batch {
  Index const* keys;        ///< n keys, ascending (stable sort)
  Pos const* positions;     ///< positions[i]: where sorted key i stood in the batch
  Pos const* run_begin;     ///< run_begin[r]: first sorted element of run r, r < runs;
                            ///< run_begin[runs] == n
  Pos const* runs;          ///< device: the number of runs (distinct keys, invalid ones included)
  std::size_t n;            ///< batch size (host)
  Pos const* heads{};       ///< heads[i]: the first sorted element of i's run (n entries)
  Pos const* long_runs{};   ///< the first sorted elements of the runs longer than fused_copies,
                            ///< in no particular order (at most n / (fused_copies + 1))
  Pos const* long_count{};  ///< device: how many long_runs holds
};

/// Selects the first sorted element of each run of equal keys (full equality); lists the first
/// elements of the runs longer than fused_copies in long_runs when that is not null. CUB's select
/// evaluates the predicate once per element (cub/agent/agent_select_if.cuh), so the list holds
/// each long run once; long runs are disjoint stretches of more than fused_copies elements, so
/// n / (fused_copies + 1) entries hold them all.
template <class Index, class Pos>
struct run_head_op {
  Index const* keys;
  std::size_t n;
  Pos* long_runs;
  Pos* long_count;
  [[nodiscard]] __device__ bool operator()(Pos i) const {
    bool const head = i == 0 || keys[i] != keys[i - 1];
    if (head && long_runs != nullptr && i + fused_copies < n && keys[i + fused_copies] == keys[i]) {
      // A sort on the low bits only may put other keys between equal ones: the run is long
      // only if every key up to i + fused_copies is its key.
      bool whole = true;
      for (std::size_t j = 1; j < fused_copies && whole; ++j) { whole = keys[i + j] == keys[i]; }
      if (whole) {
        cuda::atomic_ref<Pos, cuda::thread_scope_device> const count{*long_count};
        long_runs[count.fetch_add(1, cuda::memory_order_relaxed)] = i;
      }
    }
    return head;
  }
};

/// i where sorted element i starts a run, else 0: its running maximum is i's run head.
template <class Index, class Pos>
struct head_index_op {
  Index const* keys;
  [[nodiscard]] __device__ Pos operator()(Pos i) const {
    return i == 0 || keys[i] != keys[i - 1] ? i : Pos{0};
  }
};

/// Closes the run list: run_begin[runs] = n.
template <class Pos>
struct close_runs_op {
  Pos* run_begin;
  Pos const* runs;
  std::size_t n;
  __device__ void operator()(std::size_t) const { run_begin[*runs] = static_cast<Pos>(n); }
};

/// The narrowed keys of plan_distinct_narrow: 32-bit rows, invalid ones as @p rows (sorted last,
/// read as invalid); positions 0..n-1.
template <class Index>
struct narrow_keys_op {
  Index const* idx;
  std::uint32_t rows;
  std::uint32_t* keys;
  std::uint32_t* positions;
  __device__ void operator()(std::size_t i) const {
    Index const k = idx[i];
    keys[i]       = valid_index(k, rows) ? static_cast<std::uint32_t>(k) : rows;
    positions[i]  = static_cast<std::uint32_t>(i);
  }
};

namespace distinct_plan {

/// Where plan_distinct's arrays for @p n keys lie in its workspace (sort, runs, CUB's room) for
/// keys of type Key (narrowed from the caller's type when @p narrow) and positions of type Pos.
template <class Key, class Pos>
struct layout {
  int bits;
  std::size_t cub_sort{}, cub_select{}, cub_scan{};
  carver c;
  std::size_t o_in{}, o_pos{}, o_keys{}, o_spos{}, o_begin{}, o_runs{}, o_long{}, o_lcnt{}, o_cub{};
  layout(std::size_t n, int key_bits, bool narrow, cudaStream_t s)
      : bits{std::clamp(key_bits, 1, int{sizeof(Key) * 8})} {
    std::size_t const items = std::max<std::size_t>(n, 1);
    thrust::counting_iterator<Pos> const first{0};
    WM_CUDA_TRY(cub::DeviceRadixSort::SortPairs(
        nullptr, cub_sort, static_cast<Key const*>(nullptr), static_cast<Key*>(nullptr),
        static_cast<Pos const*>(nullptr), static_cast<Pos*>(nullptr), items, 0, bits, s));
    WM_CUDA_TRY(cub::DeviceSelect::If(nullptr, cub_select, first, static_cast<Pos*>(nullptr),
                                      static_cast<Pos*>(nullptr), static_cast<std::int64_t>(items),
                                      run_head_op<Key, Pos>{}, s));
    auto const head_index =
        thrust::make_transform_iterator(first, head_index_op<Key, Pos>{nullptr});
    WM_CUDA_TRY(cub::DeviceScan::InclusiveScan(
        nullptr, cub_scan, head_index, static_cast<Pos*>(nullptr), cuda::maximum<>{}, items, s));
    o_in    = c.add<Key>(narrow ? n : 0);
    o_pos   = c.add<Pos>(n);
    o_keys  = c.add<Key>(n);
    o_spos  = c.add<Pos>(n);
    o_begin = c.add<Pos>(n + 1);
    o_runs  = c.add<Pos>(1);
    o_long  = c.add<Pos>(n / (fused_copies + 1) + 1);
    o_lcnt  = c.add<Pos>(1);
    o_cub   = c.add<std::byte>(std::max({cub_sort, cub_select, cub_scan}));
  }
  [[nodiscard]] std::size_t total() const noexcept { return c.total(); }
};

/// plan_distinct's work for keys of type Key (the caller's, or narrowed from @p idx when Key is
/// std::uint32_t and Index is not) and positions of type Pos.
template <class Key, class Pos, class Index>
distinct_batch<Key, Pos> make(Index const* idx, std::size_t n, std::size_t rows, int bits,
                              workspace& ws, cudaStream_t s) {
  constexpr bool narrow = !std::is_same_v<Key, Index>;
  layout<Key, Pos> const l{n, bits, narrow, s};
  bits                   = l.bits;
  std::size_t cub_sort   = l.cub_sort;
  std::size_t cub_select = l.cub_select;
  std::size_t cub_scan   = l.cub_scan;
  thrust::counting_iterator<Pos> const first{0};
  carver const& c    = l.c;
  auto const o_in    = l.o_in;
  auto const o_pos   = l.o_pos;
  auto const o_keys  = l.o_keys;
  auto const o_spos  = l.o_spos;
  auto const o_begin = l.o_begin;
  auto const o_runs  = l.o_runs;
  auto const o_long  = l.o_long;
  auto const o_lcnt  = l.o_lcnt;
  auto const o_cub   = l.o_cub;
  std::byte* base    = ws.reserve(c.total(), s);
  auto* in           = c.take<Key>(base, o_in);
  auto* pos          = c.take<Pos>(base, o_pos);
  auto* keys         = c.take<Key>(base, o_keys);
  auto* spos         = c.take<Pos>(base, o_spos);
  auto* run_begin    = c.take<Pos>(base, o_begin);
  auto* runs         = c.take<Pos>(base, o_runs);
  auto* long_runs    = c.take<Pos>(base, o_long);
  auto* long_count   = c.take<Pos>(base, o_lcnt);
  auto* temp         = c.take<std::byte>(base, o_cub);
  // pos (the sort's input) becomes heads once the sort has read it.
  distinct_batch<Key, Pos> const b{keys, spos, run_begin, runs, n, pos, long_runs, long_count};
  WM_CUDA_TRY(cudaMemsetAsync(long_count, 0, sizeof(Pos), s));
  if (n == 0) {
    WM_CUDA_TRY(cudaMemsetAsync(runs, 0, sizeof(Pos), s));
    WM_CUDA_TRY(cudaMemsetAsync(run_begin, 0, sizeof(Pos), s));
    return b;
  }
  Key const* sort_in = nullptr;
  if constexpr (narrow) {
    WM_CUDA_TRY(cub::DeviceFor::Bulk(
        n, narrow_keys_op<Index>{idx, static_cast<std::uint32_t>(rows), in, pos}, s));
    sort_in = in;
  } else {
    (void)rows;
    iota_async(pos, n, 0, s);
    sort_in = idx;
  }
  WM_CUDA_TRY(
      cub::DeviceRadixSort::SortPairs(temp, cub_sort, sort_in, keys, pos, spos, n, 0, bits, s));
  WM_CUDA_TRY(cub::DeviceSelect::If(temp, cub_select, first, run_begin, runs,
                                    static_cast<std::int64_t>(n),
                                    run_head_op<Key, Pos>{keys, n, long_runs, long_count}, s));
  WM_CUDA_TRY(cub::DeviceFor::Bulk(1, close_runs_op<Pos>{run_begin, runs, n}, s));
  WM_CUDA_TRY(cub::DeviceScan::InclusiveScan(
      temp, cub_scan, thrust::make_transform_iterator(first, head_index_op<Key, Pos>{keys}), pos,
      cuda::maximum<>{}, n, s));
  return b;
}

}  // namespace distinct_plan

/**
 * Sorts @p idx (n keys) on the low @p bits bits with positions, finds runs of EQUAL keys (full
 * equality, so invalid keys that share low bits with valid ones only split runs), all in @p ws on
 * @p s, no host synchronization. The batch's arrays live in @p ws until its next use.
 */
template <class Index>
distinct_batch<Index> plan_distinct(Index const* idx, std::size_t n, int bits, workspace& ws,
                                    cudaStream_t s) {
  return distinct_plan::make<Index, std::size_t>(idx, n, 0, bits, ws, s);
}

/// The workspace bytes plan_distinct takes for @p n keys of type Index on @p bits bits (so that a
/// caller can reserve them ahead).
template <class Index>
[[nodiscard]] std::size_t plan_distinct_bytes(std::size_t n, int bits, cudaStream_t s) {
  return distinct_plan::layout<Index, std::size_t>{n, bits, false, s}.total();
}

/// Whether plan_distinct_narrow takes a batch of @p n keys over @p rows rows.
[[nodiscard]] constexpr bool narrow_fits(std::size_t rows, std::size_t n) noexcept {
  return rows < std::size_t{0xffffffffu} && n < std::size_t{0xffffffffu};
}

/**
 * As plan_distinct, for batches over @p rows rows with narrow_fits(rows, n): keys and positions
 * become 32-bit (half the sort's bytes); invalid keys become @p rows (one run, sorted last, which
 * the reads take as invalid).
 */
template <class Index>
distinct_batch<std::uint32_t, std::uint32_t> plan_distinct_narrow(Index const* idx, std::size_t n,
                                                                  std::size_t rows, workspace& ws,
                                                                  cudaStream_t s) {
  WM_EXPECTS(narrow_fits(rows, n), "plan_distinct_narrow: too many rows or keys");
  return distinct_plan::make<std::uint32_t, std::uint32_t>(idx, n, rows, row_bits(rows + 1), ws, s);
}

/// Output row of sorted element i: out row order[positions[i]] (positions[i] when order is null).
template <class Index, class Pos>
[[nodiscard]] __device__ inline std::byte* output_row(distinct_batch<Index, Pos> const& b,
                                                      std::size_t const* order, packed_rows out,
                                                      std::size_t i) {
  std::size_t const p = b.positions[i];
  return out.row(order != nullptr ? order[p] : p);
}

/// Replication: the output row of sorted element i = that of the first of i's run, for the
/// elements at least `written` past their run's first (those before are in place); the first
/// comes from heads (one load, no search).
template <class Index, class Pos>
struct replicate_moves {
  distinct_batch<Index, Pos> b;
  std::size_t const* order;
  packed_rows out;
  std::size_t written;  // >= 1
  [[nodiscard]] __device__ row_move operator()(std::size_t i, int) const {
    // No run longer than fused_copies: nothing lies that far past its run's first.
    if (written >= fused_copies && b.long_count != nullptr && *b.long_count == 0) {
      return {nullptr, nullptr};
    }
    std::size_t const head = b.heads[i];
    if (i - head < written) { return {nullptr, nullptr}; }
    return {output_row(b, order, out, head), output_row(b, order, out, i)};
  }
};

/// As replicate_runs, with output rows out.row(order[positions[i]]) (@p order may be null) of
/// @p row_bytes at a stride of out.stride_bytes, for the elements at least @p written (>= 1)
/// past their run's first (those before must be in place).
template <class Index, class Pos>
void replicate_runs_to(distinct_batch<Index, Pos> const& b, std::size_t const* order,
                       packed_rows out, std::size_t row_bytes, std::size_t written, cudaStream_t s,
                       int blocks_per_sm = 8) {
  launch_rows(
      b.n, row_bytes, {row_bytes, reinterpret_cast<std::uintptr_t>(out.base), out.stride_bytes},
      [&]<class Vec>(row_launch const& l) {
        using M = replicate_moves<Index, Pos>;
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
template <class Index, class Pos>
void replicate_runs(distinct_batch<Index, Pos> const& b, std::byte* out, std::size_t row_bytes,
                    cudaStream_t s, int blocks_per_sm = 8) {
  replicate_runs_to(b, static_cast<std::size_t const*>(nullptr), packed_rows{out, row_bytes},
                    row_bytes, 1, s, blocks_per_sm);
}

/**
 * The long runs' reads: for each run listed in b.long_runs (all longer than fused_copies), its
 * row rows.row(key) to the output rows (see output_row) of the run's first fused_copies
 * elements; invalid keys write zero rows and set *err. A group of `group` lanes takes a row in
 * vectors of Vec, `unroll` runs in flight (loads issued before the first store); the grid is
 * sized for the most long runs there can be and the groups past their count exit at once.
 */
template <class Vec, bool Fresh, class Rows, class Index, class Pos>
__global__ void __launch_bounds__(256)
    read_long_runs_kernel(Rows rows, distinct_batch<Index, Pos> b, std::size_t const* order,
                          packed_rows out, unsigned* err, std::size_t row_vecs, int group) {
  std::size_t const tid    = grid_thread();
  std::size_t const groups = grid_threads() / static_cast<std::size_t>(group);
  std::size_t const g      = tid / static_cast<std::size_t>(group);
  int const lane           = static_cast<int>(tid % static_cast<std::size_t>(group));
  std::size_t const runs   = *b.long_count;
  for (std::size_t r0 = g; r0 < runs; r0 += groups * unroll) {
    Vec const* src[unroll];
    std::size_t first[unroll];
    bool take[unroll];
#pragma unroll
    for (int u = 0; u < unroll; ++u) {
      std::size_t const r = r0 + static_cast<std::size_t>(u) * groups;
      src[u]              = nullptr;
      take[u]             = r < runs;
      first[u]            = take[u] ? std::size_t{b.long_runs[r]} : 0;
      if (take[u]) {
        Index const k = b.keys[first[u]];
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
      load_in_flight<Fresh>(src, c, v);
#pragma unroll
      for (int u = 0; u < unroll; ++u) {
        if (!take[u]) { continue; }
        for (std::size_t j = 0; j < fused_copies; ++j) {
          auto* const dst = reinterpret_cast<Vec*>(output_row(b, order, out, first[u] + j));
          store_vec<false>(dst + c, src[u] != nullptr ? v[u] : Vec{});
        }
      }
    }
  }
}

/// Most copies of long runs that one step of read_short_runs_kernel makes.
inline constexpr std::size_t copies_per_step = 8;

/// Replication woven into another kernel's steps (read_short_runs_kernel; the cache's staged
/// write-back): steps = max(@p others, ceil(n / copies_per_step)) steps, step j copying the
/// output rows of the sorted elements [j * per, (j + 1) * per) that lie fused_copies or more past
/// their run's first from that first's row, which must be in place. A batch without long runs
/// (b.long_count 0, or @p out.base null: nothing to copy) takes only the @p others steps.
template <class Index, class Pos>
struct woven_copies {
  std::size_t steps{};
  std::size_t per{};  // elements a step covers (at most copies_per_step; 0: no copies)

  /// Device; b.long_count must be set (plan_distinct sets it).
  __device__ woven_copies(distinct_batch<Index, Pos> const& b, packed_rows out,
                          std::size_t others) {
    bool const copy = out.base != nullptr && *b.long_count != 0;
    steps           = copy ? cuda::std::max(others, cuda::ceil_div(b.n, copies_per_step)) : others;
    per             = copy && steps != 0 ? cuda::ceil_div(b.n, steps) : 0;
  }

  /// Step @p j's copies: to[e] = the output row of an element to copy, from[e] = its run's
  /// first's (both null where there is nothing to copy), as vectors of Vec.
  template <class Vec>
  __device__ void rows(distinct_batch<Index, Pos> const& b, std::size_t const* order,
                       packed_rows out, std::size_t j, Vec const* (&from)[copies_per_step],
                       Vec* (&to)[copies_per_step]) const {
    std::size_t const e0 = j * per;
#pragma unroll
    for (std::size_t e = 0; e < copies_per_step; ++e) {
      std::size_t const i    = e0 + e;
      from[e]                = nullptr;
      to[e]                  = nullptr;
      std::size_t const head = e < per && i < b.n ? std::size_t{b.heads[i]} : i;
      if (i - head >= fused_copies) {  // its run is long, its first's row in place
        from[e] = reinterpret_cast<Vec const*>(output_row(b, order, out, head));
        to[e]   = reinterpret_cast<Vec*>(output_row(b, order, out, i));
      }
    }
  }
};

/**
 * The reads of the short runs (at most fused_copies keys) with the copies of the long runs
 * woven in: step j reads short run j's row (if run j is short) into its output rows and copies
 * the rows of elements [j * per, (j + 1) * per) that lie fused_copies or more past their run's
 * first from that first's output row (the long runs' reads must have written it). While a
 * group's host row crosses PCIe it makes its copies, so a skewed batch's device copies hide
 * behind its reads; a batch without long runs (b.long_count 0) only reads. A group of `group`
 * lanes per step, steps in ascending order across the grid. Invalid keys: zero rows, *err set.
 */
template <class Vec, bool Fresh, class Rows, class Index, class Pos>
__global__ void __launch_bounds__(256)
    read_short_runs_kernel(Rows rows, distinct_batch<Index, Pos> b, std::size_t const* order,
                           packed_rows out, unsigned* err, std::size_t row_vecs, int group) {
  std::size_t const tid    = grid_thread();
  std::size_t const groups = grid_threads() / static_cast<std::size_t>(group);
  std::size_t const g      = tid / static_cast<std::size_t>(group);
  int const lane           = static_cast<int>(tid % static_cast<std::size_t>(group));
  std::size_t const runs   = *b.runs;
  woven_copies<Index, Pos> const w{b, out, runs};
  for (std::size_t j = g; j < w.steps; j += groups) {
    Vec const* src     = nullptr;
    std::size_t first  = 0;
    std::size_t copies = 0;
    if (j < runs) {
      std::size_t const at  = b.run_begin[j];
      std::size_t const len = b.run_begin[j + 1] - at;
      if (len <= fused_copies) {
        first         = at;
        copies        = len;
        Index const k = b.keys[at];
        if (valid_index(k, rows.rows())) {
          src = reinterpret_cast<Vec const*>(rows.row(static_cast<std::size_t>(k)));
        } else if (lane == 0) {
          atomicOr(err, 1u);
        }
      }
    }
    Vec const* from[copies_per_step];
    Vec* to[copies_per_step];
    w.rows(b, order, out, j, from, to);
    for (std::size_t c = static_cast<std::size_t>(lane); c < row_vecs;
         c += static_cast<std::size_t>(group)) {
      Vec v{};
      if (src != nullptr) { v = load_vec<Fresh>(src + c); }
#pragma unroll
      for (std::size_t e = 0; e < copies_per_step; ++e) {
        if (to[e] != nullptr) { store_vec<false>(to[e] + c, load_vec<false>(from[e] + c)); }
      }
      for (std::size_t i = 0; i < copies; ++i) {
        store_vec<false>(reinterpret_cast<Vec*>(output_row(b, order, out, first + i)) + c, v);
      }
    }
  }
}

/**
 * Reads each run's row of @p b once from @p rows (ascending keys: the rows in flight sit on few
 * pages) into the output rows of the run's first elements (fused_copies of them), and copies it
 * on the device to the output rows of the run's other elements: the long runs (hot keys, listed
 * by the plan) are read first, then read_short_runs_kernel reads the short runs and makes those
 * copies meanwhile. Output rows: out.row(order[positions[i]]), or out.row(positions[i]) when
 * @p order is null, @p row_bytes each. @p fresh: ld.cv loads, for host rows other GPUs may have
 * written (each is read once here, so nothing is lost by skipping L2). Invalid keys: zero rows,
 * *err set. @p rows_alignment: the source rows' stride. @p blocks_per_sm: see plan_row_launch.
 * Copies on a second stream beside the reads hid less (bench/NOTES.md, "Host gathers: the
 * 32-bit plan").
 */
template <class Rows, class Index, class Pos, class Fresh>
void read_distinct(Rows rows, distinct_batch<Index, Pos> const& b, std::size_t const* order,
                   packed_rows out, std::size_t row_bytes, std::uintptr_t rows_alignment,
                   unsigned* err, cudaStream_t s, Fresh fresh, int blocks_per_sm = 8) {
  if (b.n == 0) { return; }
  if (std::size_t const most = b.n / (fused_copies + 1); most != 0) {  // a grid for the most
    launch_rows(
        most, row_bytes,
        {row_bytes, rows_alignment, reinterpret_cast<std::uintptr_t>(out.base), out.stride_bytes},
        [&]<class Vec>(row_launch const& l) {
          with_flag(fresh, [&](auto f) {
            read_long_runs_kernel<Vec, decltype(f)::value, Rows, Index, Pos>
                <<<l.blocks, 256, 0, s>>>(rows, b, order, out, err, l.row_vecs, l.group);
          });
        },
        blocks_per_sm);
  }
  launch_rows(
      b.n, row_bytes,
      {row_bytes, rows_alignment, reinterpret_cast<std::uintptr_t>(out.base), out.stride_bytes},
      [&]<class Vec>(row_launch const& l) {
        with_flag(fresh, [&](auto f) {
          read_short_runs_kernel<Vec, decltype(f)::value, Rows, Index, Pos>
              <<<l.blocks, 256, 0, s>>>(rows, b, order, out, err, l.row_vecs, l.group);
        });
      },
      blocks_per_sm);
}

}  // namespace wm::detail
