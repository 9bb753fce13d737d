// SPDX-License-Identifier: Apache-2.0
/*
 * swap_bench: training with the saved activations paged out (wm::swap_scope) against the same
 * training without swapping and against PyTorch with and without save_on_cpu.
 *
 * Workload (bench/workloads/mlp.cuh): 16 x (Linear(8192, 8192, no bias) + ReLU), bf16, batch
 * 16,384, cuBLASLt, loss 0.5 Σ y² / batch, SGD; 17 saved activations of 256 MiB each.
 * Rows:
 *  - wm, no swap: every activation in device memory allocated once.
 *  - wm, swap, keep k, pool s: x_0 .. x_{15-k} paged out during the forward pass (the copy
 *    starts when the next layer starts reading x_i, pageout_begin, and its memory goes after
 *    that layer, pageout; ", late": the copy starts after that layer, pageout alone),
 *    prefetched in backward order (lookahead 2 activations); the pool holds s activations.
 *  - torch, and torch with save_on_cpu(pin_memory=True) (bench/peers/torch_swap.py).
 * Columns: median step ms over the timed steps (CUDA events, after 2 warm-ups); ratio to wm's
 * no-swap step; peak device GiB (wm: device memory the run allocated, cudaMemGetInfo, all of it
 * up front; torch: max_memory_allocated); GB/s of the page-outs and page-ins while copying,
 * against pinned cudaMemcpyAsync of one activation measured in this run; allocations (device,
 * pinned, events), host-blocking syncs and waits on the scope's workers per step after the
 * warm-up, counted by the scope; and whether the losses are bitwise wm's no-swap losses. Then
 * the issue's targets checked on these rows.
 *
 * Usage: swap_bench [--layers L] [--width W] [--batch B] [--steps S]   (defaults 16 8192 16384 6)
 */
#include <wm/swap.cuh>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common.cuh"
#include "workloads/mlp.cuh"
#include "workloads/swap_store.cuh"

namespace {

struct config {
  int layers{16};
  int width{8192};
  int batch{16384};
  int steps{6};
};

struct row {
  std::string name;
  double ms{0};
  double peak_gib{0};
  double out_gbps{-1};
  double in_gbps{-1};
  double allocs_per_step{-1};
  double syncs_per_step{-1};
  double syncs_pool_per_step{-1};  // of those: no pool block could change hands
  double syncs_slab_per_step{-1};  // of those: the host slab was full
  double worker_waits_per_step{-1};
  double pool_peak_gib{-1};
  int same_loss{-1};  // 1 bitwise equal, 0 not, -1 not compared
};

constexpr int warmups = 2;

std::size_t device_used() {
  std::size_t free = 0, total = 0;
  WM_CUDA_TRY(cudaMemGetInfo(&free, &total));
  return total - free;
}

/// Median ms of @p reps pinned copies of @p bytes in direction @p kind.
double pinned_copy_gbps(std::size_t bytes, cudaMemcpyKind kind, cudaStream_t s) {
  void* d = nullptr;
  void* h = nullptr;
  WM_CUDA_TRY(cudaMalloc(&d, bytes));
  WM_CUDA_TRY(cudaHostAlloc(&h, bytes, cudaHostAllocDefault));
  WM_CUDA_TRY(cudaMemset(d, 1, bytes));
  std::memset(h, 1, bytes);
  std::vector<cudaEvent_t> ev(20);
  for (auto& e : ev) { WM_CUDA_TRY(cudaEventCreate(&e)); }
  auto copy = [&] {
    if (kind == cudaMemcpyDeviceToHost) {
      WM_CUDA_TRY(cudaMemcpyAsync(h, d, bytes, kind, s));
    } else {
      WM_CUDA_TRY(cudaMemcpyAsync(d, h, bytes, kind, s));
    }
  };
  copy();
  copy();
  for (std::size_t i = 0; i < ev.size(); i += 2) {
    WM_CUDA_TRY(cudaEventRecord(ev[i], s));
    copy();
    WM_CUDA_TRY(cudaEventRecord(ev[i + 1], s));
  }
  WM_CUDA_TRY(cudaStreamSynchronize(s));
  std::vector<float> ms(ev.size() / 2);
  for (std::size_t i = 0; i < ms.size(); ++i) {
    WM_CUDA_TRY(cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]));
  }
  for (auto e : ev) { WM_CUDA_TRY(cudaEventDestroy(e)); }
  WM_CUDA_TRY(cudaFree(d));
  WM_CUDA_TRY(cudaFreeHost(h));
  return static_cast<double>(bytes) / (wm_bench::median(ms) * 1e-3) / 1e9;
}

/// Trains a fresh model; keep < 0: no swap. Returns the row and the losses of the timed steps.
row train(config const& c, int keep, int slots, bool early, std::vector<float>& losses,
          cudaStream_t s) {
  row r;
  WM_CUDA_TRY(cudaDeviceSynchronize());
  std::size_t const base = device_used();
  int const total_steps  = warmups + c.steps;
  std::vector<cudaEvent_t> ev(2 * static_cast<std::size_t>(c.steps));
  for (auto& e : ev) { WM_CUDA_TRY(cudaEventCreate(&e)); }
  {
    wm_workload::mlp model{c.layers, c.width, c.batch, 2024, total_steps};
    auto const run = [&](auto& store, wm::swap_scope* scope) {
      for (int i = 0; i < warmups; ++i) { model.step(store, i, 1 + i, 0.05f, s); }
      WM_CUDA_TRY(cudaStreamSynchronize(s));
      if (scope != nullptr) { scope->reset_statistics(); }
      for (int i = 0; i < c.steps; ++i) {
        WM_CUDA_TRY(cudaEventRecord(ev[2 * i], s));
        model.step(store, warmups + i, 1 + warmups + i, 0.05f, s);
        WM_CUDA_TRY(cudaEventRecord(ev[2 * i + 1], s));
      }
      WM_CUDA_TRY(cudaStreamSynchronize(s));
      r.peak_gib = static_cast<double>(device_used() - base) / (1 << 30);
      if (scope != nullptr) {
        auto const st = scope->statistics();
        r.out_gbps    = st.out_gbps();
        r.in_gbps     = st.in_gbps();
        r.allocs_per_step =
            static_cast<double>(st.device_allocations + st.pinned_allocations + st.events_created) /
            c.steps;
        r.syncs_per_step        = static_cast<double>(st.host_blocking_syncs) / c.steps;
        r.syncs_pool_per_step   = static_cast<double>(st.host_syncs_pool) / c.steps;
        r.syncs_slab_per_step   = static_cast<double>(st.host_syncs_slab) / c.steps;
        r.worker_waits_per_step = static_cast<double>(st.worker_waits) / c.steps;
        r.pool_peak_gib         = static_cast<double>(st.peak_resident_bytes) / (1 << 30);
      }
    };
    if (keep < 0) {
      wm_workload::resident_store store{c.layers, model.activation_bytes()};
      run(store, nullptr);
      r.name = "wm, no swap";
    } else {
      wm::swap_options o;
      o.device_budget      = static_cast<std::size_t>(slots) * model.activation_bytes();
      o.host_bytes         = static_cast<std::size_t>(c.layers + 1) * model.activation_bytes();
      o.prefetch_lookahead = 2 * model.activation_bytes();
      wm::swap_scope scope{o};
      wm_workload::swap_store store{scope, c.layers, model.activation_elements(), keep, early};
      run(store, &scope);
      r.name = (keep == 0 ? wm_bench::fmt("wm, swap all, pool %d", slots)
                          : wm_bench::fmt("wm, swap keep %d, pool %d", keep, slots)) +
               (early ? "" : ", late");
    }
    auto const all = model.losses(total_steps);
    losses.assign(all.begin() + warmups, all.end());
  }
  std::vector<float> ms(static_cast<std::size_t>(c.steps));
  for (int i = 0; i < c.steps; ++i) {
    WM_CUDA_TRY(cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]));
  }
  for (auto e : ev) { WM_CUDA_TRY(cudaEventDestroy(e)); }
  r.ms = wm_bench::median(ms);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  wm_bench::set_environment();
  config c;
  std::string csv;
  for (int i = 1; i + 1 < argc; i += 2) {
    int const v = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--csv") == 0) {
      csv = argv[i + 1];
    } else if (std::strcmp(argv[i], "--layers") == 0) {
      c.layers = v;
    } else if (std::strcmp(argv[i], "--width") == 0) {
      c.width = v;
    } else if (std::strcmp(argv[i], "--batch") == 0) {
      c.batch = v;
    } else if (std::strcmp(argv[i], "--steps") == 0) {
      c.steps = v;
    } else {
      std::fprintf(stderr,
                   "usage: swap_bench [--layers L] [--width W] [--batch B] [--steps S] "
                   "[--csv PATH]\n");
      return 2;
    }
  }
  if (c.layers < 2 || c.width < 1 || c.batch < 1 || c.steps < 1) {
    std::fprintf(stderr, "swap_bench: layers >= 2, width, batch and steps >= 1 expected\n");
    return 2;
  }
  if (wm::local_device_count() == 0) {
    std::printf("swap_bench: no GPU found, nothing to measure\n");
    return 0;
  }
  try {
    cudaStream_t s{};
    WM_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    std::size_t const act = static_cast<std::size_t>(c.batch) * c.width * 2;
    double const d2h      = pinned_copy_gbps(act, cudaMemcpyDeviceToHost, s);
    double const h2d      = pinned_copy_gbps(act, cudaMemcpyHostToDevice, s);

    std::vector<row> rows;
    std::vector<float> base_losses;
    rows.push_back(train(c, -1, 0, false, base_losses, s));
    // Policies: keep the last k inputs resident, a pool of s activations; late: each page-out
    // copy starts after the forward pass has read x_i (else while it reads it).
    int const L = c.layers;
    struct policy {
      int keep;
      int slots;
      bool early;
    };
    std::vector<policy> const policies{{0, 4, true},
                                       {0, 4, false},
                                       {2, 4, true},
                                       {3, 4, true},
                                       {0, 5, true},
                                       {3, 5, true},
                                       {0, 6, true},
                                       {0, 6, false},
                                       {0, 9, true},
                                       {0, L + 1, true},
                                       {2, 9, true},
                                       {4, 11, true},
                                       {L / 2, L / 2 + 5, true}};
    for (auto const& [keep, slots, early] : policies) {
      if (keep >= L || slots > L + 1 || slots < 3) { continue; }
      std::vector<float> losses;
      row r       = train(c, keep, slots, early, losses, s);
      r.same_loss = losses.size() == base_losses.size() &&
                            std::memcmp(losses.data(), base_losses.data(), losses.size() * 4) == 0
                        ? 1
                        : 0;
      rows.push_back(r);
    }
    rows.front().same_loss = 1;

    wm_bench::peer_result p;
    wm_bench::fs::path const script = wm_bench::find_peer("torch_swap.py", p);
    if (!script.empty()) {
      wm_bench::run_peer(wm_bench::fmt("timeout 600 python3 '%s' --json --layers %d --width %d "
                                       "--batch %d --steps %d",
                                       script.c_str(), c.layers, c.width, c.batch, c.steps),
                         p);
    }

    cudaDeviceProp prop{};
    WM_CUDA_TRY(cudaGetDeviceProperties(&prop, 0));
    double const base = rows.front().ms;
    std::printf("== swap_bench: %s, %d x Linear(%d) + ReLU, bf16, batch %d; activation %.0f MiB\n",
                prop.name, c.layers, c.width, c.batch, act / 1048576.0);
    std::printf(
        "   median of %d steps after %d warm-ups; pinned copy of one activation: "
        "D2H %.1f GB/s, H2D %.1f GB/s\n",
        c.steps, warmups, d2h, h2d);
    std::printf("%-28s %9s %7s %9s %9s %13s %13s %8s %16s %8s %6s\n", "", "step ms", "ratio",
                "peak GiB", "pool GiB", "out GB/s", "in GB/s", "alloc/st", "sync/st (p/s)",
                "wkr/st", "loss");
    for (auto const& r : rows) {
      auto gb = [](double v, double lim) {
        return v < 0 ? std::string{"-"} : wm_bench::fmt("%.1f (%.2f)", v, v / lim);
      };
      auto num = [](double v) { return v < 0 ? std::string{"-"} : wm_bench::fmt("%.2f", v); };
      std::string const syncs = r.syncs_per_step < 0
                                    ? std::string{"-"}
                                    : wm_bench::fmt("%.2f (%.2f/%.2f)", r.syncs_per_step,
                                                    r.syncs_pool_per_step, r.syncs_slab_per_step);
      std::printf("%-28s %9.1f %7.3f %9.2f %9s %13s %13s %8s %16s %8s %6s\n", r.name.c_str(), r.ms,
                  r.ms / base, r.peak_gib, num(r.pool_peak_gib).c_str(),
                  gb(r.out_gbps, d2h).c_str(), gb(r.in_gbps, h2d).c_str(),
                  num(r.allocs_per_step).c_str(), syncs.c_str(),
                  num(r.worker_waits_per_step).c_str(),
                  r.same_loss == 1 ? "same" : (r.same_loss == 0 ? "DIFF" : "-"));
    }
    std::vector<row> peers;  // PyTorch's runs, on the same GPU
    if (!p.json.empty()) {
      double const tm = wm_bench::json_number(p.json, "torch_ms");
      double const tp = wm_bench::json_number(p.json, "torch_peak_gib");
      double const om = wm_bench::json_number(p.json, "save_on_cpu_ms");
      double const op = wm_bench::json_number(p.json, "save_on_cpu_peak_gib");
      std::printf("%-28s %9.1f %7.3f %9.2f\n", "torch", tm, tm / base, tp);
      std::printf("%-28s %9.1f %7.3f %9.2f\n", "torch save_on_cpu(pinned)", om, om / base, op);
      peers.push_back(row{.name = "torch", .ms = tm, .peak_gib = tp});
      peers.push_back(row{.name = "torch save_on_cpu(pinned)", .ms = om, .peak_gib = op});
      std::printf("   wm no-swap step / torch step: %.3f (target: within 5%%)\n", base / tm);
    } else {
      std::printf("   %s\n", p.note.c_str());
    }
    std::printf(
        "   ratio: step / wm no-swap step; out/in GB/s: achieved while copying (ratio to "
        "the pinned copy); pool GiB: most of the pool in use; sync/st: host-blocking syncs "
        "(a user thread waited on the GPU) per step, of those (p/s) for want of a pool block / of "
        "room in the host slab; wkr/st: waits of the user thread on a "
        "swap worker only (for it to issue a copy) per step\n");
    // The targets on this run's rows.
    std::string met;
    double max_syncs = 0;
    for (std::size_t i = 1; i < rows.size(); ++i) {
      double const lower = 1.0 - rows[i].peak_gib / rows.front().peak_gib;
      if (lower >= 0.35 && rows[i].ms / base <= 1.10) {
        met += (met.empty() ? "" : "; ") + rows[i].name;
      }
      max_syncs = std::max(max_syncs, rows[i].syncs_per_step);
      std::printf("   %-28s peak %.1f%% lower at %.3fx\n", rows[i].name.c_str(), 100 * lower,
                  rows[i].ms / base);
    }
    std::printf("   target >= 35%% lower peak at <= 1.10x: %s\n",
                met.empty() ? "NOT met" : ("met by " + met).c_str());
    std::printf("   target 0 host-blocking syncs per step: %s (most: %.2f)\n",
                max_syncs == 0 ? "met" : "NOT met", max_syncs);
    if (!csv.empty()) {  // for bench/plot_swap.py
      std::FILE* f = std::fopen(csv.c_str(), "w");
      if (f == nullptr) {
        std::printf("swap_bench: FAILED: cannot write %s\n", csv.c_str());
        return 1;
      }
      std::fprintf(f, "system,policy,step_ms,ratio,peak_gib\n");
      auto const put = [&](char const* system, row const& r) {
        std::fprintf(f, "%s,\"%s\",%.3f,%.4f,%.4f\n", system, r.name.c_str(), r.ms, r.ms / base,
                     r.peak_gib);
      };
      for (auto const& r : rows) { put("wm", r); }
      for (auto const& r : peers) { put("torch", r); }
      std::fclose(f);
    }
    WM_CUDA_TRY(cudaStreamDestroy(s));
    bool const ok =
        std::all_of(rows.begin(), rows.end(), [](row const& r) { return r.same_loss == 1; });
    if (!ok) {
      std::printf("swap_bench: FAILED: a swapped run's losses differ from the no-swap run's\n");
      return 1;
    }
  } catch (std::exception const& e) {
    std::printf("swap_bench: FAILED: %s\n", e.what());
    return 1;
  }
  return 0;
}
