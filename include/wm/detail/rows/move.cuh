// SPDX-License-Identifier: Apache-2.0
// Kernels of the exchange engine: the row gather/scatter kernel (it moves bytes: element types
// only set the row size), the owner lookup and the grouping by owner of the dispatch plan.
//
// A group of G lanes (G = 1..32, a power of two) moves one row with vector accesses of
// sizeof(Vec) bytes; each group keeps U rows in flight (U loads issued before the first store).
// Gather and scatter differ only in where each row comes from and goes to (gather_moves,
// scatter_moves).
#pragma once

#include <wm/detail/base/cuda.cuh>
#include <wm/detail/exchange/plan.hpp>
#include <wm/error.hpp>
#include <wm/partition.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

namespace wm::detail {

/// Rows reached through per-rank chunk pointers (mapped layouts).
template <class Mapping>
struct mapped_rows {
  std::byte* const* chunks;
  mapping_ref<Mapping> map;
  std::size_t stride_bytes;
  [[nodiscard]] __device__ std::size_t rows() const { return map.rows(); }
  [[nodiscard]] __device__ std::byte* row(std::size_t k) const {
    auto const at = map.locate(k);
    return chunks[at.rank] + at.local * stride_bytes;
  }
};

/// This rank's rows, by local index (distributed layout, owner side).
struct local_rows {
  std::byte* base;
  std::size_t n_rows;
  std::size_t stride_bytes;
  [[nodiscard]] __device__ std::size_t rows() const { return n_rows; }
  [[nodiscard]] __device__ std::byte* row(std::size_t k) const { return base + k * stride_bytes; }
};

/// Packed rows in a buffer (send/receive buffers, caller-provided values/out).
struct packed_rows {
  std::byte* base;
  std::size_t stride_bytes;
  [[nodiscard]] __device__ std::byte* row(std::size_t i) const { return base + i * stride_bytes; }
};

template <class Index>
[[nodiscard]] __device__ inline bool valid_index(Index k, std::size_t rows) {
  if constexpr (std::is_signed_v<Index>) {
    if (k < 0) { return false; }
  }
  return static_cast<std::size_t>(k) < rows;
}

inline constexpr int unroll = 4;

/// Loads a vector; `Fresh` (ld.cv) refetches host memory instead of trusting a line cached in
/// this GPU's L2, so rows another GPU rewrote are always seen, whatever the caching of system
/// memory between kernels. Otherwise the read-only path: sources do not change during a copy.
template <bool Fresh, class Vec>
[[nodiscard]] __device__ inline Vec load_vec(Vec const* p) {
  if constexpr (Fresh) {
    return __ldcv(p);
  } else {
    return __ldg(p);
  }
}

/// Stores a vector; `Through` writes through this GPU's L2 to memory (host rows other GPUs
/// read); otherwise a streaming store (the destination is not read back by this kernel).
template <bool Through, class Vec>
__device__ inline void store_vec(Vec* p, Vec v) {
  if constexpr (Through) {
    __stwt(p, v);
  } else {
    __stcs(p, v);
  }
}

/// Where one row comes from and goes to: no source with a destination writes a zero row; no
/// destination skips the row.
struct row_move {
  std::byte const* src;
  std::byte* dst;
};

/// Gather: out.row(i) (or out.row(order[i])) = rows.row(idx[i]); invalid indices set *err.
template <class Rows, class Index>
struct gather_moves {
  Rows rows;
  Index const* idx;  // null: identity
  std::size_t const* order;
  packed_rows out;
  unsigned* err;
  [[nodiscard]] __device__ row_move operator()(std::size_t i, int lane) const {
    Index const k = idx != nullptr ? idx[i] : static_cast<Index>(i);
    row_move m{nullptr, out.row(order != nullptr ? order[i] : i)};
    if (valid_index(k, rows.rows())) {
      m.src = rows.row(static_cast<std::size_t>(k));
    } else if (lane == 0) {
      atomicOr(err, 1u);
    }
    return m;
  }
};

/// Scatter: rows.row(keys[j]) = values.row(pos[j]) for the last j of each run of equal keys
/// (keys sorted stably, so the last occurrence in the caller's order wins); invalid keys set *err.
template <class Rows, class Index>
struct scatter_moves {
  Rows rows;
  Index const* keys;
  std::size_t const* pos;
  std::size_t n;
  packed_rows values;
  unsigned* err;
  [[nodiscard]] __device__ row_move operator()(std::size_t j, int lane) const {
    Index const k = keys[j];
    if (!valid_index(k, rows.rows())) {
      if (lane == 0) { atomicOr(err, 1u); }
      return {nullptr, nullptr};
    }
    if (j + 1 < n && keys[j + 1] == k) { return {nullptr, nullptr}; }
    return {values.row(pos[j]), rows.row(static_cast<std::size_t>(k))};
  }
};

/**
 * Moves rows i < n as @p moves says. A group of `group` lanes moves one row in vectors of Vec;
 * each group keeps `unroll` rows in flight (all their loads issued before the first store).
 */
template <class Vec, bool Fresh, bool Through, class Moves>
__global__ void __launch_bounds__(256)
    move_rows_kernel(Moves moves, std::size_t n, std::size_t row_vecs, int group) {
  std::size_t const tid    = grid_thread();
  std::size_t const groups = grid_threads() / static_cast<std::size_t>(group);
  std::size_t const g      = tid / static_cast<std::size_t>(group);
  int const lane           = static_cast<int>(tid % static_cast<std::size_t>(group));
  for (std::size_t i0 = g; i0 < n; i0 += groups * unroll) {
    Vec const* src[unroll];
    Vec* dst[unroll];
#pragma unroll
    for (int u = 0; u < unroll; ++u) {
      std::size_t const i = i0 + static_cast<std::size_t>(u) * groups;
      src[u]              = nullptr;
      dst[u]              = nullptr;
      if (i < n) {
        auto const m = moves(i, lane);
        src[u]       = reinterpret_cast<Vec const*>(m.src);
        dst[u]       = reinterpret_cast<Vec*>(m.dst);
      }
    }
    for (std::size_t c = static_cast<std::size_t>(lane); c < row_vecs;
         c += static_cast<std::size_t>(group)) {
      Vec v[unroll];
#pragma unroll
      for (int u = 0; u < unroll; ++u) {
        if (src[u] != nullptr) { v[u] = load_vec<Fresh>(src[u] + c); }
      }
#pragma unroll
      for (int u = 0; u < unroll; ++u) {
        if (dst[u] != nullptr) { store_vec<Through>(dst[u] + c, src[u] != nullptr ? v[u] : Vec{}); }
      }
    }
  }
  if constexpr (Through) { __threadfence_system(); }  // visible to other GPUs and the host
}

/// How to launch a row kernel: vector width, lanes per row, grid.
struct row_launch {
  int vec_bytes;
  std::size_t row_vecs;
  int group;
  int blocks;
};

/// @p blocks_per_sm: most blocks of 256 per multiprocessor (8 fill one; fewer leave room for
/// kernels on other streams, e.g. NCCL's).
[[nodiscard]] inline row_launch plan_row_launch(std::size_t n, std::size_t row_bytes,
                                                std::initializer_list<std::uintptr_t> alignment,
                                                int blocks_per_sm = 8) {
  row_launch l{};
  l.vec_bytes = vector_width(alignment);
  l.row_vecs  = row_bytes / static_cast<std::size_t>(l.vec_bytes);
  l.group     = 1;
  while (l.group < 32 && static_cast<std::size_t>(l.group) < l.row_vecs) { l.group *= 2; }
  int const sms                    = sm_count();
  std::size_t const rows_per_block = 256 / static_cast<std::size_t>(l.group) * unroll;
  std::size_t const wanted         = cuda::ceil_div(n, rows_per_block);
  l.blocks                         = static_cast<int>(std::max<std::size_t>(
      1, std::min<std::size_t>(
             wanted, static_cast<std::size_t>(sms) * static_cast<std::size_t>(blocks_per_sm))));
  return l;
}

/// Launches a row kernel over @p n rows of @p row_bytes: @p launch is called as
/// `launch.template operator()<Vec>(row_launch)` with the widest vector type that every size and
/// address in @p alignment allows.
template <class Launch>
void launch_rows(std::size_t n, std::size_t row_bytes,
                 std::initializer_list<std::uintptr_t> alignment, Launch&& launch,
                 int blocks_per_sm = 8) {
  if (n == 0) { return; }
  auto const l = plan_row_launch(n, row_bytes, alignment, blocks_per_sm);
  with_vector(l.vec_bytes, [&]<class Vec>() { launch.template operator()<Vec>(l); });
  WM_CHECK_LAUNCH();
}

/// Launches move_rows_kernel for a gather; @p fresh: the rows are host memory other GPUs may have
/// written (a bool, or std::bool_constant where the caller knows it: then only that kernel
/// variant is compiled); @p blocks_per_sm: see plan_row_launch.
template <class Rows, class Index, class Fresh = std::false_type>
void launch_gather(Rows rows, Index const* idx, std::size_t const* order, std::size_t n,
                   packed_rows out, std::size_t row_bytes, std::uintptr_t rows_alignment,
                   unsigned* err, cudaStream_t stream, Fresh fresh = {}, int blocks_per_sm = 8) {
  launch_rows(
      n, row_bytes,
      {row_bytes, rows_alignment, reinterpret_cast<std::uintptr_t>(out.base), out.stride_bytes},
      [&]<class Vec>(row_launch const& l) {
        using M = gather_moves<Rows, Index>;
        with_flag(fresh, [&](auto f) {
          move_rows_kernel<Vec, decltype(f)::value, false, M>
              <<<l.blocks, 256, 0, stream>>>(M{rows, idx, order, out, err}, n, l.row_vecs, l.group);
        });
      },
      blocks_per_sm);
}

/// Launches move_rows_kernel for a scatter; @p through: the rows are host memory other GPUs may
/// read (a bool or std::bool_constant, as launch_gather's @p fresh).
template <class Rows, class Index, class Through = std::false_type>
void launch_scatter(Rows rows, Index const* keys, std::size_t const* pos, std::size_t n,
                    packed_rows values, std::size_t row_bytes, std::uintptr_t rows_alignment,
                    unsigned* err, cudaStream_t stream, Through through = {}) {
  launch_rows(n, row_bytes,
              {row_bytes, rows_alignment, reinterpret_cast<std::uintptr_t>(values.base),
               values.stride_bytes},
              [&]<class Vec>(row_launch const& l) {
                using M = scatter_moves<Rows, Index>;
                with_flag(through, [&](auto t) {
                  move_rows_kernel<Vec, false, decltype(t)::value, M><<<l.blocks, 256, 0, stream>>>(
                      M{rows, keys, pos, n, values, err}, n, l.row_vecs, l.group);
                });
              });
}

/// Ranks whose per-owner counts the locate kernel keeps in shared memory (more: global atomics).
inline constexpr int locate_shared_ranks = 4096;

/**
 * For the dispatch path: owner rank (world for an invalid index) and local row of each index,
 * the identity position (for the sort; @p position may be null when nothing sorts), and the
 * count per owner. Counting with one global atomic per index serialized a million
 * indices on a few addresses (~0.8 ms); lanes with the same owner add once per warp, into the
 * block's counters, which go to @p counts once per block.
 */
template <class Map, class Index>
__global__ void locate_kernel(Map map, Index const* idx, std::size_t n, int world, int* owner,
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
    owner[i] = r;
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
/// header words (the tag, row bytes and batch from the host, the invalid count from @p counts).
/// Also where each owner's group starts in the send order (world + 1 entries, invalid last).
template <class Word>
__global__ void dispatch_words_kernel(Word const* counts, int world, int me, Word tag,
                                      Word row_bytes, Word batch, Word* words, Word* starts) {
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
  }
}

}  // namespace wm::detail
