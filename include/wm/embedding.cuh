/**
 * @file embedding.cuh
 * @brief `wm::embedding<T, CachePolicy, Optimizer, Location, Layout, Mapping>`: an embedding
 * table over a `wm::tensor`, trained with a fused sparse optimizer.
 *
 * - Forward: `gather(indices, out, stream)` (the tensor's gather: mapped kernel or NCCL dispatch).
 * - Backward + update: `apply_gradients(indices, grads, lr, stream)` (collective). Gradients
 *   travel to the rank that owns each row (the reverse of the gather path, as sok-dispatch's
 *   backward), the owner sorts them by row and sums duplicates, then one fused kernel reads each
 *   unique row's weight, optimizer state and summed gradient once and writes them once.
 *   Optimizer state (and Adam's per-row step) lives in tensors with the table's partition, so
 *   updates never cross GPUs. State and gradient sums are float whatever T is.
 * - Checkpoints: `store(prefix)` / `load(prefix)` write and read weights, states, steps and the
 *   global step in global row order; they load into any rank count, layout or mapping. All or
 *   nothing: `load` checks every file first, `store` writes temporaries and renames them.
 *
 * Cache policies: only `wm::no_cache` exists yet; a cache plugs in around gather and the
 * owner-side update without changing the optimizer code.
 */
#pragma once

#include <wm/comm.hpp>
#include <wm/optimizer.hpp>
#include <wm/tensor.cuh>

#include <cuda/stream_ref>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>

namespace wm {

/** @brief Cache policy: no cache; every gather reads the table. */
struct no_cache {
  static constexpr char const* name = "no_cache";
};

/** @brief A cache policy (only `wm::no_cache` so far). */
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
  enum class kind { zeros, uniform, normal };
  kind how{kind::uniform};
  float a{-0.05f};  ///< uniform: low; normal: mean
  float b{0.05f};   ///< uniform: high; normal: standard deviation
  std::uint64_t seed{42};

  [[nodiscard]] static embedding_init zeros() { return {kind::zeros, 0, 0, 0}; }
  [[nodiscard]] static embedding_init uniform(float low, float high, std::uint64_t seed) {
    return {kind::uniform, low, high, seed};
  }
  [[nodiscard]] static embedding_init normal(float mean, float stddev, std::uint64_t seed) {
    return {kind::normal, mean, stddev, seed};
  }

  /// The initial value of (row, col): host and device.
  [[nodiscard]] WM_HOST_DEVICE float value(std::size_t row, std::size_t col,
                                           std::size_t dim) const noexcept;
};

namespace detail {
struct embedding_scratch;
template <class CachePolicy>
struct row_source;  // where gather reads and the update writes rows (detail/embedding/source.cuh)
}  // namespace detail

/**
 * @brief An embedding table of `rows` × `dim` values of T spread over the ranks.
 *
 * @tparam T float, half (`__half`) or bfloat16 (`__nv_bfloat16`)
 * @tparam CachePolicy `wm::no_cache`
 * @tparam Optimizer `wm::sgd`, `wm::adam`, `wm::rmsprop`, `wm::adagrad`, `wm::no_optimizer`, or
 * any type satisfying `wm::sparse_optimizer` (see <wm/optimizer.hpp>)
 * @tparam Location, Layout, Mapping the storage, as for `wm::tensor`
 */
template <class T, cache_policy CachePolicy = no_cache, optimizer_policy Optimizer = sgd,
          location Location = device, layout Layout = chunked, mapping Mapping = block>
class embedding {
 public:
  using value_type     = T;
  using optimizer_type = Optimizer;

  /**
   * @brief Allocates and initializes the table (collective).
   * @param comm the owning group (must outlive the table)
   * @param rows number of rows; @param dim values per row (>= 1)
   * @param optimizer hyper-parameters (ignored by `no_optimizer`)
   * @param init how to fill the weights
   * @throw wm::logic_error on every rank, before anything is allocated, if one rank would hold
   * more than 2^32 - 1 rows (the update sorts local rows as 32-bit keys)
   * @throw wm::comm_error on every rank if the ranks passed different @p rows or @p dim
   */
  embedding(communicator& comm, std::size_t rows, std::size_t dim, Optimizer optimizer = {},
            embedding_init init = {});
  embedding(embedding&&) noexcept;
  embedding& operator=(embedding&&) noexcept;
  ~embedding();

  [[nodiscard]] std::size_t rows() const noexcept { return weights_.rows(); }
  [[nodiscard]] std::size_t dim() const noexcept { return weights_.cols(); }
  [[nodiscard]] Optimizer const& optimizer() const noexcept { return opt_; }
  /// The weight tensor (e.g. to load weights from files or read local rows).
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

  /** @brief Forward: `out[i, :] = table[indices[i], :]`; see `wm::tensor::gather`. */
  template <index_type Index>
  void gather(std::span<Index const> indices, T* out, cuda::stream_ref stream) {
    detail::row_source<CachePolicy>::gather(weights_, indices, out, stream);
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
   * (collective). Rows are in global order, so it loads into any rank count or layout.
   *
   * Every file is written under a temporary name (`<file>.tmp`) and flushed; only when every rank
   * has written, the old `.meta` is removed, the parts are renamed and the new `.meta` is renamed
   * last. A crash leaves either the old checkpoint, or one without `.meta` (refused by `load`; the
   * `.tmp` files are still there), or the new one. The meta records rows, dim, element type,
   * optimizer name and its `checkpoint_tag()` (Adam: bias-correction mode, epsilon placement).
   * @throw wm::io_error on every rank if a rank could not write (then the temporaries are
   * removed and the previous checkpoint is untouched)
   */
  void store(std::filesystem::path const& prefix);
  /**
   * @brief Reads a checkpoint written by `store` (collective), written by any rank count.
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
  std::unique_ptr<detail::embedding_scratch> scratch_;
};

}  // namespace wm

#include <wm/detail/embedding/embedding.cuh>
