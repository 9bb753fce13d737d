// SPDX-License-Identifier: Apache-2.0
// The node identity of a rank: which ranks of a communicator share a host (node_ranks, the
// descriptor channel, mapped and shared host memory all follow from it). Host-only.
#pragma once

#include <wm/detail/base/hash.hpp>
#include <wm/error.hpp>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <string_view>
#include <unistd.h>

namespace wm::detail {

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

}  // namespace wm::detail
