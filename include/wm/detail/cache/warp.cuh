// SPDX-License-Identifier: Apache-2.0
// Warp-cooperative versions of the set bookkeeping (set.hpp): lane w handles way w; a probe is one
// coalesced read of the 32 tags and one __ballot_sync. Every function is called by all 32 lanes of
// a warp with the same arguments (full mask) and gives the same result as the sequential
// set_ref function of the same name; one warp owns the set for the duration of the call (the
// kernels group keys by set so that no two warps change one set at once).
#pragma once

#include <wm/detail/cache/set.hpp>

#include <cstdint>

namespace wm::detail::cache {

/// The way holding @p key, or no_way (same value in every lane).
template <class Impl>
__device__ int warp_find(set_ref<Impl> const& s, std::uint32_t key, unsigned lane) noexcept {
  std::uint32_t const valid = s.header->valid;
  bool const match          = ((valid >> lane) & 1u) != 0 && s.tags[lane] == key;
  std::uint32_t const found = __ballot_sync(full_warp, match);
  return found != 0 ? lowest_way(found) : no_way;
}

/// The lane's order by (state, way) among the 32 lines (set_ref::rank_of).
template <class State>
__device__ int warp_rank(State mine, unsigned lane) noexcept {
  int r = 0;
  for (int v = 0; v < ways; ++v) {
    auto const other = static_cast<State>(__shfl_sync(full_warp, static_cast<unsigned>(mine), v));
    if (other < mine || (other == mine && v < static_cast<int>(lane))) { ++r; }
  }
  return r;
}

/// The victim way among those not in @p exclude (set_ref::victim): lowest invalid way, else
/// lowest state, lowest way on ties; no_way when every way is excluded.
template <class Impl>
__device__ int warp_victim(set_ref<Impl> const& s, unsigned lane,
                           std::uint32_t exclude = 0) noexcept {
  std::uint32_t const allowed = ~exclude;
  if (allowed == 0) { return no_way; }
  std::uint32_t const invalid = ~s.header->valid & allowed;
  if (invalid != 0) { return lowest_way(invalid); }
  bool const candidate = ((allowed >> lane) & 1u) != 0;
  // Excluded lanes offer the largest value; the ballot below skips them even on a tie with it.
  auto const mine    = candidate ? static_cast<unsigned>(s.states[lane]) : 0xffffffffu;
  unsigned const low = __reduce_min_sync(full_warp, mine);
  return lowest_way(__ballot_sync(full_warp, candidate && mine == low));
}

/// Every line's state decayed (set_ref::decay); the states are stored.
template <class Impl>
__device__ void warp_decay(set_ref<Impl> const& s, unsigned lane) noexcept {
  auto const mine = s.states[lane];
  auto const next = Impl::decayed(mine, warp_rank(mine, lane));
  __syncwarp();
  s.states[lane] = next;
  if (lane == 0) { Impl::after_decay(*s.header); }
  __syncwarp();
}

/// The replacement update of a hit on @p way (set_ref::touch).
template <class Impl>
__device__ void warp_touch(set_ref<Impl> const& s, int way, unsigned lane) noexcept {
  using state_type = typename Impl::state_type;
  auto const touched =
      static_cast<state_type>(__shfl_sync(full_warp, static_cast<unsigned>(s.states[lane]), way));
  if (Impl::needs_decay(touched, *s.header)) { warp_decay(s, lane); }
  state_type mine = s.states[lane];
  if (static_cast<int>(lane) == way) { mine = Impl::hit(mine, *s.header); }
  s.states[lane] = mine;
  __syncwarp();
}

/// Puts @p key (not present) into the victim way among those not in @p exclude
/// (set_ref::admit); with every way excluded nothing changes and the way is no_way.
template <class Impl>
__device__ admission warp_admit(set_ref<Impl> const& s, std::uint32_t key, unsigned lane,
                                std::uint32_t exclude = 0) noexcept {
  admission a;
  if (exclude == all_ways) { return a; }
  if (Impl::admit_needs_decay(*s.header)) { warp_decay(s, lane); }
  a.way                   = warp_victim(s, lane, exclude);
  std::uint32_t const bit = 1u << a.way;
  set_header const h      = *s.header;
  a.evicted               = (h.valid & bit) != 0;
  a.write_back            = (h.dirty & bit) != 0;
  a.old_key               = s.tags[a.way];
  __syncwarp();
  if (static_cast<int>(lane) == a.way) {
    s.states[lane] = Impl::admitted(s.states[lane], a.evicted, *s.header);
    s.tags[lane]   = key;
    s.header->valid |= bit;
    s.header->dirty &= ~bit;
  }
  __syncwarp();
  return a;
}

/// Starts batch @p epoch in the set (set_ref::begin_batch), by lane 0.
template <class Impl>
__device__ void warp_begin_batch(set_ref<Impl> const& s, std::uint32_t epoch,
                                 unsigned lane) noexcept {
  if (lane == 0) { s.begin_batch(epoch); }
  __syncwarp();
}

/// One access of batch @p epoch (batch_access() in set.hpp), by the whole warp.
template <class Impl>
__device__ access_result warp_batch_access(set_ref<Impl> const& s, std::uint32_t key, bool write,
                                           std::uint32_t epoch, unsigned lane) noexcept {
  warp_begin_batch(s, epoch, lane);
  access_result r;
  r.way = warp_find(s, key, lane);
  r.hit = r.way != no_way;
  if (r.hit) {
    warp_touch(s, r.way, lane);
  } else {
    r.admitted = warp_admit(s, key, lane, s.header->batch);
    r.way      = r.admitted.way;
    r.bypassed = r.way == no_way;
  }
  if (r.way != no_way && lane == 0) {
    s.header->batch |= 1u << r.way;
    if (write) { s.mark_dirty(r.way); }
  }
  __syncwarp();
  return r;
}

}  // namespace wm::detail::cache
