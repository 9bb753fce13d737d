// SPDX-License-Identifier: Apache-2.0
// wm's one hash family. Every value below is compared across ranks, stored in a file name, or
// decides where a row lives, so none may change:
// - fnv1a: names and host identities as 64-bit keys (node identity, agreement arguments);
// - fmix64, the splitmix64 finalizer, and what is built on it: mix64 (two words into one:
//   agreement arguments, group tokens) and splitmix64 (one word: embedding_init's values);
// - mix32: the cache's key -> set and key -> holder hash (a bijection of the 32-bit keys);
// - siphash24: a keyed hash, for names that must not reveal their key (node-local sockets).
// Host and device (constexpr; no CUDA header needed).
#pragma once

#include <wm/config.hpp>

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace wm::detail {

/// 64-bit FNV-1a, used to turn names and host identities into compact keys.
[[nodiscard]] constexpr std::uint64_t fnv1a(std::string_view s,
                                            std::uint64_t h = 1469598103934665603ull) noexcept {
  for (char c : s) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return h;
}

/// The splitmix64 finalizer (Steele, Lea and Flood, 2014): a bijection of 64-bit words.
[[nodiscard]] WM_HOST_DEVICE constexpr std::uint64_t fmix64(std::uint64_t z) noexcept {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/// One step of splitmix64: @p x advanced by the golden-ratio increment, then finalized.
[[nodiscard]] WM_HOST_DEVICE constexpr std::uint64_t splitmix64(std::uint64_t x) noexcept {
  return fmix64(x + 0x9e3779b97f4a7c15ull);
}

/// Mixes two 64-bit values (splitmix64 finalizer over their combination).
[[nodiscard]] WM_HOST_DEVICE constexpr std::uint64_t mix64(std::uint64_t a,
                                                           std::uint64_t b) noexcept {
  return fmix64(a + 0x9e3779b97f4a7c15ull * (b + 1));
}

/// Bijective 32-bit mix of @p key under @p seed (xor-shift / odd-multiply rounds).
[[nodiscard]] WM_HOST_DEVICE constexpr std::uint32_t mix32(std::uint32_t key,
                                                           std::uint32_t seed = 0) noexcept {
  std::uint32_t x = key ^ (seed * 0x9e3779b9u);
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

/// SipHash-2-4 of @p data under the 128-bit key (@p k0, @p k1) (Aumasson and Bernstein, 2012):
/// a keyed hash whose output does not reveal the key. Names node-local sockets from the token.
[[nodiscard]] constexpr std::uint64_t siphash24(std::uint64_t k0, std::uint64_t k1,
                                                std::string_view data) noexcept {
  auto rotl        = [](std::uint64_t x, int b) { return (x << b) | (x >> (64 - b)); };
  std::uint64_t v0 = k0 ^ 0x736f6d6570736575ull;
  std::uint64_t v1 = k1 ^ 0x646f72616e646f6dull;
  std::uint64_t v2 = k0 ^ 0x6c7967656e657261ull;
  std::uint64_t v3 = k1 ^ 0x7465646279746573ull;
  auto round       = [&] {
    v0 += v1;
    v1 = rotl(v1, 13);
    v1 ^= v0;
    v0 = rotl(v0, 32);
    v2 += v3;
    v3 = rotl(v3, 16);
    v3 ^= v2;
    v0 += v3;
    v3 = rotl(v3, 21);
    v3 ^= v0;
    v2 += v1;
    v1 = rotl(v1, 17);
    v1 ^= v2;
    v2 = rotl(v2, 32);
  };
  auto compress = [&](std::uint64_t m) {
    v3 ^= m;
    round();
    round();
    v0 ^= m;
  };
  std::size_t const n = data.size();
  std::size_t i       = 0;
  for (; i + 8 <= n; i += 8) {
    std::uint64_t m = 0;
    for (int b = 0; b < 8; ++b) {
      m |= std::uint64_t{static_cast<unsigned char>(data[i + static_cast<std::size_t>(b)])}
           << (8 * b);
    }
    compress(m);
  }
  std::uint64_t last = std::uint64_t{n & 0xff} << 56;
  for (int b = 0; i + static_cast<std::size_t>(b) < n; ++b) {
    last |= std::uint64_t{static_cast<unsigned char>(data[i + static_cast<std::size_t>(b)])}
            << (8 * b);
  }
  compress(last);
  v2 ^= 0xff;
  round();
  round();
  round();
  round();
  return v0 ^ v1 ^ v2 ^ v3;
}

}  // namespace wm::detail
