// SPDX-License-Identifier: Apache-2.0
// GPU tests of wm::embedding: every optimizer x element type x layout, 1 rank ([gpu]) and one
// rank per GPU ([multi_gpu]). Several training steps with fresh random indices (many duplicates,
// an empty batch) and gradients; weights and optimizer states are compared with a float64 host
// reference of the same algorithm run on the concatenation of all ranks' batches (= what one
// rank computes on the concatenated batch). A checkpoint round trip into another layout
// continues training bit for bit. Bad indices are rejected on every rank with nothing updated.
// This file holds the suite's cases; its training runs are compiled in the
// train_<optimizer>_test.cu files (embedding_common.cuh says why); the other cases of
// embedding_test are in store_load_test.cu and failures_test.cu.
#include <wm/launch.hpp>

#include <cmath>
#include <cstdint>
#include <random>

#include "catch.hpp"
#include "embedding_common.cuh"
#include "rank_check.hpp"

using namespace embedding_tests;

namespace {

template <class T, class L, class Y, class M>
void every_optimizer(wm::communicator& comm, std::uint64_t& seed) {
  train_and_check<T, wm::sgd, L, Y, M>(comm, wm::sgd{0.01f}, ++seed, "sgd(wd)");
  train_and_check<T, wm::sgd, L, Y, M>(comm, wm::sgd{}, ++seed, "sgd");
  wm::adam lazy;
  train_and_check<T, wm::adam, L, Y, M>(comm, lazy, ++seed, "adam(lazy)");
  wm::adam global;
  global.bias_correction = wm::adam_bias_correction::global_step;
  global.weight_decay    = 0.01f;
  train_and_check<T, wm::adam, L, Y, M>(comm, global, ++seed, "adam(global, wd)");
  wm::adam adamw;
  adamw.decoupled    = true;
  adamw.weight_decay = 0.05f;
  train_and_check<T, wm::adam, L, Y, M>(comm, adamw, ++seed, "adamw");
  train_and_check<T, wm::rmsprop, L, Y, M>(comm, wm::rmsprop{}, ++seed, "rmsprop");
  wm::adagrad ag;
  ag.initial_accumulator = 0.1f;
  ag.weight_decay        = 0.01f;
  train_and_check<T, wm::adagrad, L, Y, M>(comm, ag, ++seed, "adagrad");
}

// The layouts are those WM_TRAIN_EVERY_LAYOUT instantiates (embedding_train.cuh): a layout added
// here without it there fails at link (undefined train_and_check).
template <class T>
void every_layout(wm::communicator& comm, std::uint64_t& seed) {
  every_optimizer<T, wm::device, wm::continuous, wm::block>(comm, seed);
  every_optimizer<T, wm::device, wm::chunked, wm::block>(comm, seed);
  every_optimizer<T, wm::device, wm::distributed, wm::block>(comm, seed);
  every_optimizer<T, wm::host, wm::chunked, wm::block>(comm, seed);
  every_optimizer<T, wm::host, wm::distributed, wm::cyclic>(comm, seed);
}

void run_suite(int ranks) {
  std::uint64_t const seed0 = std::random_device{}();
  wm::launch(ranks, [&](wm::communicator& comm) {
    std::uint64_t seed = seed0;
    every_layout<float>(comm, seed);
    every_layout<__half>(comm, seed);
    every_layout<__nv_bfloat16>(comm, seed);
    // One very hot row (long runs summed in segments), vector-wide rows, all three types.
    train_and_check<float, wm::adam, wm::device, wm::continuous, wm::block>(
        comm, wm::adam{}, ++seed, "adam(lazy) skewed", skewed);
    train_and_check<float, wm::sgd, wm::device, wm::distributed, wm::cyclic>(
        comm, wm::sgd{0.01f}, ++seed, "sgd(wd) skewed", skewed);
    train_and_check<__half, wm::adagrad, wm::host, wm::chunked, wm::block>(
        comm, wm::adagrad{}, ++seed, "adagrad skewed", skewed);
    train_and_check<__nv_bfloat16, wm::rmsprop, wm::device, wm::distributed, wm::block>(
        comm, wm::rmsprop{}, ++seed, "rmsprop skewed", skewed);
    // Gradients not aligned to 16 bytes (rows that are): packed for the owners with narrower
    // accesses, summed and applied as aligned ones would be.
    train_and_check<__half, wm::sgd, wm::device, wm::distributed, wm::block>(
        comm, wm::sgd{0.01f}, ++seed, "sgd(wd) misaligned grads", misaligned);
    train_and_check<float, wm::adam, wm::device, wm::chunked, wm::cyclic>(
        comm, wm::adam{}, ++seed, "adam(lazy) misaligned grads", misaligned_float);
    // More than 2^32 - 1 rows on one rank is refused on every rank before anything is allocated
    // (this table would need 16 TiB per rank: an allocation first fails with another error).
    bool refused = false;
    try {
      wm::embedding<float> huge{
          comm, (std::size_t{1} << 32) * static_cast<std::size_t>(comm.size()) + 1, 1024};
    } catch (wm::logic_error const&) { refused = true; }
    RANK_REQUIRE_MSG(
        refused, "a table of more than 2^32 - 1 rows per rank was not refused with a logic_error");
    // An inference-only table gathers like any other.
    wm::embedding<float, wm::no_cache, wm::no_optimizer> frozen{
        comm, 50, 8, {}, wm::embedding_init::normal(0.0f, 1.0f, seed)};
    cudaStream_t s{};
    WM_CUDA_TRY(cudaStreamCreate(&s));
    auto const w = read_all<float>(frozen.weights(), 50, 8, s);
    double mean  = 0;
    for (double x : w) { mean += x / static_cast<double>(w.size()); }
    RANK_REQUIRE_MSG(std::abs(mean) < 0.3, "normal init mean " << mean);
    WM_CUDA_TRY(cudaStreamDestroy(s));
  });
}

template <class E>
concept trainable = requires(E& e, std::span<std::int64_t const> i, float const* g) {
  e.apply_gradients(i, g, 0.1f, cuda::stream_ref{cudaStream_t{}});
};
static_assert(trainable<wm::embedding<float, wm::no_cache, wm::adam>>);
static_assert(!trainable<wm::embedding<float, wm::no_cache, wm::no_optimizer>>);

}  // namespace

TEST_CASE("one rank: every optimizer, element type and layout against float64", "[gpu]") {
  run_suite(1);
}

TEST_CASE("ranks: every optimizer, element type and layout against float64", "[multi_gpu]") {
  run_suite(wm::local_device_count());
}
