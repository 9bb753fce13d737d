// SPDX-License-Identifier: Apache-2.0
// The hash table layout of wm::dynamic_embedding, host and device: buckets of 128 slots in
// structure-of-arrays form (per slot a 64-bit key, a one-byte digest and a 64-bit score), the
// reserved keys, and the key -> (bucket, digest) hash. Compiles with a plain C++20 compiler (the
// host tests and the tests' host model use it). docs/design.md, "Dynamic embeddings".
#pragma once

#include <wm/config.hpp>
#include <wm/detail/base/hash.hpp>

#include <cstddef>
#include <cstdint>

namespace wm::detail::dynamic {

inline constexpr int slots_per_bucket         = 128;          ///< one warp, 4 slots per lane
inline constexpr std::uint32_t no_slot        = 0xffffffffu;  ///< a key without a slot
inline constexpr unsigned full_warp           = 0xffffffffu;
inline constexpr std::uint64_t empty_key      = ~std::uint64_t{0};  ///< a free slot's key
inline constexpr std::uint64_t locked_key     = empty_key - 1;      ///< kept for slot locks
inline constexpr std::uint64_t first_reserved = locked_key;         ///< keys >= are refused

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

}  // namespace wm::detail::dynamic
