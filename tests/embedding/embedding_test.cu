// SPDX-License-Identifier: Apache-2.0
// GPU tests of wm::embedding: every optimizer x element type x layout, 1 rank ([gpu]) and one
// rank per GPU ([multi_gpu]). Several training steps with fresh random indices (many duplicates,
// an empty batch) and gradients; weights and optimizer states are compared with a float64 host
// reference of the same algorithm run on the concatenation of all ranks' batches (= what one
// rank computes on the concatenated batch). A checkpoint round trip into another layout
// continues training bit for bit. Bad indices are rejected on every rank with nothing updated.
#include <wm/wm.cuh>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <map>
#include <random>
#include <tuple>
#include <vector>

#include "catch.hpp"
#include "device_array.cuh"
#include "rank_check.hpp"
#include "ranks.hpp"

namespace {

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
constexpr shape small_odd{301, 19, 200, 4, 8, 0.5, 0.1};
// Vector-wide rows and one row hit ~800 times per rank: its gradients are summed in segments.
constexpr shape skewed{1000, 32, 1500, 2, 1, 2.0, 2.0};
// Rows of 32 bytes (16-byte vectors fit) with gradients 2 (half) or 4 (float) bytes past one.
constexpr shape misaligned{300, 16, 200, 4, 8, 0.5, 0.1, 1};
constexpr shape misaligned_float{300, 8, 200, 4, 8, 0.5, 0.1, 1};

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

bool close(double got, double want, double rel, double abs_floor) {
  return std::abs(got - want) <= rel * std::max(std::abs(want), abs_floor) && !std::isnan(got);
}

template <class T, class Opt, class L, class Y, class M>
void train_and_check(wm::communicator& comm, Opt opt, std::uint64_t seed, std::string const& name,
                     shape sh = small_odd) {
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

// ---- user-written optimizers and all-or-nothing checkpoints (1 rank) ---------------------------

namespace {

// A user-written optimizer, known to wm only through wm::sparse_optimizer: momentum SGD whose
// step shrinks with the row's own update count (so it needs per-row steps), with a buffer that
// starts at 0.01 (so the initial state matters).
struct user_momentum {
  static constexpr char const* name = "user_momentum";
  static constexpr int states       = 1;
  float momentum{0.9f};
  [[nodiscard]] constexpr bool needs_steps() const noexcept { return true; }
  [[nodiscard]] constexpr float initial_state() const noexcept { return 0.01f; }
  template <class F>
  WM_HOST_DEVICE void update(F& w, F g, F* s, wm::update_step<F> st) const noexcept {
    using std::sqrt;
    s[0] = static_cast<F>(momentum) * s[0] + g;
    w -= st.lr / sqrt(static_cast<F>(st.step)) * s[0];
  }
};
static_assert(wm::sparse_optimizer<user_momentum>);

// A batch of half the table's size: duplicates, and rows that are absent.
struct user_batch {
  std::vector<std::int64_t> keys;
  std::vector<float> grads;
  float lr;
};
user_batch draw_batch(std::mt19937_64& rng, std::size_t rows, std::size_t dim, int step) {
  user_batch b;
  b.lr = 0.02f * static_cast<float>(step + 1);
  std::uniform_real_distribution<float> g{-1.0f, 1.0f};
  b.keys.resize(rows / 2);
  for (auto& k : b.keys) {
    k = static_cast<std::int64_t>(rng() % 4 == 0 ? rng() % 5 : rng() % rows);
  }
  b.grads.resize(b.keys.size() * dim);
  for (auto& x : b.grads) { x = g(rng); }
  return b;
}

template <class E>
void apply_batch(E& e, user_batch const& b, cudaStream_t s) {
  device_array<std::int64_t> dk{b.keys};
  device_array<float> dg{b.grads};
  e.apply_gradients(std::span<std::int64_t const>{dk.ptr, b.keys.size()}, dg.ptr, b.lr,
                    cuda::stream_ref{s});
}

// What a table holds: weights, states, per-row steps, global step.
struct table_state {
  std::vector<float> w, st;
  std::vector<std::int64_t> steps;
  std::int64_t global{};
  bool operator==(table_state const&) const = default;
};
template <class E>
table_state snapshot(E& e, cudaStream_t s) {
  table_state t;
  t.w = wm_test::gather_every_row<float>(e.weights(), e.rows(), e.dim(), -12345.0f, s);
  if (e.states() != nullptr) {
    t.st = wm_test::gather_every_row<float>(*e.states(), e.rows(),
                                            e.dim() * E::optimizer_type::states, -12345.0f, s);
  }
  if (e.steps() != nullptr) {
    t.steps = wm_test::gather_every_row<std::int64_t>(*e.steps(), e.rows(), 1, -7, s);
  }
  t.global = e.global_step();
  return t;
}

// Calls f() and reports whether it threw wm::io_error (and the message).
template <class F>
bool throws_io_error(F&& f, std::string& message) {
  try {
    f();
  } catch (wm::io_error const& e) {
    message = e.what();
    return true;
  }
  return false;
}

std::filesystem::path fresh_dir(char const* what) {
  auto const dir = std::filesystem::temp_directory_path() /
                   (std::string{"wm-"} + what + "-" + std::to_string(std::random_device{}()) +
                    std::to_string(std::random_device{}()));
  std::filesystem::create_directories(dir);
  return dir;
}

bool has_temporaries(std::filesystem::path const& dir) {
  for (auto const& f : std::filesystem::directory_iterator{dir}) {
    if (f.path().string().ends_with(".tmp")) { return true; }
  }
  return false;
}

}  // namespace

// ---- failures every rank sees (issue 16)
// ---------------------------------------------------------

namespace {

using clock_type = std::chrono::steady_clock;

// Runs @p call, which must throw wm::logic_error on this rank within 5 s; returns the message.
template <class F>
std::string logic_error_soon(F&& call, std::string const& what) {
  auto const start = clock_type::now();
  std::string msg;
  bool threw = false;
  try {
    call();
  } catch (wm::logic_error const& e) {
    threw = true;
    msg   = e.what();
  }
  auto const took = std::chrono::duration<double>(clock_type::now() - start).count();
  RANK_REQUIRE_MSG(threw, what << ": no error");
  RANK_REQUIRE_MSG(took < 5.0, what << ": the error took " << took << " s");
  return msg;
}

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
    auto const msg         = logic_error_soon(
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
  auto const msg    = logic_error_soon(
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

TEST_CASE("one rank: a user-written optimizer trains through wm::embedding against float64",
          "[gpu]") {
  std::uint64_t const seed = std::random_device{}();
  wm::launch(1, [&](wm::communicator& comm) {
    std::size_t const rows = 257, dim = 12;
    cudaStream_t s{};
    WM_CUDA_TRY(cudaStreamCreate(&s));
    user_momentum const opt{0.8f};
    wm::embedding<float, wm::no_cache, user_momentum, wm::device, wm::distributed> e{
        comm, rows, dim, opt, wm::embedding_init::uniform(-0.5f, 0.5f, seed)};
    RANK_REQUIRE(e.states() != nullptr && e.steps() != nullptr);
    auto const start = snapshot(e, s);
    for (float x : start.st) {
      RANK_REQUIRE_MSG(x == 0.01f, "initial state " << x << ", 0.01 expected");
    }
    for (auto t : start.steps) { RANK_REQUIRE(t == 0); }

    // The float64 reference, written from the rule above: duplicates summed, then per touched
    // row k: t = ++count[k]; s = momentum s + g; w -= lr / sqrt(t) s.
    std::vector<double> w(start.w.begin(), start.w.end()), st(rows * dim, 0.01);
    std::vector<std::int64_t> count(rows, 0);
    std::mt19937_64 rng{seed};
    int const steps = 6;
    for (int k = 0; k < steps; ++k) {
      auto const b = draw_batch(rng, rows, dim, k);
      apply_batch(e, b, s);
      std::map<std::size_t, std::vector<double>> sums;
      for (std::size_t i = 0; i < b.keys.size(); ++i) {
        auto& g = sums[static_cast<std::size_t>(b.keys[i])];
        g.resize(dim, 0.0);
        for (std::size_t j = 0; j < dim; ++j) { g[j] += b.grads[i * dim + j]; }
      }
      for (auto const& [row, g] : sums) {
        double const t = static_cast<double>(++count[row]);
        for (std::size_t j = 0; j < dim; ++j) {
          double& sv = st[row * dim + j];
          double& wv = w[row * dim + j];
          double wp = wv, sp = sv;  // the policy's own double path, for comparison
          opt.update(wp, g[j], &sp, wm::update_step<double>{b.lr, count[row]});
          sv = static_cast<double>(opt.momentum) * sv + g[j];
          wv -= static_cast<double>(b.lr) / std::sqrt(t) * sv;
          RANK_REQUIRE_MSG(close(wp, wv, 1e-12, 1.0) && close(sp, sv, 1e-12, 1.0),
                           "the policy's double update differs from the reference");
        }
      }
    }
    auto const got = snapshot(e, s);
    RANK_REQUIRE(got.global == steps);
    std::size_t untouched = 0;
    for (std::size_t r = 0; r < rows; ++r) {
      RANK_REQUIRE_MSG(got.steps[r] == count[r], "row " << r << " counted " << got.steps[r]
                                                        << " updates, " << count[r] << " expected");
      untouched += count[r] == 0 ? 1 : 0;
    }
    RANK_REQUIRE_MSG(untouched > 0 && count[0] > steps / 2,
                     "the batches should leave rows out and hit row 0 often");
    // Float sums of up to ~100 gradients of size 1 (the hot rows): absolute rounding ~1e-5.
    for (std::size_t i = 0; i < w.size(); ++i) {
      RANK_REQUIRE_MSG(close(got.w[i], w[i], 2e-5, 1.0),
                       "weight " << i << " is " << got.w[i] << ", reference " << w[i]);
      RANK_REQUIRE_MSG(close(got.st[i], st[i], 2e-5, 1.0),
                       "state " << i << " is " << got.st[i] << ", reference " << st[i]);
    }
    WM_CUDA_TRY(cudaStreamDestroy(s));
  });
}

TEST_CASE("one rank: a checkpoint round trip is exact, and store leaves no temporaries", "[gpu]") {
  std::uint64_t const seed = std::random_device{}();
  wm::launch(1, [&](wm::communicator& comm) {
    cudaStream_t s{};
    WM_CUDA_TRY(cudaStreamCreate(&s));
    auto const dir = fresh_dir("ckpt-roundtrip");
    std::mt19937_64 rng{seed};
    auto round_trip = [&](auto opt, char const* what) {
      using O                = decltype(opt);
      std::size_t const rows = 301, dim = 7;
      wm::embedding<float, wm::no_cache, O, wm::device, wm::chunked> a{
          comm, rows, dim, opt, wm::embedding_init::uniform(-0.5f, 0.5f, rng())};
      for (int k = 0; k < 3; ++k) { apply_batch(a, draw_batch(rng, rows, dim, k), s); }
      auto const prefix = dir / what;
      a.store(prefix);  // a first checkpoint, then more training and a second over it
      apply_batch(a, draw_batch(rng, rows, dim, 3), s);
      a.store(prefix);
      RANK_REQUIRE_MSG(!has_temporaries(dir), what << ": store left .tmp files");
      RANK_REQUIRE_MSG(std::filesystem::exists(prefix.string() + ".meta"), what);
      wm::embedding<float, wm::no_cache, O, wm::host, wm::distributed, wm::cyclic> b{
          comm, rows, dim, opt, wm::embedding_init::zeros()};
      b.load(prefix);
      auto const sa = snapshot(a, s);
      RANK_REQUIRE_MSG(sa.global == 4, what);
      RANK_REQUIRE_MSG(sa == snapshot(b, s),
                       what << ": the loaded table differs from the stored one");
      // Both go on alike.
      auto const more = draw_batch(rng, rows, dim, 4);
      apply_batch(a, more, s);
      apply_batch(b, more, s);
      RANK_REQUIRE_MSG(snapshot(a, s) == snapshot(b, s),
                       what << ": training after the round trip differs");
    };
    wm::adam lazy;
    round_trip(lazy, "adam-lazy");
    wm::adam global;
    global.bias_correction = wm::adam_bias_correction::global_step;
    global.epsilon         = wm::adam_epsilon::sparse_adam;
    round_trip(global, "adam-global");
    round_trip(wm::sgd{0.01f}, "sgd");
    round_trip(wm::adagrad{1e-10f, 0.1f, 0.0f}, "adagrad");
    round_trip(user_momentum{}, "user");
    // A store that cannot write: io_error, and nothing left behind.
    wm::embedding<float, wm::no_cache, wm::adam> c{comm, 10, 4};
    std::string msg;
    RANK_REQUIRE(throws_io_error([&] { c.store(dir / "no-such-dir" / "ck"); }, msg));
    RANK_REQUIRE_MSG(!has_temporaries(dir), "a failed store left .tmp files");
    std::filesystem::remove_all(dir);
    WM_CUDA_TRY(cudaStreamDestroy(s));
  });
}

TEST_CASE(
    "one rank: a checkpoint that does not fit is refused with io_error and the table unchanged",
    "[gpu]") {
  std::uint64_t const seed = std::random_device{}();
  wm::launch(1, [&](wm::communicator& comm) {
    cudaStream_t s{};
    WM_CUDA_TRY(cudaStreamCreate(&s));
    auto const dir = fresh_dir("ckpt-refused");
    std::mt19937_64 rng{seed};
    std::size_t const rows = 203, dim = 12;
    auto trained = [&](auto opt, std::size_t d) {
      wm::embedding<float, wm::no_cache, decltype(opt)> e{
          comm, rows, d, opt, wm::embedding_init::uniform(-0.5f, 0.5f, rng())};
      for (int k = 0; k < 2; ++k) { apply_batch(e, draw_batch(rng, rows, d, k), s); }
      return e;
    };
    // The table that refuses: lazy Adam, trained, with a known state.
    auto target       = trained(wm::adam{}, dim);
    auto const before = snapshot(target, s);
    auto refused = [&](std::filesystem::path const& prefix, char const* what, char const* word) {
      std::string msg;
      RANK_REQUIRE_MSG(throws_io_error([&] { target.load(prefix); }, msg),
                       what << ": loaded without an error");
      RANK_REQUIRE_MSG(msg.find(word) != std::string::npos,
                       what << ": the message '" << msg << "' does not name " << word);
      RANK_REQUIRE_MSG(snapshot(target, s) == before, what << ": a refused load changed the table");
    };

    // A complete checkpoint of the same kind, then each of its files missing in turn.
    auto good = trained(wm::adam{}, dim);
    {  // its last row trained for sure: the files' last bytes are not the initial zeros
      auto last        = draw_batch(rng, rows, dim, 2);
      last.keys.back() = static_cast<std::int64_t>(rows - 1);
      apply_batch(good, last, s);
    }
    RANK_REQUIRE(snapshot(good, s) != before);
    good.store(dir / "good");
    for (char const* part : {".states", ".steps", ".weights"}) {
      auto const file = std::filesystem::path{(dir / "good").string() + part + ".rank0-of-1.bin"};
      auto const kept = std::filesystem::path{file.string() + ".kept"};
      std::filesystem::rename(file, kept);
      refused(dir / "good", part, "missing");
      std::filesystem::rename(kept, file);
    }
    {  // a short states file (cut on a copy: growing it back would zero the last value)
      auto const file = std::filesystem::path{(dir / "good").string() + ".states.rank0-of-1.bin"};
      auto const kept = std::filesystem::path{file.string() + ".kept"};
      std::filesystem::copy_file(file, kept);
      std::filesystem::resize_file(file, std::filesystem::file_size(file) - 4);
      refused(dir / "good", "short .states", "bytes");
      std::filesystem::rename(kept, file);
    }
    std::filesystem::rename(dir / "good.meta", dir / "good.meta.kept");
    refused(dir / "good", "no .meta", "good.meta");
    std::filesystem::rename(dir / "good.meta.kept", dir / "good.meta");

    // Another optimizer, bias-correction mode, epsilon placement, dim.
    trained(wm::rmsprop{}, dim).store(dir / "rmsprop");
    refused(dir / "rmsprop", "rmsprop into adam", "optimizer");
    wm::adam global;
    global.bias_correction = wm::adam_bias_correction::global_step;
    trained(global, dim).store(dir / "global");
    refused(dir / "global", "global-step adam into lazy adam", "global_step");
    wm::adam sparse_eps;
    sparse_eps.epsilon = wm::adam_epsilon::sparse_adam;
    trained(sparse_eps, dim).store(dir / "eps");
    refused(dir / "eps", "SparseAdam epsilon into torch epsilon", "sparse_adam");
    trained(wm::adam{}, dim + 1).store(dir / "dim");
    refused(dir / "dim", "dim 13 into dim 12", "dim");

    // After all that, the good checkpoint still loads, exactly.
    target.load(dir / "good");
    RANK_REQUIRE(snapshot(target, s) == snapshot(good, s));
    std::filesystem::remove_all(dir);
    WM_CUDA_TRY(cudaStreamDestroy(s));
  });
}

// ---- cases run inside every rank (--ranks; tests/support/ranks.hpp) ----------------------------

namespace {

// A seed drawn on rank 0, the same on every rank.
std::uint64_t shared_seed(wm::communicator& comm) {
  return comm.all_gather(static_cast<std::uint64_t>(std::random_device{}()))[0];
}

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
