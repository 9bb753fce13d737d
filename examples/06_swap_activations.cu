// SPDX-License-Identifier: Apache-2.0
/*
 * Example 06: training with the saved activations paged out to host memory.
 *
 * What it teaches:
 *  - A `wm::swap_scope` is an RAII context: a device pool (the residency budget), a pinned host
 *    slab, a copy stream and a transfer queue with its worker per direction. Nothing is
 *    allocated while training: buffers come from the pool, copies go to the slab.
 *  - `scope.allocate<T>(n, stream)` gives a `wm::swappable<T>`. In the forward pass each layer's
 *    saved activation is `pageout_begin(stream)`-ed when the next layer starts reading it (the
 *    copy waits for the kernel that produced it through an event and runs while the next layer
 *    reads it) and `pageout(stream)`-ed once that layer has read it (its memory goes back to the
 *    pool after the copy and the read, with no second copy); the compute stream waits for a copy
 *    only when it needs the memory the copy frees.
 *  - At the start of the backward pass `prefetch_init()`, `need_prefetch()` on each activation in
 *    the order the backward pass needs them, `prefetch_all()`. `data(stream)` makes the stream
 *    wait for the page-in of that buffer (or pages it in at once, at the front of the queue, if
 *    no prefetch brought it).
 *  - Swapping changes where bytes live, never what is computed: the loss of every step is
 *    bitwise the loss without swapping. The program checks that, and prints time and memory
 *    both ways. (At this learning rate the bf16 weights barely move: the point is the equality.)
 *
 * The model: the MLP of bench/workloads/mlp.cuh (bf16 Linear + ReLU layers through cuBLASLt,
 * SGD), 8 layers of width 4096 on a batch of 8192 rows here; bench/swap_bench runs the big one.
 *
 * Run: ./06_swap_activations
 */
#include <wm/launch.hpp>
#include <wm/swap.cuh>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "workloads/mlp.cuh"
#include "workloads/swap_store.cuh"

constexpr int layers = 8;
constexpr int width  = 4096;
constexpr int batch  = 8192;
constexpr int steps  = 6;
constexpr float lr   = 0.05f;

struct run_result {
  std::vector<float> losses;
  float ms_per_step{0};
  std::size_t device_bytes{0};  // device memory the run allocated (weights, activations, pool...)
  wm::swap_statistics stats{};
};

std::size_t device_used() {
  std::size_t free = 0, total = 0;
  WM_CUDA_TRY(cudaMemGetInfo(&free, &total));
  return total - free;
}

// Trains a fresh model (same seed every time) for `steps` steps; @p swap chooses the store.
run_result train(bool swap, std::size_t budget_slots) {
  run_result r;
  WM_CUDA_TRY(cudaDeviceSynchronize());
  std::size_t const base = device_used();
  cudaStream_t s{};
  WM_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t t0{}, t1{};
  WM_CUDA_TRY(cudaEventCreate(&t0));
  WM_CUDA_TRY(cudaEventCreate(&t1));
  {
    wm_workload::mlp model{layers, width, batch, /*seed=*/2024, steps};
    auto const run = [&](auto& store) {
      model.step(store, 0, 1, lr, s);  // step 0 is the warm-up
      WM_CUDA_TRY(cudaEventRecord(t0, s));
      for (int i = 1; i < steps; ++i) { model.step(store, i, 1 + i, lr, s); }
      WM_CUDA_TRY(cudaEventRecord(t1, s));
      WM_CUDA_TRY(cudaStreamSynchronize(s));
      r.device_bytes = device_used() - base;
    };
    if (swap) {
      // 1. The scope: a pool for `budget_slots` activations, a host slab for all of them.
      wm::swap_options o;
      o.device_budget      = budget_slots * model.activation_bytes();
      o.host_bytes         = (layers + 1) * model.activation_bytes();
      o.prefetch_lookahead = 2 * model.activation_bytes();
      wm::swap_scope scope{o};
      // 2. The hooks: every layer's input is paged out while the forward pass reads it.
      wm_workload::swap_store store{scope, layers, model.activation_elements()};
      run(store);
      r.stats = scope.statistics();
    } else {
      wm_workload::resident_store store{layers, model.activation_bytes()};
      run(store);
    }
    r.losses = model.losses(steps);
  }
  float ms = 0;
  WM_CUDA_TRY(cudaEventElapsedTime(&ms, t0, t1));
  r.ms_per_step = ms / (steps - 1);
  WM_CUDA_TRY(cudaEventDestroy(t0));
  WM_CUDA_TRY(cudaEventDestroy(t1));
  WM_CUDA_TRY(cudaStreamDestroy(s));
  return r;
}

int main() {
  try {
    // 0 means the machine has no GPU; a CUDA stack that is there but broken throws (an error).
    if (wm::local_device_count() == 0) {
      std::printf("06_swap_activations: no GPU found, nothing to run\n");
      return 0;
    }
    // 3. The same training without and with swapping.
    std::size_t const slots  = layers / 2 + 2;
    run_result const plain   = train(false, 0);
    run_result const swapped = train(true, slots);

    // 4. The losses must be bitwise equal and finite; each step saw its own input, so they differ
    //    from step to step (a loss that was not computed would not).
    for (int i = 0; i < steps; ++i) {
      std::printf("step %d  loss %.6f  (swap %.6f)\n", i, plain.losses[i], swapped.losses[i]);
      if (std::memcmp(&plain.losses[i], &swapped.losses[i], sizeof(float)) != 0) {
        throw std::runtime_error{"step " + std::to_string(i) + ": the loss with swapping differs"};
      }
      if (!std::isfinite(plain.losses[i]) || plain.losses[i] <= 0) {
        throw std::runtime_error{"step " + std::to_string(i) +
                                 ": the loss is not a positive number"};
      }
      if (i > 0 && plain.losses[i] == plain.losses[i - 1]) {
        throw std::runtime_error{"steps " + std::to_string(i - 1) + " and " + std::to_string(i) +
                                 " have the same loss on different inputs"};
      }
    }
    auto const& st = swapped.stats;
    if (st.bytes_out == 0 || st.bytes_in == 0) {
      throw std::runtime_error{"nothing was paged out and in"};
    }
    double const mib = 1 << 20;
    std::printf("no swap: %8.2f ms/step, device memory %8.1f MiB\n", plain.ms_per_step,
                plain.device_bytes / mib);
    std::printf(
        "swap:    %8.2f ms/step, device memory %8.1f MiB (pool %zu activations of %zu, "
        "peak %.1f MiB in use)\n",
        swapped.ms_per_step, swapped.device_bytes / mib, slots,
        static_cast<std::size_t>(layers + 1), st.peak_resident_bytes / mib);
    std::printf(
        "swap traffic: %.1f MiB out at %.1f GB/s, %.1f MiB in at %.1f GB/s; "
        "%llu page-outs (%llu cancelled), %llu prefetches, %llu passive page-ins; "
        "compute stream waited %.2f ms; host waited on the GPU %llu times, on the swap "
        "workers %llu times\n",
        st.bytes_out / mib, st.out_gbps(), st.bytes_in / mib, st.in_gbps(),
        static_cast<unsigned long long>(st.pageouts),
        static_cast<unsigned long long>(st.pageouts_cancelled),
        static_cast<unsigned long long>(st.prefetches),
        static_cast<unsigned long long>(st.passive_pageins), st.consumer_wait_seconds * 1e3,
        static_cast<unsigned long long>(st.host_blocking_syncs),
        static_cast<unsigned long long>(st.worker_waits));
    std::printf("losses bitwise equal with and without swapping: OK\n");
  } catch (std::exception const& e) {
    std::printf("06_swap_activations: FAILED: %s\n", e.what());
    return 1;
  }
  return 0;
}
