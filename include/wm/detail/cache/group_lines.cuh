// SPDX-License-Identifier: Apache-2.0
// One rank's part of a group cache (wm::group_cache; the structure and who writes what:
// group_ref.cuh): its lines in memory mapped over the group, its private set metadata, and the
// host side of each call.
//
// A gather (group_lines::gather), on every rank alone:
// 1. the batch's distinct keys (the distinct-row plan of detail/rows/distinct.cuh);
// 2. lookup, one warp per distinct key: probe the holder's set through its line words; a hit copies
//    the line's row to the output and adds one to the line's hit counter; a miss reads the row from
//    the table and appends the key to the holder's hints (a bounded list; a full list drops it);
// 3. the copies of the long runs (replicate_runs_to);
// 4. this rank as a holder: the hit counters folded into the replacement states, then the hints
//    that peers (and this rank) left since its last gather admitted: a victim by the replacement
//    policy (never a line the same admission pass took), the row read from the table.
#pragma once

#include <wm/cache.hpp>
#include <wm/comm.hpp>
#include <wm/detail/base/cuda.cuh>
#include <wm/detail/base/deadline.hpp>
#include <wm/detail/base/resources.hpp>
#include <wm/detail/base/workspace.cuh>
#include <wm/detail/cache/group_kernels.cuh>
#include <wm/detail/cache/group_ref.cuh>
#include <wm/detail/cache/plan.hpp>
#include <wm/detail/cache/set.hpp>
#include <wm/detail/cache/statistics.hpp>
#include <wm/detail/cache/warp_rows.cuh>
#include <wm/detail/memory/collective.hpp>
#include <wm/detail/rows/distinct.cuh>
#include <wm/detail/rows/views.cuh>
#include <wm/error.hpp>
#include <wm/memory.cuh>

#include <cuda/cmath>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace wm::detail::cache {

/**
 * One rank's part of a group cache: its lines (in memory mapped over the group), its private set
 * metadata, statistics and workspaces. Construction and destruction are collective over the
 * group.
 */
template <class T, class Impl>
class group_lines {
 public:
  using state_type = typename Impl::state_type;

  /**
   * @param group the ranks that cache the table together (this rank among them; one node)
   * @param rows the table's rows; @param ratio cache_options::ratio of the whole table over the
   * group; @param seed the hash seed; @param dim values per row
   * @throw wm::logic_error for a ratio outside (0, 1] or a table of 2^32 - 1 rows or more
   * @throw wm::comm_error on every rank of the group when any rank could not allocate its part or
   * its set metadata (the error names the rank)
   */
  group_lines(communicator& group, std::size_t rows, double ratio, std::uint32_t seed,
              std::size_t dim)
      : plan_{plan_group(group, rows, ratio)}, dim_{dim}, seed_{seed}, timeout_{group.timeout()} {
    // The shared parts (a collective allocation), then this rank's own metadata as a collective
    // step: a rank that cannot allocate makes every rank throw, and every rank then releases the
    // shared parts with its peers while it unwinds.
    auto shared             = make_shared(group);
    std::size_t const bytes = plan_.lines * (sizeof(std::uint32_t) + sizeof(state_type)) +
                              plan_.sets * sizeof(set_header) + sizeof(device_statistics) +
                              sizeof(unsigned long long) + 3 * sizeof(std::uint32_t) +
                              static_cast<std::size_t>(group.size()) * sizeof(group_part<T>);
    std::unique_ptr<device_state> d;
    collective_step(group, "group_cache: allocating the set metadata", [&] {
      try {
        d = std::make_unique<device_state>(plan_, group, nullptr);
        WM_CUDA_TRY(cudaMemset(d->tags.data(), 0, plan_.lines * sizeof(std::uint32_t)));
        WM_CUDA_TRY(cudaMemset(d->states.data(), 0, plan_.lines * sizeof(state_type)));
        WM_CUDA_TRY(cudaMemset(d->headers.data(), 0, plan_.sets * sizeof(set_header)));
        WM_CUDA_TRY(cudaMemset(d->stats.data(), 0, sizeof(device_statistics)));
        WM_CUDA_TRY(cudaMemset(d->refused.data(), 0, sizeof(unsigned long long)));
        WM_CUDA_TRY(cudaMemset(d->counters.data(), 0, 3 * sizeof(std::uint32_t)));
        // This rank's shared part starts empty (no line, no hint) before any peer reads it.
        WM_CUDA_TRY(cudaMemset(shared->part_data(group.rank()), 0, part_bytes()));
        WM_CUDA_TRY(cudaDeviceSynchronize());
      } catch (std::exception const& e) {
        throw std::runtime_error{"could not allocate the " + std::to_string(bytes) +
                                 " bytes of device memory of its set metadata for " +
                                 std::to_string(plan_.lines) + " lines: " + e.what()};
      }
    });
    d->shared = std::move(shared);
    d_        = std::move(d);
    collective_step(group, "group_cache: the group's parts", [&] {
      std::vector<group_part<T>> parts(static_cast<std::size_t>(group.size()));
      for (int g = 0; g < group.size(); ++g) { parts[static_cast<std::size_t>(g)] = part(g); }
      WM_CUDA_TRY(cudaMemcpy(d_->parts.data(), parts.data(), parts.size() * sizeof(group_part<T>),
                             cudaMemcpyHostToDevice));
      WM_CUDA_TRY(cudaDeviceSynchronize());
    });
    me_         = group.rank();
    group_size_ = group.size();
    group.barrier();
  }
  group_lines(group_lines const&)            = delete;
  group_lines& operator=(group_lines const&) = delete;
  /// Peers may still read this rank's lines until their own work ends: the shared memory's
  /// collective release waits for every rank of the group, after this rank's device work, which
  /// the host waits for here (the calls' streams, up to their last call), at most the
  /// communicator's timeout. Past it the work is abandoned with a line on stderr and this rank's
  /// memory is left allocated (its kernels may still use it; freeing would wait for them too).
  ~group_lines() {
    if (settled()) { return; }
    std::fprintf(stderr,
                 "wm: group_cache: rank %d gave up after %lld ms waiting for its device work on "
                 "the cache's lines (gathers, prefetches, invalidate); abandoned, left allocated: "
                 "its lines, set metadata and workspaces\n",
                 me_, static_cast<long long>(timeout_.count()));
    (void)d_.release();  // deliberately leaked, the shared memory's collective release with it
  }

  [[nodiscard]] std::size_t lines() const noexcept { return plan_.lines; }

  /**
   * The group cache's gather of @p indices into @p out (rows of dim values, packed): lookup of
   * each distinct key in its holder's lines (else the table), the long runs' copies, then this
   * rank's admissions of the hints. @p table: the table's ref (row(k) for every k below @p rows).
   * Enqueued on @p s, no host synchronization.
   */
  template <class Table, class Index>
  void gather(Table const& table, std::size_t rows, std::span<Index const> indices, T* out,
              unsigned* err, cudaStream_t s) {
    auto const c         = ref();
    std::size_t const rb = dim_ * sizeof(T);
    int const vec =
        vector_width({rb, table.stride() * sizeof(T), reinterpret_cast<std::uintptr_t>(out)});
    std::size_t const n = indices.size();
    if (n != 0) {
      auto const b = plan_distinct(indices.data(), n, row_bits(rows), d_->ws, s);
      packed_rows const dst{reinterpret_cast<std::byte*>(out), rb};
      std::size_t const bl = blocks(n);
      with_vector(vec, [&]<class W>() {
        group_lookup_kernel<W, T, Impl>
            <<<static_cast<unsigned>(bl), line_block, 0, s>>>(c, table, rows, b, dst, err);
        WM_CHECK_LAUNCH();
      });
      replicate_runs_to(b, nullptr, dst, rb, fused_copies, s);
    }
    admit(table, rows, vec, d_->counters.data() + 1, s);
  }

  /**
   * The misses among @p keys hinted to their holders, without output or counts, then this rank's
   * admissions: rows this rank holds are loaded now, rows its peers hold when those peers next
   * gather or prefetch. Its own workspace: it may run on another stream beside a gather.
   */
  template <class Table, class Index>
  void prefetch(Table const& table, std::size_t rows, std::span<Index const> keys, unsigned* err,
                cudaStream_t s) {
    int const vec = vector_width({dim_ * sizeof(T), table.stride() * sizeof(T)});
    if (!keys.empty()) {
      auto const b = plan_distinct(keys.data(), keys.size(), row_bits(rows), d_->ws_prefetch, s);
      with_vector(vec, [&]<class W>() {
        group_lookup_kernel<W, T, Impl>
            <<<static_cast<unsigned>(blocks(keys.size())), line_block, 0, s>>>(
                ref(), table, rows, b, packed_rows{nullptr, 0}, err);
        WM_CHECK_LAUNCH();
      });
    }
    admit(table, rows, vec, d_->counters.data() + 2, s);
  }

  /// This rank as a holder: the hit counters folded, the hints admitted (enqueued on @p s;
  /// @p taken: the call's own word for the number of hints it took).
  template <class Table>
  void admit(Table const& table, std::size_t rows, int vec, std::uint32_t* taken, cudaStream_t s) {
    auto const c = ref();
    group_take_hints_kernel<<<1, 1, 0, s>>>(c, taken);
    WM_CHECK_LAUNCH();
    group_fold_kernel<<<static_cast<unsigned>(blocks(plan_.sets)), line_block, 0, s>>>(c);
    WM_CHECK_LAUNCH();
    with_vector(vec, [&]<class W>() {
      group_admit_kernel<W, T, Impl>
          <<<static_cast<unsigned>(blocks(plan_.lines)), line_block, 0, s>>>(c, table, rows, taken);
      WM_CHECK_LAUNCH();
    });
    mark(s);  // the last work of a gather or a prefetch too
  }

  /// Empties this rank's lines (enqueued on @p s). Peers' gathers that run meanwhile read them as
  /// misses from the moment each line is emptied.
  void invalidate(cudaStream_t s) {
    group_invalidate_kernel<<<static_cast<unsigned>(elementwise_blocks(plan_.lines)), 256, 0, s>>>(
        ref());
    WM_CHECK_LAUNCH();
    mark(s);
  }

  /// The counters so far (waits for the device).
  [[nodiscard]] cache_statistics statistics() const {
    WM_CUDA_TRY(cudaDeviceSynchronize());
    device_statistics d;
    WM_CUDA_TRY(cudaMemcpy(&d, d_->stats.data(), sizeof d, cudaMemcpyDeviceToHost));
    unsigned long long refused = 0;
    WM_CUDA_TRY(cudaMemcpy(&refused, d_->refused.data(), sizeof refused, cudaMemcpyDeviceToHost));
    cache_statistics st = d.to_public();
    st.refused_copies   = refused;
    return st;
  }

  /// Sets every counter to zero (waits for the device).
  void reset_statistics() {
    WM_CUDA_TRY(cudaDeviceSynchronize());
    WM_CUDA_TRY(cudaMemset(d_->stats.data(), 0, sizeof(device_statistics)));
    WM_CUDA_TRY(cudaMemset(d_->refused.data(), 0, sizeof(unsigned long long)));
    WM_CUDA_TRY(cudaDeviceSynchronize());
  }

 private:
  /// Lines per rank: the ratio of the table's rows over the group, in whole sets.
  [[nodiscard]] static cache_plan plan_group(communicator& group, std::size_t rows, double ratio) {
    WM_EXPECTS(rows < 0xffffffffull, "group_cache: a table of " + std::to_string(rows) +
                                         " rows; the group cache keys rows below 2^32 - 1");
    auto const g = static_cast<std::size_t>(group.size());
    cache_plan p = plan_cache<Impl>(cuda::ceil_div(rows, g), ratio);
    if (p.sets == 0) {  // an empty table: one set keeps every kernel's geometry simple
      p.sets  = 1;
      p.lines = ways;
    }
    return p;
  }

  /// Bytes of one rank's shared part: line words, hit counters, hint count, hints, weights.
  [[nodiscard]] std::size_t part_bytes() const noexcept {
    return cuda::round_up(words() * sizeof(std::uint32_t), std::size_t{256}) +
           plan_.lines * dim_ * sizeof(T);
  }
  /// 32-bit words of a shared part before its weights (a line word is two).
  [[nodiscard]] std::size_t words() const noexcept { return 3 * plan_.lines + 4 + hint_cap(); }
  /// Hints a holder takes per pass: as many as it has lines (a pass admits at most that many).
  [[nodiscard]] std::uint32_t hint_cap() const noexcept {
    return static_cast<std::uint32_t>(plan_.lines);
  }

  [[nodiscard]] std::unique_ptr<memory<device, chunked>> make_shared(communicator& group) const {
    std::vector<std::size_t> const ones(static_cast<std::size_t>(group.size()), 1);
    return std::make_unique<memory<device, chunked>>(
        group, part_bytes() * ones.size(), part_bytes(), std::span<std::size_t const>{ones});
  }

  /// Group rank @p g's part, as this rank addresses it.
  [[nodiscard]] group_part<T> part(int g) const {
    auto* const base = reinterpret_cast<std::uint32_t*>(d_->shared->part_data(g));
    group_part<T> p;
    p.line       = reinterpret_cast<std::uint64_t*>(base);
    p.hits       = base + 2 * plan_.lines;
    p.hint_count = base + 3 * plan_.lines;
    p.hints      = base + 3 * plan_.lines + 4;
    p.w          = reinterpret_cast<T*>(reinterpret_cast<std::byte*>(base) +
                               cuda::round_up(words() * sizeof(std::uint32_t), std::size_t{256}));
    return p;
  }

  [[nodiscard]] group_ref<T, Impl> ref() const noexcept {
    group_ref<T, Impl> c;
    c.parts = d_->parts.data();
    c.meta =
        cache_ref<Impl>{d_->tags.data(), d_->states.data(), d_->headers.data(), plan_.sets, seed_};
    c.me         = me_;
    c.group_size = group_size_;
    c.dim        = dim_;
    c.hint_cap   = hint_cap();
    c.stats      = d_->stats.data();
    c.refused    = d_->refused.data();
    c.epoch      = d_->counters.data();
    return c;
  }

  /// Blocks of line_block threads for @p warps warps' worth of work, at most 8 per SM.
  [[nodiscard]] static std::size_t blocks(std::size_t warps) {
    return std::clamp<std::size_t>(cuda::ceil_div(warps, std::size_t{line_block / ways}), 1,
                                   static_cast<std::size_t>(sm_count()) * 8);
  }

  /// What the device work of the calls uses: one allocation, leaked whole when that work is
  /// abandoned (see the destructor).
  struct device_state {
    device_state(cache_plan const& plan, communicator& group,
                 std::unique_ptr<memory<device, chunked>> shared_part)
        : tags{plan.lines},
          states{plan.lines},
          headers{plan.sets},
          stats{1},
          refused{1},
          counters{3},
          parts{static_cast<std::size_t>(group.size())},
          shared{std::move(shared_part)} {}
    device_buffer<std::uint32_t> tags;
    device_buffer<state_type> states;
    device_buffer<set_header> headers;
    device_buffer<device_statistics> stats;
    device_buffer<unsigned long long> refused;  // cache_statistics::refused_copies
    device_buffer<std::uint32_t> counters;  // the admission pass; hints taken (gather, prefetch)
    device_buffer<group_part<T>> parts;     // every group rank's part (device copy)
    std::unique_ptr<memory<device, chunked>> shared;
    workspace ws;           // the distinct-key plan of gathers
    workspace ws_prefetch;  // ... of prefetches (beside a gather on another stream)
  };

  /// The end of the work issued on @p s so far: one event per stream with work in flight (an
  /// event whose work is done serves the next stream). Nothing while @p s is captured in a
  /// graph: its replays are ordered by whoever launches it.
  void mark(cudaStream_t s) {
    cudaStreamCaptureStatus capture{};
    WM_CUDA_TRY(cudaStreamIsCapturing(s, &capture));
    if (capture != cudaStreamCaptureStatusNone) { return; }
    stream_mark* at = nullptr;
    for (auto& m : marks_) {
      if (m.stream == s) { at = &m; }
    }
    for (auto& m : marks_) {
      if (at == nullptr && cudaEventQuery(m.done.get()) != cudaErrorNotReady) { at = &m; }
    }
    if (at == nullptr) { at = &marks_.emplace_back(stream_mark{s, unique_event::make()}); }
    at->stream = s;
    WM_CUDA_TRY(cudaEventRecord(at->done.get(), s));
  }

  /// Polls every mark until its work is done (or failed: the GPU will not run it), at most the
  /// communicator's timeout; false past it.
  [[nodiscard]] bool settled() const noexcept {
    auto const deadline = deadline_after(timeout_);
    backoff pause{std::chrono::microseconds{100}};
    for (auto const& m : marks_) {
      cudaError_t e{};
      while ((e = cudaEventQuery(m.done.get())) == cudaErrorNotReady) {
        if (clock_type::now() >= deadline) { return false; }
        pause.pause();
      }
      if (e != cudaSuccess) { (void)cudaGetLastError(); }
    }
    return true;
  }

  struct stream_mark {
    cudaStream_t stream;
    unique_event done;
  };

  cache_plan plan_;
  std::size_t dim_;
  std::uint32_t seed_;
  std::chrono::milliseconds timeout_;  // the communicator's: the destructor's wait
  int me_{};
  int group_size_{1};
  std::unique_ptr<device_state> d_;
  std::vector<stream_mark> marks_;
};

}  // namespace wm::detail::cache
