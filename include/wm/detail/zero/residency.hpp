// SPDX-License-Identifier: Apache-2.0
// Host-only bookkeeping of ZeRO stage 3's gathered weights (docs/design.md, "ZeRO memory"): which
// buckets are gathered, where in the gather pool they lie, which groups hold them, and what a
// prefetch may bring in without going over the pool. No CUDA here: the optimizer turns the loads
// this returns into all-gathers; tests/zero/residency_test.cpp checks it on the CPU.
//
// Rules:
// - A group is the set of buckets that hold its parameters (a bucket may serve several groups).
// - `acquire(g)` makes every bucket of g resident and held by g; it returns the buckets that are
//   not resident yet, with the pool offsets to gather them into. A bucket a prefetch brought in
//   is taken over without a second gather. Prefetched buckets of other groups are dropped first
//   (the prediction was wrong), so a wrong guess never blocks the group that is asked for.
// - `release(g)` drops g's hold; a bucket no group holds leaves the pool at once (stage 3 keeps
//   only the weights in use: its memory bound is the pool).
// - `prefetch(g)` brings in g's missing buckets only if all of them fit in the free pool now
//   (nothing is evicted for a guess); it returns nothing otherwise. At most one group is
//   prefetched at a time.
// - The pool is a wm::detail::range_allocator: first fit over offsets aligned to `alignment`,
//   adjacent free ranges merged.
#pragma once

#include <wm/detail/base/range_allocator.hpp>
#include <wm/error.hpp>

#include <algorithm>
#include <cstddef>
#include <iterator>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace wm::detail::zero {

/// Which buckets of stage 3 are gathered, and by which groups they are held.
class residency {
 public:
  /// A bucket to gather into the pool at @p offset.
  struct load {
    std::size_t bucket{};
    std::size_t offset{};
    friend bool operator==(load const&, load const&) = default;
  };

  residency() = default;
  /**
   * @param group_buckets the buckets of each group (any order, duplicates allowed)
   * @param bucket_bytes  the bytes of each bucket
   * @param pool_bytes    the gather pool's size
   * @throw wm::logic_error if a group names an unknown bucket or does not fit in the pool alone
   */
  residency(std::vector<std::vector<std::size_t>> group_buckets,
            std::vector<std::size_t> bucket_bytes, std::size_t pool_bytes,
            std::size_t alignment = 256)
      : groups_{std::move(group_buckets)},
        bytes_{std::move(bucket_bytes)},
        pool_{pool_bytes, alignment},
        state_(bytes_.size()),
        held_(groups_.size(), false) {
    for (auto& g : groups_) {
      std::sort(g.begin(), g.end());
      g.erase(std::unique(g.begin(), g.end()), g.end());
      std::vector<std::size_t> sizes;
      for (auto b : g) {
        WM_EXPECTS(b < bytes_.size(), "group buckets below the bucket count");
        sizes.push_back(bytes_[b]);
      }
      WM_EXPECTS((range_allocator{pool_bytes, alignment}.fits_all(sizes)),
                 "a gather pool (prefetch budget) that holds the largest group alone: a group "
                 "needs " +
                     std::to_string(sum(sizes)) + " bytes, the pool has " +
                     std::to_string(pool_bytes));
    }
  }

  [[nodiscard]] std::size_t groups() const noexcept { return groups_.size(); }
  [[nodiscard]] std::vector<std::size_t> const& buckets(std::size_t g) const {
    return groups_.at(g);
  }
  [[nodiscard]] bool held(std::size_t g) const { return held_.at(g); }
  [[nodiscard]] bool any_held() const noexcept {
    return std::find(held_.begin(), held_.end(), true) != held_.end();
  }
  /// Where bucket @p b lies in the pool, if it is resident (held or prefetched).
  [[nodiscard]] std::optional<std::size_t> offset(std::size_t b) const {
    auto const& s = state_.at(b);
    return s.resident ? std::optional<std::size_t>{s.offset} : std::nullopt;
  }
  /// Whether a gathered group holds bucket @p b (its weights may be read).
  [[nodiscard]] bool held_bucket(std::size_t b) const { return state_.at(b).holders > 0; }
  /// The group whose buckets the last prefetch brought in (and nobody acquired yet), if any.
  [[nodiscard]] std::optional<std::size_t> prefetched() const noexcept { return prefetched_; }
  [[nodiscard]] range_allocator const& pool() const noexcept { return pool_; }

  /**
   * @brief Makes group @p g resident and held; returns the buckets to gather now.
   * @throw wm::logic_error if @p g is held already, or its buckets do not fit beside the groups
   * still held (release them first)
   */
  [[nodiscard]] std::vector<load> acquire(std::size_t g) {
    WM_EXPECTS(g < groups_.size(), "a group index below the group count");
    WM_EXPECTS(!held_[g], "a group that is not gathered already (release it first)");
    if (prefetched_ && *prefetched_ != g) { drop_prefetch(); }
    std::vector<std::size_t> sizes;
    for (auto b : groups_[g]) {
      if (!state_[b].resident) { sizes.push_back(bytes_[b]); }
    }
    if (!pool_.fits_all(sizes)) {
      throw logic_error{"wm: zero_optimizer::gather: group " + std::to_string(g) +
                        " does not fit in the gather pool beside the groups still gathered; "
                        "release them first or declare a larger prefetch budget"};
    }
    prefetched_.reset();
    std::vector<load> out;
    for (auto b : groups_[g]) {
      auto& s    = state_[b];
      s.prefetch = false;
      if (!s.resident) {
        s.resident = true;
        s.offset   = pool_.allocate(bytes_[b]);
        out.push_back({b, s.offset});
      }
    }
    for (auto b : groups_[g]) { ++state_[b].holders; }
    held_[g] = true;
    return out;
  }

  /// Drops @p g's hold; buckets no group holds leave the pool. @throw wm::logic_error if not held
  void release(std::size_t g) {
    WM_EXPECTS(g < groups_.size() && held_[g], "a group that is gathered");
    held_[g] = false;
    for (auto b : groups_[g]) {
      auto& s = state_[b];
      if (--s.holders == 0 && !s.prefetch) {
        s.resident = false;
        pool_.free(s.offset);
      }
    }
  }

  /**
   * @brief Brings in group @p g's missing buckets if they all fit in the free pool now and no
   * other prefetch is pending; returns the buckets to gather (empty if nothing to do or no room).
   */
  [[nodiscard]] std::vector<load> prefetch(std::size_t g) {
    if (g >= groups_.size() || held_[g] || prefetched_) { return {}; }
    std::vector<std::size_t> sizes;
    for (auto b : groups_[g]) {
      if (!state_[b].resident) { sizes.push_back(bytes_[b]); }
    }
    if (sizes.empty() || !pool_.fits_all(sizes)) { return {}; }
    std::vector<load> out;
    for (auto b : groups_[g]) {
      auto& s = state_[b];
      if (s.resident) { continue; }
      s.resident = true;
      s.prefetch = true;
      s.offset   = pool_.allocate(bytes_[b]);
      out.push_back({b, s.offset});
    }
    prefetched_ = g;
    return out;
  }

  /// Drops the pending prefetch, if any (its buckets leave the pool unless a group holds them).
  void drop_prefetch() {
    if (!prefetched_) { return; }
    for (auto b : groups_[*prefetched_]) {
      auto& s = state_[b];
      if (s.prefetch) {
        s.prefetch = false;
        if (s.holders == 0) {
          s.resident = false;
          pool_.free(s.offset);
        }
      }
    }
    prefetched_.reset();
  }

 private:
  struct bucket_state {
    bool resident{false};
    bool prefetch{false};  // brought in by a prefetch, not acquired yet
    std::size_t offset{};
    int holders{0};
  };

  static std::size_t sum(std::vector<std::size_t> const& v) {
    std::size_t s = 0;
    for (auto x : v) { s += x; }
    return s;
  }

  std::vector<std::vector<std::size_t>> groups_;
  std::vector<std::size_t> bytes_;
  range_allocator pool_;
  std::vector<bucket_state> state_;
  std::vector<bool> held_;
  std::optional<std::size_t> prefetched_;
};

}  // namespace wm::detail::zero
