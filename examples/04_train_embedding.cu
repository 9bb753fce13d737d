// SPDX-License-Identifier: Apache-2.0
/*
 * Example 04: training an embedding table with a fused sparse optimizer.
 *
 * What it teaches:
 *  - `wm::embedding<T, CachePolicy, Optimizer, Location, Layout>` is a table spread over the
 *    ranks plus the optimizer's state, partitioned the same way.
 *  - Forward: `gather(keys, out, stream)`. Backward + update: `apply_gradients(keys, grads, lr,
 *    stream)` (collective): gradients go to the rank owning each row, duplicates are summed, one
 *    fused kernel updates weight and state of each touched row.
 *  - The loop below learns a known target: row k must move to a fixed vector target(k) under the
 *    loss 0.5 · |row - target|², whose gradient is simply row - target. The loss must fall.
 *
 * Run: ./04_train_embedding            (uses every GPU of this machine)
 */
#include <wm/embedding.cuh>
#include <wm/launch.hpp>

#include <cstdio>
#include <exception>
#include <vector>

constexpr std::size_t rows  = 100'000;
constexpr std::size_t dim   = 32;
constexpr std::size_t batch = 8192;
constexpr int steps         = 300;

__host__ __device__ inline std::uint64_t mix(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The vector row k should learn: values in [-1, 1).
__device__ inline float target(std::size_t k, std::size_t j) {
  return static_cast<float>(mix(k * dim + j + 1) >> 40) / 8388608.0f - 1.0f;
}

// Keys of step s on rank r: a hot set of 2,000 rows gets half the keys (so keys repeat in a
// batch), the rest spread over the first 20,000 rows.
__global__ void draw_keys(std::int64_t* keys, int step, int rank) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < batch;
       i += gridDim.x * blockDim.x) {
    std::uint64_t const z = mix((static_cast<std::uint64_t>(step) << 40) ^
                                (static_cast<std::uint64_t>(rank) << 32) ^ i);
    keys[i]               = static_cast<std::int64_t>(i % 2 == 0 ? z % 2000 : z % 20000);
  }
}

// grads = rows - targets; loss accumulates 0.5 |rows - targets|².
__global__ void loss_and_grad(float const* out, std::int64_t const* keys, float* grads,
                              double* loss) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < batch * dim;
       i += gridDim.x * blockDim.x) {
    float const d = out[i] - target(static_cast<std::size_t>(keys[i / dim]), i % dim);
    grads[i]      = d;
    atomicAdd(loss, 0.5 * d * d);
  }
}

int main() {
  // Counted without initializing CUDA here (we still have to fork). 0 means the machine has
  // none; a CUDA stack that is there but broken throws: that is an error, not "no GPU".
  int gpus = 0;
  try {
    gpus = wm::local_device_count();
  } catch (std::exception const& e) {
    std::fprintf(stderr, "04_train_embedding: %s\n", e.what());
    return 1;
  }
  if (gpus == 0) {
    std::printf("04_train_embedding: no GPU found, nothing to run\n");
    return 0;
  }
  try {
    wm::launch(gpus, [](wm::communicator& comm) {
      // 1. A table of small random rows with Adam state, spread over the ranks.
      wm::adam adam;
      adam.weight_decay = 0.0f;
      wm::embedding<float, wm::no_cache, wm::adam, wm::device, wm::chunked> table{
          comm, rows, dim, adam, wm::embedding_init::uniform(-0.01f, 0.01f, 7)};

      std::int64_t* keys = nullptr;
      float* out         = nullptr;
      float* grads       = nullptr;
      double* loss       = nullptr;
      WM_CUDA_TRY(cudaMalloc(&keys, batch * sizeof(std::int64_t)));
      WM_CUDA_TRY(cudaMalloc(&out, batch * dim * sizeof(float)));
      WM_CUDA_TRY(cudaMalloc(&grads, batch * dim * sizeof(float)));
      WM_CUDA_TRY(cudaMalloc(&loss, sizeof(double)));
      cudaStream_t stream{};
      WM_CUDA_TRY(cudaStreamCreate(&stream));
      std::span<std::int64_t const> const key_span{keys, batch};

      double first = 0;
      double last  = 0;
      for (int step = 0; step < steps; ++step) {
        // 2. Forward: gather the rows of this batch.
        draw_keys<<<64, 256, 0, stream>>>(keys, step, comm.rank());
        WM_CHECK_LAUNCH();
        table.gather(key_span, out, cuda::stream_ref{stream});
        // 3. Loss and gradient (what a model's backward pass would produce).
        WM_CUDA_TRY(cudaMemsetAsync(loss, 0, sizeof(double), stream));
        loss_and_grad<<<256, 256, 0, stream>>>(out, keys, grads, loss);
        WM_CHECK_LAUNCH();
        double mine = 0;
        WM_CUDA_TRY(cudaMemcpyAsync(&mine, loss, sizeof(double), cudaMemcpyDeviceToHost, stream));
        // 4. Backward + update: sums duplicate keys, updates each row once.
        table.apply_gradients(key_span, grads, 0.05f, cuda::stream_ref{stream});
        double total = 0;
        for (double l : comm.all_gather(mine)) { total += l; }
        total /= static_cast<double>(batch * static_cast<std::size_t>(comm.size()));
        if (step == 0) { first = total; }
        last = total;
        if (comm.rank() == 0 && (step % 50 == 0 || step == steps - 1)) {
          std::printf("step %3d  loss per key %.5f\n", step, total);
        }
      }
      // 5. The loss must have fallen a lot.
      if (!(last < 0.05 * first)) {
        throw std::runtime_error{"the loss did not fall: " + std::to_string(first) + " -> " +
                                 std::to_string(last)};
      }
      if (comm.rank() == 0) { std::printf("loss fell from %.4f to %.5f\n", first, last); }
      WM_CUDA_TRY(cudaStreamDestroy(stream));
      WM_CUDA_TRY(cudaFree(keys));
      WM_CUDA_TRY(cudaFree(out));
      WM_CUDA_TRY(cudaFree(grads));
      WM_CUDA_TRY(cudaFree(loss));
    });
  } catch (wm::launch_error const& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  std::printf("04_train_embedding: OK on %d rank(s)\n", gpus);
  return 0;
}
