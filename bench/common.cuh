// SPDX-License-Identifier: Apache-2.0
/*
 * What the benchmark programs in bench/ share: printf into a string, the `--ranks N` argument,
 * the environment set at the start of main, memory shared with the forked ranks, timing with CUDA
 * events and the median, running the PyTorch peer script beside a benchmark (bench/peers/) and
 * reading numbers from the JSON line it prints, the address of a memory entry as a view
 * computes it in device code, device buffers, and what the two embedding-table benchmarks
 * (embedding_bench, cache_bench) share: the table, the key batches (keys.hpp), the gradients and
 * the peer run on key files.
 *
 * Each benchmark is one translation unit that includes this file once (`#include "common.cuh"`):
 * everything here is inline or a template.
 */
#pragma once

#include <wm/comm.hpp>
#include <wm/launch.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <sys/mman.h>
#include <sys/wait.h>
#include <system_error>
#include <vector>

#include "keys.hpp"

namespace wm_bench {

namespace fs = std::filesystem;

/// printf into a std::string (at most 511 characters).
inline std::string fmt(char const* f, ...) {
  char buf[512];
  va_list args;
  va_start(args, f);
  std::vsnprintf(buf, sizeof buf, f, args);
  va_end(args);
  return buf;
}

/// Sets the environment a benchmark and its torch peer run in; call it first in main. NVLink
/// multicast stays off here and in the torch peer (see the GPU machine's notes); the peer's
/// Python writes unbuffered, so its lines reach the output in order.
inline void set_environment() {
  ::setenv("NCCL_NVLS_ENABLE", "0", 1);
  ::setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1", 1);
  ::setenv("NVSHMEM_DISABLE_NVLS", "1", 1);
  ::setenv("PYTHONUNBUFFERED", "1", 1);
}

/// The N of `--ranks N` (0 without it); -1, after saying why on stderr, if the arguments are
/// wrong. @p program names the benchmark in the usage message.
inline int ranks_argument(int argc, char** argv, int gpus, char const* program) {
  int ranks = 0;
  for (int i = 1; i < argc; ++i) {
    char* end = nullptr;
    long const n =
        std::strcmp(argv[i], "--ranks") == 0 && i + 1 < argc ? std::strtol(argv[++i], &end, 10) : 0;
    if (end == nullptr || *end != '\0' || n < 1 || n > gpus) {
      std::fprintf(stderr, "%s: usage: %s [--ranks N], N from 1 to the %d GPUs present; got '%s'\n",
                   program, program, gpus, argv[i]);
      return -1;
    }
    ranks = static_cast<int>(n);
  }
  return ranks;
}

/// A value-initialized T in memory shared with the processes this one forks afterwards (the ranks
/// of wm::launch: rank 0 writes its figures there); nullptr, after printing "@p program: FAILED:
/// mmap of N bytes", if it cannot be mapped. Never unmapped: it lives until the process ends.
template <class T>
T* shared_results(char const* program) {
  void* p = ::mmap(nullptr, sizeof(T), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    std::printf("%s: FAILED: mmap of %zu bytes\n", program, sizeof(T));
    return nullptr;
  }
  return new (p) T{};
}

// ---- timing ----------------------------------------------------------------------------------

/// The median of @p v: the mean of the two middle values when their count is even (added in T).
template <class T>
double median(std::vector<T> v) {
  std::sort(v.begin(), v.end());
  return 0.5 * (v[(v.size() - 1) / 2] + v[v.size() / 2]);
}

/// Milliseconds of each of events.size() / 2 runs of @p enqueue on @p stream: @p warmups runs
/// first, a barrier on @p comm (every rank starts together), then the timed runs back to back,
/// run i between events[2i] and events[2i + 1].
template <class F>
std::vector<float> event_times_ms(F const& enqueue, int warmups,
                                  std::span<cudaEvent_t const> events, cudaStream_t stream,
                                  wm::communicator& comm) {
  for (int i = 0; i < warmups; ++i) { enqueue(); }
  WM_CUDA_TRY(cudaStreamSynchronize(stream));
  comm.barrier();
  std::size_t const runs = events.size() / 2;
  for (std::size_t i = 0; i < runs; ++i) {
    WM_CUDA_TRY(cudaEventRecord(events[2 * i], stream));
    enqueue();
    WM_CUDA_TRY(cudaEventRecord(events[2 * i + 1], stream));
  }
  WM_CUDA_TRY(cudaStreamSynchronize(stream));
  std::vector<float> ms(runs);
  for (std::size_t i = 0; i < runs; ++i) {
    WM_CUDA_TRY(cudaEventElapsedTime(&ms[i], events[2 * i], events[2 * i + 1]));
  }
  return ms;
}

/// The median of event_times_ms(@p enqueue, ...), the middle two added in double.
template <class F>
double event_median_ms(F const& enqueue, int warmups, std::span<cudaEvent_t const> events,
                       cudaStream_t stream, wm::communicator& comm) {
  auto const ms = event_times_ms(enqueue, warmups, events, stream, comm);
  return median(std::vector<double>(ms.begin(), ms.end()));
}

// ---- the PyTorch peer ------------------------------------------------------------------------

/// What a run of a peer script gave.
struct peer_result {
  std::string note;    // why it has no numbers, if it has none
  bool failed{false};  // it ran and failed (exit status not 0, or no JSON line)
  std::string json;    // the line of its stdout that starts with '{' (empty if none)
};

/// The peer script bench/peers/@p name: under $WM_REPO, the source tree this was built from,
/// ../../bench beside the executable, or bench/ under the working directory; empty if none.
inline fs::path peer_script(char const* name) {
  std::error_code ec;
  char const* repo      = std::getenv("WM_REPO");
  fs::path const script = fs::path{"peers"} / name;
  for (fs::path const& dir :
       {repo != nullptr && *repo != '\0' ? fs::path{repo} / "bench" : fs::path{},
        fs::path{__FILE__}.parent_path(),
        fs::read_symlink("/proc/self/exe", ec).parent_path() / "../../bench", fs::path{"bench"}}) {
    if (!dir.empty() && fs::is_regular_file(dir / script, ec)) { return dir / script; }
  }
  return {};
}

/// The peer script bench/peers/@p name (see peer_script), if it is found and python3 imports
/// torch; otherwise an empty path, and @p p.note says which of the two is missing.
inline fs::path find_peer(char const* name, peer_result& p) {
  fs::path const script = peer_script(name);
  if (script.empty()) {
    p.note = std::string{"torch peer not run: bench/peers/"} + name + " not found (set WM_REPO)";
    return {};
  }
  std::fflush(nullptr);
  if (std::system("python3 -c 'import torch' >/dev/null 2>&1") != 0) {
    p.note = "torch peer not run: python3 cannot import torch";
    return {};
  }
  return script;
}

/// Runs the peer command @p cmd through the shell. The line of its stdout that starts with '{'
/// goes to @p p.json (the last one, if several); every other line is passed on to stdout. If it
/// exits with a status other than 0 or prints no such line, @p p.failed is set and @p p.note
/// says so.
inline void run_peer(std::string const& cmd, peer_result& p) {
  std::FILE* pipe = ::popen(cmd.c_str(), "r");
  static char buf[1 << 16];
  while (pipe != nullptr && std::fgets(buf, sizeof buf, pipe) != nullptr) {
    if (buf[0] == '{') {
      p.json = buf;
    } else {
      std::fputs(buf, stdout);
    }
  }
  int const status = pipe == nullptr ? -1 : ::pclose(pipe);
  if (status != 0 || p.json.empty()) {
    p.failed = true;
    p.note   = "torch peer FAILED (exit status " +
             std::to_string(WIFEXITED(status) ? WEXITSTATUS(status) : -1) +
             ", 124 = timeout; its stderr is above)";
  }
}

/// The number after "key": in a JSON line (NaN if absent or null).
inline double json_number(std::string const& line, std::string const& key) {
  auto const at = line.find('"' + key + "\":");
  if (at == std::string::npos) { return std::numeric_limits<double>::quiet_NaN(); }
  char const* s  = line.c_str() + at + key.size() + 3;
  char* end      = nullptr;
  double const v = std::strtod(s, &end);
  return end == s ? std::numeric_limits<double>::quiet_NaN() : v;
}

// ---- memory ----------------------------------------------------------------------------------

/// Frees device memory (a unique_ptr deleter).
struct cuda_free {
  void operator()(void* p) const noexcept { (void)cudaFree(p); }
};

/// Device memory for an array of T.
template <class T>
using buffer = std::unique_ptr<T[], cuda_free>;

/// Device memory for @p n T (one if @p n is 0), by cudaMalloc.
template <class T>
buffer<T> allocate(std::size_t n) {
  void* p = nullptr;
  WM_CUDA_TRY(cudaMalloc(&p, std::max<std::size_t>(n, 1) * sizeof(T)));
  return buffer<T>{static_cast<T*>(p)};
}

template <class View>
__global__ void entry_address_kernel(View view, std::size_t e, std::byte** out) {
  *out = view.entry(e);
}

/// Address of global entry @p e as @p view computes it in device code: one thread writes it to
/// @p scratch (device memory for one pointer), which is copied back. Synchronizes @p stream.
template <class View>
std::byte const* entry_address(View view, std::size_t e, void* scratch, cudaStream_t stream) {
  auto** out = static_cast<std::byte**>(scratch);
  entry_address_kernel<<<1, 1, 0, stream>>>(view, e, out);
  WM_CHECK_LAUNCH();
  std::byte* host = nullptr;
  WM_CUDA_TRY(cudaMemcpyAsync(&host, out, sizeof(host), cudaMemcpyDeviceToHost, stream));
  WM_CUDA_TRY(cudaStreamSynchronize(stream));
  return host;
}

// ---- the embedding-table benchmarks (embedding_bench, cache_bench) -----------------------------

/// What embedding_bench and cache_bench share; each opens it in its anonymous namespace with
/// `using namespace wm_bench::table_bench;`.
namespace table_bench {

namespace fs = std::filesystem;
using wm_bench::allocate;
using wm_bench::buffer;
using wm_bench::fmt;
using wm_bench::json_number;
using wm_bench::median;
using wm_bench::peer_result;
using clock_type = std::chrono::steady_clock;

inline constexpr std::size_t gib        = std::size_t{1} << 30;
inline constexpr std::size_t table_rows = 10'000'000;
inline constexpr std::size_t dim        = 128;
inline constexpr std::size_t row_bytes  = dim * sizeof(float);
inline constexpr std::size_t batch      = 1'000'000;  // keys per rank per step
inline constexpr double zipf_alpha      = 1.05;
inline constexpr std::uint64_t scatter  = 7'368'787;  // coprime with 10M: a bijection
inline constexpr float lr               = 0.01f;
inline constexpr int threads            = 256;

enum dist { uniform = 0, zipf = 1 };
inline constexpr char const* dist_names[] = {"uniform", "zipf"};

/// Gradients: uniform in [-1, 1) (computed in float), a hash of the element and the seed.
template <class T>
__global__ void grad_kernel(T* g, std::size_t n, std::uint64_t seed) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    g[i] = static_cast<T>(
        static_cast<float>(splitmix(seed ^ splitmix(i)) >> 40) * (2.0f / 16777216.0f) - 1.0f);
  }
}

/// Blocks of a grid-stride kernel on @p device: 8 per multiprocessor.
inline int grid_blocks(int device) {
  int sms = 0;
  WM_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return 8 * sms;
}

/// The name of @p device (cudaGetDeviceProperties).
inline std::string device_name(int device) {
  cudaDeviceProp prop{};
  WM_CUDA_TRY(cudaGetDeviceProperties(&prop, device));
  return prop.name;
}

/// Fills @p g (@p n floats) with the gradients of grad_kernel for @p seed, in @p blocks blocks on
/// @p stream, and waits for them.
inline void fill_gradients(float* g, std::size_t n, std::uint64_t seed, int blocks,
                           cudaStream_t stream) {
  grad_kernel<<<blocks, threads, 0, stream>>>(g, n, seed);
  WM_CHECK_LAUNCH();
  WM_CUDA_TRY(cudaStreamSynchronize(stream));
}

/// Runs the peer command @p cmd (run_peer) on key files: @p keys[d] is written to
/// `<dist_names[d]>.int64` in a fresh temporary directory `@p dir_name.XXXXXX`, and
/// ` --<dist_names[d]> '<file>'` appended to @p cmd; the directory is removed afterwards. False,
/// with @p p.failed set and @p p.note "@p who FAILED: cannot create a temporary directory", if
/// the directory cannot be made (the peer is not run).
inline bool run_peer_on_keys(std::string cmd, std::array<std::span<std::int64_t const>, 2> keys,
                             char const* dir_name, char const* who, peer_result& p) {
  std::string dir_template = (fs::temp_directory_path() / dir_name).string() + ".XXXXXX";
  if (::mkdtemp(dir_template.data()) == nullptr) {
    p.failed = true;
    p.note   = std::string{who} + " FAILED: cannot create a temporary directory";
    return false;
  }
  fs::path const dir{dir_template};
  for (int d = 0; d < 2; ++d) {
    fs::path const f = dir / (std::string{dist_names[d]} + ".int64");
    std::ofstream out{f, std::ios::binary};
    out.write(reinterpret_cast<char const*>(keys[d].data()),
              static_cast<std::streamsize>(keys[d].size() * sizeof(std::int64_t)));
    cmd += " --" + std::string{dist_names[d]} + " '" + f.string() + "'";
  }
  run_peer(cmd, p);
  std::error_code ec;
  fs::remove_all(dir, ec);
  return true;
}

}  // namespace table_bench

}  // namespace wm_bench
