// SPDX-License-Identifier: Apache-2.0
// The device pool of a swap_core: blocks handed over stream-ordered, the waits that go with them
// (consumer streams on events, user threads on the workers or, as the last resort, on the GPU)
// and the event pool. Every function here runs with the core's mutex held.
#pragma once

#include <wm/detail/swap/swap_core.cuh>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>

namespace wm::detail {

// The block at @p off can hold @p bytes without wasting more than half of it.
inline bool swap_core::fits(std::size_t off, std::size_t bytes) const noexcept {
  std::size_t const size = dev_alloc_.round(bytes);
  std::size_t const have = dev_alloc_.size_of(off);
  return have >= size && have <= 2 * size;
}

// A block for @p bytes, usable on @p stream in stream order from now on, or npos. In this order:
// free room; a block given back by a released buffer (@p stream waits for its release event, the
// one released on @p stream itself first); the block of the oldest page-out whose copy is
// enqueued (@p stream waits for that copy). @p consumer: @p stream is a user stream, whose waits
// on other streams are timed and counted as consumer waits (else it is a copy stream).
inline std::size_t swap_core::take_block(std::size_t bytes, cudaStream_t stream, bool consumer) {
  reclaim();
  std::size_t off = dev_alloc_.allocate(bytes);
  if (off != npos) { return off; }
  auto best = pending_frees_.end();
  for (auto it = pending_frees_.begin(); it != pending_frees_.end(); ++it) {
    if (!fits(it->off, bytes)) { continue; }
    if (best == pending_frees_.end() || (it->stream == stream && best->stream != stream)) {
      best = it;
    }
  }
  if (best != pending_frees_.end()) {
    if (consumer && best->stream != stream) {
      consumer_wait(stream, best->ev);
    } else {
      WM_CUDA_TRY(cudaStreamWaitEvent(stream, best->ev, 0));
    }
    off = best->off;
    give_event(best->ev, false);  // the wait is enqueued: the event may be recorded again
    pending_frees_.erase(best);
    ++stats_.blocks_reused;
    return off;
  }
  record* oldest = nullptr;
  for (auto& [id, r] : records_) {
    if (r.st == state::out_issued && r.dev != npos && !r.cancel_free && !r.destroyed && !r.kept &&
        fits(r.dev, bytes) && (oldest == nullptr || r.out_seq < oldest->out_seq)) {
      oldest = &r;
    }
  }
  if (oldest == nullptr) { return npos; }
  if (consumer) {
    consumer_wait(stream, oldest->copy);
  } else {
    WM_CUDA_TRY(cudaStreamWaitEvent(stream, oldest->copy, 0));
  }
  if (oldest->reader != nullptr) {  // after pageout_begin: the readers' work too (not a transfer)
    WM_CUDA_TRY(cudaStreamWaitEvent(stream, oldest->reader, 0));
    give_event(oldest->reader, false);
    oldest->reader = nullptr;
  }
  off         = oldest->dev;
  oldest->dev = npos;  // its page-out completes without it; a page-in of it takes another block
  ++stats_.blocks_reused;
  return off;
}

// A host slab range for a page-out of @p bytes that the page-out copy stream @p stream may write
// in stream order, or npos: that of a destroyed buffer whose page-in copy still reads it (@p
// stream waits for that copy), or whose own page-out copy still writes it (issued earlier on
// @p stream, the page-out stream: it lands first). Without it, a host that runs a step ahead of
// the GPU finds the slab full of the previous step's page-ins (or, with pageout_from, page-outs)
// and must wait for them on the GPU.
inline std::size_t swap_core::take_host_range(std::size_t bytes, cudaStream_t stream) {
  std::size_t const size = host_alloc_.round(bytes);
  for (auto& [id, r] : records_) {
    bool const reading = r.st == state::in_issued && r.copy != nullptr;
    bool const writing = r.st == state::out_issued && stream == out_stream_;
    if (!r.destroyed || r.host == npos || !(reading || writing)) { continue; }
    std::size_t const have = host_alloc_.size_of(r.host);
    if (have < size || have > 2 * size) { continue; }
    if (r.copy != nullptr) { WM_CUDA_TRY(cudaStreamWaitEvent(stream, r.copy, 0)); }
    if (r.slab_read != nullptr) { WM_CUDA_TRY(cudaStreamWaitEvent(stream, r.slab_read, 0)); }
    std::size_t const off = r.host;
    r.host                = npos;  // its copy completes without it
    ++stats_.slab_ranges_reused;
    return off;
  }
  return npos;
}

// Gives back the block that submit() took for a page-in of @p r whose copy was not issued (a
// CUDA call failed): a pending block after the work queued so far on @p stream, the copy stream,
// which already waits for the block's previous user; free at once after a host wait if no event
// can be recorded there. Without it the block would stay with a buffer that never got it.
inline void swap_core::return_block(record& r, cudaStream_t stream) noexcept {
  if (r.dev == npos) { return; }
  try {
    cudaEvent_t const ev = take_event(false);
    if (cudaEventRecord(ev, stream) == cudaSuccess) {
      pending_frees_.push_back(pending_free{ev, r.dev, stream});
    } else {
      give_event(ev, false);
      (void)cudaStreamSynchronize(stream);
      dev_alloc_.free(r.dev);
    }
  } catch (...) {
    (void)cudaStreamSynchronize(stream);
    try {
      dev_alloc_.free(r.dev);
    } catch (...) {}
  }
  r.dev = npos;
  try {
    notify_room();
  } catch (...) {}
}

// The host slab has no room for @p bytes and none comes without a release: every range in use
// belongs to a live buffer (a destroyed buffer's range comes free when its copy completes, or is
// taken over by take_host_range). The slab never waits on the GPU for room then, only on the
// user.
inline bool swap_core::slab_stuck(std::size_t bytes) const {
  if (host_alloc_.largest_free() >= host_alloc_.round(bytes)) { return false; }
  return std::none_of(records_.begin(), records_.end(),
                      [](auto const& kv) { return kv.second.destroyed && kv.second.host != npos; });
}

// "the host slab (full: ...)", for messages about a page-out of @p bytes that finds no room.
inline std::string swap_core::slab_full_text(std::size_t bytes) const {
  return "room in the host slab (full: " + std::to_string(bytes) + " bytes asked for, " +
         std::to_string(host_alloc_.in_use()) + " of " + std::to_string(host_alloc_.capacity()) +
         " bytes in use, the largest free range " + std::to_string(host_alloc_.largest_free()) +
         " bytes)";
}

// A page-out still queued that would free a block for @p bytes goes to the front of the page-out
// queue (its worker issues it next, past the in-flight limit): then take_block can take its block.
// Returns its id, or 0 if there is none.
inline std::uint64_t swap_core::promote_pageout(std::size_t bytes) {
  std::uint64_t best = 0;
  record const* br   = nullptr;
  for (auto const& [id, r] : records_) {
    if (r.st == state::out_queued && r.dev != npos && !r.destroyed && !r.kept &&
        fits(r.dev, bytes) && (br == nullptr || r.out_seq < br->out_seq)) {
      best = id;
      br   = &r;
    }
  }
  if (best != 0) { (void)out_q_->promote(best); }  // false: its worker is issuing it already
  return best;
}

// Device memory for a new buffer used first on @p stream. Stream-ordered when it can be
// (take_block), after the worker has issued a promoted page-out if that is what frees a block (a
// wait on the worker, not on the GPU); else the host polls until page-outs or released buffers
// have finished (a host-blocking sync, counted).
inline std::size_t swap_core::allocate_device(std::size_t bytes, std::unique_lock<std::mutex>& lock,
                                              cudaStream_t stream) {
  // Larger than the whole pool (2^64 - 11 bytes included: round() does not wrap): no page-out
  // or release can make room, so it fails now rather than at the deadline.
  WM_EXPECTS(dev_alloc_.round(bytes) <= dev_alloc_.capacity(),
             "swap_scope::allocate: a buffer of " + std::to_string(bytes) +
                 " bytes cannot fit a device pool of " + std::to_string(dev_alloc_.capacity()) +
                 " bytes");
  auto const t0        = clock::now();
  auto const deadline  = deadline_from(t0);
  bool waited          = false;
  auto cause           = wait_cause::worker;
  std::size_t slab_for = 0;  // cause slab: the bytes of the page-out that waits for the slab
  while (true) {
    std::size_t const off = take_block(bytes, stream, true);
    if (off != npos) {
      if (waited) { count_wait(cause, t0); }
      return off;
    }
    std::uint64_t const promoted = promote_pageout(bytes);
    if (promoted == 0) {
      bool const outs = std::any_of(records_.begin(), records_.end(), [](auto const& kv) {
        record const& r = kv.second;
        return r.dev != npos && !r.kept && (r.st == state::out_queued || r.st == state::out_issued);
      });
      WM_EXPECTS(outs || !pending_frees_.empty(),
                 "swap_scope: the device budget is exhausted: " + std::to_string(bytes) +
                     " bytes asked for, " + std::to_string(dev_alloc_.in_use()) + " of " +
                     std::to_string(dev_alloc_.capacity()) +
                     " in use by buffers that are not being paged out");
      cause = wait_cause::pool;  // no block can change hands now: copies or releases must finish
    } else {
      records_.at(promoted).deferred = false;  // set if its worker finds no room in the slab
    }
    if (auto const failure = copier_failure()) {  // the page-out it waits for may never go
      if (waited) { count_wait(cause, t0); }
      std::rethrow_exception(failure);
    }
    if (clock::now() >= deadline) {
      count_wait(cause, t0);
      if (cause == wait_cause::slab) {
        throw_timeout("room in the device pool: the page-out that would free a block waits for " +
                      slab_full_text(slab_for));
      }
      throw_timeout("room in the device pool");
    }
    waited = true;
    // Polls (reclaim() in take_block) rather than blocking in cudaEventSynchronize, so that the
    // deadline holds; a promoted page-out wakes it when issued.
    cv_.wait_until(lock, std::min(deadline, clock::now() + std::chrono::microseconds{200}));
    if (promoted != 0) {
      auto const it = records_.find(promoted);
      if (it != records_.end() && it->second.deferred) {
        cause    = wait_cause::slab;
        slab_for = it->second.bytes;
      }
    }
  }
}

// A passive page-in was queued: wait until the worker has issued it (a wait on the worker; on the
// GPU too if it was deferred meanwhile for lack of room), then @p stream waits for its copy.
inline void swap_core::wait_issued(record& r, cudaStream_t stream,
                                   std::unique_lock<std::mutex>& lock) {
  r.deferred          = false;
  auto const t0       = clock::now();
  auto const deadline = deadline_from(t0);
  std::exception_ptr failure;
  while (r.st == state::in_queued && !(failure = copier_failure()) && clock::now() < deadline) {
    cv_.wait_until(lock, std::min(deadline, clock::now() + failure_poll));
  }
  bool const deferred = r.deferred;
  count_wait(deferred ? wait_cause::pool : wait_cause::worker, t0);
  r.deferred = false;
  if (failure) { std::rethrow_exception(failure); }
  if (r.st == state::in_queued) {
    throw_timeout(deferred ? "a page-in to be issued (deferred: no room in the device pool)"
                           : "a page-in to be issued");
  }
  used(r);
  if (r.st == state::in_issued) { consumer_wait(stream, r.copy); }
}

// A user thread waited since @p t0: only on a worker thread, or on the GPU (a host-blocking sync:
// for room in the pool or the slab, or to drain a queue).
inline void swap_core::count_wait(wait_cause cause, clock::time_point t0) {
  double const s = std::chrono::duration<double>(clock::now() - t0).count();
  if (cause == wait_cause::worker) {
    ++stats_.worker_waits;
    stats_.worker_wait_seconds += s;
    return;
  }
  ++stats_.host_blocking_syncs;
  stats_.host_wait_seconds += s;
  if (cause == wait_cause::pool) { ++stats_.host_syncs_pool; }
  if (cause == wait_cause::slab) { ++stats_.host_syncs_slab; }
}

// @p stream waits for @p ev; the time it waited is measured by two events around the wait.
inline void swap_core::consumer_wait(cudaStream_t stream, cudaEvent_t ev) {
  if (ev == nullptr) { return; }
  cudaEvent_t const a = take_event(true);
  cudaEvent_t const b = take_event(true);
  WM_CUDA_TRY(cudaEventRecord(a, stream));
  WM_CUDA_TRY(cudaStreamWaitEvent(stream, ev, 0));
  WM_CUDA_TRY(cudaEventRecord(b, stream));
  waits_.emplace_back(a, b);
  ++stats_.consumer_waits;
}

inline void swap_core::collect_waits() {
  for (auto it = waits_.begin(); it != waits_.end();) {
    if (cudaEventQuery(it->second) == cudaErrorNotReady) {
      ++it;
      continue;
    }
    float ms = 0;
    if (cudaEventElapsedTime(&ms, it->first, it->second) == cudaSuccess) {
      stats_.consumer_wait_seconds += ms * 1e-3;
    }
    give_event(it->first, true);
    give_event(it->second, true);
    it = waits_.erase(it);
  }
  collect_pageins_to();
}

// pagein_to copies that have completed: their time is counted, the buffer (if this is still its
// last such copy) forgets the event, and the events go back to the pool.
inline void swap_core::collect_pageins_to() {
  for (auto it = ext_ins_.begin(); it != ext_ins_.end();) {
    if (cudaEventQuery(it->end) == cudaErrorNotReady) {
      ++it;
      continue;
    }
    float ms = 0;
    if (it->link && cudaEventElapsedTime(&ms, it->start, it->end) == cudaSuccess) {
      stats_.seconds_in += ms * 1e-3;
    }
    auto const r = records_.find(it->id);
    if (r != records_.end() && r->second.ext_in == it->end) { r->second.ext_in = nullptr; }
    if (r != records_.end() && r->second.slab_read == it->end) { r->second.slab_read = nullptr; }
    give_event(it->start, true);
    give_event(it->end, true);
    it = ext_ins_.erase(it);
  }
}

// Page-ins into the pool need a block: a buffer larger than the pool would wait forever.
inline void swap_core::expect_fits_pool(record const& r, char const* what) const {
  WM_EXPECTS(dev_alloc_.round(r.bytes) <= dev_alloc_.capacity(),
             std::string{what} + ": a buffer of " + std::to_string(r.bytes) +
                 " bytes cannot be paged into a device pool of " +
                 std::to_string(dev_alloc_.capacity()) + " bytes (use pagein_to)");
}

// Device memory of a dropped buffer: free now, or a pending block after its release event.
inline void swap_core::free_device(record& r) {
  if (r.dev == npos) { return; }
  if (r.release != nullptr) {
    pending_frees_.push_back(pending_free{r.release, r.dev, r.last});
    r.release = nullptr;
  } else {
    dev_alloc_.free(r.dev);
  }
  r.dev = npos;
  notify_room();
}

// The slab range of @p r is free for the next page-out: the page-out copy stream (the only
// writer of the slab) first waits for a pagein_to copy that may still read it.
inline void swap_core::free_host(record& r) {
  if (r.host != npos) {
    if (r.slab_read != nullptr) { WM_CUDA_TRY(cudaStreamWaitEvent(out_stream_, r.slab_read, 0)); }
    host_alloc_.free(r.host);
    r.host = npos;
  }
}

// Returns pool memory whose release events have completed (so that neighbours join).
inline void swap_core::reclaim() {
  for (auto it = pending_frees_.begin(); it != pending_frees_.end();) {
    if (cudaEventQuery(it->ev) == cudaErrorNotReady) {
      ++it;
      continue;
    }
    dev_alloc_.free(it->off);
    give_event(it->ev, false);
    it = pending_frees_.erase(it);
  }
}

// A block may change hands now: wake user threads and the page-in worker (deferred page-ins).
inline void swap_core::notify_room() {
  cv_.notify_all();
  if (in_q_) { in_q_->notify(); }
}

inline cudaEvent_t swap_core::create_event(bool timing) {
  cudaEvent_t ev = nullptr;
  WM_CUDA_TRY(cudaEventCreateWithFlags(&ev, timing ? cudaEventDefault : cudaEventDisableTiming));
  all_events_.push_back(ev);
  ++events_created_;
  return ev;
}

inline cudaEvent_t swap_core::take_event(bool timing) {
  auto& free = timing ? timing_free_ : sync_free_;
  if (free.empty()) { return create_event(timing); }
  cudaEvent_t const ev = free.back();
  free.pop_back();
  return ev;
}

}  // namespace wm::detail
