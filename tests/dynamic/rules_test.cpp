// SPDX-License-Identifier: Apache-2.0
// Host tests of wm::dynamic_embedding's host-side pieces (no GPU): the reserved keys, the key
// hash (a bijection: distinct keys never share a hash), the bucket reduction (in range, monotone
// in the hash so that sorting hashes groups buckets, spread evenly), the digest, and each
// eviction policy's score rule written out here from the documented behaviour.
#include <wm/detail/dynamic/buckets.hpp>
#include <wm/detail/dynamic/scores.hpp>

#include <algorithm>
#include <cstdint>
#include <random>
#include <unordered_set>
#include <vector>

#include "catch.hpp"

namespace dy = wm::detail::dynamic;

TEST_CASE("dynamic: reserved keys are the top two 64-bit values", "[dynamic]") {
  CHECK(dy::reserved(static_cast<std::uint64_t>(std::int64_t{-1})));
  CHECK(dy::reserved(static_cast<std::uint64_t>(std::int64_t{-2})));
  CHECK_FALSE(dy::reserved(static_cast<std::uint64_t>(std::int64_t{-3})));
  CHECK_FALSE(dy::reserved(0));
  CHECK_FALSE(dy::reserved(std::uint64_t{1} << 63));
  CHECK(dy::empty_key == ~std::uint64_t{0});
  CHECK(dy::locked_key == ~std::uint64_t{0} - 1);
}

TEST_CASE("dynamic: the hash separates keys, buckets are monotone and even", "[dynamic]") {
  std::uint64_t const seed  = GENERATE(0ull, 7ull, 0xdeadbeefull);
  std::uint32_t const count = GENERATE(1u, 3u, 1000u, 1u << 25);
  dy::buckets_view const v{nullptr, nullptr, nullptr, count, seed};
  std::mt19937_64 rng{seed + count};
  std::vector<std::uint64_t> keys;
  for (std::uint64_t k = 0; k < 20000; ++k) { keys.push_back(k); }  // consecutive ids
  for (int i = 0; i < 20000; ++i) { keys.push_back(rng()); }
  std::unordered_set<std::uint64_t> hashes;
  std::vector<std::uint64_t> hs;
  for (auto k : keys) {
    std::uint64_t const h = v.hash(k);
    hashes.insert(h);
    hs.push_back(h);
    REQUIRE(v.bucket(h) < count);
    REQUIRE(dy::buckets_view::digest(h) == static_cast<std::uint8_t>(h & 0xff));
  }
  std::sort(keys.begin(), keys.end());
  keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
  CHECK(hashes.size() == keys.size());
  std::sort(hs.begin(), hs.end());
  for (std::size_t i = 1; i < hs.size(); ++i) { REQUIRE(v.bucket(hs[i - 1]) <= v.bucket(hs[i])); }
  CHECK(v.bucket(0) == 0);
  CHECK(v.bucket(~std::uint64_t{0}) == count - 1);
  if (count == 3) {  // 40,000 keys over 3 buckets: each within 5% of a third
    std::vector<int> per(3, 0);
    for (auto h : hs) { ++per[v.bucket(h)]; }
    for (int c : per) {
      CHECK(c > 12666);
      CHECK(c < 14000);
    }
  }
}

TEST_CASE("dynamic: the eviction policies' score rules", "[dynamic]") {
  dy::score_context const c1{5, 2};
  dy::score_context const c2{9, 3};
  SECTION("lru: the call's number") {
    CHECK(dy::lru_score::inserted(c1, 123) == 5);
    CHECK(dy::lru_score::hit(5, c2, 0) == 9);
    CHECK(dy::lru_score::evicts);
    CHECK_FALSE(dy::lru_score::user_scores);
    CHECK(dy::lru_score::admits(0, 100));
  }
  SECTION("lfu: calls counted, saturating") {
    CHECK(dy::lfu_score::inserted(c1, 123) == 1);
    CHECK(dy::lfu_score::hit(1, c2, 0) == 2);
    CHECK(dy::lfu_score::hit(~std::uint64_t{0}, c2, 0) == ~std::uint64_t{0});
  }
  SECTION("epoch_lru: epoch high, call low") {
    CHECK(dy::epoch_lru_score::inserted(c1, 0) == ((std::uint64_t{2} << 32) | 5));
    CHECK(dy::epoch_lru_score::hit(0, c2, 0) == ((std::uint64_t{3} << 32) | 9));
    dy::score_context const big{(std::uint64_t{1} << 32) + 4, 1};  // the call's low 32 bits
    CHECK(dy::epoch_lru_score::inserted(big, 0) == ((std::uint64_t{1} << 32) | 4));
    // a later epoch outranks any call of an earlier one
    CHECK(dy::epoch_lru_score::inserted(c2, 0) > dy::epoch_lru_score::inserted(big, 0));
  }
  SECTION("epoch_lfu: a hit moves the key to the current epoch and keeps counting") {
    std::uint64_t const s = dy::epoch_lfu_score::inserted(c1, 0);
    CHECK(s == ((std::uint64_t{2} << 32) | 1));
    CHECK(dy::epoch_lfu_score::hit(s, c1, 0) == ((std::uint64_t{2} << 32) | 2));
    CHECK(dy::epoch_lfu_score::hit(s, c2, 0) == ((std::uint64_t{3} << 32) | 2));
    std::uint64_t const full = (std::uint64_t{2} << 32) | 0xffffffffu;
    CHECK(dy::epoch_lfu_score::hit(full, c2, 0) == ((std::uint64_t{3} << 32) | 0xffffffffu));
  }
  SECTION("custom_score: the caller's, admitted if not below the victim") {
    CHECK(dy::custom_score::user_scores);
    CHECK(dy::custom_score::inserted(c1, 77) == 77);
    CHECK(dy::custom_score::hit(3, c1, 55) == 55);
    CHECK(dy::custom_score::admits(10, 10));
    CHECK(dy::custom_score::admits(11, 10));
    CHECK_FALSE(dy::custom_score::admits(9, 10));
  }
  SECTION("no_eviction: scores as lru, never evicts") {
    CHECK_FALSE(dy::no_eviction_score::evicts);
    CHECK(dy::no_eviction_score::inserted(c1, 0) == 5);
  }
}
