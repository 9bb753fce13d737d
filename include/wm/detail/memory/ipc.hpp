// SPDX-License-Identifier: Apache-2.0
// chunked·device: each rank cudaMallocs its part and opens every peer's through CUDA IPC
// handles, one pointer per rank. A part whose release could not agree with the peers is kept
// until the process ends (docs/design.md, "Memory kinds").
#pragma once

#include <wm/comm.hpp>
#include <wm/detail/memory/collective.hpp>
#include <wm/detail/memory/state.hpp>
#include <wm/error.hpp>

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <vector>

namespace wm::detail {

/// Says once per process that a chunked·device part is kept for peers (keep_for_peers).
inline void report_part_kept(int rank, int device, std::size_t bytes) noexcept {
  static std::atomic<bool> said{false};
  if (said.exchange(true)) { return; }
  std::fprintf(stderr,
               "wm: rank %d: a memory release could not agree with its peers (the communicator "
               "is aborted); keeping %zu bytes of chunked device memory on GPU %d, which peers "
               "may still map through CUDA IPC, until this process ends (this message is shown "
               "once; see docs/design.md, \"Memory kinds\")\n",
               rank, bytes, device);
}

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
      if (!release_barrier(*s.comm, s.args, s.comm->timeout())) { keep_for_peers(); }
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

  /**
   * After a release agreement that failed (the communicator is aborted): peers may still map
   * this rank's part, and memory freed while another process has it open through CUDA IPC may
   * be handed out again under their mapping (they would read another allocation's bytes, or
   * fault). The part is therefore not freed: it is kept, deliberately leaked, until this process
   * ends, with one message per process. A part no peer can have opened (one rank) is freed.
   */
  void keep_for_peers() noexcept {
    if (own_ == nullptr || !exported_) { return; }
    report_part_kept(rank_, device_, bytes_);
    own_ = nullptr;
  }

 private:
  void allocate(memory_state& s) {
    auto& comm              = *s.comm;
    int const me            = comm.rank();
    std::size_t const bytes = s.local_bytes();
    rank_                   = me;
    bytes_                  = bytes;
    exported_               = comm.size() > 1;
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
  int rank_{};
  void* own_{};
  std::size_t bytes_{};
  bool exported_{false};  // peers were given its handle (several ranks)
  std::vector<void*> opened_;
};

}  // namespace wm::detail
