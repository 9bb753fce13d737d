// SPDX-License-Identifier: Apache-2.0
// Host test of the leak check's bookkeeping (cuda_objects.hpp, leak_check.hpp), no GPU needed:
// made-up driver call records fed to the counter as CUPTI would feed them, and snapshots
// compared. Each leaked kind must show, and only a successful call's exit counts.
#include "cuda_objects.hpp"

#include <cuda.h>

#include <cstdint>
#include <string>

#include "catch.hpp"
#include "leak_check.hpp"

namespace {

// One driver call's exit (or entry) record, fed to @p c.
template <class Params>
void call(wm_test::cuda_objects& c, CUpti_CallbackId id, Params const& params,
          CUresult result = CUDA_SUCCESS, CUpti_ApiCallbackSite site = CUPTI_API_EXIT) {
  CUpti_CallbackData d{};
  d.callbackSite        = site;
  d.functionParams      = &params;
  d.functionReturnValue = &result;
  wm_test::cuda_objects::callback(&c, CUPTI_CB_DOMAIN_DRIVER_API, id, &d);
}

struct no_params {
  void* unused;
};
struct alloc {  // cuMemAlloc_v2, cuMemAllocAsync
  CUdeviceptr* dptr;
  std::size_t bytesize;
};
struct device_free {
  CUdeviceptr dptr;
};
struct host_alloc {  // cuMemAllocHost_v2, cuMemHostAlloc
  void** pp;
  std::size_t bytesize;
};
struct host_ptr {  // cuMemHostRegister_v2, cuMemFreeHost, cuMemHostUnregister
  void* p;
  std::size_t bytesize;
};

}  // namespace

TEST_CASE("leak check bookkeeping: each leaked kind shows, balanced calls do not") {
  wm_test::cuda_objects c{wm_test::cuda_objects::unsubscribed{}};
  REQUIRE_FALSE(c.counting());
  auto const base = c.now();
  no_params const none{};

  // Balanced: an event, a stream, a device allocation, an async one, pinned memory, a
  // registration, each made and destroyed.
  call(c, CUPTI_DRIVER_TRACE_CBID_cuEventCreate, none);
  call(c, CUPTI_DRIVER_TRACE_CBID_cuEventDestroy_v2, none);
  call(c, CUPTI_DRIVER_TRACE_CBID_cuStreamCreate, none);
  call(c, CUPTI_DRIVER_TRACE_CBID_cuStreamDestroy_v2, none);
  CUdeviceptr d1 = 0x7f0000001000;
  call(c, CUPTI_DRIVER_TRACE_CBID_cuMemAlloc_v2, alloc{&d1, 4096});
  call(c, CUPTI_DRIVER_TRACE_CBID_cuMemFree_v2, device_free{d1});
  CUdeviceptr d2 = 0x7f0000002000;
  call(c, CUPTI_DRIVER_TRACE_CBID_cuMemAllocAsync, alloc{&d2, 100});
  call(c, CUPTI_DRIVER_TRACE_CBID_cuMemFreeAsync, device_free{d2});
  void* h1 = reinterpret_cast<void*>(std::uintptr_t{0x7e0000000000});
  call(c, CUPTI_DRIVER_TRACE_CBID_cuMemHostAlloc, host_alloc{&h1, 1 << 20});
  call(c, CUPTI_DRIVER_TRACE_CBID_cuMemFreeHost, host_ptr{h1, 0});
  void* h2 = reinterpret_cast<void*>(std::uintptr_t{0x7e0000100000});
  call(c, CUPTI_DRIVER_TRACE_CBID_cuMemHostRegister_v2, host_ptr{h2, 8192});
  call(c, CUPTI_DRIVER_TRACE_CBID_cuMemHostUnregister, host_ptr{h2, 0});
  // Not counted: entries, failed calls.
  call(c, CUPTI_DRIVER_TRACE_CBID_cuEventCreate, none, CUDA_SUCCESS, CUPTI_API_ENTER);
  call(c, CUPTI_DRIVER_TRACE_CBID_cuStreamCreate, none, CUDA_ERROR_OUT_OF_MEMORY);
  CHECK(c.now() == base);

  SECTION("an event") {
    call(c, CUPTI_DRIVER_TRACE_CBID_cuEventCreate, none);
    auto const g = c.now() - base;
    CHECK(g.events == 1);
    CHECK(g.to_string().find("events +1") != std::string::npos);
  }
  SECTION("a stream (with a priority)") {
    call(c, CUPTI_DRIVER_TRACE_CBID_cuStreamCreateWithPriority, none);
    CHECK((c.now() - base).streams == 1);
  }
  SECTION("a 256-byte cudaMallocAsync, far below a page") {
    CUdeviceptr d = 0x7f0000003000;
    call(c, CUPTI_DRIVER_TRACE_CBID_cuMemAllocAsync_ptsz, alloc{&d, 256});
    auto const g = c.now() - base;
    CHECK(g.device_allocations == 1);
    CHECK(g.device_bytes == 256);
  }
  SECTION("pinned host memory, allocated and registered") {
    void* h = reinterpret_cast<void*>(std::uintptr_t{0x7e0000200000});
    call(c, CUPTI_DRIVER_TRACE_CBID_cuMemAllocHost_v2, host_alloc{&h, 4096});
    void* r = reinterpret_cast<void*>(std::uintptr_t{0x7e0000300000});
    call(c, CUPTI_DRIVER_TRACE_CBID_cuMemHostRegister_v2, host_ptr{r, 4096});
    auto const g = c.now() - base;
    CHECK(g.pinned_host == 2);
    CHECK(g.pinned_host_bytes == 8192);
    CHECK(g.device_allocations == 0);
  }
  SECTION("a device pointer freed as host memory does not balance it") {
    CUdeviceptr d = 0x7e0000400000;
    call(c, CUPTI_DRIVER_TRACE_CBID_cuMemAlloc_v2, alloc{&d, 64});
    call(c, CUPTI_DRIVER_TRACE_CBID_cuMemFreeHost,
         host_ptr{reinterpret_cast<void*>(static_cast<std::uintptr_t>(d)), 0});
    auto const g = c.now() - base;
    CHECK(g.device_allocations == 1);
    CHECK(g.device_bytes == 64);
    CHECK(g.pinned_host == -1);
  }
}

TEST_CASE("leak check: snapshots differ where objects, pool bytes or held memory grew") {
  wm_test::cuda_snapshot before;
  before.memory = {std::size_t{100} << 30, std::size_t{140} << 30, std::size_t{64} << 20, 4096};
  std::int64_t const slack = std::int64_t{8} << 20;
  auto after               = before;
  CHECK(wm_test::cuda_growth(before, after, slack).empty());
  SECTION("one more event") {
    after.objects.events = 1;
    CHECK(wm_test::cuda_growth(before, after, slack).find("events +1") != std::string::npos);
  }
  SECTION("fewer live allocations than at the baseline (made before it, freed since)") {
    before.objects.device_allocations = 7760;
    CHECK(wm_test::cuda_growth(before, after, slack).empty());
    after.objects.device_allocations = 7761;
    CHECK(wm_test::cuda_growth(before, after, slack).find("device allocations +1") !=
          std::string::npos);
  }
  SECTION("the pool holds 16 bytes more (its reserve the same)") {
    after.memory.pool_used += 16;
    CHECK(wm_test::cuda_growth(before, after, slack).find("memory pool in use") !=
          std::string::npos);
  }
  SECTION("a freed async allocation left reserved by its pool is not a leak") {
    after.memory.free -= std::size_t{32} << 20;
    after.memory.pool_reserved += std::size_t{32} << 20;
    CHECK(after.memory.held() == before.memory.held());
    CHECK(wm_test::cuda_growth(before, after, slack).empty());
  }
  SECTION("16 MiB more held by the device, past the slack") {
    after.memory.free -= std::size_t{16} << 20;
    CHECK(wm_test::cuda_growth(before, after, slack).find("device memory held") !=
          std::string::npos);
  }
}
