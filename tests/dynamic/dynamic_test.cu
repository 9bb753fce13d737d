// SPDX-License-Identifier: Apache-2.0
// GPU tests of wm::dynamic_embedding on one rank (the dynamic_test program): random sequences of
// find_or_insert, insert_and_evict, find and erase against a host model (a map of key -> slot
// plus the buckets' slots and scores, run with the policy's score rule and the same bucket order)
// for every eviction policy, comparing after every step the rows written, the found masks, the
// evicted sets and the whole table (export_batch); training without eviction equals a static
// wm::embedding trained on the same keys bit for bit (SGD, Adam); bad input throws and changes
// nothing; the device ref finds what the host finds.
#include <wm/dynamic_embedding.cuh>
#include <wm/embedding.cuh>
#include <wm/launch.hpp>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <span>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "catch.hpp"
#include "device_array.cuh"

namespace {

namespace dy = wm::detail::dynamic;
using wm_test::device_array;

template <class T>
device_array<T> poisoned(std::size_t n) {
  std::vector<T> h(n);
  std::memset(static_cast<void*>(h.data()), 0x7f, n * sizeof(T));
  return device_array<T>{h};
}

// ---------------------------------------------------------------------------------------------
// The host model: the same buckets, the same order (sorted by (hash, position)), the same rule.

template <class Eviction>
struct model {
  using rule = typename dy::score_rule_of<Eviction>::type;
  dy::buckets_view v;  // hash only
  std::size_t dim;
  wm::embedding_init init;
  std::vector<std::uint64_t> keys, scores;
  std::vector<std::vector<float>> rows;
  std::unordered_map<std::uint64_t, std::size_t> where;
  std::uint64_t tick{0};
  std::uint32_t epoch{0};

  model(std::uint32_t buckets, std::uint64_t seed, std::size_t d, wm::embedding_init in)
      : v{nullptr, nullptr, nullptr, buckets, seed},
        dim{d},
        init{in},
        keys(std::size_t{buckets} * 128, dy::empty_key),
        scores(keys.size(), 0),
        rows(keys.size()) {}

  std::vector<float> init_row(std::uint64_t k) const {
    std::vector<float> r(dim);
    for (std::size_t j = 0; j < dim; ++j) { r[j] = init.value(k, j, dim); }
    return r;
  }

  struct result {
    std::vector<std::uint32_t> slot;  // per position
    std::vector<dy::key_status> status;
    std::set<std::uint64_t> evicted;
    bool overflow{false};
  };

  // One upsert; values (dim per position) or null for the initializer's rows. Nothing changes on
  // overflow (no_eviction).
  result upsert(std::vector<std::uint64_t> const& in, std::vector<std::uint64_t> const& user,
                float const* values) {
    std::size_t const n = in.size();
    std::vector<std::size_t> order(n);
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [&](auto a, auto b) { return v.hash(in[a]) < v.hash(in[b]); });
    result r{std::vector<std::uint32_t>(n, dy::no_slot),
             std::vector<dy::key_status>(n, dy::key_status::not_inserted),
             {},
             false};
    // dry run for no_eviction
    if constexpr (!rule::evicts) {
      std::map<std::uint32_t, std::pair<std::size_t, std::set<std::uint64_t>>> need;
      for (auto k : in) {
        if (where.count(k) == 0) { need[v.bucket(v.hash(k))].second.insert(k); }
      }
      for (auto& [b, nk] : need) {
        std::size_t free = 0;
        for (std::size_t s = 0; s < 128; ++s) { free += keys[b * 128 + s] == dy::empty_key; }
        if (nk.second.size() > free) {
          r.overflow = true;
          return r;
        }
      }
    }
    ++tick;
    dy::score_context const ctx{tick, epoch};
    std::size_t i = 0;
    while (i < n) {
      std::uint32_t const b = v.bucket(v.hash(in[order[i]]));
      std::size_t e         = i;
      while (e < n && v.bucket(v.hash(in[order[e]])) == b) { ++e; }
      std::vector<bool> prot(128, false);
      std::vector<std::size_t> firsts;  // sorted indices of distinct keys
      for (std::size_t q = i; q < e; ++q) {
        if (q == i || in[order[q]] != in[order[q - 1]]) { firsts.push_back(q); }
      }
      auto set_run = [&](std::size_t q, std::uint32_t slot, dy::key_status st) {
        for (std::size_t k = q; k < e && in[order[k]] == in[order[q]]; ++k) {
          r.slot[order[k]]   = slot;
          r.status[order[k]] = st;
        }
      };
      for (auto q : firsts) {  // phase 1
        auto const k = in[order[q]];
        auto it      = where.find(k);
        if (it == where.end()) { continue; }
        prot[it->second % 128] = true;
        scores[it->second] = rule::hit(scores[it->second], ctx, user.empty() ? 0 : user[order[q]]);
        set_run(q, static_cast<std::uint32_t>(it->second), dy::key_status::found);
      }
      for (auto q : firsts) {  // phase 2
        auto const k = in[order[q]];
        if (where.count(k) != 0) { continue; }
        std::uint64_t const score = rule::inserted(ctx, user.empty() ? 0 : user[order[q]]);
        int target                = -1;
        bool victim               = false;
        for (int s = 0; s < 128 && target < 0; ++s) {
          if (!prot[s] && keys[b * 128 + s] == dy::empty_key) { target = s; }
        }
        if (target < 0 && rule::evicts) {
          int best = -1;
          for (int s = 0; s < 128; ++s) {
            if (!prot[s] && (best < 0 || scores[b * 128 + s] < scores[b * 128 + best])) {
              best = s;
            }
          }
          if (best >= 0 && rule::admits(score, scores[b * 128 + best])) {
            target = best;
            victim = true;
          }
        }
        if (target < 0) {
          set_run(q, dy::no_slot, dy::key_status::not_inserted);
          continue;
        }
        prot[target]           = true;
        std::size_t const slot = b * 128 + static_cast<std::size_t>(target);
        if (victim) {
          r.evicted.insert(keys[slot]);
          where.erase(keys[slot]);
        }
        keys[slot]   = k;
        scores[slot] = score;
        rows[slot]   = init_row(k);
        where[k]     = slot;
        set_run(q, static_cast<std::uint32_t>(slot), dy::key_status::inserted);
      }
      i = e;
    }
    if (values != nullptr) {  // the last occurrence of each key wins
      for (std::size_t p = 0; p < n; ++p) {
        if (r.slot[p] != dy::no_slot) {
          rows[r.slot[p]].assign(values + p * dim, values + (p + 1) * dim);
        }
      }
    }
    return r;
  }

  std::size_t erase(std::vector<std::uint64_t> const& in) {
    std::size_t n = 0;
    for (auto k : in) {
      auto it = where.find(k);
      if (it == where.end()) { continue; }
      keys[it->second]   = dy::empty_key;
      scores[it->second] = 0;
      where.erase(it);
      ++n;
    }
    return n;
  }
};

// The whole table, exported, as key -> (score, row).
template <class Table>
std::map<std::uint64_t, std::pair<std::uint64_t, std::vector<float>>> exported(Table& t,
                                                                               cudaStream_t s) {
  std::size_t const cap = t.capacity(), dim = t.dim();
  auto keys   = poisoned<std::int64_t>(cap);
  auto values = poisoned<float>(cap * dim);
  auto scores = poisoned<std::uint64_t>(cap);
  std::size_t const n =
      t.export_batch(wm::score_at_least{0}, keys.ptr, values.ptr, scores.ptr, cuda::stream_ref{s});
  auto const hk = keys.to_host();
  auto const hs = scores.to_host();
  auto const hv = values.to_host();
  std::map<std::uint64_t, std::pair<std::uint64_t, std::vector<float>>> m;
  for (std::size_t i = 0; i < n; ++i) {
    m[static_cast<std::uint64_t>(hk[i])] = {
        hs[i],
        {hv.begin() + static_cast<long>(i * dim), hv.begin() + static_cast<long>((i + 1) * dim)}};
  }
  REQUIRE(m.size() == n);  // no key twice
  return m;
}

template <class M>
std::map<std::uint64_t, std::pair<std::uint64_t, std::vector<float>>> model_table(M const& m) {
  std::map<std::uint64_t, std::pair<std::uint64_t, std::vector<float>>> r;
  for (auto const& [k, s] : m.where) { r[k] = {m.scores[s], m.rows[s]}; }
  return r;
}

template <class Eviction>
void random_sequence(wm::communicator& comm, std::uint64_t seed) {
  constexpr std::size_t dim = 5;
  std::mt19937_64 rng{seed};
  wm::embedding_init const init = wm::embedding_init::uniform(-1.0f, 1.0f, seed);
  wm::dynamic_options const opts{seed * 3 + 1, wm::missing_rows::initializer};
  // 2 buckets: 256 slots; keys from a universe of 600 (negative ones too) so buckets fill.
  wm::dynamic_embedding<float, wm::sgd, Eviction> t{comm, 200, dim, {}, init, opts};
  REQUIRE(t.capacity() == 256);
  model<Eviction> m{2, opts.hash_seed, dim, init};
  std::vector<std::uint64_t> universe(600);
  for (auto& k : universe) {
    do { k = rng() >> (rng() % 40); } while (dy::reserved(k));
    if (rng() % 3 == 0) {
      k = static_cast<std::uint64_t>(-static_cast<std::int64_t>(k % 100000) - 3);
    }
  }
  wm::detail::unique_stream const stream = wm::detail::unique_stream::make();
  cudaStream_t const s                   = stream.get();
  cuda::stream_ref const sr{s};
  std::uniform_real_distribution<float> val{-2.0f, 2.0f};
  std::size_t evictions = 0, overflows = 0;
  for (int step = 0; step < 60; ++step) {
    INFO("step " << step);
    if (step % 7 == 6) {
      ++m.epoch;
      t.set_epoch(m.epoch);
    }
    std::size_t const n = 1 + rng() % 90;
    std::vector<std::uint64_t> in(n);
    for (auto& k : in) { k = universe[rng() % (step < 20 ? 150 : universe.size())]; }
    std::vector<std::int64_t> ik(in.begin(), in.end());
    device_array<std::int64_t> dk{ik};
    std::vector<std::uint64_t> user;
    if constexpr (dy::score_rule_of<Eviction>::type::user_scores) {
      user.resize(n);
      for (auto& u : user) { u = rng() % 1000; }
    }
    device_array<std::uint64_t> du{user};
    std::span<std::uint64_t const> const us{du.ptr, user.size()};
    std::span<std::int64_t const> const keys{dk.ptr, n};
    int const op      = static_cast<int>(rng() % 4);
    auto const before = model_table(m);
    if (op == 0 || op == 1) {  // find_or_insert / insert_or_assign or insert_and_evict
      std::vector<float> values(n * dim);
      for (auto& x : values) { x = val(rng); }
      device_array<float> dv{values};
      auto out          = poisoned<float>(n * dim);
      auto found        = poisoned<std::uint8_t>(n);
      auto ek           = poisoned<std::int64_t>(n);
      auto ev           = poisoned<float>(n * dim);
      auto es           = poisoned<std::uint64_t>(n);
      auto const expect = m.upsert(in, user, op == 1 ? values.data() : nullptr);
      if (expect.overflow) {
        ++overflows;
        if (op == 0) {
          REQUIRE_THROWS_AS(
              t.find_or_insert(keys, out.ptr, reinterpret_cast<bool*>(found.ptr), sr, us),
              wm::logic_error);
        } else {
          REQUIRE_THROWS_AS(
              t.insert_and_evict(keys, dv.ptr, {ek.ptr, ev.ptr, nullptr, nullptr, es.ptr}, sr, us),
              wm::logic_error);
        }
        REQUIRE(exported(t, s) == before);  // nothing changed
        continue;
      }
      if (op == 0) {
        t.find_or_insert(keys, out.ptr, reinterpret_cast<bool*>(found.ptr), sr, us);
        auto const ho = out.to_host();
        auto const hf = found.to_host();
        for (std::size_t p = 0; p < n; ++p) {
          INFO("position " << p << " key " << in[p]);
          bool const was = expect.status[p] == dy::key_status::found;
          CHECK((hf[p] != 0) == was);
          std::vector<float> const want = was ? before.at(in[p]).second : m.init_row(in[p]);
          CHECK(std::vector<float>(ho.begin() + static_cast<long>(p * dim),
                                   ho.begin() + static_cast<long>((p + 1) * dim)) == want);
        }
      } else if (rng() % 2 == 0) {  // insert_or_assign: the same, without the evicted rows
        t.insert_or_assign(keys, dv.ptr, sr, us);
        evictions += expect.evicted.size();
      } else {
        std::size_t const ne =
            t.insert_and_evict(keys, dv.ptr, {ek.ptr, ev.ptr, nullptr, nullptr, es.ptr}, sr, us);
        REQUIRE(ne == expect.evicted.size());
        auto const hk = ek.to_host();
        auto const hv = ev.to_host();
        auto const hs = es.to_host();
        std::set<std::uint64_t> got;
        for (std::size_t e = 0; e < ne; ++e) {
          auto const k = static_cast<std::uint64_t>(hk[e]);
          got.insert(k);
          REQUIRE(before.count(k) == 1);
          CHECK(hs[e] == before.at(k).first);
          CHECK(std::vector<float>(hv.begin() + static_cast<long>(e * dim),
                                   hv.begin() + static_cast<long>((e + 1) * dim)) ==
                before.at(k).second);
        }
        CHECK(got == expect.evicted);
        evictions += ne;
      }
    } else if (op == 2) {  // find: read-only
      auto out   = poisoned<float>(n * dim);
      auto found = poisoned<std::uint8_t>(n);
      t.find(keys, out.ptr, reinterpret_cast<bool*>(found.ptr), sr);
      auto const ho = out.to_host();
      auto const hf = found.to_host();
      for (std::size_t p = 0; p < n; ++p) {
        bool const has = before.count(in[p]) == 1;
        CHECK((hf[p] != 0) == has);
        std::vector<float> const want = has ? before.at(in[p]).second : m.init_row(in[p]);
        CHECK(std::vector<float>(ho.begin() + static_cast<long>(p * dim),
                                 ho.begin() + static_cast<long>((p + 1) * dim)) == want);
      }
    } else {  // erase
      CHECK(t.erase(keys, sr) == m.erase(in));
    }
    REQUIRE(exported(t, s) == model_table(m));
    CHECK(t.size(sr) == m.where.size());
    CHECK(t.load_factor(sr) == static_cast<double>(m.where.size()) / 256.0);
  }
  // The sequence reached what it tests.
  if constexpr (dy::score_rule_of<Eviction>::type::evicts) {
    CHECK(evictions > 0);
  } else {
    CHECK(overflows > 0);
  }
  t.clear(sr);
  CHECK(t.size(sr) == 0);
}

template <class F>
void on_one_rank(F&& f) {
  std::uint64_t const seed = std::random_device{}();
  INFO("seed " << seed);
  wm::launch(1, [&](wm::communicator& comm) { f(comm, seed); });
}

}  // namespace

TEMPLATE_TEST_CASE("dynamic table follows the host model", "[gpu]", wm::lru, wm::lfu, wm::epoch_lru,
                   wm::epoch_lfu, wm::custom_score, wm::no_eviction) {
  on_one_rank(
      [](wm::communicator& comm, std::uint64_t seed) { random_sequence<TestType>(comm, seed); });
}

namespace {

template <class T>
float to_float(T x) {
  if constexpr (std::is_same_v<T, __half>) {
    return __half2float(x);
  } else {
    return x;
  }
}
template <class T>
T from_float(float x) {
  if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(x);
  } else {
    return x;
  }
}

template <class T, class Opt>
void train_like_static(wm::communicator& comm, std::uint64_t seed, Opt opt) {
  constexpr std::size_t rows = 1000, dim = 12, batch = 300;
  std::mt19937_64 rng{seed};
  auto const init = wm::embedding_init::uniform(-0.5f, 0.5f, seed);
  wm::embedding<T, wm::no_cache, Opt> ref{comm, rows, dim, opt, init};
  // 4,096 slots for 1,000 keys: a bucket of 128 overflows with probability below 1e-30.
  wm::dynamic_embedding<T, Opt, wm::no_eviction> t{comm, 4096, dim, opt, init};
  wm::detail::unique_stream const stream = wm::detail::unique_stream::make();
  cudaStream_t const s                   = stream.get();
  cuda::stream_ref const sr{s};
  std::normal_distribution<float> g{0.0f, 1.0f};
  for (int step = 0; step < 6; ++step) {
    INFO("step " << step);
    std::vector<std::int64_t> idx(batch);
    for (auto& k : idx) { k = static_cast<std::int64_t>(rng() % (rng() % 4 == 0 ? 20 : rows)); }
    std::vector<T> grads(batch * dim);
    for (auto& x : grads) { x = from_float<T>(g(rng)); }
    device_array<std::int64_t> di{idx};
    device_array<T> dg{grads};
    auto a = poisoned<T>(batch * dim);
    auto b = poisoned<T>(batch * dim);
    std::span<std::int64_t const> const keys{di.ptr, batch};
    ref.gather(keys, a.ptr, sr);
    t.gather(keys, b.ptr, sr);
    WM_CUDA_TRY(cudaStreamSynchronize(s));
    auto const ha = a.to_host(), hb = b.to_host();
    REQUIRE(std::memcmp(ha.data(), hb.data(), ha.size() * sizeof(T)) == 0);
    ref.apply_gradients(keys, dg.ptr, 0.1f, sr);
    t.apply_gradients(keys, dg.ptr, 0.1f, sr);
  }
  CHECK(t.global_step() == ref.global_step());
  // Every key ever touched, both tables, bit for bit; the rows changed from their start.
  std::vector<std::int64_t> all(rows);
  std::iota(all.begin(), all.end(), std::int64_t{0});
  device_array<std::int64_t> da{all};
  auto a     = poisoned<T>(rows * dim);
  auto b     = poisoned<T>(rows * dim);
  auto found = poisoned<std::uint8_t>(rows);
  ref.gather(std::span<std::int64_t const>{da.ptr, rows}, a.ptr, sr);
  WM_CUDA_TRY(cudaStreamSynchronize(s));
  t.find(std::span<std::int64_t const>{da.ptr, rows}, b.ptr, reinterpret_cast<bool*>(found.ptr),
         sr);
  auto const ha = a.to_host(), hb = b.to_host();
  auto const hf    = found.to_host();
  std::size_t held = 0, moved = 0;
  for (std::size_t k = 0; k < rows; ++k) {
    if (hf[k] == 0) { continue; }
    ++held;
    CHECK(std::memcmp(&ha[k * dim], &hb[k * dim], dim * sizeof(T)) == 0);
    moved += to_float(ha[k * dim]) != to_float(from_float<T>(init.value(k, 0, dim)));
  }
  CHECK(held == t.size(sr));
  CHECK(held > 500);
  CHECK(moved > 400);
}

__global__ void ref_find_kernel(wm::dynamic_embedding_ref<float> r, std::uint64_t const* keys,
                                std::size_t n, float* first, int* hit) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    float const* row = r.find(keys[i]);
    hit[i]           = row != nullptr;
    first[i]         = row != nullptr ? row[r.dim() - 1] : -7.0f;
  }
}

}  // namespace

TEST_CASE("dynamic training without eviction equals the static embedding bit for bit", "[gpu]") {
  SECTION("sgd") {
    on_one_rank([](wm::communicator& comm, std::uint64_t seed) {
      train_like_static<float>(comm, seed, wm::sgd{0.01f});
    });
  }
  SECTION("half, sgd") {
    on_one_rank([](wm::communicator& comm, std::uint64_t seed) {
      train_like_static<__half>(comm, seed, wm::sgd{0.01f});
    });
  }
  SECTION("adam") {
    on_one_rank([](wm::communicator& comm, std::uint64_t seed) {
      train_like_static<float>(comm, seed, wm::adam{});
    });
  }
}

namespace {

enum class bad_input { reserved_key, full_bucket, unexpected_scores };

// One bad call on a table of one bucket that holds 100 keys: it throws and changes nothing.
void refuse(wm::communicator& comm, std::uint64_t seed, bad_input what) {
  using table = wm::dynamic_embedding<float, wm::sgd, wm::no_eviction>;
  REQUIRE_THROWS_AS((table{comm, 0, 4}), wm::logic_error);
  REQUIRE_THROWS_AS((table{comm, 16, 0}), wm::logic_error);
  table t{comm, 100, 4, {}, wm::embedding_init::uniform(0.0f, 1.0f, seed)};
  REQUIRE(t.capacity() == 128);  // one bucket
  wm::detail::unique_stream const stream = wm::detail::unique_stream::make();
  cuda::stream_ref const sr{stream.get()};
  std::vector<std::int64_t> first(100);
  std::iota(first.begin(), first.end(), std::int64_t{1000});
  device_array<std::int64_t> d1{first};
  t.find_or_insert(std::span<std::int64_t const>{d1.ptr, 100}, nullptr, nullptr, sr);
  REQUIRE(t.size(sr) == 100);
  if (what == bad_input::full_bucket) {
    std::vector<std::int64_t> more(29);
    std::iota(more.begin(), more.end(), std::int64_t{5000});
    device_array<std::int64_t> dm{more};
    t.find_or_insert(std::span<std::int64_t const>{dm.ptr, 28}, nullptr, nullptr, sr);  // 128
    REQUIRE(t.size(sr) == 128);
    auto const full = exported(t, stream.get());
    CHECK_THROWS_AS(
        t.find_or_insert(std::span<std::int64_t const>{dm.ptr, 29}, nullptr, nullptr, sr),
        wm::logic_error);
    CHECK(exported(t, stream.get()) == full);
    return;
  }
  auto const before = exported(t, stream.get());
  if (what == bad_input::reserved_key) {
    for (std::int64_t bad : {std::int64_t{-1}, std::int64_t{-2}}) {
      std::vector<std::int64_t> k{5, bad, 6};
      device_array<std::int64_t> dk{k};
      std::span<std::int64_t const> const keys{dk.ptr, 3};
      CHECK_THROWS_AS(t.find_or_insert(keys, nullptr, nullptr, sr), wm::logic_error);
      CHECK_THROWS_AS(t.erase(keys, sr), wm::logic_error);
      auto out = poisoned<float>(12);
      CHECK_THROWS_AS(t.find(keys, out.ptr, nullptr, sr), wm::logic_error);
    }
  } else {
    std::vector<std::uint64_t> sc{1};
    device_array<std::uint64_t> ds{sc};
    std::vector<std::int64_t> k{77};
    device_array<std::int64_t> dk{k};
    CHECK_THROWS_AS(t.find_or_insert(std::span<std::int64_t const>{dk.ptr, 1}, nullptr, nullptr, sr,
                                     std::span<std::uint64_t const>{ds.ptr, 1}),
                    wm::logic_error);
  }
  CHECK(exported(t, stream.get()) == before);
  CHECK(t.size(sr) == 100);
}

}  // namespace

TEST_CASE("dynamic table refuses bad input and changes nothing", "[gpu]") {
  // Sections outside the rank: each runs in a rank of its own.
  SECTION("a reserved key") {
    on_one_rank([](wm::communicator& comm, std::uint64_t seed) {
      refuse(comm, seed, bad_input::reserved_key);
    });
  }
  SECTION("a full bucket with eviction off") {
    on_one_rank([](wm::communicator& comm, std::uint64_t seed) {
      refuse(comm, seed, bad_input::full_bucket);
    });
  }
  SECTION("scores given to a policy that keeps its own") {
    on_one_rank([](wm::communicator& comm, std::uint64_t seed) {
      refuse(comm, seed, bad_input::unexpected_scores);
    });
  }
}

TEST_CASE("dynamic custom_score needs scores", "[gpu]") {
  on_one_rank([](wm::communicator& comm, std::uint64_t) {
    wm::dynamic_embedding<float, wm::sgd, wm::custom_score> t{comm, 128, 4};
    wm::detail::unique_stream const stream = wm::detail::unique_stream::make();
    std::vector<std::int64_t> k{1, 2};
    device_array<std::int64_t> dk{k};
    CHECK_THROWS_AS(t.find_or_insert(std::span<std::int64_t const>{dk.ptr, 2}, nullptr, nullptr,
                                     cuda::stream_ref{stream.get()}),
                    wm::logic_error);
    CHECK(t.size(cuda::stream_ref{stream.get()}) == 0);
  });
}

TEST_CASE("dynamic device ref finds what the table holds", "[gpu]") {
  on_one_rank([](wm::communicator& comm, std::uint64_t seed) {
    constexpr std::size_t dim = 3;
    wm::dynamic_embedding<float, wm::sgd, wm::lru> t{
        comm, 1000, dim, {}, wm::embedding_init::uniform(1.0f, 2.0f, seed)};
    wm::detail::unique_stream const stream = wm::detail::unique_stream::make();
    cuda::stream_ref const sr{stream.get()};
    std::mt19937_64 rng{seed};
    std::vector<std::uint64_t> in(400), probe(800);
    for (auto& k : in) { k = rng() % 0xfffffff0ull; }
    for (std::size_t i = 0; i < probe.size(); ++i) { probe[i] = i % 2 == 0 ? in[i / 2] : rng(); }
    device_array<std::uint64_t> dk{in}, dp{probe};
    t.find_or_insert(std::span<std::uint64_t const>{dk.ptr, in.size()}, nullptr, nullptr, sr);
    auto first = poisoned<float>(probe.size());
    auto hit   = poisoned<int>(probe.size());
    auto out   = poisoned<float>(probe.size() * dim);
    auto found = poisoned<std::uint8_t>(probe.size());
    ref_find_kernel<<<8, 128, 0, stream.get()>>>(t.ref(), dp.ptr, probe.size(), first.ptr, hit.ptr);
    WM_CUDA_TRY(cudaGetLastError());
    t.find(std::span<std::uint64_t const>{dp.ptr, probe.size()}, out.ptr,
           reinterpret_cast<bool*>(found.ptr), sr);
    auto const hf     = first.to_host();
    auto const hh     = hit.to_host();
    auto const ho     = out.to_host();
    auto const hfound = found.to_host();
    std::size_t hits  = 0;
    for (std::size_t i = 0; i < probe.size(); ++i) {
      CHECK((hh[i] != 0) == (hfound[i] != 0));
      if (hfound[i] != 0) {
        ++hits;
        CHECK(hf[i] == ho[i * dim + dim - 1]);
      }
    }
    CHECK(hits >= in.size());
    // With missing_rows::zeros, find gives a missing key zeros.
    wm::dynamic_embedding<float, wm::sgd, wm::lru> z{comm,
                                                     128,
                                                     dim,
                                                     {},
                                                     wm::embedding_init::uniform(1.0f, 2.0f, seed),
                                                     {seed, wm::missing_rows::zeros}};
    auto zo = poisoned<float>(probe.size() * dim);
    z.find(std::span<std::uint64_t const>{dp.ptr, probe.size()}, zo.ptr, nullptr, sr);
    auto const hz = zo.to_host();
    CHECK(std::all_of(hz.begin(), hz.end(), [](float x) { return x == 0.0f; }));
    // Moved, the table still works. Gradients of keys it does not hold are dropped (nothing is
    // inserted); the others' rows move by lr x their summed gradients (exact: rows in (1, 2],
    // gradients 0.5, lr 1).
    auto moved               = std::move(t);
    std::size_t const before = moved.size(sr);
    std::vector<float> grads(probe.size() * dim, 0.5f);
    device_array<float> dg{grads};
    std::span<std::uint64_t const> const all{dp.ptr, probe.size()};
    moved.apply_gradients(all, dg.ptr, 1.0f, sr);
    CHECK(moved.size(sr) == before);
    CHECK(moved.global_step() == 1);
    std::map<std::uint64_t, int> uses;
    for (auto k : probe) { ++uses[k]; }
    auto after = poisoned<float>(probe.size() * dim);
    moved.find(all, after.ptr, nullptr, sr);
    auto const ha = after.to_host();
    for (std::size_t i = 0; i < probe.size(); ++i) {
      for (std::size_t j = 0; j < dim; ++j) {
        float const want = hfound[i] != 0
                               ? ho[i * dim + j] - 0.5f * static_cast<float>(uses[probe[i]])
                               : ho[i * dim + j];  // the initializer's row, again
        CHECK(ha[i * dim + j] == want);
      }
    }
  });
}
