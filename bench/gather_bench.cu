// SPDX-License-Identifier: Apache-2.0
/*
 * gather_bench: wm::tensor::gather_async on device and host tables, each next to a limit measured
 * in the same run, and the PyTorch peer (bench/peers/torch_gather.py) on the same sizes.
 *
 * Rows are 128 float (512 B). Indices are uniform random int64 made on the device (a hash of the
 * position, seeded per rank and case). Bytes counted: output bytes = indices x 512 B (each row read
 * once and written once); "r+w" counts both. 10M and 4M are decimal (10,000,000 / 4,000,000 rows).
 * R = the rank count of (b), (c), (d): every GPU present, or N with `gather_bench --ranks N`
 * (exit status 2 if N is not between 1 and the GPUs present); (b) and (d) need R >= 2.
 *
 * (a) 1 GPU (wm::launch(1)): tensor<float, device, continuous> of 10M rows (5.12 GB), 4M indices
 *     (2.05 GB out). Figure: output GB/s and r+w GB/s. Limit: cudaMemcpyAsync device-to-device of
 *     2 GiB, counted read+write. Targets: r+w >= 0.85 x copy; output GB/s >= 2 x torch.index_select
 *     (peer, same sizes).
 * (b) R GPUs: device tensors of 10M rows over the R ranks, layouts continuous / chunked /
 *     distributed; each rank gathers 4M indices at the same time. Floor: the bytes of the output
 *     rows other ranks own (counted exactly from the indices with t.locate; about (R-1)/R of
 *     them) / the peer-copy bandwidth (cudaMemcpyAsync of the next rank's 2 GiB part of a
 *     chunked.device memory, every rank copying at once, so each GPU sends and receives one
 *     copy). The gather reads from all R-1 peers, the copy from one: with NVSwitch (HGX) a GPU's
 *     NVLink bandwidth is the same whichever peers it reads, but where GPUs are linked directly
 *     one peer's links carry only part of it and this floor is too long (the ratio flatters).
 *     Ratio = floor / time: target >= 0.80 for the mapped layouts; reported only for distributed
 *     (NCCL all-to-all). Local rows and output writes are not counted.
 * (c) host: tensor<float, host, chunked> of 2M rows (1 GiB) and of 16M rows (8 GiB); each rank
 *     gathers 4M indices at once. Limit: pinned host-to-device cudaMemcpyAsync of 1 GiB, all ranks
 *     at once. 1 GiB target: output GB/s >= 0.80 x that copy. 8 GiB target: >= 2 x a plain kernel
 *     (one warp per output row, 16 B per lane, no unrolling, the same unsorted indices); wm's time
 *     includes the sort it does for long host batches.
 * (d) R GPUs: distributed tensor of 10M rows, 1M indices per rank at once. Figure: ms per lookup
 *     and output GB/s. Peer: the model-parallel lookup a PyTorch user writes with
 *     all_to_all_single (R processes, NCCL: `torch_gather.py --world R`). Target: wm >= 3 x
 *     faster. Limit, reported: NCCL alone moving the rows such a batch takes from the other
 *     ranks (keys / R rows of 512 B from each peer, grouped send/recv, every rank at once).
 *     Reported too, to show where the time goes: the same lookup with keys of this rank's rows
 *     only (no rows cross) and with keys of other ranks' rows only (every row crosses), and the
 *     lookup with its rows through NCCL (WM_DISPATCH_ROWS=nccl: the path across nodes) instead
 *     of the mailboxes that ranks of one node use, and with the rows stored into the mailboxes
 *     by the gather kernels (WM_DISPATCH_ROWS=put) instead of moved there by the copy engines.
 *     On one GPU too: the distributed lookup of 1M keys on a 1-rank communicator against the
 *     continuous layout's gather of the same keys (what the dispatch costs when nothing crosses).
 * (e) 1 GPU, host tables (pinned, tensor<float, host, continuous>) whose gathers read each
 *     distinct row once: 10M rows with 1M uniform keys and 1M Zipf(1.05) keys (exact discrete
 *     Zipf over ranks 1..10M by inverse CDF, rank k-1 scattered to row (k-1) * 7368787 mod 10M,
 *     as embedding_bench), and 4M uniform keys over 2M rows (1 GiB) and over 16M rows (8 GiB).
 *     Keys are made on the host before any rank starts. Floor = distinct rows x 512 B / the pinned
 *     host-to-device copy bandwidth of this GPU alone (1 GiB, measured in the same launch);
 *     target: time <= 1.1 x floor. Peer: WholeGraph's host gather (bench/peers/wg_gather.py,
 *     chunked host embedding, the very same keys through temporary files), run when python3
 *     imports pylibwholegraph.torch (PYTHONPATH set by the caller), "n/a" otherwise.
 *
 * Each case is checked once before timing (output poisoned; every output element compared on the
 * device with the pattern of its global row, 4096 rows again on the host; throws if wrong), then
 * timed: 2 warm-ups, a barrier, 10 runs back to back with CUDA events on each rank's stream, the
 * median. With several ranks every rank runs the case at once; the figure is the slowest rank's
 * (max over ranks of the per-rank medians), the limit the slowest rank's. The launcher process
 * never touches CUDA; rank 0 of each launch writes its numbers into memory shared with it. Then,
 * if python3 imports torch, the peer runs (found through $WM_REPO, the source tree this was built
 * from, or ../../bench/peers beside the executable) and prints one JSON line. Output ends with
 * one table.
 */
#include <wm/tensor.cuh>

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
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.cuh"

namespace {

namespace fs = std::filesystem;
using wm_bench::fmt;
using wm_bench::json_number;

constexpr std::size_t gib        = std::size_t{1} << 30;
constexpr std::size_t cols       = 128;
constexpr std::size_t row_bytes  = cols * sizeof(float);
constexpr std::size_t table_rows = 10'000'000;             // (a), (b), (d)
constexpr std::size_t batch      = 4'000'000;              // indices per rank in (a), (b), (c)
constexpr std::size_t keys       = 1'000'000;              // indices per rank in (d)
constexpr std::size_t host_small = std::size_t{2} << 20;   // rows: 1 GiB
constexpr std::size_t host_large = std::size_t{16} << 20;  // rows: 8 GiB
constexpr std::size_t check_rows = 4096;
constexpr std::size_t e_keys     = 1'000'000;  // (e) keys over the 10M-row host table
constexpr double zipf_alpha      = 1.05;
constexpr std::uint64_t scatter  = 7'368'787;  // odd, not a multiple of 5: a bijection mod 10M
constexpr int warmups            = 2;
constexpr int reps               = 10;
constexpr int threads            = 256;
constexpr double nan             = std::numeric_limits<double>::quiet_NaN();

__host__ __device__ constexpr std::uint64_t mix(std::uint64_t x)  // splitmix64 finalizer
{
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/// Element (row, col) of every table: a 24-bit integer, exact in float.
__host__ __device__ constexpr float pattern(std::uint64_t row, std::size_t col) {
  return static_cast<float>(mix(row * cols + col) >> 40);
}

__global__ void fill_kernel(wm::matrix_view<float> v, std::size_t first_row) {
  std::size_t const n = v.rows * cols;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    v(i / cols, i % cols) = pattern(first_row + i / cols, i % cols);
  }
}

/// Keys drawn from the @p count rows that start at @p first (wrapping at @p rows).
struct key_range {
  std::size_t first{0};
  std::size_t count{0};  // 0: every row
};

__global__ void random_kernel(std::int64_t* idx, std::size_t n, std::size_t rows,
                              std::uint64_t seed, key_range range) {
  std::size_t const count = range.count == 0 ? rows : range.count;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    idx[i] = static_cast<std::int64_t>((range.first + mix(mix(seed) + i) % count) % rows);
  }
}

/// Counts in @p bad the output elements that differ from the pattern of their row.
__global__ void check_kernel(float const* out, std::int64_t const* idx, std::size_t n,
                             unsigned long long* bad) {
  unsigned long long wrong = 0;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n * cols;
       i += std::size_t{gridDim.x} * blockDim.x) {
    wrong += out[i] != pattern(static_cast<std::uint64_t>(idx[i / cols]), i % cols) ? 1 : 0;
  }
  if (wrong != 0) { atomicAdd(bad, wrong); }
}

/// The plain gather: one warp per output row, each lane copies 16 B, no unrolling.
__global__ void plain_gather_kernel(std::byte const* table, std::int64_t const* idx, std::size_t n,
                                    std::byte* out) {
  std::size_t const t = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x;
  std::size_t const i = t / 32;
  if (i >= n) { return; }
  auto const* src =
      reinterpret_cast<uint4 const*>(table + static_cast<std::size_t>(idx[i]) * row_bytes);
  reinterpret_cast<uint4*>(out + i * row_bytes)[t % 32] = src[t % 32];
}

struct cuda_free {
  bool host{};
  void operator()(void* p) const noexcept { (void)(host ? cudaFreeHost(p) : cudaFree(p)); }
};
template <class T>
using buffer = std::unique_ptr<T[], cuda_free>;

/// n elements of T in device memory (or in pinned host memory).
template <class T>
buffer<T> allocate(std::size_t n, bool host = false) {
  void* p                 = nullptr;
  std::size_t const bytes = std::max<std::size_t>(n, 1) * sizeof(T);
  WM_CUDA_TRY(host ? cudaMallocHost(&p, bytes) : cudaMalloc(&p, bytes));
  return buffer<T>{static_cast<T*>(p), cuda_free{host}};
}

/// What rank 0 of each launch hands to main, in memory shared with it.
struct results {
  char gpu[256]{};
  int ranks{0};
  double a_ms{nan}, copy_gbps{nan};  // (a) gather; D2D copy, read+write
  double d_one_ms{nan},
      d_one_direct_ms{nan};  // (d) on one rank: distributed; continuous, same keys
  double peer_gbps{nan};     // (b) peer copy, slowest rank
  struct layout_figures {
    double r0_ms{nan}, max_ms{nan}, bound_ms{nan};
  } b[3];                // (b) continuous, chunked, distributed
  double h2d_gbps{nan};  // (c) pinned H2D copy, slowest rank
  double c_small_ms{nan}, c_large_ms{nan}, c_plain_ms{nan};
  double d_ms{nan}, d_r0_ms{nan};
  double d_nccl_ms{nan};                   // (d) limit: NCCL moving a uniform batch's remote rows
  double d_own_ms{nan}, d_remote_ms{nan};  // (d) keys of this rank's rows only / of others' only
  double d_via_nccl_ms{nan};               // (d) with the rows through NCCL (WM_DISPATCH_ROWS=nccl)
  double d_via_put_ms{nan};  // (d) rows stored into the mailboxes by kernels (WM_DISPATCH_ROWS=put)
  double e_h2d_gbps{nan};    // (e) pinned H2D copy, one GPU alone
  double e_ms[4]{nan, nan, nan, nan};  // (e) per host case (see host_cases)
};

// ---- (e) host cases: keys made on the host before any rank starts ---------------------------

/// One (e) case: its table and keys.
struct host_case {
  char const* name;   // the peer's JSON key (name + "_ms") and key file
  char const* label;  // for the table
  std::size_t rows;
  std::vector<std::int64_t> keys;
  std::size_t distinct{};
};

std::vector<std::int64_t> uniform_keys(std::size_t n, std::size_t rows, std::uint64_t seed) {
  std::vector<std::int64_t> k(n);
  for (std::size_t i = 0; i < n; ++i) {
    k[i] = static_cast<std::int64_t>(mix(mix(seed) + i) % rows);
  }
  return k;
}

/// Exact discrete Zipf(zipf_alpha) over ranks 1..rows (inverse CDF: binary search in the
/// cumulative sums of k^-alpha), rank k-1 scattered to row (k-1) * scatter mod rows.
std::vector<std::int64_t> zipf_keys(std::size_t n, std::size_t rows, std::uint64_t seed) {
  std::vector<double> cdf(rows);
  double sum = 0;
  for (std::size_t r = 0; r < rows; ++r) {
    cdf[r] = sum += std::pow(static_cast<double>(r + 1), -zipf_alpha);
  }
  std::vector<std::int64_t> k(n);
  for (std::size_t i = 0; i < n; ++i) {
    double const u = (static_cast<double>(mix(mix(seed) + i) >> 11) + 0.5) * 0x1p-53 * cdf.back();
    auto const r =
        static_cast<std::uint64_t>(std::upper_bound(cdf.begin(), cdf.end(), u) - cdf.begin());
    k[i] = static_cast<std::int64_t>(std::min<std::uint64_t>(r, rows - 1) * scatter % rows);
  }
  return k;
}

std::size_t distinct_of(std::vector<std::int64_t> keys) {
  std::sort(keys.begin(), keys.end());
  return static_cast<std::size_t>(std::unique(keys.begin(), keys.end()) - keys.begin());
}

std::vector<host_case> host_cases() {
  std::vector<host_case> c;
  c.push_back({"uniform_1m_of_10m", "10M rows, 1M uniform", table_rows,
               uniform_keys(e_keys, table_rows, 1000)});
  c.push_back({"zipf_1m_of_10m", "10M rows, 1M Zipf(1.05)", table_rows,
               zipf_keys(e_keys, table_rows, 2000)});
  c.push_back({"uniform_4m_of_2m", "2M rows (1 GiB), 4M uniform", host_small,
               uniform_keys(batch, host_small, 3000)});
  c.push_back({"uniform_4m_of_16m", "16M rows (8 GiB), 4M uniform", host_large,
               uniform_keys(batch, host_large, 4000)});
  for (auto& x : c) { x.distinct = distinct_of(x.keys); }
  return c;
}

/// Per-rank figures of one case, exchanged with comm.all_gather.
struct rank_figures {
  double ms{nan};
  double plain_ms{nan};
  double bound_ms{nan};
  std::size_t remote{};  // output rows owned by another rank
};

/// One rank's state; every public member function is collective.
class bench {
  results own_;  // where ranks other than 0 write

 public:
  results& res;  ///< the figures, once every rank has its own

  /// Rank 0 writes its figures to @p out; the other ranks to their own copy.
  bench(wm::communicator& comm, results& out) : res{comm.rank() == 0 ? out : own_}, comm_{comm} {
    int sms = 0;
    WM_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, comm.device()));
    blocks_ = 8 * sms;
    WM_CUDA_TRY(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    WM_CUDA_TRY(cudaMalloc(&scratch_, sizeof(unsigned long long)));
    for (auto& e : events_) { WM_CUDA_TRY(cudaEventCreate(&e)); }
    cudaDeviceProp prop{};
    WM_CUDA_TRY(cudaGetDeviceProperties(&prop, comm.device()));
    std::snprintf(res.gpu, sizeof res.gpu, "%s", prop.name);
    res.ranks = comm.size();
  }
  bench(bench const&)            = delete;
  bench& operator=(bench const&) = delete;
  ~bench() {
    (void)cudaStreamSynchronize(stream_);
    for (auto e : events_) { (void)cudaEventDestroy(e); }
    (void)cudaFree(scratch_);
    (void)cudaStreamDestroy(stream_);
  }

  /// (a) on a 1-rank communicator: the gather, then the device copy limit.
  void single_gpu() {
    {
      wm::tensor<float, wm::device, wm::continuous> t{comm_, table_rows, cols};
      fill(t);
      res.a_ms            = gather_case(t, batch, 1).ms;
      res.d_one_direct_ms = gather_case(t, keys, 2).ms;
    }
    {
      // What the dispatch costs where nothing crosses: plan, count exchange, own rows by order.
      wm::tensor<float, wm::device, wm::distributed> t{comm_, table_rows, cols};
      fill(t);
      res.d_one_ms = gather_case(t, keys, 2).ms;
    }
    auto const src = allocate<std::byte>(2 * gib), dst = allocate<std::byte>(2 * gib);
    WM_CUDA_TRY(cudaMemsetAsync(src.get(), 0x5A, 2 * gib, stream_));
    res.copy_gbps = 2 * copy_gbps(dst.get(), src.get(), 2 * gib, cudaMemcpyDeviceToDevice);
  }

  /// (b) limit: every rank copies the next rank's 2 GiB part at the same time.
  void peer_copy() {
    wm::memory<wm::device, wm::chunked> mem{comm_, 2 * gib * comm_.size(), row_bytes};
    auto const local = mem.local_view();
    WM_CUDA_TRY(cudaMemsetAsync(local.data, 0x5A, local.bytes(), stream_));
    WM_CUDA_TRY(cudaStreamSynchronize(stream_));
    comm_.barrier();
    int const peer      = (comm_.rank() + 1) % comm_.size();
    std::size_t const n = mem.byte_range(peer).size();
    std::byte const* src =
        wm_bench::entry_address(mem.chunked_view(), mem.entry_range(peer).begin, scratch_, stream_);
    auto const dst = allocate<std::byte>(n);
    peer_gbps_     = copy_gbps(dst.get(), src, n, cudaMemcpyDeviceToDevice);
    res.peer_gbps  = min_over_ranks(peer_gbps_);
    comm_.barrier();  // every peer part stays alive until every copy is done
  }

  /// (b) for one layout (slot 0, 1, 2); for distributed also (d), on the same table.
  template <class Layout>
  void multi_gpu(int slot) {
    wm::tensor<float, wm::device, Layout> t{comm_, table_rows, cols};
    fill(t);
    auto mine      = gather_case(t, batch, 100 + slot);
    mine.bound_ms  = double(mine.remote * row_bytes) / peer_gbps_ / 1e6;
    auto const all = comm_.all_gather(mine);
    res.b[slot] = {all[0].ms, max_of(all, &rank_figures::ms), max_of(all, &rank_figures::bound_ms)};
    if constexpr (std::same_as<Layout, wm::distributed>) {
      auto const d  = comm_.all_gather(gather_case(t, keys, 200));
      res.d_r0_ms   = d[0].ms;
      res.d_ms      = max_of(d, &rank_figures::ms);
      auto const n  = comm_.all_gather(nccl_rows_ms());
      res.d_nccl_ms = *std::max_element(n.begin(), n.end());
      // Where the time goes: the same lookup with only this rank's rows, then only others'.
      auto const own       = t.storage().local_entry_range();
      auto const size      = own.end - own.begin;
      auto const mine_only = comm_.all_gather(gather_case(t, keys, 210, false, {own.begin, size}));
      auto const others =
          comm_.all_gather(gather_case(t, keys, 220, false, {own.end, table_rows - size}));
      res.d_own_ms    = max_of(mine_only, &rank_figures::ms);
      res.d_remote_ms = max_of(others, &rank_figures::ms);
      // The path taken across nodes or without peer access: rows through NCCL, not mailboxes;
      // and rows stored into the mailboxes by the gather kernels instead of the copy engines. A
      // tensor takes its path at its first gather.
      res.d_via_nccl_ms = other_path("nccl", wm::row_path::nccl, 230);
      res.d_via_put_ms  = other_path("put", wm::row_path::put, 240);
    }
  }

  /// (d) the lookup on a fresh tensor with WM_DISPATCH_ROWS=@p how (see wm/tensor.cuh); NaN
  /// when the tensor took another path (no peer access: the mailboxes fall back to NCCL).
  double other_path(char const* how, wm::row_path want, int slot) {
    std::optional<std::string> const before =
        std::getenv("WM_DISPATCH_ROWS") != nullptr
            ? std::optional<std::string>{std::getenv("WM_DISPATCH_ROWS")}
            : std::nullopt;
    if (::setenv("WM_DISPATCH_ROWS", how, 1) != 0) { throw std::runtime_error{"setenv failed"}; }
    struct restore {
      std::optional<std::string> const& v;
      ~restore() {
        v ? (void)::setenv("WM_DISPATCH_ROWS", v->c_str(), 1)
          : (void)::unsetenv("WM_DISPATCH_ROWS");
      }
    } const put_back{before};
    wm::tensor<float, wm::device, wm::distributed> t{comm_, table_rows, cols};
    fill(t);
    double const ms = max_of(comm_.all_gather(gather_case(t, keys, slot)), &rank_figures::ms);
    return t.gather_path() == want ? ms : nan;
  }

  /// (d) limit: ms for NCCL alone to move the rows a uniform batch of `keys` takes from other
  /// ranks (keys / R rows of 512 B from each peer, every rank at once, grouped send/recv).
  double nccl_rows_ms() {
    auto const r        = static_cast<std::size_t>(comm_.size());
    std::size_t const b = keys / r * row_bytes;
    auto const send = allocate<std::byte>(b * r), recv = allocate<std::byte>(b * r);
    std::vector<std::size_t> counts(r, b);
    counts[static_cast<std::size_t>(comm_.rank())] = 0;
    std::span<std::size_t const> const c{counts};
    return median_ms([&] { comm_.all_to_all_v(send.get(), c, recv.get(), c, sref()); });
  }

  /// (c) limit: every rank copies 1 GiB of pinned host memory to its GPU at the same time.
  void pinned_h2d() {
    auto const src = allocate<std::byte>(gib, true), dst = allocate<std::byte>(gib);
    std::memset(src.get(), 0x5A, gib);
    res.h2d_gbps = min_over_ranks(copy_gbps(dst.get(), src.get(), gib, cudaMemcpyHostToDevice));
  }

  /// (e) on a 1-rank communicator: this GPU's pinned copy limit, then each host case.
  void host_distinct(std::vector<host_case> const& cases) {
    pinned_h2d();
    res.e_h2d_gbps = res.h2d_gbps;
    for (std::size_t i = 0; i < cases.size(); ++i) {
      if (i > 0 && cases[i].rows == cases[i - 1].rows) { continue; }  // same table: below
      wm::tensor<float, wm::host, wm::continuous> t{comm_, cases[i].rows, cols};
      fill(t);
      for (std::size_t j = i; j < cases.size() && cases[j].rows == cases[i].rows; ++j) {
        res.e_ms[j] = keys_case(t, cases[j].keys).ms;
      }
    }
  }

  /// (c) one host table; the large one also runs the plain kernel.
  void host_table(std::size_t rows) {
    bool const large = rows == host_large;
    wm::tensor<float, wm::host, wm::chunked> t{comm_, rows, cols};
    fill(t);
    auto const all = comm_.all_gather(gather_case(t, batch, large ? 300 : 400, large));
    (large ? res.c_large_ms : res.c_small_ms) = max_of(all, &rank_figures::ms);
    if (large) { res.c_plain_ms = max_of(all, &rank_figures::plain_ms); }
  }

 private:
  static double max_of(std::vector<rank_figures> const& v, double rank_figures::*field) {
    double m = 0;
    for (auto const& r : v) { m = std::max(m, r.*field); }
    return m;
  }

  double min_over_ranks(double x) {
    auto const all = comm_.all_gather(x);
    return *std::min_element(all.begin(), all.end());
  }

  /// This rank's GB/s of cudaMemcpyAsync of @p n bytes (every rank copying at the same time).
  double copy_gbps(void* dst, void const* src, std::size_t n, cudaMemcpyKind kind) {
    double const ms = median_ms([&] { WM_CUDA_TRY(cudaMemcpyAsync(dst, src, n, kind, stream_)); });
    return double(n) / ms / 1e6;
  }

  [[nodiscard]] cuda::stream_ref sref() const noexcept { return cuda::stream_ref{stream_}; }

  /// Writes the pattern into this rank's rows (local row l is global row begin + l).
  template <class Tensor>
  void fill(Tensor& t) {
    auto const v = t.local_view();
    if (v.rows > 0) {
      fill_kernel<<<blocks_, threads, 0, stream_>>>(v, t.storage().local_entry_range().begin);
      WM_CHECK_LAUNCH();
    }
    WM_CUDA_TRY(cudaStreamSynchronize(stream_));
    comm_.barrier();
  }

  /// Checks every output row on the device and 4096 rows on the host; throws if one is wrong.
  void verify(float const* out, std::int64_t const* idx, std::vector<std::int64_t> const& host_idx,
              char const* what) {
    std::size_t const n = host_idx.size();
    auto* bad           = reinterpret_cast<unsigned long long*>(scratch_);
    WM_CUDA_TRY(cudaMemsetAsync(bad, 0, sizeof(*bad), stream_));
    check_kernel<<<blocks_, threads, 0, stream_>>>(out, idx, n, bad);
    WM_CHECK_LAUNCH();
    unsigned long long device_wrong = 0;
    WM_CUDA_TRY(cudaMemcpyAsync(&device_wrong, bad, sizeof(*bad), cudaMemcpyDeviceToHost, stream_));
    std::size_t const step = std::max<std::size_t>(1, n / check_rows);
    std::size_t const m    = std::min(n, check_rows);
    std::vector<float> h(m * cols);
    WM_CUDA_TRY(cudaMemcpy2DAsync(h.data(), row_bytes, out, step * row_bytes, row_bytes, m,
                                  cudaMemcpyDeviceToHost, stream_));
    WM_CUDA_TRY(cudaStreamSynchronize(stream_));
    std::size_t host_wrong = 0;
    for (std::size_t j = 0; j < m * cols; ++j) {
      auto const row = static_cast<std::uint64_t>(host_idx[j / cols * step]);
      host_wrong += h[j] != pattern(row, j % cols) ? 1 : 0;
    }
    if (device_wrong != 0 || host_wrong != 0) {
      throw std::runtime_error{
          fmt("gather_bench: rank %d: %s of %zu rows: %llu wrong elements, "
              "%zu in the host sample",
              comm_.rank(), what, n, device_wrong, host_wrong)};
    }
  }

  /// Gathers n random rows of @p t: checks once, then times (and the plain kernel if asked).
  template <class Tensor>
  rank_figures gather_case(Tensor& t, std::size_t n, std::uint64_t seed, bool plain = false,
                           key_range range = {}) {
    auto const idx = allocate<std::int64_t>(n);  // and a host copy, for checks and counts
    std::vector<std::int64_t> host_idx(n);
    random_kernel<<<blocks_, threads, 0, stream_>>>(idx.get(), n, t.rows(),
                                                    seed * 100 + comm_.rank(), range);
    WM_CHECK_LAUNCH();
    WM_CUDA_TRY(
        cudaMemcpyAsync(host_idx.data(), idx.get(), n * 8, cudaMemcpyDeviceToHost, stream_));
    return timed_gather(t, idx.get(), host_idx, plain);
  }

  /// Gathers the rows of @p keys (made on the host) of @p t: checks once, then times.
  template <class Tensor>
  rank_figures keys_case(Tensor& t, std::vector<std::int64_t> const& keys) {
    auto const idx = allocate<std::int64_t>(keys.size());
    WM_CUDA_TRY(cudaMemcpyAsync(idx.get(), keys.data(), keys.size() * sizeof(std::int64_t),
                                cudaMemcpyHostToDevice, stream_));
    return timed_gather(t, idx.get(), keys, false);
  }

  /// Gathers the rows of @p idx (device; @p host_idx: its host copy, complete once the stream
  /// reaches this call) of @p t: checks once, then times (and the plain kernel if asked).
  template <class Tensor>
  rank_figures timed_gather(Tensor& t, std::int64_t const* idx,
                            std::vector<std::int64_t> const& host_idx, bool plain) {
    std::size_t const n = host_idx.size();
    auto const out      = allocate<float>(n * cols);
    std::span<std::int64_t const> const span{idx, n};
    auto const poison = [&] {
      WM_CUDA_TRY(cudaMemsetAsync(out.get(), 0xFF, n * row_bytes, stream_));  // NaN everywhere
    };
    auto const run = [&] { t.gather_async(span, out.get(), sref()); };
    poison();
    run();
    t.check_errors(sref());
    verify(out.get(), idx, host_idx, "wm gather");
    rank_figures f;
    f.ms = median_ms(run);
    t.check_errors(sref());
    for (auto const k : host_idx) {
      f.remote += t.locate(static_cast<std::size_t>(k)).rank != comm_.rank() ? 1 : 0;
    }
    if constexpr (Tensor::layout_type::mapped) {
      if (plain) {
        std::byte const* base =  // one allocation
            wm_bench::entry_address(t.storage().chunked_view(), 0, scratch_, stream_);
        auto const run_plain = [&] {
          auto const grid = static_cast<unsigned>((n * 32 + threads - 1) / threads);
          plain_gather_kernel<<<grid, threads, 0, stream_>>>(
              base, idx, n, reinterpret_cast<std::byte*>(out.get()));
          WM_CHECK_LAUNCH();
        };
        poison();
        run_plain();
        verify(out.get(), idx, host_idx, "plain kernel");
        f.plain_ms = median_ms(run_plain);
      }
    }
    return f;
  }

  /// Median milliseconds of @p enqueue: warm-ups, a barrier (every rank starts together), then
  /// the timed runs back to back, each between two events on the stream.
  template <class F>
  double median_ms(F const& enqueue) {
    return wm_bench::median(wm_bench::event_times_ms(enqueue, warmups, events_, stream_, comm_));
  }

  wm::communicator& comm_;
  int blocks_{};
  cudaStream_t stream_{};
  std::byte* scratch_{};  // device: a mismatch counter or one address
  cudaEvent_t events_[2 * reps]{};
  double peer_gbps_{nan};
};

// ---- the PyTorch peer and the table -------------------------------------------------------

/// The peer's run and its numbers (NaN where it has none).
struct peer_result : wm_bench::peer_result {
  double index_select_ms{nan}, index_select_gbps{nan}, a2a_ms{nan};
};

/// Runs the peer; its all-to-all lookup on @p world ranks (none if 1).
peer_result run_torch_peer(int world) {
  peer_result p;
  fs::path const script = wm_bench::find_peer("torch_gather.py", p);
  if (script.empty()) { return p; }
  wm_bench::run_peer(
      "timeout 180 python3 '" + script.string() + "' --json --world " + std::to_string(world), p);
  if (p.failed) { return p; }
  p.index_select_ms   = json_number(p.json, "index_select_ms");
  p.index_select_gbps = json_number(p.json, "index_select_gbps");
  p.a2a_ms            = json_number(p.json, "a2a_ms");
  return p;
}

/// WholeGraph's host gathers of the (e) keys (NaN where it has none).
struct wg_result {
  std::string note;  // why it has no numbers, if it has none
  double ms[4]{nan, nan, nan, nan};
};

/// Writes each (e) case's keys to a temporary directory and runs bench/peers/wg_gather.py on
/// them, if python3 imports pylibwholegraph.torch.
wg_result run_wg_peer(std::vector<host_case> const& cases) {
  wg_result w;
  fs::path const script = wm_bench::peer_script("wg_gather.py");
  if (script.empty()) {
    w.note = "WholeGraph peer n/a: bench/peers/wg_gather.py not found (set WM_REPO)";
    return w;
  }
  std::fflush(nullptr);
  if (std::system("python3 -c 'import pylibwholegraph.torch' >/dev/null 2>&1") != 0) {
    w.note = "WholeGraph peer n/a: python3 cannot import pylibwholegraph.torch (PYTHONPATH)";
    return w;
  }
  std::string dir_template = (fs::temp_directory_path() / "wm_gather_bench.XXXXXX").string();
  if (::mkdtemp(dir_template.data()) == nullptr) {
    w.note = "WholeGraph peer FAILED: cannot create a temporary directory";
    return w;
  }
  fs::path const dir{dir_template};
  std::string cmd = "timeout 300 python3 '" + script.string() + "' --json";
  for (auto const& c : cases) {
    fs::path const f = dir / (std::string{c.name} + ".int64");
    std::ofstream out{f, std::ios::binary};
    out.write(reinterpret_cast<char const*>(c.keys.data()),
              static_cast<std::streamsize>(c.keys.size() * sizeof(std::int64_t)));
    cmd +=
        " --case '" + std::string{c.name} + ":" + std::to_string(c.rows) + ":" + f.string() + "'";
  }
  wm_bench::peer_result p;
  wm_bench::run_peer(cmd, p);
  std::error_code ec;
  fs::remove_all(dir, ec);
  if (p.failed) {
    w.note = "WholeGraph peer FAILED (its stderr is above)";
    return w;
  }
  for (std::size_t i = 0; i < cases.size() && i < 4; ++i) {
    w.ms[i] = json_number(p.json, std::string{cases[i].name} + "_ms");
  }
  return w;
}

/// The (e) table: wm's host gathers against their floor and against WholeGraph.
void print_host_table(results const& r, std::vector<host_case> const& cases, wg_result const& wg) {
  std::printf(
      "(e) 1 GPU, pinned host tables of 512 B rows, each distinct row read once; floor = distinct "
      "rows x 512 B / pinned H2D %.1f GB/s (same run); WG/wm > 1: wm faster\n",
      r.e_h2d_gbps);
  if (!wg.note.empty()) { std::printf("   %s\n", wg.note.c_str()); }
  std::printf("%-30s %8s %9s %8s %15s %9s %8s %7s\n", "case", "ms", "distinct", "floor ms",
              "t/floor (<=1.1)", "GB/s out", "WG ms", "WG/wm");
  for (std::size_t i = 0; i < cases.size() && i < 4; ++i) {
    auto const& c        = cases[i];
    double const ms      = r.e_ms[i];
    double const floor   = double(c.distinct * row_bytes) / r.e_h2d_gbps / 1e6;
    double const ratio   = ms / floor;
    std::string const tf = std::isnan(ratio) ? "-"
                           : ratio <= 1.1    ? fmt("%.2f ok", ratio)
                                             : fmt("%.2f ABOVE", ratio);
    double const wg_ms   = wg.ms[i];
    std::printf("%-30s %8.3f %9zu %8.3f %15s %9.1f %8s %7s\n", c.label, ms, c.distinct, floor,
                tf.c_str(), double(c.keys.size() * row_bytes) / ms / 1e6,
                std::isnan(wg_ms) ? "n/a" : fmt("%.3f", wg_ms).c_str(),
                std::isnan(wg_ms) ? "n/a" : fmt("%.2fx", wg_ms / ms).c_str());
  }
}

/// One table row; target <= 0: reported only.
void row(char const* name, std::string const& figure, std::string const& limit, double ratio,
         double target) {
  std::string const r = std::isnan(ratio) ? "-" : fmt("%.2f", ratio);
  std::string t       = target > 0 ? fmt(">= %.2f", target) : "report";
  if (target > 0) { t += std::isnan(ratio) ? "  n/a" : ratio >= target ? "  ok" : "  BELOW"; }
  std::printf("%-30s %-30s %-40s %6s  %s\n", name, figure.c_str(), limit.c_str(), r.c_str(),
              t.c_str());
}

void print_table(results const& r, peer_result const& p, std::vector<host_case> const& cases,
                 wg_result const& wg, double seconds) {
  std::printf("== gather_bench: %d x %s (%.0f s in all)\n", r.ranks, r.gpu, seconds);
  std::printf("   ranks gather at once; figure: slowest rank (r0: rank 0), median of %d\n", reps);
  if (!p.note.empty()) { std::printf("   %s\n", p.note.c_str()); }
  std::printf("%-30s %-30s %-40s %6s  %s\n", "case", "figure", "limit / peer", "ratio", "target");
  auto const gbps = [](std::size_t rows, double ms) { return double(rows * row_bytes) / ms / 1e6; };
  std::string const no_peer = "torch peer not run";
  bool const two            = r.ranks >= 2;
  double const out          = gbps(batch, r.a_ms);
  row("(a) 1 GPU device gather", fmt("%.0f GB/s out (%.0f r+w)", out, 2 * out),
      fmt("%.0f GB/s dev copy (r+w)", r.copy_gbps), 2 * out / r.copy_gbps, 0.85);
  row("(a) vs torch.index_select", fmt("%.0f GB/s out (%.3f ms)", out, r.a_ms),
      std::isnan(p.index_select_ms)
          ? no_peer
          : fmt("%.0f GB/s out (%.3f ms)", p.index_select_gbps, p.index_select_ms),
      out / p.index_select_gbps, 2);
  std::string const on      = two ? fmt("%d GPUs", r.ranks) : "N GPUs";
  std::string const names[] = {"(b) continuous " + on, "(b) chunked " + on,
                               "(b) distributed " + on + " (mailboxes)"};
  for (int i = 0; i < 3; ++i) {
    auto const& b = r.b[i];
    row(names[i].c_str(), two ? fmt("%.3f ms (r0 %.3f)", b.max_ms, b.r0_ms) : "n/a (1 GPU)",
        two ? fmt("floor %.3f ms (peer copy %.0f GB/s)", b.bound_ms, r.peer_gbps) : "-",
        b.bound_ms / b.max_ms, i < 2 ? 0.80 : 0);
  }
  double const small = gbps(batch, r.c_small_ms), large = gbps(batch, r.c_large_ms);
  row("(c) host 1 GiB table", fmt("%.1f GB/s out (%.2f ms)", small, r.c_small_ms),
      fmt("%.1f GB/s pinned H2D", r.h2d_gbps), small / r.h2d_gbps, 0.80);
  row("(c) host 8 GiB table", fmt("%.1f GB/s out (%.2f ms)", large, r.c_large_ms),
      fmt("plain warp kernel %.1f GB/s (%.2f ms)", gbps(batch, r.c_plain_ms), r.c_plain_ms),
      r.c_plain_ms / r.c_large_ms, 2);
  row("(c) host 8 GiB vs pinned H2D", fmt("%.1f GB/s out", large),
      fmt("%.1f GB/s pinned H2D", r.h2d_gbps), large / r.h2d_gbps, 0);
  row(("(d) distributed " + on + " 1M keys").c_str(),
      two ? fmt("%.3f ms (%.0f GB/s out)", r.d_ms, gbps(keys, r.d_ms)) : "n/a (1 GPU)",
      std::isnan(p.a2a_ms) ? no_peer : fmt("torch a2a %.3f ms", p.a2a_ms), p.a2a_ms / r.d_ms, 3);
  row("(d) vs NCCL moving its rows", two ? fmt("%.3f ms", r.d_ms) : "n/a (1 GPU)",
      two ? fmt("NCCL send/recv alone %.3f ms (%.0f GB/s)", r.d_nccl_ms,
                gbps(keys / std::size_t(r.ranks) * std::size_t(r.ranks - 1), r.d_nccl_ms))
          : "-",
      r.d_nccl_ms / r.d_ms, 0);
  row("(d) with rows through NCCL", two ? fmt("%.3f ms", r.d_via_nccl_ms) : "n/a (1 GPU)",
      std::isnan(p.a2a_ms) ? no_peer : fmt("torch a2a %.3f ms", p.a2a_ms),
      p.a2a_ms / r.d_via_nccl_ms, 0);
  row("(d) rows put by kernels", two ? fmt("%.3f ms", r.d_via_put_ms) : "n/a (1 GPU)",
      std::isnan(p.a2a_ms) ? no_peer : fmt("torch a2a %.3f ms", p.a2a_ms),
      p.a2a_ms / r.d_via_put_ms, 0);
  row("(d) one rank, 1M keys", fmt("%.3f ms", r.d_one_ms),
      fmt("continuous layout, same keys %.3f ms", r.d_one_direct_ms),
      r.d_one_direct_ms / r.d_one_ms, 0);
  row("(d) own rows only", two ? fmt("%.3f ms", r.d_own_ms) : "n/a (1 GPU)", "-", nan, 0);
  row("(d) others' rows only", two ? fmt("%.3f ms", r.d_remote_ms) : "n/a (1 GPU)",
      two ? fmt("NCCL alone, scaled to 1M rows: %.3f ms",
                r.d_nccl_ms * double(r.ranks) / double(r.ranks - 1))
          : "-",
      nan, 0);
  print_host_table(r, cases, wg);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  wm_bench::set_environment();
  using clock     = std::chrono::steady_clock;
  auto const t0   = clock::now();
  int const gpus  = wm::local_device_count();  // before any CUDA call in this process
  int const ranks = wm_bench::ranks_argument(argc, argv, gpus, "gather_bench");
  if (ranks < 0) { return 2; }
  int const world = ranks > 0 ? ranks : gpus;  // (b), (c), (d)
  if (gpus == 0) {
    std::printf("gather_bench: no GPU found, nothing to measure\n");
    return 0;
  }
  // The ranks are forked processes: rank 0 writes its figures into memory shared with this one.
  results* const shared = wm_bench::shared_results<results>("gather_bench");
  if (shared == nullptr) { return 1; }
  results& res     = *shared;
  auto const cases = host_cases();  // (e): before any rank starts (the peer takes the same keys)
  try {
    wm::launch_options options;
    options.timeout   = std::chrono::seconds{180};  // expected: well under a minute each
    auto const single = [&](wm::communicator& comm) {
      bench b{comm, res};
      b.single_gpu();
      b.host_distinct(cases);
    };
    wm::launch(1, single, options);
    auto const multi = [&](wm::communicator& comm) {
      bench b{comm, res};
      if (comm.size() >= 2) {
        b.peer_copy();
        b.multi_gpu<wm::continuous>(0);
        b.multi_gpu<wm::chunked>(1);
        b.multi_gpu<wm::distributed>(2);
      }
      b.pinned_h2d();
      b.host_table(host_small);
      b.host_table(host_large);
    };
    wm::launch(world, multi, options);
  } catch (std::exception const& e) {
    std::fprintf(stderr, "gather_bench: %s\n", e.what());
    std::printf("gather_bench: FAILED: %s\n", e.what());
    return 1;
  }
  peer_result const peer = run_torch_peer(world);
  wg_result const wg     = run_wg_peer(cases);
  print_table(res, peer, cases, wg, std::chrono::duration<double>(clock::now() - t0).count());
  return peer.failed ? 1 : 0;
}
