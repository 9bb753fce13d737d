// The seam a cache policy plugs into: where an embedding's gather reads rows and where the
// owner-side update writes them. Without a cache (wm::no_cache) both are the table itself.
#pragma once

#include <wm/embedding.cuh>
#include <wm/tensor.cuh>

#include <cuda/stream_ref>

#include <span>

namespace wm::detail {

/// The source of rows of an embedding with @p CachePolicy (a cache specializes it: its lines in
/// front of the table). Both members are inline pass-throughs for wm::no_cache.
template <class CachePolicy>
struct row_source {
  /// The gather's read path: `out[i, :] = table[indices[i], :]`.
  template <class Table, class Index, class T>
  static void gather(Table& table, std::span<Index const> indices, T* out,
                     cuda::stream_ref stream) {
    table.gather(indices, out, stream);
  }
  /// The rows the owner-side update reads and writes (this rank's local rows).
  template <class T>
  [[nodiscard]] static matrix_view<T> update_rows(matrix_view<T> local) noexcept {
    return local;
  }
};

}  // namespace wm::detail
