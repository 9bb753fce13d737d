// SPDX-License-Identifier: Apache-2.0
/**
 * @file partition.hpp
 * @brief How a whole-memory allocation's entries are split over ranks.
 *
 * `wm::block_partition` is the plan of docs/design.md, "Partition plan":
 * `per_rank = ceil(entries / world)`, rank r owns
 * `[min(r·per_rank, entries), min((r+1)·per_rank, entries))`; 15 entries over 4 ranks give
 * 4,4,4,3 and 9 over 8 give 2,2,2,2,1,0,0,0 (trailing ranks may own nothing). A user-given list
 * of per-rank entry counts replaces the plan. `partition_ref` is its trivially copyable device
 * form. Host and device code; compiles with a plain C++20 compiler too.
 */
#pragma once

#include <wm/config.hpp>  // WM_HOST_DEVICE
#include <wm/error.hpp>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <numeric>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace wm {

/**
 * @brief Trivially copyable partition for kernels: entry count, rank count and either the
 * uniform block size or a pointer to `world + 1` start offsets in memory the caller can read.
 */
struct partition_ref {
  std::size_t entries{};        ///< total entries
  std::size_t per_rank{};       ///< block size of the uniform plan; 0 for another list
  std::size_t const* starts{};  ///< world + 1 ascending starts (always set)
  int world{};                  ///< number of ranks

  /// First entry of @p rank.
  [[nodiscard]] WM_HOST_DEVICE std::size_t begin(int rank) const noexcept { return starts[rank]; }
  /// One past the last entry of @p rank.
  [[nodiscard]] WM_HOST_DEVICE std::size_t end(int rank) const noexcept { return starts[rank + 1]; }
  /// The rank that owns @p entry (entry < entries).
  [[nodiscard]] WM_HOST_DEVICE int owner(std::size_t entry) const noexcept {
    if (per_rank != 0) { return static_cast<int>(entry / per_rank); }
    int lo = 0;  // last rank whose start <= entry and that owns something
    int hi = world - 1;
    while (lo < hi) {
      int const mid = (lo + hi + 1) / 2;
      if (starts[mid] <= entry) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    while (lo > 0 && starts[lo] == starts[lo + 1]) { --lo; }  // skip ranks that own nothing
    return lo;
  }
};

/** @brief Block partition of `entries` over `world` ranks (owning host object). */
class block_partition {
 public:
  block_partition() = default;

  /**
   * @brief The default plan: contiguous blocks of `ceil(entries / world)`.
   * @throw wm::logic_error if world < 1
   */
  block_partition(std::size_t entries, int world) : entries_{entries}, world_{world} {
    WM_EXPECTS(world >= 1, "the rank count must be at least 1, got " + std::to_string(world));
    per_rank_ = (entries + static_cast<std::size_t>(world) - 1) / static_cast<std::size_t>(world);
    starts_.assign(static_cast<std::size_t>(world) + 1, 0);
    for (std::size_t r = 0; r <= static_cast<std::size_t>(world); ++r) {
      starts_[r] = std::min(r * per_rank_, entries);
    }
    if (per_rank_ == 0) { per_rank_ = 1; }  // 0 entries: owner() is never asked; keep it uniform
  }

  /**
   * @brief A user-given plan: rank r owns `counts[r]` entries, in rank order.
   * @throw wm::logic_error unless there is one count per rank and they add up to @p entries
   */
  block_partition(std::size_t entries, int world, std::span<std::size_t const> counts)
      : entries_{entries}, world_{world} {
    WM_EXPECTS(world >= 1, "the rank count must be at least 1, got " + std::to_string(world));
    WM_EXPECTS(counts.size() == static_cast<std::size_t>(world),
               "the entry list needs one count per rank (" + std::to_string(world) + "), got " +
                   std::to_string(counts.size()));
    std::size_t const sum = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
    WM_EXPECTS(sum == entries, "the per-rank entry counts add up to " + std::to_string(sum) +
                                   ", expected " + std::to_string(entries));
    starts_.resize(static_cast<std::size_t>(world) + 1, 0);
    std::partial_sum(counts.begin(), counts.end(), starts_.begin() + 1);
    // A list that is the default plan is the default plan: owner() then divides, not searches.
    if (block_partition const uniform{entries, world}; uniform.starts_ == starts_) {
      per_rank_ = uniform.per_rank_;
    } else {
      per_rank_ = 0;  // not uniform: owner() searches
    }
  }

  /// Total entries.
  [[nodiscard]] std::size_t entries() const noexcept { return entries_; }
  /// Number of ranks.
  [[nodiscard]] int world() const noexcept { return world_; }
  /// First entry of @p rank. @throw std::out_of_range unless 0 <= rank < world()
  [[nodiscard]] std::size_t begin(int rank) const {
    return starts_.at(static_cast<std::size_t>(rank));
  }
  /// One past the last entry of @p rank. @throw std::out_of_range unless 0 <= rank < world()
  [[nodiscard]] std::size_t end(int rank) const {
    return starts_.at(static_cast<std::size_t>(rank) + 1);
  }
  /// Entries @p rank owns: `end(rank) - begin(rank)`.
  [[nodiscard]] std::size_t count(int rank) const { return end(rank) - begin(rank); }
  /// The `world() + 1` ascending starts: rank r owns `[starts()[r], starts()[r + 1])`.
  [[nodiscard]] std::vector<std::size_t> const& starts() const noexcept { return starts_; }
  /// Block size of the uniform plan (also when a user-given list equals it), 0 otherwise.
  [[nodiscard]] std::size_t per_rank() const noexcept { return per_rank_; }
  /// The owner of @p entry. @throw wm::logic_error if entry >= entries()
  [[nodiscard]] int owner(std::size_t entry) const {
    WM_EXPECTS(entry < entries_, "entry " + std::to_string(entry) + " is out of range [0, " +
                                     std::to_string(entries_) + ")");
    return ref(starts_.data()).owner(entry);
  }
  /// The device form, reading starts from @p starts (a device copy of `starts()`).
  [[nodiscard]] partition_ref ref(std::size_t const* starts) const noexcept {
    return partition_ref{entries_, per_rank_, starts, world_};
  }

  friend bool operator==(block_partition const&, block_partition const&) = default;

 private:
  std::size_t entries_{};
  int world_{1};
  std::size_t per_rank_{};
  std::vector<std::size_t> starts_{0, 0};
};

// ---- Mapping strategies: which rank owns a row, and where it lives there -------------------
//
// A mapping is a policy type that carries its own implementation (as cuco's storage types
// carry theirs): `counts(rows, world)` sizes each rank's part, and `make_ref(partition)` gives a
// trivially copyable `ref_type` with `owner(k)` and `local(k)` that kernels and host code call.
// wm's code asks the mapping, never which mapping it got, so a user-written mapping works
// unchanged: see `wm::mapping`.

/// Where a row lives: its owner rank and its row index inside the owner's part.
struct row_location {
  int rank;           ///< the owner rank
  std::size_t local;  ///< the row's index inside the owner's part
};

/**
 * @brief What a mapping's `ref_type` offers: the row count and, for a row k in [0, rows()), its
 * owner rank and its local row there (host and device functions; trivially copyable).
 */
template <class R>
concept mapping_ref_type = std::is_trivially_copyable_v<R> && requires(R const r, std::size_t k) {
  { r.rows() } -> std::same_as<std::size_t>;
  { r.owner(k) } -> std::same_as<int>;
  { r.local(k) } -> std::same_as<std::size_t>;
};

/**
 * @brief A mapping strategy (`wm::block`, `wm::cyclic`, or a user type with the same members):
 * - `name`: for messages;
 * - `counts(rows, world)`: the rows each rank owns, one count per rank, adding up to `rows`;
 * - `ref_type` (a `wm::mapping_ref_type`) and `make_ref(partition_ref)`: the mapping over the
 *   partition that `counts` gave (its starts where the ref is used: device memory for kernels,
 *   host memory for host code). Local rows of rank r are `0 .. counts[r] - 1`, each used once.
 * - optional `contiguous = true`: rank r's rows are the partition's range `[begin(r), end(r))`
 *   in order (lets a gather start its sorted reads at a peer's first row).
 */
template <class T>
concept mapping = requires(std::size_t rows, int world, partition_ref part) {
  { T::name } -> std::convertible_to<char const*>;
  { T::counts(rows, world) } -> std::same_as<std::vector<std::size_t>>;
  typename T::ref_type;
  requires mapping_ref_type<typename T::ref_type>;
  { T::make_ref(part) } -> std::same_as<typename T::ref_type>;
};

/// A mapping whose ranks own contiguous row ranges in rank order (`Mapping::contiguous`).
template <class T>
concept contiguous_mapping = mapping<T> && requires {
  { T::contiguous } -> std::convertible_to<bool>;
} && static_cast<bool>(T::contiguous);

/**
 * @brief Mapping policy: contiguous row ranges per rank (the block plan). The default.
 * Row k lives on `owner(k)` at local row `k - begin(owner(k))`.
 */
struct block {
  static constexpr char const* name = "block";  ///< for messages
  static constexpr bool contiguous  = true;     ///< rank r owns the range [begin(r), end(r))
  /// Rows each rank owns under this mapping.
  [[nodiscard]] static std::vector<std::size_t> counts(std::size_t rows, int world) {
    block_partition const p{rows, world};
    std::vector<std::size_t> c(static_cast<std::size_t>(world));
    for (int r = 0; r < world; ++r) { c[static_cast<std::size_t>(r)] = p.count(r); }
    return c;
  }
  /// Owner through the partition (a division for the uniform plan).
  struct ref_type {
    partition_ref part;  ///< the block partition of the rows
    /// Rows in all.
    [[nodiscard]] WM_HOST_DEVICE std::size_t rows() const noexcept { return part.entries; }
    /// The rank that owns row @p k.
    [[nodiscard]] WM_HOST_DEVICE int owner(std::size_t k) const noexcept { return part.owner(k); }
    /// Row @p k's index in its owner's part: `k - begin(owner(k))`.
    [[nodiscard]] WM_HOST_DEVICE std::size_t local(std::size_t k) const noexcept {
      return k - part.begin(part.owner(k));
    }
    /// Owner and local row of row @p k, with one owner lookup.
    [[nodiscard]] WM_HOST_DEVICE row_location locate(std::size_t k) const noexcept {
      int const r = part.owner(k);
      return {r, k - part.begin(r)};
    }
  };
  /// The mapping over @p part (the partition of `counts`).
  [[nodiscard]] static ref_type make_ref(partition_ref part) noexcept { return {part}; }
};

/**
 * @brief Mapping policy: rows dealt round-robin, as in a model-parallel embedding lookup: row k
 * lives on rank `k % world` at local row `k / world`.
 */
struct cyclic {
  static constexpr char const* name = "cyclic";  ///< for messages
  /// Rows each rank owns: `rows / world`, one more for the first `rows % world` ranks.
  /// @throw wm::logic_error if world < 1
  [[nodiscard]] static std::vector<std::size_t> counts(std::size_t rows, int world) {
    WM_EXPECTS(world >= 1, "the rank count must be at least 1");
    std::vector<std::size_t> c(static_cast<std::size_t>(world));
    auto const w = static_cast<std::size_t>(world);
    for (std::size_t r = 0; r < w; ++r) { c[r] = rows / w + (r < rows % w ? 1 : 0); }
    return c;
  }
  /// Owner `k % world`, local row `k / world`: no table needed.
  struct ref_type {
    std::size_t n_rows;  ///< rows in all
    int world;           ///< number of ranks
    /// Rows in all.
    [[nodiscard]] WM_HOST_DEVICE std::size_t rows() const noexcept { return n_rows; }
    /// The rank that owns row @p k: `k % world`.
    [[nodiscard]] WM_HOST_DEVICE int owner(std::size_t k) const noexcept {
      return static_cast<int>(k % static_cast<std::size_t>(world));
    }
    /// Row @p k's index in its owner's part: `k / world`.
    [[nodiscard]] WM_HOST_DEVICE std::size_t local(std::size_t k) const noexcept {
      return k / static_cast<std::size_t>(world);
    }
  };
  /// The mapping over @p part's rows and ranks.
  [[nodiscard]] static ref_type make_ref(partition_ref part) noexcept {
    return {part.entries, part.world};
  }
};

namespace detail {
template <class R>
concept locates_at_once = requires(R const r, std::size_t k) {
  { r.locate(k) } -> std::same_as<row_location>;
};
}  // namespace detail

/**
 * @brief Trivially copyable form of a mapping, for kernels and host code: `Mapping::ref_type`
 * with `locate(k)` (owner and local row at once) added. `rows()` bounds valid indices.
 */
template <mapping Mapping>
struct mapping_ref {
  typename Mapping::ref_type impl;  ///< the mapping's own ref

  /// Rows in all (valid indices are below it).
  [[nodiscard]] WM_HOST_DEVICE std::size_t rows() const noexcept { return impl.rows(); }
  /// The rank that owns row @p k (k < rows()).
  [[nodiscard]] WM_HOST_DEVICE int owner(std::size_t k) const noexcept { return impl.owner(k); }
  /// Row @p k's index inside its owner's part.
  [[nodiscard]] WM_HOST_DEVICE std::size_t local(std::size_t k) const noexcept {
    return impl.local(k);
  }
  /// Owner and local row of row @p k.
  [[nodiscard]] WM_HOST_DEVICE row_location locate(std::size_t k) const noexcept {
    if constexpr (detail::locates_at_once<typename Mapping::ref_type>) {
      return impl.locate(k);
    } else {
      return {impl.owner(k), impl.local(k)};
    }
  }
};

/**
 * @brief @p Mapping over @p part (a partition of `Mapping::counts`; its starts where the result
 * is used). Host code passes `p.ref(p.starts().data())` of a `block_partition` p.
 */
template <mapping Mapping>
[[nodiscard]] mapping_ref<Mapping> make_mapping_ref(partition_ref part) noexcept {
  return {Mapping::make_ref(part)};
}

}  // namespace wm
