// SPDX-License-Identifier: Apache-2.0
// embedding_test's training runs (train_and_check, embedding_train.cuh) with SGD (with and without
// weight decay): every element type on every layout the suite trains on, instantiated here once for
// the program.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "embedding_train.cuh"

WM_TRAIN_EVERY_LAYOUT(float, wm::sgd);
WM_TRAIN_EVERY_LAYOUT(__half, wm::sgd);
WM_TRAIN_EVERY_LAYOUT(__nv_bfloat16, wm::sgd);

// The suite's skewed table on device memory with the cyclic mapping.
WM_TRAIN_AND_CHECK(float, wm::sgd, wm::device, wm::distributed, wm::cyclic);
