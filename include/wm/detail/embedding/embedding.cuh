// SPDX-License-Identifier: Apache-2.0
// Bodies of wm::embedding (declared in <wm/embedding.cuh>): initialization, apply_gradients
// (the gradients' exchange to their owners through the exchange engine, then the owner-side
// update of update.cuh); checkpoints in checkpoint.cuh.
#pragma once

#include <wm/detail/base/cuda.cuh>
#include <wm/detail/base/hash.hpp>
#include <wm/detail/embedding/kernels.cuh>
#include <wm/detail/embedding/source.cuh>
#include <wm/detail/embedding/update.cuh>
#include <wm/detail/exchange/engine.cuh>
#include <wm/detail/exchange/plan.cuh>
#include <wm/detail/exchange/scratch.cuh>
#include <wm/detail/tensor/mapped.cuh>
#include <wm/detail/tensor/table_rows.cuh>
#include <wm/embedding.cuh>

#include <cuda/cmath>

#include <cuda_runtime_api.h>

#include <cmath>
#include <fstream>
#include <numeric>
#include <sstream>
#include <utility>

namespace wm {

WM_HOST_DEVICE inline float embedding_init::value(std::size_t row, std::size_t col,
                                                  std::size_t dim) const noexcept {
  if (how == kind::zeros) { return 0.0f; }
  using detail::splitmix64;
  std::uint64_t const z = splitmix64(seed ^ splitmix64(row * dim + col));
  float const u1        = (static_cast<float>(z >> 40) + 1.0f) * (1.0f / 16777216.0f);  // (0, 1]
  if (how == kind::uniform) { return a + (b - a) * u1; }
  float const u2 = static_cast<float>(splitmix64(z) >> 40) * (1.0f / 16777216.0f);
  return a + b * sqrtf(-2.0f * logf(u1)) * cosf(6.2831853071795864f * u2);
}

namespace detail {

struct embedding_scratch {
  exchange_scratch plan;
  workspace exchange;  // keys and gradients on their way to the owners
  workspace owner;     // the owner's sort, runs and segment sums
  explicit embedding_scratch(communicator& comm) : plan{comm, true} {}
};

/**
 * Checks the table's shape before anything is allocated (collective) and returns @p rows. The
 * update sorts local rows as 32-bit keys: at most 2^32 - 1 rows per rank. Ranks first agree on
 * rows and dim, so the bound, computed from them and the rank count, fails on every rank or none.
 */
[[nodiscard]] inline std::size_t embedding_rows(communicator& comm, std::size_t rows,
                                                std::size_t dim) {
  comm.expect_same("embedding", mix64(rows, dim));
  auto const world = static_cast<std::size_t>(comm.size());
  WM_EXPECTS(rows / world + (rows % world != 0 ? 1 : 0) <= std::size_t{0xffffffffu},
             "embedding: " + std::to_string(rows) + " rows over " + std::to_string(world) +
                 " ranks puts more than 2^32 - 1 rows on one rank; use more ranks");
  return rows;
}

/**
 * Where a cached host table keeps a row's parts in one record (the weight tensor's row, its
 * stride holding the optimizer state and the step). The cache moves whole rows: its admissions
 * read and its write-backs write every part of a row, and a scattered host row costs per access,
 * not per byte (three arrays: 1.3-1.4x one record in ascending order; bench/NOTES.md, "a host
 * table row is two or three scattered accesses"). An uncached host table keeps three tensors:
 * its gathers read weights only, and dense weight rows read faster when a batch has few distinct
 * rows (Zipf: 2.9 against 4.7 ms from records). Device tables keep three tensors.
 */
struct row_record {
  std::size_t states_at{};  ///< bytes from the row's start to its state (16-byte aligned)
  std::size_t step_at{};    ///< ... to its step
  std::size_t bytes{};      ///< the record (a multiple of record_align); 0: no record
};

/// Records start at multiples of 128 bytes: a weight row of 512 bytes then takes four whole
/// 128-byte requests, not five (1552-byte records made host gathers 9% slower).
inline constexpr std::size_t record_align = 128;

template <class T, class Location, class CachePolicy>
[[nodiscard]] constexpr row_record host_row_record(std::size_t dim, std::size_t state_cols,
                                                   bool steps) noexcept {
  if (!Location::is_host || !caching_policy<CachePolicy> || (state_cols == 0 && !steps) ||
      16 % sizeof(T) != 0) {
    return {};
  }
  std::size_t const states_at = cuda::round_up(dim * sizeof(T), std::size_t{16});
  std::size_t const states_to = states_at + state_cols * sizeof(float);
  std::size_t const step_at   = cuda::round_up(states_to, std::size_t{8});
  return {states_at, step_at,
          cuda::round_up(steps ? step_at + sizeof(std::int64_t) : states_to, record_align)};
}

}  // namespace detail

#define WM_EMBEDDING_TEMPLATE                                                                 \
  template <class T, cache_policy CachePolicy, optimizer_policy Optimizer, location Location, \
            layout Layout, mapping Mapping>
#define WM_EMBEDDING embedding<T, CachePolicy, Optimizer, Location, Layout, Mapping>

WM_EMBEDDING_TEMPLATE
WM_EMBEDDING::embedding(communicator& comm, std::size_t rows, std::size_t dim, Optimizer optimizer,
                        embedding_init init, cache_options cache)
    : comm_{&comm},
      opt_{optimizer},
      weights_{comm,
               detail::check_cache<CachePolicy>(comm, detail::embedding_rows(comm, rows, dim),
                                                cache, mapped_layout<Layout>),
               dim,
               detail::host_row_record<T, Location, CachePolicy>(
                   dim, static_cast<std::size_t>(Optimizer::states) * dim, optimizer.needs_steps())
                       .bytes /
                   sizeof(T)},
      scratch_{std::make_unique<detail::embedding_scratch>(comm)} {
  cudaStream_t const s = nullptr;
  // Every rank visits every global row and writes the ones its mapping gives it: the values
  // depend on the global row only, whatever the mapping (a user's too).
  auto const w = weights_.local_view();
  if (w.rows > 0) {
    detail::init_rows_kernel<<<detail::elementwise_blocks(rows * w.cols), 256, 0, s>>>(
        w, init, weights_.device_mapping(), comm.rank(), rows);
    WM_CHECK_LAUNCH();
  }
  std::size_t const state_cols = static_cast<std::size_t>(Optimizer::states) * dim;
  auto const record =
      detail::host_row_record<T, Location, CachePolicy>(dim, state_cols, opt_.needs_steps());
  if constexpr (Optimizer::states > 0) {
    if (record.bytes != 0) {
      states_.emplace(weights_.template view_columns<float>(record.states_at, state_cols));
    } else {
      states_.emplace(comm, rows, state_cols);
    }
    auto const v = states_->local_view();
    if (v.rows > 0) {
      detail::fill_rows_kernel<<<detail::elementwise_blocks(v.rows * v.cols), 256, 0, s>>>(
          v, opt_.initial_state());
      WM_CHECK_LAUNCH();
    }
  }
  if (opt_.needs_steps()) {
    if (record.bytes != 0) {
      steps_.emplace(weights_.template view_columns<std::int64_t>(record.step_at, 1));
    } else {
      steps_.emplace(comm, rows, 1);
    }
    auto const v = steps_->local_view();
    if (v.rows > 0) {
      detail::fill_rows_kernel<<<detail::elementwise_blocks(v.rows), 256, 0, s>>>(v,
                                                                                  std::int64_t{0});
      WM_CHECK_LAUNCH();
    }
  }
  if constexpr (detail::caching_policy<CachePolicy>) {
    if (detail::shared_lines<CachePolicy>(comm)) {
      // A group cache on several ranks: the group's lines (collective over the group).
      source_ = detail::row_source<CachePolicy, T>{cache.group != nullptr ? *cache.group : comm,
                                                   rows, dim, cache};
    } else {
      source_ = detail::row_source<CachePolicy, T>(comm, weights_.local_view().rows, dim,
                                                   state_cols, opt_.needs_steps(), cache);
    }
  }
  WM_CUDA_TRY(cudaDeviceSynchronize());
  comm.barrier();  // every rank's rows are initialized before anyone gathers
}

WM_EMBEDDING_TEMPLATE
WM_EMBEDDING::embedding(embedding&&) noexcept = default;
WM_EMBEDDING_TEMPLATE
WM_EMBEDDING& WM_EMBEDDING::operator=(embedding&& other) noexcept {
  if (this == &other) { return *this; }
  // This table's async updates end, and their scratch goes, before its tensors are freed.
  if (scratch_) { (void)scratch_->plan.drain(); }
  scratch_.reset();
  // The cache goes before the table: a group cache's release waits for this rank's device work
  // and meets its peers, so no rank's gather still reads the old table when it is freed.
  source_      = std::move(other.source_);  // its buffers are freed after the device's work
  comm_        = other.comm_;
  opt_         = std::move(other.opt_);
  weights_     = std::move(other.weights_);
  states_      = std::move(other.states_);
  steps_       = std::move(other.steps_);
  global_step_ = other.global_step_;
  scratch_     = std::move(other.scratch_);
  return *this;
}

WM_EMBEDDING_TEMPLATE
WM_EMBEDDING::~embedding() {
  // The scratch (declared last) goes first; it waits for the updates with the deadline.
  if (scratch_) { (void)scratch_->plan.drain(); }
}

WM_EMBEDDING_TEMPLATE
detail::table_rows<T> WM_EMBEDDING::table_rows() {
  detail::table_rows<T> t{weights_.local_view(), {}, nullptr};
  if (states_) { t.st = states_->local_view(); }
  if (steps_) {
    t.steps       = steps_->local_view().data;
    t.step_stride = steps_->stride();
  }
  return t;
}

WM_EMBEDDING_TEMPLATE
template <index_type Index>
void WM_EMBEDDING::gather(std::span<Index const> indices, T* out, cuda::stream_ref stream) {
  if constexpr (detail::caching_policy<CachePolicy>) {
    auto& comm           = *comm_;
    cudaStream_t const s = stream.get();
    std::size_t const n  = indices.size();
    std::size_t const rb = dim() * sizeof(T);
    auto& sc             = scratch_->plan;
    if constexpr (mapped_layout<Layout>) {
      if (source_.shared()) {
        // A group cache on several ranks: each rank reads its holders' lines and the table
        // directly (nothing collective); invalid indices as on one rank.
        detail::expect_group_alive(comm, "gather");
        WM_EXPECTS(n == 0 || (indices.data() != nullptr && out != nullptr),
                   "gather: null indices or output");
        source_.group_gather(std::as_const(weights_).ref(), rows(), indices, out, sc.err.data(), s);
        return;
      }
    }
    if (comm.size() == 1) {
      WM_EXPECTS(n == 0 || (indices.data() != nullptr && out != nullptr),
                 "gather: null indices or output");
      source_.gather(table_rows(), rows(), indices, out, sc.err.data(), s);
      return;
    }
    // Several ranks: every row through its owner's cache. The exchange engine carries the keys to
    // the owners and the rows back (as apply_gradients carries gradients); its owner-side reads
    // are the cache's (hits from lines, misses admitted). A null pointer is this rank's fault,
    // reported to every rank by the count exchange.
    detail::scratch_use const use{sc, s};
    detail::exchange_call const call{detail::exchange_op::gather, rb,
                                     n > 0 && out == nullptr ? detail::exchange_fault::null_pointer
                                                             : detail::exchange_fault::none};
    auto const p = detail::plan_exchange(comm, weights_.device_mapping(), indices.data(), n, sc, s,
                                         call, false);
    auto const table = table_rows();
    detail::gather_rows(comm, sc, p, source_.reader(table, table.w.rows, sc.err.data(), s), n,
                        reinterpret_cast<std::byte*>(out), rb, s);
    // As the tensor's distributed gather: the exchange synchronizes; invalid indices (zero rows)
    // throw on the rank that passed them.
    WM_CUDA_TRY(cudaMemcpyAsync(sc.err_host.data(), sc.err.data(), sizeof(unsigned),
                                cudaMemcpyDeviceToHost, s));
    comm.synchronize(stream, "gather");  // a peer that failed: an error, not a hang
    if (*sc.err_host.data() != 0) {
      WM_CUDA_TRY(cudaMemsetAsync(sc.err.data(), 0, sizeof(unsigned), s));
      WM_CUDA_TRY(cudaStreamSynchronize(s));
      throw logic_error{"wm: gather: an index was negative or not below the row count " +
                        std::to_string(rows()) + " (its output row is zero)"};
    }
  } else {
    weights_.gather(indices, out, stream);  // the tensor's gather (and its checks)
  }
}

WM_EMBEDDING_TEMPLATE
template <index_type Index>
void WM_EMBEDDING::prefetch(std::span<Index const> next_keys,
                            cuda::stream_ref stream) requires detail::caching_policy<CachePolicy> {
  WM_EXPECTS(next_keys.empty() || next_keys.data() != nullptr, "prefetch: null keys");
  if constexpr (mapped_layout<Layout>) {
    if (source_.shared()) {  // a group cache on several ranks
      detail::expect_group_alive(*comm_, "prefetch");
      source_.group_prefetch(std::as_const(weights_).ref(), rows(), next_keys,
                             scratch_->plan.err.data(), stream.get());
      return;
    }
  }
  WM_EXPECTS(comm_->size() == 1,
             "prefetch: not built yet for a device cache on several ranks "
             "(the keys would have to travel to their owners)");
  source_.prefetch(table_rows(), rows(), next_keys, scratch_->plan.err.data(), stream.get());
}

WM_EMBEDDING_TEMPLATE
void WM_EMBEDDING::flush(cuda::stream_ref stream) requires detail::caching_policy<CachePolicy> {
  source_.write_back(table_rows(), false, stream.get());
}

WM_EMBEDDING_TEMPLATE
void WM_EMBEDDING::invalidate(
    cuda::stream_ref stream) requires detail::caching_policy<CachePolicy> {
  source_.write_back(table_rows(), true, stream.get());
}

WM_EMBEDDING_TEMPLATE
cache_statistics WM_EMBEDDING::cache_stats() requires detail::caching_policy<CachePolicy> {
  auto const stats    = source_.statistics();  // waits for the device
  unsigned* const err = scratch_->plan.err.data();
  unsigned bad        = 0;
  WM_CUDA_TRY(cudaMemcpy(&bad, err, sizeof bad, cudaMemcpyDeviceToHost));
  if (bad != 0) {
    WM_CUDA_TRY(cudaMemset(err, 0, sizeof(unsigned)));
    WM_CUDA_TRY(cudaDeviceSynchronize());
    throw logic_error{"wm: gather/prefetch: an index was outside [0, " + std::to_string(rows()) +
                      ") (its output row is zero)"};
  }
  return stats;
}

WM_EMBEDDING_TEMPLATE
void WM_EMBEDDING::reset_cache_stats() requires detail::caching_policy<CachePolicy> {
  source_.reset_statistics();
}

WM_EMBEDDING_TEMPLATE
template <index_type Index>
void WM_EMBEDDING::apply_gradients(std::span<Index const> indices, T const* grads, float lr,
                                   cuda::stream_ref stream) requires sparse_optimizer<Optimizer> {
  auto& comm           = *comm_;
  cudaStream_t const s = stream.get();
  std::size_t const n  = indices.size();
  bool const one_rank  = comm.size() == 1;
  // Several ranks: a null pointer is this rank's fault, which the count exchange reports to all.
  if (one_rank) {
    WM_EXPECTS(n == 0 || (indices.data() != nullptr && grads != nullptr),
               "apply_gradients: null indices or gradients");
  }
  detail::scratch_use const use{scratch_->plan, s};  // its workspaces, after the last call's
  std::size_t const rb       = dim() * sizeof(T);
  std::int64_t const step    = global_step_ + 1;
  auto const table           = table_rows();
  auto const& local          = table.w;
  unsigned* const err        = scratch_->plan.err.data();
  std::size_t const too_many = std::size_t{1} << 31;

  // 1. The owner's batch: its local rows and one gradient row each. One rank owns every row:
  //    the caller's keys are its local rows (for both mappings) and are checked on the device.
  //    Several ranks: keys and gradients travel to their owners; bad keys are found first.
  Index const* keys = indices.data();
  T const* g        = grads;
  std::size_t m     = n;
  if (one_rank) {
    WM_EXPECTS(n < too_many, "apply_gradients: " + std::to_string(n) +
                                 " gradient rows in one call; split the batch below 2^31");
    if (n > 0) {  // the update's room (its out-of-memory is this call's error, nothing changed)
      detail::update_room const room{n, local.cols, detail::row_bits(rows()), s};
      (void)detail::reserve_rooms({{&scratch_->owner, room.total()}}, s);
    }
  } else {
    detail::exchange_call const call{detail::exchange_op::apply, rb,
                                     n > 0 && grads == nullptr
                                         ? detail::exchange_fault::null_pointer
                                         : detail::exchange_fault::none};
    auto const p = detail::plan_exchange(comm, weights_.device_mapping(), indices.data(), n,
                                         scratch_->plan, s, call);
    // Both batch checks from the count words, alike on every rank (a rank that threw alone
    // would leave the others waiting in the exchange below).
    std::uint64_t valid = 0;
    for (std::size_t r = 0; r < p.headers.size(); ++r) {
      if (p.headers[r].invalid != 0) {
        WM_CUDA_TRY(cudaMemsetAsync(err, 0, sizeof(unsigned), s));
        throw logic_error{"wm: apply_gradients: rank " + std::to_string(r) + " passed " +
                          std::to_string(p.headers[r].invalid) + " index(es) outside [0, " +
                          std::to_string(rows()) + "); nothing was updated"};
      }
      valid += p.headers[r].batch;
    }
    if (valid >= too_many) {
      // All ranks' batches together could give one owner too many rows: each rank's count (the
      // only case that needs another round).
      auto const seen = comm.all_gather(static_cast<std::uint64_t>(p.n_recv));
      for (std::size_t r = 0; r < seen.size(); ++r) {
        WM_EXPECTS(seen[r] < too_many,
                   "apply_gradients: rank " + std::to_string(r) + " would receive " +
                       std::to_string(seen[r]) +
                       " gradient rows in one call (all ranks' batches together); split the "
                       "batches so that each owner receives fewer than 2^31");
      }
    }
    // The owner's update room is sized by what it receives: reserved, and agreed on by every
    // rank, with the batch, before any gradient moves.
    detail::update_room const room{p.n_recv, local.cols, detail::row_bits(local.rows), s};
    auto const batch =
        detail::send_to_owners(comm, p, reinterpret_cast<std::byte const*>(grads), n, rb,
                               scratch_->exchange, err, s, {&scratch_->owner, room.total()});
    keys = batch.keys;
    g    = reinterpret_cast<T const*>(batch.rows);
    m    = batch.n;
  }

  // 2. Owner side: sort (key, position) stably on the bits of the local row count, find the
  //    runs of equal rows, sum long runs in segments, then one fused update per run.
  //    Each row is updated where it lives: the table, or (with a cache) its line.
  if (m > 0) {
    detail::update_owner_rows(opt_, source_.locator(table), table, step, keys, g, m,
                              one_rank ? rows() : local.rows, lr, err, scratch_->owner, s);
  }
  // 3. One rank: a bad key stopped the update kernels; say so. Several: checked before sending.
  WM_CUDA_TRY(cudaMemcpyAsync(scratch_->plan.err_host.data(), err, sizeof(unsigned),
                              cudaMemcpyDeviceToHost, s));
  if (one_rank) {
    WM_CUDA_TRY(cudaStreamSynchronize(s));
  } else {
    comm.synchronize(cuda::stream_ref{s},
                     "apply_gradients");  // a peer that failed: an error, not a hang
  }
  if (*scratch_->plan.err_host.data() != 0) {
    WM_CUDA_TRY(cudaMemsetAsync(err, 0, sizeof(unsigned), s));
    WM_CUDA_TRY(cudaStreamSynchronize(s));
    throw logic_error{"wm: apply_gradients: an index was outside [0, " + std::to_string(rows()) +
                      "); nothing was updated"};
  }
  global_step_ = step;
  // Mapped layouts: peers read this rank's rows directly in their next gather; they must not
  // start before every owner has finished its update (seen as stale rows without this).
  if constexpr (Layout::mapped) { comm.barrier(); }
}

#undef WM_EMBEDDING
#undef WM_EMBEDDING_TEMPLATE

}  // namespace wm

#include <wm/detail/embedding/checkpoint.cuh>
