/**
 * @file zero.cuh
 * @brief ZeRO data parallelism (issue 20, DESIGN.md §8): the policy types of
 * `wm::zero_optimizer` and, so far, its host-side foundations. THE OPTIMIZER ITSELF DOES NOT
 * EXIST YET: `wm::zero_optimizer` is only declared, so code that uses it does not compile.
 *
 * What exists (host code, tested on the CPU in tests/zero/):
 * - the bucket and shard plan, `wm::detail::zero::make_plan` (detail/zero/plan.hpp): one arena,
 *   buckets in backward order, each padded so it splits into `world` equal shards aligned to 128
 *   bytes, the parameter fragments each rank's shard holds; and the memory formula of DESIGN.md
 *   §8 per stage, `wm::detail::zero::zero_memory_estimate`;
 * - checkpoint resharding, `wm::detail::zero::plan_shard_reads` (detail/zero/reshard.hpp): a
 *   stored shard's fragment table (name, offset, length) intersected with a new plan of any rank
 *   count gives the reads that load it;
 * - the CPU Adam/AdamW of the offload path, `wm::detail::zero::cpu_adam_update`
 *   (detail/zero/cpu_adam.hpp): threads + AVX-512 / AVX2 / scalar chosen at run time.
 *
 * Intended API (not implemented; the names and shapes the issue asks for):
 * @code
 * // Collective over `comm`: every rank passes the same parameter list (forward order).
 * wm::zero_optimizer<wm::zero_stage<2>, wm::adam, wm::offload_host> opt{
 *   comm, params,              // names, shapes, element types (bf16 / fp16 compute weights)
 *   64 << 20,                  // bucket size in bytes
 *   wm::adam{...}};            // the optimizer policy's hyper-parameters
 * opt.weights(p);              // the bf16 compute weights of parameter p (in the arena)
 * opt.gradients(p);            // where backward writes p's gradient
 * // backward, as each bucket's gradients are complete (buckets are in backward order):
 * opt.reduce_gradients(bucket, stream);  // stage 1: all-reduce; stages 2-3: reduce-scatter
 * opt.step(lr, stream);        // per shard: unscale, inf check, global-norm clip, update, cast
 *                              // to bf16 into the all-gather buffer; then the all-gather
 * // stage 3 only: groups and a prefetch budget in bytes declared at construction
 * opt.gather(group, stream);   // before the group's forward / backward (next group prefetched)
 * opt.release(group);
 * opt.memory();                // bytes allocated at construction, per kind
 * opt.save(dir); opt.load(dir);  // fragment tables: loads into any rank count and stage
 * @endcode
 */
#pragma once

#include <wm/detail/zero/cpu_adam.hpp>
#include <wm/detail/zero/plan.hpp>
#include <wm/detail/zero/reshard.hpp>
#include <wm/optimizer.hpp>

#include <concepts>

namespace wm {

/**
 * @brief ZeRO stage N: 1 partitions the optimizer states, 2 also the gradients, 3 also the
 * weights (DESIGN.md §8).
 * @tparam N 1, 2 or 3
 */
template <int N>
requires(N >= 1 && N <= 3) struct zero_stage {
  static constexpr int value = N;  ///< the stage number
};

/// Optimizer states, master weights and the update stay on the GPU.
struct no_offload {
  static constexpr bool host = false;
};

/// fp32 master weights and optimizer states in pinned host memory, updated by the CPU Adam;
/// bf16 weights come back to the GPU per bucket.
struct offload_host {
  static constexpr bool host = true;
};

/// A ZeRO stage policy: `wm::zero_stage<1>`, `<2>` or `<3>`.
template <class S>
concept zero_stage_policy = std::same_as<S, zero_stage<S::value>>;

/// An offload policy: `wm::no_offload` or `wm::offload_host`.
template <class O>
concept offload_policy = std::same_as<O, no_offload> || std::same_as<O, offload_host>;

/**
 * @brief Sharded data-parallel optimizer over one arena (issue 20). Declared only: NOT
 * IMPLEMENTED YET (see the file comment for the intended API and what exists).
 * @tparam Stage     `wm::zero_stage<1|2|3>`
 * @tparam Optimizer an optimizer policy of optimizer.hpp (its element-wise update is reused)
 * @tparam Offload   `wm::no_offload` or `wm::offload_host`
 */
template <zero_stage_policy Stage, class Optimizer = adam, offload_policy Offload = no_offload>
class zero_optimizer;

}  // namespace wm
