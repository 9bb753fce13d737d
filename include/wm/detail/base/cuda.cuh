// SPDX-License-Identifier: Apache-2.0
// Kernel utilities shared by every module: launch sizes cached per device, grid-stride loops,
// the vector types of row accesses, and small element-wise operations run through CUB.
#pragma once

#include <wm/error.hpp>

#include <cub/device/device_for.cuh>
#include <cuda/cmath>
#include <cuda/std/bit>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

namespace wm::detail {

/// One int per device, computed once per device by @p make(device) (never 0 once made).
class per_device_value {
 public:
  template <class Make>
  [[nodiscard]] int get(Make&& make) {
    int dev = 0;
    WM_CUDA_TRY(cudaGetDevice(&dev));
    if (dev < 0 || static_cast<std::size_t>(dev) >= values_.size()) { return make(dev); }
    int v = values_[static_cast<std::size_t>(dev)].load(std::memory_order_relaxed);
    if (v == 0) {
      v = make(dev);
      values_[static_cast<std::size_t>(dev)].store(v, std::memory_order_relaxed);
    }
    return v;
  }

 private:
  std::array<std::atomic<int>, 64> values_{};
};

/// Multiprocessors of the current device.
[[nodiscard]] inline int sm_count() {
  static per_device_value cache;
  return cache.get([](int dev) {
    int sms = 0;
    WM_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    return std::max(sms, 1);
  });
}

/// Blocks of 256 threads for an element-wise kernel over @p n items: one item per thread, at
/// most 8 blocks per multiprocessor (the kernels stride over the rest).
[[nodiscard]] inline int elementwise_blocks(std::size_t n) {
  return static_cast<int>(std::clamp<std::size_t>(cuda::ceil_div(n, std::size_t{256}), 1,
                                                  static_cast<std::size_t>(sm_count()) * 8));
}

/// This thread's first item and the stride of a grid-stride loop.
[[nodiscard]] __device__ inline std::size_t grid_thread() {
  return blockIdx.x * std::size_t{blockDim.x} + threadIdx.x;
}
[[nodiscard]] __device__ inline std::size_t grid_threads() {
  return gridDim.x * std::size_t{blockDim.x};
}

/// Calls f(i) for every i < n, grid-stride.
template <class F>
__device__ inline void for_each_index(std::size_t n, F&& f) {
  for (std::size_t i = grid_thread(); i < n; i += grid_threads()) { f(i); }
}

/// Radix-sort bits that order every value below @p rows (at least 1, at most 63).
[[nodiscard]] constexpr int row_bits(std::size_t rows) noexcept {
  return std::clamp(static_cast<int>(cuda::std::bit_width(rows > 0 ? rows - 1 : 0)), 1, 63);
}

/// Bits that hold every owner rank 0..world (world itself marks an invalid index).
[[nodiscard]] constexpr int owner_bits(int world) noexcept {
  return std::max(1, static_cast<int>(cuda::std::bit_width(static_cast<unsigned>(world))));
}

// ---- vector accesses --------------------------------------------------------------------------

/// Largest vector width in {16, 8, 4, 2, 1} bytes dividing every size and address given.
[[nodiscard]] inline int vector_width(std::initializer_list<std::uintptr_t> values) {
  for (int v : {16, 8, 4, 2}) {
    bool ok = true;
    for (auto x : values) { ok = ok && x % static_cast<std::uintptr_t>(v) == 0; }
    if (ok) { return v; }
  }
  return 1;
}

/// Calls f.template operator()<Vec>() with the built-in vector type of @p vec_bytes bytes (the
/// types the cache-hinted loads and stores take).
template <class F>
void with_vector(int vec_bytes, F&& f) {
  switch (vec_bytes) {
    case 16: f.template operator()<uint4>(); break;
    case 8: f.template operator()<uint2>(); break;
    case 4: f.template operator()<unsigned>(); break;
    case 2: f.template operator()<unsigned short>(); break;
    default: f.template operator()<unsigned char>(); break;
  }
}

/// Calls f(std::bool_constant<b>{}): a flag known at compile time (std::true_type,
/// std::false_type) instantiates one branch, a runtime bool both (each kernel variant a flag
/// selects is compiled only where it can be taken).
template <class F>
decltype(auto) with_flag(bool b, F&& f) {
  return b ? f(std::true_type{}) : f(std::false_type{});
}
template <bool B, class F>
decltype(auto) with_flag(std::bool_constant<B>, F&& f) {
  return f(std::bool_constant<B>{});
}

/// V consecutive values of T, loaded and stored as one access (element-typed arithmetic).
template <class T, int V>
struct alignas(sizeof(T) * V) vec_of {
  T v[V];
};

// ---- element-wise operations (cub::DeviceFor) --------------------------------------------------

/// out[i] = first + i.
template <class T>
struct iota_op {
  T* out;
  std::size_t first;
  __device__ void operator()(std::size_t i) const { out[i] = static_cast<T>(first + i); }
};

/// out[i] = in[order[i]].
template <class T>
struct permute_op {
  T const* in;
  std::size_t const* order;
  T* out;
  __device__ void operator()(std::size_t i) const { out[i] = in[order[i]]; }
};

/// Fills @p out with first, first + 1, ... (n values), on @p stream.
template <class T>
void iota_async(T* out, std::size_t n, std::size_t first, cudaStream_t stream) {
  if (n == 0) { return; }
  WM_CUDA_TRY(cub::DeviceFor::Bulk(n, iota_op<T>{out, first}, stream));
}

/// out[i] = in[order[i]] for i < n, on @p stream.
template <class T>
void permute_async(T const* in, std::size_t const* order, std::size_t n, T* out,
                   cudaStream_t stream) {
  if (n == 0) { return; }
  WM_CUDA_TRY(cub::DeviceFor::Bulk(n, permute_op<T>{in, order, out}, stream));
}

}  // namespace wm::detail
