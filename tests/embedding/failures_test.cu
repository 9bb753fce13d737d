// SPDX-License-Identifier: Apache-2.0
// [ranked] tests of wm::embedding: failures every rank sees (null gradients or indices on one
// rank, apply_gradients on one rank and gather on another); each case runs inside every rank.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "catch.hpp"
#include "embedding_common.cuh"
#include "rank_check.hpp"
#include "ranks.hpp"

using namespace embedding_tests;

// ---- failures every rank sees
// --------------------------------------------------------------------

namespace {

using wm_test::throws_soon;

// Rank @p bad passes null gradients (then null indices) with a nonzero count; every rank's
// apply_gradients throws at once with nothing updated, and the next step is exact (SGD against a
// float64 reference of every rank's batch).
template <class Y, class M>
void null_gradients_everywhere(wm::communicator& comm, int bad, std::uint64_t seed) {
  std::size_t const rows = 5003, dim = 8;
  std::string const what = std::string{"null pointer on rank "} + std::to_string(bad) + " (" +
                           Y::name + "." + M::name + ")";
  wm::embedding<float, wm::no_cache, wm::sgd, wm::device, Y, M> e{
      comm, rows, dim, wm::sgd{}, wm::embedding_init::uniform(-1.0f, 1.0f, seed)};
  cudaStream_t const s = nullptr;
  auto const before    = read_all<float>(e, rows, dim, s);
  std::mt19937_64 shared{seed};  // every rank's batch, on every rank
  std::uniform_real_distribution<float> u{-1.0f, 1.0f};
  std::vector<std::vector<std::int64_t>> idx(static_cast<std::size_t>(comm.size()));
  std::vector<std::vector<float>> grads(idx.size());
  for (std::size_t r = 0; r < idx.size(); ++r) {
    idx[r].resize(700 + 13 * r);
    for (auto& k : idx[r]) { k = static_cast<std::int64_t>(shared() % rows); }
    grads[r].resize(idx[r].size() * dim);
    for (auto& x : grads[r]) { x = u(shared); }
  }
  auto const me = static_cast<std::size_t>(comm.rank());
  device_array<std::int64_t> di{idx[me]};
  device_array<float> dg{grads[me]};
  std::span<std::int64_t const> const keys{di.ptr, idx[me].size()};
  bool const me_bad = comm.rank() == bad;
  for (int round = 0; round < 2; ++round) {
    std::string const step = what + (round == 0 ? ", gradients" : ", indices");
    auto const msg         = throws_soon<wm::logic_error>(
        [&] {
          if (round == 0) {
            e.apply_gradients(keys, me_bad ? nullptr : dg.ptr, 0.5f, cuda::stream_ref{s});
          } else {
            e.apply_gradients(
                        me_bad ? std::span<std::int64_t const>{static_cast<std::int64_t const*>(nullptr),
                                                       keys.size()}
                               : keys,
                dg.ptr, 0.5f, cuda::stream_ref{s});
          }
        },
        step);
    // (One rank checks its arguments itself; several name the rank that failed.)
    RANK_REQUIRE_MSG(
        (comm.size() == 1 || msg.find("rank " + std::to_string(bad)) != std::string::npos) &&
            msg.find("null") != std::string::npos,
        step << ": " << msg);
    RANK_REQUIRE_MSG(e.global_step() == 0, step << ": the step was counted");
    RANK_REQUIRE_MSG(read_all<float>(e, rows, dim, s) == before, step << ": rows changed");
  }
  e.apply_gradients(keys, dg.ptr, 0.5f, cuda::stream_ref{s});
  RANK_REQUIRE(e.global_step() == 1);
  std::vector<double> want = before;
  for (std::size_t r = 0; r < idx.size(); ++r) {
    for (std::size_t j = 0; j < idx[r].size(); ++j) {
      for (std::size_t c = 0; c < dim; ++c) {
        want[static_cast<std::size_t>(idx[r][j]) * dim + c] -=
            0.5 * static_cast<double>(grads[r][j * dim + c]);
      }
    }
  }
  auto const got    = read_all<float>(e, rows, dim, s);
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    wrong += std::abs(got[i] - want[i]) > 1e-4 * (1.0 + std::abs(want[i]));
  }
  RANK_REQUIRE_MSG(wrong == 0, what << ": " << wrong
                                    << " values differ from the reference after the failed calls");
  comm.barrier();
}

// apply_gradients on one rank while another gathers from the table: every rank throws.
void apply_here_gather_there(wm::communicator& comm, std::uint64_t seed) {
  std::size_t const rows = 3001, dim = 16;
  wm::embedding<float, wm::no_cache, wm::adam, wm::device, wm::distributed> e{
      comm, rows, dim, wm::adam{}, wm::embedding_init::uniform(-1.0f, 1.0f, seed)};
  cudaStream_t const s = nullptr;
  std::vector<std::int64_t> idx(500);
  std::mt19937_64 rng{seed + static_cast<std::uint64_t>(comm.rank())};
  for (auto& k : idx) { k = static_cast<std::int64_t>(rng() % rows); }
  device_array<std::int64_t> di{idx};
  device_array<float> buf{std::vector<float>(idx.size() * dim, 0.25f)};
  std::span<std::int64_t const> const keys{di.ptr, idx.size()};
  auto const before = read_all<float>(e, rows, dim, s);
  auto const msg    = throws_soon<wm::logic_error>(
      [&] {
        if (comm.rank() == 0) {
          e.apply_gradients(keys, buf.ptr, 0.1f, cuda::stream_ref{s});
        } else {
          e.gather(keys, buf.ptr, cuda::stream_ref{s});
        }
      },
      "apply_gradients on rank 0, gather on the others");
  RANK_REQUIRE_MSG(msg.find("different calls") != std::string::npos &&
                       msg.find("apply_gradients") != std::string::npos,
                   msg);
  RANK_REQUIRE(e.global_step() == 0);
  RANK_REQUIRE(read_all<float>(e, rows, dim, s) == before);
  comm.barrier();
}

}  // namespace

// ---- cases run inside every rank (--ranks; tests/support/ranks.hpp) ----------------------------

namespace {

using wm_test::shared_seed;

}  // namespace

TEMPLATE_TEST_CASE(
    "ranked: null gradients or indices make every rank throw within 5 s; the next step is exact",
    "[ranked]", (std::tuple<wm::distributed, wm::block>), (std::tuple<wm::distributed, wm::cyclic>),
    (std::tuple<wm::chunked, wm::block>)) {
  using Y    = std::tuple_element_t<0, TestType>;
  using M    = std::tuple_element_t<1, TestType>;
  auto& comm = wm_test::comm();
  null_gradients_everywhere<Y, M>(comm, comm.size() - 1, shared_seed(comm));
}

TEST_CASE("ranked: apply_gradients on one rank and gather on another throw on every rank",
          "[ranked][multi]") {
  auto& comm = wm_test::comm();
  apply_here_gather_there(comm, shared_seed(comm));
}
