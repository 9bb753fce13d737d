// SPDX-License-Identifier: Apache-2.0
// One rank's cache lines as kernels see them (lines_ref, trivially copyable) and the row locator
// through which the owner-side update finds a row in its line or in the table (line_locator).
//
// Line payload: line (s, w) holds, in slot s * 32 + w, the weight row (dim values of T), every
// optimizer state of that row (Optimizer::states x dim floats) and Adam's per-row step, so a hit
// never crosses PCIe and a cached row is updated without touching the table.
#pragma once

#include <wm/config.hpp>
#include <wm/detail/cache/set.hpp>
#include <wm/detail/cache/statistics.hpp>
#include <wm/detail/tensor/table_rows.cuh>

#include <cstddef>
#include <cstdint>

namespace wm::detail::cache {

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

}  // namespace wm::detail::cache
