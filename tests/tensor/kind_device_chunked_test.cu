// SPDX-License-Identifier: Apache-2.0
// tensor_test's cases on the kinds device.chunked.block and device.chunked.cyclic: their per-kind
// bodies (gather_kinds.cuh), instantiated here once for the program.
#include "gather_kinds.cuh"

WM_TENSOR_SUITE(wm::device, wm::chunked);
WM_TENSOR_KIND(wm::device, wm::chunked, wm::block);
WM_TENSOR_KIND(wm::device, wm::chunked, wm::cyclic);
WM_TENSOR_BACK_TO_BACK(wm::device, wm::chunked, wm::block);
