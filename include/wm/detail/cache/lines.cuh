// SPDX-License-Identifier: Apache-2.0
// A cache's lines and the kernels that move rows between them and the table: the storage of one
// rank's cache (set metadata, line payloads, device statistics), the admission kernel behind
// gather and prefetch, the write-back kernel behind flush and invalidate, and the row locator
// through which the owner-side update finds a row in its line or in the table.
//
// Line payload: line (s, w) holds, in slot s * 32 + w, the weight row (dim values of T), every
// optimizer state of that row (Optimizer::states x dim floats) and Adam's per-row step, so a hit
// never crosses PCIe and a cached row is updated without touching the table.
//
// Concurrency: one warp per distinct key of a batch. Distinct keys can share a set, so a warp
// takes the set's lock word (set_header::lock) before it probes, and keeps it until the row is
// in its line and copied out: lane 0 spins with atomicCAS and __nanosleep back-off (acquire),
// the warp works, lane 0 releases (release store). Staged calls (one-rank gathers, which run
// alone and first protect every cached key of the batch) copy the row out after the release:
// the batch rule keeps the line. Locks rather than grouping keys by set: the
// batch is already sorted by key for the distinct-row plan (detail/rows/distinct.cuh); a
// second sort by set would cost a full radix sort per gather, while with ~10 distinct keys per
// set a lock is rarely contended. Independent thread scheduling lets the spinning lane wait
// while another warp holds the lock; a warp holds one lock at a time, so nothing can deadlock.
//
// Batches (set.hpp): each admission call (a gather or a prefetch) takes the next epoch from a
// device counter (bumped by a one-thread kernel before the admission kernel, so a call captured
// in a CUDA graph gets a new epoch at every replay), and its misses never evict a line the same
// call has hit or admitted; a key whose set has all 32 ways in use by the call bypasses the
// cache: its weight row goes from the table straight to the output, and the update, a probe,
// finds it in the table (write-around). Two calls beside each other (the engine's reads on two
// streams) have different epochs and may reset each other's masks in a set they share: that
// costs replacement quality only, never correctness (a row is copied out under its set's lock).
#pragma once

#include <wm/cache.hpp>
#include <wm/detail/base/cuda.cuh>
#include <wm/detail/base/resources.hpp>
#include <wm/detail/base/workspace.cuh>
#include <wm/detail/cache/kernels.cuh>
#include <wm/detail/cache/plan.hpp>
#include <wm/detail/cache/set.hpp>
#include <wm/detail/rows/distinct.cuh>
#include <wm/detail/rows/views.cuh>
#include <wm/detail/tensor/table_rows.cuh>

#include <cub/device/device_radix_sort.cuh>
#include <cuda/atomic>
#include <cuda/cmath>
#include <cuda/std/bit>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>

namespace wm::detail::cache {

/// One staged gather's counts (device, zeroed by the next call's first kernel, which publishes
/// them to host-mapped memory): what the host reads to choose the next call's path.
struct call_counters {
  unsigned long long requests{};
  unsigned long long misses{};
  unsigned long long bypasses{};
};

/// One rank's lines as kernels see them (trivially copyable).
template <class T, class Impl>
struct lines_ref {
  cache_ref<Impl> meta;        ///< tags, replacement states, set headers
  T* w{};                      ///< lines x dim weights
  float* st{};                 ///< lines x st_cols optimizer states (null: none)
  std::int64_t* steps{};       ///< lines per-row steps (null: none)
  std::size_t dim{};           ///< values per weight row
  std::size_t st_cols{};       ///< state floats per row
  device_statistics* stats{};  ///< the counters
  std::uint32_t* epoch{};      ///< the batch counter (the current admission call's epoch)
  /// Staged write-backs (null: dirty victims are written back at once, inside the set's lock):
  /// room for `stage_rows` payloads, their old keys and the count of those taken.
  T* stage_w{};
  float* stage_st{};
  std::int64_t* stage_steps{};
  std::uint32_t* stage_keys{};
  unsigned* stage_count{};
  std::size_t stage_rows{};
  /// This call's counts for the next call's choice of path (staged gathers only; else null).
  call_counters* call{};

  /// The payload of staging slot @p i.
  [[nodiscard]] __device__ row_place<T> staged(std::size_t i) const noexcept {
    return {stage_w + i * dim, stage_st != nullptr ? stage_st + i * st_cols : nullptr,
            stage_steps != nullptr ? stage_steps + i : nullptr};
  }

  /// The payload of data slot @p slot.
  [[nodiscard]] __device__ row_place<T> line(std::size_t slot) const noexcept {
    return {w + slot * dim, st != nullptr ? st + slot * st_cols : nullptr,
            steps != nullptr ? steps + slot : nullptr};
  }
  /// Bytes of one row's payload (weight, states, step).
  [[nodiscard]] WM_HOST_DEVICE std::size_t payload_bytes() const noexcept {
    return dim * sizeof(T) + st_cols * sizeof(float) +
           (steps != nullptr ? sizeof(std::int64_t) : 0);
  }
};

/// A row found by the update: in a line (then `dirty` names the set's dirty mask) or the table.
template <class T>
struct cached_place : row_place<T> {
  std::uint32_t* dirty{};  ///< the set's dirty mask (null: the row is in the table)
  std::uint32_t bit{};     ///< the line's bit in it
};

/**
 * The update's row locator with a cache: a row held by a line is read and written there (and
 * the line marked dirty); any other row in the table (write-around: the update admits nothing).
 * A probe only: the replacement state is the gather's business.
 */
template <class T, class Impl>
struct line_locator {
  using place_type = cached_place<T>;

  table_rows<T> table;
  lines_ref<T, Impl> lines;

  [[nodiscard]] __device__ place_type locate(std::uint32_t key) const noexcept {
    if (lines.meta.sets != 0) {
      std::uint32_t const s = lines.meta.set_index(key);
      auto const set        = lines.meta.set(s);
      int const way         = set.find(key);
      if (way != no_way) {
        place_type p{lines.line(cache_ref<Impl>::slot(s, way))};
        p.dirty = &set.header->dirty;
        p.bit   = 1u << way;
        return p;
      }
    }
    return place_type{table.locate(key)};
  }
  /// After the update wrote @p p: its line (if any) differs from the table now.
  __device__ void written(place_type const& p) const noexcept {
    if (p.dirty != nullptr) { atomicOr(p.dirty, p.bit); }
  }
};

// ---- kernels ----------------------------------------------------------------------------------

inline constexpr int line_block = 256;  ///< threads per block of the line kernels (8 warps)

/// Copies @p bytes (a multiple of sizeof(W)) from @p src to @p dst with the warp's lanes.
template <class W>
__device__ void warp_copy(void* dst, void const* src, std::size_t bytes, unsigned lane) noexcept {
  auto* d       = static_cast<W*>(dst);
  auto const* q = static_cast<W const*>(src);
  for (std::size_t i = lane; i < bytes / sizeof(W); i += ways) { d[i] = q[i]; }
}

/// Copies one row of @p bytes at @p src to the @p copies rows `dst(0)`, ..., `dst(copies - 1)`
/// with the warp: each lane loads its vectors of the row once and stores them to every copy.
template <class W, class Dst>
__device__ void warp_copy_to(Dst const& dst, std::size_t copies, void const* src, std::size_t bytes,
                             unsigned lane) noexcept {
  auto const* q = static_cast<W const*>(src);
  for (std::size_t i = lane; i < bytes / sizeof(W); i += ways) {
    W const v = q[i];
    for (std::size_t k = 0; k < copies; ++k) { reinterpret_cast<W*>(dst(k))[i] = v; }
  }
}

/// Vectors per lane a warp_move loads before it stores (one round for a 128-float Adam row).
inline constexpr int move_depth = 8;

/// Moves one row's payload (weight, states, step) with the warp. Each lane issues the loads of
/// up to move_depth vectors of the weight and the states together (and lane 0 the step's) before
/// any of its stores, so a row read over PCIe costs one round trip rather than one per part.
template <class W, class T>
__device__ void warp_move(row_place<T> const& to, row_place<T> const& from, std::size_t dim,
                          std::size_t st_cols, unsigned lane) noexcept {
  std::size_t const nw    = dim * sizeof(T) / sizeof(W);
  std::size_t const ns    = from.st != nullptr ? st_cols * sizeof(float) / sizeof(W) : 0;
  std::size_t const total = nw + ns;
  auto const* const qw    = reinterpret_cast<W const*>(from.w);
  auto const* const qs    = reinterpret_cast<W const*>(from.st);
  auto* const dw          = reinterpret_cast<W*>(to.w);
  auto* const ds          = reinterpret_cast<W*>(to.st);
  bool const step         = from.step != nullptr && lane == 0;
  std::int64_t step_value = 0;
  if (step) { step_value = *from.step; }
  for (std::size_t base = 0; base < total; base += std::size_t{move_depth} * ways) {
    W v[move_depth];
#pragma unroll
    for (int j = 0; j < move_depth; ++j) {
      std::size_t const i = base + static_cast<std::size_t>(j) * ways + lane;
      if (i < total) { v[j] = i < nw ? qw[i] : qs[i - nw]; }
    }
#pragma unroll
    for (int j = 0; j < move_depth; ++j) {
      std::size_t const i = base + static_cast<std::size_t>(j) * ways + lane;
      if (i < nw) {
        dw[i] = v[j];
      } else if (i < total) {
        ds[i - nw] = v[j];
      }
    }
  }
  if (step) { *to.step = step_value; }
}

/// Takes set @p h's lock for the warp: lane 0 acquires the lock word, then every lane fences
/// (acquire), so the last holder's writes, by any of its lanes, are visible to every lane.
__device__ inline void lock_set(set_header* h, unsigned lane) noexcept {
  if (lane == 0) {
    cuda::atomic_ref<std::uint32_t, cuda::thread_scope_device> word{h->lock};
    unsigned wait          = 32;
    std::uint32_t expected = 0;
    while (!word.compare_exchange_weak(expected, 1u, cuda::memory_order_acquire,
                                       cuda::memory_order_relaxed)) {
      expected = 0;
      __nanosleep(wait);
      wait = wait < 1024 ? wait * 2 : wait;
    }
  }
  __syncwarp();
  cuda::atomic_thread_fence(cuda::memory_order_acquire, cuda::thread_scope_device);
}

/// Releases set @p h's lock: every lane fences (release) its writes to the set and the line,
/// then lane 0 stores the lock word with release order.
__device__ inline void unlock_set(set_header* h, unsigned lane) noexcept {
  cuda::atomic_thread_fence(cuda::memory_order_release, cuda::thread_scope_device);
  __syncwarp();
  if (lane == 0) {
    cuda::atomic_ref<std::uint32_t, cuda::thread_scope_device> word{h->lock};
    word.store(0u, cuda::memory_order_release);
  }
  __syncwarp();
}

/// Advances the batch counter: the next admission call's epoch (atomic: calls on two streams
/// may bump it at once).
template <class Counter>
__global__ void next_epoch_kernel(Counter* epoch) {
  atomicAdd(epoch, Counter{1});
}

/// The first kernel of a staged gather: shows the last staged gather's counts (if it made
/// requests) in host-mapped @p shown, zeroes them (and @p miss_count when not null) and advances
/// the batch counter.
template <class Counter>
__global__ void begin_staged_call_kernel(Counter* epoch, call_counters* call, call_counters* shown,
                                         unsigned long long* miss_count) {
  call_counters const last = *call;
  if (last.requests != 0) {
    auto volatile* const h = shown;
    h->misses              = last.misses;
    h->bypasses            = last.bypasses;
    h->requests            = last.requests;
    __threadfence_system();
  }
  *call = call_counters{};
  if (miss_count != nullptr) { *miss_count = 0; }
  atomicAdd(epoch, Counter{1});
}

/**
 * Before a staged admission call: every distinct key of batch @p b already cached gets its
 * way's bit in the set's batch mask for this call's epoch (one 64-bit CAS on the adjacent
 * batch and epoch words), so no admission of the call can evict a row the call still reads.
 * One thread per distinct key.
 */
template <class T, class Impl, class Index>
__global__ void protect_kernel(lines_ref<T, Impl> c, std::size_t rows, distinct_batch<Index> b) {
  static_assert(offsetof(set_header, epoch) == offsetof(set_header, batch) + 4);
  std::size_t const runs    = *b.runs;
  std::uint32_t const epoch = *c.epoch;
  for (std::size_t r = grid_thread(); r < runs; r += grid_threads()) {
    Index const key = b.keys[b.run_begin[r]];
    if (!valid_index(key, rows)) { continue; }
    auto const k   = static_cast<std::uint32_t>(key);
    auto const set = c.meta.set(c.meta.set_index(k));
    int const way  = set.find(k);
    if (way == no_way) { continue; }
    auto* const word        = reinterpret_cast<unsigned long long*>(&set.header->batch);
    unsigned long long seen = *reinterpret_cast<unsigned long long volatile*>(word);
    for (;;) {
      auto const mask = static_cast<std::uint32_t>(seen);
      auto const at   = static_cast<std::uint32_t>(seen >> 32);
      unsigned long long const next =
          (static_cast<unsigned long long>(epoch) << 32) |
          ((at == epoch ? mask : 0u) | (1u << static_cast<unsigned>(way)));
      if (next == seen) { break; }
      unsigned long long const prev = atomicCAS(word, seen, next);
      if (prev == seen) { break; }
      seen = prev;
    }
  }
}

/**
 * The staged write-backs, in ascending key order (@p keys sorted, @p slots their staging slots;
 * entries at or past *c.stage_count, or past stage_rows, hold no row), with the replication of
 * batch @p b's long runs woven in. One warp per step: step j writes victim j back, and, with an
 * output (@p out.base not null) and runs longer than fused_copies in the batch, copies the output
 * rows (output_row) of the sorted elements [j * per, (j + 1) * per) that lie fused_copies or more
 * past their run's first from that first's row (the admission wrote it). The copies run while
 * the victims' rows leave over the link, as read_short_runs_kernel's beside its reads.
 */
template <class W, class T, class Impl, class Index>
__global__ void __launch_bounds__(line_block)
    staged_write_back_kernel(lines_ref<T, Impl> c, table_rows<T> table, std::uint32_t const* keys,
                             unsigned const* slots, distinct_batch<Index> b,
                             std::size_t const* order, packed_rows out) {
  unsigned const lane      = threadIdx.x % ways;
  std::size_t const warp   = grid_thread() / ways;
  std::size_t const warps  = grid_threads() / ways;
  std::size_t const staged = *c.stage_count;
  std::size_t const n      = staged < c.stage_rows ? staged : c.stage_rows;
  woven_copies<Index, std::size_t> const wc{b, out, n};
  std::size_t const vecs = c.dim * sizeof(T) / sizeof(W);
  for (std::size_t j = warp; j < wc.steps; j += warps) {
    if (j < n) { warp_move<W>(table.locate(keys[j]), c.staged(slots[j]), c.dim, c.st_cols, lane); }
    W const* from[copies_per_step];
    W* to[copies_per_step];
    wc.rows(b, order, out, j, from, to);
    for (std::size_t v = lane; v < vecs; v += ways) {
#pragma unroll
      for (std::size_t e = 0; e < copies_per_step; ++e) {
        if (to[e] != nullptr) { to[e][v] = from[e][v]; }
      }
    }
  }
}

/**
 * One warp per distinct key of batch @p b (grid-stride over the runs; the run count is read on
 * the device), all of one epoch (*c.epoch, see batch_access): a hit touches the line; a miss
 * admits the key (write-allocate) into a way this batch has not used, writes a dirty victim back
 * to its table row, and loads the row's payload from the table into the line; a miss whose set
 * has all 32 ways in use by this batch bypasses the cache (nothing admitted; with an output the
 * weight row is read from the table). With an output (@p out.base not null), the row is copied to
 * the output rows (output_row: out row order[position], or position when @p order is null) of
 * the run's first min(length, fused_copies) elements; the rest are copied from there after the
 * kernel (staged calls: by staged_write_back_kernel, else by replicate_runs_to). An
 * invalid key (negative or not below @p rows) gives zero output rows and sets *err; it counts as
 * a miss and admits nothing. With @p count_requests (gather) requests, distinct keys, hits, misses
 * and bypasses are counted (a run counts its length, a bypass one per key); evictions,
 * write-backs and bytes from the table always (prefetch too).
 */
template <class W, class T, class Impl, class Index>
__global__ void __launch_bounds__(line_block)
    admit_kernel(lines_ref<T, Impl> c, table_rows<T> table, std::size_t rows,
                 distinct_batch<Index> b, std::size_t const* order, packed_rows out,
                 bool count_requests, unsigned* err) {
  unsigned const lane         = threadIdx.x % ways;
  std::size_t const warp      = grid_thread() / ways;
  std::size_t const n_warps   = grid_threads() / ways;
  std::size_t const runs      = *b.runs;
  std::size_t const row_bytes = c.dim * sizeof(T);
  std::uint32_t const epoch   = *c.epoch;
  bool const staged           = c.stage_count != nullptr;
  unsigned long long requests = 0, distinct = 0, hits = 0, evictions = 0, write_backs = 0,
                     loaded = 0, bypasses = 0, bypass_rows = 0;
  for (std::size_t r = warp; r < runs; r += n_warps) {  // the same trip count in every lane
    std::size_t const begin  = b.run_begin[r];
    std::size_t const len    = b.run_begin[r + 1] - begin;
    Index const key          = b.keys[begin];
    std::size_t const copies = out.base != nullptr ? (len < fused_copies ? len : fused_copies) : 0;
    requests += len;
    ++distinct;
    if (!valid_index(key, rows)) {
      for (std::size_t q = 0; q < copies; ++q) {
        auto* const dst = reinterpret_cast<W*>(output_row(b, order, out, begin + q));
        for (std::size_t i = lane; i < row_bytes / sizeof(W); i += ways) { dst[i] = W{}; }
      }
      if (lane == 0) { atomicOr(err, 1u); }
      continue;
    }
    auto const k          = static_cast<std::uint32_t>(key);
    std::uint32_t const s = c.meta.set_index(k);
    auto const set        = c.meta.set(s);
    lock_set(set.header, lane);
    access_result const a = warp_batch_access(set, k, false, epoch, lane);
    if (a.hit) {
      hits += len;
    } else if (!a.bypassed) {
      auto const line = c.line(cache_ref<Impl>::slot(s, a.way));
      if (a.admitted.evicted) { ++evictions; }
      if (a.admitted.write_back) {
        // Staged: the victim goes to a device slot now and to the table after this kernel, in
        // ascending key order (scattered host writes cost far more than their bytes); the
        // protect pass made sure no key of this batch is a victim, so nothing here reads the
        // table row before it is written. Without room: to the table at once.
        unsigned slot = 0;
        if (c.stage_count != nullptr && lane == 0) { slot = atomicAdd(c.stage_count, 1u); }
        slot = __shfl_sync(full_warp, slot, 0);
        if (c.stage_count != nullptr && slot < c.stage_rows) {
          warp_move<W>(c.staged(slot), line, c.dim, c.st_cols, lane);
          if (lane == 0) { c.stage_keys[slot] = a.admitted.old_key; }
        } else {
          warp_move<W>(table.locate(a.admitted.old_key), line, c.dim, c.st_cols, lane);
        }
        ++write_backs;
        __syncwarp();
      }
      warp_move<W>(line, table.locate(k), c.dim, c.st_cols, lane);
      loaded += c.payload_bytes();
      __syncwarp();
    }
    auto const to      = [&](std::size_t q) { return output_row(b, order, out, begin + q); };
    T const* const src = a.bypassed ? nullptr : c.line(cache_ref<Impl>::slot(s, a.way)).w;
    // Staged calls run alone and protected every cached key of the batch; the batch rule keeps
    // the line this warp hit or admitted: its row may be copied out after the lock is gone.
    if (src != nullptr && !staged) { warp_copy_to<W>(to, copies, src, row_bytes, lane); }
    unlock_set(set.header, lane);
    if (src != nullptr && staged) { warp_copy_to<W>(to, copies, src, row_bytes, lane); }
    // A bypassed row is in no line (it missed; a call beside this one that admits it meanwhile
    // loads it clean): the table holds it, and the lock is not needed to read it. It is read over
    // PCIe once, into the run's first output row, and copied from there to the others.
    if (a.bypassed) {
      if (count_requests) { ++bypasses; }
      if (copies != 0) {
        void* const first = output_row(b, order, out, begin);
        warp_copy<W>(first, table.locate(k).w, row_bytes, lane);
        loaded += row_bytes;
        ++bypass_rows;
        __syncwarp();
        for (std::size_t q = 1; q < copies; ++q) {
          warp_copy<W>(output_row(b, order, out, begin + q), first, row_bytes, lane);
        }
      }
    }
  }
  if (lane == 0 && c.call != nullptr && count_requests && requests != 0) {
    atomicAdd(&c.call->requests, requests);
    atomicAdd(&c.call->misses, requests - hits);
    if (bypasses != 0) { atomicAdd(&c.call->bypasses, bypasses); }
  }
  if (lane == 0 && c.stats != nullptr) {
    if (count_requests && requests != 0) {
      atomicAdd(&c.stats->requests, requests);
      atomicAdd(&c.stats->distinct_keys, distinct);
      atomicAdd(&c.stats->hits, hits);
      atomicAdd(&c.stats->misses, requests - hits);
    }
    if (count_requests && bypasses != 0) { atomicAdd(&c.stats->bypasses, bypasses); }
    if (evictions != 0) { atomicAdd(&c.stats->evictions, evictions); }
    if (write_backs != 0) { atomicAdd(&c.stats->write_backs, write_backs); }
    if (loaded != 0) { atomicAdd(&c.stats->bytes_from_host, loaded); }
    if (bypass_rows != 0) { atomicAdd(&c.stats->bypass_rows, bypass_rows); }
  }
}

/// One warp per set: every dirty line is written to its table row and cleaned; with @p drop
/// every line is invalidated as well.
template <class W, class T, class Impl>
__global__ void __launch_bounds__(line_block)
    write_back_kernel(lines_ref<T, Impl> c, table_rows<T> table, bool drop) {
  unsigned const lane        = threadIdx.x % ways;
  std::size_t const warp     = grid_thread() / ways;
  std::size_t const n_warps  = grid_threads() / ways;
  unsigned long long written = 0;
  for (std::size_t s = warp; s < c.meta.sets; s += n_warps) {
    auto const set      = c.meta.set(static_cast<std::uint32_t>(s));
    std::uint32_t dirty = set.header->dirty;
    written += static_cast<unsigned long long>(count_ways(dirty));
    while (dirty != 0) {
      int const w = lowest_way(dirty);
      dirty &= dirty - 1;
      warp_move<W>(table.locate(set.tags[w]),
                   c.line(cache_ref<Impl>::slot(static_cast<std::uint32_t>(s), w)), c.dim,
                   c.st_cols, lane);
    }
    __syncwarp();
    if (lane == 0) {
      if (drop) {
        (void)set.invalidate();
      } else {
        (void)set.flush();
      }
    }
    __syncwarp();
  }
  if (lane == 0 && written != 0 && c.stats != nullptr) {
    atomicAdd(&c.stats->write_backs, written);
  }
}

// ---- the hit-first path: staged gathers with few misses ---------------------------------------
//
// A staged gather whose previous calls missed rarely skips the distinct-key plan: one pass probes
// every occurrence without locks (a staged call runs alone, and nothing changes a line while the
// pass runs), copies each hit row straight from its line and joins it to the batch (the first
// occurrence to set the way's batch bit makes the replacement update, so each key is touched once
// per batch, as in the planned path); the misses go to a list, which a second kernel admits under
// the sets' locks in the list's order (each miss is read from the table once per key: a later
// occurrence finds the line its first occurrence admitted). Dirty victims are written back at
// once: with few misses there are few, and their order costs little.

/// Positions of a hit-first pass's misses (bit 63: a hit whose replacement update needs the set's
/// lock, a set-wide decay) and their count.
struct miss_list {
  std::uint64_t* entries{};
  unsigned long long* count{};
  /// The keys that bypassed the cache so far in this call (open addressing, empty: ~0; `memo`
  /// entries, a power of two), so that each counts once.
  unsigned long long* memo{};
  std::size_t memo_size{};
};
inline constexpr unsigned long long memo_empty = ~0ull;

/// Whether this is the first time @p key bypasses the cache in this call (one thread). Keys past
/// a full memo count again.
__device__ inline bool first_bypass(miss_list const& m, std::uint32_t key) noexcept {
  std::size_t const mask = m.memo_size - 1;
  std::size_t h          = mix32(key) & mask;
  for (std::size_t probe = 0; probe < m.memo_size; ++probe, h = (h + 1) & mask) {
    unsigned long long const prev = atomicCAS(&m.memo[h], memo_empty, key);
    if (prev == memo_empty) { return true; }
    if (prev == key) { return false; }
  }
  return true;
}
inline constexpr std::uint64_t deferred_touch = std::uint64_t{1} << 63;

/// The replacement update of a hit on @p way without the set's lock, by one thread, in a
/// hit-first pass: only the batch's first hit of a way updates it, so no other thread writes this
/// way's state meanwhile (others may update other ways of the set). False when the update needs a
/// set-wide decay: the caller leaves it to the locked kernel.
template <class Impl>
__device__ bool touch_unlocked(set_ref<Impl> const& s, int way) noexcept {
  if constexpr (std::is_same_v<Impl, lru_impl>) {
    // At most 32 stamps per set and batch: far enough below the wrap, the clock cannot reach it.
    cuda::atomic_ref<std::uint32_t, cuda::thread_scope_device> clock{s.header->clock};
    if (clock.load(cuda::memory_order_relaxed) >= 0xffffffffu - 2u * ways) { return false; }
    s.states[way] = clock.fetch_add(1u, cuda::memory_order_relaxed) + 1u;
    return true;
  } else {
    static_assert(std::is_same_v<Impl, lfu_impl>, "touch_unlocked: an unknown replacement policy");
    auto const state = s.states[way];
    if (Impl::needs_decay(state, *s.header)) { return false; }
    s.states[way] = static_cast<typename Impl::state_type>(state + 1);
    return true;
  }
}

/// Sets way @p way's bit in the set's batch mask for @p epoch (one 64-bit CAS on the adjacent
/// batch and epoch words; a mask of another epoch is reset first). True for the thread that set
/// it, false when it was set already.
__device__ inline bool join_batch(set_header* h, int way, std::uint32_t epoch) noexcept {
  static_assert(offsetof(set_header, epoch) == offsetof(set_header, batch) + 4);
  auto* const word        = reinterpret_cast<unsigned long long*>(&h->batch);
  std::uint32_t const bit = 1u << static_cast<unsigned>(way);
  unsigned long long seen = *reinterpret_cast<unsigned long long volatile*>(word);
  for (;;) {
    auto const at            = static_cast<std::uint32_t>(seen >> 32);
    std::uint32_t const mask = at == epoch ? static_cast<std::uint32_t>(seen) : 0u;
    if ((mask & bit) != 0) { return false; }
    unsigned long long const next = (static_cast<unsigned long long>(epoch) << 32) | (mask | bit);
    unsigned long long const prev = atomicCAS(word, seen, next);
    if (prev == seen) { return true; }
    seen = prev;
  }
}

/**
 * The hit-first pass over the @p n keys of a staged gather (output row i for key i): a warp takes
 * 32 keys, one per lane, each lane reading its key's set's 32 tags, joins the hits to the batch
 * (the first to join a way updates its replacement state, or defers that to the locked kernel),
 * copies the hit rows from their lines (eight in flight per lane), and appends the misses (and
 * invalid keys, and deferred updates) to @p m. Counts requests, hits and the distinct hit keys.
 */
template <class W, class T, class Impl, class Index>
__global__ void __launch_bounds__(line_block)
    hit_first_kernel(lines_ref<T, Impl> c, std::size_t rows, Index const* keys, std::size_t n,
                     packed_rows out, miss_list m) {
  constexpr std::size_t none  = ~std::size_t{0};
  constexpr int in_flight     = 8;
  unsigned const lane         = threadIdx.x % ways;
  std::size_t const warp      = grid_thread() / ways;
  std::size_t const n_warps   = grid_threads() / ways;
  std::uint32_t const epoch   = *c.epoch;
  std::size_t const vecs      = c.dim * sizeof(T) / sizeof(W);
  unsigned long long requests = 0, hits = 0, distinct = 0;
  for (std::size_t i = grid_thread(); i < m.memo_size; i += grid_threads()) {
    m.memo[i] = memo_empty;  // the miss kernel, after this one, fills it
  }
  for (std::size_t base = warp * ways; base < n; base += n_warps * ways) {
    std::size_t const i   = base + lane;
    bool const live       = i < n;
    Index const key       = live ? keys[i] : Index{};
    bool const valid      = live && valid_index(key, rows);
    auto const k          = static_cast<std::uint32_t>(key);
    std::uint32_t const s = valid ? c.meta.set_index(k) : 0u;
    // Each lane probes its own key: the set's 32 tags in eight 16-byte loads, all issued before
    // any compare (one round trip for the warp's 32 keys).
    int way = no_way;
    if (valid) {
      auto const set      = c.meta.set(s);
      auto const* const q = reinterpret_cast<uint4 const*>(set.tags);
      uint4 tags[ways / 4];
#pragma unroll
      for (int j = 0; j < ways / 4; ++j) { tags[j] = q[j]; }
      std::uint32_t const live_ways = set.header->valid;
#pragma unroll
      for (int j = 0; j < ways / 4; ++j) {
        std::uint32_t const t4[4] = {tags[j].x, tags[j].y, tags[j].z, tags[j].w};
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          int const w = 4 * j + u;
          if (t4[u] == k && ((live_ways >> w) & 1u) != 0) { way = w; }
        }
      }
    }
    bool const hit = way != no_way;
    bool deferred  = false;
    if (hit) {
      auto const set = c.meta.set(s);
      if (join_batch(set.header, way, epoch)) {
        ++distinct;
        deferred = !touch_unlocked(set, way);
      }
    }
    requests += live ? 1 : 0;
    hits += hit ? 1 : 0;
    bool const listed     = live && (!hit || deferred);
    std::uint32_t const b = __ballot_sync(full_warp, listed);
    if (b != 0) {
      unsigned long long at = 0;
      if (lane == 0) { at = atomicAdd(m.count, static_cast<unsigned long long>(__popc(b))); }
      at = __shfl_sync(full_warp, at, 0);
      if (listed) {
        m.entries[at + static_cast<unsigned>(__popc(b & ((1u << lane) - 1u)))] =
            static_cast<std::uint64_t>(i) | (deferred ? deferred_touch : 0);
      }
    }
    // The hit rows, from their lines: each lane loads its vectors of eight rows, then stores them.
    std::size_t const slot = hit ? cache_ref<Impl>::slot(s, way) : none;
    for (int t = 0; t < ways; t += in_flight) {
      std::size_t from[in_flight];
#pragma unroll
      for (int u = 0; u < in_flight; ++u) {
        from[u] = static_cast<std::size_t>(__shfl_sync(full_warp, slot, t + u));
      }
      for (std::size_t v = lane; v < vecs; v += ways) {
        W a[in_flight];
#pragma unroll
        for (int u = 0; u < in_flight; ++u) {
          if (from[u] != none) { a[u] = reinterpret_cast<W const*>(c.w + from[u] * c.dim)[v]; }
        }
#pragma unroll
        for (int u = 0; u < in_flight; ++u) {
          if (from[u] != none) {
            reinterpret_cast<W*>(out.row(base + static_cast<std::size_t>(t + u)))[v] = a[u];
          }
        }
      }
    }
  }
  requests = __reduce_add_sync(full_warp, static_cast<unsigned>(requests));
  hits     = __reduce_add_sync(full_warp, static_cast<unsigned>(hits));
  distinct = __reduce_add_sync(full_warp, static_cast<unsigned>(distinct));
  if (lane == 0 && requests != 0) {
    atomicAdd(&c.stats->requests, requests);
    atomicAdd(&c.stats->hits, hits);
    if (distinct != 0) { atomicAdd(&c.stats->distinct_keys, distinct); }
    atomicAdd(&c.call->requests, requests);
  }
}

/**
 * The misses of a hit-first pass (@p m), one warp per entry under its set's lock: a deferred entry
 * makes its hit's replacement update (with the decay); a miss admits its key (write-allocate,
 * dirty victim written back at once; a later miss of the same key finds the line) or bypasses the
 * cache when the batch holds all 32 ways, and copies the row to output row i. An invalid key gives
 * a zero row and sets *err. Counts misses, distinct keys (one per admitted key; a bypassed or
 * invalid key once per occurrence), evictions, write-backs, bytes from the table and bypasses.
 */
template <class W, class T, class Impl, class Index>
__global__ void __launch_bounds__(line_block)
    miss_kernel(lines_ref<T, Impl> c, table_rows<T> table, std::size_t rows, Index const* keys,
                packed_rows out, miss_list m, unsigned* err) {
  unsigned const lane         = threadIdx.x % ways;
  std::size_t const warp      = grid_thread() / ways;
  std::size_t const n_warps   = grid_threads() / ways;
  std::size_t const count     = *m.count;
  std::size_t const row_bytes = c.dim * sizeof(T);
  std::uint32_t const epoch   = *c.epoch;
  unsigned long long misses = 0, distinct = 0, evictions = 0, write_backs = 0, loaded = 0,
                     bypasses = 0, bypass_rows = 0;
  for (std::size_t e = warp; e < count; e += n_warps) {  // the same trip count in every lane
    std::uint64_t const entry = m.entries[e];
    std::size_t const i       = static_cast<std::size_t>(entry & ~deferred_touch);
    Index const key           = keys[i];
    void* const dst           = out.row(i);
    if ((entry & deferred_touch) == 0) {
      ++misses;
      if (!valid_index(key, rows)) {
        ++distinct;
        for (std::size_t v = lane; v < row_bytes / sizeof(W); v += ways) {
          static_cast<W*>(dst)[v] = W{};
        }
        if (lane == 0) { atomicOr(err, 1u); }
        continue;
      }
    }
    auto const k          = static_cast<std::uint32_t>(key);
    std::uint32_t const s = c.meta.set_index(k);
    auto const set        = c.meta.set(s);
    lock_set(set.header, lane);
    if ((entry & deferred_touch) != 0) {  // its row is in place; the batch keeps its line
      warp_touch(set, warp_find(set, k, lane), lane);
      unlock_set(set.header, lane);
      continue;
    }
    warp_begin_batch(set, epoch, lane);
    int way       = warp_find(set, k, lane);  // found: admitted by an earlier miss of the batch
    bool bypassed = false;
    if (way == no_way) {
      admission const a = warp_admit(set, k, lane, set.header->batch);
      way               = a.way;
      bypassed          = way == no_way;
      if (bypassed) {  // distinct the first time only
        int first = 0;
        if (lane == 0) { first = first_bypass(m, k) ? 1 : 0; }
        if (__shfl_sync(full_warp, first, 0) != 0) {
          ++distinct;
          ++bypasses;
        }
      } else {
        ++distinct;
        if (lane == 0) { set.header->batch |= 1u << static_cast<unsigned>(way); }
        auto const line = c.line(cache_ref<Impl>::slot(s, way));
        if (a.evicted) { ++evictions; }
        if (a.write_back) {
          warp_move<W>(table.locate(a.old_key), line, c.dim, c.st_cols, lane);
          ++write_backs;
          __syncwarp();
        }
        warp_move<W>(line, table.locate(k), c.dim, c.st_cols, lane);
        loaded += c.payload_bytes();
        __syncwarp();
      }
    }
    unlock_set(set.header, lane);
    if (bypassed) {
      warp_copy<W>(dst, table.locate(k).w, row_bytes, lane);
      loaded += row_bytes;  // once per occurrence: no other warp's copy to take it from
      ++bypass_rows;
    } else {
      warp_copy<W>(dst, c.line(cache_ref<Impl>::slot(s, way)).w, row_bytes, lane);
    }
  }
  if (lane == 0) {
    if (misses != 0) {
      atomicAdd(&c.stats->misses, misses);
      atomicAdd(&c.call->misses, misses);
    }
    if (distinct != 0) { atomicAdd(&c.stats->distinct_keys, distinct); }
    if (evictions != 0) { atomicAdd(&c.stats->evictions, evictions); }
    if (write_backs != 0) { atomicAdd(&c.stats->write_backs, write_backs); }
    if (loaded != 0) { atomicAdd(&c.stats->bytes_from_host, loaded); }
    if (bypass_rows != 0) { atomicAdd(&c.stats->bypass_rows, bypass_rows); }
    if (bypasses != 0) {
      atomicAdd(&c.stats->bypasses, bypasses);
      atomicAdd(&c.call->bypasses, bypasses);
    }
  }
}

// ---- the storage --------------------------------------------------------------------------------

/// The most victims one admission call stages (their payloads take device memory beside the
/// lines; past this many, victims are written back at once, inside their set's lock).
inline constexpr std::size_t max_staged = std::size_t{1} << 20;

/// A staged gather takes the hit-first path after calls that missed at most one key in this
/// many (bench/NOTES.md: where the unplanned misses start to cost more than the plan).
inline constexpr unsigned long long hit_first_miss_share = 32;
/// Distinct bypassed keys a hit-first gather counts exactly (its memo has room for twice as many
/// keys, up to twice the batch).
inline constexpr std::size_t hit_first_memo_keys = std::size_t{1} << 16;

/// slots[i] = i; keys[i] = the sentinel 2^32 - 1 for the slots at or past *count (not taken).
template <class Key>
__global__ void fill_sentinels_kernel(Key* keys, unsigned const* count, std::size_t n,
                                      unsigned* slots) {
  std::size_t const taken = *count;
  for (std::size_t i = grid_thread(); i < n; i += grid_threads()) {
    slots[i] = static_cast<unsigned>(i);
    if (i >= taken) { keys[i] = ~Key{}; }
  }
}

/**
 * One rank's cache: set metadata sized by plan_cache from the rank's rows and the ratio, the
 * line payloads, the device statistics and the workspace of the distinct-key plan. Device
 * memory, RAII; move-only. Calls on one cache are ordered by the caller (one stream, or events):
 * they share the lines and the workspace.
 */
template <class T, class Impl>
class line_storage {
 public:
  using state_type = typename Impl::state_type;

  /**
   * @param rows this rank's rows; @param ratio cache_options::ratio; @param seed the hash seed
   * @param dim values per row; @param st_cols optimizer state floats per row (0: none)
   * @param steps whether lines keep the per-row step
   * @throw wm::logic_error for a ratio outside (0, 1] or more than 2^32 rows
   */
  line_storage(std::size_t rows, double ratio, std::uint32_t seed, std::size_t dim,
               std::size_t st_cols, bool steps, bool stage_write_backs = false)
      : plan_{plan_cache<Impl>(rows, ratio)},
        seed_{seed},
        dim_{dim},
        st_cols_{st_cols},
        tags_{plan_.lines},
        states_{plan_.lines},
        headers_{plan_.sets},
        w_{plan_.lines * dim},
        st_{plan_.lines * st_cols},
        steps_{steps ? plan_.lines : 0},
        stats_{1},
        epoch_{1},
        stage_cap_{stage_write_backs ? std::min<std::size_t>(plan_.lines, max_staged) : 0},
        stage_w_{stage_cap_ * dim},
        stage_st_{stage_cap_ * st_cols},
        stage_steps_{steps ? stage_cap_ : std::size_t{0}},
        stage_keys_{stage_cap_},
        stage_count_{stage_cap_ != 0 ? std::size_t{1} : std::size_t{0}},
        call_{1},
        shown_{1} {
    WM_CUDA_TRY(cudaMemset(call_.data(), 0, sizeof(call_counters)));
    *shown_.data() = call_counters{};
    if (plan_.sets != 0) {
      WM_CUDA_TRY(cudaMemset(tags_.data(), 0, plan_.lines * sizeof(std::uint32_t)));
      WM_CUDA_TRY(cudaMemset(states_.data(), 0, plan_.lines * sizeof(state_type)));
      WM_CUDA_TRY(cudaMemset(headers_.data(), 0, plan_.sets * sizeof(set_header)));
    }
    WM_CUDA_TRY(cudaMemset(stats_.data(), 0, sizeof(device_statistics)));
    WM_CUDA_TRY(cudaMemset(epoch_.data(), 0, sizeof(std::uint32_t)));  // headers: epoch 0 too
    WM_CUDA_TRY(cudaDeviceSynchronize());
  }

  /// Lines of this rank's cache.
  [[nodiscard]] std::size_t lines() const noexcept { return plan_.lines; }

  /// The kernels' view.
  [[nodiscard]] lines_ref<T, Impl> ref() const noexcept {
    return {cache_ref<Impl>{tags_.data(), states_.data(), headers_.data(), plan_.sets, seed_},
            w_.data(),
            st_cols_ != 0 ? st_.data() : nullptr,
            steps_.data(),
            dim_,
            st_cols_,
            stats_.data(),
            epoch_.data()};
  }

  /// The update's locator over @p table and these lines.
  [[nodiscard]] line_locator<T, Impl> locator(table_rows<T> const& table) const noexcept {
    return {table, ref()};
  }

  /**
   * Admits the distinct keys among @p keys (@p n of them; write-allocate) and, with an output
   * (@p out.base not null), writes row keys[i] to out row (@p order ? order[i] : i). Keys are
   * this rank's local rows, valid below @p rows. @p aux: use the second workspace (a call on
   * another stream beside the first, as the exchange engine's own-rows read); @p blocks_per_sm:
   * the most blocks per multiprocessor (the engine leaves room for its other work). Enqueued on
   * @p s; no host synchronization.
   */
  template <class Index>
  void admit(table_rows<T> const& table, std::size_t rows, Index const* keys, std::size_t n,
             std::size_t const* order, packed_rows out, bool count_requests, unsigned* err,
             bool aux, cudaStream_t s, int blocks_per_sm = 8, bool staged = false) {
    if (n == 0) { return; }
    auto c = ref();
    if (staged) { c.call = call_.data(); }
    int const vec = width(table, out);
    std::size_t const bl =
        std::min<std::size_t>(cuda::ceil_div(n, std::size_t{line_block / ways}),
                              static_cast<std::size_t>(sm_count()) *
                                  static_cast<std::size_t>(std::max(blocks_per_sm, 1)));
    if (staged && take_hit_first(n, order, out, count_requests, s)) {
      std::size_t const memo =
          std::size_t{2} << cuda::std::bit_width(std::min<std::size_t>(n, hit_first_memo_keys) - 1);
      carver k;
      auto const o_entries = k.add<std::uint64_t>(n);
      auto const o_count   = k.add<unsigned long long>(1);
      auto const o_memo    = k.add<unsigned long long>(memo);
      std::byte* base      = ws_.reserve(k.total(), s);
      miss_list const m{k.take<std::uint64_t>(base, o_entries),
                        k.take<unsigned long long>(base, o_count),
                        k.take<unsigned long long>(base, o_memo), memo};
      begin_staged_call_kernel<<<1, 1, 0, s>>>(epoch_.data(), c.call, shown_.data(), m.count);
      WM_CHECK_LAUNCH();
      with_vector(vec, [&]<class W>() {
        hit_first_kernel<W, T, Impl, Index>
            <<<static_cast<unsigned>(bl), line_block, 0, s>>>(c, rows, keys, n, out, m);
        WM_CHECK_LAUNCH();
        miss_kernel<W, T, Impl, Index>
            <<<static_cast<unsigned>(bl), line_block, 0, s>>>(c, table, rows, keys, out, m, err);
        WM_CHECK_LAUNCH();
      });
      ++hit_first_calls_;
      return;
    }
    auto const b = plan_distinct(keys, n, row_bits(rows), aux ? ws_aux_ : ws_, s);
    // Staged write-backs: at most one victim per distinct key, so n slots are enough.
    std::size_t const sn = staged ? std::min(stage_cap_, n) : 0;
    if (sn != 0) {
      c.stage_w     = stage_w_.data();
      c.stage_st    = st_cols_ != 0 ? stage_st_.data() : nullptr;
      c.stage_steps = c.steps != nullptr ? stage_steps_.data() : nullptr;
      c.stage_keys  = stage_keys_.data();
      c.stage_count = stage_count_.data();
      c.stage_rows  = sn;
      WM_CUDA_TRY(cudaMemsetAsync(stage_count_.data(), 0, sizeof(unsigned), s));
    }
    if (staged) {  // this call is a batch of its own
      begin_staged_call_kernel<<<1, 1, 0, s>>>(epoch_.data(), c.call, shown_.data(),
                                               static_cast<unsigned long long*>(nullptr));
    } else {
      next_epoch_kernel<<<1, 1, 0, s>>>(epoch_.data());
    }
    WM_CHECK_LAUNCH();
    if (sn != 0) {
      protect_kernel<T, Impl, Index><<<static_cast<unsigned>(bl), line_block, 0, s>>>(c, rows, b);
      WM_CHECK_LAUNCH();
    }
    with_vector(vec, [&]<class W>() {
      admit_kernel<W, T, Impl, Index><<<static_cast<unsigned>(bl), line_block, 0, s>>>(
          c, table, rows, b, order, out, count_requests, err);
      WM_CHECK_LAUNCH();
    });
    if (sn != 0) {  // the long runs' copies too
      write_back_staged(c, table, sn, b, order, out, s);
    } else if (out.base != nullptr) {
      replicate_runs_to(b, order, out, dim_ * sizeof(T), fused_copies, s);
    }
  }

  /// The staged victims of the last admission (view @p c, @p sn slots) to @p table in ascending
  /// key order: the slots' keys sorted (slots past the count hold the sentinel key 2^32 - 1 and
  /// sort last; the kernel stops at the count), then one warp per row; with an output (@p out.base
  /// not null) the same kernel replicates batch @p b's long runs (staged_write_back_kernel).
  template <class Index>
  void write_back_staged(lines_ref<T, Impl> const& c, table_rows<T> const& table, std::size_t sn,
                         distinct_batch<Index> const& b, std::size_t const* order, packed_rows out,
                         cudaStream_t s) {
    std::size_t cub_bytes = 0;
    WM_CUDA_TRY(cub::DeviceRadixSort::SortPairs(
        nullptr, cub_bytes, static_cast<std::uint32_t const*>(nullptr),
        static_cast<std::uint32_t*>(nullptr), static_cast<unsigned const*>(nullptr),
        static_cast<unsigned*>(nullptr), sn, 0, 32, s));
    carver k;
    auto const o_skeys  = k.add<std::uint32_t>(sn);
    auto const o_slots  = k.add<unsigned>(sn);
    auto const o_sslots = k.add<unsigned>(sn);
    auto const o_cub    = k.add<std::byte>(cub_bytes);
    std::byte* base     = stage_ws_.reserve(k.total(), s);
    auto* sorted_keys   = k.take<std::uint32_t>(base, o_skeys);
    auto* slots         = k.take<unsigned>(base, o_slots);
    auto* sorted_slots  = k.take<unsigned>(base, o_sslots);
    // Slots the kernel did not take keep the sentinel (set here, after the kernel, for the
    // slots at or past the count: a kernel-side fill would need the count on the host).
    fill_sentinels_kernel<<<static_cast<unsigned>(elementwise_blocks(sn)), 256, 0, s>>>(
        c.stage_keys, c.stage_count, sn, slots);
    WM_CHECK_LAUNCH();
    WM_CUDA_TRY(cub::DeviceRadixSort::SortPairs(k.take<std::byte>(base, o_cub), cub_bytes,
                                                c.stage_keys, sorted_keys, slots, sorted_slots, sn,
                                                0, 32, s));
    std::size_t const steps =
        out.base != nullptr ? std::max(sn, cuda::ceil_div(b.n, copies_per_step)) : sn;
    std::size_t const bl =
        std::min<std::size_t>(cuda::ceil_div(steps, std::size_t{line_block / ways}),
                              static_cast<std::size_t>(sm_count()) * 8);
    with_vector(width(table, out), [&]<class W>() {
      staged_write_back_kernel<W, T, Impl, Index><<<static_cast<unsigned>(bl), line_block, 0, s>>>(
          c, table, sorted_keys, sorted_slots, b, order, out);
      WM_CHECK_LAUNCH();
    });
  }

  /// Writes every dirty line back to @p table and cleans it; with @p drop empties every line.
  /// Enqueued on @p s.
  void write_back(table_rows<T> const& table, bool drop, cudaStream_t s) {
    if (plan_.sets == 0) { return; }
    std::size_t const bl = std::min<std::size_t>(
        cuda::ceil_div(std::size_t{plan_.sets}, std::size_t{line_block / ways}),
        static_cast<std::size_t>(sm_count()) * 8);
    with_vector(width(table, packed_rows{nullptr, 0}), [&]<class W>() {
      write_back_kernel<W, T, Impl>
          <<<static_cast<unsigned>(bl), line_block, 0, s>>>(ref(), table, drop);
      WM_CHECK_LAUNCH();
    });
  }

  /// The counters so far (waits for the device).
  [[nodiscard]] cache_statistics statistics() const {
    WM_CUDA_TRY(cudaDeviceSynchronize());
    device_statistics d;
    WM_CUDA_TRY(cudaMemcpy(&d, stats_.data(), sizeof d, cudaMemcpyDeviceToHost));
    cache_statistics st  = d.to_public();
    st.hit_first_gathers = hit_first_calls_;
    return st;
  }

  /// Sets every counter to zero (waits for the device).
  void reset_statistics() {
    WM_CUDA_TRY(cudaDeviceSynchronize());
    WM_CUDA_TRY(cudaMemset(stats_.data(), 0, sizeof(device_statistics)));
    WM_CUDA_TRY(cudaDeviceSynchronize());
    hit_first_calls_ = 0;
  }

 private:
  /// Whether a staged gather of @p n keys takes the hit-first path: a plain gather (no order,
  /// an output, counted), not captured in a graph (a graph keeps the path it was captured with,
  /// so it keeps the one that suits any batch), and the last staged gather the device has shown
  /// missed at most one key in hit_first_miss_share without bypasses. The shown counts lag a
  /// call or two and may mix two calls: they choose a path, never a result.
  [[nodiscard]] bool take_hit_first(std::size_t n, std::size_t const* order, packed_rows out,
                                    bool count_requests, cudaStream_t s) const {
    if (order != nullptr || out.base == nullptr || !count_requests || n == 0) { return false; }
    cudaStreamCaptureStatus capture{};
    WM_CUDA_TRY(cudaStreamIsCapturing(s, &capture));
    if (capture != cudaStreamCaptureStatusNone) { return false; }
    auto const volatile* const h    = shown_.data();
    unsigned long long const req    = h->requests;
    unsigned long long const misses = h->misses;
    unsigned long long const bypass = h->bypasses;
    return req != 0 && bypass == 0 && misses * hit_first_miss_share <= req;
  }

  /// Widest access dividing every row size, stride and base the kernels copy.
  [[nodiscard]] int width(table_rows<T> const& table, packed_rows out) const noexcept {
    return vector_width({dim_ * sizeof(T), table.w.stride * sizeof(T),
                         reinterpret_cast<std::uintptr_t>(table.w.data),
                         reinterpret_cast<std::uintptr_t>(out.base), out.stride_bytes,
                         st_cols_ * sizeof(float), table.st.stride * sizeof(float),
                         reinterpret_cast<std::uintptr_t>(table.st.data)});
  }

  cache_plan plan_;
  std::uint32_t seed_;
  std::size_t dim_;
  std::size_t st_cols_;
  device_buffer<std::uint32_t> tags_;
  device_buffer<state_type> states_;
  device_buffer<set_header> headers_;
  device_buffer<T> w_;
  device_buffer<float> st_;
  device_buffer<std::int64_t> steps_;
  device_buffer<device_statistics> stats_;
  device_buffer<std::uint32_t> epoch_;  // the batch counter (lines_ref::epoch)
  std::size_t stage_cap_;               // staging slots (0: write-backs are never staged)
  device_buffer<T> stage_w_;            // staged victims: weights, states, steps, old keys
  device_buffer<float> stage_st_;
  device_buffer<std::int64_t> stage_steps_;
  device_buffer<std::uint32_t> stage_keys_;
  device_buffer<unsigned> stage_count_;
  device_buffer<call_counters> call_;   // this staged gather's counts
  pinned_buffer<call_counters> shown_;  // the last ones the device showed (host-mapped)
  std::size_t hit_first_calls_{};
  workspace stage_ws_;  // the staged keys' sort
  workspace ws_;        // the distinct-key plan of calls on the caller's stream
  workspace ws_aux_;    // the same for the engine's own-rows read beside them
};

/**
 * The owner side's reads of a distributed gather (the exchange engine's reader, engine.cuh):
 * the keys this rank owns, asked for by any rank, are served by its cache (hits from lines,
 * misses admitted) into the engine's buffers.
 */
template <class T, class Impl>
struct line_reader {
  line_storage<T, Impl>* lines;
  table_rows<T> table;
  std::size_t rows;  ///< this rank's rows
  unsigned* err;
  cudaStream_t main_stream;  ///< calls on any other stream use the second workspace
  template <class Index>
  void operator()(Index const* keys, std::size_t const* order, std::size_t n, packed_rows dst,
                  cudaStream_t s, int blocks_per_sm) const {
    lines->admit(table, rows, keys, n, order, dst, true, err, s != main_stream, s, blocks_per_sm);
  }
};

}  // namespace wm::detail::cache
