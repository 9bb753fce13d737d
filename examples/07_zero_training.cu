// SPDX-License-Identifier: Apache-2.0
/*
 * Example 07: data-parallel training with ZeRO stage 2 (docs/design.md, "ZeRO memory").
 *
 * What it teaches:
 *  - `wm::zero_optimizer<wm::zero_stage<2>, wm::adam>` takes the model's parameter list (names,
 *    shapes, bf16) and a bucket size, and owns every byte of the model state from then on: the
 *    bf16 weights (one arena, every rank), the gradients (each rank keeps its shard; backward
 *    writes into two bucket staging buffers), and the fp32 master weights and Adam moments of
 *    the rank's shard only. `memory()` reports them; nothing is allocated while training.
 *  - The model reads `opt.weights<bf16>(p)` and writes `opt.gradients<bf16>(p)`. Buckets are in
 *    backward order: as soon as backward has produced the last gradient of a bucket,
 *    `reduce_gradients(bucket, stream)` reduce-scatters it (it overlaps the rest of backward).
 *  - `step(lr, stream)`: the global gradient norm and the inf check from one scalar all-reduce,
 *    one fused Adam kernel per shard writing bf16 weights, then the in-place all-gather.
 *
 * The model: the MLP of bench/workloads/mlp.cuh (bf16 Linear + ReLU layers through cuBLASLt,
 * loss 0.5 · Σ y² / batch) as bench/workloads/zero_mlp.cuh runs it: weights and gradients in
 * the optimizer's arena, each bucket reduced as soon as backward completes it. Each rank trains
 * on its own batches; the mean loss over the ranks is printed and must fall.
 *
 * The same training runs twice: with the update on the GPU, then with `wm::offload_host` (fp32
 * master weights and Adam moments in pinned host memory, the CPU Adam updating each bucket while
 * the previous bucket's weights go back to the GPU); the two loss curves must agree.
 *
 * Run: ./07_zero_training [ranks]     (default: one rank per GPU)
 */
#include <wm/launch.hpp>
#include <wm/zero.cuh>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "workloads/zero_mlp.cuh"

constexpr int layers              = 8;
constexpr int width               = 2048;
constexpr int batch               = 4096;
constexpr int steps               = 30;
constexpr float lr                = 1e-4f;
constexpr std::size_t bucket_size = std::size_t{16} << 20;  // two layers of 8 MiB per bucket

namespace wl = wm_workload;

// Trains a fresh model (same seed every time) and returns the mean loss of every step.
template <class Offload>
std::vector<double> train(wm::communicator& comm, cudaStream_t stream) {
  using optimizer_type = wm::zero_optimizer<wm::zero_stage<2>, wm::adam, Offload>;
  cuda::stream_ref const s{stream};
  // 1. The parameter list, forward order: one width × width bf16 weight per layer.
  auto const params = wl::zero_mlp_parameters(layers, width);
  // 2. The optimizer: plan, arena, shards, all allocated now (collective).
  wm::zero_options options;
  options.max_grad_norm = 1.0f;
  // With offload, a step returns while the CPU Adam finishes the buckets in forward order; the
  // model's forward calls opt.weights_ready(b, stream) before it reads bucket b's weights.
  options.offload_overlap_forward = Offload::host;
  optimizer_type opt{comm, params, bucket_size, wm::adam{}, options};
  auto const mem = opt.memory();
  if (comm.rank() == 0) {
    std::printf(
        "ZeRO-2%s on %d rank(s), %zu buckets, per rank: weights %.1f MiB, gradient shard %.1f "
        "MiB, fp32 master + Adam states %.1f MiB, staging %.1f MiB; pinned host %.1f MiB\n",
        Offload::host ? " with offload" : "", comm.size(), opt.buckets(), mem.weights / 1048576.0,
        mem.gradients / 1048576.0, (mem.master_weights + mem.optimizer_states) / 1048576.0,
        mem.buffers / 1048576.0, mem.host / 1048576.0);
  }
  // 3. The model, its weights and gradients in the optimizer's arena; initial weights the same
  // on every rank (as mlp.cuh draws them).
  wl::zero_mlp<optimizer_type> model{opt, layers, width, batch};
  model.init_weights(42, stream);

  // 4. Train: forward, backward with per-bucket reduce-scatters, one ZeRO step.
  std::vector<double> losses;
  double first = 0, last = 0;
  for (int step = 0; step < steps; ++step) {
    std::uint64_t const seed =
        1000003ull * static_cast<std::uint64_t>(step) + static_cast<std::uint64_t>(comm.rank());
    model.forward_backward(seed, stream);
    opt.step(lr, s);
    float loss = 0;
    comm.synchronize(s);
    WM_CUDA_TRY(cudaMemcpy(&loss, model.loss(), sizeof(float), cudaMemcpyDeviceToHost));
    double mean = 0;
    for (float l : comm.all_gather(loss)) { mean += l; }
    mean /= comm.size();
    if (step == 0) { first = mean; }
    last = mean;
    losses.push_back(mean);
    if (comm.rank() == 0 && (step % 5 == 0 || step == steps - 1)) {
      std::printf("step %2d  loss %.6g%s\n", step, mean,
                  opt.last_step_skipped(s) ? "  (skipped: inf/NaN gradient)" : "");
    }
  }
  // 5. The loss must have fallen.
  if (!(std::isfinite(last) && last < 0.5 * first)) {
    throw std::runtime_error{"the loss did not fall: " + std::to_string(first) + " -> " +
                             std::to_string(last)};
  }
  if (comm.rank() == 0) {
    std::printf("loss fell from %.6g to %.6g (%lld steps applied)\n", first, last,
                static_cast<long long>(opt.applied_steps(s)));
  }
  return losses;
}

int main(int argc, char** argv) {
  // Counted without initializing CUDA here (we still have to fork). 0 means the machine has
  // none; a CUDA stack that is there but broken throws: that is an error, not "no GPU".
  int gpus = 0;
  try {
    gpus = wm::local_device_count();
  } catch (std::exception const& e) {
    std::fprintf(stderr, "07_zero_training: %s\n", e.what());
    return 1;
  }
  int const ranks = argc > 1 ? std::atoi(argv[1]) : gpus;
  if (gpus == 0) {
    std::printf("07_zero_training: no GPU found, nothing to run\n");
    return 0;
  }
  if (ranks < 1 || ranks > gpus) {
    std::fprintf(stderr, "07_zero_training: ranks must be in [1, %d]\n", gpus);
    return 2;
  }
  try {
    wm::launch(ranks, [](wm::communicator& comm) {
      cudaStream_t stream{};
      WM_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

      auto const device  = train<wm::no_offload>(comm, stream);
      auto const offload = train<wm::offload_host>(comm, stream);
      // 6. Offload moves the update to the CPU, not what it computes: the losses agree.
      for (int step = 0; step < steps; ++step) {
        double const a = device[static_cast<std::size_t>(step)];
        double const b = offload[static_cast<std::size_t>(step)];
        if (!(std::abs(a - b) <= 0.02 * std::abs(a) + 1e-6 * std::abs(device.front()))) {
          throw std::runtime_error{"step " + std::to_string(step) + ": loss " + std::to_string(a) +
                                   " on the GPU, " + std::to_string(b) + " with offload"};
        }
      }
      if (comm.rank() == 0) { std::printf("offload follows the on-device run within 2%%\n"); }
      WM_CUDA_TRY(cudaStreamDestroy(stream));
    });
  } catch (wm::launch_error const& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  std::printf("07_zero_training: OK on %d rank(s)\n", ranks);
  return 0;
}
