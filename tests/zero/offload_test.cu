// SPDX-License-Identifier: Apache-2.0
// GPU tests of wm::zero_optimizer with offload_host (the zero_test program): the offload
// pipeline equals the unpipelined offload bit for bit (modes, spare-region pools, overlap with
// forward); one rank's veto makes every rank redo; a failed step leaves the optimizer unusable,
// naming the failure; destruction stops the pipeline's CPU Adam at a chunk boundary.
// Every case is [ranked]: it runs inside every rank (tests/support/ranks.hpp), with one rank
// (ctest zero_ranked_gpu) and with one rank per GPU (zero_ranked_multi_gpu), so the same code
// checks world 1 and world N.
#include <wm/zero.cuh>

#include <bit>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "catch.hpp"
#include "ranks.hpp"
#include "zero_common.cuh"
#include "zero_model.cuh"

using namespace zero_cases;

// The policy names the engine: an optimizer without offload carries none of the offload's members.
static_assert(sizeof(wm::zero_optimizer<wm::zero_stage<2>>) + 256 <
              sizeof(wm::zero_optimizer<wm::zero_stage<2>, wm::adam, wm::offload_host>));

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

// Weights uniform in [-1, 1) from @p seed into the nonempty parameters of @p opt.
template <class O>
void set_random_weights(O& opt, std::vector<model_param> const& mp, std::uint64_t seed,
                        wm::communicator& comm, stream_holder const& s) {
  set_random_weights_of(mp, seed, comm, s, opt);
}

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
