// SPDX-License-Identifier: Apache-2.0
// Device workspaces: memory reused across calls (grown stream-ordered when a call needs more) and
// the carver that lays aligned arrays out in one. Every module that sorts or stages rows on the
// device uses them.
#pragma once

#include <wm/error.hpp>

#include <cuda/cmath>

#include <cuda_runtime_api.h>

#include <cstddef>

namespace wm::detail {

/// Device memory reused across calls; grows (stream-ordered) when a call needs more.
class workspace {
 public:
  workspace()                            = default;
  workspace(workspace const&)            = delete;
  workspace& operator=(workspace const&) = delete;
  /// Waits for the device (cudaFree does not wait for work that still uses stream-ordered
  /// memory), then gives the memory back to the pool it came from.
  ~workspace() {
    if (ptr_ != nullptr) {
      (void)cudaDeviceSynchronize();
      (void)cudaFreeAsync(ptr_, cudaStreamLegacy);
    }
  }
  /// At least @p bytes of device memory, valid for work ordered after this on @p stream.
  [[nodiscard]] std::byte* reserve(std::size_t bytes, cudaStream_t stream) {
    if (bytes > bytes_) {
      if (ptr_ != nullptr) { WM_CUDA_TRY(cudaFreeAsync(ptr_, stream)); }
      ptr_                    = nullptr;
      bytes_                  = 0;
      std::size_t const grown = cuda::round_up(bytes + bytes / 4, std::size_t{1} << 20);
      WM_CUDA_TRY(cudaMallocAsync(reinterpret_cast<void**>(&ptr_), grown, stream));
      bytes_ = grown;
    }
    return ptr_;
  }

 private:
  std::byte* ptr_{};
  std::size_t bytes_{};
};

/// Carves aligned arrays out of a workspace: first `add` every array, then `reserve`, then `take`.
class carver {
 public:
  template <class T>
  std::size_t add(std::size_t n) {
    std::size_t const at = total_;
    total_               = cuda::round_up(total_ + n * sizeof(T), std::size_t{256});
    return at;
  }
  [[nodiscard]] std::size_t total() const noexcept { return total_ == 0 ? 256 : total_; }
  template <class T>
  T* take(std::byte* base, std::size_t offset) const {
    return reinterpret_cast<T*>(base + offset);
  }

 private:
  std::size_t total_{};
};

}  // namespace wm::detail
