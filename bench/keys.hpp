// SPDX-License-Identifier: Apache-2.0
/*
 * The key generators the embedding benchmarks share (host code, plain C++20):
 *   uniform: splitmix64(splitmix64(seed) + i) mod rows;
 *   zipf:    exact discrete Zipf(alpha) over ranks 1..rows by inverse CDF (binary search in the
 *            table of cumulative k^-alpha), rank k-1 scattered to row (k-1) * scatter mod rows
 *            (a bijection when scatter is coprime with rows), so the hot rows are spread over the
 *            table;
 * and the count of distinct keys in a batch. embedding_bench and cache_bench draw their keys here,
 * so the same seed gives the same keys in both.
 */
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace wm_bench {

/// The splitmix64 finalizer.
constexpr std::uint64_t splitmix(std::uint64_t x) noexcept {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/// Cumulative sums of k^-alpha, k = 1..rows (the Zipf inverse-CDF table).
inline std::vector<double> zipf_cdf(std::size_t rows, double alpha) {
  std::vector<double> cdf(rows);
  double sum = 0;
  for (std::size_t r = 0; r < rows; ++r) {
    cdf[r] = sum += std::pow(static_cast<double>(r + 1), -alpha);
  }
  return cdf;
}

/// out[i] = splitmix(splitmix(seed) + i) mod rows.
inline void uniform_keys(std::span<std::int64_t> out, std::size_t rows, std::uint64_t seed) {
  for (std::size_t i = 0; i < out.size(); ++i) {
    out[i] = static_cast<std::int64_t>(splitmix(splitmix(seed) + i) % rows);
  }
}

/// out[i]: a Zipf rank drawn through @p cdf (see zipf_cdf; rows = cdf.size()) with the uniform
/// (splitmix(splitmix(seed) + i) >> 11 + 0.5) * 2^-53, scattered to row rank * scatter mod rows.
inline void zipf_keys(std::span<std::int64_t> out, std::vector<double> const& cdf,
                      std::uint64_t scatter, std::uint64_t seed) {
  std::size_t const rows = cdf.size();
  for (std::size_t i = 0; i < out.size(); ++i) {
    double const u =
        (static_cast<double>(splitmix(splitmix(seed) + i) >> 11) + 0.5) * 0x1p-53 * cdf.back();
    auto const r =
        static_cast<std::uint64_t>(std::upper_bound(cdf.begin(), cdf.end(), u) - cdf.begin());
    out[i] = static_cast<std::int64_t>(std::min<std::uint64_t>(r, rows - 1) * scatter % rows);
  }
}

/// The number of distinct values in @p keys.
inline std::size_t distinct_count(std::span<std::int64_t const> keys) {
  std::vector<std::int64_t> k(keys.begin(), keys.end());
  std::sort(k.begin(), k.end());
  return static_cast<std::size_t>(std::unique(k.begin(), k.end()) - k.begin());
}

}  // namespace wm_bench
