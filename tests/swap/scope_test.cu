// SPDX-License-Identifier: Apache-2.0
// GPU tests of wm::swap_scope and wm::swappable on one GPU (the swap_test program): random
// sequences of writes, page-outs, prefetches and reads from several streams over buffers whose
// total exceeds the device budget (every read sees the last write: a check kernel and a copy back
// to the host, fresh random data each write); a passive access while a page-out is in flight;
// pinned buffers stay resident; small buffers travel together; the scope is destroyed with
// transfers in flight, or with a copy that never completes (given up at the timeout); statistics.
// Page-outs from caller memory and page-ins into caller memory (pageout_from / pagein_to)
// ordered after their producers and consumers, slab reuse without
// allocations or host syncs, their edge cases and errors, copy streams given in swap_options. A
// timeout of milliseconds::max() (no limit), sizes that cannot be rounded or exceed the pool, a
// full host slab named at once; and, run alone, a copy whose event reports an error.
#include <wm/swap.cuh>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "catch.hpp"
#include "swap_common.cuh"

using namespace swap_tests;

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

// A copy that never completes (its producer spins until the test lets it go) does not hang the
// scope's destructor: past swap_options::timeout it abandons the copy (a line on stderr; the pool
// and the slab the copy may still use are left allocated) and returns. Before, destroy() closed
// the page-out queue, whose worker ends only once every copy in flight has completed, and then
// synchronized the copy streams, all without a deadline.
TEST_CASE("swap: destroying the scope gives up on a copy that never completes", "[gpu][swap]") {
  load_kernels();
  streams st{1};
  cuda::stream_ref const s0{st.s[0]};
  gate g;
  wm::swap_options o = small_scope(4 * mib);
  o.host_bytes       = 4 * mib;
  o.timeout          = std::chrono::milliseconds{2'000};
  auto scope         = std::make_unique<wm::swap_scope>(o);
  {
    auto b = filled(*scope, mib / 4, 1, s0);
    g.hold(s0);              // the buffer's producer never finishes while the test runs
    REQUIRE(b.pageout(s0));  // its copy waits for the spin
    wait_until([&] { return scope->statistics().copies_out > 0; });
    REQUIRE(scope->statistics().copies_out == 1);  // issued: in flight behind the spin
  }  // released with its copy in flight: the scope frees its memory once the copy is done
  std::promise<void> done;
  auto destroyed = done.get_future();
  auto const t0  = std::chrono::steady_clock::now();
  std::thread destroyer{[&] {
    scope.reset();
    done.set_value();
  }};
  // The timeout and a slack for the polls and the teardown's CUDA calls.
  bool const returned = destroyed.wait_for(std::chrono::seconds{10}) == std::future_status::ready;
  auto const took     = std::chrono::steady_clock::now() - t0;
  g.release();  // the spin ends; the copy completes (into the slab left allocated)
  destroyer.join();
  WM_CUDA_TRY(cudaDeviceSynchronize());
  CHECK(returned);
  CHECK(took >= std::chrono::milliseconds{1'900});  // it waited for the copy until the deadline
  CHECK(cudaGetLastError() == cudaSuccess);
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

// swap_options::timeout = milliseconds::max() means no limit: every wait of the scope gets a
// deadline at the clock's end (t0 + max() would wrap into the past and fail every wait at once).
TEST_CASE_METHOD(swap_fixture, "swap: a timeout of milliseconds::max() means no limit",
                 "[gpu][swap]") {
  load_kernels();
  std::size_t const words = mib;  // 4 MiB buffers; the pool holds one
  wm::swap_options o      = small_scope(words * 4);
  o.timeout               = std::chrono::milliseconds::max();
  wm::swap_scope scope{o};
  device_words src{words};
  device_words dst{words};
  std::uint64_t const sd = rng();
  fill(src.p, words, sd, s0);
  // pageout_from waits for its worker to issue the copy.
  auto b = scope.pageout_from<std::uint32_t>(src.p, words, s0);
  CHECK(b);
  b.wait_pageout(s0);
  b.pagein_to(dst.p, s0);
  b.wait_pagein(s0);
  CHECK(wrong_on_host(dst.p, words, sd, s0) == 0);
  // allocate waits for room in the pool (a page-out frees the one block); data() of a paged-out
  // buffer waits for its page-in to be issued; the drains wait for the queues.
  std::uint64_t const sa = rng();
  std::uint64_t const sc = rng();
  auto a                 = filled(scope, words, sa, s0);
  CHECK(a.pageout(s0));
  auto c = filled(scope, words, sc, s1);
  scope.wait_pageouts();
  c.reset();
  chk.check(a.data(s0), words, sa, s0);
  scope.prefetch_init();
  scope.prefetch_all();
  scope.wait_prefetches();
  CHECK(chk.wrong_checks() == 0);
  CHECK(scope.options().timeout == std::chrono::milliseconds::max());
}

// A size that rounds past the largest size_t (2^64 - 11 bytes) is refused: rounded with
// wrap-around it would be 0 bytes, fit anything and alias the next buffer. So is a buffer larger
// than the whole pool while page-outs are in flight (no page-out can make room for it).
TEST_CASE("swap: impossible sizes are refused at once, not wrapped or waited for", "[gpu][swap]") {
  streams st{1};
  cuda::stream_ref const s0{st.s[0]};
  wm::swap_options o = small_scope(4 * mib);
  o.host_bytes       = 4 * mib;
  o.timeout          = std::chrono::milliseconds{20'000};
  wm::swap_scope scope{o};
  device_words mem{mib};
  std::size_t const huge  = ~std::size_t{0} - 10;
  auto const* const bytes = reinterpret_cast<std::byte const*>(mem.p);
  auto const t0           = std::chrono::steady_clock::now();
  CHECK_THROWS_AS((void)scope.pageout_from(bytes, huge, s0), wm::logic_error);
  CHECK_THROWS_AS((void)scope.allocate<std::byte>(huge, s0), wm::logic_error);
  auto a = scope.allocate<std::byte>(mib, s0);
  CHECK(a.pageout(s0));  // a page-out queued or in flight: a wait could free a block
  CHECK_THROWS_AS((void)scope.allocate<std::byte>(4 * mib + 1, s0), wm::logic_error);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds{10});
  // Nothing was handed out for them: two new buffers do not alias each other.
  scope.wait_pageouts();
  auto x = scope.allocate<std::byte>(256, s0);
  auto y = scope.allocate<std::byte>(256, s0);
  CHECK(x.data(s0) != y.data(s0));
  auto const stats = scope.statistics();
  CHECK(stats.resident_bytes == 512);
  CHECK(stats.host_bytes_in_use == mib);  // a's range only
}

// A page-out from caller memory that finds the slab full of live buffers (no copy in flight
// frees a range: only a release would) fails at once and names the slab, its size and the bytes
// asked for; before, it waited the whole timeout and blamed the worker.
TEST_CASE("swap: a full host slab is named at once, with its size and the request", "[gpu][swap]") {
  streams st{1};
  cuda::stream_ref const s0{st.s[0]};
  wm::swap_options o = small_scope(4 * mib);
  o.host_bytes       = mib;
  o.timeout          = std::chrono::milliseconds{20'000};
  wm::swap_scope scope{o};
  device_words mem{mib};
  auto a        = scope.pageout_from(mem.p, mib / 4, s0);  // the whole slab, for a's life
  auto const t0 = std::chrono::steady_clock::now();
  try {
    (void)scope.pageout_from(mem.p, 1000, s0);
    FAIL("pageout_from into a full slab did not throw");
  } catch (wm::logic_error const& e) {
    std::string const what = e.what();
    CHECK(what.find("host slab") != std::string::npos);
    CHECK(what.find("4000 bytes asked for") != std::string::npos);
    CHECK(what.find("of " + std::to_string(mib) + " bytes in use") != std::string::npos);
  }
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds{5});
  // Released, the range is free again and the next page-out goes.
  a.reset();
  auto b = scope.pageout_from(mem.p, 1000, s0);
  CHECK(b);
  b.wait_pageout(s0);
  CHECK(scope.statistics().host_bytes_in_use == 4096);
}

namespace {
__global__ void fault_kernel() {
  __trap();
}
}  // namespace

// A copy whose end event reports an error has failed, not completed: the worker's poll throws and
// the next drain reports it (before, the page-out was booked as done and the drain returned).
// Hidden, and tagged apart from [gpu]: the fault is sticky, every later CUDA call of the process
// fails, so it runs alone: swap_test "[swap_sticky]".
TEST_CASE("swap: a copy whose event reports an error fails the drain", "[.][swap_sticky]") {
  streams st{1};
  cuda::stream_ref const s0{st.s[0]};
  wm::swap_scope scope{small_scope(16 * mib)};
  load_kernels();
  auto a = filled(scope, mib, 1, s0);
  spin(200, s0);  // the fault comes after the page-out's copy is enqueued behind it
  fault_kernel<<<1, 1, 0, st.s[0]>>>();
  REQUIRE(a.pageout(s0));
  CHECK_THROWS_AS(scope.wait_pageouts(), wm::cuda_error);
}
