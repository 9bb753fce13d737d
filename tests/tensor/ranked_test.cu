// SPDX-License-Identifier: Apache-2.0
// [ranked] tests of wm::tensor, each case run inside every rank: failures every rank sees (a null
// pointer on one rank, ranks that make different calls), 0-row tensors, and lifetime and ordering
// on every kind (scatter_async then store() at once, views of a tensor's columns that outlive it,
// a move-assignment while gathers run). The per-kind bodies are in gather_kinds.cuh.
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

using clock_type = std::chrono::steady_clock;

// Runs @p call, which must throw E on this rank within 5 s; returns the message.
template <class E, class F>
std::string throws_soon(F&& call, std::string const& what) {
  auto const start = clock_type::now();
  std::string msg;
  bool threw = false;
  try {
    call();
  } catch (E const& e) {
    threw = true;
    msg   = e.what();
  }
  auto const took = std::chrono::duration<double>(clock_type::now() - start).count();
  RANK_REQUIRE_MSG(threw, what << ": no error");
  RANK_REQUIRE_MSG(took < 5.0, what << ": the error took " << took << " s");
  return msg;
}

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
  device_indices<std::int64_t> di{batch};
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
  device_indices<std::int64_t> di{batch};
  device_indices<std::int32_t> di32{batch32};
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

// A seed drawn on rank 0, the same on every rank.
std::uint64_t shared_seed(wm::communicator& comm) {
  return comm.all_gather(static_cast<std::uint64_t>(std::random_device{}()))[0];
}

}  // namespace

// ---- cases run inside every rank (--ranks; tests/support/ranks.hpp) ----------------------------

#define WM_EVERY_KIND                                        \
  (std::tuple<wm::device, wm::continuous, wm::block>),       \
      (std::tuple<wm::device, wm::chunked, wm::block>),      \
      (std::tuple<wm::device, wm::distributed, wm::block>),  \
      (std::tuple<wm::host, wm::continuous, wm::block>),     \
      (std::tuple<wm::host, wm::chunked, wm::block>),        \
      (std::tuple<wm::host, wm::distributed, wm::block>),    \
      (std::tuple<wm::device, wm::continuous, wm::cyclic>),  \
      (std::tuple<wm::device, wm::chunked, wm::cyclic>),     \
      (std::tuple<wm::device, wm::distributed, wm::cyclic>), \
      (std::tuple<wm::host, wm::continuous, wm::cyclic>),    \
      (std::tuple<wm::host, wm::chunked, wm::cyclic>),       \
      (std::tuple<wm::host, wm::distributed, wm::cyclic>)

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

TEMPLATE_TEST_CASE("ranked: 0-row tensors take 70,000-index gathers and scatters", "[ranked]",
                   WM_EVERY_KIND) {
  using L = std::tuple_element_t<0, TestType>;
  using Y = std::tuple_element_t<1, TestType>;
  using M = std::tuple_element_t<2, TestType>;
  zero_rows<L, Y, M>(wm_test::comm());
}

TEMPLATE_TEST_CASE("ranked: scatter_async on a stream, then store() at once, stores the new rows",
                   "[ranked]", WM_EVERY_KIND) {
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
                   WM_EVERY_KIND) {
  using L    = std::tuple_element_t<0, TestType>;
  using Y    = std::tuple_element_t<1, TestType>;
  using M    = std::tuple_element_t<2, TestType>;
  auto& comm = wm_test::comm();
  column_views<L, Y, M>(comm, shared_seed(comm));
}

TEMPLATE_TEST_CASE("ranked: move-assignment while gathers run", "[ranked]", WM_EVERY_KIND) {
  using L    = std::tuple_element_t<0, TestType>;
  using Y    = std::tuple_element_t<1, TestType>;
  using M    = std::tuple_element_t<2, TestType>;
  auto& comm = wm_test::comm();
  move_during_async<L, Y, M>(comm, shared_seed(comm));
}
