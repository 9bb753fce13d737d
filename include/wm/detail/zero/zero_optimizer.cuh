// SPDX-License-Identifier: Apache-2.0
// Bodies of wm::zero_optimizer (declared in <wm/zero.cuh>): construction (the plan, the arenas,
// the shards and the gather stream; the offload policy's engine allocates the master weights and
// states), teardown, and the accessors of weights and gradients. The rest by topic, included at
// the end: the reductions and the step (step.cuh), stage 3's gathers (gather.cuh), checkpoints
// (save_load.cuh), and the two engines (device_update.cuh, offload/host_offload.cuh).
#pragma once

#include <wm/detail/base/cuda.cuh>
#include <wm/detail/base/deadline.hpp>
#include <wm/detail/base/hash.hpp>
#include <wm/detail/base/resources.hpp>
#include <wm/detail/zero/kernels.cuh>
#include <wm/detail/zero/teardown.hpp>
#include <wm/zero.cuh>

#include <cub/device/device_for.cuh>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>

namespace wm {
namespace detail::zero {

/// The element type that @p T is (compile-time).
template <class T>
[[nodiscard]] constexpr element_type element_type_of() noexcept {
  if constexpr (std::is_same_v<std::remove_cv_t<T>, float>) {
    return element_type::f32;
  } else if constexpr (std::is_same_v<std::remove_cv_t<T>, __half>) {
    return element_type::f16;
  } else {
    static_assert(std::is_same_v<std::remove_cv_t<T>, __nv_bfloat16>,
                  "wm::zero_optimizer: compute types are float, __half and __nv_bfloat16");
    return element_type::bf16;
  }
}

}  // namespace detail::zero

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
zero_optimizer<Stage, Optimizer, Offload>::zero_optimizer(communicator& comm,
                                                          std::span<zero_parameter const> params,
                                                          std::size_t bucket_bytes,
                                                          Optimizer optimizer, zero_options options)
    : comm_{&comm}, opt_{optimizer}, options_{std::move(options)}, engine_{*this} {
  namespace z = detail::zero;
  rank_       = comm.rank();
  world_      = comm.size();
  WM_EXPECTS(std::isfinite(options_.loss_scale) && options_.loss_scale > 0.0f,
             "zero_optimizer: a finite loss scale above 0");
  WM_EXPECTS(options_.offload_chunk_elements > 0 && options_.offload_chunk_elements % 64 == 0,
             "zero_optimizer: offload_chunk_elements a positive multiple of 64");
  WM_EXPECTS(std::isfinite(options_.offload_spare_fraction) &&
                 options_.offload_spare_fraction >= 0.0f && options_.offload_spare_fraction <= 1.0f,
             "zero_optimizer: offload_spare_fraction in [0, 1]");
  WM_EXPECTS(std::isfinite(options_.max_grad_norm),
             "zero_optimizer: a finite max_grad_norm (0: no clipping)");
  WM_EXPECTS(!options_.dynamic_loss_scale ||
                 (options_.scale_growth > 1.0f && std::isfinite(options_.scale_growth) &&
                  options_.scale_backoff > 0.0f && options_.scale_backoff < 1.0f &&
                  options_.scale_growth_interval > 0),
             "zero_optimizer: dynamic loss scaling needs scale_growth > 1, scale_backoff in "
             "(0, 1) and scale_growth_interval > 0");
  std::vector<z::param_spec> specs;
  specs.reserve(params.size());
  for (auto const& p : params) { specs.push_back({p.name, p.elements(), p.type}); }
  plan_ = z::make_plan(specs, bucket_bytes, world_);

  // Every rank must pass the same model, stage, optimizer and options: agree once, here, so
  // that the hot-path collectives (which check nothing) get matching sizes.
  std::uint64_t h = detail::mix64(static_cast<std::uint64_t>(Stage::value), bucket_bytes);
  h               = detail::fnv1a(Optimizer::name, h);
  h               = detail::mix64(h, engine_type::id);
  for (auto const& p : specs) {
    h = detail::mix64(detail::fnv1a(p.name, h),
                      p.elements * 4 + static_cast<std::uint64_t>(p.type));
  }
  h = detail::mix64(h, std::bit_cast<std::uint32_t>(options_.loss_scale));
  h = detail::mix64(h, std::bit_cast<std::uint32_t>(options_.max_grad_norm));
  h = detail::mix64(h, options_.dynamic_loss_scale ? 1 : 0);
  h = detail::mix64(h, std::bit_cast<std::uint32_t>(options_.scale_growth));
  h = detail::mix64(h, std::bit_cast<std::uint32_t>(options_.scale_backoff));
  h = detail::mix64(h, static_cast<std::uint64_t>(options_.scale_growth_interval));
  h = detail::mix64(h, options_.average_gradients ? 1 : 0);
  h = detail::mix64(h, options_.prefetch_bytes);
  h = detail::mix64(h, options_.offload_pipeline ? 1 : 0);
  h = detail::mix64(h, options_.offload_chunk_elements);
  h = detail::mix64(h, std::bit_cast<std::uint32_t>(options_.offload_spare_fraction));
  h = detail::mix64(h, options_.offload_overlap_forward ? 1 : 0);
  h = detail::mix64(h, options_.gradient_accumulation ? 1 : 0);
  for (auto const& g : options_.groups) {
    for (auto p : g) { h = detail::mix64(h, p); }
    h = detail::mix64(h, ~0ull);
  }
  comm.expect_same("zero_optimizer", h);

  // Shards of the buckets, one after the other (stages 2-3 keep gradients, stage 3 weights so).
  std::size_t shard_arena = 0;
  std::size_t partials    = 0;
  for (auto const& b : plan_.buckets) {
    shard_bytes_offset_.push_back(shard_arena);
    shard_arena += b.shard_elements * z::size_of(b.type);
    partial_offset_.push_back(partials);
    partial_blocks_.push_back(z::norm_blocks(b.shard_elements));
    partials += static_cast<std::size_t>(partial_blocks_.back());
  }
  partials_                  = partials;
  std::size_t const max_b    = plan_.max_bucket_bytes();
  std::size_t const stagings = std::min<std::size_t>(2, plan_.buckets.size());

  // Stage 3: the buckets of each group, and the gather pool.
  std::size_t pool_bytes = 0;
  if constexpr (Stage::value == 3) {
    auto groups = options_.groups;
    if (groups.empty()) {
      for (std::size_t p = 0; p < specs.size(); ++p) { groups.push_back({p}); }
    }
    std::vector<std::size_t> bucket_bytes_of;
    for (auto const& b : plan_.buckets) { bucket_bytes_of.push_back(b.bytes()); }
    std::size_t largest = 0;
    for (auto const& g : groups) {
      std::vector<std::size_t> bs;
      for (auto p : g) {
        WM_EXPECTS(p < specs.size(), "zero_optimizer: groups name parameters below the count (" +
                                         std::to_string(specs.size()) + "), got " +
                                         std::to_string(p));
        if (plan_.places[p].bucket != z::no_bucket) { bs.push_back(plan_.places[p].bucket); }
      }
      std::sort(bs.begin(), bs.end());
      bs.erase(std::unique(bs.begin(), bs.end()), bs.end());
      std::size_t bytes = 0;
      for (auto b : bs) { bytes += z::ceil_to(bucket_bytes_of[b], 256); }
      largest = std::max(largest, bytes);
      group_buckets_.push_back(std::move(bs));
    }
    pool_bytes =
        options_.prefetch_bytes == 0 ? 2 * largest : std::max(options_.prefetch_bytes, largest);
    residency_ = z::residency{group_buckets_, bucket_bytes_of, pool_bytes};
  }

  memory_.weights          = Stage::value < 3 ? plan_.arena_bytes : shard_arena;
  memory_.gradients        = Stage::value == 1 ? plan_.arena_bytes : shard_arena;
  memory_.master_weights   = plan_.state_elements * sizeof(float);
  memory_.optimizer_states = memory_.master_weights * static_cast<std::size_t>(Optimizer::states);
  std::size_t const accum_bytes =
      Stage::value == 1 && options_.gradient_accumulation ? shard_arena : 0;
  memory_.buffers = (Stage::value >= 2 ? stagings * max_b : 0) + pool_bytes + accum_bytes;
  memory_.scratch = (partials_ + 4) * sizeof(double) + 3 * sizeof(std::int64_t);

  gather_stream_  = detail::unique_stream::make();
  gather_done_    = detail::unique_event::make();
  user_ready_     = detail::unique_event::make();
  arenas_         = std::make_unique<z::arenas>();
  auto& a         = *arenas_;
  a.weights       = detail::device_buffer<std::byte>{memory_.weights};
  a.grads         = detail::device_buffer<std::byte>{memory_.gradients};
  a.staging       = detail::device_buffer<std::byte>{Stage::value >= 2 ? stagings * max_b : 0};
  a.pool          = detail::device_buffer<std::byte>{pool_bytes};
  a.accum         = detail::device_buffer<std::byte>{accum_bytes};
  a.scratch       = detail::device_buffer<double>{partials_ + 4};
  a.counters      = detail::device_buffer<z::step_counters>{1};
  a.scale         = detail::device_buffer<float>{1};
  a.host_counters = detail::pinned_buffer<z::step_counters>{1};
  weights_        = a.weights.data();
  grads_          = a.grads.data();
  staging_        = a.staging.data();
  pool_           = a.pool.data();
  accum_          = a.accum.data();
  scratch_        = a.scratch.data();
  counters_       = a.counters.data();
  scale_          = a.scale.data();
  host_counters_  = a.host_counters.data();
  *host_counters_ = z::step_counters{};
  accumulated_.assign(plan_.buckets.size(), 0);
  cudaStream_t const init = gather_stream_.get();
  // The engine's master weights and states (device or pinned host memory), initialized on init.
  engine_.allocate(memory_, shard_arena, init);
  host_scale_ = options_.loss_scale;
  WM_CUDA_TRY(cudaMemcpy(scale_, &host_scale_, sizeof(float), cudaMemcpyHostToDevice));
  // Padding must stay zero (it enters the norm): every buffer starts at zero.
  for (auto [p, n] : {std::pair{static_cast<void*>(weights_), memory_.weights},
                      std::pair{static_cast<void*>(grads_), memory_.gradients},
                      std::pair{static_cast<void*>(staging_), stagings * max_b},
                      std::pair{static_cast<void*>(counters_), sizeof(z::step_counters)}}) {
    if (p != nullptr && n > 0) { WM_CUDA_TRY(cudaMemsetAsync(p, 0, n, init)); }
  }
  WM_CUDA_TRY(cudaStreamSynchronize(init));
  engine_.start();
}

// Before the buffers go, the host waits for the device work that may still use them: its own
// streams up to now and every event it recorded (on the caller's streams too), at most the
// communicator's timeout in all, stack unwinding included. Past it the work is abandoned with a
// line on stderr and the memory is left allocated: freeing it would wait as well (cudaFree
// synchronizes the device), or free what a copy or a kernel still uses.
template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
zero_optimizer<Stage, Optimizer, Offload>::~zero_optimizer() {
  engine_.stop();  // first: the offload pipeline's jobs enqueue copies
  detail::zero::teardown wait{comm_->timeout()};
  wait.stream(gather_stream_.get(), "the gather stream");
  engine_.drain(wait);
  for (cudaEvent_t e : {gather_done_.get(), user_ready_.get()}) {
    wait.event(e, "the last work of a step on the caller's stream");
  }
  if (char const* const stuck = wait.stuck()) {
    std::fprintf(stderr,
                 "wm: zero_optimizer on rank %d: the teardown gave up after %lld ms waiting for "
                 "%s; abandoned, left allocated: its device and pinned host buffers\n",
                 rank_, static_cast<long long>(comm_->timeout().count()), stuck);
    // Deliberately leaked: the members then destroy the events and streams only.
    (void)arenas_.release();
    engine_.abandon();
  }
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
std::size_t zero_optimizer<Stage, Optimizer, Offload>::index(std::string_view name) const {
  for (std::size_t p = 0; p < plan_.params.size(); ++p) {
    if (plan_.params[p].name == name) { return p; }
  }
  throw logic_error{"wm: zero_optimizer has no parameter named '" + std::string{name} + "'"};
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void* zero_optimizer<Stage, Optimizer, Offload>::shard_weights(std::size_t b) const noexcept {
  auto const& bk = plan_.buckets[b];
  if constexpr (Stage::value == 3) {
    return weights_ + shard_bytes_offset_[b];
  } else {
    return weights_ + bk.byte_offset +
           static_cast<std::size_t>(rank_) * bk.shard_elements * detail::zero::size_of(bk.type);
  }
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::all_gather_bucket(std::size_t b, std::byte* into,
                                                                  cuda::stream_ref stream) {
  auto const& bk = plan_.buckets[b];
  detail::zero::with_element_type(bk.type, [&](auto tag) {
    using T = decltype(tag);
    comm_->all_gather(static_cast<T const*>(shard_weights(b)), reinterpret_cast<T*>(into),
                      bk.shard_elements, stream);
  });
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void* zero_optimizer<Stage, Optimizer, Offload>::shard_gradients(std::size_t b) const noexcept {
  auto const& bk = plan_.buckets[b];
  if constexpr (Stage::value == 1) {
    return grads_ + bk.byte_offset +
           static_cast<std::size_t>(rank_) * bk.shard_elements * detail::zero::size_of(bk.type);
  } else {
    return grads_ + shard_bytes_offset_[b];
  }
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void* zero_optimizer<Stage, Optimizer, Offload>::staging(std::size_t b) const noexcept {
  return staging_ + (b % 2) * plan_.max_bucket_bytes();
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
template <class T>
std::span<T> zero_optimizer<Stage, Optimizer, Offload>::weights(std::size_t p) {
  expect_usable("weights");
  WM_EXPECTS(p < plan_.params.size(), "zero_optimizer::weights: a parameter index below the count");
  WM_EXPECTS(plan_.params[p].type == detail::zero::element_type_of<T>(),
             "zero_optimizer::weights: T must be the parameter's compute type");
  auto const& pl = plan_.places[p];
  if (pl.bucket == detail::zero::no_bucket) { return {}; }
  std::size_t const n = plan_.params[p].elements;
  if constexpr (Stage::value == 3) {
    auto const at = residency_.offset(pl.bucket);
    WM_EXPECTS(at.has_value() && residency_.held_bucket(pl.bucket),
               "zero_optimizer::weights: parameter '" + plan_.params[p].name +
                   "' is not gathered (stage 3: gather a group that holds it first)");
    return {reinterpret_cast<T*>(pool_ + *at) + pl.offset, n};
  } else {
    WM_EXPECTS(engine_.pending() <= pl.bucket,
               "zero_optimizer::weights: parameter '" + plan_.params[p].name +
                   "' still waits for the last step's weights (offload_overlap_forward): call "
                   "weights_ready(bucket_of(p), stream) first");
    return {reinterpret_cast<T*>(weights_ + plan_.byte_offset(p)), n};
  }
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
template <class T>
std::span<T> zero_optimizer<Stage, Optimizer, Offload>::gradients(std::size_t p) {
  expect_usable("gradients");
  WM_EXPECTS(p < plan_.params.size(),
             "zero_optimizer::gradients: a parameter index below the count");
  WM_EXPECTS(plan_.params[p].type == detail::zero::element_type_of<T>(),
             "zero_optimizer::gradients: T must be the parameter's compute type");
  auto const& pl = plan_.places[p];
  if (pl.bucket == detail::zero::no_bucket) { return {}; }
  std::size_t const n = plan_.params[p].elements;
  if constexpr (Stage::value == 1) {
    return {reinterpret_cast<T*>(grads_ + plan_.byte_offset(p)), n};
  } else {
    return {reinterpret_cast<T*>(staging(pl.bucket)) + pl.offset, n};
  }
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
template <class T>
void zero_optimizer<Stage, Optimizer, Offload>::set_weights(std::size_t p, T const* values,
                                                            cuda::stream_ref stream) {
  expect_usable("set_weights");
  WM_EXPECTS(p < plan_.params.size(),
             "zero_optimizer::set_weights: a parameter index below the count");
  WM_EXPECTS(plan_.params[p].type == detail::zero::element_type_of<T>(),
             "zero_optimizer::set_weights: T must be the parameter's compute type");
  auto const& pl = plan_.places[p];
  if (pl.bucket == detail::zero::no_bucket) { return; }
  WM_EXPECTS(values != nullptr, "zero_optimizer::set_weights: values");
  engine_.complete_tail(stream);  // the last step's weights land first (they would overwrite these)
  masters_stale_ = true;
  engine_.invalidate();
  if constexpr (Stage::value == 3) {
    for (auto const& f : plan_.fragments(pl.bucket, rank_)) {
      if (f.param != p) { continue; }
      WM_CUDA_TRY(cudaMemcpyAsync(static_cast<T*>(shard_weights(f.bucket)) + f.shard_offset,
                                  values + f.param_offset, f.elements * sizeof(T),
                                  cudaMemcpyDefault, stream.get()));
    }
  } else {
    WM_CUDA_TRY(cudaMemcpyAsync(weights_ + plan_.byte_offset(p), values,
                                plan_.params[p].elements * sizeof(T), cudaMemcpyDefault,
                                stream.get()));
  }
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::widen_masters(cudaStream_t s) {
  for (std::size_t b = 0; b < plan_.buckets.size(); ++b) {
    auto const& bk = plan_.buckets[b];
    detail::zero::with_element_type(bk.type, [&](auto tag) {
      using T = decltype(tag);
      WM_CUDA_TRY(
          cub::DeviceFor::Bulk(bk.shard_elements,
                               detail::zero::widen_op<T>{static_cast<T const*>(shard_weights(b)),
                                                         engine_.master() + bk.state_offset},
                               s));
    });
  }
  masters_stale_ = false;
}

}  // namespace wm

#include <wm/detail/zero/device_update.cuh>
#include <wm/detail/zero/gather.cuh>
#include <wm/detail/zero/offload/host_offload.cuh>
#include <wm/detail/zero/save_load.cuh>
#include <wm/detail/zero/step.cuh>
