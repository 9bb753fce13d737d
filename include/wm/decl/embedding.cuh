// SPDX-License-Identifier: Apache-2.0
/**
 * @file decl/embedding.cuh
 * @brief The declarations of `<wm/embedding.cuh>` without their bodies, for `<wm/wm.cuh>`: every
 * type and signature, none of the definitions (docs/design.md, "Compile time").
 */
#pragma once

#include <wm/decl/cache.hpp>
#include <wm/decl/comm.hpp>
#include <wm/decl/tensor.cuh>
#include <wm/optimizer.hpp>

#include <cuda/stream_ref>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>

namespace wm {

/** @brief Cache policy: no cache; every gather reads the table. */
struct no_cache {
  static constexpr char const* name = "no_cache";  ///< for messages and checkpoints
};

/** @brief A cache policy: `wm::no_cache`, `wm::device_cache<A, R>`, `wm::group_cache<R>`. */
template <class C>
concept cache_policy = requires {
  { C::name } -> std::convertible_to<char const*>;
};

/** @brief An optimizer policy for `wm::embedding`: a sparse optimizer or `wm::no_optimizer`. */
template <class O>
concept optimizer_policy = sparse_optimizer<O> || std::same_as<O, no_optimizer>;

/**
 * @brief How to fill a new table. Values depend only on (seed, global row, column), so the same
 * seed gives the same table for any rank count, layout or mapping.
 */
struct embedding_init {
  /// The distribution of the initial weights: all zeros, uniform in (a, b], or normal with mean
  /// a and standard deviation b.
  enum class kind { zeros, uniform, normal };
  /// Which distribution.
  kind how{kind::uniform};
  float a{-0.05f};  ///< uniform: low; normal: mean
  float b{0.05f};   ///< uniform: high; normal: standard deviation
  /// Seed of the hash of (seed, row, column) that gives each value: the same seed, the same table.
  std::uint64_t seed{42};

  /// Every weight 0.
  [[nodiscard]] static embedding_init zeros() { return {kind::zeros, 0, 0, 0}; }
  /// Uniform in (@p low, @p high] from @p seed.
  [[nodiscard]] static embedding_init uniform(float low, float high, std::uint64_t seed) {
    return {kind::uniform, low, high, seed};
  }
  /// Normal with @p mean and @p stddev from @p seed.
  [[nodiscard]] static embedding_init normal(float mean, float stddev, std::uint64_t seed) {
    return {kind::normal, mean, stddev, seed};
  }

  /// The initial value of (row, col): host and device.
  [[nodiscard]] WM_HOST_DEVICE float value(std::size_t row, std::size_t col,
                                           std::size_t dim) const noexcept;
};

namespace detail {
struct embedding_scratch;
/// A policy that puts a cache in front of the table (device_cache, group_cache).
template <class C>
concept caching_policy = requires {
  typename C::access_type;
  typename C::replacement_type;
};
template <class CachePolicy, class T>
class row_source;  // where gather reads and the update writes rows (detail/embedding/source.cuh)
template <class T>
struct table_rows;  // this rank's weights, states and steps (detail/tensor/table_rows.cuh)
}  // namespace detail

/**
 * @brief An embedding table of `rows` × `dim` values of T spread over the ranks.
 *
 * @tparam T float, half (`__half`) or bfloat16 (`__nv_bfloat16`)
 * @tparam CachePolicy `wm::no_cache`, `wm::device_cache<Access, Replacement>` or
 * `wm::group_cache<Replacement>` (see the file comment); a read-only policy with a sparse
 * optimizer does not compile
 * @tparam Optimizer `wm::sgd`, `wm::adam`, `wm::rmsprop`, `wm::adagrad`, `wm::no_optimizer`, or
 * any type satisfying `wm::sparse_optimizer` (see <wm/optimizer.hpp>)
 * @tparam Location, Layout, Mapping the storage, as for `wm::tensor`
 */
template <class T, cache_policy CachePolicy = no_cache, optimizer_policy Optimizer = sgd,
          location Location = device, layout Layout = chunked, mapping Mapping = block>
class embedding {
 public:
  using value_type        = T;            ///< the weight type
  using optimizer_type    = Optimizer;    ///< the optimizer policy
  using cache_policy_type = CachePolicy;  ///< the cache policy

  static_assert(writable_cache<CachePolicy> || !sparse_optimizer<Optimizer>,
                WM_CACHE_READ_ONLY_MESSAGE);

  /**
   * @brief Allocates and initializes the table (collective).
   * @param comm the owning group (must outlive the table)
   * @param rows number of rows; @param dim values per row (>= 1)
   * @param optimizer hyper-parameters (ignored by `no_optimizer`)
   * @param init how to fill the weights
   * @param cache the cache's ratio and hash seed (ignored by `wm::no_cache`)
   * @throw wm::logic_error on every rank, before anything is allocated, if one rank would hold
   * more than 2^32 - 1 rows (the update sorts local rows as 32-bit keys); with a cache, if
   * `cache.ratio` is not in (0, 1]; with a group cache on several ranks, if the layout is
   * `wm::distributed` (not built yet), the group has more ranks than the table or the table
   * 2^32 - 1 rows or more
   * @throw wm::comm_error on every rank if the ranks passed different @p rows or @p dim
   */
  embedding(communicator& comm, std::size_t rows, std::size_t dim, Optimizer optimizer = {},
            embedding_init init = {}, cache_options cache = {});
  /// Takes @p other's tensors, cache and buffers; @p other is left empty.
  embedding(embedding&&) noexcept;
  /// Waits for this table's updates to end and frees its cache and tensors, then takes @p other's.
  embedding& operator=(embedding&&) noexcept;
  ~embedding();

  /// Rows in all.
  [[nodiscard]] std::size_t rows() const noexcept { return weights_.rows(); }
  /// Values per row.
  [[nodiscard]] std::size_t dim() const noexcept { return weights_.cols(); }
  /// The optimizer's hyper-parameters.
  [[nodiscard]] Optimizer const& optimizer() const noexcept { return opt_; }
  /// The weight tensor (e.g. to load weights from files or read local rows). With a
  /// `read_write` cache, rows in dirty lines are newer than the tensor: `flush()` first. On a
  /// host table with a cache and optimizer state or steps its rows are records (stride > dim)
  /// that also hold the state and the step: `states()` and `steps()` are `view_columns` of it,
  /// so a row the cache admits or writes back crosses PCIe as one access.
  [[nodiscard]] tensor<T, Location, Layout, Mapping>& weights() noexcept { return weights_; }
  /// Optimizer state: `Optimizer::states × dim` floats per row (absent if the optimizer has none).
  [[nodiscard]] tensor<float, Location, Layout, Mapping>* states() noexcept {
    return states_ ? &*states_ : nullptr;
  }
  /// Per-row step counts (present when the optimizer `needs_steps()`, e.g. lazy Adam).
  [[nodiscard]] tensor<std::int64_t, Location, Layout, Mapping>* steps() noexcept {
    return steps_ ? &*steps_ : nullptr;
  }
  /// Number of `apply_gradients` calls so far (the global step).
  [[nodiscard]] std::int64_t global_step() const noexcept { return global_step_; }

  /**
   * @brief Forward: `out[i, :] = table[indices[i], :]`; see `wm::tensor::gather`.
   *
   * With a cache: hits are served from lines, each distinct missing row is read once from the
   * table and admitted (its dirty victim written back), and rows are replicated to every
   * position that asks for them. One rank: enqueued on @p stream without host synchronization (a
   * CUDA graph can capture it); an invalid index gives a zero row and is reported by the next
   * `apply_gradients` (which then updates nothing) or `cache_stats()`, as wm::logic_error.
   * Several ranks, device cache: collective; rows travel through their owners' caches, and an
   * invalid index throws wm::logic_error on the rank that passed it, as the tensor's gather.
   * Several ranks, group cache: not collective, no host synchronization; rows come from their
   * holders' lines or the table; invalid indices are reported as on one rank.
   * Gathers and `apply_gradients` on one cached table share its lines and must be ordered by
   * the caller (one stream, or events); see `prefetch` for what may overlap. `flush`,
   * `invalidate`, `store` and `load` order themselves after the table's gathers and prefetches.
   */
  template <index_type Index>
  void gather(std::span<Index const> indices, T* out, cuda::stream_ref stream);

  /**
   * @brief Admits the rows of @p next_keys that are not cached (as a gather would, without output
   * and without counting requests), so that the next batch's misses load while the current one
   * computes. Enqueued on @p stream; invalid keys are reported like the gather's.
   *
   * It may run on another stream beside the computation between `gather` and
   * `apply_gradients`, but not beside any call on the same table (a one-rank gather writes its
   * evicted rows back after its admissions, so a prefetch beside it could read a row not yet
   * written back): issue it after `gather` and make the next `apply_gradients` wait on an event
   * recorded after it.
   *
   * A group cache on several ranks: the keys' misses are left to their holders as hints; this
   * rank admits the rows it holds now, its peers theirs when they next gather or prefetch.
   * @throw wm::logic_error with a device cache on several ranks (not built yet)
   */
  template <index_type Index>
  void prefetch(std::span<Index const> next_keys,
                cuda::stream_ref stream) requires detail::caching_policy<CachePolicy>;

  /**
   * @brief Writes every dirty line back to the table (`read_write`); lines stay cached and
   * clean. Enqueued on @p stream, after the gathers and prefetches this table issued on any
   * stream (@p stream waits for them).
   */
  void flush(cuda::stream_ref stream) requires detail::caching_policy<CachePolicy>;

  /**
   * @brief `flush()`, then every line emptied. Enqueued on @p stream, after the gathers and
   * prefetches this table issued on any stream.
   */
  void invalidate(cuda::stream_ref stream) requires detail::caching_policy<CachePolicy>;

  /**
   * @brief The cache's counters since construction or `reset_cache_stats()` (waits for the
   * device). `hits + misses == requests`; prefetches add evictions, write-backs and bytes only.
   * `bytes_from_host` counts the bytes admissions read from the table (weight, state, step)
   * and the weight rows of bypassed keys (`bypasses <= misses`: keys of a gather whose set had
   * all 32 lines in use by the same gather, read around the cache; see wm::cache_statistics).
   * Several ranks: each rank counts the requests its cache served (any rank's keys), and
   * distinct keys per owner-side read (the engine may read a batch in several pieces).
   * @throw wm::logic_error if a gather or prefetch since the last report met an invalid index
   */
  [[nodiscard]] cache_statistics cache_stats() requires detail::caching_policy<CachePolicy>;

  /** @brief Sets every cache counter to zero (waits for the device). */
  void reset_cache_stats() requires detail::caching_policy<CachePolicy>;

  /** @brief Lines of this rank's cache (whole 32-way sets). */
  [[nodiscard]] std::size_t cache_lines()
      const noexcept requires detail::caching_policy<CachePolicy> {
    return source_.lines();
  }

  /// Read-only rows for user kernels (see `wm::tensor_ref`): this rank's rows on every layout,
  /// any row on mapped layouts; nothing can write through it.
  [[nodiscard]] tensor_ref<T const, Layout, Mapping> ref() const noexcept { return weights_.ref(); }

  /**
   * @brief Backward + update (collective): `grads` has one dense row of `dim` values per index;
   * duplicates are summed; each touched row is updated once with @p lr. Synchronizes @p stream.
   * @throw wm::logic_error if an index is out of range (then nothing is updated)
   */
  template <index_type Index>
  void apply_gradients(std::span<Index const> indices, T const* grads, float lr,
                       cuda::stream_ref stream) requires sparse_optimizer<Optimizer>;

  /**
   * @brief Writes the checkpoint `<prefix>.weights.*`, `.states.*`, `.steps.*` and `<prefix>.meta`
   * (collective). Rows are in global order, so it loads into any rank count or layout. A cache is
   * flushed first, so the checkpoint holds every update; the gathers and prefetches this table
   * issued on any stream are waited for first (within the communicator's timeout).
   *
   * Every file is written under a temporary name (`<file>.tmp`) and flushed; only when every rank
   * has written, the old `.meta` is removed, the parts are renamed and the new `.meta` is renamed
   * last. A crash leaves either the old checkpoint, or one without `.meta` (refused by `load`; the
   * `.tmp` files are still there), or the new one. The meta records rows, dim, element type,
   * optimizer name and its `checkpoint_tag()` (Adam: bias-correction mode, epsilon placement).
   * @throw wm::io_error on every rank if a rank could not write (then the temporaries are
   * removed and the previous checkpoint is untouched)
   * @throw wm::comm_error on every rank if a rank's pending gathers did not finish in time
   */
  void store(std::filesystem::path const& prefix);
  /**
   * @brief Reads a checkpoint written by `store` (collective), written by any rank count. A
   * cache is invalidated first (flushed and emptied: its lines would be stale), after the
   * gathers and prefetches this table issued on any stream (waited for, within the
   * communicator's timeout; else wm::comm_error on every rank).
   *
   * One collective step first checks, on every rank, the meta against this table (rows, dim,
   * element type, optimizer name and `checkpoint_tag()`, state slots, per-row steps) and every
   * part file of every set (present, exact size); only then are weights, states and steps read.
   * @throw wm::io_error on every rank, with the table unchanged, if anything is missing or does
   * not fit (another optimizer, another Adam bias-correction mode or epsilon placement, another
   * dim, a missing `.states` file, ...)
   */
  void load(std::filesystem::path const& prefix);

 private:
  communicator* comm_;
  Optimizer opt_;
  tensor<T, Location, Layout, Mapping> weights_;
  std::optional<tensor<float, Location, Layout, Mapping>> states_;
  std::optional<tensor<std::int64_t, Location, Layout, Mapping>> steps_;
  std::int64_t global_step_{0};
  detail::row_source<CachePolicy, T> source_;
  std::unique_ptr<detail::embedding_scratch> scratch_;

  /// This rank's weights, states and steps as the update and the cache see them.
  [[nodiscard]] detail::table_rows<T> table_rows();
};

}  // namespace wm
