// SPDX-License-Identifier: Apache-2.0
// Helpers shared by the embedding_cache_test program's GPU tests (training_test.cu,
// gather_paths_test.cu, device_cache_ranks_test.cu, group_cache_test.cu): batches of keys with
// repeats and their gradients, gathers and updates as bytes, snapshots of a table's weights,
// states and steps, a cached table beside the uncached one it must equal. A helper that one file
// uses is in that file.
#pragma once

#include <wm/embedding.cuh>
#include <wm/launch.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <set>
#include <span>
#include <type_traits>
#include <vector>

#include "catch.hpp"
#include "device_array.cuh"
#include "rank_check.hpp"
#include "ranks.hpp"

namespace cache_tests {

template <class T>
T from_float(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(x);
  } else {
    return __float2bfloat16_rn(x);
  }
}

using wm_test::device_array;

/// A value of V whose every byte is @p byte (a poison that is the same for every T).
template <class V>
V filled_with(unsigned char byte) {
  V v{};
  std::memset(static_cast<void*>(&v), byte, sizeof(V));
  return v;
}

/// The bytes of @p v (bitwise comparisons, whatever T is).
template <class T>
std::vector<unsigned char> bytes_of(std::vector<T> const& v) {
  std::vector<unsigned char> b(v.size() * sizeof(T));
  if (!v.empty()) { std::memcpy(b.data(), v.data(), b.size()); }
  return b;
}

/// Every row of a tensor (gathered through the tensor itself, not the cache), as bytes.
template <class V, class Tensor>
std::vector<unsigned char> all_rows(Tensor& t, std::size_t rows, std::size_t cols, cudaStream_t s) {
  return bytes_of(wm_test::gather_every_row<V>(t, rows, cols, filled_with<V>(0x5a), s));
}

/// Weights, states, per-row steps and global step of a table, as bytes.
struct table_state {
  std::vector<unsigned char> w, st, steps;
  std::int64_t global{};
  bool operator==(table_state const&) const = default;
};
template <class E>
table_state snapshot(E& e, cudaStream_t s) {
  using T = typename E::value_type;
  table_state t;
  t.w = all_rows<T>(e.weights(), e.rows(), e.dim(), s);
  if (e.states() != nullptr) {
    t.st = all_rows<float>(*e.states(), e.rows(), e.dim() * E::optimizer_type::states, s);
  }
  if (e.steps() != nullptr) { t.steps = all_rows<std::int64_t>(*e.steps(), e.rows(), 1, s); }
  t.global = e.global_step();
  return t;
}

/// A batch: keys with repeats (a quarter from five hot rows, the first three and the last two of
/// the table, so long runs sit at both ends of the sorted batch) and gradients.
template <class T>
struct batch {
  std::vector<std::int64_t> keys;
  std::vector<T> grads;
  float lr{};
  std::size_t distinct{};
};
template <class T>
batch<T> draw(std::mt19937_64& rng, std::size_t rows, std::size_t dim, std::size_t n, int step) {
  batch<T> b;
  b.lr = 0.01f * static_cast<float>(step + 1);
  b.keys.resize(n);
  std::size_t const hot = std::min<std::size_t>(rows, 5);
  for (auto& k : b.keys) {
    std::size_t const h = rng() % hot;
    k = static_cast<std::int64_t>(rng() % 4 == 0 ? (h < 3 ? h : rows - 1 - (h - 3)) : rng() % rows);
  }
  b.distinct = std::set<std::int64_t>(b.keys.begin(), b.keys.end()).size();
  std::uniform_real_distribution<float> g{-1.0f, 1.0f};
  b.grads.resize(n * dim);
  for (auto& x : b.grads) { x = from_float<T>(g(rng)); }
  return b;
}

/// e.gather(b.keys) into a poisoned buffer, as bytes.
template <class E, class T>
std::vector<unsigned char> gather(E& e, batch<T> const& b, cudaStream_t s) {
  device_array<std::int64_t> dk{b.keys};
  device_array<T> out{std::vector<T>(b.keys.size() * e.dim(), filled_with<T>(0xa5))};
  e.gather(std::span<std::int64_t const>{dk.ptr, b.keys.size()}, out.ptr, cuda::stream_ref{s});
  WM_CUDA_TRY(cudaStreamSynchronize(s));
  return bytes_of(out.to_host());
}

template <class E, class T>
void apply(E& e, batch<T> const& b, cudaStream_t s) {
  device_array<std::int64_t> dk{b.keys};
  device_array<T> dg{b.grads};
  e.apply_gradients(std::span<std::int64_t const>{dk.ptr, b.keys.size()}, dg.ptr, b.lr,
                    cuda::stream_ref{s});
}

/// Runs f(comm, seed) on one rank; the seed is fresh from std::random_device and logged.
template <class F>
void on_one_rank(F&& f) {
  std::uint64_t const seed = std::random_device{}();
  INFO("seed " << seed);
  wm::launch(1, [&](wm::communicator& comm) { f(comm, seed); });
}

using wm_test::shared_seed;

/// Bytes one cache line moves to or from the host: the weight row, its states, its step.
template <class T, class Opt>
std::size_t line_payload(Opt const& opt, std::size_t dim) {
  return dim * sizeof(T) + dim * Opt::states * sizeof(float) +
         (opt.needs_steps() ? sizeof(std::int64_t) : 0);
}

/**
 * A table in host memory behind a read-write device cache and the uncached device table it must
 * equal, both initialized alike; draws the init seed from @p rng, then the cache's hash seed.
 */
template <class T, class R, class Opt>
struct cached_and_plain {
  wm::embedding_init init;
  wm::cache_options co;
  wm::embedding<T, wm::device_cache<wm::read_write, R>, Opt, wm::host, wm::chunked> cached;
  wm::embedding<T, wm::no_cache, Opt, wm::device, wm::chunked> plain;

  cached_and_plain(wm::communicator& comm, std::size_t rows, std::size_t dim, Opt opt, double ratio,
                   std::mt19937_64& rng)
      : init{wm::embedding_init::uniform(-0.5f, 0.5f, rng())},
        co{options(ratio, rng)},
        cached{comm, rows, dim, opt, init, co},
        plain{comm, rows, dim, opt, init} {}

  static wm::cache_options options(double ratio, std::mt19937_64& rng) {
    wm::cache_options o;
    o.ratio     = ratio;
    o.hash_seed = static_cast<std::uint32_t>(rng());
    return o;
  }
};

/// cached.flush(), then whether the cached table holds what the plain one does, bit for bit.
template <class C, class P>
bool flushed_equal(C& cached, P& plain, cudaStream_t s) {
  cached.flush(cuda::stream_ref{s});
  return snapshot(cached, s) == snapshot(plain, s);
}

}  // namespace cache_tests
