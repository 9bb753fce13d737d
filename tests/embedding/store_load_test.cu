// SPDX-License-Identifier: Apache-2.0
// GPU tests of wm::embedding on one rank ([gpu]): a user-written optimizer against float64, exact
// checkpoint round trips with every optimizer (the user-written one too), into a prefix with or
// without a directory, and store leaving no temporaries, and checkpoints that do not fit refused
// with the table unchanged.
#include <wm/launch.hpp>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "embedding_common.cuh"
#include "rank_check.hpp"

using namespace embedding_tests;

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
    // A prefix without a directory: store renames in the working directory and flushes it.
    {
      struct in_dir {
        std::filesystem::path back = std::filesystem::current_path();
        explicit in_dir(std::filesystem::path const& d) { std::filesystem::current_path(d); }
        ~in_dir() { std::filesystem::current_path(back); }
      } const here{dir};
      wm::embedding<float, wm::no_cache, wm::sgd> d{comm, 10, 4, wm::sgd{},
                                                    wm::embedding_init::uniform(-1.0f, 1.0f, 7)};
      apply_batch(d, draw_batch(rng, 10, 4, 0), s);
      d.store("relative");
      RANK_REQUIRE(std::filesystem::exists(dir / "relative.meta"));
      RANK_REQUIRE_MSG(!has_temporaries(dir), "store with a relative prefix left .tmp files");
      wm::embedding<float, wm::no_cache, wm::sgd> e{comm, 10, 4};
      e.load("relative");
      RANK_REQUIRE_MSG(snapshot(d, s) == snapshot(e, s), "a relative prefix's round trip");
    }
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
