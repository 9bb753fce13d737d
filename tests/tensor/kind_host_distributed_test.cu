// SPDX-License-Identifier: Apache-2.0
// tensor_test's cases on the kinds host.distributed.block and host.distributed.cyclic: their
// per-kind bodies (gather_kinds.cuh), instantiated here once for the program.
#include "gather_kinds.cuh"

WM_TENSOR_SUITE(wm::host, wm::distributed);
WM_TENSOR_KIND(wm::host, wm::distributed, wm::block);
WM_TENSOR_KIND(wm::host, wm::distributed, wm::cyclic);
