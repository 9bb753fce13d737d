// SPDX-License-Identifier: Apache-2.0
// wm::detail::swap_core: everything a wm::swap_scope owns (device pool, host slab, copy streams,
// transfer queues, buffer records). The member bodies are split by topic:
//   swap_blocks.cuh   the device pool: blocks handed over stream-ordered, events, waits
//   swap_buffers.cuh  what wm::swappable calls: allocate, data, pageout, prefetch, release
//   swap_copy.cuh     the two copiers the transfer queues' workers call: submit, poll, complete
//
// Pool blocks change hands by events, never by a host wait: a block whose page-out copy is
// enqueued, or whose buffer was released after work on some stream, goes to its next user at
// once and the next user's stream (a consumer stream, or the page-in copy stream) waits on the
// copy's or the release's event. A page-out still queued that would free a block is promoted to
// the front of its queue (the worker enqueues it next; it never blocks on CUDA). The host waits
// on the GPU only when no block can change hands that way (the pool is fragmented, or every block
// belongs to a buffer nobody pages out); `host_blocking_syncs` counts those waits.
// Included by <wm/swap.cuh> (after wm::swap_options and wm::swap_statistics), not on its own.
#pragma once

#include <wm/detail/base/deadline.hpp>
#include <wm/detail/base/range_allocator.hpp>
#include <wm/error.hpp>
#include <wm/transfer_queue.hpp>

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace wm::detail {

/// Everything a swap_scope owns; swappable buffers hold a pointer to it.
class swap_core {
 public:
  static constexpr std::size_t npos = range_allocator::npos;

  /// Where a buffer's data is.
  enum class state : std::uint8_t {
    resident,    // device memory holds it
    out_queued,  // resident; a page-out waits in the queue
    out_issued,  // resident; the page-out copy runs (its block may change hands meanwhile)
    host,        // only the host slab holds it
    in_queued,   // on the host; a page-in waits in the queue
    in_issued    // device memory taken; the page-in copy runs
  };

  struct record {
    std::size_t bytes{0};
    std::size_t dev{npos};   // offset in the device pool
    std::size_t host{npos};  // offset in the host slab (kept for the buffer's life once given)
    state st{state::resident};
    bool cancel_free{false};  // out_issued, but wanted again: keep the device memory
    bool destroyed{false};    // the owner is gone; free everything when the copies are done
    bool prefetched{false};   // brought in by a prefetch, not yet used (lookahead)
    bool deferred{false};     // a copier deferred it until the GPU frees room (pool or slab)
    bool kept{false};         // pageout_begin: the block stays (readable) until pageout()
    bool clean{false};        // kept, and its page-out copy has completed: the host copy is valid
    int pins{0};
    cudaEvent_t producer{nullptr};   // a page-out waits on it (recorded by pageout())
    cudaEvent_t copy{nullptr};       // end of the copy in flight (out_issued / in_issued)
    cudaEvent_t release{nullptr};    // destroyed: the device memory is free after it
    cudaEvent_t after{nullptr};      // its page-out, whose block another buffer took: a page-in
                                     // waits for it on the copy stream
    cudaEvent_t reader{nullptr};     // pageout() after pageout_begin(): the block is free after
                                     // it (the readers' work) and after the copy
    cudaEvent_t ext_in{nullptr};     // end of the last pagein_to copy (owned by ext_ins_; the
                                     // collector clears it here once the copy has completed)
    cudaEvent_t slab_read{nullptr};  // end of the last pagein_to copy from the slab (same owner;
                                     // on the page-in stream, so it follows the earlier ones)
    std::byte const* ext{nullptr};   // pageout_from: the caller's memory its page-out copies
                                     // (out_queued without a block; cleared once issued)
    std::uint64_t out_seq{0};        // order in which page-outs were asked for, then issued
    cudaStream_t last{nullptr};      // the last stream that used it
  };

  struct ticket {
    cudaEvent_t start{nullptr};
    cudaEvent_t end{nullptr};
    std::vector<std::uint64_t> ids;
  };

  /// The copier of one direction (wm::transfer_copier). What it throws goes to the queue (its
  /// next drain) and to the core (the user threads waiting for a copy; see copier_failed).
  struct copier {
    using ticket_type = ticket;
    swap_core* core;
    bool out;
    std::optional<ticket> submit(std::span<transfer_task> batch) {
      try {
        return core->submit(out, batch);
      } catch (...) {
        core->copier_failed(std::current_exception());
        throw;
      }
    }
    bool poll(ticket const& t) {
      try {
        if (core->poll(t)) { return true; }
        core->expect_teardown_time();  // throws past the teardown's deadline: the copy is dropped
        return false;
      } catch (...) {
        core->copier_failed(std::current_exception());
        throw;
      }
    }
    void complete(ticket const& t) {
      try {
        core->complete(out, t);
      } catch (...) {
        core->copier_failed(std::current_exception());
        throw;
      }
    }
  };

  explicit swap_core(swap_options const& options)
      : options_{options}, dev_alloc_{0, 256}, host_alloc_{0, 256} {
    WM_EXPECTS(options.host_bytes > 0, "swap_scope: the host slab must have a positive size");
    WM_EXPECTS(options.max_in_flight >= 1, "swap_scope: max_in_flight must be at least 1");
    WM_EXPECTS(options.timeout.count() > 0,
               "swap_scope: the timeout must be positive (milliseconds::max(): no limit)");
    WM_EXPECTS((options.pageout_stream == nullptr) == (options.pagein_stream == nullptr),
               "swap_scope: give both copy streams or neither");
    WM_EXPECTS(options.pageout_stream == nullptr || options.pageout_stream != options.pagein_stream,
               "swap_scope: the page-out and page-in streams must differ");
    if (options_.device < 0) { WM_CUDA_TRY(cudaGetDevice(&options_.device)); }
    try {
      WM_CUDA_TRY(cudaSetDevice(options_.device));
      dev_alloc_  = range_allocator{options.device_budget, alignment};
      host_alloc_ = range_allocator{options.host_bytes, alignment};
      WM_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&pool_), dev_alloc_.capacity() + alignment));
      ++device_allocations_;
      WM_CUDA_TRY(cudaHostAlloc(reinterpret_cast<void**>(&slab_),
                                host_alloc_.capacity() + alignment, cudaHostAllocDefault));
      ++pinned_allocations_;
      if (options.pageout_stream != nullptr) {
        out_stream_  = options.pageout_stream;
        in_stream_   = options.pagein_stream;
        own_streams_ = false;
      } else {
        WM_CUDA_TRY(cudaStreamCreateWithFlags(&out_stream_, cudaStreamNonBlocking));
        WM_CUDA_TRY(cudaStreamCreateWithFlags(&in_stream_, cudaStreamNonBlocking));
      }
      // Enough events for several steps of work enqueued ahead of the GPU (each transfer and
      // each consumer wait holds two timing events until the GPU has passed them).
      for (int i = 0; i < 256 * options.max_in_flight; ++i) {
        timing_free_.push_back(create_event(true));
      }
      for (int i = 0; i < 64 * options.max_in_flight; ++i) {
        sync_free_.push_back(create_event(false));
      }
      transfer_queue_options q;
      q.max_in_flight         = options.max_in_flight;
      q.coalesce_below        = options.coalesce_below;
      q.coalesce_limit        = options.coalesce_limit;
      out_q_                  = std::make_unique<transfer_queue<copier>>(out_copier_, q);
      q.lookahead_bytes       = options.prefetch_lookahead;
      q.release_on_completion = false;
      in_q_                   = std::make_unique<transfer_queue<copier>>(in_copier_, q);
      out_q_->start();  // page-outs go as they come; prefetches wait for prefetch_all()
    } catch (...) {
      destroy();
      throw;
    }
  }

  swap_core(swap_core const&)            = delete;
  swap_core& operator=(swap_core const&) = delete;
  ~swap_core() { destroy(); }

  [[nodiscard]] swap_options const& options() const noexcept { return options_; }

  // ---- buffers (swap_buffers.cuh) --------------------------------------------------------------
  std::uint64_t allocate(std::size_t bytes, cudaStream_t stream);
  void* data(std::uint64_t id, cudaStream_t stream, bool pin);
  bool pageout(std::uint64_t id, cudaStream_t stream, bool keep);
  void need_prefetch(std::uint64_t id);
  void unpin(std::uint64_t id);
  [[nodiscard]] bool resident(std::uint64_t id) const;
  [[nodiscard]] int pins(std::uint64_t id) const;
  void release(std::uint64_t id) noexcept;
  std::uint64_t pageout_from(void const* src, std::size_t bytes, cudaStream_t stream);
  void pagein_to(std::uint64_t id, void* dst, cudaStream_t stream);
  void wait_pagein(std::uint64_t id, cudaStream_t stream);
  void wait_pageout(std::uint64_t id, cudaStream_t stream);
  [[nodiscard]] cudaStream_t pageout_stream() const noexcept { return out_stream_; }
  [[nodiscard]] cudaStream_t pagein_stream() const noexcept { return in_stream_; }

  // ---- scope operations (swap_buffers.cuh) -----------------------------------------------------
  void prefetch_init() { in_q_->pause(); }
  void prefetch_all() { in_q_->start(); }
  void wait_pageouts() { drain(*out_q_, "the page-outs"); }
  void wait_prefetches() { drain(*in_q_, "the page-ins"); }
  [[nodiscard]] swap_statistics statistics();
  void reset_statistics();

  // ---- the copiers, on the worker threads (swap_copy.cuh) --------------------------------------
  std::optional<ticket> submit(bool out, std::span<transfer_task> batch);
  bool poll(ticket const& t);
  void complete(bool out, ticket const& t);

 private:
  static constexpr std::size_t alignment = 256;
  using clock                            = clock_type;
  /// How often a user thread waiting for a worker looks for a copier failure (which cannot wake
  /// it: see copier_failed).
  static constexpr std::chrono::milliseconds failure_poll{10};

  /// A pagein_to copy in flight: its timing events and the buffer it copied (the record's
  /// ext_in is cleared when the copy is collected, if it is still this copy).
  struct copy_to {
    std::uint64_t id;
    cudaEvent_t start;
    cudaEvent_t end;
    bool link;  // host to device (counted in seconds_in), else a device copy
  };

  /// A pool block given back after some work: free for the next user once @p ev has completed.
  struct pending_free {
    cudaEvent_t ev;       // the block is free once this has completed
    std::size_t off;      // offset in the pool
    cudaStream_t stream;  // the stream it was recorded on
  };

  record& at(std::uint64_t id) {
    auto const it = records_.find(id);
    WM_EXPECTS(it != records_.end(), "swappable: the buffer was reset or moved from");
    return it->second;
  }

  [[noreturn]] void throw_timeout(std::string const& what) const {
    throw wm::cuda_error{
        "wm: swap_scope: gave up waiting for " + what + " after " + timeout_text(options_.timeout),
        static_cast<int>(cudaErrorTimeout)};
  }

  /// The deadline of a wait that starts at @p t0 (saturating: `milliseconds::max()` is no limit).
  [[nodiscard]] clock::time_point deadline_from(clock::time_point t0) const noexcept {
    return deadline_after(options_.timeout, t0);
  }

  // During destroy(), past its deadline: the copy a worker polls is abandoned (a throw from the
  // copier's poll makes the queue drop its ticket, so that close() returns).
  void expect_teardown_time() {
    if (!stopping_.load(std::memory_order_acquire) || clock::now() < teardown_deadline_) { return; }
    abandoned_.store(true, std::memory_order_release);
    throw_timeout("a copy in flight (the scope's teardown)");
  }

  // ---- failures of the copiers (swap_copy.cuh) -------------------------------------------------
  // A copier threw on a worker thread (a CUDA call or an event failed): the first error is kept
  // and every later wait of a user thread on a copy throws it, since the copy it waits for may
  // never be issued or completed. The worker calls this under its queue's lock (poll), so it
  // takes failure_mutex_ only, never mutex_; waiters therefore poll for it (failure_poll).
  void copier_failed(std::exception_ptr e) noexcept;
  [[nodiscard]] std::exception_ptr copier_failure() const;

  // ---- the device pool (swap_blocks.cuh) -------------------------------------------------------
  [[nodiscard]] bool fits(std::size_t off, std::size_t bytes) const noexcept;
  std::size_t take_block(std::size_t bytes, cudaStream_t stream, bool consumer);
  std::size_t take_host_range(std::size_t bytes, cudaStream_t stream);
  void return_block(record& r, cudaStream_t stream) noexcept;
  [[nodiscard]] bool slab_stuck(std::size_t bytes) const;
  [[nodiscard]] std::string slab_full_text(std::size_t bytes) const;
  std::uint64_t promote_pageout(std::size_t bytes);
  std::size_t allocate_device(std::size_t bytes, std::unique_lock<std::mutex>& lock,
                              cudaStream_t stream);
  void wait_issued(record& r, cudaStream_t stream, std::unique_lock<std::mutex>& lock);
  /// What a user thread waited for.
  enum class wait_cause : std::uint8_t { worker, pool, slab, drain };
  void count_wait(wait_cause cause, clock::time_point t0);
  void consumer_wait(cudaStream_t stream, cudaEvent_t ev);
  void collect_waits();
  void collect_pageins_to();
  void expect_fits_pool(record const& r, char const* what) const;
  void free_device(record& r);
  void free_host(record& r);
  void reclaim();
  void notify_room();
  cudaEvent_t create_event(bool timing);
  cudaEvent_t take_event(bool timing);
  void give_event(cudaEvent_t ev, bool timing) {
    (timing ? timing_free_ : sync_free_).push_back(ev);
  }

  // ---- buffers (swap_buffers.cuh) --------------------------------------------------------------
  void used(record& r);
  void cancel_queued_pageout(std::uint64_t id, record& r);
  bool finish_kept_pageout(record& r, cudaStream_t stream);
  void drop_kept(record& r);
  void page_in_front(std::uint64_t id, record& r, cudaStream_t stream,
                     std::unique_lock<std::mutex>& lock);
  void drain(transfer_queue<copier>& q, char const* what);

  // Stops the workers (queued transfers dropped, copies in flight finished), waits for the GPU
  // work this scope issued, frees everything. Never throws, and never waits past the scope's
  // timeout: a copy that has not completed by then (its producer never finishes, say) is
  // abandoned with a line on stderr, and the pool and the slab it may still read or write are
  // left allocated (freeing them would also wait: cudaFree synchronizes the device).
  void destroy() noexcept {
    teardown_deadline_ = deadline_after(options_.timeout);
    stopping_.store(true, std::memory_order_release);  // the copiers' polls give up after it
    if (out_q_) { out_q_->close(); }
    if (in_q_) { in_q_->close(); }
    char const* stuck = abandoned_.load(std::memory_order_acquire) ? "a copy in flight" : nullptr;
    auto const settle = [&](cudaEvent_t ev, char const* what) {
      if (stuck == nullptr && !settled(ev, teardown_deadline_)) { stuck = what; }
    };
    for (auto const& p : pending_frees_) { settle(p.ev, "a released buffer's last work"); }
    for (auto const& [a, b] : waits_) { settle(b, "a consumer stream's wait on a copy"); }
    for (auto const& c : ext_ins_) { settle(c.end, "a pagein_to copy"); }
    // The copy streams, up to what is queued now (caller streams may get more work later).
    for (cudaStream_t const s : {out_stream_, in_stream_}) {
      if (s == nullptr || stuck != nullptr) { continue; }
      cudaEvent_t ev = nullptr;
      if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) == cudaSuccess &&
          cudaEventRecord(ev, s) == cudaSuccess) {
        settle(ev, s == out_stream_ ? "the page-out copy stream" : "the page-in copy stream");
      } else {
        (void)cudaGetLastError();
        while (cudaStreamQuery(s) == cudaErrorNotReady && clock::now() < teardown_deadline_) {
          std::this_thread::sleep_for(std::chrono::microseconds{100});
        }
        if (cudaStreamQuery(s) == cudaErrorNotReady) { stuck = "a copy stream"; }
      }
      if (ev != nullptr) { (void)cudaEventDestroy(ev); }
    }
    // Events and streams may go with work pending (CUDA frees them once it completes).
    for (cudaEvent_t ev : all_events_) { (void)cudaEventDestroy(ev); }
    all_events_.clear();
    if (own_streams_ && out_stream_ != nullptr) { (void)cudaStreamDestroy(out_stream_); }
    if (own_streams_ && in_stream_ != nullptr) { (void)cudaStreamDestroy(in_stream_); }
    if (stuck != nullptr) {
      std::fprintf(stderr,
                   "wm: swap_scope: the teardown gave up after %lld ms waiting for %s; abandoned, "
                   "left allocated: the device pool (%zu bytes at %p) and the pinned host slab "
                   "(%zu bytes at %p), which its copies may still use\n",
                   static_cast<long long>(options_.timeout.count()), stuck,
                   dev_alloc_.capacity() + alignment, static_cast<void*>(pool_),
                   host_alloc_.capacity() + alignment, static_cast<void*>(slab_));
    } else {
      if (pool_ != nullptr) { (void)cudaFree(pool_); }
      if (slab_ != nullptr) { (void)cudaFreeHost(slab_); }
    }
    out_stream_ = in_stream_ = nullptr;
    pool_                    = nullptr;
    slab_                    = nullptr;
  }

  // Polls @p ev until it has completed (or failed: the GPU will not run it) or @p deadline.
  static bool settled(cudaEvent_t ev, clock::time_point deadline) noexcept {
    backoff nap{std::chrono::microseconds{100}};
    while (true) {
      cudaError_t const e = cudaEventQuery(ev);
      if (e != cudaErrorNotReady) {
        if (e != cudaSuccess) { (void)cudaGetLastError(); }
        return true;
      }
      if (clock::now() >= deadline) { return false; }
      nap.pause();
    }
  }

  swap_options options_;
  range_allocator dev_alloc_;
  range_allocator host_alloc_;
  std::byte* pool_{nullptr};
  std::byte* slab_{nullptr};
  cudaStream_t out_stream_{nullptr};
  cudaStream_t in_stream_{nullptr};
  bool own_streams_{true};  // false: swap_options' streams, not destroyed here
  std::vector<cudaEvent_t> all_events_;
  std::vector<cudaEvent_t> timing_free_;
  std::vector<cudaEvent_t> sync_free_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;  // a copy was issued, deferred or completed, a block was given back
  mutable std::mutex failure_mutex_;  // guards failure_ only (taken last, under any other lock)
  std::exception_ptr failure_;        // the first error a copier threw
  std::unordered_map<std::uint64_t, record> records_;
  std::uint64_t next_id_{1};
  std::vector<pending_free> pending_frees_;
  std::uint64_t out_seq_{0};
  std::vector<std::pair<cudaEvent_t, cudaEvent_t>> waits_;
  std::vector<copy_to> ext_ins_;
  swap_statistics stats_;
  std::uint64_t device_allocations_{0};
  std::uint64_t pinned_allocations_{0};
  std::uint64_t events_created_{0};
  // The teardown (destroy): its deadline, written before stopping_ is set; a copier's poll past
  // it throws (the queue drops the ticket uncompleted) and sets abandoned_.
  clock::time_point teardown_deadline_{};
  std::atomic<bool> stopping_{false};
  std::atomic<bool> abandoned_{false};
  copier out_copier_{this, true};
  copier in_copier_{this, false};
  std::unique_ptr<transfer_queue<copier>> out_q_;  // after the copiers: closed first
  std::unique_ptr<transfer_queue<copier>> in_q_;
};

}  // namespace wm::detail
