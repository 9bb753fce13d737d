// SPDX-License-Identifier: Apache-2.0
// GPU tests of wm::zero_optimizer (the zero_test program): device and host memory against the
// formula of docs/design.md, "ZeRO memory", stages 1-3, with and without offload_host; bad input
// is rejected.
// Every case is [ranked]: it runs inside every rank (tests/support/ranks.hpp), with one rank
// (ctest zero_ranked_gpu) and with one rank per GPU (zero_ranked_multi_gpu), so the same code
// checks world 1 and world N.
#include <wm/zero.cuh>

#include <algorithm>
#include <cstddef>
#include <vector>

#include "catch.hpp"
#include "ranks.hpp"
#include "zero_common.cuh"
#include "zero_model.cuh"

using namespace zero_cases;

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
