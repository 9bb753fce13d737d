// SPDX-License-Identifier: Apache-2.0
// Shared by the translation units of embedding_test: element-type conversions, the float64
// reference of a training step, the shapes of the tables trained. train_and_check() is defined in
// embedding_train.cuh and instantiated once for each element type x optimizer x layout the suite
// trains, in train_sgd_test.cu, train_adam_test.cu, train_rmsprop_test.cu and
// train_adagrad_test.cu, which compile at once. The cases (embedding_test.cu) see this declaration
// only and link against those instantiations.
#pragma once

#include <wm/comm.hpp>
#include <wm/embedding.cuh>
#include <wm/error.hpp>
#include <wm/optimizer.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "device_array.cuh"
#include "rank_check.hpp"

namespace embedding_tests {

template <class T>
double to_double(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, __half>) {
    return static_cast<double>(__half2float(x));
  } else {
    return static_cast<double>(__bfloat162float(x));
  }
}
template <class T>
T from_double(double x) {
  if constexpr (std::is_same_v<T, float>) {
    return static_cast<float>(x);
  } else if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(static_cast<float>(x));
  } else {
    return __float2bfloat16_rn(static_cast<float>(x));
  }
}
template <class T>
double tolerance()  // relative, for weights stored as T
{
  if constexpr (std::is_same_v<T, float>) {
    return 1e-5;
  } else if constexpr (std::is_same_v<T, __half>) {
    return 2e-3;  // one rounding step of half apart at most
  } else {
    return 1.6e-2;
  }
}

using wm_test::device_array;

// All rows of a tensor-like (gather with every index), as doubles.
template <class T, class Table>
std::vector<double> read_all(Table& t, std::size_t rows, std::size_t cols, cudaStream_t s) {
  auto const h = wm_test::gather_every_row<T>(t, rows, cols, from_double<T>(-12345.0), s);
  std::vector<double> d(h.size());
  for (std::size_t i = 0; i < h.size(); ++i) { d[i] = to_double(h[i]); }
  return d;
}

// One training step's data for every rank (all ranks draw the same numbers).
template <class T>
struct step_data {
  std::vector<std::vector<std::int64_t>> idx;  // per rank
  std::vector<std::vector<T>> grads;           // per rank, dim per index
  float lr;
};

// Table and batch sizes: every `hot_every`-th key (on average) is one of the first `hot_rows`.
struct shape {
  std::size_t rows;
  std::size_t dim;
  std::size_t batch;  // rank r passes batch + 37 r keys
  unsigned hot_every;
  std::size_t hot_rows;
  // Absolute scale under the relative tolerances: float sums of n gradients of size ~1 carry
  // rounding that grows with n, however small the sum (seen: 1.3e-6 on a state of 0.007 after
  // summing 1,600 gradients), so the skewed shape's scale is the hot row's gradient mass.
  double weight_scale;
  double state_scale;
  // Gradients passed this many elements past an aligned address (an odd-element slice).
  std::size_t grad_offset = 0;
};
// Odd width (no vector access), a few hot rows with short runs of duplicates.
inline constexpr shape small_odd{301, 19, 200, 4, 8, 0.5, 0.1};
// Vector-wide rows and one row hit ~800 times per rank: its gradients are summed in segments.
inline constexpr shape skewed{1000, 32, 1500, 2, 1, 2.0, 2.0};
// Rows of 32 bytes (16-byte vectors fit) with gradients 2 (half) or 4 (float) bytes past one.
inline constexpr shape misaligned{300, 16, 200, 4, 8, 0.5, 0.1, 1};
inline constexpr shape misaligned_float{300, 8, 200, 4, 8, 0.5, 0.1, 1};

template <class T>
step_data<T> draw_step(std::mt19937_64& rng, int world, shape sh, int step) {
  std::size_t const rows = sh.rows;
  std::size_t const dim  = sh.dim;
  step_data<T> d;
  d.lr = 0.01f * static_cast<float>(step + 1);
  std::uniform_real_distribution<float> g{-1.0f, 1.0f};
  for (int r = 0; r < world; ++r) {
    std::size_t const n = (step == 1 && r == world - 1)
                              ? 0
                              : sh.batch + 37 * static_cast<std::size_t>(r);  // one empty batch
    std::vector<std::int64_t> idx(n);
    for (auto& k : idx) {
      k = static_cast<std::int64_t>(rng() % sh.hot_every == 0 ? rng() % sh.hot_rows : rng() % rows);
    }
    std::vector<T> gr(n * dim);
    for (auto& x : gr) { x = from_double<T>(g(rng)); }
    d.idx.push_back(std::move(idx));
    d.grads.push_back(std::move(gr));
  }
  return d;
}

// The float64 reference: sum duplicates over the concatenated batch, update each touched row.
template <class T, class Opt>
struct reference_table {
  Opt opt;
  std::size_t rows, dim;
  std::vector<double> w, st;
  std::vector<long> row_steps;
  long global = 0;

  void step(step_data<T> const& d) {
    ++global;
    std::map<std::size_t, std::vector<double>> sums;
    for (std::size_t r = 0; r < d.idx.size(); ++r) {
      for (std::size_t i = 0; i < d.idx[r].size(); ++i) {
        auto& g = sums[static_cast<std::size_t>(d.idx[r][i])];
        g.resize(dim, 0.0);
        for (std::size_t j = 0; j < dim; ++j) { g[j] += to_double(d.grads[r][i * dim + j]); }
      }
    }
    for (auto const& [k, g] : sums) {
      long t = global;
      if constexpr (std::is_same_v<Opt, wm::adam>) {
        if (opt.bias_correction == wm::adam_bias_correction::per_row) { t = ++row_steps[k]; }
      }
      for (std::size_t j = 0; j < dim; ++j) {
        double s[2] = {0, 0};
        for (int q = 0; q < Opt::states; ++q) { s[q] = st[k * Opt::states * dim + q * dim + j]; }
        double& wv = w[k * dim + j];
        opt.update(wv, g[j], s, wm::update_step<double>{static_cast<double>(d.lr), t});
        wv = to_double(from_double<T>(wv));  // stored as T
        for (int q = 0; q < Opt::states; ++q) { st[k * Opt::states * dim + q * dim + j] = s[q]; }
      }
    }
  }
};

// Passes this rank's gradients @p offset elements into their buffer (after values that must not
// be read: a misaligned read of them would show in the weights).
template <class E, class T>
void apply(E& e, wm::communicator& comm, step_data<T> const& d, cudaStream_t s,
           std::size_t offset = 0) {
  auto const& idx = d.idx[static_cast<std::size_t>(comm.rank())];
  device_array<std::int64_t> di{idx};
  std::vector<T> grads(offset, from_double<T>(1000.0));
  auto const& mine = d.grads[static_cast<std::size_t>(comm.rank())];
  grads.insert(grads.end(), mine.begin(), mine.end());
  device_array<T> dg{grads};
  e.apply_gradients(std::span<std::int64_t const>{di.ptr, idx.size()}, dg.ptr + offset, d.lr,
                    cuda::stream_ref{s});
}

inline bool close(double got, double want, double rel, double abs_floor) {
  return std::abs(got - want) <= rel * std::max(std::abs(want), abs_floor) && !std::isnan(got);
}

// Trains an embedding<T, no_cache, Opt, L, Y, M> of shape @p sh for a few steps on every rank
// against the float64 reference, then checks a checkpoint round trip into other layouts and a
// rejected bad index (embedding_train.cuh).
template <class T, class Opt, class L, class Y, class M>
void train_and_check(wm::communicator& comm, Opt opt, std::uint64_t seed, std::string const& name,
                     shape sh = small_odd);

}  // namespace embedding_tests
