// SPDX-License-Identifier: Apache-2.0
/*
 * Example 03: a feature table across GPUs, gathered by random node ids.
 *
 * What it teaches:
 *  - `wm::tensor<T, Location, Layout>` is a 2D table whose rows are spread over the ranks
 *    (here 200,003 nodes × 64 float features; a row is never split).
 *  - `gather(ids, out, stream)` fetches rows by global id into a dense device buffer, whichever
 *    rank holds them: mapped layouts read peers' rows directly in one kernel; the distributed
 *    layout sends ids to their owners and rows back over NCCL (every rank must call it).
 *  - `scatter(ids, values, stream)` writes rows; with duplicate ids the last one wins.
 *  - Your own kernels reach the rows through `table.ref()` (a small value passed by value):
 *    any row by global id on mapped layouts (`row(k)`), this rank's rows on every layout
 *    (`local_row(l)`); `row(k)` does not compile on the distributed layout.
 *  - All layouts give the same result for the same data: the example checks that.
 *
 * Run: ./03_gather_scatter            (uses every GPU of this machine)
 */
#include <wm/launch.hpp>
#include <wm/tensor.cuh>

#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

constexpr std::size_t nodes    = 200'003;
constexpr std::size_t features = 64;
constexpr std::size_t batch    = 50'000;

// Feature j of node k is k + j / 100 (exact in float for these sizes).
__host__ __device__ inline float feature(std::size_t k, std::size_t j) {
  return static_cast<float>(k) + j / 100.0f;
}

__global__ void fill_local(wm::matrix_view<float> v, std::size_t first_row) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < v.rows * v.cols;
       i += gridDim.x * blockDim.x) {
    v(i / v.cols, i % v.cols) = feature(first_row + i / v.cols, i % v.cols);
  }
}

// Random node ids: a small hash of (rank, position), the same on every run.
__host__ __device__ inline std::int64_t random_id(std::size_t i, int rank) {
  std::uint64_t z = (i + 1) * 0x9e3779b97f4a7c15ull ^ (static_cast<std::uint64_t>(rank) << 32);
  z ^= z >> 29;
  z *= 0xbf58476d1ce4e5b9ull;
  return static_cast<std::int64_t>((z ^ (z >> 32)) % nodes);
}

__global__ void random_ids(std::int64_t* ids, std::size_t n, int rank) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    ids[i] = random_id(i, rank);
  }
}

// A user kernel: reads the rows of ids[0..n) through a read-only ref, any rank's (mapped
// layouts), and counts the elements that are not feature(k, j).
template <class Ref>
__global__ void count_wrong_rows(Ref table, std::int64_t const* ids, std::size_t n,
                                 unsigned long long* wrong) {
  std::size_t const cols = table.cols();
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n * cols;
       i += gridDim.x * blockDim.x) {
    auto const k     = static_cast<std::size_t>(ids[i / cols]);
    float const* row = table.row(k);
    if (row[i % cols] != feature(k, i % cols)) { atomicAdd(wrong, 1ull); }
  }
}

// The same for this rank's own rows, which every layout offers (block mapping: local row l is
// global row first_row + l).
template <class Ref>
__global__ void count_wrong_local_rows(Ref table, std::size_t first_row,
                                       unsigned long long* wrong) {
  std::size_t const cols = table.cols();
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < table.local_rows() * cols;
       i += gridDim.x * blockDim.x) {
    if (table.local_row(i / cols)[i % cols] != feature(first_row + i / cols, i % cols)) {
      atomicAdd(wrong, 1ull);
    }
  }
}

template <class Layout>
std::vector<float> gather_with(wm::communicator& comm, std::int64_t const* ids,
                               cudaStream_t stream) {
  // 1. Collective allocation, then each rank fills the rows it owns.
  wm::tensor<float, wm::device, Layout> table{comm, nodes, features};
  fill_local<<<256, 256, 0, stream>>>(table.local_view(),
                                      table.storage().local_entry_range().begin);
  WM_CHECK_LAUNCH();
  WM_CUDA_TRY(cudaStreamSynchronize(stream));
  comm.barrier();

  // 2. A kernel of our own reads rows through the table's ref: on mapped layouts the rows of this
  //    rank's batch wherever they live, on every layout this rank's rows.
  unsigned long long* wrong = nullptr;
  WM_CUDA_TRY(cudaMalloc(&wrong, sizeof(*wrong)));
  WM_CUDA_TRY(cudaMemsetAsync(wrong, 0, sizeof(*wrong), stream));
  auto const rows = std::as_const(table).ref();  // read-only: row(k) gives float const*
  if constexpr (wm::mapped_layout<Layout>) {
    count_wrong_rows<<<256, 256, 0, stream>>>(rows, ids, batch, wrong);
    WM_CHECK_LAUNCH();
  }
  count_wrong_local_rows<<<256, 256, 0, stream>>>(rows, table.storage().local_entry_range().begin,
                                                  wrong);
  WM_CHECK_LAUNCH();
  unsigned long long wrong_host = 0;
  WM_CUDA_TRY(
      cudaMemcpyAsync(&wrong_host, wrong, sizeof(wrong_host), cudaMemcpyDeviceToHost, stream));
  WM_CUDA_TRY(cudaStreamSynchronize(stream));
  WM_CUDA_TRY(cudaFree(wrong));
  if (wrong_host != 0) {
    throw std::runtime_error{std::to_string(wrong_host) + " wrong elements read through ref()"};
  }

  // 3. Gather this rank's batch; rows come from every rank.
  float* out = nullptr;
  WM_CUDA_TRY(cudaMalloc(&out, batch * features * sizeof(float)));
  table.gather(std::span<std::int64_t const>{ids, batch}, out, cuda::stream_ref{stream});
  std::vector<float> host(batch * features);
  WM_CUDA_TRY(cudaMemcpy(host.data(), out, host.size() * sizeof(float), cudaMemcpyDeviceToHost));

  // 4. Scatter: rank 0 doubles the features of the first 100 ids of its batch (others pass
  //    nothing; the distributed layout needs every rank in the call).
  std::size_t const n = comm.rank() == 0 ? 100 : 0;
  for (std::size_t i = 0; i < n * features; ++i) { host[i] *= 2; }
  WM_CUDA_TRY(cudaMemcpy(out, host.data(), n * features * sizeof(float), cudaMemcpyHostToDevice));
  table.scatter(std::span<std::int64_t const>{ids, n}, out, cuda::stream_ref{stream});
  comm.barrier();
  table.gather(std::span<std::int64_t const>{ids, batch}, out, cuda::stream_ref{stream});
  WM_CUDA_TRY(cudaMemcpy(host.data(), out, host.size() * sizeof(float), cudaMemcpyDeviceToHost));
  WM_CUDA_TRY(cudaFree(out));
  comm.barrier();  // nobody frees the table while a peer still reads it
  return host;
}

int main() {
  // Counted without initializing CUDA here (we still have to fork). 0 means the machine has
  // none; a CUDA stack that is there but broken throws: that is an error, not "no GPU".
  int gpus = 0;
  try {
    gpus = wm::local_device_count();
  } catch (std::exception const& e) {
    std::fprintf(stderr, "03_gather_scatter: %s\n", e.what());
    return 1;
  }
  if (gpus == 0) {
    std::printf("03_gather_scatter: no GPU found, nothing to run\n");
    return 0;
  }
  try {
    wm::launch(gpus, [](wm::communicator& comm) {
      cudaStream_t stream{};
      WM_CUDA_TRY(cudaStreamCreate(&stream));
      std::int64_t* ids = nullptr;
      WM_CUDA_TRY(cudaMalloc(&ids, batch * sizeof(std::int64_t)));
      random_ids<<<128, 256, 0, stream>>>(ids, batch, comm.rank());
      WM_CHECK_LAUNCH();
      std::vector<std::int64_t> host_ids(batch);
      WM_CUDA_TRY(cudaMemcpyAsync(host_ids.data(), ids, batch * sizeof(std::int64_t),
                                  cudaMemcpyDeviceToHost, stream));
      WM_CUDA_TRY(cudaStreamSynchronize(stream));

      auto const a = gather_with<wm::continuous>(comm, ids, stream);
      auto const b = gather_with<wm::chunked>(comm, ids, stream);
      auto const c = gather_with<wm::distributed>(comm, ids, stream);

      // 5. Every layout returned the same rows, and they are right (doubled where scattered).
      bool const same = a == b && b == c;
      std::vector<bool> doubled(nodes, false);  // the rows rank 0 scattered
      for (std::size_t i = 0; i < 100; ++i) {
        doubled[static_cast<std::size_t>(random_id(i, 0))] = true;
      }
      std::size_t wrong = 0;
      for (std::size_t i = 0; i < batch; ++i) {
        auto const k = static_cast<std::size_t>(host_ids[i]);
        for (std::size_t j = 0; j < features; ++j) {
          float const expect = doubled[k] ? 2 * feature(k, j) : feature(k, j);
          if (a[i * features + j] != expect) { ++wrong; }
        }
      }
      if (!same || wrong != 0) { throw std::runtime_error{"layouts disagree or rows are wrong"}; }
      std::printf(
          "rank %d: gathered %zu random rows of %zu through continuous, chunked and distributed "
          "layouts: identical and correct; rows read through ref() in a user kernel: correct\n",
          comm.rank(), batch, nodes);
      WM_CUDA_TRY(cudaFree(ids));
      WM_CUDA_TRY(cudaStreamDestroy(stream));
    });
  } catch (wm::launch_error const& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  std::printf("03_gather_scatter: OK on %d rank(s)\n", gpus);
  return 0;
}
