// SPDX-License-Identifier: Apache-2.0
/**
 * @file decl/zero.cuh
 * @brief The declarations of `<wm/zero.cuh>` without their bodies, for `<wm/wm.cuh>`: every
 * type and signature, none of the definitions (docs/design.md, "Compile time").
 */
#pragma once

#include <wm/decl/comm.hpp>
#include <wm/detail/base/resources.hpp>
#include <wm/detail/zero/arenas.hpp>
#include <wm/detail/zero/counters.hpp>
#include <wm/detail/zero/plan.hpp>
#include <wm/detail/zero/residency.hpp>
#include <wm/optimizer.hpp>
#include <wm/zero_policy.hpp>

#include <cuda/stream_ref>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace wm {

/**
 * @brief Sharded data-parallel mixed-precision optimizer over one arena (docs/design.md,
 * "ZeRO memory").
 *
 * Every rank holds the compute weights (bf16, fp16 or fp32 per parameter) that forward and
 * backward use (stage 3: only while a group is gathered), and the fp32 master weights and
 * optimizer states of its shard. A step: Σ g² of the shard in float64 partials, one scalar
 * all-reduce (the inf/NaN check and the global norm in one number), then one fused kernel per
 * bucket shard: g · (1 / (loss scale · ranks)) · clip factor, the optimizer policy's element-wise
 * update (the one `wm::embedding` uses) on the fp32 master weight and states, the result cast to
 * the compute type straight into the all-gather's send block. A step whose gradients hold an inf
 * or NaN on any rank changes nothing and does not count (Adam's step count stays).
 *
 * Stream contract: pass the stream backward runs on (or order yours with events). In stages 2-3
 * the gradients of bucket b live in staging buffer b % 2, which bucket b + 2 reuses: its
 * `reduce_gradients(b)` must be enqueued before backward writes bucket b + 2's gradients; the
 * staging buffer is zeroed after the reduce-scatter. In stage 1 the gradients stay in the arena
 * until backward overwrites them, except with `wm::offload_host` and
 * `zero_options::offload_pipeline`: this rank's shard of bucket b's gradients then carries the
 * step's new weights back to the GPU from `reduce_gradients(b)` on (read gradients before it).
 *
 * @tparam Stage     `wm::zero_stage<1|2|3>`
 * @tparam Optimizer an optimizer policy of optimizer.hpp (`wm::adam`, `wm::sgd`, ...); every
 *                   element is updated every step, so its step count is the global one
 * @tparam Offload   `wm::no_offload`, or `wm::offload_host` (with `wm::adam`, bf16 or fp32
 *                   parameters): master weights and moments on the host, updated by the CPU
 *                   Adam bucket by bucket as each bucket's gradients land (the offload
 *                   pipeline; `step` waits for the norm and the last bucket on the host)
 */
template <zero_stage_policy Stage, sparse_optimizer Optimizer = adam,
          offload_policy Offload = no_offload>
class zero_optimizer {
 public:
  static constexpr int stage = Stage::value;  ///< 1, 2 or 3
  using optimizer_type       = Optimizer;     ///< the optimizer policy

  /**
   * @brief Builds the plan and allocates everything (collective over @p comm).
   * @param comm the data-parallel group (kept by address: do not move it while this lives)
   * @param params the parameters in forward order (same list on every rank)
   * @param bucket_bytes the bucket size (a larger parameter gets a bucket of its own)
   * @param optimizer the optimizer's hyper-parameters
   * @param options clipping, loss scale, averaging; stage 3: groups and the pool budget
   * @throw wm::logic_error on bad input (empty or duplicate names, bucket size 0, a group naming
   * an unknown parameter)
   * @throw wm::comm_error if the ranks passed different lists, sizes, stages or options
   */
  zero_optimizer(communicator& comm, std::span<zero_parameter const> params,
                 std::size_t bucket_bytes, Optimizer optimizer = {}, zero_options options = {});

  zero_optimizer(zero_optimizer const&)            = delete;
  zero_optimizer& operator=(zero_optimizer const&) = delete;
  zero_optimizer(zero_optimizer&&)                 = delete;
  zero_optimizer& operator=(zero_optimizer&&)      = delete;
  /// Waits for this rank's device work (never throws) and frees everything. With the offload
  /// pipeline, its CPU Adam stops at the next chunk boundary instead of finishing the update.
  ~zero_optimizer();

  /// The layout: buckets (backward order), shards, the fragments each rank holds.
  [[nodiscard]] detail::zero::plan const& layout() const noexcept { return plan_; }
  /// Number of parameters.
  [[nodiscard]] std::size_t parameters() const noexcept { return plan_.params.size(); }
  /// Number of buckets (the `reduce_gradients` calls per step).
  [[nodiscard]] std::size_t buckets() const noexcept { return plan_.buckets.size(); }
  /// The bucket of parameter @p p (`detail::zero::no_bucket` if it has no elements).
  [[nodiscard]] std::size_t bucket_of(std::size_t p) const { return plan_.places.at(p).bucket; }
  /// Index of the parameter named @p name. @throw wm::logic_error if there is none
  [[nodiscard]] std::size_t index(std::string_view name) const;
  /// Stage 3: number of groups.
  [[nodiscard]] std::size_t groups() const noexcept { return residency_.groups(); }
  /// Device bytes allocated at construction, per kind.
  [[nodiscard]] zero_memory memory() const noexcept { return memory_; }

  /**
   * @brief Compute weights of parameter @p p (its elements, contiguous, in the arena).
   * Stage 3: only while a group that holds it is gathered.
   * @tparam T `float`, `__nv_bfloat16` or `__half`, matching the parameter's type
   * @throw wm::logic_error on a wrong T, an index out of range, (stage 3) a parameter that is
   * not gathered, (stages 1-2, `zero_options::offload_overlap_forward`) a parameter whose
   * weights from the last step have not come yet: `weights_ready(bucket_of(p), stream)` first,
   * or (`wm::offload_host`) after an offload step failed, as every operation on the state does
   * (see the file's notes)
   */
  template <class T>
  [[nodiscard]] std::span<T> weights(std::size_t p);

  /**
   * @brief Where backward writes parameter @p p's gradient (overwriting; stages 2-3: a staging
   * buffer that is zero after its bucket's `reduce_gradients`). See the stream contract.
   * @throw wm::logic_error on a wrong T or an index out of range
   */
  template <class T>
  [[nodiscard]] std::span<T> gradients(std::size_t p);

  /**
   * @brief Sets parameter @p p's weights from @p values (`elements()` values of its compute
   * type, on the host or the device; the same on every rank), on @p stream. The fp32 master
   * weights of the rank's shard are taken from the compute weights at the next `step`. After a
   * step whose update is still finishing (`zero_options::offload_overlap_forward`) it first
   * completes it, which in stages 1-2 all-gathers the buckets left: then every rank must call it.
   */
  template <class T>
  void set_weights(std::size_t p, T const* values, cuda::stream_ref stream);

  /**
   * @brief Takes the fp32 master weights of this rank's shard from the compute weights again
   * (at the next step), e.g. after writing weights through `weights(p)` (stages 1-2).
   */
  void reset_master_weights() noexcept {
    masters_stale_ = true;
    engine_.invalidate();
  }

  /**
   * @brief Reduces bucket @p b's gradients over the ranks (collective), on @p stream: stage 1
   * all-reduces them in place; stages 2-3 reduce-scatter the staging buffer into this rank's
   * gradient shard and zero the staging buffer. Call once per bucket per step, buckets in any
   * order that every rank shares (backward order: 0, 1, ...).
   */
  void reduce_gradients(std::size_t b, cuda::stream_ref stream);

  /**
   * @brief Gradient accumulation over micro-batches: reduces bucket @p b's gradients of a
   * micro-batch that is not the step's last (collective, with the order rules of
   * `reduce_gradients`) and adds them to the sum of the step's earlier micro-batches. Backward
   * writes (overwrites) `gradients(p)` in every micro-batch as before; the last micro-batch calls
   * `reduce_gradients(b)`, which adds its own and goes on as usual (offload: the sum goes to the
   * host), and `step` updates with the sum (the loss scale and `average_gradients` apply once:
   * scale the loss by 1 / micro-batches for a mean). Each micro-batch's reduced gradients are
   * added to the sum in float and rounded to the compute type once. Stage 1 keeps the sum in a
   * shard allocated with `zero_options::gradient_accumulation`; the arena then holds the last
   * micro-batch's reduced gradients outside this rank's shard.
   * @throw wm::logic_error on a bucket index out of range, or at stage 1 without
   * `zero_options::gradient_accumulation`
   */
  void accumulate_gradients(std::size_t b, cuda::stream_ref stream);

  /**
   * @brief One optimizer step with learning rate @p lr (collective), on @p stream, without
   * waiting on the host (`wm::offload_host`: it waits for the norm and the CPU Adam): the norm
   * partials, one scalar all-reduce, the fused update of every bucket shard, then (stages 1-2) the
   * in-place all-gather of the weights. Stage 3: no group may be gathered (the gathered copies
   * would be stale); the next `gather` brings the new weights. With
   * `zero_options::offload_overlap_forward`, a step whose pipelined update applies returns while
   * the CPU Adam finishes the last buckets: `weights_ready` brings each bucket's weights.
   * @throw wm::logic_error if a group is gathered (stage 3), a bucket that
   * `accumulate_gradients` took lacks its `reduce_gradients`, or an offload step failed before
   * @throw wm::comm_error at the communicator's deadline (a peer, or with `wm::offload_host` the
   * CPU Adam, did not end in time), or what the CPU Adam threw: with `wm::offload_host` the
   * optimizer is unusable from then on (see the file's notes)
   */
  void step(float lr, cuda::stream_ref stream);

  /**
   * @brief `wm::offload_host` with `zero_options::offload_pipeline`: announces the learning rate
   * the next `step` will get, before that step's first `reduce_gradients`, so that the CPU Adam
   * can update each bucket as soon as its gradients land. Without it the pipeline assumes the
   * last step's rate. A `step` with another rate is still right (its update is redone after
   * backward) but not overlapped. Does nothing for the other policies.
   */
  void prepare_step(float lr) noexcept { engine_.prepare(lr); }

  /**
   * @brief `wm::offload_host` with `zero_options::offload_overlap_forward`: makes the new
   * weights of bucket @p b, and of every bucket above it, available on @p stream after a `step`
   * that returned before the CPU Adam had finished (collective: stages 1-2 all-gather them; call
   * it in the same order on every rank). Waits on the host, with the communicator's deadline,
   * until the CPU Adam has sent those buckets back; @p stream waits for their copies. The forward
   * calls it before it first reads a bucket's weights, going down from the last bucket (its
   * first layers). Does nothing when nothing is pending (another policy, the option off, or the
   * buckets ready already), or for `detail::zero::no_bucket` (`bucket_of` a parameter without
   * elements).
   * @throw wm::logic_error on a bucket index out of range, or after an offload step failed
   * @throw wm::comm_error at the deadline, or what the CPU Adam threw (the optimizer is unusable
   * from then on)
   */
  void weights_ready(std::size_t b, cuda::stream_ref stream);

  /**
   * @brief Stage 3: makes group @p g's weights available on @p stream (collective): its buckets
   * not gathered yet are all-gathered into the pool (on an internal stream that waits for @p
   * stream's work so far; @p stream waits for them), then the next group in the direction of
   * the last two gathers is prefetched if it fits in the pool beside what is held.
   * @throw wm::logic_error if @p g is gathered already or does not fit beside the groups held
   */
  void gather(std::size_t g, cuda::stream_ref stream) requires(Stage::value == 3);

  /**
   * @brief Stage 3: drops group @p g's weights (collective in effect: every rank must make the
   * same gathers and releases, since they decide the all-gathers). Work that reads them must
   * have been enqueued on the stream given to `gather` before this call.
   */
  void release(std::size_t g) requires(Stage::value == 3);

  /**
   * @brief Saves this rank's fp32 master weights and optimizer states, with the fragment table
   * that names what each range holds, to a file of @p dir (collective; waits for @p stream;
   * creates @p dir). All or nothing across the ranks: every rank's file is written and flushed
   * to the disk and the ranks agree before any is renamed into a new generation, which
   * `dir/manifest`, written by rank 0 last, names (docs/design.md, "Checkpoints"). A failure or
   * a crash at any point leaves the previous checkpoint in @p dir, or the new one, never a mix.
   * A directory saved by any rank count, bucket size or stage loads into any other (`load`).
   * @throw wm::io_error on every rank if any rank could not write its file, naming the ranks
   * that failed and their errors; the previous checkpoint in @p dir still loads
   */
  void save(std::filesystem::path const& dir, cuda::stream_ref stream);

  /**
   * @brief Loads a directory written by `save` (collective; waits for @p stream): from the files
   * its manifest names (no other file is read), this rank's master weights and states are read
   * from the stored fragments that intersect its shard (any rank count, bucket size or stage
   * saved it), the compute weights are made from the masters
   * (stages 1-2: all-gathered), and the step count is restored. Stage 3: no group may be
   * gathered.
   * @throw wm::io_error on every rank if any rank could not load: a file missing or malformed,
   * a parameter missing or of another size, another optimizer or other optimizer settings
   */
  void load(std::filesystem::path const& dir, cuda::stream_ref stream);

  /// Whether the last step was skipped for an inf or NaN gradient (waits for @p stream).
  [[nodiscard]] bool last_step_skipped(cuda::stream_ref stream) const;
  /// Steps applied so far, skipped ones not counted (waits for @p stream).
  [[nodiscard]] std::int64_t applied_steps(cuda::stream_ref stream) const;
  /** @brief The loss scale the next backward pass must use (`zero_options::loss_scale`, updated
   * by each step with `dynamic_loss_scale`); waits for @p stream. */
  [[nodiscard]] float loss_scale(cuda::stream_ref stream) const;
  /** @brief The same scale on the device, for a loss kernel on the stream after `step` (no host
   * wait). */
  [[nodiscard]] float const* loss_scale_device() const noexcept { return scale_; }

  /// This rank's fp32 master weights: `layout().state_elements` floats on the device (pinned
  /// host memory with `wm::offload_host`), in the order of `layout().fragments(rank)`. With the
  /// offload pipeline, call it between steps: it first copies the chunks whose current values
  /// sit in a spare region back to their place (a step begun is then redone after backward).
  [[nodiscard]] float const* master_shard() const {
    expect_usable("master_shard");
    engine_.settle_states();
    return engine_.master();
  }
  /// This rank's optimizer state @p k (0 ≤ k < Optimizer::states), laid out as `master_shard`.
  /// @throw wm::logic_error on k out of range
  [[nodiscard]] float const* state_shard(int k) const {
    expect_usable("state_shard");
    WM_EXPECTS(k >= 0 && k < Optimizer::states,
               "zero_optimizer::state_shard: a state index in [0, " +
                   std::to_string(Optimizer::states) + "), got " + std::to_string(k));
    engine_.settle_states();
    return engine_.states() + static_cast<std::size_t>(k) * plan_.state_elements;
  }
  /**
   * @brief `wm::offload_host` with the pipeline: whether the last step's update was the one the
   * pipeline computed beside backward (false: redone after backward, skipped, or no pipeline).
   */
  [[nodiscard]] bool last_step_pipelined() const noexcept { return engine_.pipelined(); }
  /**
   * @brief `wm::offload_host` with the pipeline: chunks updated ahead of the step's decision, in
   * place after it, dropped and redone, waits for a spare region, and the spare pool's size and
   * peak use, since construction. Call it between steps (zero for the other policies).
   */
  [[nodiscard]] zero_offload_stats offload_stats() const noexcept { return engine_.stats(); }

 private:
  // The offload policy's engine: where the master weights and states live and how a step
  // updates them (detail/zero/device_update.cuh, detail/zero/offload/host_offload.cuh).
  using engine_type = typename Offload::template engine<zero_optimizer>;
  friend engine_type;

  void* shard_weights(std::size_t b) const noexcept;  // the send block of bucket b's all-gather
  void all_gather_bucket(std::size_t b, std::byte* into, cuda::stream_ref stream);
  void* shard_gradients(std::size_t b) const noexcept;
  void* staging(std::size_t b) const noexcept;
  void widen_masters(cudaStream_t s);
  void gather_buckets(std::vector<detail::zero::residency::load> const& loads, cudaStream_t s);
  void read_counters(cuda::stream_ref stream) const;
  void agree(std::string const& error, char const* what);
  double* norm_async(cuda::stream_ref stream);  // the global sum of squares, on the device
  void norm_partials(std::size_t b, cudaStream_t s);
  // The partials summed, then all-reduced with @p veto beside (global[1]: the ranks' sum).
  double* norm_total(cuda::stream_ref stream, double veto = 0.0);
  // reduce_gradients (last: the step's last micro-batch) and accumulate_gradients.
  void reduce_bucket(std::size_t b, cuda::stream_ref stream, bool last);
  // Throws wm::logic_error naming @p operation once the engine failed (offload: a step).
  void expect_usable(char const* operation) const { engine_.check(operation); }

  communicator* comm_;
  Optimizer opt_;
  zero_options options_;
  detail::zero::plan plan_;
  int rank_{0};
  int world_{1};
  std::vector<std::size_t> shard_bytes_offset_;  // bucket b's shard in the shard arenas
  std::vector<std::size_t> partial_offset_;      // bucket b's first norm partial
  std::vector<int> partial_blocks_;
  std::size_t partials_{0};
  // The buffers (detail/zero/arenas.hpp); the pointers below point into them.
  std::unique_ptr<detail::zero::arenas> arenas_;
  std::byte* weights_{nullptr};  // stages 1-2: arena; 3: shard arena
  std::byte* grads_{nullptr};    // stage 1: arena; 2-3: shard arena
  std::byte* staging_{nullptr};  // stages 2-3: two buckets
  std::byte* pool_{nullptr};     // stage 3: gather pool
  std::byte* accum_{nullptr};    // stage 1 with gradient_accumulation: the sums (shard layout)
  double* scratch_{nullptr};     // partials, then [local Σ g², veto, global Σ g², vetoes]
  detail::zero::step_counters* counters_{nullptr};       // device
  detail::zero::step_counters* host_counters_{nullptr};  // pinned host
  float* scale_{nullptr};                                // the loss scale of the next step (device)
  mutable float host_scale_{1.0f};         // offload: the scale itself; else the last one read
  std::vector<std::uint8_t> accumulated_;  // per bucket: a micro-batch's sum is kept this step
  detail::unique_stream gather_stream_;
  detail::unique_event gather_done_;
  detail::unique_event user_ready_;
  detail::zero::residency residency_;
  std::vector<std::vector<std::size_t>> group_buckets_;
  std::ptrdiff_t last_group_{-1};
  int direction_{1};
  bool masters_stale_{true};
  zero_memory memory_{};
  engine_type engine_;  // last: it stops (the offload pipeline's worker) before the buffers go
};

}  // namespace wm
