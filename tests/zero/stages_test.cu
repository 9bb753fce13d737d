// SPDX-License-Identifier: Apache-2.0
// GPU tests of wm::zero_optimizer (the zero_test program): stages 1-3 with Adam and SGD, and
// with Adam offloaded to the host, against float64 data-parallel mixed-precision training (the
// reference below), on an awkward model and a tiny one, with and without clipping
// and a skipped inf step; gradient accumulation over micro-batches equals one batch of the
// summed gradients bit for bit, stages 1-3, with and without offload_host.
// Every case is [ranked]: it runs inside every rank (tests/support/ranks.hpp), with one rank
// (ctest zero_ranked_gpu) and with one rank per GPU (zero_ranked_multi_gpu), so the same code
// checks world 1 and world N.
#include <wm/zero.cuh>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "catch.hpp"
#include "ranks.hpp"
#include "zero_common.cuh"
#include "zero_model.cuh"

// A stage and an optimizer (in a named namespace: nvcc's kernel stubs name template arguments
// through it, which an anonymous namespace breaks).
namespace zero_cases {
template <class Stage, class Opt, class Off = wm::no_offload>
struct combo {
  using stage     = Stage;
  using optimizer = Opt;
  using offload   = Off;
};
}  // namespace zero_cases

using namespace zero_cases;

namespace {

// The reference is plain data-parallel mixed-precision training in float64 on the host, written
// from the documented semantics, not from wm's code: every rank's gradients summed and divided by
// the rank count (DDP), divided by the loss scale (GradScaler.unscale_), an inf/NaN anywhere
// skips the step (GradScaler.step) without counting it, clipping as
// torch.nn.utils.clip_grad_norm_ (one L2 norm over every parameter; coef = max / (norm + 1e-6),
// clamped to 1), then torch.optim.AdamW / torch.optim.SGD as their documentation writes the
// update.
struct ref_adamw {  // torch.optim.AdamW's documented algorithm (amsgrad off, maximize off)
  double b1{0.9}, b2{0.999}, eps{1e-8}, wd{0.01};
  void update(double& w, double g, double& m, double& v, double, std::int64_t t, double lr) const {
    w -= lr * wd * w;
    m               = b1 * m + (1 - b1) * g;
    v               = b2 * v + (1 - b2) * g * g;
    double const mh = m / (1 - std::pow(b1, static_cast<double>(t)));
    double const vh = v / (1 - std::pow(b2, static_cast<double>(t)));
    w -= lr * mh / (std::sqrt(vh) + eps);
  }
};

struct ref_sgd {  // torch.optim.SGD without momentum: g += wd w; w -= lr g
  double wd{0.001};
  void update(double& w, double g, double&, double&, double, std::int64_t, double lr) const {
    g += wd * w;
    w -= lr * g;
  }
};

template <class O>
auto make_reference() {
  if constexpr (std::is_same_v<O, wm::adam>) {
    return ref_adamw{};
  } else {
    return ref_sgd{};
  }
}

// The compute weights of every parameter must be the reference rounded to the compute type
// (within one unit in the last place: the fp32 master differs from float64 by ~1e-7).
void check_weights(std::vector<double> const& got, std::vector<double> const& want,
                   zero_element_type type, std::string const& name, int step) {
  REQUIRE(got.size() == want.size());
  double const rel = type == zero_element_type::f32 ? 1e-6 : std::ldexp(1.0, -8);
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO("parameter " << name << " element " << i << " after step " << step);
    REQUIRE(std::abs(got[i] - want[i]) <= rel * std::abs(want[i]) + 2e-5);
  }
}

}  // namespace

TEMPLATE_PRODUCT_TEST_CASE("zero_optimizer equals float64 data-parallel mixed precision",
                           "[ranked]", zero_cases::combo,
                           ((wm::zero_stage<1>, wm::adam), (wm::zero_stage<1>, wm::sgd),
                            (wm::zero_stage<2>, wm::adam), (wm::zero_stage<2>, wm::sgd),
                            (wm::zero_stage<3>, wm::adam), (wm::zero_stage<3>, wm::sgd),
                            (wm::zero_stage<1>, wm::adam, wm::offload_host),
                            (wm::zero_stage<2>, wm::adam, wm::offload_host),
                            (wm::zero_stage<3>, wm::adam, wm::offload_host))) {
  using stage_t   = typename TestType::stage;
  using opt_t     = typename TestType::optimizer;
  using offload_t = typename TestType::offload;
  auto& comm      = wm_test::comm();
  stream_holder s;
  int const world          = comm.size();
  std::uint64_t const seed = shared_seed(comm);
  int const which          = GENERATE(0, 1);  // the awkward model, one tiny tensor
  bool const clip          = GENERATE(false, true);
  bool const with_inf      = GENERATE(false, true);
  INFO("model " << which << " clip " << clip << " inf " << with_inf << " world " << world);
  auto const mp           = model(which);
  auto const params       = zero_params(mp);
  double const loss_scale = 8;
  wm::zero_options options;
  options.loss_scale    = static_cast<float>(loss_scale);
  options.max_grad_norm = clip ? 0.05f : 0.0f;  // small enough to clip every step
  if constexpr (stage_t::value == 3) {
    if (which == 0) { options.groups = {{0, 1}, {2, 3, 4}, {5, 6}, {7}}; }
  }
  // 1 KiB buckets: several buckets, w1 (4 KiB) in one of its own.
  wm::zero_optimizer<stage_t, opt_t, offload_t> opt{comm, params, 1024, make_optimizer<opt_t>(),
                                                    options};
  auto const& plan = opt.layout();
  REQUIRE(opt.parameters() == mp.size());

  // Initial weights: bf16/fp32 values from the seed, the same on every rank.
  std::vector<std::vector<double>> ref(mp.size()), m(mp.size()), v(mp.size());
  std::mt19937_64 rng{seed};
  std::uniform_real_distribution<double> u(-1, 1);
  for (std::size_t p = 0; p < mp.size(); ++p) {
    std::size_t const n = elements_of(mp[p]);
    ref[p].resize(n);
    m[p].assign(n, 0.0);
    v[p].assign(n, 0.0);
    for (auto& x : ref[p]) {
      x = mp[p].type == zero_element_type::f32 ? static_cast<double>(static_cast<float>(u(rng)))
                                               : to_double(__double2bfloat16(u(rng)));
    }
    set_weights_from(opt, p, mp[p].type, ref[p], s);
    comm.synchronize(s);
  }
  auto const reference = make_reference<opt_t>();
  std::int64_t applied = 0;
  int const steps      = 4;
  int const inf_step   = with_inf ? 1 : -1;  // on the last rank only: every rank must skip

  auto read_all = [&](int step) {
    for (std::size_t p = 0; p < mp.size(); ++p) {
      if constexpr (stage_t::value < 3) {
        auto got =
            read_typed(mp[p].type, weights_ptr(opt, p, mp[p].type), ref[p].size(), comm, s.s);
        check_weights(got, ref[p], mp[p].type, mp[p].name, step);
      }
    }
    if constexpr (stage_t::value == 3) {
      // Forward order, as a forward pass gathers (the next group is prefetched).
      for (std::size_t g = 0; g < opt.groups(); ++g) {
        opt.gather(g, s);
        auto const& members =
            options.groups.empty() ? std::vector<std::size_t>{g} : options.groups[g];
        for (auto p : members) {
          auto got =
              read_typed(mp[p].type, weights_ptr(opt, p, mp[p].type), ref[p].size(), comm, s.s);
          check_weights(got, ref[p], mp[p].type, mp[p].name, step);
        }
        opt.release(g);
      }
      // A parameter that is not gathered cannot be read.
      for (std::size_t p = 0; p < mp.size(); ++p) {
        if (opt.bucket_of(p) != wm::detail::zero::no_bucket) {
          REQUIRE_THROWS_AS(weights_ptr(opt, p, mp[p].type), wm::logic_error);
        }
      }
    }
    // The fp32 master weights of this rank's shard: the reference itself (float vs float64);
    // padding stays zero.
    std::vector<float> master(plan.state_elements);
    comm.synchronize(s);
    WM_CUDA_TRY(cudaMemcpyAsync(master.data(), opt.master_shard(), master.size() * sizeof(float),
                                cudaMemcpyDefault, s.s));  // device, or pinned host (offload)
    comm.synchronize(s);
    std::vector<char> covered(master.size(), 0);
    for (auto const& f : plan.fragments(comm.rank())) {
      for (std::size_t j = 0; j < f.elements; ++j) {
        double const want = ref[f.param][f.param_offset + j];
        INFO("master of " << mp[f.param].name << "[" << f.param_offset + j << "] after step "
                          << step);
        REQUIRE(std::abs(master[f.state_offset + j] - want) <= 1e-5 * (1 + std::abs(want)));
        covered[f.state_offset + j] = 1;
      }
    }
    for (std::size_t i = 0; i < master.size(); ++i) {
      if (covered[i] == 0) { REQUIRE(master[i] == 0.0f); }
    }
  };

  for (int t = 0; t < steps; ++t) {
    double const lr = 0.05 * (1 + t);
    // Backward: gradients bucket by bucket (bucket 0 holds the last parameters), each bucket
    // reduced as soon as it is written.
    for (std::size_t b = 0; b < opt.buckets(); ++b) {
      for (auto p : plan.buckets[b].params) {
        auto g = grad_values(seed, t, comm.rank(), p, ref[p].size(), loss_scale);
        if (t == inf_step && comm.rank() == world - 1 && p == plan.buckets[b].params.front()) {
          g[g.size() / 2] = std::numeric_limits<double>::infinity();
        }
        write_typed(mp[p].type, gradients_ptr(opt, p, mp[p].type), g, comm, s.s);
      }
      opt.reduce_gradients(b, s);
    }
    opt.step(static_cast<float>(lr), s);
    bool const skipped = opt.last_step_skipped(s);
    REQUIRE(skipped == (t == inf_step));
    if (t != inf_step) {
      // The reference: DDP average, unscale, global norm, clip, update.
      std::vector<std::vector<double>> G(mp.size());
      double sumsq = 0;
      for (std::size_t p = 0; p < mp.size(); ++p) {
        G[p].resize(ref[p].size());
        for (std::size_t i = 0; i < G[p].size(); ++i) {
          double sum = 0;
          for (int r = 0; r < world; ++r) { sum += grad_value(seed, t, r, p, i, loss_scale); }
          G[p][i] = sum / world / loss_scale;
          sumsq += G[p][i] * G[p][i];
        }
      }
      double coef = 1;
      if (clip) { coef = std::min(1.0, options.max_grad_norm / (std::sqrt(sumsq) + 1e-6)); }
      ++applied;
      for (std::size_t p = 0; p < mp.size(); ++p) {
        for (std::size_t i = 0; i < G[p].size(); ++i) {
          reference.update(ref[p][i], G[p][i] * coef, m[p][i], v[p][i], 0.0, applied, lr);
        }
      }
    }
    REQUIRE(opt.applied_steps(s) == applied);
    read_all(t);
  }
}

TEMPLATE_PRODUCT_TEST_CASE(
    "zero_optimizer gradient accumulation equals one batch of the summed "
    "gradients bit for bit",
    "[ranked]", zero_cases::combo,
    ((wm::zero_stage<1>, wm::adam), (wm::zero_stage<2>, wm::adam), (wm::zero_stage<3>, wm::adam),
     (wm::zero_stage<1>, wm::adam, wm::offload_host),
     (wm::zero_stage<2>, wm::adam, wm::offload_host),
     (wm::zero_stage<3>, wm::adam, wm::offload_host))) {
  // Optimizer a takes 3 micro-batches per step (accumulate_gradients, accumulate_gradients,
  // reduce_gradients); optimizer b one batch whose gradients are their exact sum. Gradients are
  // k / 64 · loss scale with |k| <= 10: every sum over 3 micro-batches and up to 8 ranks (at
  // most 240 / 64) is exact in bf16, so the two must agree bit for bit: weights (poisoned before
  // each step, stages 1-2), master weights and moments.
  using stage_t   = typename TestType::stage;
  using offload_t = typename TestType::offload;
  using opt_t     = wm::zero_optimizer<stage_t, wm::adam, offload_t>;
  auto& comm      = wm_test::comm();
  stream_holder s;
  std::uint64_t const seed = shared_seed(comm);
  INFO("world " << comm.size());
  auto const mp           = model(0);
  auto const params       = zero_params(mp);
  double const loss_scale = 8;
  wm::zero_options options;
  options.loss_scale            = static_cast<float>(loss_scale);
  options.gradient_accumulation = true;
  if constexpr (stage_t::value == 1) {
    // Stage 1 keeps the sum in a shard of its own, only when asked to.
    opt_t plain{comm, params, 1024, make_optimizer<wm::adam>(), wm::zero_options{}};
    REQUIRE_THROWS_AS(plain.accumulate_gradients(0, s), wm::logic_error);
  }
  opt_t a{comm, params, 1024, make_optimizer<wm::adam>(), options};
  opt_t b{comm, params, 1024, make_optimizer<wm::adam>(), options};
  if constexpr (stage_t::value == 1) {
    REQUIRE(a.memory().buffers == a.layout().arena_bytes / static_cast<std::size_t>(comm.size()));
  }
  set_same_random_weights(a, b, mp, seed, comm, s);
  // Gradient of micro-batch mb: k in [-10, 10].
  auto grad = [&](int t, int mb, std::size_t p, std::size_t i) {
    auto const k = static_cast<int>(mix(seed ^
                                        mix(t * 7919ull + comm.rank() * 104729ull +
                                            p * 15485863ull + mb * 32452843ull) ^
                                        (i * 0x9E3779B97F4A7C15ull)) %
                                    21) -
                   10;
    return k / 64.0 * loss_scale;
  };
  int const micro  = 3;
  auto const& plan = a.layout();
  for (int t = 0; t < 4; ++t) {
    INFO("step " << t);
    for (int mb = 0; mb < micro; ++mb) {
      for (std::size_t bk = 0; bk < a.buckets(); ++bk) {
        for (auto p : plan.buckets[bk].params) {
          std::vector<double> g(elements_of(mp[p]));
          for (std::size_t i = 0; i < g.size(); ++i) { g[i] = grad(t, mb, p, i); }
          write_typed(mp[p].type, gradients_ptr(a, p, mp[p].type), g, comm, s.s);
        }
        if (mb + 1 < micro) {
          a.accumulate_gradients(bk, s);
        } else {
          a.reduce_gradients(bk, s);
        }
      }
      if (mb == 0 && t == 0) {  // a step with a bucket still accumulating is refused
        REQUIRE_THROWS_AS(a.step(0.05f, s), wm::logic_error);
      }
    }
    for (std::size_t bk = 0; bk < b.buckets(); ++bk) {
      for (auto p : plan.buckets[bk].params) {
        std::vector<double> g(elements_of(mp[p]), 0.0);
        for (std::size_t i = 0; i < g.size(); ++i) {
          for (int mb = 0; mb < micro; ++mb) { g[i] += grad(t, mb, p, i); }
        }
        write_typed(mp[p].type, gradients_ptr(b, p, mp[p].type), g, comm, s.s);
      }
      b.reduce_gradients(bk, s);
    }
    // Poison: the step rewrites every compute weight. Not before the first step: after
    // set_weights the masters are taken from the compute weights at the next step (documented),
    // so that step would start from the poison.
    if (stage_t::value < 3 && t > 0) { poison_weights(a, b, mp, comm, s); }
    a.step(0.05f, s);
    b.step(0.05f, s);
    REQUIRE_FALSE(a.last_step_skipped(s));
    REQUIRE(a.applied_steps(s) == t + 1);
    require_same_weights(a, b, mp, comm, s);
    require_same_shards(a, b, comm, s, false, 0u, 0u);  // read by cudaMemcpy, buffers zeroed
  }
}
