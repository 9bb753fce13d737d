// SPDX-License-Identifier: Apache-2.0
// The hit-first path of a cache: staged gathers with few misses.
//
// A staged gather whose previous calls missed rarely skips the distinct-key plan: one pass probes
// every occurrence without locks (a staged call runs alone, and nothing changes a line while the
// pass runs), copies each hit row straight from its line and joins it to the batch (the first
// occurrence to set the way's batch bit makes the replacement update, so each key is touched once
// per batch, as in the planned path); the misses go to a list, which a second kernel admits under
// the sets' locks in the list's order (each miss is read from the table once per key: a later
// occurrence finds the line its first occurrence admitted). Dirty victims are written back at
// once: with few misses there are few, and their order costs little.
#pragma once

#include <wm/detail/base/cuda.cuh>
#include <wm/detail/cache/lines_ref.cuh>
#include <wm/detail/cache/set.hpp>
#include <wm/detail/cache/warp.cuh>
#include <wm/detail/cache/warp_rows.cuh>
#include <wm/detail/rows/views.cuh>
#include <wm/detail/tensor/table_rows.cuh>

#include <cstddef>
#include <cstdint>

namespace wm::detail::cache {

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
        deferred = !Impl::touch_unlocked(set.states[way], *set.header);
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
  if (lane == 0) {
    add_counts(c.stats, {.requests = requests, .distinct_keys = distinct, .hits = hits});
    add_counts(c.call, {.requests = requests});
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
        warp_copy_row<W>(dst, nullptr, row_bytes, lane);  // a zero row
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
      warp_copy_row<W>(dst, table.locate(k).w, row_bytes, lane);
      loaded += row_bytes;  // once per occurrence: no other warp's copy to take it from
      ++bypass_rows;
    } else {
      warp_copy_row<W>(dst, c.line(cache_ref<Impl>::slot(s, way)).w, row_bytes, lane);
    }
  }
  if (lane == 0) {
    add_counts(c.stats, {.distinct_keys   = distinct,
                         .misses          = misses,
                         .evictions       = evictions,
                         .write_backs     = write_backs,
                         .bytes_from_host = loaded,
                         .bypasses        = bypasses,
                         .bypass_rows     = bypass_rows});
    add_counts(c.call, {.misses = misses, .bypasses = bypasses});
  }
}

}  // namespace wm::detail::cache
