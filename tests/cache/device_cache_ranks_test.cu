// SPDX-License-Identifier: Apache-2.0
// GPU tests of read-write device caches in wm::embedding on several ranks (the
// embedding_cache_test program), [ranked] cases run inside every rank: a device cache on each
// rank's own rows trains bit for bit like the uncached table of the same layout, through flush(),
// invalidate(), store() and load() into another layout (one rank per GPU, each combination a
// section); a rank that cannot allocate its cache lines makes every rank throw the same error,
// naming it (one rank, and one per GPU).
#include <wm/embedding.cuh>
#include <wm/launch.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <random>
#include <string>

#include "cache_common.cuh"
#include "catch.hpp"
#include "device_array.cuh"
#include "rank_check.hpp"
#include "ranks.hpp"

using namespace cache_tests;

namespace {

/**
 * Several ranks: a read-write device cache on each rank's own rows against the uncached table of
 * the same layout; every rank passes its own batches; gathers go through the owners' caches.
 */
template <class T, class R, class Opt, class Y, class M>
void train_ranks(wm::communicator& comm, Opt opt, std::uint64_t seed) {
  std::string const what = std::string{"ranks="} + std::to_string(comm.size()) + " " + Y::name +
                           "." + M::name + " T=" + std::to_string(sizeof(T)) + "B " + R::name +
                           " " + Opt::name;
  cudaStream_t s{};
  WM_CUDA_TRY(cudaStreamCreate(&s));
  std::size_t const rows = 1001, dim = 16;
  auto const init = wm::embedding_init::uniform(-0.5f, 0.5f, seed);
  wm::cache_options co;
  co.ratio = 0.1;
  wm::embedding<T, wm::device_cache<wm::read_write, R>, Opt, wm::host, Y, M> cached{comm, rows, dim,
                                                                                    opt,  init, co};
  wm::embedding<T, wm::no_cache, Opt, wm::device, Y, M> plain{comm, rows, dim, opt, init};
  std::mt19937_64 rng{seed * 31 + static_cast<std::uint64_t>(comm.rank())};  // this rank's keys
  std::uint64_t requests = 0;
  for (int k = 0; k < 6; ++k) {
    auto const b = draw<T>(rng, rows, dim, 300 + 17 * static_cast<std::size_t>(comm.rank()), k);
    RANK_REQUIRE_MSG(gather(cached, b, s) == gather(plain, b, s),
                     what << ": gather of step " << k << " differs");
    requests += b.keys.size();
    apply(cached, b, s);
    apply(plain, b, s);
    if (k == 2) {
      cached.flush(cuda::stream_ref{s});
      // Mapped layouts read peers' rows directly: every rank's flush first.
      WM_CUDA_TRY(cudaStreamSynchronize(s));
      comm.barrier();
      RANK_REQUIRE_MSG(snapshot(cached, s) == snapshot(plain, s), what << ": after flush()");
    }
    if (k == 3) { cached.invalidate(cuda::stream_ref{s}); }
  }
  // Each owner counted the requests it served: together, every key of every rank.
  auto const st = cached.cache_stats();
  RANK_REQUIRE_MSG(st.hits + st.misses == st.requests, what);
  std::uint64_t served = 0, made = 0;
  for (auto x : comm.all_gather(static_cast<std::uint64_t>(st.requests))) { served += x; }
  for (auto x : comm.all_gather(requests)) { made += x; }
  RANK_REQUIRE_MSG(served == made, what << ": " << served << " requests served, " << made);
  // One directory for all ranks (named by the shared seed), made by rank 0 before anyone writes.
  auto const dir =
      std::filesystem::temp_directory_path() / ("wm-cache-ranks-" + std::to_string(seed));
  if (comm.rank() == 0) {
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
  }
  comm.barrier();
  cached.store(dir / "ck");
  RANK_REQUIRE_MSG(snapshot(cached, s) == snapshot(plain, s), what << ": after store()");
  wm::embedding<T, wm::no_cache, Opt, wm::device, wm::chunked, wm::block> loaded{
      comm, rows, dim, opt, wm::embedding_init::zeros()};
  loaded.load(dir / "ck");
  RANK_REQUIRE_MSG(snapshot(loaded, s) == snapshot(plain, s), what << ": the reloaded table");
  comm.barrier();
  if (comm.rank() == 0) { std::filesystem::remove_all(dir); }
  WM_CUDA_TRY(cudaStreamDestroy(s));
}

}  // namespace

TEST_CASE("ranked: a device cache on each rank's rows trains bit for bit like no cache",
          "[ranked][multi]") {
  auto& comm               = wm_test::comm();
  std::uint64_t const seed = shared_seed(comm);
  INFO("seed " << seed);
  SECTION("float, LFU, Adam, host distributed, block mapping") {
    train_ranks<float, wm::lfu, wm::adam, wm::distributed, wm::block>(comm, wm::adam{}, seed);
  }
  SECTION("float, LRU, SGD, host chunked, cyclic mapping") {
    train_ranks<float, wm::lru, wm::sgd, wm::chunked, wm::cyclic>(comm, wm::sgd{}, seed + 1);
  }
  SECTION("half, LRU, Adam, host continuous, block mapping") {
    train_ranks<__half, wm::lru, wm::adam, wm::continuous, wm::block>(comm, wm::adam{}, seed + 2);
  }
}

namespace {

/// Device memory the filled rank leaves free: room for the table's small device allocations and
/// the kernels' modules, far less than its cache lines (1 GiB of weights alone).
constexpr std::size_t left_free = std::size_t{256} << 20;

/// Takes all but left_free of this rank's GPU (freed with the buffer).
wm::detail::device_buffer<std::byte> fill_device() {
  WM_CUDA_TRY(cudaDeviceSynchronize());
  int device = 0;
  WM_CUDA_TRY(cudaGetDevice(&device));
  cudaMemPool_t pool{};
  WM_CUDA_TRY(cudaDeviceGetMemPool(&pool, device));
  WM_CUDA_TRY(cudaMemPoolTrimTo(pool, 0));  // what the pool keeps would not be free to the cache
  std::size_t free = 0, total = 0;
  WM_CUDA_TRY(cudaMemGetInfo(&free, &total));
  return wm::detail::device_buffer<std::byte>{free > left_free ? free - left_free : 0};
}

}  // namespace

TEST_CASE("ranked: a device cache one rank cannot allocate fails on every rank, naming it",
          "[ranked]") {
  auto& comm              = wm_test::comm();
  int const bad           = comm.size() - 1;
  bool const me_bad       = comm.rank() == bad;
  std::size_t const dim   = 256;                   // 1 KiB rows
  std::size_t const lines = std::size_t{1} << 20;  // the bad rank's lines: 1 GiB of weights
  std::size_t const rows  = lines * static_cast<std::size_t>(comm.size());
  // The options are each rank's own: the bad rank caches every row of its part (ratio 1, whole
  // sets), its peers a few, on a host table (so the lines are the rank's only large device
  // allocation), and the bad rank's GPU is full.
  wm::cache_options co;
  co.ratio  = me_bad ? 1.0 : 0.01;
  auto fill = me_bad ? fill_device() : wm::detail::device_buffer<std::byte>{};
  std::string msg;
  bool agreed = false;
  try {
    wm::embedding<float, wm::device_cache<wm::read_write, wm::lru>, wm::sgd, wm::host,
                  wm::distributed>
        e{comm, rows, dim, wm::sgd{}, wm::embedding_init::uniform(-0.5f, 0.5f, 7), co};
    msg = "no error";
  } catch (wm::comm_error const& x) {
    agreed = true;
    msg    = x.what();
  } catch (std::exception const& x) { msg = std::string{"not a wm::comm_error: "} + x.what(); }
  fill.reset();
  std::string const who = "rank " + std::to_string(bad) + ": could not allocate";
  RANK_REQUIRE_MSG(agreed, "rank " << comm.rank() << ": " << msg);
  RANK_REQUIRE_MSG(
      msg.find("device_cache") != std::string::npos && msg.find(who) != std::string::npos &&
          msg.find("bytes of device memory its " + std::to_string(lines) + " cache lines") !=
              std::string::npos &&
          msg.find("cudaErrorMemoryAllocation") != std::string::npos &&
          msg.find("mismatched") == std::string::npos,
      "rank " << comm.rank() << ": " << msg);
  // Every rank unwound its table with the same releases: the communicator still works.
  comm.barrier();
  RANK_REQUIRE(comm.all_gather(comm.rank())[static_cast<std::size_t>(bad)] == bad);
}
