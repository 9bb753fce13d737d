// SPDX-License-Identifier: Apache-2.0
// Helpers of tensor_test's cases that choose the path rows of a distributed gather take between
// ranks (WM_DISPATCH_ROWS): gather_test.cu runs the suite on each path, gather_path_test.cu checks
// how the ranks agree on one.
#pragma once

#include <wm/comm.hpp>
#include <wm/tensor.cuh>

#include <cstdint>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "gather_common.cuh"
#include "rank_check.hpp"
#include "ranks.hpp"

namespace gather_tests {

using wm_test::shared_seed;

// Sets WM_DISPATCH_ROWS in this rank's process for a scope; unsets it at the end, also when a
// check throws.
struct dispatch_rows_setting {
  explicit dispatch_rows_setting(char const* how) {
    RANK_REQUIRE(::setenv("WM_DISPATCH_ROWS", how, 1) == 0);
  }
  dispatch_rows_setting(dispatch_rows_setting const&) = delete;
  ~dispatch_rows_setting() { ::unsetenv("WM_DISPATCH_ROWS"); }
};

// Whether every pair of this node's GPUs has peer access (the mailboxes need it).
inline bool peers_reach_each_other() {
  int n = 0;
  WM_CUDA_TRY(cudaGetDeviceCount(&n));
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      int can = 1;
      if (i != j) { WM_CUDA_TRY(cudaDeviceCanAccessPeer(&can, i, j)); }
      if (can == 0) { return false; }
    }
  }
  return true;
}

// The path a fresh distributed tensor takes under this process's WM_DISPATCH_ROWS: undecided
// until its first gather (here of every row, so rows cross), then what every rank agreed on.
inline wm::row_path path_of_fresh_tensor(wm::communicator& comm) {
  std::size_t const rows = 1000;
  wm::tensor<float, wm::device, wm::distributed> t{comm, rows, 4};
  RANK_REQUIRE(t.gather_path() == wm::row_path::undecided);
  std::vector<std::int32_t> all(rows);
  std::iota(all.begin(), all.end(), 0);
  device_array<std::int32_t> const di{all};
  device_bytes const out{rows * t.cols() * sizeof(float)};
  t.gather(di.span(), reinterpret_cast<float*>(out.ptr), cuda::stream_ref{cudaStream_t{}});
  return t.gather_path();
}

}  // namespace gather_tests
