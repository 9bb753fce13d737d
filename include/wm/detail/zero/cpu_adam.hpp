// SPDX-License-Identifier: Apache-2.0
// The CPU Adam of wm::zero_optimizer's host offload (docs/design.md, "ZeRO memory"): fp32 master
// weights, m and v in host memory, fp32 or bf16 gradients in, fp32 master and (optionally) a bf16
// copy out. Multi-threaded over a wm::detail::zero::thread_pool, vectorized with AVX-512 or
// AVX2 + FMA chosen at run time (__builtin_cpu_supports), with a scalar fallback; each ISA can be
// forced (the tests run every one the CPU has).
//
// The update is torch.optim.AdamW's documented algorithm (decoupled weight decay), or
// torch.optim.Adam's (weight decay added to the gradient) with `decoupled = false`:
//   g = grad · grad_scale                     (loss unscaling and clipping, folded by the caller)
//   AdamW: w = w · (1 − lr·wd)    Adam: g = g + wd·w
//   m = β1·m + (1 − β1)·g ;  v = β2·v + (1 − β2)·g²
//   w = w − lr/(1 − β1^t) · m / (sqrt(v)/sqrt(1 − β2^t) + eps)     (eps added to sqrt(v̂))
// No amsgrad, no maximize. bf16 rounding is to nearest even; NaN becomes 0x7fc0.
//
// Host-only; compiles with g++ and nvcc (the vector bodies carry target attributes, so the
// translation unit needs no -mavx flags).
#pragma once

#include <wm/detail/zero/thread_pool.hpp>
#include <wm/error.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define WM_ZERO_X86 1
#else
#define WM_ZERO_X86 0
#endif

namespace wm::detail::zero {

/// Raw bits of a bfloat16 value.
using bf16_bits = std::uint16_t;

/// Instruction sets the CPU Adam has a body for.
enum class cpu_isa : std::uint8_t { scalar, avx2, avx512 };

[[nodiscard]] constexpr char const* name_of(cpu_isa isa) noexcept {
  return isa == cpu_isa::avx512 ? "avx512" : isa == cpu_isa::avx2 ? "avx2" : "scalar";
}

/// Whether this CPU (and OS) runs @p isa's body.
[[nodiscard]] inline bool cpu_supports(cpu_isa isa) noexcept {
#if WM_ZERO_X86 && defined(__GNUC__)
  switch (isa) {
    case cpu_isa::avx512: return __builtin_cpu_supports("avx512f");
    case cpu_isa::avx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    default: return true;
  }
#else
  return isa == cpu_isa::scalar;
#endif
}

/// The widest ISA this CPU supports.
[[nodiscard]] inline cpu_isa best_cpu_isa() noexcept {
  if (cpu_supports(cpu_isa::avx512)) { return cpu_isa::avx512; }
  if (cpu_supports(cpu_isa::avx2)) { return cpu_isa::avx2; }
  return cpu_isa::scalar;
}

/// Hyper-parameters (torch.optim.AdamW's defaults).
struct cpu_adam_options {
  float beta1{0.9f};
  float beta2{0.999f};
  float eps{1e-8f};
  float weight_decay{1e-2f};
  bool decoupled{true};  ///< AdamW; false: torch.optim.Adam's L2 term added to the gradient
};

/// What changes from call to call.
struct cpu_adam_step {
  float lr{1e-3f};
  std::int64_t step{1};    ///< 1-based step count of this update (bias correction)
  float grad_scale{1.0f};  ///< gradients are multiplied by it first
};

/// One update's arrays, `n` elements each; `bf16_out` may be null. Grad is float or bf16_bits.
/// master, m and v are updated in place, or, where `master_out`, `m_out` and `v_out` are all
/// set, read from master, m, v and written there (the inputs stay as they were). Outputs that do
/// not alias an input, and the bf16 copy, are written with streaming stores (no read for
/// ownership) where they are aligned to 64 bytes.
template <class Grad>
struct cpu_adam_arrays {
  float* master{};
  float* m{};
  float* v{};
  Grad const* grad{};
  bf16_bits* bf16_out{};
  std::size_t n{};
  float* master_out{};
  float* m_out{};
  float* v_out{};
};

// g++ 12 at -O3 reports its own AVX-512 intrinsics' _mm512_undefined_*() as maybe-uninitialized.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
namespace cpu_adam_detail {

/// Per-call constants, computed once in double.
struct constants {
  float b1, omb1, b2, omb2, eps, scale, step_size, inv_bc2_sqrt, decay, l2;
};

[[nodiscard]] inline constants make_constants(cpu_adam_options const& o, cpu_adam_step s) noexcept {
  double const t   = static_cast<double>(s.step);
  double const bc1 = 1.0 - std::pow(static_cast<double>(o.beta1), t);
  double const bc2 = 1.0 - std::pow(static_cast<double>(o.beta2), t);
  double const lr  = s.lr;
  return {o.beta1,
          static_cast<float>(1.0 - static_cast<double>(o.beta1)),
          o.beta2,
          static_cast<float>(1.0 - static_cast<double>(o.beta2)),
          o.eps,
          s.grad_scale,
          static_cast<float>(lr / bc1),
          static_cast<float>(1.0 / std::sqrt(bc2)),
          static_cast<float>(1.0 - lr * static_cast<double>(o.weight_decay)),
          o.weight_decay};
}

[[nodiscard]] inline float to_float(float g) noexcept {
  return g;
}
[[nodiscard]] inline float to_float(bf16_bits g) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(g) << 16);
}

/// fp32 → bf16, round to nearest even; NaN → 0x7fc0.
[[nodiscard]] inline bf16_bits to_bf16(float x) noexcept {
  if (std::isnan(x)) { return 0x7fc0; }
  std::uint32_t const b = std::bit_cast<std::uint32_t>(x);
  return static_cast<bf16_bits>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

/// Where the update writes master, m and v (in place unless all three outputs are given).
struct outputs {
  float* master;
  float* m;
  float* v;
  bool separate;
};
template <class Grad>
[[nodiscard]] outputs outputs_of(cpu_adam_arrays<Grad> const& a) noexcept {
  bool const separate = a.master_out != nullptr && a.m_out != nullptr && a.v_out != nullptr;
  return separate ? outputs{a.master_out, a.m_out, a.v_out, true}
                  : outputs{a.master, a.m, a.v, false};
}

/// Whether every separate output (and the bf16 copy) of [first, ...) is aligned to @p bytes.
template <class Grad>
[[nodiscard]] bool streamable(cpu_adam_arrays<Grad> const& a, outputs const& o, std::size_t first,
                              std::size_t bytes) noexcept {
  auto aligned = [&](void const* p) {
    return p == nullptr || reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
  };
  bool ok = a.bf16_out == nullptr || aligned(a.bf16_out + first);
  if (o.separate) {
    ok = ok && aligned(o.master + first) && aligned(o.m + first) && aligned(o.v + first);
  }
  return ok;
}

template <bool Decoupled, class Grad>
void scalar_range(constants const& c, cpu_adam_arrays<Grad> const& a, std::size_t first,
                  std::size_t last) noexcept {
  outputs const o = outputs_of(a);
  for (std::size_t i = first; i < last; ++i) {
    float g = to_float(a.grad[i]) * c.scale;
    float w = a.master[i];
    if constexpr (Decoupled) {
      w *= c.decay;
    } else {
      g += c.l2 * w;
    }
    float const m     = c.b1 * a.m[i] + c.omb1 * g;
    float const v     = c.b2 * a.v[i] + c.omb2 * (g * g);
    float const denom = std::sqrt(v) * c.inv_bc2_sqrt + c.eps;
    w -= c.step_size * (m / denom);
    o.m[i]      = m;
    o.v[i]      = v;
    o.master[i] = w;
    if (a.bf16_out != nullptr) { a.bf16_out[i] = to_bf16(w); }
  }
}

#if WM_ZERO_X86

// ---- AVX2 + FMA: 8 lanes ----
__attribute__((target("avx2,fma"))) inline __m256 load8(float const* p) noexcept {
  return _mm256_loadu_ps(p);
}
__attribute__((target("avx2,fma"))) inline __m256 load8(bf16_bits const* p) noexcept {
  __m128i const h = _mm_loadu_si128(reinterpret_cast<__m128i const*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
template <bool Stream>
__attribute__((target("avx2,fma"))) inline void store8_bf16(bf16_bits* p, __m256 w) noexcept {
  __m256i const b   = _mm256_castps_si256(w);
  __m256i const lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb), 16);
  __m256i const nan = _mm256_castps_si256(_mm256_cmp_ps(w, w, _CMP_UNORD_Q));
  r                 = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  // 32 → 16 bits: pack within 128-bit lanes, then take quadwords 0 and 2.
  __m256i const packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  if constexpr (Stream) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
}
template <bool Stream>
__attribute__((target("avx2,fma"))) inline void store8(float* p, __m256 x) noexcept {
  if constexpr (Stream) {
    _mm256_stream_ps(p, x);
  } else {
    _mm256_storeu_ps(p, x);
  }
}

// Stream: the bf16 copy, and master, m and v where they go to separate outputs, are written with
// streaming stores (the caller checked the alignment).
template <bool Decoupled, bool Stream, class Grad>
__attribute__((target("avx2,fma"))) void avx2_body(constants const& c,
                                                   cpu_adam_arrays<Grad> const& a,
                                                   std::size_t first, std::size_t last) noexcept {
  outputs const o = outputs_of(a);
  __m256 const b1 = _mm256_set1_ps(c.b1), omb1 = _mm256_set1_ps(c.omb1);
  __m256 const b2 = _mm256_set1_ps(c.b2), omb2 = _mm256_set1_ps(c.omb2);
  __m256 const eps = _mm256_set1_ps(c.eps), scale = _mm256_set1_ps(c.scale);
  __m256 const step = _mm256_set1_ps(c.step_size), ibc2 = _mm256_set1_ps(c.inv_bc2_sqrt);
  __m256 const decay = _mm256_set1_ps(c.decay), l2 = _mm256_set1_ps(c.l2);
  std::size_t i = first;
  for (; i + 8 <= last; i += 8) {
    __m256 g = _mm256_mul_ps(load8(a.grad + i), scale);
    __m256 w = _mm256_loadu_ps(a.master + i);
    if constexpr (Decoupled) {
      w = _mm256_mul_ps(w, decay);
    } else {
      g = _mm256_fmadd_ps(l2, w, g);
    }
    __m256 const m = _mm256_fmadd_ps(b1, _mm256_loadu_ps(a.m + i), _mm256_mul_ps(omb1, g));
    __m256 const v =
        _mm256_fmadd_ps(b2, _mm256_loadu_ps(a.v + i), _mm256_mul_ps(omb2, _mm256_mul_ps(g, g)));
    __m256 const denom = _mm256_fmadd_ps(_mm256_sqrt_ps(v), ibc2, eps);
    w                  = _mm256_fnmadd_ps(step, _mm256_div_ps(m, denom), w);
    if (Stream && o.separate) {
      store8<true>(o.m + i, m);
      store8<true>(o.v + i, v);
      store8<true>(o.master + i, w);
    } else {
      store8<false>(o.m + i, m);
      store8<false>(o.v + i, v);
      store8<false>(o.master + i, w);
    }
    if (a.bf16_out != nullptr) { store8_bf16<Stream>(a.bf16_out + i, w); }
  }
  if constexpr (Stream) { _mm_sfence(); }
  scalar_range<Decoupled>(c, a, i, last);
}

template <bool Decoupled, class Grad>
__attribute__((target("avx2,fma"))) void avx2_range(constants const& c,
                                                    cpu_adam_arrays<Grad> const& a,
                                                    std::size_t first, std::size_t last) noexcept {
  if (streamable(a, outputs_of(a), first, 32)) {
    avx2_body<Decoupled, true>(c, a, first, last);
  } else {
    avx2_body<Decoupled, false>(c, a, first, last);
  }
}

// ---- AVX-512F: 16 lanes ----
__attribute__((target("avx512f"))) inline __m512 load16(float const* p) noexcept {
  return _mm512_loadu_ps(p);
}
__attribute__((target("avx512f"))) inline __m512 load16(bf16_bits const* p) noexcept {
  __m256i const h = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
template <bool Stream>
__attribute__((target("avx512f"))) inline void store16_bf16(bf16_bits* p, __m512 w) noexcept {
  __m512i const b   = _mm512_castps_si512(w);
  __m512i const lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb), 16);
  __mmask16 const nan = _mm512_cmp_ps_mask(w, w, _CMP_UNORD_Q);
  r                   = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
  if constexpr (Stream) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
}
template <bool Stream>
__attribute__((target("avx512f"))) inline void store16(float* p, __m512 x) noexcept {
  if constexpr (Stream) {
    _mm512_stream_ps(p, x);
  } else {
    _mm512_storeu_ps(p, x);
  }
}

/// Software prefetch of the cache line 1 KiB past @p p (integer arithmetic: the address may lie
/// past the array, which a prefetch never faults on).
__attribute__((always_inline)) inline void prefetch_ahead(void const* p) noexcept {
  _mm_prefetch(reinterpret_cast<char const*>(reinterpret_cast<std::uintptr_t>(p) + 1024),
               _MM_HINT_T0);
}

// Each iteration prefetches 1 KiB ahead in every input stream: on the 16-core hosts of the
// H100 and H200 machines 8-15% faster than the hardware prefetchers alone (bench/NOTES.md,
// cpu_adam_bench's u1-nt-pf1k).
template <bool Decoupled, bool Stream, class Grad>
__attribute__((target("avx512f"))) void avx512_body(constants const& c,
                                                    cpu_adam_arrays<Grad> const& a,
                                                    std::size_t first, std::size_t last) noexcept {
  outputs const o = outputs_of(a);
  __m512 const b1 = _mm512_set1_ps(c.b1), omb1 = _mm512_set1_ps(c.omb1);
  __m512 const b2 = _mm512_set1_ps(c.b2), omb2 = _mm512_set1_ps(c.omb2);
  __m512 const eps = _mm512_set1_ps(c.eps), scale = _mm512_set1_ps(c.scale);
  __m512 const step = _mm512_set1_ps(c.step_size), ibc2 = _mm512_set1_ps(c.inv_bc2_sqrt);
  __m512 const decay = _mm512_set1_ps(c.decay), l2 = _mm512_set1_ps(c.l2);
  std::size_t i = first;
  for (; i + 16 <= last; i += 16) {
    prefetch_ahead(a.master + i);
    prefetch_ahead(a.m + i);
    prefetch_ahead(a.v + i);
    prefetch_ahead(a.grad + i);
    __m512 g = _mm512_mul_ps(load16(a.grad + i), scale);
    __m512 w = _mm512_loadu_ps(a.master + i);
    if constexpr (Decoupled) {
      w = _mm512_mul_ps(w, decay);
    } else {
      g = _mm512_fmadd_ps(l2, w, g);
    }
    __m512 const m = _mm512_fmadd_ps(b1, _mm512_loadu_ps(a.m + i), _mm512_mul_ps(omb1, g));
    __m512 const v =
        _mm512_fmadd_ps(b2, _mm512_loadu_ps(a.v + i), _mm512_mul_ps(omb2, _mm512_mul_ps(g, g)));
    __m512 const denom = _mm512_fmadd_ps(_mm512_sqrt_ps(v), ibc2, eps);
    w                  = _mm512_fnmadd_ps(step, _mm512_div_ps(m, denom), w);
    if (Stream && o.separate) {
      store16<true>(o.m + i, m);
      store16<true>(o.v + i, v);
      store16<true>(o.master + i, w);
    } else {
      store16<false>(o.m + i, m);
      store16<false>(o.v + i, v);
      store16<false>(o.master + i, w);
    }
    if (a.bf16_out != nullptr) { store16_bf16<Stream>(a.bf16_out + i, w); }
  }
  if constexpr (Stream) { _mm_sfence(); }
  scalar_range<Decoupled>(c, a, i, last);
}

template <bool Decoupled, class Grad>
__attribute__((target("avx512f"))) void avx512_range(constants const& c,
                                                     cpu_adam_arrays<Grad> const& a,
                                                     std::size_t first, std::size_t last) noexcept {
  if (streamable(a, outputs_of(a), first, 64)) {
    avx512_body<Decoupled, true>(c, a, first, last);
  } else {
    avx512_body<Decoupled, false>(c, a, first, last);
  }
}

#endif  // WM_ZERO_X86

template <bool Decoupled, class Grad>
void range(cpu_isa isa, constants const& c, cpu_adam_arrays<Grad> const& a, std::size_t first,
           std::size_t last) noexcept {
#if WM_ZERO_X86
  if (isa == cpu_isa::avx512) { return avx512_range<Decoupled>(c, a, first, last); }
  if (isa == cpu_isa::avx2) { return avx2_range<Decoupled>(c, a, first, last); }
#endif
  (void)isa;
  scalar_range<Decoupled>(c, a, first, last);
}

}  // namespace cpu_adam_detail
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

/// The ranges an update of @p n elements is split in: eight per thread of at least 64 Ki
/// elements (1.75 MiB of traffic), claimed by free threads, so that one that shares its core
/// (with the caller's forward pass, the driver's threads) takes fewer instead of holding up the
/// update (bench/NOTES.md).
[[nodiscard]] inline std::size_t cpu_adam_tasks(std::size_t n, thread_pool const& pool) noexcept {
  return std::max<std::size_t>(
      1, std::min<std::size_t>(std::size_t{8} * pool.size(), (n + 65535) / 65536));
}

/**
 * @brief One Adam/AdamW step over @p a's n elements, split in up to 8 × size() contiguous ranges
 * (boundaries on 64 elements) that the pool's threads claim as they are free, run with @p isa's
 * body.
 * @throw wm::logic_error @p isa is not supported by this CPU, a required array is null, or
 * step < 1.
 */
template <class Grad>
void cpu_adam_update(cpu_adam_options const& opt, cpu_adam_step s, cpu_adam_arrays<Grad> const& a,
                     thread_pool& pool, cpu_isa isa = best_cpu_isa()) {
  static_assert(std::same_as<Grad, float> || std::same_as<Grad, bf16_bits>,
                "gradients are float or bf16 bits");
  WM_EXPECTS(cpu_supports(isa), "an instruction set this CPU supports");
  WM_EXPECTS(s.step >= 1, "a 1-based Adam step count");
  if (a.n == 0) { return; }
  WM_EXPECTS(a.master != nullptr && a.m != nullptr && a.v != nullptr && a.grad != nullptr,
             "master weights, m, v and gradients for every element");
  WM_EXPECTS((a.master_out == nullptr) == (a.m_out == nullptr) &&
                 (a.m_out == nullptr) == (a.v_out == nullptr),
             "all three outputs (master, m, v) or none");
  auto const c             = cpu_adam_detail::make_constants(opt, s);
  std::size_t const tasks  = cpu_adam_tasks(a.n, pool);
  std::size_t const blocks = (a.n + 63) / 64;
  pool.run_claimed(tasks, [&](std::size_t t) {
    std::size_t const first = std::min(a.n, blocks * t / tasks * 64);
    std::size_t const last  = std::min(a.n, blocks * (t + 1) / tasks * 64);
    if (opt.decoupled) {
      cpu_adam_detail::range<true>(isa, c, a, first, last);
    } else {
      cpu_adam_detail::range<false>(isa, c, a, first, last);
    }
  });
}

}  // namespace wm::detail::zero
