// SPDX-License-Identifier: Apache-2.0
// The exchange engine's transports: rows from their owners back to the asking rank (the
// distributed gather: NCCL, copy-engine mailbox or put, pipelined in pieces), and keys with rows
// (or gradients) from the asking rank to the owners (scatter, the embedding's backward).
#pragma once

#include <wm/comm.hpp>
#include <wm/detail/base/cuda.cuh>
#include <wm/detail/exchange/mailbox.cuh>
#include <wm/detail/exchange/plan.cuh>
#include <wm/detail/exchange/plan.hpp>
#include <wm/detail/exchange/room.cuh>
#include <wm/detail/exchange/scratch.cuh>
#include <wm/detail/rows/distinct.cuh>
#include <wm/detail/rows/move.cuh>
#include <wm/detail/rows/views.cuh>

#include <cub/device/device_radix_sort.cuh>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <vector>

namespace wm::detail {

/**
 * The owner side's reads of a distributed gather, from a table: `reader(keys, order, n, dst, s,
 * blocks_per_sm)` writes row keys[i] of the table to dst.row(order ? order[i] : i) (a zero row
 * and *err set for an invalid key), with a grid of at most @p blocks_per_sm blocks per
 * multiprocessor (see plan_row_launch).
 */
template <class Rows>
struct table_reader {
  Rows table;
  std::size_t stride_bytes;  ///< the table's row stride
  std::size_t row_bytes;
  unsigned* err;
  template <class Index>
  void operator()(Index const* keys, std::size_t const* order, std::size_t n, packed_rows dst,
                  cudaStream_t s, int blocks_per_sm) const {
    launch_gather(table, keys, order, n, dst, row_bytes, stride_bytes, err, s, std::false_type{},
                  blocks_per_sm);
  }
};

/**
 * As table_reader, reading each distinct row of a batch once (host tables: the rows cross PCIe
 * once however often a batch asks for them; distinct.cuh). Batches below
 * host_distinct_threshold are read as table_reader does. Its sorts use @p ws on the stream
 * @p ws_stream and @p aux_ws on any other (the engine reads this rank's own rows on a side
 * stream beside the pieces).
 */
template <class Rows, class Fresh = std::false_type>
struct distinct_reader {
  Rows table;
  std::size_t stride_bytes;
  std::size_t row_bytes;
  unsigned* err;
  int bits;  ///< radix bits that order every valid local row (row_bits of the local rows)
  workspace* ws;
  cudaStream_t ws_stream;
  workspace* aux_ws;
  Fresh fresh;  ///< ld.cv loads (rows another GPU may have written): a bool or bool_constant
  /// Appends to @p out the workspaces that its reads of at most @p on_ws keys on `ws_stream` and
  /// of at most @p on_aux keys on another stream take (the gather reserves them with the rest of
  /// what the counts size, see reserve_received).
  template <class Index>
  void rooms(std::size_t on_ws, std::size_t on_aux, std::vector<room_request>& out) const {
    if (on_ws >= host_distinct_threshold) {
      out.push_back({ws, plan_distinct_bytes<Index>(on_ws, bits, ws_stream)});
    }
    if (on_aux >= host_distinct_threshold) {
      out.push_back({aux_ws, plan_distinct_bytes<Index>(on_aux, bits, ws_stream)});
    }
  }
  template <class Index>
  void operator()(Index const* keys, std::size_t const* order, std::size_t n, packed_rows dst,
                  cudaStream_t s, int blocks_per_sm) const {
    if (n < host_distinct_threshold) {
      launch_gather(table, keys, order, n, dst, row_bytes, stride_bytes, err, s, fresh,
                    blocks_per_sm);
      return;
    }
    auto const b = plan_distinct(keys, n, bits, s == ws_stream ? *ws : *aux_ws, s);
    read_distinct(table, b, order, dst, row_bytes, stride_bytes, err, s, fresh, blocks_per_sm);
  }
};

/**
 * The rows of a planned gather (@p p, planned without order: the gather's plan) from their owners
 * into @p out (dense rows of @p rb bytes, the caller's order; zero rows for invalid indices).
 * @p read: the owner side's reads of this rank's rows, called as `read(keys, order, n, dst, s,
 * blocks_per_sm)` (see table_reader). Collective, as the plan.
 */
template <class Reader, class Index>
requires std::invocable<Reader&, Index const*, std::size_t const*, std::size_t, packed_rows,
                        cudaStream_t, int>
void gather_rows(communicator& comm, exchange_scratch& sc, dispatch_plan_device<Index> const& p,
                 Reader&& read, std::size_t n, std::byte* out, std::size_t rb, cudaStream_t s) {
  auto const world = static_cast<std::size_t>(comm.size());
  auto const me    = static_cast<std::size_t>(comm.rank());
  bool const put   = mailbox_ready(comm, sc, p.most_remote * rb);
  bool const copy  = put && sc.mail.copy;  // gathered here, then copied into the mailboxes
  // Rows this rank owns are served in place; only the other ranks' share crosses.
  auto remote_send   = p.send_counts;  // keys out = rows back in
  auto remote_recv   = p.recv_counts;  // keys in = rows out
  remote_send[me]    = 0;
  remote_recv[me]    = 0;
  auto const key_at  = block_starts(p.send_counts);  // in p.send_keys and p.order
  auto const back_at = block_starts(remote_send);    // in back (the mailbox when put)
  auto const recv_at = block_starts(remote_recv);    // in recv_keys and rows_out
  int pieces         = 0;
  for (std::size_t q = 0; q < world; ++q) {
    pieces = std::max({pieces, pieces_of(remote_send[q], rb), pieces_of(remote_recv[q], rb)});
  }
  bool const own_beside = put && !copy && pieces > 0;  // see 3. below
  carver c;
  auto const o_keys  = c.add<Index>(recv_at[world]);
  auto const o_flags = c.add<unsigned>(2 * world);
  auto const o_rows  = c.add<std::byte>(put && !copy ? 0 : recv_at[world] * rb);
  auto const o_back  = c.add<std::byte>(put ? 0 : back_at[world] * rb);
  // Sized by what this rank receives: every rank has its room before any key moves, the reader's
  // too where it says what it takes (the most keys it reads at once on each stream).
  std::vector<room_request> rooms{{&sc.b, c.total()}};
  if constexpr (requires(std::vector<room_request> & out) {
                  read.template rooms<Index>(std::size_t{}, std::size_t{}, out);
                }) {
    std::size_t on_s = own_beside ? 0 : p.send_counts[me];
    for (std::size_t q = 0; q < world; ++q) {
      for (int k = 0; k < pieces; ++k) {
        auto const x = piece_of(remote_recv[q], rb, k);
        on_s         = std::max(on_s, x.last - x.first);
      }
    }
    read.template rooms<Index>(on_s, own_beside ? p.send_counts[me] : 0, rooms);
  }
  std::byte* base = reserve_received(comm, p, exchange_op::gather, rooms, s)[0];
  auto* recv_keys = c.take<Index>(base, o_keys);
  auto* flags     = c.take<unsigned>(base, o_flags);
  auto* rows_out  = c.take<std::byte>(base, o_rows);
  auto* back      = !put || sc.mail.at.empty() ? c.take<std::byte>(base, o_back) : sc.mail.at[me];
  packed_rows const dst{out, rb};

  // 1. Keys to their owners (not to this rank).
  {
    std::vector<communicator::send_part> sends;
    std::vector<communicator::recv_part> recvs;
    for (std::size_t q = 0; q < world; ++q) {
      sends.push_back(
          {static_cast<int>(q), p.send_keys + key_at[q], remote_send[q] * sizeof(Index)});
      recvs.push_back(
          {static_cast<int>(q), recv_keys + recv_at[q], remote_recv[q] * sizeof(Index)});
    }
    comm.send_recv(sends, recvs, cuda::stream_ref{s});
  }
  // 2. Pipelined rows in pieces (both ends cut a peer's rows alike, see `pieces_of`). This stream
  //    gathers piece k of every peer's request — into the peer's mailbox, or into a send buffer
  //    that NCCL moves on the side stream — while the side stream puts piece k - 1 in the
  //    caller's order. While pieces are in flight the kernels get grids of a few blocks per SM
  //    at most (a smaller grid, not a per-SM limit): the gather kernel's blocks stay until its
  //    rows are done, and the other streams' blocks (NCCL's among them) need room beside them.
  int const room = 3;
  // Put kernels wait on NVLink stores, not on memory: they take every slot (measured on 2 H200s,
  // 1M keys: room 3 -> 8 took 1.27 -> 1.15 ms), and the own rows and the reordering, which
  // hide behind them, take little (bench/NOTES.md).
  int const put_room = 8, side_room = 4, own_room = 1;
  cudaStream_t const side = pieces > 0 || put ? sc.side.get() : nullptr;
  if (put && pieces > 0) {
    WM_CUDA_TRY(cudaMemsetAsync(flags, 0, 2 * world * sizeof(unsigned), s));
  }
  // 3. This rank's own rows, straight from the table to their output rows: on the aux stream
  //    beside the pieces when kernels put the rows (they wait on NVLink, not on memory); after
  //    the pieces on this stream otherwise, while the last ones cross.
  cudaStream_t const own = own_beside ? sc.side.aux() : s;
  if (own != s) {
    WM_CUDA_TRY(cudaEventRecord(sc.side.forked(), s));
    WM_CUDA_TRY(cudaStreamWaitEvent(own, sc.side.forked(), 0));
  }
  if (own_beside || pieces == 0) {
    read(p.send_keys + key_at[me], p.order + key_at[me], p.send_counts[me], dst, own,
         pieces > 0 ? own_room : 8);
  }
  if (own != s) { WM_CUDA_TRY(cudaEventRecord(sc.side.joined(), own)); }
  // Piece k of every peer's answer, arrived in `back`, to the caller's order: back row j of
  // peer q's block is output row order[key_at[q] + j].
  auto const reorder = [&](int k, cudaStream_t on, int blocks_per_sm) {
    for (std::size_t q = 0; q < world; ++q) {
      auto const in_piece    = piece_of(remote_send[q], rb, k);
      std::size_t const n_in = in_piece.last - in_piece.first;
      if (n_in == 0) { continue; }
      launch_gather(local_rows{back + (back_at[q] + in_piece.first) * rb, n_in, rb},
                    static_cast<std::size_t const*>(nullptr), p.order + key_at[q] + in_piece.first,
                    n_in, dst, rb, rb, sc.err.data(), on, std::false_type{}, blocks_per_sm);
    }
  };
  struct copy_part {
    std::byte* to;
    std::byte const* from;
    std::size_t bytes;
  };
  for (int k = 0; k < pieces; ++k) {
    std::vector<communicator::send_part> sends;
    std::vector<communicator::recv_part> recvs;
    std::vector<copy_part> copies;
    for (std::size_t i = 1; i <= world; ++i) {
      std::size_t const q     = (me + i) % world;  // ranks start with different owners
      auto const out_piece    = piece_of(remote_recv[q], rb, k);
      auto const in_piece     = piece_of(remote_send[q], rb, k);
      std::size_t const n_out = out_piece.last - out_piece.first;
      std::size_t const n_in  = in_piece.last - in_piece.first;
      std::byte* const mail =
          put ? sc.mail.at[q] + (p.mail_offsets[q] + out_piece.first) * rb : nullptr;
      std::byte* const rows = put && !copy ? mail : rows_out + (recv_at[q] + out_piece.first) * rb;
      if (n_out > 0) {
        read(recv_keys + recv_at[q] + out_piece.first, static_cast<std::size_t const*>(nullptr),
             n_out, packed_rows{rows, rb}, s, put ? put_room : room);
        if (copy) { copies.push_back({mail, rows, n_out * rb}); }
      }
      if (put) {
        // Only a flag crosses NCCL: the rows are in q's mailbox once this stream's kernel is done.
        sends.push_back({static_cast<int>(q), flags + q, n_out > 0 ? sizeof(unsigned) : 0});
        recvs.push_back({static_cast<int>(q), flags + world + q, n_in > 0 ? sizeof(unsigned) : 0});
      } else {
        sends.push_back({static_cast<int>(q), rows, n_out * rb});
        recvs.push_back(
            {static_cast<int>(q), back + (back_at[q] + in_piece.first) * rb, n_in * rb});
      }
    }
    WM_CUDA_TRY(cudaEventRecord(sc.side.ready(k), s));
    if (copy) {
      // The copy engines move piece k over NVLink (aux stream) while this stream gathers the next.
      cudaStream_t const ce = sc.side.aux();
      WM_CUDA_TRY(cudaStreamWaitEvent(ce, sc.side.ready(k), 0));
      for (auto const& part : copies) {
        WM_CUDA_TRY(cudaMemcpyAsync(part.to, part.from, part.bytes, cudaMemcpyDeviceToDevice, ce));
      }
      WM_CUDA_TRY(cudaEventRecord(sc.side.copied(k), ce));
      WM_CUDA_TRY(cudaStreamWaitEvent(side, sc.side.copied(k), 0));
    } else {
      WM_CUDA_TRY(cudaStreamWaitEvent(side, sc.side.ready(k), 0));
    }
    comm.send_recv(sends, recvs, cuda::stream_ref{side});
    if (put) { reorder(k, side, side_room); }  // 4 (put): on the side stream, beside the next piece
    WM_CUDA_TRY(cudaEventRecord(sc.side.arrived(k), side));
  }
  // 3 (NCCL, copy). This rank's own rows while the last pieces cross.
  if (pieces > 0 && !own_beside) {
    read(p.send_keys + key_at[me], p.order + key_at[me], p.send_counts[me], dst, s, room);
  }
  if (put) {
    if (pieces > 0) { WM_CUDA_TRY(cudaStreamWaitEvent(s, sc.side.arrived(pieces - 1), 0)); }
    if (own != s) { WM_CUDA_TRY(cudaStreamWaitEvent(s, sc.side.joined(), 0)); }
  } else {
    // 4 (NCCL). Arrived pieces to the caller's order, on this stream.
    for (int k = 0; k < pieces; ++k) {
      WM_CUDA_TRY(cudaStreamWaitEvent(s, sc.side.arrived(k), 0));
      reorder(k, s, k + 1 < pieces ? room : 8);
    }
  }
  // Invalid indices sit at the end of the grouped order: zero rows (the error is already set).
  launch_gather(local_rows{back, 0, rb}, static_cast<std::size_t const*>(nullptr),
                p.order + p.n_sent, n - p.n_sent, dst, rb, rb, sc.err.data(), s);
}

/**
 * As above, the owner side reading @p table (this rank's rows, of stride @p stride_bytes) through
 * table_reader.
 */
template <class Rows, class Index>
void gather_rows(communicator& comm, exchange_scratch& sc, dispatch_plan_device<Index> const& p,
                 Rows const& table, std::size_t stride_bytes, std::size_t n, std::byte* out,
                 std::size_t rb, cudaStream_t s) {
  gather_rows(comm, sc, p, table_reader<Rows>{table, stride_bytes, rb, sc.err.data()}, n, out, rb,
              s);
}

/// What reached an owner: @p n local rows (keys) and one row of values each, in the order of
/// the ranks that sent them (this rank's own share at its place), each rank's in its order.
/// `sort`: the scatter's owner-side sort room (scatter_sort_room), reserved with the batch.
template <class Index>
struct owner_batch {
  Index const* keys;
  std::byte const* rows;
  std::size_t n;
  std::byte* sort{};
};

/// The layout of the scatter's owner-side sort of @p m keys (positions, sorted keys and
/// positions, CUB's room) in one workspace.
template <class Index>
struct scatter_sort_room {
  std::size_t cub_bytes{};
  int bits{int{sizeof(Index) * 8}};
  carver c;
  std::size_t o_pos{}, o_sk{}, o_sp{}, o_cub{};
  scatter_sort_room(std::size_t m, cudaStream_t s) {
    WM_CUDA_TRY(cub::DeviceRadixSort::SortPairs(
        nullptr, cub_bytes, static_cast<Index const*>(nullptr), static_cast<Index*>(nullptr),
        static_cast<std::size_t const*>(nullptr), static_cast<std::size_t*>(nullptr), m, 0, bits,
        s));
    o_pos = c.add<std::size_t>(m);
    o_sk  = c.add<Index>(m);
    o_sp  = c.add<std::size_t>(m);
    o_cub = c.add<std::byte>(cub_bytes);
  }
  [[nodiscard]] std::size_t total() const noexcept { return c.total(); }
};

/**
 * Keys and rows (values, gradients) of a planned exchange (@p p, planned in order) to their
 * owners. This rank's own share goes straight into its batch; only the other ranks' shares
 * cross, keys and rows in one NCCL group. @p rows: the caller's dense rows of @p rb bytes (need
 * only be aligned for their element type); @p ws: where the batch is kept (a scatter's owner-side
 * sort too). @p also: further workspaces the owner side will take, sized from the counts (the
 * embedding's update). Every one of them is reserved, and agreed on by every rank, before anything
 * moves (reserve_received). Collective.
 */
template <class Index>
owner_batch<Index> send_to_owners(communicator& comm, dispatch_plan_device<Index> const& p,
                                  std::byte const* rows, std::size_t n, std::size_t rb,
                                  workspace& ws, unsigned* err, cudaStream_t s,
                                  room_request also = {nullptr, 0}) {
  auto const me         = static_cast<std::size_t>(comm.rank());
  auto const key_at     = block_starts(p.send_counts);  // in p.order and p.send_keys
  auto const recv_at    = block_starts(p.recv_counts);  // in the owner's batch
  std::size_t const own = p.send_counts[me];
  exchange_op const op  = p.headers[me].op;
  bool const sorts      = op == exchange_op::scatter;  // its owner side sorts in this workspace
  scatter_sort_room<Index> const sort{sorts ? p.n_recv : 0, s};
  carver c;
  auto const o_send = c.add<std::byte>((p.n_sent - own) * rb);
  auto const o_keys = c.add<Index>(p.n_recv);
  auto const o_rows = c.add<std::byte>(p.n_recv * rb);
  auto const o_sort = c.add<std::byte>(sorts ? sort.total() : 0);
  auto const bases = also.ws != nullptr ? reserve_received(comm, p, op, {{&ws, c.total()}, also}, s)
                                        : reserve_received(comm, p, op, {{&ws, c.total()}}, s);
  std::byte* base  = bases[0];
  auto* send_rows  = c.take<std::byte>(base, o_send);
  auto* recv_keys  = c.take<Index>(base, o_keys);
  auto* recv_rows  = c.take<std::byte>(base, o_rows);
  local_rows const caller{const_cast<std::byte*>(rows), n, rb};
  // The caller's rows need only be aligned for their type (e.g. an odd-element slice of half
  // values): vectors no wider than both the row size and that address allow.
  std::uintptr_t const alignment =
      std::gcd(static_cast<std::uintptr_t>(rb), reinterpret_cast<std::uintptr_t>(rows));
  auto pack = [&](std::size_t first, std::size_t count, std::byte* to) {
    launch_gather(caller, p.order + first, static_cast<std::size_t const*>(nullptr), count,
                  packed_rows{to, rb}, rb, alignment, err, s);
  };
  pack(0, key_at[me], send_rows);  // peers before this rank, then those after it
  pack(key_at[me + 1], p.n_sent - key_at[me + 1], send_rows + key_at[me] * rb);
  pack(key_at[me], own, recv_rows + recv_at[me] * rb);
  if (own > 0) {
    WM_CUDA_TRY(cudaMemcpyAsync(recv_keys + recv_at[me], p.send_keys + key_at[me],
                                own * sizeof(Index), cudaMemcpyDeviceToDevice, s));
  }
  std::vector<communicator::send_part> sends;
  std::vector<communicator::recv_part> recvs;
  for (std::size_t q = 0; q < p.send_counts.size(); ++q) {
    if (q == me) { continue; }
    std::size_t const sent_before = key_at[q] - (q > me ? own : 0);  // rows of send_rows before q's
    sends.push_back(
        {static_cast<int>(q), p.send_keys + key_at[q], p.send_counts[q] * sizeof(Index)});
    sends.push_back({static_cast<int>(q), send_rows + sent_before * rb, p.send_counts[q] * rb});
    recvs.push_back(
        {static_cast<int>(q), recv_keys + recv_at[q], p.recv_counts[q] * sizeof(Index)});
    recvs.push_back({static_cast<int>(q), recv_rows + recv_at[q] * rb, p.recv_counts[q] * rb});
  }
  comm.send_recv(sends, recvs, cuda::stream_ref{s});
  return {recv_keys, recv_rows, p.n_recv, sorts ? c.take<std::byte>(base, o_sort) : nullptr};
}

/**
 * Owner side of a scatter: writes the batch's rows into @p table (last of each run of equal keys
 * wins: keys are sorted stably, so the highest sending rank, then its last position). The sort's
 * room: the batch's (reserved by send_to_owners with the batch), else @p ws.
 */
template <class Rows, class Index>
void scatter_owner_rows(owner_batch<Index> const& batch, Rows const& table, std::size_t rb,
                        std::size_t stride_bytes, workspace& ws, unsigned* err, cudaStream_t s) {
  std::size_t const m = batch.n;
  if (m == 0) { return; }
  scatter_sort_room<Index> const room{m, s};
  std::byte* base       = batch.sort != nullptr ? batch.sort : ws.reserve(room.total(), s);
  auto* pos             = room.c.template take<std::size_t>(base, room.o_pos);
  auto* sorted_keys     = room.c.template take<Index>(base, room.o_sk);
  auto* sorted_pos      = room.c.template take<std::size_t>(base, room.o_sp);
  std::size_t cub_bytes = room.cub_bytes;
  iota_async(pos, m, 0, s);
  WM_CUDA_TRY(cub::DeviceRadixSort::SortPairs(room.c.template take<std::byte>(base, room.o_cub),
                                              cub_bytes, batch.keys, sorted_keys, pos, sorted_pos,
                                              m, 0, room.bits, s));
  launch_scatter(table, sorted_keys, sorted_pos, m,
                 packed_rows{const_cast<std::byte*>(batch.rows), rb}, rb, stride_bytes, err, s);
}

}  // namespace wm::detail
