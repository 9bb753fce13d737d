// SPDX-License-Identifier: Apache-2.0
// A cache's statistics counters as they live in device memory (the kernels add to them with
// atomics) and their host form, wm::cache_statistics; a staged gather's own counts
// (call_counters); and the one flush by which a kernel's warp adds what it counted to either.
#pragma once

#include <wm/cache.hpp>

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

/// One staged gather's counts (device, zeroed by the next call's first kernel, which publishes
/// them to host-mapped memory): what the host reads to choose the next call's path.
struct call_counters {
  unsigned long long requests{};
  unsigned long long misses{};
  unsigned long long bypasses{};
};

#if defined(__CUDACC__)
/// Adds a warp's counts @p d to the counters at @p st, one atomic per counter that is not zero
/// (by one lane: the values are the warp's).
__device__ __forceinline__ void add_counts(device_statistics* st,
                                           device_statistics const& d) noexcept {
  if (d.requests != 0) { atomicAdd(&st->requests, d.requests); }
  if (d.distinct_keys != 0) { atomicAdd(&st->distinct_keys, d.distinct_keys); }
  if (d.hits != 0) { atomicAdd(&st->hits, d.hits); }
  if (d.misses != 0) { atomicAdd(&st->misses, d.misses); }
  if (d.evictions != 0) { atomicAdd(&st->evictions, d.evictions); }
  if (d.write_backs != 0) { atomicAdd(&st->write_backs, d.write_backs); }
  if (d.bytes_from_host != 0) { atomicAdd(&st->bytes_from_host, d.bytes_from_host); }
  if (d.bytes_from_peers != 0) { atomicAdd(&st->bytes_from_peers, d.bytes_from_peers); }
  if (d.bypasses != 0) { atomicAdd(&st->bypasses, d.bypasses); }
  if (d.bypass_rows != 0) { atomicAdd(&st->bypass_rows, d.bypass_rows); }
}

/// The same for a staged gather's counts.
__device__ __forceinline__ void add_counts(call_counters* call, call_counters const& d) noexcept {
  if (d.requests != 0) { atomicAdd(&call->requests, d.requests); }
  if (d.misses != 0) { atomicAdd(&call->misses, d.misses); }
  if (d.bypasses != 0) { atomicAdd(&call->bypasses, d.bypasses); }
}
#endif

}  // namespace wm::detail::cache
