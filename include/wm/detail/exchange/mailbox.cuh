// SPDX-License-Identifier: Apache-2.0
// The copy-engine / put transports' receive buffers: the collective vote on the path and the
// (re)allocation of every rank's mailbox.
#pragma once

#include <wm/detail/exchange/scratch.cuh>

#include <cuda/cmath>

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <string_view>

namespace wm::detail {

/// Whether this call's rows go through the mailboxes (see `mailbox`); makes or grows them first.
/// Collective: every rank passes the same @p bytes (from the count exchange). The first call
/// decides, for the life of the scratch, with every rank's vote: one node, more than one rank, and
/// `WM_DISPATCH_ROWS` not set to `nccl`; rows are copied by the copy engines unless some rank has
/// `WM_DISPATCH_ROWS=put` (then the gather kernels store them). A mailbox that cannot be made (no
/// peer access between the GPUs, no memory) leaves the scratch on the NCCL path on every rank.
/// Any other value of the variable on any rank throws on every rank (the vote stays open).
inline bool mailbox_ready(communicator& comm, exchange_scratch& sc, std::size_t bytes) {
  mailbox& m = sc.mail;
  if (m.mode == mailbox::state::unknown) {
    char const* env            = std::getenv("WM_DISPATCH_ROWS");
    std::string_view const how = env != nullptr ? env : "";
    // 0: NCCL, 1: put, 2: copy, -1: a value nobody knows.
    int want = how.empty() || how == "copy" ? 2 : how == "put" ? 1 : how == "nccl" ? 0 : -1;
    if (want > 0 && (comm.size() == 1 || !comm.single_node())) { want = 0; }
    auto const votes = comm.all_gather(want);
    if (std::ranges::any_of(votes, [](int v) { return v < 0; })) {
      throw logic_error{
          "wm: gather: WM_DISPATCH_ROWS must be unset, nccl, put or copy on every rank (this rank: "
          "'" +
          std::string{how} + "')"};
    }
    m.mode = std::ranges::all_of(votes, [](int v) { return v != 0; }) ? mailbox::state::on
                                                                      : mailbox::state::off;
    m.copy = std::ranges::all_of(votes, [](int v) { return v == 2; });
  }
  if (m.mode == mailbox::state::off) { return false; }
  if (bytes <= m.bytes) { return true; }
  // Every rank's earlier gathers are done with every buffer before any is freed: this rank's
  // kernels by this wait (the last call's work, joined into its stream, and anything left on
  // the side streams), peers' writes into this buffer because this rank waited for their flags,
  // and no rank frees before all have waited (the release is collective).
  sc.wait_idle("growing the gather's mailboxes");
  m.buffer.reset();
  m.at.clear();
  m.bytes                 = 0;
  std::size_t const grown = cuda::round_up(bytes + bytes / 4, std::size_t{2} << 20);
  auto const world        = static_cast<std::size_t>(comm.size());
  try {
    m.buffer.emplace(comm, grown * world, grown);
  } catch (std::runtime_error const&) {
    // A comm_error or cuda_error. The allocation's steps are collective: a failure anywhere (no
    // memory, no peer access) is reported on every rank, which all land here. (A communicator
    // that failed meanwhile says so at the next call.)
    m.mode = mailbox::state::off;
    return false;
  }
  for (int q = 0; q < comm.size(); ++q) { m.at.push_back(m.buffer->part_data(q)); }
  m.bytes = grown;
  return true;
}

}  // namespace wm::detail
