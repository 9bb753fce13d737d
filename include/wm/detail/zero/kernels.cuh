// SPDX-License-Identifier: Apache-2.0
// Kernels of wm::zero_optimizer (zero.cuh): the gradient norm partials of a shard, their sum,
// the fused update of a shard (unscale, skip on inf/NaN, clip, the optimizer policy's
// element-wise update on fp32 master weights and states, cast into the compute weights that the
// all-gather sends), and the step counter.
#pragma once

#include <wm/detail/base/cuda.cuh>
#include <wm/detail/zero/counters.hpp>
#include <wm/detail/zero/plan.hpp>
#include <wm/optimizer.hpp>

#include <cub/block/block_reduce.cuh>
#include <cub/device/device_for.cuh>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace wm::detail::zero {

inline constexpr int norm_block = 256;  ///< threads of the norm kernels

/// Calls f(T{}) with the compute type of @p t.
template <class F>
void with_element_type(element_type t, F&& f) {
  switch (t) {
    case element_type::f32: f(float{}); break;
    case element_type::f16: f(__half{}); break;
    default: f(__nv_bfloat16{}); break;
  }
}

/// Blocks of the norm partials kernel over a shard of @p n elements (fixed at construction, so
/// the sum's order never changes).
[[nodiscard]] inline int norm_blocks(std::size_t n) {
  return static_cast<int>(std::clamp<std::size_t>(cuda::ceil_div(n, std::size_t{norm_block} * 4), 1,
                                                  static_cast<std::size_t>(sm_count()) * 2));
}

/// partials[block] = Σ g[i]² (float64) over this block's grid-stride share of the shard; an inf
/// or NaN gradient makes the sum inf or NaN.
template <class T>
__global__ void __launch_bounds__(norm_block)
    norm_partials_kernel(T const* __restrict__ g, std::size_t n, double* __restrict__ partials) {
  double acc = 0.0;
  for_each_index(n, [&](std::size_t i) {
    double const v = static_cast<double>(static_cast<float>(g[i]));
    acc += v * v;
  });
  using reduce = cub::BlockReduce<double, norm_block>;
  __shared__ typename reduce::TempStorage temp;
  double const total = reduce(temp).Sum(acc);
  if (threadIdx.x == 0) { partials[blockIdx.x] = total; }
}

/// out[0] = Σ partials[0..n) in a fixed order, out[1] = @p veto (one block of Block threads; a
/// template so that the header defines no non-template kernel).
template <int Block = norm_block>
__global__ void __launch_bounds__(Block)
    sum_partials_kernel(double const* __restrict__ partials, std::size_t n, double* out,
                        double veto) {
  double acc = 0.0;
  for (std::size_t i = threadIdx.x; i < n; i += Block) { acc += partials[i]; }
  using reduce = cub::BlockReduce<double, Block>;
  __shared__ typename reduce::TempStorage temp;
  double const total = reduce(temp).Sum(acc);
  if (threadIdx.x == 0) {
    out[0] = total;
    out[1] = veto;  // summed over the ranks beside the norm (see zero_optimizer::norm_total)
  }
}

/// What every shard's update needs besides its pointers.
struct step_args {
  float lr;                       ///< learning rate of this step
  float inv_ranks;                ///< 1 / ranks averaged over (1: sums)
  float const* scale;             ///< the loss scale of this step (device)
  float max_norm;                 ///< clip threshold (<= 0: none)
  double const* sumsq;            ///< Σ g² of the raw (scaled, summed) gradients, all ranks
  step_counters const* counters;  ///< the steps before this one (device)
};

/// The gradient multiplier of a step whose raw gradients have Σ g² = @p sumsq (finite):
/// unscale · min(1, max / (‖g · unscale‖ + 1e-6)), as torch.nn.utils.clip_grad_norm_ after
/// GradScaler.unscale_ (no clipping when @p max_norm <= 0).
__host__ __device__ inline float grad_factor_of(double sumsq, float unscale, float max_norm) {
  double f = unscale;
  if (max_norm > 0.0f) {
    double const norm = sqrt(sumsq) * static_cast<double>(unscale);
    double const coef = static_cast<double>(max_norm) / (norm + 1e-6);
    if (coef < 1.0) { f *= coef; }
  }
  return static_cast<float>(f);
}

/// grad_factor_of this step's global sum; 0 marks a step to skip.
__device__ inline float grad_factor(step_args const& a) {
  double const s = *a.sumsq;
  if (!isfinite(s)) { return 0.0f; }
  return grad_factor_of(s, a.inv_ranks / *a.scale, a.max_norm);
}

/**
 * The fused update of one shard of @p n elements: g = grad · factor, the optimizer's update of
 * master weight and states (state k of element i at states[k · state_stride + i]), the new weight
 * cast to T into @p w_out (the all-gather's send block). Skips everything when the global sum
 * of squares is not finite.
 */
template <class T, class Optimizer>
__global__ void update_kernel(T const* __restrict__ grad, float* __restrict__ master,
                              float* __restrict__ states, std::size_t state_stride,
                              T* __restrict__ w_out, std::size_t n, Optimizer opt, step_args a) {
  if (!isfinite(*a.sumsq)) { return; }  // every rank skips: they all see the same sum
  float const factor = grad_factor(a);
  update_step<float> const step{a.lr, a.counters->applied + 1};
  constexpr int k = Optimizer::states;
  for_each_index(n, [&](std::size_t i) {
    float st[k > 0 ? k : 1];
#pragma unroll
    for (int j = 0; j < k; ++j) { st[j] = states[j * state_stride + i]; }
    float w       = master[i];
    float const g = static_cast<float>(grad[i]) * factor;
    opt.update(w, g, st, step);
#pragma unroll
    for (int j = 0; j < k; ++j) { states[j * state_stride + i] = st[j]; }
    master[i] = w;
    w_out[i]  = static_cast<T>(w);
  });
}

/// The next loss scale and growth tracker after a step (torch.cuda.amp.GradScaler's
/// _amp_update_scale_): an inf/NaN step multiplies the scale by @p backoff and resets the
/// tracker; otherwise the tracker counts, and at @p interval the scale grows by @p growth.
__host__ __device__ inline void update_scale(bool skipped, float& scale, std::int64_t& tracker,
                                             float growth, float backoff, std::int64_t interval) {
  if (skipped) {
    scale *= backoff;
    tracker = 0;
  } else if (++tracker == interval) {
    scale *= growth;
    tracker = 0;
  }
}

/// The counters after a step (with @p dynamic, *scale is updated too).
struct finish_step_op {
  double const* sumsq;
  step_counters* counters;
  float* scale;
  bool dynamic;
  float growth, backoff;
  std::int64_t interval;
  __device__ void operator()(std::size_t) const {
    bool const skip = !isfinite(*sumsq);
    counters->applied += skip ? 0 : 1;
    counters->last_skipped = skip ? 1 : 0;
    counters->skipped += skip ? 1 : 0;
    if (dynamic) {
      update_scale(skip, *scale, counters->growth_tracker, growth, backoff, interval);
    }
  }
};

/// out[i] = float(in[i]): master weights from compute weights.
template <class T>
struct widen_op {
  T const* in;
  float* out;
  __device__ void operator()(std::size_t i) const { out[i] = static_cast<float>(in[i]); }
};

/// out[i] = T(in[i]): compute weights from master weights (after a load).
template <class T>
struct narrow_op {
  float const* in;
  T* out;
  __device__ void operator()(std::size_t i) const { out[i] = static_cast<T>(in[i]); }
};

/// out[i] = T(float(out[i]) + float(in[i])): a micro-batch's reduced gradients added to a sum.
template <class T>
struct add_op {
  T* out;
  T const* in;
  __device__ void operator()(std::size_t i) const {
    out[i] = static_cast<T>(static_cast<float>(out[i]) + static_cast<float>(in[i]));
  }
};

/// out[i] = value.
struct fill_op {
  float* out;
  float value;
  __device__ void operator()(std::size_t i) const { out[i] = value; }
};

}  // namespace wm::detail::zero
