// SPDX-License-Identifier: Apache-2.0
// The step of the host offload engine (host_offload.cuh): the CPU Adam of a shard's range
// (cpu_adam.hpp), and the step that adopts the pipeline's update or redoes it bucket by bucket
// after backward, the ranks deciding together from the all-reduced norm.
#pragma once

#include <wm/detail/zero/cpu_adam.hpp>
#include <wm/detail/zero/kernels.cuh>
#include <wm/detail/zero/offload/host_offload.cuh>
#include <wm/detail/zero/plan.hpp>
#include <wm/detail/zero/spare_regions.hpp>

#include <cuda/stream_ref>

#include <cuda_runtime_api.h>

#include <array>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>

namespace wm::detail::zero {

template <class Owner>
std::array<float*, 3> host_offload<Owner>::home_states(std::size_t b,
                                                       std::size_t first) const noexcept {
  std::size_t const off = o_->plan_.buckets[b].state_offset + first;
  return {master() + off, states() + off, states() + o_->plan_.state_elements + off};
}

template <class Owner>
void host_offload<Owner>::cpu_update(std::size_t b, std::size_t first, std::size_t count, float lr,
                                     std::int64_t t, float factor, std::array<float*, 3> in,
                                     std::array<float*, 3> out) {
  static_assert(optimizer_type::states == 2, "the CPU Adam keeps m and v");
  Owner& o                = *o_;
  auto const started      = std::chrono::steady_clock::now();
  auto const& bk          = o.plan_.buckets[b];
  std::size_t const at    = o.shard_bytes_offset_[b] + first * size_of(bk.type);
  std::byte* const grads  = storage_->host_grads.data() + at;
  std::byte* const weight = storage_->host_weights.data() + at;
  cpu_adam_options const opts{o.opt_.beta1, o.opt_.beta2, o.opt_.eps, o.opt_.weight_decay,
                              o.opt_.decoupled};
  bool const separate     = out[0] != in[0];  // into other arrays (ahead of the decision)
  float* const master_out = separate ? out[0] : nullptr;
  float* const m_out      = separate ? out[1] : nullptr;
  float* const v_out      = separate ? out[2] : nullptr;
  if (bk.type == element_type::bf16) {
    cpu_adam_update(opts, cpu_adam_step{lr, t, factor},
                    cpu_adam_arrays<bf16_bits>{
                        in[0], in[1], in[2], reinterpret_cast<bf16_bits const*>(grads),
                        reinterpret_cast<bf16_bits*>(weight), count, master_out, m_out, v_out},
                    *cpu_pool_);
  } else {
    cpu_adam_update(
        opts, cpu_adam_step{lr, t, factor},
        cpu_adam_arrays<float>{in[0], in[1], in[2], reinterpret_cast<float const*>(grads), nullptr,
                               count, master_out, m_out, v_out},
        *cpu_pool_);
    std::memcpy(weight, out[0], count * sizeof(float));
  }
  cpu_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now() - started)
                        .count(),
                    std::memory_order_relaxed);
}

template <class Owner>
void host_offload<Owner>::step(float lr, cuda::stream_ref stream) {
  Owner& o               = *o_;
  auto const& plan       = o.plan_;
  auto const& options    = o.options_;
  auto& counters         = *o.host_counters_;
  cudaStream_t const s   = stream.get();
  bool const pipeline    = options.offload_pipeline;
  speculation const spec = std::exchange(spec_, speculation{});
  step_open_             = false;
  pipelined_             = false;
  next_lr_               = lr;  // the next step's guess, unless prepare_step says otherwise
  if (pipeline) {               // the gradients' copies to the host, before the host reads them
    WM_CUDA_TRY(cudaEventRecord(d2h_done_.get(), d2h_stream_.get()));
    WM_CUDA_TRY(cudaStreamWaitEvent(s, d2h_done_.get(), 0));
  }
  bool const stale = o.masters_stale_;
  if (o.masters_stale_) {  // weights were set: the pipeline's work (if any) is dropped
    if (spec.active) {
      decision_.store(step_decision::drop, std::memory_order_release);
      finish_pipeline(stream);  // it reads the masters that the widen rewrites
      end_speculation(false);
    }
    gather_host_copies();  // the moments stay; the masters come from the compute weights
    o.widen_masters(s);
  }
  // This rank can adopt the pipeline's update if the update assumed this step's inputs as this
  // rank knows them: the same learning rate and count, every bucket posted, nothing that
  // changed its inputs since (weights set, states read while it ran ahead). Some of these are
  // this rank's own (a reset_master_weights, how far its worker got when the states were
  // read), so the ranks sum their vetoes in the norm's all-reduce and adopt only together: with
  // offload_overlap_forward an adopting rank all-gathers in another order than a redoing one.
  bool const can_adopt = spec.active && !stale && !spec.invalid &&
                         spec.posted == plan.buckets.size() && spec.t == counters.applied + 1 &&
                         std::bit_cast<std::uint32_t>(spec.lr) == std::bit_cast<std::uint32_t>(lr);
  // The pipeline took the partials as each bucket was reduced (its shards now hold weights).
  double* const global =
      pipeline ? o.norm_total(stream, can_adopt ? 0.0 : 1.0) : o.norm_async(stream);
  double* const sumsq = storage_->host_sumsq.data();
  WM_CUDA_TRY(cudaMemcpyAsync(sumsq, global, 2 * sizeof(double), cudaMemcpyDeviceToHost, s));
  // The norm, and every gradient shard on the host (reduce_gradients sent them).
  o.comm_->synchronize(stream, "zero_optimizer::step");
  bool const vetoed = !(sumsq[1] == 0.0);
  float const scale = o.host_scale_;  // this step's
  bool const skip   = !std::isfinite(sumsq[0]);
  float const ranks = options.average_gradients ? static_cast<float>(o.world_) : 1.0f;
  float const factor =
      skip ? 0.0f : grad_factor_of(sumsq[0], 1.0f / (scale * ranks), options.max_grad_norm);
  // The pipeline's update is this step's if every rank can adopt it and it assumed this
  // step's gradient factor (clipping that scales changes it; the factor, like skip, comes from
  // the all-reduced norm, so every rank decides the same).
  bool const adopt =
      can_adopt && !vetoed && !skip &&
      std::bit_cast<std::uint32_t>(spec.factor) == std::bit_cast<std::uint32_t>(factor);
  if (spec.active) {
    // The chunks the worker has not begun are done in place now (or not at all); then it ends
    // the last buckets. What it did ahead becomes current, or is dropped. With
    // offload_overlap_forward an adopted update ends while the caller goes on (settle_tail).
    decision_.store(adopt ? step_decision::apply : step_decision::drop, std::memory_order_release);
    if (adopt && options.offload_overlap_forward) {
      tail_worker_ = true;
    } else {
      finish_pipeline(stream);
      end_speculation(adopt);
    }
  }
  if (options.dynamic_loss_scale) {  // the next step's scale, on the host and the device
    update_scale(skip, o.host_scale_, counters.growth_tracker, options.scale_growth,
                 options.scale_backoff, options.scale_growth_interval);
    WM_CUDA_TRY(
        cudaMemcpyAsync(o.scale_, &o.host_scale_, sizeof(float), cudaMemcpyHostToDevice, s));
  }
  if (skip) {  // every rank sees the same sum: every rank skips (the pipeline's copy is dropped)
    counters.last_skipped = 1;
    ++counters.skipped;
    return;
  }
  counters.last_skipped = 0;
  std::int64_t const t  = ++counters.applied;
  if (adopt) {
    pipelined_ = true;
    if (tail_worker_) {  // weights_ready brings each bucket's weights as the worker sends them
      pending_ = plan.buckets.size();
      return;
    }
    // The new weights wait in the gradient shards (the caller's stream waited for their H2D).
    for (std::size_t b = 0; b < plan.buckets.size(); ++b) { adopt_bucket(b, stream); }
    return;
  }
  // Redone after backward, in place (the pipeline's work is dropped; its H2D copies read the
  // weight buffers rewritten below, so they end first).
  if (spec.active) { wait_event(h2d_done_.get(), "the offload pipeline's copies"); }
  // Bucket by bucket: the CPU updates bucket b while bucket b - 1's weights go back to the GPU
  // and are all-gathered.
  for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
    auto const& bk         = plan.buckets[b];
    std::size_t const at   = o.shard_bytes_offset_[b];
    std::size_t const size = bk.shard_elements * size_of(bk.type);
    if (pipeline) {  // chunk by chunk: a chunk whose values are in a region goes back home
      for (std::size_t c = first_chunk_[b];
           c < spares_.chunks() && chunk_bucket_[c] == b && bk.shard_elements > 0; ++c) {
        auto const from = spares_.settle(c);
        cpu_update(b, chunk_first_[c], chunk_elements(c), lr, t, factor, chunk_states(c, from),
                   chunk_states(c, spare_regions::home));
        ++chunks_redone_;
      }
      sync_spares();
    } else {
      auto const place = home_states(b, 0);
      cpu_update(b, 0, bk.shard_elements, lr, t, factor, place, place);
    }
    WM_CUDA_TRY(cudaMemcpyAsync(o.shard_weights(b), storage_->host_weights.data() + at, size,
                                cudaMemcpyHostToDevice, s));
    if constexpr (Owner::stage < 3) { o.all_gather_bucket(b, o.weights_ + bk.byte_offset, stream); }
  }
}

}  // namespace wm::detail::zero
