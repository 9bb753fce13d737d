// SPDX-License-Identifier: Apache-2.0
// Collective steps of wm::memory (and of the modules built on it): a step whose failure every
// rank sees, and the barrier of a release, with a descriptor of its own.
#pragma once

#include <wm/comm.hpp>
#include <wm/error.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <string>

namespace wm::detail {

/**
 * Runs @p step on every rank, then exchanges outcomes (collective): if any rank failed, every
 * rank throws @p Error naming the ranks and their messages. Keeps a local failure from leaving
 * the other ranks waiting in the next collective.
 */
template <class Error = comm_error, class F>
void collective_step(communicator& comm, std::string const& what, F&& step) {
  std::string err;
  try {
    step();
  } catch (std::exception const& e) {
    err = e.what();
    if (err.empty()) { err = "unknown error"; }
  }
  auto const all = comm.all_gather_bytes(std::as_bytes(std::span{err.data(), err.size()}));
  std::string msg;
  for (std::size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty()) { continue; }
    msg += (msg.empty() ? "" : "; ") + std::string{"rank "} + std::to_string(r) + ": " +
           std::string{reinterpret_cast<char const*>(all[r].data()), all[r].size()};
  }
  if (!msg.empty()) { throw Error{"wm: " + what + " failed: " + msg}; }
}

/// The name every rank's release barrier carries: never the user's `barrier`, so a release on
/// one rank cannot stand in for a peer's unrelated `communicator::barrier` (both get an error).
inline constexpr char const* release_step_name = "memory release";

/// How long a release run by stack unwinding waits for its peers. Peers that fail with this
/// rank (an error every rank saw) meet it at once and the communicator stays usable; a peer that
/// is elsewhere (in a device exchange, computing) is not waited for longer than this: the
/// communicator is then aborted, and the peer's own waits fail at once.
inline constexpr std::chrono::milliseconds unwinding_release_limit{5000};

/**
 * The barrier of a release (collective, never throws): every rank waits, at most @p limit,
 * until all ranks reach their release of the same allocation (@p args identifies it: sizes,
 * kind and partition, so releases in different orders on different ranks are an error too). If
 * the wait fails (a peer is gone, late, or in another collective), the communicator is aborted,
 * so that no peer waits on this rank either, and false is returned: the caller skips the rest of
 * its barriers.
 */
[[nodiscard]] inline bool release_barrier(communicator& comm, std::uint64_t args,
                                          std::chrono::milliseconds limit) noexcept {
  return comm.agree_within(release_step_name, args, limit);
}

}  // namespace wm::detail
