// SPDX-License-Identifier: Apache-2.0
// Cache kernels: the batch probe (a warp per key, one ballot over the set's 32 tags) and the
// device statistics counters it adds to. The gather / update paths build on these.
#pragma once

#include <wm/cache.hpp>
#include <wm/detail/cache/set.hpp>
#include <wm/error.hpp>

#include <cuda/cmath>
#include <cuda/stream_ref>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace wm::detail::cache {

/// Statistics counters in device memory (added to with atomics; see wm::cache_statistics).
struct device_statistics {
  unsigned long long requests{};
  unsigned long long distinct_keys{};
  unsigned long long hits{};
  unsigned long long misses{};
  unsigned long long evictions{};
  unsigned long long write_backs{};
  unsigned long long bytes_from_host{};
  unsigned long long bytes_from_peers{};
  unsigned long long bypasses{};
  unsigned long long bypass_rows{};

  /// The host-side form.
  [[nodiscard]] wm::cache_statistics to_public() const noexcept {
    return {requests,        distinct_keys,    hits,     misses,     evictions, write_backs,
            bytes_from_host, bytes_from_peers, bypasses, bypass_rows};
  }
};

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
