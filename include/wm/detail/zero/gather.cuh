// SPDX-License-Identifier: Apache-2.0
// Stage 3 of wm::zero_optimizer (declared in <wm/zero.cuh>): a group's weights all-gathered into
// the pool on the gather stream, the next group in the direction of the last two gathers
// prefetched, and groups released (the residency bookkeeping is residency.hpp).
#pragma once

#include <wm/detail/zero/kernels.cuh>
#include <wm/zero.cuh>

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

namespace wm {

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::gather_buckets(
    std::vector<detail::zero::residency::load> const& loads, cudaStream_t s) {
  if (loads.empty()) { return; }
  // The shard weights come from the last step, and the pool ranges were read by released groups:
  // both on the caller's stream.
  WM_CUDA_TRY(cudaEventRecord(user_ready_.get(), s));
  WM_CUDA_TRY(cudaStreamWaitEvent(gather_stream_.get(), user_ready_.get(), 0));
  for (auto const& l : loads) {
    all_gather_bucket(l.bucket, pool_ + l.offset, cuda::stream_ref{gather_stream_.get()});
  }
  WM_CUDA_TRY(cudaEventRecord(gather_done_.get(), gather_stream_.get()));
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::gather(
    std::size_t g, cuda::stream_ref stream) requires(Stage::value == 3) {
  expect_usable("gather");
  WM_EXPECTS(g < residency_.groups(), "zero_optimizer::gather: a group index below the count (" +
                                          std::to_string(residency_.groups()) + "), got " +
                                          std::to_string(g));
  auto const gi = static_cast<std::ptrdiff_t>(g);
  if (last_group_ >= 0 && gi != last_group_) { direction_ = gi > last_group_ ? 1 : -1; }
  last_group_ = gi;
  // offload_overlap_forward: this group's and the next one's shard weights
  if (std::size_t const pending = engine_.pending(); pending > 0) {
    std::size_t low = pending;
    for (std::ptrdiff_t k : {gi, gi + direction_}) {
      if (k < 0 || k >= static_cast<std::ptrdiff_t>(group_buckets_.size())) { continue; }
      for (std::size_t b : group_buckets_[static_cast<std::size_t>(k)]) { low = std::min(low, b); }
    }
    if (low < pending) { weights_ready(low, stream); }
  }
  gather_buckets(residency_.acquire(g), stream.get());
  // This group's buckets (gathered now or by the last prefetch) are complete for the caller.
  WM_CUDA_TRY(cudaStreamWaitEvent(stream.get(), gather_done_.get(), 0));
  std::ptrdiff_t const next = gi + direction_;
  if (next >= 0 && next < static_cast<std::ptrdiff_t>(residency_.groups())) {
    gather_buckets(residency_.prefetch(static_cast<std::size_t>(next)), stream.get());
  }
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::release(std::size_t g) requires(Stage::value == 3) {
  WM_EXPECTS(g < residency_.groups(), "zero_optimizer::release: a group index below the count");
  residency_.release(g);
}

}  // namespace wm
