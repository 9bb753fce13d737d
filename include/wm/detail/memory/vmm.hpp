// SPDX-License-Identifier: Apache-2.0
// continuous·device: each rank backs its share of one virtual range with its own GPU memory
// (driver VMM: cuMemCreate, fd export over the node channel, import, cuMemMap into one reserved
// range on every rank).
#pragma once

#include <wm/comm.hpp>
#include <wm/detail/base/posix.hpp>
#include <wm/detail/memory/collective.hpp>
#include <wm/detail/memory/driver.hpp>
#include <wm/detail/memory/plan.hpp>
#include <wm/detail/memory/state.hpp>
#include <wm/error.hpp>

#include <cuda.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace wm::detail {

class vmm_resource {
 public:
  /// Peers map this rank's memory, but the mappings keep it alive: no second release barrier.
  static constexpr bool peers_import = false;

  /// Allocates, exports, imports and maps (collective). Fills @p s's pointers.
  explicit vmm_resource(memory_state& s) : device_{s.device} {
    try {
      allocate(s);
    } catch (...) {
      release_local();
      throw;
    }
  }
  vmm_resource(vmm_resource const&)            = delete;
  vmm_resource& operator=(vmm_resource const&) = delete;
  ~vmm_resource() { release_local(); }

  void close_imports() noexcept {}

 private:
  void allocate(memory_state& s) {
    auto const& d = driver_api::get();
    auto& comm    = *s.comm;
    int const me  = comm.rank();
    CUmemAllocationProp prop{};
    prop.type                 = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type        = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id          = s.device;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    std::uint64_t vmm         = 0;
    collective_step(comm, "continuous device memory: VMM granularity", [&] {
      std::size_t g = 0;
      WM_CU_TRY(d.granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
      vmm = g;
    });
    for (auto g : comm.all_gather(vmm)) { vmm = std::max(vmm, g); }  // same on every rank
    auto const b    = vmm_boundaries(s.part.starts(), s.gran, vmm, s.total);
    va_bytes_       = b.back();
    auto const at   = [&](int p) { return b[static_cast<std::size_t>(p)]; };
    auto const mine = at(me + 1) - at(me);
    unique_fd exported;
    collective_step(
        comm, "continuous device memory: cuMemCreate of " + std::to_string(mine) + " bytes", [&] {
          if (mine == 0) { return; }
          WM_CU_TRY(d.mem_create(&own_, mine, &prop, 0));
          own_held_ = true;
          int fd    = -1;
          WM_CU_TRY(d.mem_export(&fd, own_, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
          exported.reset(fd);
        });
    auto fds = comm.channel().all_gather(exported.get());  // mapped layouts: node ranks == ranks
    collective_step(comm, "continuous device memory: mapping", [&] {
      if (va_bytes_ == 0) { return; }
      WM_CU_TRY(d.address_reserve(&va_, va_bytes_, vmm, 0, 0));
      for (int p = 0; p < comm.size(); ++p) {
        auto const off   = at(p);
        auto const bytes = at(p + 1) - off;
        if (bytes == 0) { continue; }
        CUmemGenericAllocationHandle h = own_;
        if (p != me) {
          auto const& fd = fds[static_cast<std::size_t>(p)];
          WM_EXPECTS(fd.valid(), "rank " + std::to_string(p) + " sent no allocation");
          WM_CU_TRY(d.mem_import(&h, reinterpret_cast<void*>(static_cast<std::uintptr_t>(fd.get())),
                                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
        }
        CUresult const mapped = d.mem_map(va_ + off, bytes, 0, h, 0);
        if (p != me) { (void)d.mem_release(h); }  // the mapping keeps the memory alive
        WM_CU_TRY(mapped);
        mapped_.emplace_back(off, bytes);
      }
      CUmemAccessDesc access{};
      access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      access.location.id   = s.device;
      access.flags         = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      WM_CU_TRY(d.mem_set_access(va_, va_bytes_, &access, 1));
    });
    if (own_held_) {  // the mapping holds the memory from here on
      (void)d.mem_release(own_);
      own_held_ = false;
    }
    s.chunks_from_base(va_ == 0 ? nullptr : reinterpret_cast<std::byte*>(va_));
  }

  void release_local() noexcept {
    if (va_ == 0 && !own_held_) { return; }
    device_scope const on{device_};
    auto const& d = driver_api::get();  // loaded: something was allocated through it
    if (va_ != 0) {
      for (auto [offset, bytes] : mapped_) { (void)d.mem_unmap(va_ + offset, bytes); }
      (void)d.address_free(va_, va_bytes_);
    }
    if (own_held_) { (void)d.mem_release(own_); }
    va_       = 0;
    own_held_ = false;
    mapped_.clear();
  }

  int device_{};
  CUdeviceptr va_{};
  std::size_t va_bytes_{};
  std::vector<std::pair<std::size_t, std::size_t>> mapped_;  // (offset, bytes) mapped into va_
  CUmemGenericAllocationHandle own_{};
  bool own_held_{false};
};

}  // namespace wm::detail
