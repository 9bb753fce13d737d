// SPDX-License-Identifier: Apache-2.0
// GPU tests of the read-only caches in wm::embedding (the embedding_cache_test program). On one
// rank: a group cache of one rank and a read-only device cache gather the table; the several-rank
// group cache's lines (detail::cache::group_lines) on a group of one, through admissions,
// evictions, prefetches and invalidate(), while a prefetch beside a gather replaces lines, and
// with replacements started while a gather is copying the same lines (the copies must be refused,
// counted in cache_statistics::refused_copies, and never served). On several ranks ([ranked]
// cases run inside every rank, one per GPU): a group cache on every rank gathers the table bit for
// bit (several layouts, groups of the table's ranks, of the whole communicator, of one rank each),
// peers' lines serve hits, lines are replaced while peers read them, prefetches; a distributed
// table is refused.
#include <wm/embedding.cuh>
#include <wm/launch.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cache_common.cuh"
#include "catch.hpp"
#include "device_array.cuh"
#include "rank_check.hpp"
#include "ranks.hpp"

using namespace cache_tests;

namespace {

/// The read-only cache a section of the case below checks.
enum class read_only_cache { group_of_one_rank, device_read_only };

}  // namespace

TEST_CASE("read-only caches (group cache of one rank, read-only device cache) gather the table",
          "[gpu]") {
  auto which = read_only_cache::group_of_one_rank;
  SECTION("group_cache<lru> of one rank") {
    which = read_only_cache::group_of_one_rank;
  }
  SECTION("device_cache<read_only, lfu>") {
    which = read_only_cache::device_read_only;
  }
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
    if (which == read_only_cache::group_of_one_rank) {
      wm::cache_options co;
      co.ratio = 0.2;
      co.group = &comm;  // a group of one rank: a read-only device cache of the whole table
      wm::embedding<float, wm::group_cache<wm::lru>, wm::no_optimizer, wm::host> group{
          comm, 2000, 24, {}, init, co};
      check(group, plain, "group_cache<lru>", seed + 1);
    } else {
      wm::cache_options ro;
      ro.ratio = 0.05;
      wm::embedding<float, wm::device_cache<wm::read_only, wm::lfu>, wm::no_optimizer, wm::host,
                    wm::distributed>
          read_only{comm, 2000, 24, {}, init, ro};
      check(read_only, plain, "device_cache<read_only, lfu>", seed + 2);
    }
    WM_CUDA_TRY(cudaStreamDestroy(s));
  });
}

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
  RANK_REQUIRE_MSG(st.refused_copies == 0, what << ": a copy refused with nothing beside it");
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

TEST_CASE("group cache lines on one rank (the several-rank path, a group of one)", "[gpu]") {
  using wm::detail::cache::lfu_impl;
  using wm::detail::cache::lru_impl;
  SECTION("float, LFU, ratio 0.001: one set") {
    on_one_rank([&](wm::communicator& comm, std::uint64_t seed) {
      group_lines_one_rank<float, lfu_impl>(comm, 0.001, seed);
    });
  }
  SECTION("float, LRU, ratio 0.1") {
    on_one_rank([&](wm::communicator& comm, std::uint64_t seed) {
      group_lines_one_rank<float, lru_impl>(comm, 0.1, seed);
    });
  }
  SECTION("half, LFU, ratio 1") {
    on_one_rank([&](wm::communicator& comm, std::uint64_t seed) {
      group_lines_one_rank<__half, lfu_impl>(comm, 1.0, seed);
    });
  }
  SECTION("half, LRU, ratio 0.001: one set") {
    on_one_rank([&](wm::communicator& comm, std::uint64_t seed) {
      group_lines_one_rank<__half, lru_impl>(comm, 0.001, seed);
    });
  }
}

namespace {

/// The GPU's global timer, in nanoseconds.
__device__ std::uint64_t global_ns() {
  std::uint64_t t = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

/// Spins until the word at @p p is no longer @p poison (a gather on another stream has begun to
/// write its output rows), at most @p limit_ns; a wait that ran out adds one to @p timed_out.
__global__ void wait_for_output(unsigned const* p, unsigned poison, std::uint64_t limit_ns,
                                unsigned* timed_out) {
  std::uint64_t const end = global_ns() + limit_ns;
  while (*static_cast<unsigned const volatile*>(p) == poison) {
    if (global_ns() > end) {
      atomicAdd(timed_out, 1u);
      return;
    }
    __nanosleep(200);
  }
}

}  // namespace

TEST_CASE("group cache lines on one rank: a line replaced during its copy is refused, not served",
          "[gpu]") {
  on_one_rank([&](wm::communicator& comm, std::uint64_t seed) {
    using wm::detail::cache::lru_impl;
    // One set (32 lines) of 1 MiB rows: a warp copies a row in hundreds of microseconds (2048
    // loads of 16 bytes per lane, each from L2 or memory), far longer than a prefetch on another
    // stream takes to reach its admissions.
    std::size_t const rows = 96, dim = 262144, n = 32;
    std::size_t const row_bytes = dim * sizeof(float);
    wm::embedding<float, wm::no_cache, wm::no_optimizer, wm::device, wm::chunked> plain{
        comm, rows, dim, {}, wm::embedding_init::normal(0.0f, 1.0f, seed)};
    wm::detail::cache::group_lines<float, lru_impl> lines{comm, rows, 0.001,
                                                          static_cast<std::uint32_t>(seed), dim};
    RANK_REQUIRE(lines.lines() == n);
    auto const ref = std::as_const(plain.weights()).ref();
    cudaStream_t s1{}, s2{};
    WM_CUDA_TRY(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    WM_CUDA_TRY(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    // The reader gathers keys 0..31 (the whole set); the writer prefetches 32 others, two sets of
    // them in turn, so every prefetch admits 32 keys the set does not hold.
    std::vector<std::int64_t> reader(n), writer(2 * n);
    std::iota(reader.begin(), reader.end(), std::int64_t{0});
    std::iota(writer.begin(), writer.end(), static_cast<std::int64_t>(n));
    device_array<std::int64_t> const dr{reader}, dw{writer};
    device_array<unsigned> err{std::vector<unsigned>{0u}}, timed_out{std::vector<unsigned>{0u}};
    device_array<float> warm{std::vector<float>(n * dim)}, out{std::vector<float>(n * dim)};
    batch<float> rb;
    rb.keys         = reader;
    auto const want = gather(plain, rb, s1);  // the table's rows of the reader's keys
    std::span<std::int64_t const> const reader_keys{dr.ptr, n};
    auto const writer_keys = [&](std::size_t round) {
      return std::span<std::int64_t const>{dw.ptr + (round % 2) * n, n};
    };
    // Both workspaces grown before the race (no allocation inside it).
    lines.prefetch(ref, rows, writer_keys(0), err.ptr, s2);
    lines.gather(ref, rows, reader_keys, warm.ptr, err.ptr, s1);
    WM_CUDA_TRY(cudaStreamSynchronize(s1));
    WM_CUDA_TRY(cudaStreamSynchronize(s2));
    lines.reset_statistics();
    auto const start  = std::chrono::steady_clock::now();
    std::size_t round = 0, wrong = 0;
    for (; round < 400 &&
           (round < 8 || std::chrono::steady_clock::now() - start < std::chrono::seconds{1});
         ++round) {
      // The set holds exactly the reader's keys: leftover hints taken, every line emptied, then a
      // gather whose 32 misses are admitted into the 32 empty ways.
      lines.prefetch(ref, rows, std::span<std::int64_t const>{}, err.ptr, s1);
      lines.invalidate(s1);
      lines.gather(ref, rows, reader_keys, warm.ptr, err.ptr, s1);
      WM_CUDA_TRY(cudaMemsetAsync(out.ptr, 0xa5, n * row_bytes, s1));
      WM_CUDA_TRY(cudaStreamSynchronize(s1));
      // The race: s2 waits until the gather on s1 is copying its hits out of the lines, then
      // admits the writer's keys, replacing the lines those copies are reading.
      wait_for_output<<<1, 1, 0, s2>>>(reinterpret_cast<unsigned const*>(out.ptr), 0xa5a5a5a5u,
                                       20'000'000, timed_out.ptr);
      WM_CUDA_TRY(cudaGetLastError());
      lines.gather(ref, rows, reader_keys, out.ptr, err.ptr, s1);
      lines.prefetch(ref, rows, writer_keys(round + 1), err.ptr, s2);
      WM_CUDA_TRY(cudaStreamSynchronize(s1));
      WM_CUDA_TRY(cudaStreamSynchronize(s2));
      auto const got = bytes_of(out.to_host());
      for (std::size_t i = 0; i < n; ++i) {
        auto const at = static_cast<std::ptrdiff_t>(i * row_bytes);
        wrong +=
            std::equal(want.begin() + at,
                       want.begin() + at + static_cast<std::ptrdiff_t>(row_bytes), got.begin() + at)
                ? 0
                : 1;
      }
    }
    auto const st     = lines.statistics();
    auto const missed = timed_out.to_host()[0];
    std::ostringstream what;
    what << round << " rounds: " << st.refused_copies << " copies refused, " << st.hits << " hits, "
         << st.evictions << " evictions, " << missed
         << " rounds where the writer never saw the gather begin";
    RANK_REQUIRE_MSG(wrong == 0, what.str() << "; " << wrong << " rows torn or of another key");
    RANK_REQUIRE_MSG(st.refused_copies > 0, what.str() << "; no replacement overlapped a copy");
    RANK_REQUIRE_MSG(st.refused_copies <= round * n, what.str());
    RANK_REQUIRE_MSG(st.hits > 0 && st.hits + st.misses == st.requests, what.str());
    RANK_REQUIRE(err.to_host()[0] == 0u);
    WM_CUDA_TRY(cudaStreamDestroy(s1));
    WM_CUDA_TRY(cudaStreamDestroy(s2));
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

// ---- cases run inside every rank (--ranks; tests/support/ranks.hpp) ----------------------------

TEST_CASE("ranked: a group cache on several ranks gathers the table (float, LFU, host chunked)",
          "[ranked][multi]") {
  auto& comm               = wm_test::comm();
  std::uint64_t const seed = shared_seed(comm);
  INFO("seed " << seed);
  for (double const ratio : {0.05, 1.0}) {
    DYNAMIC_SECTION("ratio " << ratio) {
      group_cache_ranks<float, wm::lfu, wm::host, wm::chunked, wm::block>(comm, grouping::table,
                                                                          ratio, seed);
    }
  }
}

TEST_CASE("ranked: a group cache on several ranks gathers the table (half, LRU, device continuous)",
          "[ranked][multi]") {
  auto& comm               = wm_test::comm();
  std::uint64_t const seed = shared_seed(comm);
  INFO("seed " << seed);
  for (double const ratio : {0.05, 1.0}) {
    DYNAMIC_SECTION("ratio " << ratio) {
      group_cache_ranks<__half, wm::lru, wm::device, wm::continuous, wm::cyclic>(
          comm, grouping::explicit_whole, ratio, seed);
    }
  }
}

TEST_CASE("ranked: group caches of one rank each on a table of several", "[ranked][multi]") {
  auto& comm               = wm_test::comm();
  std::uint64_t const seed = shared_seed(comm);
  INFO("seed " << seed);
  SECTION("float, LRU, host continuous, ratio 0.05") {
    group_cache_ranks<float, wm::lru, wm::host, wm::continuous, wm::cyclic>(
        comm, grouping::each_alone, 0.05, seed);
  }
  SECTION("float, LFU, host continuous, ratio 1") {
    group_cache_ranks<float, wm::lfu, wm::host, wm::continuous, wm::cyclic>(
        comm, grouping::each_alone, 1.0, seed + 1);
  }
}

TEST_CASE("ranked: a group cache's lines replaced while peers read them (one set per rank)",
          "[ranked][multi]") {
  auto& comm               = wm_test::comm();
  std::uint64_t const seed = shared_seed(comm);
  INFO("seed " << seed);
  // 32 lines per rank for 5001 rows: nearly every admission evicts a line that peers probe.
  group_cache_ranks<float, wm::lfu, wm::device, wm::chunked, wm::block>(comm, grouping::table,
                                                                        0.001, seed);
}

TEST_CASE("ranked: group caches on a distributed table are refused at construction (not built yet)",
          "[ranked][multi]") {
  auto& comm   = wm_test::comm();
  auto refused = [&](auto make) {
    try {
      make();
    } catch (wm::logic_error const& e) {
      return std::string{e.what()}.find("not built yet") != std::string::npos;
    }
    return false;
  };
  RANK_REQUIRE(refused([&] {
    wm::embedding<float, wm::group_cache<>, wm::no_optimizer, wm::host, wm::distributed> e{comm,
                                                                                           100, 8};
  }));
  comm.barrier();
}

TEST_CASE("ranked: a group cache's rows read while prefetches beside replace lines",
          "[ranked][multi]") {
  auto& comm               = wm_test::comm();
  std::uint64_t const seed = shared_seed(comm);
  INFO("seed " << seed);
  std::size_t const rows = 3001, dim = 64;
  auto const init = wm::embedding_init::normal(0.0f, 1.0f, seed);
  wm::embedding<float, wm::no_cache, wm::no_optimizer, wm::device, wm::chunked> plain{
      comm, rows, dim, {}, init};
  wm::cache_options co;
  co.ratio = 0.001;  // one set per rank
  wm::embedding<float, wm::group_cache<wm::lfu>, wm::no_optimizer, wm::device, wm::chunked> cached{
      comm, rows, dim, {}, init, co};
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
      "group_cache<lfu> on " + std::to_string(comm.size()) + " ranks, one set each");
  auto const st = cached.cache_stats();
  RANK_REQUIRE_MSG(st.hits > 0 && st.bytes_from_peers > 0 && st.evictions > 0,
                   st.hits << " hits, " << st.bytes_from_peers << " bytes from peers, "
                           << st.evictions << " evictions");
  WM_CUDA_TRY(cudaStreamSynchronize(s));
  comm.barrier();
  WM_CUDA_TRY(cudaStreamDestroy(s));
}
