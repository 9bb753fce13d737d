// SPDX-License-Identifier: Apache-2.0
// Wall-clock timing of host work for the benchmarks and probes (CPU Adam and the like).
#pragma once

#include <algorithm>
#include <chrono>
#include <vector>

namespace wm_bench {

/// Median wall-clock milliseconds of @p reps calls of @p f, after 2 warm-up calls.
template <class F>
double median_ms(int reps, F&& f) {
  for (int i = 0; i < 2; ++i) { f(); }
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    auto const t0 = std::chrono::steady_clock::now();
    f();
    ms.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace wm_bench
