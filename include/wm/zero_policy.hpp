// SPDX-License-Identifier: Apache-2.0
/**
 * @file zero_policy.hpp
 * @brief The host-side types of `wm::zero_optimizer` (zero.cuh): its policies (stage, offload),
 * the parameter description, the options and the memory report. No CUDA code: host programs and
 * tests read it with a plain C++20 compiler.
 */
#pragma once

#include <wm/detail/zero/plan.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace wm {
namespace detail::zero {
template <class Owner>
class device_update;  // detail/zero/device_update.cuh
template <class Owner>
class host_offload;  // detail/zero/offload/host_offload.cuh
}  // namespace detail::zero

/**
 * @brief ZeRO stage N: 1 partitions the optimizer states, 2 also the gradients, 3 also the
 * weights (docs/design.md, "ZeRO memory").
 * @tparam N 1, 2 or 3
 */
template <int N>
requires(N >= 1 && N <= 3) struct zero_stage {
  static constexpr int value = N;  ///< the stage number
};

/// Optimizer states, master weights and the update stay on the GPU.
struct no_offload {
  static constexpr bool host = false;  ///< nothing on the host
  /// The engine `wm::zero_optimizer` holds: device master weights and states, the fused update
  /// kernel per bucket shard (detail/zero/device_update.cuh).
  template <class Owner>
  using engine = detail::zero::device_update<Owner>;
};

/// fp32 master weights and Adam moments in pinned host memory, updated by the CPU Adam
/// (detail/zero/cpu_adam.hpp: threads, AVX-512 / AVX2 chosen at run time); each bucket's reduced
/// gradient shard goes to the host as soon as it is reduced, and its new weights come back and
/// are all-gathered while the CPU updates the next bucket. `wm::zero_optimizer` takes it with
/// `wm::adam` only.
struct offload_host {
  static constexpr bool host = true;  ///< masters and moments on the host
  /// The engine `wm::zero_optimizer` holds: pinned host master weights and moments, the CPU Adam
  /// and its pipeline (detail/zero/offload/host_offload.cuh).
  template <class Owner>
  using engine = detail::zero::host_offload<Owner>;
};

/// A ZeRO stage policy: `wm::zero_stage<1>`, `<2>` or `<3>`.
template <class S>
concept zero_stage_policy = std::same_as<S, zero_stage<S::value>>;

/// An offload policy: `wm::no_offload` or `wm::offload_host`.
template <class O>
concept offload_policy = std::same_as<O, no_offload> || std::same_as<O, offload_host>;

/// Element type of a parameter's compute weights and gradients (`f32`, `bf16`, `f16`).
using zero_element_type = detail::zero::element_type;

/// One parameter of the model, as `wm::zero_optimizer` takes it (list them in forward order).
struct zero_parameter {
  std::string name;                                 ///< unique, non-empty (checkpoints match by it)
  std::vector<std::size_t> shape;                   ///< dimensions; empty: a scalar
  zero_element_type type{zero_element_type::bf16};  ///< compute weight and gradient type

  /// Number of elements: the product of the shape (1 for a scalar, 0 if a dimension is 0).
  [[nodiscard]] std::size_t elements() const noexcept {
    std::size_t n = 1;
    for (auto d : shape) { n *= d; }
    return n;
  }
};

/// Settings of a `wm::zero_optimizer` besides the bucket size and the optimizer policy.
struct zero_options {
  /// Global gradient-norm clipping as `torch.nn.utils.clip_grad_norm_` (L2 norm over every
  /// parameter, after unscaling): gradients times min(1, max / (norm + 1e-6)). 0: no clipping.
  float max_grad_norm{0.0f};
  /// The loss was multiplied by this; gradients are divided by it before anything else. With
  /// `dynamic_loss_scale`, the initial scale.
  float loss_scale{1.0f};
  /// Dynamic loss scaling for fp16 compute, as torch.cuda.amp.GradScaler updates its scale: a
  /// step with an inf or NaN gradient on any rank is skipped and the scale multiplied by
  /// `scale_backoff`; after `scale_growth_interval` applied steps in a row it is multiplied by
  /// `scale_growth`. The scale for the next backward pass: `loss_scale()` (waits) or
  /// `loss_scale_device()` (a device pointer, no wait).
  bool dynamic_loss_scale{false};
  float scale_growth{2.0f};                  ///< > 1
  float scale_backoff{0.5f};                 ///< in (0, 1)
  std::int64_t scale_growth_interval{2000};  ///< > 0
  /// Divide the summed gradients by the rank count (PyTorch DDP's average); false keeps sums.
  bool average_gradients{true};
  /// Stage 3: the parameters (indices into the list, forward order) of each group that
  /// `gather` / `release` handle; empty: one group per parameter.
  std::vector<std::vector<std::size_t>> groups;
  /// Stage 3: bytes of the gather pool that holds gathered weights (the groups in use plus one
  /// prefetched). 0: twice the largest group. Raised to the largest group if smaller.
  std::size_t prefetch_bytes{0};
  /// `wm::offload_host`: run each bucket's CPU Adam as soon as its gradients reach the host,
  /// while backward goes on (the update of a step is still that step's: no delayed update). Until
  /// `step` knows the gradient norm, a chunk (`offload_chunk_elements`) is updated into a spare
  /// host region (`offload_spare_fraction`), so that a step that must not apply as computed (an
  /// inf/NaN skip, clipping that scales, a learning rate other than the one announced) leaves the
  /// current values as they were; such a step is then redone after backward as without the
  /// pipeline. Once `step` has decided, the chunks left are updated in place. false: the update
  /// runs in `step`, after backward.
  bool offload_pipeline{true};
  /// With `offload_pipeline`: the spare host regions for the chunks updated before `step`'s
  /// decision, as a fraction of the shard's chunks: ceil(fraction × chunks) regions, each the
  /// largest chunk's master weights and moments (about 12 pinned bytes per parameter times the
  /// fraction, beside the 16 of the unpipelined path).
  /// Only the part of the update that runs while backward does needs a region: with the CPU
  /// Adam slower than backward (what makes offload worth it), a fraction of about backward's time
  /// over the CPU Adam's. A chunk that finds no free region waits for the decision and is then
  /// updated in place (the CPU idles until backward ends; `zero_optimizer::offload_stats`
  /// counts such waits). 1: a region for every chunk (never waits); 0: nothing is updated before
  /// the decision. The default, 0.25, covers a backward of up to about a quarter of the CPU
  /// Adam's time (the MLPs of bench/zero_bench.cu need less, bench/NOTES.md) for a quarter of a
  /// full second copy's memory; results are the same bits for every value.
  float offload_spare_fraction{0.25f};
  /// With `offload_pipeline`: a bucket's gradients go to the host, and its update and weights
  /// back, in chunks of this many elements (a multiple of 64), so that the update of a bucket
  /// starts when its first chunk has landed and only its last chunk's weights are copied after
  /// the update ends.
  std::size_t offload_chunk_elements{std::size_t{1} << 24};
  /// With `offload_pipeline`: a step whose update the pipeline applies returns before the CPU
  /// Adam has updated every bucket, so that the next forward pass overlaps the end of the update
  /// (the CPU, which sets the pace of an offloaded step, otherwise idles through the forward).
  /// Once `step` has decided to apply the update, the CPU updates the buckets left in forward
  /// order (the last bucket first). The forward must then call `zero_optimizer::weights_ready(b,
  /// stream)` before it reads bucket b's weights (stage 3: `gather` does; stages 1-2:
  /// `weights(p)` throws for a parameter whose weights have not come yet); any other call that
  /// needs the step's results (`reduce_gradients`, `step`, `set_weights`, `save`, `load`,
  /// `master_shard`) first completes what is left (in stages 1-2 with the all-gathers left:
  /// every rank makes such a call at the same point). Ranks adopt an update only together (their
  /// vetoes ride on the norm's all-reduce), so they all-gather in the same order. false: `step`
  /// waits for the whole update.
  bool offload_overlap_forward{false};
  /// `wm::offload_host`: threads of the CPU Adam, the thread that runs it included. 0: one per
  /// CPU the constructing thread may run on (its affinity mask: a launcher that binds each rank's
  /// process to its own cores gives each rank's CPU Adam those cores). Several ranks on one host
  /// without such a binding should divide the cores between them here (and not pin).
  unsigned cpu_threads{0};
  /// `wm::offload_host`: pin each CPU Adam worker thread to one of those CPUs (worker k on the
  /// k-th, cyclically; the thread that calls the update, the library's own with
  /// `offload_pipeline`, the caller's of `step` without it or for a redone step, stays
  /// unpinned). Several ranks on one host need each its own CPUs (a launcher's binding):
  /// without one, every rank pins its workers to the same first CPUs of the host. Measured on one
  /// 16-core host: 0-6% faster, within that host's spread between runs (bench/NOTES.md); off
  /// by default because pinned threads take those cores from the user's own threads (data
  /// loaders). Linux only: elsewhere the constructor throws std::system_error.
  bool pin_cpu_threads{false};
  /// Stage 1: allocate a gradient shard (counted in `zero_memory::buffers`) that keeps the sum of
  /// a step's micro-batches, for `zero_optimizer::accumulate_gradients`. Stages 2-3 keep the sum
  /// in their gradient shard and need nothing more.
  bool gradient_accumulation{false};
};

/// Device bytes a `wm::zero_optimizer` allocated at construction, per kind.
struct zero_memory {
  std::size_t weights{};           ///< compute weights: the arena (stages 1-2) or its shard (3)
  std::size_t gradients{};         ///< compute gradients: the arena (stage 1) or its shard (2-3)
  std::size_t master_weights{};    ///< fp32 master weights of this rank's shard
  std::size_t optimizer_states{};  ///< fp32 optimizer states of this rank's shard
  std::size_t buffers{};           ///< bucket staging (stages 2-3) and the gather pool (stage 3)
  std::size_t scratch{};           ///< norm partials and step counters
  std::size_t host{};  ///< pinned host bytes (`wm::offload_host`: fp32 master weights, Adam
                       ///< moments, gradient and weight shards, and with
                       ///< `zero_options::offload_pipeline` the spare regions of
                       ///< `offload_spare_fraction`); not part of total()

  /// The terms of the ZeRO memory formula (docs/design.md, "ZeRO memory"): weights,
  /// gradients, master weights and optimizer states.
  [[nodiscard]] constexpr std::size_t model_states() const noexcept {
    return weights + gradients + master_weights + optimizer_states;
  }
  /// Every device byte.
  [[nodiscard]] constexpr std::size_t total() const noexcept {
    return model_states() + buffers + scratch;
  }
};

/**
 * @brief What the offload pipeline did (`wm::offload_host` with `zero_options::offload_pipeline`),
 * counted since construction; `zero_optimizer::offload_stats()` reads it between steps (with
 * `zero_options::offload_overlap_forward`: once every bucket's weights are ready). A chunk
 * is `zero_options::offload_chunk_elements` elements of a bucket's shard (the last one of a
 * bucket may be shorter).
 */
struct zero_offload_stats {
  std::int64_t chunks_ahead{};    ///< updated while backward ran, before the step's decision
  std::int64_t chunks_after{};    ///< updated by the pipeline in place, after the decision
  std::int64_t chunks_dropped{};  ///< updated ahead for a step that did not apply as assumed
  std::int64_t chunks_redone{};   ///< updated after backward by `step` (not ahead, or redone)
  std::int64_t region_waits{};    ///< a chunk found no free spare region: waited for the decision
  double wait_seconds{};          ///< time spent in those waits
  /// wall time of the CPU Adam's updates (every chunk, in the pipeline or in `step`), as they
  /// ran inside the steps: with other work beside them (copies, the GPU's driver threads)
  double cpu_adam_seconds{};
  std::size_t spare_regions{};    ///< regions in the pool (`offload_spare_fraction`)
  std::size_t region_elements{};  ///< elements per region (the largest chunk)
  std::size_t peak_regions{};     ///< most regions in use at once
};

}  // namespace wm
