// SPDX-License-Identifier: Apache-2.0
// Probe: where a host gather's time goes beyond its floor: the plan (sort, run select), the reads,
// and the plan with 32-bit keys and positions. Pinned host table of 512 B rows; the four cases of
// gather_bench (e): 10M rows with 1M uniform and 1M Zipf(1.05) keys, 2M rows with 4M uniform keys,
// 16M rows with 4M uniform keys.
// Floor = distinct rows x 512 B / pinned H2D cudaMemcpyAsync of 1 GiB (same run).
// Variants (every output row checked on the device once before timing):
//   plan1         plan_distinct alone (sort of (key, 64-bit position), run select, head scan)
//   read1         read_distinct on a ready plan (long runs first, then the short runs with the
//                 long runs' copies woven in; 8 blocks per SM; read32 woven/b: b blocks)
//   one-sort      plan_distinct + read_distinct (the host gather since this probe; 64-bit plan)
//   plan32, read32, narrow   the same with keys and positions narrowed to 32 bits
//   plan32+read32, plan1+read32  a fresh plan made, then the kept one read
//   (the variants "read32 serial", "short only", "long+rep alone" and "long first" of the NOTES
//   tables measured the kernel this change removed; they are in this file at 3f4517a)
//   pure heads               the plan's distinct rows read into consecutive rows, a warp each
// Timing: 2 warm-ups, then 10 runs each between CUDA events; the median.
//
// Standalone, not in CMake:
//   nvcc -std=c++20 -O3 -arch=sm_90 --expt-relaxed-constexpr -Iinclude \
//        bench/probes/host_gather_probe.cu -o probe
//
// Results and what they mean: bench/NOTES.md, "Host gathers: the 32-bit plan".
#include <wm/detail/rows/distinct.cuh>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "../keys.hpp"
#include "check.cuh"

namespace {

constexpr std::size_t row_bytes = 512;
constexpr std::size_t row_words = row_bytes / 4;

__global__ void fill_kernel(std::uint32_t* table, std::size_t words) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < words;
       i += std::size_t{gridDim.x} * blockDim.x) {
    table[i] = static_cast<std::uint32_t>(i * 2654435761u);
  }
}

// Counts output words that differ from the table's word of their key's row.
__global__ void check_kernel(std::uint32_t const* out, std::int64_t const* keys, std::size_t n,
                             unsigned long long* bad) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n * row_words;
       i += std::size_t{gridDim.x} * blockDim.x) {
    std::size_t const r = i / row_words, w = i % row_words;
    auto const want = static_cast<std::uint32_t>(
        (static_cast<std::size_t>(keys[r]) * row_words + w) * 2654435761u);
    if (out[i] != want) { atomicAdd(bad, 1ull); }
  }
}

// Reads the run heads' rows of a narrow plan into consecutive device rows: a warp per row, 16 B
// per lane, ld.cv (host_rows_load_probe's reader on the plan's rows).
__global__ void pure_kernel(uint4 const* host, uint4* out, std::uint32_t const* keys,
                            std::uint32_t const* run_begin, std::uint32_t const* runs) {
  int const lane       = threadIdx.x % 32;
  std::size_t const w  = (blockIdx.x * std::size_t{blockDim.x} + threadIdx.x) / 32;
  std::size_t const nw = std::size_t{gridDim.x} * blockDim.x / 32;
  std::size_t const n  = *runs;
  for (std::size_t r = w; r < n; r += nw) {
    std::uint32_t const k            = keys[run_begin[r]];
    out[r * (row_bytes / 16) + lane] = __ldcv(host + std::size_t{k} * (row_bytes / 16) + lane);
  }
}

struct timer {
  cudaEvent_t a{}, b{};
  timer() {
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
  }
  float time(cudaStream_t s, std::function<void()> const& f) {
    for (int w = 0; w < 2; ++w) { f(); }
    std::vector<float> ms;
    for (int r = 0; r < 10; ++r) {
      CK(cudaEventRecord(a, s));
      f();
      CK(cudaEventRecord(b, s));
      CK(cudaEventSynchronize(b));
      float t = 0;
      CK(cudaEventElapsedTime(&t, a, b));
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  }
};

}  // namespace

int main(int argc, char** argv) {
  // Optional: the index of the one case to run (0-3).
  int const only = argc > 1 ? std::atoi(argv[1]) : -1;
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::size_t const max_rows = 16'000'000, max_keys = 4'000'000;
  std::byte* table = nullptr;
  CK(cudaHostAlloc(reinterpret_cast<void**>(&table), max_rows * row_bytes, cudaHostAllocMapped));
  std::byte *out = nullptr, *dev_gib = nullptr;
  std::int64_t* keys      = nullptr;
  unsigned* err           = nullptr;
  unsigned long long* bad = nullptr;
  CK(cudaMalloc(&out, max_keys * row_bytes));
  CK(cudaMalloc(&dev_gib, std::size_t{1} << 30));
  CK(cudaMalloc(&keys, max_keys * sizeof(std::int64_t)));
  CK(cudaMalloc(&err, sizeof(unsigned)));
  CK(cudaMalloc(&bad, sizeof(unsigned long long)));
  CK(cudaMemset(err, 0, sizeof(unsigned)));
  fill_kernel<<<prop.multiProcessorCount * 8, 256>>>(reinterpret_cast<std::uint32_t*>(table),
                                                     max_rows * row_words);
  CK(cudaDeviceSynchronize());
  cudaStream_t s{};
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  timer tm;
  wm::detail::workspace ws;
  wm::detail::workspace ws2;  // plans made beside the one kept in ws

  auto const h2d = [&] {
    float const ms = tm.time(s, [&] {
      CK(cudaMemcpyAsync(dev_gib, table, std::size_t{1} << 30, cudaMemcpyHostToDevice, s));
    });
    return double(std::size_t{1} << 30) / ms / 1e6;
  };
  double const h2d_before = h2d();
  std::printf("probe: %s, %d SMs; pinned H2D 1 GiB %.2f GB/s\n", prop.name,
              prop.multiProcessorCount, h2d_before);

  struct gather_case {
    char const* label;
    std::size_t rows, n;
    bool zipf;
  };
  std::vector<gather_case> const cases{{"10M rows, 1M uniform", 10'000'000, 1'000'000, false},
                                       {"10M rows, 1M Zipf(1.05)", 10'000'000, 1'000'000, true},
                                       {"2M rows, 4M uniform", 2'000'000, 4'000'000, false},
                                       {"16M rows, 4M uniform", 16'000'000, 4'000'000, false}};
  std::printf("%-26s %-16s %9s %9s %8s\n", "case", "variant", "ms", "floor ms", "t/floor");
  bool ok = true;
  for (std::size_t ci = 0; ci < cases.size(); ++ci) {
    if (only >= 0 && static_cast<std::size_t>(only) != ci) { continue; }
    auto const& gc = cases[ci];
    std::vector<std::int64_t> hk(gc.n);
    if (gc.zipf) {
      wm_bench::zipf_keys(hk, wm_bench::zipf_cdf(gc.rows, 1.05), 7368787, 11);
    } else {
      wm_bench::uniform_keys(hk, gc.rows, 5 + gc.rows);
    }
    std::size_t const distinct = wm_bench::distinct_count(hk);
    CK(cudaMemcpy(keys, hk.data(), gc.n * sizeof(std::int64_t), cudaMemcpyHostToDevice));
    double const floor_ms = double(distinct * row_bytes) / h2d_before / 1e6;
    wm::detail::local_rows const rows{table, gc.rows, row_bytes};
    wm::detail::packed_rows const dst{out, row_bytes};
    int const bits      = wm::detail::row_bits(gc.rows);
    auto const one_sort = [&] {
      auto const b = wm::detail::plan_distinct(keys, gc.n, bits, ws, s);
      wm::detail::read_distinct(rows, b, static_cast<std::size_t const*>(nullptr), dst, row_bytes,
                                row_bytes, err, s, true);
    };
    auto const narrow = [&] {
      auto const b = wm::detail::plan_distinct_narrow(keys, gc.n, gc.rows, ws, s);
      wm::detail::read_distinct(rows, b, static_cast<std::size_t const*>(nullptr), dst, row_bytes,
                                row_bytes, err, s, true);
    };
    auto const report = [&](char const* variant, std::function<void()> const& f, bool check) {
      if (check) {
        CK(cudaMemsetAsync(out, 0xff, gc.n * row_bytes, s));
        f();
        CK(cudaMemsetAsync(bad, 0, sizeof(unsigned long long), s));
        check_kernel<<<prop.multiProcessorCount * 8, 256, 0, s>>>(
            reinterpret_cast<std::uint32_t const*>(out), keys, gc.n, bad);
        unsigned long long nbad = 0;
        unsigned e              = 0;
        CK(cudaMemcpyAsync(&nbad, bad, sizeof nbad, cudaMemcpyDeviceToHost, s));
        CK(cudaMemcpyAsync(&e, err, sizeof e, cudaMemcpyDeviceToHost, s));
        CK(cudaStreamSynchronize(s));
        if (nbad != 0 || e != 0) {
          std::printf("CHECK FAILED %s %s: %llu bad words, err %u\n", gc.label, variant, nbad, e);
          ok = false;
        }
      }
      float const ms = tm.time(s, f);
      std::printf("%-26s %-16s %9.3f %9.3f %8.3f\n", gc.label, variant, ms, floor_ms,
                  ms / floor_ms);
    };
    std::printf("%-26s distinct rows %zu\n", gc.label, distinct);
    report(
        "plan1", [&] { (void)wm::detail::plan_distinct(keys, gc.n, bits, ws, s); }, false);
    {
      auto const b = wm::detail::plan_distinct(keys, gc.n, bits, ws, s);
      report(
          "read1",
          [&] {
            wm::detail::read_distinct(rows, b, static_cast<std::size_t const*>(nullptr), dst,
                                      row_bytes, row_bytes, err, s, true);
          },
          false);
    }
    report("one-sort", one_sort, true);
    report(
        "plan32", [&] { (void)wm::detail::plan_distinct_narrow(keys, gc.n, gc.rows, ws, s); },
        false);
    {
      auto const b = wm::detail::plan_distinct_narrow(keys, gc.n, gc.rows, ws, s);
      report(
          "read32",
          [&] {
            wm::detail::read_distinct(rows, b, static_cast<std::size_t const*>(nullptr), dst,
                                      row_bytes, row_bytes, err, s, true);
          },
          false);
      for (int bps : {2, 4}) {
        std::string const name = "read32 woven/" + std::to_string(bps);
        report(
            name.c_str(),
            [&] {
              wm::detail::read_distinct(rows, b, static_cast<std::size_t const*>(nullptr), dst,
                                        row_bytes, row_bytes, err, s, true, bps);
            },
            false);
      }
      // A fresh plan made (beside the kept one), then the kept one read: what the plan's run
      // costs the reads after it.
      auto const* no_order = static_cast<std::size_t const*>(nullptr);
      std::pair<char const*, std::function<void()>> const plans[] = {
          {"plan32+read32",
           [&] { (void)wm::detail::plan_distinct_narrow(keys, gc.n, gc.rows, ws2, s); }},
          {"plan1+read32", [&] { (void)wm::detail::plan_distinct(keys, gc.n, bits, ws2, s); }}};
      for (auto const& [name, plan] : plans) {
        report(
            name,
            [&] {
              plan();
              wm::detail::read_distinct(rows, b, no_order, dst, row_bytes, row_bytes, err, s, true);
            },
            false);
      }
      report(
          "pure heads",
          [&] {
            pure_kernel<<<prop.multiProcessorCount * 2, 256, 0, s>>>(
                reinterpret_cast<uint4 const*>(table), reinterpret_cast<uint4*>(out), b.keys,
                b.run_begin, b.runs);
          },
          false);
    }
    report("narrow", narrow, true);
  }
  std::printf("pinned H2D 1 GiB at the end %.2f GB/s\n", h2d());
  std::printf(ok ? "checks passed\n" : "CHECKS FAILED\n");
  return ok ? 0 : 1;
}
