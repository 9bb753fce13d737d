// SPDX-License-Identifier: Apache-2.0
// The bookkeeping of one 32-way cache set: probe, victim, admission, dirty bits, eviction, flush,
// invalidation, the batch mask, and the replacement policies' per-line state (lfu_impl, lru_impl).
// Every function is host and device (a sequential version: the host model, tests, and a kernel
// thread that owns a set); the warp_* functions are the warp-cooperative device versions (one lane
// per way, one __ballot_sync per probe) and give the same results as the sequential ones.
//
// Layout of a cache of S sets (structure of arrays, so a warp's 32 lanes read one set's tags or
// states in one coalesced access): tags[S * 32], states[S * 32] (the policy's state_type),
// headers[S] (valid mask, dirty mask, clock, lock word, batch mask and its epoch). Line (s, w)
// holds table row tags[s * 32 + w] in data slot s * 32 + w. Metadata: 8 or 6 bytes per line + 24
// per set, nothing per table row.
//
// Batches: a gather or prefetch is one batch with its own epoch number. The header's batch mask
// holds the ways the batch `epoch` has used (hit or admitted); a set that sees a new epoch resets
// the mask first (lazily, no clearing pass). A miss of a batch never evicts a way in the mask (a
// row that batch just loaded or hit would otherwise be replaced by a later key of the same batch
// and loaded for nothing); when every way is in the mask the key bypasses the cache (batch_access
// reports `bypassed`, nothing is admitted). Across batches the ordinary policy applies.
//
// Tag: the key itself, 32 bits (keys < 2^32: a device cache holds rows of its own rank's part,
// which the embedding limits to 2^32 - 1 rows). The set index comes from a hash of the key, so the
// tag must name the key within the set; storing the key whole also gives the write-back address
// without an inverse hash.
#pragma once

#include <wm/config.hpp>
#include <wm/detail/base/hash.hpp>

#if defined(__CUDACC__)
#include <cuda/atomic>
#endif

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace wm::detail::cache {

inline constexpr int ways                = 32;           ///< lines per set (one warp)
inline constexpr int no_way              = -1;           ///< probe result: miss
inline constexpr std::uint32_t all_ways  = 0xffffffffu;  ///< mask of every way
inline constexpr std::uint32_t full_warp = 0xffffffffu;  ///< __*_sync mask

/// Index of the lowest set bit of a non-zero mask.
[[nodiscard]] WM_HOST_DEVICE inline int lowest_way(std::uint32_t mask) noexcept {
#if defined(__CUDA_ARCH__)
  return __ffs(static_cast<int>(mask)) - 1;
#else
  return __builtin_ctz(mask);
#endif
}

/// Number of set bits.
[[nodiscard]] WM_HOST_DEVICE inline int count_ways(std::uint32_t mask) noexcept {
#if defined(__CUDA_ARCH__)
  return __popc(mask);
#else
  return __builtin_popcount(mask);
#endif
}

// ---------------------------------------------------------------------------------------------
// Hash: key -> set. A 32-bit integer mix (xor-shift / odd-multiply rounds, a bijection of the
// 32-bit keys) then a multiply-shift range reduction, so the set count need not be a power of
// two. Consecutive ids (renumbered hot rows) land on unrelated sets.

/// The key mix: mix32 of wm's one hash family (detail/base/hash.hpp).
using detail::mix32;

/// The set of @p key in a cache of @p sets sets (sets >= 1).
[[nodiscard]] WM_HOST_DEVICE constexpr std::uint32_t set_of(std::uint32_t key, std::uint32_t sets,
                                                            std::uint32_t seed = 0) noexcept {
  return static_cast<std::uint32_t>((static_cast<std::uint64_t>(mix32(key, seed)) * sets) >> 32);
}

// ---------------------------------------------------------------------------------------------
// Per-set header.

/// Valid and dirty bits of the 32 ways, the set's clock (LRU stamps), its lock word and the
/// ways used by the current batch.
struct set_header {
  std::uint32_t valid{};  ///< bit w: way w holds a row
  std::uint32_t dirty{};  ///< bit w: way w differs from the table (a subset of valid)
  std::uint32_t clock{};  ///< LRU: last stamp given in this set
  std::uint32_t lock{};   ///< the kernels' set lock (detail/cache/warp_rows.cuh); 0: free
  std::uint32_t batch{};  ///< bit w: way w was hit or admitted by batch `epoch`
  std::uint32_t epoch{};  ///< the batch that `batch` belongs to
};

// ---------------------------------------------------------------------------------------------
// Replacement policies. Each supplies state_type, what a hit does (hit), the state of an admitted
// line (admitted), and a set-wide decay (decayed, after_decay) that runs before a hit when
// needs_decay says so and before an admission when admit_needs_decay says so. The
// victim among valid lines is always the lowest state (lowest way on ties): the state orders the
// lines from "evict first" up. touch_unlocked is the hit of a thread that does not hold the set:
// the hit-first pass (hit_first_kernels.cuh), where only the batch's first hit of a line updates
// it, so no other thread writes that line's state meanwhile (others may update other lines).

/// Decayed LFU: a 16-bit use count per line (see wm::lfu).
struct lfu_impl {
  using state_type                     = std::uint16_t;
  static constexpr std::uint32_t limit = 0xffffu;

  /// Whether the hit on a line with state @p s must first halve the set's counts.
  [[nodiscard]] WM_HOST_DEVICE static constexpr bool needs_decay(state_type s,
                                                                 set_header const&) noexcept {
    return s == limit;
  }
  /// The line's state after a set-wide decay; @p rank (its order in the set) is unused.
  [[nodiscard]] WM_HOST_DEVICE static constexpr state_type decayed(state_type s, int) noexcept {
    return static_cast<state_type>(s >> 1);
  }
  /// Whether an admission must first decay the set (never: a saturated victim stays saturated).
  [[nodiscard]] WM_HOST_DEVICE static constexpr bool admit_needs_decay(set_header const&) noexcept {
    return false;
  }
  /// After a decay, the header's part (nothing for LFU).
  WM_HOST_DEVICE static constexpr void after_decay(set_header&) noexcept {}
  /// The state of a line after a hit (decay already done).
  [[nodiscard]] WM_HOST_DEVICE static constexpr state_type hit(state_type s, set_header&) noexcept {
    return static_cast<state_type>(s + 1);
  }
  /// The state of a newly admitted line; @p victim is the replaced line's state if
  /// @p replaced_valid. Dynamic aging: the newcomer starts one above the line it replaced.
  [[nodiscard]] WM_HOST_DEVICE static constexpr state_type admitted(state_type victim,
                                                                    bool replaced_valid,
                                                                    set_header&) noexcept {
    if (!replaced_valid) { return 1; }
    return static_cast<state_type>(victim < limit ? victim + 1 : limit);
  }
  /// A hit on a line with state @p s without the set's lock: false (nothing changed) when it
  /// needs a set-wide decay first, which is left to a thread that holds the set.
  [[nodiscard]] WM_HOST_DEVICE static bool touch_unlocked(state_type& s,
                                                          set_header const& h) noexcept {
    state_type const state = s;
    if (needs_decay(state, h)) { return false; }
    s = static_cast<state_type>(state + 1);
    return true;
  }
};

/// LRU: a 32-bit stamp per line from the set's clock (see wm::lru).
struct lru_impl {
  using state_type = std::uint32_t;

  [[nodiscard]] WM_HOST_DEVICE static constexpr bool needs_decay(state_type,
                                                                 set_header const& h) noexcept {
    return h.clock == 0xffffffffu;
  }
  [[nodiscard]] WM_HOST_DEVICE static constexpr bool admit_needs_decay(
      set_header const& h) noexcept {
    return h.clock == 0xffffffffu;
  }
  /// After a decay the stamps are the lines' ranks 1..32 (order kept).
  [[nodiscard]] WM_HOST_DEVICE static constexpr state_type decayed(state_type, int rank) noexcept {
    return static_cast<state_type>(rank + 1);
  }
  WM_HOST_DEVICE static constexpr void after_decay(set_header& h) noexcept { h.clock = ways; }
  [[nodiscard]] WM_HOST_DEVICE static constexpr state_type hit(state_type, set_header& h) noexcept {
    return ++h.clock;
  }
  [[nodiscard]] WM_HOST_DEVICE static constexpr state_type admitted(state_type, bool,
                                                                    set_header& h) noexcept {
    return ++h.clock;
  }
  /// A hit on a line with state @p s without the set's lock: the next stamp from the set's clock
  /// (an atomic add: other lines of the set are stamped meanwhile); false (nothing changed) near
  /// the wrap, whose renumbering is left to a thread that holds the set. At most 32 stamps per set
  /// and batch: a clock below the margin cannot reach the wrap.
  [[nodiscard]] WM_HOST_DEVICE static bool touch_unlocked(state_type& s, set_header& h) noexcept {
    constexpr std::uint32_t margin = 0xffffffffu - 2u * ways;
#if defined(__CUDACC__)
    cuda::atomic_ref<std::uint32_t, cuda::thread_scope_device> clock{h.clock};
    if (clock.load(cuda::memory_order_relaxed) >= margin) { return false; }
    s = clock.fetch_add(1u, cuda::memory_order_relaxed) + 1u;
#else
    std::atomic_ref<std::uint32_t> clock{h.clock};
    if (clock.load(std::memory_order_relaxed) >= margin) { return false; }
    s = clock.fetch_add(1u, std::memory_order_relaxed) + 1u;
#endif
    return true;
  }
};

/// What an admission did.
struct admission {
  int way{no_way};           ///< the way the key now occupies
  bool evicted{false};       ///< a valid line was replaced
  bool write_back{false};    ///< the replaced line was dirty: write row old_key back
  std::uint32_t old_key{0};  ///< the replaced line's key (when evicted)
};

/**
 * One set's metadata, by pointers into the cache's arrays (trivially copyable; a kernel gets it
 * by value). The sequential functions suit the host and a device thread that owns the set.
 */
template <class Impl>
struct set_ref {
  using state_type = typename Impl::state_type;

  std::uint32_t* tags{};  ///< 32 keys
  state_type* states{};   ///< 32 replacement states
  set_header* header{};   ///< valid / dirty / clock

  /// The way holding @p key, or no_way.
  [[nodiscard]] WM_HOST_DEVICE int find(std::uint32_t key) const noexcept {
    std::uint32_t const valid = header->valid;
    for (int w = 0; w < ways; ++w) {
      if (((valid >> w) & 1u) != 0 && tags[w] == key) { return w; }
    }
    return no_way;
  }

  /// The replacement update of a hit on @p way (decaying the set first when the policy says so).
  WM_HOST_DEVICE void touch(int way) const noexcept {
    if (Impl::needs_decay(states[way], *header)) { decay(); }
    states[way] = Impl::hit(states[way], *header);
  }

  /// Every line's state decayed (LFU halves counts; LRU renumbers stamps 1..32 in order).
  WM_HOST_DEVICE void decay() const noexcept {
    state_type next[ways];
    for (int w = 0; w < ways; ++w) { next[w] = Impl::decayed(states[w], rank_of(w)); }
    for (int w = 0; w < ways; ++w) { states[w] = next[w]; }
    Impl::after_decay(*header);
  }

  /// The way an admission would take among the ways not in @p exclude: the lowest invalid one,
  /// else the lowest state (lowest way on ties); no_way when @p exclude holds every way.
  [[nodiscard]] WM_HOST_DEVICE int victim(std::uint32_t exclude = 0) const noexcept {
    std::uint32_t const allowed = ~exclude;
    if (allowed == 0) { return no_way; }
    std::uint32_t const invalid = ~header->valid & allowed;
    if (invalid != 0) { return lowest_way(invalid); }
    int best = no_way;
    for (int w = 0; w < ways; ++w) {
      if (((allowed >> w) & 1u) != 0 && (best == no_way || states[w] < states[best])) { best = w; }
    }
    return best;
  }

  /// Puts @p key (not present) into the victim way among those not in @p exclude; reports what
  /// was replaced. With every way excluded nothing changes and the admission's way is no_way.
  WM_HOST_DEVICE admission admit(std::uint32_t key, std::uint32_t exclude = 0) const noexcept {
    admission a;
    if (exclude == all_ways) { return a; }
    if (Impl::admit_needs_decay(*header)) { decay(); }
    a.way                   = victim(exclude);
    std::uint32_t const bit = 1u << a.way;
    a.evicted               = (header->valid & bit) != 0;
    a.write_back            = (header->dirty & bit) != 0;
    a.old_key               = tags[a.way];
    states[a.way]           = Impl::admitted(states[a.way], a.evicted, *header);
    tags[a.way]             = key;
    header->valid |= bit;
    header->dirty &= ~bit;
    return a;
  }

  /// Starts batch @p epoch in this set unless it has started: a mask of another epoch is reset.
  WM_HOST_DEVICE void begin_batch(std::uint32_t epoch) const noexcept {
    if (header->epoch != epoch) {
      header->batch = 0;
      header->epoch = epoch;
    }
  }

  /// Marks a valid line as changed (it is written back on eviction, flush or invalidation).
  WM_HOST_DEVICE void mark_dirty(int way) const noexcept { header->dirty |= 1u << way; }

  /// Drops one line; returns whether it was dirty (the caller writes row tags[way] back).
  WM_HOST_DEVICE bool evict(int way) const noexcept {
    std::uint32_t const bit = 1u << way;
    bool const dirty        = (header->dirty & bit) != 0;
    header->valid &= ~bit;
    header->dirty &= ~bit;
    return dirty;
  }

  /// Cleans every line: returns the dirty ways (write rows tags[w] back), which stay valid.
  WM_HOST_DEVICE std::uint32_t flush() const noexcept {
    std::uint32_t const dirty = header->dirty;
    header->dirty             = 0;
    return dirty;
  }

  /// Drops every line: returns the dirty ways (their tags stay readable for the write-back).
  WM_HOST_DEVICE std::uint32_t invalidate() const noexcept {
    std::uint32_t const dirty = header->dirty;
    header->valid             = 0;
    header->dirty             = 0;
    return dirty;
  }

  /// Order of way @p w by (state, way): 0 for the next victim among all ways.
  [[nodiscard]] WM_HOST_DEVICE int rank_of(int w) const noexcept {
    int r = 0;
    for (int v = 0; v < ways; ++v) {
      if (states[v] < states[w] || (states[v] == states[w] && v < w)) { ++r; }
    }
    return r;
  }
};

/**
 * A whole cache's metadata (structure of arrays, see the top of this file) and its hash: the
 * trivially copyable form kernels take by value.
 */
template <class Impl>
struct cache_ref {
  using state_type = typename Impl::state_type;

  std::uint32_t* tags{};  ///< sets * 32 keys
  state_type* states{};   ///< sets * 32 replacement states
  set_header* headers{};  ///< sets headers
  std::uint32_t sets{};   ///< number of sets (>= 1)
  std::uint32_t seed{};   ///< hash seed

  /// The set @p key maps to.
  [[nodiscard]] WM_HOST_DEVICE std::uint32_t set_index(std::uint32_t key) const noexcept {
    return set_of(key, sets, seed);
  }
  /// Set @p s's metadata.
  [[nodiscard]] WM_HOST_DEVICE set_ref<Impl> set(std::uint32_t s) const noexcept {
    return {tags + static_cast<std::size_t>(s) * ways, states + static_cast<std::size_t>(s) * ways,
            headers + s};
  }
  /// Data slot of line (set @p s, way @p w).
  [[nodiscard]] WM_HOST_DEVICE static std::size_t slot(std::uint32_t s, int w) noexcept {
    return static_cast<std::size_t>(s) * ways + static_cast<std::size_t>(w);
  }
};

/// What one access did (see batch_access()).
struct access_result {
  bool hit{false};
  int way{no_way};       ///< no_way only when bypassed
  admission admitted{};  ///< on a miss
  bool bypassed{false};  ///< batch_access: a miss with every way used by the batch; not admitted
};

/**
 * One access of batch @p epoch with write-allocate: starts the batch in the set (begin_batch);
 * a hit touches the line; a miss admits the key into a way the batch has not used, or bypasses
 * the cache when the batch has used all 32 (`bypassed`, way no_way, nothing changes). The line
 * hit or admitted joins the batch mask; with @p write it is marked dirty.
 */
template <class Impl>
WM_HOST_DEVICE access_result batch_access(set_ref<Impl> const& s, std::uint32_t key, bool write,
                                          std::uint32_t epoch) noexcept {
  s.begin_batch(epoch);
  access_result r;
  r.way = s.find(key);
  r.hit = r.way != no_way;
  if (r.hit) {
    s.touch(r.way);
  } else {
    r.admitted = s.admit(key, s.header->batch);
    r.way      = r.admitted.way;
    r.bypassed = r.way == no_way;
  }
  if (r.way != no_way) {
    s.header->batch |= 1u << r.way;
    if (write) { s.mark_dirty(r.way); }
  }
  return r;
}

}  // namespace wm::detail::cache

#if defined(__CUDACC__)
#include <wm/detail/cache/warp.cuh>
#endif
