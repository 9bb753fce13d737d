// SPDX-License-Identifier: Apache-2.0
// The kernels of a group cache (group_ref.cuh): the lookup behind gather and prefetch, and this
// rank's pass as a holder (take the hints, fold the hit counters, admit), and invalidation.
//
// Lines under a reader's feet (a seqlock; the word's encoding and the reader's check are in
// line_word.hpp, whose host tests run the protocol): a line's 64-bit word holds the key + 1 while
// the line holds that key's whole row (0 otherwise) in its low half and a generation in its high
// half. The holder empties the word with the next generation, fences, writes the new row, fences,
// and publishes the key with that generation (release). A reader loads the word in every lane
// (acquire), copies the row, fences (acquire) and loads the word again: any change, even a trip
// through other keys back to the same one, sends it to the table (a refused copy, counted in
// cache_statistics::refused_copies). The row's own accesses are plain loads and stores, ordered
// by the fences: this relies on the fences ordering them (as CUDA's seqlocks do) rather than on
// morally strong accesses of the PTX memory model. The table does not change under a read-only
// cache; after changing it, invalidate().
//
// Hints and hit counters are advice: a hint read before its writer stored it gives an older key
// (admitted if it is valid and hashes here, else skipped), a full list drops hints, a hit counted
// for a line that changed meanwhile credits its new row. None of it changes a gathered value.
#pragma once

#include <wm/detail/base/cuda.cuh>
#include <wm/detail/cache/group_ref.cuh>
#include <wm/detail/cache/line_word.hpp>
#include <wm/detail/cache/set.hpp>
#include <wm/detail/cache/statistics.hpp>
#include <wm/detail/cache/warp_rows.cuh>
#include <wm/detail/rows/distinct.cuh>
#include <wm/detail/rows/move.cuh>
#include <wm/detail/rows/views.cuh>

#include <cuda/atomic>

#include <cstddef>
#include <cstdint>

namespace wm::detail::cache {

/**
 * The lookup: one warp per distinct key of batch @p b. A key held by a line of its holder (this
 * rank or a peer) is copied from the line, checked against a concurrent replacement (see the top
 * of this file), and the line's hit counter gets one; any other key is read from @p table (its
 * row(k): every row on mapped layouts) and hinted to its holder. The row goes to the output rows of
 * the run's first min(length, fused_copies) elements (replicate_runs_to copies the rest). Invalid
 * keys: zero rows, *err set, counted as misses, nothing hinted. Without an output (@p out.base
 * null: a prefetch) a miss is only hinted: nothing is copied, read from the table or counted.
 */
template <class W, class T, class Impl, class Table, class Index, class Pos>
__global__ void __launch_bounds__(line_block)
    group_lookup_kernel(group_ref<T, Impl> c, Table table, std::size_t rows,
                        distinct_batch<Index, Pos> b, packed_rows out, unsigned* err) {
  unsigned const lane         = threadIdx.x % ways;
  std::size_t const warp      = grid_thread() / ways;
  std::size_t const n_warps   = grid_threads() / ways;
  std::size_t const runs      = *b.runs;
  std::size_t const row_bytes = c.dim * sizeof(T);
  bool const prefetch         = out.base == nullptr;
  unsigned long long requests = 0, distinct = 0, hits = 0, misses = 0, from_host = 0,
                     from_peers = 0, refused = 0;
  for (std::size_t r = warp; r < runs; r += n_warps) {  // the same trip count in every lane
    std::size_t const begin  = b.run_begin[r];
    std::size_t const len    = b.run_begin[r + 1] - begin;
    Index const key          = b.keys[begin];
    std::size_t const copies = prefetch ? 0 : len < fused_copies ? len : fused_copies;
    requests += len;
    ++distinct;
    auto const to = [&](std::size_t q) { return output_row(b, nullptr, out, begin + q); };
    if (!valid_index(key, rows)) {
      warp_copy_row<W>(to, copies, nullptr, row_bytes, lane);  // zero rows
      if (lane == 0) { atomicOr(err, 1u); }
      misses += len;
      continue;
    }
    auto const k                 = static_cast<std::uint32_t>(key);
    int const g                  = c.holder(k);
    group_part<T> const part     = c.parts[g];
    std::size_t const first_slot = cache_ref<Impl>::slot(c.meta.set_index(k), 0);
    std::uint64_t const seen =
        line_word(part.line + first_slot + lane).load(cuda::memory_order_acquire);
    std::uint32_t const hit_lanes = __ballot_sync(full_warp, word_holds(seen, k));
    bool served                   = false;
    if (prefetch) {  // a hint for a miss; a hit counts as a use of the line
      if (lane == 0) {
        if (hit_lanes == 0) {
          hint(part, k, c.hint_cap);
        } else {
          std::size_t const slot = first_slot + static_cast<std::size_t>(lowest_way(hit_lanes));
          shared_word(part.hits + slot).fetch_add(1u, cuda::memory_order_relaxed);
        }
      }
      continue;
    }
    if (hit_lanes != 0) {
      std::size_t const slot = first_slot + static_cast<std::size_t>(lowest_way(hit_lanes));
      auto const word        = line_word(part.line + slot);
      // Every lane acquires the published word itself (its loads of the row come after the
      // holder's writes of it), copies its share, and after a fence finds the same word again.
      std::uint64_t const before = word.load(cuda::memory_order_acquire);
      std::uint64_t const lane0  = __shfl_sync(full_warp, before, 0);
      if (__all_sync(full_warp, word_holds(before, k) && before == lane0)) {
        warp_copy_row<W, true>(to, copies, part.w + slot * c.dim, row_bytes, lane);
        cuda::atomic_thread_fence(cuda::memory_order_acquire, cuda::thread_scope_system);
        served =
            __all_sync(full_warp, copy_stands(before, word.load(cuda::memory_order_relaxed), k));
      }
      if (served && lane == 0) {
        shared_word(part.hits + slot).fetch_add(1u, cuda::memory_order_relaxed);
      }
    }
    if (served) {
      hits += len;
      if (g != c.me) { from_peers += row_bytes; }
      continue;
    }
    refused += hit_lanes != 0 ? 1 : 0;  // the probe saw the key, the word changed since
    // A miss (or a line replaced while it was read): the table's row, and a hint to the holder.
    warp_copy_row<W, true>(to, copies, table.row(k), row_bytes, lane);
    misses += len;
    from_host += row_bytes;
    if (lane == 0) { hint(part, k, c.hint_cap); }
  }
  // Every lane of a warp counted the same keys: lane 0's counts are the warp's.
  if (!prefetch && lane == 0) {
    add_counts(c.stats, {.requests         = requests,
                         .distinct_keys    = distinct,
                         .hits             = hits,
                         .misses           = misses,
                         .bytes_from_host  = from_host,
                         .bytes_from_peers = from_peers});
    if (refused != 0) { atomicAdd(c.refused, refused); }
  }
}

/**
 * This rank as a holder, before it admits: takes the hints left since the last pass (their count
 * to @p taken, at most hint_cap; the list starts again at 0) and starts a new admission pass.
 */
template <class T, class Impl>
__global__ void group_take_hints_kernel(group_ref<T, Impl> c, std::uint32_t* taken) {
  std::uint32_t* const count = c.parts[c.me].hint_count;
  std::uint32_t const n      = shared_word(count).exchange(0u, cuda::memory_order_acq_rel);
  *taken                     = n < c.hint_cap ? n : c.hint_cap;
  atomicAdd(c.epoch, 1u);
}

/**
 * Folds the hit counters of this rank's lines into their replacement states (one warp per set;
 * each counted hit is one set_ref::touch, at most 64 per line and pass).
 */
template <class T, class Impl>
__global__ void __launch_bounds__(line_block) group_fold_kernel(group_ref<T, Impl> c) {
  unsigned const lane       = threadIdx.x % ways;
  std::size_t const warp    = grid_thread() / ways;
  std::size_t const n_warps = grid_threads() / ways;
  std::uint32_t* const hits = c.parts[c.me].hits;
  for (std::size_t s = warp; s < c.meta.sets; s += n_warps) {
    std::size_t const slot = cache_ref<Impl>::slot(static_cast<std::uint32_t>(s), 0) + lane;
    std::uint32_t h        = 0;
    if (shared_word(hits + slot).load(cuda::memory_order_relaxed) != 0) {
      h = shared_word(hits + slot).exchange(0u, cuda::memory_order_relaxed);
    }
    std::uint32_t const touched = __ballot_sync(full_warp, h != 0);
    if (touched == 0) { continue; }
    auto const set = c.meta.set(static_cast<std::uint32_t>(s));
    lock_set(set.header, lane);
    for (std::uint32_t m = touched; m != 0; m &= m - 1) {
      int const way          = lowest_way(m);
      std::uint32_t const hw = __shfl_sync(full_warp, h, static_cast<unsigned>(way));
      if (lane == 0 && ((set.header->valid >> way) & 1u) != 0) {
        for (std::uint32_t i = 0; i < hw && i < 64; ++i) { set.touch(way); }
      }
    }
    unlock_set(set.header, lane);
  }
}

/**
 * The admissions of this rank's hints (*taken of them; one warp per hint): a valid key that
 * hashes here and is not held takes a way by the replacement policy among those this pass has not
 * taken (none left: dropped), under the set's lock; the line is emptied (its key word 0),
 * filled from @p table and published (its key word key + 1), see the top of this file.
 */
template <class W, class T, class Impl, class Table>
__global__ void __launch_bounds__(line_block)
    group_admit_kernel(group_ref<T, Impl> c, Table table, std::size_t rows,
                       std::uint32_t const* taken) {
  unsigned const lane          = threadIdx.x % ways;
  std::size_t const warp       = grid_thread() / ways;
  std::size_t const n_warps    = grid_threads() / ways;
  std::size_t const n          = *taken;
  std::uint32_t const epoch    = *c.epoch;
  group_part<T> const part     = c.parts[c.me];
  std::size_t const row_bytes  = c.dim * sizeof(T);
  unsigned long long evictions = 0, loaded = 0;
  for (std::size_t i = warp; i < n; i += n_warps) {
    std::uint32_t key = 0;
    if (lane == 0) { key = shared_word(part.hints + i).load(cuda::memory_order_relaxed); }
    key = __shfl_sync(full_warp, key, 0);
    if (key >= rows || c.holder(key) != c.me) { continue; }  // a stale hint's leftover
    std::uint32_t const s = c.meta.set_index(key);
    auto const set        = c.meta.set(s);
    lock_set(set.header, lane);
    int way      = no_way;
    bool evicted = false;
    if (lane == 0 && set.find(key) == no_way) {
      set.begin_batch(epoch);
      admission const a = set.admit(key, set.header->batch);
      if (a.way != no_way) {
        set.header->batch |= 1u << a.way;
        way     = a.way;
        evicted = a.evicted;
      }
    }
    way     = __shfl_sync(full_warp, way, 0);
    evicted = __shfl_sync(full_warp, evicted, 0);
    if (way != no_way) {
      std::size_t const slot = cache_ref<Impl>::slot(s, way);
      auto const word        = line_word(part.line + slot);
      std::uint64_t next     = 0;  // the line's next generation, in the high half
      if (lane == 0) {
        next = emptied_word(word.load(cuda::memory_order_relaxed));
        word.store(next, cuda::memory_order_relaxed);
      }
      next = __shfl_sync(full_warp, next, 0);
      __syncwarp();
      // Readers that see any of the new row's values see the emptied key word afterwards.
      cuda::atomic_thread_fence(cuda::memory_order_seq_cst, cuda::thread_scope_system);
      warp_copy_row<W, true>(part.w + slot * c.dim, table.row(key), row_bytes, lane);
      // Every lane's writes of the row come before the key that publishes it.
      cuda::atomic_thread_fence(cuda::memory_order_release, cuda::thread_scope_system);
      __syncwarp();
      if (lane == 0) { word.store(published_word(next, key), cuda::memory_order_release); }
      evictions += evicted ? 1 : 0;
      loaded += row_bytes;
    }
    unlock_set(set.header, lane);
  }
  if (lane == 0) { add_counts(c.stats, {.evictions = evictions, .bytes_from_host = loaded}); }
}

/// Empties every line of this rank (one thread per line; set headers by the way-0 thread).
template <class T, class Impl>
__global__ void group_invalidate_kernel(group_ref<T, Impl> c) {
  group_part<T> const part = c.parts[c.me];
  std::size_t const lines  = static_cast<std::size_t>(c.meta.sets) * ways;
  for (std::size_t i = grid_thread(); i < lines; i += grid_threads()) {
    auto const word = line_word(part.line + i);
    word.store(emptied_word(word.load(cuda::memory_order_relaxed)), cuda::memory_order_relaxed);
    shared_word(part.hits + i).store(0u, cuda::memory_order_relaxed);
    if (i % ways == 0) {
      set_header* const h = c.meta.headers + i / ways;
      h->valid            = 0;
      h->dirty            = 0;
    }
  }
}

}  // namespace wm::detail::cache
