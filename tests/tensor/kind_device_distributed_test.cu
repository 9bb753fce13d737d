// SPDX-License-Identifier: Apache-2.0
// tensor_test's cases on the kinds device.distributed.block and device.distributed.cyclic: their
// per-kind bodies (gather_kinds.cuh), instantiated here once for the program.
#include "gather_kinds.cuh"

WM_TENSOR_SUITE(wm::device, wm::distributed);
WM_TENSOR_KIND(wm::device, wm::distributed, wm::block);
WM_TENSOR_KIND(wm::device, wm::distributed, wm::cyclic);
WM_TENSOR_BACK_TO_BACK(wm::device, wm::distributed, wm::block);
WM_TENSOR_BACK_TO_BACK(wm::device, wm::distributed, wm::cyclic);

// Called on its own by the long-gather and put/NCCL cases (gather_test.cu).
template void gather_tests::exercise<float, wm::device, wm::distributed, wm::block, std::int64_t>(
    wm::communicator&, std::uint64_t, std::size_t, std::size_t, std::size_t);
