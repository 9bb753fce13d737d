// SPDX-License-Identifier: Apache-2.0
// GPU tests of the caches in wm::embedding on one rank (the embedding_cache_test program):
// training through a read-write device cache (LFU and LRU, float and half, SGD, Adam and
// global-step Adam) equals the uncached table bit for bit over several steps of fresh random keys
// with repeats, also across flush(), invalidate(), prefetch() and a store() + load() into an
// uncached table of another layout; the statistics add up; edge geometries (one set, ratio 1,
// fewer rows than one set's 32 ways, many lines, wide rows). And nothing is lost when a gather
// runs out of device memory, or when store() or load() follow a gather still running on a
// non-blocking stream.
#include <wm/embedding.cuh>
#include <wm/launch.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <random>
#include <set>
#include <span>
#include <string>
#include <unistd.h>
#include <vector>

#include "cache_common.cuh"
#include "catch.hpp"
#include "device_array.cuh"
#include "rank_check.hpp"

using namespace cache_tests;

namespace {

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

// Every geometry a section, on a rank of its own.
template <class T, class R, class Opt>
void every_geometry(Opt opt) {
  for (auto const& g : geometries) {
    DYNAMIC_SECTION(g.what) {
      on_one_rank([&](wm::communicator& comm, std::uint64_t seed) {
        train_bitwise<T, R, Opt>(comm, opt, g, seed);
      });
    }
  }
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

// ---- failures and calls still running: nothing a read-write cache holds is lost ---------------

namespace {

/// @p n keys drawn uniformly from [0, rows) (a batch only gathered: no gradients).
std::vector<std::int64_t> random_keys(std::mt19937_64& rng, std::size_t rows, std::size_t n) {
  std::vector<std::int64_t> k(n);
  for (auto& x : k) { x = static_cast<std::int64_t>(rng() % rows); }
  return k;
}

/// Device memory taken with cudaMalloc until none is left (1 GiB pieces, then 4 MiB ones) and
/// given back one 4 MiB piece at a time.
class device_filler {
 public:
  static constexpr std::size_t piece = std::size_t{4} << 20;
  device_filler() {
    for (std::size_t const bytes : {std::size_t{1} << 30, piece}) {
      for (;;) {
        void* p = nullptr;
        if (cudaMalloc(&p, bytes) != cudaSuccess) {
          (void)cudaGetLastError();  // out of memory is not sticky
          break;
        }
        (bytes == piece ? small_ : big_).push_back(p);
      }
    }
  }
  device_filler(device_filler const&)            = delete;
  device_filler& operator=(device_filler const&) = delete;
  ~device_filler() {
    for (void* p : small_) { (void)cudaFree(p); }
    for (void* p : big_) { (void)cudaFree(p); }
  }
  /// Frees one more piece (a 1 GiB one once the small ones are gone); false when none is left.
  bool give_back() {
    auto& from = small_.empty() ? big_ : small_;
    if (from.empty()) { return false; }
    WM_CUDA_TRY(cudaFree(from.back()));
    from.pop_back();
    return true;
  }

 private:
  std::vector<void*> big_, small_;
};

/// The default memory pool of the current device gives its unused memory back to the device.
void trim_pool() {
  int dev = 0;
  WM_CUDA_TRY(cudaGetDevice(&dev));
  cudaMemPool_t pool{};
  WM_CUDA_TRY(cudaDeviceGetDefaultMemPool(&pool, dev));
  WM_CUDA_TRY(cudaDeviceSynchronize());
  WM_CUDA_TRY(cudaMemPoolTrimTo(pool, 0));
}

/// Sleeps on the device for about @p ns nanoseconds (what a stream waits behind).
__global__ void sleep_kernel(unsigned long long ns) {
  unsigned long long start = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (;;) {
    unsigned long long now = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start >= ns) { break; }
    __nanosleep(10000);
  }
}

/// Spins until @p want of @p samples output rows (@p stride rows apart, @p dim values each) no
/// longer begin with the poison bits @p poison, or @p limit_ns nanoseconds pass: the work queued
/// behind it starts while a gather on another stream is writing its rows.
__global__ void wait_for_rows_kernel(float const* out, std::size_t dim, std::size_t samples,
                                     std::size_t stride, unsigned poison, std::size_t want,
                                     unsigned long long limit_ns) {
  unsigned long long start = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (;;) {
    std::size_t seen = 0;
    for (std::size_t i = 0; i < samples; ++i) {
      auto const* const v = reinterpret_cast<unsigned const volatile*>(out + i * stride * dim);
      if (*v != poison) { ++seen; }
    }
    unsigned long long now = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (seen >= want || now - start >= limit_ns) { break; }
    __nanosleep(1000);
  }
}

/// A non-blocking stream of the highest priority: its blocks start before those of work already
/// queued on the legacy stream.
cudaStream_t urgent_stream() {
  int least = 0, greatest = 0;
  WM_CUDA_TRY(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t s{};
  WM_CUDA_TRY(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, greatest));
  return s;
}

using plain_adam = wm::embedding<float, wm::no_cache, wm::adam, wm::device, wm::chunked>;

}  // namespace

// A one-rank gather stages its dirty victims (their lines cleaned) and writes them back after its
// admissions. A gather larger than any before it grows its workspaces: the distinct-key plan's
// before the admissions, the staged write-backs' sort's after them in the old code, so that with
// the device full but for the plan's growth, the call threw after staging its victims, and the
// next call overwrote the staging slots: those rows' updates were gone (the flushed table below
// differs from the uncached one). Now every workspace of the call is reserved before the first
// admission, so a call that runs out of memory fails with nothing admitted. The device is filled
// and given back 4 MiB at a time, so that the big gather meets every amount of free memory: too
// little for the plan, enough for the plan but not the sort, enough for both.
TEST_CASE("device cache: a gather that runs out of device memory loses no dirty row", "[gpu]") {
  on_one_rank([&](wm::communicator& comm, std::uint64_t seed) {
    cudaStream_t s{};
    WM_CUDA_TRY(cudaStreamCreate(&s));
    std::mt19937_64 rng{seed};
    // 2^20 lines (as many as one call stages); training batches of 100,000 keys leave every line
    // dirty and the workspaces sized for them; the big batch stages 2^20 victims (a sort of about
    // 26 MiB beside a plan of about 53 MiB).
    std::size_t const rows = std::size_t{1} << 22, dim = 4, n = 100000, big = 1500000;
    auto const big_keys = random_keys(rng, rows, big);
    device_array<std::int64_t> dk{big_keys};
    device_array<float> out{std::vector<float>(big * dim, 0.0f)};
    auto const big_gather = [&](auto& e) {
      e.gather(std::span<std::int64_t const>{dk.ptr, big}, out.ptr, cuda::stream_ref{s});
      WM_CUDA_TRY(cudaStreamSynchronize(s));
      return bytes_of(out.to_host());
    };
    {  // every kernel of the big gather loaded now (lazy loading allocates at the first launch)
      cached_and_plain<float, wm::lru, wm::sgd> warm{comm, rows, dim, wm::sgd{}, 0.25, rng};
      (void)big_gather(warm.cached);
      warm.cached.flush(cuda::stream_ref{s});
      WM_CUDA_TRY(cudaStreamSynchronize(s));
    }
    cached_and_plain<float, wm::lru, wm::sgd> tables{comm, rows, dim, wm::sgd{}, 0.25, rng};
    auto& cached = tables.cached;
    auto& plain  = tables.plain;
    RANK_REQUIRE(cached.cache_lines() >= std::size_t{1} << 20);
    for (int k = 0; k < 16; ++k) {
      auto const b = draw<float>(rng, rows, dim, n, k);
      RANK_REQUIRE_MSG(gather(cached, b, s) == gather(plain, b, s), "training step " << k);
      apply(cached, b, s);
      apply(plain, b, s);
    }
    auto const before = cached.cache_stats();
    trim_pool();
    int failures  = 0;
    bool gathered = false;
    {
      device_filler fill;
      for (int attempt = 0; attempt < 512 && !gathered; ++attempt) {
        try {
          cached.gather(std::span<std::int64_t const>{dk.ptr, big}, out.ptr, cuda::stream_ref{s});
          WM_CUDA_TRY(cudaStreamSynchronize(s));
          gathered = true;
        } catch (wm::cuda_error const& e) {
          RANK_REQUIRE_MSG(e.code() == cudaErrorMemoryAllocation, e.what());
          (void)cudaGetLastError();  // not sticky
          WM_CUDA_TRY(cudaStreamSynchronize(s));
          ++failures;
          if (!fill.give_back()) { break; }
        }
      }
    }
    RANK_REQUIRE_MSG(failures > 0, "the big gather never ran out of memory");
    // With memory again: the gather's rows, then the table, equal the uncached ones.
    RANK_REQUIRE_MSG(big_gather(cached) == big_gather(plain), "the big gather");
    RANK_REQUIRE_MSG(cached.cache_stats().write_backs > before.write_backs,
                     "the big gather wrote no dirty victim back");
    RANK_REQUIRE_MSG(flushed_equal(cached, plain, s),
                     "the flushed table differs: a gather that ran out of memory lost rows");
    auto const b = draw<float>(rng, rows, dim, n, 16);
    apply(cached, b, s);
    apply(plain, b, s);
    RANK_REQUIRE_MSG(flushed_equal(cached, plain, s), "training after the failures");
    WM_CUDA_TRY(cudaStreamDestroy(s));
  });
}

// store() flushes on the legacy stream, which does not wait for a cudaStreamNonBlocking stream.
// In the old code a one-rank gather on one returned with its admissions running, and the flush
// ran beside them: it read a set's dirty ways and tags while admissions replaced them, and wrote
// a line's row under another key, or half of one. To make the two meet, the legacy stream first
// waits (wait_for_rows_kernel) until the gather of 4M keys has written some of its rows, so the
// old flush started in the middle of the admissions (and the gather's stream has the highest
// priority, so its blocks keep running beside the flush's). The checkpoint, loaded into an
// uncached table, then differed from the uncached twin. Now store waits for every gather and
// prefetch the cache has issued before it flushes (then the wait kernel has long ended).
TEST_CASE("device cache: store() right after a gather on a non-blocking stream holds every update",
          "[gpu]") {
  on_one_rank([&](wm::communicator& comm, std::uint64_t seed) {
    cudaStream_t const s = urgent_stream();
    std::mt19937_64 rng{seed};
    // 2^19 lines of Adam rows (200-byte payloads), dirty; a pending gather of 4M keys evicts them.
    std::size_t const rows = std::size_t{1} << 21, dim = 16, n = 300000, big = std::size_t{1} << 22;
    cached_and_plain<float, wm::lfu, wm::adam> tables{comm, rows, dim, wm::adam{}, 0.25, rng};
    auto& cached = tables.cached;
    auto& plain  = tables.plain;
    plain_adam loaded{comm, rows, dim, wm::adam{}, wm::embedding_init::zeros()};
    auto const dir = fresh_dir("pending-store");
    device_array<float> out{std::vector<float>(big * dim, 0.0f)};
    for (int round = 0; round < 3; ++round) {
      for (int k = 0; k < 2; ++k) {
        auto const b = draw<float>(rng, rows, dim, n, 2 * round + k);
        RANK_REQUIRE(gather(cached, b, s) == gather(plain, b, s));
        apply(cached, b, s);
        apply(plain, b, s);
      }
      device_array<std::int64_t> dk{random_keys(rng, rows, big)};
      WM_CUDA_TRY(cudaMemset(out.ptr, 0xff, big * dim * sizeof(float)));  // poison: NaN bits
      WM_CUDA_TRY(cudaDeviceSynchronize());
      cached.gather(std::span<std::int64_t const>{dk.ptr, big}, out.ptr, cuda::stream_ref{s});
      std::size_t const samples = 1024;
      wait_for_rows_kernel<<<1, 1, 0, cudaStreamLegacy>>>(out.ptr, dim, samples, big / samples,
                                                          0xffffffffu, samples / 16,
                                                          2ull * 1000 * 1000 * 1000);
      WM_CHECK_LAUNCH();
      cached.store(dir / "ck");  // at once: the gather's admissions are still running
      loaded.load(dir / "ck");
      RANK_REQUIRE_MSG(snapshot(loaded, s) == snapshot(plain, s),
                       "round " << round << ": the checkpoint differs from the uncached table");
      auto const got = bytes_of(out.to_host());
      plain.gather(std::span<std::int64_t const>{dk.ptr, big}, out.ptr, cuda::stream_ref{s});
      WM_CUDA_TRY(cudaStreamSynchronize(s));
      RANK_REQUIRE_MSG(got == bytes_of(out.to_host()), "round " << round << ": the gather");
      RANK_REQUIRE_MSG(flushed_equal(cached, plain, s), "round " << round << ": the table");
    }
    std::filesystem::remove_all(dir);
    WM_CUDA_TRY(cudaStreamDestroy(s));
  });
}

// load() empties the lines on the legacy stream, which does not wait for a cudaStreamNonBlocking
// stream. In the old code a one-rank gather still queued there (behind 200 ms of sleep) admitted
// its rows after the lines were emptied: they stayed cached, clean, with the values from before
// the load, and the next gather returned them (and training updated them). Now load waits for
// every gather and prefetch the cache has issued before it empties the lines.
TEST_CASE("device cache: load() right after a gather on a non-blocking stream leaves no stale line",
          "[gpu]") {
  on_one_rank([&](wm::communicator& comm, std::uint64_t seed) {
    cudaStream_t s{};
    WM_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    std::mt19937_64 rng{seed};
    std::size_t const rows = std::size_t{1} << 21, dim = 16, n = 200000, big = std::size_t{1} << 22;
    cached_and_plain<float, wm::lru, wm::adam> tables{comm, rows, dim, wm::adam{}, 0.25, rng};
    auto& cached = tables.cached;
    // The checkpoint to load: another table, other values, trained a step.
    plain_adam source{comm, rows, dim, wm::adam{},
                      wm::embedding_init::uniform(-1.0f, 1.0f, static_cast<std::uint32_t>(rng()))};
    auto const first = draw<float>(rng, rows, dim, n, 0);
    apply(source, first, s);
    auto const dir = fresh_dir("pending-load");
    source.store(dir / "ck");
    // The cache dirty and full before the load.
    RANK_REQUIRE(gather(cached, first, s) == gather(tables.plain, first, s));
    apply(cached, first, s);
    device_array<std::int64_t> dk{random_keys(rng, rows, big)};
    device_array<float> out{std::vector<float>(big * dim, 0.0f)};
    sleep_kernel<<<1, 1, 0, s>>>(200ull * 1000 * 1000);
    WM_CHECK_LAUNCH();
    cached.gather(std::span<std::int64_t const>{dk.ptr, big}, out.ptr, cuda::stream_ref{s});
    cached.load(dir / "ck");  // at once: the gather has not started yet
    RANK_REQUIRE_MSG(snapshot(cached, s) == snapshot(source, s), "the loaded table");
    // The big batch's first keys (admitted by the pending gather), then a training step.
    batch<float> again                   = draw<float>(rng, rows, dim, n, 1);
    std::vector<std::int64_t> const head = dk.to_host();
    std::copy(head.begin(), head.begin() + static_cast<std::ptrdiff_t>(n / 2), again.keys.begin());
    again.distinct = std::set<std::int64_t>(again.keys.begin(), again.keys.end()).size();
    RANK_REQUIRE_MSG(gather(cached, again, s) == gather(source, again, s),
                     "a gather after load() returned rows from before it");
    apply(cached, again, s);
    apply(source, again, s);
    RANK_REQUIRE_MSG(flushed_equal(cached, source, s), "training after load()");
    std::filesystem::remove_all(dir);
    WM_CUDA_TRY(cudaStreamDestroy(s));
  });
}
