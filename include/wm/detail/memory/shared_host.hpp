// SPDX-License-Identifier: Apache-2.0
// continuous·host and chunked·host: the first rank creates a memfd, every rank maps it
// (MAP_SHARED) and registers it with CUDA (device pointer == host pointer). The fd travels over
// the node channel, so nothing is left in /dev/shm or System V when a process dies.
#pragma once

#include <wm/comm.hpp>
#include <wm/detail/base/posix.hpp>
#include <wm/detail/memory/collective.hpp>
#include <wm/detail/memory/plan.hpp>
#include <wm/detail/memory/state.hpp>
#include <wm/error.hpp>

#include <cuda_runtime_api.h>

#include <string>
#include <sys/mman.h>
#include <unistd.h>

namespace wm::detail {

class shared_host_resource {
 public:
  /// Every rank holds its own mapping of the memfd: no second release barrier.
  static constexpr bool peers_import = false;

  /// Creates (first rank), maps and registers (every rank); collective. Fills @p s's pointers.
  explicit shared_host_resource(memory_state& s) : device_{s.device} {
    try {
      allocate(s);
    } catch (...) {
      release_local();
      throw;
    }
  }
  shared_host_resource(shared_host_resource const&)            = delete;
  shared_host_resource& operator=(shared_host_resource const&) = delete;
  ~shared_host_resource() { release_local(); }

  void close_imports() noexcept {}

 private:
  void allocate(memory_state& s) {
    auto& comm      = *s.comm;
    long const page = ::sysconf(_SC_PAGESIZE);
    bytes_          = round_up(s.total, static_cast<std::size_t>(page > 0 ? page : 4096));
    unique_fd created;
    collective_step(comm, "host memory: memfd_create", [&] {
      if (comm.rank() != 0 || bytes_ == 0) { return; }
      created.reset(::memfd_create("wm-memory", MFD_CLOEXEC));
      if (!created.valid()) { throw io_error{"memfd_create: " + errno_text()}; }
      if (::ftruncate(created.get(), static_cast<off_t>(bytes_)) != 0) {
        throw io_error{"ftruncate to " + std::to_string(bytes_) + " bytes: " + errno_text()};
      }
    });
    auto fds               = comm.channel().all_gather(created.get());
    std::byte* device_base = nullptr;
    collective_step(comm, "host memory: mapping and registering", [&] {
      if (bytes_ == 0) { return; }
      void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0].get(), 0);
      if (p == MAP_FAILED) { throw io_error{"mmap of shared host memory: " + errno_text()}; }
      map_ = p;
      WM_CUDA_TRY(cudaHostRegister(p, bytes_, cudaHostRegisterMapped | cudaHostRegisterPortable));
      registered_ = true;
      void* dev   = nullptr;
      WM_CUDA_TRY(cudaHostGetDevicePointer(&dev, p, 0));
      device_base = static_cast<std::byte*>(dev);
    });
    s.chunks_from_base(device_base);
    s.local_host =
        map_ == nullptr ? nullptr : static_cast<std::byte*>(map_) + s.part.begin(s.rank()) * s.gran;
  }

  void release_local() noexcept {
    if (map_ == nullptr) { return; }
    device_scope const on{device_};
    if (registered_) { (void)cudaHostUnregister(map_); }
    (void)::munmap(map_, bytes_);
    map_        = nullptr;
    registered_ = false;
  }

  int device_{};
  void* map_{};
  std::size_t bytes_{};
  bool registered_{false};
};

}  // namespace wm::detail
