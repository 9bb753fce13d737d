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
 *  - All layouts give the same result for the same data: the example checks that.
 *
 * Run: ./03_gather_scatter            (uses every GPU of this machine)
 */
#include <wm/wm.cuh>

#include <cstdio>
#include <cstring>
#include <vector>

constexpr std::size_t nodes    = 200'003;
constexpr std::size_t features = 64;
constexpr std::size_t batch    = 50'000;

// Feature j of node k is k + j / 100 (exact in float for these sizes).
__host__ __device__ inline float feature(std::size_t k, std::size_t j) { return static_cast<float>(k) + j / 100.0f; }

__global__ void fill_local(wm::matrix_view<float> v, std::size_t first_row)
{
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < v.rows * v.cols; i += gridDim.x * blockDim.x) {
    v(i / v.cols, i % v.cols) = feature(first_row + i / v.cols, i % v.cols);
  }
}

// Random node ids: a small hash of (rank, position), the same on every run.
__host__ __device__ inline std::int64_t random_id(std::size_t i, int rank)
{
  std::uint64_t z = (i + 1) * 0x9e3779b97f4a7c15ull ^ (static_cast<std::uint64_t>(rank) << 32);
  z ^= z >> 29;
  z *= 0xbf58476d1ce4e5b9ull;
  return static_cast<std::int64_t>((z ^ (z >> 32)) % nodes);
}

__global__ void random_ids(std::int64_t* ids, std::size_t n, int rank)
{
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    ids[i] = random_id(i, rank);
  }
}

template <class Layout>
std::vector<float> gather_with(wm::communicator& comm, std::int64_t const* ids, cudaStream_t stream)
{
  // 1. Collective allocation, then each rank fills the rows it owns.
  wm::tensor<float, wm::device, Layout> table{comm, nodes, features};
  fill_local<<<256, 256, 0, stream>>>(table.local_view(), table.storage().local_entry_range().begin);
  WM_CHECK_LAUNCH();
  WM_CUDA_TRY(cudaStreamSynchronize(stream));
  comm.barrier();

  // 2. Gather this rank's batch; rows come from every rank.
  float* out = nullptr;
  WM_CUDA_TRY(cudaMalloc(&out, batch * features * sizeof(float)));
  table.gather(std::span<std::int64_t const>{ids, batch}, out, cuda::stream_ref{stream});
  std::vector<float> host(batch * features);
  WM_CUDA_TRY(cudaMemcpy(host.data(), out, host.size() * sizeof(float), cudaMemcpyDeviceToHost));

  // 3. Scatter: rank 0 doubles the features of the first 100 ids of its batch (others pass
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

int main()
{
  int const gpus = wm::local_device_count();
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
      WM_CUDA_TRY(cudaMemcpyAsync(host_ids.data(), ids, batch * sizeof(std::int64_t), cudaMemcpyDeviceToHost, stream));
      WM_CUDA_TRY(cudaStreamSynchronize(stream));

      auto const a = gather_with<wm::continuous>(comm, ids, stream);
      auto const b = gather_with<wm::chunked>(comm, ids, stream);
      auto const c = gather_with<wm::distributed>(comm, ids, stream);

      // 4. Every layout returned the same rows, and they are right (doubled where scattered).
      bool const same = a == b && b == c;
      std::vector<bool> doubled(nodes, false);  // the rows rank 0 scattered
      for (std::size_t i = 0; i < 100; ++i) { doubled[static_cast<std::size_t>(random_id(i, 0))] = true; }
      std::size_t wrong = 0;
      for (std::size_t i = 0; i < batch; ++i) {
        auto const k = static_cast<std::size_t>(host_ids[i]);
        for (std::size_t j = 0; j < features; ++j) {
          float const expect = doubled[k] ? 2 * feature(k, j) : feature(k, j);
          if (a[i * features + j] != expect) { ++wrong; }
        }
      }
      if (!same || wrong != 0) { throw std::runtime_error{"layouts disagree or rows are wrong"}; }
      std::printf("rank %d: gathered %zu random rows of %zu through continuous, chunked and distributed "
                  "layouts: identical and correct\n",
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
