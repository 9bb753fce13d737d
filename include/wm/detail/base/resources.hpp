// SPDX-License-Identifier: Apache-2.0
// RAII owners of CUDA runtime resources: a stream, an event, pinned host and device buffers.
// Move-only; destructors never throw (errors in teardown are ignored). Host-only.
#pragma once

#include <wm/error.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>

namespace wm::detail {

/// An owned stream (RMM's cuda_stream is the model).
class unique_stream {
 public:
  unique_stream() = default;
  /// A non-blocking stream; @p highest_priority: the device's highest stream priority.
  [[nodiscard]] static unique_stream make(bool highest_priority = false) {
    unique_stream s;
    if (highest_priority) {
      int least = 0, greatest = 0;
      WM_CUDA_TRY(cudaDeviceGetStreamPriorityRange(&least, &greatest));
      WM_CUDA_TRY(cudaStreamCreateWithPriority(&s.s_, cudaStreamNonBlocking, greatest));
    } else {
      WM_CUDA_TRY(cudaStreamCreateWithFlags(&s.s_, cudaStreamNonBlocking));
    }
    return s;
  }
  unique_stream(unique_stream&& o) noexcept : s_{std::exchange(o.s_, nullptr)} {}
  unique_stream& operator=(unique_stream&& o) noexcept {
    if (this != &o) {
      reset();
      s_ = std::exchange(o.s_, nullptr);
    }
    return *this;
  }
  unique_stream(unique_stream const&)            = delete;
  unique_stream& operator=(unique_stream const&) = delete;
  ~unique_stream() { reset(); }
  [[nodiscard]] cudaStream_t get() const noexcept { return s_; }
  [[nodiscard]] explicit operator bool() const noexcept { return s_ != nullptr; }
  void reset() noexcept {
    if (s_ != nullptr) { (void)cudaStreamDestroy(s_); }
    s_ = nullptr;
  }

 private:
  cudaStream_t s_{};
};

/// An owned event (no timing: for ordering only).
class unique_event {
 public:
  unique_event() = default;
  [[nodiscard]] static unique_event make() {
    unique_event e;
    WM_CUDA_TRY(cudaEventCreateWithFlags(&e.e_, cudaEventDisableTiming));
    return e;
  }
  unique_event(unique_event&& o) noexcept : e_{std::exchange(o.e_, nullptr)} {}
  unique_event& operator=(unique_event&& o) noexcept {
    if (this != &o) {
      reset();
      e_ = std::exchange(o.e_, nullptr);
    }
    return *this;
  }
  unique_event(unique_event const&)            = delete;
  unique_event& operator=(unique_event const&) = delete;
  ~unique_event() { reset(); }
  [[nodiscard]] cudaEvent_t get() const noexcept { return e_; }
  [[nodiscard]] explicit operator bool() const noexcept { return e_ != nullptr; }
  void reset() noexcept {
    if (e_ != nullptr) { (void)cudaEventDestroy(e_); }
    e_ = nullptr;
  }

 private:
  cudaEvent_t e_{};
};

/// @p n values of T in pinned host memory (`Pinned`) or device memory.
template <class T, bool Pinned>
class cuda_buffer {
 public:
  cuda_buffer() = default;
  explicit cuda_buffer(std::size_t n) {
    if (n == 0) { return; }
    if constexpr (Pinned) {
      WM_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&p_), n * sizeof(T)));
    } else {
      WM_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&p_), n * sizeof(T)));
    }
    n_ = n;
  }
  cuda_buffer(cuda_buffer&& o) noexcept
      : p_{std::exchange(o.p_, nullptr)}, n_{std::exchange(o.n_, 0)} {}
  cuda_buffer& operator=(cuda_buffer&& o) noexcept {
    if (this != &o) {
      reset();
      p_ = std::exchange(o.p_, nullptr);
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }
  cuda_buffer(cuda_buffer const&)            = delete;
  cuda_buffer& operator=(cuda_buffer const&) = delete;
  ~cuda_buffer() { reset(); }
  [[nodiscard]] T* data() const noexcept { return p_; }
  [[nodiscard]] std::size_t size() const noexcept { return n_; }
  void reset() noexcept {
    if (p_ != nullptr) {
      if constexpr (Pinned) {
        (void)cudaFreeHost(p_);
      } else {
        (void)cudaFree(p_);
      }
    }
    p_ = nullptr;
    n_ = 0;
  }

 private:
  T* p_{};
  std::size_t n_{};
};

template <class T>
using pinned_buffer = cuda_buffer<T, true>;
template <class T>
using device_buffer = cuda_buffer<T, false>;

}  // namespace wm::detail
