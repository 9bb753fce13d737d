// SPDX-License-Identifier: Apache-2.0
// GPU tests of the cache foundations: the warp-cooperative set functions (warp.cuh) run a random
// access sequence step for step like the sequential ones (set.hpp), for LFU and LRU, through
// count saturation and clock wrap, also as batches (batch_access: batch masks, bypasses); the batch
// probe (kernels.cuh) finds exactly what the host finds after random admissions, and its device
// statistics add up.
#include <wm/cache.hpp>
#include <wm/detail/cache/statistics.hpp>
#include <wm/error.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <type_traits>
#include <vector>

#include "cache_oracle.cuh"
#include "catch.hpp"
#include "device_array.cuh"

namespace {

namespace cache = wm::detail::cache;

using wm_test::device_array;

// Outputs of the kernels are poisoned with this byte first.
constexpr std::byte poison{0x7f};

// One cache's metadata on the host (the model side) with a device copy.
template <class Impl>
struct host_cache {
  using state_type = typename Impl::state_type;
  std::vector<std::uint32_t> tags;
  std::vector<state_type> states;
  std::vector<cache::set_header> headers;
  std::uint32_t sets;
  std::uint32_t seed;

  host_cache(std::uint32_t s, std::uint32_t sd)
      : tags(std::size_t{s} * 32, 0x12345678u),
        states(std::size_t{s} * 32, state_type{}),
        headers(s),
        sets{s},
        seed{sd} {}
  [[nodiscard]] cache::cache_ref<Impl> ref() {
    return {tags.data(), states.data(), headers.data(), sets, seed};
  }
};

enum op : std::uint8_t { op_read, op_write, op_flush, op_invalidate, op_evict, op_next_batch };

struct step_record {
  int way;
  std::uint32_t old_key;
  std::uint32_t mask;
  int flags;  // 1 hit, 2 evicted, 4 write-back, 8 bypassed
};

bool operator==(step_record const& a, step_record const& b) {
  return a.way == b.way && a.old_key == b.old_key && a.mask == b.mask && a.flags == b.flags;
}

// One step by the sequential functions (host) or by lane 0 after the warp did its part.
template <class Impl>
__host__ __device__ step_record sequential_step(cache::set_ref<Impl> const& s, op o,
                                                std::uint32_t key) {
  step_record r{cache::no_way, 0, 0, 0};
  switch (o) {
    case op_flush: r.mask = s.flush(); break;
    case op_invalidate: r.mask = s.invalidate(); break;
    case op_evict: {
      int const w = static_cast<int>(key % 32);
      if ((s.header->valid >> w) & 1u) {
        r.way   = w;
        r.flags = s.evict(w) ? 4 : 0;
      }
      break;
    }
    default: break;
  }
  return r;
}

template <class Impl>
__host__ __device__ step_record access_record(cache::access_result const& a) {
  step_record r{a.way, 0, 0, a.hit ? 1 : 0};
  if (!a.hit && a.admitted.evicted) {
    r.flags |= 2;
    r.old_key = a.admitted.old_key;
  }
  if (!a.hit && a.admitted.write_back) { r.flags |= 4; }
  if (a.bypassed) { r.flags |= 8; }
  return r;
}

// One warp runs the whole sequence on one set with the warp functions; @p batched: accesses are
// batch_access of the current epoch (op_next_batch: the next epoch).
template <class Impl>
__global__ void sequence_kernel(cache::set_ref<Impl> s, std::uint32_t const* keys,
                                std::uint8_t const* ops, std::size_t n, step_record* out,
                                bool batched, std::uint32_t epoch) {
  unsigned const lane = threadIdx.x;
  for (std::size_t i = 0; i < n; ++i) {
    auto const o = static_cast<op>(ops[i]);
    if (o == op_next_batch) {
      ++epoch;
      if (lane == 0) { out[i] = step_record{cache::no_way, 0, 0, 0}; }
    } else if ((o == op_read || o == op_write) && batched) {
      auto const a = cache::warp_batch_access(s, keys[i], o == op_write, epoch, lane);
      if (lane == 0) { out[i] = access_record<Impl>(a); }
    } else if (o == op_read || o == op_write) {
      auto const a = cache::warp_access(s, keys[i], o == op_write, lane);
      if (lane == 0) { out[i] = access_record<Impl>(a); }
    } else {
      if (lane == 0) { out[i] = sequential_step(s, o, keys[i]); }
    }
    __syncwarp();
  }
}

template <class Impl>
void check_warp_against_sequential(std::uint64_t seed, int universe, std::size_t steps,
                                   std::uint32_t clock0, bool churn, bool batched = false) {
  std::mt19937_64 rng{seed};
  std::vector<std::uint32_t> pool(static_cast<std::size_t>(universe));
  for (auto& k : pool) { k = static_cast<std::uint32_t>(rng()); }
  std::vector<double> weights(pool.size());
  for (std::size_t i = 0; i < weights.size(); ++i) { weights[i] = 1.0 / std::pow(i + 1.0, 1.2); }
  std::discrete_distribution<std::size_t> pick{weights.begin(), weights.end()};
  std::vector<std::uint32_t> keys(steps);
  std::vector<std::uint8_t> ops(steps);
  for (std::size_t i = 0; i < steps; ++i) {
    auto const r = churn ? rng() % 10000 : 40 + rng() % 9960;  // no flush / invalidate / evict
    ops[i]       = r < 3                ? op_flush
                   : r < 5              ? op_invalidate
                   : r < 40             ? op_evict
                   : batched && r < 140 ? op_next_batch  // batches of ~100 accesses
                   : r < 3000           ? op_write
                                        : op_read;
    keys[i]      = ops[i] == op_evict ? static_cast<std::uint32_t>(rng()) : pool[pick(rng)];
  }

  host_cache<Impl> host{1, 0};
  host.headers[0].clock      = clock0;
  auto const hs              = host.ref().set(0);
  std::uint32_t const epoch0 = static_cast<std::uint32_t>(rng());
  std::uint32_t epoch        = epoch0;
  std::vector<step_record> expected(steps);
  int decays = 0;  // LFU: a hit on a saturated count; LRU: the clock renumbered
  for (std::size_t i = 0; i < steps; ++i) {
    auto const o = static_cast<op>(ops[i]);
    if (o == op_next_batch) {
      ++epoch;
      expected[i] = step_record{cache::no_way, 0, 0, 0};
      continue;
    }
    if (o == op_read || o == op_write) {
      int const w = hs.find(keys[i]);
      decays += std::is_same_v<Impl, cache::lfu_impl> && w != cache::no_way &&
                hs.states[w] == cache::lfu_impl::limit;
      decays += std::is_same_v<Impl, cache::lru_impl> && hs.header->clock == 0xffffffffu;
    }
    if (batched && (o == op_read || o == op_write)) {
      expected[i] = access_record<Impl>(cache::batch_access(hs, keys[i], o == op_write, epoch));
      continue;
    }
    expected[i] = (o == op_read || o == op_write)
                      ? access_record<Impl>(cache::access(hs, keys[i], o == op_write))
                      : sequential_step(hs, o, keys[i]);
  }

  host_cache<Impl> init{1, 0};
  init.headers[0].clock = clock0;
  device_array<std::uint32_t> d_tags{init.tags};
  device_array<typename Impl::state_type> d_states{init.states};
  device_array<cache::set_header> d_headers{init.headers};
  device_array<std::uint32_t> d_keys{keys};
  device_array<std::uint8_t> d_ops{ops};
  device_array<step_record> d_out{steps, poison};
  cache::set_ref<Impl> const ds{d_tags.ptr, d_states.ptr, d_headers.ptr};
  sequence_kernel<Impl><<<1, 32>>>(ds, d_keys.ptr, d_ops.ptr, steps, d_out.ptr, batched, epoch0);
  WM_CHECK_LAUNCH();
  WM_CUDA_TRY(cudaDeviceSynchronize());

  auto const got        = d_out.to_host();
  std::size_t first_bad = steps;
  for (std::size_t i = 0; i < steps && first_bad == steps; ++i) {
    if (!(got[i] == expected[i])) { first_bad = i; }
  }
  INFO("first differing step " << first_bad);
  CHECK(first_bad == steps);
  // Final metadata equal too (tags of valid lines, states, header).
  auto const tags    = d_tags.to_host();
  auto const states  = d_states.to_host();
  auto const headers = d_headers.to_host();
  CHECK(headers[0].valid == host.headers[0].valid);
  CHECK(headers[0].dirty == host.headers[0].dirty);
  CHECK(headers[0].clock == host.headers[0].clock);
  CHECK(headers[0].batch == host.headers[0].batch);
  CHECK(headers[0].epoch == host.headers[0].epoch);
  CHECK(states == host.states);
  for (int w = 0; w < 32; ++w) {
    if ((host.headers[0].valid >> w) & 1u) { CHECK(tags[w] == host.tags[w]); }
  }
  // The sequence did what it claims: hits, write-backs, evictions.
  int hits = 0, write_backs = 0, bypasses = 0;
  for (auto const& r : expected) {
    hits += (r.flags & 1) != 0;
    write_backs += (r.flags & 4) != 0 && r.way >= 0;
    bypasses += (r.flags & 8) != 0;
  }
  CHECK(hits > 0);
  CHECK(write_backs > 0);
  if (!batched) { CHECK(bypasses == 0); }
  if (batched && universe > 100) { CHECK(bypasses > 0); }     // batches of > 32 distinct keys
  if (!churn || clock0 > 0xffff0000u) { CHECK(decays > 0); }  // the set decayed at least once
}

}  // namespace

TEST_CASE("cache: warp set functions equal the sequential ones (LFU, saturating counts)", "[gpu]") {
  auto const universe = GENERATE(33, 40, 300);
  // 300k steps over few keys: the hottest key's 16-bit count saturates and the set halves.
  auto const churn = GENERATE(false, true);
  check_warp_against_sequential<cache::lfu_impl>(17 + universe, universe, 400000, 0, churn);
}

TEST_CASE("cache: warp set functions equal the sequential ones (LRU, clock wrap)", "[gpu]") {
  auto const universe = GENERATE(33, 40, 300);
  auto const clock0   = GENERATE(0u, 0xffffffffu - 5000u);
  check_warp_against_sequential<cache::lru_impl>(29 + universe, universe, 100000, clock0, true);
}

TEST_CASE("cache: warp batch accesses equal the sequential ones (LFU, LRU; bypasses)", "[gpu]") {
  auto const universe = GENERATE(33, 40, 300);
  auto const churn    = GENERATE(false, true);
  SECTION("LFU") {
    check_warp_against_sequential<cache::lfu_impl>(41 + universe, universe, 400000, 0, churn, true);
  }
  SECTION("LRU, clock wrap") {
    check_warp_against_sequential<cache::lru_impl>(43 + universe, universe, 100000,
                                                   0xffffffffu - 20000u, churn, true);
  }
}

TEMPLATE_TEST_CASE("cache: batch probe finds what the host finds; statistics add up", "[gpu]",
                   cache::lfu_impl, cache::lru_impl) {
  auto const sets = GENERATE(1u, 7u, 1000u);
  auto const n    = GENERATE(std::size_t{0}, std::size_t{1}, std::size_t{100003});
  std::mt19937_64 rng{sets * 31 + n};
  host_cache<TestType> host{sets, 11};
  auto const hc = host.ref();
  // Random admissions (and hits, dirty writes) of keys from a universe 3x the capacity.
  std::uint32_t const universe = sets * 32 * 3;
  std::uniform_int_distribution<std::uint32_t> key_of{0, universe - 1};
  for (std::uint32_t i = 0; i < sets * 32 * 4; ++i) {
    auto const k = key_of(rng);
    (void)cache::access(hc.set(hc.set_index(k)), k, (rng() & 1) != 0);
  }
  std::vector<std::uint32_t> keys(n);
  for (auto& k : keys) { k = key_of(rng); }

  device_array<std::uint32_t> d_tags{host.tags};
  device_array<typename TestType::state_type> d_states{host.states};
  device_array<cache::set_header> d_headers{host.headers};
  device_array<std::uint32_t> d_keys{keys};
  device_array<int> d_ways{n, poison};
  device_array<cache::device_statistics> d_stats{1, std::byte{0}};  // counters start at zero
  cache::cache_ref<TestType> const dc{d_tags.ptr, d_states.ptr, d_headers.ptr, sets, 11};

  cudaStream_t stream{};
  WM_CUDA_TRY(cudaStreamCreate(&stream));
  cache::probe_async(dc, d_keys.ptr, n, d_ways.ptr, d_stats.ptr, cuda::stream_ref{stream});
  cache::probe_async(dc, d_keys.ptr, n, d_ways.ptr, d_stats.ptr, cuda::stream_ref{stream});
  WM_CUDA_TRY(cudaStreamSynchronize(stream));
  WM_CUDA_TRY(cudaStreamDestroy(stream));

  auto const ways    = d_ways.to_host();
  std::uint64_t hits = 0, mismatches = 0;
  for (std::size_t i = 0; i < n; ++i) {
    int const w = hc.set(hc.set_index(keys[i])).find(keys[i]);
    hits += w != cache::no_way;
    mismatches += ways[i] != w;
  }
  CHECK(mismatches == 0);
  if (n > 1000) { CHECK(hits > n / 10); }  // about a third of the universe is cached
  if (n > 1000) { CHECK(hits < n); }
  auto const s = d_stats.to_host()[0].to_public();
  CHECK(s.requests == 2 * n);
  CHECK(s.hits == 2 * hits);
  CHECK(s.misses == 2 * (n - hits));
  CHECK(s.hits + s.misses == s.requests);
  CHECK(s.evictions == 0);  // a probe changes nothing
  // The probe left the metadata as it was.
  CHECK(d_tags.to_host() == host.tags);
  CHECK(d_states.to_host() == host.states);
}
