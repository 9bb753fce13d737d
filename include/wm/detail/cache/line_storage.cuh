// SPDX-License-Identifier: Apache-2.0
// The storage of one rank's cache (line_storage): set metadata, line payloads, device statistics,
// the staging of write-backs, and the host side of each call, which chooses its path (planned:
// admit_kernels.cuh; hit-first: hit_first_kernels.cuh) and launches it.
#pragma once

#include <wm/cache.hpp>
#include <wm/detail/base/cuda.cuh>
#include <wm/detail/base/resources.hpp>
#include <wm/detail/base/workspace.cuh>
#include <wm/detail/cache/admit_kernels.cuh>
#include <wm/detail/cache/hit_first_kernels.cuh>
#include <wm/detail/cache/lines_ref.cuh>
#include <wm/detail/cache/plan.hpp>
#include <wm/detail/cache/set.hpp>
#include <wm/detail/cache/statistics.hpp>
#include <wm/detail/memory/collective.hpp>
#include <wm/detail/rows/distinct.cuh>
#include <wm/detail/rows/views.cuh>
#include <wm/detail/tensor/table_rows.cuh>

#include <cub/device/device_radix_sort.cuh>
#include <cuda/cmath>
#include <cuda/std/bit>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>

namespace wm::detail::cache {

/// The most victims one admission call stages (their payloads take device memory beside the
/// lines; past this many, victims are written back at once, inside their set's lock).
inline constexpr std::size_t max_staged = std::size_t{1} << 20;

/// A staged gather takes the hit-first path after calls that missed at most one key in this
/// many (bench/NOTES.md: where the unplanned misses start to cost more than the plan).
inline constexpr unsigned long long hit_first_miss_share = 32;
/// Distinct bypassed keys a hit-first gather counts exactly (its memo has room for twice as many
/// keys, up to twice the batch).
inline constexpr std::size_t hit_first_memo_keys = std::size_t{1} << 16;

/// What a cache's lines hold: the constructors' options of the cache engines (line_storage, and
/// group_storage, which a group cache names).
struct line_options {
  std::size_t rows{};        ///< rows cached: this rank's part, or the table's when `shared`
  std::size_t dim{};         ///< values per row
  std::size_t state_cols{};  ///< optimizer state floats per row (0: none)
  bool steps{false};         ///< whether lines keep the per-row step
  double ratio{0.1};         ///< cache_options::ratio
  std::uint32_t seed{};      ///< cache_options::hash_seed
  /// Dirty victims of one-rank gathers staged and written back in ascending key order (a
  /// writable cache).
  bool stage_write_backs{false};
  /// Lines shared over the communicator's ranks, each holding the rows hashed to it (a group
  /// cache on several ranks); otherwise each rank caches rows of its own part.
  bool shared{false};
};

/// What one admission call does besides admitting its keys (line_storage::admit).
struct admit_options {
  std::size_t const* order{};  ///< output row of key i: order[i] (null: i)
  packed_rows out{};           ///< the output (a null base: none, as a prefetch)
  bool count_requests{false};  ///< count requests, hits, misses and bypasses (a gather)
  unsigned* err{};             ///< set when a key is not below the call's rows
  /// The second workspace: a call on another stream beside the first (the exchange engine's
  /// own-rows read, a prefetch).
  bool aux{false};
  int blocks_per_sm{8};  ///< the most blocks per multiprocessor (the engine leaves room)
  /// A one-rank gather: a batch of its own, dirty victims staged, the hit-first path allowed.
  bool staged{false};
};

/**
 * One rank's cache: set metadata sized by plan_cache from the rank's rows and the ratio, the
 * line payloads, the device statistics and the workspace of the distinct-key plan. Device
 * memory, RAII; move-only. Calls on one cache are ordered by the caller (one stream, or events):
 * they share the lines and the workspace.
 */
template <class T, class Impl>
class line_storage {
 public:
  using state_type = typename Impl::state_type;

  /**
   * Allocates and clears the lines as a collective step over @p comm (every rank of the table
   * builds its cache): if any rank cannot allocate, every rank throws the same error naming it
   * and the bytes it asked for, and each unwinds its table in the same order as its peers.
   * @param comm the table's communicator
   * @param o this rank's rows, the row's parts, ratio, seed, staging (never `shared`: each rank
   * caches rows of its own part)
   * @throw wm::logic_error for a ratio outside (0, 1], more than 2^32 rows or `shared` (this
   * rank only)
   * @throw wm::comm_error on every rank when any rank's allocation failed
   */
  line_storage(communicator& comm, line_options const& o)
      : plan_{plan_cache<Impl>(o.rows, o.ratio)},
        seed_{o.seed},
        dim_{o.dim},
        st_cols_{o.state_cols},
        stage_cap_{o.stage_write_backs ? std::min<std::size_t>(plan_.lines, max_staged) : 0} {
    WM_EXPECTS(!o.shared,
               "device_cache: each rank caches rows of its own part; no lines are "
               "shared over a group");
    bool const steps             = o.steps;
    std::size_t const dim        = o.dim;
    std::size_t const st_cols    = o.state_cols;
    std::size_t const step_bytes = steps ? sizeof(std::int64_t) : 0;
    std::size_t const bytes =
        plan_.lines * (sizeof(std::uint32_t) + sizeof(state_type) + dim * sizeof(T) +
                       st_cols * sizeof(float) + step_bytes) +
        plan_.sets * sizeof(set_header) + sizeof(device_statistics) + sizeof(std::uint32_t) +
        stage_cap_ *
            (dim * sizeof(T) + st_cols * sizeof(float) + step_bytes + sizeof(std::uint32_t)) +
        (stage_cap_ != 0 ? sizeof(unsigned) : 0) + sizeof(call_counters);
    collective_step(comm, "device_cache: allocating the cache lines", [&] {
      try {
        tags_        = device_buffer<std::uint32_t>{plan_.lines};
        states_      = device_buffer<state_type>{plan_.lines};
        headers_     = device_buffer<set_header>{plan_.sets};
        w_           = device_buffer<T>{plan_.lines * dim};
        st_          = device_buffer<float>{plan_.lines * st_cols};
        steps_       = device_buffer<std::int64_t>{steps ? plan_.lines : 0};
        stats_       = device_buffer<device_statistics>{1};
        epoch_       = device_buffer<std::uint32_t>{1};
        stage_w_     = device_buffer<T>{stage_cap_ * dim};
        stage_st_    = device_buffer<float>{stage_cap_ * st_cols};
        stage_steps_ = device_buffer<std::int64_t>{steps ? stage_cap_ : std::size_t{0}};
        stage_keys_  = device_buffer<std::uint32_t>{stage_cap_};
        stage_count_ = device_buffer<unsigned>{stage_cap_ != 0 ? std::size_t{1} : std::size_t{0}};
        call_        = device_buffer<call_counters>{1};
        shown_       = pinned_buffer<call_counters>{1};
        WM_CUDA_TRY(cudaMemset(call_.data(), 0, sizeof(call_counters)));
        *shown_.data() = call_counters{};
        if (plan_.sets != 0) {
          WM_CUDA_TRY(cudaMemset(tags_.data(), 0, plan_.lines * sizeof(std::uint32_t)));
          WM_CUDA_TRY(cudaMemset(states_.data(), 0, plan_.lines * sizeof(state_type)));
          WM_CUDA_TRY(cudaMemset(headers_.data(), 0, plan_.sets * sizeof(set_header)));
        }
        WM_CUDA_TRY(cudaMemset(stats_.data(), 0, sizeof(device_statistics)));
        WM_CUDA_TRY(cudaMemset(epoch_.data(), 0, sizeof(std::uint32_t)));  // headers: epoch 0 too
        WM_CUDA_TRY(cudaDeviceSynchronize());
      } catch (std::exception const& e) {
        throw std::runtime_error{"could not allocate the " + std::to_string(bytes) +
                                 " bytes of device memory its " + std::to_string(plan_.lines) +
                                 " cache lines take: " + e.what()};
      }
    });
  }

  /// Lines of this rank's cache.
  [[nodiscard]] std::size_t lines() const noexcept { return plan_.lines; }

  /// The kernels' view.
  [[nodiscard]] lines_ref<T, Impl> ref() const noexcept {
    return {cache_ref<Impl>{tags_.data(), states_.data(), headers_.data(), plan_.sets, seed_},
            w_.data(),
            st_cols_ != 0 ? st_.data() : nullptr,
            steps_.data(),
            dim_,
            st_cols_,
            stats_.data(),
            epoch_.data()};
  }

  /// The update's locator over @p table and these lines.
  [[nodiscard]] line_locator<T, Impl> locator(table_rows<T> const& table) const noexcept {
    return {table, ref()};
  }

  /// The lines of this rank's own rows: all of them (the engine's side for row_source, as
  /// group_storage's).
  [[nodiscard]] line_storage* own_lines() noexcept { return this; }
  /// Whether the lines are shared over a group: never (each rank caches its own rows).
  [[nodiscard]] static constexpr bool shared() noexcept { return false; }
  /// Calls @p f with the lines shared over a group: there are none, so it is never called.
  template <class F>
  static void with_shared(F&&) noexcept {}

  /**
   * Admits the distinct keys among @p keys (@p n of them; write-allocate) and, with an output
   * (@p o.out.base not null), writes row keys[i] to out row (@p o.order ? order[i] : i). Keys are
   * this rank's local rows, valid below @p rows. Enqueued on @p s; no host synchronization.
   */
  template <class Index>
  void admit(table_rows<T> const& table, std::size_t rows, Index const* keys, std::size_t n,
             admit_options const& o, cudaStream_t s) {
    if (n == 0) { return; }
    auto c = ref();
    if (o.staged) { c.call = call_.data(); }
    int const vec = width(table, o.out);
    std::size_t const bl =
        std::min<std::size_t>(cuda::ceil_div(n, std::size_t{line_block / ways}),
                              static_cast<std::size_t>(sm_count()) *
                                  static_cast<std::size_t>(std::max(o.blocks_per_sm, 1)));
    if (o.staged && take_hit_first(n, o.order, o.out, o.count_requests, s)) {
      std::size_t const memo =
          std::size_t{2} << cuda::std::bit_width(std::min<std::size_t>(n, hit_first_memo_keys) - 1);
      carver k;
      auto const o_entries = k.add<std::uint64_t>(n);
      auto const o_count   = k.add<unsigned long long>(1);
      auto const o_memo    = k.add<unsigned long long>(memo);
      std::byte* base      = ws_.reserve(k.total(), s);
      miss_list const m{k.take<std::uint64_t>(base, o_entries),
                        k.take<unsigned long long>(base, o_count),
                        k.take<unsigned long long>(base, o_memo), memo};
      begin_staged_call_kernel<<<1, 1, 0, s>>>(epoch_.data(), c.call, shown_.data(), m.count);
      WM_CHECK_LAUNCH();
      with_vector(vec, [&]<class W>() {
        hit_first_kernel<W, T, Impl, Index>
            <<<static_cast<unsigned>(bl), line_block, 0, s>>>(c, rows, keys, n, o.out, m);
        WM_CHECK_LAUNCH();
        miss_kernel<W, T, Impl, Index><<<static_cast<unsigned>(bl), line_block, 0, s>>>(
            c, table, rows, keys, o.out, m, o.err);
        WM_CHECK_LAUNCH();
      });
      ++hit_first_calls_;
      return;
    }
    auto const b = plan_distinct(keys, n, row_bits(rows), o.aux ? ws_aux_ : ws_, s);
    // Staged write-backs: at most one victim per distinct key, so n slots are enough.
    std::size_t const sn = o.staged ? std::min(stage_cap_, n) : 0;
    // Every allocation of the call comes before the admission kernel: from the moment it stages a
    // dirty victim (and cleans its line) until write_back_staged has written it, the victim's row
    // is in a staging slot only, which the next call overwrites. A call that fails for want of
    // memory fails here, with nothing admitted.
    stage_sort const sort{sn, s};
    std::byte* const sort_base = sn != 0 ? stage_ws_.reserve(sort.bytes(), s) : nullptr;
    if (sn != 0) {
      c.stage_w     = stage_w_.data();
      c.stage_st    = st_cols_ != 0 ? stage_st_.data() : nullptr;
      c.stage_steps = c.steps != nullptr ? stage_steps_.data() : nullptr;
      c.stage_keys  = stage_keys_.data();
      c.stage_count = stage_count_.data();
      c.stage_rows  = sn;
      WM_CUDA_TRY(cudaMemsetAsync(stage_count_.data(), 0, sizeof(unsigned), s));
    }
    if (o.staged) {  // this call is a batch of its own
      begin_staged_call_kernel<<<1, 1, 0, s>>>(epoch_.data(), c.call, shown_.data(),
                                               static_cast<unsigned long long*>(nullptr));
    } else {
      next_epoch_kernel<<<1, 1, 0, s>>>(epoch_.data());
    }
    WM_CHECK_LAUNCH();
    if (sn != 0) {
      protect_kernel<T, Impl, Index><<<static_cast<unsigned>(bl), line_block, 0, s>>>(c, rows, b);
      WM_CHECK_LAUNCH();
    }
    with_vector(vec, [&]<class W>() {
      admit_kernel<W, T, Impl, Index><<<static_cast<unsigned>(bl), line_block, 0, s>>>(
          c, table, rows, b, o.order, o.out, o.count_requests, o.err);
      WM_CHECK_LAUNCH();
    });
    if (sn != 0) {  // the long runs' copies too
      write_back_staged(c, table, sn, sort, sort_base, b, o.order, o.out, s);
    } else if (o.out.base != nullptr) {
      replicate_runs_to(b, o.order, o.out, dim_ * sizeof(T), fused_copies, s);
    }
  }

  /// The layout of write_back_staged's sort of @p sn staging slots in its workspace (stage_ws_):
  /// the slots' keys sorted, their slots before and after the sort, CUB's temporary storage.
  struct stage_sort {
    carver k;
    std::size_t cub_bytes{};
    std::size_t skeys{}, slots{}, sslots{}, cub{};
    stage_sort(std::size_t sn, cudaStream_t s) {
      if (sn == 0) { return; }
      WM_CUDA_TRY(cub::DeviceRadixSort::SortPairs(
          nullptr, cub_bytes, static_cast<std::uint32_t const*>(nullptr),
          static_cast<std::uint32_t*>(nullptr), static_cast<unsigned const*>(nullptr),
          static_cast<unsigned*>(nullptr), sn, 0, 32, s));
      skeys  = k.add<std::uint32_t>(sn);
      slots  = k.add<unsigned>(sn);
      sslots = k.add<unsigned>(sn);
      cub    = k.add<std::byte>(cub_bytes);
    }
    [[nodiscard]] std::size_t bytes() const noexcept { return k.total(); }
  };

  /// The staged victims of the last admission (view @p c, @p sn slots) to @p table in ascending
  /// key order: the slots' keys sorted (slots past the count hold the sentinel key 2^32 - 1 and
  /// sort last; the kernel stops at the count), then one warp per row; with an output (@p out.base
  /// not null) the same kernel replicates batch @p b's long runs (staged_write_back_kernel). The
  /// sort's workspace (@p sort, at @p base) was reserved before the admission: nothing here
  /// allocates.
  template <class Index>
  void write_back_staged(lines_ref<T, Impl> const& c, table_rows<T> const& table, std::size_t sn,
                         stage_sort const& sort, std::byte* base, distinct_batch<Index> const& b,
                         std::size_t const* order, packed_rows out, cudaStream_t s) {
    carver const& k    = sort.k;
    auto* sorted_keys  = k.take<std::uint32_t>(base, sort.skeys);
    auto* slots        = k.take<unsigned>(base, sort.slots);
    auto* sorted_slots = k.take<unsigned>(base, sort.sslots);
    // Slots the kernel did not take keep the sentinel (set here, after the kernel, for the
    // slots at or past the count: a kernel-side fill would need the count on the host).
    fill_sentinels_kernel<<<static_cast<unsigned>(elementwise_blocks(sn)), 256, 0, s>>>(
        c.stage_keys, c.stage_count, sn, slots);
    WM_CHECK_LAUNCH();
    std::size_t cub_bytes = sort.cub_bytes;
    WM_CUDA_TRY(cub::DeviceRadixSort::SortPairs(k.take<std::byte>(base, sort.cub), cub_bytes,
                                                c.stage_keys, sorted_keys, slots, sorted_slots, sn,
                                                0, 32, s));
    std::size_t const steps =
        out.base != nullptr ? std::max(sn, cuda::ceil_div(b.n, copies_per_step)) : sn;
    std::size_t const bl =
        std::min<std::size_t>(cuda::ceil_div(steps, std::size_t{line_block / ways}),
                              static_cast<std::size_t>(sm_count()) * 8);
    with_vector(width(table, out), [&]<class W>() {
      staged_write_back_kernel<W, T, Impl, Index><<<static_cast<unsigned>(bl), line_block, 0, s>>>(
          c, table, sorted_keys, sorted_slots, b, order, out);
      WM_CHECK_LAUNCH();
    });
  }

  /// Writes every dirty line back to @p table and cleans it; with @p drop empties every line.
  /// Enqueued on @p s.
  void write_back(table_rows<T> const& table, bool drop, cudaStream_t s) {
    if (plan_.sets == 0) { return; }
    std::size_t const bl = std::min<std::size_t>(
        cuda::ceil_div(std::size_t{plan_.sets}, std::size_t{line_block / ways}),
        static_cast<std::size_t>(sm_count()) * 8);
    with_vector(width(table, packed_rows{nullptr, 0}), [&]<class W>() {
      write_back_kernel<W, T, Impl>
          <<<static_cast<unsigned>(bl), line_block, 0, s>>>(ref(), table, drop);
      WM_CHECK_LAUNCH();
    });
  }

  /// The counters so far (waits for the device).
  [[nodiscard]] cache_statistics statistics() const {
    WM_CUDA_TRY(cudaDeviceSynchronize());
    device_statistics d;
    WM_CUDA_TRY(cudaMemcpy(&d, stats_.data(), sizeof d, cudaMemcpyDeviceToHost));
    cache_statistics st  = d.to_public();
    st.hit_first_gathers = hit_first_calls_;
    return st;
  }

  /// Sets every counter to zero (waits for the device).
  void reset_statistics() {
    WM_CUDA_TRY(cudaDeviceSynchronize());
    WM_CUDA_TRY(cudaMemset(stats_.data(), 0, sizeof(device_statistics)));
    WM_CUDA_TRY(cudaDeviceSynchronize());
    hit_first_calls_ = 0;
  }

 private:
  /// Whether a staged gather of @p n keys takes the hit-first path: a plain gather (no order,
  /// an output, counted), not captured in a graph (a graph keeps the path it was captured with,
  /// so it keeps the one that suits any batch), and the last staged gather the device has shown
  /// missed at most one key in hit_first_miss_share without bypasses. The shown counts lag a
  /// call or two and may mix two calls: they choose a path, never a result.
  [[nodiscard]] bool take_hit_first(std::size_t n, std::size_t const* order, packed_rows out,
                                    bool count_requests, cudaStream_t s) const {
    if (order != nullptr || out.base == nullptr || !count_requests || n == 0) { return false; }
    cudaStreamCaptureStatus capture{};
    WM_CUDA_TRY(cudaStreamIsCapturing(s, &capture));
    if (capture != cudaStreamCaptureStatusNone) { return false; }
    auto const volatile* const h    = shown_.data();
    unsigned long long const req    = h->requests;
    unsigned long long const misses = h->misses;
    unsigned long long const bypass = h->bypasses;
    return req != 0 && bypass == 0 && misses * hit_first_miss_share <= req;
  }

  /// Widest access dividing every row size, stride and base the kernels copy.
  [[nodiscard]] int width(table_rows<T> const& table, packed_rows out) const noexcept {
    return vector_width({dim_ * sizeof(T), table.w.stride * sizeof(T),
                         reinterpret_cast<std::uintptr_t>(table.w.data),
                         reinterpret_cast<std::uintptr_t>(out.base), out.stride_bytes,
                         st_cols_ * sizeof(float), table.st.stride * sizeof(float),
                         reinterpret_cast<std::uintptr_t>(table.st.data)});
  }

  cache_plan plan_;
  std::uint32_t seed_;
  std::size_t dim_;
  std::size_t st_cols_;
  device_buffer<std::uint32_t> tags_;
  device_buffer<state_type> states_;
  device_buffer<set_header> headers_;
  device_buffer<T> w_;
  device_buffer<float> st_;
  device_buffer<std::int64_t> steps_;
  device_buffer<device_statistics> stats_;
  device_buffer<std::uint32_t> epoch_;  // the batch counter (lines_ref::epoch)
  std::size_t stage_cap_;               // staging slots (0: write-backs are never staged)
  device_buffer<T> stage_w_;            // staged victims: weights, states, steps, old keys
  device_buffer<float> stage_st_;
  device_buffer<std::int64_t> stage_steps_;
  device_buffer<std::uint32_t> stage_keys_;
  device_buffer<unsigned> stage_count_;
  device_buffer<call_counters> call_;   // this staged gather's counts
  pinned_buffer<call_counters> shown_;  // the last ones the device showed (host-mapped)
  std::size_t hit_first_calls_{};
  workspace stage_ws_;  // the staged keys' sort
  workspace ws_;        // the distinct-key plan of calls on the caller's stream
  workspace ws_aux_;    // the same for the engine's own-rows read beside them
};

}  // namespace wm::detail::cache
