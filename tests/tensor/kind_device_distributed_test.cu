// SPDX-License-Identifier: Apache-2.0
// tensor_test's cases on the kinds device.distributed.block and device.distributed.cyclic: their
// per-kind bodies (gather_kinds.cuh), instantiated here once for the program.
#include "gather_kinds.cuh"

WM_TENSOR_SUITE(wm::device, wm::distributed);
WM_TENSOR_KIND(wm::device, wm::distributed, wm::block);
WM_TENSOR_KIND(wm::device, wm::distributed, wm::cyclic);
WM_TENSOR_BACK_TO_BACK(wm::device, wm::distributed, wm::block);
WM_TENSOR_BACK_TO_BACK(wm::device, wm::distributed, wm::cyclic);
