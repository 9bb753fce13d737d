// SPDX-License-Identifier: Apache-2.0
// Host-only bookkeeping of the offload pipeline's spare host regions (wm::zero_optimizer with
// wm::offload_host and zero_options::offload_pipeline). No CUDA here; the optimizer
// turns what this returns into CPU Adam calls; tests/zero/residency_test.cpp checks it on the CPU.
//
// The pipeline updates a bucket's shard in chunks as its gradients land, before `step` knows
// whether the step applies as assumed (its decision: the gradient norm, the learning rate). A
// chunk updated before the decision must not overwrite its current master weights and moments,
// so it writes somewhere else; after the decision a chunk is updated in place.
//
// Rules:
// - Every chunk has its place (`home`: its range of the contiguous master / moment arrays) and at
//   most one spare region (a pool of equal regions, each as large as the largest chunk) that may
//   hold its current values instead.
// - `ahead(c)`, an update before the decision: a chunk whose values are in a region writes them
//   back to its place (no region needed); a chunk at its place takes a free region to write into,
//   or gets nothing if none is free (the caller then waits for the decision and calls `settle`).
//   Every chunk updated ahead holds one region until the decision, so at most `regions()` are.
// - `commit()`, the step applies as assumed: the chunks updated ahead take what they wrote as
//   current; a region that is no longer current is freed. `drop()`, it does not: what the chunks
//   wrote ahead is forgotten, the regions they took are freed; their current values are unchanged.
// - `settle(c)`, an update after the decision (or a copy back to the place, `release`): the chunk
//   reads from where its values are and writes them to its place; the region it read from is free
//   from then on (the caller reads it before it takes another region: the bookkeeping is not
//   thread-safe, one thread uses it at a time).
// - Each chunk is updated at most once between two decisions.
#pragma once

#include <wm/error.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace wm::detail::zero {

/// Where each chunk's current master weights and moments are: its place, or a spare region.
class spare_regions {
 public:
  using region_index                 = std::uint32_t;
  static constexpr region_index home = ~region_index{0};  ///< the chunk's own place

  spare_regions() = default;
  /// @p chunks chunks, all at home; @p regions free spare regions.
  spare_regions(std::size_t chunks, std::size_t regions)
      : current_(chunks, home), pending_(chunks, none), free_(regions) {
    WM_EXPECTS(regions < home - 1, "fewer spare regions than 2^32 - 2");
    // Taken from the back: region 0 first.
    for (std::size_t r = 0; r < regions; ++r) {
      free_[r] = static_cast<region_index>(regions - 1 - r);
    }
    regions_ = regions;
  }

  [[nodiscard]] std::size_t chunks() const noexcept { return current_.size(); }
  [[nodiscard]] std::size_t regions() const noexcept { return regions_; }
  [[nodiscard]] std::size_t free_regions() const noexcept { return free_.size(); }
  /// Regions not free (current values of a chunk, or written ahead by one).
  [[nodiscard]] std::size_t in_use() const noexcept { return regions_ - free_.size(); }
  /// The most regions in use at once so far.
  [[nodiscard]] std::size_t peak_in_use() const noexcept { return peak_; }
  /// Chunks whose current values are in a region.
  [[nodiscard]] std::size_t away() const noexcept { return away_; }
  /// Chunks updated ahead since the last decision.
  [[nodiscard]] std::size_t pending() const noexcept { return pending_count_; }
  /// Where chunk @p c's current values are: a region, or `home`.
  [[nodiscard]] region_index current(std::size_t c) const { return current_.at(c); }

  /**
   * @brief An update of chunk @p c before the decision: where it writes (`home` if its values
   * are in a region, else a region it takes), or nothing if it is at home and no region is free
   * (then nothing changed).
   */
  [[nodiscard]] std::optional<region_index> ahead(std::size_t c) {
    WM_EXPECTS(c < current_.size(), "a chunk index below the chunk count");
    WM_EXPECTS(pending_[c] == none, "a chunk updated once per step");
    region_index to = home;
    if (current_[c] == home) {
      if (free_.empty()) { return std::nullopt; }
      to = free_.back();
      free_.pop_back();
      peak_ = std::max(peak_, in_use());
    }
    pending_[c] = to;
    ++pending_count_;
    return to;
  }

  /// The step applied as assumed: what the chunks wrote ahead is current.
  void commit() {
    for (std::size_t c = 0; c < current_.size() && pending_count_ > 0; ++c) {
      region_index const to = pending_[c];
      if (to == none) { continue; }
      if (to == home) {  // back at its place: the region it was in is free
        free_.push_back(current_[c]);
        --away_;
      } else {
        ++away_;
      }
      current_[c] = to;
      pending_[c] = none;
      --pending_count_;
    }
  }

  /// The step did not apply as assumed: what the chunks wrote ahead is forgotten.
  void drop() {
    for (std::size_t c = 0; c < current_.size() && pending_count_ > 0; ++c) {
      region_index const to = pending_[c];
      if (to == none) { continue; }
      if (to != home) { free_.push_back(to); }
      pending_[c] = none;
      --pending_count_;
    }
  }

  /**
   * @brief An update of chunk @p c after the decision (or its copy back home): returns where it
   * reads (`home`: in place); its values are at home afterwards and that region is free.
   */
  region_index settle(std::size_t c) {
    WM_EXPECTS(c < current_.size(), "a chunk index below the chunk count");
    WM_EXPECTS(pending_[c] == none, "a chunk updated once per step");
    region_index const from = current_[c];
    if (from != home) {
      free_.push_back(from);
      current_[c] = home;
      --away_;
    }
    return from;
  }

 private:
  static constexpr region_index none = home - 1;  // pending_: not updated ahead
  std::vector<region_index> current_;
  std::vector<region_index> pending_;
  std::vector<region_index> free_;
  std::size_t regions_{0};
  std::size_t peak_{0};
  std::size_t away_{0};
  std::size_t pending_count_{0};
};

}  // namespace wm::detail::zero
