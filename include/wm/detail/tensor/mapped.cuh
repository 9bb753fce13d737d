// SPDX-License-Identifier: Apache-2.0
// The mapped layouts' sorted read: long batches of chunked rows are read in ascending row order
// (optionally rotated so that ranks start at different owners); long host batches read each
// distinct row once (distinct.cuh). And the check every mapped call makes before it touches
// peers' memory.
#pragma once

#include <wm/comm.hpp>
#include <wm/detail/base/cuda.cuh>
#include <wm/detail/base/workspace.cuh>
#include <wm/detail/rows/views.cuh>
#include <wm/error.hpp>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_transform.cuh>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <string>

namespace wm::detail {

/**
 * Mapped calls read and write peers' parts directly, with no collective that would notice a
 * failed group. Once @p comm is aborted a peer may be gone, and its part with it (or kept only
 * until its process ends: docs/design.md, "Memory kinds"), so they throw before touching any
 * part. @throw wm::comm_error if @p comm was aborted
 */
inline void expect_group_alive(communicator const& comm, char const* what) {
  if (comm.aborted()) {
    throw comm_error{std::string{"wm: "} + what +
                     ": the communicator was aborted (a peer failed or timed out, or a release "
                     "could not agree with its peers), so peers' memory may be gone; nothing was "
                     "read or written. Make a new communicator and new tensors"};
  }
}

/// Batches at least this long are read in ascending row order (chunked device memory of several
/// ranks).
inline constexpr std::size_t host_sort_threshold = std::size_t{1} << 16;

template <class Index>
struct sorted_indices {
  Index* keys;
  std::size_t* positions;
};

/// Stable radix sort of (index, position) pairs in workspace @p ws. @p bits: the low key bits to
/// sort on (all of them where keys may be invalid and order matters).
template <class Index>
sorted_indices<Index> sort_with_positions(Index const* idx, std::size_t n, int bits, workspace& ws,
                                          cudaStream_t s) {
  bits = std::min(bits, int{sizeof(Index) * 8});
  carver c;
  auto const o_pos      = c.add<std::size_t>(n);
  auto const o_keys     = c.add<Index>(n);
  auto const o_spos     = c.add<std::size_t>(n);
  std::size_t cub_bytes = 0;
  WM_CUDA_TRY(cub::DeviceRadixSort::SortPairs(
      nullptr, cub_bytes, static_cast<Index const*>(nullptr), static_cast<Index*>(nullptr),
      static_cast<std::size_t const*>(nullptr), static_cast<std::size_t*>(nullptr),
      std::max<std::size_t>(n, 1), 0, bits, s));
  auto const o_cub = c.add<std::byte>(cub_bytes);
  std::byte* base  = ws.reserve(c.total(), s);
  auto* pos        = c.take<std::size_t>(base, o_pos);
  sorted_indices<Index> out{c.take<Index>(base, o_keys), c.take<std::size_t>(base, o_spos)};
  if (n == 0) { return out; }
  iota_async(pos, n, 0, s);
  WM_CUDA_TRY(cub::DeviceRadixSort::SortPairs(c.take<std::byte>(base, o_cub), cub_bytes, idx,
                                              out.keys, pos, out.positions, n, 0, bits, s));
  return out;
}

/// Valid rows k become (k + by) mod rows; invalid indices stay as they are (still invalid).
template <class Index>
struct rotate_op {
  std::size_t rows;
  std::size_t by;
  __device__ Index operator()(Index k) const {
    return valid_index(k, rows) ? static_cast<Index>((static_cast<std::size_t>(k) + by) % rows) : k;
  }
};

/// out[i] = in[i] rotated by @p by rows (see rotate_op); @p out may be @p in. @p rows > 0.
template <class Index>
void rotate_rows(Index const* in, Index* out, std::size_t n, std::size_t rows, std::size_t by,
                 cudaStream_t s) {
  if (n == 0) { return; }
  WM_CUDA_TRY(cub::DeviceTransform::Transform(in, out, n, rotate_op<Index>{rows, by}, s));
}

}  // namespace wm::detail
