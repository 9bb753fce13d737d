// SPDX-License-Identifier: Apache-2.0
// The seam a cache policy plugs into: where an embedding's gather reads rows and where the
// owner-side update writes them. Without a cache (wm::no_cache) both are the table itself; with
// a cache (wm::device_cache, wm::group_cache) the rank's lines stand in front of the table.
#pragma once

#include <wm/cache.hpp>
#include <wm/comm.hpp>
#include <wm/detail/base/deadline.hpp>
#include <wm/detail/base/resources.hpp>
#include <wm/detail/cache/group_storage.cuh>
#include <wm/detail/cache/line_reader.cuh>
#include <wm/detail/cache/line_storage.cuh>
#include <wm/detail/cache/lines_ref.cuh>
#include <wm/detail/tensor/table_rows.cuh>
#include <wm/embedding.cuh>
#include <wm/error.hpp>

#include <cuda/std/bit>
#include <cuda/stream_ref>

#include <cuda_runtime_api.h>

#include <chrono>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace wm::detail {

/**
 * The ends of a cache's calls that return before their work is done (one-rank gathers and
 * prefetches, a group cache's): one event per stream they were issued on, recorded after each
 * call. What a call on another stream waits for before it writes lines back or empties them
 * (flush, invalidate, and so store and load, whose work runs on the legacy stream, which a
 * non-blocking stream's work does not precede). A mark whose work is done serves the next stream,
 * so they are as many as the streams with calls in flight. A call captured in a CUDA graph
 * records nothing: its replays are ordered by whoever launches the graph.
 */
class call_marks {
 public:
  /// The end of the work issued on @p s so far.
  void record(cudaStream_t s) {
    if (capturing(s)) { return; }
    mark* at = nullptr;
    for (auto& m : marks_) {
      if (m.stream == s) { at = &m; }
    }
    for (auto& m : marks_) {
      if (at == nullptr && cudaEventQuery(m.done.get()) != cudaErrorNotReady) { at = &m; }
    }
    if (at == nullptr) { at = &marks_.emplace_back(mark{s, unique_event::make()}); }
    at->stream = s;
    WM_CUDA_TRY(cudaEventRecord(at->done.get(), s));
  }
  /// As `record`, errors ignored (a call that is failing: what it enqueued is marked if it can be).
  void record_if_possible(cudaStream_t s) noexcept {
    try {
      record(s);
    } catch (...) {  // the call's own error is the one to report
    }
  }
  /// Makes @p s wait for every marked call (not while @p s is captured: a graph's order is its
  /// launcher's).
  void order_before(cudaStream_t s) const {
    if (capturing(s)) { return; }
    for (auto const& m : marks_) {
      if (m.stream != s) { WM_CUDA_TRY(cudaStreamWaitEvent(s, m.done.get(), 0)); }
    }
  }
  /// Waits on the host until every marked call is done, at most @p timeout (the communicator's);
  /// false past it.
  [[nodiscard]] bool wait(std::chrono::milliseconds timeout) const {
    auto const deadline = deadline_after(timeout);
    backoff pause{std::chrono::microseconds{20}};
    for (auto const& m : marks_) {
      while (cudaEventQuery(m.done.get()) == cudaErrorNotReady) {
        if (clock_type::now() >= deadline) { return false; }
        pause.pause();
      }
    }
    return true;
  }

 private:
  struct mark {
    cudaStream_t stream;
    unique_event done;
  };
  [[nodiscard]] static bool capturing(cudaStream_t s) {
    cudaStreamCaptureStatus capture{};
    WM_CUDA_TRY(cudaStreamIsCapturing(s, &capture));
    return capture != cudaStreamCaptureStatusNone;
  }
  std::vector<mark> marks_;
};

/// No cache: gathers read the table (the embedding calls the tensor's own gather), the update
/// writes the table.
template <class CachePolicy, class T>
class row_source {
 public:
  row_source() = default;
  row_source(std::size_t, std::size_t, std::size_t, bool, cache_options const&) {}

  /// The update's row locator: the table.
  [[nodiscard]] table_rows<T> locator(table_rows<T> const& table) const noexcept { return table; }
};

/**
 * Checks what a cached table can be before anything is allocated: a ratio in (0, 1]. A group
 * cache on one rank takes a group of one rank; on several ranks (any group of them, by default
 * the table's communicator) the group reads table rows through the mapping, so the layout must be
 * mapped (@p mapped_table). A device cache on several ranks caches each rank's own rows; gathers
 * of other ranks' rows go through their owners. Returns @p rows.
 */
template <class CachePolicy>
[[nodiscard]] std::size_t check_cache(communicator& comm, std::size_t rows,
                                      cache_options const& cache, bool mapped_table) {
  if constexpr (caching_policy<CachePolicy>) {
    std::size_t parts = static_cast<std::size_t>(comm.size());
    if constexpr (!CachePolicy::caches_own_rows) {
      std::string const name = CachePolicy::name;
      int const group        = cache.group == nullptr ? comm.size() : cache.group->size();
      WM_EXPECTS(cache.group == nullptr || cache.group->valid(),
                 name + ": cache_options::group is an empty communicator");
      WM_EXPECTS(group <= comm.size(),
                 name + ": a group of " + std::to_string(group) + " ranks caches a table of " +
                     std::to_string(comm.size()) + "; the group is a subset of the table's ranks");
      WM_EXPECTS(comm.size() == 1 || mapped_table,
                 name +
                     ": a group cache on several ranks is not built yet for a distributed "
                     "layout (the group reads table rows through the mapping); use "
                     "wm::continuous or wm::chunked");
      parts = static_cast<std::size_t>(group);
      WM_EXPECTS(rows < 0xffffffffull || comm.size() == 1,
                 name + ": a table of " + std::to_string(rows) +
                     " rows; a group cache on several ranks keys rows below 2^32 - 1");
      if (comm.size() > 1) {
        // Every rank hashes keys to holders and sets alike: the same seed and ratio everywhere
        // (a rank with another seed would look for rows where no holder puts them).
        comm.expect_same(name + " options (cache_options::hash_seed, ratio)",
                         cuda::std::bit_cast<std::uint64_t>(cache.ratio) ^
                             (std::uint64_t{cache.hash_seed} * 0x9e3779b97f4a7c15ull));
      }
    }
    // The ratio (and the 32-bit tags) checked on the largest part a rank can hold; each rank
    // plans its lines from its own rows when they exist.
    (void)cache::plan_cache<typename CachePolicy::replacement_type::impl>(
        rows / parts + (rows % parts != 0 ? 1 : 0), cache.ratio);
  }
  return rows;
}

/// Whether a table of @p comm's ranks with this policy caches in a group cache's shared lines
/// (a group cache on several ranks) rather than in lines of each rank's own rows.
template <class CachePolicy>
[[nodiscard]] bool shared_lines(communicator const& comm) noexcept {
  if constexpr (caching_policy<CachePolicy>) {
    return !CachePolicy::caches_own_rows && comm.size() > 1;
  } else {
    return false;
  }
}

/**
 * A cache in front of this rank's rows: its lines hold rows with their optimizer state; the
 * gather (one rank) or the owner side of the exchange (several) serves hits from lines and admits
 * misses; the update writes cached rows in their lines. The lines are the engine the policy names
 * (CachePolicy::storage_type: a device cache's own lines, or a group cache's lines, shared over
 * the group on several ranks).
 */
template <caching_policy CachePolicy, class T>
class row_source<CachePolicy, T> {
 public:
  using impl_type    = typename CachePolicy::replacement_type::impl;
  using storage_type = typename CachePolicy::template storage_type<T>;

  row_source() = default;
  /// Lines for @p rows local rows of @p dim values, @p st_cols state floats and (@p steps) a
  /// per-row step each: a collective step over the table's @p comm (a rank that cannot allocate
  /// its lines makes every rank throw the same wm::comm_error, naming it).
  row_source(communicator& comm, std::size_t rows, std::size_t dim, std::size_t st_cols, bool steps,
             cache_options const& cache)
      : lines_{std::make_unique<storage_type>(
            comm, cache::line_options{.rows              = rows,
                                      .dim               = dim,
                                      .state_cols        = st_cols,
                                      .steps             = steps,
                                      .ratio             = cache.ratio,
                                      .seed              = cache.hash_seed,
                                      .stage_write_backs = CachePolicy::writable})} {}

  /// A group cache on several ranks: lines shared over @p group (collective over it), for a
  /// table of @p rows rows of @p dim values.
  row_source(communicator& group, std::size_t rows, std::size_t dim, cache_options const& cache)
      : lines_{std::make_unique<storage_type>(group, cache::line_options{.rows   = rows,
                                                                         .dim    = dim,
                                                                         .ratio  = cache.ratio,
                                                                         .seed   = cache.hash_seed,
                                                                         .shared = true})} {}

  /// Whether this is a group cache's shared lines (then gathers take group_gather).
  [[nodiscard]] bool shared() const noexcept { return lines_ != nullptr && lines_->shared(); }
  /// A group cache's gather: @p table is the table's ref (every row through the mapping).
  template <class Table, class Index>
  void group_gather(Table const& table, std::size_t rows, std::span<Index const> indices, T* out,
                    unsigned* err, cudaStream_t s) {
    marked(s, [&] {
      lines_->with_shared([&](auto& group) { group.gather(table, rows, indices, out, err, s); });
    });
  }

  /// A group cache's prefetch: misses hinted to their holders, this rank's hints admitted.
  template <class Table, class Index>
  void group_prefetch(Table const& table, std::size_t rows, std::span<Index const> keys,
                      unsigned* err, cudaStream_t s) {
    marked(s, [&] {
      lines_->with_shared([&](auto& group) { group.prefetch(table, rows, keys, err, s); });
    });
  }

  /// The gather of this rank's rows (one rank: every row): hits from lines, misses admitted
  /// (distinct rows read once), then replicated. Dirty victims are staged and written back in
  /// ascending key order after the admissions (no other admission call may overlap this one).
  template <class Index>
  void gather(table_rows<T> const& table, std::size_t rows, std::span<Index const> indices, T* out,
              unsigned* err, cudaStream_t s) {
    marked(s, [&] {
      lines_->own_lines()->admit(
          table, rows, indices.data(), indices.size(),
          {.out = packed_rows{reinterpret_cast<std::byte*>(out), table.w.cols * sizeof(T)},
           .count_requests = true,
           .err            = err,
           .staged         = true},
          s);
    });
  }
  /// The exchange engine's owner-side reader (several ranks): this rank's rows through its
  /// cache; calls on @p s use the first workspace, calls beside it the second.
  [[nodiscard]] cache::line_reader<T, impl_type> reader(table_rows<T> const& table,
                                                        std::size_t rows, unsigned* err,
                                                        cudaStream_t s) const {
    return {lines_->own_lines(), table, rows, err, s};
  }
  /// prefetch: the gather's admissions without output or request counts (its own workspace, so
  /// it may run on another stream beside a gather).
  template <class Index>
  void prefetch(table_rows<T> const& table, std::size_t rows, std::span<Index const> keys,
                unsigned* err, cudaStream_t s) {
    marked(s, [&] {
      lines_->own_lines()->admit(table, rows, keys.data(), keys.size(), {.err = err, .aux = true},
                                 s);
    });
  }
  /// The update's row locator: the row's line, else the table.
  [[nodiscard]] cache::line_locator<T, impl_type> locator(table_rows<T> const& table) const {
    return lines_->locator(table);
  }
  /// Dirty lines written back; with @p drop every line emptied. After every gather and prefetch
  /// this cache has issued, on whatever stream (call_marks).
  void write_back(table_rows<T> const& table, bool drop, cudaStream_t s) {
    marks_.order_before(s);
    lines_->write_back(table, drop, s);
  }
  [[nodiscard]] cache_statistics statistics() const { return lines_->statistics(); }
  void reset_statistics() { lines_->reset_statistics(); }
  [[nodiscard]] std::size_t lines() const noexcept { return lines_ ? lines_->lines() : 0; }
  /// Waits on the host until every gather and prefetch this cache has issued is done, at most
  /// @p timeout; false past it.
  [[nodiscard]] bool wait_for_calls(std::chrono::milliseconds timeout) const {
    return marks_.wait(timeout);
  }

 private:
  /// Runs the call @p f issued on @p s and marks its end, also when it throws.
  template <class F>
  void marked(cudaStream_t s, F&& f) {
    try {
      f();
    } catch (...) {
      marks_.record_if_possible(s);
      throw;
    }
    marks_.record(s);
  }

  std::unique_ptr<storage_type> lines_;  // the policy's engine
  call_marks marks_;  // the ends of gathers and prefetches that return before their work is done
};

}  // namespace wm::detail
