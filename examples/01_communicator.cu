// SPDX-License-Identifier: Apache-2.0
/*
 * Example 01: ranks and the communicator.
 *
 * What it teaches:
 *  - wm runs one process per GPU. `wm::launch(n, fn)` forks n local ranks (this process must not
 *    have used CUDA before), gives rank r the GPU r % device_count, and builds a
 *    `wm::communicator` for each; real jobs start ranks with mpirun or a scheduler and call
 *    `wm::communicator_from_env()` instead.
 *  - Host-side exchange: `all_gather` of small values (here: which GPU each rank drives).
 *  - Device exchange over NCCL: `all_to_all_v`, where every rank sends a different number of
 *    elements to every other rank (here: rank r sends r + p + 1 numbers to rank p).
 *  - Errors: if any rank throws, `wm::launch` throws a `wm::launch_error` naming it.
 *
 * Run: ./01_communicator            (uses every GPU of this machine)
 */
#include <wm/comm.hpp>
#include <wm/launch.hpp>

#include <cstdio>
#include <exception>
#include <numeric>
#include <vector>

// Every element says who sent it to whom: src * 1000 + dst.
__global__ void fill(int* out, std::size_t n, int value) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    out[i] = value;
  }
}

int main() {
  // 1. Count the GPUs without initializing CUDA here (we still have to fork). 0 means the
  //    machine has none; a CUDA stack that is there but broken throws: that is an error.
  int gpus = 0;
  try {
    gpus = wm::local_device_count();
  } catch (std::exception const& e) {
    std::fprintf(stderr, "01_communicator: %s\n", e.what());
    return 1;
  }
  if (gpus == 0) {
    std::printf("01_communicator: no GPU found, nothing to run\n");
    return 0;
  }

  try {
    wm::launch(gpus, [](wm::communicator& comm) {
      int const me    = comm.rank();
      int const world = comm.size();

      // 2. Host-side exchange: every rank learns which GPU every rank uses.
      auto const devices = comm.all_gather(comm.device());

      // 3. Device exchange: rank `me` sends me + p + 1 ints to each rank p.
      std::vector<std::size_t> send_counts(world), recv_counts(world);
      for (int p = 0; p < world; ++p) {
        send_counts[p] = static_cast<std::size_t>(me + p + 1);
        recv_counts[p] = static_cast<std::size_t>(p + me + 1);  // what p sends to me
      }
      std::size_t const n_send =
          std::accumulate(send_counts.begin(), send_counts.end(), std::size_t{0});
      std::size_t const n_recv =
          std::accumulate(recv_counts.begin(), recv_counts.end(), std::size_t{0});
      int* send = nullptr;
      int* recv = nullptr;
      WM_CUDA_TRY(cudaMalloc(&send, n_send * sizeof(int)));
      WM_CUDA_TRY(cudaMalloc(&recv, n_recv * sizeof(int)));
      cudaStream_t stream{};
      WM_CUDA_TRY(cudaStreamCreate(&stream));
      std::size_t offset = 0;
      for (int p = 0; p < world; ++p) {
        fill<<<1, 128, 0, stream>>>(send + offset, send_counts[p], me * 1000 + p);
        WM_CHECK_LAUNCH();
        offset += send_counts[p];
      }
      comm.all_to_all_v(send, std::span<std::size_t const>{send_counts}, recv,
                        std::span<std::size_t const>{recv_counts}, cuda::stream_ref{stream});
      std::vector<int> got(n_recv);
      WM_CUDA_TRY(
          cudaMemcpyAsync(got.data(), recv, n_recv * sizeof(int), cudaMemcpyDeviceToHost, stream));
      WM_CUDA_TRY(cudaStreamSynchronize(stream));

      // 4. Check: the block from rank p holds p * 1000 + me, recv_counts[p] times.
      offset = 0;
      for (int p = 0; p < world; ++p) {
        for (std::size_t i = 0; i < recv_counts[p]; ++i) {
          if (got[offset + i] != p * 1000 + me) {
            throw std::runtime_error{"wrong element from rank " + std::to_string(p)};
          }
        }
        offset += recv_counts[p];
      }
      comm.barrier();
      std::printf(
          "rank %d/%d on GPU %d (node rank %d/%d): all-gather saw %zu devices, "
          "all-to-all-v received %zu ints, all correct\n",
          me, world, comm.device(), comm.local_rank(), comm.local_size(), devices.size(), n_recv);
      WM_CUDA_TRY(cudaStreamDestroy(stream));
      WM_CUDA_TRY(cudaFree(send));
      WM_CUDA_TRY(cudaFree(recv));
    });
  } catch (wm::launch_error const& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  std::printf("01_communicator: OK on %d rank(s)\n", gpus);
  return 0;
}
