// SPDX-License-Identifier: Apache-2.0
// A cache as the exchange engine's reader (engine.cuh): on the owner side of a distributed
// gather, the rows asked of this rank come from its cache.
#pragma once

#include <wm/detail/cache/line_storage.cuh>
#include <wm/detail/rows/views.cuh>
#include <wm/detail/tensor/table_rows.cuh>

#include <cuda_runtime_api.h>

#include <cstddef>

namespace wm::detail::cache {

/**
 * The owner side's reads of a distributed gather (the exchange engine's reader, engine.cuh):
 * the keys this rank owns, asked for by any rank, are served by its cache (hits from lines,
 * misses admitted) into the engine's buffers.
 */
template <class T, class Impl>
struct line_reader {
  line_storage<T, Impl>* lines;
  table_rows<T> table;
  std::size_t rows;  ///< this rank's rows
  unsigned* err;
  cudaStream_t main_stream;  ///< calls on any other stream use the second workspace
  template <class Index>
  void operator()(Index const* keys, std::size_t const* order, std::size_t n, packed_rows dst,
                  cudaStream_t s, int blocks_per_sm) const {
    lines->admit(table, rows, keys, n,
                 {.order          = order,
                  .out            = dst,
                  .count_requests = true,
                  .err            = err,
                  .aux            = s != main_stream,
                  .blocks_per_sm  = blocks_per_sm},
                 s);
  }
};

}  // namespace wm::detail::cache
