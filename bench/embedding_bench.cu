// SPDX-License-Identifier: Apache-2.0
/*
 * embedding_bench: one training step of wm::embedding (gather forward + apply_gradients with
 * given gradients), next to the device-copy limit measured in the same run and the PyTorch peer
 * (bench/peers/torch_embedding.py: nn.Embedding(sparse=True) + SparseAdam / SGD / Adagrad).
 *
 * Table: wm::embedding<float, no_cache, Opt, device, chunked>, 10M rows x 128 float (512 B rows,
 * 5.12 GB), Opt in sgd, adam (lazy: per-row bias correction), rmsprop, adagrad; lr 0.01. Each rank
 * passes 1M int64 keys per step and 1M x 128 float gradients (uniform in [-1, 1], made on the
 * device, the same every step). Keys are made on the host before any rank starts, so the peer
 * reads the very same keys (rank 0's sets, through temporary files):
 *   uniform: splitmix64(splitmix64(seed) + i) mod 10M (generators: bench/keys.hpp);
 *   zipf:    exact discrete Zipf(alpha = 1.05) over ranks 1..10M (inverse CDF: binary search in the
 *            table of cumulative k^-alpha), rank k-1 scattered to row (k-1) * 7368787 mod 10M (a
 *            bijection), so the hot rows are spread over the table and over all owners.
 * Rank r's keys use seeds 1000 + r (uniform) and 2000 + r (zipf).
 * Cases: 1 GPU (wm::launch(1)): each optimizer x {uniform, zipf}; N GPUs (wm::launch(N), all
 * ranks step at once, each with its own 1M keys): the same cases, for
 * every N in 2, 4, 8, ... up to the GPUs present, and N = the GPU count if that is not a power of
 * two. `embedding_bench --ranks N` runs the N-GPU cases for that N only (none for N = 1); exit
 * status 2 if N is not between 1 and the GPUs present.
 *
 * Timing: a step = e.gather(keys, out) + e.apply_gradients(keys, grads, lr) (both synchronize),
 * timed with std::chrono; the stream is synchronized and the ranks pass a barrier before each
 * step (not timed). 2 warm-up steps, then the median of 10. "apply ms" is the median of the
 * apply_gradients part of the same steps. With N ranks: max over ranks of the per-rank medians.
 *
 * Figures (U = distinct rows in the step's keys, over all ranks; S = optimizer states per row):
 *   uniq GB/s  = 2 x U x 512 B x (1 + S) / apply ms: each touched row's weight and state read
 *                once and written once (Adam's 8-byte per-row step count is not counted).
 *   copy GB/s  = cudaMemcpyAsync device-to-device of 2 GiB, read + write counted (2 x 2 GiB /
 *                time), median of 10 with CUDA events; with N ranks all copy at once, the min.
 *   ratio      = uniq GB/s / copy GB/s.
 *   step GB/s  = (gather 2 x n x 512 B + unique-row bytes + gradients read once n x 512 B)
 *                / ms/step: the floor of a step; dispatch copies, sort and keys not counted.
 *   N GPUs: n = keys of all N ranks; both GB/s figures are per GPU (the sum over GPUs / N),
 *   so the ratios compare with one GPU's copy bandwidth; the NVLink exchange is not a byte
 *   the floor counts.
 *   torch ms   = the peer's median step (out = emb(keys); out.backward(grads); opt.step();
 *                opt.zero_grad()), CUDA events, 1 GPU, same keys; speedup = torch ms / ms/step.
 * Target (issue): 1 GPU adam uniform: speedup >= 5 and ratio >= 0.60.
 *
 * Before timing, once per optimizer and launch, each rank applies one step to keys {0, 0, 5} with
 * gradients of known sign per column and checks that rows 0 and 5 moved against the summed
 * gradient in every column and row 1 did not move (throws otherwise). Output ends with one table.
 */
#include <wm/embedding.cuh>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.cuh"
#include "keys.hpp"

namespace {

using namespace wm_bench::table_bench;  // the table, batch, dist, grad_kernel, buffer, fmt, ...
using wm_bench::splitmix;

constexpr int warmups   = 2;
constexpr int reps      = 10;
constexpr int max_cases = 64;
constexpr double nan    = std::numeric_limits<double>::quiet_NaN();

// ---- keys (host, before any rank starts) ---------------------------------------------------

std::vector<std::int64_t> uniform_keys(std::uint64_t seed) {
  std::vector<std::int64_t> k(batch);
  wm_bench::uniform_keys(k, table_rows, seed);
  return k;
}

/// @p cdf: cumulative sums of k^-alpha, k = 1..rows.
std::vector<std::int64_t> zipf_keys(std::vector<double> const& cdf, std::uint64_t seed) {
  std::vector<std::int64_t> k(batch);
  wm_bench::zipf_keys(k, cdf, scatter, seed);
  return k;
}

struct key_sets {
  std::vector<std::vector<std::int64_t>> keys[2];  // [dist][rank]
  std::vector<std::size_t> uniq[2];  // [dist][ranks - 1]: distinct rows over ranks 0..ranks-1
  std::size_t hottest[2]{};          // [dist]: most repeats of one row in rank 0's keys
};

/// The keys of ranks 0..ranks-1.
key_sets make_keys(int ranks) {
  key_sets s;
  std::vector<double> const cdf = wm_bench::zipf_cdf(table_rows, zipf_alpha);
  for (int rank = 0; rank < ranks; ++rank) {
    s.keys[uniform].push_back(uniform_keys(1000 + rank));
    s.keys[zipf].push_back(zipf_keys(cdf, 2000 + rank));
  }
  for (int d = 0; d < 2; ++d) {
    std::vector<std::int64_t> all;  // the keys of ranks 0..rank, sorted
    for (int rank = 0; rank < ranks; ++rank) {
      auto const mid = static_cast<std::ptrdiff_t>(all.size());
      all.insert(all.end(), s.keys[d][rank].begin(), s.keys[d][rank].end());
      std::sort(all.begin() + mid, all.end());
      std::inplace_merge(all.begin(), all.begin() + mid, all.end());
      std::size_t distinct = 0, run = 0;
      for (std::size_t i = 0; i < all.size(); ++i) {
        run = i > 0 && all[i] == all[i - 1] ? run + 1 : 1;
        distinct += run == 1 ? 1 : 0;
        if (rank == 0) { s.hottest[d] = std::max(s.hottest[d], run); }
      }
      s.uniq[d].push_back(distinct);
    }
  }
  return s;
}

// ---- what rank 0 hands back (memory shared with main) ---------------------------------------

struct case_result {
  char opt[16]{};
  int d{};
  int gpus{};
  int states{};
  double step_ms{nan}, apply_ms{nan}, copy_gbps{nan};
  std::size_t uniq{};
};

struct results {
  char gpu[256]{};
  int count{0};
  case_result cases[max_cases];
};

/// One rank's state; every public member function is collective.
class bench {
 public:
  bench(wm::communicator& comm, results& out, key_sets const& keys)
      : comm_{comm}, res_{out}, keys_{keys} {
    blocks_ = grid_blocks(comm.device());
    WM_CUDA_TRY(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    for (auto& e : events_) { WM_CUDA_TRY(cudaEventCreate(&e)); }
    std::string const gpu = device_name(comm.device());
    if (comm.rank() == 0) { std::snprintf(res_.gpu, sizeof res_.gpu, "%s", gpu.c_str()); }
    idx_   = allocate<std::int64_t>(batch);
    grads_ = allocate<float>(batch * dim);
    out_   = allocate<float>(batch * dim);
    fill_gradients(grads_.get(), batch * dim, 77 + comm.rank(), blocks_, stream_);
  }
  bench(bench const&)            = delete;
  bench& operator=(bench const&) = delete;
  ~bench() {
    (void)cudaStreamSynchronize(stream_);
    for (auto e : events_) { (void)cudaEventDestroy(e); }
    (void)cudaStreamDestroy(stream_);
  }

  /// The limit: cudaMemcpyAsync D2D of 2 GiB, read + write counted; all ranks at once, the min.
  void copy_limit() {
    auto const src = allocate<std::byte>(2 * gib), dst = allocate<std::byte>(2 * gib);
    WM_CUDA_TRY(cudaMemsetAsync(src.get(), 0x5A, 2 * gib, stream_));
    double const ms = wm_bench::event_median_ms(
        [&] {
          WM_CUDA_TRY(
              cudaMemcpyAsync(dst.get(), src.get(), 2 * gib, cudaMemcpyDeviceToDevice, stream_));
        },
        warmups, events_, stream_, comm_);
    auto const all = comm_.all_gather(2.0 * double(2 * gib) / ms / 1e6);
    copy_gbps_     = *std::min_element(all.begin(), all.end());
  }

  /// One table with optimizer @p opt: the sanity step, then each key distribution in @p dists.
  template <class Opt>
  void run(Opt opt, std::initializer_list<dist> dists) {
    wm::embedding<float, wm::no_cache, Opt, wm::device, wm::chunked> e{
        comm_, table_rows, dim, opt, wm::embedding_init::uniform(-0.05f, 0.05f, 42)};
    sanity(e);
    for (dist const d : dists) {
      auto const& keys = keys_.keys[d][comm_.rank()];
      WM_CUDA_TRY(cudaMemcpyAsync(idx_.get(), keys.data(), batch * sizeof(std::int64_t),
                                  cudaMemcpyHostToDevice, stream_));
      std::span<std::int64_t const> const span{idx_.get(), batch};
      cuda::stream_ref const s{stream_};
      std::vector<double> step, apply;
      for (int i = 0; i < warmups + reps; ++i) {
        WM_CUDA_TRY(cudaStreamSynchronize(stream_));
        comm_.barrier();  // every rank starts the step together
        auto const t0 = clock_type::now();
        e.gather(span, out_.get(), s);
        auto const t1 = clock_type::now();
        e.apply_gradients(span, grads_.get(), lr, s);
        auto const t2 = clock_type::now();
        if (i >= warmups) {
          step.push_back(std::chrono::duration<double, std::milli>(t2 - t0).count());
          apply.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
        }
      }
      auto const steps   = comm_.all_gather(median(step));
      auto const applies = comm_.all_gather(median(apply));
      if (comm_.rank() != 0 || res_.count >= max_cases) { continue; }
      case_result& c = res_.cases[res_.count++];
      std::snprintf(c.opt, sizeof c.opt, "%s", Opt::name);
      c.d         = d;
      c.gpus      = comm_.size();
      c.states    = Opt::states;
      c.step_ms   = *std::max_element(steps.begin(), steps.end());
      c.apply_ms  = *std::max_element(applies.begin(), applies.end());
      c.copy_gbps = copy_gbps_;
      c.uniq      = keys_.uniq[d][comm_.size() - 1];
      std::printf("embedding_bench: %d GPU %-8s %-8s %8.3f ms/step, apply %8.3f ms\n", c.gpus,
                  c.opt, dist_names[d], c.step_ms, c.apply_ms);
      std::fflush(stdout);
    }
  }

 private:
  /// Rows {0, 5, 1} of @p e, gathered to the host.
  template <class E>
  std::vector<float> probe(E& e, std::int64_t const* d_rows) {
    std::vector<float> h(3 * dim);
    e.gather(std::span<std::int64_t const>{d_rows, 3}, out_.get(), cuda::stream_ref{stream_});
    WM_CUDA_TRY(cudaMemcpyAsync(h.data(), out_.get(), h.size() * sizeof(float),
                                cudaMemcpyDeviceToHost, stream_));
    WM_CUDA_TRY(cudaStreamSynchronize(stream_));
    return h;
  }

  /// One step on keys {0, 0, 5} (every rank); rows 0 and 5 must move against the summed
  /// gradient's sign in every column, row 1 must not move.
  template <class E>
  void sanity(E& e) {
    std::int64_t const hk[6] = {0, 0, 5, /* probe: */ 0, 5, 1};
    std::vector<float> hg(3 * dim);
    auto const sign = [](std::uint64_t h) { return (h & 1) != 0 ? 1.0f : -1.0f; };
    for (std::size_t j = 0; j < dim; ++j) {  // the same on every rank: sums keep the sign
      float const mag = 0.25f + static_cast<float>(splitmix(j + 99) >> 40) * (1.0f / 16777216.0f);
      hg[j]           = sign(splitmix(j)) * mag;
      hg[dim + j]     = sign(splitmix(j)) * 0.5f * mag;
      hg[2 * dim + j] = sign(splitmix(j + 1000)) * mag;
    }
    auto const d_keys = allocate<std::int64_t>(6);
    auto const d_g    = allocate<float>(hg.size());
    WM_CUDA_TRY(cudaMemcpyAsync(d_keys.get(), hk, sizeof hk, cudaMemcpyHostToDevice, stream_));
    WM_CUDA_TRY(cudaMemcpyAsync(d_g.get(), hg.data(), hg.size() * sizeof(float),
                                cudaMemcpyHostToDevice, stream_));
    comm_.barrier();
    auto const before = probe(e, d_keys.get() + 3);
    comm_.barrier();
    e.apply_gradients(std::span<std::int64_t const>{d_keys.get(), 3}, d_g.get(), lr,
                      cuda::stream_ref{stream_});
    comm_.barrier();  // every owner has finished its update
    auto const after = probe(e, d_keys.get() + 3);
    comm_.barrier();
    std::size_t wrong = 0;
    for (std::size_t j = 0; j < dim; ++j) {
      float const d0 = after[j] - before[j], d5 = after[dim + j] - before[dim + j];
      wrong += !(d0 * hg[j] < 0) || !std::isfinite(after[j]) ? 1 : 0;
      wrong += !(d5 * hg[2 * dim + j] < 0) || !std::isfinite(after[dim + j]) ? 1 : 0;
      wrong += after[2 * dim + j] != before[2 * dim + j] ? 1 : 0;
    }
    if (wrong != 0) {
      throw std::runtime_error{
          fmt("embedding_bench: rank %d: %s sanity step: %zu of %zu checked values moved wrongly",
              comm_.rank(), E::optimizer_type::name, wrong, 3 * dim)};
    }
  }

  wm::communicator& comm_;
  results& res_;  // written by rank 0 only
  key_sets const& keys_;
  int blocks_{};
  cudaStream_t stream_{};
  cudaEvent_t events_[2 * reps]{};
  buffer<std::int64_t> idx_;
  buffer<float> grads_, out_;
  double copy_gbps_{nan};
};

// ---- the PyTorch peer and the table -----------------------------------------------------------

/// Writes rank 0's key sets to a temporary directory and runs the peer on them.
peer_result run_torch_peer(key_sets const& keys) {
  peer_result p;
  fs::path const script = wm_bench::find_peer("torch_embedding.py", p);
  if (script.empty()) { return p; }
  run_peer_on_keys("timeout 80 python3 '" + script.string() + "' --json",
                   {std::span<std::int64_t const>{keys.keys[uniform][0].data(), batch},
                    std::span<std::int64_t const>{keys.keys[zipf][0].data(), batch}},
                   "wm_embedding_bench", "torch peer", p);
  return p;
}

void print_table(results const& r, int gpus, int ranks, key_sets const& keys, peer_result const& p,
                 double seconds) {
  std::printf(
      "== embedding_bench: %d x %s, 10M x 128 float, 1M keys/step/rank, lr %.2g (%.0f s in all)\n",
      gpus, r.gpu, double(lr), seconds);
  std::printf("   median of %d steps after %d warm-ups; N GPU: slowest rank, GB/s per GPU\n", reps,
              warmups);
  std::printf(
      "   zipf(%.2f): %zu distinct rows in rank 0's 1M keys (uniform %zu); hottest row %zu times\n",
      zipf_alpha, keys.uniq[zipf][0], keys.uniq[uniform][0], keys.hottest[zipf]);
  if (!p.note.empty()) { std::printf("   %s\n", p.note.c_str()); }
  if (gpus < 2) {
    std::printf("   multi-GPU cases not run: 1 GPU visible\n");
  } else if (ranks == 1) {
    std::printf("   multi-GPU cases not run: --ranks 1\n");
  }
  std::printf("%-24s %8s %8s %9s %9s %9s %6s %9s %6s %8s %7s  %s\n", "case", "ms/step", "apply ms",
              "uniq rows", "uniq GB/s", "copy GB/s", "ratio", "step GB/s", "step r", "torch ms",
              "speedup", "target");
  for (int i = 0; i < r.count; ++i) {
    case_result const& c  = r.cases[i];
    double const n        = double(batch) * c.gpus;
    double const uniq_b   = 2.0 * double(c.uniq) * row_bytes * (1 + c.states);
    double const step_b   = 2.0 * n * row_bytes + uniq_b + n * row_bytes;
    double const uniq_gbs = uniq_b / c.gpus / c.apply_ms / 1e6;
    double const step_gbs = step_b / c.gpus / c.step_ms / 1e6;
    double const ratio    = uniq_gbs / c.copy_gbps;
    double const torch_ms =
        c.gpus == 1 ? json_number(p.json, std::string{c.opt} + "_" + dist_names[c.d] + "_ms") : nan;
    double const speedup = torch_ms / c.step_ms;
    std::string target   = "report";
    if (c.gpus == 1 && c.d == uniform && std::string{c.opt} == "adam") {
      bool const ok = speedup >= 5 && ratio >= 0.60;
      target = std::string{">=5x, >=0.60  "} + (std::isnan(speedup) ? "n/a" : ok ? "ok" : "BELOW");
    }
    auto const num = [](double v, char const* f) {
      return std::isnan(v) ? std::string{"-"} : fmt(f, v);
    };
    std::printf("%-24s %8.3f %8.3f %9zu %9.0f %9.0f %6.2f %9.0f %6.2f %8s %7s  %s\n",
                fmt("%d GPU %s %s", c.gpus, c.opt, dist_names[c.d]).c_str(), c.step_ms, c.apply_ms,
                c.uniq, uniq_gbs, c.copy_gbps, ratio, step_gbs, step_gbs / c.copy_gbps,
                num(torch_ms, "%.3f").c_str(), num(speedup, "%.1fx").c_str(), target.c_str());
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  wm_bench::set_environment();
  auto const t0   = clock_type::now();
  int const gpus  = wm::local_device_count();  // before any CUDA call in this process
  int const ranks = wm_bench::ranks_argument(argc, argv, gpus, "embedding_bench");
  if (ranks < 0) { return 2; }
  if (gpus == 0) {
    std::printf("embedding_bench: no GPU found, nothing to measure\n");
    return 0;
  }
  results* const shared = wm_bench::shared_results<results>("embedding_bench");
  if (shared == nullptr) { return 1; }
  results& res = *shared;
  std::vector<int> counts;  // rank counts of the multi-GPU cases, ascending
  if (ranks >= 2) {
    counts.push_back(ranks);
  } else if (ranks == 0) {
    for (int n = 2; n <= gpus; n *= 2) { counts.push_back(n); }
    if (gpus > 2 && (gpus & (gpus - 1)) != 0) { counts.push_back(gpus); }
  }
  // host only; the forked ranks inherit them
  key_sets const keys = make_keys(counts.empty() ? 1 : counts.back());
  try {
    wm::launch_options options;
    options.timeout       = std::chrono::seconds{80};      // expected: well under a minute each
    auto const every_case = [&](wm::communicator& comm) {  // the same cases for every rank count
      bench b{comm, res, keys};
      b.copy_limit();
      b.run(wm::sgd{}, {uniform, zipf});
      b.run(wm::adam{}, {uniform, zipf});
      b.run(wm::rmsprop{}, {uniform, zipf});
      b.run(wm::adagrad{}, {uniform, zipf});
    };
    wm::launch(1, every_case, options);
    for (int const n : counts) { wm::launch(n, every_case, options); }
  } catch (std::exception const& e) {
    std::fprintf(stderr, "embedding_bench: %s\n", e.what());
    std::printf("embedding_bench: FAILED: %s\n", e.what());
    return 1;
  }
  peer_result const peer = run_torch_peer(keys);
  print_table(res, gpus, ranks, keys, peer,
              std::chrono::duration<double>(clock_type::now() - t0).count());
  return peer.failed ? 1 : 0;
}
