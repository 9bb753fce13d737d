// SPDX-License-Identifier: Apache-2.0
// Host tests: the ZeRO bucket and shard plan (backward order, one element type per bucket,
// aligned parameters and shards, equal shards, fragments covering each parameter exactly once)
// on a hand-worked case and random parameter lists for 1 to 9 ranks; the memory formula against
// the ZeRO paper's figure 1.
#include <wm/detail/zero/plan.hpp>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"

namespace z = wm::detail::zero;

namespace {

std::vector<z::param_spec> random_params(std::mt19937_64& rng, std::size_t max_count) {
  std::uniform_int_distribution<std::size_t> count{0, max_count};
  std::uniform_int_distribution<int> kind{0, 9};
  std::vector<z::param_spec> ps;
  std::size_t const n = count(rng);
  // A few runs of one type, so buckets change type now and then.
  auto type = z::element_type::bf16;
  for (std::size_t i = 0; i < n; ++i) {
    int const k = kind(rng);
    if (k == 0) { type = static_cast<z::element_type>(rng() % 3); }
    std::size_t elements = 0;
    if (k <= 1) {
      elements = 0;  // empty
    } else if (k <= 5) {
      elements = 1 + rng() % 70;  // biases, norms: below one alignment unit
    } else if (k <= 8) {
      elements = 1 + rng() % 3000;
    } else {
      elements = 3000 + rng() % 40000;  // larger than most buckets below
    }
    // (Appended piece by piece: g++ 12 -O3 reports a false -Wrestrict for "p" + std::string.)
    std::string name = "p";
    name += std::to_string(i);
    name += '_';
    name += std::to_string(rng() % 1000);
    ps.push_back({std::move(name), elements, type});
  }
  return ps;
}

// Checks every layout rule of plan.hpp's header comment, from the plan's own fields.
void check_plan(z::plan const& pl, std::span<z::param_spec const> ps, std::size_t bucket_bytes,
                int world, std::size_t alignment) {
  auto const w = static_cast<std::size_t>(world);
  REQUIRE(pl.places.size() == ps.size());
  std::size_t arena = 0, state = 0;
  std::size_t prev_last_param = ps.size();  // parameter indices fall along the arena
  for (std::size_t b = 0; b < pl.buckets.size(); ++b) {
    auto const& bk       = pl.buckets[b];
    std::size_t const es = z::size_of(bk.type);
    INFO("bucket " << b);
    CHECK(bk.byte_offset == arena);
    CHECK(bk.byte_offset % alignment == 0);
    CHECK(bk.state_offset == state);
    CHECK(bk.elements == w * bk.shard_elements);
    CHECK((bk.shard_elements * es) % alignment == 0);
    CHECK(bk.shard_elements > 0);
    CHECK(bk.used_elements <= bk.elements);
    CHECK(bk.elements - bk.used_elements < w * alignment / es);  // padding below one unit per rank
    REQUIRE(!bk.params.empty());
    std::size_t end = 0;
    for (std::size_t p : bk.params) {
      CHECK(p < prev_last_param);  // backward order, inside and across buckets
      prev_last_param = p;
      CHECK(ps[p].type == bk.type);
      CHECK(ps[p].elements > 0);
      CHECK(pl.places[p].bucket == b);
      CHECK(pl.places[p].offset >= end);  // no overlap
      CHECK((pl.places[p].offset * es) % alignment == 0);
      CHECK(pl.byte_offset(p) % alignment == 0);
      CHECK(pl.places[p].offset - end < alignment / es);  // no gap beyond the alignment
      end = pl.places[p].offset + ps[p].elements;
    }
    CHECK(end == bk.used_elements);
    // Bucket size: within the request unless a single parameter is larger.
    if (bk.params.size() > 1) { CHECK(bk.used_elements * es <= bucket_bytes); }
    // Greedy: the next bucket's first parameter would not have fitted in this one.
    if (b + 1 < pl.buckets.size()) {
      std::size_t const next = pl.buckets[b + 1].params.front();
      std::size_t const start =
          (bk.used_elements + alignment / es - 1) / (alignment / es) * (alignment / es);
      CHECK((ps[next].type != bk.type || (start + ps[next].elements) * es > bucket_bytes));
    }
    arena += bk.elements * es;
    state += bk.shard_elements;
  }
  CHECK(pl.arena_bytes == arena);
  CHECK(pl.state_elements == state);
  for (std::size_t p = 0; p < ps.size(); ++p) {
    CHECK((ps[p].elements == 0) == (pl.places[p].bucket == z::no_bucket));
  }

  // Fragments: inside their shard, each parameter element exactly once over all ranks, shard
  // offsets consistent with the arena.
  std::vector<std::vector<int>> seen(ps.size());
  for (std::size_t p = 0; p < ps.size(); ++p) { seen[p].assign(ps[p].elements, 0); }
  for (int r = 0; r < world; ++r) {
    std::size_t prev_state_end = 0;
    for (auto const& f : pl.fragments(r)) {
      auto const& bk = pl.buckets[f.bucket];
      CHECK(f.elements > 0);
      CHECK(f.shard_offset + f.elements <= bk.shard_elements);
      CHECK(f.state_offset == bk.state_offset + f.shard_offset);
      CHECK(f.state_offset >= prev_state_end);
      prev_state_end = f.state_offset + f.elements;
      CHECK(pl.places[f.param].bucket == f.bucket);
      // The fragment's arena position equals the parameter's position plus its offset.
      CHECK(static_cast<std::size_t>(r) * bk.shard_elements + f.shard_offset ==
            pl.places[f.param].offset + f.param_offset);
      REQUIRE(f.param_offset + f.elements <= ps[f.param].elements);
      for (std::size_t e = 0; e < f.elements; ++e) { ++seen[f.param][f.param_offset + e]; }
    }
  }
  for (std::size_t p = 0; p < ps.size(); ++p) {
    INFO("parameter " << p << " of " << ps[p].elements << " elements");
    CHECK(std::all_of(seen[p].begin(), seen[p].end(), [](int c) { return c == 1; }));
  }
}

}  // namespace

TEST_CASE("zero plan: a hand-worked layout", "[host]") {
  // a(100), b(1000), c(10) bf16; buckets of 2048 bytes (1024 elements); 3 ranks; 128-byte
  // alignment (64 bf16 elements). Backward: c at 0 → b would end at 64 + 1000 > 1024, so bucket
  // 0 = {c}: 10 used, padded to 3·64 = 192, shards of 64. Bucket 1 = {b}: a would start at 1024
  // and end past it; 1000 padded to 6·192 = 1152, shards of 384. Bucket 2 = {a}: 192, shards of 64.
  std::vector<z::param_spec> ps{{"a", 100, z::element_type::bf16},
                                {"b", 1000, z::element_type::bf16},
                                {"c", 10, z::element_type::bf16}};
  auto const pl = z::make_plan(ps, 2048, 3, 128);
  REQUIRE(pl.buckets.size() == 3);
  CHECK(pl.buckets[0].params == std::vector<std::size_t>{2});
  CHECK(pl.buckets[1].params == std::vector<std::size_t>{1});
  CHECK(pl.buckets[2].params == std::vector<std::size_t>{0});
  CHECK(pl.buckets[0].elements == 192);
  CHECK(pl.buckets[1].elements == 1152);
  CHECK(pl.buckets[2].elements == 192);
  CHECK(pl.buckets[1].shard_elements == 384);
  CHECK(pl.buckets[1].byte_offset == 384);
  CHECK(pl.buckets[2].byte_offset == 384 + 2304);
  CHECK(pl.arena_bytes == 2 * (192 + 1152 + 192));
  CHECK(pl.state_elements == 64 + 384 + 64);
  CHECK(pl.buckets[2].state_offset == 64 + 384);
  // Ranks 1 and 2 own nothing of bucket 0; b is split 384/384/232.
  CHECK(pl.fragments(0, 0).size() == 1);
  CHECK(pl.fragments(0, 1).empty());
  CHECK(pl.fragments(0, 2).empty());
  auto const f = pl.fragments(1, 2);
  REQUIRE(f.size() == 1);
  CHECK(f[0].param == 1);
  CHECK(f[0].param_offset == 768);
  CHECK(f[0].elements == 232);
  CHECK(f[0].state_offset == 64 + 0);

  // Two small parameters share a bucket, the second aligned: b2(3) then a2(5) placed at 64.
  std::vector<z::param_spec> two{{"a2", 5, z::element_type::f32}, {"b2", 3, z::element_type::f32}};
  auto const p2 = z::make_plan(two, 1 << 20, 2, 128);
  REQUIRE(p2.buckets.size() == 1);
  CHECK(p2.places[1].offset == 0);
  CHECK(p2.places[0].offset == 32);  // 128 bytes of f32
  CHECK(p2.buckets[0].elements == 64);
  REQUIRE(p2.fragments(0, 1).size() == 1);  // rank 1's shard is [32, 64): all of a2
  CHECK(p2.fragments(0, 1)[0].param == 0);
  CHECK(p2.fragments(0, 0)[0].param == 1);
}

TEST_CASE("zero plan: edge cases", "[host]") {
  SECTION("no parameters") {
    auto const pl = z::make_plan(std::span<z::param_spec const>{}, 4096, 4);
    CHECK(pl.buckets.empty());
    CHECK(pl.arena_bytes == 0);
    CHECK(pl.state_elements == 0);
    CHECK(pl.fragments(3).empty());
  }
  SECTION("only empty parameters") {
    std::vector<z::param_spec> ps{{"x", 0, z::element_type::bf16}, {"y", 0, z::element_type::f32}};
    auto const pl = z::make_plan(ps, 4096, 2);
    CHECK(pl.buckets.empty());
    CHECK(pl.places[0].bucket == z::no_bucket);
  }
  SECTION("a parameter larger than a bucket gets its own") {
    std::vector<z::param_spec> ps{{"s", 7, z::element_type::bf16},
                                  {"big", 100001, z::element_type::bf16},
                                  {"t", 9, z::element_type::bf16}};
    auto const pl = z::make_plan(ps, 1024, 5);
    REQUIRE(pl.buckets.size() == 3);
    CHECK(pl.buckets[1].params == std::vector<std::size_t>{1});
    check_plan(pl, ps, 1024, 5, 128);
  }
  SECTION("a change of element type closes the bucket") {
    std::vector<z::param_spec> ps{{"h", 10, z::element_type::f16},
                                  {"b", 10, z::element_type::bf16},
                                  {"f", 10, z::element_type::f32}};
    auto const pl = z::make_plan(ps, 1 << 20, 2);
    REQUIRE(pl.buckets.size() == 3);
    CHECK(pl.buckets[0].type == z::element_type::f32);
    CHECK(pl.buckets[0].shard_elements == 32);
    CHECK(pl.buckets[2].shard_elements == 64);
    check_plan(pl, ps, 1 << 20, 2, 128);
  }
  SECTION("bad input is rejected") {
    std::vector<z::param_spec> dup{{"x", 1, z::element_type::bf16},
                                   {"x", 2, z::element_type::bf16}};
    CHECK_THROWS_AS(z::make_plan(dup, 4096, 2), wm::logic_error);
    std::vector<z::param_spec> ok{{"x", 1, z::element_type::bf16}};
    CHECK_THROWS_AS(z::make_plan(ok, 4096, 0), wm::logic_error);
    CHECK_THROWS_AS(z::make_plan(ok, 4096, 2, 96), wm::logic_error);
    CHECK_THROWS_AS(z::make_plan(ok, 0, 2), wm::logic_error);
    auto const pl = z::make_plan(ok, 4096, 2);
    CHECK_THROWS_AS(pl.fragments(0, 2), wm::logic_error);
    CHECK_THROWS_AS(pl.fragments(1, 0), wm::logic_error);
  }
}

TEST_CASE("zero plan: random parameter lists, 1 to 9 ranks", "[host]") {
  std::mt19937_64 rng{std::random_device{}()};
  for (int trial = 0; trial < 300; ++trial) {
    auto const ps                  = random_params(rng, trial < 20 ? 3 : 60);
    int const world                = 1 + static_cast<int>(rng() % 9);
    std::size_t const alignment    = std::size_t{4} << (rng() % 7);  // 4 .. 256 bytes
    std::size_t const bucket_bytes = 1 + rng() % 60000;
    INFO("trial " << trial << ": " << ps.size() << " parameters, world " << world << ", alignment "
                  << alignment << ", bucket " << bucket_bytes);
    auto const pl = z::make_plan(ps, bucket_bytes, world, alignment);
    check_plan(pl, ps, bucket_bytes, world, alignment);
  }
}

TEST_CASE("zero memory formula matches the ZeRO paper's figure 1", "[host]") {
  // 7.5 B parameters, 64 ranks, K = 12: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per GPU.
  double const psi = 7.5e9;
  CHECK(z::zero_memory_estimate(0, psi, 64).device_bytes == Catch::Approx(120e9));
  CHECK(z::zero_memory_estimate(1, psi, 64).device_bytes == Catch::Approx(4 * psi + 12 * psi / 64));
  CHECK(z::zero_memory_estimate(1, psi, 64).device_bytes / 1e9 ==
        Catch::Approx(31.4).epsilon(0.002));
  CHECK(z::zero_memory_estimate(2, psi, 64).device_bytes / 1e9 ==
        Catch::Approx(16.6).epsilon(0.003));
  CHECK(z::zero_memory_estimate(3, psi, 64).device_bytes / 1e9 == Catch::Approx(1.875));
  // Offload: the state term moves to the host with a gradient shard.
  auto const o = z::zero_memory_estimate(2, psi, 64, true);
  CHECK(o.device_bytes == Catch::Approx(2 * psi + 2 * psi / 64));
  CHECK(o.host_bytes == Catch::Approx(14 * psi / 64));
  // From a parameter list: f32 weights count 4 bytes.
  std::vector<z::param_spec> ps{{"a", 1000, z::element_type::f32},
                                {"b", 3000, z::element_type::bf16}};
  CHECK(z::zero_memory_estimate(3, ps, 2).device_bytes ==
        Catch::Approx((2 * 10000.0 + 12 * 4000.0) / 2));
  CHECK_THROWS_AS(z::zero_memory_estimate(4, psi, 2), wm::logic_error);
}
