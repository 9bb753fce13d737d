// SPDX-License-Identifier: Apache-2.0
// The copiers of a swap_core, called by the transfer queues' worker threads: submit issues the
// copies of a batch (taking pool blocks stream-ordered for page-ins), poll asks an event (and
// throws its error), complete books what finished. None of them blocks on CUDA.
#pragma once

#include <wm/detail/swap/swap_blocks.cuh>
#include <wm/detail/swap/swap_core.cuh>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <optional>
#include <span>
#include <vector>

namespace wm::detail {

inline std::optional<swap_core::ticket> swap_core::submit(bool out,
                                                          std::span<transfer_task> batch) {
  WM_CUDA_TRY(cudaSetDevice(options_.device));
  std::optional<ticket> result;
  {
    std::lock_guard lock{mutex_};
    cudaStream_t const s = out ? out_stream_ : in_stream_;
    ticket t;
    struct piece {
      std::byte* dst;
      std::byte const* src;
      std::size_t bytes;
    };
    std::vector<piece> pieces;
    // What this call took, given back if a CUDA call below throws: the pool blocks of page-ins
    // whose copies were not issued (else their records would keep them), the ticket's events.
    struct rollback {
      swap_core& core;
      cudaStream_t stream;
      std::vector<std::uint64_t> blocks;  // ids of records given a block here
      ticket* t;
      bool done{false};
      ~rollback() {
        if (done) { return; }
        for (std::uint64_t const id : blocks) {
          auto const it = core.records_.find(id);
          if (it != core.records_.end()) { core.return_block(it->second, stream); }
        }
        if (t->start != nullptr) { core.give_event(t->start, true); }
        if (t->end != nullptr) { core.give_event(t->end, true); }
      }
    } undo{*this, s, {}, &t};
    undo.blocks.reserve(batch.size());  // no allocation between taking a block and noting it
    bool deferring = false;
    for (auto& x : batch) {
      auto const it = records_.find(x.id);
      if (it == records_.end() || it->second.destroyed ||
          it->second.st != (out ? state::out_queued : state::in_queued)) {
        x.admission = transfer_admission::drop;
        continue;
      }
      record& r = it->second;
      if (deferring) {
        x.admission = transfer_admission::defer;
        continue;
      }
      if (out) {
        if (r.host == npos) { r.host = host_alloc_.allocate(r.bytes); }
        if (r.host == npos) { r.host = take_host_range(r.bytes, s); }
        if (r.host == npos) {  // the slab is full until buffers are released
          r.deferred  = true;
          x.admission = transfer_admission::defer;
          deferring   = true;
          cv_.notify_all();  // a pageout_from waiting for it names the full slab
          continue;
        }
        WM_CUDA_TRY(cudaStreamWaitEvent(s, r.producer, 0));
        give_event(r.producer, false);
        r.producer = nullptr;
        if (r.dev != npos) {
          pieces.push_back({slab_ + r.host, pool_ + r.dev, dev_alloc_.round(r.bytes)});
        } else if (r.bytes != 0) {  // pageout_from: the caller's memory, exactly its bytes
          pieces.push_back({slab_ + r.host, r.ext, r.bytes});
        }
        r.ext = nullptr;  // issued: its completion needs no source
      } else {
        // The copy stream waits for the block's previous user (a page-out copy or a release).
        if (r.dev == npos) {
          r.dev = take_block(r.bytes, s, false);
          if (r.dev != npos) { undo.blocks.push_back(x.id); }
        }
        if (r.dev == npos) {
          // A queued page-out would free a block: promoted, it goes next and this retries (a
          // wait on the other worker). Else only the GPU (or the user) can make room.
          if (promote_pageout(r.bytes) == 0) { r.deferred = true; }
          x.admission = transfer_admission::defer;
          deferring   = true;
          continue;
        }
        if (r.after != nullptr) {  // its own page-out is still running (its block went elsewhere)
          WM_CUDA_TRY(cudaStreamWaitEvent(s, r.after, 0));
        }
        pieces.push_back({pool_ + r.dev, slab_ + r.host, dev_alloc_.round(r.bytes)});
      }
      x.admission = transfer_admission::start;
      t.ids.push_back(x.id);
    }
    if (t.ids.empty()) {
      undo.done = true;
      return std::nullopt;
    }
    t.start = take_event(true);
    t.end   = take_event(true);
    WM_CUDA_TRY(cudaEventRecord(t.start, s));
    // Neighbours in both memories travel as one copy.
    std::uint64_t& copies = out ? stats_.copies_out : stats_.copies_in;
    for (std::size_t i = 0; i < pieces.size();) {
      std::size_t j     = i + 1;
      std::size_t bytes = pieces[i].bytes;
      while (j < pieces.size() && pieces[j].dst == pieces[i].dst + bytes &&
             pieces[j].src == pieces[i].src + bytes) {
        bytes += pieces[j].bytes;
        ++j;
      }
      WM_CUDA_TRY(cudaMemcpyAsync(pieces[i].dst, pieces[i].src, bytes,
                                  out ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice, s));
      ++copies;
      i = j;
    }
    WM_CUDA_TRY(cudaEventRecord(t.end, s));
    undo.done = true;  // issued: the blocks are the copies', the events the ticket's
    for (auto const& x : batch) {
      if (x.admission != transfer_admission::start) { continue; }
      record& r = records_.at(x.id);
      r.st      = out ? state::out_issued : state::in_issued;
      r.copy    = t.end;
      if (out) {
        r.out_seq = ++out_seq_;
      } else {
        r.prefetched = !x.passive;
        ++(x.passive ? stats_.passive_pageins : stats_.prefetches);
      }
    }
    cv_.notify_all();
    result = std::move(t);
  }
  if (out) { in_q_->notify(); }  // a page-in that promoted this page-out can take its block
  return result;
}

inline void swap_core::copier_failed(std::exception_ptr e) noexcept {
  {
    std::lock_guard lock{failure_mutex_};
    if (!failure_) { failure_ = std::move(e); }
  }
  cv_.notify_all();  // without mutex_: a waiter may miss it, and finds it within failure_poll
}

inline std::exception_ptr swap_core::copier_failure() const {
  std::lock_guard lock{failure_mutex_};
  return failure_;
}

// An error is not a completion (the copies may not have run): it is thrown, and the transfer
// queue reports it to its next drain without completing the ticket.
inline bool swap_core::poll(ticket const& t) {
  cudaError_t const e = cudaEventQuery(t.end);
  if (e == cudaErrorNotReady) { return false; }
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // a non-sticky error is not left for an unrelated call to find
    ::wm::detail::throw_cuda_error(__FILE__, __LINE__, "cudaEventQuery(end of a swap copy)", e);
  }
  return true;
}

inline void swap_core::complete(bool out, ticket const& t) {
  {
    std::lock_guard lock{mutex_};
    float ms = 0;
    if (cudaEventElapsedTime(&ms, t.start, t.end) == cudaSuccess) {
      (out ? stats_.seconds_out : stats_.seconds_in) += ms * 1e-3;
    }
    for (std::uint64_t id : t.ids) {
      auto const it = records_.find(id);
      if (it == records_.end()) { continue; }
      record& r = it->second;
      // This ticket is the buffer's copy in flight, or an older one: the buffer moved on since
      // (paged in, then out again; its new copy is r.copy) and only the newer copy's completion
      // may change its state (free its block, say it is on the host).
      bool const current = r.copy == t.end;
      if (current) { r.copy = nullptr; }
      if (out) {
        stats_.bytes_out += r.bytes;
        ++stats_.pageouts;
        if (r.after == t.end) { r.after = nullptr; }
        if (!current || r.st != state::out_issued) {  // its block was taken, a page-in followed
          continue;
        }
        if (r.kept) {  // pageout_begin: the data stays until pageout(); the host copy is valid
          r.st    = state::resident;
          r.clean = true;
          --stats_.pageouts;  // counted when pageout() releases the block
        } else if (r.destroyed) {
          if (r.producer != nullptr) { give_event(r.producer, false); }
          free_device(r);
          free_host(r);
          records_.erase(it);
        } else if (r.cancel_free) {
          r.cancel_free = false;
          r.st          = state::resident;
          if (r.producer != nullptr) {  // paged out again after it was wanted: go again
            r.st      = state::out_queued;
            r.out_seq = ++out_seq_;
            if (!out_q_->requeue(transfer_task{id, r.bytes})) {
              r.st = state::resident;
              give_event(r.producer, false);
              r.producer = nullptr;
            }
          }
        } else {
          if (r.dev != npos && r.reader != nullptr) {  // free after the readers' work as well
            pending_frees_.push_back(pending_free{r.reader, r.dev, r.last});
            r.reader = nullptr;
          } else if (r.dev != npos) {
            dev_alloc_.free(r.dev);
          }
          if (r.reader != nullptr) {
            give_event(r.reader, false);
            r.reader = nullptr;
          }
          r.dev = npos;
          r.st  = state::host;
        }
      } else {
        stats_.bytes_in += r.bytes;
        if (!current) { continue; }  // an older page-in: the buffer went out and in again since
        if (r.destroyed) {
          free_device(r);
          free_host(r);
          records_.erase(it);
        } else if (r.st == state::in_issued) {
          r.st = state::resident;
        }
      }
    }
    give_event(t.start, true);
    give_event(t.end, true);
    collect_waits();
    cv_.notify_all();
  }
  if (out) { in_q_->notify(); }  // room in the pool for deferred page-ins
}

}  // namespace wm::detail
