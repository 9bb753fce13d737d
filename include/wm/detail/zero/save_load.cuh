// SPDX-License-Identifier: Apache-2.0
// Checkpoints of wm::zero_optimizer (declared in <wm/zero.cuh>): save writes this rank's
// masters and states with their fragment table, all or nothing across the ranks (a new
// generation of files that the manifest, written last, names: checkpoint.hpp); load reads the
// fragments that intersect this rank's shard from the files the manifest names, saved by any
// rank count, bucket size or stage. Every rank learns whether any rank failed.
#pragma once

#include <wm/detail/zero/checkpoint.hpp>
#include <wm/detail/zero/kernels.cuh>
#include <wm/detail/zero/reshard.hpp>
#include <wm/zero.cuh>

#include <cub/device/device_for.cuh>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

namespace wm {

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::agree(std::string const& error, char const* what) {
  // Every rank learns whether any rank failed, so that none goes on to the collectives alone.
  auto const ok = comm_->all_gather(error.empty() ? 1 : 0);
  for (std::size_t r = 0; r < ok.size(); ++r) {
    if (ok[r] == 0) {
      throw io_error{error.empty() ? "wm: zero_optimizer::" + std::string{what} +
                                         " failed on rank " + std::to_string(r)
                                   : error};
    }
  }
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::save(std::filesystem::path const& dir,
                                                     cuda::stream_ref stream) {
  namespace z                   = detail::zero;
  std::size_t const n           = plan_.state_elements;
  constexpr std::size_t streams = 1 + static_cast<std::size_t>(Optimizer::states);
  expect_usable("save");
  engine_.complete_tail(stream);
  engine_.settle_states();
  if (masters_stale_) { widen_masters(stream.get()); }
  read_counters(stream);  // waits for the stream (with the communicator's deadline)
  std::int64_t const applied = host_counters_->applied;
  std::vector<std::vector<float>> data(streams, std::vector<float>(n));
  for (std::size_t k = 0; k < streams && n > 0; ++k) {
    WM_CUDA_TRY(cudaMemcpyAsync(data[k].data(),
                                k == 0 ? engine_.master() : engine_.states() + (k - 1) * n,
                                n * sizeof(float), cudaMemcpyDefault, stream.get()));
  }
  comm_->synchronize(stream, "zero_optimizer::save");
  z::shard_header const h{static_cast<std::uint64_t>(world_),
                          static_cast<std::uint64_t>(rank_),
                          n,
                          streams,
                          applied,
                          Optimizer::name,
                          checkpoint_tag(opt_),
                          {},
                          0};
  std::vector<std::span<float const>> spans(data.begin(), data.end());
  // All or nothing across the ranks (checkpoint.hpp): they agree on each step's outcome through
  // the communicator's checked all-gather, so a failure on any rank throws on every rank.
  (void)z::save_shards(
      dir, h, z::fragment_table_of(plan_, rank_), spans,
      [this](std::span<std::byte const> mine) { return comm_->all_gather_bytes(mine); });
}

template <zero_stage_policy Stage, sparse_optimizer Optimizer, offload_policy Offload>
void zero_optimizer<Stage, Optimizer, Offload>::load(std::filesystem::path const& dir,
                                                     cuda::stream_ref stream) {
  namespace z                   = detail::zero;
  cudaStream_t const s          = stream.get();
  std::size_t const n           = plan_.state_elements;
  constexpr std::size_t streams = 1 + static_cast<std::size_t>(Optimizer::states);
  expect_usable("load");
  engine_.before_load(stream);  // offload: a step begun ends, every chunk at its place
  if constexpr (Stage::value == 3) {
    WM_EXPECTS(!residency_.any_held(),
               "zero_optimizer::load (stage 3): release every gathered group first");
    residency_.drop_prefetch();
    WM_CUDA_TRY(cudaStreamWaitEvent(s, gather_done_.get(), 0));
  }
  std::vector<std::vector<float>> data(streams, std::vector<float>(n, 0.0f));
  std::int64_t applied = 0;
  std::string error;
  try {
    // The files the manifest names, each checked against it (world, rank, step).
    auto const stored = z::read_checkpoint(dir);
    std::vector<z::fragment_table> tables;
    for (std::size_t r = 0; r < stored.files.size(); ++r) {
      auto const& h           = stored.headers[r];
      std::string const where = stored.files[r].string();
      if (h.streams != streams || h.optimizer != Optimizer::name) {
        throw io_error{"'" + where + "' holds the states of optimizer '" + h.optimizer + "' (" +
                       std::to_string(h.streams) + " streams); this one is '" + Optimizer::name +
                       "' (" + std::to_string(streams) + ")"};
      }
      if (h.tag != checkpoint_tag(opt_)) {
        throw io_error{"'" + where + "' was saved with optimizer settings '" + h.tag +
                       "'; this optimizer has '" + checkpoint_tag(opt_) + "'"};
      }
      tables.push_back(h.table);
    }
    auto const reads = z::plan_shard_reads(tables, plan_, rank_);
    std::vector<std::span<float>> spans(data.begin(), data.end());
    z::read_shards(stored.files, stored.headers, reads, spans);
    applied = stored.headers[0].applied;
  } catch (std::exception const& e) {
    error = "wm: zero_optimizer::load on rank " + std::to_string(rank_) + ": " + e.what();
  }
  agree(error, "load");
  comm_->synchronize(stream, "zero_optimizer::load");  // host_counters_ and the buffers are free
  for (std::size_t k = 0; k < streams && n > 0; ++k) {
    WM_CUDA_TRY(cudaMemcpyAsync(k == 0 ? engine_.master() : engine_.states() + (k - 1) * n,
                                data[k].data(), n * sizeof(float), cudaMemcpyDefault, s));
  }
  host_counters_->applied      = applied;
  host_counters_->last_skipped = 0;
  host_counters_->skipped      = 0;
  engine_.counters_loaded(s);  // to the device (offload: the host keeps them)
  // The compute weights of this rank's shard from the masters, then (stages 1-2) everyone's.
  for (std::size_t b = 0; b < plan_.buckets.size(); ++b) {
    auto const& bk = plan_.buckets[b];
    z::with_element_type(bk.type, [&](auto tag) {
      using T = decltype(tag);
      WM_CUDA_TRY(cub::DeviceFor::Bulk(
          bk.shard_elements,
          z::narrow_op<T>{engine_.master() + bk.state_offset, static_cast<T*>(shard_weights(b))},
          s));
    });
    if constexpr (Stage::value < 3) { all_gather_bucket(b, weights_ + bk.byte_offset, stream); }
  }
  masters_stale_ = false;
  comm_->synchronize(stream, "zero_optimizer::load");  // `data` and host_counters_ are read
}

}  // namespace wm
