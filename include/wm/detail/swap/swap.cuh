// Bodies of wm::swap_scope and wm::swappable (declared in <wm/swap.cuh>): the scope's core, its
// buffer records and the two copiers that feed the transfer queues.
#pragma once

#include <wm/detail/swap/range_allocator.hpp>
#include <wm/error.hpp>
#include <wm/transfer_queue.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
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
    out_issued,  // resident; the page-out copy runs (device freed when it is done)
    host,        // only the host slab holds it
    in_queued,   // on the host; a page-in waits in the queue
    in_issued    // device memory allocated; the page-in copy runs
  };

  struct record {
    std::size_t bytes{0};
    std::size_t dev{npos};   // offset in the device pool
    std::size_t host{npos};  // offset in the host slab (kept for the buffer's life once given)
    state st{state::resident};
    bool cancel_free{false};  // out_issued, but wanted again: keep the device memory
    bool destroyed{false};    // the owner is gone; free everything when the copies are done
    bool prefetched{false};   // brought in by a prefetch, not yet used (lookahead)
    bool deferred{false};     // its page-in waited for room in the pool
    int pins{0};
    cudaEvent_t producer{nullptr};  // a page-out waits on it (recorded by pageout())
    cudaEvent_t copy{nullptr};      // end of the copy in flight (out_issued / in_issued)
    cudaEvent_t release{nullptr};   // destroyed: the device memory is free after it
    cudaEvent_t after{nullptr};     // its page-out, whose block another buffer took: a page-in
                                    // waits for it on the copy stream
    std::uint64_t out_seq{0};       // order in which page-outs were issued
    cudaStream_t last{nullptr};     // the last stream that used it
  };

  struct ticket {
    cudaEvent_t start{nullptr};
    cudaEvent_t end{nullptr};
    std::vector<std::uint64_t> ids;
  };

  /// The copier of one direction (wm::transfer_copier).
  struct copier {
    using ticket_type = ticket;
    swap_core* core;
    bool out;
    std::optional<ticket> submit(std::span<transfer_task> batch) {
      return core->submit(out, batch);
    }
    bool poll(ticket const& t) { return core->poll(t); }
    void complete(ticket const& t) { core->complete(out, t); }
  };

  explicit swap_core(swap_options const& options)
      : options_{options}, dev_alloc_{0, 256}, host_alloc_{0, 256} {
    WM_EXPECTS(options.device_budget > 0, "swap_scope: the device budget must be positive");
    WM_EXPECTS(options.host_bytes > 0, "swap_scope: the host slab must have a positive size");
    WM_EXPECTS(options.max_in_flight >= 1, "swap_scope: max_in_flight must be at least 1");
    WM_EXPECTS(options.timeout.count() > 0, "swap_scope: the timeout must be positive");
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
      WM_CUDA_TRY(cudaStreamCreateWithFlags(&out_stream_, cudaStreamNonBlocking));
      WM_CUDA_TRY(cudaStreamCreateWithFlags(&in_stream_, cudaStreamNonBlocking));
      for (int i = 0; i < 8 * options.max_in_flight + 64; ++i) {
        timing_free_.push_back(create_event(true));
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

  // ---- buffers ---------------------------------------------------------------------------------

  std::uint64_t allocate(std::size_t bytes, cudaStream_t stream) {
    std::unique_lock lock{mutex_};
    std::size_t const dev  = allocate_device(bytes, lock, stream);
    std::uint64_t const id = next_id_++;
    record& r              = records_[id];
    r.bytes                = bytes;
    r.dev                  = dev;
    r.last                 = stream;
    return id;
  }

  void* data(std::uint64_t id, cudaStream_t stream, bool pin) {
    std::unique_lock lock{mutex_};
    record& r = at(id);
    r.last    = stream;
    used(r);
    switch (r.st) {
      case state::resident: break;
      case state::out_queued: cancel_queued_pageout(id, r); break;
      case state::out_issued:
        if (r.dev == npos) {  // its block went to another buffer: page in after the page-out
          r.after = r.copy;
          r.st    = state::in_queued;
          WM_EXPECTS(in_q_->enqueue_front(transfer_task{id, r.bytes}),
                     "swappable::data: the page-in queue is locked (wait_prefetches in progress)");
          wait_issued(r, stream, lock);
          break;
        }
        r.cancel_free = true;  // a page-in of it waits for its page-out first: the stream does
        if (r.producer != nullptr) {  // a page-out asked for again is off: it is in use again
          give_event(r.producer, false);
          r.producer = nullptr;
        }
        consumer_wait(stream, r.copy);
        ++stats_.pageouts_cancelled;
        break;
      case state::host:
        r.st = state::in_queued;
        WM_EXPECTS(in_q_->enqueue_front(transfer_task{id, r.bytes}),
                   "swappable::data: the page-in queue is locked (wait_prefetches in progress)");
        wait_issued(r, stream, lock);
        break;
      case state::in_queued:
        if (in_q_->erase(id)) {  // a queued prefetch goes first now
          WM_EXPECTS(in_q_->enqueue_front(transfer_task{id, r.bytes}),
                     "swappable::data: the page-in queue is locked (wait_prefetches in progress)");
        }
        wait_issued(r, stream, lock);
        break;
      case state::in_issued: consumer_wait(stream, r.copy); break;
    }
    if (pin) { ++r.pins; }
    return pool_ + r.dev;
  }

  bool pageout(std::uint64_t id, cudaStream_t stream) {
    std::unique_lock lock{mutex_};
    record& r = at(id);
    r.last    = stream;
    if (r.pins > 0) { return false; }
    used(r);
    switch (r.st) {
      case state::in_issued:
        WM_CUDA_TRY(cudaStreamWaitEvent(stream, r.copy, 0));  // the page-out copies what came in
        [[fallthrough]];
      case state::resident: {
        cudaEvent_t ev = take_event(false);
        WM_CUDA_TRY(cudaEventRecord(ev, stream));
        state const before = r.st;
        r.producer         = ev;
        r.st               = state::out_queued;
        if (!out_q_->enqueue(transfer_task{id, r.bytes})) {
          r.st       = before;
          r.producer = nullptr;
          give_event(ev, false);
          return false;
        }
        return true;
      }
      case state::out_issued:
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

  void need_prefetch(std::uint64_t id) {
    std::unique_lock lock{mutex_};
    record& r = at(id);
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
        break;
      default: break;
    }
  }

  void unpin(std::uint64_t id) {
    std::lock_guard lock{mutex_};
    record& r = at(id);
    WM_EXPECTS(r.pins > 0, "swappable::unpin: the buffer is not pinned");
    --r.pins;
  }

  [[nodiscard]] bool resident(std::uint64_t id) const {
    std::lock_guard lock{mutex_};
    record const& r = records_.at(id);
    return r.st == state::resident || r.st == state::in_issued ||
           (r.st == state::out_issued && r.cancel_free && r.producer == nullptr);
  }

  [[nodiscard]] int pins(std::uint64_t id) const {
    std::lock_guard lock{mutex_};
    return records_.at(id).pins;
  }

  /// The owner is gone: the device memory returns after the last stream's work, the host slot
  /// after the copies in flight.
  void release(std::uint64_t id) noexcept {
    try {
      std::unique_lock lock{mutex_};
      auto const it = records_.find(id);
      if (it == records_.end()) { return; }
      record& r   = it->second;
      r.destroyed = true;
      used(r);
      if (r.st == state::in_issued) {  // r.last may be the legacy stream 0: still a stream
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
      cv_.notify_all();
    } catch (...) {
      // Destructors never throw; a CUDA error here resurfaces on the next call that checks.
    }
  }

  // ---- scope operations ------------------------------------------------------------------------

  void prefetch_init() { in_q_->pause(); }
  void prefetch_all() { in_q_->start(); }

  void wait_pageouts() { drain(*out_q_, "the page-outs"); }
  void wait_prefetches() { drain(*in_q_, "the page-ins"); }

  [[nodiscard]] swap_statistics statistics() {
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

  void reset_statistics() {
    std::lock_guard lock{mutex_};
    collect_waits();
    stats_ = swap_statistics{};
    dev_alloc_.reset_peak();
    device_allocations_ = pinned_allocations_ = events_created_ = 0;
  }

  // ---- the copiers (worker threads) ------------------------------------------------------------

  std::optional<ticket> submit(bool out, std::span<transfer_task> batch) {
    WM_CUDA_TRY(cudaSetDevice(options_.device));
    std::lock_guard lock{mutex_};
    cudaStream_t const s = out ? out_stream_ : in_stream_;
    ticket t;
    struct piece {
      std::byte* dst;
      std::byte const* src;
      std::size_t bytes;
    };
    std::vector<piece> pieces;
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
        if (r.host == npos) {
          x.admission = transfer_admission::defer;
          deferring   = true;
          continue;
        }
        WM_CUDA_TRY(cudaStreamWaitEvent(s, r.producer, 0));
        give_event(r.producer, false);
        r.producer = nullptr;
        pieces.push_back({slab_ + r.host, pool_ + r.dev, dev_alloc_.round(r.bytes)});
      } else {
        if (r.dev == npos) {
          reclaim();
          r.dev = dev_alloc_.allocate(r.bytes);
        }
        if (r.dev == npos) {
          r.deferred  = true;
          x.admission = transfer_admission::defer;
          deferring   = true;
          continue;
        }
        if (r.after != nullptr) {  // its page-out is still running (its block went elsewhere)
          WM_CUDA_TRY(cudaStreamWaitEvent(s, r.after, 0));
        }
        pieces.push_back({pool_ + r.dev, slab_ + r.host, dev_alloc_.round(r.bytes)});
      }
      x.admission = transfer_admission::start;
      t.ids.push_back(x.id);
    }
    if (t.ids.empty()) { return std::nullopt; }
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
    for (auto const& x : batch) {
      if (x.admission != transfer_admission::start) { continue; }
      record& r = records_.at(x.id);
      r.st      = out ? state::out_issued : state::in_issued;
      if (out) { r.out_seq = ++out_seq_; }
      r.copy = t.end;
      if (!out) {
        r.prefetched = !x.passive;
        ++(x.passive ? stats_.passive_pageins : stats_.prefetches);
      }
    }
    cv_.notify_all();
    return t;
  }

  bool poll(ticket const& t) {
    cudaError_t const e = cudaEventQuery(t.end);
    return e != cudaErrorNotReady;  // an error: done; the next checked call reports it
  }

  void complete(bool out, ticket const& t) {
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
        if (r.copy == t.end) { r.copy = nullptr; }
        if (out) {
          stats_.bytes_out += r.bytes;
          ++stats_.pageouts;
          if (r.after == t.end) { r.after = nullptr; }
          if (r.st != state::out_issued) {  // its block was taken and a page-in followed
            continue;
          }
          if (r.destroyed) {
            if (r.producer != nullptr) { give_event(r.producer, false); }
            free_device(r);
            free_host(r);
            records_.erase(it);
          } else if (r.cancel_free) {
            r.cancel_free = false;
            r.st          = state::resident;
            if (r.producer != nullptr) {  // paged out again after it was wanted: go again
              r.st = state::out_queued;
              if (!out_q_->requeue(transfer_task{id, r.bytes})) {
                r.st = state::resident;
                give_event(r.producer, false);
                r.producer = nullptr;
              }
            }
          } else {
            if (r.dev != npos) { dev_alloc_.free(r.dev); }
            r.dev = npos;
            r.st  = state::host;
          }
        } else {
          stats_.bytes_in += r.bytes;
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

 private:
  static constexpr std::size_t alignment = 256;

  record& at(std::uint64_t id) {
    auto const it = records_.find(id);
    WM_EXPECTS(it != records_.end(), "swappable: the buffer was reset or moved from");
    return it->second;
  }

  [[noreturn]] void throw_timeout(char const* what) const {
    throw wm::cuda_error{"wm: swap_scope: gave up waiting for " + std::string{what} + " after " +
                             std::to_string(options_.timeout.count()) + " ms",
                         static_cast<int>(cudaErrorTimeout)};
  }

  // A prefetched buffer is being used (or dropped): its bytes leave the lookahead.
  void used(record& r) {
    if (r.prefetched) {
      r.prefetched = false;
      in_q_->release(r.bytes);
    }
  }

  // A passive page-in was queued: wait (host) until the worker has issued it, then @p stream
  // waits for its copy.
  void wait_issued(record& r, cudaStream_t stream, std::unique_lock<std::mutex>& lock) {
    auto const t0 = std::chrono::steady_clock::now();
    bool const issued =
        cv_.wait_until(lock, t0 + options_.timeout, [&] { return r.st != state::in_queued; });
    stats_.host_wait_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r.deferred) { ++stats_.host_blocking_syncs; }  // it waited for page-outs to finish
    r.deferred = false;
    if (!issued) { throw_timeout("a page-in to be issued"); }
    used(r);
    if (r.st == state::in_issued) { consumer_wait(stream, r.copy); }
  }

  void cancel_queued_pageout(std::uint64_t id, record& r) {
    out_q_->erase(id);  // if the worker holds it already, it drops it: the state says resident
    r.st = state::resident;
    if (r.producer != nullptr) {
      give_event(r.producer, false);
      r.producer = nullptr;
    }
    ++stats_.pageouts_cancelled;
  }

  // @p stream waits for @p ev; the time it waited is measured by two events around the wait.
  void consumer_wait(cudaStream_t stream, cudaEvent_t ev) {
    if (ev == nullptr) { return; }
    cudaEvent_t const a = take_event(true);
    cudaEvent_t const b = take_event(true);
    WM_CUDA_TRY(cudaEventRecord(a, stream));
    WM_CUDA_TRY(cudaStreamWaitEvent(stream, ev, 0));
    WM_CUDA_TRY(cudaEventRecord(b, stream));
    waits_.emplace_back(a, b);
    ++stats_.consumer_waits;
  }

  void collect_waits() {
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
  }

  // Device memory of a dropped buffer: free now, or after its release event.
  void free_device(record& r) {
    if (r.dev == npos) { return; }
    if (r.release != nullptr) {
      pending_frees_.push_back(pending_free{r.release, r.dev, r.last});
      r.release = nullptr;
    } else {
      dev_alloc_.free(r.dev);
    }
    r.dev = npos;
  }

  void free_host(record& r) {
    if (r.host != npos) {
      host_alloc_.free(r.host);
      r.host = npos;
    }
  }

  // Returns pool memory whose release events have completed.
  void reclaim() {
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

  // Device memory for a new buffer; waits (host) for page-outs and released buffers if needed.
  // Device memory for a new buffer used first on @p stream. In this order: free room; a block
  // released on @p stream itself (stream order makes it safe at once); the block of a page-out
  // in flight (@p stream waits for that copy); else the host waits for page-outs and releases.
  std::size_t allocate_device(std::size_t bytes, std::unique_lock<std::mutex>& lock,
                              cudaStream_t stream) {
    auto const t0          = std::chrono::steady_clock::now();
    auto const deadline    = t0 + options_.timeout;
    std::size_t const size = dev_alloc_.round(bytes);
    auto const fits        = [&](std::size_t off) {
      std::size_t const have = dev_alloc_.size_of(off);
      return have >= size && have <= 2 * size;
    };
    bool waited = false;
    while (true) {
      reclaim();
      std::size_t off = dev_alloc_.allocate(bytes);
      if (off == npos) {
        for (auto it = pending_frees_.begin(); it != pending_frees_.end(); ++it) {
          if (it->stream == stream && fits(it->off)) {
            off = it->off;
            give_event(it->ev, false);
            pending_frees_.erase(it);
            ++stats_.blocks_reused;
            break;
          }
        }
      }
      if (off == npos) {
        record* oldest = nullptr;
        for (auto& [id, r] : records_) {
          if (r.st == state::out_issued && r.dev != npos && !r.cancel_free && !r.destroyed &&
              fits(r.dev) && (oldest == nullptr || r.out_seq < oldest->out_seq)) {
            oldest = &r;
          }
        }
        if (oldest != nullptr) {
          consumer_wait(stream, oldest->copy);
          off         = oldest->dev;
          oldest->dev = npos;
          ++stats_.blocks_reused;
        }
      }
      if (off != npos) {
        if (waited) {
          ++stats_.host_blocking_syncs;
          stats_.host_wait_seconds +=
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        }
        return off;
      }
      bool const outs = std::any_of(records_.begin(), records_.end(), [](auto const& kv) {
        return kv.second.st == state::out_queued || kv.second.st == state::out_issued;
      });
      WM_EXPECTS(outs || !pending_frees_.empty(),
                 "swap_scope: the device budget is exhausted: " + std::to_string(bytes) +
                     " bytes asked for, " + std::to_string(dev_alloc_.in_use()) + " of " +
                     std::to_string(dev_alloc_.capacity()) +
                     " in use by buffers that are not being paged out");
      if (std::chrono::steady_clock::now() >= deadline) {
        throw_timeout("room in the device pool");
      }
      waited = true;
      // Page-outs or released buffers will make room: poll (reclaim() at the top of the loop)
      // rather than block in cudaEventSynchronize, so that the deadline holds.
      cv_.wait_until(lock, std::min(deadline, std::chrono::steady_clock::now() +
                                                  std::chrono::microseconds{200}));
    }
  }

  void drain(transfer_queue<copier>& q, char const* what) {
    auto const t0 = std::chrono::steady_clock::now();
    bool const ok = q.wait(t0 + options_.timeout);
    {
      std::lock_guard lock{mutex_};
      ++stats_.host_blocking_syncs;
      stats_.host_wait_seconds +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    if (!ok) { throw_timeout(what); }
  }

  cudaEvent_t create_event(bool timing) {
    cudaEvent_t ev = nullptr;
    WM_CUDA_TRY(cudaEventCreateWithFlags(&ev, timing ? cudaEventDefault : cudaEventDisableTiming));
    all_events_.push_back(ev);
    ++events_created_;
    return ev;
  }
  cudaEvent_t take_event(bool timing) {
    auto& free = timing ? timing_free_ : sync_free_;
    if (free.empty()) { return create_event(timing); }
    cudaEvent_t const ev = free.back();
    free.pop_back();
    return ev;
  }
  void give_event(cudaEvent_t ev, bool timing) {
    (timing ? timing_free_ : sync_free_).push_back(ev);
  }

  // Stops the workers (queued transfers dropped, copies in flight finished), waits for the GPU
  // work this scope issued, frees everything. Never throws.
  void destroy() noexcept {
    if (out_q_) { out_q_->close(); }
    if (in_q_) { in_q_->close(); }
    for (auto const& [ev, off, stream] : pending_frees_) { (void)cudaEventSynchronize(ev); }
    for (auto const& [a, b] : waits_) { (void)cudaEventSynchronize(b); }
    if (out_stream_ != nullptr) { (void)cudaStreamSynchronize(out_stream_); }
    if (in_stream_ != nullptr) { (void)cudaStreamSynchronize(in_stream_); }
    for (cudaEvent_t ev : all_events_) { (void)cudaEventDestroy(ev); }
    all_events_.clear();
    if (out_stream_ != nullptr) { (void)cudaStreamDestroy(out_stream_); }
    if (in_stream_ != nullptr) { (void)cudaStreamDestroy(in_stream_); }
    if (pool_ != nullptr) { (void)cudaFree(pool_); }
    if (slab_ != nullptr) { (void)cudaFreeHost(slab_); }
    out_stream_ = in_stream_ = nullptr;
    pool_                    = nullptr;
    slab_                    = nullptr;
  }

  swap_options options_;
  range_allocator dev_alloc_;
  range_allocator host_alloc_;
  std::byte* pool_{nullptr};
  std::byte* slab_{nullptr};
  cudaStream_t out_stream_{nullptr};
  cudaStream_t in_stream_{nullptr};
  std::vector<cudaEvent_t> all_events_;
  std::vector<cudaEvent_t> timing_free_;
  std::vector<cudaEvent_t> sync_free_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::unordered_map<std::uint64_t, record> records_;
  std::uint64_t next_id_{1};
  struct pending_free {
    cudaEvent_t ev;       // the block is free once this has completed
    std::size_t off;      // offset in the pool
    cudaStream_t stream;  // the stream it was recorded on
  };
  std::vector<pending_free> pending_frees_;
  std::uint64_t out_seq_{0};
  std::vector<std::pair<cudaEvent_t, cudaEvent_t>> waits_;
  swap_statistics stats_;
  std::uint64_t device_allocations_{0};
  std::uint64_t pinned_allocations_{0};
  std::uint64_t events_created_{0};
  copier out_copier_{this, true};
  copier in_copier_{this, false};
  std::unique_ptr<transfer_queue<copier>> out_q_;  // after the copiers: closed first
  std::unique_ptr<transfer_queue<copier>> in_q_;
};

}  // namespace wm::detail

namespace wm {

inline swap_scope::swap_scope(swap_options const& options)
    : core_{std::make_unique<detail::swap_core>(options)} {}

inline swap_scope::~swap_scope() = default;

template <class T>
swappable<T> swap_scope::allocate(std::size_t count, cuda::stream_ref stream) {
  WM_EXPECTS(count <= std::numeric_limits<std::size_t>::max() / sizeof(T),
             "swap_scope::allocate: " + std::to_string(count) + " elements overflow a size_t");
  return swappable<T>{core_.get(), core_->allocate(count * sizeof(T), stream.get()), count};
}

inline void swap_scope::prefetch_init() {
  core_->prefetch_init();
}
inline void swap_scope::wait_pageouts() {
  core_->wait_pageouts();
}
inline void swap_scope::prefetch_all() {
  core_->prefetch_all();
}
inline void swap_scope::wait_prefetches() {
  core_->wait_prefetches();
}
inline swap_statistics swap_scope::statistics() const {
  return core_->statistics();
}
inline void swap_scope::reset_statistics() {
  core_->reset_statistics();
}
inline swap_options const& swap_scope::options() const noexcept {
  return core_->options();
}

template <class T>
swappable<T>::swappable(swappable&& other) noexcept
    : core_{std::exchange(other.core_, nullptr)},
      id_{other.id_},
      count_{std::exchange(other.count_, 0)} {}

template <class T>
swappable<T>& swappable<T>::operator=(swappable&& other) noexcept {
  if (this != &other) {
    reset();
    core_  = std::exchange(other.core_, nullptr);
    id_    = other.id_;
    count_ = std::exchange(other.count_, 0);
  }
  return *this;
}

template <class T>
swappable<T>::~swappable() {
  reset();
}

template <class T>
void swappable<T>::reset() noexcept {
  if (core_ != nullptr) { core_->release(id_); }
  core_  = nullptr;
  count_ = 0;
}

template <class T>
T* swappable<T>::data(cuda::stream_ref stream) {
  WM_EXPECTS(core_ != nullptr, "swappable::data: empty buffer");
  return static_cast<T*>(core_->data(id_, stream.get(), false));
}

template <class T>
bool swappable<T>::pageout(cuda::stream_ref stream) {
  WM_EXPECTS(core_ != nullptr, "swappable::pageout: empty buffer");
  return core_->pageout(id_, stream.get());
}

template <class T>
void swappable<T>::need_prefetch() {
  WM_EXPECTS(core_ != nullptr, "swappable::need_prefetch: empty buffer");
  core_->need_prefetch(id_);
}

template <class T>
T* swappable<T>::pin(cuda::stream_ref stream) {
  WM_EXPECTS(core_ != nullptr, "swappable::pin: empty buffer");
  return static_cast<T*>(core_->data(id_, stream.get(), true));
}

template <class T>
void swappable<T>::unpin() {
  WM_EXPECTS(core_ != nullptr, "swappable::unpin: empty buffer");
  core_->unpin(id_);
}

template <class T>
bool swappable<T>::resident() const {
  WM_EXPECTS(core_ != nullptr, "swappable::resident: empty buffer");
  return core_->resident(id_);
}

template <class T>
int swappable<T>::pins() const {
  WM_EXPECTS(core_ != nullptr, "swappable::pins: empty buffer");
  return core_->pins(id_);
}

}  // namespace wm
