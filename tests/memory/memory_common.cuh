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

// A device buffer for the tensor rounds.
template <class T>
struct device_array {
  T* ptr{};
  explicit device_array(std::size_t n) {
    WM_CUDA_TRY(cudaMalloc(&ptr, std::max<std::size_t>(n, 1) * sizeof(T)));
  }
  ~device_array() { (void)cudaFree(ptr); }
  device_array(device_array const&) = delete;
};

inline float cell(std::size_t row, std::size_t col, std::uint32_t salt) {
  return static_cast<float>(pattern(row * 16 + col, 0, salt)) - 128.0f;  // exact in float
}

// A seed drawn on rank 0, the same on every rank.
inline std::uint64_t shared_seed(wm::communicator& comm) {
  return comm.all_gather(static_cast<std::uint64_t>(std::random_device{}()))[0];
}

}  // namespace memory_tests
