// SPDX-License-Identifier: Apache-2.0
// GPU test of host memory's coherence across GPUs: a GPU writes and reads host words, a peer GPU
// rewrites them, the first GPU reads again with ld.cv loads and must see the new words.
#include <wm/memory.cuh>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "catch.hpp"
#include "memory_common.cuh"
#include "rank_check.hpp"
#include "ranks.hpp"

using namespace memory_tests;

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

TEST_CASE("ranked: host memory rewritten by a peer GPU is read fresh", "[ranked][multi]") {
  auto& comm                       = wm_test::comm();
  auto const seed                  = static_cast<std::uint32_t>(shared_seed(comm));
  int const me                     = comm.rank();
  std::size_t const words_per_rank = std::size_t{1} << 18;  // 1 MiB per rank
  std::size_t const total          = words_per_rank * static_cast<std::size_t>(comm.size());
  device_array<unsigned long long> const counter{1,
                                                 std::byte{0}};  // freed also when a check throws
  unsigned long long* const bad = counter.ptr;
  auto wrong                    = [&](std::uint32_t const* p, std::uint32_t salt, bool fresh) {
    WM_CUDA_TRY(cudaMemset(bad, 0, sizeof(*bad)));
    count_wrong<<<264, 256>>>(p, total, salt, fresh, bad);
    WM_CHECK_LAUNCH();
    unsigned long long h = 0;
    WM_CUDA_TRY(cudaMemcpy(&h, bad, sizeof(h), cudaMemcpyDeviceToHost));
    return h;
  };
  for (int first_write : {0, 1, 2}) {  // 0: kernel stores, 1: cudaMemcpy, 2: the CPU
    char const* how = first_write == 0 ? "kernel" : first_write == 1 ? "cudaMemcpy" : "CPU";
    DYNAMIC_SECTION("first written by " << how) {
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
  }
}
