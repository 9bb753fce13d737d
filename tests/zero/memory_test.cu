// SPDX-License-Identifier: Apache-2.0
// GPU tests of wm::zero_optimizer (the zero_test program): device and host memory against the
// formula of docs/design.md, "ZeRO memory", stages 1-3, with and without offload_host; the
// device figure of memory() against the device memory the driver counts; bad input is rejected.
// Every case is [ranked]: it runs inside every rank (tests/support/ranks.hpp), with one rank
// (ctest zero_ranked_gpu) and with one rank per GPU (zero_ranked_multi_gpu), so the same code
// checks world 1 and world N.
#include <wm/zero.cuh>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "catch.hpp"
#include "device_memory.hpp"
#include "ranks.hpp"
#include "zero_common.cuh"
#include "zero_model.cuh"

using namespace zero_cases;

TEMPLATE_TEST_CASE("zero_optimizer memory against the design's formula", "[ranked]",
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
  // Every parameter's weights (stages 1-2) are a view of its own elements (as many as its shape,
  // multiplied out here) inside the weights arena, apart from the others': each holds what was
  // set for it after all were set, read back from the device through its view.
  if constexpr (TestType::value < 3) {
    stream_holder s;
    std::vector<std::vector<bf16>> set(params.size());  // alive until the stream is done
    for (std::size_t p = 0; p < params.size(); ++p) {
      std::size_t elements = 1;
      for (std::size_t d : params[p].shape) { elements *= d; }
      auto const w = opt.template weights<bf16>(p);
      INFO("parameter " << params[p].name);
      REQUIRE(w.size() == elements);
      set[p].assign(elements, __float2bfloat16(static_cast<float>(p + 1)));
      opt.set_weights(p, set[p].data(), s);
    }
    WM_CUDA_TRY(cudaStreamSynchronize(s.s));
    for (std::size_t p = 0; p < params.size(); ++p) {
      auto const w = opt.template weights<bf16>(p);
      std::vector<bf16> back(w.size());
      WM_CUDA_TRY(
          cudaMemcpy(back.data(), w.data(), w.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
      std::size_t wrong = 0;
      for (bf16 v : back) { wrong += __bfloat162float(v) == static_cast<float>(p + 1) ? 0 : 1; }
      INFO("parameter " << params[p].name);
      REQUIRE(wrong == 0);
    }
  }
}

namespace {

// Device bytes a zero_optimizer of this kind holds while it lives, measured: one optimizer is
// made and destroyed first (kernel modules load lazily at first launch; NCCL and the driver keep
// per-process state from first use), then the driver's count before construction, after it and
// after destruction (tests/support/device_memory.hpp).
//
// Tolerance: 2 MiB per device allocation of the optimizer (at most 10: weights, gradients,
// master weights, states, staging, pool, accumulation, scratch, counters, loss scale; the driver
// maps cudaMalloc memory in 2 MiB pages, and a small allocation may take a fresh page) plus 16 MiB
// for what streams and events hold on the device (two streams and one event per chunk with the
// offload pipeline) and what NCCL or the driver adds lazily. The model is sized so that every term
// of memory() but the scratch (under 1 MiB), and at world 8 the stage-3 shards, is larger than
// that: leaving out the staging, the gather pool or an arena fails. cudaMemGetInfo counts every
// process on the device: a measurement that misses is taken again (all ranks together, since
// construction is collective), up to three times, and each is printed.
template <class Optimizer>
void expect_measured_device_memory(wm::communicator& comm,
                                   std::vector<wm::zero_parameter> const& params,
                                   std::size_t bucket) {
  std::int64_t const tolerance = (2 * 10 + 16) * (std::int64_t{1} << 20);
  { Optimizer warm{comm, params, bucket}; }
  std::int64_t grew = 0, released = 0, reported = 0;
  bool ok = false;
  for (int attempt = 1; attempt <= 3 && !ok; ++attempt) {
    comm.barrier();
    auto const before = wm_test::read_device_memory();
    std::int64_t held = 0;
    {
      Optimizer opt{comm, params, bucket};
      reported = static_cast<std::int64_t>(opt.memory().total());
      held     = wm_test::read_device_memory().held();
      comm.barrier();  // every rank has measured before any destroys its part
    }
    grew     = held - before.held();
    released = held - wm_test::read_device_memory().held();
    std::printf(
        "zero memory, rank %d, attempt %d: memory().total() %lld bytes, measured growth "
        "%lld, released %lld (tolerance %lld)\n",
        comm.rank(), attempt, static_cast<long long>(reported), static_cast<long long>(grew),
        static_cast<long long>(released), static_cast<long long>(tolerance));
    bool const mine =
        std::abs(grew - reported) <= tolerance && std::abs(released - reported) <= tolerance;
    auto const all = comm.all_gather(mine ? 1 : 0);
    ok             = std::all_of(all.begin(), all.end(), [](int v) { return v == 1; });
  }
  INFO("memory().total() " << reported << ", measured growth at construction " << grew
                           << ", released at destruction " << released << ", tolerance "
                           << tolerance);
  REQUIRE(std::abs(grew - reported) <= tolerance);
  REQUIRE(std::abs(released - reported) <= tolerance);
}

}  // namespace

TEMPLATE_TEST_CASE("zero_optimizer memory(): the device holds what it reports (measured)",
                   "[ranked]", wm::zero_stage<1>, wm::zero_stage<2>, wm::zero_stage<3>) {
  auto& comm = wm_test::comm();
  // About 69M elements (1.1 GB of device memory at stage 1, world 1) in buckets of 64 MiB: the
  // staging (two buckets) and the stage-3 gather pool (two of the largest parameter) are
  // 128 MiB each.
  std::vector<wm::zero_parameter> const params{
      {"a", {8192, 4096}}, {"b", {20000003}}, {"c", {5000, 3001}}, {"d", {3}}};
  std::size_t const bucket = std::size_t{64} << 20;
  SECTION("device optimizer states") {
    expect_measured_device_memory<wm::zero_optimizer<TestType, wm::adam>>(comm, params, bucket);
  }
  SECTION("offload_host: only weights, gradients and buffers on the device") {
    expect_measured_device_memory<wm::zero_optimizer<TestType, wm::adam, wm::offload_host>>(
        comm, params, bucket);
  }
}

TEMPLATE_TEST_CASE("zero_optimizer offload_host memory against the design's formula", "[ranked]",
                   wm::zero_stage<1>, wm::zero_stage<2>, wm::zero_stage<3>) {
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
