// SPDX-License-Identifier: Apache-2.0
// tensor_test's cases on the kinds device.continuous.block and device.continuous.cyclic: their
// per-kind bodies (gather_kinds.cuh), instantiated here once for the program.
#include "gather_kinds.cuh"

WM_TENSOR_SUITE(wm::device, wm::continuous);
WM_TENSOR_KIND(wm::device, wm::continuous, wm::block);
WM_TENSOR_KIND(wm::device, wm::continuous, wm::cyclic);
