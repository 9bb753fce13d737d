// SPDX-License-Identifier: Apache-2.0
// A host model of the exchange engine's dispatch plan: which rank owns each index, the caller's
// positions grouped by owner (stable; invalid indices last), the per-owner counts and the local
// rows each owner is asked for, as the device plan (detail/exchange/plan.cuh) computes them.
#pragma once

#include <wm/partition.hpp>

#include <cstddef>
#include <span>
#include <type_traits>
#include <vector>

namespace wm_test {

template <class Index>
struct dispatch_plan {
  std::vector<std::size_t> send_counts;  ///< per owner rank
  std::vector<std::size_t> order;        ///< positions grouped by owner; invalid indices last
  std::vector<Index> send_keys;  ///< local row asked of the owner, for the sent prefix of order
  std::size_t invalid{};         ///< number of indices outside [0, rows)
};

template <class Mapping, class Index>
[[nodiscard]] dispatch_plan<Index> plan_dispatch(std::span<Index const> idx,
                                                 wm::mapping_ref<Mapping> map, int world) {
  auto const w = static_cast<std::size_t>(world);
  std::vector<std::vector<std::size_t>> buckets(w + 1);
  for (std::size_t i = 0; i < idx.size(); ++i) {
    Index const k = idx[i];
    bool const ok =
        (!std::is_signed_v<Index> || k >= 0) && static_cast<std::size_t>(k) < map.rows();
    buckets[ok ? static_cast<std::size_t>(map.locate(static_cast<std::size_t>(k)).rank) : w]
        .push_back(i);
  }
  dispatch_plan<Index> p;
  for (std::size_t r = 0; r <= w; ++r) {
    if (r < w) { p.send_counts.push_back(buckets[r].size()); }
    for (std::size_t i : buckets[r]) {
      p.order.push_back(i);
      if (r < w) {
        p.send_keys.push_back(
            static_cast<Index>(map.locate(static_cast<std::size_t>(idx[i])).local));
      }
    }
  }
  p.invalid = buckets[w].size();
  return p;
}

}  // namespace wm_test
