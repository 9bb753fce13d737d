// SPDX-License-Identifier: Apache-2.0
// embedding_test's training runs (train_and_check, embedding_train.cuh) with Adam (lazy,
// global-step with weight decay, AdamW): every element type on every layout the suite trains on,
// instantiated here once for the program.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "embedding_train.cuh"

WM_TRAIN_EVERY_LAYOUT(float, wm::adam);
WM_TRAIN_EVERY_LAYOUT(__half, wm::adam);
WM_TRAIN_EVERY_LAYOUT(__nv_bfloat16, wm::adam);

// The suite's misaligned gradients on device memory with the cyclic mapping.
WM_TRAIN_AND_CHECK(float, wm::adam, wm::device, wm::chunked, wm::cyclic);
