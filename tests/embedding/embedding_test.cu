// SPDX-License-Identifier: Apache-2.0
// GPU tests of wm::embedding: every element type x layout a [ranked] case run inside every rank
// (one rank, and one rank per GPU), every optimizer a section of it. Several training steps with
// fresh random indices (many duplicates, an empty batch) and gradients; weights and optimizer
// states are compared with a float64 host reference of the same algorithm run on the concatenation
// of all ranks' batches (= what one rank computes on the concatenated batch). A checkpoint round
// trip into another layout continues training bit for bit. Bad indices are rejected on every rank
// with nothing updated. This file holds the suite's cases; its training runs are compiled in the
// train_<optimizer>_test.cu files (embedding_common.cuh says why); the other cases of
// embedding_test are in store_load_test.cu and failures_test.cu.
#include <wm/launch.hpp>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <tuple>

#include "catch.hpp"
#include "embedding_common.cuh"
#include "rank_check.hpp"
#include "ranks.hpp"

using namespace embedding_tests;

namespace {

using wm_test::shared_seed;

template <class E>
concept trainable = requires(E& e, std::span<std::int64_t const> i, float const* g) {
  e.apply_gradients(i, g, 0.1f, cuda::stream_ref{cudaStream_t{}});
};
static_assert(trainable<wm::embedding<float, wm::no_cache, wm::adam>>);
static_assert(!trainable<wm::embedding<float, wm::no_cache, wm::no_optimizer>>);

}  // namespace

// ---- cases run inside every rank (--ranks; tests/support/ranks.hpp) ----------------------------

// The layouts are those WM_TRAIN_EVERY_LAYOUT instantiates (embedding_train.cuh): a layout added
// here without it there fails at link (undefined train_and_check).
#define WM_EMBEDDING_EVERY_LAYOUT(T)                           \
  (std::tuple<T, wm::device, wm::continuous, wm::block>),      \
      (std::tuple<T, wm::device, wm::chunked, wm::block>),     \
      (std::tuple<T, wm::device, wm::distributed, wm::block>), \
      (std::tuple<T, wm::host, wm::chunked, wm::block>),       \
      (std::tuple<T, wm::host, wm::distributed, wm::cyclic>)

TEMPLATE_TEST_CASE(
    "ranked: training on an element type and layout against float64 with every optimizer",
    "[ranked]", WM_EMBEDDING_EVERY_LAYOUT(float), WM_EMBEDDING_EVERY_LAYOUT(__half),
    WM_EMBEDDING_EVERY_LAYOUT(__nv_bfloat16)) {
  using T                  = std::tuple_element_t<0, TestType>;
  using L                  = std::tuple_element_t<1, TestType>;
  using Y                  = std::tuple_element_t<2, TestType>;
  using M                  = std::tuple_element_t<3, TestType>;
  auto& comm               = wm_test::comm();
  std::uint64_t const seed = shared_seed(comm);
  SECTION("sgd(wd)") {
    train_and_check<T, wm::sgd, L, Y, M>(comm, wm::sgd{0.01f}, seed + 1, "sgd(wd)");
  }
  SECTION("sgd") {
    train_and_check<T, wm::sgd, L, Y, M>(comm, wm::sgd{}, seed + 2, "sgd");
  }
  SECTION("adam(lazy)") {
    wm::adam lazy;
    train_and_check<T, wm::adam, L, Y, M>(comm, lazy, seed + 3, "adam(lazy)");
  }
  SECTION("adam(global, wd)") {
    wm::adam global;
    global.bias_correction = wm::adam_bias_correction::global_step;
    global.weight_decay    = 0.01f;
    train_and_check<T, wm::adam, L, Y, M>(comm, global, seed + 4, "adam(global, wd)");
  }
  SECTION("adamw") {
    wm::adam adamw;
    adamw.decoupled    = true;
    adamw.weight_decay = 0.05f;
    train_and_check<T, wm::adam, L, Y, M>(comm, adamw, seed + 5, "adamw");
  }
  SECTION("rmsprop") {
    train_and_check<T, wm::rmsprop, L, Y, M>(comm, wm::rmsprop{}, seed + 6, "rmsprop");
  }
  SECTION("adagrad") {
    wm::adagrad ag;
    ag.initial_accumulator = 0.1f;
    ag.weight_decay        = 0.01f;
    train_and_check<T, wm::adagrad, L, Y, M>(comm, ag, seed + 7, "adagrad");
  }
}

// One very hot row (long runs summed in segments), vector-wide rows, all three types; gradients
// not aligned to 16 bytes (rows that are): packed for the owners with narrower accesses, summed
// and applied as aligned ones would be.
TEST_CASE("ranked: training on awkward batches and gradients against float64", "[ranked]") {
  auto& comm               = wm_test::comm();
  std::uint64_t const seed = shared_seed(comm);
  SECTION("skewed: float, adam(lazy), device.continuous.block") {
    train_and_check<float, wm::adam, wm::device, wm::continuous, wm::block>(
        comm, wm::adam{}, seed + 1, "adam(lazy) skewed", skewed);
  }
  SECTION("skewed: float, sgd(wd), device.distributed.cyclic") {
    train_and_check<float, wm::sgd, wm::device, wm::distributed, wm::cyclic>(
        comm, wm::sgd{0.01f}, seed + 2, "sgd(wd) skewed", skewed);
  }
  SECTION("skewed: half, adagrad, host.chunked.block") {
    train_and_check<__half, wm::adagrad, wm::host, wm::chunked, wm::block>(
        comm, wm::adagrad{}, seed + 3, "adagrad skewed", skewed);
  }
  SECTION("skewed: bfloat16, rmsprop, device.distributed.block") {
    train_and_check<__nv_bfloat16, wm::rmsprop, wm::device, wm::distributed, wm::block>(
        comm, wm::rmsprop{}, seed + 4, "rmsprop skewed", skewed);
  }
  SECTION("misaligned gradients: half, sgd(wd), device.distributed.block") {
    train_and_check<__half, wm::sgd, wm::device, wm::distributed, wm::block>(
        comm, wm::sgd{0.01f}, seed + 5, "sgd(wd) misaligned grads", misaligned);
  }
  SECTION("misaligned gradients: float, adam(lazy), device.chunked.cyclic") {
    train_and_check<float, wm::adam, wm::device, wm::chunked, wm::cyclic>(
        comm, wm::adam{}, seed + 6, "adam(lazy) misaligned grads", misaligned_float);
  }
}

// More than 2^32 - 1 rows on one rank is refused on every rank before anything is allocated
// (this table would need 16 TiB per rank: an allocation first fails with another error).
TEST_CASE("ranked: a table of more than 2^32 - 1 rows per rank is refused on every rank",
          "[ranked]") {
  auto& comm   = wm_test::comm();
  bool refused = false;
  try {
    wm::embedding<float> huge{
        comm, (std::size_t{1} << 32) * static_cast<std::size_t>(comm.size()) + 1, 1024};
  } catch (wm::logic_error const&) { refused = true; }
  RANK_REQUIRE_MSG(
      refused, "a table of more than 2^32 - 1 rows per rank was not refused with a logic_error");
}

TEST_CASE("ranked: an inference-only table gathers like any other", "[ranked]") {
  auto& comm = wm_test::comm();
  wm::embedding<float, wm::no_cache, wm::no_optimizer> frozen{
      comm, 50, 8, {}, wm::embedding_init::normal(0.0f, 1.0f, shared_seed(comm))};
  cudaStream_t s{};
  WM_CUDA_TRY(cudaStreamCreate(&s));
  auto const w = read_all<float>(frozen.weights(), 50, 8, s);
  double mean  = 0;
  for (double x : w) { mean += x / static_cast<double>(w.size()); }
  RANK_REQUIRE_MSG(std::abs(mean) < 0.3, "normal init mean " << mean);
  WM_CUDA_TRY(cudaStreamDestroy(s));
}
