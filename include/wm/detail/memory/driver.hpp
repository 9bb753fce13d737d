// SPDX-License-Identifier: Apache-2.0
// The few CUDA driver API functions wm::memory needs (virtual memory management), reached
// through cudaGetDriverEntryPointByVersion: programs then load without libcuda.so present
// (GPU tests can report "skipped" on machines with no driver), and need no -lcuda.
#pragma once

#include <wm/error.hpp>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <string>

namespace wm::detail {

struct driver_api {
  decltype(&::cuMemCreate) mem_create{};
  decltype(&::cuMemRelease) mem_release{};
  decltype(&::cuMemExportToShareableHandle) mem_export{};
  decltype(&::cuMemImportFromShareableHandle) mem_import{};
  decltype(&::cuMemAddressReserve) address_reserve{};
  decltype(&::cuMemAddressFree) address_free{};
  decltype(&::cuMemMap) mem_map{};
  decltype(&::cuMemUnmap) mem_unmap{};
  decltype(&::cuMemSetAccess) mem_set_access{};
  decltype(&::cuMemGetAllocationGranularity) granularity{};
  decltype(&::cuGetErrorName) error_name{};

  /// Loads the entry points once. @throw wm::cuda_error if the driver lacks one
  [[nodiscard]] static driver_api const& get() {
    static driver_api const api = [] {
      driver_api a;
      load(a.mem_create, "cuMemCreate");
      load(a.mem_release, "cuMemRelease");
      load(a.mem_export, "cuMemExportToShareableHandle");
      load(a.mem_import, "cuMemImportFromShareableHandle");
      load(a.address_reserve, "cuMemAddressReserve");
      load(a.address_free, "cuMemAddressFree");
      load(a.mem_map, "cuMemMap");
      load(a.mem_unmap, "cuMemUnmap");
      load(a.mem_set_access, "cuMemSetAccess");
      load(a.granularity, "cuMemGetAllocationGranularity");
      load(a.error_name, "cuGetErrorName");
      return a;
    }();
    return api;
  }

 private:
  template <class F>
  static void load(F& fn, char const* name) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status{};
    WM_CUDA_TRY(cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &status));
    if (status != cudaDriverEntryPointSuccess || p == nullptr) {
      throw cuda_error{std::string{"wm: the CUDA driver has no entry point "} + name,
                       static_cast<int>(cudaErrorSymbolNotFound)};
    }
    fn = reinterpret_cast<F>(p);
  }
};

[[noreturn]] inline void throw_cu_error(char const* file, int line, char const* call, CUresult r) {
  char const* name = nullptr;
  if (driver_api::get().error_name(r, &name) != CUDA_SUCCESS || name == nullptr) { name = "?"; }
  throw cuda_error{
      "wm: CUDA driver error " + std::string{name} + " in `" + call + "` at " + where(file, line),
      static_cast<int>(r)};
}

}  // namespace wm::detail

/// Runs a CUDA driver call (through wm::detail::driver_api) and throws wm::cuda_error on failure.
#define WM_CU_TRY(call)                                                       \
  do {                                                                        \
    CUresult const wm_cu_status_ = (call);                                    \
    if (wm_cu_status_ != CUDA_SUCCESS) {                                      \
      ::wm::detail::throw_cu_error(__FILE__, __LINE__, #call, wm_cu_status_); \
    }                                                                         \
  } while (0)
