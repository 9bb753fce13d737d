// SPDX-License-Identifier: Apache-2.0
// chunked·device: each rank cudaMallocs its part and opens every peer's through CUDA IPC
// handles, one pointer per rank.
#pragma once

#include <wm/comm.hpp>
#include <wm/detail/memory/collective.hpp>
#include <wm/detail/memory/state.hpp>
#include <wm/error.hpp>

#include <cuda_runtime_api.h>

#include <cstring>
#include <span>
#include <string>
#include <vector>

namespace wm::detail {

class ipc_resource {
 public:
  /// Peers open this rank's allocation: it may be freed only after every peer closed it (a
  /// second release barrier, after `close_imports`).
  static constexpr bool peers_import = true;

  /// Allocates and opens every peer's part (collective). Fills @p s's pointers.
  explicit ipc_resource(memory_state& s) : device_{s.device} {
    try {
      allocate(s);
    } catch (...) {
      // The steps fail on every rank together: close what this rank opened, wait until every
      // peer closed this rank's part (every rank, whether it owns memory or not), then free it.
      close_imports();
      (void)release_barrier(*s.comm, s.args, s.comm->timeout());
      release_local();
      throw;
    }
  }
  ipc_resource(ipc_resource const&)            = delete;
  ipc_resource& operator=(ipc_resource const&) = delete;
  ~ipc_resource() {
    close_imports();
    release_local();
  }

  /// Closes what this rank opened of its peers' parts. Peers may free theirs after this.
  void close_imports() noexcept {
    if (opened_.empty()) { return; }
    device_scope const on{device_};
    for (void* p : opened_) { (void)cudaIpcCloseMemHandle(p); }
    opened_.clear();
  }

 private:
  void allocate(memory_state& s) {
    auto& comm              = *s.comm;
    int const me            = comm.rank();
    std::size_t const bytes = s.local_bytes();
    cudaIpcMemHandle_t handle{};
    collective_step(
        comm, "chunked device memory: cudaMalloc of " + std::to_string(bytes) + " bytes", [&] {
          if (bytes == 0) { return; }
          WM_CUDA_TRY(cudaMalloc(&own_, bytes));
          WM_CUDA_TRY(cudaIpcGetMemHandle(&handle, own_));
        });
    auto const handles = comm.all_gather_bytes(bytes == 0 ? std::span<std::byte const>{}
                                                          : std::as_bytes(std::span{&handle, 1}));
    s.chunks.assign(static_cast<std::size_t>(comm.size()), nullptr);
    collective_step(comm, "chunked device memory: opening peers' IPC handles", [&] {
      for (int p = 0; p < comm.size(); ++p) {
        auto const& h = handles[static_cast<std::size_t>(p)];
        if (p == me) {
          s.chunks[static_cast<std::size_t>(p)] = static_cast<std::byte*>(own_);
        } else if (h.size() == sizeof(cudaIpcMemHandle_t)) {
          cudaIpcMemHandle_t peer{};
          std::memcpy(&peer, h.data(), sizeof(peer));
          void* ptr = nullptr;
          WM_CUDA_TRY(cudaIpcOpenMemHandle(&ptr, peer, cudaIpcMemLazyEnablePeerAccess));
          opened_.push_back(ptr);
          s.chunks[static_cast<std::size_t>(p)] = static_cast<std::byte*>(ptr);
        }
      }
    });
    s.local = s.chunks[static_cast<std::size_t>(me)];
  }

  void release_local() noexcept {
    if (own_ == nullptr) { return; }
    device_scope const on{device_};
    (void)cudaFree(own_);
    own_ = nullptr;
  }

  int device_{};
  void* own_{};
  std::vector<void*> opened_;
};

}  // namespace wm::detail
