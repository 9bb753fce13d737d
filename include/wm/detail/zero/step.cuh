// SPDX-License-Identifier: Apache-2.0
// The step of wm::zero_optimizer (declared in <wm/zero.cuh>): gradients reduced (or accumulated)
// bucket by bucket as backward produces them, each reduced bucket handed to the engine, the
// global norm (float64 partials and one all-reduce) that the engines' steps use, the step
// itself (the engine's), and the step counters read back.
#pragma once

#include <wm/detail/base/cuda.cuh>
#include <wm/detail/zero/kernels.cuh>
#include <wm/detail/zero/plan.hpp>
#include <wm/zero.cuh>

#include <cub/device/device_for.cuh>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace wm {

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::reduce_gradients(std::size_t b,
                                                                 cuda::stream_ref stream) {
  expect_usable("reduce_gradients");
  WM_EXPECTS(b < plan_.buckets.size(),
             "zero_optimizer::reduce_gradients: a bucket index below the bucket count (" +
                 std::to_string(plan_.buckets.size()) + "), got " + std::to_string(b));
  try {  // offload: a bucket half sent or half posted leaves the step unfinishable
    reduce_bucket(b, stream, true);
  } catch (...) {
    engine_.fail();
    throw;
  }
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::accumulate_gradients(std::size_t b,
                                                                     cuda::stream_ref stream) {
  expect_usable("accumulate_gradients");
  WM_EXPECTS(b < plan_.buckets.size(),
             "zero_optimizer::accumulate_gradients: a bucket index below the bucket count (" +
                 std::to_string(plan_.buckets.size()) + "), got " + std::to_string(b));
  WM_EXPECTS(Stage::value > 1 || options_.gradient_accumulation,
             "zero_optimizer::accumulate_gradients at stage 1: construct with "
             "zero_options::gradient_accumulation");
  try {
    reduce_bucket(b, stream, false);
  } catch (...) {
    engine_.fail();
    throw;
  }
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::reduce_bucket(std::size_t b,
                                                              cuda::stream_ref stream, bool last) {
  namespace z = detail::zero;
  engine_.complete_tail(stream);  // the last step's weights land before backward's next ones
  cudaStream_t const s = stream.get();
  auto const& bk       = plan_.buckets[b];
  bool const summed    = accumulated_[b] != 0;  // earlier micro-batches of this step
  accumulated_[b]      = last ? 0 : 1;
  z::with_element_type(bk.type, [&](auto tag) {
    using T                = decltype(tag);
    std::size_t const mine = static_cast<std::size_t>(rank_) * bk.shard_elements;
    auto add               = [&](T* out, T const* in) {
      WM_CUDA_TRY(cub::DeviceFor::Bulk(bk.shard_elements, z::add_op<T>{out, in}, s));
    };
    if constexpr (Stage::value == 1) {
      T* g   = reinterpret_cast<T*>(grads_ + bk.byte_offset);
      T* acc = accum_ == nullptr ? nullptr : reinterpret_cast<T*>(accum_ + shard_bytes_offset_[b]);
      if (!last) {  // only this rank's block enters its sum: reduce-scatter in place
        comm_->reduce_scatter(static_cast<T const*>(g), g + mine, bk.shard_elements, stream);
        if (summed) {
          add(acc, g + mine);
        } else {
          WM_CUDA_TRY(cudaMemcpyAsync(acc, g + mine, bk.shard_elements * sizeof(T),
                                      cudaMemcpyDeviceToDevice, s));
        }
        return;
      }
      comm_->all_reduce(g, g, bk.elements, stream);
      if (summed) { add(g + mine, acc); }
    } else {
      T* const st = static_cast<T*>(staging(b));
      if (!summed) {
        comm_->reduce_scatter(static_cast<T const*>(st), static_cast<T*>(shard_gradients(b)),
                              bk.shard_elements, stream);
      } else {  // in place in the staging buffer, then added to the shard's sum
        comm_->reduce_scatter(static_cast<T const*>(st), st + mine, bk.shard_elements, stream);
        add(static_cast<T*>(shard_gradients(b)), st + mine);
      }
      WM_CUDA_TRY(cudaMemsetAsync(staging(b), 0, bk.bytes(), s));
      if (!last) { return; }
    }
  });
  if (last) { engine_.reduced(b, stream); }  // offload: to the host at once (backward goes on)
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::step(float lr, cuda::stream_ref stream) {
  expect_usable("step");
  WM_EXPECTS(
      std::find(accumulated_.begin(), accumulated_.end(), std::uint8_t{1}) == accumulated_.end(),
      "zero_optimizer::step: every bucket that accumulate_gradients took needs its "
      "reduce_gradients (the step's last micro-batch) first");
  if constexpr (Stage::value == 3) {
    WM_EXPECTS(!residency_.any_held(),
               "zero_optimizer::step (stage 3): release every gathered group first");
  }
  engine_.complete_tail(stream);  // a step without backward: the last step's update ends first
  if constexpr (Stage::value == 3) {
    residency_.drop_prefetch();  // its copies would be stale after the update
    // A prefetch may still be reading the shard weights that the update rewrites.
    WM_CUDA_TRY(cudaStreamWaitEvent(stream.get(), gather_done_.get(), 0));
  }
  try {
    engine_.step(lr, stream);
  } catch (...) {  // offload: the masters and moments may be half updated, the step half decided
    engine_.fail();
    throw;
  }
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::weights_ready(std::size_t b,
                                                              cuda::stream_ref stream) {
  expect_usable("weights_ready");
  if (b == detail::zero::no_bucket) { return; }  // a parameter without elements
  WM_EXPECTS(b < plan_.buckets.size(),
             "zero_optimizer::weights_ready: a bucket index below the count (" +
                 std::to_string(plan_.buckets.size()) + "), got " + std::to_string(b));
  engine_.weights_ready(b, stream);
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::norm_partials(std::size_t b, cudaStream_t s) {
  namespace z    = detail::zero;
  auto const& bk = plan_.buckets[b];
  z::with_element_type(bk.type, [&](auto tag) {
    using T = decltype(tag);
    z::norm_partials_kernel<T><<<partial_blocks_[b], z::norm_block, 0, s>>>(
        static_cast<T const*>(shard_gradients(b)), bk.shard_elements,
        scratch_ + partial_offset_[b]);
    WM_CHECK_LAUNCH();
  });
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
double* zero_optimizer<Stage, Optimizer, Offload>::norm_async(cuda::stream_ref stream) {
  // 1. Σ g² of this rank's shards in float64 partials, summed in a fixed order.
  for (std::size_t b = 0; b < plan_.buckets.size(); ++b) { norm_partials(b, stream.get()); }
  return norm_total(stream);
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
double* zero_optimizer<Stage, Optimizer, Offload>::norm_total(cuda::stream_ref stream,
                                                              double veto) {
  namespace z          = detail::zero;
  cudaStream_t const s = stream.get();
  double* const local  = scratch_ + partials_;
  double* const global = local + 2;
  z::sum_partials_kernel<z::norm_block>
      <<<1, z::norm_block, 0, s>>>(scratch_, partials_, local, veto);
  WM_CHECK_LAUNCH();
  // 2. One all-reduce of two scalars: the global norm and the inf/NaN check (an inf or NaN
  // anywhere makes the sum inf or NaN on every rank, so every rank skips the same steps), and
  // the offload pipeline's vetoes (global[1] > 0: some rank cannot adopt its update).
  comm_->all_reduce(static_cast<double const*>(local), global, 2, stream);
  return global;
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::read_counters(cuda::stream_ref stream) const {
  engine_.read_counters(stream);  // from the device (offload: the host keeps them)
  comm_->synchronize(stream, "zero_optimizer counters");
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
bool zero_optimizer<Stage, Optimizer, Offload>::last_step_skipped(cuda::stream_ref stream) const {
  expect_usable("last_step_skipped");
  read_counters(stream);
  return host_counters_->last_skipped != 0;
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
float zero_optimizer<Stage, Optimizer, Offload>::loss_scale(cuda::stream_ref stream) const {
  expect_usable("loss_scale");
  read_counters(stream);
  return host_scale_;
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
std::int64_t zero_optimizer<Stage, Optimizer, Offload>::applied_steps(
    cuda::stream_ref stream) const {
  expect_usable("applied_steps");
  read_counters(stream);
  return host_counters_->applied;
}

}  // namespace wm
