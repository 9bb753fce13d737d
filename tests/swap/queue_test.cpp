// SPDX-License-Identifier: Apache-2.0
// Host tests of wm::transfer_queue (driven by a fake copier) and of the range allocator behind a
// swap scope's host slab and device pool: queue order (passive at the front, prefetch at the
// back), erase, wait against wait_and_stop, deadlines, many producer threads, coalescing of small
// tasks, the in-flight and lookahead limits, deferred tasks, close with copies in flight, a poll
// that throws; the allocator's sizes that cannot be rounded.
#include <wm/detail/base/range_allocator.hpp>
#include <wm/transfer_queue.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "catch.hpp"

namespace {

using namespace std::chrono_literals;
using clock_type          = std::chrono::steady_clock;
constexpr std::size_t mib = std::size_t{1} << 20;

auto deadline(std::chrono::milliseconds ms = 5000ms) {
  return clock_type::now() + ms;
}

// Polls @p pred for up to 5 s.
template <class P>
bool eventually(P pred) {
  auto const end = clock_type::now() + 5s;
  while (clock_type::now() < end) {
    if (pred()) { return true; }
    std::this_thread::sleep_for(1ms);
  }
  return pred();
}

// What a fake copier remembers of a started task.
struct transfer_task_copy {
  std::uint64_t id;
  std::size_t bytes;
  bool passive;
};

// A copier that records what it was given. Tickets finish at once (auto_finish) or when the test
// says; a budget defers tasks that do not fit (freed by the test); ids in `drop` are dropped; a
// gate can hold submit until the test opens it.
struct fake_copier {
  using ticket_type = std::uint64_t;

  std::mutex m;
  std::condition_variable gate_cv;
  bool gate_open{true};
  std::atomic<int> in_submit{0};
  bool auto_finish{true};
  std::size_t budget{~std::size_t{0}};
  std::size_t used{0};
  std::set<std::uint64_t> drop;
  std::vector<std::vector<transfer_task_copy>> batches;  // started tasks of each ticket
  std::set<ticket_type> finished;
  std::vector<std::uint64_t> completed;  // ids, in completion order
  ticket_type next{0};

  std::optional<ticket_type> submit(std::span<wm::transfer_task> batch) {
    ++in_submit;
    std::unique_lock lock{m};
    gate_cv.wait(lock, [&] { return gate_open; });
    --in_submit;
    std::vector<transfer_task_copy> started;
    for (auto& t : batch) {
      if (drop.count(t.id) != 0) {
        t.admission = wm::transfer_admission::drop;
      } else if (used + t.bytes > budget) {
        t.admission = wm::transfer_admission::defer;
      } else {
        t.admission = wm::transfer_admission::start;
        used += t.bytes;
        started.push_back({t.id, t.bytes, t.passive});
      }
    }
    if (started.empty()) { return std::nullopt; }
    batches.push_back(started);
    return next++;
  }
  bool poll(ticket_type const& t) {
    std::lock_guard lock{m};
    return auto_finish || finished.count(t) != 0;
  }
  void complete(ticket_type const& t) {
    std::lock_guard lock{m};
    for (auto const& x : batches.at(t)) { completed.push_back(x.id); }
  }

  // helpers for the test thread
  void open(bool o) {
    {
      std::lock_guard lock{m};
      gate_open = o;
    }
    gate_cv.notify_all();
  }
  void finish_all() {
    std::lock_guard lock{m};
    auto_finish = true;
  }
  void free_bytes(std::size_t b) {
    std::lock_guard lock{m};
    used -= b;
  }
  std::vector<std::uint64_t> submitted_ids() {
    std::lock_guard lock{m};
    std::vector<std::uint64_t> ids;
    for (auto const& b : batches) {
      for (auto const& t : b) { ids.push_back(t.id); }
    }
    return ids;
  }
  std::size_t batch_count() {
    std::lock_guard lock{m};
    return batches.size();
  }
};

wm::transfer_task task(std::uint64_t id, std::size_t bytes) {
  return {id, bytes};
}

wm::transfer_queue_options no_coalescing(int in_flight = 4) {
  wm::transfer_queue_options o;
  o.max_in_flight  = in_flight;
  o.coalesce_below = 0;
  return o;
}

// A copier whose poll fails, as swap_core's does when an event reports an error: every task
// starts, no ticket completes.
struct failing_poll_copier {
  using ticket_type = int;
  std::atomic<int> polls{0};
  std::atomic<int> completes{0};
  std::optional<ticket_type> submit(std::span<wm::transfer_task> batch) {
    for (auto& t : batch) { t.admission = wm::transfer_admission::start; }
    return 1;
  }
  bool poll(ticket_type const&) {
    ++polls;
    throw std::runtime_error{"the copy's event failed"};
  }
  void complete(ticket_type const&) { ++completes; }
};

}  // namespace

static_assert(wm::transfer_copier<fake_copier>);
static_assert(wm::transfer_copier<failing_poll_copier>);

TEST_CASE("transfer_queue: passive tasks at the front go first, back tasks in order once started",
          "[host][swap]") {
  fake_copier c;
  wm::transfer_queue q{c, no_coalescing(1)};
  // Back tasks wait until start().
  for (std::uint64_t id = 1; id <= 3; ++id) { REQUIRE(q.enqueue(task(id, 8 * mib))); }
  std::this_thread::sleep_for(20ms);
  CHECK(c.batch_count() == 0);
  CHECK(q.waiting() == 3);
  // A passive task goes although the queue is not started; hold it in submit.
  c.open(false);
  REQUIRE(q.enqueue_front(task(100, 8 * mib)));
  REQUIRE(eventually([&] { return c.in_submit.load() == 1; }));
  REQUIRE(q.enqueue(task(4, 8 * mib)));
  REQUIRE(q.enqueue_front(task(10, 8 * mib)));
  REQUIRE(q.enqueue_front(task(11, 8 * mib)));
  c.open(true);
  REQUIRE(eventually([&] { return c.submitted_ids().size() == 3; }));
  CHECK(c.submitted_ids() == std::vector<std::uint64_t>{100, 11, 10});
  q.start();
  REQUIRE(q.wait(deadline()));
  CHECK(c.submitted_ids() == std::vector<std::uint64_t>{100, 11, 10, 1, 2, 3, 4});
  CHECK(c.completed == c.submitted_ids());
  auto const b = c.batches;
  CHECK(b[0][0].passive);
  CHECK_FALSE(b[3][0].passive);
}

TEST_CASE("transfer_queue: dequeue pops the task the worker would take next", "[host][swap]") {
  fake_copier c;
  wm::transfer_queue q{c, no_coalescing()};
  REQUIRE(q.enqueue(task(1, 1)));
  REQUIRE(q.enqueue(task(2, 1)));
  REQUIRE(q.enqueue(task(3, 1)));
  CHECK(q.dequeue()->id == 1);
  CHECK(q.dequeue()->id == 2);
  CHECK(q.dequeue()->id == 3);
  CHECK_FALSE(q.dequeue().has_value());
  CHECK(c.batch_count() == 0);
}

TEST_CASE("transfer_queue: erase takes back a waiting task only", "[host][swap]") {
  fake_copier c;
  wm::transfer_queue q{c, no_coalescing()};
  for (std::uint64_t id = 1; id <= 5; ++id) { REQUIRE(q.enqueue(task(id, mib))); }
  CHECK(q.erase(2));
  CHECK_FALSE(q.erase(2));
  CHECK(q.erase(5));
  CHECK_FALSE(q.erase(99));
  CHECK(q.waiting() == 3);
  q.start();
  REQUIRE(q.wait(deadline()));
  CHECK(c.submitted_ids() == std::vector<std::uint64_t>{1, 3, 4});
  CHECK_FALSE(q.erase(1));  // done
}

TEST_CASE("transfer_queue: wait unlocks afterwards, wait_and_stop refuses new tasks",
          "[host][swap]") {
  fake_copier c;
  wm::transfer_queue q{c, no_coalescing()};
  q.start();
  SECTION("wait") {
    c.open(false);
    REQUIRE(q.enqueue(task(1, mib)));
    REQUIRE(eventually([&] { return c.in_submit.load() == 1; }));
    bool drained = false;
    std::thread waiter{[&] { drained = q.wait(deadline()); }};
    REQUIRE(eventually([&] { return q.locked(); }));
    CHECK_FALSE(q.enqueue(task(2, mib)));  // refused while draining
    CHECK_FALSE(q.enqueue_front(task(3, mib)));
    c.open(true);
    waiter.join();
    CHECK(drained);
    CHECK_FALSE(q.locked());
    CHECK(q.enqueue(task(4, mib)));  // accepted again, and it runs: still started
    REQUIRE(q.wait(deadline()));
    CHECK(c.submitted_ids() == std::vector<std::uint64_t>{1, 4});
  }
  SECTION("wait_and_stop") {
    REQUIRE(q.enqueue(task(1, mib)));
    REQUIRE(q.enqueue(task(2, mib)));
    REQUIRE(q.wait_and_stop(deadline()));
    CHECK(c.submitted_ids() == std::vector<std::uint64_t>{1, 2});
    CHECK(q.locked());
    CHECK_FALSE(q.enqueue(task(3, mib)));
    CHECK_FALSE(q.enqueue_front(task(4, mib)));
    CHECK(q.requeue(task(6, mib)));  // a copier's follow-up goes in while locked
    REQUIRE(q.wait(deadline()));
    CHECK(q.locked());  // wait restores the lock it found
    q.pause();          // unlocked, back tasks held
    REQUIRE(q.enqueue(task(5, mib)));
    std::this_thread::sleep_for(20ms);
    CHECK(c.submitted_ids().size() == 3);
    q.start();
    REQUIRE(q.wait(deadline()));
    CHECK(c.submitted_ids() == std::vector<std::uint64_t>{1, 2, 6, 5});
  }
}

TEST_CASE("transfer_queue: drains drain unstarted queues and give up at the deadline",
          "[host][swap]") {
  fake_copier c;
  c.auto_finish = false;
  wm::transfer_queue q{c, no_coalescing()};
  REQUIRE(q.enqueue(task(1, mib)));  // not started: a drain submits it anyway
  auto const t0 = clock_type::now();
  CHECK_FALSE(q.wait(clock_type::now() + 50ms));  // the copy never finishes
  auto const waited = clock_type::now() - t0;
  CHECK(waited >= 50ms);
  CHECK(waited < 2s);
  CHECK(c.submitted_ids() == std::vector<std::uint64_t>{1});
  CHECK(q.in_flight() == 1);
  c.finish_all();
  CHECK(q.wait(deadline()));
  CHECK(q.in_flight() == 0);
}

TEST_CASE("transfer_queue: many producer threads, every task once", "[host][swap]") {
  fake_copier c;
  wm::transfer_queue_options o;
  o.max_in_flight  = 3;
  o.coalesce_below = 4 * mib;
  wm::transfer_queue q{c, o};
  q.start();
  constexpr int threads = 8;
  constexpr int per     = 2000;
  std::atomic<std::size_t> bytes{0};
  std::atomic<int> refused{0};
  std::vector<std::thread> producers;
  for (int p = 0; p < threads; ++p) {
    producers.emplace_back([&, p] {
      std::mt19937_64 rng{std::random_device{}()};
      for (int i = 0; i < per; ++i) {
        std::uint64_t const id = static_cast<std::uint64_t>(p) * per + i;
        std::size_t const b    = rng() % (6 * mib) + 1;
        bytes += b;
        bool const ok = rng() % 3 == 0 ? q.enqueue_front(task(id, b)) : q.enqueue(task(id, b));
        if (!ok) { ++refused; }  // Catch's assertions are not thread-safe
      }
    });
  }
  for (auto& t : producers) { t.join(); }
  CHECK(refused.load() == 0);
  REQUIRE(q.wait(deadline(20000ms)));
  auto ids = c.submitted_ids();
  std::sort(ids.begin(), ids.end());
  REQUIRE(ids.size() == threads * per);
  for (std::size_t i = 0; i < ids.size(); ++i) { REQUIRE(ids[i] == i); }
  std::size_t seen = 0;
  for (auto const& b : c.batches) {
    for (auto const& t : b) { seen += t.bytes; }
  }
  CHECK(seen == bytes.load());
  CHECK(c.completed.size() == ids.size());
}

TEST_CASE("transfer_queue: small tasks travel together, large ones alone", "[host][swap]") {
  fake_copier c;
  wm::transfer_queue_options o;
  o.max_in_flight  = 1;
  o.coalesce_below = 4 * mib;
  o.coalesce_limit = 4 * mib;
  wm::transfer_queue q{c, o};
  std::uint64_t id = 0;
  for (int i = 0; i < 10; ++i) { REQUIRE(q.enqueue(task(id++, mib))); }
  REQUIRE(q.enqueue(task(id++, 8 * mib)));
  REQUIRE(q.enqueue(task(id++, 4 * mib)));  // not small: alone
  REQUIRE(q.enqueue(task(id++, mib)));
  REQUIRE(q.enqueue(task(id++, 3 * mib)));
  REQUIRE(q.enqueue(task(id++, mib)));
  q.start();
  REQUIRE(q.wait(deadline()));
  std::vector<std::size_t> sizes;
  for (auto const& b : c.batches) { sizes.push_back(b.size()); }
  CHECK(sizes == std::vector<std::size_t>{4, 4, 2, 1, 1, 2, 1});
  CHECK(c.submitted_ids().size() == id);
  std::vector<std::uint64_t> in_order(id);
  for (std::uint64_t i = 0; i < id; ++i) { in_order[i] = i; }
  CHECK(c.submitted_ids() == in_order);
}

TEST_CASE("transfer_queue: at most max_in_flight batches in flight", "[host][swap]") {
  fake_copier c;
  c.auto_finish = false;
  wm::transfer_queue q{c, no_coalescing(2)};
  for (std::uint64_t id = 0; id < 5; ++id) { REQUIRE(q.enqueue(task(id, 8 * mib))); }
  q.start();
  REQUIRE(eventually([&] { return c.batch_count() == 2; }));
  std::this_thread::sleep_for(20ms);
  CHECK(c.batch_count() == 2);
  CHECK(q.in_flight() == 2);
  REQUIRE(q.enqueue_front(task(9, mib)));  // passive: not held by the limit
  REQUIRE(eventually([&] { return c.batch_count() == 3; }));
  c.finish_all();
  REQUIRE(q.wait(deadline()));
  CHECK(c.submitted_ids() == std::vector<std::uint64_t>{0, 1, 9, 2, 3, 4});
}

TEST_CASE("transfer_queue: promote sends a waiting task next, past the limits and the lock",
          "[host][swap]") {
  fake_copier c;
  c.auto_finish = false;
  wm::transfer_queue q{c, no_coalescing(2)};
  for (std::uint64_t id = 0; id < 6; ++id) { REQUIRE(q.enqueue(task(id, 8 * mib))); }
  CHECK_FALSE(q.promote(99));  // never queued
  REQUIRE(q.promote(4));       // not started yet: it goes all the same
  REQUIRE(eventually([&] { return c.batch_count() == 1; }));
  CHECK(c.batches.at(0).at(0).id == 4);
  CHECK(c.batches.at(0).at(0).passive);
  CHECK_FALSE(q.promote(4));  // submitted: no longer waiting
  q.start();
  REQUIRE(eventually([&] { return c.batch_count() == 2; }));
  std::this_thread::sleep_for(20ms);
  CHECK(c.batch_count() == 2);  // the limit: 2 in flight
  REQUIRE(q.promote(3));        // past the in-flight limit
  REQUIRE(eventually([&] { return c.batch_count() == 3; }));
  // While a drain holds the queue locked (new tasks refused), a waiting task can still be
  // promoted.
  std::atomic<bool> drained{false};
  std::thread drainer{[&] { drained = q.wait(deadline()); }};  // Catch2 asserts on this thread
  REQUIRE(eventually([&] { return q.locked(); }));
  CHECK_FALSE(q.enqueue(task(7, mib)));
  REQUIRE(q.promote(5));
  c.finish_all();
  drainer.join();
  CHECK(drained);
  auto const ids = c.submitted_ids();
  CHECK(ids.size() == 6);
  CHECK(std::vector<std::uint64_t>(ids.begin(), ids.begin() + 3) ==
        std::vector<std::uint64_t>{4, 0, 3});
  CHECK(std::set<std::uint64_t>(ids.begin(), ids.end()) ==
        std::set<std::uint64_t>{0, 1, 2, 3, 4, 5});
}

TEST_CASE("transfer_queue: prefetch stays within the byte lookahead", "[host][swap]") {
  fake_copier c;
  wm::transfer_queue_options o = no_coalescing(8);
  o.lookahead_bytes            = 3 * mib;
  o.release_on_completion      = false;
  wm::transfer_queue q{c, o};
  for (std::uint64_t id = 0; id < 10; ++id) { REQUIRE(q.enqueue(task(id, mib))); }
  q.start();
  REQUIRE(eventually([&] { return c.batch_count() == 3; }));
  std::this_thread::sleep_for(20ms);
  CHECK(c.batch_count() == 3);
  CHECK(q.lookahead_used() == 3 * mib);
  q.release(mib);
  REQUIRE(eventually([&] { return c.batch_count() == 4; }));
  q.release(2 * mib);
  REQUIRE(eventually([&] { return c.batch_count() == 6; }));
  std::this_thread::sleep_for(20ms);
  CHECK(c.batch_count() == 6);
  REQUIRE(q.enqueue_front(task(50, 2 * mib)));  // passive: needed now, not counted
  REQUIRE(eventually([&] { return c.batch_count() == 7; }));
  CHECK(q.lookahead_used() == 3 * mib);
  q.release(10 * mib);
  REQUIRE(q.wait(deadline()));
  CHECK(c.submitted_ids() == std::vector<std::uint64_t>{0, 1, 2, 3, 4, 5, 50, 6, 7, 8, 9});
}

TEST_CASE("transfer_queue: deferred tasks keep their place and go when there is room",
          "[host][swap]") {
  fake_copier c;
  c.budget = 2 * mib;
  wm::transfer_queue q{c, no_coalescing(8)};
  for (std::uint64_t id = 0; id < 4; ++id) { REQUIRE(q.enqueue(task(id, mib))); }
  q.start();
  REQUIRE(eventually([&] { return c.batch_count() == 2; }));
  std::this_thread::sleep_for(20ms);
  CHECK(c.batch_count() == 2);
  CHECK(q.waiting() == 2);
  c.free_bytes(2 * mib);
  q.notify();
  REQUIRE(q.wait(deadline()));
  CHECK(c.submitted_ids() == std::vector<std::uint64_t>{0, 1, 2, 3});
}

TEST_CASE("transfer_queue: dropped tasks are forgotten", "[host][swap]") {
  fake_copier c;
  c.drop = {1, 3};
  wm::transfer_queue q{c, no_coalescing()};
  for (std::uint64_t id = 0; id < 5; ++id) { REQUIRE(q.enqueue(task(id, mib))); }
  q.start();
  REQUIRE(q.wait(deadline()));
  CHECK(c.submitted_ids() == std::vector<std::uint64_t>{0, 2, 4});
  CHECK(c.completed == std::vector<std::uint64_t>{0, 2, 4});
}

TEST_CASE("transfer_queue: close waits for the copies in flight and drops waiting tasks",
          "[host][swap]") {
  fake_copier c;
  c.auto_finish = false;
  std::thread finisher;
  {
    wm::transfer_queue q{c, no_coalescing(2)};
    for (std::uint64_t id = 0; id < 6; ++id) { REQUIRE(q.enqueue(task(id, 8 * mib))); }
    q.start();
    REQUIRE(eventually([&] { return c.batch_count() == 2; }));
    finisher = std::thread{[&] {
      std::this_thread::sleep_for(30ms);
      c.finish_all();
    }};
  }  // destructor: close()
  finisher.join();
  CHECK(c.submitted_ids() == std::vector<std::uint64_t>{0, 1});
  CHECK(c.completed == std::vector<std::uint64_t>{0, 1});
}

TEST_CASE("range_allocator: first fit by address, aligned, neighbours joined", "[host][swap]") {
  wm::detail::range_allocator a{1000, 64};
  CHECK(a.capacity() == 960);
  auto const x = a.allocate(1);
  auto const y = a.allocate(100);
  auto const z = a.allocate(64);
  CHECK(x == 0);
  CHECK(y == 64);
  CHECK(z == 192);
  CHECK(a.in_use() == 256);
  CHECK(a.size_of(y) == 128);  // 100 rounded up to the alignment
  CHECK(a.size_of(5) == 0);
  CHECK(a.allocate(0) == 256);  // zero bytes still take a unit
  CHECK(a.allocate(10'000) == wm::detail::range_allocator::npos);
  a.free(y);
  CHECK(a.allocate(128) == 64);  // the hole is reused
  a.free(64);
  a.free(x);
  a.free(z);
  a.free(256);
  CHECK(a.in_use() == 0);
  CHECK(a.largest_free() == 960);  // all joined again
  CHECK(a.peak() >= 320);
  CHECK_THROWS_AS(a.free(5), wm::logic_error);
  CHECK_THROWS_AS((wm::detail::range_allocator{10, 3}), wm::logic_error);
}

TEST_CASE("range_allocator: random allocations never overlap and free space is whole",
          "[host][swap]") {
  std::mt19937_64 rng{std::random_device{}()};
  wm::detail::range_allocator a{std::size_t{1} << 24, 256};
  std::map<std::size_t, std::size_t> live;  // offset -> rounded size
  for (int i = 0; i < 20000; ++i) {
    if (live.empty() || rng() % 2 == 0) {
      std::size_t const b = rng() % 100'000;
      auto const o        = a.allocate(b);
      if (o == wm::detail::range_allocator::npos) { continue; }
      REQUIRE(o % 256 == 0);
      auto const s = a.round(b);
      REQUIRE(o + s <= a.capacity());
      auto const next = live.lower_bound(o);
      if (next != live.end()) { REQUIRE(o + s <= next->first); }
      if (next != live.begin()) { REQUIRE(std::prev(next)->first + std::prev(next)->second <= o); }
      live.emplace(o, s);
    } else {
      auto it = live.begin();
      std::advance(it, static_cast<long>(rng() % live.size()));
      a.free(it->first);
      live.erase(it);
    }
  }
  for (auto const& [o, s] : live) { a.free(o); }
  CHECK(a.in_use() == 0);
  CHECK(a.largest_free() == a.capacity());
}

TEST_CASE("range_allocator: sizes that cannot be rounded fail instead of wrapping",
          "[host][swap]") {
  constexpr auto npos = wm::detail::range_allocator::npos;
  wm::detail::range_allocator a{1000, 64};
  std::size_t const huge = ~std::size_t{0} - 10;  // 2^64 - 11: rounding it up would wrap to 0
  CHECK(a.round(huge) == npos);                   // not a size, so never <= a capacity
  CHECK(a.round(~std::size_t{0}) == npos);
  CHECK(a.round(~std::size_t{0} - 62) == npos);                  // 2^64 - 63: would be 2^64
  CHECK(a.round(~std::size_t{0} - 63) == ~std::size_t{0} - 63);  // 2^64 - 64, a multiple of 64
  CHECK(a.round(~std::size_t{0} - 64) == ~std::size_t{0} - 63);
  CHECK(a.allocate(huge) == npos);
  CHECK(a.allocate(~std::size_t{0}) == npos);
  CHECK(a.allocate(a.capacity() + 1) == npos);
  CHECK(a.in_use() == 0);
  CHECK(a.allocations() == 0);
  // The failed probes took nothing: the whole range is still there, once.
  auto const x = a.allocate(960);
  CHECK(x == 0);
  CHECK(a.allocate(1) == npos);
  CHECK_FALSE(a.fits_all(std::vector<std::size_t>{huge}));
  // With an alignment of one nothing rounds, and the largest size is an ordinary one.
  wm::detail::range_allocator b{100, 1};
  CHECK(b.round(huge) == huge);
  CHECK(b.allocate(huge) == npos);
  CHECK(b.allocate(100) == 0);
}

// What @p f throws, or "" if it returns (Catch2 v2 and v3 spell the matchers differently).
template <class F>
std::string thrown_message(F&& f) {
  try {
    f();
  } catch (std::exception const& e) { return e.what(); }
  return "";
}

TEST_CASE("transfer_queue: an error from poll reaches the next drain; the ticket is not completed",
          "[host][swap]") {
  failing_poll_copier c;
  {
    wm::transfer_queue<failing_poll_copier> q{c, no_coalescing()};
    REQUIRE(q.enqueue(task(1, mib)));
    q.start();
    CHECK(thrown_message([&] { q.wait(deadline()); }) == "the copy's event failed");
    CHECK(q.in_flight() == 0);  // the failed ticket is dropped, not polled for ever
    // The worker goes on: the next failure is reported by the next drain.
    REQUIRE(q.enqueue(task(2, mib)));
    CHECK(thrown_message([&] { q.wait(deadline()); }) == "the copy's event failed");
  }  // close() with nothing in flight
  CHECK(c.polls == 2);
  CHECK(c.completes == 0);
}
