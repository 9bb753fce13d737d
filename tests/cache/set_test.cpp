// SPDX-License-Identifier: Apache-2.0
// Host tests: one 32-way cache set (detail/cache/set.hpp) against a plain model of LFU / LRU
// with write-back, driven by random access sequences; the key -> set hash; the policy traits; a
// group-cache line's word (detail/cache/line_word.hpp) under a reader's feet.
#include <wm/cache.hpp>
#include <wm/detail/cache/line_word.hpp>
#include <wm/detail/cache/plan.hpp>
#include <wm/optimizer.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "cache_oracle.hpp"
#include "catch.hpp"

namespace cache = wm::detail::cache;

// ---------------------------------------------------------------------------------------------
// Policy types and the writable trait.

struct no_cache_like {  // like wm::no_cache: no `writable` member
  static constexpr char const* name = "no_cache";
};

// What the embedding will require of (CachePolicy, Optimizer).
template <class C, class O>
concept trainable_combination = wm::writable_cache<C> || !wm::sparse_optimizer<O>;

static_assert(wm::cache_access<wm::read_only> && wm::cache_access<wm::read_write>);
static_assert(wm::replacement_policy<wm::lfu> && wm::replacement_policy<wm::lru>);
static_assert(!wm::cache_access<wm::lfu> && !wm::replacement_policy<wm::read_only>);
static_assert(std::is_same_v<wm::device_cache<>, wm::device_cache<wm::read_write, wm::lfu>>);
static_assert(std::is_same_v<wm::group_cache<>, wm::group_cache<wm::lfu>>);
static_assert(wm::is_writable_cache_v<wm::device_cache<>>);
static_assert(wm::is_writable_cache_v<wm::device_cache<wm::read_write, wm::lru>>);
static_assert(!wm::is_writable_cache_v<wm::device_cache<wm::read_only>>);
static_assert(!wm::is_writable_cache_v<wm::device_cache<wm::read_only, wm::lru>>);
static_assert(!wm::is_writable_cache_v<wm::group_cache<>>);
static_assert(!wm::is_writable_cache_v<wm::group_cache<wm::lru>>);
static_assert(wm::is_writable_cache_v<no_cache_like>);
static_assert(wm::writable_cache<no_cache_like> && !wm::writable_cache<wm::group_cache<>>);
static_assert(!trainable_combination<wm::group_cache<>, wm::adam>);
static_assert(!trainable_combination<wm::device_cache<wm::read_only>, wm::sgd>);
static_assert(trainable_combination<wm::group_cache<>, wm::no_optimizer>);
static_assert(trainable_combination<wm::device_cache<wm::read_only>, wm::no_optimizer>);
static_assert(trainable_combination<wm::device_cache<>, wm::adam>);
static_assert(trainable_combination<no_cache_like, wm::sgd>);
static_assert(sizeof(cache::set_header) == 24);
static_assert(sizeof(cache::lfu_impl::state_type) == 2 && sizeof(cache::lru_impl::state_type) == 4);

TEST_CASE("cache policies: names, defaults and options", "[cache]") {
  CHECK(std::string{wm::device_cache<>::name} == "device_cache");
  CHECK(std::string{wm::group_cache<>::name} == "group_cache");
  CHECK(std::string{wm::device_cache<wm::read_only, wm::lru>::replacement_type::name} == "lru");
  CHECK(std::string{wm::group_cache<>::access_type::name} == "read_only");
  wm::cache_options const o;
  CHECK(o.ratio > 0.0);
  CHECK(o.group == nullptr);
  CHECK(std::string{cache::read_only_message}.find("read-only") != std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// The model: 32 lines in a vector, written from the documented semantics (wm::lfu, wm::lru,
// read_write), with unbounded LRU time (the real set's 32-bit clock renumbers on wrap).

struct model_line {
  bool valid{false};
  bool dirty{false};
  std::uint32_t key{0};
  std::uint64_t count{0};  // LFU
  std::uint64_t last{0};   // LRU: time of the last use
};

struct model_step {
  bool hit{false};
  int way{-1};
  bool evicted{false};
  bool write_back{false};
  std::uint32_t old_key{0};
  bool bypassed{false};
};

template <bool Lfu>
struct set_model {
  std::vector<model_line> lines = std::vector<model_line>(32);
  std::uint64_t time            = 0;

  int victim() const {
    for (int w = 0; w < 32; ++w) {
      if (!lines[w].valid) { return w; }
    }
    auto const less = [](model_line const& a, model_line const& b) {
      return Lfu ? a.count < b.count : a.last < b.last;
    };
    return static_cast<int>(std::min_element(lines.begin(), lines.end(), less) - lines.begin());
  }

  // Batches: the ways the current batch has hit or admitted; a miss never takes one of them.
  std::vector<bool> used = std::vector<bool>(32, false);

  void begin_batch() { used.assign(32, false); }

  // The victim among the ways the batch has not used (-1: none, the key bypasses).
  int victim_outside_batch() const {
    for (int w = 0; w < 32; ++w) {
      if (!used[w] && !lines[w].valid) { return w; }
    }
    int best = -1;
    for (int w = 0; w < 32; ++w) {
      if (used[w]) { continue; }
      bool const lower =
          best < 0 || (Lfu ? lines[w].count < lines[best].count : lines[w].last < lines[best].last);
      if (lower) { best = w; }
    }
    return best;
  }

  model_step batch_access(std::uint32_t key, bool write) {
    model_step s = lookup(key);
    if (!s.hit) {
      int const w = victim_outside_batch();
      if (w < 0) {
        s.bypassed = true;
        return s;  // nothing changes
      }
      admit_at(s, w, key);
    }
    used[s.way] = true;
    if (write) { lines[s.way].dirty = true; }
    return s;
  }

  model_step access(std::uint32_t key, bool write) {
    model_step s = lookup(key);
    if (!s.hit) { admit_at(s, victim(), key); }
    if (write) { lines[s.way].dirty = true; }
    return s;
  }

  // Finds the key; a hit updates the line's count / time.
  model_step lookup(std::uint32_t key) {
    model_step s;
    for (int w = 0; w < 32; ++w) {
      if (lines[w].valid && lines[w].key == key) { s.way = w; }
    }
    s.hit = s.way >= 0;
    if (s.hit) {
      auto& l = lines[s.way];
      if (Lfu && l.count == 0xffff) {
        for (auto& m : lines) { m.count /= 2; }
      }
      l.count += 1;
      l.last = ++time;
    }
    return s;
  }

  void admit_at(model_step& s, int way, std::uint32_t key) {
    s.way        = way;
    auto& l      = lines[s.way];
    s.evicted    = l.valid;
    s.write_back = l.valid && l.dirty;
    s.old_key    = l.key;
    l.count      = l.valid ? std::min<std::uint64_t>(l.count + 1, 0xffff) : 1;
    l.valid      = true;
    l.dirty      = false;
    l.key        = key;
    l.last       = ++time;
  }

  std::set<std::uint32_t> flush() {
    std::set<std::uint32_t> out;
    for (auto& l : lines) {
      if (l.valid && l.dirty) { out.insert(l.key); }
      l.dirty = false;
    }
    return out;
  }

  std::set<std::uint32_t> invalidate() {
    auto out = flush();
    for (auto& l : lines) { l.valid = false; }
    return out;
  }

  bool evict(int w) {
    bool const d   = lines[w].valid && lines[w].dirty;
    lines[w].valid = lines[w].dirty = false;
    return d;
  }
};

template <class Impl>
struct real_set {
  std::vector<std::uint32_t> tags = std::vector<std::uint32_t>(32, 0xdeadbeefu);
  std::vector<typename Impl::state_type> states =
      std::vector<typename Impl::state_type>(32, static_cast<typename Impl::state_type>(0x5a5a));
  cache::set_header header{};

  cache::set_ref<Impl> ref() { return {tags.data(), states.data(), &header}; }
};

std::set<std::uint32_t> keys_of(std::uint32_t mask, std::vector<std::uint32_t> const& tags) {
  std::set<std::uint32_t> out;
  for (int w = 0; w < 32; ++w) {
    if ((mask >> w) & 1u) { out.insert(tags[w]); }
  }
  return out;
}

template <class Impl, bool Lfu>
void compare_lines(set_model<Lfu> const& m, real_set<Impl>& r) {
  for (int w = 0; w < 32; ++w) {
    bool const valid = (r.header.valid >> w) & 1u;
    bool const dirty = (r.header.dirty >> w) & 1u;
    REQUIRE(valid == m.lines[w].valid);
    REQUIRE(dirty == (m.lines[w].valid && m.lines[w].dirty));
    if (valid) { REQUIRE(r.tags[w] == m.lines[w].key); }
    if (valid && Lfu) { REQUIRE(r.states[w] == m.lines[w].count); }
  }
  REQUIRE((r.header.dirty & ~r.header.valid) == 0u);
}

// Random sequences over `universe` keys: skewed (a few keys take most accesses, so LFU counts
// saturate and decay) or uniform; writes, evictions, flushes and invalidations mixed in.
template <class Impl, bool Lfu>
void run_random(std::uint64_t seed, int universe, bool skewed, int steps, std::uint32_t clock0,
                bool churn = true) {
  std::mt19937_64 rng{seed};
  std::vector<std::uint32_t> keys(static_cast<std::size_t>(universe));
  for (auto& k : keys) { k = static_cast<std::uint32_t>(rng()); }  // any 32-bit key
  std::vector<double> weights(keys.size());
  for (std::size_t i = 0; i < weights.size(); ++i) {
    weights[i] = skewed ? 1.0 / std::pow(static_cast<double>(i + 1), 1.2) : 1.0;
  }
  std::discrete_distribution<std::size_t> pick{weights.begin(), weights.end()};
  std::uniform_int_distribution<int> op{0, 9999};

  set_model<Lfu> model;
  real_set<Impl> real;
  real.header.clock  = clock0;
  auto const s       = real.ref();
  std::uint64_t hits = 0, write_backs = 0, decays_seen = 0;
  for (int step = 0; step < steps; ++step) {
    int const o = churn ? op(rng) : 40 + op(rng) % 9960;  // churn: flush, invalidate, evict
    if (o < 3) {                                          // flush
      auto const mask = s.flush();
      REQUIRE(keys_of(mask, real.tags) == model.flush());
    } else if (o < 5) {  // invalidate
      auto const mask = s.invalidate();
      REQUIRE(keys_of(mask, real.tags) == model.invalidate());
    } else if (o < 40) {  // evict a random way that holds a line
      int const w = static_cast<int>(rng() % 32);
      if (model.lines[w].valid) {
        bool const d = s.evict(w);
        REQUIRE(d == model.evict(w));
      }
    } else {
      std::uint32_t const key = keys[pick(rng)];
      bool const write        = o < 3000;
      std::uint32_t const c   = real.header.clock;
      int const w0            = s.find(key);
      if (Lfu && w0 != cache::no_way && real.states[w0] == cache::lfu_impl::limit) {
        ++decays_seen;
      }
      auto const r = cache::access(s, key, write);
      auto const e = model.access(key, write);
      if (real.header.clock < c) { ++decays_seen; }
      REQUIRE(r.hit == e.hit);
      REQUIRE(r.way == e.way);
      if (!e.hit) {
        REQUIRE(r.admitted.evicted == e.evicted);
        REQUIRE(r.admitted.write_back == e.write_back);
        if (e.evicted) { REQUIRE(r.admitted.old_key == e.old_key); }
        write_backs += e.write_back;
      }
      hits += e.hit;
    }
    compare_lines(model, real);
  }
  // The sequences must have exercised what they claim to test.
  CHECK(hits > 0);
  if (universe > 32) { CHECK(write_backs > 0); }
  if ((!Lfu && clock0 > 0xffff0000u) || (Lfu && !churn)) { CHECK(decays_seen > 0); }
}

TEST_CASE("cache set: LFU against the model, random sequences", "[cache]") {
  auto const skewed   = GENERATE(true, false);
  auto const universe = GENERATE(20, 33, 64, 500);
  for (std::uint64_t seed = 1; seed <= 3; ++seed) {
    run_random<cache::lfu_impl, true>(seed * 7919 + universe, universe, skewed, 20000, 0);
  }
}

TEST_CASE("cache set: LFU counts saturate and halve", "[cache]") {
  // Few keys, many hits: the hottest key's 16-bit count reaches the limit several times.
  run_random<cache::lfu_impl, true>(99, 34, true, 400000, 0, false);
  real_set<cache::lfu_impl> r;
  auto const s = r.ref();
  for (std::uint32_t k = 0; k < 32; ++k) { (void)cache::access(s, k, false); }
  for (int i = 0; i < 0xffff; ++i) { s.touch(3); }  // way 3: 1 + 65535 hits would overflow
  CHECK(r.states[3] == 0x8000);                     // halved at 0xffff, then one more
  CHECK(r.states[0] == 0);                          // the others 1 -> 0
  CHECK(s.victim() == 0);
}

TEST_CASE("cache set: LRU against the model, random sequences and clock wrap", "[cache]") {
  auto const skewed   = GENERATE(true, false);
  auto const universe = GENERATE(20, 33, 64, 500);
  auto const clock0   = GENERATE(0u, 0xffffffffu - 3000u);
  for (std::uint64_t seed = 1; seed <= 3; ++seed) {
    run_random<cache::lru_impl, false>(seed * 104729 + universe, universe, skewed, 20000, clock0);
  }
}

TEST_CASE("cache set: a hit without the set's lock is the locked hit, or declines", "[cache]") {
  SECTION("LFU: one more use; declines at the limit, where the locked hit halves the set") {
    cache::set_header h{};
    std::uint16_t state = 7;
    CHECK(cache::lfu_impl::touch_unlocked(state, h));
    CHECK(state == 8);
    state = cache::lfu_impl::limit;
    CHECK_FALSE(cache::lfu_impl::touch_unlocked(state, h));
    CHECK(state == cache::lfu_impl::limit);
  }
  SECTION("LRU: the next stamp of the set's clock; declines near the wrap") {
    cache::set_header h{};
    h.clock             = 41;
    std::uint32_t state = 3;
    CHECK(cache::lru_impl::touch_unlocked(state, h));
    CHECK(state == 42);
    CHECK(h.clock == 42);
    std::uint32_t const last = 0xffffffffu - 2u * cache::ways - 1u;  // the last clock it takes
    h.clock                  = last;
    CHECK(cache::lru_impl::touch_unlocked(state, h));
    CHECK(state == last + 1u);
    CHECK_FALSE(cache::lru_impl::touch_unlocked(state, h));
    CHECK(state == last + 1u);
    CHECK(h.clock == last + 1u);
  }
}

TEST_CASE("cache set: edge cases", "[cache]") {
  real_set<cache::lru_impl> r;
  auto const s = r.ref();
  CHECK(s.find(0xdeadbeefu) == cache::no_way);  // garbage tags of invalid lines never match
  CHECK(s.victim() == 0);
  auto const a = s.admit(0xdeadbeefu);
  CHECK(a.way == 0);
  CHECK(!a.evicted);
  CHECK(s.find(0xdeadbeefu) == 0);
  s.mark_dirty(0);
  CHECK(s.flush() == 1u);
  CHECK(s.flush() == 0u);  // clean now, still valid
  CHECK(s.find(0xdeadbeefu) == 0);
  s.mark_dirty(0);
  CHECK(s.invalidate() == 1u);
  CHECK(s.find(0xdeadbeefu) == cache::no_way);
  // Fill all ways, then every miss evicts the least recently used.
  for (std::uint32_t k = 100; k < 132; ++k) { (void)cache::access(s, k, k % 2 == 0); }
  CHECK(r.header.valid == cache::all_ways);
  (void)cache::access(s, 100, false);  // 100 is now the most recent; 101 the oldest
  auto const b = cache::access(s, 7, false);
  CHECK(!b.hit);
  CHECK(b.admitted.evicted);
  CHECK(b.admitted.old_key == 101);
  CHECK(!b.admitted.write_back);  // 101 was read only
  auto const c = cache::access(s, 8, false);
  CHECK(c.admitted.old_key == 102);
  CHECK(c.admitted.write_back);  // 102 was written
}

// ---------------------------------------------------------------------------------------------
// Batches (batch_access): a miss never evicts a line its own batch has hit or admitted; a batch
// with more than 32 distinct keys of the set bypasses exactly the extra ones; across batches the
// ordinary policy applies.

template <class Impl, bool Lfu>
void run_batches(std::uint64_t seed, int universe, bool skewed, int batches, std::uint32_t clock0,
                 std::size_t max_batch) {
  std::mt19937_64 rng{seed};
  std::vector<std::uint32_t> keys(static_cast<std::size_t>(universe));
  for (auto& k : keys) { k = static_cast<std::uint32_t>(rng()); }
  std::vector<double> weights(keys.size());
  for (std::size_t i = 0; i < weights.size(); ++i) {
    weights[i] = skewed ? 1.0 / std::pow(static_cast<double>(i + 1), 1.05) : 1.0;
  }
  std::discrete_distribution<std::size_t> pick{weights.begin(), weights.end()};

  set_model<Lfu> model;
  real_set<Impl> real;
  real.header.clock     = clock0;
  real.header.epoch     = 0x5a5a5a5au;  // a stale mask of some old batch
  real.header.batch     = 0xf0f0f0f0u;
  auto const s          = real.ref();
  std::uint32_t epoch   = static_cast<std::uint32_t>(rng());
  std::uint64_t bypassd = 0, hits = 0, write_backs = 0, evictions = 0;
  for (int b = 0; b < batches; ++b) {
    // Between batches: now and then a flush, an invalidation or a single eviction.
    auto const between = rng() % 100;
    if (between < 3) {
      REQUIRE(keys_of(s.flush(), real.tags) == model.flush());
    } else if (between < 4) {
      REQUIRE(keys_of(s.invalidate(), real.tags) == model.invalidate());
    } else if (between < 8) {
      int const w = static_cast<int>(rng() % 32);
      if (model.lines[w].valid) { REQUIRE(s.evict(w) == model.evict(w)); }
    }
    epoch += 1 + static_cast<std::uint32_t>(rng() % 3);  // any new number starts a batch
    model.begin_batch();
    std::size_t const n = 1 + rng() % max_batch;
    std::set<std::uint32_t> used_keys, bypassed_keys, asked;
    for (std::size_t i = 0; i < n; ++i) {
      std::uint32_t const key = keys[pick(rng)];
      bool const write        = rng() % 3 == 0;
      if (i == 0) {
        // The batch's first access is the ordinary one (the mask of the last batch is gone).
        real_set<Impl> plain = real;
        auto const p         = cache::access(plain.ref(), key, write);
        auto const r         = cache::batch_access(s, key, write, epoch);
        REQUIRE(r.hit == p.hit);
        REQUIRE(r.way == p.way);
        REQUIRE(!r.bypassed);
        REQUIRE(r.admitted.evicted == p.admitted.evicted);
        REQUIRE(r.admitted.old_key == p.admitted.old_key);
        REQUIRE(plain.tags == real.tags);
        REQUIRE(plain.states == real.states);
        REQUIRE(plain.header.valid == real.header.valid);
        REQUIRE(plain.header.dirty == real.header.dirty);
        REQUIRE(real.header.batch == 1u << r.way);
        REQUIRE(real.header.epoch == epoch);
        (void)model.batch_access(key, write);
        used_keys.insert(key);
        asked.insert(key);
        hits += r.hit;
        compare_lines(model, real);
        continue;
      }
      auto const r = cache::batch_access(s, key, write, epoch);
      auto const e = model.batch_access(key, write);
      REQUIRE(r.hit == e.hit);
      REQUIRE(r.bypassed == e.bypassed);
      REQUIRE(r.way == (e.bypassed ? cache::no_way : e.way));
      if (!e.hit && !e.bypassed) {
        REQUIRE(r.admitted.evicted == e.evicted);
        REQUIRE(r.admitted.write_back == e.write_back);
        if (e.evicted) { REQUIRE(r.admitted.old_key == e.old_key); }
        write_backs += e.write_back;
        evictions += e.evicted;
      }
      compare_lines(model, real);
      asked.insert(key);
      if (r.bypassed) {
        bypassed_keys.insert(key);
        REQUIRE(real.header.batch == cache::all_ways);
      } else {
        used_keys.insert(key);
      }
      hits += r.hit;
      // No line the batch has used was evicted: each of its keys is still where it was.
      for (auto const k : used_keys) { REQUIRE(s.find(k) != cache::no_way); }
      REQUIRE(static_cast<int>(used_keys.size()) == cache::count_ways(real.header.batch));
    }
    // The first 32 distinct keys of the batch are served by lines; exactly the others bypass.
    REQUIRE(used_keys.size() == std::min<std::size_t>(asked.size(), 32));
    REQUIRE(bypassed_keys.size() == asked.size() - used_keys.size());
    bypassd += bypassed_keys.size();
  }
  // The batches exercised what they claim to test.
  CHECK(hits > 0);
  CHECK(evictions > 0);
  CHECK(write_backs > 0);
  if (max_batch > 40 && universe > 40) { CHECK(bypassd > 0); }
}

TEST_CASE("cache set: batches (LFU) against the model; bypass beyond 32 keys of a batch",
          "[cache]") {
  auto const skewed   = GENERATE(true, false);
  auto const universe = GENERATE(33, 64, 500);
  auto const longest  = GENERATE(std::size_t{20}, std::size_t{90});
  for (std::uint64_t seed = 1; seed <= 2; ++seed) {
    run_batches<cache::lfu_impl, true>(seed * 7907 + universe + longest, universe, skewed, 600, 0,
                                       longest);
  }
}

TEST_CASE("cache set: batches (LRU) against the model, clock wrap", "[cache]") {
  auto const skewed   = GENERATE(true, false);
  auto const universe = GENERATE(33, 64, 500);
  auto const clock0   = GENERATE(0u, 0xffffffffu - 10000u);
  for (std::uint64_t seed = 1; seed <= 2; ++seed) {
    run_batches<cache::lru_impl, false>(seed * 104723 + universe, universe, skewed, 600, clock0,
                                        90);
  }
}

TEST_CASE("cache set: a batch of 40 new keys evicts the old 32 and bypasses 8", "[cache]") {
  real_set<cache::lfu_impl> r;
  auto const s = r.ref();
  for (std::uint32_t k = 0; k < 32; ++k) { (void)cache::batch_access(s, k, k % 2 == 0, 1); }
  CHECK(r.header.valid == cache::all_ways);
  CHECK(r.header.batch == cache::all_ways);
  // The same batch asks for one more key: every way is in use, so it bypasses; nothing changes.
  auto const before = r.states;
  auto const a      = cache::batch_access(s, 1000, true, 1);
  CHECK(a.bypassed);
  CHECK(!a.hit);
  CHECK(a.way == cache::no_way);
  CHECK(s.find(1000) == cache::no_way);
  CHECK(r.states == before);
  CHECK(r.header.dirty == 0x55555555u);
  // A new batch of 40 new keys: the first 32 replace the old lines (16 write-backs), 8 bypass.
  int bypasses = 0, write_backs = 0;
  std::set<std::uint32_t> evicted;
  for (std::uint32_t k = 100; k < 140; ++k) {
    auto const b = cache::batch_access(s, k, false, 2);
    bypasses += b.bypassed;
    write_backs += b.admitted.write_back;
    if (b.admitted.evicted) { evicted.insert(b.admitted.old_key); }
    CHECK(b.bypassed == (k >= 132));
  }
  CHECK(bypasses == 8);
  CHECK(write_backs == 16);
  CHECK(evicted.size() == 32);
  CHECK(*evicted.rbegin() == 31);
  // The next batch admits the 8 that bypassed, by the ordinary policy.
  for (std::uint32_t k = 132; k < 140; ++k) {
    auto const c = cache::batch_access(s, k, false, 3);
    CHECK(!c.bypassed);
    CHECK(c.admitted.evicted);
  }
  for (std::uint32_t k = 132; k < 140; ++k) { CHECK(s.find(k) != cache::no_way); }
  // The plain functions ignore the batch mask.
  CHECK(s.victim() == s.victim(0));
  CHECK(s.victim(cache::all_ways) == cache::no_way);
  CHECK(s.victim(~1u) == 0);
}

// ---------------------------------------------------------------------------------------------
// The key -> set hash.

TEST_CASE("cache hash: consecutive ids spread over many sets", "[cache]") {
  auto const sets = GENERATE(1u, 7u, 1000u, 4096u, 31250u);
  SECTION("ids 0..N-1, N = 64 per set: every set gets close to its share") {
    std::uint32_t const n = 64 * sets;
    std::vector<std::uint32_t> load(sets, 0);
    for (std::uint32_t k = 0; k < n; ++k) {
      auto const s = cache::set_of(k, sets);
      REQUIRE(s < sets);
      ++load[s];
    }
    // Binomial(n, 1/sets): mean 64, sd ~8; 7 sd either side is a failure of the hash.
    auto const [lo, hi] = std::minmax_element(load.begin(), load.end());
    CHECK(*lo >= 64 - 56);
    CHECK(*hi <= 64 + 56);
    double chi2 = 0;
    for (auto const l : load) { chi2 += (l - 64.0) * (l - 64.0) / 64.0; }
    // chi2 / dof has mean 1 and sd sqrt(2 / dof) for a uniform spread: 5 sd is a bad hash.
    if (sets > 1) {
      double const dof = sets - 1.0;
      CHECK(chi2 / dof < 1.0 + 5.0 * std::sqrt(2.0 / dof));
    }
  }
  SECTION("the hottest `sets` ids (a renumbered table's first rows) use most sets") {
    std::set<std::uint32_t> used;
    for (std::uint32_t k = 0; k < sets; ++k) { used.insert(cache::set_of(k, sets)); }
    // Uniform random placement uses 1 - 1/e ~ 63% of the sets; a contiguous-range mapping would
    // put all of them into one set.
    CHECK(used.size() >= static_cast<std::size_t>(0.55 * sets));
  }
  SECTION("32 · sets hot ids overflow no set by much (a full cache's worth)") {
    std::vector<std::uint32_t> load(sets, 0);
    for (std::uint32_t k = 0; k < 32 * sets; ++k) { ++load[cache::set_of(k, sets)]; }
    CHECK(*std::max_element(load.begin(), load.end()) <= 32 + 40);
  }
}

TEST_CASE("cache hash: the seed changes the placement; mix32 is a bijection", "[cache]") {
  int same = 0;
  for (std::uint32_t k = 0; k < 10000; ++k) {
    same += cache::set_of(k, 1024, 0) == cache::set_of(k, 1024, 1);
  }
  CHECK(same < 40);  // ~10000 / 1024 expected
  std::vector<std::uint32_t> v;
  for (std::uint32_t k = 0; k < (1u << 20); ++k) { v.push_back(cache::mix32(k << 12, 5)); }
  std::sort(v.begin(), v.end());
  CHECK(std::adjacent_find(v.begin(), v.end()) == v.end());
}

// ---------------------------------------------------------------------------------------------
// Geometry.

TEST_CASE("cache plan: sets from rows and ratio; edges", "[cache]") {
  using cache::plan_cache;
  auto const p = plan_cache<cache::lfu_impl>(10'000'000, 0.1);
  CHECK(p.sets == 31250);
  CHECK(p.lines == 1'000'000);
  CHECK(p.metadata_bytes == 31250u * (32 * 6 + 24));  // 6.75 bytes per line, none per row
  CHECK(plan_cache<cache::lru_impl>(1000, 0.1).metadata_bytes == 4u * (32 * 8 + 24));
  CHECK(plan_cache<cache::lfu_impl>(1, 0.001).sets == 1);  // at least one set
  CHECK(plan_cache<cache::lfu_impl>(10, 1.0).sets == 1);   // cache larger than the table
  CHECK(plan_cache<cache::lfu_impl>(33, 1.0).sets == 2);
  CHECK(plan_cache<cache::lfu_impl>(64, 1.0).sets == 2);
  CHECK(plan_cache<cache::lfu_impl>(0, 0.5).sets == 0);  // a rank that owns nothing
  CHECK(plan_cache<cache::lfu_impl>(0xffffffffull, 1.0).sets == 134217728u);
  CHECK_THROWS_AS(plan_cache<cache::lfu_impl>(100, 0.0), wm::logic_error);
  CHECK_THROWS_AS(plan_cache<cache::lfu_impl>(100, 1.5), wm::logic_error);
  CHECK_THROWS_AS(plan_cache<cache::lfu_impl>(100, -0.1), wm::logic_error);
  CHECK_THROWS_AS(plan_cache<cache::lfu_impl>(std::size_t{1} << 32, 0.1), wm::logic_error);
}

TEST_CASE("cache plan: at ratio 1 the hashed sets hold most but not all rows", "[cache]") {
  auto const rows = GENERATE(std::size_t{32}, std::size_t{1000}, std::size_t{1'000'000});
  auto const p    = cache::plan_cache<cache::lfu_impl>(rows, 1.0);
  std::vector<std::uint32_t> load(p.sets, 0);
  for (std::uint32_t k = 0; k < rows; ++k) { ++load[cache::set_of(k, p.sets)]; }
  std::size_t held = 0;
  for (auto const l : load) { held += std::min<std::uint32_t>(l, 32); }
  double const fraction = static_cast<double>(held) / static_cast<double>(rows);
  INFO("rows " << rows << ": a full cache holds " << fraction * 100 << "% of them at once");
  CHECK(fraction > 0.88);
  if (rows == 32) { CHECK(fraction == 1.0); }  // one set
}

// ---------------------------------------------------------------------------------------------
// A group-cache line under a reader's feet: the holder replaces the line's row (empty the word,
// write the row, publish the word) while a reader on another GPU copies it (load the word, copy
// the row, load the word again). Steps interleave one word at a time, in one order for all: the
// order the kernels' fences give (detail/cache/group_kernels.cuh). The words are line_word.hpp's.

namespace {

constexpr std::size_t model_row_words = 8;

std::uint64_t table_word(std::uint32_t key, std::size_t j) {
  return (std::uint64_t{key} << 8) | j;  // every key's row differs from every other's in each word
}

struct group_line_model {
  std::uint64_t word{};  // the line word
  std::array<std::uint64_t, model_row_words> row{};
};

/// The holder's replacement of the line's row by @p key's, one step at a time.
struct model_holder {
  std::uint32_t key{};
  std::size_t step{};
  std::uint64_t empty{};
  /// One step; true once the row is published.
  bool advance(group_line_model& l) {
    if (step == 0) {
      empty  = cache::emptied_word(l.word);
      l.word = empty;
    } else if (step <= model_row_words) {
      l.row[step - 1] = table_word(key, step - 1);
    } else {
      l.word = cache::published_word(empty, key);
      step   = 0;
      return true;
    }
    ++step;
    return false;
  }
};

enum class read_end { running, missed, served, refused };

/// A reader's copy of @p key's row from the line, one step at a time.
struct model_reader {
  std::uint32_t key{};
  std::size_t step{};
  std::uint64_t before{};
  std::array<std::uint64_t, model_row_words> copy{};
  read_end advance(group_line_model const& l) {
    if (step == 0) {
      before = l.word;
      if (!cache::word_holds(before, key)) { return read_end::missed; }
    } else if (step <= model_row_words) {
      copy[step - 1] = l.row[step - 1];
    } else {
      step = 0;
      return cache::copy_stands(before, l.word, key) ? read_end::served : read_end::refused;
    }
    ++step;
    return read_end::running;
  }
  [[nodiscard]] bool copy_is_the_row() const {
    for (std::size_t j = 0; j < model_row_words; ++j) {
      if (copy[j] != table_word(key, j)) { return false; }
    }
    return true;
  }
};

void replace(group_line_model& l, std::uint32_t key) {
  model_holder h{key};
  while (!h.advance(l)) {}
}

}  // namespace

TEST_CASE("group line word: the encoding", "[cache]") {
  std::uint32_t const keys[] = {0u, 1u, 12345u, 0xfffffffeu};  // the largest key a cache holds
  for (std::uint64_t const word : {std::uint64_t{0}, std::uint64_t{7} << 32 | 5u,
                                   std::uint64_t{0xffffffffu} << 32 | 0xffffffffu}) {
    std::uint64_t const empty = cache::emptied_word(word);
    CHECK(cache::word_key(empty) == 0u);  // an emptied line holds no key
    CHECK(empty >> 32 == ((word >> 32) + 1) % (std::uint64_t{1} << 32));  // the next generation
    for (auto const k : keys) {
      CHECK_FALSE(cache::word_holds(empty, k));
      std::uint64_t const full = cache::published_word(empty, k);
      CHECK(cache::word_holds(full, k));
      CHECK(full >> 32 == empty >> 32);
      CHECK(cache::copy_stands(full, full, k));
      for (auto const other : keys) {
        if (other != k) { CHECK_FALSE(cache::word_holds(full, other)); }
      }
      CHECK_FALSE(cache::copy_stands(full, empty, k));  // emptied while copied
      CHECK_FALSE(cache::copy_stands(empty, empty, k));
    }
  }
}

TEST_CASE("group line word: a copy made across a replacement back to the same key is refused",
          "[cache]") {
  std::uint32_t const a = 17, b = 99;
  group_line_model l;
  replace(l, a);
  model_reader r{a};
  REQUIRE(r.advance(l) == read_end::running);                              // the word names a
  for (std::size_t j = 0; j < model_row_words / 2; ++j) { r.advance(l); }  // a's first half
  replace(l, b);
  for (std::size_t j = model_row_words / 2; j < model_row_words; ++j) { r.advance(l); }  // b's
  replace(l, a);                             // the line holds a again, whole
  CHECK_FALSE(r.copy_is_the_row());          // the copy is torn ...
  CHECK(r.advance(l) == read_end::refused);  // ... and the reader sees it
  // Without a replacement the same reader is served.
  REQUIRE(r.advance(l) == read_end::running);
  for (std::size_t j = 0; j < model_row_words; ++j) { r.advance(l); }
  CHECK(r.advance(l) == read_end::served);
  CHECK(r.copy_is_the_row());
}

TEST_CASE("group line word: random interleavings never serve a torn row", "[cache]") {
  auto const seed = std::random_device{}();
  INFO("seed " << seed);
  std::mt19937_64 rng{seed};
  std::uint32_t const keys[] = {3, 4, 5};  // a reader's key comes back often (ABA)
  group_line_model l;
  replace(l, keys[0]);
  model_holder h{keys[1]};
  model_reader r{keys[0]};
  std::size_t served = 0, refused = 0, torn_refused = 0, missed = 0;
  int idle = 0;  // the holder's turns left before its next replacement
  for (int i = 0; i < 2'000'000; ++i) {
    // Replacements at random moments, some of them inside copies.
    if (std::uniform_int_distribution<int>{0, 1}(rng) == 0) {
      if (idle > 0) {
        --idle;
      } else if (h.advance(l)) {
        h.key = keys[std::uniform_int_distribution<int>{0, 2}(rng)];
        idle  = std::uniform_int_distribution<int>{0, 40}(rng);
      }
      continue;
    }
    switch (r.advance(l)) {
      case read_end::running: continue;
      case read_end::missed: ++missed; break;
      case read_end::served:
        ++served;
        REQUIRE(r.copy_is_the_row());
        break;
      case read_end::refused:
        ++refused;
        torn_refused += r.copy_is_the_row() ? 0 : 1;
        break;
    }
    r = model_reader{keys[std::uniform_int_distribution<int>{0, 2}(rng)]};
  }
  INFO("served " << served << ", refused " << refused << " (" << torn_refused << " torn), missed "
                 << missed);
  CHECK(served > 1000);        // the reader was served often ...
  CHECK(torn_refused > 1000);  // ... and refused torn copies often: both paths ran
}
