// SPDX-License-Identifier: Apache-2.0
// Helpers shared by the zero_test program's tests of wm::zero_optimizer (stages_test.cu,
// checkpoint_load_test.cu, offload_test.cu, memory_test.cu), beside those of zero_common.cuh: the
// model, its optimizers and its gradients, typed reads and writes of weights and gradients, and
// the checks that two optimizers hold the same bits. A helper that one file uses is in that file.
//
// Gradients are k / 64 · loss scale with k in [-31, 31] (fresh random each run): bf16 holds them
// and their sums over up to 8 ranks exactly, so the bf16 all-reduce adds no rounding that the
// float64 reference of stages_test.cu lacks.
#pragma once

#include <wm/comm.hpp>
#include <wm/zero.cuh>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "catch.hpp"
#include "zero_common.cuh"

namespace zero_cases {

using wm::zero_element_type;

struct model_param {
  std::string name;
  std::vector<std::size_t> shape;
  zero_element_type type;
};

inline std::vector<model_param> model(int which) {
  if (which == 1) { return {{"only", {1}, zero_element_type::bf16}}; }
  // Awkward sizes: not multiples of anything, an empty one, a scalar, an fp32 one between bf16
  // ones (a type change closes a bucket), one larger than a bucket.
  return {{"emb", {37, 5}, zero_element_type::bf16}, {"w1", {64, 33}, zero_element_type::bf16},
          {"b1", {33}, zero_element_type::bf16},     {"empty", {0, 4}, zero_element_type::bf16},
          {"scale", {19}, zero_element_type::f32},   {"w2", {33, 7}, zero_element_type::bf16},
          {"s", {}, zero_element_type::bf16},        {"w3", {1000}, zero_element_type::bf16}};
}

inline std::size_t elements_of(model_param const& p) {
  std::size_t n = 1;
  for (auto d : p.shape) { n *= d; }
  return n;
}

// The optimizer's description of the parameters of @p mp.
inline std::vector<wm::zero_parameter> zero_params(std::vector<model_param> const& mp) {
  std::vector<wm::zero_parameter> params;
  for (auto const& p : mp) { params.push_back({p.name, p.shape, p.type}); }
  return params;
}

template <class O>
O make_optimizer() {
  if constexpr (std::is_same_v<O, wm::adam>) {
    wm::adam a;
    a.decoupled       = true;  // AdamW
    a.weight_decay    = 0.01f;
    a.bias_correction = wm::adam_bias_correction::global_step;
    return a;
  } else {
    return wm::sgd{0.001f};
  }
}

// The gradient rank r computes for element i of parameter p at step t: k / 64 · scale.
inline double grad_value(std::uint64_t seed, int t, int r, std::size_t p, std::size_t i,
                         double scale) {
  auto const k = static_cast<int>(mix(seed ^ mix(t * 7919ull + r * 104729ull + p * 15485863ull) ^
                                      (i * 0x9E3779B97F4A7C15ull)) %
                                  63) -
                 31;
  return k / 64.0 * scale;
}

// The gradients rank r computes for the @p n elements of parameter p at step t (grad_value).
inline std::vector<double> grad_values(std::uint64_t seed, int t, int r, std::size_t p,
                                       std::size_t n, double scale) {
  std::vector<double> g(n);
  for (std::size_t i = 0; i < n; ++i) { g[i] = grad_value(seed, t, r, p, i, scale); }
  return g;
}

// Writes @p values (converted to the parameter's type) to device memory @p dst, on @p s after
// the work on it (a copy from pageable memory has returned once the values are staged).
inline void write_typed(zero_element_type type, void* dst, std::vector<double> const& values,
                        wm::communicator& comm, cudaStream_t s) {
  if (values.empty()) { return; }
  comm.synchronize(cuda::stream_ref{s});  // waits with the communicator's deadline
  auto put = [&](auto tag) {
    using T = decltype(tag);
    std::vector<T> h(values.size());
    for (std::size_t i = 0; i < h.size(); ++i) { h[i] = from_double<T>(values[i]); }
    WM_CUDA_TRY(cudaMemcpyAsync(dst, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice, s));
  };
  if (type == zero_element_type::f32) {
    put(float{});
  } else {
    put(bf16{});
  }
}

inline std::vector<double> read_typed(zero_element_type type, void const* src, std::size_t n,
                                      wm::communicator& comm, cudaStream_t s) {
  std::vector<double> out(n);
  auto get = [&](auto tag) {
    using T = decltype(tag);
    std::vector<T> h(n);
    comm.synchronize(cuda::stream_ref{s});  // waits with the communicator's deadline
    WM_CUDA_TRY(cudaMemcpyAsync(h.data(), src, n * sizeof(T), cudaMemcpyDeviceToHost, s));
    comm.synchronize(cuda::stream_ref{s});
    for (std::size_t i = 0; i < n; ++i) { out[i] = to_double(h[i]); }
  };
  if (n == 0) { return out; }
  if (type == zero_element_type::f32) {
    get(float{});
  } else {
    get(bf16{});
  }
  return out;
}

template <class O>
void* weights_ptr(O& opt, std::size_t p, zero_element_type type) {
  return type == zero_element_type::f32 ? static_cast<void*>(opt.template weights<float>(p).data())
                                        : static_cast<void*>(opt.template weights<bf16>(p).data());
}
template <class O>
void* gradients_ptr(O& opt, std::size_t p, zero_element_type type) {
  return type == zero_element_type::f32
             ? static_cast<void*>(opt.template gradients<float>(p).data())
             : static_cast<void*>(opt.template gradients<bf16>(p).data());
}

// Sets the compute weights of parameter @p p of @p opt to @p w rounded to @p type, on @p s.
template <class O>
void set_weights_from(O& opt, std::size_t p, zero_element_type type, std::vector<double> const& w,
                      stream_holder const& s) {
  if (type == zero_element_type::f32) {
    std::vector<float> h(w.begin(), w.end());
    opt.set_weights(p, h.data(), s);
  } else {
    std::vector<bf16> h(w.size());
    for (std::size_t i = 0; i < w.size(); ++i) { h[i] = __double2bfloat16(w[i]); }
    opt.set_weights(p, h.data(), s);
  }
}

// Writes step @p t's gradients of every parameter of @p opt (grad_value, scaled by
// @p loss_scale) and reduces each bucket, as backward does.
template <class O>
void backward(O& opt, std::vector<model_param> const& mp, std::uint64_t seed, int t,
              double loss_scale, wm::communicator& comm, stream_holder const& s) {
  auto const& plan = opt.layout();
  for (std::size_t b = 0; b < opt.buckets(); ++b) {
    for (auto p : plan.buckets[b].params) {
      auto const g = grad_values(seed, t, comm.rank(), p, elements_of(mp[p]), loss_scale);
      write_typed(mp[p].type, gradients_ptr(opt, p, mp[p].type), g, comm, s.s);
    }
    opt.reduce_gradients(b, s);
  }
}

// One training step of @p opt on the gradients of grad_value (bucket by bucket, as backward).
template <class O>
void train_step(O& opt, std::vector<model_param> const& mp, std::uint64_t seed, int t,
                double loss_scale, wm::communicator& comm, stream_holder const& s) {
  backward(opt, mp, seed, t, loss_scale, comm, s);
  opt.step(0.05f * static_cast<float>(1 + t), s);
}

// Parameter @p p's compute weights (stage 3: gathered; default groups, group p is parameter p).
template <class O>
std::vector<double> read_param(O& opt, std::size_t p, model_param const& mp, wm::communicator& comm,
                               stream_holder const& s) {
  if constexpr (O::stage == 3) {
    opt.gather(p, s);
    auto v = read_typed(mp.type, weights_ptr(opt, p, mp.type), elements_of(mp), comm, s.s);
    opt.release(p);
    return v;
  } else {
    return read_typed(mp.type, weights_ptr(opt, p, mp.type), elements_of(mp), comm, s.s);
  }
}

// The same weights, uniform in [-1, 1) from @p seed, into the nonempty parameters of every one
// of @p opts.
template <class... O>
void set_random_weights_of(std::vector<model_param> const& mp, std::uint64_t seed,
                           wm::communicator& comm, stream_holder const& s, O&... opts) {
  std::mt19937_64 rng{seed};
  std::uniform_real_distribution<double> u(-1, 1);
  for (std::size_t p = 0; p < mp.size(); ++p) {
    std::vector<double> w(elements_of(mp[p]));
    if (w.empty()) { continue; }
    for (auto& x : w) { x = u(rng); }
    (set_weights_from(opts, p, mp[p].type, w, s), ...);
    comm.synchronize(s);
  }
}

// The same weights, uniform in [-1, 1) from @p seed, into the nonempty parameters of @p a and @p b.
template <class O>
void set_same_random_weights(O& a, O& b, std::vector<model_param> const& mp, std::uint64_t seed,
                             wm::communicator& comm, stream_holder const& s) {
  set_random_weights_of(mp, seed, comm, s, a, b);
}

// Poisons (NaN) every compute weight of @p a and @p b: a step that applies must rewrite them.
template <class O>
void poison_weights(O& a, O& b, std::vector<model_param> const& mp, wm::communicator& comm,
                    stream_holder const& s) {
  for (std::size_t p = 0; p < mp.size(); ++p) {
    std::vector<double> const nan(elements_of(mp[p]), std::numeric_limits<double>::quiet_NaN());
    write_typed(mp[p].type, weights_ptr(a, p, mp[p].type), nan, comm, s.s);
    write_typed(mp[p].type, weights_ptr(b, p, mp[p].type), nan, comm, s.s);
  }
}

// The compute weights of @p a and @p b: the same bits, none left NaN (poisoned).
template <class O>
void require_same_weights(O& a, O& b, std::vector<model_param> const& mp, wm::communicator& comm,
                          stream_holder const& s) {
  for (std::size_t p = 0; p < mp.size(); ++p) {
    auto const wa = read_param(a, p, mp[p], comm, s);
    auto const wb = read_param(b, p, mp[p], comm, s);
    REQUIRE(wa.size() == wb.size());
    for (std::size_t i = 0; i < wa.size(); ++i) {
      INFO("weight " << mp[p].name << "[" << i << "]");
      REQUIRE(!std::isnan(wa[i]));
      REQUIRE(std::memcmp(&wa[i], &wb[i], sizeof(double)) == 0);
    }
  }
}

// The master weights and the optimizer states of this rank's shard in @p a and @p b: the same
// bits. They are read into buffers filled with @p poison_a and @p poison_b, by std::memcpy from
// host memory (@p host) or else by cudaMemcpy.
template <class O>
void require_same_shards(O& a, O& b, wm::communicator& comm, stream_holder const& s, bool host,
                         std::uint32_t poison_a, std::uint32_t poison_b) {
  std::size_t const n = a.layout().state_elements;
  comm.synchronize(s);
  for (int k = -1; k < wm::adam::states; ++k) {
    INFO("state " << k << " (-1: master weights)");
    std::vector<std::uint32_t> ga(n, poison_a), gb(n, poison_b);
    void const* const sa = k < 0 ? a.master_shard() : a.state_shard(k);
    void const* const sb = k < 0 ? b.master_shard() : b.state_shard(k);
    if (host) {
      std::memcpy(ga.data(), sa, n * 4);
      std::memcpy(gb.data(), sb, n * 4);
    } else {
      WM_CUDA_TRY(cudaMemcpy(ga.data(), sa, n * 4, cudaMemcpyDefault));
      WM_CUDA_TRY(cudaMemcpy(gb.data(), sb, n * 4, cudaMemcpyDefault));
    }
    std::size_t differ = 0;
    for (std::size_t i = 0; i < n; ++i) { differ += ga[i] != gb[i]; }
    REQUIRE(differ == 0);
  }
}

}  // namespace zero_cases
