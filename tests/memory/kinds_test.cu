// SPDX-License-Identifier: Apache-2.0
// GPU tests of wm::memory's kinds: the six Location x Layout kinds, each a [ranked] case run
// inside every rank (one rank, and one rank per GPU), each size a section of it. Every rank
// writes a rank- and offset-dependent pattern into its part; after a barrier every rank checks
// every byte of every part through every view its layout offers, in a kernel. Files round-trip
// into a different kind; bad files fail on every rank. The views a layout cannot serve do not
// compile.
#include <wm/launch.hpp>
#include <wm/memory.cuh>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "memory_common.cuh"
#include "rank_check.hpp"
#include "ranks.hpp"

using namespace memory_tests;

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

// Owner of an entry from the test's own copy of the starts (independent of partition_ref).
__device__ inline int owner_of(std::size_t e, std::size_t const* starts, int world) {
  for (int r = 0; r < world; ++r) {
    if (e >= starts[r] && e < starts[r + 1]) { return r; }
  }
  return -1;
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

}  // namespace

// ---- cases run inside every rank (--ranks; tests/support/ranks.hpp) ----------------------------

// Each kind (L, Y) stores into files that another kind (L2, Y2) loads; every (entries,
// granularity) a section: odd granularities; a rank owning nothing; 0 entries; a size that spans
// several VMM granules and does not divide by the rank count.
TEMPLATE_TEST_CASE(
    "ranked: a memory kind with its views and files loaded into another kind is released",
    "[ranked]", (std::tuple<wm::device, wm::continuous, wm::host, wm::chunked>),
    (std::tuple<wm::device, wm::chunked, wm::device, wm::distributed>),
    (std::tuple<wm::host, wm::continuous, wm::device, wm::continuous>),
    (std::tuple<wm::host, wm::chunked, wm::host, wm::distributed>),
    (std::tuple<wm::device, wm::distributed, wm::host, wm::continuous>),
    (std::tuple<wm::host, wm::distributed, wm::device, wm::chunked>)) {
  using L                  = std::tuple_element_t<0, TestType>;
  using Y                  = std::tuple_element_t<1, TestType>;
  using L2                 = std::tuple_element_t<2, TestType>;
  using Y2                 = std::tuple_element_t<3, TestType>;
  auto& comm               = wm_test::comm();
  std::uint64_t const seed = shared_seed(comm);
  auto const dir =
      std::filesystem::temp_directory_path() / ("wm-memory-test-" + std::to_string(seed));
  if (comm.rank() == 0) { std::filesystem::create_directories(dir); }
  comm.barrier();
  (void)free_device_memory();  // context and allocator warm-up before any measurement
  std::pair<std::size_t, std::size_t> const cases[]{
      {15, 12}, {1, 1000}, {0, 8}, {9, 4}, {(std::size_t{5} << 20) / 12 + 7, 12}, {3001, 1000}};
  auto salt = static_cast<std::uint32_t>(seed);
  for (auto const& [entries, gran] : cases) {
    ++salt;
    DYNAMIC_SECTION(entries << " entries of " << gran << " bytes") {
      scenario<L, Y, L2, Y2>(comm, entries, gran, dir, salt);
    }
  }
  comm.barrier();
  if (comm.rank() == 0) { std::filesystem::remove_all(dir); }
}

TEST_CASE("ranked: a user-given entry list with a rank owning nothing", "[ranked][multi]") {
  auto& comm      = wm_test::comm();
  auto const salt = static_cast<std::uint32_t>(shared_seed(comm));
  auto const n    = static_cast<std::size_t>(comm.size());
  std::vector<std::size_t> counts(n, 0);
  counts.back()  = 1000;  // rank 0 owns nothing
  counts.front() = 0;
  if (n > 2) { counts[1] = 17; }
  std::size_t const entries = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
  SECTION("device.continuous") {
    wm::memory<wm::device, wm::continuous> a{comm, entries * 24, 24, counts};
    RANK_REQUIRE(a.local_entry_range().size() == counts[static_cast<std::size_t>(comm.rank())]);
    write_and_check(comm, a, salt, "continuous.device with an entry list");
  }
  SECTION("host.chunked") {
    wm::memory<wm::host, wm::chunked> b{comm, entries * 24, 24, counts};
    write_and_check(comm, b, salt + 1, "chunked.host with an entry list");
  }
  SECTION("device.chunked") {
    wm::memory<wm::device, wm::chunked> c{comm, entries * 24, 24, counts};
    write_and_check(comm, c, salt + 2, "chunked.device with an entry list");
  }
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
