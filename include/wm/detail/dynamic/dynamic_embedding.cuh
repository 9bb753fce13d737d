// SPDX-License-Identifier: Apache-2.0
// Host side of wm::dynamic_embedding: argument checks, the calls' kernel sequences (hash and
// sort the batch, find the buckets' runs, check, upsert, write or assign rows) and the update
// through the embedding's update kernels over rows in slot order.
#pragma once

#include <wm/comm.hpp>
#include <wm/decl/dynamic_embedding.cuh>
#include <wm/detail/base/cuda.cuh>
#include <wm/detail/dynamic/buckets.cuh>
#include <wm/detail/dynamic/kernels.cuh>
#include <wm/detail/dynamic/table.cuh>
#include <wm/embedding.cuh>  // update_owner_rows (detail/embedding/update.cuh)
#include <wm/error.hpp>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_select.cuh>
#include <thrust/iterator/counting_iterator.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

namespace wm {

#define WM_DYNAMIC_TEMPLATE template <class T, optimizer_policy Optimizer, eviction_policy Eviction>
#define WM_DYNAMIC dynamic_embedding<T, Optimizer, Eviction>

namespace detail::dynamic {

/// The slot of each of @p n keys and whether it was found, in @p t's workspace.
struct located_keys {
  std::uint32_t* slots;
  key_status* status;
};

/// Finds the slots of @p n keys (@p missing for a key the table does not hold); reserved keys
/// set the table's error flag. Enqueued on @p s.
template <class T, class Key>
located_keys locate_keys(table<T>& t, Key const* keys, std::size_t n, std::uint32_t missing,
                         cudaStream_t s) {
  carver c;
  std::size_t const o_slots  = c.add<std::uint32_t>(n);
  std::size_t const o_status = c.add<key_status>(n);
  std::byte* base            = t.ws.reserve(c.total(), s);
  located_keys const at{c.take<std::uint32_t>(base, o_slots), c.take<key_status>(base, o_status)};
  find_kernel<<<elementwise_blocks(n * 32), 256, 0, s>>>(t.view(), keys, n, missing, at.slots,
                                                         at.status, t.err.data());
  WM_CHECK_LAUNCH();
  return at;
}

/// Buckets for @p capacity rows (checked by the constructor).
[[nodiscard]] inline std::uint32_t bucket_count(communicator& comm, std::size_t capacity,
                                                std::size_t dim) {
  WM_EXPECTS(comm.size() == 1, "dynamic_embedding: " + std::to_string(comm.size()) +
                                   " ranks; only one rank is built yet");
  WM_EXPECTS(capacity >= 1, "dynamic_embedding: capacity 0; at least one row expected");
  WM_EXPECTS(dim >= 1, "dynamic_embedding: dim 0; at least one value per row expected");
  std::size_t const b = (capacity + slots_per_bucket - 1) / slots_per_bucket;
  // The update sorts slots as 32-bit keys, and one sink slot follows the table.
  WM_EXPECTS(b * slots_per_bucket <= std::size_t{0xfffffffeu},
             "dynamic_embedding: capacity " + std::to_string(capacity) +
                 " rows; at most 2^32 - 2 per rank");
  return static_cast<std::uint32_t>(b);
}

}  // namespace detail::dynamic

WM_DYNAMIC_TEMPLATE
WM_DYNAMIC::dynamic_embedding(communicator& comm, std::size_t capacity, std::size_t dim,
                              Optimizer optimizer, embedding_init init, dynamic_options options)
    : opt_{optimizer}, init_{init}, options_{options} {
  std::uint32_t const buckets = detail::dynamic::bucket_count(comm, capacity, dim);
  table_                      = std::make_unique<detail::dynamic::table<T>>(
      buckets, dim, Optimizer::states, opt_.needs_steps(), initial_state(opt_), options.hash_seed);
}

WM_DYNAMIC_TEMPLATE
WM_DYNAMIC::dynamic_embedding(dynamic_embedding&&) noexcept = default;
WM_DYNAMIC_TEMPLATE
WM_DYNAMIC& WM_DYNAMIC::operator=(dynamic_embedding&&) noexcept = default;
WM_DYNAMIC_TEMPLATE
WM_DYNAMIC::~dynamic_embedding() = default;

WM_DYNAMIC_TEMPLATE
std::size_t WM_DYNAMIC::capacity() const noexcept {
  return table_ ? table_->slots : 0;
}
WM_DYNAMIC_TEMPLATE
std::size_t WM_DYNAMIC::dim() const noexcept {
  return table_ ? table_->dim : 0;
}

WM_DYNAMIC_TEMPLATE
std::size_t WM_DYNAMIC::size(cuda::stream_ref stream) {
  auto& t              = *table_;
  cudaStream_t const s = stream.get();
  detail::dynamic::count_kernel<<<detail::elementwise_blocks(t.slots), 256, 0, s>>>(
      t.view(), t.slots, t.counter.data());
  WM_CHECK_LAUNCH();
  return static_cast<std::size_t>(t.read_back(s).second);
}

WM_DYNAMIC_TEMPLATE
double WM_DYNAMIC::load_factor(cuda::stream_ref stream) {
  return static_cast<double>(size(stream)) / static_cast<double>(capacity());
}

WM_DYNAMIC_TEMPLATE
template <dynamic_key Key>
void WM_DYNAMIC::find(std::span<Key const> keys, T* out, bool* found, cuda::stream_ref stream) {
  namespace dy         = detail::dynamic;
  auto& t              = *table_;
  cudaStream_t const s = stream.get();
  std::size_t const n  = keys.size();
  WM_EXPECTS(n == 0 || (keys.data() != nullptr && (out != nullptr || found != nullptr)),
             "dynamic_embedding::find: null keys, or neither out nor found");
  if (n == 0) { return; }
  auto const [slots, status] = dy::locate_keys(t, keys.data(), n, dy::no_slot, s);
  dy::rows_out_kernel<<<detail::elementwise_blocks(n * t.dim), 256, 0, s>>>(
      t.rows(), keys.data(), slots, status, n, out, found, init_,
      options_.missing == missing_rows::zeros);
  WM_CHECK_LAUNCH();
  WM_EXPECTS((t.read_back(s).first & dy::reserved_key) == 0,
             "dynamic_embedding::find: a key is reserved (dynamic_empty_key or "
             "dynamic_locked_key)");
}

WM_DYNAMIC_TEMPLATE
template <dynamic_key Key>
std::size_t WM_DYNAMIC::upsert(std::span<Key const> keys, T const* values, T* out, bool* found,
                               dynamic_evicted<T, Key> const* evicted,
                               std::span<std::uint64_t const> scores, cuda::stream_ref stream) {
  namespace dy         = detail::dynamic;
  auto& t              = *table_;
  cudaStream_t const s = stream.get();
  std::size_t const n  = keys.size();
  WM_EXPECTS(n < (std::size_t{1} << 31), "dynamic_embedding: " + std::to_string(n) +
                                             " keys in one call; split the batch below 2^31");
  WM_EXPECTS(n == 0 || keys.data() != nullptr, "dynamic_embedding: null keys");
  if constexpr (rule_type::user_scores) {
    WM_EXPECTS(scores.size() == n && (n == 0 || scores.data() != nullptr),
               std::string{"dynamic_embedding: "} + Eviction::name + " needs one score per key (" +
                   std::to_string(n) + "), got " + std::to_string(scores.size()));
  } else {
    WM_EXPECTS(scores.empty(), std::string{"dynamic_embedding: scores given to "} + Eviction::name +
                                   ", which keeps its own");
  }
  if (n == 0) { return 0; }
  int const ni = static_cast<int>(n);

  // 1. The batch's hashes sorted with their positions (equal keys adjacent, buckets in runs),
  //    the runs' heads, the slots and statuses per position.
  thrust::counting_iterator<int> const positions{0};
  std::size_t cub_sort = 0, cub_select = 0;
  WM_CUDA_TRY(cub::DeviceRadixSort::SortPairs(
      nullptr, cub_sort, static_cast<std::uint64_t const*>(nullptr),
      static_cast<std::uint64_t*>(nullptr), static_cast<int const*>(nullptr),
      static_cast<int*>(nullptr), ni, 0, 64, s));
  WM_CUDA_TRY(cub::DeviceSelect::If(nullptr, cub_select, positions, static_cast<int*>(nullptr),
                                    static_cast<int*>(nullptr), ni,
                                    dy::bucket_head{t.view(), nullptr}, s));
  detail::carver c;
  std::size_t const o_h      = c.add<std::uint64_t>(n);
  std::size_t const o_sh     = c.add<std::uint64_t>(n);
  std::size_t const o_pos    = c.add<int>(n);
  std::size_t const o_spos   = c.add<int>(n);
  std::size_t const o_offs   = c.add<int>(n);
  std::size_t const o_runs   = c.add<int>(1);
  std::size_t const o_slots  = c.add<std::uint32_t>(n);
  std::size_t const o_status = c.add<dy::key_status>(n);
  std::size_t const o_cub    = c.add<std::byte>(std::max(cub_sort, cub_select));
  std::byte* base            = t.ws.reserve(c.total(), s);
  auto* h                    = c.take<std::uint64_t>(base, o_h);
  auto* sorted_h             = c.take<std::uint64_t>(base, o_sh);
  auto* pos                  = c.take<int>(base, o_pos);
  auto* sorted_pos           = c.take<int>(base, o_spos);
  auto* offsets              = c.take<int>(base, o_offs);
  auto* runs                 = c.take<int>(base, o_runs);
  auto* slots                = c.take<std::uint32_t>(base, o_slots);
  auto* status               = c.take<dy::key_status>(base, o_status);
  auto* temp                 = c.take<std::byte>(base, o_cub);

  dy::hash_keys_kernel<<<detail::elementwise_blocks(n), 256, 0, s>>>(t.view(), keys.data(), n, h,
                                                                     pos, t.err.data());
  WM_CHECK_LAUNCH();
  WM_CUDA_TRY(
      cub::DeviceRadixSort::SortPairs(temp, cub_sort, h, sorted_h, pos, sorted_pos, ni, 0, 64, s));
  WM_CUDA_TRY(cub::DeviceSelect::If(temp, cub_select, positions, offsets, runs, ni,
                                    dy::bucket_head{t.view(), sorted_h}, s));

  // 2. Checks before anything changes: reserved keys; buckets that may not evict and would
  //    overflow (a dry run of the upsert).
  ++tick_;
  dy::upsert_args<T, Key> a{
      t.view(), t.rows(),        keys.data(), rule_type::user_scores ? scores.data() : nullptr,
      sorted_h, sorted_pos,      offsets,     runs,
      ni,       {tick_, epoch_}, init_,       values == nullptr,
      {},       slots,           status,      t.err.data()};
  // As many warps as runs, at most a few waves.
  auto const warps_needed = std::min<std::size_t>(n, std::size_t{1} << 20);
  int const blocks        = static_cast<int>((warps_needed + 7) / 8);
  if constexpr (!rule_type::evicts) {
    dy::upsert_kernel<rule_type, true><<<blocks, 256, 0, s>>>(a);
    WM_CHECK_LAUNCH();
  }
  unsigned const bad = t.read_back(s).first;
  if (bad != 0) {
    --tick_;
    WM_EXPECTS((bad & dy::reserved_key) == 0,
               "dynamic_embedding: a key is reserved (dynamic_empty_key or dynamic_locked_key); "
               "nothing was changed");
    throw logic_error{std::string{"wm: dynamic_embedding: a bucket is full and the eviction "
                                  "policy is "} +
                      Eviction::name + "; nothing was changed (raise the capacity)"};
  }

  // 3. The upsert, then the rows the call writes out or assigns.
  if (evicted != nullptr) {
    a.evicted = {reinterpret_cast<std::uint64_t*>(evicted->keys),
                 evicted->values,
                 evicted->states,
                 evicted->steps,
                 evicted->scores,
                 t.counter.data()};
  }
  dy::upsert_kernel<rule_type, false><<<blocks, 256, 0, s>>>(a);
  WM_CHECK_LAUNCH();
  if (values != nullptr) {
    dy::assign_rows_kernel<<<detail::elementwise_blocks(n * t.dim), 256, 0, s>>>(
        t.rows(), sorted_h, sorted_pos, n, slots, values);
    WM_CHECK_LAUNCH();
  }
  if (out != nullptr || found != nullptr) {
    dy::rows_out_kernel<<<detail::elementwise_blocks(n * t.dim), 256, 0, s>>>(
        t.rows(), keys.data(), slots, status, n, out, found, init_, false);
    WM_CHECK_LAUNCH();
  }
  return static_cast<std::size_t>(t.read_back(s).second);
}

WM_DYNAMIC_TEMPLATE
template <dynamic_key Key>
void WM_DYNAMIC::find_or_insert(std::span<Key const> keys, T* out, bool* found,
                                cuda::stream_ref stream, std::span<std::uint64_t const> scores) {
  (void)upsert<Key>(keys, nullptr, out, found, nullptr, scores, stream);
}

WM_DYNAMIC_TEMPLATE
template <dynamic_key Key>
void WM_DYNAMIC::insert_or_assign(std::span<Key const> keys, T const* values,
                                  cuda::stream_ref stream, std::span<std::uint64_t const> scores) {
  WM_EXPECTS(keys.empty() || values != nullptr, "dynamic_embedding::insert_or_assign: null values");
  (void)upsert<Key>(keys, values, nullptr, nullptr, nullptr, scores, stream);
}

WM_DYNAMIC_TEMPLATE
template <dynamic_key Key>
std::size_t WM_DYNAMIC::insert_and_evict(std::span<Key const> keys, T const* values,
                                         dynamic_evicted<T, Key> const& evicted,
                                         cuda::stream_ref stream,
                                         std::span<std::uint64_t const> scores) {
  WM_EXPECTS(keys.empty() || values != nullptr, "dynamic_embedding::insert_and_evict: null values");
  return upsert<Key>(keys, values, nullptr, nullptr, &evicted, scores, stream);
}

WM_DYNAMIC_TEMPLATE
template <dynamic_key Key>
void WM_DYNAMIC::gather(std::span<Key const> keys, T* out, cuda::stream_ref stream) {
  (void)upsert<Key>(keys, nullptr, out, nullptr, nullptr, {}, stream);
}

WM_DYNAMIC_TEMPLATE
template <dynamic_key Key>
std::size_t WM_DYNAMIC::erase(std::span<Key const> keys, cuda::stream_ref stream) {
  namespace dy         = detail::dynamic;
  auto& t              = *table_;
  cudaStream_t const s = stream.get();
  std::size_t const n  = keys.size();
  WM_EXPECTS(n == 0 || keys.data() != nullptr, "dynamic_embedding::erase: null keys");
  if (n == 0) { return 0; }
  dy::check_keys_kernel<<<detail::elementwise_blocks(n), 256, 0, s>>>(keys.data(), n, t.err.data());
  WM_CHECK_LAUNCH();
  WM_EXPECTS((t.read_back(s).first & dy::reserved_key) == 0,
             "dynamic_embedding::erase: a key is reserved (dynamic_empty_key or "
             "dynamic_locked_key); nothing was changed");
  dy::erase_kernel<<<detail::elementwise_blocks(n * 32), 256, 0, s>>>(t.view(), keys.data(), n,
                                                                      t.counter.data());
  WM_CHECK_LAUNCH();
  return static_cast<std::size_t>(t.read_back(s).second);
}

WM_DYNAMIC_TEMPLATE
void WM_DYNAMIC::clear(cuda::stream_ref stream) {
  auto& t              = *table_;
  cudaStream_t const s = stream.get();
  WM_CUDA_TRY(cudaMemsetAsync(t.keys.data(), 0xff, t.slots * sizeof(std::uint64_t), s));
  WM_CUDA_TRY(cudaMemsetAsync(t.digests.data(), 0, t.slots, s));
  WM_CUDA_TRY(cudaMemsetAsync(t.scores.data(), 0, t.slots * sizeof(std::uint64_t), s));
}

WM_DYNAMIC_TEMPLATE
template <dynamic_key Key, class Pred>
std::size_t WM_DYNAMIC::export_batch(Pred pred, Key* keys, T* values, std::uint64_t* scores,
                                     cuda::stream_ref stream) {
  auto& t              = *table_;
  cudaStream_t const s = stream.get();
  WM_EXPECTS(keys != nullptr, "dynamic_embedding::export_batch: null keys");
  detail::dynamic::export_kernel<<<detail::elementwise_blocks(t.slots), 256, 0, s>>>(
      t.view(), t.rows(), t.slots, pred, reinterpret_cast<std::uint64_t*>(keys), values, scores,
      t.counter.data());
  WM_CHECK_LAUNCH();
  return static_cast<std::size_t>(t.read_back(s).second);
}

WM_DYNAMIC_TEMPLATE
template <dynamic_key Key>
void WM_DYNAMIC::apply_gradients(std::span<Key const> keys, T const* grads, float lr,
                                 cuda::stream_ref stream) requires sparse_optimizer<Optimizer> {
  namespace dy         = detail::dynamic;
  auto& t              = *table_;
  cudaStream_t const s = stream.get();
  std::size_t const n  = keys.size();
  WM_EXPECTS(n == 0 || (keys.data() != nullptr && grads != nullptr),
             "dynamic_embedding::apply_gradients: null keys or gradients");
  WM_EXPECTS(n < (std::size_t{1} << 31),
             "dynamic_embedding::apply_gradients: " + std::to_string(n) +
                 " gradient rows in one call; split the batch below "
                 "2^31");
  std::int64_t const step = global_step_ + 1;
  if (n > 0) {
    // Slots of the keys; keys the table does not hold go to the sink slot (the last row), whose
    // update nobody reads, so the other rows' sums keep the batch order.
    auto const [slots, status] =
        dy::locate_keys(t, keys.data(), n, static_cast<std::uint32_t>(t.slots), s);
    WM_EXPECTS((t.read_back(s).first & dy::reserved_key) == 0,
               "dynamic_embedding::apply_gradients: a key is reserved (dynamic_empty_key or "
               "dynamic_locked_key); nothing was updated");
    std::size_t const rows = t.slots + 1;
    detail::table_rows<T> const table{
        {t.w.data(), rows, t.dim, t.dim},
        {t.st.size() != 0 ? t.st.data() : nullptr, rows, t.state_len, t.state_len},
        t.steps.size() != 0 ? t.steps.data() : nullptr,
        1};
    detail::update_owner_rows(opt_, table, table, step, slots, grads, n, rows, lr, t.err.data(),
                              t.update, s);
    WM_EXPECTS(t.read_back(s).first == 0,
               "dynamic_embedding::apply_gradients: a slot was out of range (internal error)");
  }
  global_step_ = step;
}

WM_DYNAMIC_TEMPLATE
dynamic_embedding_ref<T> WM_DYNAMIC::ref() const noexcept {
  auto const& t = *table_;
  return {t.keys.data(), t.digests.data(), t.w.data(), t.buckets, t.seed, t.dim};
}

template <class T>
template <dynamic_key Key>
__device__ T const* dynamic_embedding_ref<T>::find(Key key) const noexcept {
  detail::dynamic::buckets_view const v{const_cast<std::uint64_t*>(keys_),
                                        const_cast<std::uint8_t*>(digests_), nullptr, buckets_,
                                        seed_};
  std::uint32_t const s = detail::dynamic::thread_find(v, static_cast<std::uint64_t>(key));
  return s == detail::dynamic::no_slot ? nullptr : rows_ + static_cast<std::size_t>(s) * dim_;
}

#undef WM_DYNAMIC
#undef WM_DYNAMIC_TEMPLATE

}  // namespace wm
