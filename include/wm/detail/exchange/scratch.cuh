// SPDX-License-Identifier: Apache-2.0
// What one user of the exchange engine (a tensor, an embedding) keeps between calls: its exchange
// id (alike on every rank), reusable device workspaces, the side streams of the pipelined gather,
// the mailboxes, the error flag, the count words, and the event that orders the calls that share
// them.
#pragma once

#include <wm/comm.hpp>
#include <wm/detail/base/deadline.hpp>
#include <wm/detail/base/resources.hpp>
#include <wm/detail/base/workspace.cuh>
#include <wm/detail/exchange/plan.hpp>
#include <wm/memory.cuh>

#include <cuda_runtime_api.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace wm::detail {

/// Streams and events for the distributed gather, made on first use. The side stream (highest
/// priority) moves rows between ranks and puts arrived pieces in the caller's order while the
/// caller's stream gathers the next piece; the aux stream serves this rank's own rows meanwhile.
class side_stream {
 public:
  [[nodiscard]] cudaStream_t get() {
    make();
    return stream_.get();
  }
  /// Whether the streams and events exist (the first `get` or `aux` makes them).
  [[nodiscard]] bool made() const noexcept { return static_cast<bool>(stream_); }
  /// Whether both streams are idle (true when not made).
  [[nodiscard]] bool idle() const noexcept {
    for (cudaStream_t st : {stream_.get(), aux_.get()}) {
      if (st != nullptr && cudaStreamQuery(st) == cudaErrorNotReady) { return false; }
    }
    return true;
  }
  /// The stream that serves this rank's own rows while the others cross (rows put by kernels), or
  /// that hands gathered pieces to the copy engine (rows copied).
  [[nodiscard]] cudaStream_t aux() {
    make();
    return aux_.get();
  }
  /// Piece k is gathered (recorded on the caller's stream).
  [[nodiscard]] cudaEvent_t ready(int k) const { return ready_[static_cast<std::size_t>(k)].get(); }
  /// Piece k is copied into the peers' mailboxes (recorded on the aux stream).
  [[nodiscard]] cudaEvent_t copied(int k) const {
    return copied_[static_cast<std::size_t>(k)].get();
  }
  /// Piece k has crossed (recorded on the side stream).
  [[nodiscard]] cudaEvent_t arrived(int k) const {
    return arrived_[static_cast<std::size_t>(k)].get();
  }
  /// The caller's stream reached the fork (aux waits for it).
  [[nodiscard]] cudaEvent_t forked() const { return marks_[0].get(); }
  /// The aux stream's work is done (the caller's stream waits for it).
  [[nodiscard]] cudaEvent_t joined() const { return marks_[1].get(); }
  /// Makes @p s wait for everything on both streams (a call that failed half-way: what it left
  /// there still uses the scratch buffers). Errors ignored.
  void join_into(cudaStream_t s) noexcept {
    if (!stream_ || !marks_[2]) { return; }
    for (cudaStream_t st :
         {stream_.get(), aux_.get()}) {  // a wait takes the event as last recorded
      if (cudaEventRecord(marks_[2].get(), st) == cudaSuccess) {
        (void)cudaStreamWaitEvent(s, marks_[2].get(), 0);
      }
    }
  }

 private:
  void make() {
    if (stream_) { return; }
    // Events and the aux stream first, the side stream last: after a failure here the next call
    // tries again.
    auto const make_all = [](auto& set) {
      for (auto& x : set) {
        if (!x) { x = unique_event::make(); }
      }
    };
    make_all(ready_);
    make_all(arrived_);
    make_all(copied_);
    make_all(marks_);
    if (!aux_) { aux_ = unique_stream::make(); }
    // Highest priority: its blocks start as soon as the gather's blocks leave an SM.
    stream_ = unique_stream::make(true);
  }
  // Events before streams: the streams are destroyed first.
  std::array<unique_event, max_pieces> ready_{};
  std::array<unique_event, max_pieces> arrived_{};
  std::array<unique_event, max_pieces> copied_{};
  std::array<unique_event, 3> marks_{};
  unique_stream aux_;
  unique_stream stream_;
};

/// Where the distributed gather's owners store rows for this rank: a receive buffer of equal
/// size on every rank, mapped into every peer (chunked device memory over CUDA IPC), so the
/// rows an owner sends land straight in the asking rank's buffer over NVLink instead of going
/// through NCCL. Made (and grown) collectively by the gather; used only when every rank shares
/// one node (see mailbox_ready).
struct mailbox {
  enum class state { unknown, on, off };
  state mode{state::unknown};
  bool copy{};  // rows reach the mailbox by cudaMemcpyAsync, not by the gather kernel's stores
  std::optional<memory<device, chunked>> buffer;
  std::vector<std::byte*> at;  // every rank's buffer, as this GPU addresses it
  std::size_t bytes{};         // per rank
};

/// The exchange id of a new exchange-engine user of @p comm: rank 0's `next_exchange_id`
/// (collective: a host all-gather; with one rank no round trip).
[[nodiscard]] inline std::uint64_t agree_exchange_id(communicator& comm) {
  return comm.all_gather(next_exchange_id())[0];
}

/**
 * The scratch of one exchange-engine user. `last` marks the end of the last call that used any
 * of it (every call records it, see `scratch_use`); waits for it on the host have the
 * communicator's deadline (`wait_idle`). A collective scratch is made collectively (it agrees on
 * its `id`).
 */
struct exchange_scratch {
  communicator* comm;
  bool collective;  // the calls exchange with peers (distributed layout)
  /// The user's exchange id, the same on every rank (0 when not collective): every call puts it
  /// into its header, so that ranks calling on different tensors fail (docs/design.md, "Exchange
  /// words").
  std::uint64_t id;
  /// The last call that used this scratch threw (set by `scratch_use`): what it left on the
  /// streams may wait for peers that wait for the part of the exchange it never enqueued.
  bool threw{};
  unique_event last;
  device_buffer<unsigned> err;
  pinned_buffer<unsigned> err_host;
  /// Count words: counts (world + 1), received words, sent words (words_per_peer per peer), then
  /// the group starts (world + 1). The first two parts are copied to words_host in one piece.
  device_buffer<unsigned long long> words;
  pinned_buffer<unsigned long long> words_host;
  workspace a;  // sized by the caller's batch
  workspace b;  // sized by what this rank receives (mapped layouts: rotated keys of long gathers)
  workspace reads;      // the owner side's distinct reads of host rows (the caller's stream)
  workspace reads_aux;  // the same beside them (this rank's own rows on the aux stream)
  side_stream side;
  mailbox mail;

  exchange_scratch(communicator& c, bool is_collective)
      : comm{&c},
        collective{is_collective},
        id{is_collective ? agree_exchange_id(c) : 0},
        last{unique_event::make()},
        err{1},
        err_host{1},
        words{(2 * static_cast<std::size_t>(words_per_peer) + 2) *
                  static_cast<std::size_t>(c.size()) +
              2},
        words_host{(static_cast<std::size_t>(words_per_peer) + 1) *
                       static_cast<std::size_t>(c.size()) +
                   1} {
    WM_CUDA_TRY(cudaMemset(err.data(), 0, sizeof(unsigned)));
  }
  exchange_scratch(exchange_scratch const&)            = delete;
  exchange_scratch& operator=(exchange_scratch const&) = delete;
  ~exchange_scratch() { (void)drain(); }

  [[nodiscard]] bool idle() const noexcept {
    return cudaEventQuery(last.get()) != cudaErrorNotReady && side.idle();
  }

  /**
   * Waits until the work of every call that used this scratch is done (this rank's kernels that
   * read or write peers' mailboxes included), at most the communicator's timeout. Past it the
   * communicator is aborted (its pending transfers end) and false is returned. While the stack
   * unwinds, a collective scratch whose last call threw half-way (`threw`) with work pending
   * aborts the communicator first: that work may wait for peers that wait for the rest of the
   * exchange, which this rank never enqueued. Work of calls that returned (an `_async` call still
   * running when another object's error, e.g. a bad index, unwinds past this scratch) is a whole
   * exchange that the peers complete too: it is waited for with the deadline and the
   * communicator stays usable. Never throws.
   */
  [[nodiscard]] bool drain() noexcept {
    if (idle()) { return true; }
    if (collective && threw && std::uncaught_exceptions() > 0) { comm->abort(); }
    // (A timeout too long to add to the clock waits without end.)
    auto const now = clock_type::now();
    auto const room =
        std::chrono::duration_cast<std::chrono::milliseconds>(clock_type::time_point::max() - now);
    auto const deadline =
        comm->timeout() < room ? now + comm->timeout() : clock_type::time_point::max();
    backoff wait{std::chrono::microseconds{20}};
    while (!idle()) {
      if (clock_type::now() >= deadline) {
        comm->abort();
        return false;
      }
      wait.pause();
    }
    return true;
  }

  /// As `drain`; past the deadline throws `wm::comm_error` naming @p what.
  void wait_idle(std::string_view what) {
    if (!drain()) {
      throw comm_error{"wm: rank " + std::to_string(comm->rank()) + " timed out after " +
                       std::to_string(comm->timeout().count()) +
                       " ms waiting for earlier work in " + std::string{what} +
                       "; the communicator was aborted"};
    }
  }
};

/// For the span of a call that uses a scratch (workspaces, mailboxes, error flag): the call
/// starts after the last one that used it has finished with it, on whatever stream that ran
/// (calls on one stream are ordered anyway), and marks its own end.
class scratch_use {
 public:
  scratch_use(exchange_scratch& sc, cudaStream_t s) : sc_{sc}, s_{s} {
    WM_CUDA_TRY(cudaStreamWaitEvent(s, sc.last.get(), 0));
  }
  scratch_use(scratch_use const&)            = delete;
  scratch_use& operator=(scratch_use const&) = delete;
  ~scratch_use() {
    // A call that threw may have left work on the side streams that it had not joined yet.
    sc_.threw = std::uncaught_exceptions() > unwinding_;
    if (sc_.threw) { sc_.side.join_into(s_); }
    (void)cudaEventRecord(sc_.last.get(), s_);
  }

 private:
  exchange_scratch& sc_;
  cudaStream_t s_;
  int unwinding_{std::uncaught_exceptions()};
};

}  // namespace wm::detail
