// SPDX-License-Identifier: Apache-2.0
// GPU test of the leak check (leak_check.hpp): a leak of each kind, made on purpose between two
// snapshots, is reported, exactly, and the same calls balanced are not; the leaks are then freed.
// Under a profiler or compute-sanitizer (no CUPTI subscription) the case reports "skipped".
#include <wm/error.hpp>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "catch.hpp"
#include "leak_check.hpp"
#include "skip.hpp"

namespace {

std::int64_t const slack = std::int64_t{8} << 20;  // as tests/memory/memory_test.cu's check

}  // namespace

TEST_CASE("leak check: leaked events, streams, small device and pinned allocations show", "[gpu]") {
  auto& objects = wm_test::cuda_objects::start();
  if (!objects.counting()) {
    return wm_test::skip("CUDA objects not counted: " + objects.why_not());
  }
  cudaStream_t s{};
  WM_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // First use of the pool, so that its reserve exists before the baseline.
  void* warm = nullptr;
  WM_CUDA_TRY(cudaMallocAsync(&warm, 256, s));
  WM_CUDA_TRY(cudaFreeAsync(warm, s));
  auto const before = wm_test::cuda_snapshot::take();

  SECTION("balanced: nothing shows") {
    cudaEvent_t e{};
    WM_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    WM_CUDA_TRY(cudaEventDestroy(e));
    void* d = nullptr;
    WM_CUDA_TRY(cudaMalloc(&d, 4096));
    WM_CUDA_TRY(cudaFree(d));
    WM_CUDA_TRY(cudaMallocAsync(&d, 4096, s));
    WM_CUDA_TRY(cudaFreeAsync(d, s));
    void* h = nullptr;
    WM_CUDA_TRY(cudaMallocHost(&h, 4096));
    WM_CUDA_TRY(cudaFreeHost(h));
    auto const grew = wm_test::cuda_growth(before, wm_test::cuda_snapshot::take(), slack);
    INFO(grew);
    CHECK(grew.empty());
  }
  SECTION("an event") {
    cudaEvent_t e{};
    WM_CUDA_TRY(cudaEventCreate(&e));
    auto const g = wm_test::cuda_snapshot::take().objects - before.objects;
    CHECK(g.events == 1);
    CHECK_FALSE(wm_test::cuda_growth(before, wm_test::cuda_snapshot::take(), slack).empty());
    WM_CUDA_TRY(cudaEventDestroy(e));
  }
  SECTION("a stream") {
    cudaStream_t t{};
    WM_CUDA_TRY(cudaStreamCreate(&t));
    CHECK((wm_test::cuda_snapshot::take().objects - before.objects).streams == 1);
    WM_CUDA_TRY(cudaStreamDestroy(t));
  }
  SECTION("4 KiB of cudaMalloc, below the driver's 2 MiB pages") {
    void* d = nullptr;
    WM_CUDA_TRY(cudaMalloc(&d, 4096));
    auto const g = wm_test::cuda_snapshot::take().objects - before.objects;
    CHECK(g.device_allocations == 1);
    CHECK(g.device_bytes == 4096);
    WM_CUDA_TRY(cudaFree(d));
  }
  SECTION("256 bytes of cudaMallocAsync: the pool's used bytes, exactly") {
    void* d = nullptr;
    WM_CUDA_TRY(cudaMallocAsync(&d, 256, s));
    auto const after = wm_test::cuda_snapshot::take();
    CHECK(after.memory.pool_used > before.memory.pool_used);
    CHECK((after.objects - before.objects).device_bytes == 256);
    CHECK_FALSE(wm_test::cuda_growth(before, after, slack).empty());
    WM_CUDA_TRY(cudaFreeAsync(d, s));
  }
  SECTION("pinned host memory: cudaMallocHost and cudaHostRegister") {
    void* h = nullptr;
    WM_CUDA_TRY(cudaMallocHost(&h, 4096));
    void* r = std::aligned_alloc(4096, 8192);
    REQUIRE(r != nullptr);
    WM_CUDA_TRY(cudaHostRegister(r, 8192, cudaHostRegisterDefault));
    auto const g = wm_test::cuda_snapshot::take().objects - before.objects;
    CHECK(g.pinned_host == 2);
    CHECK(g.pinned_host_bytes == 4096 + 8192);
    WM_CUDA_TRY(cudaHostUnregister(r));
    std::free(r);
    WM_CUDA_TRY(cudaFreeHost(h));
  }
  WM_CUDA_TRY(cudaStreamSynchronize(s));
  WM_CUDA_TRY(cudaStreamDestroy(s));
}
