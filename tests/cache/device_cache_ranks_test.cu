// SPDX-License-Identifier: Apache-2.0
// GPU tests of read-write device caches in wm::embedding on several ranks (the
// embedding_cache_test program, [multi_gpu]): a device cache on each rank's own rows trains bit
// for bit like the uncached table of the same layout, through flush(), invalidate(), store() and
// load() into another layout.
#include <wm/embedding.cuh>
#include <wm/launch.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <filesystem>
#include <random>
#include <string>

#include "cache_common.cuh"
#include "catch.hpp"
#include "device_array.cuh"
#include "rank_check.hpp"

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

TEST_CASE("ranks: a device cache on each rank's rows trains bit for bit like no cache",
          "[multi_gpu]") {
  std::uint64_t const seed = std::random_device{}();
  INFO("seed " << seed);
  wm::launch(2, [&](wm::communicator& comm) {
    train_ranks<float, wm::lfu, wm::adam, wm::distributed, wm::block>(comm, wm::adam{}, seed);
    train_ranks<float, wm::lru, wm::sgd, wm::chunked, wm::cyclic>(comm, wm::sgd{}, seed + 1);
    train_ranks<__half, wm::lru, wm::adam, wm::continuous, wm::block>(comm, wm::adam{}, seed + 2);
  });
}
