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

/// No cache: gathers read the table (the embedding calls the tensor's own gather), the update
/// writes the table.
template <class CachePolicy, class T>
class row_source {
 public:
  row_source() = default;
  row_source(std::size_t, std::size_t, std::size_t, bool, cache_options const&) {}

  /// The update's row locator: the table.
  [[nodiscard]] table_rows<T> locator(table_rows<T> const& table) const noexcept { return table; }
};

/**
 * Checks what a cached table can be before anything is allocated: a ratio in (0, 1]; a group
 * cache only on a table of one rank with a group of one rank (several-rank group caches are not
 * built yet). A device cache on several ranks caches each rank's own rows; gathers of other
 * ranks' rows go through their owners. Returns @p rows.
 */
template <class CachePolicy>
[[nodiscard]] std::size_t check_cache(communicator& comm, std::size_t rows,
                                      cache_options const& cache) {
  if constexpr (caching_policy<CachePolicy>) {
    if constexpr (!CachePolicy::caches_own_rows) {
      std::string const name = CachePolicy::name;
      int const group        = cache.group == nullptr ? 1 : cache.group->size();
      WM_EXPECTS(comm.size() == 1 && group == 1,
                 name + ": a group cache on several ranks is not built yet (a table of " +
                     std::to_string(comm.size()) + " ranks, a group of " + std::to_string(group) +
                     "); use a group of one rank on a table of one rank, or wm::device_cache");
    }
    // The ratio (and the 32-bit tags) checked on the largest part a rank can hold; each rank
    // plans its lines from its own rows when they exist.
    auto const world = static_cast<std::size_t>(comm.size());
    (void)cache::plan_cache<typename CachePolicy::replacement_type::impl>(
        rows / world + (rows % world != 0 ? 1 : 0), cache.ratio);
  }
  return rows;
}

/**
 * A cache in front of this rank's rows: its lines hold rows with their optimizer state; the
 * gather (one rank) or the owner side of the exchange (several) serves hits from lines and admits
 * misses; the update writes cached rows in their lines.
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
            rows, cache.ratio, cache.hash_seed, dim, st_cols, steps, CachePolicy::writable)} {}

  /// The gather of this rank's rows (one rank: every row): hits from lines, misses admitted
  /// (distinct rows read once), then replicated. Dirty victims are staged and written back in
  /// ascending key order after the admissions (no other admission call may overlap this one).
  template <class Index>
  void gather(table_rows<T> const& table, std::size_t rows, std::span<Index const> indices, T* out,
              unsigned* err, cudaStream_t s) {
    lines_->admit(table, rows, indices.data(), indices.size(),
                  static_cast<std::size_t const*>(nullptr),
                  packed_rows{reinterpret_cast<std::byte*>(out), table.w.cols * sizeof(T)}, true,
                  err, false, s, 8, true);
  }
  /// The exchange engine's owner-side reader (several ranks): this rank's rows through its
  /// cache; calls on @p s use the first workspace, calls beside it the second.
  [[nodiscard]] cache::line_reader<T, impl_type> reader(table_rows<T> const& table,
                                                        std::size_t rows, unsigned* err,
                                                        cudaStream_t s) const {
    return {lines_.get(), table, rows, err, s};
  }
  /// prefetch: the gather's admissions without output or request counts (its own workspace, so
  /// it may run on another stream beside a gather).
  template <class Index>
  void prefetch(table_rows<T> const& table, std::size_t rows, std::span<Index const> keys,
                unsigned* err, cudaStream_t s) {
    lines_->admit(table, rows, keys.data(), keys.size(), static_cast<std::size_t const*>(nullptr),
                  packed_rows{nullptr, 0}, false, err, true, s);
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
