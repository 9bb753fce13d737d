// SPDX-License-Identifier: Apache-2.0
// The device collectives of wm::communicator (declared in <wm/comm.hpp>): grouped point-to-point
// exchanges (send_recv, all_to_all_v, all_to_all) and the typed NCCL collectives (all_reduce,
// reduce_scatter, all_gather, broadcast), each enqueued on the caller's stream through the
// blocking twin when there is one (the first call of each collective shape meets every rank
// first, with the deadline: see device_collective). Host-only.
#pragma once

#include <wm/comm.hpp>
#include <wm/detail/base/hash.hpp>
#include <wm/detail/comm/nccl.hpp>
#include <wm/error.hpp>

#include <cuda/stream_ref>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace wm {

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

/// The typed collectives, for their shapes.
enum class collective_kind : std::uint8_t {
  all_reduce     = 1,
  reduce_scatter = 2,
  all_gather     = 3,
  broadcast      = 4
};

/// What decides which of NCCL's algorithms a typed collective takes (and so which connections it
/// needs): the kind, the element type, the reduction, the count, the root. Alike on every rank
/// that makes the same call; the argument word of its first call's agreement.
[[nodiscard]] constexpr std::uint64_t collective_shape(collective_kind kind, ncclDataType_t type,
                                                       ncclRedOp_t op, std::size_t count,
                                                       int root = 0) noexcept {
  std::uint64_t const head = std::uint64_t{static_cast<std::uint8_t>(kind)} << 48 |
                             static_cast<std::uint64_t>(static_cast<std::uint32_t>(type)) << 24 |
                             static_cast<std::uint64_t>(static_cast<std::uint32_t>(op));
  return mix64(mix64(head, static_cast<std::uint64_t>(count)),
               static_cast<std::uint64_t>(static_cast<std::uint32_t>(root)));
}

}  // namespace detail

template <class Issue>
void communicator::device_collective(std::string_view what, std::uint64_t shape,
                                     Issue&& issue) const {
  check_usable();
  ncclComm_t const via = s_->p2p != nullptr ? s_->p2p : s_->comm;
  if (via == s_->p2p && !s_->connected.contains(shape)) {
    // NCCL connects the algorithm of a collective on the host at its first use (only
    // point-to-point is connected at setup), and on the blocking twin that waits for every peer
    // with no deadline: a peer busy elsewhere would hold this rank there for as long. Which
    // algorithm a call takes depends on its shape, so the first call of each shape meets every
    // rank in a host-side collective first (deadline, descriptors: a peer that does not come is a
    // comm_error after the timeout, a peer that calls another shape one at once); every rank then
    // connects beside the others. Later calls of the shape go straight to the twin.
    // docs/design.md, "Process model".
    (void)const_cast<communicator*>(this)->exchange("device " + std::string{what}, shape, {});
    s_->connected.insert(shape);
  }
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
  auto const shape = detail::collective_shape(detail::collective_kind::all_reduce,
                                              detail::nccl_type<T>(), detail::nccl_op(op), count);
  device_collective("all_reduce", shape, [&](ncclComm_t c) {
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
  auto const shape =
      detail::collective_shape(detail::collective_kind::reduce_scatter, detail::nccl_type<T>(),
                               detail::nccl_op(op), recv_count);
  device_collective("reduce_scatter", shape, [&](ncclComm_t c) {
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
  auto const shape = detail::collective_shape(detail::collective_kind::all_gather,
                                              detail::nccl_type<T>(), ncclSum, send_count);
  device_collective("all_gather", shape, [&](ncclComm_t c) {
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
  auto const shape = detail::collective_shape(detail::collective_kind::broadcast,
                                              detail::nccl_type<T>(), ncclSum, count, root);
  device_collective("broadcast", shape, [&](ncclComm_t c) {
    return ncclBroadcast(send, recv, count, detail::nccl_type<T>(), root, c, stream.get());
  });
}

}  // namespace wm
