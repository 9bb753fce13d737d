// SPDX-License-Identifier: Apache-2.0
// A third mapping strategy, written as a user would: row k goes to rank hash(k) % world, with a
// dense local numbering. The hash p is a bijection of [0, rows): an invertible mix of b bits
// (2^b >= rows: multiply by an odd constant, xor-shift, multiply again, all mod 2^b), walked
// until it lands below rows. Row k lives on rank p(k) % world at local row p(k) / world. Nothing
// in wm knows this type: the tests use it to show that tensor code asks the mapping, not its
// name. Host and device code.
#pragma once

#include <wm/partition.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace wm_test {

struct hashed {
  static constexpr char const* name = "hashed";

  [[nodiscard]] static std::vector<std::size_t> counts(std::size_t rows, int world) {
    return wm::cyclic::counts(rows, world);  // p is a bijection: as many p(k) per residue
  }

  struct ref_type {
    std::size_t n_rows;
    std::uint64_t mask;  // 2^b - 1
    int shift;           // of the xor-shift, in [1, b]
    int world;

    [[nodiscard]] WM_HOST_DEVICE std::uint64_t mix(std::uint64_t x) const noexcept {
      x = (x * 0x9e3779b97f4a7c15ull) & mask;
      x ^= x >> shift;
      return (x * 0xbf58476d1ce4e5b9ull) & mask;
    }
    /// p(k): a bijection of [0, rows) (cycle walking over a bijection of [0, 2^b)).
    [[nodiscard]] WM_HOST_DEVICE std::size_t permuted(std::size_t k) const noexcept {
      std::uint64_t x = mix(k);
      while (x >= n_rows) { x = mix(x); }
      return static_cast<std::size_t>(x);
    }
    [[nodiscard]] WM_HOST_DEVICE std::size_t rows() const noexcept { return n_rows; }
    [[nodiscard]] WM_HOST_DEVICE int owner(std::size_t k) const noexcept {
      return static_cast<int>(permuted(k) % static_cast<std::size_t>(world));
    }
    [[nodiscard]] WM_HOST_DEVICE std::size_t local(std::size_t k) const noexcept {
      return permuted(k) / static_cast<std::size_t>(world);
    }
  };

  [[nodiscard]] static ref_type make_ref(wm::partition_ref part) noexcept {
    int bits = 0;
    while (bits < 64 && (std::uint64_t{1} << bits) < part.entries) { ++bits; }
    std::uint64_t const mask = bits == 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << bits) - 1;
    return {part.entries, mask, bits / 2 > 0 ? bits / 2 : 1, part.world};
  }
};

static_assert(wm::mapping<hashed>);
static_assert(!wm::contiguous_mapping<hashed>);

}  // namespace wm_test
