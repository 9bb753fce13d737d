// SPDX-License-Identifier: Apache-2.0
// Test oracles of the cache's warp code (detail/cache/warp.cuh): the warp form of one plain
// access (against cache_oracle.hpp's sequential one), and a batch probe kernel (a warp per key,
// one ballot over the set's 32 tags) that counts into the device statistics.
#pragma once

#include <wm/detail/cache/set.hpp>
#include <wm/detail/cache/statistics.hpp>
#include <wm/detail/cache/warp.cuh>
#include <wm/error.hpp>

#include <cuda/cmath>
#include <cuda/stream_ref>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "cache_oracle.hpp"

namespace wm::detail::cache {

/// One access with write-allocate (access() in set.hpp), by the whole warp.
template <class Impl>
__device__ access_result warp_access(set_ref<Impl> const& s, std::uint32_t key, bool write,
                                     unsigned lane) noexcept {
  access_result r;
  r.way = warp_find(s, key, lane);
  r.hit = r.way != no_way;
  if (r.hit) {
    warp_touch(s, r.way, lane);
  } else {
    r.admitted = warp_admit(s, key, lane);
    r.way      = r.admitted.way;
  }
  if (write && lane == 0) { s.mark_dirty(r.way); }
  __syncwarp();
  return r;
}

inline constexpr int probe_block = 256;  ///< threads per block of the probe (8 warps)

/**
 * ways[i] = the way of set(keys[i]) that holds keys[i], or no_way; one warp per key (grid-stride
 * over warps). Adds requests / hits / misses to @p stats when it is not null (one atomic per warp
 * and counter). Changes nothing in the cache.
 */
template <class Impl>
__global__ void __launch_bounds__(probe_block)
    probe_kernel(cache_ref<Impl> cache, std::uint32_t const* keys, std::size_t n, int* ways_out,
                 device_statistics* stats) {
  unsigned const lane    = threadIdx.x % ways;
  std::size_t const warp = (static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x) / ways;
  std::size_t const n_warps   = static_cast<std::size_t>(gridDim.x) * blockDim.x / ways;
  unsigned long long requests = 0;
  unsigned long long hits     = 0;
  for (std::size_t i = warp; i < n; i += n_warps) {  // the same trip count in every lane
    std::uint32_t const key = keys[i];
    int const way           = warp_find(cache.set(cache.set_index(key)), key, lane);
    if (lane == 0) { ways_out[i] = way; }
    ++requests;
    hits += way != no_way ? 1 : 0;
  }
  if (lane == 0 && stats != nullptr && requests != 0) {
    atomicAdd(&stats->requests, requests);
    atomicAdd(&stats->hits, hits);
    atomicAdd(&stats->misses, requests - hits);
  }
}

/// Launches probe_kernel on @p stream (no synchronization).
template <class Impl>
void probe_async(cache_ref<Impl> const& cache, std::uint32_t const* keys, std::size_t n,
                 int* ways_out, device_statistics* stats, cuda::stream_ref stream) {
  if (n == 0) { return; }
  std::size_t const warps_per_block = probe_block / ways;
  std::size_t const blocks =
      std::min<std::size_t>(cuda::ceil_div(n, warps_per_block), std::size_t{1} << 20);
  probe_kernel<Impl><<<static_cast<unsigned>(blocks), probe_block, 0, stream.get()>>>(
      cache, keys, n, ways_out, stats);
  WM_CHECK_LAUNCH();
}

}  // namespace wm::detail::cache
