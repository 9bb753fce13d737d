// SPDX-License-Identifier: Apache-2.0
// train_and_check's body, included only by the train_<optimizer>_test.cu files, which
// instantiate it explicitly (once per program); the cases that call it (embedding_test.cu)
// include embedding_common.cuh alone and link against those instantiations.
#pragma once

#include <filesystem>

#include "embedding_common.cuh"

namespace embedding_tests {

template <class T, class Opt, class L, class Y, class M>
void train_and_check(wm::communicator& comm, Opt opt, std::uint64_t seed, std::string const& name,
                     shape sh) {
  std::string const what = name + " T=" + std::to_string(sizeof(T)) + "B " + L::name + "." +
                           Y::name + "." + M::name + " ranks=" + std::to_string(comm.size()) +
                           " dim=" + std::to_string(sh.dim);
  std::size_t const rows = sh.rows;
  std::size_t const dim  = sh.dim;
  cudaStream_t s{};
  WM_CUDA_TRY(cudaStreamCreate(&s));
  using E = wm::embedding<T, wm::no_cache, Opt, L, Y, M>;
  E e{comm, rows, dim, opt, wm::embedding_init::uniform(-0.5f, 0.5f, seed)};

  reference_table<T, Opt> ref{opt,
                              rows,
                              dim,
                              read_all<T>(e.weights(), rows, dim, s),
                              std::vector<double>(rows * dim * Opt::states, wm::initial_state(opt)),
                              std::vector<long>(rows, 0)};
  // Every row holds embedding_init's value for its global row (rounded to T); exactly 0 is a
  // legitimate value (u = 0.5), so the check compares values rather than ruling 0 out.
  {
    auto const init = wm::embedding_init::uniform(-0.5f, 0.5f, seed);
    for (std::size_t k = 0; k < rows; ++k) {
      for (std::size_t j = 0; j < dim; ++j) {
        double const x    = ref.w[k * dim + j];
        double const want = init.value(k, j, dim);
        RANK_REQUIRE_MSG(std::abs(x - want) <= 1e-2 * std::abs(want) + 1e-6,
                         what << ": initial weight of row " << k << " col " << j << " is " << x
                              << ", embedding_init gives " << want);
      }
    }
  }

  // An uncached table keeps weights, states and steps in three tensors (a cached host table keeps
  // one record per row: embedding_cache_test).
  RANK_REQUIRE_MSG(e.weights().stride() == dim,
                   what << ": weight row stride " << e.weights().stride());
  if constexpr (Opt::states > 0) {
    RANK_REQUIRE_MSG(e.states()->column_offset() == 0 && e.states()->stride() == dim * Opt::states,
                     what << ": state columns at " << e.states()->column_offset());
  }

  std::mt19937_64 rng{seed};
  int const steps = 4;
  for (int k = 0; k < steps; ++k) {
    auto const d = draw_step<T>(rng, comm.size(), sh, k);
    apply(e, comm, d, s, sh.grad_offset);
    ref.step(d);
    RANK_REQUIRE(e.global_step() == k + 1);
  }
  auto const w = read_all<T>(e.weights(), rows, dim, s);
  for (std::size_t i = 0; i < w.size(); ++i) {
    // Relative to the weights' scale (init range 0.5): one rounding of T taken differently while
    // a weight was ~0.4 stays as an absolute difference after it shrinks (seen: 1 half ulp).
    RANK_REQUIRE_MSG(close(w[i], ref.w[i], tolerance<T>(), sh.weight_scale),
                     what << ": weight " << i << " is " << w[i] << ", reference " << ref.w[i]);
  }
  if constexpr (Opt::states > 0) {
    auto const st = read_all<float>(*e.states(), rows, dim * Opt::states, s);
    // Relative to the gradients' scale (0.1): a duplicate sum of float terms of size ~1 carries
    // absolute rounding of ~1e-7 however small the sum. Half/bfloat16: states see rounded weights.
    double const rel = std::is_same_v<T, float> ? 1e-5 : 2e-2;
    for (std::size_t i = 0; i < st.size(); ++i) {
      RANK_REQUIRE_MSG(close(st[i], ref.st[i], rel, sh.state_scale),
                       what << ": state " << i << " is " << st[i] << ", reference " << ref.st[i]);
    }
  }

  // Checkpoint: store, train two more steps (A); load into another layout, same two steps (B).
  auto const dir = std::filesystem::temp_directory_path() / ("wm-emb-test-" + std::to_string(seed));
  std::filesystem::create_directories(dir);
  e.store(dir / "ckpt");
  auto const more1 = draw_step<T>(rng, comm.size(), sh, 10);
  auto const more2 = draw_step<T>(rng, comm.size(), sh, 11);
  apply(e, comm, more1, s, sh.grad_offset);
  apply(e, comm, more2, s, sh.grad_offset);
  using Y2 = std::conditional_t<std::is_same_v<Y, wm::distributed>, wm::chunked, wm::distributed>;
  wm::embedding<T, wm::no_cache, Opt, L, Y2, M> e2{comm, rows, dim, opt,
                                                   wm::embedding_init::zeros()};
  e2.load(dir / "ckpt");
  RANK_REQUIRE(e2.global_step() == steps);
  {  // The same checkpoint in the other location.
    using L3 = std::conditional_t<std::is_same_v<L, wm::host>, wm::device, wm::host>;
    wm::embedding<T, wm::no_cache, Opt, L3, Y, M> e3{comm, rows, dim, opt,
                                                     wm::embedding_init::zeros()};
    e3.load(dir / "ckpt");
    RANK_REQUIRE_MSG(
        read_all<T>(e3.weights(), rows, dim, s) == read_all<T>(e2.weights(), rows, dim, s),
        what << ": weights loaded into the other location differ");
    if constexpr (Opt::states > 0) {
      RANK_REQUIRE_MSG(read_all<float>(*e3.states(), rows, dim * Opt::states, s) ==
                           read_all<float>(*e2.states(), rows, dim * Opt::states, s),
                       what << ": states loaded into the other location differ");
    }
    if (e3.steps() != nullptr) {
      RANK_REQUIRE_MSG(wm_test::gather_every_row<std::int64_t>(*e3.steps(), rows, 1, -7, s) ==
                           wm_test::gather_every_row<std::int64_t>(*e2.steps(), rows, 1, -7, s),
                       what << ": steps loaded into the other location differ");
    }
  }
  apply(e2, comm, more1, s, sh.grad_offset);
  apply(e2, comm, more2, s, sh.grad_offset);
  auto const a = read_all<T>(e.weights(), rows, dim, s);
  auto const b = read_all<T>(e2.weights(), rows, dim, s);
  RANK_REQUIRE_MSG(a == b, what << ": training after a checkpoint round trip differs");
  if constexpr (Opt::states > 0) {
    RANK_REQUIRE_MSG(read_all<float>(*e.states(), rows, dim * Opt::states, s) ==
                         read_all<float>(*e2.states(), rows, dim * Opt::states, s),
                     what << ": optimizer state after a checkpoint round trip differs");
  }
  comm.barrier();
  if (comm.rank() == 0) { std::filesystem::remove_all(dir); }

  // A bad index on one rank: every rank gets the error; nothing changes.
  auto bad = draw_step<T>(rng, comm.size(), sh, 20);
  bad.idx[static_cast<std::size_t>(comm.size() - 1)].push_back(static_cast<std::int64_t>(rows));
  bad.grads[static_cast<std::size_t>(comm.size() - 1)].resize(bad.idx[comm.size() - 1].size() * dim,
                                                              from_double<T>(1.0));
  bool threw = false;
  try {
    apply(e, comm, bad, s, sh.grad_offset);
  } catch (wm::logic_error const&) { threw = true; }
  RANK_REQUIRE_MSG(threw, what << ": an out-of-range gradient index was accepted");
  RANK_REQUIRE(e.global_step() == steps + 2);
  RANK_REQUIRE_MSG(read_all<T>(e.weights(), rows, dim, s) == a,
                   what << ": a rejected batch changed the table");
  WM_CUDA_TRY(cudaStreamDestroy(s));
  comm.barrier();
}

}  // namespace embedding_tests

// One explicit instantiation of train_and_check.
#define WM_TRAIN_AND_CHECK(T, Opt, L, Y, M)                        \
  template void embedding_tests::train_and_check<T, Opt, L, Y, M>( \
      wm::communicator&, Opt, std::uint64_t, std::string const&, embedding_tests::shape)

// train_and_check for element type T and optimizer Opt on the five layouts of every_layout()
// (embedding_test.cu): device continuous, chunked, distributed; host chunked; host distributed
// with the cyclic mapping.
#define WM_TRAIN_EVERY_LAYOUT(T, Opt)                                 \
  WM_TRAIN_AND_CHECK(T, Opt, wm::device, wm::continuous, wm::block);  \
  WM_TRAIN_AND_CHECK(T, Opt, wm::device, wm::chunked, wm::block);     \
  WM_TRAIN_AND_CHECK(T, Opt, wm::device, wm::distributed, wm::block); \
  WM_TRAIN_AND_CHECK(T, Opt, wm::host, wm::chunked, wm::block);       \
  WM_TRAIN_AND_CHECK(T, Opt, wm::host, wm::distributed, wm::cyclic)
