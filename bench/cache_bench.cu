// SPDX-License-Identifier: Apache-2.0
/*
 * cache_bench: Adam training steps on a host table with a device cache, next to its
 * bounds (the device-table step and the uncached host step), the pinned copy bandwidth measured
 * in the same run, and the WholeGraph peer (bench/peers/wg_cache.py) on the very same keys.
 *
 * Table: 10M rows x 128 float (512 B rows), Adam (lazy: per-row step), lr 0.01, one GPU
 * (wm::launch(1)). Every case is a fresh table:
 *   cached R: wm::embedding<float, wm::device_cache<>, wm::adam, wm::host, wm::chunked> with
 *             cache_options ratio R in 0.05, 0.1, 0.25 (read_write, lfu);
 *   host:     wm::embedding<float, wm::no_cache, wm::adam, wm::host, wm::chunked> (bound);
 *   device:   wm::embedding<float, wm::no_cache, wm::adam, wm::device, wm::chunked> (bound).
 * Keys: FRESH keys every step, from a ring of 16 pre-drawn batches of 1M int64 keys per
 * distribution (step s uses batch s mod 16), made on the host before any rank starts with the
 * generators of bench/keys.hpp (the same as embedding_bench): uniform (seeds 3000 + b) and exact
 * discrete Zipf(1.05) by inverse CDF, rank k-1 scattered to row (k-1) * 7368787 mod 10M (seeds
 * 4000 + b). Gradients: 1M x 128 float uniform in [-1, 1), the same every step.
 *
 * A step = e.gather(keys, out) + e.apply_gradients(keys, grads, lr) (both synchronize). Steady
 * state: a warm-up pass over the ring (16 steps: the cache fills), reset_cache_stats(), then 32
 * steps (the ring twice), each between two CUDA events; the figure is the median ms/step. Cached
 * cases: hit rate = hits / requests of cache_stats() over the timed steps; "in" = bytes_from_host
 * per step; "out" = write_backs x line bytes per step (line = weight + m + v + the 8-byte step:
 * 1544 B). After timing each cached case is flushed and the last batch gathered through the cache
 * and straight from the host table (weights().gather): the two must be equal bit for bit.
 *
 * Link (same run): pinned cudaMemcpyAsync of 1 GiB host-to-device, device-to-host, and both at
 * once on two streams (GB/s = 2 GiB / time), median of 10 with CUDA events. Moving `in` bytes to
 * the device and `out` bytes to the host takes link(in, out) = max(in / H2D, out / D2H,
 * (in + out) / both).
 * Figures and limits:
 *   host floor   = link(U x 1536 B, U x 1536 B): read and write the weight and both Adam states of
 *                  each distinct row U (mean over the ring's batches); floor / host ms >= 0.8 is
 *                  the target for uniform keys.
 *   cached limit = device-table step (same keys) + link(in, out) / 0.8: the step's miss traffic
 *                  (rows in, dirty rows out) at 80% of the measured link. Target at ratio 0.1 Zipf:
 *                  wm <= limit and WG / wm >= 5. Uniform keys (no cache can help): cached <= 1.1 x
 *                  the uncached host step.
 *   miss GB/s    = (in + out) / ms/step.
 *   100% hits    = 1M keys drawn from 100k distinct rows, gather only, through the ratio-0.25
 *                  cache after 3 gathers of the same batch (every key a hit) against the
 *                  device-table gather of the same keys; target device ms / cached ms >= 0.85.
 * WholeGraph peer: bench/peers/wg_cache.py (one process, one GPU) runs after the wm cases on the
 * same rings (written to temporary files), the same warm-up and timed steps, when python3 imports
 * pylibwholegraph.torch (PYTHONPATH / LD_LIBRARY_PATH as shared/peers/wholegraph/README.md says);
 * otherwise its columns print "n/a". `--no-peer` skips it.
 * Output ends with one table; a CSV of ms/step against cache ratio (wm and WG, uniform and Zipf;
 * host rows at ratio 0, device rows at ratio 1) goes to `--csv PATH`, else $OUT/cache_bench.csv
 * when $OUT is set, else ./cache_bench.csv (bench/plot_cache.py plots it).
 * Exit status: 0, or 1 if a case or the peer failed, 2 for wrong arguments.
 */
#include <wm/cache.hpp>
#include <wm/embedding.cuh>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <nvtx3/nvToolsExt.h>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "common.cuh"
#include "keys.hpp"

namespace {

using namespace wm_bench::table_bench;  // the table, batch, dist, grad_kernel, buffer, fmt, ...

constexpr std::size_t line_bytes  = row_bytes * (1 + wm::adam::states) + sizeof(std::int64_t);
constexpr int ring                = 16;
constexpr int warm_steps          = ring;  // one pass over the ring
constexpr int timed_steps         = 2 * ring;
constexpr std::size_t hot_rows    = 100'000;  // distinct keys of the 100%-hits batch
constexpr int hot_warm            = 3;
constexpr int hot_reps            = 16;
constexpr double link_share       = 0.8;  // the limit's share of the measured link
constexpr int n_ratios            = 3;
constexpr double ratios[n_ratios] = {0.05, 0.1, 0.25};
constexpr int hot_ratio           = 2;  // the 100%-hits case runs on ratios[2]
constexpr double nan              = std::numeric_limits<double>::quiet_NaN();

using cached_table = wm::embedding<float, wm::device_cache<>, wm::adam, wm::host, wm::chunked>;
using host_table   = wm::embedding<float, wm::no_cache, wm::adam, wm::host, wm::chunked>;
using device_table = wm::embedding<float, wm::no_cache, wm::adam, wm::device, wm::chunked>;

/// Counts in @p bad the 32-bit words where @p a and @p b differ.
__global__ void compare_kernel(std::uint32_t const* a, std::uint32_t const* b, std::size_t n,
                               unsigned long long* bad) {
  unsigned long long wrong = 0;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    wrong += a[i] != b[i] ? 1 : 0;
  }
  if (wrong != 0) { atomicAdd(bad, wrong); }
}

struct host_free {
  void operator()(void* p) const noexcept { (void)cudaFreeHost(p); }
};

std::unique_ptr<std::byte[], host_free> allocate_pinned(std::size_t n) {
  void* p = nullptr;
  WM_CUDA_TRY(cudaMallocHost(&p, n));
  return std::unique_ptr<std::byte[], host_free>{static_cast<std::byte*>(p)};
}

// ---- keys (host, before any rank starts) ---------------------------------------------------

struct key_rings {
  std::vector<std::int64_t> keys[2];  // [dist]: ring x batch keys, batch b at [b * batch, ...)
  double distinct[2]{};               // [dist]: mean distinct rows per batch
  std::size_t distinct_min[2]{}, distinct_max[2]{};
  std::vector<std::int64_t> hot;  // batch keys from hot_rows distinct rows
  std::size_t hot_distinct{};
};

/// The two rings and the 100%-hits batch; the batches are drawn and counted in parallel.
key_rings make_keys() {
  key_rings k;
  std::vector<double> const cdf = wm_bench::zipf_cdf(table_rows, zipf_alpha);
  std::size_t counts[2][ring]{};
  for (auto& v : k.keys) { v.resize(ring * batch); }
  std::vector<std::thread> pool;
  for (int d = 0; d < 2; ++d) {
    for (int b = 0; b < ring; ++b) {
      pool.emplace_back([&k, &cdf, &counts, d, b] {
        std::span<std::int64_t> const out{k.keys[d].data() + std::size_t(b) * batch, batch};
        if (d == uniform) {
          wm_bench::uniform_keys(out, table_rows, 3000 + b);
        } else {
          wm_bench::zipf_keys(out, cdf, scatter, 4000 + b);
        }
        counts[d][b] = wm_bench::distinct_count(out);
      });
    }
  }
  for (auto& t : pool) { t.join(); }
  for (int d = 0; d < 2; ++d) {
    double sum        = 0;
    k.distinct_min[d] = counts[d][0];
    for (std::size_t const c : counts[d]) {
      sum += double(c);
      k.distinct_min[d] = std::min(k.distinct_min[d], c);
      k.distinct_max[d] = std::max(k.distinct_max[d], c);
    }
    k.distinct[d] = sum / ring;
  }
  k.hot.resize(batch);
  for (std::size_t i = 0; i < batch; ++i) {  // hot_rows rows spread over the table
    k.hot[i] = static_cast<std::int64_t>(wm_bench::splitmix(wm_bench::splitmix(5000) + i) %
                                         hot_rows * scatter % table_rows);
  }
  k.hot_distinct = wm_bench::distinct_count(k.hot);
  return k;
}

// ---- what the rank hands back (memory shared with main) ------------------------------------

struct step_result {
  double ms{nan};         // median ms/step
  double gather_ms{nan};  // median of the gather part of the same steps
  double hit{nan};        // hits / requests over the timed steps
  double in_bytes{nan};   // per step: bytes_from_host
  double out_bytes{nan};  // per step: write_backs x line_bytes
  bool ran{false};
};

struct results {
  char gpu[256]{};
  char error[512]{};
  double h2d{nan}, d2h{nan}, both{nan};  // GB/s
  step_result device[2], host[2], cached[n_ratios][2];
  double hot_device_ms{nan}, hot_cached_ms{nan}, hot_hit{nan};
};

/// ms to move @p in bytes to the device and @p out bytes to the host at the measured rates.
double link_ms(results const& r, double in, double out) {
  return std::max({in / r.h2d, out / r.d2h, (in + out) / r.both}) / 1e6;
}

/// The rank's state (one rank).
class bench {
 public:
  bench(wm::communicator& comm, results& out, key_rings const& keys)
      : comm_{comm}, res_{out}, keys_{keys} {
    blocks_ = grid_blocks(comm.device());
    WM_CUDA_TRY(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    WM_CUDA_TRY(cudaStreamCreateWithFlags(&stream2_, cudaStreamNonBlocking));
    for (auto& e : events_) { WM_CUDA_TRY(cudaEventCreate(&e)); }
    for (auto& e : mid_) { WM_CUDA_TRY(cudaEventCreate(&e)); }
    WM_CUDA_TRY(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
    WM_CUDA_TRY(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));
    std::snprintf(res_.gpu, sizeof res_.gpu, "%s", device_name(comm.device()).c_str());
    for (int d = 0; d < 2; ++d) {
      ring_[d] = allocate<std::int64_t>(ring * batch);
      WM_CUDA_TRY(cudaMemcpyAsync(ring_[d].get(), keys_.keys[d].data(),
                                  ring * batch * sizeof(std::int64_t), cudaMemcpyHostToDevice,
                                  stream_));
    }
    hot_ = allocate<std::int64_t>(batch);
    WM_CUDA_TRY(cudaMemcpyAsync(hot_.get(), keys_.hot.data(), batch * sizeof(std::int64_t),
                                cudaMemcpyHostToDevice, stream_));
    grads_ = allocate<float>(batch * dim);
    out_   = allocate<float>(batch * dim);
    out2_  = allocate<float>(batch * dim);
    bad_   = allocate<unsigned long long>(1);
    fill_gradients(grads_.get(), batch * dim, 77, blocks_, stream_);
  }
  bench(bench const&)            = delete;
  bench& operator=(bench const&) = delete;
  ~bench() {
    (void)cudaStreamSynchronize(stream_);
    (void)cudaStreamSynchronize(stream2_);
    for (auto e : events_) { (void)cudaEventDestroy(e); }
    for (auto e : mid_) { (void)cudaEventDestroy(e); }
    (void)cudaEventDestroy(fork_);
    (void)cudaEventDestroy(join_);
    (void)cudaStreamDestroy(stream2_);
    (void)cudaStreamDestroy(stream_);
  }

  /// Pinned copies of 1 GiB: host-to-device, device-to-host, and both at once on two streams.
  void copy_limits() {
    auto const h_src = allocate_pinned(gib), h_dst = allocate_pinned(gib);
    auto const d_src = allocate<std::byte>(gib), d_dst = allocate<std::byte>(gib);
    std::memset(h_src.get(), 0x5A, gib);
    WM_CUDA_TRY(cudaMemsetAsync(d_src.get(), 0xA5, gib, stream_));
    double const h2d  = events_median_ms(10, [&] {
      WM_CUDA_TRY(cudaMemcpyAsync(d_dst.get(), h_src.get(), gib, cudaMemcpyHostToDevice, stream_));
    });
    double const d2h  = events_median_ms(10, [&] {
      WM_CUDA_TRY(cudaMemcpyAsync(h_dst.get(), d_src.get(), gib, cudaMemcpyDeviceToHost, stream_));
    });
    double const both = events_median_ms(10, [&] {
      WM_CUDA_TRY(cudaEventRecord(fork_, stream_));
      WM_CUDA_TRY(cudaStreamWaitEvent(stream2_, fork_));
      WM_CUDA_TRY(cudaMemcpyAsync(d_dst.get(), h_src.get(), gib, cudaMemcpyHostToDevice, stream_));
      WM_CUDA_TRY(cudaMemcpyAsync(h_dst.get(), d_src.get(), gib, cudaMemcpyDeviceToHost, stream2_));
      WM_CUDA_TRY(cudaEventRecord(join_, stream2_));
      WM_CUDA_TRY(cudaStreamWaitEvent(stream_, join_));
    });
    res_.h2d          = double(gib) / h2d / 1e6;
    res_.d2h          = double(gib) / d2h / 1e6;
    res_.both         = 2.0 * double(gib) / both / 1e6;
    std::printf(
        "cache_bench: pinned copy 1 GiB: H2D %.1f GB/s, D2H %.1f GB/s, both at once %.1f "
        "GB/s (sum)\n",
        res_.h2d, res_.d2h, res_.both);
    std::fflush(stdout);
  }

  /// The device-table bound: steps on both rings, then the 100%-hits batch's gather.
  void device_cases() {
    device_table e{comm_, table_rows, dim, wm::adam{}, init()};
    for (int d = 0; d < 2; ++d) { res_.device[d] = steps(e, static_cast<dist>(d), "device"); }
    res_.hot_device_ms = hot_gather_ms(e);
    std::printf("cache_bench: device   100%%-hits batch gather %8.3f ms\n", res_.hot_device_ms);
    std::fflush(stdout);
  }

  /// The uncached host bound.
  void host_cases() {
    host_table e{comm_, table_rows, dim, wm::adam{}, init()};
    for (int d = 0; d < 2; ++d) { res_.host[d] = steps(e, static_cast<dist>(d), "host"); }
  }

  /// The cached cases at ratios[r] (and the 100%-hits gather at hot_ratio).
  template <class E = cached_table>
  void cached_cases(int r) {
    wm::cache_options options;
    options.ratio = ratios[r];
    E e{comm_, table_rows, dim, wm::adam{}, init(), options};
    std::printf("cache_bench: cache ratio %.2f: %zu lines (%.2f GB of lines)\n", ratios[r],
                e.cache_lines(), double(e.cache_lines()) * line_bytes / 1e9);
    for (int d = 0; d < 2; ++d) {
      e.invalidate(cuda::stream_ref{stream_});  // each distribution starts from an empty cache
      res_.cached[r][d] = steps(e, static_cast<dist>(d), fmt("cache %.2f", ratios[r]).c_str());
      check_flushed(e, static_cast<dist>(d));
    }
    if (r == hot_ratio) {
      e.invalidate(cuda::stream_ref{stream_});
      res_.hot_cached_ms = hot_gather_ms(e);
      std::printf("cache_bench: cache %.2f 100%%-hits batch gather %8.3f ms, hit rate %.4f\n",
                  ratios[r], res_.hot_cached_ms, res_.hot_hit);
      std::fflush(stdout);
    }
  }

 private:
  static wm::embedding_init init() { return wm::embedding_init::uniform(-0.05f, 0.05f, 42); }

  std::span<std::int64_t const> keys(dist d, int step) const {
    return {ring_[d].get() + std::size_t(step % ring) * batch, batch};
  }

  /// Median ms of @p enqueue with CUDA events (2 warm-ups, @p reps timed runs).
  template <class F>
  double events_median_ms(int reps, F const& enqueue) {
    return wm_bench::event_median_ms(
        enqueue, 2, std::span<cudaEvent_t const>{events_, std::size_t(2 * reps)}, stream_, comm_);
  }

  /// Steady-state steps of @p e on ring @p d: a warm-up pass, then timed_steps steps.
  template <class E>
  step_result steps(E& e, dist d, char const* name) {
    constexpr bool cached = std::is_same_v<E, cached_table>;
    cuda::stream_ref const s{stream_};
    auto const step = [&](int i) {
      e.gather(keys(d, i), out_.get(), s);
      e.apply_gradients(keys(d, i), grads_.get(), lr, s);
    };
    for (int i = 0; i < warm_steps; ++i) { step(i); }
    WM_CUDA_TRY(cudaStreamSynchronize(stream_));
    if constexpr (cached) { e.reset_cache_stats(); }
    // NVTX range "steps_<case>_<dist>" ('.' and ' ' as '_') over the timed steps: a profiler
    // (ncu --nvtx --nvtx-include "steps_cache_0_10_zipf/") can time their kernels one by one.
    std::string range = fmt("steps_%s_%s", name, dist_names[d]);
    std::replace_if(
        range.begin(), range.end(), [](char ch) { return ch == ' ' || ch == '.'; }, '_');
    nvtxRangePushA(range.c_str());
    for (int i = 0; i < timed_steps; ++i) {
      WM_CUDA_TRY(cudaEventRecord(events_[2 * i], stream_));
      e.gather(keys(d, i), out_.get(), s);
      WM_CUDA_TRY(cudaEventRecord(mid_[i], stream_));
      e.apply_gradients(keys(d, i), grads_.get(), lr, s);
      WM_CUDA_TRY(cudaEventRecord(events_[2 * i + 1], stream_));
    }
    nvtxRangePop();
    WM_CUDA_TRY(cudaStreamSynchronize(stream_));
    std::vector<double> ms(timed_steps), gms(timed_steps);
    for (int i = 0; i < timed_steps; ++i) {
      float t = 0, g = 0;
      WM_CUDA_TRY(cudaEventElapsedTime(&t, events_[2 * i], events_[2 * i + 1]));
      WM_CUDA_TRY(cudaEventElapsedTime(&g, events_[2 * i], mid_[i]));
      ms[i]  = t;
      gms[i] = g;
    }
    step_result r;
    r.ran       = true;
    r.ms        = median(ms);
    r.gather_ms = median(gms);
    if constexpr (cached) {
      wm::cache_statistics const c = e.cache_stats();
      r.hit                        = c.requests == 0 ? nan : double(c.hits) / double(c.requests);
      r.in_bytes                   = double(c.bytes_from_host) / timed_steps;
      r.out_bytes                  = double(c.write_backs) * line_bytes / timed_steps;
      std::printf(
          "cache_bench: %-10s %-8s %8.3f ms/step (gather %.3f), hit rate %.4f, in %.1f MB/step = "
          "%.1f GB/s "
          "(%.2f of H2D), out %.1f MB/step = %.1f GB/s (%.2f of D2H); requests %llu, distinct "
          "%llu, misses %llu, evictions %llu, write-backs %llu, bypasses %llu, hit-first gathers "
          "%llu\n",
          name, dist_names[d], r.ms, r.gather_ms, r.hit, r.in_bytes / 1e6, r.in_bytes / r.ms / 1e6,
          r.in_bytes / r.ms / 1e6 / res_.h2d, r.out_bytes / 1e6, r.out_bytes / r.ms / 1e6,
          r.out_bytes / r.ms / 1e6 / res_.d2h, static_cast<unsigned long long>(c.requests),
          static_cast<unsigned long long>(c.distinct_keys),
          static_cast<unsigned long long>(c.misses), static_cast<unsigned long long>(c.evictions),
          static_cast<unsigned long long>(c.write_backs),
          static_cast<unsigned long long>(c.bypasses),
          static_cast<unsigned long long>(c.hit_first_gathers));
    } else {
      std::printf("cache_bench: %-10s %-8s %8.3f ms/step (gather %.3f)\n", name, dist_names[d],
                  r.ms, r.gather_ms);
    }
    std::fflush(stdout);
    return r;
  }

  /// After flush(), the last batch gathered through the cache and straight from the host table
  /// must be equal bit for bit (dirty lines were written back). Throws otherwise.
  template <class E>
  void check_flushed(E& e, dist d) {
    cuda::stream_ref const s{stream_};
    e.flush(s);
    auto const k = keys(d, timed_steps - 1);
    e.gather(k, out_.get(), s);
    e.weights().gather(k, out2_.get(), s);
    WM_CUDA_TRY(cudaMemsetAsync(bad_.get(), 0, sizeof(unsigned long long), stream_));
    compare_kernel<<<blocks_, threads, 0, stream_>>>(
        reinterpret_cast<std::uint32_t const*>(out_.get()),
        reinterpret_cast<std::uint32_t const*>(out2_.get()), batch * dim, bad_.get());
    WM_CHECK_LAUNCH();
    unsigned long long bad = 0;
    WM_CUDA_TRY(cudaMemcpyAsync(&bad, bad_.get(), sizeof bad, cudaMemcpyDeviceToHost, stream_));
    WM_CUDA_TRY(cudaStreamSynchronize(stream_));
    if (bad != 0) {
      throw std::runtime_error{
          fmt("cache_bench: %s after flush(): %llu of %zu values of the "
              "last batch differ between the cache and the host table",
              dist_names[d], bad, batch * dim)};
    }
  }

  /// Median ms of the 100%-hits batch's gather (hot_warm gathers first; cached tables: hit rate
  /// of the timed gathers to res_.hot_hit).
  template <class E>
  double hot_gather_ms(E& e) {
    constexpr bool cached = std::is_same_v<E, cached_table>;
    cuda::stream_ref const s{stream_};
    std::span<std::int64_t const> const k{hot_.get(), batch};
    for (int i = 0; i < hot_warm; ++i) { e.gather(k, out_.get(), s); }
    WM_CUDA_TRY(cudaStreamSynchronize(stream_));
    if constexpr (cached) { e.reset_cache_stats(); }
    nvtxRangePushA(cached ? "hot_cached" : "hot_device");  // as in steps()
    double const ms = events_median_ms(hot_reps, [&] { e.gather(k, out_.get(), s); });
    nvtxRangePop();
    if constexpr (cached) {
      wm::cache_statistics const c = e.cache_stats();
      res_.hot_hit                 = c.requests == 0 ? nan : double(c.hits) / double(c.requests);
    }
    return ms;
  }

  wm::communicator& comm_;
  results& res_;
  key_rings const& keys_;
  int blocks_{};
  cudaStream_t stream_{}, stream2_{};
  cudaEvent_t events_[2 * timed_steps]{};
  cudaEvent_t mid_[timed_steps]{};  // between each timed step's gather and apply_gradients
  cudaEvent_t fork_{}, join_{};
  buffer<std::int64_t> ring_[2], hot_;
  buffer<float> grads_, out_, out2_;
  buffer<unsigned long long> bad_;
};

// ---- the WholeGraph peer ----------------------------------------------------------------------

/// Writes the rings to a temporary directory and runs bench/peers/wg_cache.py on them.
peer_result run_wg_peer(key_rings const& keys) {
  peer_result p;
  fs::path const script = wm_bench::peer_script("wg_cache.py");
  if (script.empty()) {
    p.note = "WG peer n/a: bench/peers/wg_cache.py not found (set WM_REPO)";
    return p;
  }
  std::fflush(nullptr);
  if (std::system("python3 -c 'import pylibwholegraph.torch' >/dev/null 2>&1") != 0) {
    p.note =
        "WG peer n/a: python3 cannot import pylibwholegraph.torch (PYTHONPATH and "
        "LD_LIBRARY_PATH: shared/peers/wholegraph/README.md)";
    return p;
  }
  std::string cmd = "timeout 300 python3 '" + script.string() + "' --json --steps " +
                    std::to_string(timed_steps) + " --ratios";
  for (double const r : ratios) { cmd += fmt(" %g", r); }
  if (run_peer_on_keys(cmd, {keys.keys[uniform], keys.keys[zipf]}, "wm_cache_bench", "WG peer",
                       p) &&
      p.failed) {
    p.note = "WG peer FAILED: " + p.note;
  }
  return p;
}

// ---- output -----------------------------------------------------------------------------------

std::string num(double v, char const* f) {
  return std::isnan(v) ? std::string{"n/a"} : fmt(f, v);
}

std::string verdict(bool ok, bool known) {
  return !known ? "n/a" : ok ? "ok" : "BELOW";
}

/// The WG peer's ms for a JSON key (NaN if absent).
double wg_ms(peer_result const& p, std::string const& key) {
  return p.json.empty() ? nan : json_number(p.json, key);
}

void print_table(results const& r, key_rings const& keys, peer_result const& p, double seconds) {
  std::printf(
      "== cache_bench: %s, 10M x 128 float host table, Adam, 1M fresh keys/step (ring "
      "of %d), lr %.2g (%.0f s in all)\n",
      r.gpu, ring, double(lr), seconds);
  std::printf(
      "   median of %d steps after a warm-up pass of %d; pinned copy H2D %.1f, D2H %.1f, "
      "both %.1f GB/s\n",
      timed_steps, warm_steps, r.h2d, r.d2h, r.both);
  for (int d = 0; d < 2; ++d) {
    std::printf("   %-7s: %.0f distinct rows per batch (min %zu, max %zu)\n", dist_names[d],
                keys.distinct[d], keys.distinct_min[d], keys.distinct_max[d]);
  }
  if (!p.note.empty()) { std::printf("   %s\n", p.note.c_str()); }
  if (r.error[0] != '\0') { std::printf("   wm FAILED: %s\n", r.error); }
  std::printf("%-26s %9s %9s %7s %8s %9s %9s %8s  %s\n", "case", "wm ms", "WG ms", "WG/wm",
              "hit rate", "miss GB/s", "limit ms", "wm/limit", "target");
  for (int d = 0; d < 2; ++d) {
    // device and uncached host bounds
    double const wg_dev = wg_ms(p, fmt("device_%s_ms", dist_names[d]));
    std::printf("%-26s %9s %9s %7s %8s %9s %9s %8s  %s\n", fmt("device %s", dist_names[d]).c_str(),
                num(r.device[d].ms, "%.3f").c_str(), num(wg_dev, "%.3f").c_str(),
                num(wg_dev / r.device[d].ms, "%.2fx").c_str(), "-", "-", "-", "-", "bound");
    double const u      = keys.distinct[d] * line_bytes;
    double const floor  = link_ms(r, u, u);
    double const host   = r.host[d].ms;
    double const wg_hst = wg_ms(p, fmt("host_%s_ms", dist_names[d]));
    std::string target  = fmt("floor %.2f ms: %.2f of it", floor, floor / host);
    if (d == uniform) {
      target += " (>=0.8 " + verdict(floor / host >= 0.8, !std::isnan(host)) + ")";
    }
    std::printf("%-26s %9s %9s %7s %8s %9s %9s %8s  %s\n", fmt("host %s", dist_names[d]).c_str(),
                num(host, "%.3f").c_str(), num(wg_hst, "%.3f").c_str(),
                num(wg_hst / host, "%.2fx").c_str(), "-", "-", num(floor, "%.3f").c_str(),
                num(host / floor, "%.2f").c_str(), target.c_str());
    for (int i = 0; i < n_ratios; ++i) {
      step_result const& c = r.cached[i][d];
      double const wg      = wg_ms(p, fmt("cache_%s_%g_ms", dist_names[d], ratios[i]));
      double const limit   = r.device[d].ms + link_ms(r, c.in_bytes, c.out_bytes) / link_share;
      double const miss    = (c.in_bytes + c.out_bytes) / c.ms / 1e6;
      std::string target   = "report";
      if (d == zipf && i == 1) {  // ratio 0.1
        target = "WG/wm>=5 " + verdict(wg / c.ms >= 5, !std::isnan(wg / c.ms)) + ", <=limit " +
                 verdict(c.ms <= limit, !std::isnan(c.ms / limit));
      } else if (d == uniform) {
        target = fmt("<=1.1x host (%.2fx) ", c.ms / host) +
                 verdict(c.ms <= 1.1 * host, !std::isnan(c.ms / host));
      }
      std::printf("%-26s %9s %9s %7s %8s %9s %9s %8s  %s\n",
                  fmt("cache %.2f %s", ratios[i], dist_names[d]).c_str(), num(c.ms, "%.3f").c_str(),
                  num(wg, "%.3f").c_str(), num(wg / c.ms, "%.2fx").c_str(),
                  num(c.hit, "%.4f").c_str(), num(miss, "%.1f").c_str(), num(limit, "%.3f").c_str(),
                  num(c.ms / limit, "%.2f").c_str(), target.c_str());
    }
  }
  double const hot = r.hot_device_ms / r.hot_cached_ms;
  std::printf("%-26s %9s %9s %7s %8s %9s %9s %8s  %s\n", "100% hits gather",
              num(r.hot_cached_ms, "%.3f").c_str(), "-", "-", num(r.hot_hit, "%.4f").c_str(), "-",
              num(r.hot_device_ms, "%.3f").c_str(), num(hot, "%.2f").c_str(),
              fmt("device gather / cached >=0.85 %s (%zu distinct keys; limit = device gather)",
                  verdict(hot >= 0.85, !std::isnan(hot)).c_str(), keys.hot_distinct)
                  .c_str());
  std::printf(
      "   miss GB/s = (bytes_from_host + write_backs x %zu B) / ms; limit = device step + "
      "link(in, out) / %.1f; host floor = link(U x %zu B both ways)\n",
      line_bytes, link_share, line_bytes);
  std::fflush(stdout);
}

/// ms/step against cache ratio (host rows at ratio 0, device rows at ratio 1).
bool write_csv(fs::path const& path, results const& r, peer_result const& p) {
  std::ofstream f{path};
  if (!f) { return false; }
  f << "system,dist,case,ratio,ms_per_step,hit_rate\n";
  auto const row = [&](char const* sys, int d, char const* kind, double ratio, double ms,
                       double hit) {
    f << sys << ',' << dist_names[d] << ',' << kind << ',' << fmt("%g", ratio) << ','
      << (std::isnan(ms) ? std::string{} : fmt("%.4f", ms)) << ','
      << (std::isnan(hit) ? std::string{} : fmt("%.4f", hit)) << '\n';
  };
  for (int d = 0; d < 2; ++d) {
    row("wm", d, "host", 0, r.host[d].ms, nan);
    row("wg", d, "host", 0, wg_ms(p, fmt("host_%s_ms", dist_names[d])), nan);
    for (int i = 0; i < n_ratios; ++i) {
      row("wm", d, "cached", ratios[i], r.cached[i][d].ms, r.cached[i][d].hit);
      row("wg", d, "cached", ratios[i], wg_ms(p, fmt("cache_%s_%g_ms", dist_names[d], ratios[i])),
          nan);
    }
    row("wm", d, "device", 1, r.device[d].ms, nan);
    row("wg", d, "device", 1, wg_ms(p, fmt("device_%s_ms", dist_names[d])), nan);
  }
  return static_cast<bool>(f);
}

}  // namespace

int main(int argc, char** argv) {
  wm_bench::set_environment();
  auto const t0 = clock_type::now();
  fs::path csv;
  bool peer = true;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--csv") == 0 && i + 1 < argc) {
      csv = argv[++i];
    } else if (std::strcmp(argv[i], "--no-peer") == 0) {
      peer = false;
    } else {
      std::fprintf(stderr, "cache_bench: usage: cache_bench [--csv PATH] [--no-peer]; got '%s'\n",
                   argv[i]);
      return 2;
    }
  }
  if (csv.empty()) {
    char const* out = std::getenv("OUT");
    csv = out != nullptr && *out != '\0' ? fs::path{out} / "cache_bench.csv" : "cache_bench.csv";
  }
  int const gpus = wm::local_device_count();  // before any CUDA call in this process
  if (gpus == 0) {
    std::printf("cache_bench: no GPU found, nothing to measure\n");
    return 0;
  }
  results* const shared = wm_bench::shared_results<results>("cache_bench");
  if (shared == nullptr) { return 1; }
  results& res         = *shared;
  key_rings const keys = make_keys();  // host only; the forked rank inherits them
  std::printf("cache_bench: rings made (%.1f s)\n",
              std::chrono::duration<double>(clock_type::now() - t0).count());
  std::fflush(stdout);
  bool failed = false;
  try {
    wm::launch_options options;
    options.timeout = std::chrono::seconds{480};  // expected: about two minutes
    wm::launch(
        1,
        [&](wm::communicator& comm) {
          bench b{comm, res, keys};
          b.copy_limits();
          // A failed case is reported and the next one still runs.
          auto const guarded = [&](char const* what, auto const& run) {
            try {
              run();
            } catch (std::exception const& e) {
              std::fprintf(stderr, "cache_bench: %s: %s\n", what, e.what());
              std::size_t const used = std::strlen(res.error);
              std::snprintf(res.error + used, sizeof res.error - used, "%s%s: %s",
                            used == 0 ? "" : "; ", what, e.what());
            }
          };
          guarded("device table", [&] { b.device_cases(); });
          guarded("host table", [&] { b.host_cases(); });
          for (int r = 0; r < n_ratios; ++r) {
            guarded(fmt("cache %.2f", ratios[r]).c_str(), [&] { b.cached_cases(r); });
          }
        },
        options);
  } catch (std::exception const& e) {
    std::fprintf(stderr, "cache_bench: %s\n", e.what());
    if (res.error[0] == '\0') { std::snprintf(res.error, sizeof res.error, "%s", e.what()); }
    failed = true;
  }
  failed = failed || res.error[0] != '\0';
  peer_result p;
  if (peer) {
    p = run_wg_peer(keys);
  } else {
    p.note = "WG peer n/a: --no-peer";
  }
  print_table(res, keys, p, std::chrono::duration<double>(clock_type::now() - t0).count());
  if (write_csv(csv, res, p)) {
    std::printf("cache_bench: CSV written to %s\n", csv.string().c_str());
  } else {
    std::printf("cache_bench: FAILED to write the CSV %s\n", csv.string().c_str());
    failed = true;
  }
  return failed || p.failed ? 1 : 0;
}
