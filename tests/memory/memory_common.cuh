// SPDX-License-Identifier: Apache-2.0
// Shared by the files of memory_test (one unit, tests/CMakeLists.txt): the byte pattern every
// rank writes into its part, and the small helpers several of the files use.
#pragma once

#include <wm/comm.hpp>
#include <wm/error.hpp>
#include <wm/memory.cuh>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <string>

#include "device_array.cuh"
#include "ranks.hpp"

namespace memory_tests {

// ---- the pattern ------------------------------------------------------------------------------
__host__ __device__ inline std::uint8_t pattern(std::size_t offset, int owner, std::uint32_t salt) {
  std::uint64_t z = offset * 0x9e3779b97f4a7c15ull +
                    static_cast<std::uint64_t>(owner) * 0xbf58476d1ce4e5b9ull + salt;
  z ^= z >> 31;
  z *= 0x94d049bb133111ebull;
  return static_cast<std::uint8_t>(z >> 56);
}

// Writes the pattern into a local view (View: wm::local_view).
template <class View>
__global__ void write_local(View v, int me, std::uint32_t salt) {
  std::size_t const first = v.first_entry * v.granularity;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < v.bytes();
       i += gridDim.x * blockDim.x) {
    reinterpret_cast<std::uint8_t*>(v.data)[i] = pattern(first + i, me, salt);
  }
}

inline constexpr int blocks  = 264;
inline constexpr int threads = 256;

template <class L, class Y>
std::string name_of() {
  return std::string{L::name} + "." + Y::name;
}

using wm_test::device_array;

inline float cell(std::size_t row, std::size_t col, std::uint32_t salt) {
  return static_cast<float>(pattern(row * 16 + col, 0, salt)) - 128.0f;  // exact in float
}

using wm_test::shared_seed;

}  // namespace memory_tests
