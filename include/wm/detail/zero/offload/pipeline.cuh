// SPDX-License-Identifier: Apache-2.0
// The worker's side of the host offload engine (host_offload.cuh; wm::offload_host with
// zero_options::offload_pipeline): the job per bucket (wait for its gradients on the host, update
// each chunk ahead into a spare region or in place once the step has decided, send the weights
// back), the spare regions' bookkeeping around it, the host waits with the communicator's
// deadline, and offload_overlap_forward's weights_ready.
#pragma once

#include <wm/detail/base/deadline.hpp>
#include <wm/detail/zero/offload/host_offload.cuh>
#include <wm/detail/zero/serial_worker.hpp>
#include <wm/detail/zero/spare_regions.hpp>
#include <wm/error.hpp>

#include <cuda/stream_ref>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace wm::detail::zero {

template <class Owner>
void host_offload<Owner>::wait_event(cudaEvent_t e, char const* what,
                                     serial_worker const* worker) const {
  auto const deadline = deadline_after(o_->comm_->timeout());
  backoff wait{std::chrono::microseconds{50}};
  for (;;) {
    cudaError_t const q = cudaEventQuery(e);
    if (q == cudaSuccess) { return; }
    if (q != cudaErrorNotReady) { WM_CUDA_TRY(q); }
    if (worker != nullptr && worker->cancelled()) {
      throw comm_error{"wm: zero_optimizer: the wait for " + std::string{what} + " was cancelled"};
    }
    if (clock_type::now() >= deadline) {
      throw comm_error{"wm: zero_optimizer on rank " + std::to_string(o_->rank_) + ": waited for " +
                       what + " longer than the communicator's timeout"};
    }
    wait.pause();
  }
}

template <class Owner>
std::array<float*, 3> host_offload<Owner>::chunk_states(
    std::size_t c, spare_regions::region_index where) const noexcept {
  if (where == spare_regions::home) { return home_states(chunk_bucket_[c], chunk_first_[c]); }
  float* const r = storage_->spare.data() + static_cast<std::size_t>(where) * 3 * region_elements_;
  return {r, r + region_elements_, r + 2 * region_elements_};
}

template <class Owner>
std::size_t host_offload<Owner>::chunk_elements(std::size_t c) const noexcept {
  std::size_t const shard = o_->plan_.buckets[chunk_bucket_[c]].shard_elements;
  return std::min(o_->options_.offload_chunk_elements, shard - chunk_first_[c]);
}

template <class Owner>
void host_offload<Owner>::gather_host_copies() const try {
  settle_tail();
  if (away_ == 0) { return; }  // (a step begun only writes ahead into regions: not current yet)
  if (step_open_ && spec_.active) {
    // Mid-step: the worker may be writing the place of a chunk whose values are in a region. It
    // stops taking chunks and ends; its work is dropped and the step is redone after backward.
    decision_.store(step_decision::drop, std::memory_order_release);
    spec_.invalid = true;
    bool idle     = false;
    try {
      idle = worker_->wait_idle(deadline_after(o_->comm_->timeout()));
    } catch (...) {  // a job failed (the worker is idle): its work is dropped
      chunks_dropped_ += static_cast<std::int64_t>(spares_.pending());
      spares_.drop();
      throw;
    }
    if (!idle) {
      throw comm_error{"wm: zero_optimizer on rank " + std::to_string(o_->rank_) +
                       ": the offload pipeline's CPU Adam did not end within the communicator's "
                       "timeout"};
    }
    chunks_dropped_ += static_cast<std::int64_t>(spares_.pending());
    spares_.drop();
  }
  for (std::size_t c = 0; c < spares_.chunks(); ++c) {
    auto const from = spares_.current(c);
    if (from == spare_regions::home) { continue; }
    auto const src      = chunk_states(c, from);
    auto const dst      = chunk_states(c, spare_regions::home);
    std::size_t const n = chunk_elements(c);
    for (std::size_t k = 0; k < 3; ++k) { std::memcpy(dst[k], src[k], n * sizeof(float)); }
    (void)spares_.settle(c);
  }
  away_ = 0;
} catch (...) {  // the step's chunks are neither dropped nor in place for sure: unusable
  fail();
  throw;
}

template <class Owner>
void host_offload<Owner>::wait_decision(serial_worker const& worker) {
  region_waits_.fetch_add(1, std::memory_order_relaxed);
  auto const start    = std::chrono::steady_clock::now();
  auto const deadline = deadline_after(o_->comm_->timeout());
  backoff wait{std::chrono::microseconds{50}};
  // step always publishes the decision once it has the norm (and load, master_shard and the
  // destructor stop the worker first).
  while (decision_.load(std::memory_order_acquire) == step_decision::undecided) {
    if (worker.cancelled()) {
      throw comm_error{"wm: zero_optimizer: the wait for the step's decision was cancelled"};
    }
    if (clock_type::now() >= deadline) {
      throw comm_error{"wm: zero_optimizer on rank " + std::to_string(o_->rank_) +
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

template <class Owner>
void host_offload<Owner>::end_speculation(bool adopt) const {
  if (adopt) {
    spares_.commit();
  } else {
    chunks_dropped_ += static_cast<std::int64_t>(spares_.pending());
    spares_.drop();
  }
  sync_spares();
}

template <class Owner>
std::size_t host_offload<Owner>::claim_bucket(std::size_t b) {
  // Before the decision the jobs take their buckets as backward reduced them (0, 1, ...); once
  // the step applies as assumed, the buckets left in forward order (the highest first), the order
  // in which the next forward needs their weights. Each of the step's jobs claims one bucket.
  if (decision_.load(std::memory_order_acquire) == step_decision::apply) {
    while (claim_top_ > 0 && claimed_[claim_top_ - 1] != 0) { --claim_top_; }
    if (claim_top_ > 0) { b = claim_top_ - 1; }
  }
  claimed_[b] = 1;
  return b;
}

template <class Owner>
void host_offload<Owner>::pipeline_job(std::size_t posted, float lr, std::int64_t t, float factor,
                                       std::uint64_t epoch, serial_worker const& worker) {
  Owner& o = *o_;
  WM_CUDA_TRY(cudaSetDevice(device_));
  std::size_t const b     = claim_bucket(posted);
  auto const& bk          = o.plan_.buckets[b];
  std::size_t const esize = size_of(bk.type);
  std::size_t c           = first_chunk_[b];
  std::size_t const chunk = o.options_.offload_chunk_elements;
  for (std::size_t first = 0; first < bk.shard_elements; first += chunk, ++c) {
    std::size_t const count = std::min(chunk, bk.shard_elements - first);
    // Dropped (or the optimizer failed), or the worker is being destroyed: stop at this chunk
    // boundary rather than finish the bucket, whose update no one will take.
    if (decision_.load(std::memory_order_acquire) == step_decision::drop || worker.cancelled()) {
      return;
    }
    wait_event(landed_[c].get(), "a bucket's gradients on the host", &worker);
    // Not decided yet: into a spare region (or from one back to the chunk's place), which the
    // step adopts or drops; no region free: wait for the decision. Decided: in place (the step
    // applies as assumed), or not at all (dropped).
    step_decision decision = decision_.load(std::memory_order_acquire);
    if (decision == step_decision::undecided) {
      if (auto const to = spares_.ahead(c)) {
        cpu_update(b, first, count, lr, t, factor, chunk_states(c, spares_.current(c)),
                   chunk_states(c, *to));
        chunks_ahead_.fetch_add(1, std::memory_order_relaxed);
      } else {
        wait_decision(worker);
        decision = decision_.load(std::memory_order_acquire);
      }
    }
    if (decision == step_decision::drop) { return; }
    if (decision == step_decision::apply) {
      auto const from = spares_.settle(c);
      cpu_update(b, first, count, lr, t, factor, chunk_states(c, from),
                 chunk_states(c, spare_regions::home));
      chunks_after_.fetch_add(1, std::memory_order_relaxed);
    }
    // Into the bucket's device gradient shard (these gradients are on the host now): the
    // compute weights stay as they are until step adopts the update.
    WM_CUDA_TRY(
        cudaMemcpyAsync(static_cast<std::byte*>(o.shard_gradients(b)) + first * esize,
                        storage_->host_weights.data() + o.shard_bytes_offset_[b] + first * esize,
                        count * esize, cudaMemcpyHostToDevice, h2d_stream_.get()));
  }
  // The bucket's weights are on their way (weights_ready waits for the event once it sees the
  // epoch).
  WM_CUDA_TRY(cudaEventRecord(bucket_sent_[b].get(), h2d_stream_.get()));
  bucket_epoch_[b].store(epoch, std::memory_order_release);
}

template <class Owner>
void host_offload<Owner>::settle_tail() const try {
  if (!tail_worker_) { return; }
  bool idle = false;
  try {
    idle = worker_->wait_idle(deadline_after(o_->comm_->timeout()));
  } catch (...) {  // a job failed: the step is incomplete, its weights are not coming
    tail_worker_ = false;
    pending_     = 0;
    end_speculation(false);
    throw;
  }
  if (!idle) {
    throw comm_error{"wm: zero_optimizer on rank " + std::to_string(o_->rank_) +
                     ": the offload pipeline's CPU Adam did not end within the communicator's "
                     "timeout"};
  }
  tail_worker_ = false;
  end_speculation(true);  // the step applied: what was computed ahead is current
} catch (...) {           // the step that `step` adopted did not end: its update is incomplete
  fail();
  throw;
}

template <class Owner>
void host_offload<Owner>::adopt_bucket(std::size_t b, cuda::stream_ref stream) {
  Owner& o       = *o_;
  auto const& bk = o.plan_.buckets[b];
  if constexpr (Owner::stage < 3) {
    with_element_type(bk.type, [&](auto tag) {
      using T = decltype(tag);
      o.comm_->all_gather(static_cast<T const*>(o.shard_gradients(b)),
                          reinterpret_cast<T*>(o.weights_ + bk.byte_offset), bk.shard_elements,
                          stream);
    });
  } else {
    WM_CUDA_TRY(cudaMemcpyAsync(o.shard_weights(b), o.shard_gradients(b),
                                bk.shard_elements * size_of(bk.type), cudaMemcpyDeviceToDevice,
                                stream.get()));
  }
}

template <class Owner>
void host_offload<Owner>::weights_ready(std::size_t b, cuda::stream_ref stream) try {
  auto const deadline = deadline_after(o_->comm_->timeout());
  while (pending_ > b) {  // the buckets above b first: every rank all-gathers in that order
    std::size_t const x = pending_ - 1;
    // A bucket takes the CPU milliseconds: naps of 0.1 ms keep this thread off its cores.
    backoff wait{std::chrono::microseconds{100}};
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
        idle = worker_->wait_idle(clock_type::now());  // rethrows a job's failure
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
      if (clock_type::now() >= deadline) {
        throw comm_error{"wm: zero_optimizer on rank " + std::to_string(o_->rank_) +
                         ": weights_ready waited for the CPU Adam of bucket " + std::to_string(x) +
                         " longer than the communicator's timeout"};
      }
      wait.pause();
    }
    WM_CUDA_TRY(cudaStreamWaitEvent(stream.get(), bucket_sent_[x].get(), 0));
    adopt_bucket(x, stream);
    pending_ = x;
  }
  if (pending_ == 0) { settle_tail(); }
} catch (...) {  // the buckets left will not come: the step that `step` adopted is incomplete
  fail();
  throw;
}

template <class Owner>
void host_offload<Owner>::finish_pipeline(cuda::stream_ref stream) try {
  bool idle = false;
  try {
    idle = worker_->wait_idle(deadline_after(o_->comm_->timeout()));
  } catch (...) {  // a job failed (the worker is idle): what it did ahead is not the step's
    end_speculation(false);
    throw;
  }
  if (!idle) {
    throw comm_error{"wm: zero_optimizer::step on rank " + std::to_string(o_->rank_) +
                     ": the offload pipeline's CPU Adam did not end within the communicator's "
                     "timeout"};
  }
  // Every H2D of the step is enqueued: the caller's stream waits for them.
  WM_CUDA_TRY(cudaEventRecord(h2d_done_.get(), h2d_stream_.get()));
  WM_CUDA_TRY(cudaStreamWaitEvent(stream.get(), h2d_done_.get(), 0));
} catch (...) {  // a job failed, or the worker goes on past the deadline (it stops: fail)
  fail();
  throw;
}

}  // namespace wm::detail::zero
