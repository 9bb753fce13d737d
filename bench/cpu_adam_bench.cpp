// SPDX-License-Identifier: Apache-2.0
/*
 * cpu_adam_bench: the CPU AdamW of wm::zero_optimizer's host offload in parameters per
 * second, against the host's memory copy bandwidth measured in the same run, both counted at 28
 * bytes per parameter (read master, m, v and a 4-byte fp32 gradient, write master, m, v: 16 + 12;
 * or read a bf16 gradient and write a bf16 weight copy too: 14 + 14). The copy moves the same
 * bytes per step (14·N read, 14·N written) over the same threads.
 *
 * Besides the production update (`prod`: detail/zero/cpu_adam.hpp, every ISA the CPU has with
 * --isa all) it sweeps variants of the AVX-512 body written here, to find what the memory system
 * of a host rewards (the production path takes what wins; the variants stay here):
 *   prod       the production update, in place (bf16 copy with streaming stores)
 *   prod-sep   the production update into a second copy of master, m, v (the offload pipeline's
 *              form: streaming stores for all outputs), alternating between the two copies
 *   u1-store   one vector per iteration, plain stores everywhere (the production body before)
 *   u1-nt      one vector, streaming stores for the bf16 copy (prod's body before the prefetch)
 *   u2-nt, u4-nt            2 or 4 vectors per iteration (more loads in flight per core)
 *   u1-nt-pf1k, u1-nt-pf2k, u1-nt-pf4k  software prefetch 1, 2 or 4 KiB ahead in every input
 *                           stream (pf1k = prod's AVX-512 body since 2026-11-24)
 *   u2-nt-pf1k     2 vectors per iteration with the prefetch
 *   u1-nt-pf1k-nta the prefetch with the non-temporal hint (less cache displaced)
 *   u1-allnt   streaming stores for master, m and v too (in place)
 *   u1-nt-fixed  u1-nt with one fixed range per thread (the split before the claimed ranges)
 * Every variant but u1-nt-fixed splits the work as prod does: up to 8 ranges per thread, claimed
 * by free threads.
 * Each variant is first checked bit for bit against prod on a small array (a variant that
 * computes something else prints MISMATCH and is not timed). Cases: fp32 gradients (torch's
 * case, 28 B/param), bf16 gradients with the bf16 weight copy (the offload's, 28 B), bf16
 * gradients alone (26 B: fewer bytes where the semantics allow).
 *
 * Usage: cpu_adam_bench [--params N] [--threads T[,T...]] [--reps R] [--isa all|best]
 *                       [--variants all|name[,name...]] [--pin] [--peer]
 *   --threads: one sweep per count (0: every CPU of the process); --pin: pool worker k on the
 *   k-th CPU (thread_pool's pinning; the calling thread, which starts the peer, stays unpinned).
 *   --peer runs bench/peers/torch_cpu_adam.py on the same size and thread count (torch's
 *   AdamW default, foreach and fused on CPU tensors, and DeepSpeedCPUAdam where deepspeed
 *   imports) and prints the ratios to torch fused and to DeepSpeed.
 * Targets: ≥ 1.1 × torch fused, ≥ 0.80 of the copy bandwidth at 28 B/param.
 */
#include <wm/detail/zero/cpu_adam.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "host_timing.hpp"

namespace z  = wm::detail::zero;
namespace zd = wm::detail::zero::cpu_adam_detail;

namespace {

struct free_deleter {
  void operator()(void* p) const noexcept { std::free(p); }
};
template <class T>
using buffer = std::unique_ptr<T[], free_deleter>;

template <class T>
buffer<T> allocate(std::size_t n) {
  std::size_t const bytes = (n * sizeof(T) + 63) / 64 * 64;
  auto* p = static_cast<T*>(std::aligned_alloc(64, std::max<std::size_t>(bytes, 64)));
  if (p == nullptr) {
    std::fprintf(stderr, "cpu_adam_bench: out of memory (%zu bytes)\n", bytes);
    std::exit(1);
  }
  return buffer<T>{p};
}

/// [first, last) of part t of n split like cpu_adam_update splits it (64-element blocks).
std::pair<std::size_t, std::size_t> part(std::size_t n, std::size_t parts, std::size_t t) {
  std::size_t const blocks = (n + 63) / 64;
  return {std::min(n, blocks * t / parts * 64), std::min(n, blocks * (t + 1) / parts * 64)};
}

double json_number(std::string const& line, char const* key) {
  std::string const k = std::string{"\""} + key + "\":";
  auto const at       = line.find(k);
  return at == std::string::npos ? -1.0 : std::atof(line.c_str() + at + k.size());
}

std::vector<std::string> split_list(std::string const& s) {
  std::vector<std::string> out;
  std::size_t at = 0;
  while (at <= s.size()) {
    auto const comma = s.find(',', at);
    out.push_back(s.substr(at, comma == std::string::npos ? std::string::npos : comma - at));
    if (comma == std::string::npos) { break; }
    at = comma + 1;
  }
  return out;
}

// ---- the AVX-512 variants (AdamW, the production math) -----------------------------------------

#if WM_ZERO_X86
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
/// U vectors from element i: all loads and the math first, then the stores (Pf: software
/// prefetch Prefetch bytes ahead in every input stream).
template <int U, int Prefetch, bool Stream16, bool StreamStates, class Grad>
__attribute__((target("avx512f"), always_inline)) inline void variant_body(
    zd::constants const& c, z::cpu_adam_arrays<Grad> const& a, float* wo, float* mo, float* vo,
    std::size_t i) {
  __m512 const b1 = _mm512_set1_ps(c.b1), omb1 = _mm512_set1_ps(c.omb1);
  __m512 const b2 = _mm512_set1_ps(c.b2), omb2 = _mm512_set1_ps(c.omb2);
  __m512 const eps = _mm512_set1_ps(c.eps), scale = _mm512_set1_ps(c.scale);
  __m512 const step = _mm512_set1_ps(c.step_size), ibc2 = _mm512_set1_ps(c.inv_bc2_sqrt);
  __m512 const decay = _mm512_set1_ps(c.decay);
  if constexpr (Prefetch != 0) {  // < 0: |Prefetch| bytes ahead with the non-temporal hint
    constexpr std::size_t ahead = (Prefetch > 0 ? Prefetch : -Prefetch) / 4;  // floats
    constexpr auto hint         = Prefetch > 0 ? _MM_HINT_T0 : _MM_HINT_NTA;
    for (int u = 0; u < U; ++u) {
      std::size_t const j = i + ahead + 16 * static_cast<std::size_t>(u);
      _mm_prefetch(reinterpret_cast<char const*>(a.master + j), hint);
      _mm_prefetch(reinterpret_cast<char const*>(a.m + j), hint);
      _mm_prefetch(reinterpret_cast<char const*>(a.v + j), hint);
      if (sizeof(Grad) == 4 || u % 2 == 0) {
        _mm_prefetch(reinterpret_cast<char const*>(a.grad + j), hint);
      }
    }
  }
  __m512 w[U], m[U], v[U];
  for (int u = 0; u < U; ++u) {
    std::size_t const j = i + 16 * static_cast<std::size_t>(u);
    __m512 const g      = _mm512_mul_ps(zd::load16(a.grad + j), scale);
    w[u]                = _mm512_mul_ps(_mm512_loadu_ps(a.master + j), decay);
    m[u]                = _mm512_fmadd_ps(b1, _mm512_loadu_ps(a.m + j), _mm512_mul_ps(omb1, g));
    v[u] = _mm512_fmadd_ps(b2, _mm512_loadu_ps(a.v + j), _mm512_mul_ps(omb2, _mm512_mul_ps(g, g)));
    __m512 const denom = _mm512_fmadd_ps(_mm512_sqrt_ps(v[u]), ibc2, eps);
    w[u]               = _mm512_fnmadd_ps(step, _mm512_div_ps(m[u], denom), w[u]);
  }
  for (int u = 0; u < U; ++u) {
    std::size_t const j = i + 16 * static_cast<std::size_t>(u);
    zd::store16<StreamStates>(mo + j, m[u]);
    zd::store16<StreamStates>(vo + j, v[u]);
    zd::store16<StreamStates>(wo + j, w[u]);
    if (a.bf16_out != nullptr) { zd::store16_bf16<Stream16>(a.bf16_out + j, w[u]); }
  }
}

/// Unroll vectors per iteration; Prefetch bytes ahead in each input stream (0: none); Stream16:
/// streaming stores for the bf16 copy; StreamStates: for master, m and v too; Separate: master,
/// m and v are written to the arrays' separate outputs (the offload pipeline's second copy).
template <int Unroll, int Prefetch, bool Stream16, bool StreamStates, bool Separate, class Grad>
__attribute__((target("avx512f"))) void variant_range(zd::constants const& c,
                                                      z::cpu_adam_arrays<Grad> const& a,
                                                      std::size_t first, std::size_t last) {
  float* const wo = Separate ? a.master_out : a.master;
  float* const mo = Separate ? a.m_out : a.m;
  float* const vo = Separate ? a.v_out : a.v;
  std::size_t i   = first;
  for (; i + 16 * Unroll <= last; i += 16 * Unroll) {
    variant_body<Unroll, Prefetch, Stream16, StreamStates>(c, a, wo, mo, vo, i);
  }
  for (; i + 16 <= last; i += 16) {  // one vector at a time, as prod's body: the same tail
    variant_body<1, 0, Stream16, StreamStates>(c, a, wo, mo, vo, i);
  }
  if constexpr (Stream16 || StreamStates) { _mm_sfence(); }
  zd::scalar_range<true>(c, a, i, last);  // reads master, m, v; writes the outputs
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif

template <class Grad>
using range_fn = void (*)(zd::constants const&, z::cpu_adam_arrays<Grad> const&, std::size_t,
                          std::size_t);

struct variant {
  char const* name;
  range_fn<float> f32;  // null: prod, prod-sep
  range_fn<z::bf16_bits> b16;
  int chunks_per_thread;  // 0: the production split (claimed); k: k fixed ranges per thread
  bool separate{false};   // writes master, m, v to a second copy
};

std::vector<variant> all_variants() {
  std::vector<variant> v{{"prod", nullptr, nullptr, 0}, {"prod-sep", nullptr, nullptr, 0}};
#if WM_ZERO_X86
  if (z::cpu_supports(z::cpu_isa::avx512)) {
    v.push_back({"u1-store", variant_range<1, 0, false, false, false, float>,
                 variant_range<1, 0, false, false, false, z::bf16_bits>, 0});
    v.push_back({"u1-nt", variant_range<1, 0, true, false, false, float>,
                 variant_range<1, 0, true, false, false, z::bf16_bits>, 0});
    v.push_back({"u2-nt", variant_range<2, 0, true, false, false, float>,
                 variant_range<2, 0, true, false, false, z::bf16_bits>, 0});
    v.push_back({"u4-nt", variant_range<4, 0, true, false, false, float>,
                 variant_range<4, 0, true, false, false, z::bf16_bits>, 0});
    v.push_back({"u1-nt-pf1k", variant_range<1, 1024, true, false, false, float>,
                 variant_range<1, 1024, true, false, false, z::bf16_bits>, 0});
    v.push_back({"u1-nt-pf4k", variant_range<1, 4096, true, false, false, float>,
                 variant_range<1, 4096, true, false, false, z::bf16_bits>, 0});
    v.push_back({"u1-nt-pf2k", variant_range<1, 2048, true, false, false, float>,
                 variant_range<1, 2048, true, false, false, z::bf16_bits>, 0});
    v.push_back({"u2-nt-pf1k", variant_range<2, 1024, true, false, false, float>,
                 variant_range<2, 1024, true, false, false, z::bf16_bits>, 0});
    v.push_back({"u1-nt-pf1k-nta", variant_range<1, -1024, true, false, false, float>,
                 variant_range<1, -1024, true, false, false, z::bf16_bits>, 0});
    v.push_back({"u1-allnt", variant_range<1, 0, true, true, false, float>,
                 variant_range<1, 0, true, true, false, z::bf16_bits>, 0});
    v.push_back({"sep-store", variant_range<1, 0, true, false, true, float>,
                 variant_range<1, 0, true, false, true, z::bf16_bits>, 0, true});
    v.push_back({"u2-sep-nt", variant_range<2, 0, true, true, true, float>,
                 variant_range<2, 0, true, true, true, z::bf16_bits>, 0, true});
    // The split before the claimed ranges: one fixed range per thread.
    v.push_back({"u1-nt-fixed", variant_range<1, 0, true, false, false, float>,
                 variant_range<1, 0, true, false, false, z::bf16_bits>, 1});
  }
#endif
  return v;
}

/// One variant's update of @p a over the pool. chunks 0: the production split (up to 8 ranges
/// per thread of at least 64 Ki elements, claimed by free threads, as cpu_adam_update); k > 0:
/// k fixed contiguous ranges per thread, range t on thread t mod size.
template <class Grad>
void run_variant(range_fn<Grad> f, int chunks, z::cpu_adam_options const& o, z::cpu_adam_step s,
                 z::cpu_adam_arrays<Grad> const& a, z::thread_pool& pool) {
  auto const c = zd::make_constants(o, s);
  if (chunks == 0) {
    std::size_t const tasks = z::cpu_adam_tasks(a.n, pool);
    pool.run_claimed(tasks, [&](std::size_t t) {
      auto const [first, last] = part(a.n, tasks, t);
      f(c, a, first, last);
    });
    return;
  }
  std::size_t const tasks = pool.size() * static_cast<std::size_t>(chunks);
  pool.run(tasks, [&](std::size_t t) {
    auto const [first, last] = part(a.n, tasks, t);
    f(c, a, first, last);
  });
}

/// Each variant against prod on a small array, bit for bit (master, m, v, bf16 copy).
bool same_as_prod(variant const& v, z::thread_pool& pool) {
  if (v.f32 == nullptr) { return true; }
  std::size_t const n = 100003;
  std::mt19937 rng{42};
  std::uniform_real_distribution<float> d{-1.0f, 1.0f};
  auto w0 = allocate<float>(n), m0 = allocate<float>(n), v0 = allocate<float>(n);
  auto g   = allocate<float>(n);
  auto g16 = allocate<z::bf16_bits>(n);
  for (std::size_t i = 0; i < n; ++i) {
    w0[i] = d(rng);
    m0[i] = 0.1f * d(rng);
    v0[i] = 0.01f * std::abs(d(rng));
    g[i]  = d(rng);
    std::uint32_t b;
    std::memcpy(&b, &g[i], 4);
    g16[i] = static_cast<z::bf16_bits>(b >> 16);
  }
  bool ok = true;
  for (int mode = 0; mode < 2; ++mode) {
    auto w1 = allocate<float>(n), m1 = allocate<float>(n), v1 = allocate<float>(n);
    auto w2 = allocate<float>(n), m2 = allocate<float>(n), v2 = allocate<float>(n);
    auto o1 = allocate<z::bf16_bits>(n), o2 = allocate<z::bf16_bits>(n);
    auto w3 = allocate<float>(n), m3 = allocate<float>(n), v3 = allocate<float>(n);
    for (auto* p : {w3.get(), m3.get(), v3.get()}) { std::memset(p, 0xff, n * 4); }
    // Separate variants write to the third copy and leave the second as it was.
    auto with_outputs = [&](auto a) {
      if (v.separate) {
        a.master_out = w3.get();
        a.m_out      = m3.get();
        a.v_out      = v3.get();
      }
      return a;
    };
    for (auto* p : {w1.get(), w2.get()}) { std::memcpy(p, w0.get(), n * 4); }
    for (auto* p : {m1.get(), m2.get()}) { std::memcpy(p, m0.get(), n * 4); }
    for (auto* p : {v1.get(), v2.get()}) { std::memcpy(p, v0.get(), n * 4); }
    std::memset(o1.get(), 0, n * 2);
    std::memset(o2.get(), 0xff, n * 2);
    z::cpu_adam_options const o;
    z::cpu_adam_step const st{1e-3f, 5, 0.5f};
    if (mode == 0) {
      z::cpu_adam_update(
          o, st, z::cpu_adam_arrays<float>{w1.get(), m1.get(), v1.get(), g.get(), o1.get(), n},
          pool);
      run_variant(v.f32, v.chunks_per_thread, o, st,
                  with_outputs(z::cpu_adam_arrays<float>{w2.get(), m2.get(), v2.get(), g.get(),
                                                         o2.get(), n}),
                  pool);
    } else {
      z::cpu_adam_update(
          o, st,
          z::cpu_adam_arrays<z::bf16_bits>{w1.get(), m1.get(), v1.get(), g16.get(), o1.get(), n},
          pool);
      run_variant(v.b16, v.chunks_per_thread, o, st,
                  with_outputs(z::cpu_adam_arrays<z::bf16_bits>{w2.get(), m2.get(), v2.get(),
                                                                g16.get(), o2.get(), n}),
                  pool);
    }
    float const* const wr = v.separate ? w3.get() : w2.get();
    float const* const mr = v.separate ? m3.get() : m2.get();
    float const* const vr = v.separate ? v3.get() : v2.get();
    ok = ok && std::memcmp(w1.get(), wr, n * 4) == 0 && std::memcmp(m1.get(), mr, n * 4) == 0 &&
         std::memcmp(v1.get(), vr, n * 4) == 0 && std::memcmp(o1.get(), o2.get(), n * 2) == 0;
    if (v.separate) {  // the inputs stay as they were
      ok = ok && std::memcmp(w2.get(), w0.get(), n * 4) == 0 &&
           std::memcmp(m2.get(), m0.get(), n * 4) == 0 &&
           std::memcmp(v2.get(), v0.get(), n * 4) == 0;
    }
  }
  return ok;
}

struct sweep_result {
  double best_fp32{0.0};
  double best_bf16{0.0};
  double best_bf16_in{0.0};  // bf16 gradients, no bf16 copy: 26 bytes per parameter
  double bound{0.0};
  std::string best_fp32_name, best_bf16_name, best_bf16_in_name;
};

sweep_result sweep(std::size_t n, unsigned threads, int reps, bool all_isas, bool pinned,
                   std::vector<std::string> const& wanted) {
  z::thread_pool pool{threads, pinned};  // pinned: workers, not this thread (nor the peer's)
  std::size_t const parts = pool.size();

  // Buffers, first touched by the thread that updates them (the production split).
  auto master = allocate<float>(n), m = allocate<float>(n), v = allocate<float>(n);
  auto master2 = allocate<float>(n), m2 = allocate<float>(n), v2 = allocate<float>(n);
  auto grad                    = allocate<float>(n);
  auto grad16                  = allocate<z::bf16_bits>(n);
  auto out16                   = allocate<z::bf16_bits>(n);
  std::size_t const copy_bytes = 14 * n;
  auto copy_src                = allocate<char>(copy_bytes);
  auto copy_dst                = allocate<char>(copy_bytes);
  pool.run(parts, [&](std::size_t t) {
    auto const [first, last] = part(n, parts, t);
    std::mt19937 rng{static_cast<unsigned>(t) + 1};
    std::uniform_real_distribution<float> d{-1.0f, 1.0f};
    for (std::size_t i = first; i < last; ++i) {
      master[i] = master2[i] = d(rng);
      m[i] = v[i] = m2[i] = v2[i] = 0.0f;
      grad[i]                     = 1e-3f * d(rng);
      std::uint32_t b;
      std::memcpy(&b, &grad[i], 4);
      grad16[i] = static_cast<z::bf16_bits>(b >> 16);
      out16[i]  = 0;
    }
    auto const [cf, cl] = part(copy_bytes, parts, t);
    std::memset(copy_src.get() + cf, 1, cl - cf);
    std::memset(copy_dst.get() + cf, 0, cl - cf);
  });

  double const copy_ms  = wm_bench::median_ms(reps, [&] {
    pool.run(parts, [&](std::size_t t) {
      auto const [cf, cl] = part(copy_bytes, parts, t);
      std::memcpy(copy_dst.get() + cf, copy_src.get() + cf, cl - cf);
    });
  });
  double const copy_gbs = 2.0 * static_cast<double>(copy_bytes) / (copy_ms * 1e6);
  // The same bytes read and written in place (as Adam does with master, m and v): no
  // read-for-ownership of a destination, whatever memcpy's store strategy is.
  auto* words                  = reinterpret_cast<std::uint32_t*>(copy_src.get());
  std::size_t const word_count = copy_bytes / 4;
  double const sweep_ms        = wm_bench::median_ms(reps, [&] {
    pool.run(parts, [&](std::size_t t) {
      auto const [first, last] = part(word_count, parts, t);
      for (std::size_t i = first; i < last; ++i) { words[i] += 1u; }
    });
  });
  double const sweep_gbs       = 2.0 * static_cast<double>(word_count * 4) / (sweep_ms * 1e6);
  sweep_result r;
  double const limit_gbs = std::max(copy_gbs, sweep_gbs);
  r.bound                = limit_gbs * 1e9 / 28.0;  // params/s the host memory allows

  std::printf("\n## %zu parameters, %u threads%s, best ISA %s, median of %d\n", n, pool.size(),
              pinned ? " (pinned)" : "", z::name_of(z::best_cpu_isa()), reps);
  std::printf(
      "host memcpy: %.1f GB/s; in-place read+write sweep: %.1f GB/s (both read + write, "
      "%.2f GB per pass); limit %.1f GB/s -> %.3f Gparams/s at 28 B\n",
      copy_gbs, sweep_gbs, 2.0 * static_cast<double>(copy_bytes) / 1e9, limit_gbs, r.bound / 1e9);
  std::printf(
      "| variant | case | isa | ms | Gparams/s | GB/s moved | vs limit |\n| --- | --- | --- | "
      "--- | --- | --- | --- |\n");

  z::cpu_adam_options const opt;  // AdamW defaults: wd 0.01, eps 1e-8
  auto report = [&](char const* name, int mode, char const* isa, double ms) {
    double const pps = static_cast<double>(n) / (ms * 1e-3);
    if (mode == 0 && pps > r.best_fp32) {
      r.best_fp32      = pps;
      r.best_fp32_name = name;
    }
    if (mode == 1 && pps > r.best_bf16) {
      r.best_bf16      = pps;
      r.best_bf16_name = name;
    }
    if (mode == 2 && pps > r.best_bf16_in) {
      r.best_bf16_in      = pps;
      r.best_bf16_in_name = name;
    }
    double const bytes = mode == 2 ? 26.0 : 28.0;
    std::printf("| %s | %s | %s | %.2f | %.3f | %.1f | %.2f |\n", name,
                mode == 0   ? "fp32 grad, fp32 out"
                : mode == 1 ? "bf16 grad, fp32 + bf16 out"
                            : "bf16 grad, fp32 out (26 B)",
                isa, ms, pps / 1e9, pps * bytes / 1e9, pps * bytes / 28.0 / r.bound);
  };
  auto want = [&](char const* name) {
    return wanted.empty() || std::find(wanted.begin(), wanted.end(), name) != wanted.end();
  };
  for (auto const& var : all_variants()) {
    if (!want(var.name)) { continue; }
    std::string const name = var.name;
    if (!same_as_prod(var, pool)) {
      std::printf("| %s | MISMATCH against prod: not timed | | | | | |\n", var.name);
      continue;
    }
    bool const sep = var.separate || name == "prod-sep";
    // Modes: fp32 gradients; bf16 gradients and a bf16 copy (the offload's form); bf16
    // gradients alone (26 bytes per parameter: the fewest torch's semantics allow).
    for (int mode = 0; mode < 3; ++mode) {
      std::int64_t step = 0;
      // Separate outputs: step k reads one copy and writes the other (as the pipeline does).
      auto arrays = [&](auto const* g, z::bf16_bits* out) {
        bool const odd = sep && (step % 2 == 1);
        using G        = std::remove_cv_t<std::remove_pointer_t<decltype(g)>>;
        z::cpu_adam_arrays<G> a{odd ? master2.get() : master.get(),
                                odd ? m2.get() : m.get(),
                                odd ? v2.get() : v.get(),
                                g,
                                out,
                                n};
        if (sep) {
          a.master_out = odd ? master.get() : master2.get();
          a.m_out      = odd ? m.get() : m2.get();
          a.v_out      = odd ? v.get() : v2.get();
        }
        return a;
      };
      if (var.f32 == nullptr) {  // prod, prod-sep: every ISA asked for
        for (auto isa : {z::cpu_isa::avx512, z::cpu_isa::avx2, z::cpu_isa::scalar}) {
          if (!z::cpu_supports(isa) || (!all_isas && isa != z::best_cpu_isa())) { continue; }
          double const ms = wm_bench::median_ms(reps, [&] {
            ++step;
            if (mode == 0) {
              z::cpu_adam_update(opt, {1e-3f, step, 1.0f}, arrays(grad.get(), nullptr), pool, isa);
            } else {
              z::cpu_adam_update(opt, {1e-3f, step, 1.0f},
                                 arrays(grad16.get(), mode == 1 ? out16.get() : nullptr), pool,
                                 isa);
            }
          });
          report(var.name, mode, z::name_of(isa), ms);
        }
        continue;
      }
      double const ms = wm_bench::median_ms(reps, [&] {
        ++step;
        if (mode == 0) {
          run_variant(var.f32, var.chunks_per_thread, opt, {1e-3f, step, 1.0f},
                      arrays(grad.get(), nullptr), pool);
        } else {
          run_variant(var.b16, var.chunks_per_thread, opt, {1e-3f, step, 1.0f},
                      arrays(grad16.get(), mode == 1 ? out16.get() : nullptr), pool);
        }
      });
      report(var.name, mode, "avx512", ms);
    }
  }
  std::printf(
      "best: fp32 grads %s %.3f Gparams/s; bf16 grads + bf16 out %s %.3f; bf16 grads, no copy %s "
      "%.3f\n",
      r.best_fp32_name.c_str(), r.best_fp32 / 1e9, r.best_bf16_name.c_str(), r.best_bf16 / 1e9,
      r.best_bf16_in_name.c_str(), r.best_bf16_in / 1e9);
  return r;
}

void run_peer(std::size_t n, unsigned threads, int reps, sweep_result const& r) {
  // The script beside this source file, or under bench/peers/ of the working directory (a
  // binary built elsewhere and run from the repository root).
  std::string script = "bench/peers/torch_cpu_adam.py";
  if (!std::filesystem::exists(script)) {
    std::string s = __FILE__;
    auto const at = s.rfind('/');
    script =
        (at == std::string::npos ? std::string{"."} : s.substr(0, at)) + "/peers/torch_cpu_adam.py";
  }
  std::string const cmd = "python3 " + script + " --json --params " + std::to_string(n) +
                          " --threads " + std::to_string(threads) + " --reps " +
                          std::to_string(reps);
  std::fflush(stdout);
  FILE* p = ::popen(cmd.c_str(), "r");
  std::string last;
  if (p == nullptr) {
    std::printf("torch peer: could not start: %s\n", cmd.c_str());
    return;
  }
  char line[4096];
  while (std::fgets(line, sizeof line, p) != nullptr) { last = line; }
  int const rc = ::pclose(p);
  if (rc != 0 || last.find('{') == std::string::npos) {
    std::printf("torch peer: failed (exit %d): %s\n", rc, cmd.c_str());
    return;
  }
  double const fused    = json_number(last, "fused");
  double const foreach_ = json_number(last, "foreach");
  double const plain    = json_number(last, "default");
  std::printf(
      "torch CPU AdamW (same size, %u threads): default %.3f, foreach %.3f, fused %.3f "
      "Gparams/s\n",
      threads, plain / 1e9, foreach_ / 1e9, fused / 1e9);
  std::printf(
      "wm / torch fused (target >= 1.1): fp32 grads (%s) %.2f; bf16 grads + bf16 copy (%s) %.2f; "
      "bf16 grads, no copy (%s) %.2f. wm fp32 / memory limit: %.2f (target >= 0.80)\n",
      r.best_fp32_name.c_str(), r.best_fp32 / fused, r.best_bf16_name.c_str(), r.best_bf16 / fused,
      r.best_bf16_in_name.c_str(), r.best_bf16_in / fused, r.best_fp32 / r.bound);
  double const deepspeed = json_number(last, "deepspeed");
  if (deepspeed > 0) {
    std::printf(
        "DeepSpeedCPUAdam (same size, %u threads, one step equal to torch AdamW within %.1e): "
        "%.3f Gparams/s; wm / DeepSpeed (target >= 1.1): fp32 grads (%s) %.2f\n",
        threads, json_number(last, "deepspeed_max_diff"), deepspeed / 1e9, r.best_fp32_name.c_str(),
        r.best_fp32 / deepspeed);
  } else {
    std::printf("DeepSpeed peer: not run (the peer script's stderr says why)\n");
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t n = std::size_t{1} << 27;
  std::vector<unsigned> thread_counts{0};
  int reps      = 10;
  bool all_isas = true;
  bool peer     = false;
  bool pinned   = false;
  std::vector<std::string> wanted;
  for (int i = 1; i < argc; ++i) {
    std::string const a = argv[i];
    if (a == "--params" && i + 1 < argc) {
      n = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--threads" && i + 1 < argc) {
      thread_counts.clear();
      for (auto const& t : split_list(argv[++i])) {
        thread_counts.push_back(static_cast<unsigned>(std::atoi(t.c_str())));
      }
    } else if (a == "--reps" && i + 1 < argc) {
      reps = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--isa" && i + 1 < argc) {
      all_isas = std::string{argv[++i]} == "all";
    } else if (a == "--variants" && i + 1 < argc) {
      std::string const list = argv[++i];
      wanted                 = list == "all" ? std::vector<std::string>{} : split_list(list);
    } else if (a == "--pin") {
      pinned = true;
    } else if (a == "--peer") {
      peer = true;
    } else {
      std::fprintf(stderr,
                   "usage: %s [--params N] [--threads T[,T...]] [--reps R] [--isa all|best] "
                   "[--variants all|name[,name...]] [--pin] [--peer]\nvariants:",
                   argv[0]);
      for (auto const& v : all_variants()) { std::fprintf(stderr, " %s", v.name); }
      std::fprintf(stderr, "\n");
      return 2;
    }
  }
  std::printf("cpu_adam_bench: %zu parameters, %u hardware threads\n", n,
              std::thread::hardware_concurrency());
  for (unsigned threads : thread_counts) {
    auto const r = sweep(n, threads, reps, all_isas, pinned, wanted);
    if (peer) {
      run_peer(n, threads == 0 ? std::max(1u, std::thread::hardware_concurrency()) : threads, reps,
               r);
    }
  }
  return 0;
}
