// SPDX-License-Identifier: Apache-2.0
// Bodies of wm::communicator (declared in <wm/comm.hpp>). Host-only.
#pragma once

#include <wm/comm.hpp>
#include <wm/detail/base/deadline.hpp>
#include <wm/detail/base/hash.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <future>
#include <thread>
#include <unistd.h>

namespace wm {
namespace detail {

/// What every rank contributes to each host-side collective; compared across ranks.
struct collective_descriptor {
  std::uint64_t magic;
  std::uint64_t seq;
  std::uint64_t args;
  std::uint64_t bytes;  // payload size of this rank (may differ; not compared)
  char name[32];
};
static_assert(sizeof(collective_descriptor) == 64);

inline constexpr std::uint64_t descriptor_magic = 0x31637365642d6d77ull;  // "wm-desc1"

/// Identity of the node of rank @p rank: hostname and boot id (containers on one host share the
/// boot id). Two overrides, for testing on one machine the paths a job of several hosts takes
/// (no mapped memory, no shared host memory and no descriptor passing between nodes; rows
/// travel through NCCL); real jobs set neither:
/// - `WM_NODE_NAME` (not empty): the node's name; ranks with different names are different nodes;
/// - else `WM_RANKS_PER_NODE=k` (k > 0): ranks r and s are one node when r / k == s / k.
[[nodiscard]] inline std::uint64_t node_key(int rank) {
  if (char const* name = std::getenv("WM_NODE_NAME"); name != nullptr && *name != '\0') {
    return fnv1a(std::string_view{name}, fnv1a("wm node name"));
  }
  if (char const* per = std::getenv("WM_RANKS_PER_NODE"); per != nullptr && *per != '\0') {
    char* end    = nullptr;
    long const k = std::strtol(per, &end, 10);
    WM_EXPECTS(end != per && *end == '\0' && k > 0,
               std::string{"WM_RANKS_PER_NODE must be a positive integer, not '"} + per + "'");
    return fnv1a(std::to_string(rank / k), fnv1a("wm ranks per node"));
  }
  char host[256]{};
  ::gethostname(host, sizeof(host) - 1);
  std::string boot;
  std::ifstream{"/proc/sys/kernel/random/boot_id"} >> boot;
  return fnv1a(boot, fnv1a(host));
}

[[nodiscard]] inline std::string describe(collective_descriptor const& d) {
  if (d.magic != descriptor_magic) { return "<garbage>"; }
  std::string name{d.name, strnlen(d.name, sizeof(d.name))};
  char args[32];
  std::snprintf(args, sizeof(args), "0x%llx", static_cast<unsigned long long>(d.args));
  return name + "(" + args + ") as collective #" + std::to_string(d.seq);
}

}  // namespace detail

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

inline std::vector<std::vector<std::byte>> communicator::exchange(std::string_view what,
                                                                  std::uint64_t args,
                                                                  std::span<std::byte const> mine) {
  check_usable();
  if (s_->size == 1) {  // nothing to agree on or wait for: no NCCL round trip, no stream sync
    ++s_->seq;
    return {std::vector<std::byte>(mine.begin(), mine.end())};
  }
  auto const n        = static_cast<std::size_t>(s_->size);
  auto const me       = static_cast<std::size_t>(s_->rank);
  constexpr auto desc = sizeof(detail::collective_descriptor);
  ensure_scratch(n * desc);

  detail::collective_descriptor d{detail::descriptor_magic, s_->seq++, args, mine.size(), {}};
  std::memcpy(d.name, what.data(), std::min(what.size(), sizeof(d.name) - 1));
  std::memcpy(s_->staging + me * desc, &d, desc);
  WM_CUDA_TRY(cudaMemcpyAsync(s_->scratch + me * desc, s_->staging + me * desc, desc,
                              cudaMemcpyHostToDevice, s_->stream));
  WM_NCCL_TRY(
      ncclAllGather(s_->scratch + me * desc, s_->scratch, desc, ncclUint8, s_->comm, s_->stream));
  wait_nccl(what);
  WM_CUDA_TRY(
      cudaMemcpyAsync(s_->staging, s_->scratch, n * desc, cudaMemcpyDeviceToHost, s_->stream));
  wait_stream(what, s_->stream);

  std::vector<detail::collective_descriptor> all(n);
  std::memcpy(all.data(), s_->staging, n * desc);
  std::size_t longest = 0;
  bool same           = true;
  for (auto const& x : all) {
    same = same && x.magic == d.magic && x.seq == d.seq && x.args == d.args &&
           std::memcmp(x.name, d.name, sizeof(d.name)) == 0;
    longest = std::max<std::size_t>(longest, x.bytes);
  }
  if (!same) {
    std::string msg = "wm: mismatched collective calls across ranks:";
    for (std::size_t r = 0; r < n; ++r) {
      msg += " rank " + std::to_string(r) + " called " + detail::describe(all[r]) + ";";
    }
    msg += " every rank must call the same collectives in the same order with the same arguments";
    throw comm_error{msg};
  }

  std::vector<std::vector<std::byte>> out(n);
  if (longest == 0) { return out; }
  ensure_scratch(n * longest);
  std::memcpy(s_->staging + me * longest, mine.data(), mine.size());
  WM_CUDA_TRY(cudaMemcpyAsync(s_->scratch + me * longest, s_->staging + me * longest, longest,
                              cudaMemcpyHostToDevice, s_->stream));
  WM_NCCL_TRY(ncclAllGather(s_->scratch + me * longest, s_->scratch, longest, ncclUint8, s_->comm,
                            s_->stream));
  wait_nccl(what);
  WM_CUDA_TRY(
      cudaMemcpyAsync(s_->staging, s_->scratch, n * longest, cudaMemcpyDeviceToHost, s_->stream));
  wait_stream(what, s_->stream);
  for (std::size_t r = 0; r < n; ++r) {
    auto const* p = s_->staging + r * longest;
    out[r].assign(p, p + all[r].bytes);
  }
  return out;
}

inline void communicator::send_recv(std::span<send_part const> sends,
                                    std::span<recv_part const> recvs,
                                    cuda::stream_ref stream) const {
  check_usable();
  auto known = [&](int peer) { return peer >= 0 && peer < s_->size; };
  for (auto const& x : sends) {
    WM_EXPECTS(known(x.peer),
               "send_recv: peer " + std::to_string(x.peer) + " is not a rank of this communicator");
    WM_EXPECTS(x.bytes == 0 || x.data != nullptr, "send_recv: send buffer is null");
  }
  for (auto const& x : recvs) {
    WM_EXPECTS(known(x.peer),
               "send_recv: peer " + std::to_string(x.peer) + " is not a rank of this communicator");
    WM_EXPECTS(x.bytes == 0 || x.data != nullptr, "send_recv: receive buffer is null");
  }
  // Nothing to move: no NCCL group and no wait. Point-to-point calls carry no synchronization
  // between ranks, so no peer waits on this rank's empty call (a peer that expects bytes from it
  // has sizes that disagree with this rank's, which hangs with or without a group here).
  auto const moves = [](auto const& x) { return x.bytes > 0; };
  if (std::none_of(sends.begin(), sends.end(), moves) &&
      std::none_of(recvs.begin(), recvs.end(), moves)) {
    return;
  }
  ncclComm_t const via = s_->p2p != nullptr ? s_->p2p : s_->comm;
  WM_NCCL_TRY(ncclGroupStart());
  try {
    for (auto const& x : sends) {
      if (x.bytes > 0) {
        WM_NCCL_TRY(ncclSend(x.data, x.bytes, ncclUint8, x.peer, via, stream.get()));
      }
    }
    for (auto const& x : recvs) {
      if (x.bytes > 0) {
        WM_NCCL_TRY(ncclRecv(x.data, x.bytes, ncclUint8, x.peer, via, stream.get()));
      }
    }
  } catch (...) {
    // Close the group this thread opened (NCCL cancels a group in which a call failed), so that
    // the next NCCL call on this thread is not taken into it. The first error is the one
    // reported; the group's own result adds nothing.
    (void)ncclGroupEnd();
    throw;
  }
  if (via == s_->comm) {
    WM_NCCL_TRY(ncclGroupEnd());
    wait_nccl("send_recv");
    return;
  }
  // Blocking: the group is launched (or failed) when this returns. A failure there leaves the
  // operations' state unknown to the peers: the communicator is failed, as after a timeout.
  // (NCCL_COMM_BLOCKING=0 in the environment makes the twin nonblocking: then wait as above.)
  ncclResult_t const r = ncclGroupEnd();
  if (r == ncclInProgress) {
    wait_nccl("send_recv", s_->p2p);
    return;
  }
  if (r != ncclSuccess) {
    const_cast<communicator*>(this)->abort();
    throw comm_error{"wm: NCCL failed during send_recv on rank " + std::to_string(s_->rank) + ": " +
                     ncclGetErrorString(r) + "; the communicator was aborted"};
  }
}

template <class T>
void communicator::all_to_all_v(T const* send, std::span<std::size_t const> send_counts, T* recv,
                                std::span<std::size_t const> recv_counts,
                                cuda::stream_ref stream) const {
  check_usable();
  auto const n = static_cast<std::size_t>(s_->size);
  WM_EXPECTS(send_counts.size() == n && recv_counts.size() == n,
             "all_to_all_v needs one send and one receive count per rank (" + std::to_string(n) +
                 "), got " + std::to_string(send_counts.size()) + " and " +
                 std::to_string(recv_counts.size()));
  std::vector<send_part> sends(n);
  std::vector<recv_part> recvs(n);
  std::size_t send_offset = 0;
  std::size_t recv_offset = 0;
  for (std::size_t p = 0; p < n; ++p) {
    sends[p] = {static_cast<int>(p), send + send_offset, send_counts[p] * sizeof(T)};
    recvs[p] = {static_cast<int>(p), recv + recv_offset, recv_counts[p] * sizeof(T)};
    send_offset += send_counts[p];
    recv_offset += recv_counts[p];
  }
  send_recv(sends, recvs, stream);
}

template <class T>
void communicator::all_to_all(T const* send, T* recv, std::size_t count,
                              cuda::stream_ref stream) const {
  check_usable();
  if (count == 0) { return; }
  WM_EXPECTS(send != nullptr && recv != nullptr, "all_to_all: null buffer");
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
  ncclComm_t const via = s_->p2p != nullptr ? s_->p2p : s_->comm;
  ncclResult_t const r = ncclAlltoAll(send, recv, count * sizeof(T), ncclUint8, via, stream.get());
  if (via == s_->comm || r == ncclInProgress) {
    if (r != ncclSuccess && r != ncclInProgress) { WM_NCCL_TRY(r); }
    wait_nccl("all_to_all", via);
    return;
  }
  if (r != ncclSuccess) {
    // As in send_recv: the peers cannot know what this rank's call did; fail the communicator.
    const_cast<communicator*>(this)->abort();
    throw comm_error{"wm: NCCL failed during all_to_all on rank " + std::to_string(s_->rank) +
                     ": " + ncclGetErrorString(r) + "; the communicator was aborted"};
  }
#else
  std::vector<std::size_t> const counts(static_cast<std::size_t>(s_->size), count);
  all_to_all_v(send, std::span<std::size_t const>{counts}, recv,
               std::span<std::size_t const>{counts}, stream);
#endif
}

namespace detail {

/// The NCCL element type of @p T (device collectives).
template <class T>
[[nodiscard]] constexpr ncclDataType_t nccl_type() noexcept {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, float>) {
    return ncclFloat32;
  } else if constexpr (std::is_same_v<U, double>) {
    return ncclFloat64;
  } else if constexpr (std::is_same_v<U, __half>) {
    return ncclFloat16;
  } else if constexpr (std::is_same_v<U, __nv_bfloat16>) {
    return ncclBfloat16;
  } else if constexpr (std::is_integral_v<U> && sizeof(U) == 1) {
    return std::is_signed_v<U> ? ncclInt8 : ncclUint8;
  } else if constexpr (std::is_integral_v<U> && sizeof(U) == 4) {
    return std::is_signed_v<U> ? ncclInt32 : ncclUint32;
  } else if constexpr (std::is_integral_v<U> && sizeof(U) == 8) {
    return std::is_signed_v<U> ? ncclInt64 : ncclUint64;
  } else {
    static_assert(sizeof(U) == 0,
                  "wm: device collectives take float, double, __half, __nv_bfloat16 or 8/32/64-bit "
                  "integers");
    return ncclUint8;
  }
}

[[nodiscard]] constexpr ncclRedOp_t nccl_op(reduce_op op) noexcept {
  return op == reduce_op::max ? ncclMax : ncclSum;
}

}  // namespace detail

template <class Issue>
void communicator::device_collective(std::string_view what, Issue&& issue) const {
  check_usable();
  ncclComm_t const via = s_->p2p != nullptr ? s_->p2p : s_->comm;
  ncclResult_t const r = issue(via);
  if (via == s_->comm || r == ncclInProgress) {
    // Nonblocking communicator (or the twin made nonblocking by the environment): NCCL may
    // still be launching; wait for it with the deadline (a failure aborts and throws).
    if (r != ncclSuccess && r != ncclInProgress) {
      const_cast<communicator*>(this)->abort();
      throw comm_error{"wm: NCCL failed during " + std::string{what} + " on rank " +
                       std::to_string(s_->rank) + ": " + ncclGetErrorString(r) +
                       "; the communicator was aborted"};
    }
    wait_nccl(what, via);
    return;
  }
  if (r != ncclSuccess) {
    // As in all_to_all: the peers cannot know what this rank's call did; fail the communicator,
    // so that their waits end with an error instead of waiting on this rank.
    const_cast<communicator*>(this)->abort();
    throw comm_error{"wm: NCCL failed during " + std::string{what} + " on rank " +
                     std::to_string(s_->rank) + ": " + ncclGetErrorString(r) +
                     "; the communicator was aborted"};
  }
}

template <class T>
void communicator::all_reduce(T const* send, T* recv, std::size_t count, cuda::stream_ref stream,
                              reduce_op op) const {
  check_usable();
  if (count == 0) { return; }
  WM_EXPECTS(send != nullptr && recv != nullptr, "all_reduce: null buffer");
  device_collective("all_reduce", [&](ncclComm_t c) {
    return ncclAllReduce(send, recv, count, detail::nccl_type<T>(), detail::nccl_op(op), c,
                         stream.get());
  });
}

template <class T>
void communicator::reduce_scatter(T const* send, T* recv, std::size_t recv_count,
                                  cuda::stream_ref stream, reduce_op op) const {
  check_usable();
  if (recv_count == 0) { return; }
  WM_EXPECTS(send != nullptr && recv != nullptr, "reduce_scatter: null buffer");
  device_collective("reduce_scatter", [&](ncclComm_t c) {
    return ncclReduceScatter(send, recv, recv_count, detail::nccl_type<T>(), detail::nccl_op(op), c,
                             stream.get());
  });
}

template <class T>
void communicator::all_gather(T const* send, T* recv, std::size_t send_count,
                              cuda::stream_ref stream) const {
  check_usable();
  if (send_count == 0) { return; }
  WM_EXPECTS(send != nullptr && recv != nullptr, "all_gather: null buffer");
  device_collective("all_gather", [&](ncclComm_t c) {
    return ncclAllGather(send, recv, send_count, detail::nccl_type<T>(), c, stream.get());
  });
}

template <class T>
void communicator::broadcast(T const* send, T* recv, std::size_t count, int root,
                             cuda::stream_ref stream) const {
  check_usable();
  WM_EXPECTS(root >= 0 && root < s_->size,
             "broadcast: root " + std::to_string(root) + " is not a rank of this communicator");
  if (count == 0) { return; }
  WM_EXPECTS(recv != nullptr && (send != nullptr || s_->rank != root), "broadcast: null buffer");
  device_collective("broadcast", [&](ncclComm_t c) {
    return ncclBroadcast(send, recv, count, detail::nccl_type<T>(), root, c, stream.get());
  });
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

inline bool communicator::agree_within(std::string_view what, std::uint64_t args,
                                       std::chrono::milliseconds limit) noexcept {
  if (s_ == nullptr) { return false; }
  auto const saved = s_->timeout;
  s_->timeout      = std::min(saved, limit);  // every wait below takes its deadline from it
  bool agreed      = true;
  try {
    (void)exchange(what, args, {});
  } catch (...) { agreed = false; }
  s_->timeout = saved;
  if (!agreed) { abort(); }
  return agreed;
}

}  // namespace wm
