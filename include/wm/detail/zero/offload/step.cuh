// SPDX-License-Identifier: Apache-2.0
// The step of wm::zero_optimizer with wm::offload_host (declared in <wm/zero.cuh>): the CPU Adam
// of a shard's range (cpu_adam.hpp), and the step that adopts the pipeline's update or redoes it
// bucket by bucket after backward, the ranks deciding together from the all-reduced norm.
#pragma once

#include <wm/detail/zero/cpu_adam.hpp>
#include <wm/detail/zero/kernels.cuh>
#include <wm/detail/zero/plan.hpp>
#include <wm/detail/zero/spare_regions.hpp>
#include <wm/zero.cuh>

#include <array>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>

namespace wm {

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
std::array<float*, 3> zero_optimizer<Stage, Optimizer, Offload>::home_states(
    std::size_t b, std::size_t first) const noexcept {
  std::size_t const off = plan_.buckets[b].state_offset + first;
  return {master_ + off, states_ + off, states_ + plan_.state_elements + off};
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::cpu_update(std::size_t b, std::size_t first,
                                                           std::size_t count, float lr,
                                                           std::int64_t t, float factor,
                                                           std::array<float*, 3> in,
                                                           std::array<float*, 3> out) {
  namespace z = detail::zero;
  if constexpr (Offload::host) {  // only the offload instantiations read adam's fields
    static_assert(Optimizer::states == 2, "the CPU Adam keeps m and v");
    auto const started   = std::chrono::steady_clock::now();
    auto const& bk       = plan_.buckets[b];
    std::size_t const at = shard_bytes_offset_[b] + first * z::size_of(bk.type);
    z::cpu_adam_options const o{opt_.beta1, opt_.beta2, opt_.eps, opt_.weight_decay,
                                opt_.decoupled};
    bool const separate     = out[0] != in[0];  // into other arrays (ahead of the decision)
    float* const master_out = separate ? out[0] : nullptr;
    float* const m_out      = separate ? out[1] : nullptr;
    float* const v_out      = separate ? out[2] : nullptr;
    if (bk.type == z::element_type::bf16) {
      z::cpu_adam_update(
          o, z::cpu_adam_step{lr, t, factor},
          z::cpu_adam_arrays<z::bf16_bits>{
              in[0], in[1], in[2], reinterpret_cast<z::bf16_bits const*>(host_grads_ + at),
              reinterpret_cast<z::bf16_bits*>(host_weights_ + at), count, master_out, m_out, v_out},
          *cpu_pool_);
    } else {
      z::cpu_adam_update(o, z::cpu_adam_step{lr, t, factor},
                         z::cpu_adam_arrays<float>{in[0], in[1], in[2],
                                                   reinterpret_cast<float const*>(host_grads_ + at),
                                                   nullptr, count, master_out, m_out, v_out},
                         *cpu_pool_);
      std::memcpy(host_weights_ + at, out[0], count * sizeof(float));
    }
    cpu_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now() - started)
                          .count(),
                      std::memory_order_relaxed);
  }
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::step_offload(float lr, cuda::stream_ref stream) {
  namespace z = detail::zero;
  if constexpr (Offload::host) {  // only the offload instantiations read adam's fields
    cudaStream_t const s   = stream.get();
    bool const pipeline    = options_.offload_pipeline;
    speculation const spec = std::exchange(spec_, speculation{});
    step_open_             = false;
    pipelined_             = false;
    next_lr_               = lr;  // the next step's guess, unless prepare_step says otherwise
    if (pipeline) {               // the gradients' copies to the host, before the host reads them
      WM_CUDA_TRY(cudaEventRecord(d2h_done_, d2h_stream_));
      WM_CUDA_TRY(cudaStreamWaitEvent(s, d2h_done_, 0));
    }
    bool const stale = masters_stale_;
    if (masters_stale_) {  // weights were set: the pipeline's work (if any) is dropped
      if (spec.active) {
        decision_.store(2, std::memory_order_release);
        finish_pipeline(stream);  // it reads the masters that the widen rewrites
        end_speculation(false);
      }
      gather_host_copies();  // the moments stay; the masters come from the compute weights
      widen_masters(s);
    }
    // This rank can adopt the pipeline's update if the update assumed this step's inputs as this
    // rank knows them: the same learning rate and count, every bucket posted, nothing that
    // changed its inputs since (weights set, states read while it ran ahead). Some of these are
    // this rank's own (a reset_master_weights, how far its worker got when the states were
    // read), so the ranks sum their vetoes in the norm's all-reduce and adopt only together: with
    // offload_overlap_forward an adopting rank all-gathers in another order than a redoing one.
    bool const can_adopt =
        spec.active && !stale && !spec.invalid && spec.posted == plan_.buckets.size() &&
        spec.t == host_counters_[0] + 1 &&
        std::bit_cast<std::uint32_t>(spec.lr) == std::bit_cast<std::uint32_t>(lr);
    // The pipeline took the partials as each bucket was reduced (its shards now hold weights).
    double* const global =
        pipeline ? norm_total(stream, can_adopt ? 0.0 : 1.0) : norm_async(stream);
    WM_CUDA_TRY(
        cudaMemcpyAsync(host_sumsq_, global, 2 * sizeof(double), cudaMemcpyDeviceToHost, s));
    // The norm, and every gradient shard on the host (reduce_gradients sent them).
    comm_->synchronize(stream, "zero_optimizer::step");
    double const sumsq = host_sumsq_[0];
    bool const vetoed  = !(host_sumsq_[1] == 0.0);
    float const scale  = host_scale_;  // this step's
    bool const skip    = !std::isfinite(sumsq);
    float const ranks  = options_.average_gradients ? static_cast<float>(world_) : 1.0f;
    float const factor =
        skip ? 0.0f : z::grad_factor_of(sumsq, 1.0f / (scale * ranks), options_.max_grad_norm);
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
      decision_.store(adopt ? 1 : 2, std::memory_order_release);
      if (adopt && options_.offload_overlap_forward) {
        tail_worker_ = true;
      } else {
        finish_pipeline(stream);
        end_speculation(adopt);
      }
    }
    if (options_.dynamic_loss_scale) {  // the next step's scale, on the host and the device
      z::update_scale(skip, host_scale_, host_counters_[3], options_.scale_growth,
                      options_.scale_backoff, options_.scale_growth_interval);
      WM_CUDA_TRY(cudaMemcpyAsync(scale_, &host_scale_, sizeof(float), cudaMemcpyHostToDevice, s));
    }
    if (skip) {  // every rank sees the same sum: every rank skips (the pipeline's copy is dropped)
      host_counters_[1] = 1;
      ++host_counters_[2];
      return;
    }
    host_counters_[1]    = 0;
    std::int64_t const t = ++host_counters_[0];
    if (adopt) {
      pipelined_ = true;
      if (tail_worker_) {  // weights_ready brings each bucket's weights as the worker sends them
        pending_ = plan_.buckets.size();
        return;
      }
      // The new weights wait in the gradient shards (the caller's stream waited for their H2D).
      for (std::size_t b = 0; b < plan_.buckets.size(); ++b) { adopt_bucket(b, stream); }
      return;
    }
    // Redone after backward, in place (the pipeline's work is dropped; its H2D copies read the
    // weight buffers rewritten below, so they end first).
    if (spec.active) { wait_event(h2d_done_, "the offload pipeline's copies"); }
    // Bucket by bucket: the CPU updates bucket b while bucket b - 1's weights go back to the GPU
    // and are all-gathered.
    for (std::size_t b = 0; b < plan_.buckets.size(); ++b) {
      auto const& bk         = plan_.buckets[b];
      std::size_t const at   = shard_bytes_offset_[b];
      std::size_t const size = bk.shard_elements * z::size_of(bk.type);
      if (pipeline) {  // chunk by chunk: a chunk whose values are in a region goes back home
        for (std::size_t c = first_chunk_[b];
             c < spares_.chunks() && chunk_bucket_[c] == b && bk.shard_elements > 0; ++c) {
          auto const from = spares_.settle(c);
          cpu_update(b, chunk_first_[c], chunk_elements(c), lr, t, factor, chunk_states(c, from),
                     chunk_states(c, z::spare_regions::home));
          ++chunks_redone_;
        }
        sync_spares();
      } else {
        auto const place = home_states(b, 0);
        cpu_update(b, 0, bk.shard_elements, lr, t, factor, place, place);
      }
      WM_CUDA_TRY(
          cudaMemcpyAsync(shard_weights(b), host_weights_ + at, size, cudaMemcpyHostToDevice, s));
      if constexpr (Stage::value < 3) { all_gather_bucket(b, weights_ + bk.byte_offset, stream); }
    }
  }
}

}  // namespace wm
