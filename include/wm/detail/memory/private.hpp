// SPDX-License-Identifier: Apache-2.0
// distributed·device and distributed·host: each rank allocates its own part, which no peer maps
// (cudaMalloc; cudaMallocHost, mapped into this rank's GPU).
#pragma once

#include <wm/comm.hpp>
#include <wm/detail/memory/collective.hpp>
#include <wm/detail/memory/state.hpp>
#include <wm/error.hpp>

#include <cuda_runtime_api.h>

#include <string>

namespace wm::detail {

/// One rank's own allocation: GPU memory (@p Host false) or pinned host memory (@p Host true).
template <bool Host>
class private_resource {
 public:
  /// No peer reaches this memory: no second release barrier.
  static constexpr bool peers_import = false;

  /// Allocates this rank's part (collective: every rank learns of any rank's failure).
  explicit private_resource(memory_state& s) : device_{s.device} {
    try {
      allocate(s);
    } catch (...) {  // another rank failed, or this one after allocating
      release_local();
      throw;
    }
  }
  private_resource(private_resource const&)            = delete;
  private_resource& operator=(private_resource const&) = delete;
  ~private_resource() { release_local(); }

  void close_imports() noexcept {}

 private:
  void allocate(memory_state& s) {
    std::size_t const bytes = s.local_bytes();
    collective_step(*s.comm,
                    std::string{"distributed "} + (Host ? "host" : "device") +
                        " memory: allocating " + std::to_string(bytes) + " bytes",
                    [&] {
                      if (bytes == 0) { return; }
                      if constexpr (Host) {
                        WM_CUDA_TRY(cudaMallocHost(&own_, bytes));
                        void* dev = nullptr;
                        WM_CUDA_TRY(cudaHostGetDevicePointer(&dev, own_, 0));
                        s.local      = static_cast<std::byte*>(dev);
                        s.local_host = static_cast<std::byte*>(own_);
                      } else {
                        WM_CUDA_TRY(cudaMalloc(&own_, bytes));
                        s.local = static_cast<std::byte*>(own_);
                      }
                    });
  }

  void release_local() noexcept {
    if (own_ == nullptr) { return; }
    device_scope const on{device_};
    if constexpr (Host) {
      (void)cudaFreeHost(own_);
    } else {
      (void)cudaFree(own_);
    }
    own_ = nullptr;
  }

  int device_{};
  void* own_{};
};

using device_resource = private_resource<false>;  ///< distributed·device
using pinned_resource = private_resource<true>;   ///< distributed·host

}  // namespace wm::detail
