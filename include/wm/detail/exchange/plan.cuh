// SPDX-License-Identifier: Apache-2.0
// Step 1 of every exchange: owner and local row of each index, grouped by owner, and the count
// words exchanged with every peer. The words also carry each rank's header (operation, row
// bytes, index width, status, the tensor's exchange id), so that a rank that failed before the
// exchange, or ranks that made different calls, make every rank throw the same error right after
// it.
#pragma once

#include <wm/comm.hpp>
#include <wm/detail/base/cuda.cuh>
#include <wm/detail/exchange/owners.cuh>
#include <wm/detail/exchange/plan.hpp>
#include <wm/detail/exchange/scratch.cuh>
#include <wm/partition.hpp>

#include <cub/device/device_radix_sort.cuh>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <numeric>
#include <string>
#include <vector>

namespace wm::detail {

/// The plan of one exchange; host-side counts are valid on return (one stream sync).
template <class Index>
struct dispatch_plan_device {
  int* owner{};
  Index* local{};
  std::size_t* order{};  // positions in the caller's batch, grouped by owner
  Index* send_keys{};    // local rows to request, in send order
  std::vector<std::size_t> send_counts;
  std::vector<std::size_t> recv_counts;
  std::size_t n_sent{};
  std::size_t n_recv{};
  /// Per peer q: where, in rows, this rank's answer starts in q's mailbox (q's rows from the
  /// other ranks packed by owner, q's own share left out).
  std::vector<std::size_t> mail_offsets;
  /// The most rows any rank takes from other ranks in this call (the mailbox must hold them).
  std::size_t most_remote{};
  /// Every rank's header, in rank order (alike on every rank).
  std::vector<exchange_header> headers;
  /// The words of the agreement on the workspaces sized by the counts (room.cuh): world + 1 on
  /// the device, world in pinned host memory (the count words' host copy, read by then).
  unsigned long long* agree{};
  unsigned long long* agree_host{};
};

/// What the caller of an exchange says about its call.
struct exchange_call {
  exchange_op op;
  std::size_t row_bytes;
  /// A fault found before the plan (e.g. a null rows pointer); the rank still exchanges its words.
  exchange_fault fault{exchange_fault::none};
};

/// Exclusive prefix sums: where each peer's block starts (size + 1 entries).
[[nodiscard]] inline std::vector<std::size_t> block_starts(std::vector<std::size_t> const& counts) {
  std::vector<std::size_t> at(counts.size() + 1, 0);
  std::partial_sum(counts.begin(), counts.end(), at.begin() + 1);
  return at;
}

inline std::vector<std::size_t> scaled(std::vector<std::size_t> v, std::size_t f) {
  for (auto& x : v) { x *= f; }
  return v;
}

/// The fault an exception thrown before the exchange stands for.
[[nodiscard]] inline exchange_fault fault_of(std::exception_ptr const& e) {
  try {
    std::rethrow_exception(e);
  } catch (cuda_error const&) { return exchange_fault::cuda; } catch (logic_error const&) {
    return exchange_fault::bad_argument;
  } catch (...) { return exchange_fault::other; }
}

/**
 * Plans an exchange of @p n indices (collective). @p map: the mapping's device ref (`rows()`,
 * `locate(k)` -> {rank, local}). @p in_order: keep the caller's order inside
 * each owner's group (scatter, apply: last duplicate wins, sums in a fixed order); without it
 * one placing pass replaces the sort (gather). Every rank takes part in the count exchange even
 * when its own call is bad (null @p idx with n > 0, a workspace it cannot get): after the
 * exchange every rank throws the same error (`wm::logic_error` for bad arguments and calls that
 * differ between ranks: operation, row bytes, index width or tensor (`exchange_scratch::id`),
 * `wm::comm_error` for a CUDA failure on some rank).
 */
template <class Map, class Index>
dispatch_plan_device<Index> plan_exchange(communicator& comm, Map map, Index const* idx,
                                          std::size_t n, exchange_scratch& scratch, cudaStream_t s,
                                          exchange_call call, bool in_order = true) {
  int const world  = comm.size();
  auto const w     = static_cast<std::size_t>(world);
  auto const wpp   = static_cast<std::size_t>(words_per_peer);
  int const bits   = owner_bits(world);
  bool const place = !in_order && world < place_shared_ranks;

  exchange_fault fault = call.fault;
  if (fault == exchange_fault::none && n > 0 && idx == nullptr) {
    fault = exchange_fault::null_pointer;
  }
  exchange_header const mine{
      call.op, fault, static_cast<std::uint8_t>(sizeof(Index)), call.row_bytes, n, 0, scratch.id};

  // counts (world + 1; the last: invalid), words received, words sent, group starts.
  auto* counts = scratch.words.data();
  auto* recv   = counts + w + 1;
  auto* words  = recv + wpp * w;
  auto* starts = words + wpp * w;

  dispatch_plan_device<Index> p;
  if (fault == exchange_fault::none) {
    try {
      carver c;
      // Owners: int for place_by_owner; the index type where they are sort keys (see
      // locate_kernel).
      auto const o_owner    = c.add<int>(place ? n : 0);
      auto const o_okeys    = c.add<Index>(place ? 0 : n);
      auto const o_sowner   = c.add<Index>(place ? 0 : n);
      auto const o_local    = c.add<Index>(n);
      auto const o_pos      = c.add<std::size_t>(place ? 0 : n);
      auto const o_order    = c.add<std::size_t>(n);
      auto const o_keys     = c.add<Index>(n);
      std::size_t cub_bytes = 0;
      if (!place) {
        WM_CUDA_TRY(cub::DeviceRadixSort::SortPairs(
            nullptr, cub_bytes, static_cast<Index const*>(nullptr), static_cast<Index*>(nullptr),
            static_cast<std::size_t const*>(nullptr), static_cast<std::size_t*>(nullptr),
            std::max<std::size_t>(n, 1), 0, bits, s));
      }
      auto const o_cub   = c.add<std::byte>(cub_bytes);
      auto const o_agree = c.add<unsigned long long>(w + 1);
      std::byte* base    = scratch.a.reserve(c.total(), s);
      p.agree            = c.take<unsigned long long>(base, o_agree);
      p.agree_host       = scratch.words_host.data();
      p.owner            = place ? c.take<int>(base, o_owner) : nullptr;
      p.local            = c.take<Index>(base, o_local);
      p.order            = c.take<std::size_t>(base, o_order);
      p.send_keys        = c.take<Index>(base, o_keys);
      auto* pos          = c.take<std::size_t>(base, o_pos);
      auto* owner_keys   = c.take<Index>(base, o_okeys);
      auto* sowner       = c.take<Index>(base, o_sowner);
      WM_CUDA_TRY(cudaMemsetAsync(counts, 0, (w + 1) * sizeof(unsigned long long), s));
      if (n > 0) {
        std::size_t const shared =
            world < locate_shared_ranks ? (w + 1) * sizeof(unsigned long long) : 0;
        auto const locate = [&](auto* owner) {
          locate_kernel<<<elementwise_blocks(n), 256, shared, s>>>(map, idx, n, world, owner,
                                                                   p.local, place ? nullptr : pos,
                                                                   counts, scratch.err.data());
        };
        if (place) {
          locate(p.owner);
        } else {
          locate(owner_keys);
        }
        WM_CHECK_LAUNCH();
      }
      // Counts and headers travel on the device, then both directions come back at once.
      dispatch_words_kernel<<<1, 1, 0, s>>>(
          counts, world, comm.rank(), static_cast<unsigned long long>(header_tag(mine)),
          static_cast<unsigned long long>(call.row_bytes), static_cast<unsigned long long>(n),
          static_cast<unsigned long long>(scratch.id), words, starts);
      WM_CHECK_LAUNCH();
      if (place) {
        launch_place_by_owner(p.owner, p.local, n, world, starts, p.order, p.send_keys, s,
                              elementwise_blocks(n));
      } else if (n > 0) {
        WM_CUDA_TRY(cub::DeviceRadixSort::SortPairs(c.take<std::byte>(base, o_cub), cub_bytes,
                                                    owner_keys, sowner, pos, p.order, n, 0, bits,
                                                    s));
        permute_async(p.local, p.order, n, p.send_keys, s);
      }
    } catch (...) { fault = fault_of(std::current_exception()); }
  }
  if (fault != exchange_fault::none) {
    // This rank still sends its words (no rows asked, its fault in the header) so that its
    // peers learn of the fault now instead of waiting for rows that never come.
    exchange_header bad = mine;
    bad.fault           = fault;
    auto* host          = scratch.words_host.data();
    for (std::size_t q = 0; q < w; ++q) {
      auto* x = host + wpp * q;
      x[0] = x[1] = x[2] = 0;
      x[3]               = header_tag(bad);
      x[4]               = call.row_bytes;
      x[5]               = n;
      x[6]               = 0;
      x[7]               = scratch.id;
    }
    WM_CUDA_TRY(cudaMemcpyAsync(words, host, wpp * w * sizeof(unsigned long long),
                                cudaMemcpyHostToDevice, s));
  }
  comm.all_to_all(static_cast<unsigned long long const*>(words), recv, wpp, cuda::stream_ref{s});
  WM_CUDA_TRY(cudaMemcpyAsync(scratch.words_host.data(), counts,
                              (w + 1 + wpp * w) * sizeof(unsigned long long),
                              cudaMemcpyDeviceToHost, s));
  comm.synchronize(cuda::stream_ref{s},
                   "the distributed exchange's count words");  // a dead peer: an error
  auto const* host = scratch.words_host.data();
  auto const* got  = host + w + 1;
  for (std::size_t q = 0; q < w; ++q) {
    std::uint64_t hw[header_words];
    std::copy_n(got + wpp * q + count_words, header_words, hw);
    p.headers.push_back(read_header(hw));
  }
  if (auto const msg = check_headers(p.headers); !msg.empty()) {
    bool const user = std::ranges::all_of(p.headers, [](exchange_header const& h) {
      return h.fault == exchange_fault::none || h.fault == exchange_fault::null_pointer ||
             h.fault == exchange_fault::bad_argument;
    });
    if (user) { throw logic_error{msg}; }
    throw comm_error{msg};
  }
  p.send_counts.assign(host, host + w);
  for (std::size_t q = 0; q < w; ++q) {
    p.recv_counts.push_back(got[wpp * q]);
    p.mail_offsets.push_back(got[wpp * q + 1]);
    p.most_remote = std::max<std::size_t>(p.most_remote, got[wpp * q + 2]);
  }
  p.n_sent = std::accumulate(p.send_counts.begin(), p.send_counts.end(), std::size_t{0});
  p.n_recv = std::accumulate(p.recv_counts.begin(), p.recv_counts.end(), std::size_t{0});
  return p;
}

}  // namespace wm::detail
