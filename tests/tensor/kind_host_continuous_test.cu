// SPDX-License-Identifier: Apache-2.0
// tensor_test's cases on the kinds host.continuous.block and host.continuous.cyclic: their per-kind
// bodies (gather_kinds.cuh), instantiated here once for the program.
#include "gather_kinds.cuh"

WM_TENSOR_SUITE(wm::host, wm::continuous);
WM_TENSOR_KIND(wm::host, wm::continuous, wm::block);
WM_TENSOR_KIND(wm::host, wm::continuous, wm::cyclic);
WM_TENSOR_BACK_TO_BACK(wm::host, wm::continuous, wm::block);
