// SPDX-License-Identifier: Apache-2.0
// GPU tests of the caches in wm::embedding (one rank): training through a read-write device
// cache (LFU and LRU, float and half, SGD and Adam) equals the uncached table bit for bit over
// several steps of fresh random keys with repeats, also across flush(), invalidate(), prefetch()
// and a store() + load() into an uncached table of another layout; read-only caches (group
// cache of one rank, device_cache<read_only>) gather what the table holds; the statistics add up
// and match a host count; edge geometries (one set, ratio 1, fewer rows than one set's 32 ways);
// invalid keys give zero rows and are reported. A gather loop with many dirty victims per gather
// checks the flushed table and exact write-back counts.
#include <wm/wm.cuh>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <unistd.h>
#include <vector>

#include "catch.hpp"
#include "device_array.cuh"
#include "rank_check.hpp"

namespace {

template <class T>
T from_float(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(x);
  } else {
    return __float2bfloat16_rn(x);
  }
}

using wm_test::device_array;

/// A value of V whose every byte is @p byte (a poison that is the same for every T).
template <class V>
V filled_with(unsigned char byte) {
  V v{};
  std::memset(static_cast<void*>(&v), byte, sizeof(V));
  return v;
}

/// The bytes of @p v (bitwise comparisons, whatever T is).
template <class T>
std::vector<unsigned char> bytes_of(std::vector<T> const& v) {
  std::vector<unsigned char> b(v.size() * sizeof(T));
  if (!v.empty()) { std::memcpy(b.data(), v.data(), b.size()); }
  return b;
}

/// Every row of a tensor (gathered through the tensor itself, not the cache), as bytes.
template <class V, class Tensor>
std::vector<unsigned char> all_rows(Tensor& t, std::size_t rows, std::size_t cols, cudaStream_t s) {
  return bytes_of(wm_test::gather_every_row<V>(t, rows, cols, filled_with<V>(0x5a), s));
}

/// Weights, states, per-row steps and global step of a table, as bytes.
struct table_state {
  std::vector<unsigned char> w, st, steps;
  std::int64_t global{};
  bool operator==(table_state const&) const = default;
};
template <class E>
table_state snapshot(E& e, cudaStream_t s) {
  using T = typename E::value_type;
  table_state t;
  t.w = all_rows<T>(e.weights(), e.rows(), e.dim(), s);
  if (e.states() != nullptr) {
    t.st = all_rows<float>(*e.states(), e.rows(), e.dim() * E::optimizer_type::states, s);
  }
  if (e.steps() != nullptr) { t.steps = all_rows<std::int64_t>(*e.steps(), e.rows(), 1, s); }
  t.global = e.global_step();
  return t;
}

/// A batch: keys with repeats (a quarter from five hot rows, the first three and the last two of
/// the table, so long runs sit at both ends of the sorted batch) and gradients.
template <class T>
struct batch {
  std::vector<std::int64_t> keys;
  std::vector<T> grads;
  float lr{};
  std::size_t distinct{};
};
template <class T>
batch<T> draw(std::mt19937_64& rng, std::size_t rows, std::size_t dim, std::size_t n, int step) {
  batch<T> b;
  b.lr = 0.01f * static_cast<float>(step + 1);
  b.keys.resize(n);
  std::size_t const hot = std::min<std::size_t>(rows, 5);
  for (auto& k : b.keys) {
    std::size_t const h = rng() % hot;
    k = static_cast<std::int64_t>(rng() % 4 == 0 ? (h < 3 ? h : rows - 1 - (h - 3)) : rng() % rows);
  }
  b.distinct = std::set<std::int64_t>(b.keys.begin(), b.keys.end()).size();
  std::uniform_real_distribution<float> g{-1.0f, 1.0f};
  b.grads.resize(n * dim);
  for (auto& x : b.grads) { x = from_float<T>(g(rng)); }
  return b;
}

/// e.gather(b.keys) into a poisoned buffer, as bytes.
template <class E, class T>
std::vector<unsigned char> gather(E& e, batch<T> const& b, cudaStream_t s) {
  device_array<std::int64_t> dk{b.keys};
  device_array<T> out{std::vector<T>(b.keys.size() * e.dim(), filled_with<T>(0xa5))};
  e.gather(std::span<std::int64_t const>{dk.ptr, b.keys.size()}, out.ptr, cuda::stream_ref{s});
  WM_CUDA_TRY(cudaStreamSynchronize(s));
  return bytes_of(out.to_host());
}

template <class E, class T>
void apply(E& e, batch<T> const& b, cudaStream_t s) {
  device_array<std::int64_t> dk{b.keys};
  device_array<T> dg{b.grads};
  e.apply_gradients(std::span<std::int64_t const>{dk.ptr, b.keys.size()}, dg.ptr, b.lr,
                    cuda::stream_ref{s});
}

/// Table geometry and cache ratio of one scenario.
struct geometry {
  std::size_t rows, dim, batch;
  double ratio;
  char const* what;
};

std::filesystem::path fresh_dir(char const* what) {
  auto const dir = std::filesystem::temp_directory_path() /
                   ("wm-cache-" + std::string{what} + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

/// Runs f(comm, seed) on one rank; the seed is fresh from std::random_device and logged.
template <class F>
void on_one_rank(F&& f) {
  std::uint64_t const seed = std::random_device{}();
  INFO("seed " << seed);
  wm::launch(1, [&](wm::communicator& comm) { f(comm, seed); });
}

/// Bytes one cache line moves to or from the host: the weight row, its states, its step.
template <class T, class Opt>
std::size_t line_payload(Opt const& opt, std::size_t dim) {
  return dim * sizeof(T) + dim * Opt::states * sizeof(float) +
         (opt.needs_steps() ? sizeof(std::int64_t) : 0);
}

/**
 * A table in host memory behind a read-write device cache and the uncached device table it must
 * equal, both initialized alike; draws the init seed from @p rng, then the cache's hash seed.
 */
template <class T, class R, class Opt>
struct cached_and_plain {
  wm::embedding_init init;
  wm::cache_options co;
  wm::embedding<T, wm::device_cache<wm::read_write, R>, Opt, wm::host, wm::chunked> cached;
  wm::embedding<T, wm::no_cache, Opt, wm::device, wm::chunked> plain;

  cached_and_plain(wm::communicator& comm, std::size_t rows, std::size_t dim, Opt opt, double ratio,
                   std::mt19937_64& rng)
      : init{wm::embedding_init::uniform(-0.5f, 0.5f, rng())},
        co{options(ratio, rng)},
        cached{comm, rows, dim, opt, init, co},
        plain{comm, rows, dim, opt, init} {}

  static wm::cache_options options(double ratio, std::mt19937_64& rng) {
    wm::cache_options o;
    o.ratio     = ratio;
    o.hash_seed = static_cast<std::uint32_t>(rng());
    return o;
  }
};

/// cached.flush(), then whether the cached table holds what the plain one does, bit for bit.
template <class C, class P>
bool flushed_equal(C& cached, P& plain, cudaStream_t s) {
  cached.flush(cuda::stream_ref{s});
  return snapshot(cached, s) == snapshot(plain, s);
}

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
 * Trains a host table behind a read-write device cache and an uncached device table side by
 * side on the same batches; gathers, tables (after flush), statistics and a checkpoint reloaded
 * into an uncached table of another layout must agree bit for bit.
 */
template <class T, class R, class Opt>
void train_bitwise(wm::communicator& comm, Opt opt, geometry g, std::uint64_t seed) {
  std::string const what = std::string{g.what} + " T=" + std::to_string(sizeof(T)) + "B " +
                           R::name + " " + Opt::name + " rows=" + std::to_string(g.rows) +
                           " dim=" + std::to_string(g.dim) + " ratio=" + std::to_string(g.ratio);
  cudaStream_t s{};
  WM_CUDA_TRY(cudaStreamCreate(&s));
  std::mt19937_64 rng{seed};
  cached_and_plain<T, R, Opt> tables{comm, g.rows, g.dim, opt, g.ratio, rng};
  auto& cached = tables.cached;
  auto& plain  = tables.plain;
  RANK_REQUIRE_MSG(cached.cache_lines() >= 32 && cached.cache_lines() % 32 == 0, what);
  double const wanted = g.ratio * static_cast<double>(g.rows);
  RANK_REQUIRE_MSG(static_cast<double>(cached.cache_lines()) >= wanted &&
                       static_cast<double>(cached.cache_lines()) < wanted + 32,
                   what << ": " << cached.cache_lines() << " lines");
  // A cached host table keeps each row's weight, state and step in one record of whole 128-byte
  // pieces (the states and steps are views of the weight tensor's rows); without state or steps
  // its weight rows are dense.
  std::size_t const record = cached.weights().stride() * sizeof(T);
  if (cached.states() == nullptr && cached.steps() == nullptr) {
    RANK_REQUIRE_MSG(cached.weights().stride() == g.dim, what << ": record of " << record << " B");
  } else {
    RANK_REQUIRE_MSG(record % 128 == 0 && record >= line_payload<T>(opt, g.dim) &&
                         record < line_payload<T>(opt, g.dim) + 128 + 16,
                     what << ": record of " << record << " B");
  }
  if (cached.states() != nullptr) {
    auto const& st = *cached.states();
    RANK_REQUIRE_MSG(st.column_offset() >= g.dim * sizeof(T) && st.column_offset() % 16 == 0 &&
                         st.stride() * sizeof(float) == record,
                     what << ": states at " << st.column_offset());
  }
  if (cached.steps() != nullptr) {
    auto const& sp = *cached.steps();
    RANK_REQUIRE_MSG(sp.column_offset() + sizeof(std::int64_t) <= record &&
                         sp.stride() * sizeof(std::int64_t) == record,
                     what << ": steps at " << sp.column_offset());
  }

  std::uint64_t requests = 0, distinct = 0, prefetched = 0;
  auto check_stats = [&](char const* when) {
    auto const st = cached.cache_stats();
    RANK_REQUIRE_MSG(st.requests == requests, what << " " << when << ": " << st.requests
                                                   << " requests, " << requests << " made");
    RANK_REQUIRE_MSG(st.distinct_keys == distinct, what << " " << when << ": " << st.distinct_keys
                                                        << " distinct, " << distinct << " made");
    RANK_REQUIRE_MSG(st.hits + st.misses == st.requests, what << " " << when);
    RANK_REQUIRE_MSG(st.bytes_from_peers == 0, what);
    // A gather loads each distinct missing row once (distinct misses <= misses); a prefetch
    // loads at most its distinct keys.
    std::size_t const payload = line_payload<T>(opt, g.dim);
    // Bypassed keys (more than 32 of one set in a batch) read their weight rows only.
    RANK_REQUIRE_MSG(st.bypasses <= st.misses, what << " " << when);
    // A hit-first gather reads a bypassed key's row once per occurrence, other gathers once.
    RANK_REQUIRE_MSG(st.bypasses <= st.bypass_rows, what << " " << when);
    RANK_REQUIRE_MSG(st.bypass_rows <= st.misses, what << " " << when);
    RANK_REQUIRE_MSG(st.hit_first_gathers != 0 || st.bypass_rows == st.bypasses,
                     what << " " << when);
    RANK_REQUIRE_MSG(st.bypass_rows * g.dim * sizeof(T) <= st.bytes_from_host, what << " " << when);
    std::uint64_t const lines_in = st.bytes_from_host - st.bypass_rows * g.dim * sizeof(T);
    RANK_REQUIRE_MSG(lines_in % payload == 0, what << " " << when << ": " << st.bytes_from_host
                                                   << " bytes from host, " << st.bypass_rows
                                                   << " bypass rows of " << g.dim * sizeof(T)
                                                   << " B, payload " << payload);
    RANK_REQUIRE_MSG(lines_in / payload <= st.misses + prefetched, what << " " << when);
    RANK_REQUIRE_MSG(st.evictions <= lines_in / payload, what << " " << when);
    return st;
  };

  int const steps = 8;
  for (int k = 0; k < steps; ++k) {
    auto const b = draw<T>(rng, g.rows, g.dim, g.batch + static_cast<std::size_t>(k) * 7, k);
    if (k == 5) {  // prefetch: the gather after it sees every key that fits
      device_array<std::int64_t> dk{b.keys};
      cached.prefetch(std::span<std::int64_t const>{dk.ptr, b.keys.size()}, cuda::stream_ref{s});
      WM_CUDA_TRY(cudaStreamSynchronize(s));
      prefetched += b.distinct;
    }
    auto const before = cached.cache_stats();
    auto const got    = gather(cached, b, s);
    RANK_REQUIRE_MSG(got == gather(plain, b, s), what << ": gather of step " << k << " differs");
    requests += b.keys.size();
    distinct += b.distinct;
    auto const after = check_stats("after a gather");
    if (k == 3) {  // just invalidated: every request misses
      RANK_REQUIRE_MSG(after.hits == before.hits, what << ": hits right after invalidate()");
    }
    if (k == 5 && g.rows <= 32) {  // one set holds every row: the prefetched batch all hits
      RANK_REQUIRE_MSG(after.hits - before.hits == b.keys.size(),
                       what << ": a prefetched batch missed though every row fits");
    }
    apply(cached, b, s);
    apply(plain, b, s);
    if (k == 1 || k == 4) {
      RANK_REQUIRE_MSG(flushed_equal(cached, plain, s),
                       what << ": the flushed table differs after step " << k);
      // Flushed lines are clean: a second flush writes nothing back.
      auto const w0 = cached.cache_stats().write_backs;
      cached.flush(cuda::stream_ref{s});
      RANK_REQUIRE_MSG(cached.cache_stats().write_backs == w0, what << ": flush twice");
    }
    if (k == 2) {
      cached.invalidate(cuda::stream_ref{s});
      RANK_REQUIRE_MSG(snapshot(cached, s) == snapshot(plain, s),
                       what << ": the table differs after invalidate()");
    }
  }
  // A checkpoint: store() flushes first; the table loads into another layout, uncached.
  auto const dir = fresh_dir("ckpt");
  cached.store(dir / "ck");
  RANK_REQUIRE_MSG(snapshot(cached, s) == snapshot(plain, s), what << ": after store()");
  wm::embedding<T, wm::no_cache, Opt, wm::device, wm::distributed, wm::cyclic> loaded{
      comm, g.rows, g.dim, opt, wm::embedding_init::zeros()};
  loaded.load(dir / "ck");
  RANK_REQUIRE_MSG(snapshot(loaded, s) == snapshot(plain, s), what << ": the reloaded table");
  // And back into a cached table over stale lines: load() invalidates them.
  auto const b = draw<T>(rng, g.rows, g.dim, g.batch, steps);
  (void)gather(cached, b, s);
  apply(cached, b, s);
  cached.load(dir / "ck");
  RANK_REQUIRE_MSG(snapshot(cached, s) == snapshot(plain, s), what << ": load() into the cache");
  auto const again = draw<T>(rng, g.rows, g.dim, g.batch, steps + 1);
  RANK_REQUIRE_MSG(gather(cached, again, s) == gather(plain, again, s),
                   what << ": gather after load()");
  apply(cached, again, s);
  apply(plain, again, s);
  RANK_REQUIRE_MSG(flushed_equal(cached, plain, s), what << ": training after load()");
  std::filesystem::remove_all(dir);
  WM_CUDA_TRY(cudaStreamDestroy(s));
}

constexpr geometry geometries[] = {
    {1000, 16, 400, 0.1, "many sets"},
    {1000, 13, 300, 0.25, "odd dim"},
    {20, 8, 40, 1.0, "fewer rows than 32 ways (one set)"},
    {100, 8, 120, 1.0, "ratio 1"},
    {3000, 32, 500, 0.01, "one set, many misses"},
    // 75,000 lines and 70,000 keys: many victims staged per gather, sets past 32 keys.
    {300000, 4, 70000, 0.25, "many lines"},
    // Wide payloads: Adam rows of 192 floats (2,304 B with m and v), SGD's of 768 B.
    {4000, 192, 600, 0.05, "wide rows"},
};

template <class T, class R, class Opt>
void every_geometry(Opt opt) {
  on_one_rank([&](wm::communicator& comm, std::uint64_t seed) {
    std::uint64_t sd = seed;
    for (auto const& g : geometries) { train_bitwise<T, R, Opt>(comm, opt, g, sd++); }
  });
}

}  // namespace

TEST_CASE("device cache: float, LFU, SGD trains bit for bit like no cache", "[gpu]") {
  every_geometry<float, wm::lfu>(wm::sgd{});
}
TEST_CASE("device cache: float, LRU, Adam trains bit for bit like no cache", "[gpu]") {
  every_geometry<float, wm::lru>(wm::adam{});
}
TEST_CASE("device cache: half, LFU, Adam trains bit for bit like no cache", "[gpu]") {
  every_geometry<__half, wm::lfu>(wm::adam{});
}
TEST_CASE("device cache: half, LRU, SGD trains bit for bit like no cache", "[gpu]") {
  every_geometry<__half, wm::lru>(wm::sgd{0.01f});
}
TEST_CASE("device cache: float, LRU, global-step Adam trains bit for bit like no cache", "[gpu]") {
  wm::adam global;
  global.bias_correction = wm::adam_bias_correction::global_step;
  every_geometry<float, wm::lru>(global);
}

namespace {

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

TEST_CASE("read-only caches (group cache of one rank, read-only device cache) gather the table",
          "[gpu]") {
  on_one_rank([&](wm::communicator& comm, std::uint64_t seed) {
    cudaStream_t s{};
    WM_CUDA_TRY(cudaStreamCreate(&s));
    auto check = [&](auto& cached, auto& plain, char const* what, std::uint64_t sd) {
      std::mt19937_64 rng{sd};
      std::uint64_t requests = 0, distinct = 0;
      for (int k = 0; k < 6; ++k) {
        auto const b = draw<float>(rng, cached.rows(), cached.dim(), 500, k);
        RANK_REQUIRE_MSG(gather(cached, b, s) == gather(plain, b, s), what << " step " << k);
        requests += b.keys.size();
        distinct += b.distinct;
        auto const st = cached.cache_stats();
        RANK_REQUIRE_MSG(st.requests == requests && st.distinct_keys == distinct, what);
        RANK_REQUIRE_MSG(st.hits + st.misses == st.requests, what);
        RANK_REQUIRE_MSG(st.write_backs == 0, what << ": a read-only cache wrote back");
        RANK_REQUIRE_MSG(st.bytes_from_host <= st.misses * cached.dim() * sizeof(float), what);
      }
      cached.reset_cache_stats();
      auto const z = cached.cache_stats();
      RANK_REQUIRE_MSG(z.requests == 0 && z.hits == 0 && z.misses == 0 && z.evictions == 0, what);
    };
    auto const init = wm::embedding_init::normal(0.0f, 1.0f, seed);
    wm::embedding<float, wm::no_cache, wm::no_optimizer, wm::device> plain{
        comm, 2000, 24, {}, init};
    wm::cache_options co;
    co.ratio = 0.2;
    co.group = &comm;  // a group of one rank: a read-only device cache of the whole table
    wm::embedding<float, wm::group_cache<wm::lru>, wm::no_optimizer, wm::host> group{
        comm, 2000, 24, {}, init, co};
    check(group, plain, "group_cache<lru>", seed + 1);
    wm::cache_options ro;
    ro.ratio = 0.05;
    wm::embedding<float, wm::device_cache<wm::read_only, wm::lfu>, wm::no_optimizer, wm::host,
                  wm::distributed>
        read_only{comm, 2000, 24, {}, init, ro};
    check(read_only, plain, "device_cache<read_only, lfu>", seed + 2);
    WM_CUDA_TRY(cudaStreamDestroy(s));
  });
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

namespace {

/**
 * Several ranks: a read-write device cache on each rank's own rows against the uncached table of
 * the same layout; every rank passes its own batches; gathers go through the owners' caches.
 */
template <class T, class R, class Opt, class Y, class M>
void train_ranks(wm::communicator& comm, Opt opt, std::uint64_t seed) {
  std::string const what = std::string{"ranks="} + std::to_string(comm.size()) + " " + Y::name +
                           "." + M::name + " T=" + std::to_string(sizeof(T)) + "B " + R::name +
                           " " + Opt::name;
  cudaStream_t s{};
  WM_CUDA_TRY(cudaStreamCreate(&s));
  std::size_t const rows = 1001, dim = 16;
  auto const init = wm::embedding_init::uniform(-0.5f, 0.5f, seed);
  wm::cache_options co;
  co.ratio = 0.1;
  wm::embedding<T, wm::device_cache<wm::read_write, R>, Opt, wm::host, Y, M> cached{comm, rows, dim,
                                                                                    opt,  init, co};
  wm::embedding<T, wm::no_cache, Opt, wm::device, Y, M> plain{comm, rows, dim, opt, init};
  std::mt19937_64 rng{seed * 31 + static_cast<std::uint64_t>(comm.rank())};  // this rank's keys
  std::uint64_t requests = 0;
  for (int k = 0; k < 6; ++k) {
    auto const b = draw<T>(rng, rows, dim, 300 + 17 * static_cast<std::size_t>(comm.rank()), k);
    RANK_REQUIRE_MSG(gather(cached, b, s) == gather(plain, b, s),
                     what << ": gather of step " << k << " differs");
    requests += b.keys.size();
    apply(cached, b, s);
    apply(plain, b, s);
    if (k == 2) {
      cached.flush(cuda::stream_ref{s});
      // Mapped layouts read peers' rows directly: every rank's flush first.
      WM_CUDA_TRY(cudaStreamSynchronize(s));
      comm.barrier();
      RANK_REQUIRE_MSG(snapshot(cached, s) == snapshot(plain, s), what << ": after flush()");
    }
    if (k == 3) { cached.invalidate(cuda::stream_ref{s}); }
  }
  // Each owner counted the requests it served: together, every key of every rank.
  auto const st = cached.cache_stats();
  RANK_REQUIRE_MSG(st.hits + st.misses == st.requests, what);
  std::uint64_t served = 0, made = 0;
  for (auto x : comm.all_gather(static_cast<std::uint64_t>(st.requests))) { served += x; }
  for (auto x : comm.all_gather(requests)) { made += x; }
  RANK_REQUIRE_MSG(served == made, what << ": " << served << " requests served, " << made);
  // One directory for all ranks (named by the shared seed), made by rank 0 before anyone writes.
  auto const dir =
      std::filesystem::temp_directory_path() / ("wm-cache-ranks-" + std::to_string(seed));
  if (comm.rank() == 0) {
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
  }
  comm.barrier();
  cached.store(dir / "ck");
  RANK_REQUIRE_MSG(snapshot(cached, s) == snapshot(plain, s), what << ": after store()");
  wm::embedding<T, wm::no_cache, Opt, wm::device, wm::chunked, wm::block> loaded{
      comm, rows, dim, opt, wm::embedding_init::zeros()};
  loaded.load(dir / "ck");
  RANK_REQUIRE_MSG(snapshot(loaded, s) == snapshot(plain, s), what << ": the reloaded table");
  comm.barrier();
  if (comm.rank() == 0) { std::filesystem::remove_all(dir); }
  WM_CUDA_TRY(cudaStreamDestroy(s));
}

}  // namespace

TEST_CASE("ranks: a device cache on each rank's rows trains bit for bit like no cache",
          "[multi_gpu]") {
  std::uint64_t const seed = std::random_device{}();
  INFO("seed " << seed);
  wm::launch(2, [&](wm::communicator& comm) {
    train_ranks<float, wm::lfu, wm::adam, wm::distributed, wm::block>(comm, wm::adam{}, seed);
    train_ranks<float, wm::lru, wm::sgd, wm::chunked, wm::cyclic>(comm, wm::sgd{}, seed + 1);
    train_ranks<__half, wm::lru, wm::adam, wm::continuous, wm::block>(comm, wm::adam{}, seed + 2);
  });
}

namespace {

/**
 * The several-rank group cache's lines (detail::cache::group_lines, what a group cache on several
 * ranks runs) on one rank, a group of one: gathers equal the table bit for bit through admissions
 * from hints, hit-counter folds and evictions (a one-set cache: every pass replaces lines), a
 * repeated batch hits entirely once admitted, counts add up, invalidate() after a table change.
 */
template <class T, class Impl>
void group_lines_one_rank(wm::communicator& comm, double ratio, std::uint64_t seed) {
  std::string const what = std::string{"group_lines "} + (sizeof(T) == 4 ? "float" : "half") +
                           (std::is_same_v<Impl, wm::detail::cache::lfu_impl> ? " lfu" : " lru") +
                           " ratio " + std::to_string(ratio);
  INFO(what);
  std::size_t const rows = 3001, dim = 40;
  cudaStream_t s{};
  WM_CUDA_TRY(cudaStreamCreate(&s));
  wm::embedding<T, wm::no_cache, wm::no_optimizer, wm::host, wm::chunked> plain{
      comm, rows, dim, {}, wm::embedding_init::normal(0.0f, 1.0f, seed)};
  wm::detail::cache::group_lines<T, Impl> lines{comm, rows, ratio,
                                                static_cast<std::uint32_t>(seed >> 5), dim};
  device_array<unsigned> err{std::vector<unsigned>{0u}};
  auto cached_gather = [&](batch<T> const& b) {
    device_array<std::int64_t> dk{b.keys};
    device_array<T> out{std::vector<T>(b.keys.size() * dim, filled_with<T>(0xa5))};
    lines.gather(std::as_const(plain.weights()).ref(), rows,
                 std::span<std::int64_t const>{dk.ptr, b.keys.size()}, out.ptr, err.ptr, s);
    WM_CUDA_TRY(cudaStreamSynchronize(s));
    return bytes_of(out.to_host());
  };
  std::mt19937_64 rng{seed};
  std::uint64_t requests = 0, distinct = 0;
  for (int k = 0; k < 16; ++k) {
    auto const b = draw<T>(rng, rows, dim, k % 5 == 4 ? 0 : 300 + 500 * (k % 4), k);
    RANK_REQUIRE_MSG(cached_gather(b) == gather(plain, b, s), what << ": batch " << k);
    requests += b.keys.size();
    distinct += b.distinct;
  }
  auto st = lines.statistics();
  RANK_REQUIRE_MSG(st.requests == requests && st.distinct_keys == distinct, what);
  RANK_REQUIRE_MSG(st.hits + st.misses == st.requests && st.hits > 0, what << ": " << st.hits);
  RANK_REQUIRE_MSG(st.bytes_from_peers == 0 && st.write_backs == 0, what);
  if (lines.lines() == 32) {
    RANK_REQUIRE_MSG(st.evictions > 0, what << ": a one-set cache evicted nothing");
  }
  // A repeated batch: misses are admitted at the end of the gather that hinted them.
  auto const b = draw<T>(rng, rows, dim, 200, 0);
  RANK_REQUIRE_MSG(cached_gather(b) == gather(plain, b, s), what);
  lines.reset_statistics();
  RANK_REQUIRE_MSG(cached_gather(b) == gather(plain, b, s), what);
  st = lines.statistics();
  if (ratio == 1.0) {
    RANK_REQUIRE_MSG(st.hits == st.requests && st.requests == b.keys.size(),
                     what << ": " << st.hits << " of " << st.requests << " hit");
  }
  // A prefetched batch: no requests counted; at ratio 1 its gather then hits entirely.
  auto const next = draw<T>(rng, rows, dim, 250, 1);
  {
    device_array<std::int64_t> dk{next.keys};
    lines.reset_statistics();
    lines.prefetch(std::as_const(plain.weights()).ref(), rows,
                   std::span<std::int64_t const>{dk.ptr, next.keys.size()}, err.ptr, s);
    st = lines.statistics();
    RANK_REQUIRE_MSG(st.requests == 0 && st.hits == 0 && st.misses == 0, what << ": prefetch");
    RANK_REQUIRE_MSG(cached_gather(next) == gather(plain, next, s), what << ": prefetched");
    st = lines.statistics();
    if (ratio == 1.0) {
      RANK_REQUIRE_MSG(st.hits == st.requests && st.requests == next.keys.size(),
                       what << ": " << st.hits << " of " << st.requests << " prefetched hit");
    }
  }
  // The table changes; after invalidate() the gathers see the new rows.
  std::vector<std::int64_t> all(rows);
  std::iota(all.begin(), all.end(), std::int64_t{0});
  std::vector<T> values(rows * dim);
  std::uniform_real_distribution<float> u{-3.0f, 3.0f};
  for (auto& x : values) { x = from_float<T>(u(rng)); }
  device_array<std::int64_t> const dk{all};
  device_array<T> const dv{values};
  plain.weights().scatter(std::span<std::int64_t const>{dk.ptr, rows}, dv.ptr, cuda::stream_ref{s});
  lines.invalidate(s);
  RANK_REQUIRE_MSG(cached_gather(b) == gather(plain, b, s), what << ": after invalidate()");
  RANK_REQUIRE_MSG(err.to_host()[0] == 0u, what << ": an error flagged");
  // Invalid keys: zero rows, the error flag set.
  batch<T> bad;
  bad.keys       = {1, static_cast<std::int64_t>(rows), -5};
  auto const got = cached_gather(bad);
  RANK_REQUIRE_MSG(std::all_of(got.begin() + static_cast<std::ptrdiff_t>(dim * sizeof(T)),
                               got.end(), [](unsigned char c) { return c == 0; }),
                   what << ": invalid keys' rows are not zero");
  batch<T> one;
  one.keys = {1};
  RANK_REQUIRE_MSG(
      std::equal(got.begin(), got.begin() + static_cast<std::ptrdiff_t>(dim * sizeof(T)),
                 gather(plain, one, s).begin()),
      what << ": the valid key beside invalid ones");
  RANK_REQUIRE_MSG(err.to_host()[0] != 0u, what << ": invalid keys not flagged");
  WM_CUDA_TRY(cudaStreamDestroy(s));
}

}  // namespace

namespace {

/// Every row of @p plain's table, as bytes per row (the reference of the stress loops).
template <class E>
std::vector<std::vector<unsigned char>> table_rows_of(E& plain, cudaStream_t s) {
  using T = typename E::value_type;
  batch<T> all;
  all.keys.resize(plain.rows());
  std::iota(all.keys.begin(), all.keys.end(), std::int64_t{0});
  auto const bytes           = gather(plain, all, s);
  std::size_t const row_size = plain.dim() * sizeof(T);
  std::vector<std::vector<unsigned char>> rows(plain.rows());
  for (std::size_t r = 0; r < rows.size(); ++r) {
    rows[r].assign(bytes.begin() + static_cast<std::ptrdiff_t>(r * row_size),
                   bytes.begin() + static_cast<std::ptrdiff_t>((r + 1) * row_size));
  }
  return rows;
}

/**
 * Lines replaced while they are read: @p iterations rounds of a gather on one stream and a
 * prefetch of other keys on a second stream, both enqueued before either is waited for, over a
 * hot key space three times the cache's lines (@p gather_on(keys, out, s) and
 * @p prefetch_on(keys, s) call the cache under test). Every gathered row must be the table's row
 * of its key, whatever the admissions beside the gather did to its lines.
 */
template <class T, class Gather, class Prefetch>
void reads_beside_admissions(std::vector<std::vector<unsigned char>> const& table,
                             std::size_t lines, int iterations, std::uint64_t seed,
                             Gather&& gather_on, Prefetch&& prefetch_on, std::string const& what) {
  std::size_t const dim = table.front().size() / sizeof(T);
  std::size_t const hot = std::min(table.size(), 3 * lines);
  std::size_t const n = 512, m = 384;
  cudaStream_t s1{}, s2{};
  WM_CUDA_TRY(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  WM_CUDA_TRY(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  std::mt19937_64 rng{seed};
  std::vector<std::int64_t> keys(n), next(m);
  device_array<std::int64_t> dk{std::vector<std::int64_t>(n)}, dn{std::vector<std::int64_t>(m)};
  device_array<T> out{std::vector<T>(n * dim)};
  std::size_t wrong = 0;
  for (int it = 0; it < iterations && wrong == 0; ++it) {
    for (auto& k : keys) { k = static_cast<std::int64_t>((rng() % hot) * (table.size() / hot)); }
    for (auto& k : next) { k = static_cast<std::int64_t>((rng() % hot) * (table.size() / hot)); }
    WM_CUDA_TRY(cudaMemcpy(dk.ptr, keys.data(), n * sizeof(std::int64_t), cudaMemcpyHostToDevice));
    WM_CUDA_TRY(cudaMemcpy(dn.ptr, next.data(), m * sizeof(std::int64_t), cudaMemcpyHostToDevice));
    WM_CUDA_TRY(cudaDeviceSynchronize());  // a pageable copy may return before its DMA ends
    prefetch_on(std::span<std::int64_t const>{dn.ptr, m}, s2);
    gather_on(std::span<std::int64_t const>{dk.ptr, n}, out.ptr, s1);
    WM_CUDA_TRY(cudaStreamSynchronize(s1));
    WM_CUDA_TRY(cudaStreamSynchronize(s2));
    auto const got = bytes_of(out.to_host());
    for (std::size_t i = 0; i < n; ++i) {
      auto const& want = table[static_cast<std::size_t>(keys[i])];
      wrong += std::equal(want.begin(), want.end(),
                          got.begin() + static_cast<std::ptrdiff_t>(i * want.size()))
                   ? 0
                   : 1;
    }
  }
  RANK_REQUIRE_MSG(wrong == 0, what << ": " << wrong << " rows gathered wrong beside admissions");
  WM_CUDA_TRY(cudaStreamDestroy(s1));
  WM_CUDA_TRY(cudaStreamDestroy(s2));
}

}  // namespace

TEST_CASE("group cache lines on one rank: rows read while a prefetch beside replaces lines",
          "[gpu]") {
  on_one_rank([&](wm::communicator& comm, std::uint64_t seed) {
    using wm::detail::cache::lfu_impl;
    using wm::detail::cache::lru_impl;
    std::size_t const rows = 3001, dim = 64;
    wm::embedding<float, wm::no_cache, wm::no_optimizer, wm::host, wm::chunked> plain{
        comm, rows, dim, {}, wm::embedding_init::normal(0.0f, 1.0f, seed)};
    cudaStream_t s{};
    WM_CUDA_TRY(cudaStreamCreate(&s));
    auto const table = table_rows_of(plain, s);
    device_array<unsigned> err{std::vector<unsigned>{0u}};
    auto const run = [&]<class Impl>(char const* what, std::uint64_t sd) {
      wm::detail::cache::group_lines<float, Impl> lines{comm, rows, 0.001,
                                                        static_cast<std::uint32_t>(sd), dim};
      auto const ref = std::as_const(plain.weights()).ref();
      reads_beside_admissions<float>(
          table, lines.lines(), 300, sd,
          [&](std::span<std::int64_t const> k, float* out, cudaStream_t st) {
            lines.gather(ref, rows, k, out, err.ptr, st);
          },
          [&](std::span<std::int64_t const> k, cudaStream_t st) {
            lines.prefetch(ref, rows, k, err.ptr, st);
          },
          what);
      auto const stats = lines.statistics();
      RANK_REQUIRE_MSG(stats.hits > 0 && stats.evictions > 0,
                       what << ": " << stats.hits << " hits, " << stats.evictions << " evictions");
    };
    run.template operator()<lfu_impl>("group_lines lfu, one set", seed);
    run.template operator()<lru_impl>("group_lines lru, one set", seed + 1);
    RANK_REQUIRE(err.to_host()[0] == 0u);
    WM_CUDA_TRY(cudaStreamDestroy(s));
  });
}

TEST_CASE("ranks: a group cache's rows read while prefetches beside replace lines", "[multi_gpu]") {
  std::uint64_t const seed = std::random_device{}();
  INFO("seed " << seed);
  wm::launch(2, [&](wm::communicator& comm) {
    std::size_t const rows = 3001, dim = 64;
    auto const init = wm::embedding_init::normal(0.0f, 1.0f, seed);
    wm::embedding<float, wm::no_cache, wm::no_optimizer, wm::device, wm::chunked> plain{
        comm, rows, dim, {}, init};
    wm::cache_options co;
    co.ratio = 0.001;  // one set per rank
    wm::embedding<float, wm::group_cache<wm::lfu>, wm::no_optimizer, wm::device, wm::chunked>
        cached{comm, rows, dim, {}, init, co};
    cudaStream_t s{};
    WM_CUDA_TRY(cudaStreamCreate(&s));
    auto const table = table_rows_of(plain, s);
    reads_beside_admissions<float>(
        table, cached.cache_lines() * static_cast<std::size_t>(comm.size()), 300,
        seed + static_cast<std::uint64_t>(comm.rank()),
        [&](std::span<std::int64_t const> k, float* out, cudaStream_t st) {
          cached.gather(k, out, cuda::stream_ref{st});
        },
        [&](std::span<std::int64_t const> k, cudaStream_t st) {
          cached.prefetch(k, cuda::stream_ref{st});
        },
        "group_cache<lfu> on 2 ranks, one set each");
    auto const st = cached.cache_stats();
    RANK_REQUIRE_MSG(st.hits > 0 && st.bytes_from_peers > 0 && st.evictions > 0,
                     st.hits << " hits, " << st.bytes_from_peers << " bytes from peers, "
                             << st.evictions << " evictions");
    WM_CUDA_TRY(cudaStreamSynchronize(s));
    comm.barrier();
    WM_CUDA_TRY(cudaStreamDestroy(s));
  });
}

TEST_CASE("group cache lines on one rank (the several-rank path, a group of one)", "[gpu]") {
  on_one_rank([&](wm::communicator& comm, std::uint64_t seed) {
    using wm::detail::cache::lfu_impl;
    using wm::detail::cache::lru_impl;
    group_lines_one_rank<float, lfu_impl>(comm, 0.001, seed);  // one set
    group_lines_one_rank<float, lru_impl>(comm, 0.1, seed + 1);
    group_lines_one_rank<__half, lfu_impl>(comm, 1.0, seed + 2);
    group_lines_one_rank<__half, lru_impl>(comm, 0.001, seed + 3);
  });
}

namespace {

/// Which ranks cache together in group_cache_ranks.
enum class grouping { table, explicit_whole, each_alone };

/**
 * A group cache on every rank of @p comm against the uncached table (same init): gathers of
 * skewed batches (hot keys at both ends of the table, fresh keys every batch, every rank its own)
 * are bit for bit the table's, the counts add up, peers' lines serve hits (a group of several),
 * lines are evicted while peers read them, a repeated small batch hits entirely once every holder
 * admitted it, and after the table changes and every rank invalidates, gathers see the new rows.
 */
template <class T, class R, class L, class Y, class M>
void group_cache_ranks(wm::communicator& comm, grouping how, double ratio, std::uint64_t seed) {
  std::string const what = std::string{"group_cache<"} + R::name + "> " + L::name + "." + Y::name +
                           "." + M::name + " ratio " + std::to_string(ratio) +
                           (how == grouping::table            ? " (the table's ranks)"
                            : how == grouping::explicit_whole ? " (group = comm)"
                                                              : " (groups of one)");
  INFO(what);
  std::size_t const rows = 5001, dim = 24;
  cudaStream_t s{};
  WM_CUDA_TRY(cudaStreamCreate(&s));
  std::optional<wm::communicator> alone;
  wm::cache_options co;
  co.ratio     = ratio;
  co.hash_seed = static_cast<std::uint32_t>(seed >> 7);
  if (how == grouping::explicit_whole) { co.group = &comm; }
  if (how == grouping::each_alone) {
    alone.emplace(comm.split(comm.rank(), 0));
    co.group = &*alone;
  }
  int const group_size = co.group != nullptr ? co.group->size() : comm.size();
  auto const init      = wm::embedding_init::normal(0.0f, 1.0f, seed);
  wm::embedding<T, wm::no_cache, wm::no_optimizer, L, Y, M> plain{comm, rows, dim, {}, init};
  wm::embedding<T, wm::group_cache<R>, wm::no_optimizer, L, Y, M> cached{comm, rows, dim,
                                                                         {},   init, co};
  std::mt19937_64 rng{seed + 1000 * static_cast<std::uint64_t>(comm.rank() + 1)};
  std::uint64_t requests = 0, distinct = 0;
  for (int k = 0; k < 24; ++k) {
    auto const b = draw<T>(rng, rows, dim, k % 5 == 4 ? 0 : 400 + 300 * (k % 4), k);
    RANK_REQUIRE_MSG(gather(cached, b, s) == gather(plain, b, s),
                     what << ": batch " << k << " (" << b.keys.size() << " keys)");
    requests += b.keys.size();
    distinct += b.distinct;
  }
  auto const st = cached.cache_stats();
  RANK_REQUIRE_MSG(st.requests == requests && st.distinct_keys == distinct,
                   what << ": " << st.requests << " requests, " << st.distinct_keys << " distinct");
  RANK_REQUIRE_MSG(st.hits + st.misses == st.requests, what);
  RANK_REQUIRE_MSG(st.hits > 0, what << ": nothing hit in 24 batches with hot keys");
  RANK_REQUIRE_MSG(st.write_backs == 0, what << ": a read-only cache wrote back");
  if (ratio < 0.1) {
    RANK_REQUIRE_MSG(st.evictions > 0, what << ": a small cache evicted nothing");
  }
  // Peers' lines served hits on some rank of a group of several (the hot keys hash to every
  // holder with probability 1 - 2^-4 or more; a group of one never reads a peer).
  auto const from_peers     = comm.all_gather(static_cast<std::uint64_t>(st.bytes_from_peers));
  std::uint64_t peers_total = 0;
  for (auto x : from_peers) { peers_total += x; }
  if (group_size == 1) {
    RANK_REQUIRE_MSG(peers_total == 0, what << ": a group of one read a peer's lines");
  } else {
    RANK_REQUIRE_MSG(peers_total > 0, what << ": no rank read a peer's line");
  }

  // A small batch, the same on every rank, gathered in step (sync + barrier) until every holder
  // has admitted the hints of every rank: then it hits entirely (ratio 1: no set overflows).
  if (ratio == 1.0) {
    // Empty lines first: a late hint admitted into a full set could evict a line of the same
    // batch that an earlier pass admitted (replacement, not an error), and the count would vary.
    cached.invalidate(cuda::stream_ref{s});
    WM_CUDA_TRY(cudaStreamSynchronize(s));
    comm.barrier();
    std::mt19937_64 same{seed + 7};
    auto const b = draw<T>(same, rows, dim, 300, 0);
    for (int k = 0; k < 3; ++k) {
      RANK_REQUIRE_MSG(gather(cached, b, s) == gather(plain, b, s), what << ": warm " << k);
      comm.barrier();
    }
    cached.reset_cache_stats();
    RANK_REQUIRE_MSG(gather(cached, b, s) == gather(plain, b, s), what << ": warm");
    auto const w = cached.cache_stats();
    RANK_REQUIRE_MSG(w.hits == w.requests && w.requests == b.keys.size(),
                     what << ": " << w.hits << " of " << w.requests << " hit after warming");
    if (group_size > 1) {
      RANK_REQUIRE_MSG(w.bytes_from_peers > 0, what << ": no hit from a peer's line");
    }
    // Prefetched on every rank, twice in step (holders admit their peers' hints in their next
    // prefetch): the gather then hits entirely, and prefetches count no requests.
    auto const next = draw<T>(same, rows, dim, 250, 1);
    device_array<std::int64_t> const dk{next.keys};
    cached.reset_cache_stats();
    for (int k = 0; k < 2; ++k) {
      cached.prefetch(std::span<std::int64_t const>{dk.ptr, next.keys.size()}, cuda::stream_ref{s});
      WM_CUDA_TRY(cudaStreamSynchronize(s));
      comm.barrier();
    }
    RANK_REQUIRE_MSG(cached.cache_stats().requests == 0, what << ": a prefetch counted requests");
    RANK_REQUIRE_MSG(gather(cached, next, s) == gather(plain, next, s), what << ": prefetched");
    auto const p = cached.cache_stats();
    RANK_REQUIRE_MSG(p.hits == p.requests && p.requests == next.keys.size(),
                     what << ": " << p.hits << " of " << p.requests << " prefetched keys hit");
    comm.barrier();
  }

  // The table changes (every rank rewrites its share of rows in both tables), every rank
  // invalidates its lines, then gathers see the new rows.
  {
    std::vector<std::int64_t> mine;
    for (std::size_t r = static_cast<std::size_t>(comm.rank()); r < rows;
         r += static_cast<std::size_t>(comm.size())) {
      mine.push_back(static_cast<std::int64_t>(r));
    }
    std::vector<T> values(mine.size() * dim);
    std::uniform_real_distribution<float> u{-3.0f, 3.0f};
    for (auto& x : values) { x = from_float<T>(u(rng)); }
    device_array<std::int64_t> const dk{mine};
    device_array<T> const dv{values};
    comm.barrier();  // nobody reads the old rows any more
    for (auto* t : {&plain.weights(), &cached.weights()}) {
      t->scatter(std::span<std::int64_t const>{dk.ptr, mine.size()}, dv.ptr, cuda::stream_ref{s});
    }
    cached.invalidate(cuda::stream_ref{s});
    WM_CUDA_TRY(cudaStreamSynchronize(s));
    comm.barrier();
    for (int k = 0; k < 4; ++k) {
      auto const b = draw<T>(rng, rows, dim, 700, k);
      RANK_REQUIRE_MSG(gather(cached, b, s) == gather(plain, b, s),
                       what << ": after the table changed, batch " << k);
    }
  }

  // An invalid key: a zero row, reported by cache_stats on this rank alone.
  {
    batch<T> b;
    b.keys         = {3, static_cast<std::int64_t>(rows), -1, 4};
    auto const got = gather(cached, b, s);
    RANK_REQUIRE_MSG(std::all_of(got.begin() + static_cast<std::ptrdiff_t>(dim * sizeof(T)),
                                 got.begin() + static_cast<std::ptrdiff_t>(3 * dim * sizeof(T)),
                                 [](unsigned char c) { return c == 0; }),
                     what << ": invalid keys' rows are not zero");
    batch<T> valid;
    valid.keys           = {3, 4};
    auto const want      = gather(plain, valid, s);
    auto const row_bytes = static_cast<std::ptrdiff_t>(dim * sizeof(T));
    RANK_REQUIRE_MSG(std::equal(got.begin(), got.begin() + row_bytes, want.begin()) &&
                         std::equal(got.end() - row_bytes, got.end(), want.end() - row_bytes),
                     what << ": the valid keys beside invalid ones");
    bool reported = false;
    try {
      (void)cached.cache_stats();
    } catch (wm::logic_error const&) { reported = true; }
    RANK_REQUIRE_MSG(reported, what << ": invalid keys were not reported");
  }
  WM_CUDA_TRY(cudaStreamSynchronize(s));
  comm.barrier();  // nobody frees a table or lines a peer still reads
  WM_CUDA_TRY(cudaStreamDestroy(s));
}

}  // namespace

TEST_CASE("ranks: a group cache on several ranks gathers the table (float, LFU, host chunked)",
          "[multi_gpu]") {
  std::uint64_t const seed = std::random_device{}();
  INFO("seed " << seed);
  wm::launch(2, [&](wm::communicator& comm) {
    group_cache_ranks<float, wm::lfu, wm::host, wm::chunked, wm::block>(comm, grouping::table, 0.05,
                                                                        seed);
    group_cache_ranks<float, wm::lfu, wm::host, wm::chunked, wm::block>(comm, grouping::table, 1.0,
                                                                        seed + 1);
  });
}

TEST_CASE("ranks: a group cache on several ranks gathers the table (half, LRU, device continuous)",
          "[multi_gpu]") {
  std::uint64_t const seed = std::random_device{}();
  INFO("seed " << seed);
  wm::launch(2, [&](wm::communicator& comm) {
    group_cache_ranks<__half, wm::lru, wm::device, wm::continuous, wm::cyclic>(
        comm, grouping::explicit_whole, 0.05, seed);
    group_cache_ranks<__half, wm::lru, wm::device, wm::continuous, wm::cyclic>(
        comm, grouping::explicit_whole, 1.0, seed + 1);
  });
}

TEST_CASE("ranks: group caches of one rank each on a table of several", "[multi_gpu]") {
  std::uint64_t const seed = std::random_device{}();
  INFO("seed " << seed);
  wm::launch(2, [&](wm::communicator& comm) {
    group_cache_ranks<float, wm::lru, wm::host, wm::continuous, wm::cyclic>(
        comm, grouping::each_alone, 0.05, seed);
    group_cache_ranks<float, wm::lfu, wm::host, wm::continuous, wm::cyclic>(
        comm, grouping::each_alone, 1.0, seed + 1);
  });
}

TEST_CASE("ranks: a group cache's lines replaced while peers read them (one set per rank)",
          "[multi_gpu]") {
  std::uint64_t const seed = std::random_device{}();
  INFO("seed " << seed);
  wm::launch(2, [&](wm::communicator& comm) {
    // 32 lines per rank for 5001 rows: nearly every admission evicts a line that peers probe.
    group_cache_ranks<float, wm::lfu, wm::device, wm::chunked, wm::block>(comm, grouping::table,
                                                                          0.001, seed);
  });
}

TEST_CASE("ranks: group caches on a distributed table are refused at construction (not built yet)",
          "[multi_gpu]") {
  wm::launch(2, [&](wm::communicator& comm) {
    auto refused = [&](auto make) {
      try {
        make();
      } catch (wm::logic_error const& e) {
        return std::string{e.what()}.find("not built yet") != std::string::npos;
      }
      return false;
    };
    RANK_REQUIRE(refused([&] {
      wm::embedding<float, wm::group_cache<>, wm::no_optimizer, wm::host, wm::distributed> e{
          comm, 100, 8};
    }));
    comm.barrier();
  });
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
  on_one_rank([&](wm::communicator& comm, std::uint64_t seed) {
    train_with_bypasses<float, wm::lfu>(comm, wm::sgd{}, seed);
    train_with_bypasses<float, wm::lru>(comm, wm::adam{}, seed + 1);
    train_with_bypasses<__half, wm::lfu>(comm, wm::adam{}, seed + 2);
  });
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
  on_one_rank([&](wm::communicator& comm, std::uint64_t seed) {
    many_victims<float, wm::lfu>(comm, wm::adam{}, seed);
    many_victims<__half, wm::lru>(comm, wm::sgd{0.01f}, seed + 1);
    many_victims<float, wm::lru>(comm, wm::sgd{}, seed + 2);
  });
}
