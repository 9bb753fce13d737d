// SPDX-License-Identifier: Apache-2.0
/**
 * @file decl/cache.hpp
 * @brief The declarations of `<wm/cache.hpp>` without their bodies, for `<wm/wm.cuh>`: every
 * type and signature, none of the definitions (docs/design.md, "Compile time").
 */
#pragma once

#include <concepts>
#include <cstdint>
#include <type_traits>

namespace wm {

class communicator;

namespace detail::cache {
struct lfu_impl;
struct lru_impl;
template <class T, class Impl>
class line_storage;  // a device cache's lines (detail/cache/line_storage.cuh)
template <class T, class Impl>
class group_storage;  // a group cache's lines (detail/cache/group_storage.cuh)
}  // namespace detail::cache

// ---------------------------------------------------------------------------------------------
// Access

/** @brief Cache access: lines are never written; nothing is written back. */
struct read_only {
  /// For messages.
  static constexpr char const* name = "read_only";
  static constexpr bool writable    = false;  ///< an optimizer may not update through it
};

/** @brief Cache access: lines are updated in place, marked dirty and written back on eviction
 * and on `flush()` (write-back). */
struct read_write {
  /// For messages.
  static constexpr char const* name = "read_write";
  static constexpr bool writable    = true;  ///< an optimizer may update through it
};

/**
 * @brief A cache access type: `static constexpr char const* name` and
 * `static constexpr bool writable` (`wm::read_only`, `wm::read_write`).
 */
template <class A>
concept cache_access = requires {
  { A::name } -> std::convertible_to<char const*>;
  { A::writable } -> std::convertible_to<bool>;
};

// ---------------------------------------------------------------------------------------------
// Replacement

/**
 * @brief Replacement: least frequently used, with decay. Each line keeps a 16-bit use count; a
 * hit adds one; when a count would overflow, every count of the set is halved first (old
 * popularity fades); a newly admitted line starts at the evicted line's count + 1 (LFU with
 * dynamic aging), so a newcomer is not the next victim of its set by construction. The victim
 * is an invalid way if any, else the way with the lowest count (lowest way index on ties),
 * among the ways the current batch has not used (see wm::cache_statistics::bypasses).
 */
struct lfu {
  /// For messages.
  static constexpr char const* name = "lfu";
  using impl                        = detail::cache::lfu_impl;  ///< the set bookkeeping
};

/**
 * @brief Replacement: least recently used. Each set has a 32-bit use clock; a hit or an
 * admission stamps the line with the next clock value; the victim is an invalid way if any, else
 * the way with the oldest stamp, among the ways the current batch has not used. When the clock
 * would wrap, the set's stamps are renumbered 1..32 in their order (rare: 2^32 uses of one set).
 */
struct lru {
  /// For messages.
  static constexpr char const* name = "lru";
  using impl                        = detail::cache::lru_impl;  ///< the set bookkeeping
};

/**
 * @brief A replacement policy: a `name` and an `impl` type that supplies the per-line state and
 * its updates (see `wm::detail::cache::lfu_impl`); the set code never asks which policy it got.
 */
template <class R>
concept replacement_policy = requires {
  { R::name } -> std::convertible_to<char const*>;
  typename R::impl;
};

// ---------------------------------------------------------------------------------------------
// Cache policies

/**
 * @brief Device-cached host table: each GPU caches rows of its own part in its own memory.
 * @tparam Access `wm::read_write` (default: trainable, write-back) or `wm::read_only`
 * @tparam Replacement `wm::lfu` (default) or `wm::lru`
 */
template <cache_access Access = read_write, replacement_policy Replacement = lfu>
struct device_cache {
  using access_type                     = Access;            ///< `read_write` or `read_only`
  using replacement_type                = Replacement;       ///< `lfu` or `lru`
  static constexpr char const* name     = "device_cache";    ///< for messages
  static constexpr bool writable        = Access::writable;  ///< write-back with `read_write`
  static constexpr bool caches_own_rows = true;  ///< each rank caches rows of its own part
  /// The lines of a table of @p T rows: each rank's own, in its device memory.
  template <class T>
  using storage_type = detail::cache::line_storage<T, typename Replacement::impl>;
};

/**
 * @brief Group-cached global table: a subset of the table's ranks (`cache_options::group`)
 * cache the whole table together, each rank the rows hashed to it; peers read each other's
 * lines. Always read-only.
 * @tparam Replacement `wm::lfu` (default) or `wm::lru`
 */
template <replacement_policy Replacement = lfu>
struct group_cache {
  using access_type                     = read_only;      ///< always `read_only`
  using replacement_type                = Replacement;    ///< `lfu` or `lru`
  static constexpr char const* name     = "group_cache";  ///< for messages
  static constexpr bool writable        = false;          ///< read-only by nature
  static constexpr bool caches_own_rows = false;          ///< the group caches the whole table
  /// The lines of a table of @p T rows: shared over the group (one rank: its own).
  template <class T>
  using storage_type = detail::cache::group_storage<T, typename Replacement::impl>;
};

/**
 * @brief Whether an embedding with cache policy @p C may be trained (updated through an
 * optimizer). A policy without a `writable` member caches nothing (`wm::no_cache`) and is
 * writable; otherwise its `writable` constant decides.
 */
template <class C>
struct is_writable_cache : std::true_type {};

/// A policy with a `writable` member: that constant decides (see the primary template).
template <class C>
requires requires {
  { C::writable } -> std::convertible_to<bool>;
}
struct is_writable_cache<C> : std::bool_constant<static_cast<bool>(C::writable)> {};

/// `is_writable_cache<C>::value`: whether an embedding with cache policy @p C may be trained.
template <class C>
inline constexpr bool is_writable_cache_v = is_writable_cache<C>::value;

/**
 * @brief A cache policy through which an optimizer may update rows: `wm::no_cache`,
 * `wm::device_cache<wm::read_write, R>`; not `wm::device_cache<wm::read_only, R>` nor
 * `wm::group_cache<R>`. The embedding rejects a trainable optimizer (a sparse optimizer policy,
 * <wm/optimizer.hpp>) with any other policy at compile time, with the message
 * `WM_CACHE_READ_ONLY_MESSAGE`.
 */
template <class C>
concept writable_cache = is_writable_cache_v<C>;

/// The compile-time message for an optimizer on a cache that cannot be written (a macro because
/// a C++20 static_assert takes a string literal).
#define WM_CACHE_READ_ONLY_MESSAGE                                                            \
  "this cache policy is read-only (wm::group_cache, or wm::device_cache<wm::read_only>): an " \
  "embedding with it cannot be trained; use wm::no_optimizer, or "                            \
  "wm::device_cache<wm::read_write> for a trainable cached table"

namespace detail::cache {
/// The compile-time message for an optimizer on a cache that cannot be written.
inline constexpr char const read_only_message[] = WM_CACHE_READ_ONLY_MESSAGE;
}  // namespace detail::cache

// ---------------------------------------------------------------------------------------------
// Run-time options and statistics

/**
 * @brief Run-time cache settings, the embedding's last constructor argument.
 */
struct cache_options {
  /// Fraction of the rows the cache holds: for `device_cache` of each rank's own part, for
  /// `group_cache` of the whole table over the group. In (0, 1]; rounded up to whole 32-way sets
  /// (at least one set).
  double ratio{0.1};
  /// `group_cache` only: the ranks that cache the table together (a subset of the table's
  /// communicator on one node, e.g. from `split`; every rank of the table passes its own group);
  /// must outlive the embedding. Null: the table's communicator. Ignored by `device_cache` (its
  /// group is the table's).
  communicator* group{nullptr};
  /// Seed of the key → set hash (the same on every rank of a group).
  std::uint32_t hash_seed{0};
};

/**
 * @brief Cache statistics, counted on the device and read on the host. Counts add up:
 * `hits + misses == requests`, `bypasses <= misses`, `bypasses <= bypass_rows` and
 * `write_backs <= evictions + flushed lines`.
 *
 * Each gather or prefetch is a batch: a miss never evicts a line that the same batch has hit or
 * admitted (it would have been loaded for nothing). A key whose set has all 32 lines in use by
 * its batch (the batch asks for more than 32 rows of one set) bypasses the cache: its weight row
 * is read from the table straight to the output, nothing is admitted, and `apply_gradients`
 * updates it in the table.
 */
struct cache_statistics {
  std::uint64_t requests{};  ///< keys asked for (with repeats)
  /// distinct keys per batch, summed over batches (a hit-first gather, see hit_first_gathers,
  /// counts an invalid key, and a bypassed key past the first 65,536 of the batch, once per
  /// occurrence)
  std::uint64_t distinct_keys{};
  std::uint64_t hits{};              ///< requests served from a line
  std::uint64_t misses{};            ///< requests not in the cache
  std::uint64_t evictions{};         ///< valid lines replaced
  std::uint64_t write_backs{};       ///< dirty lines written to the table
  std::uint64_t bytes_from_host{};   ///< bytes read from the host table (lines, bypassed rows)
  std::uint64_t bytes_from_peers{};  ///< bytes read from peers' lines (group cache)
  /// distinct keys of gathers read around the cache (every line of their set in use by the
  /// same batch; their requests count as misses, their weight rows in bytes_from_host)
  std::uint64_t bypasses{};
  /// weight rows read from the host table for bypassed keys: one per bypassed key, except in a
  /// hit-first gather, which reads a bypassed key's row once per occurrence (so
  /// `bytes_from_host == lines loaded × line payload + bypass_rows × row bytes` and
  /// `bypass_rows >= bypasses`)
  std::uint64_t bypass_rows{};
  /// one-rank gathers that took the hit-first path: after gathers that missed at most one key
  /// in 32, hits are copied from their lines in one pass over the keys and only the misses are
  /// admitted, without sorting the batch (the path never changes a result, only the time)
  std::uint64_t hit_first_gathers{};
  /// group cache: distinct keys whose line the holder replaced or emptied while a gather copied
  /// it (the line's word changed between the reader's two loads); the copy was refused and the
  /// row read from the table instead, so their requests count as misses and their rows in
  /// bytes_from_host. A figure of contention between gathers and admissions (0 for a device
  /// cache; never a changed result)
  std::uint64_t refused_copies{};
};

}  // namespace wm
