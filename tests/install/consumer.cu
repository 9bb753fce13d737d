// SPDX-License-Identifier: Apache-2.0
// A user's program against the installed package. It instantiates the templates whose device
// code needs the package's compile requirements (wm-cuda-std.cmake: C++20,
// --expt-relaxed-constexpr): tensor gather and scatter on a mapped and on the distributed layout,
// and an embedding's gather and apply_gradients with Adam. Only built by the install test;
// running it needs GPUs.
#include <wm/embedding.cuh>
#include <wm/launch.hpp>
#include <wm/wm.cuh>  // the umbrella (declarations) after the module headers: both orders compile

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <span>

// The package must give a user's program the flags wm's own build uses (wm-cuda-std.cmake, one
// function for both). Checked here directly: today's headers also compile without the nvcc flag.
static_assert(__cplusplus >= 202002L, "wm::wm did not request C++20");
#if !defined(__CUDACC_RELAXED_CONSTEXPR__)
#error "wm::wm did not add --expt-relaxed-constexpr, which wm's own build uses"
#endif

namespace {

template <class Tensor>
void round_trip(Tensor& t, std::span<std::int64_t const> ids, float* rows, cudaStream_t s) {
  t.gather(ids, rows, cuda::stream_ref{s});
  t.scatter(ids, rows, cuda::stream_ref{s});
}

}  // namespace

int main() {
  if (wm::local_device_count() == 0) {
    std::printf("consumer: no GPU found, nothing to run\n");
    return 0;
  }
  wm::launch(wm::local_device_count(), [](wm::communicator& comm) {
    std::size_t const rows = 1000;
    std::size_t const dim  = 8;
    std::size_t const n    = 16;
    std::int64_t* ids      = nullptr;
    float* values          = nullptr;
    WM_CUDA_TRY(cudaMalloc(&ids, n * sizeof(std::int64_t)));
    WM_CUDA_TRY(cudaMalloc(&values, n * dim * sizeof(float)));
    WM_CUDA_TRY(cudaMemset(ids, 0, n * sizeof(std::int64_t)));
    cudaStream_t s{};
    WM_CUDA_TRY(cudaStreamCreate(&s));
    std::span<std::int64_t const> const keys{ids, n};
    {
      wm::tensor<float> mapped{comm, rows, dim};
      round_trip(mapped, keys, values, s);
      wm::tensor<float, wm::device, wm::distributed> spread{comm, rows, dim};
      round_trip(spread, keys, values, s);
      wm::embedding<float, wm::no_cache, wm::adam> table{comm, rows, dim};
      table.gather(keys, values, cuda::stream_ref{s});
      table.apply_gradients(keys, values, 0.01f, cuda::stream_ref{s});
    }
    WM_CUDA_TRY(cudaStreamDestroy(s));
    WM_CUDA_TRY(cudaFree(values));
    WM_CUDA_TRY(cudaFree(ids));
    std::printf("rank %d of %d: gather, scatter and apply_gradients ran\n", comm.rank(),
                comm.size());
  });
  return 0;
}
