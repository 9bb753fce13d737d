// SPDX-License-Identifier: Apache-2.0
// The step counters of wm::zero_optimizer, one layout on the device (updated by the step's last
// kernel) and in pinned host memory (read back, or with wm::offload_host kept there by the host
// step). Host-only: a plain struct that nvcc and the host compiler both read.
#pragma once

#include <cstdint>
#include <type_traits>

namespace wm::detail::zero {

/// What the steps so far did (zeroed at construction; `load` restores `applied`).
struct step_counters {
  std::int64_t applied;         ///< steps applied (skipped ones not counted): Adam's step count
  std::int64_t last_skipped;    ///< 1 if the last step was skipped for an inf/NaN gradient
  std::int64_t skipped;         ///< steps skipped so far
  std::int64_t growth_tracker;  ///< dynamic loss scale: applied steps since the scale last changed
};
static_assert(std::is_trivially_copyable_v<step_counters> && sizeof(step_counters) == 32);

}  // namespace wm::detail::zero
