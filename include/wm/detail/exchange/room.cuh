// SPDX-License-Identifier: Apache-2.0
// The workspaces an exchange sizes by what a rank receives: reserved once the count words are
// known and agreed on by every rank before anything moves, so that a rank that cannot get its
// memory makes every rank throw at once instead of leaving its peers waiting for rows it will
// never take (docs/design.md, "Exchange words").
#pragma once

#include <wm/comm.hpp>
#include <wm/detail/base/workspace.cuh>
#include <wm/detail/exchange/plan.cuh>
#include <wm/detail/exchange/plan.hpp>
#include <wm/error.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <initializer_list>
#include <span>
#include <string>
#include <vector>

namespace wm::detail {

/// One workspace a call reserves from its counts, and how many bytes.
struct room_request {
  workspace* ws;
  std::size_t bytes;
};

/**
 * For tests only: 0, or k > 0: the k-th receive-sized reservation of this process from now (see
 * `reserve_room`) asks for more device memory than any GPU has, so that it fails as a real
 * out-of-memory does (the workspace frees what it held and `cudaMallocAsync` fails). Set it in
 * the rank that is to fail; it counts down to 0.
 */
inline std::atomic<int> test_room_failure_at{0};

/// Bytes that no device has (64 TiB; an injected out-of-memory, see `test_room_failure_at`).
inline constexpr std::size_t impossible_room = std::size_t{1} << 46;

/// Reserves @p r (test_room_failure_at applies); throws as `workspace::reserve`. @p asked: set to
/// the bytes asked for.
inline std::byte* reserve_room(room_request r, cudaStream_t s, std::size_t* asked = nullptr) {
  std::size_t bytes = r.bytes;
  if (test_room_failure_at.load(std::memory_order_relaxed) > 0 &&
      test_room_failure_at.fetch_sub(1, std::memory_order_relaxed) == 1) {
    bytes = impossible_room;
  }
  if (asked != nullptr) { *asked = bytes; }
  return r.ws->reserve(bytes, s);
}

/// Reserves every request in order; @p asked: the bytes of the last request tried.
inline std::vector<std::byte*> reserve_rooms(std::span<room_request const> rooms, cudaStream_t s,
                                             std::size_t* asked = nullptr) {
  std::vector<std::byte*> bases;
  for (auto const& r : rooms) { bases.push_back(reserve_room(r, s, asked)); }
  return bases;
}
inline std::vector<std::byte*> reserve_rooms(std::initializer_list<room_request> rooms,
                                             cudaStream_t s, std::size_t* asked = nullptr) {
  return reserve_rooms(std::span<room_request const>{rooms.begin(), rooms.size()}, s, asked);
}

/// What a rank says in the room agreement: 0 when it has every workspace, else the bytes it could
/// not get, or `room_other` for an error that is not CUDA's.
inline constexpr unsigned long long room_other = ~0ull;

/// The error every rank throws when some rank of @p words (one per rank) could not reserve.
[[nodiscard]] inline std::string room_failure(std::vector<unsigned long long> const& words,
                                              exchange_op op) {
  std::string failed;
  for (std::size_t r = 0; r < words.size(); ++r) {
    if (words[r] == 0) { continue; }
    failed += (failed.empty() ? "" : "; ") + std::string{"rank "} + std::to_string(r) + " (" +
              op_name(op) + "): " +
              (words[r] == room_other
                   ? std::string{"an error while reserving the workspaces sized by what it "
                                 "receives"}
                   : "out of device memory for a workspace of " + std::to_string(words[r]) +
                         " bytes sized by what it receives");
  }
  return "wm: distributed exchange failed on every rank because " + failed + "; nothing was moved";
}

/**
 * Reserves @p rooms (sized from the counts of @p p) and agrees with every rank on the outcome
 * before anything moves: one device all-gather of a word per rank (through the plan's agreement
 * words) and one stream synchronization with the communicator's deadline. If any rank could not
 * reserve, every rank throws `wm::comm_error` naming each such rank and what it lacked (the
 * communicator stays usable, and so do the workspaces: the next call reserves again). With one
 * rank there is nothing to agree: the reservation's own error (`wm::cuda_error` for an
 * out-of-memory) is thrown. Collective. @return the rooms' bases, in order.
 */
template <class Index>
std::vector<std::byte*> reserve_received(communicator& comm, dispatch_plan_device<Index> const& p,
                                         exchange_op op, std::span<room_request const> rooms,
                                         cudaStream_t s) {
  if (comm.size() == 1) { return reserve_rooms(rooms, s); }
  std::vector<std::byte*> bases;
  unsigned long long status = 0;
  std::string mine;
  std::size_t asked = 0;  // the request that failed, when one does
  try {
    bases = reserve_rooms(rooms, s, &asked);
  } catch (cuda_error const& e) {
    status = std::max<unsigned long long>(1, asked);
    mine   = e.what();
  } catch (std::exception const& e) {
    status = room_other;
    mine   = e.what();
  }
  auto const world = static_cast<std::size_t>(comm.size());
  p.agree_host[0]  = status;
  WM_CUDA_TRY(cudaMemcpyAsync(p.agree + world, p.agree_host, sizeof(unsigned long long),
                              cudaMemcpyHostToDevice, s));
  comm.all_gather(static_cast<unsigned long long const*>(p.agree + world), p.agree, 1,
                  cuda::stream_ref{s});
  WM_CUDA_TRY(cudaMemcpyAsync(p.agree_host, p.agree, world * sizeof(unsigned long long),
                              cudaMemcpyDeviceToHost, s));
  comm.synchronize(cuda::stream_ref{s}, "the distributed exchange's workspace agreement");
  std::vector<unsigned long long> const words(p.agree_host, p.agree_host + world);
  for (auto const w : words) {
    if (w != 0) {
      throw comm_error{room_failure(words, op) +
                       (mine.empty() ? std::string{} : " (this rank: " + mine + ")")};
    }
  }
  return bases;
}

template <class Index>
std::vector<std::byte*> reserve_received(communicator& comm, dispatch_plan_device<Index> const& p,
                                         exchange_op op, std::initializer_list<room_request> rooms,
                                         cudaStream_t s) {
  return reserve_received(comm, p, op, std::span<room_request const>{rooms.begin(), rooms.size()},
                          s);
}

}  // namespace wm::detail
