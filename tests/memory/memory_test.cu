// SPDX-License-Identifier: Apache-2.0
// GPU tests of wm::memory: the six Location x Layout kinds with 1 rank ([gpu]) and with one rank
// per GPU ([multi_gpu]). Every rank writes a rank- and offset-dependent pattern into its part;
// after a barrier every rank checks every byte of every part through every view its layout
// offers, in a kernel. Files round-trip into a different kind; bad files fail on every rank;
// one long-lived process that makes and destroys every kind, tensors and splits 20 times ends
// with the descriptors, memfd mappings, GPU memory and pinned registrations it started with.
#include <wm/launch.hpp>
#include <wm/tensor.cuh>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "leak_check.hpp"
#include "rank_check.hpp"
#include "ranks.hpp"

namespace policy_checks {

// The policy sets are closed: a type that merely looks like a location or layout (the members
// the old concepts asked for) is rejected, and so is a memory of it.
struct foreign_location {
  static constexpr bool is_host     = false;
  static constexpr char const* name = "foreign";
};
struct foreign_layout {
  static constexpr bool mapped      = false;
  static constexpr char const* name = "foreign";
};
template <class L, class Y>
concept memory_of = requires {
  typename wm::memory<L, Y>;
};
static_assert(!wm::location<foreign_location> && !wm::layout<foreign_layout>);
static_assert(memory_of<wm::device, wm::distributed> && memory_of<wm::host, wm::chunked>);
static_assert(!memory_of<foreign_location, wm::chunked> && !memory_of<wm::device, foreign_layout>);

}  // namespace policy_checks

namespace {

// ---- compile-time: a view a layout cannot serve does not compile ------------------------------
template <class M>
concept has_chunked_view = requires(M const& m) {
  m.chunked_view();
};
template <class M>
concept has_continuous_view = requires(M const& m) {
  m.continuous_view();
};

static_assert(has_continuous_view<wm::memory<wm::device, wm::continuous>>);
static_assert(has_continuous_view<wm::memory<wm::host, wm::continuous>>);
static_assert(!has_continuous_view<wm::memory<wm::device, wm::chunked>>);
static_assert(!has_continuous_view<wm::memory<wm::host, wm::chunked>>);
static_assert(!has_continuous_view<wm::memory<wm::device, wm::distributed>>);
static_assert(!has_continuous_view<wm::memory<wm::host, wm::distributed>>);
static_assert(has_chunked_view<wm::memory<wm::device, wm::continuous>>);
static_assert(has_chunked_view<wm::memory<wm::host, wm::chunked>>);
static_assert(!has_chunked_view<wm::memory<wm::device, wm::distributed>>);
static_assert(!has_chunked_view<wm::memory<wm::host, wm::distributed>>);
static_assert(std::is_trivially_copyable_v<wm::local_view>);
static_assert(std::is_trivially_copyable_v<wm::chunked_view>);
static_assert(std::is_trivially_copyable_v<wm::continuous_view>);
static_assert(!std::is_copy_constructible_v<wm::memory<wm::device, wm::chunked>>);
static_assert(std::is_nothrow_move_constructible_v<wm::memory<wm::device, wm::chunked>>);
static_assert(wm::location<wm::host> && wm::location<wm::device> && !wm::location<wm::chunked>);
static_assert(wm::layout<wm::continuous> && wm::layout<wm::distributed> && !wm::layout<wm::host>);
// Each pair selects its resource type at compile time.
static_assert(std::is_same_v<wm::continuous::resource<wm::device>, wm::detail::vmm_resource>);
static_assert(std::is_same_v<wm::chunked::resource<wm::device>, wm::detail::ipc_resource>);
static_assert(std::is_same_v<wm::continuous::resource<wm::host>, wm::chunked::resource<wm::host>>);
static_assert(std::is_same_v<wm::distributed::resource<wm::device>, wm::detail::device_resource>);
static_assert(std::is_same_v<wm::distributed::resource<wm::host>, wm::detail::pinned_resource>);

// ---- the pattern ------------------------------------------------------------------------------
__host__ __device__ inline std::uint8_t pattern(std::size_t offset, int owner, std::uint32_t salt) {
  std::uint64_t z = offset * 0x9e3779b97f4a7c15ull +
                    static_cast<std::uint64_t>(owner) * 0xbf58476d1ce4e5b9ull + salt;
  z ^= z >> 31;
  z *= 0x94d049bb133111ebull;
  return static_cast<std::uint8_t>(z >> 56);
}

// Owner of an entry from the test's own copy of the starts (independent of partition_ref).
__device__ inline int owner_of(std::size_t e, std::size_t const* starts, int world) {
  for (int r = 0; r < world; ++r) {
    if (e >= starts[r] && e < starts[r + 1]) { return r; }
  }
  return -1;
}

__global__ void write_local(wm::local_view v, int me, std::uint32_t salt) {
  std::size_t const first = v.first_entry * v.granularity;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < v.bytes();
       i += gridDim.x * blockDim.x) {
    reinterpret_cast<std::uint8_t*>(v.data)[i] = pattern(first + i, me, salt);
  }
}

__global__ void check_local(wm::local_view v, int me, std::uint32_t salt, unsigned long long* bad) {
  std::size_t const first = v.first_entry * v.granularity;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < v.bytes();
       i += gridDim.x * blockDim.x) {
    if (reinterpret_cast<std::uint8_t const*>(v.data)[i] != pattern(first + i, me, salt)) {
      atomicAdd(bad, 1ull);
    }
  }
}

// Every byte of every entry through the view's entry(e); View: chunked_view or continuous_view.
template <class View>
__global__ void check_all(View v, std::size_t entries, std::size_t const* starts, int world,
                          std::uint32_t salt, unsigned long long* bad) {
  std::size_t const g     = v.granularity;
  std::size_t const total = entries * g;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += gridDim.x * blockDim.x) {
    std::size_t const e = i / g;
    auto const* p       = reinterpret_cast<std::uint8_t const*>(v.entry(e));
    if (p[i % g] != pattern(i, owner_of(e, starts, world), salt)) { atomicAdd(bad, 1ull); }
  }
}

// Device scratch for the checks: a mismatch counter and the test's copy of the starts.
struct checker {
  unsigned long long* bad{};
  std::size_t* starts{};
  int world{};

  explicit checker(wm::block_partition const& p) : world{p.world()} {
    WM_CUDA_TRY(cudaMalloc(&bad, sizeof(*bad)));
    WM_CUDA_TRY(cudaMalloc(&starts, p.starts().size() * sizeof(std::size_t)));
    WM_CUDA_TRY(cudaMemcpy(starts, p.starts().data(), p.starts().size() * sizeof(std::size_t),
                           cudaMemcpyHostToDevice));
  }
  ~checker() {
    (void)cudaFree(bad);
    (void)cudaFree(starts);
  }
  template <class Launch>
  unsigned long long count(Launch&& launch) {
    WM_CUDA_TRY(cudaMemset(bad, 0, sizeof(*bad)));
    WM_CUDA_TRY(cudaDeviceSynchronize());  // zero before a kernel on any stream counts
    launch();
    WM_CHECK_LAUNCH();
    WM_CUDA_TRY(cudaDeviceSynchronize());
    unsigned long long n = 0;
    WM_CUDA_TRY(cudaMemcpy(&n, bad, sizeof(n), cudaMemcpyDeviceToHost));
    return n;
  }
};

constexpr int blocks  = 264;
constexpr int threads = 256;

template <class L, class Y>
std::string name_of() {
  return std::string{L::name} + "." + Y::name;
}

// Writes the pattern into the local part, then checks every view the layout offers.
template <class L, class Y>
void write_and_check(wm::communicator& comm, wm::memory<L, Y>& m, std::uint32_t salt,
                     std::string const& what) {
  int const me = comm.rank();
  auto const v = m.local_view();
  RANK_REQUIRE(v.first_entry == m.partition().begin(me));
  RANK_REQUIRE(v.entries == m.partition().count(me));
  RANK_REQUIRE(v.granularity == m.granularity());
  RANK_REQUIRE(v.entries == 0 || v.data != nullptr);
  if (v.bytes() > 0) {
    write_local<<<blocks, threads>>>(v, me, salt);
    WM_CHECK_LAUNCH();
  }
  WM_CUDA_TRY(cudaDeviceSynchronize());
  comm.barrier();
  checker c{m.partition()};
  auto const bad_local = c.count([&] { check_local<<<blocks, threads>>>(v, me, salt, c.bad); });
  RANK_REQUIRE_MSG(bad_local == 0, what << ": " << bad_local << " wrong bytes in the local view");
  if constexpr (Y::mapped) {
    auto const bad = c.count([&] {
      check_all<<<blocks, threads>>>(m.chunked_view(), m.entries(), c.starts, c.world, salt, c.bad);
    });
    RANK_REQUIRE_MSG(bad == 0, what << ": " << bad << " wrong bytes through chunked_view");
    // part_data: the same per-rank starts, for host code; this rank's is its local view.
    std::vector<std::byte*> chunks(static_cast<std::size_t>(comm.size()));
    WM_CUDA_TRY(cudaMemcpy(chunks.data(), m.chunked_view().chunks,
                           chunks.size() * sizeof(std::byte*), cudaMemcpyDeviceToHost));
    for (int q = 0; q < comm.size(); ++q) {
      RANK_REQUIRE_MSG(m.part_data(q) == chunks[static_cast<std::size_t>(q)],
                       what << ": part_data(" << q << ") differs");
    }
    RANK_REQUIRE(v.entries == 0 || m.part_data(me) == v.data);
    for (int bad_rank : {-1, comm.size()}) {
      bool threw = false;
      try {
        (void)m.part_data(bad_rank);
      } catch (wm::logic_error const&) { threw = true; }
      RANK_REQUIRE_MSG(threw, what << ": part_data(" << bad_rank << ") did not throw");
    }
  }
  if constexpr (std::is_same_v<Y, wm::continuous>) {
    auto const cv = m.continuous_view();
    RANK_REQUIRE(cv.entries == m.entries() && (m.entries() == 0 || cv.data != nullptr));
    auto const bad = c.count(
        [&] { check_all<<<blocks, threads>>>(cv, m.entries(), c.starts, c.world, salt, c.bad); });
    RANK_REQUIRE_MSG(bad == 0, what << ": " << bad << " wrong bytes through continuous_view");
  }
  comm.barrier();  // nobody writes the next pattern while a peer still reads this one
}

template <class L, class Y>
void check_loaded(wm::communicator& comm, wm::memory<L, Y>& m, std::uint32_t salt,
                  std::string const& what) {
  checker c{m.partition()};
  auto const v   = m.local_view();
  auto const bad = c.count([&] { check_local<<<blocks, threads>>>(v, comm.rank(), salt, c.bad); });
  RANK_REQUIRE_MSG(bad == 0, what << ": " << bad << " wrong bytes after load");
}

std::size_t free_device_memory() {
  WM_CUDA_TRY(cudaDeviceSynchronize());
  std::size_t free  = 0;
  std::size_t total = 0;
  WM_CUDA_TRY(cudaMemGetInfo(&free, &total));
  return free;
}

// One scenario: allocate kind (L, Y), pattern + views, store, load into kind (L2, Y2), check.
template <class L, class Y, class L2, class Y2>
void scenario(wm::communicator& comm, std::size_t entries, std::size_t gran,
              std::filesystem::path const& dir, std::uint32_t salt) {
  std::string const what = name_of<L, Y>() + " entries=" + std::to_string(entries) +
                           " granularity=" + std::to_string(gran) +
                           " ranks=" + std::to_string(comm.size());
  std::size_t const free_before = free_device_memory();
  {
    wm::memory<L, Y> m{comm, entries * gran, gran};
    RANK_REQUIRE(m.total_bytes() == entries * gran && m.entries() == entries &&
                 m.granularity() == gran);
    RANK_REQUIRE(m.world() == comm.size() && m.rank() == comm.rank());
    RANK_REQUIRE(m.partition() == wm::block_partition(entries, comm.size()));
    std::size_t sum = 0;
    for (int r = 0; r < comm.size(); ++r) {
      RANK_REQUIRE(m.byte_range(r).begin == m.entry_range(r).begin * gran);
      sum += m.byte_range(r).size();
    }
    RANK_REQUIRE(sum == entries * gran);
    write_and_check(comm, m, salt, what);

    auto const files = m.store(dir / ("s" + std::to_string(salt)));
    RANK_REQUIRE(files.size() == static_cast<std::size_t>(comm.size()));
    RANK_REQUIRE(std::filesystem::file_size(files[comm.rank()]) == m.local_byte_range().size());
    wm::memory<L2, Y2> other{comm, entries * gran, gran};
    other.load(std::span<std::filesystem::path const>{files});
    check_loaded(comm, other, salt, what + " stored, then loaded as " + name_of<L2, Y2>());
    comm.barrier();
  }
  comm.barrier();  // peers have unmapped this rank's memory too
  std::size_t const free_after = free_device_memory();
  RANK_REQUIRE_MSG(
      free_after + (std::size_t{4} << 20) >= free_before,
      what << ": GPU free memory " << free_before << " before, " << free_after << " after");
}

template <class F>
void for_each_kind(F&& f) {
  f.template operator()<wm::device, wm::continuous, wm::host, wm::chunked>();
  f.template operator()<wm::device, wm::chunked, wm::device, wm::distributed>();
  f.template operator()<wm::host, wm::continuous, wm::device, wm::continuous>();
  f.template operator()<wm::host, wm::chunked, wm::host, wm::distributed>();
  f.template operator()<wm::device, wm::distributed, wm::host, wm::continuous>();
  f.template operator()<wm::host, wm::distributed, wm::device, wm::chunked>();
}

void run_all_kinds(int ranks) {
  std::mt19937_64 rng{std::random_device{}()};
  auto const dir =
      std::filesystem::temp_directory_path() / ("wm-memory-test-" + std::to_string(rng()));
  std::filesystem::create_directories(dir);
  auto const seed = static_cast<std::uint32_t>(rng());
  wm::launch(ranks, [&](wm::communicator& comm) {
    (void)free_device_memory();  // context and allocator warm-up before any measurement
    std::uint32_t salt = seed;
    // (entries, granularity): odd granularities; a rank owning nothing; 0 entries; a size that
    // spans several VMM granules and does not divide by the rank count.
    std::vector<std::pair<std::size_t, std::size_t>> const cases{
        {15, 12}, {1, 1000}, {0, 8}, {9, 4}, {(std::size_t{5} << 20) / 12 + 7, 12}, {3001, 1000}};
    for (auto [entries, gran] : cases) {
      for_each_kind([&]<class L, class Y, class L2, class Y2>() {
        scenario<L, Y, L2, Y2>(comm, entries, gran, dir, ++salt);
      });
    }
  });
  std::filesystem::remove_all(dir);
}

}  // namespace

TEST_CASE("one rank: every kind, views, files, release", "[gpu]") {
  run_all_kinds(1);
}

TEST_CASE("ranks: every kind, every view reads every rank's bytes", "[multi_gpu]") {
  run_all_kinds(wm::local_device_count());
}

TEST_CASE("ranks: a user-given entry list, with a rank owning nothing", "[multi_gpu]") {
  int const n              = wm::local_device_count();
  std::uint32_t const salt = std::random_device{}();
  wm::launch(n, [&](wm::communicator& comm) {
    std::vector<std::size_t> counts(static_cast<std::size_t>(n), 0);
    counts.back()  = 1000;  // rank 0 owns nothing
    counts.front() = 0;
    if (n > 2) { counts[1] = 17; }
    std::size_t const entries = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
    wm::memory<wm::device, wm::continuous> a{comm, entries * 24, 24, counts};
    RANK_REQUIRE(a.local_entry_range().size() == counts[static_cast<std::size_t>(comm.rank())]);
    write_and_check(comm, a, salt, "continuous.device with an entry list");
    wm::memory<wm::host, wm::chunked> b{comm, entries * 24, 24, counts};
    write_and_check(comm, b, salt + 1, "chunked.host with an entry list");
    wm::memory<wm::device, wm::chunked> c{comm, entries * 24, 24, counts};
    write_and_check(comm, c, salt + 2, "chunked.device with an entry list");
  });
}

TEST_CASE("bad arguments and bad files fail on every rank", "[gpu][multi_gpu]") {
  int const n = wm::local_device_count();
  std::mt19937_64 rng{std::random_device{}()};
  auto const dir =
      std::filesystem::temp_directory_path() / ("wm-memory-bad-" + std::to_string(rng()));
  std::filesystem::create_directories(dir);
  std::size_t const gran  = 12;
  std::size_t const total = gran * 101;
  auto write_file         = [&](std::string const& name, std::size_t bytes) {
    std::ofstream out{dir / name, std::ios::binary};
    std::vector<char> data(bytes, 'x');
    out.write(data.data(), static_cast<std::streamsize>(bytes));
    return dir / name;
  };
  auto const right    = write_file("right.bin", total);
  auto const too_long = write_file("long.bin", total + gran);
  auto const odd_a    = write_file("odd_a.bin", gran * 50 + 5);
  auto const odd_b    = write_file("odd_b.bin", gran * 51 - 5);
  auto const missing  = dir / "missing.bin";
  wm::launch(n, [&](wm::communicator& comm) {
    auto expect_io_error = [&](auto&& call, std::string const& needle) {
      bool ok = false;
      try {
        call();
      } catch (wm::io_error const& e) {
        ok = std::string{e.what()}.find(needle) != std::string::npos;
        RANK_REQUIRE_MSG(ok, "message lacks '" << needle << "': " << e.what());
      }
      RANK_REQUIRE_MSG(ok, "no io_error for " << needle);
    };
    wm::memory<wm::device, wm::chunked> m{comm, total, gran};
    m.load(right);  // fine
    expect_io_error([&] { m.load(missing); }, "missing.bin");
    expect_io_error([&] { m.load(too_long); }, "bytes in all");
    std::vector<std::filesystem::path> const odd{odd_a, odd_b};
    expect_io_error([&] { m.load(std::span<std::filesystem::path const>{odd}); }, "not a multiple");
    // Only one rank lacks its file: every rank still fails.
    std::vector<std::filesystem::path> const list{comm.rank() == n - 1 ? missing : right};
    expect_io_error([&] { m.load(std::span<std::filesystem::path const>{list}); }, "missing.bin");
    // Store into a directory that does not exist.
    expect_io_error([&] { (void)m.store(dir / "no-such-dir" / "x"); }, "cannot create");
    // Argument errors are local and immediate.
    bool threw = false;
    try {
      wm::memory<wm::device, wm::distributed> bad{comm, 100, 0};
    } catch (wm::logic_error const&) { threw = true; }
    RANK_REQUIRE(threw);
    threw = false;
    try {
      wm::memory<wm::host, wm::distributed> bad{comm, 100, 7};
    } catch (wm::logic_error const&) { threw = true; }
    RANK_REQUIRE(threw);
    // Ranks that disagree on the size get an error, not a hang.
    if (comm.size() > 1) {
      threw = false;
      try {
        wm::memory<wm::device, wm::continuous> bad{comm, comm.rank() == 0 ? 96u : 48u, 12};
      } catch (wm::comm_error const&) { threw = true; }
      RANK_REQUIRE(threw);
    }
    comm.barrier();
  });
  std::filesystem::remove_all(dir);
}

TEST_CASE("a rank that fails holding every kind of memory is named, and no rank waits for it",
          "[multi_gpu]") {
  // (Its memfd memory, VMM and IPC handles end with the processes; what a live process leaks is
  // checked by the create-and-destroy test below.)
  int const n      = wm::local_device_count();
  auto const start = std::chrono::steady_clock::now();
  try {
    wm::launch(n, [&](wm::communicator& comm) {
      wm::memory<wm::host, wm::continuous> a{comm, std::size_t{64} << 20, 64};
      wm::memory<wm::host, wm::chunked> b{comm, std::size_t{64} << 20, 64};
      wm::memory<wm::device, wm::continuous> c{comm, std::size_t{64} << 20, 64};
      wm::memory<wm::device, wm::chunked> d{comm, std::size_t{64} << 20, 64};
      if (comm.rank() == 1) { throw std::runtime_error{"rank 1 fails holding memory"}; }
      comm.barrier();
    });
    FAIL("no launch_error");
  } catch (wm::launch_error const& e) {
    REQUIRE_FALSE(e.failures().empty());
    CHECK(e.failures().front().rank == 1);
    CHECK(e.failures().front().primary);
    CHECK(e.failures().front().reason.find("rank 1 fails holding memory") != std::string::npos);
  }
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds{120});
}

namespace {

// Cross-GPU coherence of host memory: a GPU writes and reads host words, a peer GPU rewrites
// them, the first GPU reads again and must see the new words (the contract host-location
// tensors rely on).
__host__ __device__ inline std::uint32_t word(std::size_t i, std::uint32_t salt) {
  return static_cast<std::uint32_t>(i * 2654435761u) ^ salt;
}

__global__ void write_words(std::uint32_t* p, std::size_t n, std::size_t first, std::uint32_t salt,
                            bool through) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    if (through) {
      __stwt(p + i, word(first + i, salt));
    } else {
      p[i] = word(first + i, salt);
    }
  }
  if (through) { __threadfence_system(); }
}

__global__ void count_wrong(std::uint32_t const* p, std::size_t n, std::uint32_t salt, bool fresh,
                            unsigned long long* bad) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    std::uint32_t const v = fresh ? __ldcv(p + i) : p[i];
    if (v != word(i, salt)) { atomicAdd(bad, 1ull); }
  }
}

}  // namespace

TEST_CASE("ranks: host memory rewritten by a peer GPU is read fresh", "[multi_gpu]") {
  int const n              = wm::local_device_count();
  std::uint32_t const seed = std::random_device{}();
  wm::launch(n, [&](wm::communicator& comm) {
    int const me                     = comm.rank();
    std::size_t const words_per_rank = std::size_t{1} << 18;  // 1 MiB per rank
    std::size_t const total          = words_per_rank * static_cast<std::size_t>(comm.size());
    unsigned long long* bad          = nullptr;
    WM_CUDA_TRY(cudaMalloc(&bad, sizeof(*bad)));
    auto wrong = [&](std::uint32_t const* p, std::uint32_t salt, bool fresh) {
      WM_CUDA_TRY(cudaMemset(bad, 0, sizeof(*bad)));
      count_wrong<<<264, 256>>>(p, total, salt, fresh, bad);
      WM_CHECK_LAUNCH();
      unsigned long long h = 0;
      WM_CUDA_TRY(cudaMemcpy(&h, bad, sizeof(h), cudaMemcpyDeviceToHost));
      return h;
    };
    for (int first_write : {0, 1, 2}) {  // 0: kernel stores, 1: cudaMemcpy, 2: the CPU
      char const* how = first_write == 0 ? "kernel" : first_write == 1 ? "cudaMemcpy" : "CPU";
      wm::memory<wm::host, wm::continuous> m{comm, total * 4, 4};
      auto* all = reinterpret_cast<std::uint32_t*>(m.continuous_view().data);
      // 1. Each rank writes its own part; everyone reads everything.
      std::uint32_t const s1  = seed ^ 0x1111u;
      std::size_t const first = static_cast<std::size_t>(me) * words_per_rank;
      std::vector<std::uint32_t> h(words_per_rank);
      for (std::size_t i = 0; i < words_per_rank; ++i) { h[i] = word(first + i, s1); }
      if (first_write == 0) {
        write_words<<<264, 256>>>(all + first, words_per_rank, first, s1, false);
        WM_CHECK_LAUNCH();
      } else if (first_write == 1) {
        WM_CUDA_TRY(cudaMemcpy(all + first, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
      } else {
        std::memcpy(all + first, h.data(), h.size() * 4);  // device pointer == host pointer (UVA)
      }
      WM_CUDA_TRY(cudaDeviceSynchronize());
      comm.barrier();
      // Plain loads first, so this GPU's L2 may hold these lines when rank 0 rewrites them below.
      // The library reads host rows with ld.cv; plain-load staleness is reported, not required.
      auto const plain1 = wrong(all, s1, false);
      auto const cv1    = wrong(all, s1, true);
      std::printf(
          "host coherence, rank %d, first read after %s writes: %llu stale words with plain loads, "
          "%llu with ld.cv\n",
          me, how, plain1, cv1);
      RANK_REQUIRE_MSG(cv1 == 0, "first read after " << how << " writes: " << cv1
                                                     << " stale words with ld.cv loads");
      comm.barrier();
      // 2. Rank 0 rewrites everything (write-through); then every rank reads again.
      std::uint32_t const s2 = seed ^ 0x2222u;
      if (me == 0) {
        write_words<<<264, 256>>>(all, total, 0, s2, true);
        WM_CHECK_LAUNCH();
        WM_CUDA_TRY(cudaDeviceSynchronize());
      }
      comm.barrier();
      auto const plain = wrong(all, s2, false);  // first: an ld.cv read would refresh the lines
      auto const cv    = wrong(all, s2, true);
      std::printf(
          "host coherence, rank %d, first written by %s: %llu stale words with plain loads, %llu "
          "with ld.cv\n",
          me, how, plain, cv);
      RANK_REQUIRE_MSG(cv == 0, "rank " << me << " after " << how << " first writes: " << cv
                                        << " stale words with ld.cv loads, " << plain
                                        << " with plain loads");
      comm.barrier();
    }
    WM_CUDA_TRY(cudaFree(bad));
  });
}

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

// A device buffer for the tensor rounds.
template <class T>
struct device_array {
  T* ptr{};
  explicit device_array(std::size_t n) {
    WM_CUDA_TRY(cudaMalloc(&ptr, std::max<std::size_t>(n, 1) * sizeof(T)));
  }
  ~device_array() { (void)cudaFree(ptr); }
  device_array(device_array const&) = delete;
};

inline float cell(std::size_t row, std::size_t col, std::uint32_t salt) {
  return static_cast<float>(pattern(row * 16 + col, 0, salt)) - 128.0f;  // exact in float
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
  device_array<std::int64_t> d_all{rows};
  device_array<float> d_values{rows * cols};
  WM_CUDA_TRY(
      cudaMemcpy(d_all.ptr, all.data(), rows * sizeof(std::int64_t), cudaMemcpyHostToDevice));
  WM_CUDA_TRY(cudaMemcpy(d_values.ptr, values.data(), values.size() * sizeof(float),
                         cudaMemcpyHostToDevice));
  WM_CUDA_TRY(cudaDeviceSynchronize());  // a pageable copy may return before its DMA ends
  t.scatter(std::span<std::int64_t const>{d_all.ptr, rows}, d_values.ptr, cuda::stream_ref{stream});
  comm.barrier();
  std::vector<std::int32_t> keys(500);
  std::uniform_int_distribution<std::int32_t> pick(0, static_cast<std::int32_t>(rows) - 1);
  for (auto& k : keys) { k = pick(rng); }
  device_array<std::int32_t> d_keys{keys.size()};
  device_array<float> d_out{keys.size() * cols};
  WM_CUDA_TRY(cudaMemcpy(d_keys.ptr, keys.data(), keys.size() * sizeof(std::int32_t),
                         cudaMemcpyHostToDevice));
  WM_CUDA_TRY(cudaMemset(d_out.ptr, 0xff, keys.size() * cols * sizeof(float)));  // NaN poison
  WM_CUDA_TRY(cudaDeviceSynchronize());  // keys and poison in place before a non-blocking stream
  t.gather(std::span<std::int32_t const>{d_keys.ptr, keys.size()}, d_out.ptr,
           cuda::stream_ref{stream});
  std::vector<float> out(keys.size() * cols);
  WM_CUDA_TRY(
      cudaMemcpy(out.data(), d_out.ptr, out.size() * sizeof(float), cudaMemcpyDeviceToHost));
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

// ---- teardown after a failure ------------------------------------------------------------------

namespace {

using clock_type = std::chrono::steady_clock;

template <class L, class Y>
struct kind {
  using location_type = L;
  using layout_type   = Y;
};
using continuous_device  = kind<wm::device, wm::continuous>;
using chunked_device     = kind<wm::device, wm::chunked>;
using continuous_host    = kind<wm::host, wm::continuous>;
using distributed_device = kind<wm::device, wm::distributed>;
using distributed_host   = kind<wm::host, wm::distributed>;

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

}  // namespace

TEMPLATE_TEST_CASE(
    "ranked: memory destroyed by unwinding on every rank leaves the communicator usable",
    "[ranked]", continuous_device, chunked_device, continuous_host, distributed_device,
    distributed_host) {
  using L    = typename TestType::location_type;
  using Y    = typename TestType::layout_type;
  auto& comm = wm_test::comm();
  // A communicator of its own, so that a failure here leaves the program's one alone.
  auto sub = comm.split(0, comm.rank());
  REQUIRE(sub.valid());
  std::size_t const gran = 64;
  // Every rank fails together (as after an error every rank saw): the releases meet at once, and
  // the communicator goes on.
  for (int round = 0; round < 2; ++round) {
    auto const t0 = clock_type::now();
    bool caught   = false;
    try {
      wm::memory<L, Y> a{sub, gran * 1000, gran};
      wm::memory<L, Y> b{sub, gran * 7, gran};
      throw std::runtime_error{"every rank fails holding memory"};
    } catch (std::runtime_error const&) { caught = true; }
    CHECK(caught);
    CHECK(seconds_since(t0) < 4.0);  // below the 5 s that a rank failing alone would wait
    CHECK_NOTHROW(sub.barrier());
  }
  comm.barrier();
}

TEST_CASE("ranked: a rank that fails alone holding memory waits for its peers 5 s, not the timeout",
          "[ranked][multi]") {
  auto& comm = wm_test::comm();
  auto sub   = comm.split(0, comm.rank());
  REQUIRE(sub.valid());
  double const limit = std::min(std::chrono::duration<double>(sub.timeout()).count(),
                                5.0);  // what the release waits
  {
    wm::memory<wm::device, wm::chunked> a{sub, std::size_t{64} << 10, 64};
    std::optional<wm::memory<wm::host, wm::continuous>> b;
    b.emplace(sub, std::size_t{64} << 10, 64);
    if (sub.rank() == 1) {
      // The peers are busy elsewhere (sleeping, below) and do not come to the release: this rank
      // gives up after the limit and aborts the communicator instead of sitting out the timeout.
      auto const t0 = clock_type::now();
      try {
        wm::memory<wm::host, wm::continuous> held{std::move(*b)};
        b.reset();  // moved from: nothing to release
        throw std::runtime_error{"rank 1 fails alone"};
      } catch (std::runtime_error const&) {}
      double const took = seconds_since(t0);
      INFO("the failing rank's release took " << took << " s, limit " << limit << " s");
      CHECK(took >= 0.8 * limit);  // it did wait for its peers, up to the limit
      CHECK(took < limit + 10.0);  // and no longer (the old release waited WM_TIMEOUT_S, 300 s)
      CHECK_THROWS_AS(sub.barrier(), wm::comm_error);  // aborted
    } else {
      std::this_thread::sleep_for(std::chrono::duration<double>(limit + 3.0));
      // The group cannot go on (rank 1 gave up on it): abort here too, so that this rank's
      // releases below do not wait for rank 1 either.
      sub.abort();
    }
  }  // every rank's remaining releases skip their barriers: the communicator is aborted
  comm.barrier();
}

TEST_CASE("ranked: a release does not stand in for a peer's barrier", "[ranked][multi]") {
  auto& comm = wm_test::comm();
  auto sub   = comm.split(0, comm.rank());
  REQUIRE(sub.valid());
  std::optional<wm::memory<wm::device, wm::distributed>> m;
  m.emplace(sub, std::size_t{64} * 100, 64);
  if (sub.rank() == 1) {
    // Rank 1 releases while the others call barrier(): with one descriptor for both, the release
    // would satisfy their barrier and every rank would go on, out of step. Now every rank sees
    // the mismatch; the release, which cannot throw, aborts the communicator.
    auto const t0 = clock_type::now();
    m.reset();
    CHECK(seconds_since(t0) < 10.0);
    CHECK_THROWS_AS(sub.barrier(), wm::comm_error);
  } else {
    std::string what;
    try {
      sub.barrier();
    } catch (wm::comm_error const& e) { what = e.what(); }
    INFO("barrier error: " << what);
    CHECK(what.find("memory release") != std::string::npos);
    sub.abort();  // this group cannot go on; the release below then skips its barrier
    auto const t0 = clock_type::now();
    m.reset();
    CHECK(seconds_since(t0) < 10.0);
  }
  comm.barrier();
}

TEST_CASE("a rank that throws holding memory lets wm::launch report it within seconds",
          "[multi_gpu]") {
  int const n = wm::local_device_count();
  // A failing test stays short: the old behaviour sat out this timeout on the throwing rank.
  char const* old_timeout = std::getenv("WM_TIMEOUT_S");
  std::string const saved = old_timeout != nullptr ? old_timeout : "";
  ::setenv("WM_TIMEOUT_S", "60", 1);
  auto const t0 = clock_type::now();
  std::string error;
  try {
    wm::launch(n, [&](wm::communicator& comm) {
      wm::memory<wm::device, wm::chunked> a{comm, std::size_t{64} << 20, 64};
      wm::memory<wm::host, wm::continuous> b{comm, std::size_t{16} << 20, 64};
      if (comm.rank() == 1) { throw std::runtime_error{"rank 1 fails holding memory"}; }
      // The others wait for rank 1 in a device exchange, not in a host collective: a release
      // barrier there would wait for the timeout.
      std::byte* buf = nullptr;
      WM_CUDA_TRY(cudaMalloc(&buf, 1));
      wm::communicator::recv_part const from_1{1, buf, 1};
      comm.send_recv({}, std::span{&from_1, 1}, cuda::stream_ref{cudaStreamLegacy});
      comm.synchronize(cuda::stream_ref{cudaStreamLegacy}, "waiting for rank 1");
    });
  } catch (wm::launch_error const& e) { error = e.what(); }
  double const took = seconds_since(t0);
  if (old_timeout != nullptr) {
    ::setenv("WM_TIMEOUT_S", saved.c_str(), 1);
  } else {
    ::unsetenv("WM_TIMEOUT_S");
  }
  INFO("launch error: " << error << "; took " << took << " s");
  CHECK(error.find("rank 1 fails holding memory") != std::string::npos);
  CHECK(took < 30.0);
}

// A recoverable CUDA error (an allocation the device cannot hold) is reported once, by the call
// that failed: the runtime's last-error slot is cleared when wm throws, so the next launch check
// does not throw the same error again (a caller that frees memory and retries can go on).
TEST_CASE("a failed allocation is reported once, not again at the next launch check", "[gpu]") {
  wm::launch(1, [](wm::communicator&) {
    void* p         = nullptr;
    auto const huge = std::size_t{1} << 62;
    REQUIRE_THROWS_AS([&] { WM_CUDA_TRY(cudaMalloc(&p, huge)); }(), wm::cuda_error);
    REQUIRE_NOTHROW([] { WM_CHECK_LAUNCH(); }());
    REQUIRE(cudaPeekAtLastError() == cudaSuccess);
  });
}

// ---- after the communicator is aborted ---------------------------------------------------------

namespace {

using chunked_host = kind<wm::host, wm::chunked>;

// Gathers @p keys of @p t into a NaN-poisoned buffer; returns the rows (rows x cols floats).
template <class Tensor>
std::vector<float> gathered(Tensor& t, std::vector<std::int64_t> const& keys) {
  std::size_t const cols = t.cols();
  device_array<std::int64_t> d_keys{keys.size()};
  device_array<float> d_out{keys.size() * cols};
  WM_CUDA_TRY(cudaMemcpy(d_keys.ptr, keys.data(), keys.size() * sizeof(std::int64_t),
                         cudaMemcpyHostToDevice));
  WM_CUDA_TRY(cudaMemset(d_out.ptr, 0xff, keys.size() * cols * sizeof(float)));
  WM_CUDA_TRY(cudaDeviceSynchronize());
  t.gather(std::span<std::int64_t const>{d_keys.ptr, keys.size()}, d_out.ptr,
           cuda::stream_ref{cudaStream_t{}});
  std::vector<float> out(keys.size() * cols);
  WM_CUDA_TRY(
      cudaMemcpy(out.data(), d_out.ptr, out.size() * sizeof(float), cudaMemcpyDeviceToHost));
  return out;
}

// Rows of @p out that differ from the reference cell(keys[i], c, salt).
std::size_t wrong_rows(std::vector<float> const& out, std::vector<std::int64_t> const& keys,
                       std::size_t cols, std::uint32_t salt) {
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    bool same = true;
    for (std::size_t c = 0; c < cols; ++c) {
      same = same && out[i * cols + c] == cell(static_cast<std::size_t>(keys[i]), c, salt);
    }
    wrong += same ? 0 : 1;
  }
  return wrong;
}

// A mapped tensor of kind (L, Y) on a split of @p comm: every rank scatters the rows it owns
// (fresh values), and every rank gathers random rows right. Then the last rank aborts the split
// (on one rank: the only one). There, a gather and a scatter throw wm::comm_error before they
// touch memory: the gather's output keeps its poison and this rank's rows keep their values (the
// old code read and wrote through the mappings of an aborted group, whose peers' parts may be
// gone). The other ranks, whose split was not aborted, still gather every row right (no part was
// released). Then every rank aborts the split and its tensor goes.
template <class L, class Y>
void mapped_calls_after_abort(wm::communicator& comm, std::uint32_t salt, std::mt19937_64& rng) {
  std::string const what = name_of<L, Y>() + " tensor";
  auto sub               = comm.split(0, comm.rank());
  RANK_REQUIRE(sub.valid());
  std::size_t const rows = 1037;
  std::size_t const cols = 8;
  std::optional<wm::tensor<float, L, Y>> t;
  t.emplace(sub, rows, cols);
  std::vector<std::int64_t> mine;
  for (std::size_t k = 0; k < rows; ++k) {
    if (t->locate(k).rank == sub.rank()) { mine.push_back(static_cast<std::int64_t>(k)); }
  }
  std::vector<float> values(mine.size() * cols);
  for (std::size_t i = 0; i < mine.size(); ++i) {
    for (std::size_t c = 0; c < cols; ++c) {
      values[i * cols + c] = cell(static_cast<std::size_t>(mine[i]), c, salt);
    }
  }
  device_array<std::int64_t> d_mine{mine.size()};
  device_array<float> d_values{values.size()};
  WM_CUDA_TRY(cudaMemcpy(d_mine.ptr, mine.data(), mine.size() * sizeof(std::int64_t),
                         cudaMemcpyHostToDevice));
  WM_CUDA_TRY(cudaMemcpy(d_values.ptr, values.data(), values.size() * sizeof(float),
                         cudaMemcpyHostToDevice));
  WM_CUDA_TRY(cudaDeviceSynchronize());
  std::span<std::int64_t const> const mine_span{d_mine.ptr, mine.size()};
  t->scatter(mine_span, d_values.ptr, cuda::stream_ref{cudaStream_t{}});
  sub.barrier();
  std::vector<std::int64_t> keys(700);
  std::uniform_int_distribution<std::int64_t> pick(0, static_cast<std::int64_t>(rows) - 1);
  for (auto& k : keys) { k = pick(rng); }
  auto const before = gathered(*t, keys);
  RANK_REQUIRE_MSG(wrong_rows(before, keys, cols, salt) == 0,
                   what << ": rows gathered wrong before the abort");
  sub.barrier();
  comm.barrier();

  bool const aborts = sub.rank() == sub.size() - 1;
  if (aborts) {
    RANK_REQUIRE_MSG(!sub.aborted(), what << ": the split reads as aborted before abort()");
    sub.abort();
    RANK_REQUIRE_MSG(sub.aborted(), what << ": the split does not read as aborted after abort()");
    // The gather: wm::comm_error at once, the output untouched (NaN poison, bit for bit).
    device_array<std::int64_t> d_keys{keys.size()};
    device_array<float> d_out{keys.size() * cols};
    WM_CUDA_TRY(cudaMemcpy(d_keys.ptr, keys.data(), keys.size() * sizeof(std::int64_t),
                           cudaMemcpyHostToDevice));
    WM_CUDA_TRY(cudaMemset(d_out.ptr, 0xff, keys.size() * cols * sizeof(float)));
    WM_CUDA_TRY(cudaDeviceSynchronize());
    std::span<std::int64_t const> const key_span{d_keys.ptr, keys.size()};
    std::string msg;
    try {
      t->gather(key_span, d_out.ptr, cuda::stream_ref{cudaStream_t{}});
    } catch (wm::comm_error const& e) { msg = e.what(); }
    RANK_REQUIRE_MSG(msg.find("aborted") != std::string::npos,
                     what << ": a gather on an aborted communicator did not throw "
                             "wm::comm_error naming the abort (got '"
                          << msg << "')");
    std::vector<std::uint32_t> out(keys.size() * cols);
    WM_CUDA_TRY(cudaMemcpy(out.data(), d_out.ptr, out.size() * sizeof(std::uint32_t),
                           cudaMemcpyDeviceToHost));
    RANK_REQUIRE_MSG(std::all_of(out.begin(), out.end(), [](auto w) { return w == ~0u; }),
                     what << ": the gather that threw wrote its output");
    // The scatter of other values: wm::comm_error at once; this rank's rows keep theirs.
    device_array<float> d_other{values.size()};
    WM_CUDA_TRY(cudaMemset(d_other.ptr, 0, values.size() * sizeof(float)));
    WM_CUDA_TRY(cudaDeviceSynchronize());
    msg.clear();
    try {
      t->scatter(mine_span, d_other.ptr, cuda::stream_ref{cudaStream_t{}});
    } catch (wm::comm_error const& e) { msg = e.what(); }
    RANK_REQUIRE_MSG(msg.find("aborted") != std::string::npos,
                     what << ": a scatter on an aborted communicator did not throw "
                             "wm::comm_error naming the abort (got '"
                          << msg << "')");
    WM_CUDA_TRY(cudaDeviceSynchronize());
    auto const lv = t->local_view();
    std::vector<float> local(lv.rows * cols);
    if (lv.rows > 0) {
      WM_CUDA_TRY(cudaMemcpy2D(local.data(), cols * sizeof(float), lv.data,
                               lv.stride * sizeof(float), cols * sizeof(float), lv.rows,
                               cudaMemcpyDefault));
    }
    std::vector<float> want(lv.rows * cols);
    for (std::size_t i = 0; i < mine.size() && i < lv.rows; ++i) {
      auto const l = t->locate(static_cast<std::size_t>(mine[i])).local;
      for (std::size_t c = 0; c < cols; ++c) { want[l * cols + c] = values[i * cols + c]; }
    }
    RANK_REQUIRE_MSG(mine.size() == lv.rows && local == want,
                     what << ": the scatter that threw wrote this rank's rows");
  }
  comm.barrier();  // the aborting rank is done with its checks and still holds its part
  if (!aborts) {
    auto const again = gathered(*t, keys);
    RANK_REQUIRE_MSG(wrong_rows(again, keys, cols, salt) == 0,
                     what << ": a rank whose split was not aborted gathered wrong rows");
  }
  comm.barrier();
  sub.abort();  // the group cannot go on: every release below skips its barrier
  t.reset();
  comm.barrier();
}

}  // namespace

TEMPLATE_TEST_CASE(
    "ranked: on an aborted communicator, mapped gathers and scatters throw comm_error and touch "
    "nothing",
    "[ranked]", continuous_device, chunked_device, continuous_host, chunked_host) {
  using L    = typename TestType::location_type;
  using Y    = typename TestType::layout_type;
  auto& comm = wm_test::comm();
  auto const salt =
      comm.all_gather(static_cast<std::uint32_t>(std::random_device{}()))[0];  // alike everywhere
  std::mt19937_64 rng{std::random_device{}()};
  mapped_calls_after_abort<L, Y>(comm, salt, rng);
}

// Rank 0's chunked·device part, which every peer maps through CUDA IPC, after rank 0's release
// could not agree with the peers (its split is aborted): rank 0 must keep the part until its
// process ends (docs/design.md, "Memory kinds"). Rank 0 then allocates memory of the same size
// and fills it with another byte, where the old code's cudaFree let the driver hand the part out
// again; the peers still read rank 0's pattern through their mappings, not that byte (nor a
// fault).
TEST_CASE(
    "ranked: after a failed release, a chunked device part peers still map keeps its bytes for "
    "them",
    "[ranked][multi]") {
  auto& comm = wm_test::comm();
  auto const salt =
      comm.all_gather(static_cast<std::uint32_t>(std::random_device{}()))[0];  // alike everywhere
  auto sub = comm.split(0, comm.rank());
  REQUIRE(sub.valid());
  std::size_t const part = std::size_t{64} << 20;  // an allocation of its own on every rank
  auto const world       = static_cast<std::size_t>(sub.size());
  std::optional<wm::memory<wm::device, wm::chunked>> m;
  m.emplace(sub, part * world, 64);
  auto const lv = m->local_view();
  REQUIRE(lv.bytes() == part);
  write_local<<<blocks, threads>>>(lv, sub.rank(), salt);
  WM_CHECK_LAUNCH();
  WM_CUDA_TRY(cudaDeviceSynchronize());
  sub.barrier();
  std::vector<void*> fillers;
  if (sub.rank() == 0) {
    sub.abort();
    m.reset();  // the release barrier fails at once: the communicator is aborted
    for (int i = 0; i < 4; ++i) {
      void* p = nullptr;
      if (cudaMalloc(&p, part) != cudaSuccess) {
        (void)cudaGetLastError();
        break;
      }
      WM_CUDA_TRY(cudaMemset(p, 0x5a, part));
      fillers.push_back(p);
    }
    WM_CUDA_TRY(cudaDeviceSynchronize());
  }
  comm.barrier();  // rank 0 has released (or kept) its part and refilled what it freed
  if (sub.rank() != 0) {
    std::byte* const peer = m->part_data(0);
    REQUIRE(peer != nullptr);
    std::vector<std::uint8_t> got(part);
    cudaError_t const read = cudaMemcpy(got.data(), peer, part, cudaMemcpyDeviceToHost);
    INFO("reading rank 0's part through this rank's mapping: " << cudaGetErrorString(read));
    CHECK(read == cudaSuccess);
    std::size_t wrong       = 0;
    std::size_t const first = m->byte_range(0).begin;
    for (std::size_t i = 0; i < part; ++i) { wrong += got[i] != pattern(first + i, 0, salt); }
    INFO(wrong << " of " << part << " bytes of rank 0's part differ from its pattern");
    CHECK(wrong == 0);
  }
  comm.barrier();  // the peers are done reading
  for (void* p : fillers) { WM_CUDA_TRY(cudaFree(p)); }
  sub.abort();
  m.reset();
  comm.barrier();
}
