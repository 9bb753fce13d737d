// SPDX-License-Identifier: Apache-2.0
// Host tests: the CPU Adam of the ZeRO offload against a float64 reference transcribed from the
// pseudo-code in PyTorch's documentation of torch.optim.AdamW (decoupled weight decay) and
// torch.optim.Adam (L2 weight decay), for every instruction set this CPU has, fp32 and bf16
// gradients, sizes 0, 1, 15, 17, 1000003, many steps of fresh gradients from 1e-6 to 1. Each
// step's reference starts from the fp32 state the code under test holds, so the error measured
// is that of one step; the bf16 copy must be the fp32 result rounded to nearest even.
#include <wm/detail/zero/cpu_adam.hpp>
#include <wm/detail/zero/serial_worker.hpp>
#include <wm/detail/zero/thread_pool.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <thread>
#include <type_traits>
#include <vector>

#include "catch.hpp"

namespace z = wm::detail::zero;

namespace {

// torch.optim.AdamW / torch.optim.Adam, one element, in double (the documentation's pseudo-code):
//   AdamW: θ ← θ − γλθ          Adam: g ← g + λθ (when λ ≠ 0)
//   m ← β1 m + (1 − β1) g ;  v ← β2 v + (1 − β2) g²
//   m̂ ← m / (1 − β1^t) ;  v̂ ← v / (1 − β2^t) ;  θ ← θ − γ m̂ / (sqrt(v̂) + ε)
struct ref_result {
  double w, m, v;
  double w_scale, m_scale;  // magnitude of the terms (for a cancellation-aware relative error)
};
ref_result reference(double w, double m, double v, double g, z::cpu_adam_options const& o,
                     double lr, long t) {
  double const b1 = o.beta1, b2 = o.beta2, wd = o.weight_decay, eps = o.eps;
  double const w0 = w;
  if (o.decoupled) {
    w = w - lr * wd * w;
  } else if (wd != 0.0) {
    g = g + wd * w;
  }
  double const m_new = b1 * m + (1.0 - b1) * g;
  double const v_new = b2 * v + (1.0 - b2) * g * g;
  double const m_hat = m_new / (1.0 - std::pow(b1, static_cast<double>(t)));
  double const v_hat = v_new / (1.0 - std::pow(b2, static_cast<double>(t)));
  double const upd   = lr * m_hat / (std::sqrt(v_hat) + eps);
  return {w - upd, m_new, v_new, std::abs(w0) + std::abs(upd),
          b1 * std::abs(m) + (1.0 - b1) * std::abs(g)};
}

// bf16 round to nearest, ties to even, written from the definition: the two bf16 neighbours of
// x (its bits truncated, and the next one away from zero), the nearer in double, ties to the
// one with an even last bit.
std::uint16_t bf16_rne(float x) {
  if (std::isnan(x)) { return 0x7fc0; }
  std::uint32_t b;
  std::memcpy(&b, &x, 4);
  auto const lo_bits = static_cast<std::uint16_t>(b >> 16);
  auto const hi_bits = static_cast<std::uint16_t>(lo_bits + 1);
  auto value         = [](std::uint16_t h) {
    std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return static_cast<double>(f);
  };
  if ((b & 0xffffu) == 0) { return lo_bits; }
  if ((hi_bits & 0x7f80u) == 0x7f80u) {  // the upper neighbour is infinity
    double const max_b = value(lo_bits);
    double const ulp   = max_b - value(static_cast<std::uint16_t>(lo_bits - 1));
    return std::abs(static_cast<double>(x)) - std::abs(max_b) < std::abs(ulp) / 2 ? lo_bits
                                                                                  : hi_bits;
  }
  double const d_lo = std::abs(static_cast<double>(x) - value(lo_bits));
  double const d_hi = std::abs(value(hi_bits) - static_cast<double>(x));
  if (d_lo < d_hi) { return lo_bits; }
  if (d_hi < d_lo) { return hi_bits; }
  return (lo_bits & 1u) == 0 ? lo_bits : hi_bits;
}

float from_bf16(std::uint16_t h) {
  std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

std::vector<z::cpu_isa> supported_isas() {
  std::vector<z::cpu_isa> out;
  for (auto isa : {z::cpu_isa::scalar, z::cpu_isa::avx2, z::cpu_isa::avx512}) {
    if (z::cpu_supports(isa)) { out.push_back(isa); }
  }
  return out;
}

struct errors {
  double w = 0, m = 0, v = 0;
  double raw_w              = 0;  // without the sensitivity allowance
  std::size_t bf16_mismatch = 0;
};

template <class Grad>
errors run_steps(z::cpu_isa isa, z::thread_pool& pool, std::size_t n, z::cpu_adam_options const& o,
                 float lr, float grad_scale, long t0, int steps, bool zero_start,
                 std::mt19937_64& rng) {
  std::uniform_real_distribution<float> unit{-1.0f, 1.0f};
  std::uniform_real_distribution<double> expo{-6.0, 0.0};
  std::vector<float> w(n), m(n), v(n), gf(n);
  std::vector<Grad> g(n);
  std::vector<std::uint16_t> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    w[i] = unit(rng);
    m[i] = zero_start ? 0.0f : 0.1f * unit(rng);
    v[i] = zero_start ? 0.0f : 0.01f * std::abs(unit(rng));
  }
  errors e;
  for (int s = 0; s < steps; ++s) {
    long const t = t0 + s;
    for (std::size_t i = 0; i < n; ++i) {  // |g| from 1e-6 to 1, either sign
      float const mag = static_cast<float>(std::pow(10.0, expo(rng)));
      float const x   = (rng() & 1) ? mag : -mag;
      if constexpr (std::is_same_v<Grad, float>) {
        g[i]  = x;
        gf[i] = x;
      } else {
        g[i]  = bf16_rne(x);
        gf[i] = from_bf16(g[i]);
      }
      out[i] = 0xffff;  // poison
    }
    std::vector<float> const w0 = w, m0 = m, v0 = v;
    z::cpu_adam_update(
        o, z::cpu_adam_step{lr, t, grad_scale},
        z::cpu_adam_arrays<Grad>{w.data(), m.data(), v.data(), g.data(), out.data(), n}, pool, isa);
    for (std::size_t i = 0; i < n; ++i) {
      // The gradient the update sees is an fp32 value in any fp32 implementation (scaled, plus
      // the L2 term for Adam); where its terms cancel, one rounding of it moves the exact result
      // a lot. That sensitivity (the reference at g ± one fp32 ulp of its terms) is allowed on
      // top of the error bound; everything else must be far below 1e-6 of the terms' size.
      double const gi = static_cast<double>(gf[i]) * static_cast<double>(grad_scale);
      double const wd_term =
          o.decoupled ? 0.0 : std::abs(static_cast<double>(o.weight_decay) * w0[i]);
      double const ulp = std::ldexp(std::abs(gi) + wd_term, -23);
      auto const r     = reference(w0[i], m0[i], v0[i], gi, o, lr, t);
      auto const rp    = reference(w0[i], m0[i], v0[i], gi + ulp, o, lr, t);
      auto const rm    = reference(w0[i], m0[i], v0[i], gi - ulp, o, lr, t);
      auto excess      = [](double got, double want, double a, double b, double scale) {
        double const sens = std::max(std::abs(a - want), std::abs(b - want));
        return std::max(0.0, std::abs(got - want) - 2.0 * sens) / std::max(scale, 1e-30);
      };
      double const m_scale = r.m_scale + (1.0 - o.beta1) * wd_term;
      e.w                  = std::max(e.w, excess(w[i], r.w, rp.w, rm.w, r.w_scale));
      e.m                  = std::max(e.m, excess(m[i], r.m, rp.m, rm.m, m_scale));
      e.v                  = std::max(e.v, excess(v[i], r.v, rp.v, rm.v, r.v));
      e.raw_w              = std::max(e.raw_w, std::abs(w[i] - r.w) / r.w_scale);
      e.bf16_mismatch += out[i] != bf16_rne(w[i]);
    }
  }
  return e;
}

}  // namespace

TEST_CASE("cpu adam: every ISA against the float64 torch AdamW / Adam reference", "[host]") {
  std::mt19937_64 rng{std::random_device{}()};
  z::thread_pool pool2{2};
  z::thread_pool pool3{3};
  for (auto isa : supported_isas()) {
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{15}, std::size_t{17},
                          std::size_t{4096 * 3 + 77}, std::size_t{1000003}}) {
      for (int variant = 0; variant < 4; ++variant) {
        bool const decoupled = (variant & 1) == 0;
        bool const bf16_grad = (variant & 2) != 0;
        z::cpu_adam_options o;
        o.decoupled            = decoupled;
        o.beta1                = (rng() & 1) ? 0.9f : 0.8f;
        o.beta2                = (rng() & 1) ? 0.999f : 0.95f;
        o.eps                  = (rng() & 1) ? 1e-8f : 1e-6f;
        o.weight_decay         = std::array<float, 3>{0.0f, 1e-2f, 0.1f}[rng() % 3];
        float const lr         = std::array<float, 3>{1e-3f, 1e-2f, 0.1f}[rng() % 3];
        float const grad_scale = (rng() & 1) ? 1.0f : 0.37f;
        bool const zero_start  = (rng() & 1) != 0;
        long const t0          = zero_start ? 1 : 1 + static_cast<long>(rng() % 5000);
        int const steps        = n > 100000 ? 4 : 25;
        auto& pool             = (rng() & 1) ? pool2 : pool3;
        INFO(z::name_of(isa) << ", n " << n << (decoupled ? ", AdamW" : ", Adam")
                             << (bf16_grad ? ", bf16" : ", fp32") << " gradients, b1 " << o.beta1
                             << ", b2 " << o.beta2 << ", eps " << o.eps << ", wd " << o.weight_decay
                             << ", lr " << lr << ", scale " << grad_scale << ", t0 " << t0
                             << ", threads " << pool.size());
        auto const e = bf16_grad ? run_steps<z::bf16_bits>(isa, pool, n, o, lr, grad_scale, t0,
                                                           steps, zero_start, rng)
                                 : run_steps<float>(isa, pool, n, o, lr, grad_scale, t0, steps,
                                                    zero_start, rng);
        INFO("max errors: w " << e.w << " (raw " << e.raw_w << "), m " << e.m << ", v " << e.v);
        CHECK(e.w < 1e-6);
        CHECK(e.m < 1e-6);
        CHECK(e.v < 1e-6);
        CHECK(e.bf16_mismatch == 0);
        if (n == 1000003 && variant == 0) {
          WARN(z::name_of(isa) << ": max relative error per step w " << e.w << " (raw " << e.raw_w
                               << "), m " << e.m << ", v " << e.v);
        }
      }
    }
  }
}

TEST_CASE("cpu adam: bf16 copy rounds to nearest even on every ISA", "[host]") {
  // lr = 0 and no weight decay leave the master weights as they are: the bf16 copy is then the
  // conversion alone, on values chosen for it (ties both ways, the largest float, infinities,
  // NaN, subnormals, signed zeros) and random ones.
  std::vector<std::uint32_t> bits{0x3f808000u, 0x3f818000u, 0x3f807fffu, 0x3f808001u, 0x7f7fffffu,
                                  0xff7fffffu, 0x7f7f7fffu, 0x7f800000u, 0xff800000u, 0x7fc00001u,
                                  0xffffffffu, 0x00000001u, 0x00018000u, 0x80000000u, 0x00000000u,
                                  0x7f7f8000u, 0xbf808000u};
  std::mt19937_64 rng{std::random_device{}()};
  while (bits.size() < 1000) { bits.push_back(static_cast<std::uint32_t>(rng())); }
  std::size_t const n = bits.size();
  z::thread_pool pool{2};
  for (auto isa : supported_isas()) {
    std::vector<float> w(n), m(n, 0.0f), v(n, 0.0f), g(n, 0.5f);
    std::vector<std::uint16_t> out(n, 0x1234);
    for (std::size_t i = 0; i < n; ++i) { std::memcpy(&w[i], &bits[i], 4); }
    z::cpu_adam_options o;
    o.weight_decay = 0.0f;
    z::cpu_adam_update(
        o, z::cpu_adam_step{0.0f, 1, 1.0f},
        z::cpu_adam_arrays<float>{w.data(), m.data(), v.data(), g.data(), out.data(), n}, pool,
        isa);
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < n; ++i) {
      float f;
      std::memcpy(&f, &bits[i], 4);
      bool const same_w = std::isnan(f) ? std::isnan(w[i]) : std::memcmp(&w[i], &f, 4) == 0;
      if (!same_w || out[i] != bf16_rne(f)) {
        ++wrong;
        if (wrong < 5) { UNSCOPED_INFO(std::hex << "bits " << bits[i] << " -> " << out[i]); }
      }
    }
    INFO(z::name_of(isa));
    CHECK(wrong == 0);
  }
}

TEST_CASE("cpu adam: no bf16 copy, a null copy pointer and bad input", "[host]") {
  z::thread_pool pool{2};
  std::vector<float> w(100, 0.5f), m(100, 0.0f), v(100, 0.0f), g(100, 0.25f);
  z::cpu_adam_options o;
  z::cpu_adam_update(
      o, z::cpu_adam_step{1e-3f, 1, 1.0f},
      z::cpu_adam_arrays<float>{w.data(), m.data(), v.data(), g.data(), nullptr, 100}, pool);
  // Step 1 from zero moments: m̂ = g, v̂ = g², so θ = 0.5 (1 − 1e-5) − 1e-3 · g/(|g| + ε).
  CHECK(w[0] == Catch::Approx(0.5 * (1 - 1e-5) - 1e-3 * 0.25 / (0.25 + 1e-8)).epsilon(1e-7));
  CHECK(w[99] == w[0]);
  CHECK_THROWS_AS(
      z::cpu_adam_update(
          o, z::cpu_adam_step{1e-3f, 0, 1.0f},
          z::cpu_adam_arrays<float>{w.data(), m.data(), v.data(), g.data(), nullptr, 100}, pool),
      wm::logic_error);
  CHECK_THROWS_AS(
      z::cpu_adam_update(
          o, z::cpu_adam_step{},
          z::cpu_adam_arrays<float>{w.data(), m.data(), v.data(), nullptr, nullptr, 100}, pool),
      wm::logic_error);
}

TEST_CASE("cpu adam: separate outputs equal the in-place update bit for bit", "[host]") {
  // The offload pipeline writes each step's master weights and moments to a second copy (read
  // from the first, which stays as it was). Aligned outputs take the streaming stores, outputs
  // one element off 64 bytes the plain ones; both must equal the in-place result exactly.
  std::mt19937_64 rng{std::random_device{}()};
  std::uniform_real_distribution<float> unit{-1.0f, 1.0f};
  z::thread_pool pool{3};
  for (auto isa : supported_isas()) {
    for (std::size_t n : {std::size_t{1}, std::size_t{33}, std::size_t{4096 * 5 + 19}}) {
      for (std::size_t shift : {std::size_t{0}, std::size_t{1}}) {
        for (bool bf16_grad : {false, true}) {
          INFO(z::name_of(isa) << ", n " << n << ", shift " << shift << ", bf16 grad "
                               << bf16_grad);
          std::size_t const pad = 64;  // 64 floats: the vectors' 64-byte alignment is kept
          std::vector<float> w(n), m(n), v(n), g(n);
          std::vector<std::uint16_t> g16(n);
          for (std::size_t i = 0; i < n; ++i) {
            w[i]   = unit(rng);
            m[i]   = 0.1f * unit(rng);
            v[i]   = 0.01f * std::abs(unit(rng));
            g[i]   = unit(rng);
            g16[i] = bf16_rne(g[i]);
          }
          // Separate outputs in over-aligned storage, at offset `shift` elements, poisoned.
          std::vector<float> wo(n + pad, std::numeric_limits<float>::quiet_NaN()), mo = wo, vo = wo;
          auto align = [&](std::vector<float>& x) {
            auto const at = reinterpret_cast<std::uintptr_t>(x.data());
            return x.data() + (64 - at % 64) % 64 / 4 + shift;
          };
          float *const wp = align(wo), *const mp = align(mo), *const vp = align(vo);
          std::vector<std::uint16_t> out_in(n, 0xffff), out_sep(n + pad, 0xffff);
          std::uint16_t* const op =
              out_sep.data() +
              (64 - reinterpret_cast<std::uintptr_t>(out_sep.data()) % 64) % 64 / 2 + shift;
          std::vector<float> const w0 = w, m0 = m, v0 = v;
          z::cpu_adam_options o;
          z::cpu_adam_step const st{1e-2f, 7, 0.5f};
          if (bf16_grad) {
            z::cpu_adam_update(o, st,
                               z::cpu_adam_arrays<z::bf16_bits>{w.data(), m.data(), v.data(),
                                                                g16.data(), op, n, wp, mp, vp},
                               pool, isa);
          } else {
            z::cpu_adam_update(o, st,
                               z::cpu_adam_arrays<float>{w.data(), m.data(), v.data(), g.data(), op,
                                                         n, wp, mp, vp},
                               pool, isa);
          }
          CHECK(std::memcmp(w.data(), w0.data(), n * 4) == 0);  // inputs untouched
          CHECK(std::memcmp(m.data(), m0.data(), n * 4) == 0);
          CHECK(std::memcmp(v.data(), v0.data(), n * 4) == 0);
          if (bf16_grad) {
            z::cpu_adam_update(o, st,
                               z::cpu_adam_arrays<z::bf16_bits>{w.data(), m.data(), v.data(),
                                                                g16.data(), out_in.data(), n},
                               pool, isa);
          } else {
            z::cpu_adam_update(
                o, st,
                z::cpu_adam_arrays<float>{w.data(), m.data(), v.data(), g.data(), out_in.data(), n},
                pool, isa);
          }
          CHECK(std::memcmp(w.data(), wp, n * 4) == 0);
          CHECK(std::memcmp(m.data(), mp, n * 4) == 0);
          CHECK(std::memcmp(v.data(), vp, n * 4) == 0);
          CHECK(std::memcmp(out_in.data(), op, n * 2) == 0);
          CHECK(std::isnan(wp[n]));  // nothing written past the end
          CHECK(op[n] == 0xffff);
        }
      }
    }
  }
  std::vector<float> w(8), m(8), v(8), g(8);
  CHECK_THROWS_AS(
      z::cpu_adam_update(z::cpu_adam_options{}, z::cpu_adam_step{},
                         z::cpu_adam_arrays<float>{w.data(), m.data(), v.data(), g.data(), nullptr,
                                                   8, w.data(), nullptr, v.data()},
                         pool),
      wm::logic_error);
}

TEST_CASE("thread pool runs every task once and passes exceptions on", "[host]") {
  z::thread_pool pool{3};
  for (bool claimed : {false, true}) {
    DYNAMIC_SECTION((claimed ? "run_claimed" : "run")) {
      auto const run = [&](std::size_t tasks, auto&& fn) {
        if (claimed) {
          pool.run_claimed(tasks, fn);
        } else {
          pool.run(tasks, fn);
        }
      };
      for (std::size_t tasks :
           {std::size_t{0}, std::size_t{1}, std::size_t{2}, std::size_t{7}, std::size_t{100}}) {
        std::vector<std::atomic<int>> hits(tasks);
        std::vector<std::thread::id> by(tasks);
        for (int round = 0; round < 50; ++round) {
          run(tasks, [&](std::size_t t) {
            hits[t].fetch_add(1);
            by[t] = std::this_thread::get_id();
          });
          if (!claimed) {  // task k on thread k mod 3: tasks 0, 3, 6, ... on the caller's
            for (std::size_t t = 0; t < tasks; t += 3) {
              CHECK(by[t] == std::this_thread::get_id());
            }
          }
        }
        for (auto const& h : hits) { CHECK(h.load() == 50); }
      }
      // A task that blocks its thread: with run_claimed the other threads take the rest.
      if (claimed) {
        std::atomic<int> done{0};
        bool timed_out = false;
        run(40, [&](std::size_t t) {
          if (t != 0) {
            done.fetch_add(1);
            return;
          }
          auto const deadline = std::chrono::steady_clock::now() + std::chrono::seconds{10};
          while (done.load() < 39) {  // a static split would leave tasks 3, 6, ... to this thread
            if (std::chrono::steady_clock::now() > deadline) {
              timed_out = true;
              return;
            }
            std::this_thread::yield();
          }
        });
        CHECK_FALSE(timed_out);
        CHECK(done.load() == 39);
      }
      CHECK_THROWS_AS(run(5,
                          [](std::size_t t) {
                            if (t == 3) { throw std::runtime_error{"task 3"}; }
                          }),
                      std::runtime_error);
      int after = 0;
      run(1, [&](std::size_t) { ++after; });  // still usable
      CHECK(after == 1);
    }
  }
}

#if defined(__linux__)
namespace {
// The calling thread's affinity mask, CPUs in increasing order.
std::vector<int> thread_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  REQUIRE(pthread_getaffinity_np(pthread_self(), sizeof set, &set) == 0);
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) { cpus.push_back(c); }
  }
  return cpus;
}
}  // namespace

TEST_CASE("thread pool: default size, pinned workers on one CPU each, the caller unpinned",
          "[host]") {
  auto const cpus = z::allowed_cpus();
  REQUIRE(!cpus.empty());
  CHECK(cpus == thread_cpus());
  CHECK(z::thread_pool{}.size() == cpus.size());
  for (bool pin : {false, true}) {
    DYNAMIC_SECTION((pin ? "pinned" : "not pinned")) {
      unsigned const threads = 5;  // more threads than CI's 2 CPUs: workers wrap around
      z::thread_pool pool{threads, pin};
      REQUIRE(pool.size() == threads);
      std::vector<std::vector<int>> seen(threads);
      // Task k runs on thread k: each records the mask of the thread it ran on (no Catch
      // assertions off the main thread).
      pool.run(threads, [&](std::size_t t) {
        cpu_set_t set;
        CPU_ZERO(&set);
        if (pthread_getaffinity_np(pthread_self(), sizeof set, &set) != 0) { return; }
        for (int c = 0; c < CPU_SETSIZE; ++c) {
          if (CPU_ISSET(c, &set)) { seen[t].push_back(c); }
        }
      });
      CHECK(seen[0] == cpus);  // the caller's share: never pinned
      for (unsigned k = 1; k < threads; ++k) {
        INFO("worker " << k);
        if (pin) {
          CHECK(seen[k] == std::vector<int>{cpus[k % cpus.size()]});
        } else {
          CHECK(seen[k] == cpus);
        }
      }
      CHECK(thread_cpus() == cpus);  // the caller's mask is untouched
    }
  }
}

TEST_CASE("thread pool: a narrowed affinity mask sets the default size and the pinned CPUs",
          "[host]") {
  auto const cpus = z::allowed_cpus();
  int const only  = cpus.back();
  // On a thread of its own, so the test runner's mask stays as it was.
  std::vector<int> allowed, worker;
  unsigned size = 0;
  bool narrowed = false;
  std::thread t{[&] {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(only, &set);
    narrowed = pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0;
    if (!narrowed) { return; }
    allowed = z::allowed_cpus();
    z::thread_pool pool{0, true};
    size = pool.size();
    z::thread_pool two{2, true};
    two.run(2, [&](std::size_t k) {
      if (k != 1) { return; }
      cpu_set_t s;
      CPU_ZERO(&s);
      if (pthread_getaffinity_np(pthread_self(), sizeof s, &s) != 0) { return; }
      for (int c = 0; c < CPU_SETSIZE; ++c) {
        if (CPU_ISSET(c, &s)) { worker.push_back(c); }
      }
    });
  }};
  t.join();
  REQUIRE(narrowed);
  CHECK(allowed == std::vector<int>{only});
  CHECK(size == 1);
  CHECK(worker == std::vector<int>{only});  // worker 1 of 2 on the one allowed CPU
}
#endif

TEST_CASE("serial worker runs jobs in order, waits with a deadline, drops a failed step's rest",
          "[host]") {
  using namespace std::chrono_literals;
  auto const later = [] { return z::serial_worker::clock::now() + 10s; };
  {
    z::serial_worker w;
    CHECK(w.wait_idle(later()));  // nothing posted: idle at once
    std::vector<int> order;
    for (int i = 0; i < 100; ++i) {
      w.post([&order, i] { order.push_back(i); });
    }
    REQUIRE(w.wait_idle(later()));
    REQUIRE(order.size() == 100);
    for (int i = 0; i < 100; ++i) { CHECK(order[static_cast<std::size_t>(i)] == i); }

    // A job that throws: the ones behind it are dropped, the error comes out once.
    std::atomic<int> ran{0};
    std::atomic<bool> go{false};
    w.post([&] {
      while (!go.load()) { std::this_thread::yield(); }
      ++ran;
    });
    w.post([&] { throw std::runtime_error{"bucket 1"}; });
    w.post([&] { ++ran; });
    w.post([&] { ++ran; });
    CHECK_FALSE(w.wait_idle(z::serial_worker::clock::now() + 20ms));  // the first still waits
    go = true;
    CHECK_THROWS_AS((void)w.wait_idle(later()), std::runtime_error);
    CHECK(ran.load() == 1);
    CHECK(w.wait_idle(later()));  // the error was reported once
    w.post([&] { ++ran; });       // still usable
    CHECK(w.wait_idle(later()));
    CHECK(ran.load() == 2);
    CHECK_FALSE(w.cancelled());
  }
  // The destructor tells a waiting job to stop, drops the queue and joins.
  std::atomic<int> ran{0};
  {
    z::serial_worker w;
    w.post([&] {
      while (!w.cancelled()) { std::this_thread::sleep_for(1ms); }
    });
    for (int i = 0; i < 10; ++i) {
      w.post([&] { ++ran; });
    }
  }
  CHECK(ran.load() == 0);
}
