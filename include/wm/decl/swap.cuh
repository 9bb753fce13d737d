// SPDX-License-Identifier: Apache-2.0
/**
 * @file decl/swap.cuh
 * @brief The declarations of `<wm/swap.cuh>` without their bodies, for `<wm/wm.cuh>`: every
 * type and signature, none of the definitions (docs/design.md, "Compile time").
 */
#pragma once

#include <wm/decl/transfer_queue.hpp>
#include <wm/decl/zero_codec.cuh>
#include <wm/error.hpp>

#include <cuda/stream_ref>

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

namespace wm {

/** @brief Sizes and limits of a `swap_scope`. */
struct swap_options {
  std::size_t device_budget{std::size_t{1} << 30};    ///< bytes of the device pool (0: none)
  std::size_t host_bytes{std::size_t{4} << 30};       ///< bytes of the pinned host slab
  int max_in_flight{4};                               ///< batches in flight per direction
  std::size_t coalesce_below{std::size_t{4} << 20};   ///< buffers smaller than this are batched
  std::size_t coalesce_limit{std::size_t{32} << 20};  ///< bytes of one batch of small buffers
  /// Bytes prefetched and not yet used that the page-in queue may hold (0: the budget only).
  std::size_t prefetch_lookahead{0};
  std::chrono::milliseconds timeout{60'000};  ///< deadline of every host wait; max() means no limit
  int device{-1};                             ///< the GPU (-1: the current device)
  /// Copy streams to use instead of two the scope creates (both or neither; not owned: they must
  /// outlive the scope, and, where a framework's allocator records them for memory the copies
  /// used, everything it recorded them for; e.g. PyTorch's pool streams, which live as long as
  /// the process, when tensors are `record_stream`-ed on them). Non-blocking streams expected.
  cudaStream_t pageout_stream{nullptr};
  /// The page-in copy stream to use with `pageout_stream` (the same rules).
  cudaStream_t pagein_stream{nullptr};
};

/** @brief What a scope did since it was made or since `reset_statistics()`. */
struct swap_statistics {
  std::uint64_t bytes_out{0};            ///< bytes copied device → host
  std::uint64_t bytes_in{0};             ///< bytes copied host → device
  double seconds_out{0};                 ///< copy-stream time of those copies (CUDA events)
  double seconds_in{0};                  ///< copy-stream time of the page-ins
  std::uint64_t copies_out{0};           ///< cudaMemcpyAsync calls device → host
  std::uint64_t copies_in{0};            ///< cudaMemcpyAsync calls host → device
  std::uint64_t pageouts{0};             ///< buffers paged out (copies completed)
  std::uint64_t pageouts_cancelled{0};   ///< page-outs made unnecessary by an access or prefetch
  std::uint64_t passive_pageins{0};      ///< page-ins started by `data()` / `pin()`
  std::uint64_t prefetches{0};           ///< page-ins started by `need_prefetch()`
  std::uint64_t consumer_waits{0};       ///< times a consumer stream waited on a transfer
  double consumer_wait_seconds{0};       ///< how long those streams waited (CUDA events)
  std::uint64_t blocks_reused{0};        ///< pool blocks handed over stream-ordered (by events)
  std::uint64_t host_blocking_syncs{0};  ///< waits of a user thread on the GPU (all causes)
  double host_wait_seconds{0};           ///< how long they took
  std::uint64_t host_syncs_pool{0};  ///< of those: no pool block could change hands stream-ordered
  std::uint64_t host_syncs_slab{0};  ///< of those: the host slab was full
  /// Host slab ranges of destroyed buffers taken by a page-out while their page-in still ran
  /// (the page-out copy waits for it on the GPU, the host does not).
  std::uint64_t slab_ranges_reused{0};
  /// Waits of a user thread on a worker thread only (for it to issue a copy; no GPU wait).
  std::uint64_t worker_waits{0};
  double worker_wait_seconds{0};        ///< how long they took
  std::size_t resident_bytes{0};        ///< device pool bytes in use now
  std::size_t peak_resident_bytes{0};   ///< most device pool bytes in use at once
  std::size_t host_bytes_in_use{0};     ///< host slab bytes in use now
  std::uint64_t device_allocations{0};  ///< cudaMalloc calls (the pool)
  std::uint64_t pinned_allocations{0};  ///< cudaHostAlloc calls (the slab)
  std::uint64_t events_created{0};      ///< cudaEventCreate calls (a pool that grows on demand)
  std::uint64_t pageouts_from{0};       ///< buffers made by `pageout_from` (from caller memory)
  std::uint64_t pageins_to{0};          ///< `pagein_to` copies from the slab into caller memory

  /** @brief Achieved device → host GB/s while copying (0 if nothing moved). */
  [[nodiscard]] double out_gbps() const noexcept {
    return seconds_out > 0 ? static_cast<double>(bytes_out) / seconds_out / 1e9 : 0.0;
  }
  /** @brief Achieved host → device GB/s while copying (0 if nothing moved). */
  [[nodiscard]] double in_gbps() const noexcept {
    return seconds_in > 0 ? static_cast<double>(bytes_in) / seconds_in / 1e9 : 0.0;
  }
};

namespace detail {
class swap_core;
}

template <class T>
class swappable;

/**
 * @brief A swap context: device pool, host slab, copy streams, transfer queues and workers.
 *
 * Move-only in effect (neither copyable nor movable: buffers point at it). The destructor drops
 * queued transfers, waits for the copies in flight and frees everything; it never throws. The
 * wait is bounded by `swap_options::timeout`: past it (a copy that never completes, e.g. behind
 * a kernel that does not end), it says on stderr what it gave up on and returns, leaving the
 * pool and the slab allocated (a copy may still write them).
 */
class swap_scope {
 public:
  /**
   * @brief create_swap_env: allocates the pool and the slab, creates streams and events, starts
   * the workers. A zero device budget makes a scope without a pool, for `pageout_from` /
   * `pagein_to` buffers only (`allocate`, `data` of a paged-out buffer and `need_prefetch` throw).
   * @throw wm::logic_error on a zero slab, wm::cuda_error on CUDA errors.
   */
  explicit swap_scope(swap_options const& options);
  swap_scope(swap_scope const&)            = delete;
  swap_scope& operator=(swap_scope const&) = delete;
  ~swap_scope();

  /**
   * @brief A resident buffer of @p count elements from the pool, usable on @p stream.
   * When the pool is full, it takes the block of a page-out in flight or of a released buffer
   * and @p stream waits for that copy or release (no host wait; see the file comment).
   * @throw wm::logic_error if the pool cannot hold it even after every page-out has finished.
   */
  template <class T = std::byte>
  [[nodiscard]] swappable<T> allocate(std::size_t count, cuda::stream_ref stream);

  /**
   * @brief A buffer of @p count elements that starts paged out from caller memory @p src (device
   * memory, or any memory the copy engine reads), holding no pool block.
   *
   * The copy to the host slab goes on `pageout_stream()` after the work queued so far on @p
   * stream, and it is issued before the call returns (the host waits for the worker to issue it:
   * a worker wait; on the GPU only if the slab is full until page-ins finish). @p src must stay
   * allocated and unchanged until that copy is done: free it stream-ordered after the copy
   * stream (PyTorch: `tensor.record_stream(pageout_stream())` after this call) or after
   * `wait_pageout(stream)` on the stream that will reuse it. Zero elements: a valid empty buffer.
   * @throw wm::logic_error if @p src is null (count > 0) or not aligned for @p T, or the buffer
   * cannot fit the host slab; wm::cuda_error on CUDA errors or when the worker does not issue
   * the copy before the scope's timeout.
   */
  template <class T = std::byte>
  [[nodiscard]] swappable<T> pageout_from(T const* src, std::size_t count, cuda::stream_ref stream);

  /** @brief The stream of the page-out copies (device → host). */
  [[nodiscard]] cudaStream_t pageout_stream() const noexcept;
  /** @brief The stream of the page-in copies (host → device, `pagein_to` too). */
  [[nodiscard]] cudaStream_t pagein_stream() const noexcept;

  /** @brief prefetch_init: holds the page-in queue's prefetches until `prefetch_all()`. */
  void prefetch_init();
  /** @brief before_prefetch_wait_all: blocks until every queued page-out has completed (a
   * host-blocking sync; not needed for correctness). @throw wm::cuda_error on timeout. */
  void wait_pageouts();
  /** @brief prefetch_all: starts the prefetches queued by `need_prefetch()`, in that order. */
  void prefetch_all();
  /** @brief Blocks until every queued page-in has been copied. @throw wm::cuda_error on timeout. */
  void wait_prefetches();

  /** @brief What the scope did; collects the timings of finished consumer waits. */
  [[nodiscard]] swap_statistics statistics() const;
  /** @brief Zeroes the counters; the peak restarts from what is resident now. */
  void reset_statistics();
  /** @brief The options it was made with (device resolved). */
  [[nodiscard]] swap_options const& options() const noexcept;

 private:
  template <class T>
  friend class swappable;
  std::unique_ptr<detail::swap_core> core_;
};

/**
 * @brief A buffer of @p T that a `swap_scope` can page out to host memory and back.
 *
 * Move-only owner. Destroying it (or `reset()`) returns its memory after the work queued so far
 * on the last stream it was used on (`allocate`, `data`, `pin`, `pageout`).
 */
template <class T>
class swappable {
 public:
  using value_type = T;  ///< the element type

  swappable() = default;
  /// Takes @p other's buffer; @p other is left empty (`operator bool` false).
  swappable(swappable&& other) noexcept;
  /// Returns this buffer's memory (as `reset()`), then takes @p other's.
  swappable& operator=(swappable&& other) noexcept;
  swappable(swappable const&)            = delete;
  swappable& operator=(swappable const&) = delete;
  ~swappable();

  /**
   * @brief The device pointer, valid on @p stream. Not resident: a passive page-in at the front
   * of the queue, and @p stream waits on its copy (the host waits only for the worker to issue
   * it; on the GPU only if no pool block can change hands stream-ordered).
   */
  [[nodiscard]] T* data(cuda::stream_ref stream);
  /**
   * @brief Queues a page-out after the work queued so far on @p stream. After `pageout_begin()`:
   * ends it (the device memory goes after the copy and the work queued so far on @p stream; the
   * data is not copied again).
   * @return false (nothing queued) if the buffer is pinned, or already paged out or on its way.
   */
  bool pageout(cuda::stream_ref stream);
  /**
   * @brief Starts a page-out that keeps the data on the device for reading: the copy goes after
   * the work queued so far on @p stream, and `data()` meanwhile gives the pointer without
   * cancelling it. The data must not change until `pageout()` ends it (a copy made while kernels
   * still read the buffer: it starts as soon as the producer is done, not after the readers).
   * `pin()` and `need_prefetch()` cancel it (the buffer stays as if never paged out).
   * @return false (nothing queued) if the buffer is pinned, not resident, on its way out, or
   * its page-in copy may still run (`pageout()` then pages it out as usual).
   */
  bool pageout_begin(cuda::stream_ref stream);
  /** @brief Queues a prefetch at the back of the page-in queue (if the buffer is not resident
   * and not on its way; a queued page-out is cancelled instead). */
  void need_prefetch();
  /**
   * @brief Copies the data into caller memory @p dst (bytes() bytes, device memory) without
   * giving the buffer device memory: on `pagein_stream()` from the host slab, after the work
   * queued so far on @p stream (where @p dst was allocated) and after a page-out of it still
   * running. The buffer stays as it was (paged out). Use @p dst on a stream that has called
   * `wait_pagein()`; free it only after that stream's use, or stream-ordered after the copy
   * stream (PyTorch: `record_stream(pagein_stream())`). If the device pool holds the data
   * (resident, or a page-out queued or begun), a device copy on @p stream after `data(stream)`.
   * @throw wm::logic_error if @p dst is null (bytes() > 0) or not aligned for @p T.
   */
  void pagein_to(T* dst, cuda::stream_ref stream);
  /** @brief @p stream waits for the last `pagein_to` copy (nothing if it has completed). */
  void wait_pagein(cuda::stream_ref stream);
  /**
   * @brief @p stream waits for the buffer's page-out copy in flight, if it has been issued
   * (always so for a buffer of `pageout_from`): after it, the copy's source may be reused. A
   * page-out still queued is not waited for (its source is the pool, which the scope manages).
   */
  void wait_pageout(cuda::stream_ref stream);
  /** @brief `data(stream)` and one more in-use count: never paged out until as many `unpin()`. */
  T* pin(cuda::stream_ref stream);
  /** @brief One less in-use count. @throw wm::logic_error if not pinned. */
  void unpin();
  /** @brief The device memory holds the data (or will, once a stream waits on its page-in). */
  [[nodiscard]] bool resident() const;
  /** @brief Number of pin() calls not yet undone. */
  [[nodiscard]] int pins() const;
  /** @brief Returns the memory now (as the destructor does). */
  void reset() noexcept;

  [[nodiscard]] std::size_t size() const noexcept { return count_; }  ///< elements
  /// `size() * sizeof(T)`.
  [[nodiscard]] std::size_t bytes() const noexcept { return count_ * sizeof(T); }
  /// Whether it holds a buffer (false: default-made, moved from or reset).
  [[nodiscard]] explicit operator bool() const noexcept { return core_ != nullptr; }

 private:
  friend class swap_scope;
  swappable(detail::swap_core* core, std::uint64_t id, std::size_t count) noexcept
      : core_{core}, id_{id}, count_{count} {}
  detail::swap_core* core_{nullptr};
  std::uint64_t id_{0};
  std::size_t count_{0};
};

}  // namespace wm
