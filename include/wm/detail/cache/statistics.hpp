// SPDX-License-Identifier: Apache-2.0
// A cache's statistics counters as they live in device memory (the kernels add to them with
// atomics) and their host form, wm::cache_statistics.
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

}  // namespace wm::detail::cache
