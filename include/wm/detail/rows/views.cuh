// SPDX-License-Identifier: Apache-2.0
// Row views: where the row movers, the distinct plan and the caches find row k. Each gives a
// row's first byte; the element type only sets the stride. Mapped rows go through the per-rank
// chunk pointers and a mapping; local rows are this rank's part; packed rows a dense buffer.
#pragma once

#include <wm/config.hpp>
#include <wm/partition.hpp>

#include <cstddef>
#include <type_traits>

namespace wm::detail {

/// Rows reached through per-rank chunk pointers (mapped layouts).
template <class Mapping>
struct mapped_rows {
  std::byte* const* chunks;
  mapping_ref<Mapping> map;
  std::size_t stride_bytes;
  [[nodiscard]] __device__ std::size_t rows() const { return map.rows(); }
  [[nodiscard]] __device__ std::byte* row(std::size_t k) const {
    auto const at = map.locate(k);
    return chunks[at.rank] + at.local * stride_bytes;
  }
};

/// This rank's rows, by local index (distributed layout, owner side).
struct local_rows {
  std::byte* base;
  std::size_t n_rows;
  std::size_t stride_bytes;
  [[nodiscard]] __device__ std::size_t rows() const { return n_rows; }
  [[nodiscard]] __device__ std::byte* row(std::size_t k) const { return base + k * stride_bytes; }
};

/// Packed rows in a buffer (send/receive buffers, caller-provided values/out).
struct packed_rows {
  std::byte* base;
  std::size_t stride_bytes;
  [[nodiscard]] __device__ std::byte* row(std::size_t i) const { return base + i * stride_bytes; }
};

template <class Index>
[[nodiscard]] __device__ inline bool valid_index(Index k, std::size_t rows) {
  if constexpr (std::is_signed_v<Index>) {
    if (k < 0) { return false; }
  }
  return static_cast<std::size_t>(k) < rows;
}

}  // namespace wm::detail
