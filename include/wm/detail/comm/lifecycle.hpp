// SPDX-License-Identifier: Apache-2.0
// The NCCL lifecycle of wm::communicator (declared in <wm/comm.hpp>): construction (the
// nonblocking NCCL communicator, the node ranks, the descriptor channel, the blocking twin),
// waits with the communicator's deadline, abort, split, and the teardown that finalizes or
// aborts. Host-only.
#pragma once

#include <wm/comm.hpp>
#include <wm/detail/base/deadline.hpp>
#include <wm/detail/base/hash.hpp>
#include <wm/detail/comm/nccl.hpp>
#include <wm/detail/comm/node_identity.hpp>
#include <wm/error.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <future>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace wm {

inline communicator::state::~state() {
  int previous{};
  bool const restore = cudaGetDevice(&previous) == cudaSuccess;
  (void)cudaSetDevice(device);
  bool hung = false;  // the twin's finalize is still running on its thread
  if (p2p != nullptr) {
    // The blocking twin's finalize waits for this rank's operations on it and may wait for the
    // node's other ranks, with no deadline of its own: a thread runs it. Past the timeout the
    // thread is left to it, with the twin: aborting the twin now would free it under that
    // thread. The communicator below is aborted, and what the twin's pending work may still
    // use (stream, buffers) is left alone; this rank is failing anyway.
    bool clean = !failed && std::uncaught_exceptions() == 0;
    if (clean) {
      auto result    = std::make_shared<std::promise<ncclResult_t>>();
      auto finalized = result->get_future();
      bool started   = false;
      try {
        std::thread{[result, c = p2p] {
          ncclResult_t r = ncclCommFinalize(c);
          // Nonblocking after all (NCCL_COMM_BLOCKING=0 in the environment): wait for it here.
          while (r == ncclInProgress) {
            std::this_thread::sleep_for(std::chrono::microseconds{100});
            if (ncclCommGetAsyncError(c, &r) != ncclSuccess) { r = ncclSystemError; }
          }
          result->set_value(r);
        }}.detach();
        started = true;
      } catch (...) {  // no thread: abort, as after an error
      }
      // No limit: wait for the finalize (wait_for would overflow the clock's arithmetic).
      bool const finished =
          started &&
          (detail::unlimited(timeout) ? (finalized.wait(), true)
                                      : finalized.wait_until(detail::deadline_after(timeout)) ==
                                            std::future_status::ready);
      if (started && !finished) {
        hung  = true;
        clean = false;
      } else {
        clean = started && finalized.get() == ncclSuccess;
        if (clean) {
          (void)ncclCommDestroy(p2p);
        } else {
          (void)ncclCommAbort(p2p);
        }
      }
      failed = failed || !clean;
    } else {
      (void)ncclCommAbort(p2p);
    }
    p2p = nullptr;
  }
  if (comm != nullptr) {
    // Destroyed by stack unwinding: this rank is failing, and its peers may be waiting in a
    // collective it will never join. Abort instead of finalizing (which would wait for them).
    bool ok = !failed && std::uncaught_exceptions() == 0;
    if (ok) {
      ncclResult_t const f = ncclCommFinalize(comm);
      ok                   = f == ncclSuccess || f == ncclInProgress;
    }
    if (ok) {
      auto const deadline = detail::deadline_after(timeout);
      ncclResult_t r      = ncclInProgress;
      while (ok) {
        if (ncclCommGetAsyncError(comm, &r) != ncclSuccess) { r = ncclSystemError; }
        if (r != ncclInProgress) { break; }
        if (detail::clock_type::now() >= deadline) { ok = false; }
        std::this_thread::yield();
      }
      ok = ok && r == ncclSuccess;
    }
    if (ok) {
      (void)ncclCommDestroy(comm);
    } else {
      (void)ncclCommAbort(comm);
    }
  }
  if (!hung) {
    if (stream != nullptr) { (void)cudaStreamDestroy(stream); }
    if (scratch != nullptr) { (void)cudaFree(scratch); }
    if (staging != nullptr) { (void)cudaFreeHost(staging); }
  }
  if (restore) { (void)cudaSetDevice(previous); }
}

inline communicator::communicator(unique_id const& id, int rank, int size,
                                  communicator_options options) {
  WM_EXPECTS(size >= 1, "a communicator needs at least one rank, got size " + std::to_string(size));
  WM_EXPECTS(rank >= 0 && rank < size,
             "rank must be in [0, " + std::to_string(size) + "), got " + std::to_string(rank));
  WM_EXPECTS(id.valid(), "the unique id is invalid (default-constructed or corrupted)");
  WM_EXPECTS(options.timeout.count() > 0, "the timeout must be positive");
  auto s     = std::make_unique<state>();
  s->rank    = rank;
  s->size    = size;
  s->node    = detail::node_key(rank);
  s->token   = id.token();
  s->timeout = options.timeout;
  s->twin    = options.exchange_twin;
  WM_CUDA_TRY(cudaGetDevice(&s->device));
  WM_CUDA_TRY(cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking     = 0;  // every wait is ours, with a deadline
  WM_NCCL_TRY(ncclCommInitRankConfig(&s->comm, size, id.nccl_id(), rank, &config));
  s_ = std::move(s);
  wait_nccl("communicator construction");
  finish_setup();
}

inline void communicator::finish_setup() {
  expect_same("communicator", static_cast<std::uint64_t>(s_->size));
  struct about {
    std::uint64_t node;
    int twin;
  };
  auto const all = all_gather(about{s_->node, s_->twin ? 1 : 0});
  s_->node_of_rank.clear();
  for (auto const& a : all) {
    s_->node_of_rank.push_back(a.node);
    // The twin is made only if every rank wants it (the split is collective; a rank left out
    // would hang the others). A rank that turned it off turns it off for all.
    s_->twin = s_->twin && a.twin != 0;
  }
  s_->node_ranks.clear();
  for (int r = 0; r < s_->size; ++r) {
    if (s_->node_of_rank[static_cast<std::size_t>(r)] ==
        s_->node_of_rank[static_cast<std::size_t>(s_->rank)]) {
      if (r == s_->rank) { s_->local_rank = static_cast<int>(s_->node_ranks.size()); }
      s_->node_ranks.push_back(r);
    }
  }
  s_->channel = node_channel{s_->token, s_->rank, s_->node_ranks, s_->timeout};
  barrier();  // every channel listens before anyone sends
  // Device exchanges (send_recv) go through a blocking twin of the NCCL communicator. On the
  // nonblocking one every group is launched by a new NCCL thread, which costs 60-110 us of host
  // time per call (measured on an H100, NCCL 2.28), against ~9 us here; the hot paths make
  // several such calls each. Made while every rank is known to be here, and connected to every
  // peer at once by one byte each way, so that a later exchange never waits for a peer on the
  // host (a peer that is gone shows up, as before, in the waits for the stream).
  if (!s_->twin) { return; }
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking     = 1;
  WM_NCCL_TRY(ncclCommSplit(s_->comm, 0, s_->rank, &s_->p2p, &config));
  wait_nccl("communicator construction");
  if (s_->p2p == nullptr) {
    abort();
    throw comm_error{"wm: rank " + std::to_string(s_->rank) +
                     ": NCCL made no communicator for the device exchanges"};
  }
  wait_nccl("communicator construction", s_->p2p);
  auto const n = static_cast<std::size_t>(s_->size);
  ensure_scratch(2 * n);
  std::vector<send_part> sends;
  std::vector<recv_part> recvs;
  for (int q = 0; q < s_->size; ++q) {
    sends.push_back({q, s_->scratch + q, 1});
    recvs.push_back({q, s_->scratch + n + static_cast<std::size_t>(q), 1});
  }
  send_recv(sends, recvs, cuda::stream_ref{s_->stream});
  wait_stream("communicator construction", s_->stream);
}

inline void communicator::check_usable() const {
  WM_EXPECTS(s_ != nullptr, "this communicator is empty (moved from, or not part of a split)");
  if (s_->failed) {
    throw comm_error{
        "wm: the communicator failed earlier (a peer died, timed out or an NCCL "
        "error occurred) and was aborted; create a new one"};
  }
}

inline void communicator::abort() noexcept {
  if (s_ != nullptr && s_->comm != nullptr && !s_->failed) {
    s_->failed = true;
    // The parent first: that ends a split still making the twin, which then exists or not.
    (void)ncclCommAbort(s_->comm);
    if (s_->p2p != nullptr) { (void)ncclCommAbort(s_->p2p); }
    s_->p2p  = nullptr;
    s_->comm = nullptr;
  }
}

inline void communicator::wait_nccl(std::string_view what, ncclComm_t which) const {
  auto const deadline = detail::deadline_after(s_->timeout);
  detail::backoff wait{std::chrono::microseconds{50}};
  while (true) {
    ncclResult_t r{};
    ncclResult_t const q = ncclCommGetAsyncError(which != nullptr ? which : s_->comm, &r);
    if (q != ncclSuccess) { r = q; }
    if (r == ncclSuccess) { return; }
    if (r != ncclInProgress) {
      const_cast<communicator*>(this)->abort();
      throw comm_error{"wm: NCCL failed during " + std::string{what} + " on rank " +
                       std::to_string(s_->rank) + ": " + ncclGetErrorString(r) +
                       "; the communicator was aborted"};
    }
    if (detail::clock_type::now() >= deadline) {
      const_cast<communicator*>(this)->abort();
      throw comm_error{"wm: rank " + std::to_string(s_->rank) + " timed out after " +
                       std::to_string(s_->timeout.count()) + " ms in " + std::string{what} +
                       "; a peer may have died or not joined. The communicator was aborted"};
    }
    wait.pause();
  }
}

inline void communicator::wait_stream(std::string_view what, cudaStream_t stream) const {
  auto const deadline = detail::deadline_after(s_->timeout);
  detail::backoff wait{std::chrono::microseconds{20}};
  while (true) {
    cudaError_t const q = cudaStreamQuery(stream);
    if (q == cudaSuccess) { return; }
    if (q != cudaErrorNotReady) { WM_CUDA_TRY(q); }
    ncclResult_t r{};
    for (ncclComm_t c : {s_->comm, s_->p2p}) {
      ncclResult_t e{};
      if (c != nullptr && r == ncclSuccess) {
        r = ncclCommGetAsyncError(c, &e) != ncclSuccess ? ncclSystemError : e;
      }
    }
    bool const late = detail::clock_type::now() >= deadline;
    if ((r != ncclSuccess && r != ncclInProgress) || late) {
      const_cast<communicator*>(this)->abort();
      // The abort ends the pending transfers (and waits, as any cudaFree does, for the kernels
      // running on the device); the communicator's own stream is drained before its buffers are
      // reused. A caller's stream is left to the caller.
      if (stream == s_->stream) { (void)cudaStreamSynchronize(stream); }
      throw comm_error{"wm: rank " + std::to_string(s_->rank) +
                       (late ? " timed out after " + std::to_string(s_->timeout.count()) +
                                   " ms waiting for peers in "
                             : " saw an NCCL error in ") +
                       std::string{what} +
                       "; a peer may have died or called a different collective. The "
                       "communicator was aborted"};
    }
    wait.pause();
  }
}

inline void communicator::ensure_scratch(std::size_t bytes) {
  if (bytes <= s_->scratch_bytes) { return; }
  bytes = std::max<std::size_t>(bytes, 4096);
  if (s_->scratch != nullptr) { WM_CUDA_TRY(cudaFree(s_->scratch)); }
  if (s_->staging != nullptr) { WM_CUDA_TRY(cudaFreeHost(s_->staging)); }
  s_->scratch       = nullptr;
  s_->staging       = nullptr;
  s_->scratch_bytes = 0;
  WM_CUDA_TRY(cudaMalloc(&s_->scratch, bytes));
  WM_CUDA_TRY(cudaMallocHost(&s_->staging, bytes));
  s_->scratch_bytes = bytes;
}

inline communicator communicator::split(int color, int key) {
  check_usable();
  struct choice {
    int color;
    int key;
  };
  auto const choices  = all_gather(choice{color, key});
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking     = 0;
  ncclComm_t sub      = nullptr;
  WM_NCCL_TRY(ncclCommSplit(s_->comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &sub, &config));
  try {
    wait_nccl("split");
  } catch (...) {
    if (sub != nullptr) { (void)ncclCommAbort(sub); }  // made before the parent was aborted
    throw;
  }
  std::uint64_t const seq = s_->split_seq++;
  if (color < 0) { return communicator{}; }

  std::vector<int> members;
  for (int r = 0; r < s_->size; ++r) {
    if (choices[static_cast<std::size_t>(r)].color == color) { members.push_back(r); }
  }
  std::stable_sort(members.begin(), members.end(), [&](int a, int b) {
    return choices[static_cast<std::size_t>(a)].key < choices[static_cast<std::size_t>(b)].key;
  });
  auto s  = std::make_unique<state>();
  s->comm = sub;
  s->size = static_cast<int>(members.size());
  s->rank = static_cast<int>(std::find(members.begin(), members.end(), s_->rank) - members.begin());
  s->device  = s_->device;
  s->timeout = s_->timeout;
  s->twin    = s_->twin;
  s->node    = s_->node;  // a split keeps the nodes of its parent
  s->token   = detail::mix64(s_->token, detail::mix64(seq, static_cast<std::uint64_t>(color)));
  WM_CUDA_TRY(cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking));
  communicator child{std::move(s)};
  child.wait_nccl("split");  // the new communicator finishes its own setup
  child.finish_setup();
  return child;
}

}  // namespace wm
