// SPDX-License-Identifier: Apache-2.0
// embedding_test's training runs (train_and_check, embedding_train.cuh) with RMSprop:
// every element type on every layout the suite trains on, instantiated here once for the program.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "embedding_train.cuh"

WM_TRAIN_EVERY_LAYOUT(float, wm::rmsprop);
WM_TRAIN_EVERY_LAYOUT(__half, wm::rmsprop);
WM_TRAIN_EVERY_LAYOUT(__nv_bfloat16, wm::rmsprop);
