// SPDX-License-Identifier: Apache-2.0
// Device memory as the driver counts it, for tests that check what a constructor allocates or a
// destructor gives back against a measurement instead of the library's own figures.
//
//   auto const before = wm_test::read_device_memory();
//   ... allocate ...
//   auto const grew = wm_test::read_device_memory().held() - before.held();  // signed bytes
//
// held() is what the device's allocations hold: cudaMemGetInfo's used bytes (total - free)
// less the part of the current memory pool's reserve that no cudaMallocAsync allocation uses
// (a freed stream-ordered allocation stays reserved by its pool, and must not read as a leak).
// pool_used is exact to the byte for cudaMallocAsync allocations; the rest is counted by the
// driver in pages (2 MiB for cudaMalloc), and counts every process on the device: a reading is
// only meaningful while this process is alone there.
#pragma once

#include <wm/error.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace wm_test {

/// One reading of the current device's memory (see above).
struct device_memory_reading {
  std::size_t free{};           ///< cudaMemGetInfo: free bytes of the device
  std::size_t total{};          ///< cudaMemGetInfo: the device's bytes
  std::size_t pool_reserved{};  ///< the current memory pool's cudaMemPoolAttrReservedMemCurrent
  std::size_t pool_used{};      ///< the current memory pool's cudaMemPoolAttrUsedMemCurrent

  /// Bytes the device's allocations hold, signed so that differences of readings are too.
  [[nodiscard]] std::int64_t held() const noexcept {
    return static_cast<std::int64_t>(total - free) - static_cast<std::int64_t>(pool_reserved) +
           static_cast<std::int64_t>(pool_used);
  }
};

/// Reads the current device's memory once the device is idle (synchronizes it: a cudaFree or
/// cudaFreeAsync still queued is counted as done).
[[nodiscard]] inline device_memory_reading read_device_memory() {
  WM_CUDA_TRY(cudaDeviceSynchronize());
  device_memory_reading r;
  WM_CUDA_TRY(cudaMemGetInfo(&r.free, &r.total));
  int device = 0;
  WM_CUDA_TRY(cudaGetDevice(&device));
  cudaMemPool_t pool{};
  WM_CUDA_TRY(cudaDeviceGetMemPool(&pool, device));
  std::uint64_t v = 0;
  WM_CUDA_TRY(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &v));
  r.pool_reserved = static_cast<std::size_t>(v);
  WM_CUDA_TRY(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &v));
  r.pool_used = static_cast<std::size_t>(v);
  return r;
}

}  // namespace wm_test
