// SPDX-License-Identifier: Apache-2.0
// Host tests: each optimizer's update rule (float, as the GPU runs it, and double) against a
// float64 reference written out here from the frameworks' documented algorithms, not from
// optimizer.hpp; several steps, weight decay on and off, lazy (per-row step) and global-step
// Adam, AdamW, both epsilon placements. Also: what a policy supplies (states, initial state,
// per-row steps) and a user-written optimizer satisfying the concept.
#include <wm/optimizer.hpp>

#include <cmath>
#include <random>
#include <vector>

#include "catch.hpp"

namespace {

// Plain double-precision transcriptions. Symbols as in PyTorch's docs: gamma = lr, lambda =
// weight decay, theta = w, g = gradient, t = step.
struct reference {
  // torch.optim.SGD (momentum 0, dampening 0): g <- g + lambda theta; theta <- theta - gamma g.
  static void sgd(double& w, double g, double lr, double wd) {
    if (wd != 0) { g = g + wd * w; }
    w = w - lr * g;
  }
  // torch.optim.Adam (amsgrad off, maximize off):
  //   if lambda != 0: g <- g + lambda theta
  //   m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
  //   m^ <- m / (1 - b1^t);  v^ <- v / (1 - b2^t);  theta <- theta - gamma m^ / (sqrt(v^) + eps)
  // torch.optim.AdamW: the first line becomes theta <- theta - gamma lambda theta.
  static void torch_adam(double& w, double g, double& m, double& v, double lr, long t, double b1,
                         double b2, double eps, double wd, bool adamw) {
    if (adamw) {
      w = w - lr * wd * w;
    } else if (wd != 0) {
      g = g + wd * w;
    }
    m               = b1 * m + (1 - b1) * g;
    v               = b2 * v + (1 - b2) * g * g;
    double const mh = m / (1 - std::pow(b1, static_cast<double>(t)));
    double const vh = v / (1 - std::pow(b2, static_cast<double>(t)));
    w               = w - lr * mh / (std::sqrt(vh) + eps);
  }
  // torch.optim.SparseAdam (per present row; t counts the optimizer's steps):
  //   m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
  //   step_size <- gamma sqrt(1 - b2^t) / (1 - b1^t);  theta <- theta - step_size m / (sqrt(v) +
  //   eps)
  // (no weight decay in torch; wm's L2 / decoupled decay is applied as for Adam / AdamW).
  static void sparse_adam(double& w, double g, double& m, double& v, double lr, long t, double b1,
                          double b2, double eps, double wd, bool decoupled) {
    if (decoupled) {
      w = w - lr * wd * w;
    } else if (wd != 0) {
      g = g + wd * w;
    }
    m                      = b1 * m + (1 - b1) * g;
    v                      = b2 * v + (1 - b2) * g * g;
    double const step_size = lr * std::sqrt(1 - std::pow(b2, static_cast<double>(t))) /
                             (1 - std::pow(b1, static_cast<double>(t)));
    w = w - step_size * m / (std::sqrt(v) + eps);
  }
  static void adam(double& w, double g, double* s, double lr, long t, wm::adam const& o) {
    double const b1 = o.beta1, b2 = o.beta2, eps = o.eps, wd = o.weight_decay;
    if (o.epsilon == wm::adam_epsilon::torch_adam) {
      torch_adam(w, g, s[0], s[1], lr, t, b1, b2, eps, wd, o.decoupled);
    } else {
      sparse_adam(w, g, s[0], s[1], lr, t, b1, b2, eps, wd, o.decoupled);
    }
  }
  // torch.optim.RMSprop (centered off, momentum 0): g <- g + lambda theta;
  // v <- alpha v + (1 - alpha) g^2; theta <- theta - gamma g / (sqrt(v) + eps).
  static void rmsprop(double& w, double g, double& v, double lr, wm::rmsprop const& o) {
    if (o.weight_decay != 0) { g = g + o.weight_decay * w; }
    v = o.alpha * v + (1 - o.alpha) * g * g;
    w = w - lr * g / (std::sqrt(v) + o.eps);
  }
  // torch.optim.Adagrad (lr_decay 0): g <- g + lambda theta; state_sum <- state_sum + g^2;
  // theta <- theta - gamma g / (sqrt(state_sum) + eps); state_sum starts at the initial value.
  static void adagrad(double& w, double g, double& s, double lr, wm::adagrad const& o) {
    if (o.weight_decay != 0) { g = g + o.weight_decay * w; }
    s = s + g * g;
    w = w - lr * g / (std::sqrt(s) + o.eps);
  }
};

bool close(double got, double want, double rel) {
  return std::abs(got - want) <=
         rel * std::max(std::abs(want), 0.1);  // floor: values near 0 after cancellation
}

// Runs `ts.size()` updates of one row with random gradients through the policy (float and
// double) and through `ref`, and compares. Gradients span 1e-6 .. 1 (eps matters at the bottom).
template <class Opt, class Ref>
void check(Opt const& opt, Ref&& ref, std::vector<long> const& ts) {
  std::mt19937_64 rng{std::random_device{}()};
  std::uniform_real_distribution<double> d{-1.0, 1.0};
  constexpr int states = Opt::states;
  for (int trial = 0; trial < 30; ++trial) {
    double const scale = trial % 3 == 0 ? 1e-6 : trial % 3 == 1 ? 1e-3 : 1.0;
    double const w0    = d(rng);
    double const s0    = opt.initial_state();
    double wr = w0, wd = w0;
    auto wf = static_cast<float>(w0);
    std::vector<double> sr(2, s0), sd(2, s0);
    std::vector<float> sf(2, static_cast<float>(s0));
    std::vector<double> peak(2, std::abs(s0));  // a state's largest size so far: the floor under
                                                // its relative tolerance (m can cancel to ~0)
    for (std::size_t k = 0; k < ts.size(); ++k) {
      double const g  = static_cast<float>(d(rng) * scale);  // exactly representable in float
      double const lr = 0.01 * static_cast<double>(k + 1);
      ref(wr, g, sr.data(), lr, ts[k]);
      opt.update(wd, g, sd.data(), wm::update_step<double>{lr, ts[k]});
      opt.update(wf, static_cast<float>(g), sf.data(),
                 wm::update_step<float>{static_cast<float>(lr), ts[k]});
      INFO("trial " << trial << " step " << k << " t " << ts[k] << ": double " << wd << ", float "
                    << wf << ", reference " << wr);
      REQUIRE(close(wd, wr, 1e-12));
      REQUIRE(close(wf, wr, 1e-5));
      for (int i = 0; i < states; ++i) {
        peak[i] = std::max(peak[i], std::abs(sr[i]));
        REQUIRE(std::abs(sd[i] - sr[i]) <= 1e-12 * std::max(std::abs(sr[i]), 0.1 * peak[i]));
        REQUIRE(std::abs(sf[i] - sr[i]) <= 1e-5 * std::max(std::abs(sr[i]), 0.1 * peak[i]));
      }
    }
  }
}

}  // namespace

TEST_CASE("SGD matches torch.optim.SGD, with and without weight decay", "[host]") {
  for (float wd : {0.0f, 0.01f}) {
    wm::sgd const o{wd};
    check(o, [&](double& w, double g, double*, double lr, long) { reference::sgd(w, g, lr, wd); },
          {1, 2, 3, 4, 5});
  }
}

TEST_CASE(
    "Adam matches torch's algorithms: lazy and global steps, L2 and decoupled decay, both epsilons",
    "[host]") {
  for (auto eps_form : {wm::adam_epsilon::torch_adam, wm::adam_epsilon::sparse_adam}) {
    for (bool decoupled : {false, true}) {
      for (float wd : {0.0f, 0.02f}) {
        wm::adam o;
        o.weight_decay = wd;
        o.decoupled    = decoupled;
        o.epsilon      = eps_form;
        auto ref       = [&](double& w, double g, double* s, double lr, long t) {
          reference::adam(w, g, s, lr, t, o);
        };
        check(o, ref, {1, 2, 3, 4, 5, 6});  // lazy: the row's own count
        o.bias_correction = wm::adam_bias_correction::global_step;
        check(o, ref, {1, 3, 4, 9, 10, 30});  // global: the table's count skips steps
      }
    }
  }
  // The float step itself, not only the weight after it, to 2e-6: 1 - 0.999^t computed as
  // 1 - powf(0.999f, t) lost 4 digits (3e-5 relative at t = 1) and made a GPU test miss 1e-5.
  std::mt19937_64 rng{std::random_device{}()};
  std::uniform_real_distribution<double> u{-1.0, 1.0};
  for (auto eps_form : {wm::adam_epsilon::torch_adam, wm::adam_epsilon::sparse_adam}) {
    for (long t : {1L, 2L, 3L, 7L, 100L, 5000L}) {
      for (int trial = 0; trial < 50; ++trial) {
        wm::adam a;
        a.epsilon = eps_form;
        // A row's first update at step t (global-step Adam): zero moments, so the only
        // cancellation is in the bias corrections.
        double const g = static_cast<float>(u(rng) * (trial % 2 == 0 ? 1.0 : 1e-6));
        double wr = 0.0, sr[2] = {0.0, 0.0};
        reference::adam(wr, g, sr, 0.01, t, a);
        float wf = 0.0f, sf[2] = {0.0f, 0.0f};
        a.update(wf, static_cast<float>(g), sf, wm::update_step<float>{0.01f, t});
        INFO("t " << t << ": float step " << wf << ", reference " << wr);
        REQUIRE(std::abs(wf - wr) <= 2e-6 * std::abs(wr) + 1e-12);
      }
    }
  }
  wm::adam const d;  // framework defaults
  CHECK(d.beta1 == 0.9f);
  CHECK(d.beta2 == 0.999f);
  CHECK(d.eps == 1e-8f);
  CHECK(d.epsilon == wm::adam_epsilon::torch_adam);
  CHECK(d.needs_steps());
}

TEST_CASE("Adam's epsilon placement: the documented step-1 moves for g = 1e-6, lr = 1", "[host]") {
  // m = 1e-7, v = 1e-15, c1 = 0.1, c2 = 1e-3. torch form: 1e-6 / (1e-6 + 1e-8) = 0.990099;
  // SparseAdam form: sqrt(1e-3) / 0.1 * 1e-7 / (sqrt(1e-15) + 1e-8) = 0.759746.
  for (bool decoupled : {false, true}) {
    wm::adam a;
    a.decoupled = decoupled;
    double w = 0, s[2] = {0, 0};
    a.update(w, 1e-6, s, wm::update_step<double>{1.0, 1});
    CHECK(std::abs(-w - 1.0 / 1.01) < 1e-5);  // beta1/beta2 are floats: 0.9f, 0.999f
    a.epsilon = wm::adam_epsilon::sparse_adam;
    double w2 = 0, s2[2] = {0, 0};
    a.update(w2, 1e-6, s2, wm::update_step<double>{1.0, 1});
    double const want = std::sqrt(1e-3) / 0.1 * 1e-7 / (std::sqrt(1e-15) + 1e-8);
    CHECK(std::abs(-w2 - want) < 1e-5);
    CHECK(std::abs(want - 0.759746) < 1e-6);
  }
}

TEST_CASE("RMSProp and AdaGrad match torch's algorithms", "[host]") {
  for (float wd : {0.0f, 0.01f}) {
    wm::rmsprop r;
    r.weight_decay = wd;
    check(r,
          [&](double& w, double g, double* s, double lr, long) {
            reference::rmsprop(w, g, s[0], lr, r);
          },
          {1, 2, 3, 4});
    wm::adagrad a;
    a.weight_decay        = wd;
    a.initial_accumulator = 0.1f;
    check(a,
          [&](double& w, double g, double* s, double lr, long) {
            reference::adagrad(w, g, s[0], lr, a);
          },
          {1, 2, 3, 4});
  }
  CHECK(wm::rmsprop{}.alpha == 0.99f);
  CHECK(wm::adagrad{}.eps == 1e-10f);
}

namespace {
// A user-written optimizer: sign SGD with a momentum buffer that starts at 0.25, known to wm
// only through the concept.
struct signum {
  static constexpr char const* name = "signum";
  static constexpr int states       = 1;
  float momentum{0.5f};
  [[nodiscard]] constexpr bool needs_steps() const noexcept { return false; }
  [[nodiscard]] constexpr float initial_state() const noexcept { return 0.25f; }
  template <class F>
  WM_HOST_DEVICE void update(F& w, F g, F* s, wm::update_step<F> st) const noexcept {
    s[0] = static_cast<F>(momentum) * s[0] + g;
    w -= st.lr * static_cast<F>((s[0] > F{0}) - (s[0] < F{0}));
  }
};
struct not_an_optimizer {  // no needs_steps / initial_state
  static constexpr char const* name = "x";
  static constexpr int states       = 0;
  template <class F>
  void update(F&, F, F*, wm::update_step<F>) const noexcept {}
};
}  // namespace

TEST_CASE("policies supply what the table needs; a user-written optimizer satisfies the concept",
          "[host]") {
  STATIC_REQUIRE(wm::sparse_optimizer<signum>);
  STATIC_REQUIRE(!wm::sparse_optimizer<not_an_optimizer>);
  CHECK(wm::initial_state(signum{}) == 0.25f);
  CHECK(wm::initial_state(wm::adagrad{.eps = 1e-10f, .initial_accumulator = 0.3f}) == 0.3f);
  CHECK(wm::initial_state(wm::adam{}) == 0.0f);
  CHECK(!wm::sgd{}.needs_steps());
  wm::adam global;
  global.bias_correction = wm::adam_bias_correction::global_step;
  CHECK(!global.needs_steps());
  CHECK(wm::checkpoint_tag(signum{}).empty());
  CHECK(wm::checkpoint_tag(wm::adam{}) == "bias_correction=per_row epsilon=torch_adam");
  global.epsilon = wm::adam_epsilon::sparse_adam;
  CHECK(wm::checkpoint_tag(global) == "bias_correction=global_step epsilon=sparse_adam");
}

static_assert(wm::sparse_optimizer<wm::sgd> && wm::sparse_optimizer<wm::adam> &&
              wm::sparse_optimizer<wm::rmsprop> && wm::sparse_optimizer<wm::adagrad>);
static_assert(!wm::sparse_optimizer<wm::no_optimizer>);
