// SPDX-License-Identifier: Apache-2.0
// Helpers of every GPU test of the zero_test program (collectives_test.cu, stages_test.cu,
// checkpoint_load_test.cu, offload_test.cu, memory_test.cu): a stream, the seed all ranks share,
// a hash, element conversions. They need the communicator only: collectives_test.cu, which tests
// the communicator's device collectives, includes no more. The optimizer tests' helpers are in
// zero_model.cuh; a helper that one file uses is in that file.
#pragma once

#include <wm/comm.hpp>
#include <wm/error.hpp>

#include <cuda/stream_ref>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <random>
#include <type_traits>

#include "ranks.hpp"

namespace zero_cases {

using bf16 = __nv_bfloat16;

struct stream_holder {
  cudaStream_t s{};
  stream_holder() { WM_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~stream_holder() { (void)cudaStreamDestroy(s); }
  operator cuda::stream_ref() const { return cuda::stream_ref{s}; }
};

using wm_test::shared_seed;

inline std::uint64_t mix(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

inline double to_double(float v) {
  return v;
}
inline double to_double(bf16 v) {
  return static_cast<double>(__bfloat162float(v));
}

template <class T>
T from_double(double v) {
  if constexpr (std::is_same_v<T, float>) {
    return static_cast<float>(v);
  } else if constexpr (std::is_same_v<T, __half>) {
    return __double2half(v);
  } else {
    return __double2bfloat16(v);
  }
}

}  // namespace zero_cases
