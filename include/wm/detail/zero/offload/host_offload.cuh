// SPDX-License-Identifier: Apache-2.0
// The engine of wm::offload_host (docs/design.md, "ZeRO step and offload"): the fp32 master
// weights and Adam moments in pinned host memory, the CPU Adam (cpu_adam.hpp) and, with
// zero_options::offload_pipeline, the pipeline around it: each reduced gradient shard goes to the
// host on a copy stream, a worker thread updates it chunk by chunk (ahead of the step's decision
// into a spare region, in place once decided) and sends the new weights back; `step` decides
// with every rank from the all-reduced norm, adopts the update or redoes it after backward;
// offload_overlap_forward's weights_ready brings the buckets left in place. Every host wait has
// the communicator's deadline; a failure latches (failure_latch.hpp).
//
// Here: the engine's class, its storage, and what a bucket's reduction starts. Its bodies by
// topic, included at the end: the step (step.cuh) and the worker's side (pipeline.cuh).
#pragma once

#include <wm/detail/base/deadline.hpp>
#include <wm/detail/base/resources.hpp>
#include <wm/detail/zero/counters.hpp>
#include <wm/detail/zero/cpu_adam.hpp>
#include <wm/detail/zero/failure_latch.hpp>
#include <wm/detail/zero/kernels.cuh>
#include <wm/detail/zero/plan.hpp>
#include <wm/detail/zero/serial_worker.hpp>
#include <wm/detail/zero/spare_regions.hpp>
#include <wm/detail/zero/teardown.hpp>
#include <wm/detail/zero/thread_pool.hpp>
#include <wm/error.hpp>
#include <wm/optimizer.hpp>
#include <wm/zero_policy.hpp>

#include <cuda/stream_ref>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace wm::detail::zero {

/// What the pipeline's worker does with a chunk it starts (set by `step`, read by the worker).
enum class step_decision : std::uint8_t {
  undecided,  ///< update it ahead into a spare region if one is free; else wait for the decision
  apply,      ///< the step applies as assumed: update it in place
  drop,       ///< the step's work is dropped (or the optimizer failed): stop
};

/**
 * @brief The host offload of `wm::zero_optimizer<Stage, wm::adam, wm::offload_host>`: the
 * engine interface of `device_update` (which see), with host master weights and moments.
 * @tparam Owner the `wm::zero_optimizer` that holds it (and names it a friend)
 */
template <class Owner>
class host_offload {
  using optimizer_type = typename Owner::optimizer_type;
  static_assert(std::same_as<optimizer_type, adam>,
                "wm::zero_optimizer: wm::offload_host runs the CPU Adam; the optimizer must be "
                "wm::adam");

 public:
  static constexpr std::uint64_t id = 1;  ///< enters the ranks' agreement on the options

  explicit host_offload(Owner& owner) noexcept : o_{&owner} {}
  host_offload(host_offload const&)            = delete;
  host_offload& operator=(host_offload const&) = delete;

  /// Pinned master weights, moments, gradient and weight shards (+ the pipeline's spare regions,
  /// chunks, copy streams and events); @p m's master and state terms move to `host`.
  void allocate(zero_memory& m, std::size_t shard_arena, cudaStream_t init);
  /// With the pipeline: its worker thread.
  void start() {
    if (o_->options_.offload_pipeline) { worker_ = std::make_unique<serial_worker>(); }
  }
  /// Cancels a job that waits, joins: nothing on the host uses the buffers after it.
  void stop() noexcept { worker_.reset(); }

  [[nodiscard]] float* master() const noexcept { return storage_->master.data(); }
  [[nodiscard]] float* states() const noexcept { return storage_->states.data(); }

  /// Throws wm::logic_error naming @p operation once an offload step failed.
  void check(char const* operation) const { failure_.check(operation); }
  /// Inside a catch block: the exception being handled makes the optimizer unusable (the first
  /// one is kept as the cause), and the pipeline's job stops at its next chunk.
  void fail() const noexcept {
    failure_.record_current();
    decision_.store(step_decision::drop, std::memory_order_release);
  }

  /// Bucket b's gradient shard is reduced on @p stream: to the host at once.
  void reduced(std::size_t b, cuda::stream_ref stream);
  void step(float lr, cuda::stream_ref stream);
  /// Buckets [0, pending()) still wait for their weights (offload_overlap_forward).
  [[nodiscard]] std::size_t pending() const noexcept { return pending_; }
  void weights_ready(std::size_t b, cuda::stream_ref stream);
  /// Every pending bucket's weights on @p stream, then the worker's tail settled.
  void complete_tail(cuda::stream_ref stream) {
    if (pending_ > 0) { o_->weights_ready(0, stream); }
    settle_tail();
  }
  /// Something changed the inputs of the jobs posted (weights set): they are not the step's.
  void invalidate() noexcept { spec_.invalid = true; }
  void prepare(float lr) noexcept { next_lr_ = lr; }
  [[nodiscard]] bool pipelined() const noexcept { return pipelined_; }
  [[nodiscard]] zero_offload_stats stats() const noexcept;

  /// The host keeps the counters and the scale: nothing to read back or to send.
  void read_counters(cuda::stream_ref) const noexcept {}
  void counters_loaded(cudaStream_t) noexcept {}
  /// Copies the chunks whose current values are in a spare region back to their place (master,
  /// states), so that those are current everywhere.
  void settle_states() const { gather_host_copies(); }
  /// The jobs of a step begun before a load end; every chunk at its place (which load writes,
  /// or keeps if it fails).
  void before_load(cuda::stream_ref stream);

  /// The teardown waits for the copy streams and every event recorded.
  void drain(teardown& wait) const noexcept;
  /// The teardown gave up waiting: the pinned buffers are left allocated.
  void abandon() noexcept { (void)storage_.release(); }

 private:
  // The CPU Adam of elements [first, first + count) of bucket b's shard (this step's lr, count
  // and gradient factor), reading master weights, m and v at @p in and writing them to @p out
  // (the same pointers: in place), the new compute weights into host_weights.
  void cpu_update(std::size_t b, std::size_t first, std::size_t count, float lr, std::int64_t t,
                  float factor, std::array<float*, 3> in, std::array<float*, 3> out);
  // Master weights, m and v of elements [first, ...) of bucket b's shard, at their place.
  [[nodiscard]] std::array<float*, 3> home_states(std::size_t b, std::size_t first) const noexcept;
  // Pipeline: master weights, m and v of chunk @p c at @p where (home or a spare region).
  [[nodiscard]] std::array<float*, 3> chunk_states(
      std::size_t c, spare_regions::region_index where) const noexcept;
  // Pipeline: elements in chunk @p c.
  [[nodiscard]] std::size_t chunk_elements(std::size_t c) const noexcept;
  // On the worker, no free spare region: waits for the decision (cancellable, with the deadline).
  void wait_decision(serial_worker const& worker);
  // Pipeline, the worker idle: the work done ahead becomes current (@p adopt) or is dropped.
  void end_speculation(bool adopt) const;
  // The worker idle: away_ and peak_regions_ from spares_.
  void sync_spares() const noexcept {
    away_         = spares_.away();
    peak_regions_ = spares_.peak_in_use();
  }
  // On the worker: wait for the gradients, update, send the weights back.
  void pipeline_job(std::size_t b, float lr, std::int64_t t, float factor, std::uint64_t epoch,
                    serial_worker const& worker);
  void finish_pipeline(cuda::stream_ref stream);  // waits for the worker (deadline)
  // offload_overlap_forward: the worker's end of a step that `step` adopted without waiting for
  // it (host only: the pending buckets' copies are left to weights_ready).
  void settle_tail() const;
  // On the worker: the bucket the job posted for @p b works on (forward order once decided).
  [[nodiscard]] std::size_t claim_bucket(std::size_t b);
  // Bucket b's new weights, sent back by the pipeline into its gradient shard, into place on
  // @p stream (stages 1-2: all-gathered into the arena; 3: copied into the shard weights).
  void adopt_bucket(std::size_t b, cuda::stream_ref stream);
  // Host poll of @p e with the communicator's deadline (stops early once @p worker is cancelled).
  void wait_event(cudaEvent_t e, char const* what, serial_worker const* worker = nullptr) const;
  void gather_host_copies() const;

  // Pinned host memory (the CPU Adam's arrays; the device reads and writes them too, through
  // UVA, where it widens or narrows weights).
  struct storage {
    pinned_buffer<float> master;            // state_elements
    pinned_buffer<float> states;            // state_elements × 2: m, then v
    pinned_buffer<std::byte> host_grads;    // the gradient shards (shard arena layout)
    pinned_buffer<std::byte> host_weights;  // the new weight shards (shard arena layout)
    pinned_buffer<double> host_sumsq;       // the step's global Σ g² and the ranks' vetoes
    pinned_buffer<float> spare;             // the spare regions, each [master | m | v]
  };
  // What the jobs of a step assume.
  struct speculation {
    bool active{false};   // jobs of this step were posted
    bool invalid{false};  // something changed the inputs after they were posted
    float lr{0.0f};       // what the jobs assume
    float factor{0.0f};
    std::int64_t t{0};
    std::size_t posted{0};
  };

  Owner* o_;
  std::unique_ptr<storage> storage_;
  std::unique_ptr<thread_pool> cpu_pool_;  // the CPU Adam's threads
  std::size_t region_elements_{0};
  unique_stream d2h_stream_;
  unique_stream h2d_stream_;
  unique_event reduced_;   // on the caller's stream after a bucket's reduction
  unique_event d2h_done_;  // the last D2H of a step
  unique_event h2d_done_;  // the last H2D of a step
  // The pipeline moves and updates a bucket's shard in chunks of options_.offload_chunk_elements
  // (a multiple of 64: the CPU Adam's vector bodies then cover the same elements as in one call).
  std::vector<unique_event> landed_;       // per chunk: its gradients are on the host
  std::vector<std::size_t> first_chunk_;   // bucket b's first chunk in landed_
  std::vector<std::size_t> chunk_bucket_;  // per chunk: its bucket and first element in the shard
  std::vector<std::size_t> chunk_first_;
  mutable speculation spec_{};  // mutable: gather_host_copies may invalidate it
  bool step_open_{false};       // a reduce_gradients of this step was made
  bool pipelined_{false};       // the last step adopted the pipeline's update
  // Per chunk: where its current master weights and moments are (its place or a spare region),
  // and what the worker wrote ahead. The worker uses it during a step (between the first
  // reduce_gradients and finish_pipeline), the caller's thread otherwise.
  mutable spare_regions spares_;
  mutable std::size_t away_{0};          // spares_.away() when the worker was last idle
  mutable std::size_t peak_regions_{0};  // spares_.peak_in_use() then
  mutable std::atomic<step_decision> decision_{step_decision::undecided};
  // The first failure of a step (its message); set, every operation on the state throws.
  mutable failure_latch failure_;
  // Statistics (stats): the worker's counts, and the caller's.
  std::atomic<std::int64_t> chunks_ahead_{0};
  std::atomic<std::int64_t> chunks_after_{0};
  std::atomic<std::int64_t> region_waits_{0};
  std::atomic<std::int64_t> wait_ns_{0};
  std::atomic<std::int64_t> cpu_ns_{0};  // wall time of cpu_update calls
  mutable std::int64_t chunks_dropped_{0};
  std::int64_t chunks_redone_{0};
  // Per step of the pipeline (its first reduce_gradients): the epoch its jobs publish.
  std::uint64_t epoch_{0};
  // Per bucket: the last H2D of its weights (h2d_stream_), and the epoch whose job recorded it.
  std::vector<unique_event> bucket_sent_;
  std::unique_ptr<std::atomic<std::uint64_t>[]> bucket_epoch_;
  // The worker's claims of the step's buckets (reset by the caller while the worker is idle).
  std::vector<std::uint8_t> claimed_;
  std::size_t claim_top_{0};
  // offload_overlap_forward: `step` adopted the update without waiting for the worker
  // (tail_worker_), and buckets [0, pending_) still need their weights brought into place.
  mutable bool tail_worker_{false};
  mutable std::size_t pending_{0};
  float next_lr_{std::numeric_limits<float>::quiet_NaN()};  // prepare_step's, else the last
  int device_{0};
  std::unique_ptr<serial_worker> worker_;  // last: stops before the buffers go
};

template <class Owner>
void host_offload<Owner>::allocate(zero_memory& m, std::size_t shard_arena, cudaStream_t) {
  Owner& o            = *o_;
  auto const& plan    = o.plan_;
  auto const& options = o.options_;
  WM_EXPECTS(o.opt_.epsilon == adam_epsilon::torch_adam,
             "zero_optimizer with offload_host: wm::adam with adam_epsilon::torch_adam (the CPU "
             "Adam's form)");
  for (auto const& b : plan.buckets) {
    WM_EXPECTS(b.type != element_type::f16,
               "zero_optimizer with offload_host: bf16 or fp32 parameters (the CPU Adam reads "
               "no fp16)");
  }
  // The pipeline's chunks (bucket by bucket) and its spare regions, each as large as the largest
  // chunk: ceil(fraction × chunks) of them.
  bool const pipeline = options.offload_pipeline;
  std::size_t chunks  = 0;
  std::size_t regions = 0;
  if (pipeline) {
    std::size_t const chunk = options.offload_chunk_elements;
    for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
      std::size_t const shard = plan.buckets[b].shard_elements;
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
      double const want = std::ceil(static_cast<double>(options.offload_spare_fraction) *
                                    static_cast<double>(chunks) * (1.0 - 1e-7));
      regions           = std::min(chunks, static_cast<std::size_t>(want));
    }
  }
  std::size_t const region_floats =
      region_elements_ * (1 + static_cast<std::size_t>(optimizer_type::states));
  // Master weights and moments live on the host (+ spares).
  m.host = m.master_weights + m.optimizer_states + regions * region_floats * sizeof(float) +
           2 * shard_arena;
  m.master_weights   = 0;
  m.optimizer_states = 0;

  auto zeroed = [](auto& buffer, std::size_t n) {
    buffer = std::remove_reference_t<decltype(buffer)>{n};
    if (n > 0) { std::memset(buffer.data(), 0, n * sizeof(*buffer.data())); }
  };
  std::size_t const n = plan.state_elements;
  storage_            = std::make_unique<storage>();
  zeroed(storage_->master, n);
  zeroed(storage_->states, n * optimizer_type::states);
  zeroed(storage_->host_grads, shard_arena);
  zeroed(storage_->host_weights, shard_arena);
  zeroed(storage_->host_sumsq, 2);
  std::fill_n(states(), n * optimizer_type::states, initial_state(o.opt_));
  cpu_pool_ = std::make_unique<thread_pool>(options.cpu_threads, options.pin_cpu_threads);
  if (pipeline) {
    zeroed(storage_->spare, regions * region_floats);  // written before read (a chunk's update)
    spares_ = spare_regions{chunks, regions};
    WM_CUDA_TRY(cudaGetDevice(&device_));
    d2h_stream_ = unique_stream::make();
    h2d_stream_ = unique_stream::make();
    reduced_    = unique_event::make();
    d2h_done_   = unique_event::make();
    h2d_done_   = unique_event::make();
    landed_.resize(chunks);
    for (auto& e : landed_) { e = unique_event::make(); }
    bucket_sent_.resize(plan.buckets.size());
    for (auto& e : bucket_sent_) { e = unique_event::make(); }
    bucket_epoch_ = std::make_unique<std::atomic<std::uint64_t>[]>(plan.buckets.size());
    claimed_.assign(plan.buckets.size(), 0);
  }
}

template <class Owner>
void host_offload<Owner>::drain(teardown& wait) const noexcept {
  wait.stream(d2h_stream_.get(), "the device-to-host copy stream");
  wait.stream(h2d_stream_.get(), "the host-to-device copy stream");
  for (cudaEvent_t e : {reduced_.get(), d2h_done_.get(), h2d_done_.get()}) {
    wait.event(e, "the last work of a step on the caller's stream");
  }
  for (auto const& e : landed_) { wait.event(e.get(), "a gradient chunk's copy to the host"); }
  for (auto const& e : bucket_sent_) {
    wait.event(e.get(), "a bucket's weights' copy to the device");
  }
}

template <class Owner>
void host_offload<Owner>::reduced(std::size_t b, cuda::stream_ref stream) {
  Owner& o               = *o_;
  auto const& bk         = o.plan_.buckets[b];
  std::size_t const size = bk.shard_elements * size_of(bk.type);
  std::byte* const grads = storage_->host_grads.data() + o.shard_bytes_offset_[b];
  if (!o.options_.offload_pipeline) {
    WM_CUDA_TRY(
        cudaMemcpyAsync(grads, o.shard_gradients(b), size, cudaMemcpyDeviceToHost, stream.get()));
    return;
  }
  // The norm partials now: the shard is the landing place of the new weights later.
  o.norm_partials(b, stream.get());
  if (!step_open_) {  // the step's first bucket: what the CPU Adam assumes for all of them
    step_open_ = true;
    spec_      = {};
    decision_.store(step_decision::undecided, std::memory_order_relaxed);  // the worker is idle
    ++epoch_;
    std::fill(claimed_.begin(), claimed_.end(), std::uint8_t{0});
    claim_top_ = claimed_.size();
    if (!o.masters_stale_ && std::isfinite(next_lr_)) {
      float const ranks = o.options_.average_gradients ? static_cast<float>(o.world_) : 1.0f;
      spec_.active      = true;
      spec_.lr          = next_lr_;
      spec_.t           = o.host_counters_->applied + 1;
      spec_.factor      = 1.0f / (o.host_scale_ * ranks);  // as step computes it, unclipped
    }
  }
  // On the copy stream: backward goes on while the gradients go to the host.
  WM_CUDA_TRY(cudaEventRecord(reduced_.get(), stream.get()));
  WM_CUDA_TRY(cudaStreamWaitEvent(d2h_stream_.get(), reduced_.get(), 0));
  std::size_t const chunk_bytes = o.options_.offload_chunk_elements * size_of(bk.type);
  std::size_t c                 = first_chunk_[b];
  for (std::size_t at = 0; at < size; at += chunk_bytes, ++c) {
    WM_CUDA_TRY(cudaMemcpyAsync(grads + at, static_cast<std::byte*>(o.shard_gradients(b)) + at,
                                std::min(chunk_bytes, size - at), cudaMemcpyDeviceToHost,
                                d2h_stream_.get()));
    WM_CUDA_TRY(cudaEventRecord(landed_[c].get(), d2h_stream_.get()));
  }
  if (spec_.active) {
    ++spec_.posted;
    serial_worker const* w = worker_.get();
    worker_->post([this, b, lr = spec_.lr, t = spec_.t, f = spec_.factor, e = epoch_, w] {
      pipeline_job(b, lr, t, f, e, *w);
    });
  }
}

template <class Owner>
zero_offload_stats host_offload<Owner>::stats() const noexcept {
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

template <class Owner>
void host_offload<Owner>::before_load(cuda::stream_ref stream) {
  complete_tail(stream);
  if (spec_.active) {
    decision_.store(step_decision::drop, std::memory_order_release);
    finish_pipeline(stream);
    end_speculation(false);
  }
  spec_      = {};
  step_open_ = false;
  gather_host_copies();
}

}  // namespace wm::detail::zero

#include <wm/detail/zero/offload/pipeline.cuh>
#include <wm/detail/zero/offload/step.cuh>
