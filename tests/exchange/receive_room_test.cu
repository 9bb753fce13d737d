// SPDX-License-Identifier: Apache-2.0
// [ranked] tests of the exchange's receive-sized workspaces (docs/design.md, "Exchange words"):
// one rank cannot get the workspace it sizes from the count words (an out-of-memory injected
// with wm::detail::test_room_failure_at: the workspace asks for more memory than any GPU has). On
// one rank the call throws that out-of-memory; on several every rank throws at once, naming the
// rank; nothing moved, and the next call works.
#include <wm/embedding.cuh>
#include <wm/tensor.cuh>

#include <chrono>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "catch.hpp"
#include "device_array.cuh"
#include "rank_check.hpp"
#include "ranks.hpp"

namespace {

using clock_type = std::chrono::steady_clock;
using wm_test::device_array;

/// The legacy default stream (the device arrays' copies are ordered with it).
cuda::stream_ref const on_default{cudaStream_t{}};

enum class outcome { none, cuda_error, comm_error, other };

struct failure {
  outcome kind{outcome::none};
  std::string message;
  double seconds{};
};

/// Runs @p call with the @p which-th receive-sized reservation from now failing on rank @p bad.
template <class F>
failure with_room_failure(wm::communicator& comm, int bad, int which, F&& call) {
  if (comm.rank() == bad) { wm::detail::test_room_failure_at = which; }
  failure f;
  auto const start = clock_type::now();
  try {
    call();
  } catch (wm::cuda_error const& e) {
    f = {outcome::cuda_error, e.what()};
  } catch (wm::comm_error const& e) {
    f = {outcome::comm_error, e.what()};
  } catch (std::exception const& e) { f = {outcome::other, e.what()}; }
  f.seconds = std::chrono::duration<double>(clock_type::now() - start).count();
  wm::detail::test_room_failure_at = 0;
  return f;
}

/// One rank: the out-of-memory itself. Several: a comm_error on every rank naming rank @p bad.
/// Either way within seconds (the communicator's timeout is minutes).
void check_failure(wm::communicator& comm, int bad, failure const& f, std::string const& what) {
  RANK_REQUIRE_MSG(f.kind != outcome::none, what << ": no error");
  RANK_REQUIRE_MSG(f.seconds < 10.0, what << ": the error took " << f.seconds << " s");
  if (comm.size() == 1) {
    RANK_REQUIRE_MSG(f.kind == outcome::cuda_error, what << ": " << f.message);
    RANK_REQUIRE_MSG(f.message.find("cudaErrorMemoryAllocation") != std::string::npos,
                     what << ": " << f.message);
  } else {
    RANK_REQUIRE_MSG(f.kind == outcome::comm_error, what << ": " << f.message);
    RANK_REQUIRE_MSG(f.message.find("rank " + std::to_string(bad) + " (") != std::string::npos,
                     what << ": " << f.message);
    RANK_REQUIRE_MSG(f.message.find("out of device memory") != std::string::npos,
                     what << ": " << f.message);
  }
}

constexpr std::size_t rows = 1009, cols = 4;

float value(std::size_t row, std::size_t col, float salt) {
  return salt + static_cast<float>(row) + 0.25f * static_cast<float>(col);
}

/// Every row of @p t set to value(row, col, salt) (rank 0 scatters them all).
template <class Tensor>
void fill(wm::communicator& comm, Tensor& t, float salt) {
  std::vector<std::int64_t> idx;
  std::vector<float> v;
  if (comm.rank() == 0) {
    for (std::size_t k = 0; k < rows; ++k) {
      idx.push_back(static_cast<std::int64_t>(k));
      for (std::size_t c = 0; c < cols; ++c) { v.push_back(value(k, c, salt)); }
    }
  }
  device_array<std::int64_t> di{idx};
  device_array<float> dv{v};
  t.scatter(std::span<std::int64_t const>{di.ptr, idx.size()}, dv.ptr, on_default);
}

/// Every row of @p t equals value(row, col, salt).
template <class Tensor>
void expect_rows(Tensor& t, float salt, std::string const& what) {
  auto const h = wm_test::gather_every_row<float>(t, rows, cols, -1.0f, nullptr);
  for (std::size_t k = 0; k < rows; ++k) {
    for (std::size_t c = 0; c < cols; ++c) {
      RANK_REQUIRE_MSG(h[k * cols + c] == value(k, c, salt),
                       what << ": row " << k << " col " << c << " is " << h[k * cols + c]);
    }
  }
}

/// A batch of @p n keys, other keys on every rank (duplicates included).
std::vector<std::int64_t> batch(int rank, std::uint64_t seed, std::size_t n = 3000) {
  std::mt19937_64 rng{seed + static_cast<std::uint64_t>(rank)};
  std::vector<std::int64_t> idx(n);
  for (auto& k : idx) { k = static_cast<std::int64_t>(rng() % rows); }
  return idx;
}

}  // namespace

TEST_CASE(
    "ranked: an out-of-memory in a distributed gather's receive workspace is an error on every "
    "rank at once, and the tensor gathers afterwards",
    "[ranked]") {
  auto& comm    = wm_test::comm();
  int const bad = comm.size() - 1;
  wm::tensor<float, wm::device, wm::distributed> t{comm, rows, cols};
  fill(comm, t, 3.0f);
  auto const idx = batch(comm.rank(), 11);
  device_array<std::int64_t> di{idx};
  device_array<float> out{std::vector<float>(idx.size() * cols, -1.0f)};
  std::span<std::int64_t const> const keys{di.ptr, idx.size()};
  auto const f = with_room_failure(comm, bad, 1, [&] { t.gather(keys, out.ptr, on_default); });
  check_failure(comm, bad, f, "gather");
  t.gather(keys, out.ptr, on_default);  // the same call again: every row
  auto const h = out.to_host();
  for (std::size_t i = 0; i < idx.size(); ++i) {
    for (std::size_t c = 0; c < cols; ++c) {
      RANK_REQUIRE(h[i * cols + c] == value(static_cast<std::size_t>(idx[i]), c, 3.0f));
    }
  }
}

TEST_CASE(
    "ranked: an out-of-memory in the distinct reads of a host table's distributed gather is an "
    "error on every rank at once, and the tensor gathers afterwards",
    "[ranked]") {
  auto& comm    = wm_test::comm();
  int const bad = comm.size() - 1;
  wm::tensor<float, wm::host, wm::distributed> t{comm, rows, cols};
  fill(comm, t, 4.0f);
  // Long enough that every owner reads its share of distinct rows through a sort (at least
  // host_distinct_threshold keys from each peer and of its own).
  auto const idx =
      batch(comm.rank(), 17,
            2 * wm::detail::host_distinct_threshold * static_cast<std::size_t>(comm.size()));
  device_array<std::int64_t> di{idx};
  device_array<float> out{std::vector<float>(idx.size() * cols, -1.0f)};
  std::span<std::int64_t const> const keys{di.ptr, idx.size()};
  // The second workspace the counts size: the owner's distinct reads (the first is the gather's).
  auto const f = with_room_failure(comm, bad, 2, [&] { t.gather(keys, out.ptr, on_default); });
  check_failure(comm, bad, f, "host gather");
  t.gather(keys, out.ptr, on_default);
  auto const h = out.to_host();
  for (std::size_t i = 0; i < idx.size(); ++i) {
    for (std::size_t c = 0; c < cols; ++c) {
      RANK_REQUIRE(h[i * cols + c] == value(static_cast<std::size_t>(idx[i]), c, 4.0f));
    }
  }
}

TEST_CASE(
    "ranked: an out-of-memory in a distributed scatter's receive workspace is an error on every "
    "rank at once, writes nothing, and the tensor scatters afterwards",
    "[ranked]") {
  auto& comm    = wm_test::comm();
  int const bad = comm.size() - 1;
  wm::tensor<float, wm::device, wm::distributed> t{comm, rows, cols};
  fill(comm, t, 5.0f);
  // Every rank writes every row with the new values (the same value from every rank).
  std::vector<std::int64_t> idx(rows);
  std::vector<float> v;
  for (std::size_t k = 0; k < rows; ++k) {
    idx[k] = static_cast<std::int64_t>(rows - 1 - k);
    for (std::size_t c = 0; c < cols; ++c) { v.push_back(value(rows - 1 - k, c, 9.0f)); }
  }
  device_array<std::int64_t> di{idx};
  device_array<float> dv{v};
  std::span<std::int64_t const> const keys{di.ptr, idx.size()};
  auto const f = with_room_failure(comm, bad, 1, [&] { t.scatter(keys, dv.ptr, on_default); });
  check_failure(comm, bad, f, "scatter");
  expect_rows(t, 5.0f, "after the failed scatter");
  t.scatter(keys, dv.ptr, on_default);
  expect_rows(t, 9.0f, "after the next scatter");
}

TEST_CASE(
    "ranked: an out-of-memory in apply_gradients' receive workspaces is an error on every rank "
    "at once, updates nothing, and the next update is that of a table that never failed",
    "[ranked]") {
  auto& comm             = wm_test::comm();
  int const bad          = comm.size() - 1;
  std::size_t const dim  = 8;
  std::uint64_t const sd = 23;
  using table            = wm::embedding<float, wm::no_cache, wm::sgd, wm::device, wm::distributed>;
  auto const init        = wm::embedding_init::uniform(-1.0f, 1.0f, sd);
  table e{comm, rows, dim, wm::sgd{}, init};
  table twin{comm, rows, dim, wm::sgd{}, init};  // never fails: the reference
  auto const idx = batch(comm.rank(), 31);
  std::mt19937_64 rng{sd + 7 * static_cast<std::uint64_t>(comm.rank())};
  std::uniform_real_distribution<float> u{-1.0f, 1.0f};
  std::vector<float> g(idx.size() * dim);
  for (auto& x : g) { x = u(rng); }
  device_array<std::int64_t> di{idx};
  device_array<float> dg{g};
  std::span<std::int64_t const> const keys{di.ptr, idx.size()};
  auto const before = wm_test::gather_every_row<float>(e, rows, dim, -9.0f, nullptr);
  // Several ranks reserve two workspaces from the counts (the batch, the owner's update): either
  // may fail. One rank reserves the update's only.
  int const rooms = comm.size() == 1 ? 1 : 2;
  for (int which = 1; which <= rooms; ++which) {
    std::string const what = "apply_gradients, workspace " + std::to_string(which);
    auto const f           = with_room_failure(comm, bad, which,
                                               [&] { e.apply_gradients(keys, dg.ptr, 0.5f, on_default); });
    check_failure(comm, bad, f, what);
    auto const after = wm_test::gather_every_row<float>(e, rows, dim, -9.0f, nullptr);
    for (std::size_t i = 0; i < before.size(); ++i) {
      RANK_REQUIRE_MSG(after[i] == before[i], what << ": element " << i << " changed");
    }
  }
  e.apply_gradients(keys, dg.ptr, 0.5f, on_default);
  twin.apply_gradients(keys, dg.ptr, 0.5f, on_default);
  auto const got  = wm_test::gather_every_row<float>(e, rows, dim, -9.0f, nullptr);
  auto const want = wm_test::gather_every_row<float>(twin, rows, dim, -7.0f, nullptr);
  for (std::size_t i = 0; i < got.size(); ++i) {
    RANK_REQUIRE_MSG(got[i] == want[i], "element " << i << ": " << got[i] << ", not " << want[i]);
  }
}
