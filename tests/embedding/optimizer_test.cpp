// Host tests: each optimizer's update rule (float, as the GPU runs it, and double) against a
// float64 reference written out here from the frameworks' formulas; several steps, weight decay
// on and off, lazy (per-row step) and global-step Adam, AdamW.
#include "catch.hpp"

#include <wm/optimizer.hpp>

#include <cmath>
#include <random>
#include <vector>

namespace {

struct reference {  // plain double-precision formulas, PyTorch semantics
  static void sgd(double& w, double g, double lr, double wd) { w -= lr * (g + wd * w); }
  static void adam(double& w, double g, double& m, double& v, double lr, long t, wm::adam const& o)
  {
    if (o.decoupled) {
      w *= 1.0 - lr * o.weight_decay;
    } else {
      g += o.weight_decay * w;
    }
    m = o.beta1 * m + (1.0 - o.beta1) * g;
    v = o.beta2 * v + (1.0 - o.beta2) * g * g;
    double const bc1 = 1.0 - std::pow(static_cast<double>(o.beta1), static_cast<double>(t));
    double const bc2 = 1.0 - std::pow(static_cast<double>(o.beta2), static_cast<double>(t));
    w -= lr * std::sqrt(bc2) / bc1 * m / (std::sqrt(v) + o.eps);  // torch.optim.SparseAdam's form
  }
  static void rmsprop(double& w, double g, double& v, double lr, wm::rmsprop const& o)
  {
    g += o.weight_decay * w;
    v = o.alpha * v + (1.0 - o.alpha) * g * g;
    w -= lr * g / (std::sqrt(v) + o.eps);
  }
  static void adagrad(double& w, double g, double& s, double lr, wm::adagrad const& o)
  {
    g += o.weight_decay * w;
    s += g * g;
    w -= lr * g / (std::sqrt(s) + o.eps);
  }
};

bool close(double got, double want, double rel)
{
  return std::abs(got - want) <= rel * std::max(std::abs(want), 0.1);  // floor: values near 0 after cancellation
}

// Runs `steps` updates of one row with random gradients through the policy (float and double)
// and through `ref`, and compares.
template <class Opt, class Ref>
void check(Opt const& opt, Ref&& ref, int states, std::vector<long> const& ts)
{
  std::mt19937_64 rng{std::random_device{}()};
  std::uniform_real_distribution<double> d{-1.0, 1.0};
  for (int trial = 0; trial < 20; ++trial) {
    double const w0 = d(rng);
    double s0       = wm::initial_state(opt);
    double wr = w0, wd = w0;
    float wf = static_cast<float>(w0);
    std::vector<double> sr(2, s0), sd(2, s0);
    std::vector<float> sf(2, static_cast<float>(s0));
    for (std::size_t k = 0; k < ts.size(); ++k) {
      double const g  = d(rng) * (trial % 3 == 0 ? 1e-3 : 1.0);  // small gradients too
      double const lr = 0.01 * static_cast<double>(k + 1);
      ref(wr, g, sr.data(), lr, ts[k]);
      opt.update(wd, g, sd.data(), wm::update_step<double>{lr, ts[k]});
      opt.update(wf, static_cast<float>(g), sf.data(), wm::update_step<float>{static_cast<float>(lr), ts[k]});
      REQUIRE(close(wd, wr, 1e-12));
      REQUIRE(close(wf, wr, 1e-5));
      for (int i = 0; i < states; ++i) {
        REQUIRE(close(sd[i], sr[i], 1e-12));
        REQUIRE(close(sf[i], sr[i], 1e-5));
      }
    }
  }
}

}  // namespace

TEST_CASE("SGD matches the reference, with and without weight decay", "[host]")
{
  for (float wd : {0.0f, 0.01f}) {
    wm::sgd const o{wd};
    check(o, [&](double& w, double g, double*, double lr, long) { reference::sgd(w, g, lr, wd); }, 0, {1, 2, 3, 4, 5});
  }
}

TEST_CASE("Adam matches the reference: lazy and global steps, L2 and decoupled decay", "[host]")
{
  for (bool decoupled : {false, true}) {
    for (float wd : {0.0f, 0.02f}) {
      wm::adam o;
      o.weight_decay = wd;
      o.decoupled    = decoupled;
      auto ref = [&](double& w, double g, double* s, double lr, long t) { reference::adam(w, g, s[0], s[1], lr, t, o); };
      check(o, ref, 2, {1, 2, 3, 4, 5, 6});        // lazy: the row's own count
      o.bias_correction = wm::adam_bias_correction::global_step;
      check(o, ref, 2, {1, 3, 4, 9, 10, 30});      // global: the table's count skips steps
    }
  }
  // The float step itself, not only the weight after it, to 2e-6: 1 - 0.999^t computed as
  // 1 - powf(0.999f, t) lost 4 digits (3e-5 relative at t = 1) and made a GPU test miss 1e-5.
  std::mt19937_64 rng{std::random_device{}()};
  std::uniform_real_distribution<double> u{-1.0, 1.0};
  for (long t : {1L, 2L, 3L, 7L, 100L, 5000L}) {
    for (int trial = 0; trial < 50; ++trial) {
      wm::adam const a;
      // A row's first update, at step t (global-step Adam): zero moments, so the only
      // cancellation is in the bias corrections.
      double const g = static_cast<float>(u(rng));
      double wr = 0.0, sr[2] = {0.0, 0.0};
      reference::adam(wr, g, sr[0], sr[1], 0.01, t, a);
      float wf = 0.0f, sf[2] = {0.0f, 0.0f};
      a.update(wf, static_cast<float>(g), sf, wm::update_step<float>{0.01f, t});
      INFO("t " << t << ": float step " << wf << ", reference " << wr);
      REQUIRE(std::abs(wf - wr) <= 2e-6 * std::abs(wr) + 1e-12);
    }
  }
  wm::adam const d;  // framework defaults
  CHECK(d.beta1 == 0.9f);
  CHECK(d.beta2 == 0.999f);
  CHECK(d.eps == 1e-8f);
}

TEST_CASE("RMSProp and AdaGrad match the reference", "[host]")
{
  for (float wd : {0.0f, 0.01f}) {
    wm::rmsprop r;
    r.weight_decay = wd;
    check(r, [&](double& w, double g, double* s, double lr, long) { reference::rmsprop(w, g, s[0], lr, r); }, 1, {1, 2, 3, 4});
    wm::adagrad a;
    a.weight_decay        = wd;
    a.initial_accumulator = 0.1f;
    check(a, [&](double& w, double g, double* s, double lr, long) { reference::adagrad(w, g, s[0], lr, a); }, 1, {1, 2, 3, 4});
  }
  CHECK(wm::rmsprop{}.alpha == 0.99f);
  CHECK(wm::adagrad{}.eps == 1e-10f);
}

static_assert(wm::sparse_optimizer<wm::sgd> && wm::sparse_optimizer<wm::adam> && wm::sparse_optimizer<wm::rmsprop> &&
              wm::sparse_optimizer<wm::adagrad>);
static_assert(!wm::sparse_optimizer<wm::no_optimizer>);
