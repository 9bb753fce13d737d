// SPDX-License-Identifier: Apache-2.0
/**
 * @file decl/swap.cuh
 * @brief The declarations of `<wm/swap.cuh>` without their bodies, for `<wm/wm.cuh>`: every
 * type and signature, none of the definitions (docs/design.md, "Compile time").
 */
#pragma once

#include <wm/decl/transfer_queue.hpp>
#include <wm/decl/zero_codec.cuh>
#include <wm/detail/base/resources.hpp>
#include <wm/error.hpp>

#include <cuda/stream_ref>

#include <cuda_runtime_api.h>

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

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

// ---------------------------------------------------------------------------------------------
// Saved tensors: a framework's saved activations over a swap scope (docs/guide/swap.md, "Saved
// tensors"). The scheduling of PyTorch's saved-tensor hooks, usable from C++.

/** @brief Where `saved_tensors` keeps a save's data on the device while it is paged out. */
enum class save_mode {
  /// The page-out reads the source's own memory (`swap_scope::pageout_from`); the page-in goes
  /// into memory of the caller's allocator (`swappable::pagein_to`). No device pool needed.
  direct,
  /// A device copy into the scope's pool, paged out and in there; a restore returns a pointer
  /// into the pool.
  pool,
};

/** @brief How a `saved_tensors` schedules its saves (its options may change between passes). */
struct saved_tensors_options {
  save_mode mode{save_mode::direct};            ///< direct (page-outs from the source) or pool
  std::size_t min_bytes{std::size_t{1} << 20};  ///< smaller sources are kept as they are
  /// Direct: page-out bytes that may still run before the producer waits for the oldest (0: no
  /// limit). The producer is the host (`host_pacing`) or the stream of `save()`.
  std::size_t max_outstanding_bytes{0};
  /// Direct: bytes restored ahead of their `restore()` in backward order (at least one save).
  std::size_t stage_bytes{0};
  /// Direct: the newest `keep_last` saves are held (not copied) until newer ones come; those
  /// still held when the backward pass starts are never copied.
  std::size_t keep_last{0};
  /// Direct: encode each save of 1-, 2-, 4- or 8-byte elements with `wm::zero_codec` before it
  /// goes out (the encoding's page-out is issued at the next save, once its size is known).
  bool compress{false};
  /// Direct: the host, not the stream, waits for the page-outs beyond `max_outstanding_bytes`,
  /// and `end_forward()` waits for all of them: a caching allocator that reuses a block once the
  /// host has seen its copy end then reuses the sources in time.
  bool host_pacing{false};
  /// The first `restore()` after saves calls `prefetch_all()` (the backward pass has started).
  bool auto_prefetch{true};
};

/** @brief What a `saved_tensors` did since it was made or since `reset_statistics()`. */
struct saved_tensors_statistics {
  std::uint64_t saves{0};              ///< `save()` calls
  std::uint64_t copies{0};             ///< saves that took a copy (or, keep_last, were held)
  std::uint64_t bytes_copied{0};       ///< their bytes
  std::uint64_t shared{0};             ///< saves answered with an earlier save of the same data
  std::uint64_t kept{0};               ///< saves declined: the source stays as it is
  std::uint64_t kept_no_room{0};       ///< of those: the pool or the slab could not hold it
  std::uint64_t restores{0};           ///< `restore()` calls
  std::uint64_t live{0};               ///< saves alive now
  std::uint64_t reused_sources{0};     ///< restores that returned the source itself
  std::uint64_t staged_restores{0};    ///< restores of a page-in started ahead (staged)
  std::uint64_t unstaged_restores{0};  ///< restores that started their page-in
  std::uint64_t throttle_waits{0};     ///< stream waits of `max_outstanding_bytes`
  std::uint64_t kept_last{0};          ///< restores of a save keep_last held (never copied)
  std::uint64_t encoded{0};            ///< saves paged out zero-encoded
  std::uint64_t encoded_raw_bytes{0};  ///< their bytes before encoding
  std::uint64_t encoded_bytes{0};      ///< their encodings' bytes (what crossed the link)
  std::uint64_t host_waits{0};         ///< host waits on an encoding or a page-out (pacing)
  double host_wait_seconds{0};         ///< how long they took
};

/**
 * @brief Device memory of a framework's allocator, as `saved_tensors` uses it: the sources it
 * saves, the memory it restores into and its scratch.
 *
 * - `handle_type`: a copyable owning reference to device memory (a `torch::Tensor`, a
 *   `std::shared_ptr<stream_block>`); a source of `save()` is one.
 * - `watch_type`: what a save remembers of its source without keeping it alive: identity,
 *   layout, version.
 * - `bytes(h)` (0: never save it), `element_bytes(h)`, `data(h)`, `base(h)` (the address of
 *   the whole allocation: what `set_skip` names); `watch(h)`; `reuse(w)`: the source itself if it
 *   is alive and unchanged since `watch`, else nothing; `same(a, b)`: two watches of the same
 *   live data, layout and version; `unchanged(h, w)`: @p h not modified since @p w.
 * - `allocate(bytes, s)` and `allocate_like(w, s)` (shaped as the watched source): memory usable
 *   on stream @p s in its order, freed in that order when its last handle goes;
 *   `record_stream(h, s)`: not reused before the work queued so far on @p s is done.
 */
template <class M>
concept saved_memory = std::copyable<typename M::handle_type> &&
    std::copyable<typename M::watch_type> &&
    requires(M& m, M const& cm, typename M::handle_type const& h, typename M::watch_type const& w,
             std::size_t n, cudaStream_t s) {
  { cm.bytes(h) } -> std::same_as<std::size_t>;
  { cm.element_bytes(h) } -> std::same_as<std::size_t>;
  { cm.data(h) } -> std::same_as<void*>;
  { cm.base(h) } -> std::same_as<void const*>;
  { cm.watch(h) } -> std::same_as<typename M::watch_type>;
  { cm.reuse(w) } -> std::same_as<std::optional<typename M::handle_type>>;
  { cm.same(w, w) } -> std::same_as<bool>;
  { cm.unchanged(h, w) } -> std::same_as<bool>;
  { m.allocate(n, s) } -> std::same_as<typename M::handle_type>;
  { m.allocate_like(w, s) } -> std::same_as<typename M::handle_type>;
  m.record_stream(h, s);
};

/**
 * @brief Device memory from `cudaMallocAsync` on a stream, freed by `cudaFreeAsync` there after
 * the work of every stream it was recorded on: the handle of `stream_memory`, a stream-ordered
 * allocator with version counters (the parts of PyTorch's caching allocator and tensors that
 * `saved_tensors` relies on).
 */
class stream_block {
 public:
  /**
   * @brief @p bytes of device memory (current device) usable on @p stream in its order.
   * @param bytes the size (0: no memory)
   * @param element_bytes the size of one element (1, 2, 4 or 8 can be zero-encoded)
   * @param stream where it is allocated, and freed when the last handle goes
   * @throw wm::logic_error if @p bytes is not a multiple of @p element_bytes (or it is 0);
   * wm::cuda_error on CUDA errors
   */
  stream_block(std::size_t bytes, std::size_t element_bytes, cudaStream_t stream);
  stream_block(stream_block const&)            = delete;
  stream_block& operator=(stream_block const&) = delete;
  /// Frees the memory stream-ordered after every recorded stream's work; never throws.
  ~stream_block();

  [[nodiscard]] void* data() const noexcept { return data_; }          ///< the device memory
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }  ///< its size
  /// The size of one element.
  [[nodiscard]] std::size_t element_bytes() const noexcept { return element_bytes_; }
  /// The stream it was allocated on (and is freed on).
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_; }
  /** @brief The memory is freed only after the work queued so far on @p s.
   * @throw wm::cuda_error on CUDA errors */
  void record_stream(cudaStream_t s);
  /// Changes of the data in place so far (`bump_version()` calls).
  [[nodiscard]] std::uint64_t version() const noexcept { return version_; }
  /// Says that the data changed in place: saves made before no longer reuse it.
  void bump_version() noexcept { ++version_; }

 private:
  void* data_{nullptr};
  std::size_t bytes_{0};
  std::size_t element_bytes_{1};
  cudaStream_t stream_{nullptr};
  std::uint64_t version_{0};
  std::vector<std::pair<cudaStream_t, cudaEvent_t>> recorded_;  // one event per stream
};

/** @brief The `saved_memory` of plain CUDA code: `std::shared_ptr<stream_block>` handles. */
struct stream_memory {
  using handle_type = std::shared_ptr<stream_block>;  ///< an owning reference
  /// What a save remembers of its source.
  struct watch_type {
    std::weak_ptr<stream_block> block;  ///< expired once the source is freed
    std::size_t bytes{0};               ///< its size
    std::size_t element_bytes{1};       ///< its element size
    std::uint64_t version{0};           ///< its version at the save
  };

  /** @brief A new block (see `stream_block`). @throw as `stream_block` */
  [[nodiscard]] static handle_type make(std::size_t bytes, std::size_t element_bytes,
                                        cudaStream_t stream);

  /// @p h's bytes (0 for a null handle: not saved).
  [[nodiscard]] std::size_t bytes(handle_type const& h) const noexcept;
  /// @p h's element size.
  [[nodiscard]] std::size_t element_bytes(handle_type const& h) const noexcept;
  /// @p h's memory.
  [[nodiscard]] void* data(handle_type const& h) const noexcept;
  /// @p h's memory: a block is its own allocation.
  [[nodiscard]] void const* base(handle_type const& h) const noexcept;
  /// A weak reference, the size and the version of @p h.
  [[nodiscard]] watch_type watch(handle_type const& h) const;
  /// The watched block if it is alive at the same version.
  [[nodiscard]] std::optional<handle_type> reuse(watch_type const& w) const;
  /// Both watch the same live block at the same version.
  [[nodiscard]] bool same(watch_type const& a, watch_type const& b) const;
  /// @p h is at the version @p w saw.
  [[nodiscard]] bool unchanged(handle_type const& h, watch_type const& w) const noexcept;
  /// A new block of @p bytes on @p s (element size 1). @throw wm::cuda_error on CUDA errors
  [[nodiscard]] handle_type allocate(std::size_t bytes, cudaStream_t s);
  /// A new block shaped as @p w's source on @p s. @throw wm::cuda_error on CUDA errors
  [[nodiscard]] handle_type allocate_like(watch_type const& w, cudaStream_t s);
  /// `h->record_stream(s)`. @throw wm::cuda_error on CUDA errors
  void record_stream(handle_type const& h, cudaStream_t s);
};

namespace detail {
template <class Memory>
class saved_tensors_core;
}

/**
 * @brief One save of a `saved_tensors`: the data of a source while the backward pass needs it.
 *
 * Shared (`std::shared_ptr`) by every save of the same data; destroying the last reference
 * returns its host slab range (and pool block), stream-ordered.
 * @tparam Memory the `saved_memory` of the sources
 */
template <class Memory>
class saved_tensor {
 public:
  using handle_type = typename Memory::handle_type;  ///< the memory handle of `Memory`
  using watch_type  = typename Memory::watch_type;   ///< what is remembered of the source

  saved_tensor(saved_tensor const&)            = delete;
  saved_tensor& operator=(saved_tensor const&) = delete;
  /// Returns the slab range (and pool block) after the work queued so far; never throws.
  ~saved_tensor();

  /// The source's bytes.
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
  /// The source's identity, layout and version at the save (e.g. to shape a restored pointer).
  [[nodiscard]] watch_type const& source() const noexcept { return watch_; }
  /// The mode it was saved in.
  [[nodiscard]] save_mode mode() const noexcept { return mode_; }
  /// Its data is in device memory of the pool (pool mode; false in direct mode).
  [[nodiscard]] bool resident() const;

 private:
  friend class detail::saved_tensors_core<Memory>;
  saved_tensor() = default;

  std::shared_ptr<detail::saved_tensors_core<Memory>> core_;  // keeps the scope alive
  swappable<std::byte> buf_;
  watch_type watch_{};
  save_mode mode_{save_mode::direct};
  std::size_t bytes_{0};
  std::optional<handle_type> staged_;    // direct: restored ahead (its copy may still run)
  cudaStream_t staged_stream_{nullptr};  // where staged_ was allocated (it waits before a drop)
  std::optional<handle_type> held_;      // keep_last: the source itself, not (yet) paged out
  std::optional<handle_type> restored_;  // what restore returned: a second restore gets it again
  bool encoded_{false};                  // the slab holds the zero encoding
  std::size_t numel_{0};
  std::size_t element_bytes_{0};
  std::size_t encoded_bytes_{0};
  std::optional<detail::unique_event> decoded_;  // page-in stream, after the last decode
};

/** @brief What `saved_tensors::restore` returns: memory that holds the saved data on a stream. */
template <class Memory>
struct restored_tensor {
  /// Direct mode: the memory (the source itself, or memory of `Memory` filled by a page-in).
  /// Pool mode: nothing; the data is at `data` in the pool while the save lives.
  std::optional<typename Memory::handle_type> memory;
  void* data{nullptr};  ///< the saved bytes, usable on the stream of `restore()`
};

/**
 * @brief The saved activations of a training step over a swap scope it owns: the scheduling of
 * PyTorch's saved-tensor hooks (examples/pytorch) for any framework's memory.
 *
 * Forward: `save(source, stream)` pages each saved tensor out (or declines it), sharing one save
 * among saves of the same data; `end_forward(stream)`. Backward: `prefetch_all(stream)` (or the
 * first `restore`) queues the page-ins in reverse order of the saves; `restore(save, stream)`
 * gives memory that holds the data on @p stream. The modes, pacing, compression and staging are
 * in `saved_tensors_options` and docs/guide/swap.md, "Saved tensors".
 *
 * Thread-safe; saves may outlive it (each keeps the scope alive). A call that drops the last
 * reference to a save releases it after the object's lock.
 * @tparam Memory the framework's memory (`saved_memory`): `stream_memory` for plain CUDA code
 */
template <class Memory = stream_memory>
requires saved_memory<Memory>
class saved_tensors {
 public:
  using memory_type   = Memory;                        ///< the framework's memory
  using handle_type   = typename Memory::handle_type;  ///< its handles
  using save_type     = saved_tensor<Memory>;          ///< one save
  using save_ptr      = std::shared_ptr<save_type>;    ///< how saves are held
  using restored_type = restored_tensor<Memory>;       ///< what `restore` returns

  /**
   * @brief Creates the swap scope (`swap_scope{scope_options}`) and the bookkeeping.
   * @throw wm::logic_error, wm::cuda_error as `swap_scope`'s constructor
   */
  saved_tensors(swap_options const& scope_options, saved_tensors_options const& options,
                Memory memory = Memory{});
  saved_tensors(saved_tensors const&)            = delete;
  saved_tensors& operator=(saved_tensors const&) = delete;
  /// Waits (within the scope's timeout) for encodings in flight; the scope goes with the last
  /// save. Never throws.
  ~saved_tensors();

  /// The options now.
  [[nodiscard]] saved_tensors_options options() const;
  /// New options, for the saves from now on.
  void set_options(saved_tensors_options const& options);
  /// Allocations (by `Memory::base`) never saved, e.g. parameters.
  void set_skip(std::vector<void const*> const& bases);

  /**
   * @brief Saves @p source, whose data was produced by the work queued so far on @p stream.
   * @return the save (an earlier one of the same live data, layout and version, if any), or
   * null: keep @p source as it is (0 bytes, under `min_bytes`, skipped, or no room in the pool or
   * the slab)
   * @throw wm::cuda_error on CUDA errors and timeouts
   */
  [[nodiscard]] save_ptr save(handle_type const& source, cudaStream_t stream);

  /**
   * @brief The saved data, usable on @p stream: the memory of an earlier restore of @p save, the
   * source itself if it is alive and unchanged, a staged page-in, or a page-in now; then the next
   * saves in backward order are staged (direct mode). Pool mode: the pool pointer (a page-in if
   * it is not resident).
   * @throw wm::logic_error if @p save is null or of another object, or a held source changed in
   * place; wm::cuda_error on CUDA errors and timeouts
   */
  [[nodiscard]] restored_type restore(save_ptr const& save, cudaStream_t stream);

  /// The forward pass ended (work on @p stream): the encoding still waiting goes out; with host
  /// pacing the host waits for every page-out. @throw wm::cuda_error on timeouts
  void end_forward(cudaStream_t stream);
  /// Queues every save since the last call for page-in, most recent first, and starts the
  /// queue (direct mode: stages on @p stream). @throw wm::cuda_error on CUDA errors
  void prefetch_all(cudaStream_t stream);
  /// Blocks until every queued page-in is done (a host wait; not needed for correctness).
  void wait_prefetches();
  /// Whether @p save was made by this object (`restore` takes no other).
  [[nodiscard]] bool owns(save_ptr const& save) const noexcept;

  /// What it did (its own counters; the scope's are `scope().statistics()`).
  [[nodiscard]] saved_tensors_statistics statistics() const;
  /// Zeroes its counters and the scope's.
  void reset_statistics();
  /// The swap scope it owns.
  [[nodiscard]] swap_scope& scope() const noexcept;
  /// The device pool's usable bytes (the budget rounded down to the pool's alignment).
  [[nodiscard]] std::size_t pool_bytes() const noexcept;

 private:
  std::shared_ptr<detail::saved_tensors_core<Memory>> core_;
};

}  // namespace wm
