// SPDX-License-Identifier: Apache-2.0
// The kernels of a cache's planned path: the admission kernel behind gather and prefetch (one warp
// per distinct key of the batch's distinct-key plan), the staged write-backs and the protect pass
// of one-rank gathers, the write-back kernel behind flush and invalidate, and the batch counter.
//
// Concurrency: one warp per distinct key of a batch. Distinct keys can share a set, so a warp
// holds the set's lock (warp_rows.cuh) from its probe until the row is in its line and copied
// out. Staged calls (one-rank gathers, which run alone and first protect every cached key of the
// batch) copy the row out after the release: the batch rule keeps the line. Locks rather than
// grouping keys by set: the batch is already sorted by key for the distinct-row plan
// (detail/rows/distinct.cuh); a second sort by set would cost a full radix sort per gather, while
// with ~10 distinct keys per set a lock is rarely contended.
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

#include <wm/detail/base/cuda.cuh>
#include <wm/detail/cache/lines_ref.cuh>
#include <wm/detail/cache/set.hpp>
#include <wm/detail/cache/warp.cuh>
#include <wm/detail/cache/warp_rows.cuh>
#include <wm/detail/rows/distinct.cuh>
#include <wm/detail/rows/views.cuh>
#include <wm/detail/tensor/table_rows.cuh>

#include <cstddef>
#include <cstdint>

namespace wm::detail::cache {

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
 * way's bit in the set's batch mask for this call's epoch (join_batch), so no admission of the call
 * can evict a row the call still reads. One thread per distinct key.
 */
template <class T, class Impl, class Index>
__global__ void protect_kernel(lines_ref<T, Impl> c, std::size_t rows, distinct_batch<Index> b) {
  std::size_t const runs    = *b.runs;
  std::uint32_t const epoch = *c.epoch;
  for (std::size_t r = grid_thread(); r < runs; r += grid_threads()) {
    Index const key = b.keys[b.run_begin[r]];
    if (!valid_index(key, rows)) { continue; }
    auto const k   = static_cast<std::uint32_t>(key);
    auto const set = c.meta.set(c.meta.set_index(k));
    int const way  = set.find(k);
    if (way == no_way) { continue; }
    (void)join_batch(set.header, way, epoch);
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
    auto const to = [&](std::size_t q) { return output_row(b, order, out, begin + q); };
    if (!valid_index(key, rows)) {
      warp_copy_row<W>(to, copies, nullptr, row_bytes, lane);  // zero rows
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
        // table row before it is written. Without room: to the table at once. Until then the
        // slot holds the only copy of the row: the call reserved every workspace it needs
        // before this kernel (line_storage::admit), so nothing between can fail for memory.
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
    T const* const src = a.bypassed ? nullptr : c.line(cache_ref<Impl>::slot(s, a.way)).w;
    // Staged calls run alone and protected every cached key of the batch; the batch rule keeps
    // the line this warp hit or admitted: its row may be copied out after the lock is gone.
    if (src != nullptr && !staged) { warp_copy_row<W>(to, copies, src, row_bytes, lane); }
    unlock_set(set.header, lane);
    if (src != nullptr && staged) { warp_copy_row<W>(to, copies, src, row_bytes, lane); }
    // A bypassed row is in no line (it missed; a call beside this one that admits it meanwhile
    // loads it clean): the table holds it, and the lock is not needed to read it. It is read over
    // PCIe once, into the run's first output row, and copied from there to the others.
    if (a.bypassed) {
      if (count_requests) { ++bypasses; }
      if (copies != 0) {
        void* const first = output_row(b, order, out, begin);
        warp_copy_row<W>(first, table.locate(k).w, row_bytes, lane);
        loaded += row_bytes;
        ++bypass_rows;
        __syncwarp();
        for (std::size_t q = 1; q < copies; ++q) {
          warp_copy_row<W>(output_row(b, order, out, begin + q), first, row_bytes, lane);
        }
      }
    }
  }
  if (!count_requests) { requests = distinct = hits = 0; }  // a prefetch: what it moved only
  if (lane == 0 && c.call != nullptr) {
    add_counts(c.call, {.requests = requests, .misses = requests - hits, .bypasses = bypasses});
  }
  if (lane == 0 && c.stats != nullptr) {
    add_counts(c.stats, {.requests        = requests,
                         .distinct_keys   = distinct,
                         .hits            = hits,
                         .misses          = requests - hits,
                         .evictions       = evictions,
                         .write_backs     = write_backs,
                         .bytes_from_host = loaded,
                         .bypasses        = bypasses,
                         .bypass_rows     = bypass_rows});
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
  if (lane == 0 && c.stats != nullptr) { add_counts(c.stats, {.write_backs = written}); }
}

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

}  // namespace wm::detail::cache
