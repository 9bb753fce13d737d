// The seam a cache policy plugs into: where an embedding's gather reads rows and where the
// owner-side update writes them. Without a cache (wm::no_cache) both are the table itself; with
// a cache (wm::device_cache, wm::group_cache) the rank's lines stand in front of the table.
#pragma once

#include <wm/cache.hpp>
#include <wm/comm.hpp>
#include <wm/detail/cache/lines.cuh>
#include <wm/detail/embedding/rows.cuh>
#include <wm/embedding.cuh>
#include <wm/error.hpp>

#include <cuda/stream_ref>

#include <memory>
#include <span>
#include <string>

namespace wm::detail {

/// No cache: gathers read the table (the tensor's own gather), the update writes the table.
template <class CachePolicy, class T>
class row_source {
 public:
  row_source() = default;
  row_source(std::size_t, std::size_t, std::size_t, bool, cache_options const&) {}

  /// The gather's read path: `out[i, :] = table[indices[i], :]` (the tensor's gather).
  template <class Table, class Index>
  void gather(Table& table, table_rows<T> const&, std::size_t, std::span<Index const> indices,
              T* out, unsigned*, cudaStream_t s) {
    table.gather(indices, out, cuda::stream_ref{s});
  }
  /// The update's row locator: the table.
  [[nodiscard]] table_rows<T> locator(table_rows<T> const& table) const noexcept { return table; }
};

/**
 * Checks what a cached table can be before anything is allocated: one rank only (the
 * several-rank path, through the row owners, is not built yet), a ratio in (0, 1], and for a
 * group cache a group of one rank. Returns @p rows.
 */
template <class CachePolicy>
[[nodiscard]] std::size_t check_cache(communicator& comm, std::size_t rows,
                                      cache_options const& cache) {
  if constexpr (caching_policy<CachePolicy>) {
    std::string const name = CachePolicy::name;
    WM_EXPECTS(comm.size() == 1, name + ": caches on several ranks are not built yet (a table of " +
                                     std::to_string(comm.size()) +
                                     " ranks); use one rank per table, or wm::no_cache on several");
    WM_EXPECTS(cache.group == nullptr || cache.group->size() == 1,
               name + ": a cache group of several ranks is not built yet (group of " +
                   std::to_string(cache.group == nullptr ? 0 : cache.group->size()) + " ranks)");
    (void)cache::plan_cache<typename CachePolicy::replacement_type::impl>(rows, cache.ratio);
  }
  return rows;
}

/**
 * A cache in front of the table (one rank): its lines hold rows with their optimizer state; the
 * gather serves hits from lines and admits misses, the update writes cached rows in their lines.
 */
template <caching_policy CachePolicy, class T>
class row_source<CachePolicy, T> {
 public:
  using impl_type = typename CachePolicy::replacement_type::impl;

  row_source() = default;
  /// Lines for @p rows local rows of @p dim values, @p st_cols state floats and (@p steps) a
  /// per-row step each.
  row_source(std::size_t rows, std::size_t dim, std::size_t st_cols, bool steps,
             cache_options const& cache)
      : lines_{std::make_unique<cache::line_storage<T, impl_type>>(
            rows, cache.ratio, cache.hash_seed, dim, st_cols, steps)} {}

  /// The gather: hits from lines, misses admitted (distinct rows read once), then replicated.
  template <class Table, class Index>
  void gather(Table&, table_rows<T> const& table, std::size_t rows, std::span<Index const> indices,
              T* out, unsigned* err, cudaStream_t s) {
    lines_->admit(table, rows, indices, out, true, err, s);
  }
  /// prefetch: the gather's admissions without output or request counts.
  template <class Index>
  void prefetch(table_rows<T> const& table, std::size_t rows, std::span<Index const> keys,
                unsigned* err, cudaStream_t s) {
    lines_->admit(table, rows, keys, static_cast<T*>(nullptr), false, err, s);
  }
  /// The update's row locator: the row's line, else the table.
  [[nodiscard]] cache::line_locator<T, impl_type> locator(table_rows<T> const& table) const {
    return lines_->locator(table);
  }
  /// Dirty lines written back; with @p drop every line emptied.
  void write_back(table_rows<T> const& table, bool drop, cudaStream_t s) {
    lines_->write_back(table, drop, s);
  }
  [[nodiscard]] cache_statistics statistics() const { return lines_->statistics(); }
  void reset_statistics() { lines_->reset_statistics(); }
  [[nodiscard]] std::size_t lines() const noexcept { return lines_ ? lines_->lines() : 0; }

 private:
  std::unique_ptr<cache::line_storage<T, impl_type>> lines_;
};

}  // namespace wm::detail
