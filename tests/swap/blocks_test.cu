// SPDX-License-Identifier: Apache-2.0
// GPU tests of wm::swap_scope on one GPU (the swap_test program): pool blocks handed over
// stream-ordered (page-outs in flight, released buffers, prefetches) with no host-blocking sync;
// page-outs and page-ins booked late leave a buffer's newer transfer alone; pageout_begin beside
// a page-in in flight and beside readers; slab ranges taken on the copy stream.
#include <wm/swap.cuh>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "catch.hpp"
#include "swap_common.cuh"

using namespace swap_tests;

namespace {

// A swap_fixture whose scope's pool holds @p Blocks buffers of @c words (16 MiB: each buffer a
// block of its own, not coalesced, each copy alone).
template <std::size_t Blocks>
struct blocks_fixture : swap_fixture {
  std::size_t const words = 4 * mib;
  wm::swap_scope scope{small_scope(Blocks * words * 4)};
};

// Takes a block of @p scope for @p words, writes it on @p s with the pattern of @p seed and
// releases it after a spin of @p ms there: the block's next user waits for the spin.
void release_after_spin(wm::swap_scope& scope, std::size_t words, std::uint64_t seed,
                        std::uint64_t ms, cuda::stream_ref s) {
  auto const b = filled(scope, words, seed, s);
  spin(ms, s);
}

}  // namespace

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
