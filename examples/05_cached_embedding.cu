// SPDX-License-Identifier: Apache-2.0
/*
 * Example 05: a host table with a device cache, trained on skewed (Zipf) keys.
 *
 * What it teaches:
 *  - `wm::embedding<T, wm::device_cache<Access, Replacement>, Optimizer, wm::host, Layout>` keeps
 *    the table and its optimizer state in pinned host memory and caches the rows each GPU uses
 *    most in its own memory. `wm::cache_options{ratio}` (the last constructor argument) says
 *    what fraction of the rows the cache holds.
 *  - `wm::read_write` lines hold a row's weight and all its optimizer state; `apply_gradients`
 *    updates cached rows in their lines (marked dirty) and writes them back on eviction and on
 *    `flush()`; `store()` flushes first. `wm::lfu` keeps the rows asked for most often.
 *  - `cache_stats()` / `reset_cache_stats()`: requests, hits, misses, evictions, write-backs and
 *    bytes read from the host, counted on the device.
 *  - The training code is the same as with `wm::no_cache` (example 04): gather, loss and
 *    gradient, apply_gradients. Here row k must move to a fixed vector target(k) under the loss
 *    0.5 · |row - target|² (gradient: row - target); keys follow Zipf(1.05), so a few rows get
 *    most of the keys and the cache serves most requests. The loss must fall.
 *  - A read-only feature table with `wm::group_cache`: the ranks cache it together, each rank
 *    the rows hashed to it, and every rank reads every rank's lines (`bytes_from_peers`).
 *
 * Run: ./05_cached_embedding            (one rank per GPU of the machine)
 */
#include <wm/cache.hpp>
#include <wm/embedding.cuh>
#include <wm/launch.hpp>

#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

constexpr std::size_t rows     = 50'000;
constexpr std::size_t dim      = 32;
constexpr std::size_t batch    = 16'384;
constexpr int steps            = 300;
constexpr double ratio         = 0.1;  // the cache holds 10% of each rank's rows
constexpr double alpha         = 1.05;
constexpr std::uint64_t spread = 7'919;  // rank k-1 goes to row (k-1) * 7919 mod rows

__host__ __device__ inline std::uint64_t mix(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The vector row k should learn: values in [-1, 1).
__device__ inline float target(std::size_t k, std::size_t j) {
  return static_cast<float>(mix(k * dim + j + 1) >> 40) / 8388608.0f - 1.0f;
}

// Keys of step s on rank r: Zipf(alpha) ranks 1..rows by the inverse of the continuous power
// law's CDF (close to the discrete one), rank k-1 spread to row (k-1) * spread mod rows so the
// hot rows do not sit side by side.
__global__ void draw_keys(std::int64_t* keys, int step, int rank) {
  double const top = pow(static_cast<double>(rows), 1.0 - alpha) - 1.0;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < batch;
       i += gridDim.x * blockDim.x) {
    std::uint64_t const z = mix((static_cast<std::uint64_t>(step) << 40) ^
                                (static_cast<std::uint64_t>(rank) << 32) ^ i);
    double const u        = (static_cast<double>(z >> 11) + 0.5) * 0x1p-53;
    auto const k          = static_cast<std::uint64_t>(pow(top * u + 1.0, 1.0 / (1.0 - alpha)));
    keys[i] = static_cast<std::int64_t>((k < 1 ? 0 : k > rows ? rows - 1 : k - 1) * spread % rows);
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
    std::fprintf(stderr, "05_cached_embedding: %s\n", e.what());
    return 1;
  }
  if (gpus == 0) {
    std::printf("05_cached_embedding: no GPU found, nothing to run\n");
    return 0;
  }
  try {
    wm::launch(gpus, [](wm::communicator& comm) {
      // 1. A host table with Adam state and a read-write LFU cache on each GPU (each caches rows
      //    of its own part; other ranks' rows come through their owners).
      wm::adam adam;
      adam.weight_decay = 0.0f;
      wm::cache_options cache;
      cache.ratio      = ratio;
      using table_type = wm::embedding<float, wm::device_cache<wm::read_write, wm::lfu>, wm::adam,
                                       wm::host, wm::chunked>;
      table_type table{comm, rows, dim, adam, wm::embedding_init::uniform(-0.01f, 0.01f, 7), cache};
      if (comm.rank() == 0) {
        std::printf(
            "table %zu x %zu float in host memory; cache: %zu lines on rank 0 (ratio %.2f)\n", rows,
            dim, table.cache_lines(), ratio);
      }

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
      cuda::stream_ref const s{stream};
      std::span<std::int64_t const> const key_span{keys, batch};

      double first = 0;
      double last  = 0;
      for (int step = 0; step < steps; ++step) {
        // 2. Forward: gather the rows of this batch (hits from the cache, misses from the host).
        draw_keys<<<64, 256, 0, stream>>>(keys, step, comm.rank());
        WM_CHECK_LAUNCH();
        table.gather(key_span, out, s);
        // 3. Loss and gradient (what a model's backward pass would produce).
        WM_CUDA_TRY(cudaMemsetAsync(loss, 0, sizeof(double), stream));
        loss_and_grad<<<256, 256, 0, stream>>>(out, keys, grads, loss);
        WM_CHECK_LAUNCH();
        double mine = 0;
        WM_CUDA_TRY(cudaMemcpyAsync(&mine, loss, sizeof(double), cudaMemcpyDeviceToHost, stream));
        // 4. Backward + update: cached rows in their lines, the others in the host table.
        table.apply_gradients(key_span, grads, 0.05f, s);
        double total = 0;
        for (double l : comm.all_gather(mine)) { total += l; }
        total /= static_cast<double>(batch * static_cast<std::size_t>(comm.size()));
        if (step == 0) { first = total; }
        last = total;
        // 5. The cache's counters since the last print (every rank reads its own).
        if (step % 50 == 49 || step == steps - 1) {
          wm::cache_statistics const st = table.cache_stats();
          table.reset_cache_stats();
          double const hit = st.requests == 0 ? 0.0 : double(st.hits) / double(st.requests);
          if (comm.rank() == 0) {
            std::printf(
                "step %3d  loss per key %.5f  hit rate %.3f  misses %llu  write-backs "
                "%llu  from host %.1f MB\n",
                step, total, hit, static_cast<unsigned long long>(st.misses),
                static_cast<unsigned long long>(st.write_backs), double(st.bytes_from_host) / 1e6);
          }
        }
      }
      // 6. flush(): every dirty line is written back, so the host table now holds the trained
      //    rows; a gather through the cache and one straight from the table must agree.
      table.flush(s);
      WM_CUDA_TRY(cudaStreamSynchronize(stream));
      comm.barrier();  // every rank's dirty lines are back before anyone reads the table directly
      std::vector<float> cached(batch * dim), direct(batch * dim);
      table.gather(key_span, out, s);
      WM_CUDA_TRY(cudaMemcpyAsync(cached.data(), out, cached.size() * sizeof(float),
                                  cudaMemcpyDeviceToHost, stream));
      table.weights().gather(key_span, out, s);
      WM_CUDA_TRY(cudaMemcpyAsync(direct.data(), out, direct.size() * sizeof(float),
                                  cudaMemcpyDeviceToHost, stream));
      WM_CUDA_TRY(cudaStreamSynchronize(stream));
      if (cached != direct) {
        throw std::runtime_error{"after flush() the host table differs from the cache"};
      }
      // 7. The loss must have fallen a lot.
      if (!(last < 0.05 * first)) {  // a CPU model of this run ends near 0.011 x first
        throw std::runtime_error{"the loss did not fall: " + std::to_string(first) + " -> " +
                                 std::to_string(last)};
      }
      if (comm.rank() == 0) {
        std::printf("loss fell from %.4f to %.5f; after flush() the host table equals the cache\n",
                    first, last);
      }

      // 8. A read-only feature table cached by the group: with cache_options::group null the
      //    group is the table's ranks; each rank holds the rows hashed to it, and a gather reads
      //    any rank's lines directly (nothing collective). Misses are admitted by their holders.
      wm::cache_options shared;
      shared.ratio = ratio;  // of the whole table, over the group
      wm::embedding<float, wm::group_cache<wm::lru>, wm::no_optimizer, wm::host, wm::chunked>
          features{comm, rows, dim, {}, wm::embedding_init::uniform(-1.0f, 1.0f, 11), shared};
      for (int step = 0; step < 40; ++step) {
        draw_keys<<<64, 256, 0, stream>>>(keys, step, comm.rank());
        WM_CHECK_LAUNCH();
        features.gather(key_span, out, s);
      }
      features.gather(key_span, out, s);
      WM_CUDA_TRY(cudaMemcpyAsync(cached.data(), out, cached.size() * sizeof(float),
                                  cudaMemcpyDeviceToHost, stream));
      features.weights().gather(key_span, out, s);
      WM_CUDA_TRY(cudaMemcpyAsync(direct.data(), out, direct.size() * sizeof(float),
                                  cudaMemcpyDeviceToHost, stream));
      WM_CUDA_TRY(cudaStreamSynchronize(stream));
      if (cached != direct) { throw std::runtime_error{"the group cache differs from the table"}; }
      wm::cache_statistics const fs = features.cache_stats();
      double const hits             = double(fs.hits) / double(fs.requests);
      if (hits < 0.25) {  // Zipf(1.05) keys, 10% of the rows: the hot rows hit (0.46 on one H200)
        throw std::runtime_error{"the group cache's hit rate is " + std::to_string(hits)};
      }
      if (comm.rank() == 0) {
        std::printf(
            "group cache of %d rank(s): %zu lines each, hit rate %.3f, %.1f MB from peers' lines, "
            "%.1f MB from the host table; gathers equal the table\n",
            comm.size(), features.cache_lines(), hits, double(fs.bytes_from_peers) / 1e6,
            double(fs.bytes_from_host) / 1e6);
      }
      WM_CUDA_TRY(cudaStreamSynchronize(stream));
      comm.barrier();  // nobody frees the feature table while a peer still reads its lines
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
  std::printf("05_cached_embedding: OK\n");
  return 0;
}
