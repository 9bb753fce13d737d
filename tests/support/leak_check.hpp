// SPDX-License-Identifier: Apache-2.0
// The CUDA part of a leak check: what a process holds before and after rounds that make and
// destroy things, compared.
//
//   if (!wm_test::cuda_objects::start().counting()) {   // before the baseline, in the rank
//     return wm_test::skip(wm_test::cuda_objects::start().why_not());
//   }
//   round(); round();                                   // first-use state (modules, NCCL)
//   auto const before = wm_test::cuda_snapshot::take();
//   for (int i = 0; i < 20; ++i) { round(); }
//   auto const grew = wm_test::cuda_growth(before, wm_test::cuda_snapshot::take(), 8 << 20);
//   INFO(grew);
//   REQUIRE(grew.empty());
//
// Exact: the live events, streams, device allocations and pinned host allocations and
// registrations with their bytes (cuda_objects.hpp), and the bytes that cudaMallocAsync
// allocations of the current pool hold (its used-memory attribute: one leaked byte shows).
// Within @p slack: the device memory the driver counts (device_memory.hpp), which sees in 2 MiB
// pages what no call record does (memory a library holds through calls not counted).
#pragma once

#include <cstdint>
#include <string>

#include "cuda_objects.hpp"
#include "device_memory.hpp"

namespace wm_test {

/// What this process holds on its current device and in pinned host memory.
struct cuda_snapshot {
  device_memory_reading memory;
  cuda_object_counts objects;

  /// Synchronizes the device first (device_memory.hpp).
  [[nodiscard]] static cuda_snapshot take() {
    cuda_snapshot s;
    s.memory  = read_device_memory();
    s.objects = cuda_objects::start().now();
    return s;
  }
};

/// What grew (or shrank) from @p before to @p after, in words; empty when nothing did (the
/// driver's device count within @p slack bytes).
[[nodiscard]] inline std::string cuda_growth(cuda_snapshot const& before,
                                             cuda_snapshot const& after, std::int64_t slack) {
  std::string out;
  if (grew(before.objects, after.objects)) {
    out += "live CUDA objects: " + (after.objects - before.objects).to_string() + "; ";
  }
  if (after.memory.pool_used != before.memory.pool_used) {
    out += "memory pool in use: " + std::to_string(before.memory.pool_used) + " -> " +
           std::to_string(after.memory.pool_used) + " bytes; ";
  }
  std::int64_t const held = after.memory.held() - before.memory.held();
  if (held > slack || held < -slack) {
    out += "device memory held: " + std::to_string(held) + " bytes (slack " +
           std::to_string(slack) + "); ";
  }
  return out;
}

}  // namespace wm_test
