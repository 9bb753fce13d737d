// SPDX-License-Identifier: Apache-2.0
// Kernels of the exchange engine's dispatch plan: the owner lookup (owner rank and local row of
// each index, counted per owner), the grouping by owner, and the count words of the exchange.
#pragma once

#include <wm/detail/base/cuda.cuh>
#include <wm/detail/exchange/plan.hpp>
#include <wm/detail/rows/views.cuh>
#include <wm/error.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

namespace wm::detail {

/// Ranks whose per-owner counts the locate kernel keeps in shared memory (more: global atomics).
inline constexpr int locate_shared_ranks = 4096;

/**
 * For the dispatch path: owner rank (world for an invalid index) and local row of each index,
 * the identity position (for the sort; @p position may be null when nothing sorts), and the
 * count per owner. @p owner is int for place_by_owner_kernel, or the index type where the owners
 * are radix-sort keys: the sort then shares its instantiation with the index sorts of the same
 * translation unit (one CUB radix sort compiled instead of two). Counting with one global atomic
 * per index serialized a million indices on a few addresses (~0.8 ms); lanes with the same owner
 * add once per warp, into the block's counters, which go to @p counts once per block.
 */
template <class Map, class Index, class Owner>
__global__ void locate_kernel(Map map, Index const* idx, std::size_t n, int world, Owner* owner,
                              Index* local, std::size_t* position, unsigned long long* counts,
                              unsigned* err) {
  extern __shared__ unsigned long long block_counts[];  // world + 1 when they fit
  bool const in_shared = world < locate_shared_ranks;
  if (in_shared) {
    for (int r = static_cast<int>(threadIdx.x); r <= world; r += static_cast<int>(blockDim.x)) {
      block_counts[r] = 0;
    }
    __syncthreads();
  }
  unsigned long long* const tally = in_shared ? block_counts : counts;
  for (std::size_t i = grid_thread(); i < n; i += grid_threads()) {
    Index const k = idx[i];
    int r         = world;
    Index l       = 0;
    if (valid_index(k, map.rows())) {
      auto const at = map.locate(static_cast<std::size_t>(k));
      r             = at.rank;
      l             = static_cast<Index>(at.local);
    } else {
      atomicOr(err, 1u);
    }
    owner[i] = static_cast<Owner>(r);
    local[i] = l;
    if (position != nullptr) { position[i] = i; }
    unsigned const same = __match_any_sync(__activemask(), r);
    if (static_cast<int>(threadIdx.x % 32) == __ffs(static_cast<int>(same)) - 1) {
      atomicAdd(tally + r, static_cast<unsigned long long>(__popc(same)));
    }
  }
  if (in_shared) {
    __syncthreads();
    for (int r = static_cast<int>(threadIdx.x); r <= world; r += static_cast<int>(blockDim.x)) {
      if (block_counts[r] != 0) { atomicAdd(counts + r, block_counts[r]); }
    }
  }
}

/// Owners up to this count (plus the invalid group) are grouped by place_by_owner_kernel.
inline constexpr int place_shared_ranks = 1024;
inline constexpr int place_items        = 8;  // indices per thread per tile

/**
 * For the dispatch path when the order inside an owner's group does not matter (the gather):
 * groups indices by owner in one pass instead of a sort. Index i (owner[i], local row local[i],
 * from locate_kernel; owner == world: invalid) goes to a slot of its owner's group: order[slot]
 * = i, keys[slot] = local[i]. @p next: world + 1 counters that start at each group's first slot
 * (groups in rank order, invalid last). Each block takes tiles of place_items * blockDim.x
 * indices: it counts a tile's indices per owner in shared memory, claims their room with one
 * global atomic per owner, then places them, lanes with the same owner adding once per warp.
 */
template <class Index>
__global__ void place_by_owner_kernel(int const* owner, Index const* local, std::size_t n,
                                      int world, unsigned long long* next, std::size_t* order,
                                      Index* keys) {
  extern __shared__ unsigned long long tile_base[];  // world + 1, then world + 1 unsigned counts
  auto* const tile_count = reinterpret_cast<unsigned*>(tile_base + world + 1);
  unsigned const lane    = threadIdx.x % 32;
  std::size_t const tile = std::size_t{place_items} * blockDim.x;
  // The lanes of this warp that hold an index of this lane's owner (none if this lane holds none).
  auto const same_owner = [&](std::size_t i, int& r) {
    bool const in     = i < n;
    unsigned const m  = __ballot_sync(0xffffffffu, in);
    r                 = in ? owner[i] : 0;
    unsigned const eq = __match_any_sync(0xffffffffu, r);
    return in ? eq & m : 0u;
  };
  for (std::size_t first = blockIdx.x * tile; first < n; first += gridDim.x * tile) {
    for (int r = static_cast<int>(threadIdx.x); r <= world; r += static_cast<int>(blockDim.x)) {
      tile_count[r] = 0;
    }
    __syncthreads();
    for (int j = 0; j < place_items; ++j) {
      int r               = 0;
      unsigned const same = same_owner(first + j * std::size_t{blockDim.x} + threadIdx.x, r);
      if (same != 0 && lane == static_cast<unsigned>(__ffs(static_cast<int>(same)) - 1)) {
        atomicAdd(tile_count + r, __popc(same));
      }
    }
    __syncthreads();
    for (int r = static_cast<int>(threadIdx.x); r <= world; r += static_cast<int>(blockDim.x)) {
      if (tile_count[r] != 0) {
        tile_base[r] = atomicAdd(next + r, static_cast<unsigned long long>(tile_count[r]));
      }
      tile_count[r] = 0;
    }
    __syncthreads();
    for (int j = 0; j < place_items; ++j) {
      std::size_t const i = first + j * std::size_t{blockDim.x} + threadIdx.x;
      int r               = 0;
      unsigned const same = same_owner(i, r);
      if (same == 0) { continue; }
      int const leader = __ffs(static_cast<int>(same)) - 1;
      unsigned at      = 0;
      if (lane == static_cast<unsigned>(leader)) { at = atomicAdd(tile_count + r, __popc(same)); }
      at                     = __shfl_sync(same, at, leader);
      std::size_t const slot = tile_base[r] + at + __popc(same & ((1u << lane) - 1u));
      order[slot]            = i;
      keys[slot]             = local[i];
    }
    __syncthreads();  // the counters are reset for the next tile
  }
}

/// Launches place_by_owner_kernel (@p world below place_shared_ranks) on at most @p max_blocks
/// blocks of 256 threads (fewer when the indices fill fewer tiles).
template <class Index>
void launch_place_by_owner(int const* owner, Index const* local, std::size_t n, int world,
                           unsigned long long* next, std::size_t* order, Index* keys,
                           cudaStream_t stream, int max_blocks) {
  WM_EXPECTS(world >= 1 && world < place_shared_ranks,
             "place_by_owner: world " + std::to_string(world) + " outside [1, " +
                 std::to_string(place_shared_ranks) + ")");
  if (n == 0) { return; }
  std::size_t const tile = std::size_t{place_items} * 256;
  std::size_t const blocks =
      std::min((n + tile - 1) / tile, static_cast<std::size_t>(std::max(max_blocks, 1)));
  std::size_t const shared =
      (static_cast<std::size_t>(world) + 1) * (sizeof(unsigned long long) + sizeof(unsigned));
  place_by_owner_kernel<<<static_cast<int>(blocks), 256, shared, stream>>>(owner, local, n, world,
                                                                           next, order, keys);
  WM_CHECK_LAUNCH();
}

/// Three count words per peer q for the count exchange (the rows asked of q, where q's answer
/// starts among the rows this rank asks of other ranks, how many rows that is in all), then the
/// header words (the tag, row bytes and batch from the host, the invalid count from @p counts,
/// the tensor's exchange id from the host).
/// Also where each owner's group starts in the send order (world + 1 entries, invalid last).
template <class Word>
__global__ void dispatch_words_kernel(Word const* counts, int world, int me, Word tag,
                                      Word row_bytes, Word batch, Word tensor, Word* words,
                                      Word* starts) {
  if (blockIdx.x != 0 || threadIdx.x != 0) { return; }
  Word at = 0, sent = 0;
  for (int q = 0; q < world; ++q) {
    Word* w   = words + words_per_peer * q;
    w[0]      = counts[q];
    w[1]      = at;
    starts[q] = sent;
    if (q != me) { at += counts[q]; }
    sent += counts[q];
  }
  starts[world] = sent;
  for (int q = 0; q < world; ++q) {
    Word* w = words + words_per_peer * q;
    w[2]    = at;
    w[3]    = tag;
    w[4]    = row_bytes;
    w[5]    = batch;
    w[6]    = counts[world];
    w[7]    = tensor;
  }
}

}  // namespace wm::detail
