// SPDX-License-Identifier: Apache-2.0
// The engine a group cache names (wm::group_cache::storage_type): on several ranks the group's
// shared lines (group_lines.cuh), on one rank the lines of its own rows, which are the whole table
// (line_storage.cuh, read-only: nothing is ever dirty). Which of the two a table gets depends on
// its communicator, not on the policy: it is chosen once, when the lines are built.
#pragma once

#include <wm/cache.hpp>
#include <wm/comm.hpp>
#include <wm/detail/cache/group_lines.cuh>
#include <wm/detail/cache/line_storage.cuh>
#include <wm/detail/cache/lines_ref.cuh>
#include <wm/detail/tensor/table_rows.cuh>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>
#include <variant>

namespace wm::detail::cache {

/**
 * A group cache's lines: the group's shared lines (line_options::shared) or, on one rank, the
 * lines of its own rows. Collective over the communicator it is built on, as the one it holds.
 */
template <class T, class Impl>
class group_storage {
 public:
  /// Builds the lines @p o asks for over @p comm (the group when @p o.shared, else the table's).
  group_storage(communicator& comm, line_options const& o) : lines_{make(comm, o)} {}

  /// The lines of this rank's own rows (one rank), or null (shared lines).
  [[nodiscard]] line_storage<T, Impl>* own_lines() noexcept {
    return std::get_if<line_storage<T, Impl>>(&lines_);
  }
  /// Whether the lines are shared over the group (several ranks).
  [[nodiscard]] bool shared() const noexcept {
    return std::holds_alternative<group_lines<T, Impl>>(lines_);
  }
  /// Calls @p f with the group's shared lines, if these are they.
  template <class F>
  void with_shared(F&& f) {
    if (auto* const g = std::get_if<group_lines<T, Impl>>(&lines_)) { std::forward<F>(f)(*g); }
  }

  /// The update's locator: a group cache is read-only, so shared lines hold no row the update
  /// could write (rows are found in the table).
  [[nodiscard]] line_locator<T, Impl> locator(table_rows<T> const& table) const noexcept {
    if (auto const* const own = std::get_if<line_storage<T, Impl>>(&lines_)) {
      return own->locator(table);
    }
    return {table, {}};
  }
  /// Dirty lines written back (none: read-only); with @p drop every line emptied.
  void write_back(table_rows<T> const& table, bool drop, cudaStream_t s) {
    if (auto* const g = std::get_if<group_lines<T, Impl>>(&lines_)) {
      if (drop) { g->invalidate(s); }
      return;
    }
    std::get<line_storage<T, Impl>>(lines_).write_back(table, drop, s);
  }
  [[nodiscard]] cache_statistics statistics() const {
    return std::visit([](auto const& l) { return l.statistics(); }, lines_);
  }
  void reset_statistics() {
    std::visit([](auto& l) { l.reset_statistics(); }, lines_);
  }
  [[nodiscard]] std::size_t lines() const noexcept {
    return std::visit([](auto const& l) { return l.lines(); }, lines_);
  }

 private:
  using lines_type = std::variant<line_storage<T, Impl>, group_lines<T, Impl>>;

  /// The lines, built in place (neither kind moves).
  [[nodiscard]] static lines_type make(communicator& comm, line_options const& o) {
    if (o.shared) {
      return lines_type{
          std::in_place_type<group_lines<T, Impl>>, comm, o.rows, o.ratio, o.seed, o.dim};
    }
    return lines_type{std::in_place_type<line_storage<T, Impl>>, comm, o};
  }

  lines_type lines_;
};

}  // namespace wm::detail::cache
