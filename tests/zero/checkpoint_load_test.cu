// SPDX-License-Identifier: Apache-2.0
// GPU tests of wm::zero_optimizer (the zero_test program): a checkpoint saved by stage 2 loads
// into every stage and another bucket size and training continues bitwise identically; a save
// that fails on one rank fails on every rank and the previous checkpoint still loads; dynamic
// loss scaling follows GradScaler's rule on the device path and on the offload path.
// Every case is [ranked]: it runs inside every rank (tests/support/ranks.hpp), with one rank
// (ctest zero_ranked_gpu) and with one rank per GPU (zero_ranked_multi_gpu), so the same code
// checks world 1 and world N.
#include <wm/zero.cuh>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "ranks.hpp"
#include "zero_common.cuh"
#include "zero_model.cuh"

using namespace zero_cases;

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
  REQUIRE(std::filesystem::exists(wm::detail::zero::manifest_file(dir)));
  REQUIRE(std::filesystem::exists(wm::detail::zero::shard_file(dir, comm.rank(), 1)));

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

// This rank's master weights and optimizer states, as bits (device shards: no offload).
template <class O>
std::vector<std::vector<std::uint32_t>> shard_bits(O& opt, wm::communicator& comm,
                                                   stream_holder const& s) {
  std::size_t const n = opt.layout().state_elements;
  comm.synchronize(s);
  std::vector<std::vector<std::uint32_t>> out;
  for (int k = -1; k < wm::adam::states; ++k) {
    out.emplace_back(n);
    void const* const src = k < 0 ? opt.master_shard() : opt.state_shard(k);
    if (n > 0) { WM_CUDA_TRY(cudaMemcpy(out.back().data(), src, n * 4, cudaMemcpyDefault)); }
  }
  return out;
}

// The last rank cannot write (a directory has the name of its temporary file): the save throws
// on every rank, naming that rank, and the directory still holds the checkpoint saved before,
// whole: not the other ranks' new files beside the failing rank's old one.
TEST_CASE(
    "zero_optimizer checkpoint: a save that fails on one rank fails on every rank and "
    "the previous checkpoint loads",
    "[ranked]") {
  auto& comm = wm_test::comm();
  stream_holder s;
  std::uint64_t const seed = shared_seed(comm);
  auto const mp            = model(0);
  auto const params        = zero_params(mp);
  double const loss_scale  = 8;
  wm::zero_options options;
  options.loss_scale = static_cast<float>(loss_scale);
  auto const dir     = std::filesystem::temp_directory_path() /
                   ("wm-zero-ckpt-fail-" + std::to_string(seed % 1000000007));
  using opt_type = wm::zero_optimizer<wm::zero_stage<2>, wm::adam>;
  opt_type a{comm, params, 1024, make_optimizer<wm::adam>(), options};
  set_random_weights_of(mp, seed, comm, s, a);
  train_step(a, mp, seed, 0, loss_scale, comm, s);
  a.save(dir, s);
  std::vector<std::vector<double>> saved;
  for (std::size_t p = 0; p < mp.size(); ++p) { saved.push_back(read_param(a, p, mp[p], comm, s)); }
  auto const saved_shard = shard_bits(a, comm, s);

  train_step(a, mp, seed, 1, loss_scale, comm, s);
  int const failing  = comm.size() - 1;
  auto const blocker = dir / ("shard-" + std::to_string(failing) + ".zero.tmp");
  if (comm.rank() == failing) { std::filesystem::create_directory(blocker); }
  comm.barrier();
  std::string error;
  try {
    a.save(dir, s);
  } catch (wm::io_error const& e) { error = e.what(); }
  INFO("rank " << comm.rank() << " got: " << error);
  REQUIRE(error.find("rank " + std::to_string(failing) + ":") != std::string::npos);
  REQUIRE(a.applied_steps(s) == 2);  // the optimizer itself goes on

  opt_type b{comm, params, 1024, make_optimizer<wm::adam>(), options};
  b.load(dir, s);
  REQUIRE(b.applied_steps(s) == 1);
  for (std::size_t p = 0; p < mp.size(); ++p) {
    INFO("parameter " << mp[p].name);
    REQUIRE(read_param(b, p, mp[p], comm, s) == saved[p]);
  }
  REQUIRE(shard_bits(b, comm, s) == saved_shard);

  // Once the rank can write again, a save replaces the checkpoint whole.
  comm.barrier();
  if (comm.rank() == failing) { std::filesystem::remove(blocker); }
  comm.barrier();
  a.save(dir, s);
  b.load(dir, s);
  REQUIRE(b.applied_steps(s) == 2);
  REQUIRE(shard_bits(b, comm, s) == shard_bits(a, comm, s));
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
