// SPDX-License-Identifier: Apache-2.0
// GPU leak check of wm::memory, tensors and split communicators: one long-lived process makes and
// destroys every kind, tensors and splits 20 times and ends with the descriptors, memfd
// mappings, GPU memory and pinned registrations it started with.
#include <wm/launch.hpp>
#include <wm/memory.cuh>
#include <wm/tensor.cuh>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <numeric>
#include <random>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "leak_check.hpp"
#include "memory_common.cuh"
#include "rank_check.hpp"

using namespace memory_tests;

// ---- leak check: one long-lived process creates and destroys everything 20 times -------------
namespace {

// Open descriptors by target, inode numbers dropped ("socket:[123]" -> "socket:"), for messages.
std::multiset<std::string> open_descriptors() {
  std::multiset<std::string> out;
  for (auto const& e : std::filesystem::directory_iterator{"/proc/self/fd"}) {
    std::error_code ec;
    std::string t = std::filesystem::read_symlink(e.path(), ec).string();
    if (ec) { t = "?"; }
    out.insert(t.substr(0, t.find('[')));
  }
  return out;
}

// Mappings of memfd objects (wm's shared host memory is memfd_create + mmap).
std::multiset<std::string> memfd_mappings() {
  std::multiset<std::string> out;
  std::ifstream in{"/proc/self/maps"};
  std::string line;
  while (std::getline(in, line)) {
    if (auto const at = line.find("/memfd:"); at != std::string::npos) {
      out.insert(line.substr(at));
    }
  }
  return out;
}

template <class Set>
std::string difference(Set const& before, Set const& after) {
  std::string s;
  for (auto const& x : after) {
    if (after.count(x) > before.count(x) && s.find("+" + x + " ") == std::string::npos) {
      s += "+" + x + " (x" + std::to_string(after.count(x) - before.count(x)) + ") ";
    }
  }
  for (auto const& x : before) {
    if (before.count(x) > after.count(x) && s.find("-" + x + " ") == std::string::npos) {
      s += "-" + x + " (x" + std::to_string(before.count(x) - after.count(x)) + ") ";
    }
  }
  return s.empty() ? "no difference by name" : s;
}

// True while @p p lies in host memory registered with (or allocated pinned by) CUDA.
bool pinned(void const* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky; an unknown pointer
    return false;
  }
  return a.type == cudaMemoryTypeHost;
}

struct leak_snapshot {
  std::multiset<std::string> fds;
  std::multiset<std::string> memfd;
  wm_test::cuda_snapshot cuda;  // live events, streams, allocations; pool bytes; device memory

  static leak_snapshot take() {
    leak_snapshot s;
    s.cuda  = wm_test::cuda_snapshot::take();  // synchronizes the device first
    s.fds   = open_descriptors();
    s.memfd = memfd_mappings();
    return s;
  }
};

// Everything after `phase` must be back where it was before it: descriptors, memfd mappings,
// and (tests/support/leak_check.hpp) the live CUDA events, streams, device and pinned host
// allocations and the memory pool's used bytes exactly; the device memory the driver counts
// within 8 MiB (its 2 MiB pages).
void expect_released(wm::communicator& comm, leak_snapshot const& before, char const* phase,
                     int rounds) {
  comm.barrier();
  auto const after = leak_snapshot::take();
  auto const cuda  = wm_test::cuda_growth(before.cuda, after.cuda, std::int64_t{8} << 20);
  std::printf(
      "leak check, rank %d, %s x%d: descriptors %zu -> %zu, memfd mappings %zu -> %zu, "
      "CUDA: %s\n",
      comm.rank(), phase, rounds, before.fds.size(), after.fds.size(), before.memfd.size(),
      after.memfd.size(), cuda.empty() ? "no change" : cuda.c_str());
  RANK_REQUIRE_MSG(after.fds.size() == before.fds.size(),
                   phase << " x" << rounds << ": open descriptors " << before.fds.size() << " -> "
                         << after.fds.size() << ": " << difference(before.fds, after.fds));
  RANK_REQUIRE_MSG(after.memfd.size() == before.memfd.size(),
                   phase << " x" << rounds << ": memfd mappings " << before.memfd.size() << " -> "
                         << after.memfd.size() << ": " << difference(before.memfd, after.memfd));
  RANK_REQUIRE_MSG(cuda.empty(), phase << " x" << rounds << ": " << cuda);
}

// One memory of kind (L, Y): written, its host pages seen pinned (and memfd-mapped where
// shared) while it lives, and no longer pinned once it is gone.
template <class L, class Y>
void memory_round(wm::communicator& comm, std::size_t bytes) {
  std::string const what = name_of<L, Y>();
  std::vector<void const*> host_pages;
  {
    auto const memfd_before = memfd_mappings().size();
    wm::memory<L, Y> m{comm, bytes, 64};
    auto const v = m.local_view();
    if (v.bytes() > 0) { WM_CUDA_TRY(cudaMemset(v.data, 0x5a, v.bytes())); }
    WM_CUDA_TRY(cudaDeviceSynchronize());
    if constexpr (std::is_same_v<L, wm::host>) {
      if (v.bytes() > 0) {
        RANK_REQUIRE_MSG(pinned(v.data),
                         what << ": the probe does not see this rank's pinned pages");
        host_pages.push_back(v.data);
      }
      if constexpr (Y::mapped) {
        RANK_REQUIRE_MSG(
            memfd_mappings().size() > memfd_before,
            what << ": the probe does not see the shared host memory in /proc/self/maps");
      }
    }
    comm.barrier();
  }
  comm.barrier();
  for (void const* p : host_pages) {
    RANK_REQUIRE_MSG(!pinned(p), what << ": host pages at " << p
                                      << " are still registered with CUDA after destruction");
  }
}

// One tensor of kind (L, Y, M): every row scattered (the same values on every rank), then 500
// random rows gathered and compared; gather and scatter leave their workspaces behind in the
// tensor, which goes with it.
template <class L, class Y, class M>
void tensor_round(wm::communicator& comm, std::uint32_t salt, std::mt19937_64& rng,
                  cudaStream_t stream) {
  std::size_t const rows = 1037;
  std::size_t const cols = 8;
  wm::tensor<float, L, Y, M> t{comm, rows, cols};
  std::vector<std::int64_t> all(rows);
  std::iota(all.begin(), all.end(), std::int64_t{0});
  std::shuffle(all.begin(), all.end(), std::mt19937_64{salt});  // alike on every rank
  std::vector<float> values(rows * cols);
  for (std::size_t i = 0; i < rows; ++i) {
    for (std::size_t c = 0; c < cols; ++c) {
      values[i * cols + c] = cell(static_cast<std::size_t>(all[i]), c, salt);
    }
  }
  device_array<std::int64_t> d_all{all};
  device_array<float> d_values{values};
  t.scatter(std::span<std::int64_t const>{d_all.ptr, rows}, d_values.ptr, cuda::stream_ref{stream});
  comm.barrier();
  std::vector<std::int32_t> keys(500);
  std::uniform_int_distribution<std::int32_t> pick(0, static_cast<std::int32_t>(rows) - 1);
  for (auto& k : keys) { k = pick(rng); }
  device_array<std::int32_t> d_keys{keys};
  device_array<float> d_out{keys.size() * cols, std::byte{0xff}};  // NaN poison
  t.gather(d_keys.span(), d_out.ptr, cuda::stream_ref{stream});
  auto const out = d_out.to_host();
  for (std::size_t i = 0; i < keys.size(); ++i) {
    for (std::size_t c = 0; c < cols; ++c) {
      RANK_REQUIRE_MSG(out[i * cols + c] == cell(static_cast<std::size_t>(keys[i]), c, salt),
                       (name_of<L, Y>())
                           << " tensor: row " << keys[i] << " column " << c << " gathered wrong");
    }
  }
  comm.barrier();  // no rank frees the tensor while a peer still reads it
}

// A split communicator (its NCCL communicators, node channel, streams), used, then destroyed.
void split_round(wm::communicator& comm) {
  {
    auto sub = comm.split(0, comm.size() - 1 - comm.rank());  // reversed order
    RANK_REQUIRE(sub.valid() && sub.size() == comm.size() &&
                 sub.rank() == comm.size() - 1 - comm.rank());
    sub.barrier();
    wm::memory<wm::host, wm::continuous> m{sub, std::size_t{1} << 20,
                                           64};  // over the split's node channel
    sub.barrier();
  }
  comm.barrier();
}

void create_and_destroy_everything(int ranks) {
  constexpr int rounds     = 20;
  std::uint32_t const seed = std::random_device{}();
  std::size_t const bytes =
      (std::size_t{3} << 20) + 64 * 7;  // over one VMM granule, not a multiple
  wm::launch(ranks, [&](wm::communicator& comm) {
    // Counting starts in the rank, before anything it is to see is made. Where CUPTI cannot
    // count (not installed, or a tool such as compute-sanitizer holds it), the check still
    // compares the pool's used bytes exactly and the driver's device memory within 8 MiB, and
    // says that events, streams and allocations were not counted.
    auto& objects = wm_test::cuda_objects::start();
    if (!objects.counting()) {
      std::printf("leak check, rank %d: CUDA objects not counted: %s\n", comm.rank(),
                  objects.why_not().c_str());
    }
    std::mt19937_64 rng{seed + static_cast<std::uint32_t>(comm.rank())};
    cudaStream_t stream{};
    WM_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    auto each_memory = [&] {
      memory_round<wm::device, wm::continuous>(comm, bytes);
      memory_round<wm::device, wm::chunked>(comm, bytes);
      memory_round<wm::device, wm::distributed>(comm, bytes);
      memory_round<wm::host, wm::continuous>(comm, bytes);
      memory_round<wm::host, wm::chunked>(comm, bytes);
      memory_round<wm::host, wm::distributed>(comm, bytes);
    };
    std::uint32_t salt = seed;
    auto each_tensor   = [&] {
      ++salt;
      tensor_round<wm::device, wm::continuous, wm::block>(comm, salt, rng, stream);
      tensor_round<wm::device, wm::chunked, wm::block>(comm, salt, rng, stream);
      tensor_round<wm::device, wm::distributed, wm::block>(comm, salt, rng, stream);
      tensor_round<wm::host, wm::continuous, wm::block>(comm, salt, rng, stream);
      tensor_round<wm::host, wm::chunked, wm::cyclic>(comm, salt, rng, stream);
      tensor_round<wm::host, wm::distributed, wm::cyclic>(comm, salt, rng, stream);
    };
    // Each phase: two rounds first (lazy module loading, NCCL's and CUDA's first-use state,
    // cached launch sizes), then the baseline, then 20 rounds, then the comparison.
    std::vector<std::pair<char const*, std::function<void()>>> const phases{
        {"memory kinds", each_memory}, {"tensors", each_tensor}, {"split communicators", [&] {
                                                                    split_round(comm);
                                                                  }}};
    for (auto const& [phase, round] : phases) {
      round();
      round();
      auto const before = leak_snapshot::take();
      for (int i = 0; i < rounds; ++i) { round(); }
      expect_released(comm, before, phase, rounds);
    }
    WM_CUDA_TRY(cudaStreamDestroy(stream));
  });
}

}  // namespace

TEST_CASE("one rank: memory kinds, tensors and splits made and destroyed 20 times leak nothing",
          "[gpu]") {
  create_and_destroy_everything(1);
}

TEST_CASE("ranks: memory kinds, tensors and splits made and destroyed 20 times leak nothing",
          "[multi_gpu]") {
  create_and_destroy_everything(wm::local_device_count());
}
