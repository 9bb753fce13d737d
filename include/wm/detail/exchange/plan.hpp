// SPDX-License-Identifier: Apache-2.0
// What the exchange engine's ranks agree on before rows move: how a peer's rows are cut into
// pieces (both ends compute the same cut from the same count), and the header each rank sends
// beside its counts (operation, fault, index width, row bytes, batch, invalid indices, tensor),
// checked on every rank after the count exchange so that a call one rank cannot make, or that the
// ranks make differently (on different tensors too), fails on every rank. Host-only.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace wm::detail {

/// Most pieces the distributed gather cuts one peer's rows into (see `pieces_of`).
inline constexpr int max_pieces = 6;

/// Pieces that @p count rows of @p row_bytes to or from one peer are cut into: one per started
/// 32 MiB, at most `max_pieces` and at most one per row. Both ends compute it from the same
/// count, so their pieces match.
[[nodiscard]] inline int pieces_of(std::size_t count, std::size_t row_bytes) {
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
[[nodiscard]] inline piece piece_of(std::size_t count, std::size_t row_bytes, int k) {
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

// ---- what every rank says about its call, in the count exchange --------------------------------

/// The operation a rank runs the exchange for.
enum class exchange_op : std::uint8_t { gather = 1, scatter = 2, apply = 3, user = 4 };

/// Why a rank could not take part (it still sends its words, so that its peers throw at once).
enum class exchange_fault : std::uint8_t {
  none         = 0,
  null_pointer = 1,  // null indices or rows with a nonzero count
  cuda         = 2,  // a CUDA call failed before the exchange (e.g. out of memory in a workspace)
  other        = 3,  // any other exception before the exchange
  bad_argument = 4,  // an argument check failed before the exchange
};

/**
 * A rank's call as its peers see it: sent to every peer beside the counts (no extra round trip).
 * Five words: a tag with the operation, the fault and the index width; the row bytes; the batch
 * size; the indices outside the table (filled in on the device); the exchange id of the tensor
 * (or embedding) the call is made on, the same on every rank (see `next_exchange_id`).
 */
struct exchange_header {
  exchange_op op{exchange_op::user};
  exchange_fault fault{exchange_fault::none};
  std::uint8_t index_bytes{};
  std::uint64_t row_bytes{};
  std::uint64_t batch{};
  std::uint64_t invalid{};
  std::uint64_t tensor{};
};

inline constexpr int header_words   = 5;
inline constexpr int count_words    = 3;  // rows asked, where the answer starts, rows from others
inline constexpr int words_per_peer = count_words + header_words;
inline constexpr std::uint64_t header_magic = 0x77640000u;  // "wd" in the tag's high bytes

/// The first header word (the tag); the others are row_bytes, batch, invalid and tensor as they
/// are.
[[nodiscard]] constexpr std::uint64_t header_tag(exchange_header const& h) noexcept {
  return header_magic << 32 | std::uint64_t{static_cast<std::uint8_t>(h.op)} << 16 |
         std::uint64_t{static_cast<std::uint8_t>(h.fault)} << 8 | std::uint64_t{h.index_bytes};
}

/// Reads a header from its five words; a tag without the magic reads as a fault (`other`).
[[nodiscard]] constexpr exchange_header read_header(std::uint64_t const* w) noexcept {
  exchange_header h;
  if (w[0] >> 32 != header_magic) {
    h.fault = exchange_fault::other;
    return h;
  }
  h.op          = static_cast<exchange_op>(w[0] >> 16 & 0xff);
  h.fault       = static_cast<exchange_fault>(w[0] >> 8 & 0xff);
  h.index_bytes = static_cast<std::uint8_t>(w[0] & 0xff);
  h.row_bytes   = w[1];
  h.batch       = w[2];
  h.invalid     = w[3];
  h.tensor      = w[4];
  return h;
}

/**
 * This process's next exchange id (1, 2, ...; thread-safe). A tensor or embedding whose calls go
 * through the exchange engine takes rank 0's value at its (collective) construction: every rank
 * gives one tensor the same id, whatever else the ranks make in between, and two tensors of one
 * communicator never share one (rank 0 is the same process for all of them). The id goes into
 * every header, so that ranks that call one operation on different tensors with rows of the same
 * size fail instead of serving each other's rows.
 */
[[nodiscard]] inline std::uint64_t next_exchange_id() noexcept {
  static std::atomic<std::uint64_t> last{0};
  return last.fetch_add(1, std::memory_order_relaxed) + 1;
}

[[nodiscard]] inline char const* op_name(exchange_op op) {
  switch (op) {
    case exchange_op::gather: return "gather";
    case exchange_op::scatter: return "scatter";
    case exchange_op::apply: return "apply_gradients";
    case exchange_op::user: return "a user exchange";
  }
  return "an unknown operation";
}

[[nodiscard]] inline char const* fault_text(exchange_fault f) {
  switch (f) {
    case exchange_fault::none: return "no fault";
    case exchange_fault::null_pointer: return "a null indices or rows pointer with a nonzero count";
    case exchange_fault::cuda:
      return "a CUDA error before the exchange (e.g. out of memory in a workspace)";
    case exchange_fault::bad_argument: return "an invalid argument";
    case exchange_fault::other: return "an error before the exchange";
  }
  return "an unknown fault";
}

/**
 * What every rank's header says together: an empty string when every rank is fine and all made
 * the same call (operation, row bytes, index width, tensor); otherwise the error every rank throws
 * (built only from the headers, so it is the same text on every rank).
 */
[[nodiscard]] inline std::string check_headers(std::span<exchange_header const> all) {
  std::string failed;
  for (std::size_t r = 0; r < all.size(); ++r) {
    if (all[r].fault != exchange_fault::none) {
      failed += (failed.empty() ? "" : "; ") + std::string{"rank "} + std::to_string(r) + " (" +
                op_name(all[r].op) + "): " + fault_text(all[r].fault);
    }
  }
  if (!failed.empty()) {
    return "wm: distributed exchange failed on every rank because " + failed +
           "; nothing was moved";
  }
  bool same = true;
  for (auto const& h : all) {
    same = same && h.op == all[0].op && h.row_bytes == all[0].row_bytes &&
           h.index_bytes == all[0].index_bytes && h.tensor == all[0].tensor;
  }
  if (same) { return {}; }
  std::string msg = "wm: distributed exchange: the ranks made different calls:";
  for (std::size_t r = 0; r < all.size(); ++r) {
    msg += " rank " + std::to_string(r) + " " + op_name(all[r].op) + " (" +
           std::to_string(all[r].row_bytes) + "-byte rows, " + std::to_string(all[r].index_bytes) +
           "-byte indices, tensor " + std::to_string(all[r].tensor) + ");";
  }
  return msg + " every rank must make the same call on the same tensor; nothing was moved";
}

}  // namespace wm::detail
