// SPDX-License-Identifier: Apache-2.0
// GPU tests of tensor::ref() and embedding::ref(), and of a mapping that wm does not know (the
// hashed one of hashed_mapping.hpp) through gather, scatter and refs. The cases are [ranked]:
// they run inside every rank (tests/support/ranks.hpp), one case per location x layout x
// mapping. Tables hold values of (row, column, fresh salt); outputs are poisoned first; results
// are compared with a host reference, and rows read through refs with what gather returns.
#include <wm/embedding.cuh>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "device_array.cuh"
#include "hashed_mapping.hpp"
#include "ranks.hpp"

namespace {

// ---- compile-time: what a ref offers ------------------------------------------------------------
template <class R>
concept has_row = requires(R const r) {
  r.row(std::size_t{});
};

using chunked_ref     = wm::tensor_ref<float, wm::chunked, wm::block>;
using continuous_ref  = wm::tensor_ref<float, wm::continuous, wm_test::hashed>;
using distributed_ref = wm::tensor_ref<float, wm::distributed, wm::block>;
using read_only_ref   = wm::tensor_ref<float const, wm::chunked, wm::cyclic>;
static_assert(std::is_trivially_copyable_v<chunked_ref> &&
              std::is_trivially_copyable_v<distributed_ref>);
static_assert(std::is_trivially_copyable_v<continuous_ref> &&
              std::is_trivially_copyable_v<read_only_ref>);
static_assert(has_row<chunked_ref> && has_row<continuous_ref> && has_row<read_only_ref>);
static_assert(!has_row<distributed_ref>);  // another rank's row needs an exchange
static_assert(std::is_same_v<decltype(std::declval<read_only_ref>().local_row(0)), float const*>);
static_assert(std::is_same_v<decltype(std::declval<chunked_ref>().local_row(0)), float*>);
static_assert(
    std::is_convertible_v<chunked_ref, wm::tensor_ref<float const, wm::chunked, wm::block>>);
static_assert(
    !std::is_convertible_v<wm::tensor_ref<float const, wm::chunked, wm::block>, chunked_ref>);
static_assert(std::is_same_v<decltype(std::declval<wm::tensor<float> const&>().ref()),
                             wm::tensor_ref<float const, wm::chunked, wm::block>>);
static_assert(std::is_same_v<decltype(std::declval<wm::embedding<float>&>().ref()),
                             wm::tensor_ref<float const, wm::chunked, wm::block>>);
static_assert(wm::mapping<wm_test::hashed>);

// ---- helpers ------------------------------------------------------------------------------------

// The value of (row, column): an integer below 2^24, exact in float; salt makes it fresh per run.
__host__ __device__ inline float value(std::size_t k, std::size_t j, std::uint32_t salt) {
  return static_cast<float>((k * 2654435761u + j * 40503u + salt) % 16777213u);
}

using wm_test::device_array;

// Outputs are poisoned with this byte first (all ones: NaN in float).
constexpr std::byte poison{0xff};

using wm_test::shared_seed;

// Kernels of the kind a user writes against refs.
template <class Ref>
__global__ void copy_local_rows(Ref t, float* out) {
  std::size_t const cols = t.cols();
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < t.local_rows() * cols;
       i += gridDim.x * blockDim.x) {
    out[i] = t.local_row(i / cols)[i % cols];
  }
}

template <class Ref>
__global__ void locate_all(Ref t, int* ranks, std::size_t* locals) {
  for (std::size_t k = blockIdx.x * blockDim.x + threadIdx.x; k < t.rows();
       k += gridDim.x * blockDim.x) {
    auto const at = t.locate(k);
    ranks[k]      = at.rank;
    locals[k]     = at.local;
  }
}

template <class Ref>
__global__ void read_rows(Ref t, std::int64_t const* ids, std::size_t n, float* out) {
  std::size_t const cols = t.cols();
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n * cols;
       i += gridDim.x * blockDim.x) {
    out[i] = t.row(static_cast<std::size_t>(ids[i / cols]))[i % cols];
  }
}

// Rows k with k % world == rank get -value(k, j): every rank writes other ranks' rows too.
template <class Ref>
__global__ void negate_my_share(Ref t, int world, std::uint32_t salt) {
  std::size_t const cols = t.cols();
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < t.rows() * cols;
       i += gridDim.x * blockDim.x) {
    std::size_t const k = i / cols;
    if (k % static_cast<std::size_t>(world) == static_cast<std::size_t>(t.rank())) {
      t.row(k)[i % cols] = -value(k, i % cols, salt);
    }
  }
}

template <class L, class Y, class M>
struct kind {
  using location_type = L;
  using layout_type   = Y;
  using mapping_type  = M;
};

// Named so that a failing case names its combination.
using device_continuous_block   = kind<wm::device, wm::continuous, wm::block>;
using device_chunked_block      = kind<wm::device, wm::chunked, wm::block>;
using device_distributed_block  = kind<wm::device, wm::distributed, wm::block>;
using device_continuous_cyclic  = kind<wm::device, wm::continuous, wm::cyclic>;
using device_chunked_cyclic     = kind<wm::device, wm::chunked, wm::cyclic>;
using device_distributed_cyclic = kind<wm::device, wm::distributed, wm::cyclic>;
using device_continuous_hashed  = kind<wm::device, wm::continuous, wm_test::hashed>;
using device_chunked_hashed     = kind<wm::device, wm::chunked, wm_test::hashed>;
using device_distributed_hashed = kind<wm::device, wm::distributed, wm_test::hashed>;
using host_chunked_hashed       = kind<wm::host, wm::chunked, wm_test::hashed>;
using host_distributed_block    = kind<wm::host, wm::distributed, wm::block>;

}  // namespace

TEMPLATE_TEST_CASE(
    "ranked: refs, gather and scatter agree with a host reference on every layout and mapping",
    "[ranked]", device_continuous_block, device_chunked_block, device_distributed_block,
    device_continuous_cyclic, device_chunked_cyclic, device_distributed_cyclic,
    device_continuous_hashed, device_chunked_hashed, device_distributed_hashed, host_chunked_hashed,
    host_distributed_block) {
  using L                = typename TestType::location_type;
  using Y                = typename TestType::layout_type;
  using M                = typename TestType::mapping_type;
  auto& comm             = wm_test::comm();
  int const me           = comm.rank();
  int const world        = comm.size();
  std::size_t const rows = GENERATE(std::size_t{0}, std::size_t{1}, std::size_t{1001});
  std::size_t const cols = 5;
  std::size_t const pad  = 7;  // stride: rows do not touch
  auto const seed        = shared_seed(comm);
  auto const salt        = static_cast<std::uint32_t>(seed >> 40);
  INFO(L::name << "." << Y::name << "." << M::name << ", rows " << rows << ", ranks " << world);
  cudaStream_t s{};
  REQUIRE(cudaStreamCreate(&s) == cudaSuccess);
  cuda::stream_ref const stream{s};
  {
    wm::tensor<float, L, Y, M> t{comm, rows, cols, pad};

    // 1. Rank 0 scatters every row, in a shuffled order; the others pass nothing.
    std::vector<std::int64_t> all(rows);
    std::iota(all.begin(), all.end(), std::int64_t{0});
    std::mt19937_64 rng{seed};
    std::shuffle(all.begin(), all.end(), rng);
    std::size_t const n_fill = me == 0 ? rows : 0;
    std::vector<float> fill(n_fill * cols);
    for (std::size_t i = 0; i < n_fill; ++i) {
      for (std::size_t j = 0; j < cols; ++j) {
        fill[i * cols + j] = value(static_cast<std::size_t>(all[i]), j, salt);
      }
    }
    device_array<std::int64_t> const fill_ids{
        std::vector<std::int64_t>(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(n_fill))};
    device_array<float> const fill_values{fill};
    t.scatter(std::span<std::int64_t const>{fill_ids.ptr, n_fill}, fill_values.ptr, stream);
    comm.barrier();  // rank 0's rows are in place before anyone reads

    // 2. Gather a random batch of this rank's own (duplicates included) against the reference.
    std::mt19937_64 mine{seed + static_cast<std::uint64_t>(me) + 1};
    std::size_t const batch = rows == 0 ? 0 : 777;
    std::vector<std::int64_t> ids(batch);
    for (auto& k : ids) { k = static_cast<std::int64_t>(mine() % rows); }
    device_array<std::int64_t> const d_ids{ids};
    device_array<float> gathered{batch * cols, poison};
    t.gather(std::span<std::int64_t const>{d_ids.ptr, batch}, gathered.ptr, stream);
    auto const got    = gathered.to_host();
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < batch; ++i) {
      for (std::size_t j = 0; j < cols; ++j) {
        wrong += got[i * cols + j] == value(static_cast<std::size_t>(ids[i]), j, salt) ? 0 : 1;
      }
    }
    CHECK(wrong == 0);

    // 3. Through the ref, on every layout: the mapping on the device matches the host's, and
    //    this rank's local rows are the rows the mapping puts here.
    auto const r = t.ref();
    CHECK(r.rows() == rows);
    CHECK(r.cols() == cols);
    CHECK(r.stride() == pad);
    CHECK(r.rank() == me);
    CHECK(r.local_rows() == t.local_rows());
    device_array<int> d_ranks{rows, poison};
    device_array<std::size_t> d_locals{rows, poison};
    locate_all<<<64, 256, 0, s>>>(r, d_ranks.ptr, d_locals.ptr);
    WM_CHECK_LAUNCH();
    device_array<float> local{t.local_rows() * cols, poison};
    copy_local_rows<<<64, 256, 0, s>>>(std::as_const(t).ref(), local.ptr);
    WM_CHECK_LAUNCH();
    REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
    auto const ranks          = d_ranks.to_host();
    auto const locals         = d_locals.to_host();
    auto const mine_h         = local.to_host();
    std::size_t mapping_wrong = 0, local_wrong = 0, owned = 0;
    std::vector<bool> seen(t.local_rows(), false);
    for (std::size_t k = 0; k < rows; ++k) {
      auto const at = t.locate(k);
      mapping_wrong += ranks[k] == at.rank && locals[k] == at.local ? 0 : 1;
      if (at.rank != me) { continue; }
      ++owned;
      if (at.local >= t.local_rows() || seen[at.local]) {
        ++local_wrong;
        continue;
      }
      seen[at.local] = true;
      for (std::size_t j = 0; j < cols; ++j) {
        local_wrong += mine_h[at.local * cols + j] == value(k, j, salt) ? 0 : 1;
      }
    }
    CHECK(mapping_wrong == 0);
    CHECK(local_wrong == 0);
    CHECK(owned == t.local_rows());

    // 4. Mapped layouts: any row through the ref is what gather returned; then every rank
    //    writes its share of all rows through the ref, and gather sees the writes.
    if constexpr (wm::mapped_layout<Y>) {
      device_array<float> through_ref{batch * cols, poison};
      read_rows<<<64, 256, 0, s>>>(std::as_const(t).ref(), d_ids.ptr, batch, through_ref.ptr);
      WM_CHECK_LAUNCH();
      REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
      CHECK(through_ref.to_host() == got);
      comm.barrier();  // every rank has read the rows before any rank negates its share

      negate_my_share<<<64, 256, 0, s>>>(t.ref(), world, salt);
      WM_CHECK_LAUNCH();
      REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
      comm.barrier();
      device_array<float> again{batch * cols, poison};
      t.gather(std::span<std::int64_t const>{d_ids.ptr, batch}, again.ptr, stream);
      auto const after  = again.to_host();
      std::size_t stale = 0;
      for (std::size_t i = 0; i < batch; ++i) {
        auto const k = static_cast<std::size_t>(ids[i]);
        for (std::size_t j = 0; j < cols; ++j) {
          stale += after[i * cols + j] == -value(k, j, salt) ? 0 : 1;
        }
      }
      CHECK(stale == 0);
    }
    comm.barrier();  // nobody frees the table while a peer still reads it
  }
  REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
}

TEST_CASE("ranked: embedding::ref() reads the rows gather returns", "[ranked]") {
  auto& comm             = wm_test::comm();
  std::size_t const rows = 3001;
  std::size_t const dim  = 12;
  auto const seed        = shared_seed(comm);
  cudaStream_t s{};
  REQUIRE(cudaStreamCreate(&s) == cudaSuccess);
  {
    wm::embedding<float> e{comm, rows, dim, wm::sgd{},
                           wm::embedding_init::uniform(-1.0f, 1.0f, seed)};
    std::mt19937_64 rng{seed + static_cast<std::uint64_t>(comm.rank())};
    std::vector<std::int64_t> ids(500);
    for (auto& k : ids) { k = static_cast<std::int64_t>(rng() % rows); }
    device_array<std::int64_t> const d_ids{ids};
    device_array<float> gathered{ids.size() * dim, poison};
    device_array<float> through_ref{ids.size() * dim, poison};
    e.gather(std::span<std::int64_t const>{d_ids.ptr, ids.size()}, gathered.ptr,
             cuda::stream_ref{s});
    read_rows<<<64, 256, 0, s>>>(e.ref(), d_ids.ptr, ids.size(), through_ref.ptr);
    WM_CHECK_LAUNCH();
    REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
    auto const a = gathered.to_host();
    auto const b = through_ref.to_host();
    CHECK(a == b);
    // Real rows: initial values in [-1, 1], not poison, not all alike.
    std::size_t wrong = 0;
    for (float x : b) { wrong += x >= -1.0f && x <= 1.0f ? 0 : 1; }
    CHECK(std::adjacent_find(b.begin(), b.end(), std::not_equal_to<>{}) != b.end());
    CHECK(wrong == 0);
    comm.barrier();
  }
  REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
}

// An embedding's initial values depend on the global row only, whatever the mapping: a table
// over the hashed mapping (which wm does not know) holds at row k what embedding_init gives k.
TEMPLATE_TEST_CASE("ranked: an embedding over a user's mapping starts at embedding_init's values",
                   "[ranked]", wm::distributed, wm::chunked) {
  auto& comm             = wm_test::comm();
  std::size_t const rows = 2003;
  std::size_t const dim  = 5;
  auto const init        = wm::embedding_init::uniform(-1.0f, 1.0f, shared_seed(comm));
  cudaStream_t s{};
  REQUIRE(cudaStreamCreate(&s) == cudaSuccess);
  {
    wm::embedding<float, wm::no_cache, wm::sgd, wm::device, TestType, wm_test::hashed> e{
        comm, rows, dim, wm::sgd{}, init};
    std::vector<std::int64_t> ids(rows);
    for (std::size_t k = 0; k < rows; ++k) { ids[k] = static_cast<std::int64_t>(k); }
    device_array<std::int64_t> const d_ids{ids};
    device_array<float> got{rows * dim, poison};
    e.gather(std::span<std::int64_t const>{d_ids.ptr, rows}, got.ptr, cuda::stream_ref{s});
    REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
    auto const rows_got = got.to_host();
    std::size_t wrong   = 0;
    for (std::size_t k = 0; k < rows; ++k) {
      for (std::size_t j = 0; j < dim; ++j) {
        float const want = init.value(k, j, dim);
        wrong += std::abs(rows_got[k * dim + j] - want) <= 1e-6f * (1.0f + std::abs(want)) ? 0 : 1;
      }
    }
    CHECK(wrong == 0);
    comm.barrier();
  }
  REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
}
