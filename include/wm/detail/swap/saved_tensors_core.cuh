// SPDX-License-Identifier: Apache-2.0
// The state of a wm::saved_tensors (declared in <wm/swap.cuh>; docs/guide/swap.md, "Saved
// tensors"): its swap scope, the saves by source (to share one save among saves of the same
// data), the order of the saves (the backward pass needs them in reverse), the page-outs of the
// pacing, the encodings waiting for their size, the keep_last saves held, the staged page-ins,
// and counters. One recursive mutex guards it all: a save's destructor (from whichever thread
// drops it) may run while this thread holds it. Host code only; the codec's bodies come from
// nvcc or an explicit instantiation (docs/design.md, "Codec").
#pragma once

#include <wm/decl/swap.cuh>
#include <wm/detail/base/deadline.hpp>
#include <wm/detail/base/resources.hpp>
#include <wm/detail/swap/saved_codec.cuh>
#include <wm/error.hpp>

#include <cuda/stream_ref>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace wm::detail {

/// Selects a device for the lifetime of the guard and restores the previous one; never throws
/// from its destructor (`ok()` says whether the switch happened).
class device_switch {
 public:
  explicit device_switch(int device) noexcept {
    ok_ = cudaGetDevice(&previous_) == cudaSuccess && cudaSetDevice(device) == cudaSuccess;
  }
  device_switch(device_switch const&)            = delete;
  device_switch& operator=(device_switch const&) = delete;
  ~device_switch() {
    if (ok_) { (void)cudaSetDevice(previous_); }
  }
  [[nodiscard]] bool ok() const noexcept { return ok_; }

 private:
  int previous_{0};
  bool ok_{false};
};

template <class Memory>
class saved_tensors_core : public std::enable_shared_from_this<saved_tensors_core<Memory>> {
 public:
  using handle_type   = typename Memory::handle_type;
  using save_type     = saved_tensor<Memory>;
  using save_ptr      = std::shared_ptr<save_type>;
  using restored_type = restored_tensor<Memory>;
  using hold_type     = std::vector<save_ptr>;  // saves locked here, dropped after the lock

  static constexpr std::size_t pool_alignment = 256;  // the scope hands out multiples of it
  static constexpr int nonzero_slots          = 8;    // encodings waiting for their size, at most

  saved_tensors_core(swap_options const& scope_options, saved_tensors_options const& options,
                     Memory memory)
      : scope_{std::make_unique<swap_scope>(scope_options)},
        options_{options},
        memory_{std::move(memory)} {
    device_        = scope_->options().device;
    capacity_      = scope_options.device_budget / pool_alignment * pool_alignment;
    host_capacity_ = scope_options.host_bytes / pool_alignment * pool_alignment;
    device_switch const on{device_};
    WM_EXPECTS(on.ok(), "saved_tensors: cannot select device " + std::to_string(device_));
    slots_ = std::make_unique<pinned_buffer<std::uint64_t>>(nonzero_slots);
    for (int i = 0; i < nonzero_slots; ++i) { free_slots_.push_back(i); }
  }

  saved_tensors_core(saved_tensors_core const&)            = delete;
  saved_tensors_core& operator=(saved_tensors_core const&) = delete;

  ~saved_tensors_core() {
    device_switch const on{device_};
    // The encode kernels write the slots: the host polls for them, at most the scope's timeout
    // in all; past it they are abandoned with a line on stderr and the slots left allocated.
    auto const deadline = deadline_after(scope_->options().timeout);
    bool stuck          = false;
    for (auto& p : pending_) {
      cudaError_t r = cudaSuccess;
      while (!stuck && (r = cudaEventQuery(p.done.get())) == cudaErrorNotReady) {
        if (std::chrono::steady_clock::now() >= deadline) {
          stuck = true;
        } else {
          std::this_thread::sleep_for(std::chrono::microseconds{20});
        }
      }
      if (r != cudaSuccess && r != cudaErrorNotReady) { (void)cudaGetLastError(); }
    }
    pending_.clear();  // events destroyed with their work pending or not: CUDA allows both
    host_out_.clear();
    free_events_.clear();
    if (stuck) {
      std::fprintf(stderr,
                   "wm::saved_tensors: the teardown gave up after %lld ms waiting for an "
                   "encode kernel; abandoned, left allocated: its pinned count slots (%p)\n",
                   static_cast<long long>(scope_->options().timeout.count()),
                   static_cast<void*>(slots_->data()));
      (void)slots_.release();  // deliberately leaked: a kernel may still write them
    }
  }

  // -- options ------------------------------------------------------------------------------

  [[nodiscard]] saved_tensors_options options() const {
    std::lock_guard lk{mutex_};
    return options_;
  }
  void set_options(saved_tensors_options const& o) {
    std::lock_guard lk{mutex_};
    options_ = o;
  }
  void set_skip(std::vector<void const*> const& bases) {
    std::lock_guard lk{mutex_};
    skip_.clear();
    skip_.insert(bases.begin(), bases.end());
  }

  // -- forward ------------------------------------------------------------------------------

  save_ptr save(handle_type const& t, cudaStream_t s) {
    hold_type hold;  // destroyed after the lock
    std::lock_guard lk{mutex_};
    return save_locked(t, s, hold);
  }

  void end_forward(cudaStream_t s) {
    device_switch const on{device_};
    hold_type hold;
    std::lock_guard lk{mutex_};
    issue_pending(0, s, hold);
    while (options_.host_pacing && !host_out_.empty()) { wait_host_oldest(); }
  }

  // -- backward -----------------------------------------------------------------------------

  restored_type restore(save_ptr const& sp, cudaStream_t s) {
    WM_EXPECTS(sp != nullptr, "saved_tensors::restore: null save");
    WM_EXPECTS(sp->core_.get() == this, "saved_tensors::restore: a save of another object");
    device_switch const on{device_};
    hold_type hold;
    std::lock_guard lk{mutex_};
    issue_pending(0, s, hold);  // backward has started: the last encoded save goes out
    if (options_.auto_prefetch && !order_.empty()) { prefetch_all_locked(s, hold); }
    ++st_.restores;
    if (sp->mode_ == save_mode::direct) { return restore_direct(*sp, s, hold); }
    return restored_type{std::nullopt, sp->buf_.data(cuda::stream_ref{s})};
  }

  void prefetch_all(cudaStream_t s) {
    device_switch const on{device_};
    hold_type hold;
    std::lock_guard lk{mutex_};
    prefetch_all_locked(s, hold);
  }

  void wait_prefetches() { scope_->wait_prefetches(); }

  // -- state --------------------------------------------------------------------------------

  [[nodiscard]] saved_tensors_statistics statistics() const {
    std::lock_guard lk{mutex_};
    return st_;
  }
  void reset_statistics() {
    std::lock_guard lk{mutex_};
    scope_->reset_statistics();
    std::uint64_t const live = st_.live;
    st_                      = saved_tensors_statistics{};
    st_.live                 = live;
  }
  [[nodiscard]] bool owns(save_type const& b) const noexcept { return b.core_.get() == this; }
  [[nodiscard]] swap_scope& scope() const noexcept { return *scope_; }
  [[nodiscard]] std::size_t pool_bytes() const noexcept { return capacity_; }

  // -- for ~saved_tensor, under the lock ------------------------------------------------------

  std::recursive_mutex& mutex() const noexcept { return mutex_; }
  void released(save_type& b) noexcept {
    if (b.staged_) {  // never restored: its stream waits for the page-in before the drop
      staged_bytes_ -= std::min(b.bytes_, staged_bytes_);
      try {
        if (b.buf_) { b.buf_.wait_pagein(cuda::stream_ref{b.staged_stream_}); }
        if (b.decoded_) { (void)cudaStreamWaitEvent(b.staged_stream_, b.decoded_->get(), 0); }
      } catch (...) {  // destructors never throw; the copy's error resurfaces on the next check
      }
    }
    if (b.decoded_) { free_events_.push_back(std::move(*b.decoded_)); }
    b.decoded_.reset();
    b.buf_.reset();  // after the work queued so far on the stream of its last data() call
    --st_.live;
  }

 private:
  /// An encoding whose page-out waits for its size (the nonzero count in a pinned slot).
  struct pending_encoding {
    std::weak_ptr<save_type> sp;
    handle_type enc;  // max_encoded_bytes of the caller's memory, on the saving stream
    unique_event done;
    int slot{-1};
    std::size_t numel{0};
    std::size_t elem{0};
  };

  save_ptr save_locked(handle_type const& t, cudaStream_t s, hold_type& hold) {
    ++st_.saves;
    std::size_t const bytes = memory_.bytes(t);
    if (bytes == 0 || bytes < options_.min_bytes || skip_.contains(memory_.base(t))) {
      ++st_.kept;
      return nullptr;
    }
    bool const direct = options_.mode == save_mode::direct;
    if (direct ? bytes > host_capacity_ : bytes > capacity_) {  // could never fit
      ++st_.kept;
      ++st_.kept_no_room;
      return nullptr;
    }
    auto w = memory_.watch(t);
    // 1. The same data saved before (and still alive): share its save.
    void const* const key = memory_.data(t);
    {
      auto& same_place = saved_[key];
      std::erase_if(same_place, [](std::weak_ptr<save_type> const& e) { return e.expired(); });
      for (auto const& e : same_place) {
        if (auto sp = e.lock(); sp && memory_.same(sp->watch_, w)) {
          ++st_.shared;
          return sp;
        }
      }
    }
    device_switch const on{device_};
    save_ptr sp{new save_type{}};
    sp->watch_ = std::move(w);
    sp->mode_  = options_.mode;
    sp->bytes_ = bytes;
    if (direct) {
      // 2'. Direct: the page-out reads the source's own memory, after the work on s. With
      // keep_last the newest keep_last sources wait (held) and go out when newer ones come;
      // those still held when backward starts are never copied (backward needs them first).
      bool issued = false;
      if (options_.keep_last == 0) {
        try {
          issued = start_pageout(sp, t, bytes, s, hold);
        } catch (wm::logic_error const&) {  // larger than the slab
          ++st_.kept;
          ++st_.kept_no_room;
          return nullptr;
        }
      } else {
        sp->held_ = t;
      }
      sp->core_ = this->shared_from_this();
      ++st_.live;
      if (options_.keep_last == 0) {
        if (issued) { pace(sp, bytes, s); }
      } else {  // the oldest held beyond keep_last go out now
        deferred_.push_back(sp);
        while (deferred_.size() > options_.keep_last) {
          auto o = deferred_.front().lock();
          deferred_.pop_front();
          if (!o || !o->held_) { continue; }
          handle_type h = std::move(*o->held_);
          o->held_.reset();
          if (start_pageout(o, h, o->bytes_, s, hold)) { pace(o, o->bytes_, s); }  // fits: checked
          hold.push_back(std::move(o));
        }
      }
    } else {
      // 2. Pool: a device copy on s into a pool buffer, then its page-out after it.
      try {
        sp->buf_ = scope_->allocate<std::byte>(bytes, cuda::stream_ref{s});
      } catch (wm::logic_error const&) {  // every pool block held by buffers in use
        ++st_.kept;
        ++st_.kept_no_room;
        return nullptr;
      }
      sp->core_ = this->shared_from_this();
      ++st_.live;
      std::byte* const dst = sp->buf_.data(cuda::stream_ref{s});
      WM_CUDA_TRY(cudaMemcpyAsync(dst, memory_.data(t), bytes, cudaMemcpyDeviceToDevice, s));
      memory_.record_stream(t, s);  // not handed to another stream before the copy ran
      (void)sp->buf_.pageout(cuda::stream_ref{s});
    }
    saved_[key].push_back(sp);
    order_.push_back(sp);
    ++st_.copies;
    st_.bytes_copied += bytes;
    if (saved_.size() > 4096) {  // drop the entries of dropped saves now and then
      std::erase_if(saved_, [](auto const& e) {
        return std::all_of(e.second.begin(), e.second.end(),
                           [](std::weak_ptr<save_type> const& x) { return x.expired(); });
      });
    }
    return sp;
  }

  /// Starts @p sp's page-out from @p t (direct): first the encoding still waiting goes out, then,
  /// with compress, @p t is encoded on @p s into memory of the caller's allocator, which goes
  /// out at the next save, at backward or at end_forward (returns false); else @p t's own memory
  /// is copied (returns true).
  bool start_pageout(save_ptr const& sp, handle_type const& t, std::size_t bytes, cudaStream_t s,
                     hold_type& hold) {
    issue_pending(0, s, hold);
    std::size_t const elem = memory_.element_bytes(t);
    std::size_t const n    = bytes / elem;
    if (options_.compress && codec_supports(elem) &&
        codec_max_encoded_bytes(n, elem) <= host_capacity_) {
      encode(sp, t, n, elem, s);
      return false;
    }
    // The copy is issued before pageout_from returns; the source is recorded on the copy stream,
    // so that the allocator reuses it only after the copy. Nothing else holds it.
    sp->buf_ = scope_->pageout_from(static_cast<std::byte const*>(memory_.data(t)), bytes,
                                    cuda::stream_ref{s});
    memory_.record_stream(t, scope_->pageout_stream());
    return true;
  }

  /// Encodes @p t (a bit per element, then the nonzero elements) on @p s, its nonzero count into
  /// a pinned slot; the page-out waits in pending_ for the count (its size). @p t is read on @p s
  /// only: no record on a copy stream, nothing held until a copy ends.
  void encode(save_ptr const& sp, handle_type const& t, std::size_t n, std::size_t elem,
              cudaStream_t s) {
    WM_EXPECTS(!free_slots_.empty(), "saved_tensors: no free slot for an encoding's count");
    std::size_t const scratch_bytes = codec_scratch_bytes(n, elem);
    pending_encoding p{sp, memory_.allocate(codec_max_encoded_bytes(n, elem), s), {}, -1, n, elem};
    handle_type const scratch = memory_.allocate(std::max<std::size_t>(scratch_bytes, 1), s);
    p.slot                    = free_slots_.back();
    free_slots_.pop_back();
    try {
      codec_encode(memory_.data(t), n, elem, memory_.data(p.enc), slots_->data() + p.slot,
                   memory_.data(scratch), scratch_bytes, s);
      p.done = take_event();
      WM_CUDA_TRY(cudaEventRecord(p.done.get(), s));
    } catch (...) {
      free_slots_.push_back(p.slot);
      if (p.done) { free_events_.push_back(std::move(p.done)); }
      throw;
    }
    memory_.record_stream(t, s);  // a source made on another stream is kept until s passed it
    sp->encoded_       = true;
    sp->numel_         = n;
    sp->element_bytes_ = elem;
    pending_.push_back(std::move(p));
  }

  /// Issues the page-outs of the encodings in pending_ beyond the newest @p keep: the host waits
  /// for each encoding (one save behind the forward pass, so the GPU still has a layer queued),
  /// reads its nonzero count and pages out exactly the encoded bytes on the page-out stream; the
  /// encoding is recorded there and dropped.
  void issue_pending(std::size_t keep, cudaStream_t s, hold_type& hold) {
    while (pending_.size() > keep) {
      pending_encoding p = std::move(pending_.front());
      pending_.pop_front();
      int const slot = p.slot;
      std::uint64_t nonzeros{0};
      try {
        wait_host(p.done.get(), "the encoding of a saved tensor");
        nonzeros = *static_cast<std::uint64_t volatile*>(slots_->data() + slot);
      } catch (...) {
        free_slots_.push_back(slot);
        free_events_.push_back(std::move(p.done));
        throw;
      }
      free_slots_.push_back(slot);
      free_events_.push_back(std::move(p.done));
      auto sp = p.sp.lock();
      if (!sp) { continue; }  // dropped before it went out: the encoding goes in s's order
      std::size_t const eb   = codec_encoded_bytes(p.numel, nonzeros, p.elem);
      cudaStream_t const out = scope_->pageout_stream();
      sp->buf_ = scope_->pageout_from(static_cast<std::byte const*>(memory_.data(p.enc)), eb,
                                      cuda::stream_ref{out});
      memory_.record_stream(p.enc, out);
      sp->encoded_bytes_ = eb;
      ++st_.encoded;
      st_.encoded_raw_bytes += sp->bytes_;
      st_.encoded_bytes += eb;
      pace(sp, eb, s);
      hold.push_back(std::move(sp));
    }
  }

  /// The host waits for @p e (polling, within the scope's timeout); counted when it had to.
  void wait_host(cudaEvent_t e, char const* what) {
    auto const t0       = std::chrono::steady_clock::now();
    auto const deadline = deadline_after(scope_->options().timeout, t0);  // saturates
    bool waited         = false;
    for (;;) {
      cudaError_t const r = cudaEventQuery(e);
      if (r == cudaSuccess) { break; }
      if (r != cudaErrorNotReady) { WM_CUDA_TRY(r); }
      waited = true;
      if (std::chrono::steady_clock::now() > deadline) {
        throw wm::cuda_error{"wm::saved_tensors gave up waiting for " + std::string{what} +
                                 " after " + timeout_text(scope_->options().timeout),
                             static_cast<int>(cudaErrorTimeout)};
      }
      std::this_thread::sleep_for(std::chrono::microseconds{20});
    }
    if (waited) {
      ++st_.host_waits;
      st_.host_wait_seconds +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
  }

  /// Host pacing: the host waits for the oldest page-out still listed and drops it.
  void wait_host_oldest() {
    auto [e, n] = std::move(host_out_.front());
    host_out_.pop_front();
    host_out_bytes_ -= n;
    try {
      wait_host(e.get(), "a page-out (host pacing)");
    } catch (...) {
      free_events_.push_back(std::move(e));
      throw;
    }
    free_events_.push_back(std::move(e));
  }

  [[nodiscard]] unique_event take_event() {
    if (free_events_.empty()) { return unique_event::make(); }
    unique_event e = std::move(free_events_.back());
    free_events_.pop_back();
    return e;
  }

  /// max_outstanding_bytes: holds the forward pass (the host, or stream @p s) to the link's pace.
  void pace(save_ptr const& sp, std::size_t bytes, cudaStream_t s) {
    if (options_.host_pacing) {  // the host waits: the allocator sees the memory free in time
      unique_event e = take_event();
      if (cudaError_t const r = cudaEventRecord(e.get(), scope_->pageout_stream());
          r != cudaSuccess) {
        free_events_.push_back(std::move(e));
        WM_CUDA_TRY(r);
      }
      host_out_.emplace_back(std::move(e), bytes);
      host_out_bytes_ += bytes;
      while (host_out_bytes_ > options_.max_outstanding_bytes && host_out_.size() > 1) {
        wait_host_oldest();
      }
      return;
    }
    if (options_.max_outstanding_bytes == 0) { return; }
    outstanding_.emplace_back(sp, bytes);
    outstanding_bytes_ += bytes;
    while (outstanding_bytes_ > options_.max_outstanding_bytes && outstanding_.size() > 1) {
      auto [w, n] = outstanding_.front();
      outstanding_.pop_front();
      outstanding_bytes_ -= n;
      if (auto o = w.lock()) {
        o->buf_.wait_pageout(cuda::stream_ref{s});
        ++st_.throttle_waits;
      }
    }
  }

  /// Memory of the caller's allocator shaped as @p b's source (on @p s), filled by pagein_to on
  /// the page-in copy stream after s's work so far (and decoded there if encoded). Not recorded
  /// on the page-in stream: in backward the host runs far ahead of the GPU, and a caching
  /// allocator would keep every such block until the host saw the copy end. Instead @p s waits
  /// for the copy before any use (restore_direct) or before the memory is dropped unused
  /// (released), so that it is reused in @p s's order only after the copy.
  [[nodiscard]] handle_type page_in_new(save_type& b, cudaStream_t s) {
    handle_type t = memory_.allocate_like(b.watch_, s);
    if (b.encoded_) {  // the encoding comes in, then it is decoded into t on the page-in stream
      cudaStream_t const in           = scope_->pagein_stream();
      std::size_t const scratch_bytes = codec_scratch_bytes(b.numel_, b.element_bytes_);
      // used on the page-in stream only: allocated there, reused in its order
      handle_type const enc     = memory_.allocate(std::max<std::size_t>(b.encoded_bytes_, 1), in);
      handle_type const scratch = memory_.allocate(std::max<std::size_t>(scratch_bytes, 1), in);
      b.buf_.pagein_to(static_cast<std::byte*>(memory_.data(enc)), cuda::stream_ref{s});
      b.buf_.wait_pagein(cuda::stream_ref{in});  // the copy is there already; to be sure
      codec_decode(memory_.data(enc), b.numel_, b.element_bytes_, memory_.data(t),
                   memory_.data(scratch), scratch_bytes, in);
      if (!b.decoded_) { b.decoded_ = take_event(); }
      WM_CUDA_TRY(cudaEventRecord(b.decoded_->get(), in));
      return t;
    }
    b.buf_.pagein_to(static_cast<std::byte*>(memory_.data(t)), cuda::stream_ref{s});
    return t;
  }

  /// Direct mode's restore on @p s: an earlier restore's memory, the source held by keep_last,
  /// the source itself while it is alive and unchanged, the staged page-in, or a page-in now;
  /// then the next saves in backward order are staged.
  restored_type restore_direct(save_type& b, cudaStream_t s, hold_type& hold) {
    deferred_.clear();  // backward has started: what is still held stays on the device
    if (!b.restored_ && b.held_) {
      WM_EXPECTS(memory_.unchanged(*b.held_, b.watch_),
                 "saved_tensors: a tensor saved for backward was modified in place");
      b.restored_ = std::move(*b.held_);
      b.held_.reset();
      ++st_.kept_last;
      memory_.record_stream(*b.restored_, s);
      stage_more(s, hold);
      return restored_type{b.restored_, memory_.data(*b.restored_)};
    }
    if (!b.restored_) {
      if (auto src = memory_.reuse(b.watch_)) {
        b.restored_ = std::move(src);
        ++st_.reused_sources;
      } else if (b.staged_) {
        b.restored_ = std::move(b.staged_);
        b.staged_.reset();
        staged_bytes_ -= std::min(b.bytes_, staged_bytes_);
        ++st_.staged_restores;
      } else {
        b.restored_ = page_in_new(b, s);
        ++st_.unstaged_restores;
      }
    }
    // Nothing once the copy has completed; a source keep_last held has no buffer.
    if (b.buf_) { b.buf_.wait_pagein(cuda::stream_ref{s}); }
    if (b.decoded_) { WM_CUDA_TRY(cudaStreamWaitEvent(s, b.decoded_->get(), 0)); }
    memory_.record_stream(*b.restored_, s);  // used on s (nothing if allocated there)
    stage_more(s, hold);
    return restored_type{b.restored_, memory_.data(*b.restored_)};
  }

  /// Stages the next saves of the backward order (page-ins into new memory) while fewer than
  /// stage_bytes are staged and not yet restored (at least one).
  void stage_more(cudaStream_t s, hold_type& hold) {
    while (!in_order_.empty()) {
      auto o = in_order_.front().lock();
      if (!o || o->restored_ || o->staged_ || o->held_ || memory_.reuse(o->watch_)) {
        in_order_.pop_front();  // gone, restored, staged, or still on the device as it was
        if (o) { hold.push_back(std::move(o)); }
        continue;
      }
      if (staged_bytes_ > 0 && staged_bytes_ + o->bytes_ > options_.stage_bytes) { return; }
      o->staged_        = page_in_new(*o, s);
      o->staged_stream_ = s;
      staged_bytes_ += o->bytes_;
      in_order_.pop_front();
      hold.push_back(std::move(o));
    }
  }

  void prefetch_all_locked(cudaStream_t s, hold_type& hold) {
    issue_pending(0, s, hold);
    for (auto& [e, n] : host_out_) { free_events_.push_back(std::move(e)); }
    host_out_.clear();
    host_out_bytes_ = 0;
    outstanding_.clear();  // backward: the forward's page-out pacing ends
    deferred_.clear();     // and what keep_last still holds stays on the device
    outstanding_bytes_ = 0;
    bool any_pool      = false;
    for (auto it = order_.rbegin(); it != order_.rend(); ++it) {
      auto sp = it->lock();
      if (!sp) { continue; }
      if (sp->mode_ == save_mode::direct) {
        in_order_.push_back(sp);
      } else {
        any_pool = true;
      }
      hold.push_back(std::move(sp));
    }
    if (!in_order_.empty()) { stage_more(s, hold); }
    if (!any_pool) {
      order_.clear();
      return;
    }
    scope_->prefetch_init();
    for (auto it = order_.rbegin(); it != order_.rend(); ++it) {
      auto sp = it->lock();
      if (sp && sp->mode_ == save_mode::pool) { sp->buf_.need_prefetch(); }
      if (sp) { hold.push_back(std::move(sp)); }
    }
    order_.clear();
    scope_->prefetch_all();
  }

  // Declared first: destroyed last (saves' buffers and the encodings go before it).
  std::unique_ptr<swap_scope> scope_;
  saved_tensors_options options_;
  Memory memory_;
  int device_{0};
  std::size_t capacity_{0};                              // the pool's usable bytes
  std::size_t host_capacity_{0};                         // the slab's usable bytes
  std::unique_ptr<pinned_buffer<std::uint64_t>> slots_;  // each encoding's nonzero count
  std::vector<int> free_slots_;
  std::vector<unique_event> free_events_;
  std::deque<pending_encoding> pending_;                       // at most one: the previous save's
  std::deque<std::pair<unique_event, std::size_t>> host_out_;  // host pacing: page-outs issued
  std::size_t host_out_bytes_{0};
  std::deque<std::pair<std::weak_ptr<save_type>, std::size_t>> outstanding_;  // stream pacing
  std::size_t outstanding_bytes_{0};
  std::deque<std::weak_ptr<save_type>> in_order_;  // direct: still to stage, backward order
  std::deque<std::weak_ptr<save_type>> deferred_;  // keep_last: held, newest last
  std::size_t staged_bytes_{0};
  std::unordered_map<void const*, std::vector<std::weak_ptr<save_type>>> saved_;  // by data
  std::unordered_set<void const*> skip_;
  std::vector<std::weak_ptr<save_type>> order_;  // saves since the last prefetch_all
  saved_tensors_statistics st_;
  mutable std::recursive_mutex mutex_;
};

}  // namespace wm::detail
