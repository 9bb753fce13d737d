// SPDX-License-Identifier: Apache-2.0
/**
 * @file decl/dynamic_embedding.cuh
 * @brief The declarations of `<wm/dynamic_embedding.cuh>` without their bodies: the eviction
 * policies, the options, the device ref and `wm::dynamic_embedding`.
 */
#pragma once

#include <wm/decl/cache.hpp>
#include <wm/decl/comm.hpp>
#include <wm/decl/embedding.cuh>
#include <wm/detail/dynamic/buckets.hpp>
#include <wm/detail/dynamic/scores.hpp>
#include <wm/optimizer.hpp>

#include <cuda/stream_ref>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

namespace wm {

/** @brief A key type of `wm::dynamic_embedding`: `std::int64_t` or `std::uint64_t`. */
template <class K>
concept dynamic_key = std::same_as<K, std::int64_t> || std::same_as<K, std::uint64_t>;

/// Reserved key (its 64 bits; -1 as `std::int64_t`): marks an empty slot. Refused as input.
inline constexpr std::uint64_t dynamic_empty_key = detail::dynamic::empty_key;
/// Reserved key (-2 as `std::int64_t`): kept for the slot locks of concurrent inserts. Refused.
inline constexpr std::uint64_t dynamic_locked_key = detail::dynamic::locked_key;

// wm::lru and wm::lfu (<wm/decl/cache.hpp>) are eviction policies too: LRU scores a key with
// the number of the last inserting call that used it, LFU with how many such calls used it.

/** @brief Eviction by epoch, then recency: score = epoch << 32 | the call number (low 32 bits). */
struct epoch_lru {
  static constexpr char const* name = "epoch_lru";                       ///< for messages
  using score_rule                  = detail::dynamic::epoch_lru_score;  ///< the score rule
};
/** @brief Eviction by epoch, then frequency: score = epoch << 32 | the key's use count. */
struct epoch_lfu {
  static constexpr char const* name = "epoch_lfu";                       ///< for messages
  using score_rule                  = detail::dynamic::epoch_lfu_score;  ///< the score rule
};
/**
 * @brief Eviction by the caller's scores: every inserting call passes one score per key, stored
 * on insertion and on a hit; a new key replaces a full bucket's lowest score only if its own is
 * not lower (else it is not inserted).
 */
struct custom_score {
  static constexpr char const* name = "custom_score";                 ///< for messages
  using score_rule                  = detail::dynamic::custom_score;  ///< the score rule
};
/**
 * @brief No eviction: inserting into a full bucket throws wm::logic_error and changes nothing.
 * Scores are kept as for `wm::lru` (for `export_batch`).
 */
struct no_eviction {
  static constexpr char const* name = "no_eviction";                       ///< for messages
  using score_rule                  = detail::dynamic::no_eviction_score;  ///< the score rule
};

namespace detail::dynamic {
/// The score rule of eviction policy E: its `score_rule`; wm::lru and wm::lfu, which the cache
/// defines, are given theirs here.
template <class E>
struct score_rule_of {
  using type = typename E::score_rule;
};
template <>
struct score_rule_of<wm::lru> {
  using type = lru_score;
};
template <>
struct score_rule_of<wm::lfu> {
  using type = lfu_score;
};
template <class T>
struct table;  // slots, rows and buckets of one rank (detail/dynamic/table.cuh)
}  // namespace detail::dynamic

/**
 * @brief An eviction policy of `wm::dynamic_embedding`: `wm::lru`, `wm::lfu`, `wm::epoch_lru`,
 * `wm::epoch_lfu`, `wm::custom_score` or `wm::no_eviction`. The policy names its score rule; the
 * table never asks which policy it got.
 */
template <class E>
concept eviction_policy = requires {
  { E::name } -> std::convertible_to<char const*>;
  typename detail::dynamic::score_rule_of<E>::type;
};

/** @brief What `find` writes for a key that is not in the table. */
enum class missing_rows {
  initializer,  ///< the initializer's row of the key (what `find_or_insert` would insert)
  zeros         ///< zeros
};

/** @brief Run-time options of `wm::dynamic_embedding`. */
struct dynamic_options {
  std::uint64_t hash_seed{0};                       ///< seed of the key -> bucket hash
  missing_rows missing{missing_rows::initializer};  ///< what `find` gives for a missing key
};

/**
 * @brief Where `insert_and_evict` writes the keys it evicted (device memory, room for as many
 * as the call has keys); a null pointer skips that part.
 */
template <class T, dynamic_key Key>
struct dynamic_evicted {
  Key* keys{};              ///< evicted keys
  T* values{};              ///< their rows, dim values each
  float* states{};          ///< their optimizer states, `Optimizer::states × dim` floats each
  std::int64_t* steps{};    ///< their per-row steps (optimizers that `needs_steps()`)
  std::uint64_t* scores{};  ///< their scores
};

/** @brief `export_batch` predicate: the slots whose score is at least `threshold`. */
struct score_at_least {
  std::uint64_t threshold{};  ///< lowest score exported
  /// Whether the slot of @p key with @p score is exported.
  [[nodiscard]] WM_HOST_DEVICE constexpr bool operator()(std::uint64_t /*key*/,
                                                         std::uint64_t score) const noexcept {
    return score >= threshold;
  }
};

/**
 * @brief A dynamic table as user kernels see it (trivially copyable, by value): `find(key)` by
 * one thread. Reads only; valid until the next call that inserts, erases or clears.
 * @tparam T the weight type
 */
template <class T>
class dynamic_embedding_ref {
 public:
  /// Values per row.
  [[nodiscard]] WM_HOST_DEVICE std::size_t dim() const noexcept { return dim_; }
  /**
   * @brief The row of @p key, or null if the table does not hold it (or @p key is reserved).
   * @tparam Key `std::int64_t` or `std::uint64_t`
   */
  template <dynamic_key Key>
  [[nodiscard]] __device__ T const* find(Key key) const noexcept;

  /// Built by `dynamic_embedding::ref()`.
  dynamic_embedding_ref(std::uint64_t const* keys, std::uint8_t const* digests, T const* rows,
                        std::uint32_t buckets, std::uint64_t seed, std::size_t dim) noexcept
      : keys_{keys}, digests_{digests}, rows_{rows}, buckets_{buckets}, seed_{seed}, dim_{dim} {}

 private:
  std::uint64_t const* keys_;
  std::uint8_t const* digests_;
  T const* rows_;
  std::uint32_t buckets_;
  std::uint64_t seed_;
  std::size_t dim_;
};

/**
 * @brief A hash embedding: rows of `dim` values of T for 64-bit keys of any value (except the
 * two reserved ones, `dynamic_empty_key` and `dynamic_locked_key`), inserted on demand into a
 * table of fixed capacity, trained with a fused sparse optimizer, evicting by score when a
 * bucket is full.
 *
 * A GPU hash table maps each key to a slot: buckets of 128 slots, each probed by one warp, with a
 * one-byte digest per slot so that a probe compares few keys. Rows, optimizer state and per-row
 * steps live in slot order; each slot has a 64-bit score that the eviction policy keeps. Every
 * inserting call processes the keys of one bucket in one warp, in a fixed order, so results
 * (which key lands where, which key is evicted) do not depend on timing; keys the call finds are
 * never evicted by the same call (docs/design.md, "Dynamic embeddings").
 *
 * One rank for now: the constructor refuses a communicator of several ranks.
 *
 * @tparam T float, half (`__half`) or bfloat16 (`__nv_bfloat16`)
 * @tparam Optimizer as for `wm::embedding` (see <wm/optimizer.hpp>)
 * @tparam Eviction `wm::lru` (default), `wm::lfu`, `wm::epoch_lru`, `wm::epoch_lfu`,
 * `wm::custom_score` or `wm::no_eviction`
 */
template <class T, optimizer_policy Optimizer = sgd, eviction_policy Eviction = lru>
class dynamic_embedding {
 public:
  using value_type     = T;          ///< the weight type
  using optimizer_type = Optimizer;  ///< the optimizer policy
  using eviction_type  = Eviction;   ///< the eviction policy
  /// Slots per bucket (one warp probes a bucket, 4 slots per lane).
  static constexpr std::size_t bucket_slots = 128;

  /**
   * @brief Allocates an empty table on the current device.
   * @param comm the owning group (must outlive the table); one rank for now
   * @param capacity rows this rank may hold, rounded up to whole buckets of 128 (>= 1)
   * @param dim values per row (>= 1)
   * @param optimizer hyper-parameters (ignored by `no_optimizer`)
   * @param init the rows new keys get: row of key k is what `wm::embedding` gives its row k
   * @param options hash seed; what `find` gives for missing keys
   * @throw wm::logic_error if @p comm has several ranks (not built yet), @p capacity or @p dim is
   * 0, or the capacity exceeds 2^32 - 2 rows
   */
  dynamic_embedding(communicator& comm, std::size_t capacity, std::size_t dim,
                    Optimizer optimizer = {}, embedding_init init = {},
                    dynamic_options options = {});
  /// Takes @p other's table; @p other is left empty.
  dynamic_embedding(dynamic_embedding&&) noexcept;
  /// Frees this table, then takes @p other's.
  dynamic_embedding& operator=(dynamic_embedding&&) noexcept;
  ~dynamic_embedding();

  /// Slots (rows) of this rank: the capacity rounded up to whole buckets.
  [[nodiscard]] std::size_t capacity() const noexcept;
  /// Values per row.
  [[nodiscard]] std::size_t dim() const noexcept;
  /// The optimizer's hyper-parameters.
  [[nodiscard]] Optimizer const& optimizer() const noexcept { return opt_; }
  /// Number of `apply_gradients` calls so far (the global step).
  [[nodiscard]] std::int64_t global_step() const noexcept { return global_step_; }
  /// The epoch that `wm::epoch_lru` and `wm::epoch_lfu` put in the high half of scores.
  [[nodiscard]] std::uint32_t epoch() const noexcept { return epoch_; }
  /// Sets the epoch for the next calls (the user advances it, e.g. once per training epoch).
  void set_epoch(std::uint32_t epoch) noexcept { epoch_ = epoch; }

  /// Keys held (counts the slots; synchronizes @p stream).
  [[nodiscard]] std::size_t size(cuda::stream_ref stream);
  /// `size() / capacity()` (synchronizes @p stream).
  [[nodiscard]] double load_factor(cuda::stream_ref stream);

  /**
   * @brief Looks keys up without changing anything: `out[i, :]` is the row of `keys[i]`, or for
   * a missing key the initializer's row or zeros (`dynamic_options::missing`); `found[i]` (if not
   * null) says which. Scores are not touched. Synchronizes @p stream.
   * @param keys the keys (device memory)
   * @param out device memory, `keys.size() × dim` values
   * @param found device memory, `keys.size()` flags, or null
   * @param stream the stream the call is enqueued on
   * @throw wm::logic_error if a key is reserved (then `out` and `found` are unspecified)
   */
  template <dynamic_key Key>
  void find(std::span<Key const> keys, T* out, bool* found, cuda::stream_ref stream);

  /**
   * @brief Finds every key, inserting the missing ones with the initializer's row and fresh
   * optimizer state (a full bucket evicts its lowest score, never a key this call uses), and
   * writes the rows to @p out (if not null). A key that finds no slot (its bucket's 128 slots
   * all used by this call, or `wm::custom_score` refused it) is not inserted; its row is the
   * initializer's. Scores of found and inserted keys follow the policy. Synchronizes @p stream.
   * @param keys the keys (device memory)
   * @param out device memory, `keys.size() × dim` values, or null
   * @param found device memory, `keys.size()` flags (key was present before the call), or null
   * @param stream the stream the call is enqueued on
   * @param scores with `wm::custom_score` one score per key (device memory), else empty
   * @throw wm::logic_error, with nothing changed, if a key is reserved, scores are missing or
   * unexpected, or with `wm::no_eviction` a bucket would overflow
   */
  template <dynamic_key Key>
  void find_or_insert(std::span<Key const> keys, T* out, bool* found, cuda::stream_ref stream,
                      std::span<std::uint64_t const> scores = {});

  /**
   * @brief Stores `values[i, :]` as the row of `keys[i]` (the last occurrence wins), inserting
   * missing keys with fresh optimizer state; present keys keep theirs. Eviction as
   * `find_or_insert`. Synchronizes @p stream.
   * @param keys the keys (device memory)
   * @param values device memory, `keys.size() × dim` values
   * @param stream the stream the call is enqueued on
   * @param scores with `wm::custom_score` one score per key (device memory), else empty
   * @throw wm::logic_error, with nothing changed, as `find_or_insert`
   */
  template <dynamic_key Key>
  void insert_or_assign(std::span<Key const> keys, T const* values, cuda::stream_ref stream,
                        std::span<std::uint64_t const> scores = {});

  /**
   * @brief `insert_or_assign`, handing back the keys it evicted with their rows, optimizer
   * states, steps and scores (in no particular order). Synchronizes @p stream.
   * @param keys the keys (device memory)
   * @param values device memory, `keys.size() × dim` values
   * @param evicted device buffers with room for `keys.size()` entries each (null parts skipped)
   * @param stream the stream the call is enqueued on
   * @param scores with `wm::custom_score` one score per key (device memory), else empty
   * @return the number of keys evicted
   * @throw wm::logic_error, with nothing changed, as `find_or_insert`
   */
  template <dynamic_key Key>
  std::size_t insert_and_evict(std::span<Key const> keys, T const* values,
                               dynamic_evicted<T, Key> const& evicted, cuda::stream_ref stream,
                               std::span<std::uint64_t const> scores = {});

  /**
   * @brief Removes the keys present (others are ignored). Synchronizes @p stream.
   * @return the number of keys removed
   * @throw wm::logic_error, with nothing changed, if a key is reserved
   */
  template <dynamic_key Key>
  std::size_t erase(std::span<Key const> keys, cuda::stream_ref stream);

  /// Removes every key (rows and states stay in memory, unreachable). Enqueued on @p stream.
  void clear(cuda::stream_ref stream);

  /**
   * @brief Writes every held key whose `(key, score)` satisfies @p pred, with its row and score,
   * in no particular order. Synchronizes @p stream.
   * @tparam Pred a trivially copyable `__device__` callable `bool(std::uint64_t key,
   * std::uint64_t score)`, e.g. `wm::score_at_least`
   * @param pred the predicate
   * @param keys device buffer with room for `size()` keys
   * @param values device buffer with room for `size() × dim` values, or null
   * @param scores device buffer with room for `size()` scores, or null
   * @param stream the stream the call is enqueued on
   * @return the number of keys written
   */
  template <dynamic_key Key, class Pred>
  std::size_t export_batch(Pred pred, Key* keys, T* values, std::uint64_t* scores,
                           cuda::stream_ref stream);

  /**
   * @brief Forward of training: `find_or_insert(keys, out, nullptr, stream)`, so that every key
   * of the batch has a row for `apply_gradients`.
   */
  template <dynamic_key Key>
  void gather(std::span<Key const> keys, T* out, cuda::stream_ref stream);

  /**
   * @brief Backward + update: `grads` has one dense row of `dim` values per key; duplicates are
   * summed in batch order; each held key's row is updated once with @p lr by the optimizer, with
   * the embedding's update kernels (so a table without evictions trains bit for bit as a
   * `wm::embedding` with one row per key). Gradients of keys the table does not hold are
   * dropped. Synchronizes @p stream.
   * @throw wm::logic_error if a key is reserved (then nothing is updated)
   */
  template <dynamic_key Key>
  void apply_gradients(std::span<Key const> keys, T const* grads, float lr,
                       cuda::stream_ref stream) requires sparse_optimizer<Optimizer>;

  /// The table for user kernels (`find` by key); valid until the next inserting, erasing or
  /// clearing call.
  [[nodiscard]] dynamic_embedding_ref<T> ref() const noexcept;

 private:
  using rule_type = typename detail::dynamic::score_rule_of<Eviction>::type;
  Optimizer opt_;
  embedding_init init_;
  dynamic_options options_;
  std::unique_ptr<detail::dynamic::table<T>> table_;
  std::int64_t global_step_{0};
  std::uint64_t tick_{0};
  std::uint32_t epoch_{0};

  template <dynamic_key Key>
  std::size_t upsert(std::span<Key const> keys, T const* values, T* out, bool* found,
                     dynamic_evicted<T, Key> const* evicted, std::span<std::uint64_t const> scores,
                     cuda::stream_ref stream);
};

}  // namespace wm
