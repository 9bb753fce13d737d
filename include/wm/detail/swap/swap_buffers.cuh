// SPDX-License-Identifier: Apache-2.0
// What wm::swappable and wm::swap_scope call on a swap_core, on user threads: allocate, data,
// pageout, need_prefetch, pins, release, the scope operations and the statistics.
#pragma once

#include <wm/detail/swap/swap_blocks.cuh>
#include <wm/detail/swap/swap_core.cuh>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <string>
#include <utility>

namespace wm::detail {

inline std::uint64_t swap_core::allocate(std::size_t bytes, cudaStream_t stream) {
  std::unique_lock lock{mutex_};
  std::size_t const dev  = allocate_device(bytes, lock, stream);
  std::uint64_t const id = next_id_++;
  record& r              = records_[id];
  r.bytes                = bytes;
  r.dev                  = dev;
  r.last                 = stream;
  return id;
}

// Queues a passive page-in of @p r at the front of the page-in queue and waits until the worker
// has issued it; @p stream waits for its copy. @p r is in `host` or `out_issued` without a block.
inline void swap_core::page_in_front(std::uint64_t id, record& r, cudaStream_t stream,
                                     std::unique_lock<std::mutex>& lock) {
  expect_fits_pool(r, "swappable::data");
  state const before = r.st;
  if (before == state::out_issued) { r.after = r.copy; }  // its block went to another buffer
  r.st              = state::in_queued;
  bool const queued = in_q_->enqueue_front(transfer_task{id, r.bytes});
  if (!queued) {
    r.st    = before;
    r.after = nullptr;
  }
  WM_EXPECTS(queued, "swappable::data: the page-in queue is locked (wait_prefetches in progress)");
  wait_issued(r, stream, lock);
}

inline void* swap_core::data(std::uint64_t id, cudaStream_t stream, bool pin) {
  std::unique_lock lock{mutex_};
  record& r = at(id);
  r.last    = stream;
  used(r);
  if (r.kept) {
    if (!pin) { return pool_ + r.dev; }  // read while its copy is made: nothing to wait for
    drop_kept(r);                        // pinned: the page-out is cancelled below
  }
  switch (r.st) {
    case state::resident: break;
    case state::out_queued: cancel_queued_pageout(id, r); break;
    case state::out_issued:
      if (r.dev == npos) {  // its block went to another buffer: page in after the page-out
        page_in_front(id, r, stream, lock);
        break;
      }
      r.cancel_free = true;  // a page-in of it waits for its page-out first: the stream does
      drop_kept(r);
      if (r.producer != nullptr) {  // a page-out asked for again is off: it is in use again
        give_event(r.producer, false);
        r.producer = nullptr;
      }
      consumer_wait(stream, r.copy);
      ++stats_.pageouts_cancelled;
      break;
    case state::host: page_in_front(id, r, stream, lock); break;
    case state::in_queued:
      if (in_q_->erase(id)) {  // a queued prefetch goes first now
        WM_EXPECTS(in_q_->enqueue_front(transfer_task{id, r.bytes}),
                   "swappable::data: the page-in queue is locked (wait_prefetches in progress)");
      }
      wait_issued(r, stream, lock);
      break;
    case state::in_issued: consumer_wait(stream, r.copy); break;
  }
  // Resident with a copy in flight: a page-in whose page-out (asked for meanwhile, queued) was
  // cancelled above or by need_prefetch(): the stream waits for the page-in too.
  if (r.st == state::resident && r.copy != nullptr) { consumer_wait(stream, r.copy); }
  if (pin) { ++r.pins; }
  return pool_ + r.dev;
}

inline bool swap_core::pageout(std::uint64_t id, cudaStream_t stream, bool keep) {
  std::unique_lock lock{mutex_};
  record& r = at(id);
  r.last    = stream;
  if (r.pins > 0) { return false; }
  if (r.kept) {
    if (keep) { return false; }  // begun already
    if (finish_kept_pageout(r, stream)) { return true; }
  }
  used(r);
  switch (r.st) {
    case state::in_issued:
    case state::resident: {
      // pageout_begin: data() then gives the block to any stream without a wait, which is
      // wrong while a page-in still writes it (once the page-out is issued, r.copy is its copy).
      if (keep && r.copy != nullptr) { return false; }
      // The page-out copies what came in: after a page-in in flight (in_issued, or resident
      // after a cancelled page-out of it).
      if (r.copy != nullptr) { WM_CUDA_TRY(cudaStreamWaitEvent(stream, r.copy, 0)); }
      cudaEvent_t ev = take_event(false);
      WM_CUDA_TRY(cudaEventRecord(ev, stream));
      state const before = r.st;
      r.producer         = ev;
      r.st               = state::out_queued;
      r.out_seq          = ++out_seq_;
      r.kept             = keep;
      r.clean            = false;
      if (!out_q_->enqueue(transfer_task{id, r.bytes})) {
        r.st       = before;
        r.producer = nullptr;
        r.kept     = false;
        give_event(ev, false);
        return false;
      }
      in_q_->notify();  // a page-in waiting for room may promote this page-out
      return true;
    }
    case state::out_issued:
      if (keep) { return false; }
      if (r.cancel_free && r.producer == nullptr) {  // written again since: copy it again after
        cudaEvent_t ev = take_event(false);
        WM_CUDA_TRY(cudaEventRecord(ev, stream));
        r.producer = ev;
        return true;
      }
      return false;
    case state::in_queued:
      in_q_->erase(id);  // if the worker holds it already, it drops it: the state says host
      r.st = state::host;
      return false;
    case state::out_queued:
    case state::host: return false;
  }
  return false;
}

inline void swap_core::need_prefetch(std::uint64_t id) {
  std::unique_lock lock{mutex_};
  record& r = at(id);
  if (r.st == state::host || (r.st == state::out_issued && r.dev == npos)) {
    expect_fits_pool(r, "swappable::need_prefetch");
  }
  switch (r.st) {
    case state::host:
      r.st = state::in_queued;
      if (!in_q_->enqueue(transfer_task{id, r.bytes})) { r.st = state::host; }
      break;
    case state::out_queued: cancel_queued_pageout(id, r); break;
    case state::out_issued:
      if (r.dev == npos) {  // its block went to another buffer: page in after the page-out
        r.after = r.copy;
        r.st    = state::in_queued;
        if (!in_q_->enqueue(transfer_task{id, r.bytes})) {
          r.st    = state::out_issued;
          r.after = nullptr;
        }
        break;
      }
      if (!r.cancel_free) { ++stats_.pageouts_cancelled; }
      r.cancel_free = true;
      drop_kept(r);
      break;
    case state::resident: drop_kept(r); break;
    default: break;
  }
}

inline void swap_core::unpin(std::uint64_t id) {
  std::lock_guard lock{mutex_};
  record& r = at(id);
  WM_EXPECTS(r.pins > 0, "swappable::unpin: the buffer is not pinned");
  --r.pins;
}

inline bool swap_core::resident(std::uint64_t id) const {
  std::lock_guard lock{mutex_};
  record const& r = records_.at(id);
  return r.st == state::resident || r.st == state::in_issued || r.kept ||
         (r.st == state::out_issued && r.cancel_free && r.producer == nullptr);
}

inline int swap_core::pins(std::uint64_t id) const {
  std::lock_guard lock{mutex_};
  return records_.at(id).pins;
}

// The owner is gone: the device memory becomes a pending block, free after the last stream's
// work (the next user's stream waits for that); the host slot goes after the copies in flight.
inline void swap_core::release(std::uint64_t id) noexcept {
  try {
    std::unique_lock lock{mutex_};
    auto const it = records_.find(id);
    if (it == records_.end()) { return; }
    record& r   = it->second;
    r.destroyed = true;
    used(r);
    drop_kept(r);  // the release event below comes after the readers' work on r.last
    // A page-in still running (in_issued, or resident after a cancelled page-out): the block
    // goes after it. r.last may be the legacy stream 0: still a stream.
    if (r.copy != nullptr && (r.st == state::in_issued || r.st == state::resident)) {
      WM_CUDA_TRY(cudaStreamWaitEvent(r.last, r.copy, 0));
    }
    if (r.dev != npos) {
      r.release = take_event(false);
      WM_CUDA_TRY(cudaEventRecord(r.release, r.last));
    }
    switch (r.st) {
      case state::out_queued: out_q_->erase(id); [[fallthrough]];
      case state::resident:
        if (r.producer != nullptr) { give_event(r.producer, false); }
        free_device(r);
        free_host(r);
        records_.erase(it);
        break;
      case state::in_queued: in_q_->erase(id); [[fallthrough]];
      case state::host:
        free_host(r);
        records_.erase(it);
        break;
      case state::in_issued: free_device(r); break;  // host slot: when the copy is done
      case state::out_issued: break;                 // both: when the copy is done
    }
    notify_room();
  } catch (...) {
    // Destructors never throw; a CUDA error here resurfaces on the next call that checks.
  }
}

// A buffer whose page-out copies @p src (caller memory): queued at the front of the page-out
// queue (its worker issues it next, past the in-flight limit) after the work queued so far on
// @p stream; returns once the copy is issued, so that the caller's allocator can be told to keep
// @p src until the copy stream has passed it.
inline std::uint64_t swap_core::pageout_from(void const* src, std::size_t bytes,
                                             cudaStream_t stream) {
  WM_EXPECTS(host_alloc_.round(bytes) <= host_alloc_.capacity(),
             "swap_scope::pageout_from: " + std::to_string(bytes) +
                 " bytes cannot fit a host slab of " + std::to_string(host_alloc_.capacity()));
  std::unique_lock lock{mutex_};
  collect_pageins_to();
  std::uint64_t const id = next_id_++;
  record& r              = records_[id];
  r.bytes                = bytes;
  r.ext                  = static_cast<std::byte const*>(src);
  r.last                 = stream;
  r.st                   = state::out_queued;
  r.out_seq              = ++out_seq_;
  auto const drop        = [&] {
    out_q_->erase(id);  // a worker holding it finds no record and drops it
    if (r.producer != nullptr) { give_event(r.producer, false); }
    records_.erase(id);
  };
  try {
    r.producer = take_event(false);
    WM_CUDA_TRY(cudaEventRecord(r.producer, stream));
    WM_EXPECTS(
        out_q_->enqueue_front(transfer_task{id, bytes}),
        "swap_scope::pageout_from: the page-out queue is locked (wait_pageouts in progress)");
  } catch (...) {
    drop();
    throw;
  }
  // Wait for the worker to issue it (on the GPU too if the slab is full until copies finish).
  // If the worker defers it and the slab has no room that copies in flight would free (every
  // range belongs to a live buffer: only a release makes room), it fails at once.
  r.deferred          = false;
  auto const t0       = clock::now();
  auto const deadline = deadline_from(t0);
  std::exception_ptr failure;
  bool stuck = false;
  while (r.st == state::out_queued && !(failure = copier_failure()) &&
         !(stuck = r.deferred && slab_stuck(bytes)) && clock::now() < deadline) {
    cv_.wait_until(lock, std::min(deadline, clock::now() + failure_poll));
  }
  bool const deferred = r.deferred;
  count_wait(deferred ? wait_cause::slab : wait_cause::worker, t0);
  r.deferred = false;
  if (r.st == state::out_queued) {
    std::string const slab = slab_full_text(bytes);
    drop();
    if (failure) { std::rethrow_exception(failure); }
    WM_EXPECTS(!stuck, "swap_scope::pageout_from: no " + slab +
                           " and none comes until buffers are released");
    throw_timeout(deferred ? slab : std::string{"a page-out from caller memory to be issued"});
  }
  ++stats_.pageouts_from;
  return id;
}

// Copies the data into caller memory on the page-in copy stream (from the slab) or, if the pool
// holds it, on @p stream (a device copy after data()). The buffer's state does not change.
inline void swap_core::pagein_to(std::uint64_t id, void* dst, cudaStream_t stream) {
  std::unique_lock lock{mutex_};
  record& r = at(id);
  collect_pageins_to();
  // The slab holds the data: paged out, on its way in, or on its way out (not wanted back).
  bool const slab = r.st == state::host || r.st == state::in_queued || r.st == state::in_issued ||
                    (r.st == state::out_issued && !r.cancel_free);
  if (!slab) {
    lock.unlock();
    void const* const p = data(id, stream, false);  // resident (a queued page-out is cancelled)
    lock.lock();
    // A device copy on @p stream, which wait_pagein() makes other streams wait for (not counted
    // as a page-in: nothing crossed the link).
    copy_to c{id, take_event(true), take_event(true), false};
    WM_CUDA_TRY(cudaEventRecord(c.start, stream));
    if (r.bytes != 0) {
      WM_CUDA_TRY(cudaMemcpyAsync(dst, p, r.bytes, cudaMemcpyDeviceToDevice, stream));
    }
    WM_CUDA_TRY(cudaEventRecord(c.end, stream));
    r.ext_in = c.end;
    ext_ins_.push_back(c);
    return;
  }
  cudaEvent_t const after = take_event(false);  // dst's allocation and earlier use on stream
  WM_CUDA_TRY(cudaEventRecord(after, stream));
  WM_CUDA_TRY(cudaStreamWaitEvent(in_stream_, after, 0));
  give_event(after, false);  // the wait is enqueued
  // A page-out still writing the slab range: its copy (out_issued), or the page-out that a
  // page-in of it follows (r.after, until booked).
  if (r.st == state::out_issued) { WM_CUDA_TRY(cudaStreamWaitEvent(in_stream_, r.copy, 0)); }
  if (r.after != nullptr) { WM_CUDA_TRY(cudaStreamWaitEvent(in_stream_, r.after, 0)); }
  copy_to c{id, take_event(true), take_event(true), true};
  WM_CUDA_TRY(cudaEventRecord(c.start, in_stream_));
  if (r.bytes != 0) {
    WM_CUDA_TRY(cudaMemcpyAsync(dst, slab_ + r.host, r.bytes, cudaMemcpyHostToDevice, in_stream_));
  }
  WM_CUDA_TRY(cudaEventRecord(c.end, in_stream_));
  r.ext_in    = c.end;
  r.slab_read = c.end;
  ext_ins_.push_back(c);
  stats_.bytes_in += r.bytes;
  ++stats_.copies_in;
  ++stats_.pageins_to;
}

inline void swap_core::wait_pagein(std::uint64_t id, cudaStream_t stream) {
  std::lock_guard lock{mutex_};
  record& r = at(id);
  collect_pageins_to();
  consumer_wait(stream, r.ext_in);  // nothing if it has completed (cleared by the collector)
}

inline void swap_core::wait_pageout(std::uint64_t id, cudaStream_t stream) {
  std::lock_guard lock{mutex_};
  record& r = at(id);
  if (r.st == state::out_issued) { consumer_wait(stream, r.copy); }
  if (r.after != nullptr) { consumer_wait(stream, r.after); }  // a page-in follows it, unbooked
}

// A prefetched buffer is being used (or dropped): its bytes leave the lookahead.
inline void swap_core::used(record& r) {
  if (r.prefetched) {
    r.prefetched = false;
    in_q_->release(r.bytes);
  }
}

inline void swap_core::cancel_queued_pageout(std::uint64_t id, record& r) {
  out_q_->erase(id);  // if the worker holds it already, it drops it: the state says resident
  r.st = state::resident;
  drop_kept(r);
  if (r.producer != nullptr) {
    give_event(r.producer, false);
    r.producer = nullptr;
  }
  ++stats_.pageouts_cancelled;
}

// pageout() after pageout_begin(): the block is free after the work queued so far on @p stream
// (the readers) and after the copy, which is not made again. Returns false if the page-out was
// dropped meanwhile (the caller pages out as usual).
inline bool swap_core::finish_kept_pageout(record& r, cudaStream_t stream) {
  r.kept               = false;
  bool const clean     = std::exchange(r.clean, false);
  cudaEvent_t const ev = take_event(false);
  WM_CUDA_TRY(cudaEventRecord(ev, stream));
  if (r.st == state::resident && clean) {  // the copy has completed: the block changes hands now
    pending_frees_.push_back(pending_free{ev, r.dev, stream});
    r.dev = npos;
    r.st  = state::host;
    ++stats_.pageouts;
    notify_room();
    return true;
  }
  if (r.st == state::out_queued || r.st == state::out_issued) {  // the copy goes on
    if (r.reader != nullptr) { give_event(r.reader, false); }
    r.reader = ev;
    notify_room();  // its block may be taken now
    return true;
  }
  give_event(ev, false);
  return false;
}

// The buffer is used again: a pageout_begin() no longer holds (its reader event is dropped).
inline void swap_core::drop_kept(record& r) {
  r.kept  = false;
  r.clean = false;
  if (r.reader != nullptr) {
    give_event(r.reader, false);
    r.reader = nullptr;
  }
}

// A page-out deferred for lack of room in the slab is named in the timeout's message.
inline void swap_core::drain(transfer_queue<copier>& q, char const* what) {
  auto const t0 = clock::now();
  bool const ok = q.wait(deadline_from(t0));
  std::string slab;
  {
    std::lock_guard lock{mutex_};
    count_wait(wait_cause::drain, t0);
    if (!ok) {
      for (auto const& [id, r] : records_) {
        if (r.st == state::out_queued && r.deferred) {
          slab = " (a page-out waits for " + slab_full_text(r.bytes) + ")";
          break;
        }
      }
    }
  }
  if (!ok) { throw_timeout(what + slab); }
}

inline swap_statistics swap_core::statistics() {
  std::lock_guard lock{mutex_};
  collect_waits();
  swap_statistics s     = stats_;
  s.resident_bytes      = dev_alloc_.in_use();
  s.peak_resident_bytes = dev_alloc_.peak();
  s.host_bytes_in_use   = host_alloc_.in_use();
  s.device_allocations  = device_allocations_;
  s.pinned_allocations  = pinned_allocations_;
  s.events_created      = events_created_;
  return s;
}

inline void swap_core::reset_statistics() {
  std::lock_guard lock{mutex_};
  collect_waits();
  stats_ = swap_statistics{};
  dev_alloc_.reset_peak();
  device_allocations_ = pinned_allocations_ = events_created_ = 0;
}

}  // namespace wm::detail
