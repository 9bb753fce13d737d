// SPDX-License-Identifier: Apache-2.0
// Device buffers for the GPU tests, the one set every test uses: device_array<T> (elements, a
// poisoned buffer or a copy of a host vector), device_bytes (raw bytes, poisoned) and every row of
// a table-like (a tensor, an embedding) gathered into a poisoned buffer.
//
// Every call that fills a buffer (construction, fill_bytes, upload) returns with the bytes in
// place: cudaMemset and a pageable cudaMemcpy may return before the device is done, on the legacy
// stream, which cudaStreamNonBlocking streams do not wait for (a gather on one was seen poisoned
// after it wrote, on an H200 shared with another process). At least one element is allocated, so
// ptr is never null, also for 0 elements.
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

/// The byte a new buffer's elements are poisoned with unless a test names another.
inline constexpr std::byte poison_byte{0xA5};

/// @p n elements of T on the device, freed at scope exit (also when a fill throws).
template <class T>
struct device_array {
  T* ptr{};         ///< the elements (never null)
  std::size_t n{};  ///< how many

  /// @p count elements whose every byte is @p poison.
  explicit device_array(std::size_t count, std::byte poison = poison_byte)
      : device_array{count, allocate_only{}} {
    fill_bytes(poison);
  }
  /// A copy of @p h.
  explicit device_array(std::vector<T> const& h) : device_array{h.size(), allocate_only{}} {
    upload(h);
  }
  ~device_array() { (void)cudaFree(ptr); }
  device_array(device_array const&)            = delete;
  device_array& operator=(device_array const&) = delete;

  /// Sets every byte of the n elements to @p b (a poison before a kernel writes them).
  void fill_bytes(std::byte b) {
    WM_CUDA_TRY(cudaMemset(ptr, static_cast<int>(b), std::max<std::size_t>(n, 1) * sizeof(T)));
    WM_CUDA_TRY(cudaDeviceSynchronize());
  }
  /// Copies @p h over the first h.size() elements (h.size() <= n).
  void upload(std::vector<T> const& h) {
    WM_EXPECTS(h.size() <= n, "a host vector no longer than the device array");
    if (!h.empty()) {
      WM_CUDA_TRY(cudaMemcpy(ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    }
    WM_CUDA_TRY(cudaDeviceSynchronize());
  }
  /// The n elements, read-only (keys for a gather or a scatter).
  [[nodiscard]] std::span<T const> span() const noexcept { return {ptr, n}; }
  /// The n elements, copied back (cudaMemcpy: after the work of the legacy default stream).
  [[nodiscard]] std::vector<T> to_host() const {
    std::vector<T> h(n);
    if (n > 0) { WM_CUDA_TRY(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost)); }
    return h;
  }

 private:
  struct allocate_only {};
  // The constructors above delegate here: once this one has returned, the destructor frees the
  // memory if their fill throws.
  device_array(std::size_t count, allocate_only) : n{count} {
    WM_CUDA_TRY(cudaMalloc(&ptr, std::max<std::size_t>(n, 1) * sizeof(T)));
  }
};

/// Raw device bytes, poisoned with poison_byte unless a test names another.
using device_bytes = device_array<std::byte>;

/// Rows 0 .. rows-1 of @p t (anything with gather(span of int64 keys, T*, stream_ref)), gathered
/// on @p s into a buffer first filled with @p poison, after the stream has finished.
template <class T, class Table>
[[nodiscard]] std::vector<T> gather_every_row(Table& t, std::size_t rows, std::size_t cols,
                                              T poison, cudaStream_t s) {
  std::vector<std::int64_t> idx(rows);
  for (std::size_t k = 0; k < rows; ++k) { idx[k] = static_cast<std::int64_t>(k); }
  device_array<std::int64_t> di{idx};
  device_array<T> out{std::vector<T>(rows * cols, poison)};
  t.gather(di.span(), out.ptr, cuda::stream_ref{s});
  WM_CUDA_TRY(cudaStreamSynchronize(s));
  return out.to_host();
}

}  // namespace wm_test
