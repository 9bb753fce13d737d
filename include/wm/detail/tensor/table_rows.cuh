// SPDX-License-Identifier: Apache-2.0
// Where the owner-side update (and a cache's admissions and write-backs) find one row's values:
// the weight row, its optimizer state and its step. The update kernel is written against a row
// locator (table_rows here; a cache's line_locator in detail/cache/lines_ref.cuh), so the
// arithmetic is the same code whether a row lives in the table or in a cache line.
#pragma once

#include <wm/tensor.cuh>

#include <cstddef>
#include <cstdint>

namespace wm::detail {

/// One row's values as the update reads and writes them.
template <class T>
struct row_place {
  T* w{};                ///< dim values
  float* st{};           ///< Optimizer::states x dim floats (null: the optimizer has none)
  std::int64_t* step{};  ///< the row's step count (null: no per-row steps)
};

/// This rank's rows in the table: weights, optimizer states, per-row steps (no cache).
template <class T>
struct table_rows {
  using place_type = row_place<T>;

  matrix_view<T> w;            ///< this rank's weights
  matrix_view<float> st;       ///< this rank's states (data null: none)
  std::int64_t* steps{};       ///< this rank's per-row steps (null: none)
  std::size_t step_stride{1};  ///< elements between rows' steps (records: the row stride)

  /// Local row @p key.
  [[nodiscard]] WM_HOST_DEVICE place_type locate(std::uint32_t key) const noexcept {
    return {w.row(key), st.data != nullptr ? st.row(key) : nullptr,
            steps != nullptr ? steps + static_cast<std::size_t>(key) * step_stride : nullptr};
  }
  /// After the update wrote @p p (nothing to record for the table).
  __device__ void written(place_type const&) const noexcept {}
};

}  // namespace wm::detail
