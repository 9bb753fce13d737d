// SPDX-License-Identifier: Apache-2.0
/*
 * Example 02: whole memory in each layout.
 *
 * What it teaches:
 *  - `wm::memory<Location, Layout>` is one allocation owned by all ranks. It is split into
 *    entries of `granularity` bytes (here: rows of 16 floats = 64 bytes) by a block plan; an
 *    entry never straddles two ranks.
 *  - Every layout gives `local_view()`: this rank's part, writable from its GPU.
 *  - Mapped layouts also let a kernel read other ranks' parts: `chunked_view()` (continuous and
 *    chunked: one pointer per rank) and `continuous_view()` (continuous only: one pointer for
 *    everything). Asking a distributed memory for a chunked view does not compile.
 *  - `store(prefix)` writes one file per rank; `load(files)` reads a list of files as one
 *    concatenated byte range, each rank only the bytes it owns, into any layout.
 *
 * Run: ./02_whole_memory            (uses every GPU of this machine)
 */
#include <wm/launch.hpp>
#include <wm/memory.cuh>

#include <cstdio>
#include <exception>
#include <filesystem>

constexpr std::size_t row_floats = 16;
constexpr std::size_t rows       = 100'003;  // not divisible by the rank count

// Row r holds the values r * 16 + j.
__global__ void write_rows(wm::local_view v) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < v.entries * row_floats;
       i += gridDim.x * blockDim.x) {
    std::size_t const row = v.first_entry + i / row_floats;
    reinterpret_cast<float*>(v.entry(row))[i % row_floats] =
        static_cast<float>(row * row_floats + i % row_floats);
  }
}

// Reads every row through any view with entry(row) and counts wrong values.
template <class View>
__global__ void check_rows(View v, std::size_t n_rows, unsigned long long* wrong) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n_rows * row_floats;
       i += gridDim.x * blockDim.x) {
    std::size_t const row = i / row_floats;
    float const got       = reinterpret_cast<float const*>(v.entry(row))[i % row_floats];
    if (got != static_cast<float>(row * row_floats + i % row_floats)) { atomicAdd(wrong, 1ull); }
  }
}

template <class View>
unsigned long long count_wrong(View v, std::size_t n_rows, unsigned long long* wrong) {
  WM_CUDA_TRY(cudaMemset(wrong, 0, sizeof(*wrong)));
  check_rows<<<256, 256>>>(v, n_rows, wrong);
  WM_CHECK_LAUNCH();
  unsigned long long n = 0;
  WM_CUDA_TRY(cudaMemcpy(&n, wrong, sizeof(n), cudaMemcpyDeviceToHost));
  return n;
}

template <class Location, class Layout>
void demo(wm::communicator& comm, std::filesystem::path const& dir, unsigned long long* wrong) {
  std::size_t const bytes = rows * row_floats * sizeof(float);
  // 1. Collective allocation: every rank passes the same sizes.
  wm::memory<Location, Layout> table{comm, bytes, row_floats * sizeof(float)};
  auto const mine = table.local_entry_range();

  // 2. Each rank fills its own rows.
  write_rows<<<256, 256>>>(table.local_view());
  WM_CHECK_LAUNCH();
  WM_CUDA_TRY(cudaDeviceSynchronize());
  comm.barrier();  // everybody's rows are written

  // 3. Read through every view the layout offers.
  unsigned long long bad = 0;
  if constexpr (wm::mapped_layout<Layout>) {
    bad += count_wrong(table.chunked_view(), rows, wrong);
  }
  if constexpr (std::is_same_v<Layout, wm::continuous>) {
    bad += count_wrong(table.continuous_view(), rows, wrong);
  }

  // 4. Store one file per rank, load the list into a distributed device memory, check its rows.
  auto const files = table.store(dir / (std::string{Location::name} + "_" + Layout::name));
  wm::memory<wm::device, wm::distributed> copy{comm, bytes, row_floats * sizeof(float)};
  copy.load(files);
  auto const local              = copy.local_view();
  unsigned long long loaded_bad = 0;
  {  // distributed memory: this rank checks its own rows, here on the host
    std::vector<float> host(local.entries * row_floats);
    WM_CUDA_TRY(
        cudaMemcpy(host.data(), local.data, host.size() * sizeof(float), cudaMemcpyDeviceToHost));
    for (std::size_t i = 0; i < host.size(); ++i) {
      if (host[i] != static_cast<float>(local.first_entry * row_floats + i)) { ++loaded_bad; }
    }
  }
  comm.barrier();
  if (bad + loaded_bad != 0) {
    throw std::runtime_error{"wrong values in " + std::string{Layout::name}};
  }
  std::printf(
      "rank %d: %-6s %-11s owns rows [%zu, %zu); all %zu rows read back through its views; "
      "store+load round trip ok\n",
      comm.rank(), Location::name, Layout::name, mine.begin, mine.end,
      wm::mapped_layout<Layout> ? rows : mine.size());
}

int main() {
  // Counted without initializing CUDA here (we still have to fork). 0 means the machine has
  // none; a CUDA stack that is there but broken throws: that is an error, not "no GPU".
  int gpus = 0;
  try {
    gpus = wm::local_device_count();
  } catch (std::exception const& e) {
    std::fprintf(stderr, "02_whole_memory: %s\n", e.what());
    return 1;
  }
  if (gpus == 0) {
    std::printf("02_whole_memory: no GPU found, nothing to run\n");
    return 0;
  }
  auto const dir = std::filesystem::temp_directory_path() / "wm-example-02";
  std::filesystem::create_directories(dir);
  try {
    wm::launch(gpus, [&](wm::communicator& comm) {
      unsigned long long* wrong = nullptr;
      WM_CUDA_TRY(cudaMalloc(&wrong, sizeof(*wrong)));
      demo<wm::device, wm::continuous>(comm, dir, wrong);
      demo<wm::device, wm::chunked>(comm, dir, wrong);
      demo<wm::device, wm::distributed>(comm, dir, wrong);
      demo<wm::host, wm::continuous>(comm, dir, wrong);
      demo<wm::host, wm::chunked>(comm, dir, wrong);
      demo<wm::host, wm::distributed>(comm, dir, wrong);
      WM_CUDA_TRY(cudaFree(wrong));
    });
  } catch (wm::launch_error const& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  std::filesystem::remove_all(dir);
  std::printf("02_whole_memory: OK on %d rank(s)\n", gpus);
  return 0;
}
