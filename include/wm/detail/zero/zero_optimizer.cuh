// SPDX-License-Identifier: Apache-2.0
// Bodies of wm::zero_optimizer (declared in <wm/zero.cuh>): construction (the arenas, shards,
// streams and, with wm::offload_host, the host buffers and the pipeline's chunks), teardown, and
// the accessors of weights and gradients. The rest by topic, included at the end: the device
// step (step.cuh), stage 3's gathers (gather.cuh), checkpoints (save_load.cuh), and the host
// offload (offload/pipeline.cuh, offload/step.cuh).
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
#include <cstdio>
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

// Before the buffers go, the host waits for the device work that may still use them: its own
// streams up to now and every event it recorded (on the caller's streams too), at most the
// communicator's timeout in all, stack unwinding included. Past it the work is abandoned with a
// line on stderr and the memory is left allocated: freeing it would wait as well (cudaFree
// synchronizes the device), or free what a copy or a kernel still uses.
template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
zero_optimizer<Stage, Optimizer, Offload>::~zero_optimizer() {
  worker_.reset();  // first: its jobs enqueue copies on h2d_stream_
  auto const deadline = detail::deadline_after(comm_->timeout());
  detail::backoff pause{std::chrono::microseconds{100}};
  char const* stuck = nullptr;
  auto const settle = [&](cudaEvent_t e, char const* what) noexcept {
    if (e == nullptr || stuck != nullptr) { return; }
    cudaError_t q{};
    while ((q = cudaEventQuery(e)) == cudaErrorNotReady) {
      if (detail::clock_type::now() >= deadline) {
        stuck = what;
        return;
      }
      pause.pause();
    }
    if (q != cudaSuccess) { (void)cudaGetLastError(); }  // failed: the GPU will not run it
  };
  for (cudaStream_t const t : {d2h_stream_, h2d_stream_, gather_stream_}) {
    if (t == nullptr) { continue; }
    cudaEvent_t e = nullptr;
    if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) == cudaSuccess &&
        cudaEventRecord(e, t) == cudaSuccess) {
      settle(e, t == d2h_stream_   ? "the device-to-host copy stream"
                : t == h2d_stream_ ? "the host-to-device copy stream"
                                   : "the gather stream");
    } else {
      (void)cudaGetLastError();
    }
    if (e != nullptr) { (void)cudaEventDestroy(e); }
  }
  for (cudaEvent_t e : {reduced_, d2h_done_, h2d_done_, gather_done_, user_ready_}) {
    settle(e, "the last work of a step on the caller's stream");
  }
  for (cudaEvent_t e : landed_) { settle(e, "a gradient chunk's copy to the host"); }
  for (cudaEvent_t e : bucket_sent_) { settle(e, "a bucket's weights' copy to the device"); }
  if (stuck != nullptr) {
    std::fprintf(stderr,
                 "wm: zero_optimizer on rank %d: the teardown gave up after %lld ms waiting for "
                 "%s; abandoned, left allocated: its device and pinned host buffers\n",
                 rank_, static_cast<long long>(comm_->timeout().count()), stuck);
    // Deliberately leaked: free_all() then destroys the events and streams only.
    weights_ = grads_ = staging_ = pool_ = accum_ = nullptr;
    master_ = states_ = nullptr;
    spare_            = nullptr;
    scratch_          = nullptr;
    counters_         = nullptr;
    scale_            = nullptr;
    host_grads_ = host_weights_ = nullptr;
    host_sumsq_                 = nullptr;
    host_counters_              = nullptr;
  }
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

}  // namespace wm

#include <wm/detail/zero/gather.cuh>
#include <wm/detail/zero/offload/pipeline.cuh>
#include <wm/detail/zero/offload/step.cuh>
#include <wm/detail/zero/save_load.cuh>
#include <wm/detail/zero/step.cuh>
