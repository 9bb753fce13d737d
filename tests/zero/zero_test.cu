// SPDX-License-Identifier: Apache-2.0
// GPU tests of wm::zero_optimizer (issue 20) and of the communicator's device collectives it
// uses. Every case is [ranked]: it runs inside every rank (tests/support/ranks.hpp), with one
// rank (ctest zero_ranked_gpu) and with one rank per GPU (zero_ranked_multi_gpu), so the same
// code checks world 1 and world N.
//
// The reference is plain data-parallel mixed-precision training in float64 on the host, written
// from the documented semantics, not from wm's code: every rank's gradients summed and divided by
// the rank count (DDP), divided by the loss scale (GradScaler.unscale_), an inf/NaN anywhere
// skips the step (GradScaler.step) without counting it, clipping as
// torch.nn.utils.clip_grad_norm_ (one L2 norm over every parameter; coef = max / (norm + 1e-6),
// clamped to 1), then torch.optim.AdamW / torch.optim.SGD as their documentation writes the
// update. Gradients are k / 64 · loss scale with k in [-31, 31] (fresh random each run): bf16
// holds them and their sums over up to 8 ranks exactly, so the bf16 all-reduce adds no rounding
// the reference lacks.
#include <wm/zero.cuh>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "catch.hpp"
#include "ranks.hpp"

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

namespace {

using bf16 = __nv_bfloat16;
using wm::zero_element_type;

struct stream_holder {
  cudaStream_t s{};
  stream_holder() { WM_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~stream_holder() { (void)cudaStreamDestroy(s); }
  operator cuda::stream_ref() const { return cuda::stream_ref{s}; }
};

template <class T>
struct device_buffer {
  T* ptr{};
  std::size_t n{};
  explicit device_buffer(std::size_t count) : n{count} {
    WM_CUDA_TRY(cudaMalloc(&ptr, std::max<std::size_t>(count, 1) * sizeof(T)));
    WM_CUDA_TRY(cudaMemset(ptr, 0xff, std::max<std::size_t>(count, 1) * sizeof(T)));  // poison
    WM_CUDA_TRY(cudaDeviceSynchronize());  // legacy-stream work: non-blocking streams skip it
  }
  device_buffer(device_buffer const&) = delete;
  ~device_buffer() { (void)cudaFree(ptr); }
  void upload(std::vector<T> const& h) {
    WM_CUDA_TRY(cudaMemcpy(ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    WM_CUDA_TRY(cudaDeviceSynchronize());  // a pageable copy may return before its DMA ends
  }
  [[nodiscard]] std::vector<T> download() const {
    std::vector<T> h(n);
    WM_CUDA_TRY(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

// One seed for every rank: rank 0's, fresh per run.
std::uint64_t shared_seed(wm::communicator& comm) {
  std::uint64_t const mine =
      std::random_device{}() * 0x9E3779B97F4A7C15ull ^ std::random_device{}();
  return comm.all_gather(mine)[0];
}

std::uint64_t mix(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

double to_double(float v) {
  return v;
}
double to_double(bf16 v) {
  return static_cast<double>(__bfloat162float(v));
}

template <class T>
T from_double(double v) {
  if constexpr (std::is_same_v<T, float>) {
    return static_cast<float>(v);
  } else if constexpr (std::is_same_v<T, __half>) {
    return __double2half(v);
  } else {
    return __double2bfloat16(v);
  }
}

// ---- device collectives ------------------------------------------------------------------------

template <class T>
void check_collectives(wm::communicator& comm, std::uint64_t seed, std::size_t count) {
  stream_holder s;
  int const n  = comm.size();
  int const me = comm.rank();
  auto value   = [&](int r, std::size_t i) {  // small integers: exact sums in every type
    return static_cast<double>(static_cast<int>(mix(seed ^ (r * 1000003ull + i)) % 31) - 15);
  };
  auto const total = count * static_cast<std::size_t>(n);
  // all_reduce, sum and max, out of place and in place.
  {
    std::vector<T> h(total);
    for (std::size_t i = 0; i < total; ++i) { h[i] = from_double<T>(value(me, i)); }
    device_buffer<T> a(total), sum(total), mx(total);
    a.upload(h);
    comm.all_reduce(a.ptr, sum.ptr, total, s);
    comm.all_reduce(static_cast<T const*>(a.ptr), mx.ptr, total, s, wm::reduce_op::max);
    comm.all_reduce(a.ptr, a.ptr, total, s);  // in place
    comm.synchronize(s);
    auto const hs = sum.download(), hm = mx.download(), ha = a.download();
    for (std::size_t i = 0; i < total; ++i) {
      double es = 0, em = -1e30;
      for (int r = 0; r < n; ++r) {
        es += value(r, i);
        em = std::max(em, value(r, i));
      }
      REQUIRE(to_double(hs[i]) == es);
      REQUIRE(to_double(ha[i]) == es);
      REQUIRE(to_double(hm[i]) == em);
    }
  }
  // reduce_scatter in place (each rank's block is its own part of the send buffer).
  {
    std::vector<T> h(total);
    for (std::size_t i = 0; i < total; ++i) { h[i] = from_double<T>(value(me, i)); }
    device_buffer<T> a(total);
    a.upload(h);
    comm.reduce_scatter(a.ptr, a.ptr + static_cast<std::size_t>(me) * count, count, s);
    comm.synchronize(s);
    auto const ha = a.download();
    for (std::size_t i = 0; i < count; ++i) {
      std::size_t const at = static_cast<std::size_t>(me) * count + i;
      double e             = 0;
      for (int r = 0; r < n; ++r) { e += value(r, at); }
      REQUIRE(to_double(ha[at]) == e);
    }
  }
  // all_gather in place, and broadcast from the last rank.
  {
    std::vector<T> h(total);
    for (std::size_t i = 0; i < total; ++i) { h[i] = from_double<T>(value(me, i)); }
    device_buffer<T> a(total), b(count), c(count);
    a.upload(h);  // this rank's block is in place, the others' blocks are overwritten
    comm.all_gather(a.ptr + static_cast<std::size_t>(me) * count, a.ptr, count, s);
    std::vector<T> hb(count);
    for (std::size_t i = 0; i < count; ++i) { hb[i] = from_double<T>(value(me, 7 * i)); }
    b.upload(hb);
    comm.broadcast(b.ptr, c.ptr, count, n - 1, s);
    comm.synchronize(s);
    auto const ha = a.download(), hc = c.download();
    for (int r = 0; r < n; ++r) {
      for (std::size_t i = 0; i < count; ++i) {
        std::size_t const at = static_cast<std::size_t>(r) * count + i;
        REQUIRE(to_double(ha[at]) == value(r, at));
      }
    }
    for (std::size_t i = 0; i < count; ++i) { REQUIRE(to_double(hc[i]) == value(n - 1, 7 * i)); }
  }
}

TEMPLATE_TEST_CASE("communicator device collectives against a host sum", "[ranked]", float, double,
                   bf16) {
  auto& comm              = wm_test::comm();
  std::size_t const count = GENERATE(1, 7, 1000);
  check_collectives<TestType>(comm, shared_seed(comm), count);
}

TEST_CASE("communicator device collectives reject bad arguments", "[ranked]") {
  auto& comm = wm_test::comm();
  stream_holder s;
  float* null = nullptr;
  REQUIRE_THROWS_AS(comm.all_reduce(null, null, 4, s), wm::logic_error);
  REQUIRE_THROWS_AS(comm.broadcast(null, null, 4, comm.size(), s), wm::logic_error);
  REQUIRE_NOTHROW(comm.all_gather(null, null, 0, s));  // nothing to move: no NCCL call
}

// ---- the reference
// -------------------------------------------------------------------------------

struct model_param {
  std::string name;
  std::vector<std::size_t> shape;
  zero_element_type type;
};

std::vector<model_param> model(int which) {
  if (which == 1) { return {{"only", {1}, zero_element_type::bf16}}; }
  // Awkward sizes: not multiples of anything, an empty one, a scalar, an fp32 one between bf16
  // ones (a type change closes a bucket), one larger than a bucket.
  return {{"emb", {37, 5}, zero_element_type::bf16}, {"w1", {64, 33}, zero_element_type::bf16},
          {"b1", {33}, zero_element_type::bf16},     {"empty", {0, 4}, zero_element_type::bf16},
          {"scale", {19}, zero_element_type::f32},   {"w2", {33, 7}, zero_element_type::bf16},
          {"s", {}, zero_element_type::bf16},        {"w3", {1000}, zero_element_type::bf16}};
}

std::size_t elements_of(model_param const& p) {
  std::size_t n = 1;
  for (auto d : p.shape) { n *= d; }
  return n;
}

// The optimizer's description of the parameters of @p mp.
std::vector<wm::zero_parameter> zero_params(std::vector<model_param> const& mp) {
  std::vector<wm::zero_parameter> params;
  for (auto const& p : mp) { params.push_back({p.name, p.shape, p.type}); }
  return params;
}

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
template <class O>
auto make_reference() {
  if constexpr (std::is_same_v<O, wm::adam>) {
    return ref_adamw{};
  } else {
    return ref_sgd{};
  }
}

// The gradient rank r computes for element i of parameter p at step t: k / 64 · scale.
double grad_value(std::uint64_t seed, int t, int r, std::size_t p, std::size_t i, double scale) {
  auto const k = static_cast<int>(mix(seed ^ mix(t * 7919ull + r * 104729ull + p * 15485863ull) ^
                                      (i * 0x9E3779B97F4A7C15ull)) %
                                  63) -
                 31;
  return k / 64.0 * scale;
}

// The gradients rank r computes for the @p n elements of parameter p at step t (grad_value).
std::vector<double> grad_values(std::uint64_t seed, int t, int r, std::size_t p, std::size_t n,
                                double scale) {
  std::vector<double> g(n);
  for (std::size_t i = 0; i < n; ++i) { g[i] = grad_value(seed, t, r, p, i, scale); }
  return g;
}

// Writes @p values (converted to the parameter's type) to device memory @p dst, on @p s after
// the work on it (a copy from pageable memory has returned once the values are staged).
void write_typed(zero_element_type type, void* dst, std::vector<double> const& values,
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

std::vector<double> read_typed(zero_element_type type, void const* src, std::size_t n,
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

namespace {

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

// Weights uniform in [-1, 1) from @p seed into the nonempty parameters of @p opt.
template <class O>
void set_random_weights(O& opt, std::vector<model_param> const& mp, std::uint64_t seed,
                        wm::communicator& comm, stream_holder const& s) {
  set_random_weights_of(mp, seed, comm, s, opt);
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

}  // namespace

TEMPLATE_TEST_CASE(
    "zero_optimizer checkpoint: saved by stage 2, loaded by another stage and "
    "bucket size, training continues bitwise identically",
    "[ranked]", wm::zero_stage<1>, wm::zero_stage<2>, wm::zero_stage<3>) {
  auto& comm = wm_test::comm();
  stream_holder s;
  std::uint64_t const seed = shared_seed(comm);
  auto const mp            = model(0);
  auto const params        = zero_params(mp);
  double const loss_scale  = 8;
  wm::zero_options options;
  options.loss_scale = static_cast<float>(loss_scale);
  auto const dir     = std::filesystem::temp_directory_path() /
                   ("wm-zero-ckpt-" + std::to_string(seed % 1000000007));
  wm::zero_optimizer<wm::zero_stage<2>, wm::adam> a{comm, params, 1024, make_optimizer<wm::adam>(),
                                                    options};
  std::mt19937_64 rng{seed};
  std::uniform_real_distribution<double> u(-1, 1);
  for (std::size_t p = 0; p < mp.size(); ++p) {
    std::vector<double> w(elements_of(mp[p]));
    for (auto& x : w) { x = u(rng); }
    set_weights_from(a, p, mp[p].type, w, s);
    comm.synchronize(s);
  }
  train_step(a, mp, seed, 0, loss_scale, comm, s);
  train_step(a, mp, seed, 1, loss_scale, comm, s);
  a.save(dir, s);
  REQUIRE(std::filesystem::exists(wm::detail::zero::shard_file(dir, comm.rank())));

  wm::zero_optimizer<TestType, wm::adam> b{comm, params, 4096, make_optimizer<wm::adam>(), options};
  b.load(dir, s);
  REQUIRE(b.applied_steps(s) == 2);
  for (std::size_t p = 0; p < mp.size(); ++p) {
    INFO("parameter " << mp[p].name << " right after the load");
    REQUIRE(read_param(b, p, mp[p], comm, s) == read_param(a, p, mp[p], comm, s));
  }
  for (int t = 2; t < 4; ++t) {
    train_step(a, mp, seed, t, loss_scale, comm, s);
    train_step(b, mp, seed, t, loss_scale, comm, s);
  }
  REQUIRE(b.applied_steps(s) == 4);
  for (std::size_t p = 0; p < mp.size(); ++p) {
    INFO("parameter " << mp[p].name << " two steps after the load");
    REQUIRE(read_param(b, p, mp[p], comm, s) == read_param(a, p, mp[p], comm, s));
  }
  // Another optimizer, or no checkpoint at all: every rank gets the error.
  wm::zero_optimizer<TestType, wm::sgd> c{comm, params, 4096, wm::sgd{}, options};
  REQUIRE_THROWS_AS(c.load(dir, s), wm::io_error);
  REQUIRE_THROWS_AS(b.load(dir / "missing", s), wm::io_error);
  comm.barrier();
  if (comm.rank() == 0) { std::filesystem::remove_all(dir); }
}

// Dynamic loss scaling (fp16) against torch.cuda.amp.GradScaler's documented rule: an inf/NaN
// step is skipped and the scale multiplied by backoff_factor; growth_interval applied steps in a
// row multiply it by growth_factor. Gradients are k / 64 times the scale in effect (k in
// [-31, 31]; fp16 holds them and their sums over 8 ranks exactly); SGD; the fp32 master weights
// must follow w -= lr · k / 64 on the applied steps only.
TEMPLATE_TEST_CASE("zero_optimizer dynamic loss scale follows GradScaler", "[ranked]",
                   wm::zero_stage<1>, wm::zero_stage<2>, wm::zero_stage<3>) {
  auto& comm              = wm_test::comm();
  int const world         = comm.size();
  std::size_t const n     = 1000;
  float const lr          = 0.01f;
  std::uint64_t const key = shared_seed(comm);  // the same weights and gradients on every rank
  INFO("seed " << key);
  std::vector<wm::zero_parameter> params{{"w", {n}, zero_element_type::f16}};
  wm::zero_options options;
  options.loss_scale            = 1024.0f;
  options.dynamic_loss_scale    = true;
  options.scale_growth_interval = 2;
  wm::zero_optimizer<TestType, wm::sgd> opt{comm, params, 1024, wm::sgd{}, options};  // no decay
  stream_holder s;
  std::vector<double> w(n);
  std::vector<__half> h(n);
  for (std::size_t i = 0; i < n; ++i) {
    h[i] = __double2half(static_cast<double>((key + i * 13) % 97) / 97.0 - 0.5);
    w[i] = static_cast<double>(__half2float(h[i]));
  }
  opt.set_weights(0, h.data(), s);
  REQUIRE(opt.loss_scale(s) == 1024.0f);
  // Steps 2 and 5 have an inf on the last rank. Scales: 1024, 1024 (grows after it) -> 2048,
  // skip -> 1024, 1024, 1024 (grows) -> 2048, skip -> 1024, 1024.
  int const steps        = 7;
  float const expected[] = {1024, 2048, 1024, 1024, 2048, 1024, 1024};  // after each step
  bool const inf_at[]    = {false, false, true, false, false, true, false};
  std::int64_t applied   = 0;
  float scale            = 1024.0f;
  for (int t = 0; t < steps; ++t) {
    REQUIRE(opt.loss_scale(s) == scale);
    std::vector<__half> g(n);
    std::vector<double> k(n);
    for (std::size_t i = 0; i < n; ++i) {
      k[i] = static_cast<double>(
          static_cast<int>((key + i * 7 + static_cast<std::uint64_t>(t)) % 63) - 31);
      g[i] = __double2half(k[i] / 64.0 * scale);
    }
    if (inf_at[t] && comm.rank() == world - 1) { g[n / 2] = __double2half(INFINITY); }
    auto grads = opt.template gradients<__half>(0);
    REQUIRE(grads.size() == n);
    WM_CUDA_TRY(
        cudaMemcpyAsync(grads.data(), g.data(), n * sizeof(__half), cudaMemcpyHostToDevice, s.s));
    for (std::size_t b = 0; b < opt.buckets(); ++b) { opt.reduce_gradients(b, s); }
    opt.step(lr, s);
    REQUIRE(opt.last_step_skipped(s) == inf_at[t]);
    if (!inf_at[t]) {
      ++applied;
      for (std::size_t i = 0; i < n; ++i) { w[i] -= static_cast<double>(lr) * k[i] / 64.0; }
    }
    REQUIRE(opt.applied_steps(s) == applied);
    scale = expected[t];
    REQUIRE(opt.loss_scale(s) == scale);
    float got = 0;
    WM_CUDA_TRY(cudaMemcpy(&got, opt.loss_scale_device(), sizeof(float), cudaMemcpyDeviceToHost));
    REQUIRE(got == scale);
  }
  // The master shard of this rank: the elements it owns follow the reference.
  auto const& plan = opt.layout();
  std::vector<float> master(plan.state_elements);
  comm.synchronize(s);
  WM_CUDA_TRY(cudaMemcpy(master.data(), opt.master_shard(), master.size() * sizeof(float),
                         cudaMemcpyDeviceToHost));
  std::size_t checked = 0;
  for (auto const& f : plan.fragments(comm.rank())) {
    for (std::size_t j = 0; j < f.elements; ++j) {
      INFO("element " << f.param_offset + j);
      REQUIRE(std::abs(master[f.state_offset + j] - w[f.param_offset + j]) <= 1e-5);
    }
    checked += f.elements;
  }
  // Every element is owned by exactly one rank.
  std::vector<std::uint64_t> counts = comm.all_gather(static_cast<std::uint64_t>(checked));
  std::uint64_t total               = 0;
  for (auto c : counts) { total += c; }
  REQUIRE(total == n);
}

TEST_CASE("zero_optimizer offload_host dynamic loss scale follows GradScaler", "[ranked]") {
  // The offload path keeps the scale on the host (its step waits for the norm anyway) and copies
  // it to loss_scale_device(); the same rule and sequence as the device path above.
  auto& comm          = wm_test::comm();
  int const world     = comm.size();
  std::size_t const n = 1000;
  std::vector<wm::zero_parameter> params{{"w", {n}, zero_element_type::bf16}};
  wm::zero_options options;
  options.loss_scale            = 256.0f;
  options.dynamic_loss_scale    = true;
  options.scale_growth_interval = 2;
  options.scale_growth          = 4.0f;
  options.scale_backoff         = 0.25f;
  wm::zero_optimizer<wm::zero_stage<2>, wm::adam, wm::offload_host> opt{comm, params, 1024,
                                                                        wm::adam{}, options};
  stream_holder s;
  float const expected[] = {256, 1024, 256, 64, 64, 256};  // after each step
  bool const inf_at[]    = {false, false, true, true, false, false};
  std::int64_t applied   = 0;
  for (int t = 0; t < 6; ++t) {
    std::vector<bf16> g(n, __float2bfloat16(0.25f));
    if (inf_at[t] && comm.rank() == world - 1) { g[7] = __float2bfloat16(NAN); }
    auto grads = opt.template gradients<bf16>(0);
    WM_CUDA_TRY(
        cudaMemcpyAsync(grads.data(), g.data(), n * sizeof(bf16), cudaMemcpyHostToDevice, s.s));
    for (std::size_t b = 0; b < opt.buckets(); ++b) { opt.reduce_gradients(b, s); }
    opt.step(1e-3f, s);
    REQUIRE(opt.last_step_skipped(s) == inf_at[t]);
    applied += inf_at[t] ? 0 : 1;
    REQUIRE(opt.applied_steps(s) == applied);
    REQUIRE(opt.loss_scale(s) == expected[t]);
    float got = 0;
    comm.synchronize(s);
    WM_CUDA_TRY(cudaMemcpy(&got, opt.loss_scale_device(), sizeof(float), cudaMemcpyDeviceToHost));
    REQUIRE(got == expected[t]);
  }
}

TEMPLATE_TEST_CASE("zero_optimizer offload pipeline equals the unpipelined offload bit for bit",
                   "[ranked]", wm::zero_stage<1>, wm::zero_stage<2>, wm::zero_stage<3>) {
  // Two optimizers on the same weights and gradients, one with the offload pipeline (each
  // bucket's CPU Adam starts as its gradients land, into a second host copy that step adopts or
  // drops), one without (the update after backward, in place). Steps that the pipeline computes
  // ahead (the last step's rate, an announced one), one it must redo (a new rate), one skipped
  // (an inf on the last rank), and per mode: no clipping, a threshold never reached (adopted),
  // clipping that scales every step (always redone), dynamic loss scaling; and per pool of spare
  // regions (zero_options::offload_spare_fraction) for the chunks updated before the step's
  // decision: the default, one for every chunk, a single one (the worker then waits for the
  // decision with chunks left), none (nothing ahead). Some steps sleep before `step`, so that the
  // worker gets as far ahead as the pool lets it; a redone or skipped step after an adopted one
  // starts with chunks whose values are in a region. Weights, master weights and both moments
  // must be the same bits after every step; the compute weights are poisoned (NaN) before each
  // step that applies, so every element must be written again. The pipeline's counts must add
  // up: an adopted step updates every chunk once (ahead or after the decision), another drops
  // what it did ahead, and never more chunks go ahead in a step than there are regions.
  using stage_t = TestType;
  using opt_t   = wm::zero_optimizer<stage_t, wm::adam, wm::offload_host>;
  auto& comm    = wm_test::comm();
  stream_holder s;
  int const world          = comm.size();
  std::uint64_t const seed = shared_seed(comm);
  int const mode           = GENERATE(0, 1, 2, 3);
  int const pool           = GENERATE(0, 1, 2, 3);  // default, every chunk, one region, none
  // zero_options::offload_overlap_forward: an adopted step returns before the CPU Adam ends;
  // weights_ready brings the buckets (all of them in forward order, or the lowest one at once, or
  // stage 3's gathers), and master_shard must first wait for the worker.
  bool const overlap = GENERATE(false, true);
  INFO("mode " << mode << " pool " << pool << " overlap " << overlap << " world " << world);
  auto const mp     = model(0);
  auto const params = zero_params(mp);
  wm::zero_options options;
  options.loss_scale    = 8.0f;
  options.max_grad_norm = mode == 1 ? 1e6f : mode == 2 ? 0.05f : 0.0f;
  if (mode == 3) {
    options.dynamic_loss_scale    = true;
    options.scale_growth_interval = 2;
  }
  wm::zero_options plain = options;
  plain.offload_pipeline = false;
  // The reference's CPU Adam on 3 pinned threads, the pipeline's on the default pool (one per
  // CPU, unpinned): the bits may not depend on either.
  plain.cpu_threads               = 3;
  plain.pin_cpu_threads           = true;
  options.offload_pipeline        = true;
  options.offload_overlap_forward = overlap;
  // Chunks of 64 elements: a bucket (up to 2112 elements) moves and is updated in up to 34 parts.
  options.offload_chunk_elements = 64;
  float const fractions[]        = {wm::zero_options{}.offload_spare_fraction, 1.0f, 1e-6f, 0.0f};
  options.offload_spare_fraction = fractions[pool];
  opt_t a{comm, params, 1024, make_optimizer<wm::adam>(), options};
  opt_t b{comm, params, 1024, make_optimizer<wm::adam>(), plain};
  REQUIRE(a.buckets() >= 4);
  // The pool: ceil(fraction × chunks) regions of the largest chunk's master weights and moments.
  std::size_t chunks = 0, nonempty = 0, largest = 0;
  for (auto const& bk : a.layout().buckets) {
    std::size_t const n = (bk.shard_elements + 63) / 64;
    chunks += std::max<std::size_t>(1, n);
    nonempty += n;
    largest = std::max(largest, std::min<std::size_t>(64, bk.shard_elements));
  }
  auto const stats0            = a.offload_stats();
  std::size_t const regions    = stats0.spare_regions;
  std::size_t const expected[] = {(chunks + 3) / 4, chunks, 1, 0};
  REQUIRE(regions == expected[pool]);
  REQUIRE(stats0.region_elements == largest);
  REQUIRE(a.memory().host == b.memory().host + regions * largest * 3 * sizeof(float));
  REQUIRE(stats0.chunks_ahead == 0);
  REQUIRE(stats0.peak_regions == 0);
  REQUIRE(stats0.cpu_adam_seconds == 0.0);
  REQUIRE(b.offload_stats().spare_regions == 0);
  if (mode == 0 && pool == 0 && !overlap) {
    // The fraction as written: j / chunks as a float a little above it still gives j regions
    // (as 0.1f of 10 chunks gives 1). Up to three such j, each a fresh optimizer.
    int checked = 0;
    for (std::size_t j = 1; j < chunks && checked < 3; ++j) {
      float const f = static_cast<float>(static_cast<double>(j) / static_cast<double>(chunks));
      if (static_cast<double>(f) * static_cast<double>(chunks) <= static_cast<double>(j)) {
        continue;  // rounded down: the ceiling is j either way
      }
      wm::zero_options o       = options;
      o.offload_spare_fraction = f;
      opt_t c{comm, params, 1024, make_optimizer<wm::adam>(), o};
      INFO("fraction " << f << " of " << chunks << " chunks");
      REQUIRE(c.offload_stats().spare_regions == j);
      ++checked;
    }
    REQUIRE((checked > 0 || std::has_single_bit(chunks)));  // 2^k chunks: every j / chunks exact
  }
  wm::zero_options odd       = options;
  odd.offload_chunk_elements = 100;  // not a multiple of 64
  REQUIRE_THROWS_AS((opt_t{comm, params, 1024, make_optimizer<wm::adam>(), odd}), wm::logic_error);
  for (float f : {-0.25f, 1.5f, std::numeric_limits<float>::quiet_NaN()}) {
    wm::zero_options bad       = options;
    bad.offload_spare_fraction = f;
    REQUIRE_THROWS_AS((opt_t{comm, params, 1024, make_optimizer<wm::adam>(), bad}),
                      wm::logic_error);
  }

  set_same_random_weights(a, b, mp, seed, comm, s);

  struct planned {
    float lr;
    bool announce;
    bool inf;
    bool ahead;  // the pipeline's update applies as computed (unless clipping scales)
  };
  // Chunks updated ahead from their place go to a region, from a region back to their place:
  // steps 3, 5 and 6 start with chunks in regions (modes that adopt), since the states are read
  // (which brings every chunk back to its place) only after steps 1, 3 and 6.
  planned const steps[] = {
      {0.05f, false, false, false},  // weights were just set: not computed ahead
      {0.05f, false, false, true},   // the last step's rate: computed ahead
      {0.1f, true, false, true},     // announced: computed ahead
      {0.2f, false, false, false},   // a new rate, not announced: redone after backward
      {0.2f, false, false, true},    // the last step's rate again
      {0.2f, false, true, false},    // an inf on the last rank: skipped everywhere
      {0.15f, true, false, true},    // announced, after a skip
  };
  std::int64_t applied = 0;
  for (int t = 0; t < static_cast<int>(std::size(steps)); ++t) {
    auto const& st = steps[t];
    INFO("step " << t << " lr " << st.lr);
    auto const before  = a.offload_stats();
    double const scale = a.loss_scale(s);
    REQUIRE(b.loss_scale(s) == scale);
    if (st.announce) {
      a.prepare_step(st.lr);
      b.prepare_step(st.lr);
    }
    auto const& plan = a.layout();
    for (std::size_t bk = 0; bk < a.buckets(); ++bk) {
      for (auto p : plan.buckets[bk].params) {
        auto g = grad_values(seed, t, comm.rank(), p, elements_of(mp[p]), scale);
        if (st.inf && comm.rank() == world - 1 && p == plan.buckets[bk].params.front()) {
          g[g.size() / 2] = std::numeric_limits<double>::infinity();
        }
        write_typed(mp[p].type, gradients_ptr(a, p, mp[p].type), g, comm, s.s);
        write_typed(mp[p].type, gradients_ptr(b, p, mp[p].type), g, comm, s.s);
      }
      a.reduce_gradients(bk, s);
      b.reduce_gradients(bk, s);
    }
    // Steps 1 to 5: the worker gets as far as the pool lets it before the decision.
    if (t >= 1 && t <= 5) { std::this_thread::sleep_for(std::chrono::milliseconds{20}); }
    if constexpr (stage_t::value < 3) {
      // Poison: a step that applies rewrites every compute weight. Not before the first step:
      // after set_weights the masters are taken from the compute weights at the next step.
      if (!st.inf && t > 0) { poison_weights(a, b, mp, comm, s); }
    }
    a.step(st.lr, s);
    b.step(st.lr, s);
    // The pipeline's update applies exactly on the steps it computed for; else it is redone.
    REQUIRE(a.last_step_pipelined() == (st.ahead && mode != 2));
    REQUIRE_FALSE(b.last_step_pipelined());
    bool const last = t + 1 == static_cast<int>(std::size(steps));
    if (overlap && last) {
      // The states first (the worker may still be updating them: master_shard waits for it),
      // the weights after: every bucket still comes.
      require_same_shards(a, b, comm, s, true, 0x7fc00001u, 0x7fc00002u);
    }
    if (overlap && (t % 2 == 0 || stage_t::value < 3)) {
      if (t % 2 == 0) {  // the forward's order: the last bucket (the first layers) first
        for (std::size_t bk = a.buckets(); bk-- > 0;) { a.weights_ready(bk, s); }
      } else {
        a.weights_ready(0, s);  // every bucket at once
      }
      a.weights_ready(a.buckets() - 1, s);  // nothing pending: does nothing
    }  // else (stage 3, odd steps): require_same_weights' gathers bring them
    // Compute weights: the same bits, none left poisoned.
    require_same_weights(a, b, mp, comm, s);
    if (overlap) {
      a.weights_ready(0, s);  // the tail settled (stage 3's gathers may have left none)
      REQUIRE_THROWS_AS(a.weights_ready(a.buckets(), s), wm::logic_error);
      a.weights_ready(wm::detail::zero::no_bucket, s);  // bucket_of an empty parameter: no-op
    }
    {
      auto const after = a.offload_stats();
      auto const ahead = after.chunks_ahead - before.chunks_ahead;
      auto const later = after.chunks_after - before.chunks_after;
      auto const drop  = after.chunks_dropped - before.chunks_dropped;
      auto const redo  = after.chunks_redone - before.chunks_redone;
      auto const waits = after.region_waits - before.region_waits;
      INFO("ahead " << ahead << " after " << later << " dropped " << drop << " redone " << redo
                    << " waits " << waits << " regions " << regions << " chunks " << nonempty);
      REQUIRE(ahead <= static_cast<std::int64_t>(regions));  // each holds a region until decided
      REQUIRE(after.peak_regions <= regions);
      REQUIRE(waits <= 1);  // once the worker waited, the step is decided
      if (regions == chunks) { REQUIRE(waits == 0); }  // a region for every chunk
      if (a.last_step_pipelined()) {
        REQUIRE(ahead + later == static_cast<std::int64_t>(nonempty));
        REQUIRE(drop == 0);
        REQUIRE(redo == 0);
      } else {
        REQUIRE(later == 0);
        REQUIRE(drop == ahead);
        REQUIRE(redo == (st.inf ? 0 : static_cast<std::int64_t>(nonempty)));
      }
    }
    REQUIRE(a.last_step_skipped(s) == st.inf);
    REQUIRE(b.last_step_skipped(s) == st.inf);
    applied += st.inf ? 0 : 1;
    REQUIRE(a.applied_steps(s) == applied);
    REQUIRE(b.applied_steps(s) == applied);
    // Master weights and moments of this rank's shard (pinned host memory), read into buffers
    // poisoned differently. Not after every step: reading them brings every chunk's values back
    // to its place, and the steps in between must work from wherever they are.
    if (t != 1 && t != 3 && !(last && !overlap)) { continue; }
    require_same_shards(a, b, comm, s, true, 0x7fc00001u, 0x7fc00002u);
  }
  // The steps that slept let the worker go ahead as far as the pool allows (timing: 20 ms for a
  // few chunks of 64 elements): with regions it went ahead; one region or none, it waited.
  auto const total = a.offload_stats();
  INFO("ahead " << total.chunks_ahead << " waits " << total.region_waits << " peak "
                << total.peak_regions);
  if (regions > 0) {
    REQUIRE(total.chunks_ahead > 0);
    REQUIRE(total.peak_regions > 0);
  } else {
    REQUIRE(total.chunks_ahead == 0);
  }
  if (regions <= 1) { REQUIRE(total.region_waits > 0); }
  // Every update ran on the CPU somewhere (pipeline or step): its time is counted.
  REQUIRE(total.cpu_adam_seconds > 0.0);
  REQUIRE(b.offload_stats().cpu_adam_seconds > 0.0);  // the unpipelined updates too
}

TEMPLATE_TEST_CASE("zero_optimizer offload overlap: one rank's veto makes every rank redo",
                   "[ranked]", wm::zero_stage<1>, wm::zero_stage<2>) {
  // Rank 0 alone calls reset_master_weights between backward and step 2 (its masters come from
  // the compute weights again), so it cannot adopt the pipeline's update; then no rank may: with
  // offload_overlap_forward an adopting rank all-gathers the buckets later and in another order
  // than a redoing one (a hang or wrong weights). Every rank must redo step 2, and adopt steps 1
  // and 3 (the last step's rate); weights, masters and moments equal an unpipelined optimizer
  // given the same calls, bit for bit, after every step.
  using opt_t = wm::zero_optimizer<TestType, wm::adam, wm::offload_host>;
  auto& comm  = wm_test::comm();
  stream_holder s;
  std::uint64_t const seed = shared_seed(comm);
  auto const mp            = model(0);
  auto const params        = zero_params(mp);
  wm::zero_options options;
  options.offload_chunk_elements  = 64;
  options.offload_overlap_forward = true;
  wm::zero_options plain          = options;
  plain.offload_pipeline          = false;
  plain.offload_overlap_forward   = false;
  opt_t a{comm, params, 1024, make_optimizer<wm::adam>(), options};
  opt_t b{comm, params, 1024, make_optimizer<wm::adam>(), plain};
  set_same_random_weights(a, b, mp, seed, comm, s);
  float const lr   = 0.05f;
  auto const& plan = a.layout();
  for (int t = 0; t < 4; ++t) {
    INFO("step " << t << " world " << comm.size());
    double const scale = a.loss_scale(s);
    for (std::size_t bk = 0; bk < a.buckets(); ++bk) {
      for (auto p : plan.buckets[bk].params) {
        auto const g = grad_values(seed, t, comm.rank(), p, elements_of(mp[p]), scale);
        write_typed(mp[p].type, gradients_ptr(a, p, mp[p].type), g, comm, s.s);
        write_typed(mp[p].type, gradients_ptr(b, p, mp[p].type), g, comm, s.s);
      }
      a.reduce_gradients(bk, s);
      b.reduce_gradients(bk, s);
    }
    if (t == 2 && comm.rank() == 0) {
      a.reset_master_weights();
      b.reset_master_weights();
    }
    a.step(lr, s);
    b.step(lr, s);
    // Step 0 follows set_weights (nothing ahead); 1 and 3 reuse the last step's rate.
    REQUIRE(a.last_step_pipelined() == (t == 1 || t == 3));
    if (a.last_step_pipelined()) {  // bucket 0's weights come last: not before weights_ready
      std::size_t const p = plan.buckets[0].params.front();
      REQUIRE_THROWS_AS(weights_ptr(a, p, mp[p].type), wm::logic_error);
    }
    for (std::size_t bk = a.buckets(); bk-- > 0;) { a.weights_ready(bk, s); }
    require_same_weights(a, b, mp, comm, s);
    require_same_shards(a, b, comm, s, true, 0x7fc00001u, 0x7fc00002u);
  }
}

namespace {

// A communicator of this rank alone, with @p timeout: the cases whose optimizer fails on a
// deadline run on it, so that each rank fails alone and none waits on another.
wm::communicator own_communicator(std::chrono::milliseconds timeout) {
  (void)wm_test::comm();  // inside a rank (its GPU selected)
  wm::communicator_options options;
  options.timeout = timeout;
  return wm::communicator{wm::unique_id::create(), 0, 1, options};
}

// Seconds that @p f takes.
template <class F>
double seconds_of(F&& f) {
  auto const start = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

TEMPLATE_TEST_CASE("zero_optimizer offload: a failed step leaves it unusable, naming the failure",
                   "[ranked]", wm::zero_stage<1>, wm::zero_stage<2>, wm::zero_stage<3>) {
  // A real failure: with no spare region (offload_spare_fraction 0) the pipeline's CPU Adam waits
  // for the step's decision at its first chunk, and the step comes later than the communicator's
  // deadline. The step must throw that wm::comm_error; from then on every operation on the state
  // throws a wm::logic_error that names the operation, says the optimizer is unusable and carries
  // the first failure's whole message (also after more calls failed); the layout and the
  // statistics still answer, and destruction returns at once. A checkpoint saved before the
  // failure loads into a new optimizer on the same communicator, which trains on. Each rank runs
  // on a communicator of its own (world 1), so every rank fails alone.
  using opt_t = wm::zero_optimizer<TestType, wm::adam, wm::offload_host>;
  using namespace std::chrono_literals;
  auto const deadline      = std::chrono::milliseconds{2000};
  wm::communicator comm    = own_communicator(deadline);
  std::uint64_t const seed = shared_seed(comm);  // this rank's own
  stream_holder s;
  auto const mp     = model(0);
  auto const params = zero_params(mp);
  wm::zero_options options;
  options.offload_chunk_elements = 64;
  options.offload_spare_fraction = 0.0f;  // no region: the first chunk waits for the decision
  auto const dir                 = std::filesystem::temp_directory_path() /
                   ("wm-zero-unusable-" + std::to_string(wm_test::comm().rank()) + "-" +
                    std::to_string(seed % 1000000007));
  auto a = std::make_unique<opt_t>(comm, params, 1024, make_optimizer<wm::adam>(), options);
  REQUIRE(a->offload_stats().spare_regions == 0);
  set_random_weights(*a, mp, seed, comm, s);
  train_step(*a, mp, seed, 0, a->loss_scale(s), comm, s);  // weights were set: nothing ahead
  REQUIRE(a->applied_steps(s) == 1);
  a->save(dir, s);
  std::size_t const n = a->layout().state_elements;
  std::vector<float> const saved(a->master_shard(), a->master_shard() + n);

  // Step 1: the pipeline assumes the last step's rate, so its CPU Adam starts and waits for the
  // decision; the step comes after the deadline.
  backward(*a, mp, seed, 1, a->loss_scale(s), comm, s);
  // The deadline runs from the job's wait for the decision: sleep past it once the wait began
  // (a starved worker would otherwise meet a step that came in time).
  auto const began = std::chrono::steady_clock::now();
  while (a->offload_stats().region_waits == 0 && std::chrono::steady_clock::now() - began < 30s) {
    std::this_thread::sleep_for(1ms);
  }
  REQUIRE(a->offload_stats().region_waits == 1);
  std::this_thread::sleep_for(deadline + 500ms);
  std::string first;
  try {
    a->step(0.05f, s);
  } catch (wm::comm_error const& e) { first = e.what(); }
  INFO("the failed step threw: '" << first << "'");
  REQUIRE(first.find("waited for step longer than the communicator's timeout") !=
          std::string::npos);

  auto const unusable = [&](char const* operation, auto&& call) {
    std::string message;
    try {
      call();
    } catch (wm::logic_error const& e) { message = e.what(); }
    INFO(operation << " threw: '" << message << "'");
    REQUIRE(message.find(std::string{"zero_optimizer::"} + operation + ":") != std::string::npos);
    REQUIRE(message.find("unusable because an earlier offload step failed") != std::string::npos);
    REQUIRE(message.find(first) != std::string::npos);
  };
  unusable("step", [&] { a->step(0.05f, s); });
  unusable("step", [&] { a->step(0.05f, s); });  // still the first failure's message
  unusable("reduce_gradients", [&] { a->reduce_gradients(0, s); });
  unusable("accumulate_gradients", [&] { a->accumulate_gradients(0, s); });
  unusable("weights_ready", [&] { a->weights_ready(a->buckets() - 1, s); });
  unusable("weights_ready", [&] { a->weights_ready(a->buckets(), s); });  // before the index
  unusable("weights", [&] { (void)weights_ptr(*a, 0, mp[0].type); });
  unusable("gradients", [&] { (void)gradients_ptr(*a, 0, mp[0].type); });
  unusable("set_weights", [&] {
    set_weights_from(*a, 0, mp[0].type, std::vector<double>(elements_of(mp[0]), 0.5), s);
  });
  unusable("master_shard", [&] { (void)a->master_shard(); });
  unusable("state_shard", [&] { (void)a->state_shard(1); });
  unusable("save", [&] { a->save(dir / "after", s); });
  unusable("load", [&] { a->load(dir, s); });
  unusable("applied_steps", [&] { (void)a->applied_steps(s); });
  unusable("last_step_skipped", [&] { (void)a->last_step_skipped(s); });
  unusable("loss_scale", [&] { (void)a->loss_scale(s); });
  if constexpr (TestType::value == 3) {
    unusable("gather", [&] { a->gather(0, s); });
    // release only drops a hold, and is left open: here the residency's own check answers.
    std::string why;
    try {
      a->release(0);
    } catch (wm::logic_error const& e) { why = e.what(); }
    REQUIRE(why.find("a group that is gathered") != std::string::npos);
  }
  REQUIRE_FALSE(std::filesystem::exists(dir / "after"));
  REQUIRE(a->buckets() >= 4);  // the layout still answers
  REQUIRE(a->offload_stats().region_waits == 1);
  double const destroyed = seconds_of([&] { a.reset(); });
  INFO("destruction took " << destroyed << " s");
  REQUIRE(destroyed < 1.0);

  // The recovery the docs name: the last checkpoint into a new optimizer, which trains on.
  opt_t b{comm, params, 1024, make_optimizer<wm::adam>(), options};
  b.load(dir, s);
  REQUIRE(b.applied_steps(s) == 1);
  std::vector<float> const loaded(b.master_shard(), b.master_shard() + n);
  REQUIRE(std::memcmp(loaded.data(), saved.data(), n * sizeof(float)) == 0);
  // Input errors are the caller's, not a failed step: they leave the optimizer usable.
  REQUIRE_THROWS_AS(b.reduce_gradients(b.buckets(), s), wm::logic_error);
  REQUIRE_THROWS_AS(b.weights_ready(b.buckets(), s), wm::logic_error);
  if constexpr (TestType::value == 3) {
    b.gather(0, s);
    REQUIRE_THROWS_AS(b.step(0.05f, s), wm::logic_error);  // a group still gathered
    b.release(0);
  }
  train_step(b, mp, seed, 1, b.loss_scale(s), comm, s);
  REQUIRE(b.applied_steps(s) == 2);
  REQUIRE_FALSE(b.last_step_skipped(s));
  std::filesystem::remove_all(dir);
}

TEST_CASE("zero_optimizer offload: destruction stops the pipeline's CPU Adam at a chunk boundary",
          "[ranked]") {
  // One fp32 parameter of 4 Mi elements in chunks of 64: the pipeline's job for its bucket has
  // 65536 chunks, and starts once reduce_gradients has sent them all. An adopted step waits for
  // the whole job, which measures it; an optimizer destroyed right after reduce_gradients must
  // return well before that (its job stops at the next chunk), beyond what destroying an idle one
  // of the same size costs. A job that ran to its end would take about the whole measure.
  using opt_t              = wm::zero_optimizer<wm::zero_stage<2>, wm::adam, wm::offload_host>;
  wm::communicator comm    = own_communicator(wm::communicator_options::default_timeout());
  std::uint64_t const seed = shared_seed(comm);
  stream_holder s;
  std::vector<model_param> const mp{{"big", {std::size_t{1} << 22}, zero_element_type::f32}};
  auto const params = zero_params(mp);
  wm::zero_options options;
  options.offload_chunk_elements = 64;
  options.offload_spare_fraction = 1.0f;  // a region for every chunk: the job never waits
  options.cpu_threads            = 2;     // ranks share the host
  auto make                      = [&] {
    auto o = std::make_unique<opt_t>(comm, params, 1024, make_optimizer<wm::adam>(), options);
    set_random_weights(*o, mp, seed, comm, s);
    train_step(*o, mp, seed, 0, o->loss_scale(s), comm, s);  // weights were set: nothing ahead
    return o;
  };
  auto a    = make();
  auto idle = make();
  REQUIRE(a->buckets() == 1);
  REQUIRE(a->offload_stats().spare_regions == (std::size_t{1} << 22) / 64);

  // Both measures begin once the gradients are on the host (the job goes on meanwhile).
  backward(*a, mp, seed, 1, a->loss_scale(s), comm, s);
  WM_CUDA_TRY(cudaDeviceSynchronize());
  double const whole = seconds_of([&] { a->step(0.05f, s); });  // the last step's rate: adopted
  REQUIRE(a->last_step_pipelined());
  // Freeing synchronizes the device: a's copies of the step must not count in the idle measure.
  WM_CUDA_TRY(cudaDeviceSynchronize());
  double const freeing = seconds_of([&] { idle.reset(); });
  backward(*a, mp, seed, 2, a->loss_scale(s), comm, s);
  WM_CUDA_TRY(cudaDeviceSynchronize());
  double const destroyed = seconds_of([&] { a.reset(); });
  INFO("the whole job " << whole << " s, destroying an idle optimizer " << freeing
                        << " s, one whose job just began " << destroyed << " s");
  REQUIRE(whole > 0.05);  // long enough to tell a job stopped from a job finished
  REQUIRE(destroyed < freeing + whole / 2);
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

TEMPLATE_TEST_CASE("zero_optimizer memory against the formula of DESIGN §8", "[ranked]",
                   wm::zero_stage<1>, wm::zero_stage<2>, wm::zero_stage<3>) {
  auto& comm      = wm_test::comm();
  int const world = comm.size();
  // Parameters large against the padding (128 bytes per parameter, world × 128 per bucket).
  std::vector<wm::zero_parameter> params{
      {"a", {300, 257}}, {"b", {100001}}, {"c", {64, 1000}}, {"d", {3}}};
  std::size_t const bucket = std::size_t{1} << 17;  // 128 KiB: several buckets
  wm::zero_optimizer<TestType, wm::adam> opt{comm, params, bucket};
  auto const& plan              = opt.layout();
  auto const mem                = opt.memory();
  std::size_t const shard_arena = plan.arena_bytes / static_cast<std::size_t>(world);
  REQUIRE(plan.arena_bytes % static_cast<std::size_t>(world) == 0);
  REQUIRE(mem.master_weights == plan.state_elements * 4);
  REQUIRE(mem.optimizer_states == 2 * plan.state_elements * 4);
  REQUIRE(plan.state_elements * 2 == shard_arena);  // bf16 shards, fp32 states
  std::size_t const staging =
      std::min<std::size_t>(2, plan.buckets.size()) * plan.max_bucket_bytes();
  if constexpr (TestType::value == 1) {
    REQUIRE(mem.weights == plan.arena_bytes);
    REQUIRE(mem.gradients == plan.arena_bytes);
    REQUIRE(mem.buffers == 0);
  } else if constexpr (TestType::value == 2) {
    REQUIRE(mem.weights == plan.arena_bytes);
    REQUIRE(mem.gradients == shard_arena);
    REQUIRE(mem.buffers == staging);
  } else {
    REQUIRE(mem.weights == shard_arena);
    REQUIRE(mem.gradients == shard_arena);
    REQUIRE(mem.buffers >= staging + plan.max_bucket_bytes());  // staging + the gather pool
  }
  std::vector<wm::detail::zero::param_spec> specs;
  for (auto const& p : params) { specs.push_back({p.name, p.elements(), p.type}); }
  auto const est            = wm::detail::zero::zero_memory_estimate(TestType::value, specs, world);
  double const model_states = static_cast<double>(mem.model_states());
  INFO("model states " << model_states << " formula " << est.device_bytes);
  // Padding only: at least the formula, within 3%.
  REQUIRE(model_states >= est.device_bytes);
  REQUIRE(model_states <= est.device_bytes * 1.03);
  REQUIRE(est.host_bytes == 0.0);
  // Everything but the formula's terms: the buffers (two buckets; stage 3 its pool) and a little
  // scratch.
  REQUIRE(mem.scratch < (std::size_t{1} << 20));
  // The device really has it: reading the weights of every parameter works (stages 1-2).
  if constexpr (TestType::value < 3) { REQUIRE(opt.template weights<bf16>(1).size() == 100001); }
}

TEMPLATE_TEST_CASE("zero_optimizer offload_host memory against the formula of DESIGN §8",
                   "[ranked]", wm::zero_stage<1>, wm::zero_stage<2>, wm::zero_stage<3>) {
  auto& comm      = wm_test::comm();
  int const world = comm.size();
  std::vector<wm::zero_parameter> params{
      {"a", {300, 257}}, {"b", {100001}}, {"c", {64, 1000}}, {"d", {3}}};
  wm::zero_optimizer<TestType, wm::adam, wm::offload_host> opt{comm, params, std::size_t{1} << 17};
  auto const& plan              = opt.layout();
  auto const mem                = opt.memory();
  std::size_t const shard_arena = plan.arena_bytes / static_cast<std::size_t>(world);
  REQUIRE(mem.master_weights == 0);  // on the host
  REQUIRE(mem.optimizer_states == 0);
  // The pipeline (on by default) keeps spare regions of master weights and moments for a quarter
  // of its chunks (16M elements; one per bucket here), each the largest chunk's size.
  std::size_t const second = 3 * plan.state_elements * 4;
  std::size_t chunks = 0, largest = 0;
  for (auto const& bk : plan.buckets) {
    std::size_t const chunk = std::size_t{1} << 24;
    chunks += std::max<std::size_t>(1, (bk.shard_elements + chunk - 1) / chunk);
    largest = std::max(largest, std::min(chunk, bk.shard_elements));
  }
  auto const st = opt.offload_stats();
  REQUIRE(st.spare_regions == (chunks + 3) / 4);
  REQUIRE(st.region_elements == largest);
  std::size_t const spare = st.spare_regions * largest * 3 * 4;
  REQUIRE(spare <= second);
  REQUIRE(mem.host == second + spare + 2 * shard_arena);
  {
    wm::zero_options plain;
    plain.offload_pipeline = false;
    wm::zero_optimizer<TestType, wm::adam, wm::offload_host> unpiped{
        comm, params, std::size_t{1} << 17, wm::adam{}, plain};
    REQUIRE(unpiped.memory().host == second + 2 * shard_arena);
    REQUIRE(unpiped.memory().model_states() == mem.model_states());
    wm::zero_options none;
    none.offload_spare_fraction = 0.0f;  // the pipeline without spare regions: 16 bytes too
    wm::zero_optimizer<TestType, wm::adam, wm::offload_host> bare{
        comm, params, std::size_t{1} << 17, wm::adam{}, none};
    REQUIRE(bare.memory().host == second + 2 * shard_arena);
    REQUIRE(bare.offload_stats().spare_regions == 0);
  }
  std::vector<wm::detail::zero::param_spec> specs;
  for (auto const& p : params) { specs.push_back({p.name, p.elements(), p.type}); }
  auto const est      = wm::detail::zero::zero_memory_estimate(TestType::value, specs, world, true);
  double const device = static_cast<double>(mem.model_states());
  double const host   = static_cast<double>(mem.host);
  INFO("device " << device << " formula " << est.device_bytes << "; host " << host << " formula "
                 << est.host_bytes);
  REQUIRE(device >= est.device_bytes);
  REQUIRE(device <= est.device_bytes * 1.03);
  // The formula's host terms (states, gradient shard) plus the weight shard sent back.
  REQUIRE(host >= est.host_bytes);
  REQUIRE(host <= est.host_bytes * 1.03 + static_cast<double>(shard_arena + second));
  REQUIRE(opt.master_shard() != nullptr);
  // The CPU Adam reads no fp16 and has only torch's epsilon form.
  std::vector<wm::zero_parameter> half{{"h", {10}, wm::zero_element_type::f16}};
  REQUIRE_THROWS_AS((wm::zero_optimizer<TestType, wm::adam, wm::offload_host>{comm, half, 1024}),
                    wm::logic_error);
  wm::adam sparse;
  sparse.epsilon = wm::adam_epsilon::sparse_adam;
  REQUIRE_THROWS_AS(
      (wm::zero_optimizer<TestType, wm::adam, wm::offload_host>{comm, params, 1024, sparse}),
      wm::logic_error);
}

TEST_CASE("zero_optimizer rejects bad input", "[ranked]") {
  auto& comm = wm_test::comm();
  std::vector<wm::zero_parameter> params{{"a", {10}}, {"b", {20}}};
  REQUIRE_THROWS_AS((wm::zero_optimizer<wm::zero_stage<2>>{comm, params, 0}), wm::logic_error);
  std::vector<wm::zero_parameter> dup{{"a", {10}}, {"a", {20}}};
  REQUIRE_THROWS_AS((wm::zero_optimizer<wm::zero_stage<2>>{comm, dup, 1024}), wm::logic_error);
  wm::zero_optimizer<wm::zero_stage<2>> opt{comm, params, 1024};
  REQUIRE_THROWS_AS((void)opt.state_shard(-1), wm::logic_error);
  REQUIRE_THROWS_AS((void)opt.state_shard(wm::adam::states), wm::logic_error);
  REQUIRE(opt.state_shard(wm::adam::states - 1) != nullptr);
  REQUIRE_THROWS_AS(opt.weights<float>(0), wm::logic_error);  // bf16 parameter
  REQUIRE_THROWS_AS(opt.weights<bf16>(2), wm::logic_error);
  REQUIRE_THROWS_AS(opt.index("c"), wm::logic_error);
  REQUIRE(opt.index("b") == 1);
  stream_holder s;
  REQUIRE_THROWS_AS(opt.reduce_gradients(opt.buckets(), s), wm::logic_error);
}
