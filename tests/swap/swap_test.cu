// SPDX-License-Identifier: Apache-2.0
// GPU tests of wm::swap_scope and wm::swappable on one GPU: random sequences of writes, page-outs,
// prefetches and reads from several streams over buffers whose total exceeds the device budget
// (every read sees the last write: a check kernel and a copy back to the host, fresh random data
// each write); a passive access while a page-out is in flight; pinned buffers stay resident;
// small buffers travel together; the scope is destroyed with transfers in flight; statistics;
// pool blocks handed over stream-ordered (page-outs in flight, released buffers, prefetches) with
// no host-blocking sync.
#include <wm/swap.cuh>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "catch.hpp"

namespace {

constexpr std::size_t kib = std::size_t{1} << 10;
constexpr std::size_t mib = std::size_t{1} << 20;

__host__ __device__ inline std::uint32_t pattern(std::size_t i, std::uint64_t seed) {
  std::uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull ^ (seed * 0xbf58476d1ce4e5b9ull);
  z ^= z >> 31;
  z *= 0x94d049bb133111ebull;
  z ^= z >> 29;
  return static_cast<std::uint32_t>(z);
}

__global__ void fill_kernel(std::uint32_t* p, std::size_t n, std::uint64_t seed) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    p[i] = pattern(i, seed);
  }
}

__global__ void check_kernel(std::uint32_t const* p, std::size_t n, std::uint64_t seed,
                             unsigned long long* bad) {
  unsigned long long wrong = 0;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    wrong += p[i] != pattern(i, seed) ? 1 : 0;
  }
  if (wrong != 0) { atomicAdd(bad, wrong); }
}

// Keeps @p stream busy for about @p ns nanoseconds (so that a page-out waits on it).
__global__ void spin_kernel(std::uint64_t ns) {
  std::uint64_t start = 0;
  std::uint64_t now   = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

void fill(std::uint32_t* p, std::size_t n, std::uint64_t seed, cuda::stream_ref s) {
  fill_kernel<<<256, 256, 0, s.get()>>>(p, n, seed);
  WM_CHECK_LAUNCH();
}

void spin(std::uint64_t ms, cuda::stream_ref s) {
  spin_kernel<<<1, 1, 0, s.get()>>>(ms * 1'000'000);
  WM_CHECK_LAUNCH();
}

// Loads the test's kernels now. With lazy loading (the default since CUDA 12.2) the first launch
// of a kernel may synchronize the context: a test whose read must race a copy held back by a
// spin passes if that read is the kernel's first launch, since the launch waits for the spin.
// Tests of a missing stream wait call this first, so that they fail without the wait.
void load_kernels() {
  fill_kernel<<<1, 1>>>(nullptr, 0, 0);
  WM_CHECK_LAUNCH();
  check_kernel<<<1, 1>>>(nullptr, 0, 0, nullptr);
  WM_CHECK_LAUNCH();
  spin_kernel<<<1, 1>>>(0);
  WM_CHECK_LAUNCH();
  WM_CUDA_TRY(cudaDeviceSynchronize());
}

// Device counters of wrong words, one per check.
struct checker {
  unsigned long long* bad{nullptr};
  std::size_t used{0};
  std::size_t capacity;
  explicit checker(std::size_t n) : capacity{n} {
    WM_CUDA_TRY(cudaMalloc(&bad, n * sizeof(unsigned long long)));
    WM_CUDA_TRY(cudaMemset(bad, 0, n * sizeof(unsigned long long)));
    WM_CUDA_TRY(cudaDeviceSynchronize());  // before check kernels on non-blocking streams count
  }
  ~checker() { (void)cudaFree(bad); }
  void check(std::uint32_t const* p, std::size_t n, std::uint64_t seed, cuda::stream_ref s) {
    REQUIRE(used < capacity);
    check_kernel<<<256, 256, 0, s.get()>>>(p, n, seed, bad + used++);
    WM_CHECK_LAUNCH();
  }
  // Wrong words per check so far (synchronizes the device).
  [[nodiscard]] std::vector<unsigned long long> counts() const {
    WM_CUDA_TRY(cudaDeviceSynchronize());
    std::vector<unsigned long long> h(used);
    WM_CUDA_TRY(
        cudaMemcpy(h.data(), bad, used * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
    return h;
  }
  // Every check so far found nothing wrong (synchronizes the device).
  [[nodiscard]] std::size_t wrong_checks() const {
    WM_CUDA_TRY(cudaDeviceSynchronize());
    std::vector<unsigned long long> h(used);
    WM_CUDA_TRY(
        cudaMemcpy(h.data(), bad, used * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
    return static_cast<std::size_t>(
        std::count_if(h.begin(), h.end(), [](auto v) { return v != 0; }));
  }
};

struct streams {
  std::vector<cudaStream_t> s;
  explicit streams(int n) : s(n) {
    for (auto& x : s) { WM_CUDA_TRY(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking)); }
  }
  ~streams() {
    for (auto x : s) {
      (void)cudaStreamSynchronize(x);
      (void)cudaStreamDestroy(x);
    }
  }
};

// Orders @p to after the work queued so far on @p from (what a user does between streams).
void order(cudaStream_t from, cudaStream_t to) {
  if (from == to) { return; }
  cudaEvent_t ev{};
  WM_CUDA_TRY(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  WM_CUDA_TRY(cudaEventRecord(ev, from));
  WM_CUDA_TRY(cudaStreamWaitEvent(to, ev, 0));
  WM_CUDA_TRY(cudaEventDestroy(ev));
}

// The whole buffer, copied back on @p s, compared on the host with the pattern of @p seed.
std::size_t wrong_on_host(std::uint32_t const* d, std::size_t n, std::uint64_t seed,
                          cuda::stream_ref s) {
  std::vector<std::uint32_t> h(n, 0);
  WM_CUDA_TRY(cudaMemcpyAsync(h.data(), d, n * 4, cudaMemcpyDeviceToHost, s.get()));
  WM_CUDA_TRY(cudaStreamSynchronize(s.get()));
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < n; ++i) { wrong += h[i] != pattern(i, seed) ? 1 : 0; }
  return wrong;
}

wm::swap_options small_scope(std::size_t budget) {
  wm::swap_options o;
  o.device_budget = budget;
  o.host_bytes    = std::size_t{1} << 30;
  o.timeout       = std::chrono::milliseconds{30'000};
  return o;
}

// What the single-GPU cases start from: fresh random seeds, four streams (s0 to s3 refer to
// st.s[0] to st.s[3]) and a checker.
struct swap_fixture {
  std::mt19937_64 rng{std::random_device{}()};
  streams st{4};
  cuda::stream_ref const s0{st.s[0]};
  cuda::stream_ref const s1{st.s[1]};
  cuda::stream_ref const s2{st.s[2]};
  cuda::stream_ref const s3{st.s[3]};
  checker chk{128};
};

// A swap_fixture whose scope's pool holds @p Blocks buffers of @c words (16 MiB: each buffer a
// block of its own, not coalesced, each copy alone).
template <std::size_t Blocks>
struct blocks_fixture : swap_fixture {
  std::size_t const words = 4 * mib;
  wm::swap_scope scope{small_scope(Blocks * words * 4)};
};

// A new buffer of @p words from @p scope, written on @p s with the pattern of @p seed.
wm::swappable<std::uint32_t> filled(wm::swap_scope& scope, std::size_t words, std::uint64_t seed,
                                    cuda::stream_ref s) {
  auto b = scope.allocate<std::uint32_t>(words, s);
  fill(b.data(s), words, seed, s);
  return b;
}

// Takes a block of @p scope for @p words, writes it on @p s with the pattern of @p seed and
// releases it after a spin of @p ms there: the block's next user waits for the spin.
void release_after_spin(wm::swap_scope& scope, std::size_t words, std::uint64_t seed,
                        std::uint64_t ms, cuda::stream_ref s) {
  auto const b = filled(scope, words, seed, s);
  spin(ms, s);
}

// Polls @p done every @p poll until it holds or five seconds have passed (the workers issue and
// book the copies a moment after they were asked for or the GPU finished them).
template <class Done>
void wait_until(Done const& done, std::chrono::microseconds poll = std::chrono::microseconds{100}) {
  auto const until = std::chrono::steady_clock::now() + std::chrono::seconds{5};
  while (!done() && std::chrono::steady_clock::now() < until) { std::this_thread::sleep_for(poll); }
}

}  // namespace

TEST_CASE("swap: random writes, page-outs, prefetches and reads from several streams",
          "[gpu][swap]") {
  std::mt19937_64 rng{std::random_device{}()};
  std::size_t const budget = 96 * mib;
  streams st{3};
  checker chk{8192};
  struct buffer {
    wm::swappable<std::uint32_t> b;
    std::uint64_t seed;
    cudaStream_t last;
    bool held;  // counted by the test as taking pool memory (used, or prefetch asked for)
  };
  std::size_t total = 0;
  {
    wm::swap_scope scope{small_scope(budget)};
    std::vector<buffer> bufs;
    std::size_t held_bytes = 0;
    std::deque<std::size_t> held;  // oldest first
    // Before taking @p extra more bytes of the pool, page out the oldest held, unpinned buffers.
    auto make_room = [&](std::size_t extra) {
      while (held_bytes + extra > budget * 2 / 5 && !held.empty()) {
        std::size_t const k = held.front();
        held.pop_front();
        auto& x = bufs[k];
        if (!x.held) { continue; }
        x.held = false;
        held_bytes -= x.b.bytes();
        x.b.pageout(x.last);
      }
    };
    auto hold = [&](std::size_t k) {
      if (!bufs[k].held) {
        bufs[k].held = true;
        held_bytes += bufs[k].b.bytes();
        held.push_back(k);
      }
    };
    // Sizes: half small (coalesced), half 4-8 MiB; words of 4 bytes; 2x the budget in all.
    while (total < 2 * budget) {
      std::size_t const words =
          rng() % 2 == 0 ? rng() % (3 * mib / 4) + 1 : (rng() % (4 * mib) + 4 * mib) / 4;
      make_room(words * 4);
      cudaStream_t const s = st.s[rng() % 3];
      buffer x{scope.allocate<std::uint32_t>(words, cuda::stream_ref{s}), rng(), s, false};
      fill(x.b.data(cuda::stream_ref{s}), words, x.seed, s);
      bufs.push_back(std::move(x));
      hold(bufs.size() - 1);
      total += words * 4;
    }
    REQUIRE(total > budget);
    int writes = 0, reads = 0, pageouts = 0, prefetches = 0;
    // What happened to each buffer (for a failure's message) and which buffer each check read.
    std::vector<std::string> history(bufs.size());
    std::vector<std::size_t> checked;  // buffer of check i (the checks of this loop)
    std::size_t const first_check = chk.used;
    auto const stream_index       = [&](cudaStream_t s) {
      return std::find(st.s.begin(), st.s.end(), s) - st.s.begin();
    };
    for (int op = 0; op < 3000; ++op) {
      std::size_t const k  = rng() % bufs.size();
      auto& x              = bufs[k];
      cudaStream_t const s = st.s[rng() % 3];
      unsigned const kind  = static_cast<unsigned>(rng() % 8);
      history[k] += " | op " + std::to_string(op) + " kind " + std::to_string(kind) + " s" +
                    std::to_string(stream_index(s)) + " last s" +
                    std::to_string(stream_index(x.last)) +
                    (x.b.resident() ? " resident" : " away") + (x.held ? " held" : "");
      if (kind == 2 || kind == 3) { checked.push_back(k); }
      switch (kind) {
        case 0:
        case 1: {  // write fresh data
          make_room(x.b.bytes());
          order(x.last, s);
          std::uint32_t* p = x.b.data(cuda::stream_ref{s});
          x.seed           = rng();
          fill(p, x.b.size(), x.seed, s);
          x.last = s;
          hold(k);
          ++writes;
          break;
        }
        case 2:
        case 3: {  // read
          make_room(x.b.bytes());
          order(x.last, s);
          chk.check(x.b.data(cuda::stream_ref{s}), x.b.size(), x.seed, s);
          x.last = s;
          hold(k);
          ++reads;
          break;
        }
        case 4:
        case 5:  // page out
          order(x.last, s);
          x.b.pageout(cuda::stream_ref{s});
          x.last = s;
          if (x.held) {
            x.held = false;
            held_bytes -= x.b.bytes();
          }
          ++pageouts;
          break;
        case 6:  // prefetch
          make_room(x.b.bytes());
          x.b.need_prefetch();
          hold(k);
          ++prefetches;
          break;
        case 7:  // start or hold the prefetches
          if (rng() % 2 == 0) {
            scope.prefetch_all();
          } else {
            scope.prefetch_init();
          }
          break;
      }
    }
    scope.prefetch_all();
    INFO("writes " << writes << " reads " << reads << " pageouts " << pageouts << " prefetches "
                   << prefetches);
    auto const counts = chk.counts();
    for (std::size_t i = first_check; i < counts.size(); ++i) {
      if (counts[i] == 0) { continue; }
      std::size_t const k = checked.at(i - first_check);
      std::size_t const n = history[k].size();
      UNSCOPED_INFO("check " << i - first_check << ": buffer " << k << " (" << bufs[k].b.bytes()
                             << " bytes), " << counts[i] << " wrong words; its last ops:"
                             << history[k].substr(n > 900 ? n - 900 : 0));
    }
    CHECK(chk.wrong_checks() == 0);
    // Every buffer, once more, copied back to the host (paged in where it is not resident).
    std::size_t wrong = 0;
    for (auto& x : bufs) {
      make_room(x.b.bytes());
      cudaStream_t const s = x.last;
      wrong += wrong_on_host(x.b.data(cuda::stream_ref{s}), x.b.size(), x.seed, s);
      x.b.pageout(cuda::stream_ref{s});
      x.held = false;
      held_bytes -= std::min(held_bytes, x.b.bytes());
    }
    CHECK(wrong == 0);
    auto const stats = scope.statistics();
    CHECK(stats.pageouts > 0);
    CHECK(stats.passive_pageins > 0);
    CHECK(stats.bytes_out >= stats.bytes_in);
    CHECK(stats.peak_resident_bytes <= budget);
    CHECK(stats.device_allocations == 1);
    CHECK(stats.pinned_allocations == 1);
    CHECK(stats.out_gbps() > 0);
    CHECK(stats.in_gbps() > 0);
  }
  WM_CUDA_TRY(cudaDeviceSynchronize());
  CHECK(cudaGetLastError() == cudaSuccess);
}

TEST_CASE_METHOD(swap_fixture,
                 "swap: an access while the page-out is in flight waits for it and keeps the data",
                 "[gpu][swap]") {
  wm::swap_scope scope{small_scope(512 * mib)};
  std::size_t const words   = 64 * mib;  // 256 MiB: ~5 ms each way
  std::uint64_t const seed1 = rng();
  auto b                    = filled(scope, words, seed1, s0);
  spin(100, s0);  // the page-out is issued at once but waits for this
  REQUIRE(b.pageout(s0));
  std::this_thread::sleep_for(std::chrono::milliseconds{10});  // the worker has issued it
  std::uint32_t* p = b.data(s1);                               // passive access during the page-out
  CHECK(b.resident());
  chk.check(p, words, seed1, s1);  // after the copy, still the first data
  std::uint64_t const seed2 = rng();
  fill(p, words, seed2, s1);
  REQUIRE(b.pageout(s1));  // written again: copied again after the first
  scope.wait_pageouts();
  CHECK_FALSE(b.resident());
  p = b.data(s0);  // a passive page-in
  chk.check(p, words, seed2, s0);
  CHECK(wrong_on_host(p, words, seed2, s0) == 0);
  CHECK(chk.wrong_checks() == 0);
  auto const stats = scope.statistics();
  CHECK(stats.pageouts_cancelled >= 1);
  CHECK(stats.consumer_waits >= 1);
  CHECK(stats.consumer_wait_seconds > 0.05);  // stream 1 waited for the spin and the copy
  CHECK(stats.passive_pageins == 1);
}

TEST_CASE_METHOD(swap_fixture, "swap: pinned buffers stay resident under pressure", "[gpu][swap]") {
  std::size_t const budget = 64 * mib;
  wm::swap_scope scope{small_scope(budget)};
  auto a                 = scope.allocate<std::uint32_t>(4 * mib, s0);  // 16 MiB
  std::uint64_t const sa = rng();
  std::uint32_t* pa      = a.pin(s0);
  fill(pa, a.size(), sa, s0);
  CHECK(a.pins() == 1);
  CHECK_FALSE(a.pageout(s0));
  CHECK(a.resident());
  // 8 x 16 MiB more through the other 48 MiB of the pool: each is paged out to make room.
  std::vector<wm::swappable<std::uint32_t>> others;
  std::vector<std::uint64_t> seeds;
  for (int i = 0; i < 8; ++i) {
    seeds.push_back(rng());
    others.push_back(filled(scope, 4 * mib, seeds.back(), s0));
    REQUIRE(others.back().pageout(s0));
    CHECK(a.resident());
  }
  CHECK(a.data(s0) == pa);  // never moved
  chk.check(pa, a.size(), sa, s0);
  for (std::size_t i = 0; i < others.size(); ++i) {
    chk.check(others[i].data(s0), others[i].size(), seeds[i], s0);
    others[i].pageout(s0);
  }
  CHECK(chk.wrong_checks() == 0);
  a.unpin();
  CHECK(a.pins() == 0);
  CHECK_THROWS_AS(a.unpin(), wm::logic_error);
  REQUIRE(a.pageout(s0));
  scope.wait_pageouts();
  CHECK_FALSE(a.resident());
  CHECK(wrong_on_host(a.data(s0), a.size(), sa, s0) == 0);
  CHECK(scope.statistics().peak_resident_bytes <= budget);
}

TEST_CASE_METHOD(swap_fixture,
                 "swap: small buffers are prefetched together, in order, within the lookahead",
                 "[gpu][swap]") {
  wm::swap_scope scope{small_scope(256 * mib)};
  std::vector<wm::swappable<std::uint32_t>> bufs;
  std::vector<std::uint64_t> seeds;
  for (int i = 0; i < 64; ++i) {  // 64 x 64 KiB side by side in the pool
    seeds.push_back(rng());
    bufs.push_back(filled(scope, 16 * kib, seeds.back(), s0));
  }
  for (auto& b : bufs) { REQUIRE(b.pageout(s0)); }
  scope.wait_pageouts();
  scope.prefetch_init();
  for (auto& b : bufs) {
    CHECK_FALSE(b.resident());
    b.need_prefetch();
  }
  scope.reset_statistics();
  scope.prefetch_all();
  scope.wait_prefetches();
  auto const stats = scope.statistics();
  CHECK(stats.prefetches == 64);
  CHECK(stats.copies_in <= 2);  // one batch of 4 MiB, neighbours on both sides: one copy
  CHECK(stats.bytes_in == 64 * 64 * kib);
  for (std::size_t i = 0; i < bufs.size(); ++i) {
    CHECK(bufs[i].resident());
    chk.check(bufs[i].data(s0), bufs[i].size(), seeds[i], s0);
  }
  CHECK(chk.wrong_checks() == 0);
  CHECK(scope.statistics().device_allocations == 0);  // since the reset
  CHECK(scope.statistics().pinned_allocations == 0);
}

TEST_CASE("swap: destroying the scope with transfers in flight", "[gpu][swap]") {
  std::size_t free_before = 0, total = 0;
  WM_CUDA_TRY(cudaDeviceSynchronize());
  WM_CUDA_TRY(cudaMemGetInfo(&free_before, &total));
  streams st{2};
  auto const kind = GENERATE(0, 1, 2);
  {
    wm::swap_scope scope{small_scope(512 * mib)};
    std::vector<wm::swappable<std::uint32_t>> bufs;
    for (int i = 0; i < 24; ++i) {
      bufs.push_back(scope.allocate<std::uint32_t>(4 * mib, cuda::stream_ref{st.s[i % 2]}));
      fill(bufs.back().data(cuda::stream_ref{st.s[i % 2]}), bufs.back().size(), i, st.s[i % 2]);
    }
    if (kind == 0) {  // page-outs waiting for a busy producer
      spin(50, st.s[0]);
      for (auto& b : bufs) { b.pageout(cuda::stream_ref{st.s[0]}); }
    } else if (kind == 1) {  // prefetches in flight
      for (auto& b : bufs) { b.pageout(cuda::stream_ref{st.s[0]}); }
      scope.wait_pageouts();
      for (auto& b : bufs) { b.need_prefetch(); }
      scope.prefetch_all();
    } else {  // both directions, and a passive page-in, while the producer is busy
      for (std::size_t i = 0; i < bufs.size() / 2; ++i) {
        bufs[i].pageout(cuda::stream_ref{st.s[0]});
      }
      scope.wait_pageouts();
      spin(30, st.s[1]);
      for (std::size_t i = bufs.size() / 2; i < bufs.size(); ++i) {
        bufs[i].pageout(cuda::stream_ref{st.s[1]});
      }
      for (std::size_t i = 0; i < 4; ++i) { bufs[i].need_prefetch(); }
      scope.prefetch_all();
      (void)bufs[5].data(cuda::stream_ref{st.s[0]});
    }
    bufs.clear();  // buffers first (they must not outlive the scope), transfers still running
  }
  WM_CUDA_TRY(cudaDeviceSynchronize());
  CHECK(cudaGetLastError() == cudaSuccess);
  std::size_t free_after = 0;
  WM_CUDA_TRY(cudaMemGetInfo(&free_after, &total));
  CHECK(free_after + 64 * mib >= free_before);  // the pool went back
}

// Stream-ordered handover of pool blocks: a pool of two blocks, eight buffers, page-outs and
// passive page-ins in random order over three streams. Each new user of a block writes fresh data
// into it (poison for the buffer that left it) while the previous owner's page-out copy may still
// wait for a spin kernel: a handover without the event wait would copy the poison out.
TEST_CASE("swap: blocks change hands by events: two blocks, eight buffers, three streams",
          "[gpu][swap]") {
  std::mt19937_64 rng{std::random_device{}()};
  streams st{3};
  checker chk{1024};
  std::size_t const words = 4 * mib;  // 16 MiB each: not coalesced, each copy alone
  std::size_t const bytes = words * 4;
  wm::swap_scope scope{small_scope(2 * bytes)};
  struct buffer {
    wm::swappable<std::uint32_t> b;
    std::uint64_t seed;
    cudaStream_t last;
  };
  std::vector<buffer> bufs;
  for (int k = 0; k < 8; ++k) {
    cudaStream_t const s = st.s[static_cast<std::size_t>(k) % 3];
    // From the third on: the block of a page-out still waiting for its producer's spin.
    buffer x{scope.allocate<std::uint32_t>(words, cuda::stream_ref{s}), rng(), s};
    fill(x.b.data(cuda::stream_ref{s}), words, x.seed, s);
    spin(2, s);
    REQUIRE(x.b.pageout(cuda::stream_ref{s}));
    bufs.push_back(std::move(x));
  }
  std::vector<std::size_t> perm(bufs.size());
  std::iota(perm.begin(), perm.end(), std::size_t{0});
  for (int round = 0; round < 8; ++round) {
    // A buffer used again while its own page-out copy still runs keeps its block (the page-out
    // is cancelled, then asked for again): with two such buffers holding both blocks, a page-in
    // must wait for the GPU. Rounds start with buffers not used at the end of the last one.
    std::vector<std::size_t> const before = perm;
    do {
      std::shuffle(perm.begin(), perm.end(), rng);
    } while (round > 0 && (perm[0] == before[6] || perm[0] == before[7] || perm[1] == before[6] ||
                           perm[1] == before[7]));
    for (std::size_t const k : perm) {
      auto& x              = bufs[k];
      cudaStream_t const s = st.s[rng() % 3];
      order(x.last, s);  // the user orders one buffer's streams; the scope orders the blocks
      std::uint32_t* p = x.b.data(cuda::stream_ref{s});  // a page-in into another's block
      chk.check(p, words, x.seed, s);
      x.seed = rng();
      fill(p, words, x.seed, s);
      if (rng() % 2 == 0) { spin(1, s); }
      REQUIRE(x.b.pageout(cuda::stream_ref{s}));
      x.last = s;
    }
  }
  CHECK(chk.wrong_checks() == 0);
  std::size_t wrong = 0;
  for (auto& x : bufs) {
    order(x.last, st.s[0]);
    wrong += wrong_on_host(x.b.data(cuda::stream_ref{st.s[0]}), words, x.seed, st.s[0]);
    x.b.pageout(cuda::stream_ref{st.s[0]});
    x.last = st.s[0];
  }
  CHECK(wrong == 0);
  auto const stats = scope.statistics();
  INFO("worker waits " << stats.worker_waits << " blocks reused " << stats.blocks_reused);
  INFO("page-outs cancelled " << stats.pageouts_cancelled);
  // Every block changed hands by an event: the host waits on the GPU only when buffers written
  // again during their page-out copy hold both blocks (see above), never more often than that.
  CHECK(stats.host_blocking_syncs <= stats.pageouts_cancelled);
  CHECK(stats.blocks_reused >= 1);  // the third allocation, at least (the first spin runs)
  // Each access found its buffer on the host or leaving it: paged in, or its page-out cancelled.
  CHECK(stats.passive_pageins + stats.pageouts_cancelled >= 8 * 8 + 8);
  CHECK(stats.peak_resident_bytes <= 2 * bytes);
  CHECK(stats.device_allocations == 1);
}

TEST_CASE_METHOD(blocks_fixture<1>,
                 "swap: a released buffer's block goes to another stream after the release's work",
                 "[gpu][swap]") {
  std::uint64_t const sa = rng();
  auto a                 = filled(scope, words, sa, s0);
  spin(50, s0);
  chk.check(a.data(s0), words, sa, s0);  // runs after the spin
  a.reset();                             // released after the check, on stream 0
  // Its block: stream 1 waits the release (without the wait, b's fill would overwrite a before
  // its check).
  std::uint64_t const sb = rng();
  auto b                 = filled(scope, words, sb, s1);
  chk.check(b.data(s1), words, sb, s1);
  CHECK(chk.wrong_checks() == 0);
  auto const stats = scope.statistics();
  CHECK(stats.host_blocking_syncs == 0);
  CHECK(stats.blocks_reused == 1);
  CHECK(stats.consumer_waits >= 1);
  CHECK(stats.consumer_wait_seconds > 0.02);  // stream 1 waited for the spin
}

TEST_CASE_METHOD(
    blocks_fixture<1>,
    "swap: a prefetch takes the block of a page-out in flight (one block, two buffers)",
    "[gpu][swap]") {
  std::uint64_t const sa = rng();
  auto a                 = filled(scope, words, sa, s0);
  spin(30, s0);
  REQUIRE(a.pageout(s0));
  std::uint64_t const sb = rng();
  auto b                 = filled(scope, words, sb, s1);  // a's block, after a's page-out copy
  spin(10, s1);
  REQUIRE(b.pageout(s1));
  CHECK_FALSE(a.resident());
  scope.prefetch_init();
  a.need_prefetch();
  scope.prefetch_all();  // a's page-in takes b's block: the copy stream waits b's page-out
  // The worker issues it without waiting on the GPU (b's page-out still waits for its spin).
  wait_until([&] { return a.resident(); });
  REQUIRE(a.resident());
  std::uint32_t* pa = a.data(s0);
  chk.check(pa, words, sa, s0);
  REQUIRE(a.pageout(s0));
  std::uint32_t* pb = b.data(s1);  // b's page-in takes the block back from a's page-out
  chk.check(pb, words, sb, s1);
  CHECK(wrong_on_host(pb, words, sb, s1) == 0);
  CHECK(chk.wrong_checks() == 0);
  auto const stats = scope.statistics();
  CHECK(stats.host_blocking_syncs == 0);
  CHECK(stats.prefetches == 1);
  CHECK(stats.passive_pageins == 1);
  CHECK(stats.blocks_reused == 3);
  CHECK(stats.peak_resident_bytes <= words * 4);
}

TEST_CASE_METHOD(
    swap_fixture,
    "swap: a page-in in flight whose page-out was cancelled is waited for by the reader",
    "[gpu][swap]") {
  // x's page-in waits (on the copy stream) for a released block whose release follows a spin;
  // x is paged out again, and the page-out stays queued (one copy in flight at most, and y's
  // waits for another spin); a read of x on a stream ordered after neither cancels it and must
  // wait for the page-in, not see the block's previous contents. (On an H200 this case also
  // passed without the wait in data() that it was written for: the read was check_kernel's first
  // launch, which under lazy loading synchronized the context; load_kernels() now loads it first.)
  load_kernels();
  std::size_t const words = 4 * mib;
  wm::swap_options o      = small_scope(2 * words * 4);  // two blocks
  o.max_in_flight         = 1;
  wm::swap_scope scope{o};
  std::uint64_t const sx = rng();
  auto x                 = filled(scope, words, sx, s0);
  REQUIRE(x.pageout(s0));
  scope.wait_pageouts();
  REQUIRE_FALSE(x.resident());
  auto y = filled(scope, words, rng(), s1);          // holds the other block
  release_after_spin(scope, words, rng(), 150, s0);  // the block for x's page-in
  scope.prefetch_init();
  x.need_prefetch();
  scope.prefetch_all();  // x's page-in: issued at once, its copy waits for the spin
  wait_until([&] { return scope.statistics().prefetches != 0; });
  REQUIRE(scope.statistics().prefetches == 1);
  spin(300, s1);
  REQUIRE(y.pageout(s1));                                      // in flight, behind the second spin
  std::this_thread::sleep_for(std::chrono::milliseconds{20});  // its worker issues it
  REQUIRE(x.pageout(s1));  // queued: the one copy in flight is y's
  std::this_thread::sleep_for(std::chrono::milliseconds{5});
  auto const before = scope.statistics();
  INFO("copies out " << before.copies_out << ", in " << before.copies_in);
  REQUIRE(before.copies_out == 2);       // x's first page-out and y's: x's second one waits
  chk.check(x.data(s2), words, sx, s2);  // cancels x's page-out; s2 waits for the page-in
  CHECK(chk.wrong_checks() == 0);
  CHECK(wrong_on_host(x.data(s2), words, sx, s2) == 0);
  CHECK(scope.statistics().pageouts_cancelled >= 1);
}

TEST_CASE_METHOD(blocks_fixture<2>,
                 "swap: a page-out booked late leaves alone the buffer's newer page-out in flight",
                 "[gpu][swap]") {
  // x's page-out (out1) is held on the GPU by a spin and its block goes to y; x is paged in (after
  // out1), written anew and paged out again (out2, held by a longer spin) before the worker has
  // booked out1. Booking out1 must not act on out2: it freed x's block and said x was on the
  // host, so that a read of x paged in the slab's old contents (out1's) while out2 still waited.
  load_kernels();
  std::uint64_t const sx1 = rng();
  std::uint64_t const sx  = sx1 + 1;  // what x holds after its page-in
  std::uint64_t const sy  = rng();
  auto x                  = filled(scope, words, sx1, s0);
  spin(200, s0);
  REQUIRE(x.pageout(s0));                    // out1, after the spin
  auto w = filled(scope, words, rng(), s1);  // the other block
  auto y = filled(scope, words, sy, s1);     // x's block, after out1
  w.reset();                                 // its block goes to x's page-in
  std::uint32_t* px = x.data(s2);            // paged in after out1
  fill(px, words, sx, s2);
  spin(600, s2);
  REQUIRE(x.pageout(s2));  // out2, after the second spin
  wait_until([&] { return scope.statistics().copies_out >= 2; });
  auto const issued = scope.statistics();
  REQUIRE(issued.copies_out == 2);  // out2 is issued ...
  REQUIRE(issued.pageouts == 0);    // ... before out1 is booked (else the spin was too short)
  wait_until([&] { return scope.statistics().pageouts >= 1; });
  REQUIRE(scope.statistics().pageouts == 1);  // out1 booked; out2 still waits for its spin
  // x's page-out is cancelled: stream 3 waits for out2 (not a page-in of out1's data).
  chk.check(x.data(s3), words, sx, s3);
  CHECK(chk.wrong_checks() == 0);
  CHECK(wrong_on_host(x.data(s3), words, sx, s3) == 0);
  chk.check(y.data(s1), words, sy, s1);
  CHECK(chk.wrong_checks() == 0);
  CHECK(scope.statistics().host_blocking_syncs == 0);
}

TEST_CASE_METHOD(blocks_fixture<2>,
                 "swap: a page-in booked late leaves alone the buffer's newer page-in in flight",
                 "[gpu][swap]") {
  // x's prefetch (in1) waits for a block released after a spin; x is paged out again (out2, after
  // in1), its block goes to y, and a second prefetch (in2) waits for a block released after a
  // longer spin, all before the worker has booked in1. Booking in1 must not act on in2: it said
  // x was resident, and x's release then gave in2's block to z after x's last stream only, so
  // that in2 wrote x's data over z's.
  load_kernels();
  std::uint64_t const sx = rng();
  std::uint64_t const sy = rng();
  std::uint64_t const sz = rng();
  auto x                 = filled(scope, words, sx, s0);
  REQUIRE(x.pageout(s0));
  scope.wait_pageouts();
  REQUIRE_FALSE(x.resident());
  scope.reset_statistics();                          // wait_pageouts was a host sync
  auto w = filled(scope, words, rng(), s1);          // a block, for in2 later
  release_after_spin(scope, words, rng(), 200, s0);  // the other block, for in1
  x.need_prefetch();
  scope.prefetch_all();  // in1: into the released block, after the spin
  wait_until([&] { return scope.statistics().prefetches >= 1; });
  REQUIRE(scope.statistics().prefetches == 1);
  REQUIRE(x.pageout(s2));                 // out2: stream 2 waits for in1 first
  auto y = filled(scope, words, sy, s3);  // x's block, after out2
  spin(600, s1);
  w.reset();          // w's block, after the longer spin
  x.need_prefetch();  // in2: into w's block, after out2 and the longer spin
  wait_until([&] { return scope.statistics().prefetches >= 2; });
  auto const issued = scope.statistics();
  REQUIRE(issued.prefetches == 2);  // in2 is issued ...
  REQUIRE(issued.bytes_in == 0);    // ... before in1 is booked (else the spin was too short)
  wait_until([&] { return scope.statistics().bytes_in >= words * 4; });
  REQUIRE(scope.statistics().bytes_in == words * 4);  // in1 booked; in2 still waits
  x.reset();  // its block goes after in2 (stream 2, its last, has waited for in1 only)
  auto z = filled(scope, words, sz, s0);  // in2's block
  WM_CUDA_TRY(cudaDeviceSynchronize());   // in2 has run: it must not have written over z
  chk.check(z.data(s0), words, sz, s0);
  chk.check(y.data(s3), words, sy, s3);
  CHECK(chk.wrong_checks() == 0);
  CHECK(wrong_on_host(z.data(s0), words, sz, s0) == 0);
  CHECK(scope.statistics().host_blocking_syncs == 0);
}

TEST_CASE_METHOD(
    blocks_fixture<1>,
    "swap: pageout_begin of a buffer whose page-in still runs does not skip the reader's wait",
    "[gpu][swap]") {
  // x's prefetch waits for a block released after a spin. pageout_begin(stream 1) made stream 1
  // wait for it, but data() of a buffer being paged out that way gives the pointer to any stream
  // without a wait: a read on stream 2 saw the block's previous contents. pageout_begin now
  // declines while a page-in may still run; data() waits for it as for any page-in.
  load_kernels();
  std::uint64_t const sx = rng();
  auto x                 = filled(scope, words, sx, s0);
  REQUIRE(x.pageout(s0));
  scope.wait_pageouts();
  REQUIRE_FALSE(x.resident());
  release_after_spin(scope, words, sx + 1, 300, s0);  // the block, released after a spin
  x.need_prefetch();
  scope.prefetch_all();  // into the released block, after the spin
  wait_until([&] { return scope.statistics().prefetches >= 1; });
  REQUIRE(scope.statistics().prefetches == 1);
  REQUIRE(scope.statistics().bytes_in == 0);  // the page-in waits for the spin
  CHECK_FALSE(x.pageout_begin(s1));
  chk.check(x.data(s2), words, sx, s2);  // stream 2 is ordered after neither 0 nor 1
  CHECK(chk.wrong_checks() == 0);
  CHECK(wrong_on_host(x.data(s2), words, sx, s2) == 0);
  REQUIRE(x.pageout(s2));  // a page-out as usual
  chk.check(x.data(s1), words, sx, s1);
  CHECK(chk.wrong_checks() == 0);
}

TEST_CASE_METHOD(swap_fixture,
                 "swap: a page-out takes the slab range of a buffer whose page-in still runs",
                 "[gpu][swap]") {
  // A host that runs a step ahead of the GPU: the slab holds the previous step's page-ins until
  // their copies finish. A page-out must take such a range on the copy stream, not on the host.
  std::size_t const words = 4 * mib;
  std::size_t const bytes = words * 4;
  wm::swap_options o      = small_scope(bytes);  // one block
  o.host_bytes            = 2 * bytes;           // two slab ranges
  wm::swap_scope scope{o};
  std::uint64_t const sx = rng();
  std::uint64_t const sa = rng();
  std::uint64_t const sb = rng();
  std::uint64_t const sd = rng();
  auto x                 = filled(scope, words, sx, s0);  // stays on the host
  REQUIRE(x.pageout(s0));
  auto a = filled(scope, words, sa, s0);
  REQUIRE(a.pageout(s0));
  scope.wait_pageouts();  // both on the host: the slab is full
  REQUIRE_FALSE(a.resident());
  scope.reset_statistics();
  release_after_spin(scope, words, rng(), 100, s1);  // the block, released after a spin
  std::uint32_t* pa = a.data(s0);  // a's page-in waits on the copy stream for the spin
  chk.check(pa, words, sa, s0);
  a.reset();  // its slab range stays taken until its page-in copy has finished
  auto b = filled(scope, words, sb, s0);  // a's block, after a's check
  REQUIRE(b.pageout(s0));  // slab full: it takes a's range after a's page-in copy, on the GPU
  auto d = filled(scope, words, sd, s1);  // b's block, after b's page-out copy
  chk.check(d.data(s1), words, sd, s1);
  auto const mid = scope.statistics();
  CHECK(mid.host_blocking_syncs == 0);  // nothing above waited for the spin on the host
  CHECK(mid.host_syncs_slab == 0);
  CHECK(mid.slab_ranges_reused == 1);
  d.reset();
  std::uint32_t* pb = b.data(s0);
  chk.check(pb, words, sb, s0);
  CHECK(wrong_on_host(pb, words, sb, s0) == 0);
  b.reset();
  chk.check(x.data(s1), words, sx, s1);
  CHECK(chk.wrong_checks() == 0);
}

TEST_CASE_METHOD(
    blocks_fixture<1>,
    "swap: pageout_begin copies while the data is read; pageout frees it after the readers",
    "[gpu][swap]") {
  std::uint64_t const sa = rng();
  auto a                 = scope.allocate<std::uint32_t>(words, s0);
  std::uint32_t* pa      = a.data(s0);
  fill(pa, words, sa, s0);
  spin(20, s0);
  REQUIRE(a.pageout_begin(s0));  // the copy goes after the spin
  CHECK_FALSE(a.pageout_begin(s0));
  order(st.s[0], st.s[1]);
  CHECK(a.data(s1) == pa);  // still readable; the page-out goes on
  CHECK(a.resident());
  chk.check(pa, words, sa, s1);
  spin(30, s1);
  chk.check(pa, words, sa, s1);  // a reader well after the copy started
  REQUIRE(a.pageout(s1));        // the block goes after the copy and stream 1's readers
  CHECK_FALSE(a.resident());
  // a's block: stream 0 waits for both (without the readers' event, b's fill overwrites a under
  // them).
  std::uint64_t const sb = rng();
  auto b                 = filled(scope, words, sb, s0);
  REQUIRE(b.pageout(s0));
  std::uint32_t* pa2 = a.data(s1);  // paged in from the one copy, into b's block after b's copy
  chk.check(pa2, words, sa, s1);
  CHECK(wrong_on_host(pa2, words, sa, s1) == 0);
  CHECK(chk.wrong_checks() == 0);
  // The workers book the copies a moment after the GPU finished them.
  wait_until([&] { return scope.statistics().pageouts >= 2; }, std::chrono::milliseconds{1});
  auto const stats = scope.statistics();
  CHECK(stats.pageouts == 2);  // a once, b once: a's data was not copied again
  CHECK(stats.bytes_out == 2 * words * 4);
  CHECK(stats.pageouts_cancelled == 0);
  CHECK(stats.host_blocking_syncs == 0);
  CHECK(stats.passive_pageins == 1);
}

// ---- page-outs from caller memory, page-ins into caller memory (pageout_from / pagein_to) ----

namespace {
// Device memory that the scope does not own (what a framework's allocator hands out).
struct device_words {
  std::uint32_t* p{nullptr};
  explicit device_words(std::size_t n) { WM_CUDA_TRY(cudaMalloc(&p, n * 4)); }
  ~device_words() { (void)cudaFree(p); }
};
}  // namespace

TEST_CASE_METHOD(
    swap_fixture,
    "swap: pageout_from copies caller memory after its producer; pagein_to gives it back",
    "[gpu][swap]") {
  load_kernels();
  std::size_t const words = 64 * mib;  // 256 MiB: ~5 ms each way
  wm::swap_scope scope{small_scope(words * 4)};
  device_words src{words};
  device_words dst{words};
  std::uint64_t const s_old = rng();
  std::uint64_t const s_new = rng();
  fill(src.p, words, s_old, s0);
  WM_CUDA_TRY(cudaStreamSynchronize(st.s[0]));
  spin(100, s0);
  fill(src.p, words, s_new, s0);  // the producer: the copy must wait for it
  auto b = scope.pageout_from<std::uint32_t>(src.p, words, s0);
  CHECK(b.size() == words);
  CHECK_FALSE(b.resident());
  {
    auto const stats = scope.statistics();
    CHECK(stats.pageouts_from == 1);
    CHECK(stats.copies_out == 1);  // issued before pageout_from returned
    CHECK(stats.resident_bytes == 0);
    CHECK(stats.host_blocking_syncs == 0);
  }
  // The source is overwritten right after the call, on the producer's stream once it has waited
  // for the copy: the paged-out data stays s_new. (Without wait_pageout the fill would run right
  // after the spin, while the 5 ms copy reads.)
  b.wait_pageout(s0);
  fill(src.p, words, rng(), s0);
  // dst was in use on s1 until now: the page-in copy goes after that (else the junk fill, held
  // back by the spin, would land on the data after the copy).
  spin(50, s1);
  fill(dst.p, words, rng(), s1);
  b.pagein_to(dst.p, s1);
  b.wait_pagein(s1);
  chk.check(dst.p, words, s_new, s1);
  CHECK(wrong_on_host(dst.p, words, s_new, s1) == 0);
  CHECK_FALSE(b.resident());  // pagein_to gives the buffer no device memory
  // A second copy into other memory, read on another stream; then a page-in into the pool.
  WM_CUDA_TRY(cudaMemsetAsync(dst.p, 0, words * 4, st.s[0]));
  b.pagein_to(dst.p, s0);
  b.wait_pagein(s1);
  chk.check(dst.p, words, s_new, s1);
  std::uint32_t* const p = b.data(s1);  // a passive page-in into the pool
  chk.check(p, words, s_new, s1);
  CHECK(wrong_on_host(p, words, s_new, s1) == 0);
  // Resident now: pagein_to is a device copy on s1, which wait_pagein makes s0 wait for.
  WM_CUDA_TRY(cudaMemsetAsync(dst.p, 0, words * 4, st.s[1]));
  spin(50, s1);
  b.pagein_to(dst.p, s1);
  b.wait_pagein(s0);
  chk.check(dst.p, words, s_new, s0);
  CHECK(b.resident());
  CHECK(chk.wrong_checks() == 0);
  // The worker books the passive page-in a moment after the GPU finished it.
  wait_until([&] { return scope.statistics().bytes_in >= 3 * words * 4; },
             std::chrono::milliseconds{1});
  auto const stats = scope.statistics();
  CHECK(stats.pageins_to == 2);
  CHECK(stats.bytes_in == 3 * words * 4);
  CHECK(stats.passive_pageins == 1);
  CHECK(stats.host_blocking_syncs == 0);
  CHECK(stats.device_allocations == 1);
  CHECK(stats.pinned_allocations == 1);
}

TEST_CASE_METHOD(swap_fixture,
                 "swap: pagein_to right after pageout_from waits for the page-out copy",
                 "[gpu][swap]") {
  load_kernels();
  std::size_t const words = 16 * mib;
  wm::swap_options o      = small_scope(0);  // no pool: caller memory only
  wm::swap_scope scope{o};
  device_words src{words};
  device_words dst{words};
  std::uint64_t const sd = rng();
  fill(src.p, words, sd, s0);
  spin(100, s0);  // holds the page-out copy back
  auto b = scope.pageout_from<std::uint32_t>(src.p, words, s0);
  b.pagein_to(dst.p, s1);  // s1 is idle: without the wait on the page-out it reads the slab now
  b.wait_pagein(s1);
  chk.check(dst.p, words, sd, s1);
  CHECK(wrong_on_host(dst.p, words, sd, s1) == 0);
  CHECK(chk.wrong_checks() == 0);
  // A scope without a pool cannot page into it: an error, not a wait until the timeout.
  CHECK_THROWS_AS((void)b.data(s0), wm::logic_error);
  CHECK_THROWS_AS(b.need_prefetch(), wm::logic_error);
  CHECK_THROWS_AS((void)scope.allocate<std::uint32_t>(16, s0), wm::logic_error);
  CHECK(scope.statistics().device_allocations == 1);  // one pool of one alignment unit
}

TEST_CASE_METHOD(swap_fixture,
                 "swap: pageout_from steps reuse the slab without allocations or host syncs",
                 "[gpu][swap]") {
  std::size_t const words = mib;  // 4 MiB each
  std::size_t const n     = 6;
  wm::swap_options o      = small_scope(0);
  o.host_bytes            = 7 * words * 4;  // room for one step's buffers and one more
  wm::swap_scope scope{o};
  device_words src{words * n};
  device_words dst{words * n};
  // The workers book page-outs a moment after the GPU finished them.
  auto const booked = [&](std::uint64_t bytes) {
    wait_until([&] { return scope.statistics().bytes_out >= bytes; }, std::chrono::milliseconds{1});
  };
  for (int step = 0; step < 4; ++step) {
    if (step == 1) {
      WM_CUDA_TRY(cudaDeviceSynchronize());
      booked(n * words * 4);
      scope.reset_statistics();
    }
    std::vector<std::uint64_t> seeds(n);
    std::vector<wm::swappable<std::uint32_t>> bufs;
    for (std::size_t i = 0; i < n; ++i) {
      seeds[i] = rng();
      fill(src.p + i * words, words, seeds[i], s0);
      bufs.push_back(scope.pageout_from<std::uint32_t>(src.p + i * words, words, s0));
      bufs.back().wait_pageout(s0);  // the next step's fill overwrites the source on s0
    }
    for (std::size_t i = n; i-- > 0;) {  // backward order, as a backward pass
      bufs[i].pagein_to(dst.p + i * words, s1);
      bufs[i].wait_pagein(s1);
      chk.check(dst.p + i * words, words, seeds[i], s1);
    }
    // Slab ranges go back while their copies may still run: the next step's page-outs take them
    // stream-ordered (the host is ahead of the GPU; no wait for it).
    bufs.clear();
  }
  CHECK(chk.wrong_checks() == 0);
  booked(3 * n * words * 4);
  auto const stats = scope.statistics();
  CHECK(stats.pageouts_from == 3 * n);
  CHECK(stats.pageins_to == 3 * n);
  CHECK(stats.host_blocking_syncs == 0);
  CHECK(stats.device_allocations == 0);
  CHECK(stats.pinned_allocations == 0);
  CHECK(stats.bytes_out == 3 * n * words * 4);
}

TEST_CASE("swap: pageout_from edges: zero bytes; misaligned or null pointers; oversized buffers",
          "[gpu][swap]") {
  streams st{1};
  cuda::stream_ref const s0{st.s[0]};
  wm::swap_options o = small_scope(mib);
  o.host_bytes       = 4 * mib;
  wm::swap_scope scope{o};
  device_words mem{mib};
  // Zero elements: a valid empty buffer whose copies do nothing.
  auto z = scope.pageout_from<std::uint32_t>(nullptr, 0, s0);
  CHECK(z);
  CHECK(z.size() == 0);
  CHECK_FALSE(z.resident());
  z.wait_pageout(s0);
  z.pagein_to(nullptr, s0);
  z.wait_pagein(s0);
  auto z2 = scope.pageout_from<std::uint32_t>(mem.p, 0, s0);
  z2.pagein_to(mem.p, s0);
  WM_CUDA_TRY(cudaStreamSynchronize(st.s[0]));
  // Errors, raised before anything is queued.
  auto const* const bytes = reinterpret_cast<std::byte const*>(mem.p);
  CHECK_THROWS_AS(
      (void)scope.pageout_from(reinterpret_cast<std::uint32_t const*>(bytes + 2), 4, s0),
      wm::logic_error);
  CHECK_THROWS_AS((void)scope.pageout_from<std::uint32_t>(nullptr, 4, s0), wm::logic_error);
  CHECK_THROWS_AS((void)scope.pageout_from(mem.p, mib + 1, s0), wm::logic_error);  // > the slab
  CHECK_THROWS_AS((void)scope.pageout_from(mem.p, ~std::size_t{0} / 2, s0), wm::logic_error);
  auto b = scope.pageout_from(mem.p, 1000, s0);
  CHECK_THROWS_AS(
      b.pagein_to(reinterpret_cast<std::uint32_t*>(reinterpret_cast<std::byte*>(mem.p) + 1), s0),
      wm::logic_error);
  CHECK_THROWS_AS(b.pagein_to(nullptr, s0), wm::logic_error);
  auto const stats = scope.statistics();
  CHECK(stats.pageouts_from == 3);
  CHECK(stats.host_bytes_in_use == 2 * 256 + 4096);  // 0, 0 and 4000 bytes, in 256-byte units
}

TEST_CASE_METHOD(swap_fixture,
                 "swap: copy streams given in swap_options are used and outlive the scope",
                 "[gpu][swap]") {
  load_kernels();
  std::size_t const words = 4 * mib;
  device_words src{words};
  device_words dst{words};
  std::uint64_t const sd = rng();
  {
    wm::swap_options o = small_scope(0);
    o.pageout_stream   = st.s[1];  // st.s[1], st.s[2]: the scope's copy streams
    o.pagein_stream    = st.s[2];
    wm::swap_scope scope{o};
    CHECK(scope.pageout_stream() == st.s[1]);
    CHECK(scope.pagein_stream() == st.s[2]);
    fill(src.p, words, sd, s0);
    spin(50, s0);  // the page-out on st.s[1] must wait for this, not run at once
    auto b = scope.pageout_from<std::uint32_t>(src.p, words, s0);
    b.pagein_to(dst.p, s0);
    b.wait_pagein(s0);
    chk.check(dst.p, words, sd, s0);
    CHECK(wrong_on_host(dst.p, words, sd, s0) == 0);
    CHECK(chk.wrong_checks() == 0);
  }
  // Not destroyed with the scope: work can still be queued on them.
  cudaEvent_t ev{};
  WM_CUDA_TRY(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  for (int i = 1; i < 3; ++i) {
    CHECK(cudaEventRecord(ev, st.s[i]) == cudaSuccess);
    CHECK(cudaStreamSynchronize(st.s[i]) == cudaSuccess);
  }
  WM_CUDA_TRY(cudaEventDestroy(ev));
  wm::swap_options bad = small_scope(0);
  bad.pageout_stream   = st.s[1];  // one without the other
  CHECK_THROWS_AS(wm::swap_scope{bad}, wm::logic_error);
  bad.pagein_stream = st.s[1];  // the same stream twice
  CHECK_THROWS_AS(wm::swap_scope{bad}, wm::logic_error);
}

// ---- wm::zero_codec (issue 22): a bitmask plus the nonzero elements --------------------------

static_assert(wm::zero_codec<std::uint16_t>::mask_bytes(0) == 0);
static_assert(wm::zero_codec<std::uint16_t>::mask_bytes(1) == 16);
static_assert(wm::zero_codec<std::uint16_t>::mask_bytes(128) == 16);
static_assert(wm::zero_codec<std::uint16_t>::mask_bytes(129) == 32);
static_assert(wm::zero_codec<std::uint8_t>::mask_bytes(1025) == 144);
static_assert(wm::zero_codec<std::uint16_t>::encoded_bytes(1024, 10) == 128 + 20);
static_assert(wm::zero_codec<std::uint64_t>::max_encoded_bytes(33) == 16 + 33 * 8);
static_assert(wm::zero_codec<std::uint32_t>::encoded_bytes(0, 0) == 0);

namespace {

// Memory of @p bytes (at least 1) from @p Alloc, given back by @p Free at scope exit.
template <cudaError_t (*Alloc)(void**, std::size_t), cudaError_t (*Free)(void*)>
struct cuda_bytes {
  std::byte* p{nullptr};
  explicit cuda_bytes(std::size_t bytes) {
    WM_CUDA_TRY(Alloc(reinterpret_cast<void**>(&p), std::max<std::size_t>(bytes, 1)));
  }
  cuda_bytes(cuda_bytes const&)            = delete;
  cuda_bytes& operator=(cuda_bytes const&) = delete;
  ~cuda_bytes() { (void)Free(p); }
};

using device_bytes = cuda_bytes<cudaMalloc, cudaFree>;
using pinned_bytes = cuda_bytes<cudaMallocHost, cudaFreeHost>;

constexpr std::uint64_t poison64 = 0xdeadbeefcafef00dull;

// Transcribed from the documented layout: ceil(n/32) little-endian uint32 words (bit j of word w
// set iff element 32w+j is not all zero bits), zero bytes up to a multiple of 16, then the
// nonzero elements in order.
template <class Word>
std::vector<std::byte> reference_encode(std::vector<Word> const& x, std::size_t& nonzeros) {
  std::size_t const n     = x.size();
  std::size_t const words = (n + 31) / 32;
  std::size_t const mask  = (words * 4 + 15) / 16 * 16;
  std::vector<std::uint32_t> bits(words, 0);
  std::vector<Word> values;
  for (std::size_t i = 0; i < n; ++i) {
    if (x[i] != 0) {
      bits[i / 32] |= std::uint32_t{1} << (i % 32);
      values.push_back(x[i]);
    }
  }
  std::vector<std::byte> out(mask + values.size() * sizeof(Word), std::byte{0});
  for (std::size_t w = 0; w < words; ++w) {
    for (std::size_t b = 0; b < 4; ++b) {
      out[4 * w + b] = static_cast<std::byte>((bits[w] >> (8 * b)) & 0xffu);
    }
  }
  for (std::size_t k = 0; k < values.size(); ++k) {  // little-endian elements
    for (std::size_t b = 0; b < sizeof(Word); ++b) {
      out[mask + k * sizeof(Word) + b] =
          static_cast<std::byte>((static_cast<std::uint64_t>(values[k]) >> (8 * b)) & 0xffu);
    }
  }
  nonzeros = values.size();
  return out;
}

// n random elements, a fraction @p zeros of them 0, the others nonzero bit patterns, among them
// -0.0 (the sign bit alone) and NaNs where the width has them.
template <class Word>
std::vector<Word> codec_data(std::size_t n, double zeros, std::mt19937_64& rng) {
  std::bernoulli_distribution is_zero{zeros};
  std::vector<Word> x(n);
  for (auto& v : x) {
    if (is_zero(rng)) {
      v = 0;
    } else {
      do { v = static_cast<Word>(rng()); } while (v == 0);
    }
  }
  std::vector<std::uint64_t> special;
  if constexpr (sizeof(Word) == 1) { special = {0x80, 0x01}; }
  if constexpr (sizeof(Word) == 2) { special = {0x8000, 0x7fc0, 0xffc1, 0x7e00, 0xfe01}; }
  if constexpr (sizeof(Word) == 4) { special = {0x80000000u, 0x7fc00000u, 0xffc00001u}; }
  if constexpr (sizeof(Word) == 8) { special = {0x8000000000000000ull, 0x7ff8000000000000ull}; }
  if (n > 0) {
    std::uniform_int_distribution<std::size_t> at{0, n - 1};
    for (int k = 0; k < 8; ++k) {
      for (auto sp : special) {
        std::size_t const i = at(rng);
        if (x[i] != 0) { x[i] = static_cast<Word>(sp); }
      }
    }
  }
  return x;
}

// Index of the first byte where a and b differ (a.size() when none).
std::size_t first_difference(std::byte const* a, std::byte const* b, std::size_t n) {
  return static_cast<std::size_t>(std::mismatch(a, a + n, b).first - a);
}

// Encode x on the GPU (src at @p offset elements past a 256-byte boundary: offset 1 takes the
// element-wise path), compare with the reference byte for byte, decode into poisoned memory.
template <class Word>
void codec_round_trip(std::vector<Word> const& x, std::size_t offset, bool pinned_count,
                      cudaStream_t s) {
  using codec         = wm::zero_codec<Word>;
  std::size_t const n = x.size();
  INFO("n = " << n << ", offset = " << offset << ", pinned count = " << pinned_count);
  std::size_t nz_ref = 0;
  auto const ref     = reference_encode(x, nz_ref);
  REQUIRE(ref.size() == codec::encoded_bytes(n, nz_ref));
  std::size_t const guard     = 4096;  // elements of poison past dst[n - 1], bytes past dst
  std::size_t const enc_bytes = codec::max_encoded_bytes(n) + guard;
  std::size_t const sb        = codec::scratch_bytes(n);
  device_bytes src{(n + offset) * sizeof(Word)};
  device_bytes enc{enc_bytes};
  device_bytes dst{(n + offset + guard) * sizeof(Word)};
  device_bytes scratch{sb + 8};  // given at an 8-byte offset: any alignment works
  device_bytes nz_dev{8};
  pinned_bytes nz_host{8};
  auto* const src_w = reinterpret_cast<Word*>(src.p) + offset;
  auto* const dst_w = reinterpret_cast<Word*>(dst.p) + offset;
  auto* const nz    = reinterpret_cast<std::uint64_t*>(pinned_count ? nz_host.p : nz_dev.p);
  if (n > 0) {
    WM_CUDA_TRY(cudaMemcpyAsync(src_w, x.data(), n * sizeof(Word), cudaMemcpyHostToDevice, s));
  }
  WM_CUDA_TRY(cudaMemsetAsync(enc.p, 0xFF, enc_bytes, s));
  WM_CUDA_TRY(cudaMemsetAsync(dst.p, 0xFF, (n + offset + guard) * sizeof(Word), s));
  WM_CUDA_TRY(cudaMemcpyAsync(nz_dev.p, &poison64, 8, cudaMemcpyHostToDevice, s));
  WM_CUDA_TRY(cudaStreamSynchronize(s));
  std::memcpy(nz_host.p, &poison64, 8);

  codec::encode(src_w, n, enc.p, nz, scratch.p + 8, sb, s);
  codec::decode(enc.p, n, dst_w, scratch.p + 8, sb, s);

  std::vector<std::byte> enc_h(enc_bytes);
  std::vector<std::byte> dst_h((n + offset + guard) * sizeof(Word));
  std::uint64_t nz_h = 0;
  WM_CUDA_TRY(cudaMemcpyAsync(enc_h.data(), enc.p, enc_bytes, cudaMemcpyDeviceToHost, s));
  WM_CUDA_TRY(cudaMemcpyAsync(dst_h.data(), dst.p, dst_h.size(), cudaMemcpyDeviceToHost, s));
  if (!pinned_count) {
    WM_CUDA_TRY(cudaMemcpyAsync(&nz_h, nz_dev.p, 8, cudaMemcpyDeviceToHost, s));
  }
  WM_CUDA_TRY(cudaStreamSynchronize(s));
  if (pinned_count) { std::memcpy(&nz_h, nz_host.p, 8); }

  CHECK(nz_h == nz_ref);
  CHECK(first_difference(enc_h.data(), ref.data(), ref.size()) == ref.size());
  CHECK(std::all_of(enc_h.begin() + static_cast<std::ptrdiff_t>(ref.size()), enc_h.end(),
                    [](std::byte b) { return b == std::byte{0xFF}; }));  // nothing past it
  std::size_t const lead = offset * sizeof(Word);
  std::size_t const body = n * sizeof(Word);
  CHECK(std::all_of(dst_h.begin(), dst_h.begin() + static_cast<std::ptrdiff_t>(lead),
                    [](std::byte b) { return b == std::byte{0xFF}; }));
  CHECK(first_difference(dst_h.data() + lead, reinterpret_cast<std::byte const*>(x.data()), body) ==
        body);
  CHECK(std::all_of(dst_h.begin() + static_cast<std::ptrdiff_t>(lead + body), dst_h.end(),
                    [](std::byte b) { return b == std::byte{0xFF}; }));
}

}  // namespace

TEMPLATE_TEST_CASE("zero_codec: encode matches the layout byte for byte, decode restores the bits",
                   "[gpu][codec]", std::uint8_t, std::uint16_t, std::uint32_t, std::uint64_t) {
  std::mt19937_64 rng{std::random_device{}()};
  streams st{1};
  double const zeros       = GENERATE(0.0, 0.5, 0.9, 1.0);
  std::size_t const offset = GENERATE(std::size_t{0}, std::size_t{1});
  INFO("zero fraction = " << zeros);
  std::vector<std::size_t> sizes{0, 1, 31, 32, 33, 1023, 1024, 1025, 4095, 4096, 4097, 8193};
  std::uniform_int_distribution<std::size_t> any{1, 5'000'000};
  for (int k = 0; k < 3; ++k) { sizes.push_back(any(rng)); }
  bool pinned = false;
  for (std::size_t const n : sizes) {
    codec_round_trip(codec_data<TestType>(n, zeros, rng), offset, pinned, st.s[0]);
    pinned = !pinned;  // device and pinned host counts, alternately
  }
}

TEST_CASE("zero_codec: n = 0 writes only the count; bad arguments throw", "[gpu][codec]") {
  using codec = wm::zero_codec<std::uint16_t>;
  streams st{1};
  cuda::stream_ref const s{st.s[0]};
  std::size_t const n  = 5000;
  std::size_t const sb = codec::scratch_bytes(n);
  CHECK(codec::scratch_bytes(0) == 0);
  CHECK(sb > 0);
  CHECK(sb <= 256 + 2 * 256 + (std::size_t{1} << 20));
  device_bytes src{n * 2 + 16};
  device_bytes enc{codec::max_encoded_bytes(n) + 16};
  device_bytes scratch{sb};
  pinned_bytes nz_host{8};
  auto* const nz  = reinterpret_cast<std::uint64_t*>(nz_host.p);
  auto* const x   = reinterpret_cast<std::uint16_t*>(src.p);
  auto* const out = reinterpret_cast<std::uint16_t*>(src.p);

  std::memcpy(nz_host.p, &poison64, 8);
  codec::encode(nullptr, 0, nullptr, nz, nullptr, 0, s);
  codec::decode(nullptr, 0, nullptr, nullptr, 0, s);
  WM_CUDA_TRY(cudaStreamSynchronize(st.s[0]));
  std::uint64_t nz_h = 1;
  std::memcpy(&nz_h, nz_host.p, 8);
  CHECK(nz_h == 0);

  CHECK_THROWS_AS(codec::encode(nullptr, n, enc.p, nz, scratch.p, sb, s), wm::logic_error);
  CHECK_THROWS_AS(codec::encode(x, n, nullptr, nz, scratch.p, sb, s), wm::logic_error);
  CHECK_THROWS_AS(codec::encode(x, n, enc.p, nullptr, scratch.p, sb, s), wm::logic_error);
  CHECK_THROWS_AS(codec::encode(x, n, enc.p + 8, nz, scratch.p, sb, s), wm::logic_error);
  CHECK_THROWS_AS(codec::encode(reinterpret_cast<std::uint16_t const*>(src.p + 1), n, enc.p, nz,
                                scratch.p, sb, s),
                  wm::logic_error);
  CHECK_THROWS_AS(codec::encode(x, n, enc.p, nz, nullptr, sb, s), wm::logic_error);
  CHECK_THROWS_AS(codec::encode(x, n, enc.p, nz, scratch.p, sb - 1, s), wm::logic_error);
  std::string what;
  try {
    codec::encode(x, n, enc.p, nz, scratch.p, sb - 1, s);
  } catch (wm::logic_error const& e) { what = e.what(); }
  INFO(what);
  CHECK(what.find(std::to_string(sb)) != std::string::npos);  // names the size needed

  CHECK_THROWS_AS(codec::decode(nullptr, n, out, scratch.p, sb, s), wm::logic_error);
  CHECK_THROWS_AS(codec::decode(enc.p, n, nullptr, scratch.p, sb, s), wm::logic_error);
  CHECK_THROWS_AS(codec::decode(enc.p + 8, n, out, scratch.p, sb, s), wm::logic_error);
  CHECK_THROWS_AS(
      codec::decode(enc.p, n, reinterpret_cast<std::uint16_t*>(src.p + 1), scratch.p, sb, s),
      wm::logic_error);
  CHECK_THROWS_AS(codec::decode(enc.p, n, out, scratch.p, sb / 2, s), wm::logic_error);
  WM_CUDA_TRY(cudaStreamSynchronize(st.s[0]));
  std::memcpy(&nz_h, nz_host.p, 8);
  CHECK(nz_h == 0);  // nothing was enqueued by the failed calls
}

namespace {

__host__ __device__ inline std::uint64_t mix64(std::uint64_t z) {
  z ^= z >> 31;
  z *= 0x94d049bb133111ebull;
  z ^= z >> 29;
  z *= 0xbf58476d1ce4e5b9ull;
  return z ^ (z >> 32);
}

// About half zeros, the other half random nonzero patterns.
template <class Word>
__global__ void codec_fill_kernel(Word* p, std::size_t n, std::uint64_t seed) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    std::uint64_t const h = mix64(i * 0x9E3779B97F4A7C15ull + seed);
    Word v                = static_cast<Word>(h >> 8);
    if (v == 0) { v = static_cast<Word>(0x80); }
    p[i] = (h & 1) != 0 ? v : Word{0};
  }
}

template <class Word>
__global__ void codec_count_kernel(Word const* p, std::size_t n, unsigned long long* count) {
  unsigned long long c = 0;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    c += p[i] != 0 ? 1 : 0;
  }
  atomicAdd(count, c);
}

template <class Word>
__global__ void codec_mismatch_kernel(Word const* a, Word const* b, std::size_t n,
                                      unsigned long long* bad) {
  unsigned long long c = 0;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    c += a[i] != b[i] ? 1 : 0;
  }
  atomicAdd(bad, c);
}

// n elements, half zeros: nonzeros against an independent count, decode == src, both on the
// GPU; the poison past dst[n - 1] stays. Prints the encode and decode times of a second run.
template <class Word>
void codec_large(std::size_t n) {
  using codec = wm::zero_codec<Word>;
  INFO("sizeof(Word) = " << sizeof(Word) << ", n = " << n);
  std::size_t const guard  = 4096;
  std::size_t const sb     = codec::scratch_bytes(n);
  std::size_t const needed = n * sizeof(Word) * 2 + guard + codec::max_encoded_bytes(n) + sb;
  std::size_t free_b = 0, total_b = 0;
  WM_CUDA_TRY(cudaMemGetInfo(&free_b, &total_b));
  if (free_b < needed + (std::size_t{1} << 29)) {
    WARN("zero_codec large case skipped: needs " << needed << " bytes, " << free_b << " free");
    return;
  }
  CHECK(sb <= n / 256 + (std::size_t{64} << 20));  // small: per-tile numbers + CUB's room
  streams st{1};
  cudaStream_t const s = st.s[0];
  std::mt19937_64 rng{std::random_device{}()};
  device_bytes src{n * sizeof(Word)};
  device_bytes enc{codec::max_encoded_bytes(n)};
  device_bytes dst{n * sizeof(Word) + guard};
  device_bytes scratch{sb};
  device_bytes counters{3 * 8};  // nonzeros (codec), nonzeros (count kernel), mismatches
  auto* const cnt  = reinterpret_cast<unsigned long long*>(counters.p);
  auto* const nz   = reinterpret_cast<std::uint64_t*>(counters.p);
  auto* const x    = reinterpret_cast<Word*>(src.p);
  auto* const y    = reinterpret_cast<Word*>(dst.p);
  int const blocks = 2048;
  codec_fill_kernel<Word><<<blocks, 256, 0, s>>>(x, n, rng());
  WM_CHECK_LAUNCH();
  WM_CUDA_TRY(cudaMemsetAsync(counters.p, 0, 3 * 8, s));
  WM_CUDA_TRY(cudaMemsetAsync(dst.p, 0xFF, n * sizeof(Word) + guard, s));
  codec_count_kernel<Word><<<blocks, 256, 0, s>>>(x, n, cnt + 1);
  WM_CHECK_LAUNCH();

  codec::encode(x, n, enc.p, nz, scratch.p, sb, s);
  codec::decode(enc.p, n, y, scratch.p, sb, s);
  codec_mismatch_kernel<Word><<<blocks, 256, 0, s>>>(x, y, n, cnt + 2);
  WM_CHECK_LAUNCH();
  std::vector<unsigned long long> h(3);
  std::vector<std::byte> tail(guard);
  WM_CUDA_TRY(cudaMemcpyAsync(h.data(), counters.p, 3 * 8, cudaMemcpyDeviceToHost, s));
  WM_CUDA_TRY(
      cudaMemcpyAsync(tail.data(), dst.p + n * sizeof(Word), guard, cudaMemcpyDeviceToHost, s));
  WM_CUDA_TRY(cudaStreamSynchronize(s));
  CHECK(h[1] > n / 2 - n / 100);
  CHECK(h[1] < n / 2 + n / 100);
  CHECK(h[0] == h[1]);
  CHECK(h[2] == 0);
  CHECK(std::all_of(tail.begin(), tail.end(), [](std::byte b) { return b == std::byte{0xFF}; }));

  // Timing of a second run (information for bench/NOTES.md, not a check).
  cudaEvent_t ev[3];
  for (auto& e : ev) { WM_CUDA_TRY(cudaEventCreate(&e)); }
  WM_CUDA_TRY(cudaEventRecord(ev[0], s));
  codec::encode(x, n, enc.p, nz, scratch.p, sb, s);
  WM_CUDA_TRY(cudaEventRecord(ev[1], s));
  codec::decode(enc.p, n, y, scratch.p, sb, s);
  WM_CUDA_TRY(cudaEventRecord(ev[2], s));
  WM_CUDA_TRY(cudaEventSynchronize(ev[2]));
  float enc_ms = 0, dec_ms = 0;
  WM_CUDA_TRY(cudaEventElapsedTime(&enc_ms, ev[0], ev[1]));
  WM_CUDA_TRY(cudaEventElapsedTime(&dec_ms, ev[1], ev[2]));
  for (auto e : ev) { WM_CUDA_TRY(cudaEventDestroy(e)); }
  double const gb = static_cast<double>(n * sizeof(Word)) / 1e9;
  std::printf(
      "zero_codec<uint%zu> n=%zu (half zeros): encode %.2f ms (%.0f GB/s of input), "
      "decode %.2f ms (%.0f GB/s of output)\n",
      sizeof(Word) * 8, n, static_cast<double>(enc_ms), gb / enc_ms * 1e3,
      static_cast<double>(dec_ms), gb / dec_ms * 1e3);
}

}  // namespace

TEST_CASE("zero_codec: 2^32 + 4133 bytes and 2^31 + 77 halves, checked on the GPU",
          "[gpu][codec][large]") {
  SECTION("uint8, n = 2^32 + 4133") {
    codec_large<std::uint8_t>((std::size_t{1} << 32) + 4133);
  }
  SECTION("uint16, n = 2^31 + 77") {
    codec_large<std::uint16_t>((std::size_t{1} << 31) + 77);
  }
  SECTION("uint16, n = 2^27 (256 MiB)") {
    codec_large<std::uint16_t>(std::size_t{1} << 27);
  }
}
