// SPDX-License-Identifier: Apache-2.0
// The standalone probes' CUDA error check: print the call and the error, exit 1.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                     \
  do {                                                                            \
    auto e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                      \
      std::printf("FAIL %s: %s line %d\n", #x, cudaGetErrorString(e_), __LINE__); \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)
