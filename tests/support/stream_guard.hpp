// SPDX-License-Identifier: Apache-2.0
// A stream for a GPU test that must not leak it, also when a check throws.
#pragma once

#include <wm/error.hpp>

#include <cuda_runtime_api.h>

namespace wm_test {

/// A cudaStreamNonBlocking stream, synchronized and destroyed at scope exit (work still queued
/// on it finishes before the objects declared ahead of the guard go).
struct stream_guard {
  cudaStream_t s{};
  stream_guard() { WM_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  stream_guard(stream_guard const&)            = delete;
  stream_guard& operator=(stream_guard const&) = delete;
  ~stream_guard() {
    (void)cudaStreamSynchronize(s);
    (void)cudaStreamDestroy(s);
  }
};

}  // namespace wm_test
