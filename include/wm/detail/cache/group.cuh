// SPDX-License-Identifier: Apache-2.0
// A group cache on several ranks (wm::group_cache): the ranks of a group (cache_options::group, by
// default the table's communicator; one node) cache the whole table together. Rank g of the group
// holds the rows whose key hashes to g, in 32-way sets of its own device memory, mapped into every
// rank of the group, so any rank reads any line directly over NVLink: no exchange, no host
// synchronization, nothing collective in a gather. The table must be readable by every rank (a
// mapped layout: host or device rows through the tensor's mapping).
//
// Who writes what: only the holder writes its lines and its set metadata (tags, replacement
// states, headers: private to the holder, kept by the set code of set.hpp under the set locks of
// warp_rows.cuh). Peers only read lines, add to per-line hit counters and append miss hints, both
// with system-scope atomics.
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
//
// Lines under a reader's feet (a seqlock; the word's encoding and the reader's check are in
// line_word.hpp, whose host tests run the protocol): a line's 64-bit word holds the key + 1 while
// the line holds that key's whole row (0 otherwise) in its low half and a generation in its high
// half. The
// holder empties the word with the next generation, fences, writes the new row, fences, and
// publishes the key with that generation (release). A reader loads the word in every lane
// (acquire), copies the row, fences (acquire) and loads the word again: any change, even a trip
// through other keys back to the same one, sends it to the table. The row's own accesses are plain
// loads and stores, ordered by the fences: this relies on the fences ordering them (as CUDA's
// seqlocks do) rather than on morally strong accesses of the PTX memory model. The table does not
// change under a read-only cache; after changing it, invalidate().
//
// Hints and hit counters are advice: a hint read before its writer stored it gives an older key
// (admitted if it is valid and hashes here, else skipped), a full list drops hints, a hit counted
// for a line that changed meanwhile credits its new row. None of it changes a gathered value.
#pragma once

#include <wm/cache.hpp>
#include <wm/comm.hpp>
#include <wm/detail/base/cuda.cuh>
#include <wm/detail/base/resources.hpp>
#include <wm/detail/base/workspace.cuh>
#include <wm/detail/cache/line_word.hpp>
#include <wm/detail/cache/plan.hpp>
#include <wm/detail/cache/set.hpp>
#include <wm/detail/cache/statistics.hpp>
#include <wm/detail/cache/warp_rows.cuh>
#include <wm/detail/rows/distinct.cuh>
#include <wm/detail/rows/move.cuh>
#include <wm/detail/rows/views.cuh>
#include <wm/error.hpp>
#include <wm/memory.cuh>

#include <cuda/atomic>
#include <cuda/cmath>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace wm::detail::cache {

/// One group rank's shared part, as every rank of the group addresses it.
template <class T>
struct group_part {
  std::uint64_t* line{};        ///< lines: generation << 32 | key + 1 (0: the row is not whole)
  std::uint32_t* hits{};        ///< lines: hits not yet folded into the replacement states
  std::uint32_t* hint_count{};  ///< hints claimed since the holder last took them
  std::uint32_t* hints{};       ///< keys that missed on some rank (hint_cap of them)
  T* w{};                       ///< lines x dim weights
};

/// The seed offset of the key -> holder hash (the key -> set hash uses the seed itself: the two
/// must not be the same function, or a holder's keys would fill a range of its sets only).
inline constexpr std::uint32_t holder_seed_offset = 0x632be5abu;

/// A group cache as one rank's kernels see it (trivially copyable).
template <class T, class Impl>
struct group_ref {
  group_part<T> const* parts{};  ///< group_size entries (device)
  cache_ref<Impl> meta;          ///< this rank's set metadata (private to this rank)
  int me{};                      ///< this rank in the group
  int group_size{1};
  std::size_t dim{};
  std::uint32_t hint_cap{};
  device_statistics* stats{};
  std::uint32_t* epoch{};  ///< admission passes (set.hpp's batches)

  /// The group rank that holds @p key.
  [[nodiscard]] __device__ int holder(std::uint32_t key) const noexcept {
    return group_size == 1 ? 0
                           : static_cast<int>(set_of(key, static_cast<std::uint32_t>(group_size),
                                                     meta.seed + holder_seed_offset));
  }
};

/// A system-scope view of a line word another GPU may read.
[[nodiscard]] __device__ inline cuda::atomic_ref<std::uint64_t, cuda::thread_scope_system>
line_word(std::uint64_t* p) noexcept {
  return cuda::atomic_ref<std::uint64_t, cuda::thread_scope_system>{*p};
}

/// A system-scope view of a word another GPU may read or write.
[[nodiscard]] __device__ inline cuda::atomic_ref<std::uint32_t, cuda::thread_scope_system>
shared_word(std::uint32_t* p) noexcept {
  return cuda::atomic_ref<std::uint32_t, cuda::thread_scope_system>{*p};
}

/// Appends @p key to @p part's hints (dropped when the list is full).
template <class T>
__device__ void hint(group_part<T> const& part, std::uint32_t key, std::uint32_t cap) noexcept {
  std::uint32_t const at = shared_word(part.hint_count).fetch_add(1u, cuda::memory_order_relaxed);
  if (at < cap) { shared_word(part.hints + at).store(key, cuda::memory_order_relaxed); }
}

/// Adds a warp's counts to the statistics (lane 0; the values are the warp's sums).
__device__ inline void add_group_stats(device_statistics* st, unsigned lane,
                                       unsigned long long requests, unsigned long long distinct,
                                       unsigned long long hits, unsigned long long misses,
                                       unsigned long long from_host,
                                       unsigned long long from_peers) noexcept {
  if (lane != 0) { return; }
  if (requests != 0) { atomicAdd(&st->requests, requests); }
  if (distinct != 0) { atomicAdd(&st->distinct_keys, distinct); }
  if (hits != 0) { atomicAdd(&st->hits, hits); }
  if (misses != 0) { atomicAdd(&st->misses, misses); }
  if (from_host != 0) { atomicAdd(&st->bytes_from_host, from_host); }
  if (from_peers != 0) { atomicAdd(&st->bytes_from_peers, from_peers); }
}

/**
 * The lookup: one warp per distinct key of batch @p b. A key held by a line of its holder (this
 * rank or a peer) is copied from the line, checked against a concurrent replacement (see the top
 * of this file), and the line's hit counter gets one; any other key is read from @p table (its
 * row(k): every row on mapped layouts) and hinted to its holder. The row goes to the output rows of
 * the run's first min(length, fused_copies) elements (replicate_runs_to copies the rest). Invalid
 * keys: zero rows, *err set, counted as misses, nothing hinted. Without an output (@p out.base
 * null: a prefetch) a miss is only hinted: nothing is copied, read from the table or counted.
 */
template <class W, class T, class Impl, class Table, class Index, class Pos>
__global__ void __launch_bounds__(line_block)
    group_lookup_kernel(group_ref<T, Impl> c, Table table, std::size_t rows,
                        distinct_batch<Index, Pos> b, packed_rows out, unsigned* err) {
  unsigned const lane         = threadIdx.x % ways;
  std::size_t const warp      = grid_thread() / ways;
  std::size_t const n_warps   = grid_threads() / ways;
  std::size_t const runs      = *b.runs;
  std::size_t const row_bytes = c.dim * sizeof(T);
  std::size_t const vecs      = row_bytes / sizeof(W);
  bool const prefetch         = out.base == nullptr;
  unsigned long long requests = 0, distinct = 0, hits = 0, misses = 0, from_host = 0,
                     from_peers = 0;
  for (std::size_t r = warp; r < runs; r += n_warps) {  // the same trip count in every lane
    std::size_t const begin  = b.run_begin[r];
    std::size_t const len    = b.run_begin[r + 1] - begin;
    Index const key          = b.keys[begin];
    std::size_t const copies = prefetch ? 0 : len < fused_copies ? len : fused_copies;
    requests += len;
    ++distinct;
    auto const to = [&](std::size_t q) { return output_row(b, nullptr, out, begin + q); };
    if (!valid_index(key, rows)) {
      for (std::size_t q = 0; q < copies; ++q) {
        auto* const dst = reinterpret_cast<W*>(to(q));
        for (std::size_t i = lane; i < vecs; i += ways) { dst[i] = W{}; }
      }
      if (lane == 0) { atomicOr(err, 1u); }
      misses += len;
      continue;
    }
    auto const k                 = static_cast<std::uint32_t>(key);
    int const g                  = c.holder(k);
    group_part<T> const part     = c.parts[g];
    std::size_t const first_slot = cache_ref<Impl>::slot(c.meta.set_index(k), 0);
    std::uint64_t const seen =
        line_word(part.line + first_slot + lane).load(cuda::memory_order_acquire);
    std::uint32_t const hit_lanes = __ballot_sync(full_warp, word_holds(seen, k));
    bool served                   = false;
    if (prefetch) {  // a hint for a miss; a hit counts as a use of the line
      if (lane == 0) {
        if (hit_lanes == 0) {
          hint(part, k, c.hint_cap);
        } else {
          std::size_t const slot = first_slot + static_cast<std::size_t>(lowest_way(hit_lanes));
          shared_word(part.hits + slot).fetch_add(1u, cuda::memory_order_relaxed);
        }
      }
      continue;
    }
    if (hit_lanes != 0) {
      std::size_t const slot = first_slot + static_cast<std::size_t>(lowest_way(hit_lanes));
      auto const word        = line_word(part.line + slot);
      // Every lane acquires the published word itself (its loads of the row come after the
      // holder's writes of it), copies its share, and after a fence finds the same word again.
      std::uint64_t const before = word.load(cuda::memory_order_acquire);
      std::uint64_t const lane0  = __shfl_sync(full_warp, before, 0);
      if (__all_sync(full_warp, word_holds(before, k) && before == lane0)) {
        auto const* const src = reinterpret_cast<W const*>(part.w + slot * c.dim);
        for (std::size_t i = lane; i < vecs; i += ways) {
          W const v = load_vec<true>(src + i);
          for (std::size_t q = 0; q < copies; ++q) { reinterpret_cast<W*>(to(q))[i] = v; }
        }
        cuda::atomic_thread_fence(cuda::memory_order_acquire, cuda::thread_scope_system);
        served =
            __all_sync(full_warp, copy_stands(before, word.load(cuda::memory_order_relaxed), k));
      }
      if (served && lane == 0) {
        shared_word(part.hits + slot).fetch_add(1u, cuda::memory_order_relaxed);
      }
    }
    if (served) {
      hits += len;
      if (g != c.me) { from_peers += row_bytes; }
      continue;
    }
    // A miss (or a line replaced while it was read): the table's row, and a hint to the holder.
    auto const* const src = reinterpret_cast<W const*>(table.row(k));
    for (std::size_t i = lane; i < vecs; i += ways) {
      W const v = load_vec<true>(src + i);
      for (std::size_t q = 0; q < copies; ++q) { reinterpret_cast<W*>(to(q))[i] = v; }
    }
    misses += len;
    from_host += row_bytes;
    if (lane == 0) { hint(part, k, c.hint_cap); }
  }
  // Every lane of a warp counted the same keys: lane 0's counts are the warp's.
  if (!prefetch) {
    add_group_stats(c.stats, lane, requests, distinct, hits, misses, from_host, from_peers);
  }
}

/**
 * This rank as a holder, before it admits: takes the hints left since the last pass (their count
 * to @p taken, at most hint_cap; the list starts again at 0) and starts a new admission pass.
 */
template <class T, class Impl>
__global__ void group_take_hints_kernel(group_ref<T, Impl> c, std::uint32_t* taken) {
  std::uint32_t* const count = c.parts[c.me].hint_count;
  std::uint32_t const n      = shared_word(count).exchange(0u, cuda::memory_order_acq_rel);
  *taken                     = n < c.hint_cap ? n : c.hint_cap;
  atomicAdd(c.epoch, 1u);
}

/**
 * Folds the hit counters of this rank's lines into their replacement states (one warp per set;
 * each counted hit is one set_ref::touch, at most 64 per line and pass).
 */
template <class T, class Impl>
__global__ void __launch_bounds__(line_block) group_fold_kernel(group_ref<T, Impl> c) {
  unsigned const lane       = threadIdx.x % ways;
  std::size_t const warp    = grid_thread() / ways;
  std::size_t const n_warps = grid_threads() / ways;
  std::uint32_t* const hits = c.parts[c.me].hits;
  for (std::size_t s = warp; s < c.meta.sets; s += n_warps) {
    std::size_t const slot = cache_ref<Impl>::slot(static_cast<std::uint32_t>(s), 0) + lane;
    std::uint32_t h        = 0;
    if (shared_word(hits + slot).load(cuda::memory_order_relaxed) != 0) {
      h = shared_word(hits + slot).exchange(0u, cuda::memory_order_relaxed);
    }
    std::uint32_t const touched = __ballot_sync(full_warp, h != 0);
    if (touched == 0) { continue; }
    auto const set = c.meta.set(static_cast<std::uint32_t>(s));
    lock_set(set.header, lane);
    for (std::uint32_t m = touched; m != 0; m &= m - 1) {
      int const way          = lowest_way(m);
      std::uint32_t const hw = __shfl_sync(full_warp, h, static_cast<unsigned>(way));
      if (lane == 0 && ((set.header->valid >> way) & 1u) != 0) {
        for (std::uint32_t i = 0; i < hw && i < 64; ++i) { set.touch(way); }
      }
    }
    unlock_set(set.header, lane);
  }
}

/**
 * The admissions of this rank's hints (*taken of them; one warp per hint): a valid key that
 * hashes here and is not held takes a way by the replacement policy among those this pass has not
 * taken (none left: dropped), under the set's lock; the line is emptied (its key word 0),
 * filled from @p table and published (its key word key + 1), see the top of this file.
 */
template <class W, class T, class Impl, class Table>
__global__ void __launch_bounds__(line_block)
    group_admit_kernel(group_ref<T, Impl> c, Table table, std::size_t rows,
                       std::uint32_t const* taken) {
  unsigned const lane          = threadIdx.x % ways;
  std::size_t const warp       = grid_thread() / ways;
  std::size_t const n_warps    = grid_threads() / ways;
  std::size_t const n          = *taken;
  std::uint32_t const epoch    = *c.epoch;
  group_part<T> const part     = c.parts[c.me];
  std::size_t const row_bytes  = c.dim * sizeof(T);
  std::size_t const vecs       = row_bytes / sizeof(W);
  unsigned long long evictions = 0, loaded = 0;
  for (std::size_t i = warp; i < n; i += n_warps) {
    std::uint32_t key = 0;
    if (lane == 0) { key = shared_word(part.hints + i).load(cuda::memory_order_relaxed); }
    key = __shfl_sync(full_warp, key, 0);
    if (key >= rows || c.holder(key) != c.me) { continue; }  // a stale hint's leftover
    std::uint32_t const s = c.meta.set_index(key);
    auto const set        = c.meta.set(s);
    lock_set(set.header, lane);
    int way      = no_way;
    bool evicted = false;
    if (lane == 0 && set.find(key) == no_way) {
      set.begin_batch(epoch);
      admission const a = set.admit(key, set.header->batch);
      if (a.way != no_way) {
        set.header->batch |= 1u << a.way;
        way     = a.way;
        evicted = a.evicted;
      }
    }
    way     = __shfl_sync(full_warp, way, 0);
    evicted = __shfl_sync(full_warp, evicted, 0);
    if (way != no_way) {
      std::size_t const slot = cache_ref<Impl>::slot(s, way);
      auto const word        = line_word(part.line + slot);
      std::uint64_t next     = 0;  // the line's next generation, in the high half
      if (lane == 0) {
        next = emptied_word(word.load(cuda::memory_order_relaxed));
        word.store(next, cuda::memory_order_relaxed);
      }
      next = __shfl_sync(full_warp, next, 0);
      __syncwarp();
      // Readers that see any of the new row's values see the emptied key word afterwards.
      cuda::atomic_thread_fence(cuda::memory_order_seq_cst, cuda::thread_scope_system);
      auto const* const src = reinterpret_cast<W const*>(table.row(key));
      auto* const dst       = reinterpret_cast<W*>(part.w + slot * c.dim);
      for (std::size_t v = lane; v < vecs; v += ways) { dst[v] = load_vec<true>(src + v); }
      // Every lane's writes of the row come before the key that publishes it.
      cuda::atomic_thread_fence(cuda::memory_order_release, cuda::thread_scope_system);
      __syncwarp();
      if (lane == 0) { word.store(published_word(next, key), cuda::memory_order_release); }
      evictions += evicted ? 1 : 0;
      loaded += row_bytes;
    }
    unlock_set(set.header, lane);
  }
  if (lane == 0) {
    if (evictions != 0) { atomicAdd(&c.stats->evictions, evictions); }
    if (loaded != 0) { atomicAdd(&c.stats->bytes_from_host, loaded); }
  }
}

/// Empties every line of this rank (one thread per line; set headers by the way-0 thread).
template <class T, class Impl>
__global__ void group_invalidate_kernel(group_ref<T, Impl> c) {
  group_part<T> const part = c.parts[c.me];
  std::size_t const lines  = static_cast<std::size_t>(c.meta.sets) * ways;
  for (std::size_t i = grid_thread(); i < lines; i += grid_threads()) {
    auto const word = line_word(part.line + i);
    word.store(emptied_word(word.load(cuda::memory_order_relaxed)), cuda::memory_order_relaxed);
    shared_word(part.hits + i).store(0u, cuda::memory_order_relaxed);
    if (i % ways == 0) {
      set_header* const h = c.meta.headers + i / ways;
      h->valid            = 0;
      h->dirty            = 0;
    }
  }
}

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
   */
  group_lines(communicator& group, std::size_t rows, double ratio, std::uint32_t seed,
              std::size_t dim)
      : plan_{plan_group(group, rows, ratio)},
        dim_{dim},
        seed_{seed},
        tags_{plan_.lines},
        states_{plan_.lines},
        headers_{plan_.sets},
        stats_{1},
        counters_{3},
        parts_{static_cast<std::size_t>(group.size())},
        shared_{make_shared(group)} {
    WM_CUDA_TRY(cudaMemset(tags_.data(), 0, plan_.lines * sizeof(std::uint32_t)));
    WM_CUDA_TRY(cudaMemset(states_.data(), 0, plan_.lines * sizeof(state_type)));
    WM_CUDA_TRY(cudaMemset(headers_.data(), 0, plan_.sets * sizeof(set_header)));
    WM_CUDA_TRY(cudaMemset(stats_.data(), 0, sizeof(device_statistics)));
    WM_CUDA_TRY(cudaMemset(counters_.data(), 0, 3 * sizeof(std::uint32_t)));
    std::vector<group_part<T>> parts(static_cast<std::size_t>(group.size()));
    for (int g = 0; g < group.size(); ++g) { parts[static_cast<std::size_t>(g)] = part(g); }
    WM_CUDA_TRY(cudaMemcpy(parts_.data(), parts.data(), parts.size() * sizeof(group_part<T>),
                           cudaMemcpyHostToDevice));
    // This rank's shared part starts empty (no line, no hint) before any peer reads it.
    WM_CUDA_TRY(cudaMemset(shared_->part_data(group.rank()), 0, part_bytes()));
    WM_CUDA_TRY(cudaDeviceSynchronize());
    me_         = group.rank();
    group_size_ = group.size();
    group.barrier();
  }
  group_lines(group_lines const&)            = delete;
  group_lines& operator=(group_lines const&) = delete;
  /// Peers may still read this rank's lines until their own work ends: the shared memory's
  /// collective release waits for every rank of the group, after this rank's device work.
  ~group_lines() { (void)cudaDeviceSynchronize(); }

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
      auto const b = plan_distinct(indices.data(), n, row_bits(rows), ws_, s);
      packed_rows const dst{reinterpret_cast<std::byte*>(out), rb};
      std::size_t const bl = blocks(n);
      with_vector(vec, [&]<class W>() {
        group_lookup_kernel<W, T, Impl>
            <<<static_cast<unsigned>(bl), line_block, 0, s>>>(c, table, rows, b, dst, err);
        WM_CHECK_LAUNCH();
      });
      replicate_runs_to(b, nullptr, dst, rb, fused_copies, s);
    }
    admit(table, rows, vec, counters_.data() + 1, s);
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
      auto const b = plan_distinct(keys.data(), keys.size(), row_bits(rows), ws_prefetch_, s);
      with_vector(vec, [&]<class W>() {
        group_lookup_kernel<W, T, Impl>
            <<<static_cast<unsigned>(blocks(keys.size())), line_block, 0, s>>>(
                ref(), table, rows, b, packed_rows{nullptr, 0}, err);
        WM_CHECK_LAUNCH();
      });
    }
    admit(table, rows, vec, counters_.data() + 2, s);
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
  }

  /// Empties this rank's lines (enqueued on @p s). Peers' gathers that run meanwhile read them as
  /// misses from the moment each line is emptied.
  void invalidate(cudaStream_t s) {
    group_invalidate_kernel<<<static_cast<unsigned>(elementwise_blocks(plan_.lines)), 256, 0, s>>>(
        ref());
    WM_CHECK_LAUNCH();
  }

  /// The counters so far (waits for the device).
  [[nodiscard]] cache_statistics statistics() const {
    WM_CUDA_TRY(cudaDeviceSynchronize());
    device_statistics d;
    WM_CUDA_TRY(cudaMemcpy(&d, stats_.data(), sizeof d, cudaMemcpyDeviceToHost));
    return d.to_public();
  }

  /// Sets every counter to zero (waits for the device).
  void reset_statistics() {
    WM_CUDA_TRY(cudaDeviceSynchronize());
    WM_CUDA_TRY(cudaMemset(stats_.data(), 0, sizeof(device_statistics)));
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
    auto* const base = reinterpret_cast<std::uint32_t*>(shared_->part_data(g));
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
    c.parts = parts_.data();
    c.meta  = cache_ref<Impl>{tags_.data(), states_.data(), headers_.data(), plan_.sets, seed_};
    c.me    = me_;
    c.group_size = group_size_;
    c.dim        = dim_;
    c.hint_cap   = hint_cap();
    c.stats      = stats_.data();
    c.epoch      = counters_.data();
    return c;
  }

  /// Blocks of line_block threads for @p warps warps' worth of work, at most 8 per SM.
  [[nodiscard]] static std::size_t blocks(std::size_t warps) {
    return std::clamp<std::size_t>(cuda::ceil_div(warps, std::size_t{line_block / ways}), 1,
                                   static_cast<std::size_t>(sm_count()) * 8);
  }

  cache_plan plan_;
  std::size_t dim_;
  std::uint32_t seed_;
  int me_{};
  int group_size_{1};
  device_buffer<std::uint32_t> tags_;
  device_buffer<state_type> states_;
  device_buffer<set_header> headers_;
  device_buffer<device_statistics> stats_;
  device_buffer<std::uint32_t> counters_;  // the admission pass; hints taken (gather, prefetch)
  device_buffer<group_part<T>> parts_;     // every group rank's part (device copy)
  std::unique_ptr<memory<device, chunked>> shared_;
  workspace ws_;           // the distinct-key plan of gathers
  workspace ws_prefetch_;  // ... of prefetches (beside a gather on another stream)
};

}  // namespace wm::detail::cache
