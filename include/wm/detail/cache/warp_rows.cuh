// SPDX-License-Identifier: Apache-2.0
// The warp's row and set primitives of the cache kernels: the payload move (weight, states and
// step of a row with the loads of all parts in flight together; plain rows go through the warp row
// copy of detail/rows/move.cuh), the set lock, and the lock-free join of a line to a batch.
//
// The lock: a warp takes the set's lock word (set_header::lock) before it probes, and keeps it
// until the row is in its line (and, unless the call is staged, copied out): lane 0 spins with
// atomicCAS and __nanosleep back-off (acquire), the warp works, lane 0 releases (release store).
// Independent thread scheduling lets the spinning lane wait while another warp holds the lock; a
// warp holds one lock at a time, so nothing can deadlock.
#pragma once

#include <wm/detail/cache/set.hpp>
#include <wm/detail/rows/move.cuh>
#include <wm/detail/tensor/table_rows.cuh>

#include <cuda/atomic>

#include <cstddef>
#include <cstdint>

namespace wm::detail::cache {

inline constexpr int line_block = 256;  ///< threads per block of the line kernels (8 warps)

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

/// Sets way @p way's bit in the set's batch mask for @p epoch without the set's lock (one 64-bit
/// CAS on the adjacent batch and epoch words; a mask of another epoch is reset first). True for
/// the thread that set it, false when it was set already.
__device__ __forceinline__ bool join_batch(set_header* h, int way, std::uint32_t epoch) noexcept {
  static_assert(offsetof(set_header, epoch) == offsetof(set_header, batch) + 4);
  auto* const word        = reinterpret_cast<unsigned long long*>(&h->batch);
  std::uint32_t const bit = 1u << static_cast<unsigned>(way);
  unsigned long long seen = *reinterpret_cast<unsigned long long volatile*>(word);
  for (;;) {
    auto const at            = static_cast<std::uint32_t>(seen >> 32);
    std::uint32_t const mask = at == epoch ? static_cast<std::uint32_t>(seen) : 0u;
    if ((mask & bit) != 0) { return false; }
    unsigned long long const next = (static_cast<unsigned long long>(epoch) << 32) | (mask | bit);
    unsigned long long const prev = atomicCAS(word, seen, next);
    if (prev == seen) { return true; }
    seen = prev;
  }
}

}  // namespace wm::detail::cache
