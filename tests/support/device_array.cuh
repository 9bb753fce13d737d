// SPDX-License-Identifier: Apache-2.0
// Device buffers for the GPU tests: a host vector copied to the device (and back), and every row
// of a table-like (a tensor, an embedding) gathered into a poisoned buffer.
#pragma once

#include <wm/error.hpp>

#include <cuda/stream_ref>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace wm_test {

/// A copy of a host vector on the device (at least one element allocated, so ptr is never null).
template <class T>
struct device_array {
  T* ptr{};
  std::size_t n{};
  explicit device_array(std::vector<T> const& h) : n{h.size()} {
    WM_CUDA_TRY(cudaMalloc(&ptr, std::max<std::size_t>(n, 1) * sizeof(T)));
    if (n > 0) { WM_CUDA_TRY(cudaMemcpy(ptr, h.data(), n * sizeof(T), cudaMemcpyHostToDevice)); }
    // A pageable copy may return before its DMA ends, on the legacy stream: work on a
    // cudaStreamNonBlocking stream must find the elements in place.
    WM_CUDA_TRY(cudaDeviceSynchronize());
  }
  ~device_array() { (void)cudaFree(ptr); }
  device_array(device_array const&)            = delete;
  device_array& operator=(device_array const&) = delete;
  /// The n elements, copied back (cudaMemcpy: after the work of the legacy default stream).
  [[nodiscard]] std::vector<T> to_host() const {
    std::vector<T> h(n);
    if (n > 0) { WM_CUDA_TRY(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost)); }
    return h;
  }
};

/// Rows 0 .. rows-1 of @p t (anything with gather(span of int64 keys, T*, stream_ref)), gathered
/// on @p s into a buffer first filled with @p poison, after the stream has finished.
template <class T, class Table>
[[nodiscard]] std::vector<T> gather_every_row(Table& t, std::size_t rows, std::size_t cols,
                                              T poison, cudaStream_t s) {
  std::vector<std::int64_t> idx(rows);
  for (std::size_t k = 0; k < rows; ++k) { idx[k] = static_cast<std::int64_t>(k); }
  device_array<std::int64_t> di{idx};
  device_array<T> out{std::vector<T>(rows * cols, poison)};
  t.gather(std::span<std::int64_t const>{di.ptr, rows}, out.ptr, cuda::stream_ref{s});
  WM_CUDA_TRY(cudaStreamSynchronize(s));
  return out.to_host();
}

}  // namespace wm_test
