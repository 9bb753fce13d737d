// SPDX-License-Identifier: Apache-2.0
/*
 * zero_bench: the MLP of bench/workloads/mlp.cuh trained through wm::zero_optimizer, stage by
 * stage, on every rank given.
 *
 * Rows: ZeRO-1, ZeRO-2, ZeRO-3 (one group per layer, the default pool of two layers) with Adam on
 * the GPU; ZeRO-2 with wm::offload_host (CPU Adam); and the workload alone (forward, backward and
 * a bf16 SGD in place, no optimizer state: the floor that the model's compute sets).
 * Columns: median step ms (forward + backward with per-bucket reductions + step; CUDA events,
 * after 2 warm-ups); ratio to ZeRO-2; the model states the optimizer holds per GPU (weights,
 * gradients, fp32 masters and Adam moments) against the memory formula of docs/design.md, "ZeRO
 * memory", and their ratio; the communication buffers (staging buckets, stage-3 pool); the device
 * memory the optimizer and model allocated (cudaMemGetInfo before and after, activations included);
 * pinned host bytes. Offload rows: the pipeline (the default pool of spare regions, zero_options::
 * offload_spare_fraction, or --spare-fraction), the same with zero_options::offload_overlap_forward
 * (the next forward beside the end of the CPU Adam, weights_ready per layer; its step ms is the
 * median interval between a step's first and last enqueued work, which in steady state takes in
 * the forward's waits for the last step's weights), the pipeline with a region for every chunk (a
 * full second copy), the pipeline with clipping that scales every step (its update redone after
 * backward), and without the pipeline; for each, the CPU Adam alone on this rank's shard,
 * measured in the same run after the optimizer is freed, in place and into a second copy (the
 * pipeline's form, ahead of the step's decision), and the step's ratio to it (the issue's target:
 * <= 1.2, the pipeline's row); for the pipeline rows, the chunks updated per timed step ahead of
 * the decision, after it, redone, the waits for a free region and the regions used.
 *
 * --pin: zero_options::pin_cpu_threads in every offload row, and the CPU Adam alone on a pool
 * pinned the same way (each worker on one CPU).
 *
 * --offload-only: only the offload rows without the pipeline and with it (the pool of
 * --spare-fraction, else the default; with and without the overlap), for a model whose fp32 states
 * do not fit on the GPU; a row that cannot allocate is reported and skipped; the CPU Adam alone is
 * timed on 2^28 elements and scaled to the shard.
 *
 * PyTorch peer (bench/peers/torch_zero.py), after the wm rows, on the same ranks (one process per
 * GPU through `python3 -m torch.distributed.run` when there are several, else plain python3) and
 * the same model: DDP, ZeroRedundancyOptimizer, FSDP2 fully_shard (resharding after forward, and
 * not); their step ms against wm's ZeRO-1 (gradients all-reduced: wm's data-parallel row), ZeRO-2
 * and ZeRO-3, and their peak allocated memory per GPU. `--no-peer` skips it.
 *
 * Usage: zero_bench [--ranks N] [--layers L] [--width W] [--batch B] [--steps S] [--no-peer]
 *                   [--offload-only] [--spare-fraction F] [--pin]
 *        (defaults: every GPU, 16 8192 8192 5, the option's default fraction)
 */
#include <wm/zero.cuh>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <string>
#include <vector>

#include "common.cuh"
#include "workloads/zero_mlp.cuh"

namespace {

struct config {
  int layers{16};
  int width{8192};
  int batch{8192};
  int steps{5};
  /// The CPU Adam alone runs on at most this many elements (its time scaled to the shard): the
  /// measurement's own arrays take 28 bytes per element beside the optimizer's pinned states.
  std::size_t cpu_adam_elements{~std::size_t{0}};
  /// The offload pipeline's pool of spare regions (zero_options::offload_spare_fraction).
  float spare_fraction{wm::zero_options{}.offload_spare_fraction};
  /// zero_options::pin_cpu_threads in the offload rows and the CPU Adam alone.
  bool pin{false};
};

std::size_t device_used() {
  std::size_t free = 0, total = 0;
  WM_CUDA_TRY(cudaMemGetInfo(&free, &total));
  return total - free;
}

constexpr double gib = 1024.0 * 1024.0 * 1024.0;

struct row {
  std::string name;
  double ms{};
  double states{};   // model states held (bytes)
  double formula{};  // docs/design.md, "ZeRO memory"
  double buffers{};
  double allocated{};
  double host{};
  double cpu_adam_ms{};      // offload: the CPU Adam alone on this shard, in place
  double cpu_adam_sep_ms{};  // the same into a second copy (the offload pipeline's form)
  double cpu_adam_min_ms{};  // the fastest of the in-place repetitions (median above)
  bool pipeline{false};      // offload with the pipeline: `stats` hold its timed steps
  wm::zero_offload_stats stats{};
  int timed_steps{0};
};

/// What rank 0 hands to the parent process for the peer's table (memory shared with the ranks).
struct wm_figures {
  bool done{false};
  double ms[3]{};         // ZeRO-1, ZeRO-2, ZeRO-3
  double allocated[3]{};  // device bytes
};

/// The string after "key": in a JSON line ("" if absent or not a string; escapes kept as they are).
std::string json_string(std::string const& line, std::string const& key) {
  auto at = line.find('"' + key + "\": \"");
  if (at == std::string::npos) { return {}; }
  at += key.size() + 5;
  std::string s;
  for (; at < line.size() && line[at] != '"'; ++at) {
    if (line[at] == '\\' && at + 1 < line.size()) { s += line[at++]; }
    s += line[at];
  }
  return s;
}

/// Runs bench/peers/torch_zero.py on the same model and ranks and prints its rows beside wm's.
void run_torch_peer(config const& c, int ranks, wm_figures const& wm) {
  wm_bench::peer_result p;
  wm_bench::fs::path const script = wm_bench::find_peer("torch_zero.py", p);
  if (!script.empty()) {
    std::string const launcher =
        ranks > 1 ? wm_bench::fmt(
                        "python3 -m torch.distributed.run --standalone --nproc_per_node %d", ranks)
                  : std::string{"python3"};
    wm_bench::run_peer("timeout 480 " + launcher +
                           wm_bench::fmt(" '%s' --json --layers %d --width %d --batch %d "
                                         "--steps %d --bucket-mib 256",
                                         script.c_str(), c.layers, c.width, c.batch, c.steps),
                       p);
  }
  if (p.json.empty()) {
    std::printf("%s\n", p.note.c_str());
    return;
  }
  std::printf(
      "torch peer (bench/peers/torch_zero.py, %d process(es), torch %s): fp32 parameters as "
      "master weights, bf16 compute, gradients reduced in bf16, Adam with wm's hyper-parameters "
      "(fused; foreach if fused fails)\n",
      ranks, json_string(p.json, "torch").c_str());
  std::printf("%-28s %9s %8s %8s %8s %9s %9s\n", "run", "step ms", "/ZeRO-1", "/ZeRO-2", "/ZeRO-3",
              "peak GiB", "reserved");
  struct peer_row {
    char const* key;
    char const* name;
  };
  double fsdp2 = std::numeric_limits<double>::quiet_NaN();  // the faster FSDP2 row
  double ddp   = std::numeric_limits<double>::quiet_NaN();
  for (auto const& [key, name] :
       {peer_row{"ddp", "torch DDP"}, peer_row{"zero_redundancy", "torch ZeroRedundancyOpt"},
        peer_row{"fsdp2", "torch FSDP2"}, peer_row{"fsdp2_keep", "torch FSDP2 no reshard"}}) {
    std::string const k{key};
    double const ms = wm_bench::json_number(p.json, k + "_ms");
    if (std::isnan(ms)) {
      std::string const err = json_string(p.json, k + "_error");
      std::printf("%-28s FAILED: %s\n", name, err.empty() ? "no figures" : err.c_str());
      continue;
    }
    std::printf("%-28s %9.2f %8.3f %8.3f %8.3f %9.3f %9.3f\n", name, ms, ms / wm.ms[0],
                ms / wm.ms[1], ms / wm.ms[2], wm_bench::json_number(p.json, k + "_peak_gib"),
                wm_bench::json_number(p.json, k + "_reserved_gib"));
    if (k == "ddp") { ddp = ms; }
    if (k.starts_with("fsdp2") && !(ms >= fsdp2)) { fsdp2 = ms; }
  }
  std::printf(
      "   peak GiB: torch.cuda.max_memory_allocated over the timed steps, the largest over the "
      "ranks (wm: the 'allocated' column above: ZeRO-1 %.3f, ZeRO-2 %.3f, ZeRO-3 %.3f)\n",
      wm.allocated[0] / gib, wm.allocated[1] / gib, wm.allocated[2] / gib);
  std::printf("   wm ZeRO-1, ZeRO-2, ZeRO-3 / torch DDP: %.3f %.3f %.3f\n", wm.ms[0] / ddp,
              wm.ms[1] / ddp, wm.ms[2] / ddp);
  std::printf(
      "   target wm ZeRO-2 and ZeRO-3 ahead of FSDP2 (the faster of its rows): %s "
      "(%.3f, %.3f)\n",
      std::isnan(fsdp2)                      ? "n/a"
      : wm.ms[1] < fsdp2 && wm.ms[2] < fsdp2 ? "met"
                                             : "NOT met",
      wm.ms[1] / fsdp2, wm.ms[2] / fsdp2);
}

template <class Stage, class Offload>
row run_zero(wm::communicator& comm, config const& c, cudaStream_t stream, char const* name,
             wm::zero_options const& options = {}) {
  using optimizer_type = wm::zero_optimizer<Stage, wm::adam, Offload>;
  auto const params    = wm_workload::zero_mlp_parameters(c.layers, c.width);
  row r;
  r.name            = name;
  r.pipeline        = Offload::host && options.offload_pipeline;
  r.timed_steps     = c.steps;
  std::size_t shard = 0;
  {  // the optimizer and the model, freed before the CPU Adam alone allocates its arrays
    WM_CUDA_TRY(cudaDeviceSynchronize());
    std::size_t const before = device_used();
    optimizer_type opt{comm, params, std::size_t{256} << 20, wm::adam{}, options};
    wm_workload::zero_mlp<optimizer_type> model{opt, c.layers, c.width, c.batch};
    model.init_weights(7, stream);
    WM_CUDA_TRY(cudaDeviceSynchronize());
    r.allocated  = static_cast<double>(device_used() - before);
    auto const m = opt.memory();
    r.states     = static_cast<double>(m.model_states());
    r.buffers    = static_cast<double>(m.buffers);
    r.host       = static_cast<double>(m.host);
    std::vector<wm::detail::zero::param_spec> specs;
    for (auto const& p : params) { specs.push_back({p.name, p.elements(), p.type}); }
    auto const est =
        wm::detail::zero::zero_memory_estimate(Stage::value, specs, comm.size(), Offload::host);
    r.formula = est.device_bytes;
    shard     = opt.layout().state_elements;
    int step  = 0;
    wm::zero_offload_stats first{};  // before the first timed step (after the 2 warm-ups)
    auto once = [&] {
      if (step == 2) {  // between steps, the worker idle (overlap: once the weights are in)
        opt.weights_ready(0, cuda::stream_ref{stream});
        first = opt.offload_stats();
      }
      model.forward_backward(
          1000003ull * static_cast<std::uint64_t>(step++) + static_cast<std::uint64_t>(comm.rank()),
          stream);
      opt.step(1e-4f, cuda::stream_ref{stream});
    };
    std::vector<cudaEvent_t> events(2 * static_cast<std::size_t>(c.steps));
    for (auto& e : events) { WM_CUDA_TRY(cudaEventCreate(&e)); }
    r.ms = wm_bench::median(wm_bench::event_times_ms(once, 2, events, stream, comm));
    opt.weights_ready(0, cuda::stream_ref{stream});  // overlap: the last step's tail, then stats
    for (auto& e : events) { WM_CUDA_TRY(cudaEventDestroy(e)); }
    auto const last          = opt.offload_stats();
    r.stats                  = last;
    r.stats.chunks_ahead     = last.chunks_ahead - first.chunks_ahead;
    r.stats.chunks_after     = last.chunks_after - first.chunks_after;
    r.stats.chunks_dropped   = last.chunks_dropped - first.chunks_dropped;
    r.stats.chunks_redone    = last.chunks_redone - first.chunks_redone;
    r.stats.region_waits     = last.region_waits - first.region_waits;
    r.stats.wait_seconds     = last.wait_seconds - first.wait_seconds;
    r.stats.cpu_adam_seconds = last.cpu_adam_seconds - first.cpu_adam_seconds;
  }
  if constexpr (Offload::host) {
    // The CPU Adam alone on arrays of this rank's shard size (the same pool size as the step's),
    // in place, and into a second copy of master, m and v (the pipeline's form), alternating.
    namespace z                 = wm::detail::zero;
    std::size_t const n         = std::min(shard, c.cpu_adam_elements);
    double const scale_to_shard = n > 0 ? static_cast<double>(shard) / static_cast<double>(n) : 1.0;
    std::vector<float> master(n, 0.5f), mo(n, 0.0f), v(n, 0.0f);
    std::vector<float> master2(n, 0.5f), mo2(n, 0.0f), v2(n, 0.0f);
    std::vector<z::bf16_bits> g(n, 0x3c00), out(n);
    z::thread_pool pool{0, c.pin};
    for (int sep = 0; sep < 2; ++sep) {
      std::vector<double> ms;
      for (int i = 0; i < 2 + c.steps; ++i) {
        bool const odd = sep == 1 && i % 2 == 1;
        z::cpu_adam_arrays<z::bf16_bits> a{odd ? master2.data() : master.data(),
                                           odd ? mo2.data() : mo.data(),
                                           odd ? v2.data() : v.data(),
                                           g.data(),
                                           out.data(),
                                           n};
        if (sep == 1) {
          a.master_out = odd ? master.data() : master2.data();
          a.m_out      = odd ? mo.data() : mo2.data();
          a.v_out      = odd ? v.data() : v2.data();
        }
        auto const t0 = std::chrono::steady_clock::now();
        z::cpu_adam_update(z::cpu_adam_options{}, z::cpu_adam_step{1e-4f, i + 1, 1.0f}, a, pool);
        auto const t1 = std::chrono::steady_clock::now();
        if (i >= 2) { ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count()); }
      }
      (sep == 0 ? r.cpu_adam_ms : r.cpu_adam_sep_ms) = wm_bench::median(ms) * scale_to_shard;
      if (sep == 0) {
        r.cpu_adam_min_ms = *std::min_element(ms.begin(), ms.end()) * scale_to_shard;
      }
    }
  }
  return r;
}

row run_plain(wm::communicator& comm, config const& c, cudaStream_t stream) {
  WM_CUDA_TRY(cudaDeviceSynchronize());
  std::size_t const before = device_used();
  wm_workload::mlp model{c.layers, c.width, c.batch, 7, 64};
  wm_workload::resident_store store{c.layers, model.activation_bytes()};
  WM_CUDA_TRY(cudaDeviceSynchronize());
  row r;
  r.name      = "workload alone (bf16 SGD)";
  r.allocated = static_cast<double>(device_used() - before);
  r.states    = 4.0 * static_cast<double>(model.weight_elements()) * c.layers;  // w + g
  int step    = 0;
  auto once   = [&] {
    model.step(store, step % 64, 1000003ull * static_cast<std::uint64_t>(step), 1e-4f, stream);
    ++step;
  };
  std::vector<cudaEvent_t> events(2 * static_cast<std::size_t>(c.steps));
  for (auto& e : events) { WM_CUDA_TRY(cudaEventCreate(&e)); }
  r.ms = wm_bench::median(wm_bench::event_times_ms(once, 2, events, stream, comm));
  for (auto& e : events) { WM_CUDA_TRY(cudaEventDestroy(e)); }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  wm_bench::set_environment();
  config c;
  bool peer = true;
  // --offload-only: only the rows that keep the fp32 states in host memory (unpipelined first:
  // 16 pinned bytes per parameter; the pipeline needs 28), for a model whose states do not fit
  // on the GPU; a row that cannot allocate is reported and skipped (with one rank: a row that
  // fails on some ranks only would leave the others in its collectives until the timeout).
  bool offload_only = false;
  std::vector<char*> rest{argv[0]};
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--no-peer") == 0) {
      peer = false;
      continue;
    }
    if (std::strcmp(argv[i], "--spare-fraction") == 0 && i + 1 < argc) {
      c.spare_fraction = std::strtof(argv[++i], nullptr);
      continue;
    }
    if (std::strcmp(argv[i], "--pin") == 0) {
      c.pin = true;
      continue;
    }
    if (std::strcmp(argv[i], "--offload-only") == 0) {
      offload_only        = true;
      peer                = false;
      c.cpu_adam_elements = std::size_t{1} << 28;  // 7.5 GB of arrays, timed and scaled
      continue;
    }
    bool const known =
        i + 1 < argc &&
        (std::strcmp(argv[i], "--layers") == 0 || std::strcmp(argv[i], "--width") == 0 ||
         std::strcmp(argv[i], "--batch") == 0 || std::strcmp(argv[i], "--steps") == 0);
    if (!known) {
      rest.push_back(argv[i]);
      continue;
    }
    int const v = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--layers") == 0) { c.layers = v; }
    if (std::strcmp(argv[i], "--width") == 0) { c.width = v; }
    if (std::strcmp(argv[i], "--batch") == 0) { c.batch = v; }
    if (std::strcmp(argv[i], "--steps") == 0) { c.steps = v; }
    ++i;
  }
  if (c.layers < 1 || c.width < 1 || c.batch < 1 || c.steps < 1) {
    std::fprintf(stderr, "zero_bench: layers, width, batch and steps >= 1 expected\n");
    return 2;
  }
  if (!(c.spare_fraction >= 0.0f && c.spare_fraction <= 1.0f)) {
    std::fprintf(stderr, "zero_bench: --spare-fraction in [0, 1] expected\n");
    return 2;
  }
  int const gpus = wm::local_device_count();
  if (gpus == 0) {
    std::printf("zero_bench: no GPU found, nothing to measure\n");
    return 0;
  }
  int ranks =
      wm_bench::ranks_argument(static_cast<int>(rest.size()), rest.data(), gpus, "zero_bench");
  if (ranks < 0) { return 2; }
  if (ranks == 0) { ranks = gpus; }
  wm_figures* const figures = wm_bench::shared_results<wm_figures>("zero_bench");
  try {
    wm::launch(ranks, [&](wm::communicator& comm) {
      cudaStream_t stream{};
      WM_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      std::vector<row> rows;
      // A row that fails (an allocation too large for this machine) is reported, not fatal.
      auto const add = [&](char const* name, auto&& run) {
        try {
          rows.push_back(run());
        } catch (std::exception const& e) {
          if (comm.rank() == 0) { std::printf("zero_bench: %s: not run: %s\n", name, e.what()); }
        }
      };
      wm::zero_options piped;  // the pool of spare regions of --spare-fraction
      piped.offload_spare_fraction    = c.spare_fraction;
      piped.pin_cpu_threads           = c.pin;
      wm::zero_options clipped        = piped;
      clipped.max_grad_norm           = 1e-6f;
      wm::zero_options full           = piped;  // a region for every chunk: the full second copy
      full.offload_spare_fraction     = 1.0f;
      wm::zero_options unpiped        = piped;
      unpiped.offload_pipeline        = false;
      wm::zero_options overlap        = piped;  // the next forward beside the end of the CPU Adam
      overlap.offload_overlap_forward = true;
      if (offload_only) {
        add("ZeRO-2, offload, no pipe", [&] {
          return run_zero<wm::zero_stage<2>, wm::offload_host>(comm, c, stream,
                                                               "ZeRO-2, offload, no pipe", unpiped);
        });
        add("ZeRO-2, offload", [&] {
          return run_zero<wm::zero_stage<2>, wm::offload_host>(comm, c, stream, "ZeRO-2, offload",
                                                               piped);
        });
        add("ZeRO-2, offload, overlap", [&] {
          return run_zero<wm::zero_stage<2>, wm::offload_host>(comm, c, stream,
                                                               "ZeRO-2, offload, overlap", overlap);
        });
      } else {
        rows.push_back(run_zero<wm::zero_stage<1>, wm::no_offload>(comm, c, stream, "ZeRO-1"));
        rows.push_back(run_zero<wm::zero_stage<2>, wm::no_offload>(comm, c, stream, "ZeRO-2"));
        rows.push_back(run_zero<wm::zero_stage<3>, wm::no_offload>(comm, c, stream, "ZeRO-3"));
        // Offload: the pipeline (each bucket's CPU Adam as it lands; no clipping, the rate of
        // the last step), the same with clipping that scales every step (the update is redone
        // after backward), and without the pipeline (the update after backward).
        rows.push_back(run_zero<wm::zero_stage<2>, wm::offload_host>(comm, c, stream,
                                                                     "ZeRO-2, offload", piped));
        rows.push_back(run_zero<wm::zero_stage<2>, wm::offload_host>(
            comm, c, stream, "ZeRO-2, offload, overlap", overlap));
        rows.push_back(run_zero<wm::zero_stage<2>, wm::offload_host>(
            comm, c, stream, "ZeRO-2, offload, full copy", full));
        rows.push_back(run_zero<wm::zero_stage<2>, wm::offload_host>(
            comm, c, stream, "ZeRO-2, offload, clip", clipped));
        rows.push_back(run_zero<wm::zero_stage<2>, wm::offload_host>(
            comm, c, stream, "ZeRO-2, offload, no pipe", unpiped));
        rows.push_back(run_plain(comm, c, stream));
      }
      WM_CUDA_TRY(cudaStreamDestroy(stream));
      if (comm.rank() != 0) { return; }
      if (figures != nullptr && !offload_only) {
        for (int i = 0; i < 3; ++i) {
          figures->ms[i]        = rows[static_cast<std::size_t>(i)].ms;
          figures->allocated[i] = rows[static_cast<std::size_t>(i)].allocated;
        }
        figures->done = true;
      }
      double const params = static_cast<double>(c.layers) * c.width * c.width;
      std::printf(
          "zero_bench: %d x Linear(%d, %d) + ReLU, bf16, batch %d, %.3g B parameters, "
          "%d rank(s), Adam, 256 MiB buckets; CPU Adam threads %s\n",
          c.layers, c.width, c.width, c.batch, params / 1e9, comm.size(),
          c.pin ? "pinned (--pin)" : "not pinned");
      std::size_t free_b = 0, total_b = 0;
      WM_CUDA_TRY(cudaMemGetInfo(&free_b, &total_b));
      double const states_gib = params * 16.0 / gib;  // fp32 masters + Adam's two moments
      std::printf(
          "zero_bench: fp32 master weights and Adam states %.1f GiB, GPU memory %.1f GiB: "
          "they %s on the GPU\n",
          states_gib, static_cast<double>(total_b) / gib,
          states_gib * gib > static_cast<double>(total_b) ? "do NOT fit" : "fit");
      double base = 0;  // the ZeRO-2 row's step, when it ran
      for (auto const& r : rows) {
        if (r.name == "ZeRO-2") { base = r.ms; }
      }
      std::printf("%-28s %9s %7s %11s %11s %7s %10s %11s %9s\n", "run", "step ms", "/ZeRO-2",
                  "states GiB", "formula", "ratio", "buffers", "allocated", "host GiB");
      for (auto const& r : rows) {
        std::printf("%-28s %9.2f %7.3f %11.3f %11.3f %7.4f %10.3f %11.3f %9.3f\n", r.name.c_str(),
                    r.ms, base > 0 ? r.ms / base : 0.0, r.states / gib, r.formula / gib,
                    r.formula > 0 ? r.states / r.formula : 0.0, r.buffers / gib, r.allocated / gib,
                    r.host / gib);
      }
      if (offload_only) {
        std::printf(
            "zero_bench: the CPU Adam alone below was timed on at most %zu elements and "
            "scaled to the shard\n",
            c.cpu_adam_elements);
      }
      for (auto const& off : rows) {
        if (off.cpu_adam_ms <= 0) { continue; }
        std::printf(
            "%s: CPU Adam alone on this rank's shard %.2f ms in place, %.2f ms into a second "
            "copy; step / CPU Adam in place = %.3f%s, / into a copy = %.3f\n",
            off.name.c_str(), off.cpu_adam_ms, off.cpu_adam_sep_ms, off.ms / off.cpu_adam_ms,
            off.name.starts_with("ZeRO-2, offload") && off.pipeline ? " (target <= 1.2)" : "",
            off.ms / off.cpu_adam_sep_ms);
      }
      // The strict form of the offload target: the step against the fastest in-place CPU Adam
      // alone of the whole run (every row's repetitions), not only its own row's median.
      double fastest = 0.0;
      for (auto const& off : rows) {
        if (off.cpu_adam_min_ms > 0 && (fastest == 0.0 || off.cpu_adam_min_ms < fastest)) {
          fastest = off.cpu_adam_min_ms;
        }
      }
      for (auto const& off : rows) {
        if (off.cpu_adam_ms <= 0 || fastest <= 0) { continue; }
        std::printf(
            "%s: step / the run's fastest CPU Adam alone (%.2f ms) = %.3f%s\n", off.name.c_str(),
            fastest, off.ms / fastest,
            off.name.starts_with("ZeRO-2, offload") && off.pipeline ? " (target <= 1.2)" : "");
      }
      // The CPU Adam as it ran inside the timed steps (wall time of its chunk updates, with the
      // copies and the GPU's driver threads beside it): what the step adds on top of it.
      for (auto const& off : rows) {
        if (off.cpu_adam_ms <= 0 || off.timed_steps <= 0) { continue; }
        double const inside = 1e3 * off.stats.cpu_adam_seconds / off.timed_steps;
        if (inside <= 0) { continue; }
        std::printf("%s: CPU Adam inside the step %.2f ms; step / that = %.3f\n", off.name.c_str(),
                    inside, off.ms / inside);
      }
      for (auto const& off : rows) {
        if (!off.pipeline) { continue; }
        auto const& st     = off.stats;
        double const steps = off.timed_steps;
        std::printf(
            "%s: pinned %.2f GiB; per timed step: %.1f chunks ahead of the decision, %.1f after "
            "it, %.1f redone, %.1f dropped; %.2f waits for a free region (%.2f ms each step); "
            "spare regions %zu of %zu elements (%.2f GiB), peak %zu in use\n",
            off.name.c_str(), off.host / gib, st.chunks_ahead / steps, st.chunks_after / steps,
            st.chunks_redone / steps, st.chunks_dropped / steps, st.region_waits / steps,
            1e3 * st.wait_seconds / steps, st.spare_regions, st.region_elements,
            static_cast<double>(st.spare_regions * st.region_elements * 12) / gib, st.peak_regions);
      }
      std::printf("peak memory target: states within 3%% of the formula plus two buckets: %s\n",
                  [&] {
                    for (auto const& r : rows) {
                      if (r.formula > 0 && r.states > 1.03 * r.formula + 2.0 * (256 << 20)) {
                        return "NOT MET";
                      }
                    }
                    return "met";
                  }());
    });
  } catch (wm::launch_error const& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  // After the ranks have exited and freed their GPUs.
  if (peer && figures != nullptr && figures->done) { run_torch_peer(c, ranks, *figures); }
  return 0;
}
