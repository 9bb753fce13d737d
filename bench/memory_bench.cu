// SPDX-License-Identifier: Apache-2.0
/*
 * memory_bench: the hot paths of wm::memory, each next to a limit measured in the same run.
 *
 * (a) peer read (needs >= 2 GPUs): for continuous·device and chunked·device memories of 2 GiB per
 *     rank, rank 0 copies rank 1's whole part (2 GiB) into its own GPU memory with a copy kernel
 *     (16-byte loads, 4 in flight per thread) that reads through the view: the part's start is
 *     `continuous_view().entry(e)` / `chunked_view().entry(e)` for rank 1's first entry e.
 *     Limit: `cudaMemcpyAsync` device-to-device of the same bytes from the same mapped peer
 *     address (copy engines over NVLink). Target: kernel >= 0.85 x copy.
 * (b) host read: for continuous·host and chunked·host memories of 1 GiB in all, rank 0 copies the
 *     whole 1 GiB (pinned, mapped into the GPU) into GPU memory with the same kernel; for
 *     distributed·host, rank 0's own part (local_view). Limit: `cudaMemcpyAsync` host-to-device
 *     of the same byte count from a `cudaMallocHost` buffer. Target: kernel >= 0.70 x copy.
 * (c) files: for all six kinds, 1 GiB in all, `store(prefix)` then `load(files)`, timed on rank 0
 *     around the collective call (every rank starts after a barrier; the call returns once every
 *     rank is done). Files go to $WM_BENCH_DIR or the system temp directory and are removed.
 *
 * GB/s = bytes moved / seconds / 1e9, where a byte read once and written once counts once.
 * Kernels and copies: 2 warm-ups, then the median of 10 runs timed with CUDA events; files: one
 * run each. Each kernel copy is checked once against the fill pattern, and each memory after load,
 * so a broken path cannot report a fast time. Output: one table, printed by rank 0.
 */
#include <wm/memory.cuh>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.cuh"

namespace {

namespace fs = std::filesystem;

constexpr std::size_t gib         = std::size_t{1} << 30;
constexpr std::size_t granularity = 512;
constexpr int warmups             = 2;
constexpr int reps                = 10;
constexpr int threads             = 256;

/// Non-zero fill value of the 8-byte word at global word index @p w of a memory.
__host__ __device__ constexpr std::uint64_t pattern(std::uint64_t w) {
  std::uint64_t const x = (w + 1) * 0x9E3779B97F4A7C15ull;  // odd factor: x != 0
  return x ^ (x >> 29);
}

enum class op { write, poison, check };  // what pattern_kernel does

/// Writes the pattern (or zeros) to @p p, or counts in @p bad the words that differ from it.
__global__ void pattern_kernel(std::uint64_t* p, std::size_t words, std::uint64_t first, op what,
                               unsigned long long* bad) {
  std::size_t const stride = std::size_t{gridDim.x} * blockDim.x;
  unsigned long long n     = 0;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < words; i += stride) {
    if (what == op::check) {
      n += p[i] != pattern(first + i) ? 1 : 0;
    } else {
      p[i] = what == op::poison ? 0 : pattern(first + i);
    }
  }
  if (n != 0) { atomicAdd(bad, n); }
}

/// dst[i] = src[i] for i < n; grid-stride, four independent 16-byte loads in flight per thread.
__global__ void copy_kernel(uint4 const* __restrict__ src, uint4* __restrict__ dst, std::size_t n) {
  std::size_t const stride = std::size_t{gridDim.x} * blockDim.x;
  std::size_t i            = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint4 const a       = src[i];
    uint4 const b       = src[i + stride];
    uint4 const c       = src[i + 2 * stride];
    uint4 const d       = src[i + 3 * stride];
    dst[i]              = a;
    dst[i + stride]     = b;
    dst[i + 2 * stride] = c;
    dst[i + 3 * stride] = d;
  }
  for (; i < n; i += stride) { dst[i] = src[i]; }
}

struct row {
  std::string name;
  std::size_t bytes{};
  double figure{};  // GB/s; < 0: not measured
  double limit{};   // GB/s; 0: none
  double target{};  // minimum figure / limit
  char const* limit_name{""};
};

/// File system type of the mount that holds @p p, from /proc/mounts ("?" if unknown).
std::string fs_type(fs::path const& p) {
  std::ifstream in{"/proc/mounts"};
  std::error_code ec;
  std::string const s = fs::weakly_canonical(p, ec).string();
  std::string dev, mnt, type, rest, best, best_type{"?"};
  while (in >> dev >> mnt >> type && std::getline(in, rest)) {
    bool const under =
        s.starts_with(mnt) && (mnt == "/" || s.size() == mnt.size() || s[mnt.size()] == '/');
    if (under && mnt.size() >= best.size()) { best = mnt, best_type = type; }
  }
  return best_type;
}

double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// One rank's state. Rank 0 also holds the destination buffers and timing events.
class bench {
 public:
  bench(wm::communicator& comm, fs::path dir) : comm_{comm}, dir_{std::move(dir)} {
    int sms = 0, per_sm = 0;
    WM_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, comm.device()));
    WM_CUDA_TRY(
        cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, comm.device()));
    blocks_ = 4 * sms * per_sm / threads;
    WM_CUDA_TRY(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    WM_CUDA_TRY(cudaMalloc(&scratch_, 2 * sizeof(std::uint64_t)));
    if (comm.rank() != 0) { return; }
    WM_CUDA_TRY(cudaMalloc(&dst_, 2 * gib));
    WM_CUDA_TRY(cudaMallocHost(&pinned_, gib));
    WM_CUDA_TRY(cudaEventCreate(&start_));
    WM_CUDA_TRY(cudaEventCreate(&stop_));
  }
  bench(bench const&)            = delete;
  bench& operator=(bench const&) = delete;
  ~bench() {
    (void)cudaStreamSynchronize(stream_);
    if (start_ != nullptr) { (void)cudaEventDestroy(start_), (void)cudaEventDestroy(stop_); }
    (void)cudaFreeHost(pinned_), (void)cudaFree(dst_), (void)cudaFree(scratch_);
    (void)cudaStreamDestroy(stream_);
  }

  /// (a) Rank 0 reads rank 1's whole part of a device memory through the view.
  template <class Layout>
  void peer_read() {
    std::string name = std::string{"peer read "} + Layout::name + ".device";
    if (comm_.size() < 2) {
      rows_.push_back({std::move(name), 0, -1.0});
      return;
    }
    wm::memory<wm::device, Layout> mem{comm_, 2 * gib * comm_.size(), granularity};
    apply_local(op::write, mem);
    comm_.barrier();
    if (comm_.rank() == 0) {
      auto const part = mem.byte_range(1);
      std::byte const* src{};
      if constexpr (std::same_as<Layout, wm::continuous>) {
        src = mem.continuous_view().entry(mem.entry_range(1).begin);
      } else {
        src = wm_bench::entry_address(mem.chunked_view(), mem.entry_range(1).begin, scratch_,
                                      stream_);
      }
      double const kernel = kernel_read(src, part.size(), part.begin);
      double const copy   = copy_read(src, part.size(), cudaMemcpyDeviceToDevice);
      rows_.push_back({std::move(name), part.size(), part.size() / kernel / 1e9,
                       part.size() / copy / 1e9, 0.85, "peer copy"});
    }
    comm_.barrier();  // rank 1's part stays alive until rank 0 is done
  }

  /// (b) Rank 0 reads a host memory (all of it; its own part for distributed) from a kernel.
  template <class Layout>
  void host_read() {
    wm::memory<wm::host, Layout> mem{comm_, gib, granularity};
    apply_local(op::write, mem);
    comm_.barrier();
    if (comm_.rank() == 0) {
      std::byte const* src{};
      std::size_t bytes = mem.total_bytes();
      if constexpr (std::same_as<Layout, wm::continuous>) {
        src = mem.continuous_view().data;
      } else if constexpr (std::same_as<Layout, wm::chunked>) {
        // Host parts are one shared allocation, so rank 0's chunk runs on through every other
        // rank's (kernel_read's check of all 1 GiB against the pattern would see otherwise).
        src = wm_bench::entry_address(mem.chunked_view(), 0, scratch_, stream_);
      } else {
        src   = mem.local_view().data;
        bytes = mem.local_view().bytes();
      }
      double const kernel = kernel_read(src, bytes, 0);  // the memory and rank 0's part start at 0
      double const copy   = copy_read(pinned_, bytes, cudaMemcpyHostToDevice);
      rows_.push_back({std::string{"host read "} + Layout::name + ".host", bytes,
                       bytes / kernel / 1e9, bytes / copy / 1e9, 0.70, "pinned H2D copy"});
    }
    comm_.barrier();
  }

  /// (c) Stores 1 GiB to files and loads it back (collective), timed on rank 0.
  template <class Location, class Layout>
  void files() {
    wm::memory<Location, Layout> mem{comm_, gib, granularity};
    apply_local(op::write, mem);
    comm_.barrier();
    auto t0            = std::chrono::steady_clock::now();
    auto const parts   = mem.store(dir_ / (std::string{Layout::name} + "." + Location::name));
    double const store = since(t0);
    apply_local(op::poison, mem);  // so that the check sees what load wrote
    comm_.barrier();
    t0 = std::chrono::steady_clock::now();
    mem.load(std::span<fs::path const>{parts});
    double const load = since(t0);
    apply_local(op::check, mem);
    if (comm_.rank() != 0) { return; }
    for (auto const& f : parts) { fs::remove(f); }
    std::string const kind = std::string{Layout::name} + "." + Location::name;
    rows_.push_back({"store " + kind, gib, gib / store / 1e9});
    rows_.push_back({"load  " + kind, gib, gib / load / 1e9});
  }

  void print() const {
    if (comm_.rank() != 0) { return; }
    cudaDeviceProp prop{};
    WM_CUDA_TRY(cudaGetDeviceProperties(&prop, comm_.device()));
    std::printf("== memory_bench: %d x %s\n", comm_.size(), prop.name);
    std::printf("%-28s %6s %12s %11s %6s  %s\n", "case", "GiB", "figure GB/s", "limit GB/s",
                "ratio", "target");
    for (auto const& r : rows_) {
      if (r.figure < 0) {
        std::printf("%-28s %6s %12s\n", r.name.c_str(), "-", "n/a (1 GPU)");
      } else if (r.limit > 0) {
        double const ratio = r.figure / r.limit;
        std::printf("%-28s %6.2f %12.1f %11.1f %6.2f  >=%.2f (%s) %s\n", r.name.c_str(),
                    double(r.bytes) / gib, r.figure, r.limit, ratio, r.target, r.limit_name,
                    ratio >= r.target ? "ok" : "BELOW");
      } else {
        std::printf("%-28s %6.2f %12.1f %11s %6s\n", r.name.c_str(), double(r.bytes) / gib,
                    r.figure, "-", "-");
      }
    }
    std::printf(
        "store/load: files in %s (%s); store returns once the data is in the page cache "
        "(no fsync)\n  and load right after store reads from the page cache, so these "
        "rows measure wm's file path, not the disk.\n",
        dir_.c_str(), fs_type(dir_).c_str());
    std::fflush(stdout);
  }

 private:
  /// apply() to this rank's part of @p mem.
  template <class Memory>
  void apply_local(op what, Memory const& mem) {
    apply(what, mem.local_view().data, mem.local_view().bytes(), mem.local_byte_range().begin);
  }

  /// Runs pattern_kernel on @p bytes at @p p, which hold a memory's bytes from @p first_byte on,
  /// and waits; op::check throws if any word differs from the pattern.
  void apply(op what, std::byte* p, std::size_t bytes, std::size_t first_byte) {
    auto* bad = reinterpret_cast<unsigned long long*>(scratch_);
    WM_CUDA_TRY(cudaMemsetAsync(bad, 0, sizeof(*bad), stream_));
    if (bytes > 0) {
      pattern_kernel<<<blocks_, threads, 0, stream_>>>(reinterpret_cast<std::uint64_t*>(p),
                                                       bytes / 8, first_byte / 8, what, bad);
      WM_CHECK_LAUNCH();
    }
    unsigned long long n = 0;
    WM_CUDA_TRY(cudaMemcpyAsync(&n, bad, sizeof(n), cudaMemcpyDeviceToHost, stream_));
    WM_CUDA_TRY(cudaStreamSynchronize(stream_));
    if (n != 0) {
      throw std::runtime_error{"memory_bench: rank " + std::to_string(comm_.rank()) + ": " +
                               std::to_string(n) + " of " + std::to_string(bytes / 8) +
                               " words differ from the fill pattern"};
    }
  }

  /// Median seconds of @p enqueue (after warm-ups), timed with CUDA events on the stream.
  template <class F>
  double median_seconds(F const& enqueue) {
    for (int i = 0; i < warmups; ++i) { enqueue(); }
    std::vector<float> ms(reps);
    for (auto& t : ms) {
      WM_CUDA_TRY(cudaEventRecord(start_, stream_));
      enqueue();
      WM_CUDA_TRY(cudaEventRecord(stop_, stream_));
      WM_CUDA_TRY(cudaEventSynchronize(stop_));
      WM_CUDA_TRY(cudaEventElapsedTime(&t, start_, stop_));
    }
    std::sort(ms.begin(), ms.end());
    return 0.5e-3 * (ms[reps / 2 - 1] + ms[reps / 2]);
  }

  /// Copies @p bytes at @p src (a memory's bytes from @p first_byte on) into dst_ with the copy
  /// kernel: checks the result once, then returns the median time.
  double kernel_read(std::byte const* src, std::size_t bytes, std::size_t first_byte) {
    auto const enqueue = [&] {
      copy_kernel<<<blocks_, threads, 0, stream_>>>(reinterpret_cast<uint4 const*>(src),
                                                    reinterpret_cast<uint4*>(dst_), bytes / 16);
      WM_CHECK_LAUNCH();
    };
    apply(op::poison, dst_, bytes, 0);
    enqueue();
    apply(op::check, dst_, bytes, first_byte);
    return median_seconds(enqueue);
  }

  double copy_read(void const* src, std::size_t bytes, cudaMemcpyKind kind) {
    return median_seconds([&] { WM_CUDA_TRY(cudaMemcpyAsync(dst_, src, bytes, kind, stream_)); });
  }

  wm::communicator& comm_;
  fs::path dir_;
  int blocks_{};
  cudaStream_t stream_{};
  std::byte* scratch_{};  // device: mismatch counter or one address
  std::byte* dst_{};      // rank 0, device: 2 GiB destination of every read
  std::byte* pinned_{};   // rank 0, pinned host: 1 GiB source of the H2D limit
  cudaEvent_t start_{};
  cudaEvent_t stop_{};
  std::vector<row> rows_;
};

}  // namespace

int main() {
  int const gpus = wm::local_device_count();  // before any CUDA call in this process
  if (gpus == 0) {
    std::printf("memory_bench: no GPU found, nothing to measure\n");
    return 0;
  }
  char const* base = std::getenv("WM_BENCH_DIR");
  fs::path const dir =
      fs::path{base != nullptr && *base != '\0' ? fs::path{base} : fs::temp_directory_path()} /
      ("wm-bench-" + std::to_string(std::random_device{}()));
  int rc = 0;
  try {
    fs::create_directories(dir);
    wm::launch(gpus, [&](wm::communicator& comm) {
      bench b{comm, dir};
      b.peer_read<wm::continuous>();
      b.peer_read<wm::chunked>();
      b.host_read<wm::continuous>();
      b.host_read<wm::chunked>();
      b.host_read<wm::distributed>();
      b.files<wm::device, wm::continuous>();
      b.files<wm::device, wm::chunked>();
      b.files<wm::device, wm::distributed>();
      b.files<wm::host, wm::continuous>();
      b.files<wm::host, wm::chunked>();
      b.files<wm::host, wm::distributed>();
      b.print();
    });
  } catch (std::exception const& e) {
    std::fprintf(stderr, "memory_bench: %s\n", e.what());
    rc = 1;
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
  return rc;
}
