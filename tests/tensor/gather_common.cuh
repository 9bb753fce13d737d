// SPDX-License-Identifier: Apache-2.0
// Shared by the translation units of tensor_test (and, for random tables and fill_local_rows, by
// tensor_distinct_test): random tables, the kinds the cases run on, and the per-kind bodies of the
// cases. Those bodies (exercise, misaligned_values, zero_rows, ...) are defined in gather_kinds.cuh
// and instantiated once each, in the kind_<location>_<layout>_test.cu file of their kind (both
// mappings); the cases (gather_test.cu, gather_path_test.cu, unwind_test.cu, ranked_test.cu) see
// these declarations only and link against them, so a kind's kernels compile in one translation
// unit and the kinds in several at once. A case that calls a body for a kind no kind_*_test.cu
// instantiates fails at link (undefined reference).
#pragma once

#include <wm/comm.hpp>
#include <wm/error.hpp>
#include <wm/partition.hpp>
#include <wm/tensor.cuh>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "device_array.cuh"
#include "rank_check.hpp"

namespace gather_tests {

using wm_test::device_array;
using wm_test::device_bytes;  // poisoned with wm_test::poison_byte (0xA5) on creation

inline std::vector<std::byte> random_bytes(std::mt19937_64& rng, std::size_t n) {
  std::vector<std::byte> v(n);
  for (auto& b : v) { b = static_cast<std::byte>(rng()); }
  return v;
}

// Global row of local row l on rank r.
template <class M>
std::size_t global_row(wm::block_partition const& p, int world, int r, std::size_t l) {
  if constexpr (std::is_same_v<M, wm::block>) {
    return p.begin(r) + l;
  } else {
    return l * static_cast<std::size_t>(world) + static_cast<std::size_t>(r);
  }
}

// The TEMPLATE_TEST_CASE arguments for every location x layout, each a std::tuple of location,
// layout and the given types (a mapping, then an index type where a case needs one).
#define WM_TENSOR_EVERY_LAYOUT(...)                           \
  (std::tuple<wm::device, wm::continuous, __VA_ARGS__>),      \
      (std::tuple<wm::device, wm::chunked, __VA_ARGS__>),     \
      (std::tuple<wm::device, wm::distributed, __VA_ARGS__>), \
      (std::tuple<wm::host, wm::continuous, __VA_ARGS__>),    \
      (std::tuple<wm::host, wm::chunked, __VA_ARGS__>),       \
      (std::tuple<wm::host, wm::distributed, __VA_ARGS__>)
// Every kind: each location x layout with the block mapping, then with the cyclic one.
#define WM_TENSOR_EVERY_KIND WM_TENSOR_EVERY_LAYOUT(wm::block), WM_TENSOR_EVERY_LAYOUT(wm::cyclic)

// Writes this rank's rows of @p table (rows of rb bytes, global order) into @p t's local rows.
template <class M, class Tensor>
void fill_local_rows(wm::communicator& comm, Tensor& t, std::vector<std::byte> const& table,
                     std::size_t rb) {
  auto const lv = t.local_view();
  if (lv.rows > 0) {
    auto const first = global_row<M>(t.storage().partition(), comm.size(), comm.rank(), 0);
    std::size_t const src_pitch =
        std::is_same_v<M, wm::block> ? rb : static_cast<std::size_t>(comm.size()) * rb;
    WM_CUDA_TRY(cudaMemcpy2D(lv.data, lv.stride * sizeof(*lv.data), table.data() + first * rb,
                             src_pitch, rb, lv.rows, cudaMemcpyDefault));
  }
  WM_CUDA_TRY(cudaDeviceSynchronize());
  comm.barrier();
}

// A gather of fresh random rows on every rank, checked against @p table.
template <class Tensor>
void gather_checks(Tensor& t, std::vector<std::byte> const& table, std::size_t rb,
                   std::uint64_t seed, std::string const& what) {
  std::mt19937_64 rng{seed};
  std::vector<std::int64_t> batch(5000);
  for (auto& k : batch) { k = static_cast<std::int64_t>(rng() % t.rows()); }
  device_array<std::int64_t> di{batch};
  device_bytes out{batch.size() * rb};
  t.gather(di.span(), reinterpret_cast<typename Tensor::value_type*>(out.ptr),
           cuda::stream_ref{cudaStream_t{}});
  auto const got    = out.to_host();
  std::size_t wrong = 0;
  for (std::size_t j = 0; j < batch.size(); ++j) {
    wrong += std::memcmp(got.data() + j * rb,
                         table.data() + static_cast<std::size_t>(batch[j]) * rb, rb) != 0;
  }
  RANK_REQUIRE_MSG(wrong == 0, what << ": " << wrong << " of " << batch.size() << " rows differ");
}

// ---- per-kind case bodies (gather_kinds.cuh) ---------------------------------------------------

// A tensor of element type T and kind L.Y.M (rows x cols, the given stride) written through its
// own scatter, then gathered, scattered across ranks, stored and loaded into another kind, and
// given bad indices; every step against a host reference, on every rank of @p comm.
template <class T, class L, class Y, class M, class Index>
void exercise(wm::communicator& comm, std::uint64_t seed, std::size_t rows, std::size_t cols,
              std::size_t stride);

// Half values and outputs one element past an aligned address, scattered and gathered.
template <class L, class Y, class M>
void misaligned_values(wm::communicator& comm, std::uint64_t seed, std::size_t rows,
                       std::size_t cols);

// Three async gathers back to back (a stream each, then one stream), synchronized once.
template <class L, class Y, class M>
void back_to_back(wm::communicator& comm, std::uint64_t seed);

// A 0-row tensor given 70,000-index gathers and scatters.
template <class L, class Y, class M>
void zero_rows(wm::communicator& comm);

// scatter_async on a stream of the caller's, then store() at once, into files under @p dir.
template <class L, class Y, class M>
void scatter_then_store(wm::communicator& comm, std::uint64_t seed,
                        std::filesystem::path const& dir);

// A tensor moved onto while its own gathers (and the moved one's) still run.
template <class L, class Y, class M>
void move_during_async(wm::communicator& comm, std::uint64_t seed);

// Views of a tensor's columns (view_columns) that share its memory and outlive it.
template <class L, class Y, class M>
void column_views(wm::communicator& comm, std::uint64_t seed);

}  // namespace gather_tests
