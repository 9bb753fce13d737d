// SPDX-License-Identifier: Apache-2.0
// Bodies of wm::zero_optimizer (declared in <wm/zero.cuh>).
#pragma once

#include <wm/detail/base/cuda.cuh>
#include <wm/detail/base/deadline.hpp>
#include <wm/detail/base/hash.hpp>
#include <wm/detail/zero/kernels.cuh>
#include <wm/zero.cuh>

#include <cub/device/device_for.cuh>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>

namespace wm {
namespace detail::zero {

/// Device bytes, or nullptr for none.
template <class T = std::byte>
[[nodiscard]] T* device_alloc(std::size_t count) {
  if (count == 0) { return nullptr; }
  void* p = nullptr;
  WM_CUDA_TRY(cudaMalloc(&p, count * sizeof(T)));
  return static_cast<T*>(p);
}

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
    : comm_{&comm}, opt_{optimizer}, options_{std::move(options)} {
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
  h               = detail::mix64(h, Offload::host ? 1 : 0);
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

  if constexpr (Offload::host) {
    WM_EXPECTS(opt_.epsilon == adam_epsilon::torch_adam,
               "zero_optimizer with offload_host: wm::adam with adam_epsilon::torch_adam (the CPU "
               "Adam's form)");
    for (auto const& b : plan_.buckets) {
      WM_EXPECTS(b.type != z::element_type::f16,
                 "zero_optimizer with offload_host: bf16 or fp32 parameters (the CPU Adam reads "
                 "no fp16)");
    }
  }
  memory_.weights          = Stage::value < 3 ? plan_.arena_bytes : shard_arena;
  memory_.gradients        = Stage::value == 1 ? plan_.arena_bytes : shard_arena;
  memory_.master_weights   = plan_.state_elements * sizeof(float);
  memory_.optimizer_states = memory_.master_weights * static_cast<std::size_t>(Optimizer::states);
  std::size_t const accum_bytes =
      Stage::value == 1 && options_.gradient_accumulation ? shard_arena : 0;
  memory_.buffers     = (Stage::value >= 2 ? stagings * max_b : 0) + pool_bytes + accum_bytes;
  memory_.scratch     = (partials_ + 4) * sizeof(double) + 3 * sizeof(std::int64_t);
  bool const pipeline = Offload::host && options_.offload_pipeline;
  // The pipeline's chunks (bucket by bucket) and its spare regions, each as large as the largest
  // chunk: ceil(fraction × chunks) of them.
  std::size_t chunks  = 0;
  std::size_t regions = 0;
  if (pipeline) {
    std::size_t const chunk = options_.offload_chunk_elements;
    for (std::size_t b = 0; b < plan_.buckets.size(); ++b) {
      std::size_t const shard = plan_.buckets[b].shard_elements;
      std::size_t const n     = std::max<std::size_t>(1, cuda::ceil_div(shard, chunk));
      first_chunk_.push_back(chunks);
      for (std::size_t k = 0; k < n; ++k) {
        chunk_bucket_.push_back(b);
        chunk_first_.push_back(k * chunk);
      }
      chunks += n;
      region_elements_ = std::max(region_elements_, std::min(chunk, shard));
    }
    if (region_elements_ > 0) {
      // ceil(fraction × chunks) of the fraction as written (0.1f is a little above 0.1: without
      // the margin, 0.1f of 10 chunks would be 2 regions).
      double const want = std::ceil(static_cast<double>(options_.offload_spare_fraction) *
                                    static_cast<double>(chunks) * (1.0 - 1e-7));
      regions           = std::min(chunks, static_cast<std::size_t>(want));
    }
  }
  std::size_t const region_floats =
      region_elements_ * (1 + static_cast<std::size_t>(Optimizer::states));
  if constexpr (Offload::host) {  // master weights and moments live on the host (+ spares)
    memory_.host = memory_.master_weights + memory_.optimizer_states +
                   regions * region_floats * sizeof(float) + 2 * shard_arena;
    memory_.master_weights   = 0;
    memory_.optimizer_states = 0;
  }

  try {
    weights_ = z::device_alloc(memory_.weights);
    grads_   = z::device_alloc(memory_.gradients);
    staging_ = z::device_alloc(Stage::value >= 2 ? stagings * max_b : 0);
    pool_    = z::device_alloc(pool_bytes);
    accum_   = z::device_alloc(accum_bytes);
    accumulated_.assign(plan_.buckets.size(), 0);
    if constexpr (Offload::host) {
      // Pinned: the CPU Adam's arrays; the device reads and writes them too (UVA) where it widens
      // or narrows weights.
      auto pinned = [](std::size_t bytes) {
        void* p = nullptr;
        if (bytes > 0) { WM_CUDA_TRY(cudaMallocHost(&p, bytes)); }
        if (p != nullptr) { std::memset(p, 0, bytes); }
        return static_cast<std::byte*>(p);
      };
      master_ = reinterpret_cast<float*>(pinned(plan_.state_elements * sizeof(float)));
      states_ = reinterpret_cast<float*>(
          pinned(plan_.state_elements * Optimizer::states * sizeof(float)));
      host_grads_   = pinned(shard_arena);
      host_weights_ = pinned(shard_arena);
      host_sumsq_   = reinterpret_cast<double*>(pinned(2 * sizeof(double)));
      std::fill_n(states_, plan_.state_elements * Optimizer::states, initial_state(opt_));
      cpu_pool_ = std::make_unique<z::thread_pool>(options_.cpu_threads, options_.pin_cpu_threads);
      if (pipeline) {
        // Written before they are read (a chunk's update ahead fills its region).
        spare_  = reinterpret_cast<float*>(pinned(regions * region_floats * sizeof(float)));
        spares_ = z::spare_regions{chunks, regions};
        WM_CUDA_TRY(cudaGetDevice(&device_));
        WM_CUDA_TRY(cudaStreamCreateWithFlags(&d2h_stream_, cudaStreamNonBlocking));
        WM_CUDA_TRY(cudaStreamCreateWithFlags(&h2d_stream_, cudaStreamNonBlocking));
        for (cudaEvent_t* e : {&reduced_, &d2h_done_, &h2d_done_}) {
          WM_CUDA_TRY(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
        }
        landed_.assign(chunks, nullptr);
        for (auto& e : landed_) {
          WM_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
        }
        bucket_sent_.assign(plan_.buckets.size(), nullptr);
        for (auto& e : bucket_sent_) {
          WM_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
        }
        bucket_epoch_ = std::make_unique<std::atomic<std::uint64_t>[]>(plan_.buckets.size());
        claimed_.assign(plan_.buckets.size(), 0);
      }
    } else {
      master_ = z::device_alloc<float>(plan_.state_elements);
      states_ = z::device_alloc<float>(plan_.state_elements * Optimizer::states);
    }
    scratch_  = z::device_alloc<double>(partials_ + 4);
    counters_ = z::device_alloc<std::int64_t>(counters);
    scale_    = z::device_alloc<float>(1);
    WM_CUDA_TRY(cudaMallocHost(&host_counters_, counters * sizeof(std::int64_t)));
    std::fill_n(host_counters_, counters, std::int64_t{0});
    host_scale_ = options_.loss_scale;
    WM_CUDA_TRY(cudaMemcpy(scale_, &host_scale_, sizeof(float), cudaMemcpyHostToDevice));
    WM_CUDA_TRY(cudaStreamCreateWithFlags(&gather_stream_, cudaStreamNonBlocking));
    WM_CUDA_TRY(cudaEventCreateWithFlags(&gather_done_, cudaEventDisableTiming));
    WM_CUDA_TRY(cudaEventCreateWithFlags(&user_ready_, cudaEventDisableTiming));
    // Padding must stay zero (it enters the norm): every buffer starts at zero.
    for (auto [p, n] :
         {std::pair{static_cast<void*>(weights_), memory_.weights},
          std::pair{static_cast<void*>(grads_), memory_.gradients},
          std::pair{static_cast<void*>(staging_), stagings * max_b},
          std::pair{static_cast<void*>(Offload::host ? nullptr : master_), memory_.master_weights},
          std::pair{static_cast<void*>(counters_), counters * sizeof(std::int64_t)}}) {
      if (p != nullptr && n > 0) { WM_CUDA_TRY(cudaMemsetAsync(p, 0, n, gather_stream_)); }
    }
    if (std::size_t const n = plan_.state_elements * Optimizer::states; n > 0 && !Offload::host) {
      WM_CUDA_TRY(
          cub::DeviceFor::Bulk(n, z::fill_op{states_, initial_state(opt_)}, gather_stream_));
    }
    WM_CUDA_TRY(cudaStreamSynchronize(gather_stream_));
    if (pipeline) { worker_ = std::make_unique<z::serial_worker>(); }
  } catch (...) {
    free_all();
    throw;
  }
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
zero_optimizer<Stage, Optimizer, Offload>::~zero_optimizer() {
  free_all();
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::free_all() noexcept {
  worker_.reset();  // cancels a job that waits, joins: nothing on the host uses the buffers
  // cudaFree waits for the device work that may still use these buffers.
  for (void* p :
       {static_cast<void*>(weights_), static_cast<void*>(grads_), static_cast<void*>(staging_),
        static_cast<void*>(pool_), static_cast<void*>(scratch_), static_cast<void*>(counters_),
        static_cast<void*>(scale_), static_cast<void*>(accum_)}) {
    if (p != nullptr) { (void)cudaFree(p); }
  }
  for (void* p : {static_cast<void*>(master_), static_cast<void*>(states_)}) {
    if (p != nullptr) { (void)(Offload::host ? cudaFreeHost(p) : cudaFree(p)); }
  }
  for (void* p : {static_cast<void*>(host_grads_), static_cast<void*>(host_weights_),
                  static_cast<void*>(host_sumsq_), static_cast<void*>(spare_)}) {
    if (p != nullptr) { (void)cudaFreeHost(p); }
  }
  for (cudaEvent_t e : landed_) { (void)cudaEventDestroy(e); }
  landed_.clear();
  for (cudaEvent_t e : bucket_sent_) {
    if (e != nullptr) { (void)cudaEventDestroy(e); }
  }
  bucket_sent_.clear();
  for (cudaEvent_t* e : {&reduced_, &d2h_done_, &h2d_done_}) {
    if (*e != nullptr) { (void)cudaEventDestroy(*e); }
    *e = nullptr;
  }
  for (cudaStream_t* t : {&d2h_stream_, &h2d_stream_}) {
    if (*t != nullptr) { (void)cudaStreamDestroy(*t); }
    *t = nullptr;
  }
  spare_      = nullptr;
  host_grads_ = host_weights_ = nullptr;
  host_sumsq_                 = nullptr;
  weights_ = grads_ = staging_ = pool_ = accum_ = nullptr;
  master_ = states_ = nullptr;
  scratch_          = nullptr;
  counters_         = nullptr;
  scale_            = nullptr;
  if (host_counters_ != nullptr) { (void)cudaFreeHost(host_counters_); }
  host_counters_ = nullptr;
  if (gather_done_ != nullptr) { (void)cudaEventDestroy(gather_done_); }
  if (user_ready_ != nullptr) { (void)cudaEventDestroy(user_ready_); }
  if (gather_stream_ != nullptr) { (void)cudaStreamDestroy(gather_stream_); }
  gather_done_ = user_ready_ = nullptr;
  gather_stream_             = nullptr;
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
    WM_EXPECTS(pending_ <= pl.bucket,
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
  complete_tail(stream);  // the last step's weights land first (they would overwrite these)
  masters_stale_ = true;
  spec_.invalid  = true;
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
                                                         master_ + bk.state_offset},
                               s));
    });
  }
  masters_stale_ = false;
}

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
    fail_offload();
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
    fail_offload();
    throw;
  }
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::reduce_bucket(std::size_t b,
                                                              cuda::stream_ref stream, bool last) {
  namespace z = detail::zero;
  complete_tail(stream);  // the last step's weights are in place before backward's next ones
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
    if constexpr (Offload::host) {  // to the CPU Adam at once (overlaps the rest of backward)
      std::size_t const size = bk.shard_elements * sizeof(T);
      if (!options_.offload_pipeline) {
        WM_CUDA_TRY(cudaMemcpyAsync(host_grads_ + shard_bytes_offset_[b], shard_gradients(b), size,
                                    cudaMemcpyDeviceToHost, stream.get()));
        return;
      }
      // The norm partials now: the shard is the landing place of the new weights later.
      norm_partials(b, stream.get());
      if (!step_open_) {  // the step's first bucket: what the CPU Adam assumes for all of them
        step_open_ = true;
        spec_      = {};
        decision_.store(0, std::memory_order_relaxed);  // the worker is idle between steps
        ++epoch_;
        std::fill(claimed_.begin(), claimed_.end(), std::uint8_t{0});
        claim_top_ = claimed_.size();
        if (!masters_stale_ && std::isfinite(next_lr_)) {
          float const ranks = options_.average_gradients ? static_cast<float>(world_) : 1.0f;
          spec_.active      = true;
          spec_.lr          = next_lr_;
          spec_.t           = host_counters_[0] + 1;
          spec_.factor      = 1.0f / (host_scale_ * ranks);  // as step computes it, unclipped
        }
      }
      // On the copy stream: backward goes on while the gradients go to the host.
      WM_CUDA_TRY(cudaEventRecord(reduced_, stream.get()));
      WM_CUDA_TRY(cudaStreamWaitEvent(d2h_stream_, reduced_, 0));
      std::size_t const chunk_bytes = options_.offload_chunk_elements * sizeof(T);
      std::size_t c                 = first_chunk_[b];
      for (std::size_t at = 0; at < size; at += chunk_bytes, ++c) {
        WM_CUDA_TRY(cudaMemcpyAsync(host_grads_ + shard_bytes_offset_[b] + at,
                                    static_cast<std::byte*>(shard_gradients(b)) + at,
                                    std::min(chunk_bytes, size - at), cudaMemcpyDeviceToHost,
                                    d2h_stream_));
        WM_CUDA_TRY(cudaEventRecord(landed_[c], d2h_stream_));
      }
      if (spec_.active) {
        ++spec_.posted;
        detail::zero::serial_worker const* w = worker_.get();
        worker_->post([this, b, lr = spec_.lr, t = spec_.t, f = spec_.factor, e = epoch_, w] {
          pipeline_job(b, lr, t, f, e, *w);
        });
      }
    }
  });
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::wait_event(
    cudaEvent_t e, char const* what, detail::zero::serial_worker const* worker) const {
  auto const deadline = detail::deadline_after(comm_->timeout());
  detail::backoff wait{std::chrono::microseconds{50}};
  for (;;) {
    cudaError_t const q = cudaEventQuery(e);
    if (q == cudaSuccess) { return; }
    if (q != cudaErrorNotReady) { WM_CUDA_TRY(q); }
    if (worker != nullptr && worker->cancelled()) {
      throw comm_error{"wm: zero_optimizer: the wait for " + std::string{what} + " was cancelled"};
    }
    if (detail::clock_type::now() >= deadline) {
      throw comm_error{"wm: zero_optimizer on rank " + std::to_string(rank_) + ": waited for " +
                       what + " longer than the communicator's timeout"};
    }
    wait.pause();
  }
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
std::array<float*, 3> zero_optimizer<Stage, Optimizer, Offload>::home_states(
    std::size_t b, std::size_t first) const noexcept {
  std::size_t const off = plan_.buckets[b].state_offset + first;
  return {master_ + off, states_ + off, states_ + plan_.state_elements + off};
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
std::array<float*, 3> zero_optimizer<Stage, Optimizer, Offload>::chunk_states(
    std::size_t c, detail::zero::spare_regions::region_index where) const noexcept {
  if (where == detail::zero::spare_regions::home) {
    return home_states(chunk_bucket_[c], chunk_first_[c]);
  }
  float* const r = spare_ + static_cast<std::size_t>(where) * 3 * region_elements_;
  return {r, r + region_elements_, r + 2 * region_elements_};
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
std::size_t zero_optimizer<Stage, Optimizer, Offload>::chunk_elements(
    std::size_t c) const noexcept {
  std::size_t const shard = plan_.buckets[chunk_bucket_[c]].shard_elements;
  return std::min(options_.offload_chunk_elements, shard - chunk_first_[c]);
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::gather_host_copies() const try {
  settle_tail();
  if (away_ == 0) { return; }  // (a step begun only writes ahead into regions: not current yet)
  if (step_open_ && spec_.active) {
    // Mid-step: the worker may be writing the place of a chunk whose values are in a region. It
    // stops taking chunks and ends; its work is dropped and the step is redone after backward.
    decision_.store(2, std::memory_order_release);
    spec_.invalid = true;
    bool idle     = false;
    try {
      idle = worker_->wait_idle(detail::deadline_after(comm_->timeout()));
    } catch (...) {  // a job failed (the worker is idle): its work is dropped
      chunks_dropped_ += static_cast<std::int64_t>(spares_.pending());
      spares_.drop();
      throw;
    }
    if (!idle) {
      throw comm_error{"wm: zero_optimizer on rank " + std::to_string(rank_) +
                       ": the offload pipeline's CPU Adam did not end within the communicator's "
                       "timeout"};
    }
    chunks_dropped_ += static_cast<std::int64_t>(spares_.pending());
    spares_.drop();
  }
  for (std::size_t c = 0; c < spares_.chunks(); ++c) {
    auto const from = spares_.current(c);
    if (from == detail::zero::spare_regions::home) { continue; }
    auto const src      = chunk_states(c, from);
    auto const dst      = chunk_states(c, detail::zero::spare_regions::home);
    std::size_t const n = chunk_elements(c);
    for (std::size_t k = 0; k < 3; ++k) { std::memcpy(dst[k], src[k], n * sizeof(float)); }
    (void)spares_.settle(c);
  }
  away_ = 0;
} catch (...) {  // the step's chunks are neither dropped nor in place for sure: unusable
  fail_offload();
  throw;
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
void zero_optimizer<Stage, Optimizer, Offload>::wait_decision(
    detail::zero::serial_worker const& worker) {
  region_waits_.fetch_add(1, std::memory_order_relaxed);
  auto const start    = std::chrono::steady_clock::now();
  auto const deadline = detail::deadline_after(comm_->timeout());
  detail::backoff wait{std::chrono::microseconds{50}};
  // step always publishes the decision once it has the norm (and load, master_shard and the
  // destructor stop the worker first).
  while (decision_.load(std::memory_order_acquire) == 0) {
    if (worker.cancelled()) {
      throw comm_error{"wm: zero_optimizer: the wait for the step's decision was cancelled"};
    }
    if (detail::clock_type::now() >= deadline) {
      throw comm_error{"wm: zero_optimizer on rank " + std::to_string(rank_) +
                       ": the offload pipeline waited for step longer than the communicator's "
                       "timeout"};
    }
    wait.pause();
  }
  wait_ns_.fetch_add(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count(),
      std::memory_order_relaxed);
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::end_speculation(bool adopt) const {
  if (adopt) {
    spares_.commit();
  } else {
    chunks_dropped_ += static_cast<std::int64_t>(spares_.pending());
    spares_.drop();
  }
  sync_spares();
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
zero_offload_stats zero_optimizer<Stage, Optimizer, Offload>::offload_stats() const noexcept {
  zero_offload_stats r;
  r.chunks_ahead     = chunks_ahead_.load(std::memory_order_relaxed);
  r.chunks_after     = chunks_after_.load(std::memory_order_relaxed);
  r.chunks_dropped   = chunks_dropped_;
  r.chunks_redone    = chunks_redone_;
  r.region_waits     = region_waits_.load(std::memory_order_relaxed);
  r.wait_seconds     = static_cast<double>(wait_ns_.load(std::memory_order_relaxed)) * 1e-9;
  r.cpu_adam_seconds = static_cast<double>(cpu_ns_.load(std::memory_order_relaxed)) * 1e-9;
  r.spare_regions    = spares_.regions();
  r.region_elements  = region_elements_;
  r.peak_regions     = peak_regions_;
  return r;
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
std::size_t zero_optimizer<Stage, Optimizer, Offload>::claim_bucket(std::size_t b) {
  // Before the decision the jobs take their buckets as backward reduced them (0, 1, ...); once
  // the step applies as assumed, the buckets left in forward order (the highest first), the order
  // in which the next forward needs their weights. Each of the step's jobs claims one bucket.
  if (decision_.load(std::memory_order_acquire) == 1) {
    while (claim_top_ > 0 && claimed_[claim_top_ - 1] != 0) { --claim_top_; }
    if (claim_top_ > 0) { b = claim_top_ - 1; }
  }
  claimed_[b] = 1;
  return b;
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::pipeline_job(
    std::size_t posted, float lr, std::int64_t t, float factor, std::uint64_t epoch,
    detail::zero::serial_worker const& worker) {
  namespace z = detail::zero;
  WM_CUDA_TRY(cudaSetDevice(device_));
  std::size_t const b     = claim_bucket(posted);
  auto const& bk          = plan_.buckets[b];
  std::size_t const esize = z::size_of(bk.type);
  std::size_t c           = first_chunk_[b];
  std::size_t const chunk = options_.offload_chunk_elements;
  for (std::size_t first = 0; first < bk.shard_elements; first += chunk, ++c) {
    std::size_t const count = std::min(chunk, bk.shard_elements - first);
    // Dropped (or the optimizer failed), or the worker is being destroyed: stop at this chunk
    // boundary rather than finish the bucket, whose update no one will take.
    if (decision_.load(std::memory_order_acquire) == 2 || worker.cancelled()) { return; }
    wait_event(landed_[c], "a bucket's gradients on the host", &worker);
    // Not decided yet: into a spare region (or from one back to the chunk's place), which the
    // step adopts or drops; no region free: wait for the decision. Decided: in place (the step
    // applies as assumed), or not at all (dropped).
    int decision = decision_.load(std::memory_order_acquire);
    if (decision == 0) {
      if (auto const to = spares_.ahead(c)) {
        cpu_update(b, first, count, lr, t, factor, chunk_states(c, spares_.current(c)),
                   chunk_states(c, *to));
        chunks_ahead_.fetch_add(1, std::memory_order_relaxed);
      } else {
        wait_decision(worker);
        decision = decision_.load(std::memory_order_acquire);
      }
    }
    if (decision == 2) { return; }
    if (decision == 1) {
      auto const from = spares_.settle(c);
      cpu_update(b, first, count, lr, t, factor, chunk_states(c, from),
                 chunk_states(c, z::spare_regions::home));
      chunks_after_.fetch_add(1, std::memory_order_relaxed);
    }
    // Into the bucket's device gradient shard (these gradients are on the host now): the
    // compute weights stay as they are until step adopts the update.
    WM_CUDA_TRY(cudaMemcpyAsync(static_cast<std::byte*>(shard_gradients(b)) + first * esize,
                                host_weights_ + shard_bytes_offset_[b] + first * esize,
                                count * esize, cudaMemcpyHostToDevice, h2d_stream_));
  }
  // The bucket's weights are on their way (weights_ready waits for the event once it sees the
  // epoch).
  WM_CUDA_TRY(cudaEventRecord(bucket_sent_[b], h2d_stream_));
  bucket_epoch_[b].store(epoch, std::memory_order_release);
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::settle_tail() const try {
  if (!tail_worker_) { return; }
  bool idle = false;
  try {
    idle = worker_->wait_idle(detail::deadline_after(comm_->timeout()));
  } catch (...) {  // a job failed: the step is incomplete, its weights are not coming
    tail_worker_ = false;
    pending_     = 0;
    end_speculation(false);
    throw;
  }
  if (!idle) {
    throw comm_error{"wm: zero_optimizer on rank " + std::to_string(rank_) +
                     ": the offload pipeline's CPU Adam did not end within the communicator's "
                     "timeout"};
  }
  tail_worker_ = false;
  end_speculation(true);  // the step applied: what was computed ahead is current
} catch (...) {           // the step that `step` adopted did not end: its update is incomplete
  fail_offload();
  throw;
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::adopt_bucket(std::size_t b,
                                                             cuda::stream_ref stream) {
  namespace z    = detail::zero;
  auto const& bk = plan_.buckets[b];
  if constexpr (Stage::value < 3) {
    z::with_element_type(bk.type, [&](auto tag) {
      using T = decltype(tag);
      comm_->all_gather(static_cast<T const*>(shard_gradients(b)),
                        reinterpret_cast<T*>(weights_ + bk.byte_offset), bk.shard_elements, stream);
    });
  } else {
    WM_CUDA_TRY(cudaMemcpyAsync(shard_weights(b), shard_gradients(b),
                                bk.shard_elements * z::size_of(bk.type), cudaMemcpyDeviceToDevice,
                                stream.get()));
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
  if constexpr (Offload::host) {
    try {
      auto const deadline = detail::deadline_after(comm_->timeout());
      while (pending_ > b) {  // the buckets above b first: every rank all-gathers in that order
        std::size_t const x = pending_ - 1;
        // A bucket takes the CPU milliseconds: naps of 0.1 ms keep this thread off its cores.
        detail::backoff wait{std::chrono::microseconds{100}};
        while (bucket_epoch_[x].load(std::memory_order_acquire) != epoch_) {
          // The step is incomplete if the worker failed or ended without the bucket: its work
          // ahead is dropped and no weights come.
          auto abandon = [&] {
            tail_worker_ = false;
            pending_     = 0;
            end_speculation(false);
          };
          bool idle = false;
          try {
            idle = worker_->wait_idle(detail::clock_type::now());  // rethrows a job's failure
          } catch (...) {
            abandon();
            throw;
          }
          if (idle && bucket_epoch_[x].load(std::memory_order_acquire) != epoch_) {
            abandon();
            throw logic_error{
                "wm: zero_optimizer::weights_ready: the offload pipeline ended "
                "without bucket " +
                std::to_string(x) + "'s weights"};
          }
          if (detail::clock_type::now() >= deadline) {
            throw comm_error{"wm: zero_optimizer on rank " + std::to_string(rank_) +
                             ": weights_ready waited for the CPU Adam of bucket " +
                             std::to_string(x) + " longer than the communicator's timeout"};
          }
          wait.pause();
        }
        WM_CUDA_TRY(cudaStreamWaitEvent(stream.get(), bucket_sent_[x], 0));
        adopt_bucket(x, stream);
        pending_ = x;
      }
      if (pending_ == 0) { settle_tail(); }
    } catch (...) {  // the buckets left will not come: the step that `step` adopted is incomplete
      fail_offload();
      throw;
    }
  } else {
    (void)stream;
  }
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::finish_pipeline(cuda::stream_ref stream) try {
  bool idle = false;
  try {
    idle = worker_->wait_idle(detail::deadline_after(comm_->timeout()));
  } catch (...) {  // a job failed (the worker is idle): what it did ahead is not the step's
    end_speculation(false);
    throw;
  }
  if (!idle) {
    throw comm_error{"wm: zero_optimizer::step on rank " + std::to_string(rank_) +
                     ": the offload pipeline's CPU Adam did not end within the communicator's "
                     "timeout"};
  }
  // Every H2D of the step is enqueued: the caller's stream waits for them.
  WM_CUDA_TRY(cudaEventRecord(h2d_done_, h2d_stream_));
  WM_CUDA_TRY(cudaStreamWaitEvent(stream.get(), h2d_done_, 0));
} catch (...) {  // a job failed, or the worker goes on past the deadline (it stops: fail_offload)
  fail_offload();
  throw;
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::step(float lr, cuda::stream_ref stream) {
  namespace z          = detail::zero;
  cudaStream_t const s = stream.get();
  expect_usable("step");
  WM_EXPECTS(
      std::find(accumulated_.begin(), accumulated_.end(), std::uint8_t{1}) == accumulated_.end(),
      "zero_optimizer::step: every bucket that accumulate_gradients took needs its "
      "reduce_gradients (the step's last micro-batch) first");
  if constexpr (Stage::value == 3) {
    WM_EXPECTS(!residency_.any_held(),
               "zero_optimizer::step (stage 3): release every gathered group first");
  }
  complete_tail(stream);  // a step without backward: the last step's update ends first
  if constexpr (Stage::value == 3) {
    residency_.drop_prefetch();  // its copies would be stale after the update
    // A prefetch may still be reading the shard weights that the update rewrites.
    WM_CUDA_TRY(cudaStreamWaitEvent(s, gather_done_, 0));
  }
  if constexpr (Offload::host) {
    try {
      step_offload(lr, stream);
    } catch (...) {  // the masters and moments may be half updated, the step half decided
      fail_offload();
      throw;
    }
  } else {
    if (masters_stale_) { widen_masters(s); }
    double* const global = norm_async(stream);
    // 3. The fused update of every shard, cast into the all-gather's send block.
    float const ranks = options_.average_gradients ? static_cast<float>(world_) : 1.0f;
    z::step_args const args{lr, 1.0f / ranks, scale_, options_.max_grad_norm, global, counters_};
    for (std::size_t b = 0; b < plan_.buckets.size(); ++b) {
      auto const& bk = plan_.buckets[b];
      z::with_element_type(bk.type, [&](auto tag) {
        using T = decltype(tag);
        z::update_kernel<T, Optimizer>
            <<<detail::elementwise_blocks(bk.shard_elements), 256, 0, s>>>(
                static_cast<T const*>(shard_gradients(b)), master_ + bk.state_offset,
                states_ + bk.state_offset, plan_.state_elements, static_cast<T*>(shard_weights(b)),
                bk.shard_elements, opt_, args);
        WM_CHECK_LAUNCH();
      });
    }
    WM_CUDA_TRY(cub::DeviceFor::Bulk(
        1,
        z::finish_step_op{global, counters_, scale_, options_.dynamic_loss_scale,
                          options_.scale_growth, options_.scale_backoff,
                          options_.scale_growth_interval},
        s));
    // 4. Stages 1-2: the in-place all-gather of the new weights.
    if constexpr (Stage::value < 3) {
      for (std::size_t b = 0; b < plan_.buckets.size(); ++b) {
        all_gather_bucket(b, weights_ + plan_.buckets[b].byte_offset, stream);
      }
    }
  }
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

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::gather_buckets(
    std::vector<detail::zero::residency::load> const& loads, cudaStream_t s) {
  if (loads.empty()) { return; }
  // The shard weights come from the last step, and the pool ranges were read by released groups:
  // both on the caller's stream.
  WM_CUDA_TRY(cudaEventRecord(user_ready_, s));
  WM_CUDA_TRY(cudaStreamWaitEvent(gather_stream_, user_ready_, 0));
  for (auto const& l : loads) {
    all_gather_bucket(l.bucket, pool_ + l.offset, cuda::stream_ref{gather_stream_});
  }
  WM_CUDA_TRY(cudaEventRecord(gather_done_, gather_stream_));
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::gather(
    std::size_t g, cuda::stream_ref stream) requires(Stage::value == 3) {
  expect_usable("gather");
  WM_EXPECTS(g < residency_.groups(), "zero_optimizer::gather: a group index below the count (" +
                                          std::to_string(residency_.groups()) + "), got " +
                                          std::to_string(g));
  auto const gi = static_cast<std::ptrdiff_t>(g);
  if (last_group_ >= 0 && gi != last_group_) { direction_ = gi > last_group_ ? 1 : -1; }
  last_group_ = gi;
  if (pending_ > 0) {  // offload_overlap_forward: this group's and the next one's shard weights
    std::size_t low = pending_;
    for (std::ptrdiff_t k : {gi, gi + direction_}) {
      if (k < 0 || k >= static_cast<std::ptrdiff_t>(group_buckets_.size())) { continue; }
      for (std::size_t b : group_buckets_[static_cast<std::size_t>(k)]) { low = std::min(low, b); }
    }
    if (low < pending_) { weights_ready(low, stream); }
  }
  gather_buckets(residency_.acquire(g), stream.get());
  // This group's buckets (gathered now or by the last prefetch) are complete for the caller.
  WM_CUDA_TRY(cudaStreamWaitEvent(stream.get(), gather_done_, 0));
  std::ptrdiff_t const next = gi + direction_;
  if (next >= 0 && next < static_cast<std::ptrdiff_t>(residency_.groups())) {
    gather_buckets(residency_.prefetch(static_cast<std::size_t>(next)), stream.get());
  }
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::release(std::size_t g) requires(Stage::value == 3) {
  WM_EXPECTS(g < residency_.groups(), "zero_optimizer::release: a group index below the count");
  residency_.release(g);
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::read_counters(cuda::stream_ref stream) const {
  if constexpr (!Offload::host) {  // offload: the host keeps them
    WM_CUDA_TRY(cudaMemcpyAsync(host_counters_, counters_, counters * sizeof(std::int64_t),
                                cudaMemcpyDeviceToHost, stream.get()));
    WM_CUDA_TRY(
        cudaMemcpyAsync(&host_scale_, scale_, sizeof(float), cudaMemcpyDeviceToHost, stream.get()));
  }
  comm_->synchronize(stream, "zero_optimizer counters");
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
bool zero_optimizer<Stage, Optimizer, Offload>::last_step_skipped(cuda::stream_ref stream) const {
  expect_usable("last_step_skipped");
  read_counters(stream);
  return host_counters_[1] != 0;
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
  return host_counters_[0];
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::agree(std::string const& error, char const* what) {
  // Every rank learns whether any rank failed, so that none goes on to the collectives alone.
  auto const ok = comm_->all_gather(error.empty() ? 1 : 0);
  for (std::size_t r = 0; r < ok.size(); ++r) {
    if (ok[r] == 0) {
      throw io_error{error.empty() ? "wm: zero_optimizer::" + std::string{what} +
                                         " failed on rank " + std::to_string(r)
                                   : error};
    }
  }
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::save(std::filesystem::path const& dir,
                                                     cuda::stream_ref stream) {
  namespace z                   = detail::zero;
  std::size_t const n           = plan_.state_elements;
  constexpr std::size_t streams = 1 + static_cast<std::size_t>(Optimizer::states);
  expect_usable("save");
  complete_tail(stream);
  gather_host_copies();
  if (masters_stale_) { widen_masters(stream.get()); }
  read_counters(stream);  // waits for the stream (with the communicator's deadline)
  std::int64_t const applied = host_counters_[0];
  std::vector<std::vector<float>> data(streams, std::vector<float>(n));
  for (std::size_t k = 0; k < streams && n > 0; ++k) {
    WM_CUDA_TRY(cudaMemcpyAsync(data[k].data(), k == 0 ? master_ : states_ + (k - 1) * n,
                                n * sizeof(float), cudaMemcpyDefault, stream.get()));
  }
  comm_->synchronize(stream, "zero_optimizer::save");
  std::string error;
  try {
    std::filesystem::create_directories(dir);
    z::shard_header const h{static_cast<std::uint64_t>(world_),
                            static_cast<std::uint64_t>(rank_),
                            n,
                            streams,
                            applied,
                            Optimizer::name,
                            checkpoint_tag(opt_),
                            {},
                            0};
    std::vector<std::span<float const>> spans(data.begin(), data.end());
    z::write_shard(z::shard_file(dir, rank_), h, z::fragment_table_of(plan_, rank_), spans);
  } catch (std::exception const& e) {
    error = "wm: zero_optimizer::save on rank " + std::to_string(rank_) + ": " + e.what();
  }
  agree(error, "save");
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::load(std::filesystem::path const& dir,
                                                     cuda::stream_ref stream) {
  namespace z                   = detail::zero;
  cudaStream_t const s          = stream.get();
  std::size_t const n           = plan_.state_elements;
  constexpr std::size_t streams = 1 + static_cast<std::size_t>(Optimizer::states);
  expect_usable("load");
  if constexpr (Offload::host) {  // the pipeline's jobs of a step begun before the load end
    complete_tail(stream);
    if (spec_.active) {
      decision_.store(2, std::memory_order_release);
      finish_pipeline(stream);
      end_speculation(false);
    }
    spec_      = {};
    step_open_ = false;
    gather_host_copies();  // every chunk at its place, which load writes (or keeps if it fails)
  }
  if constexpr (Stage::value == 3) {
    WM_EXPECTS(!residency_.any_held(),
               "zero_optimizer::load (stage 3): release every gathered group first");
    residency_.drop_prefetch();
    WM_CUDA_TRY(cudaStreamWaitEvent(s, gather_done_, 0));
  }
  std::vector<std::vector<float>> data(streams, std::vector<float>(n, 0.0f));
  std::int64_t applied = 0;
  std::string error;
  try {
    auto const h0 = z::read_shard_header(z::shard_file(dir, 0));
    std::vector<std::filesystem::path> files;
    std::vector<z::shard_header> headers;
    std::vector<z::fragment_table> tables;
    for (std::uint64_t r = 0; r < h0.world; ++r) {
      files.push_back(z::shard_file(dir, static_cast<int>(r)));
      headers.push_back(r == 0 ? h0 : z::read_shard_header(files.back()));
      auto const& h           = headers.back();
      std::string const where = files.back().string();
      if (h.world != h0.world || h.rank != r || h.applied != h0.applied) {
        throw io_error{"'" + where + "' belongs to another save than shard-0 (world " +
                       std::to_string(h.world) + ", rank " + std::to_string(h.rank) + ")"};
      }
      if (h.streams != streams || h.optimizer != Optimizer::name) {
        throw io_error{"'" + where + "' holds the states of optimizer '" + h.optimizer + "' (" +
                       std::to_string(h.streams) + " streams); this one is '" + Optimizer::name +
                       "' (" + std::to_string(streams) + ")"};
      }
      if (h.tag != checkpoint_tag(opt_)) {
        throw io_error{"'" + where + "' was saved with optimizer settings '" + h.tag +
                       "'; this optimizer has '" + checkpoint_tag(opt_) + "'"};
      }
      tables.push_back(h.table);
    }
    auto const reads = z::plan_shard_reads(tables, plan_, rank_);
    std::vector<std::span<float>> spans(data.begin(), data.end());
    z::read_shards(files, headers, reads, spans);
    applied = h0.applied;
  } catch (std::exception const& e) {
    error = "wm: zero_optimizer::load on rank " + std::to_string(rank_) + ": " + e.what();
  }
  agree(error, "load");
  comm_->synchronize(stream, "zero_optimizer::load");  // host_counters_ and the buffers are free
  for (std::size_t k = 0; k < streams && n > 0; ++k) {
    WM_CUDA_TRY(cudaMemcpyAsync(k == 0 ? master_ : states_ + (k - 1) * n, data[k].data(),
                                n * sizeof(float), cudaMemcpyDefault, s));
  }
  host_counters_[0] = applied;
  host_counters_[1] = 0;
  host_counters_[2] = 0;
  if constexpr (!Offload::host) {
    WM_CUDA_TRY(cudaMemcpyAsync(counters_, host_counters_, 3 * sizeof(std::int64_t),
                                cudaMemcpyHostToDevice, s));
  }
  // The compute weights of this rank's shard from the masters, then (stages 1-2) everyone's.
  for (std::size_t b = 0; b < plan_.buckets.size(); ++b) {
    auto const& bk = plan_.buckets[b];
    z::with_element_type(bk.type, [&](auto tag) {
      using T = decltype(tag);
      WM_CUDA_TRY(cub::DeviceFor::Bulk(
          bk.shard_elements,
          z::narrow_op<T>{master_ + bk.state_offset, static_cast<T*>(shard_weights(b))}, s));
    });
    if constexpr (Stage::value < 3) { all_gather_bucket(b, weights_ + bk.byte_offset, stream); }
  }
  masters_stale_ = false;
  comm_->synchronize(stream, "zero_optimizer::load");  // `data` and host_counters_ are read
}

}  // namespace wm
