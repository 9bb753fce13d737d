// SPDX-License-Identifier: Apache-2.0
// GPU tests of read-write device caches in wm::embedding on one rank (the embedding_cache_test
// program): the gather paths and their statistics. Hit-first gathers (batches that mostly hit)
// and batches with more than 32 keys of one set (bypasses, also in each replay of a captured
// gather) train bit for bit like no cache, with exact counts; many dirty victims per gather give
// exact write-back counts and a flushed table equal to no cache bit for bit; a gather captured in
// a CUDA graph replays on new keys; invalid keys give zero rows and are reported by the
// statistics; bad ratios are refused.
#include <wm/embedding.cuh>
#include <wm/launch.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "cache_common.cuh"
#include "catch.hpp"
#include "device_array.cuh"
#include "rank_check.hpp"

using namespace cache_tests;

namespace {

/**
 * The CUDA graph tests' tables, both initialized from normal(0, 1, seed): a float Adam table in
 * host memory behind a read-write LRU device cache (ratio 0.1), and the uncached device table.
 */
struct lru_adam_tables {
  wm::embedding<float, wm::device_cache<wm::read_write, wm::lru>, wm::adam, wm::host> cached;
  wm::embedding<float, wm::no_cache, wm::adam, wm::device> plain;

  lru_adam_tables(wm::communicator& comm, std::size_t rows, std::size_t dim, std::uint64_t seed)
      : cached{comm, rows, dim, {}, wm::embedding_init::normal(0.0f, 1.0f, seed), ratio_tenth()},
        plain{comm, rows, dim, {}, wm::embedding_init::normal(0.0f, 1.0f, seed)} {}

  static wm::cache_options ratio_tenth() {
    wm::cache_options co;
    co.ratio = 0.1;
    return co;
  }
};

/**
 * Captures cached.gather of @p n keys in a CUDA graph, after an eager gather of a first batch
 * (it sizes the workspace) that must equal the uncached one, and replays the graph on @p replays
 * fresh batches: each replay reads its keys from the captured key buffer, writes a poisoned
 * output and must equal the uncached gather. on_batch(k, batch) runs after the eager gather
 * (k = 0) and after replay k.
 */
template <class C, class P, class F>
void replay_captured_gather(C& cached, P& plain, std::mt19937_64& rng, std::size_t n, int replays,
                            cudaStream_t s, F&& on_batch) {
  std::size_t const rows = cached.rows(), dim = cached.dim();
  auto const warm = draw<float>(rng, rows, dim, n, 0);
  RANK_REQUIRE(gather(cached, warm, s) == gather(plain, warm, s));  // sizes the workspace
  on_batch(0, warm);
  // The captured gather reads its keys from `dk` and writes `out`: new keys, same count.
  device_array<std::int64_t> dk{warm.keys};
  device_array<float> out{std::vector<float>(n * dim, -7.0f)};
  cudaGraph_t graph{};
  WM_CUDA_TRY(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
  cached.gather(std::span<std::int64_t const>{dk.ptr, n}, out.ptr, cuda::stream_ref{s});
  WM_CUDA_TRY(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec{};
  WM_CUDA_TRY(cudaGraphInstantiate(&exec, graph, 0));
  for (int k = 1; k <= replays; ++k) {
    auto const b = draw<float>(rng, rows, dim, n, k);
    WM_CUDA_TRY(
        cudaMemcpy(dk.ptr, b.keys.data(), n * sizeof(std::int64_t), cudaMemcpyHostToDevice));
    WM_CUDA_TRY(cudaMemset(out.ptr, 0xa5, n * dim * sizeof(float)));  // poison
    WM_CUDA_TRY(cudaDeviceSynchronize());  // keys and poison in place before the replay on s
    WM_CUDA_TRY(cudaGraphLaunch(exec, s));
    WM_CUDA_TRY(cudaStreamSynchronize(s));
    RANK_REQUIRE_MSG(bytes_of(out.to_host()) == gather(plain, b, s),
                     "replay " << k << " of the captured gather differs");
    on_batch(k, b);
  }
  WM_CUDA_TRY(cudaGraphExecDestroy(exec));
  WM_CUDA_TRY(cudaGraphDestroy(graph));
}

/**
 * Batches that mostly hit (a hot set that fits, 1 key in 48 from the whole table): after the
 * first gathers, the gathers take the hit-first path (probe every key, copy hits from lines,
 * admit only the misses, write dirty victims back at once). Training equals the uncached table
 * bit for bit, the statistics add up exactly, an invalid key in a hit-first batch gives a zero
 * row and is reported, and the path was taken.
 */
template <class T, class R, class Opt>
void hit_first_bitwise(Opt opt, char const* what) {
  INFO(what);
  on_one_rank([&](wm::communicator& comm, std::uint64_t seed) {
    cudaStream_t s{};
    WM_CUDA_TRY(cudaStreamCreate(&s));
    std::mt19937_64 rng{seed};
    std::size_t const rows = 20000, dim = 16, n = 4000, hot_rows = 600;
    cached_and_plain<T, R, Opt> tables{comm, rows, dim, opt, 0.1, rng};
    auto& cached = tables.cached;
    auto& plain  = tables.plain;
    std::vector<std::int64_t> hot(hot_rows);
    for (auto& h : hot) { h = static_cast<std::int64_t>(rng() % rows); }
    std::uint64_t requests = 0, distinct = 0;
    int const steps = 24, bad_step = 20;
    for (int k = 0; k < steps; ++k) {
      auto b = draw<T>(rng, rows, dim, n, k);
      for (auto& key : b.keys) {
        key = rng() % 48 == 0 ? static_cast<std::int64_t>(rng() % rows) : hot[rng() % hot_rows];
      }
      if (k == bad_step) { b.keys[n / 2] = static_cast<std::int64_t>(rows); }  // invalid
      b.distinct = std::set<std::int64_t>(b.keys.begin(), b.keys.end()).size();
      auto good  = b;  // what the plain table gathers and both update: valid keys only
      if (k == bad_step) { good.keys[n / 2] = hot[0]; }
      auto const got = gather(cached, b, s);
      auto want      = gather(plain, good, s);
      if (k == bad_step) {  // the invalid key's row is zero
        std::fill_n(want.begin() + static_cast<std::ptrdiff_t>((n / 2) * dim * sizeof(T)),
                    dim * sizeof(T), static_cast<unsigned char>(0));
        bool threw = false;
        try {
          (void)cached.cache_stats();
        } catch (wm::logic_error const&) { threw = true; }
        RANK_REQUIRE_MSG(threw, what << ": the invalid key was not reported");
      }
      RANK_REQUIRE_MSG(got == want, what << ": gather of step " << k << " differs");
      requests += b.keys.size();
      distinct += b.distinct;
      auto const st = cached.cache_stats();
      RANK_REQUIRE_MSG(st.requests == requests, what << " step " << k << ": " << st.requests
                                                     << " requests, " << requests << " made");
      RANK_REQUIRE_MSG(st.distinct_keys == distinct, what << " step " << k << ": "
                                                          << st.distinct_keys << " distinct, "
                                                          << distinct << " made");
      RANK_REQUIRE_MSG(st.hits + st.misses == st.requests, what << " step " << k);
      apply(cached, good, s);
      apply(plain, good, s);
    }
    auto const st = cached.cache_stats();
    INFO("hit-first gathers " << st.hit_first_gathers << " of " << steps << ", hits " << st.hits
                              << ", misses " << st.misses << ", evictions " << st.evictions
                              << ", write-backs " << st.write_backs);
    RANK_REQUIRE_MSG(st.hit_first_gathers >= static_cast<std::uint64_t>(steps) / 2,
                     what << ": the hit-first path was not taken");
    RANK_REQUIRE_MSG(st.write_backs > 0, what << ": no dirty victim was written back");
    RANK_REQUIRE_MSG(flushed_equal(cached, plain, s), what << ": the flushed table");
    WM_CUDA_TRY(cudaStreamDestroy(s));
  });
}

}  // namespace

TEST_CASE("device cache: hit-first gathers, float, LFU, Adam", "[gpu]") {
  hit_first_bitwise<float, wm::lfu>(wm::adam{}, "float LFU Adam");
}
TEST_CASE("device cache: hit-first gathers, half, LRU, SGD", "[gpu]") {
  hit_first_bitwise<__half, wm::lru>(wm::sgd{}, "half LRU SGD");
}

namespace {

/**
 * A cache of one set (32 lines) and batches of up to hundreds of distinct keys: every batch with
 * D > 32 distinct keys bypasses exactly D - 32 of them (a batch never evicts a line it used), a
 * prefetched batch as well (its gather is a batch of its own); training through it equals the
 * uncached table bit for bit, gathers and tables after flush().
 */
template <class T, class R, class Opt>
void train_with_bypasses(wm::communicator& comm, Opt opt, std::uint64_t seed) {
  std::string const what = std::string{"bypass "} + R::name + " " + Opt::name;
  std::size_t const rows = 300, dim = 16;
  cudaStream_t s{};
  WM_CUDA_TRY(cudaStreamCreate(&s));
  std::mt19937_64 rng{seed};
  cached_and_plain<T, R, Opt> tables{comm, rows, dim, opt, 0.1, rng};  // 30 lines: one set of 32
  auto& cached = tables.cached;
  auto& plain  = tables.plain;
  RANK_REQUIRE_MSG(cached.cache_lines() == 32, what << ": " << cached.cache_lines() << " lines");
  std::size_t const payload = line_payload<T>(opt, dim);
  std::uint64_t bypasses = 0, requests = 0;
  std::size_t const sizes[] = {20, 60, 100, 150, 33, 250, 400, 40, 500, 120};
  for (int k = 0; k < 10; ++k) {
    auto const b = draw<T>(rng, rows, dim, sizes[k], k);
    if (k == 6 || k == 8) {  // prefetched: its 32 lines hit, the rest bypass the gather
      device_array<std::int64_t> dk{b.keys};
      cached.prefetch(std::span<std::int64_t const>{dk.ptr, b.keys.size()}, cuda::stream_ref{s});
    }
    RANK_REQUIRE_MSG(gather(cached, b, s) == gather(plain, b, s),
                     what << ": gather of batch " << k << " (" << b.distinct << " distinct keys)");
    bypasses += b.distinct > 32 ? b.distinct - 32 : 0;
    requests += b.keys.size();
    auto const st = cached.cache_stats();
    RANK_REQUIRE_MSG(st.requests == requests, what);
    RANK_REQUIRE_MSG(st.bypasses == bypasses, what << ": batch " << k << " (" << b.distinct
                                                   << " distinct keys): " << st.bypasses
                                                   << " bypasses, " << bypasses << " expected");
    RANK_REQUIRE_MSG(st.bypasses <= st.misses && st.hits + st.misses == st.requests, what);
    RANK_REQUIRE_MSG(st.bypasses <= st.bypass_rows, what);
    RANK_REQUIRE_MSG((st.bytes_from_host - st.bypass_rows * dim * sizeof(T)) % payload == 0, what);
    apply(cached, b, s);
    apply(plain, b, s);
    if (k % 3 == 2) {
      RANK_REQUIRE_MSG(flushed_equal(cached, plain, s),
                       what << ": the flushed table differs after batch " << k);
    }
  }
  RANK_REQUIRE_MSG(bypasses > 0, what << ": no batch had more than 32 distinct keys");
  RANK_REQUIRE_MSG(flushed_equal(cached, plain, s), what << ": the final table");
  WM_CUDA_TRY(cudaStreamDestroy(s));
}

}  // namespace

TEST_CASE(
    "device cache: more than 32 keys of one set in a batch bypass; training still equals "
    "no cache bit for bit",
    "[gpu]") {
  SECTION("float, LFU, SGD") {
    on_one_rank([&](wm::communicator& comm, std::uint64_t seed) {
      train_with_bypasses<float, wm::lfu>(comm, wm::sgd{}, seed);
    });
  }
  SECTION("float, LRU, Adam") {
    on_one_rank([&](wm::communicator& comm, std::uint64_t seed) {
      train_with_bypasses<float, wm::lru>(comm, wm::adam{}, seed);
    });
  }
  SECTION("half, LFU, Adam") {
    on_one_rank([&](wm::communicator& comm, std::uint64_t seed) {
      train_with_bypasses<__half, wm::lfu>(comm, wm::adam{}, seed);
    });
  }
}

TEST_CASE("device cache: every replay of a captured gather is a batch of its own (bypass counts)",
          "[gpu]") {
  on_one_rank([&](wm::communicator& comm, std::uint64_t seed) {
    cudaStream_t s{};
    WM_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    std::size_t const n = 120;
    lru_adam_tables t{comm, 300, 32, seed};  // one set: D > 32 distinct keys bypass D - 32
    auto& cached = t.cached;
    RANK_REQUIRE(cached.cache_lines() == 32);
    std::mt19937_64 rng{seed};
    std::uint64_t bypasses = 0;
    replay_captured_gather(cached, t.plain, rng, n, 4, s, [&](int k, batch<float> const& b) {
      // With one epoch for every replay the batch masks would stay full: all misses would bypass.
      bypasses += b.distinct > 32 ? b.distinct - 32 : 0;
      auto const st = cached.cache_stats();
      RANK_REQUIRE_MSG(st.bypasses == bypasses,
                       "batch " << k << " (0: the eager gather): " << st.bypasses << " bypasses, "
                                << bypasses << " expected");
    });
    RANK_REQUIRE(bypasses > 0);
    WM_CUDA_TRY(cudaStreamDestroy(s));
  });
}

namespace {

/**
 * Many dirty victims per gather: a cache of 10,016 lines (313 sets) and 12 batches of 9,000 keys
 * (about 6,700 distinct) drawn from 200,000 rows (almost all misses: about 6,000 victims per
 * gather once the cache is full; about 21 distinct keys per set, a few sets past 32), each gathered
 * and then updated, so every line a gather admits is dirty before the next gather evicts it. Each
 * gather equals the uncached one; the statistics are exact: requests and distinct keys as made;
 * bypasses per batch as a host count over the sets (a set asked for D > 32 distinct keys bypasses D
 * - 32); no flush until the end, so every victim is dirty (write-backs == evictions) and every
 * admitted line is written back exactly once, by an eviction or by the final flush (write-backs
 * after it == lines loaded); the flushed table equals the uncached one bit for bit.
 */
template <class T, class R, class Opt>
void many_victims(wm::communicator& comm, Opt opt, std::uint64_t seed) {
  std::string const what =
      std::string{"many victims T="} + std::to_string(sizeof(T)) + "B " + R::name + " " + Opt::name;
  std::size_t const rows = 200000, dim = 32, n = 9000;
  int const steps = 12;
  cudaStream_t s{};
  WM_CUDA_TRY(cudaStreamCreate(&s));
  std::mt19937_64 rng{seed};
  cached_and_plain<T, R, Opt> tables{comm, rows, dim, opt, 0.05, rng};
  auto& cached    = tables.cached;
  auto& plain     = tables.plain;
  auto const co   = tables.co;
  auto const sets = static_cast<std::uint32_t>(cached.cache_lines() / 32);
  RANK_REQUIRE_MSG(cached.cache_lines() == 10016, what << ": " << cached.cache_lines() << " lines");
  std::size_t const payload = line_payload<T>(opt, dim);
  std::uint64_t requests = 0, distinct = 0, bypasses = 0;
  for (int k = 0; k < steps; ++k) {
    auto const b = draw<T>(rng, rows, dim, n, k);
    std::vector<std::uint32_t> per_set(sets, 0);
    for (auto const key : std::set<std::int64_t>(b.keys.begin(), b.keys.end())) {
      ++per_set[wm::detail::cache::set_of(static_cast<std::uint32_t>(key), sets, co.hash_seed)];
    }
    for (auto const d : per_set) { bypasses += d > 32 ? d - 32 : 0; }
    RANK_REQUIRE_MSG(gather(cached, b, s) == gather(plain, b, s),
                     what << ": gather of step " << k << " differs");
    requests += b.keys.size();
    distinct += b.distinct;
    apply(cached, b, s);
    apply(plain, b, s);
    auto const st = cached.cache_stats();
    INFO(what << " step " << k << ": hits " << st.hits << ", misses " << st.misses << ", evictions "
              << st.evictions << ", write-backs " << st.write_backs << ", bypasses " << st.bypasses
              << " (" << bypasses << " counted)");
    RANK_REQUIRE_MSG(st.requests == requests && st.distinct_keys == distinct, what);
    RANK_REQUIRE_MSG(st.hits + st.misses == st.requests, what);
    RANK_REQUIRE_MSG(st.bypasses == bypasses, what << " step " << k);
    RANK_REQUIRE_MSG(st.hit_first_gathers == 0, what << " step " << k << ": a hit-first gather");
    RANK_REQUIRE_MSG(st.bypass_rows == st.bypasses, what << " step " << k);
    RANK_REQUIRE_MSG(st.write_backs == st.evictions,
                     what << " step " << k << ": every victim is dirty");
    std::uint64_t const lines_in = st.bytes_from_host - st.bypass_rows * dim * sizeof(T);
    RANK_REQUIRE_MSG(lines_in % payload == 0, what << " step " << k);
    RANK_REQUIRE_MSG(lines_in / payload + st.bypasses <= distinct, what << " step " << k);
    RANK_REQUIRE_MSG(lines_in / payload - st.evictions <= cached.cache_lines(),
                     what << " step " << k << ": more lines valid than the cache has");
  }
  auto const before = cached.cache_stats();
  RANK_REQUIRE_MSG(before.hit_first_gathers == 0, what << ": a gather took the hit-first path");
  RANK_REQUIRE_MSG(before.write_backs >= 4 * cached.cache_lines(),
                   what << ": only " << before.write_backs << " victims written back");
  cached.flush(cuda::stream_ref{s});
  auto const after = cached.cache_stats();
  std::uint64_t const lines_in =
      (after.bytes_from_host - after.bypass_rows * dim * sizeof(T)) / payload;
  RANK_REQUIRE_MSG(after.write_backs == lines_in,
                   what << ": " << after.write_backs << " write-backs for " << lines_in
                        << " lines loaded (each must be written back once)");
  RANK_REQUIRE_MSG(snapshot(cached, s) == snapshot(plain, s), what << ": the flushed table");
  WM_CUDA_TRY(cudaStreamDestroy(s));
}

}  // namespace

TEST_CASE(
    "device cache: many dirty victims per gather; exact write-backs, the flushed table equals "
    "no cache bit for bit",
    "[gpu]") {
  SECTION("float, LFU, Adam") {
    on_one_rank([&](wm::communicator& comm, std::uint64_t seed) {
      many_victims<float, wm::lfu>(comm, wm::adam{}, seed);
    });
  }
  SECTION("half, LRU, SGD(wd)") {
    on_one_rank([&](wm::communicator& comm, std::uint64_t seed) {
      many_victims<__half, wm::lru>(comm, wm::sgd{0.01f}, seed);
    });
  }
  SECTION("float, LRU, SGD") {
    on_one_rank([&](wm::communicator& comm, std::uint64_t seed) {
      many_victims<float, wm::lru>(comm, wm::sgd{}, seed);
    });
  }
}

TEST_CASE("device cache: the one-rank gather is captured in a CUDA graph and replayed on new keys",
          "[gpu]") {
  on_one_rank([&](wm::communicator& comm, std::uint64_t seed) {
    cudaStream_t s{};
    WM_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    std::size_t const n = 3000;
    lru_adam_tables t{comm, 5000, 32, seed};
    std::mt19937_64 rng{seed};
    replay_captured_gather(t.cached, t.plain, rng, n, 3, s, [](int, batch<float> const&) {});
    auto const st = t.cached.cache_stats();
    RANK_REQUIRE(st.requests == 4 * n && st.hits + st.misses == st.requests);
    WM_CUDA_TRY(cudaStreamDestroy(s));
  });
}

TEST_CASE("device cache: invalid keys give zero rows and are reported; bad ratios are refused",
          "[gpu]") {
  wm::launch(1, [&](wm::communicator& comm) {
    cudaStream_t s{};
    WM_CUDA_TRY(cudaStreamCreate(&s));
    wm::embedding<float, wm::device_cache<>, wm::adam, wm::host> e{comm, 100, 8};
    batch<float> b;
    b.keys         = {3, 100, 3, -1, 7};
    auto const got = gather(e, b, s);
    std::vector<float> out(got.size() / sizeof(float));
    std::memcpy(out.data(), got.data(), got.size());
    for (std::size_t j = 0; j < 8; ++j) {
      RANK_REQUIRE(out[1 * 8 + j] == 0.0f && out[3 * 8 + j] == 0.0f);
      RANK_REQUIRE(out[0 * 8 + j] == out[2 * 8 + j] && out[0 * 8 + j] != 0.0f);
    }
    bool threw = false;
    try {
      (void)e.cache_stats();
    } catch (wm::logic_error const&) { threw = true; }
    RANK_REQUIRE_MSG(threw, "cache_stats() did not report the invalid keys");
    auto const st = e.cache_stats();  // reported once
    RANK_REQUIRE(st.requests == 5 && st.distinct_keys == 4 && st.hits + st.misses == 5);
    for (double ratio : {0.0, -0.5, 1.5}) {
      wm::cache_options co;
      co.ratio = ratio;
      bool bad = false;
      try {
        wm::embedding<float, wm::device_cache<>, wm::sgd, wm::host> f{comm, 100, 8, {}, {}, co};
      } catch (wm::logic_error const&) { bad = true; }
      RANK_REQUIRE_MSG(bad, "ratio " << ratio << " was accepted");
    }
    WM_CUDA_TRY(cudaStreamDestroy(s));
  });
}
