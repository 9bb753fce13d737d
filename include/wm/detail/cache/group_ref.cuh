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
// This file: one group rank's shared part as every rank addresses it (group_part), the group
// cache as one rank's kernels see it (group_ref), and the device helpers of the shared words.
#pragma once

#include <wm/detail/cache/set.hpp>
#include <wm/detail/cache/statistics.hpp>

#include <cuda/atomic>

#include <cstddef>
#include <cstdint>

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
  unsigned long long* refused{};  ///< copies refused (cache_statistics::refused_copies)
  std::uint32_t* epoch{};         ///< admission passes (set.hpp's batches)

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

}  // namespace wm::detail::cache
