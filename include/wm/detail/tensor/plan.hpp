// Host form of the model-parallel dispatch plan (sok-dispatch input dispatcher): which rank owns
// each index, the caller's positions grouped by owner (stable), the per-peer counts and the local
// rows each peer is asked for. The device path (plan_dispatch_device) computes the same arrays;
// the GPU tests compare the two, and the host tests check this one against a reference.
#pragma once

#include <wm/partition.hpp>

#include <algorithm>
#include <cstddef>
#include <span>
#include <type_traits>
#include <vector>

namespace wm::detail {

template <class Index>
struct dispatch_plan {
  std::vector<std::size_t> send_counts;  ///< per owner rank
  std::vector<std::size_t> order;        ///< positions grouped by owner; invalid indices last
  std::vector<Index> send_keys;          ///< local row asked of the owner, for the sent prefix of order
  std::size_t invalid{};                 ///< number of indices outside [0, rows)
};

template <class Mapping, class Index>
[[nodiscard]] dispatch_plan<Index> plan_dispatch(std::span<Index const> idx, mapping_ref<Mapping> map, int world)
{
  auto const w = static_cast<std::size_t>(world);
  std::vector<std::vector<std::size_t>> buckets(w + 1);
  for (std::size_t i = 0; i < idx.size(); ++i) {
    Index const k = idx[i];
    bool const ok = (!std::is_signed_v<Index> || k >= 0) && static_cast<std::size_t>(k) < map.rows();
    buckets[ok ? static_cast<std::size_t>(map.locate(static_cast<std::size_t>(k)).rank) : w].push_back(i);
  }
  dispatch_plan<Index> p;
  for (std::size_t r = 0; r <= w; ++r) {
    if (r < w) { p.send_counts.push_back(buckets[r].size()); }
    for (std::size_t i : buckets[r]) {
      p.order.push_back(i);
      if (r < w) { p.send_keys.push_back(static_cast<Index>(map.locate(static_cast<std::size_t>(idx[i])).local)); }
    }
  }
  p.invalid = buckets[w].size();
  return p;
}

/// Most pieces the distributed gather cuts one peer's rows into (see `pieces_of`).
inline constexpr int max_pieces = 6;

/// Pieces that @p count rows of @p row_bytes to or from one peer are cut into: one per started
/// 32 MiB, at most `max_pieces` and at most one per row. Both ends compute it from the same
/// count, so their pieces match.
[[nodiscard]] inline int pieces_of(std::size_t count, std::size_t row_bytes)
{
  if (count == 0) { return 0; }
  std::size_t const per = std::size_t{32} << 20;
  std::size_t const cap = std::min<std::size_t>(max_pieces, count);
  return static_cast<int>(std::clamp<std::size_t>((count * row_bytes + per - 1) / per, 1, cap));
}

/// Rows [first, last) of piece k of @p count rows cut into pieces_of(count, row_bytes) pieces
/// (empty for k past the last piece). From three pieces on, the first and the last are a
/// quarter of the others (when that leaves them two rows or more): nothing crosses until the
/// first piece is gathered, and the last one is put in the caller's order after everything has
/// crossed, so both are pure latency.
struct piece {
  std::size_t first;
  std::size_t last;
};
[[nodiscard]] inline piece piece_of(std::size_t count, std::size_t row_bytes, int k)
{
  auto const n = static_cast<std::size_t>(pieces_of(count, row_bytes));
  auto const q = static_cast<std::size_t>(k);
  if (q >= n) { return {count, count}; }
  // Weights 1, 4, ..., 4, 1 from three pieces on, equal pieces below (and where the small ones
  // would hold less than two rows); where each piece starts.
  std::size_t const total = n < 3 ? n : 4 * (n - 2) + 2;
  bool const taper        = n >= 3 && count >= 2 * total;
  auto const start        = [&](std::size_t j) -> std::size_t {
    if (!taper) { return count * j / n; }
    std::size_t const w = j == 0 ? 0 : j >= n ? total : 1 + 4 * (j - 1);
    return count * w / total;
  };
  return {start(q), start(q + 1)};
}
}  // namespace wm::detail
