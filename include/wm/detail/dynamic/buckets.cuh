// SPDX-License-Identifier: Apache-2.0
// The probes of wm::dynamic_embedding's buckets (buckets.hpp): one warp per bucket (lane l holds
// slots 4l..4l+3, whose digests are one 32-bit word, so a probe reads 128 bytes of digests and
// only the keys whose digest matches), and one thread (the device ref). docs/design.md,
// "Dynamic embeddings".
#pragma once

#include <wm/detail/dynamic/buckets.hpp>

#include <cstddef>
#include <cstdint>

namespace wm::detail::dynamic {

/// Bit set per byte of @p word equal to @p d (bit 8j + 7 for byte j).
[[nodiscard]] __device__ inline std::uint32_t digest_matches(std::uint32_t word,
                                                             std::uint8_t d) noexcept {
  return __vcmpeq4(word, 0x01010101u * d) & 0x80808080u;
}

/// Slot of @p key within bucket @p b (0..127), or -1; called by all 32 lanes alike.
[[nodiscard]] __device__ inline int warp_find(buckets_view const& v, std::uint32_t b,
                                              std::uint64_t key, std::uint8_t d,
                                              unsigned lane) noexcept {
  std::size_t const base = buckets_view::first(b);
  std::uint32_t const w  = reinterpret_cast<std::uint32_t const*>(v.digests + base)[lane];
  std::uint32_t m        = digest_matches(w, d);
  int mine               = -1;
  while (m != 0 && mine < 0) {
    int const byte = (__ffs(static_cast<int>(m)) - 1) / 8;
    m &= ~(0xffu << (8 * byte));
    int const s = static_cast<int>(lane) * 4 + byte;
    if (v.keys[base + static_cast<std::size_t>(s)] == key) { mine = s; }
  }
  std::uint32_t const hit = __ballot_sync(full_warp, mine >= 0);
  if (hit == 0) { return -1; }
  return __shfl_sync(full_warp, mine, __ffs(static_cast<int>(hit)) - 1);
}

/// Slot (global index) of @p key, or no_slot; one thread.
[[nodiscard]] __device__ inline std::uint32_t thread_find(buckets_view const& v,
                                                          std::uint64_t key) noexcept {
  if (reserved(key)) { return no_slot; }
  std::uint64_t const h  = v.hash(key);
  std::size_t const base = buckets_view::first(v.bucket(h));
  std::uint8_t const d   = buckets_view::digest(h);
  auto const* words      = reinterpret_cast<std::uint32_t const*>(v.digests + base);
  for (int l = 0; l < slots_per_bucket / 4; ++l) {
    std::uint32_t m = digest_matches(words[l], d);
    while (m != 0) {
      int const byte = (__ffs(static_cast<int>(m)) - 1) / 8;
      m &= ~(0xffu << (8 * byte));
      std::size_t const s = base + static_cast<std::size_t>(l * 4 + byte);
      if (v.keys[s] == key) { return static_cast<std::uint32_t>(s); }
    }
  }
  return no_slot;
}
}  // namespace wm::detail::dynamic
