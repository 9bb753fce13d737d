// SPDX-License-Identifier: Apache-2.0
// The warp's row primitives of the cache kernels: copies and the payload move (weight, states
// and step of a row with the loads of all parts in flight together), and the set lock.
//
// The lock: a warp takes the set's lock word (set_header::lock) before it probes, and keeps it
// until the row is in its line (and, unless the call is staged, copied out): lane 0 spins with
// atomicCAS and __nanosleep back-off (acquire), the warp works, lane 0 releases (release store).
// Independent thread scheduling lets the spinning lane wait while another warp holds the lock; a
// warp holds one lock at a time, so nothing can deadlock.
#pragma once

#include <wm/detail/cache/set.hpp>
#include <wm/detail/tensor/table_rows.cuh>

#include <cuda/atomic>

#include <cstddef>
#include <cstdint>

namespace wm::detail::cache {

inline constexpr int line_block = 256;  ///< threads per block of the line kernels (8 warps)

/// Copies @p bytes (a multiple of sizeof(W)) from @p src to @p dst with the warp's lanes.
template <class W>
__device__ void warp_copy(void* dst, void const* src, std::size_t bytes, unsigned lane) noexcept {
  auto* d       = static_cast<W*>(dst);
  auto const* q = static_cast<W const*>(src);
  for (std::size_t i = lane; i < bytes / sizeof(W); i += ways) { d[i] = q[i]; }
}

/// Copies one row of @p bytes at @p src to the @p copies rows `dst(0)`, ..., `dst(copies - 1)`
/// with the warp: each lane loads its vectors of the row once and stores them to every copy.
template <class W, class Dst>
__device__ void warp_copy_to(Dst const& dst, std::size_t copies, void const* src, std::size_t bytes,
                             unsigned lane) noexcept {
  auto const* q = static_cast<W const*>(src);
  for (std::size_t i = lane; i < bytes / sizeof(W); i += ways) {
    W const v = q[i];
    for (std::size_t k = 0; k < copies; ++k) { reinterpret_cast<W*>(dst(k))[i] = v; }
  }
}

/// Vectors per lane a warp_move loads before it stores (one round for a 128-float Adam row).
inline constexpr int move_depth = 8;

/// Moves one row's payload (weight, states, step) with the warp. Each lane issues the loads of
/// up to move_depth vectors of the weight and the states together (and lane 0 the step's) before
/// any of its stores, so a row read over PCIe costs one round trip rather than one per part.
template <class W, class T>
__device__ void warp_move(row_place<T> const& to, row_place<T> const& from, std::size_t dim,
                          std::size_t st_cols, unsigned lane) noexcept {
  std::size_t const nw    = dim * sizeof(T) / sizeof(W);
  std::size_t const ns    = from.st != nullptr ? st_cols * sizeof(float) / sizeof(W) : 0;
  std::size_t const total = nw + ns;
  auto const* const qw    = reinterpret_cast<W const*>(from.w);
  auto const* const qs    = reinterpret_cast<W const*>(from.st);
  auto* const dw          = reinterpret_cast<W*>(to.w);
  auto* const ds          = reinterpret_cast<W*>(to.st);
  bool const step         = from.step != nullptr && lane == 0;
  std::int64_t step_value = 0;
  if (step) { step_value = *from.step; }
  for (std::size_t base = 0; base < total; base += std::size_t{move_depth} * ways) {
    W v[move_depth];
#pragma unroll
    for (int j = 0; j < move_depth; ++j) {
      std::size_t const i = base + static_cast<std::size_t>(j) * ways + lane;
      if (i < total) { v[j] = i < nw ? qw[i] : qs[i - nw]; }
    }
#pragma unroll
    for (int j = 0; j < move_depth; ++j) {
      std::size_t const i = base + static_cast<std::size_t>(j) * ways + lane;
      if (i < nw) {
        dw[i] = v[j];
      } else if (i < total) {
        ds[i - nw] = v[j];
      }
    }
  }
  if (step) { *to.step = step_value; }
}

/// Takes set @p h's lock for the warp: lane 0 acquires the lock word, then every lane fences
/// (acquire), so the last holder's writes, by any of its lanes, are visible to every lane.
__device__ inline void lock_set(set_header* h, unsigned lane) noexcept {
  if (lane == 0) {
    cuda::atomic_ref<std::uint32_t, cuda::thread_scope_device> word{h->lock};
    unsigned wait          = 32;
    std::uint32_t expected = 0;
    while (!word.compare_exchange_weak(expected, 1u, cuda::memory_order_acquire,
                                       cuda::memory_order_relaxed)) {
      expected = 0;
      __nanosleep(wait);
      wait = wait < 1024 ? wait * 2 : wait;
    }
  }
  __syncwarp();
  cuda::atomic_thread_fence(cuda::memory_order_acquire, cuda::thread_scope_device);
}

/// Releases set @p h's lock: every lane fences (release) its writes to the set and the line,
/// then lane 0 stores the lock word with release order.
__device__ inline void unlock_set(set_header* h, unsigned lane) noexcept {
  cuda::atomic_thread_fence(cuda::memory_order_release, cuda::thread_scope_device);
  __syncwarp();
  if (lane == 0) {
    cuda::atomic_ref<std::uint32_t, cuda::thread_scope_device> word{h->lock};
    word.store(0u, cuda::memory_order_release);
  }
  __syncwarp();
}

}  // namespace wm::detail::cache
