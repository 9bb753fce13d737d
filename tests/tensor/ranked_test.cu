// SPDX-License-Identifier: Apache-2.0
// [ranked] tests of wm::tensor, each case run inside every rank: failures every rank sees (a null
// pointer on one rank, ranks that make different calls or call on different tensors), exchange
// ids, 0-row tensors, and lifetime and ordering on every kind (scatter_async then store() at once,
// views of a tensor's columns that outlive it, a move-assignment while gathers run). The per-kind
// bodies are in gather_kinds.cuh.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "catch.hpp"
#include "gather_common.cuh"
#include "rank_check.hpp"
#include "ranks.hpp"

using namespace gather_tests;

// ---- failures every rank sees, lifetime and ordering --------------------------------------------

namespace {

using wm_test::throws_soon;

// Rank @p bad passes a null pointer with a nonzero count (indices, then rows) to a distributed
// gather and scatter; every rank throws the same logic_error at once, and the next calls work.
template <class M>
void null_pointer_everywhere(wm::communicator& comm, int bad, std::uint64_t seed) {
  std::size_t const rows = 10'007, cols = 16, rb = cols * sizeof(float);
  std::mt19937_64 shared{seed};
  auto const table = random_bytes(shared, rows * rb);
  wm::tensor<float, wm::device, wm::distributed, M> t{comm, rows, cols};
  fill_local_rows<M>(comm, t, table, rb);
  std::vector<std::int64_t> batch(1000);
  for (auto& k : batch) { k = static_cast<std::int64_t>(shared() % rows); }
  device_array<std::int64_t> di{batch};
  device_bytes out{batch.size() * rb};
  auto* const out_rows = reinterpret_cast<float*>(out.ptr);
  bool const me_bad    = comm.rank() == bad;
  std::string const what =
      std::string{"null pointer on rank "} + std::to_string(bad) + " (" + M::name + ")";
  cuda::stream_ref const s = cudaStream_t{};
  for (int round = 0; round < 3; ++round) {
    std::string const step = what + (round == 0   ? ", indices in gather"
                                     : round == 1 ? ", output of gather"
                                                  : ", scatter");
    auto const msg         = throws_soon<wm::logic_error>(
        [&] {
          if (round == 0) {
            t.gather(me_bad
                                 ? std::span<std::int64_t const>{static_cast<std::int64_t const*>(nullptr),
                                                         batch.size()}
                                 : di.span(),
                     out_rows, s);
          } else if (round == 1) {
            t.gather(di.span(), me_bad ? nullptr : out_rows, s);
          } else {
            // The scatter writes the rows the table already holds (those gathered just before).
            t.scatter(di.span(), me_bad ? nullptr : out_rows, s);
          }
        },
        step);
    RANK_REQUIRE_MSG(msg.find("rank " + std::to_string(bad)) != std::string::npos &&
                         msg.find("null") != std::string::npos,
                     step << ": " << msg);
    gather_checks(t, table, rb, seed + 10 + static_cast<std::uint64_t>(round),
                  step + ", the gather after it");
  }
  comm.barrier();
}

// Ranks that make different calls on one tensor (gather / scatter), or on tensors whose rows or
// indices differ: every rank throws, and the communicator stays usable.
void different_calls_everywhere(wm::communicator& comm, std::uint64_t seed) {
  std::size_t const rows = 4099, rb = 8 * sizeof(float);
  std::mt19937_64 shared{seed};
  auto const table = random_bytes(shared, rows * rb);
  wm::tensor<float, wm::device, wm::distributed> t{comm, rows, 8};
  wm::tensor<float, wm::device, wm::distributed> wide{comm, rows, 12};
  fill_local_rows<wm::block>(comm, t, table, rb);
  std::vector<std::int64_t> batch(700);
  for (auto& k : batch) { k = static_cast<std::int64_t>(shared() % rows); }
  std::vector<std::int32_t> const batch32(batch.begin(), batch.end());
  device_array<std::int64_t> di{batch};
  device_array<std::int32_t> di32{batch32};
  device_bytes out{batch.size() * 12 * sizeof(float)};
  auto* const rows_out     = reinterpret_cast<float*>(out.ptr);
  cuda::stream_ref const s = cudaStream_t{};
  bool const first         = comm.rank() == 0;
  // Gather here, scatter there (the scatter writes back rows gathered from the table).
  t.gather(di.span(), rows_out, s);
  auto msg = throws_soon<wm::logic_error>(
      [&] {
        if (first) {
          t.gather(di.span(), rows_out, s);
        } else {
          t.scatter(di.span(), rows_out, s);
        }
      },
      "gather on rank 0, scatter on the others");
  RANK_REQUIRE_MSG(
      msg.find("different calls") != std::string::npos && msg.find("scatter") != std::string::npos,
      msg);
  gather_checks(t, table, rb, seed + 1, "gather after gather/scatter");
  // Rows of 8 floats here, 12 there.
  msg = throws_soon<wm::logic_error>([&] { (first ? t : wide).gather(di.span(), rows_out, s); },
                                     "cols differ");
  RANK_REQUIRE_MSG(msg.find("different calls") != std::string::npos, msg);
  gather_checks(t, table, rb, seed + 2, "gather after cols differ");
  // 64-bit indices here, 32-bit there.
  msg = throws_soon<wm::logic_error>(
      [&] {
        if (first) {
          t.gather(di.span(), rows_out, s);
        } else {
          t.gather(di32.span(), rows_out, s);
        }
      },
      "index types differ");
  RANK_REQUIRE_MSG(msg.find("different calls") != std::string::npos, msg);
  gather_checks(t, table, rb, seed + 3, "gather after index types differ");
  comm.barrier();
}

// Every rank of @p comm has the same @p id: every rank throws otherwise.
void same_everywhere(wm::communicator& comm, std::uint64_t id, std::string const& what) {
  auto const all = comm.all_gather(id);
  RANK_REQUIRE_MSG(std::ranges::all_of(all, [&](std::uint64_t x) { return x == all[0]; }),
                   what << ": exchange id " << id << " here, " << all[0] << " on rank 0");
}

// A distributed tensor's exchange id: nonzero, alike on every rank (also when ranks made other
// tensors in between: here rank 0 makes two on a group of its own), distinct from the other
// tensors' (a view of its columns included), kept by a move; mapped tensors have none.
void exchange_ids(wm::communicator& comm) {
  using dist = wm::tensor<float, wm::device, wm::distributed>;
  dist t{comm, 100, 8};
  {
    auto alone = comm.split(comm.rank() == 0 ? 0 : -1, 0);  // rank 0 only
    if (alone.valid()) {
      dist const a{alone, 10, 8};
      dist const b{alone, 10, 8};
      RANK_REQUIRE(a.exchange_id() != b.exchange_id());
    }
  }
  dist u{comm, 100, 8};  // the same row size as t
  auto v = t.view_columns<float>(0, 4);
  wm::tensor<float, wm::device, wm::chunked> const mapped{comm, 100, 8};
  same_everywhere(comm, t.exchange_id(), "the first tensor");
  same_everywhere(comm, u.exchange_id(), "a tensor made after others on rank 0 only");
  same_everywhere(comm, v.exchange_id(), "a view of the first tensor's columns");
  RANK_REQUIRE(t.exchange_id() != 0);
  RANK_REQUIRE(u.exchange_id() != 0);
  RANK_REQUIRE(v.exchange_id() != 0);
  RANK_REQUIRE(t.exchange_id() != u.exchange_id());
  RANK_REQUIRE(v.exchange_id() != t.exchange_id());
  RANK_REQUIRE(v.exchange_id() != u.exchange_id());
  RANK_REQUIRE(mapped.exchange_id() == 0);
  std::uint64_t const id = u.exchange_id();
  dist moved{std::move(u)};
  RANK_REQUIRE(moved.exchange_id() == id);
  RANK_REQUIRE(u.exchange_id() == 0);  // NOLINT(bugprone-use-after-move): moved from
  comm.barrier();
}

// Ranks that gather (then scatter) on different tensors with rows of one size and indices of one
// width: every rank throws a logic_error that names both tensors' exchange ids, nothing is moved
// (neither tensor is written, no rank got the other tensor's rows), and the next calls work.
void different_tensors_everywhere(wm::communicator& comm, std::uint64_t seed) {
  std::size_t const rows = 4099, cols = 8, rb = cols * sizeof(float);
  std::mt19937_64 shared{seed};
  auto const t_rows = random_bytes(shared, rows * rb);
  auto const u_rows = random_bytes(shared, rows * rb);
  wm::tensor<float, wm::device, wm::distributed> t{comm, rows, cols};
  wm::tensor<float, wm::device, wm::distributed> u{comm, rows, cols};
  fill_local_rows<wm::block>(comm, t, t_rows, rb);
  fill_local_rows<wm::block>(comm, u, u_rows, rb);
  std::vector<std::int64_t> batch(700);
  for (auto& k : batch) { k = static_cast<std::int64_t>(shared() % rows); }
  device_array<std::int64_t> di{batch};
  device_bytes out{batch.size() * rb};
  auto* const rows_out     = reinterpret_cast<float*>(out.ptr);
  cuda::stream_ref const s = cudaStream_t{};
  bool const first         = comm.rank() == 0;
  std::string const t_id   = "tensor " + std::to_string(t.exchange_id()) + ")";
  std::string const u_id   = "tensor " + std::to_string(u.exchange_id()) + ")";
  auto const names_both    = [&](std::string const& msg) {
    return msg.find("different calls") != std::string::npos &&
           msg.find(t_id) != std::string::npos && msg.find(u_id) != std::string::npos;
  };
  // Gather from t here, from u there.
  auto msg = throws_soon<wm::logic_error>([&] { (first ? t : u).gather(di.span(), rows_out, s); },
                                          "gather on different tensors");
  RANK_REQUIRE_MSG(names_both(msg), msg);
  gather_checks(t, t_rows, rb, seed + 1, "t after gathers on different tensors");
  gather_checks(u, u_rows, rb, seed + 2, "u after gathers on different tensors");
  // Scatter t's rows into t here, into u there: neither is written.
  t.gather(di.span(), rows_out, s);
  msg = throws_soon<wm::logic_error>([&] { (first ? t : u).scatter(di.span(), rows_out, s); },
                                     "scatter on different tensors");
  RANK_REQUIRE_MSG(names_both(msg), msg);
  gather_checks(t, t_rows, rb, seed + 3, "t after scatters on different tensors");
  gather_checks(u, u_rows, rb, seed + 4, "u after scatters on different tensors");
  comm.barrier();
}

using wm_test::shared_seed;

}  // namespace

// ---- cases run inside every rank (--ranks; tests/support/ranks.hpp) ----------------------------

TEST_CASE(
    "ranked: a null pointer in a distributed call makes every rank throw within 5 s; the next call "
    "works",
    "[ranked]") {
  auto& comm               = wm_test::comm();
  std::uint64_t const seed = shared_seed(comm);
  null_pointer_everywhere<wm::block>(comm, 0, seed);
  null_pointer_everywhere<wm::cyclic>(comm, comm.size() - 1, seed + 100);
}

TEST_CASE(
    "ranked: gather on one rank and scatter on another, or other rows or indices, throw on every "
    "rank",
    "[ranked][multi]") {
  auto& comm = wm_test::comm();
  different_calls_everywhere(comm, shared_seed(comm));
}

TEST_CASE("ranked: a distributed tensor's exchange id is the same on every rank and its own",
          "[ranked]") {
  exchange_ids(wm_test::comm());
}

TEST_CASE(
    "ranked: a gather or scatter on one tensor here and on another there throws on every rank, "
    "naming both",
    "[ranked][multi]") {
  auto& comm = wm_test::comm();
  different_tensors_everywhere(comm, shared_seed(comm));
}

TEMPLATE_TEST_CASE("ranked: 0-row tensors take 70,000-index gathers and scatters", "[ranked]",
                   WM_TENSOR_EVERY_KIND) {
  using L = std::tuple_element_t<0, TestType>;
  using Y = std::tuple_element_t<1, TestType>;
  using M = std::tuple_element_t<2, TestType>;
  zero_rows<L, Y, M>(wm_test::comm());
}

TEMPLATE_TEST_CASE("ranked: scatter_async on a stream, then store() at once, stores the new rows",
                   "[ranked]", WM_TENSOR_EVERY_KIND) {
  using L                  = std::tuple_element_t<0, TestType>;
  using Y                  = std::tuple_element_t<1, TestType>;
  using M                  = std::tuple_element_t<2, TestType>;
  auto& comm               = wm_test::comm();
  std::uint64_t const seed = shared_seed(comm);
  auto const dir =
      std::filesystem::temp_directory_path() / ("wm_scatter_store_" + std::to_string(seed));
  std::filesystem::create_directories(dir);
  scatter_then_store<L, Y, M>(comm, seed, dir);
  comm.barrier();
  if (comm.rank() == 0) { std::filesystem::remove_all(dir); }
}

TEMPLATE_TEST_CASE("ranked: views of a tensor's columns share its memory", "[ranked]",
                   WM_TENSOR_EVERY_KIND) {
  using L    = std::tuple_element_t<0, TestType>;
  using Y    = std::tuple_element_t<1, TestType>;
  using M    = std::tuple_element_t<2, TestType>;
  auto& comm = wm_test::comm();
  column_views<L, Y, M>(comm, shared_seed(comm));
}

TEMPLATE_TEST_CASE("ranked: move-assignment while gathers run", "[ranked]", WM_TENSOR_EVERY_KIND) {
  using L    = std::tuple_element_t<0, TestType>;
  using Y    = std::tuple_element_t<1, TestType>;
  using M    = std::tuple_element_t<2, TestType>;
  auto& comm = wm_test::comm();
  move_during_async<L, Y, M>(comm, shared_seed(comm));
}
