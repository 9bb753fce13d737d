// SPDX-License-Identifier: Apache-2.0
/**
 * @file zero.cuh
 * @brief ZeRO data parallelism (docs/design.md, "ZeRO memory"): `wm::zero_optimizer`, a sharded
 * mixed-precision optimizer over one contiguous arena, stages 1, 2 and 3 on the GPU.
 *
 * Layout (`wm::detail::zero::make_plan`, detail/zero/plan.hpp): the parameters, in backward
 * order, in buckets of about the bucket size, each bucket padded so that it splits into `world`
 * equal shards aligned to 128 bytes. Rank r owns shard r of every bucket: the fp32 master
 * weights and optimizer states of those elements live on rank r only. Gradients take a true
 * reduce-scatter per bucket (stage 1: an all-reduce), the new weights an in-place all-gather.
 *
 * Per step (construction, reduce_gradients, step, gather/release, save/load are collective: all
 * ranks, same order):
 * @code
 * wm::zero_optimizer<wm::zero_stage<2>> opt{comm, params, 64 << 20, wm::adam{}};
 * opt.set_weights(p, initial, stream);        // once per parameter (host or device values)
 * // forward reads opt.weights<bf16>(p); backward writes opt.gradients<bf16>(p) (overwrites);
 * // as each bucket's gradients are complete (bucket 0 holds the last parameters):
 * opt.reduce_gradients(bucket, stream);       // stage 1: all-reduce; 2-3: reduce-scatter
 * opt.step(lr, stream);                       // norm partials, one scalar all-reduce, the fused
 *                                             // update per shard, then the in-place all-gather
 * // stage 3: groups (zero_options::groups) and a pool budget declared at construction
 * opt.gather(group, stream); ...; opt.release(group);
 * @endcode
 *
 * Memory: everything is allocated by the constructor and reported by `memory()`; nothing is
 * allocated per step. Stage 1 keeps the arena of weights and of gradients; stage 2 the weights
 * and a gradient shard, plus two bucket staging buffers that backward writes into; stage 3 a
 * weight shard, a gradient shard, the two staging buffers and the gather pool.
 *
 * Checkpoints: `save(dir)` writes one file per rank, its fp32 shard with a fragment table
 * (parameter name, offset, length), and a manifest that names them, all or nothing across the
 * ranks (a failed or interrupted save leaves the previous checkpoint); `load(dir)` reads them into
 * any rank count, bucket size or stage by intersecting the tables with the new plan
 * (detail/zero/reshard.hpp, checkpoint.hpp).
 *
 * Offload (`wm::offload_host`, with `wm::adam`): the fp32 master weights and moments live in
 * pinned host memory; `reduce_gradients` sends each reduced gradient shard to the host at once
 * (on a copy stream, so backward does not wait for it). With `zero_options::offload_pipeline`
 * (the default) a host thread runs the CPU Adam on each bucket as soon as its gradients have
 * landed, while backward goes on, and sends the bucket's new weights back into its (now free)
 * device gradient shard; `step` then only sums the norm, waits for the last bucket and
 * all-gathers (stage 3: copies) the new weights into place. A bucket updated before the step's
 * global gradient norm is known is computed with this step's learning rate (`prepare_step`, else
 * the last step's) and no clipping, chunk by chunk (`offload_chunk_elements`) into a spare host
 * region (a pool of `zero_options::offload_spare_fraction` of the masters and moments; a chunk
 * whose values are in a region writes them back to its place instead); once `step` knows the norm
 * it decides: the step applies as assumed (the chunks left are updated in place, and those done
 * ahead take what they wrote as current), or it does not (an inf/NaN skip: nothing applies;
 * clipping that scales the gradients, another learning rate, weights set in between: the update is
 * redone after backward, as without the pipeline) and the work done ahead is dropped. A chunk that
 * finds no free region waits for the decision and is then updated in place. Results are the same
 * bits either way, for any pool size. Without the pipeline `step` waits for the norm, runs the CPU
 * Adam bucket by bucket and sends each bucket's weights back (and all-gathers them) while the CPU
 * updates the next. With `zero_options::offload_overlap_forward` a step that adopts the pipeline's
 * update does not wait for it: the CPU goes on with the buckets left in forward order while the
 * next forward runs, which calls `weights_ready(b, stream)` before it reads bucket b (going down
 * from the last bucket, the first layers'); stage 3's `gather` calls it for its groups.
 *
 * A failed offload step (a wait past the communicator's deadline, an exception from the CPU Adam,
 * a cancelled wait; in `step`, `reduce_gradients`, `weights_ready`, or wherever an update still
 * finishing is waited for) throws that error once and leaves the optimizer unusable: the host
 * master weights and moments may be half updated. It keeps the first failure's message, stops
 * the pipeline's CPU Adam at its next chunk, and from then on every operation that reads or
 * writes its state (`weights`, `gradients`, `set_weights`, `reduce_gradients`,
 * `accumulate_gradients`, `step`, `weights_ready`, `gather`, `save`, `load`, `master_shard`,
 * `state_shard`, `last_step_skipped`, `applied_steps`, `loss_scale`) throws a `wm::logic_error`
 * that says so and names that message (the layout queries, `memory`, `offload_stats` and
 * `release` still answer). Destroy it (the destructor does not wait for the rest of the
 * update) and load the last checkpoint into a new one. The other ranks are not told at once:
 * they notice when a collective this rank left out is waited for (a synchronizing wait on
 * the communicator ends with a `wm::comm_error` at its deadline and aborts the communicator), and
 * their next offload step then fails too and leaves their optimizer unusable as well.
 *
 * Loss scaling: a fixed `zero_options::loss_scale`, or with `dynamic_loss_scale` the rule of
 * torch.cuda.amp.GradScaler (backoff on an inf/NaN step, growth after an interval of applied
 * steps), kept on the device (`loss_scale_device()`) so that a step needs no host wait. A step
 * with an inf or NaN gradient is skipped on every rank and `last_step_skipped` says so. The
 * scale is not part of a checkpoint: `load` keeps the current one.
 *
 * Gradient accumulation over micro-batches: `accumulate_gradients(b, stream)` for every
 * micro-batch but the last, `reduce_gradients(b, stream)` for the last, then `step`.
 */
#pragma once

#include <wm/comm.hpp>
#include <wm/decl/zero.cuh>
#include <wm/detail/zero/checkpoint.hpp>
#include <wm/detail/zero/cpu_adam.hpp>
#include <wm/detail/zero/reshard.hpp>
#include <wm/detail/zero/zero_optimizer.cuh>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
