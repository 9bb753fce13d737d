// SPDX-License-Identifier: Apache-2.0
// How big a cache is: sets from (rows, ratio), and what its metadata costs. Host only.
//
// lines wanted = ceil(ratio * rows), rounded up to whole 32-way sets (at least one set when rows
// > 0). Because the set index is a hash, a cache with as many lines as rows (ratio 1) does not
// hold every row at once: about 7% of the rows fall into sets that already hold 32 (the binomial
// spread of 32 keys per set); set_test measures it.
#pragma once

#include <wm/detail/cache/set.hpp>
#include <wm/error.hpp>

#include <cstddef>
#include <cstdint>
#include <string>

namespace wm::detail::cache {

/// The geometry of one rank's cache.
struct cache_plan {
  std::uint32_t sets{};          ///< 32-way sets (0 only for a part of 0 rows)
  std::size_t lines{};           ///< sets * 32
  std::size_t metadata_bytes{};  ///< tags, states and set headers (24 bytes per set)
};

/**
 * @brief The cache geometry for a part of @p rows rows cached at @p ratio with policy Impl.
 * @throw wm::logic_error if ratio is not in (0, 1] or rows >= 2^32 (tags are 32-bit keys)
 */
template <class Impl>
[[nodiscard]] cache_plan plan_cache(std::size_t rows, double ratio) {
  WM_EXPECTS(ratio > 0.0 && ratio <= 1.0,
             "the cache ratio must be in (0, 1], got " + std::to_string(ratio));
  WM_EXPECTS(rows <= 0xffffffffull,
             "a cache keys rows by 32-bit tags: at most 2^32 rows per cached part, got " +
                 std::to_string(rows));
  cache_plan p;
  if (rows == 0) { return p; }
  auto wanted = static_cast<std::size_t>(ratio * static_cast<double>(rows));
  if (static_cast<double>(wanted) < ratio * static_cast<double>(rows)) { ++wanted; }
  std::size_t const sets = (wanted + ways - 1) / ways;
  p.sets                 = static_cast<std::uint32_t>(sets < 1 ? 1 : sets);
  p.lines                = static_cast<std::size_t>(p.sets) * ways;
  p.metadata_bytes =
      static_cast<std::size_t>(p.sets) *
      (ways * (sizeof(std::uint32_t) + sizeof(typename Impl::state_type)) + sizeof(set_header));
  return p;
}

}  // namespace wm::detail::cache
