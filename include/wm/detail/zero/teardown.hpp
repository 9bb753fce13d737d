// SPDX-License-Identifier: Apache-2.0
// The host side of wm::zero_optimizer's teardown: before its buffers go it waits for the device
// work that may still use them (its streams up to now, the events it recorded), at most until
// one deadline in all. Past it the rest is not waited for: `stuck()` names what was, and the
// owner leaves its buffers allocated (freeing them would wait as well, or free what a copy or a
// kernel still uses). Never throws.
#pragma once

#include <wm/detail/base/deadline.hpp>

#include <cuda_runtime_api.h>

#include <chrono>

namespace wm::detail::zero {

class teardown {
 public:
  explicit teardown(std::chrono::milliseconds timeout) noexcept
      : deadline_{deadline_after(timeout)} {}

  /// Waits for @p e (nothing for a null event, or once something got stuck).
  void event(cudaEvent_t e, char const* what) noexcept {
    if (e == nullptr || stuck_ != nullptr) { return; }
    cudaError_t q{};
    while ((q = cudaEventQuery(e)) == cudaErrorNotReady) {
      if (clock_type::now() >= deadline_) {
        stuck_ = what;
        return;
      }
      pause_.pause();
    }
    if (q != cudaSuccess) { (void)cudaGetLastError(); }  // failed: the GPU will not run it
  }

  /// Waits for the work enqueued on @p s so far (nothing for a null stream).
  void stream(cudaStream_t s, char const* what) noexcept {
    if (s == nullptr) { return; }
    cudaEvent_t e = nullptr;
    if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) == cudaSuccess &&
        cudaEventRecord(e, s) == cudaSuccess) {
      event(e, what);
    } else {
      (void)cudaGetLastError();
    }
    if (e != nullptr) { (void)cudaEventDestroy(e); }
  }

  /// What the teardown gave up waiting for; nullptr if everything ended in time.
  [[nodiscard]] char const* stuck() const noexcept { return stuck_; }

 private:
  clock_type::time_point deadline_;
  backoff pause_{std::chrono::microseconds{100}};
  char const* stuck_{nullptr};
};

}  // namespace wm::detail::zero
