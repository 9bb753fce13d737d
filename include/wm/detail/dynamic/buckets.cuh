// SPDX-License-Identifier: Apache-2.0
// The hash table of wm::dynamic_embedding: buckets of 128 slots in structure-of-arrays form (per
// slot a 64-bit key, a one-byte digest and a 64-bit score), the key -> (bucket, digest) hash, and
// the probes: one warp per bucket (lane l holds slots 4l..4l+3, whose digests are one 32-bit
// word, so a probe reads 128 bytes of digests and only the keys whose digest matches), and one
// thread (the device ref). docs/design.md, "Dynamic embeddings".
#pragma once

#include <wm/config.hpp>
#include <wm/decl/dynamic_embedding.cuh>
#include <wm/detail/base/hash.hpp>

#include <cstddef>
#include <cstdint>

namespace wm::detail::dynamic {

inline constexpr int slots_per_bucket         = 128;          ///< one warp, 4 slots per lane
inline constexpr std::uint32_t no_slot        = 0xffffffffu;  ///< a key without a slot
inline constexpr unsigned full_warp           = 0xffffffffu;
inline constexpr std::uint64_t empty_key      = wm::dynamic_empty_key;
inline constexpr std::uint64_t first_reserved = wm::dynamic_locked_key;  ///< keys >= are refused

/// Whether the 64 bits of a key are a reserved value.
[[nodiscard]] WM_HOST_DEVICE constexpr bool reserved(std::uint64_t key) noexcept {
  return key >= first_reserved;
}

/// The table's buckets (trivially copyable; kernels take it by value).
struct buckets_view {
  std::uint64_t* keys{};    ///< buckets × 128 keys (empty_key: free)
  std::uint8_t* digests{};  ///< buckets × 128 digests (0 when free)
  std::uint64_t* scores{};  ///< buckets × 128 scores
  std::uint32_t count{};    ///< number of buckets (>= 1)
  std::uint64_t seed{};     ///< hash seed

  /// The key's hash: a bijection of the 64-bit keys (equal hashes, equal keys).
  [[nodiscard]] WM_HOST_DEVICE constexpr std::uint64_t hash(std::uint64_t key) const noexcept {
    return fmix64(key ^ splitmix64(seed));
  }
  /// The bucket of hash @p h: its high bits, range-reduced (monotone in h, so sorting hashes
  /// groups buckets).
  [[nodiscard]] WM_HOST_DEVICE std::uint32_t bucket(std::uint64_t h) const noexcept {
#if defined(__CUDA_ARCH__)
    return static_cast<std::uint32_t>(__umul64hi(h, count));
#else
    return static_cast<std::uint32_t>((static_cast<unsigned __int128>(h) * count) >> 64);
#endif
  }
  /// The digest of hash @p h: its low byte (independent of the bucket's bits).
  [[nodiscard]] WM_HOST_DEVICE static constexpr std::uint8_t digest(std::uint64_t h) noexcept {
    return static_cast<std::uint8_t>(h & 0xffu);
  }
  /// First slot of bucket @p b.
  [[nodiscard]] WM_HOST_DEVICE static constexpr std::size_t first(std::uint32_t b) noexcept {
    return static_cast<std::size_t>(b) * slots_per_bucket;
  }
};

#if defined(__CUDACC__)
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
#endif

}  // namespace wm::detail::dynamic
