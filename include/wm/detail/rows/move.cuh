// SPDX-License-Identifier: Apache-2.0
// The row mover: one kernel that gathers and scatters rows (it moves bytes: element types only
// set the row size), the launch plan every row kernel uses, and the warp row copy of kernels that
// give one warp a row (the cache's).
//
// A group of G lanes (G = 1..32, a power of two) moves one row with vector accesses of
// sizeof(Vec) bytes; each group keeps U rows in flight (U loads issued before the first store).
// Gather and scatter differ only in where each row comes from and goes to (gather_moves,
// scatter_moves).
#pragma once

#include <wm/detail/base/cuda.cuh>
#include <wm/detail/rows/views.cuh>
#include <wm/error.hpp>

#include <cuda/cmath>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

namespace wm::detail {

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

/// Vector @p c of each of the `unroll` rows in flight: every load issued before the caller's first
/// store; a null source leaves its slot unset (the caller stores a zero vector or skips it).
template <bool Fresh, class Vec>
__device__ __forceinline__ void load_in_flight(Vec const* const (&src)[unroll], std::size_t c,
                                               Vec (&v)[unroll]) {
#pragma unroll
  for (int u = 0; u < unroll; ++u) {
    if (src[u] != nullptr) { v[u] = load_vec<Fresh>(src[u] + c); }
  }
}

/// Lanes of a warp: the stride of the warp row copy.
inline constexpr unsigned warp_lanes = 32;

/**
 * The warp row copy: the 32 lanes of a warp copy the row of @p bytes (a multiple of sizeof(Vec))
 * at @p src to the @p copies rows `dst(0)`, ..., `dst(copies - 1)`; each lane loads its vectors of
 * the row once and stores them to every copy. A null @p src writes zero rows. `Fresh`: loads
 * through load_vec<true> (memory another GPU may rewrite); otherwise plain loads, which see rows
 * written earlier in the same kernel (by another warp, under a lock).
 */
template <class Vec, bool Fresh = false, class Dst>
__device__ __forceinline__ void warp_copy_row(Dst const& dst, std::size_t copies, void const* src,
                                              std::size_t bytes, unsigned lane) noexcept {
  std::size_t const vecs = bytes / sizeof(Vec);
  auto const* const q    = static_cast<Vec const*>(src);
  if (q == nullptr) {
    for (std::size_t i = lane; i < vecs; i += warp_lanes) {
      for (std::size_t k = 0; k < copies; ++k) { reinterpret_cast<Vec*>(dst(k))[i] = Vec{}; }
    }
    return;
  }
  for (std::size_t i = lane; i < vecs; i += warp_lanes) {
    Vec v;
    if constexpr (Fresh) {
      v = load_vec<true>(q + i);
    } else {
      v = q[i];
    }
    for (std::size_t k = 0; k < copies; ++k) { reinterpret_cast<Vec*>(dst(k))[i] = v; }
  }
}

/// The warp row copy to the one row @p dst.
template <class Vec, bool Fresh = false>
__device__ __forceinline__ void warp_copy_row(void* dst, void const* src, std::size_t bytes,
                                              unsigned lane) noexcept {
  warp_copy_row<Vec, Fresh>([dst](std::size_t) { return dst; }, 1, src, bytes, lane);
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
      load_in_flight<Fresh>(src, c, v);
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

}  // namespace wm::detail
