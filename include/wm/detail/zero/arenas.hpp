// SPDX-License-Identifier: Apache-2.0
// The device buffers of wm::zero_optimizer that every offload policy has (the master weights and
// states belong to its engine): owned together, so that a teardown that could not wait for the
// device gives them up at once (left allocated) instead of freeing what a kernel still uses.
// Host-only.
#pragma once

#include <wm/detail/base/resources.hpp>
#include <wm/detail/zero/counters.hpp>

#include <cstddef>

namespace wm::detail::zero {

struct arenas {
  device_buffer<std::byte> weights;            ///< stages 1-2: the arena; 3: the shard arena
  device_buffer<std::byte> grads;              ///< stage 1: the arena; 2-3: the shard arena
  device_buffer<std::byte> staging;            ///< stages 2-3: two buckets
  device_buffer<std::byte> pool;               ///< stage 3: the gather pool
  device_buffer<std::byte> accum;              ///< stage 1 with accumulation: the sums
  device_buffer<double> scratch;               ///< norm partials, then [local, global] Σ g²
  device_buffer<step_counters> counters;       ///< the step's counters (device)
  device_buffer<float> scale;                  ///< the loss scale of the next step (device)
  pinned_buffer<step_counters> host_counters;  ///< read back (offload: kept by the host)
};

}  // namespace wm::detail::zero
