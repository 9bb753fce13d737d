// SPDX-License-Identifier: Apache-2.0
// The engine of wm::no_offload: the fp32 master weights and optimizer states of the rank's shard
// on the device, and the step as one fused kernel per bucket shard after the norm's all-reduce
// (docs/design.md, "ZeRO step and offload"). Every hook that only the host offload needs is an
// empty inline function here: a no-offload step does nothing it did not do before.
#pragma once

#include <wm/detail/base/cuda.cuh>
#include <wm/detail/base/resources.hpp>
#include <wm/detail/zero/counters.hpp>
#include <wm/detail/zero/kernels.cuh>
#include <wm/detail/zero/teardown.hpp>
#include <wm/zero_policy.hpp>

#include <cub/device/device_for.cuh>
#include <cuda/stream_ref>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>

namespace wm::detail::zero {

/**
 * @brief The device update of `wm::zero_optimizer<Stage, Optimizer, wm::no_offload>`.
 *
 * The interface every engine has (`host_offload` is the other): `allocate` (the master weights
 * and states, and their terms of `zero_memory`), `start` and `stop`, `step`, the counters'
 * `read_counters` / `counters_loaded`, the save and load hooks (`settle_states`, `before_load`),
 * the teardown's `drain` / `abandon`, and what only the host offload does something with
 * (`check`, `fail`, `reduced`, `pending`, `weights_ready`, `complete_tail`, `invalidate`,
 * `prepare`, `pipelined`, `stats`).
 * @tparam Owner the `wm::zero_optimizer` that holds it (and names it a friend)
 */
template <class Owner>
class device_update {
  using optimizer_type = typename Owner::optimizer_type;

 public:
  static constexpr std::uint64_t id = 0;  ///< enters the ranks' agreement on the options

  explicit device_update(Owner& owner) noexcept : o_{&owner} {}
  device_update(device_update const&)            = delete;
  device_update& operator=(device_update const&) = delete;

  /// Device master weights (zero until the first step widens them) and states (the optimizer's
  /// initial value), initialized on @p init; their bytes are already in @p m.
  void allocate(zero_memory& m, std::size_t /*shard_arena*/, cudaStream_t init) {
    std::size_t const n = o_->plan_.state_elements;
    storage_            = std::make_unique<storage>();
    storage_->master    = device_buffer<float>{n};
    storage_->states    = device_buffer<float>{n * optimizer_type::states};
    if (m.master_weights > 0) { WM_CUDA_TRY(cudaMemsetAsync(master(), 0, m.master_weights, init)); }
    if (std::size_t const k = n * optimizer_type::states; k > 0) {
      WM_CUDA_TRY(cub::DeviceFor::Bulk(k, fill_op{states(), initial_state(o_->opt_)}, init));
    }
  }
  void start() noexcept {}
  void stop() noexcept {}

  [[nodiscard]] float* master() const noexcept { return storage_->master.data(); }
  [[nodiscard]] float* states() const noexcept { return storage_->states.data(); }

  /// Σ g² and its all-reduce, the fused update of every shard cast into the all-gather's send
  /// block, the counters, then (stages 1-2) the in-place all-gather of the new weights.
  void step(float lr, cuda::stream_ref stream) {
    Owner& o             = *o_;
    cudaStream_t const s = stream.get();
    if (o.masters_stale_) { o.widen_masters(s); }
    double* const global = o.norm_async(stream);
    float const ranks    = o.options_.average_gradients ? static_cast<float>(o.world_) : 1.0f;
    step_args const args{lr, 1.0f / ranks, o.scale_, o.options_.max_grad_norm, global, o.counters_};
    for (std::size_t b = 0; b < o.plan_.buckets.size(); ++b) {
      auto const& bk = o.plan_.buckets[b];
      with_element_type(bk.type, [&](auto tag) {
        using T = decltype(tag);
        update_kernel<T, optimizer_type><<<elementwise_blocks(bk.shard_elements), 256, 0, s>>>(
            static_cast<T const*>(o.shard_gradients(b)), master() + bk.state_offset,
            states() + bk.state_offset, o.plan_.state_elements, static_cast<T*>(o.shard_weights(b)),
            bk.shard_elements, o.opt_, args);
        WM_CHECK_LAUNCH();
      });
    }
    WM_CUDA_TRY(cub::DeviceFor::Bulk(
        1,
        finish_step_op{global, o.counters_, o.scale_, o.options_.dynamic_loss_scale,
                       o.options_.scale_growth, o.options_.scale_backoff,
                       o.options_.scale_growth_interval},
        s));
    if constexpr (Owner::stage < 3) {
      for (std::size_t b = 0; b < o.plan_.buckets.size(); ++b) {
        o.all_gather_bucket(b, o.weights_ + o.plan_.buckets[b].byte_offset, stream);
      }
    }
  }

  /// The counters and the loss scale from the device into the owner's host copies, on @p stream.
  void read_counters(cuda::stream_ref stream) const {
    WM_CUDA_TRY(cudaMemcpyAsync(o_->host_counters_, o_->counters_, sizeof(step_counters),
                                cudaMemcpyDeviceToHost, stream.get()));
    WM_CUDA_TRY(cudaMemcpyAsync(&o_->host_scale_, o_->scale_, sizeof(float), cudaMemcpyDeviceToHost,
                                stream.get()));
  }
  /// After a load: the counters it set on the host to the device (the growth tracker stays).
  void counters_loaded(cudaStream_t s) {
    WM_CUDA_TRY(cudaMemcpyAsync(o_->counters_, o_->host_counters_,
                                offsetof(step_counters, growth_tracker), cudaMemcpyHostToDevice,
                                s));
  }

  void settle_states() const noexcept {}
  void before_load(cuda::stream_ref) noexcept {}
  void drain(teardown&) const noexcept {}
  /// The teardown gave up waiting: the buffers are left allocated.
  void abandon() noexcept { (void)storage_.release(); }

  void check(char const*) const noexcept {}
  void fail() const noexcept {}
  void reduced(std::size_t, cuda::stream_ref) noexcept {}
  [[nodiscard]] std::size_t pending() const noexcept { return pending_; }
  void weights_ready(std::size_t, cuda::stream_ref) noexcept {}
  void complete_tail(cuda::stream_ref) noexcept {}
  void invalidate() noexcept {}
  void prepare(float) noexcept {}
  [[nodiscard]] static constexpr bool pipelined() noexcept { return false; }
  [[nodiscard]] static constexpr zero_offload_stats stats() noexcept { return {}; }

 private:
  struct storage {
    device_buffer<float> master;  // state_elements
    device_buffer<float> states;  // state_elements × Optimizer::states
  };
  Owner* o_;
  std::unique_ptr<storage> storage_;
  // Always 0 (nothing waits for its weights), a member rather than a constant so that the
  // owner's checks of it compile without "pointless comparison" warnings.
  std::size_t pending_{0};
};

}  // namespace wm::detail::zero
