// SPDX-License-Identifier: Apache-2.0
// Host tests: the gather pool and the stage-3 residency bookkeeping of wm::zero_optimizer
// (detail/zero/residency.hpp): first-fit ranges that merge when freed, groups that share buckets,
// prefetches that never evict and are dropped when another group is asked for. And the offload
// pipeline's spare host regions (detail/zero/spare_regions.hpp): where each chunk's current
// master weights and moments are, against a model of the stored values.
#include <wm/detail/zero/residency.hpp>
#include <wm/detail/zero/spare_regions.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <random>
#include <set>
#include <vector>

#include "catch.hpp"

namespace z = wm::detail::zero;

TEST_CASE("range_allocator as the stage-3 gather pool: first fit, merging, fits_all", "[host]") {
  wm::detail::range_allocator p{1024, 256};
  constexpr auto npos = wm::detail::range_allocator::npos;
  auto const a        = p.allocate(1);
  auto const b        = p.allocate(300);  // rounds to 512
  auto const c        = p.allocate(256);
  REQUIRE(a == 0u);
  REQUIRE(b == 256u);
  REQUIRE(c == 768u);
  REQUIRE(p.allocate(1) == npos);
  REQUIRE_FALSE(p.fits_all(std::vector<std::size_t>{1}));
  p.free(a);
  p.free(c);
  REQUIRE(p.allocate(512) == npos);  // two holes of 256, not adjacent
  REQUIRE(p.fits_all(std::vector<std::size_t>{256, 256}));
  REQUIRE_FALSE(p.fits_all(std::vector<std::size_t>{256, 256, 1}));
  REQUIRE(p.in_use() == 512);  // fits_all changed nothing
  p.free(b);                   // merges into one range of 1024
  REQUIRE(p.in_use() == 0);
  REQUIRE(p.allocate(1024) == 0u);
  REQUIRE_THROWS_AS(p.free(5), wm::logic_error);
}

TEST_CASE("range_allocator: random allocations never overlap", "[host]") {
  std::mt19937_64 rng{std::random_device{}()};
  wm::detail::range_allocator p{1 << 16, 128};
  std::vector<std::pair<std::size_t, std::size_t>> live;
  for (int i = 0; i < 2000; ++i) {
    if (!live.empty() && rng() % 2 == 0) {
      auto const k = rng() % live.size();
      p.free(live[k].first);
      live.erase(live.begin() + static_cast<long>(k));
    } else {
      std::size_t const n  = 1 + rng() % 5000;
      std::size_t const at = p.allocate(n);
      if (at != wm::detail::range_allocator::npos) {
        REQUIRE(at % 128 == 0);
        REQUIRE(at + n <= (1u << 16));
        for (auto const& [o, m] : live) { REQUIRE((at + n <= o || o + m <= at)); }
        live.push_back({at, n});
      }
    }
  }
  for (auto const& [o, m] : live) { p.free(o); }
  REQUIRE(p.in_use() == 0);
}

TEST_CASE("zero residency: acquire, share, release, prefetch", "[host]") {
  // Buckets of 256 bytes; groups {0,1}, {1,2}, {3}; a pool of 3 buckets.
  z::residency r{{{1, 0, 1}, {1, 2}, {3}}, {256, 256, 256, 256}, 768};
  REQUIRE(r.buckets(0) == std::vector<std::size_t>{0, 1});
  auto l0 = r.acquire(0);
  REQUIRE(l0.size() == 2);
  REQUIRE(r.offset(0).has_value());
  REQUIRE(r.offset(1).has_value());
  REQUIRE_FALSE(r.offset(2).has_value());
  REQUIRE_THROWS_AS(r.acquire(0), wm::logic_error);  // held already
  // Group 1 shares bucket 1: only bucket 2 is gathered.
  auto l1 = r.acquire(1);
  REQUIRE(l1 == std::vector<z::residency::load>{{2, *r.offset(2)}});
  // The pool is full: group 2 neither prefetches nor fits.
  REQUIRE(r.prefetch(2).empty());
  REQUIRE_THROWS_AS(r.acquire(2), wm::logic_error);
  r.release(0);  // bucket 0 leaves, bucket 1 stays (group 1 holds it)
  REQUIRE_FALSE(r.offset(0).has_value());
  REQUIRE(r.offset(1).has_value());
  auto p2 = r.prefetch(2);
  REQUIRE(p2.size() == 1);
  REQUIRE(r.prefetched() == 2u);
  REQUIRE(r.prefetch(0).empty());  // one prefetch at a time
  // Acquiring the prefetched group gathers nothing more.
  REQUIRE(r.acquire(2).empty());
  REQUIRE_FALSE(r.prefetched().has_value());
  r.release(1);
  r.release(2);
  REQUIRE_FALSE(r.any_held());
  REQUIRE(r.pool().capacity() - r.pool().in_use() == 768);
  // A wrong guess is dropped when another group is asked for.
  REQUIRE(r.prefetch(2).size() == 1);
  REQUIRE(r.acquire(0).size() == 2);
  REQUIRE_FALSE(r.offset(3).has_value());
  r.release(0);
  REQUIRE(r.pool().capacity() - r.pool().in_use() == 768);
  REQUIRE_THROWS_AS(r.release(0), wm::logic_error);
}

TEST_CASE("zero residency: a group larger than the pool is refused at construction", "[host]") {
  REQUIRE_THROWS_AS((z::residency{{{0, 1}}, {512, 512}, 768}), wm::logic_error);
  REQUIRE_NOTHROW((z::residency{{{0}, {1}}, {512, 512}, 768}));
}

TEST_CASE("spare_regions: a chunk updated ahead takes a region, goes back home the step after",
          "[host]") {
  constexpr auto home = z::spare_regions::home;
  z::spare_regions s{3, 1};
  REQUIRE(s.chunks() == 3u);
  REQUIRE(s.regions() == 1u);
  REQUIRE(s.free_regions() == 1u);
  // Step 1: chunk 0 ahead into the one region, chunk 1 finds none (waits, then in place).
  REQUIRE(s.ahead(0) == std::optional<z::spare_regions::region_index>{0});
  REQUIRE(s.current(0) == home);  // not current before the decision
  REQUIRE_FALSE(s.ahead(1).has_value());
  REQUIRE(s.pending() == 1u);
  s.commit();
  REQUIRE(s.current(0) == 0u);
  REQUIRE(s.away() == 1u);
  REQUIRE(s.settle(1) == home);  // in place
  REQUIRE(s.settle(2) == home);
  // Step 2: chunk 0 ahead from its region back home (no region needed); chunk 1 finds none (the
  // region is chunk 0's current until the decision).
  REQUIRE(s.ahead(0) == std::optional<z::spare_regions::region_index>{home});
  REQUIRE_FALSE(s.ahead(1).has_value());
  REQUIRE(s.free_regions() == 0u);
  s.commit();
  REQUIRE(s.current(0) == home);
  REQUIRE(s.away() == 0u);
  REQUIRE(s.free_regions() == 1u);
  // Step 3, dropped: chunk 2 took the region; it is free again and chunk 2 stays home.
  REQUIRE(s.ahead(2) == std::optional<z::spare_regions::region_index>{0});
  s.drop();
  REQUIRE(s.current(2) == home);
  REQUIRE(s.free_regions() == 1u);
  REQUIRE(s.pending() == 0u);
  // Step 4, adopted, then step 5 dropped after chunk 2 went back home ahead: still in its region.
  REQUIRE(s.ahead(2).has_value());
  s.commit();
  REQUIRE(s.ahead(2) == std::optional<z::spare_regions::region_index>{home});
  s.drop();
  REQUIRE(s.current(2) == 0u);
  // A redo (or a copy back) settles it: read from the region, home afterwards, region free.
  REQUIRE(s.settle(2) == 0u);
  REQUIRE(s.current(2) == home);
  REQUIRE(s.free_regions() == 1u);
  REQUIRE(s.peak_in_use() == 1u);
  // Once per step; indices checked.
  REQUIRE(s.ahead(1).has_value());
  REQUIRE_THROWS_AS(s.ahead(1), wm::logic_error);
  REQUIRE_THROWS_AS(s.settle(1), wm::logic_error);
  REQUIRE_THROWS_AS(s.ahead(3), wm::logic_error);
  s.drop();
  // No regions: nothing goes ahead.
  z::spare_regions none{4, 0};
  REQUIRE_FALSE(none.ahead(0).has_value());
  REQUIRE(none.settle(0) == home);
}

TEST_CASE("spare_regions against a model of the stored values, random steps", "[host]") {
  // Each chunk's values are a version number written where the bookkeeping says; a read from
  // where it says the current values are must give the version the steps made. Regions written
  // ahead must be free ones (no chunk's current values), at most `regions` per step.
  constexpr auto home = z::spare_regions::home;
  std::mt19937_64 rng{GENERATE(1u, 2u, 3u, 4u)};
  std::size_t const chunks  = 1 + rng() % 12;
  std::size_t const regions = rng() % (chunks + 2);  // up to more than needed
  INFO("chunks " << chunks << " regions " << regions);
  z::spare_regions s{chunks, regions};
  std::vector<std::int64_t> at_home(chunks, 0), in_region(regions, -1), expected(chunks, 0);
  auto read = [&](std::size_t c) {
    auto const r = s.current(c);
    return r == home ? at_home[c] : in_region.at(r);
  };
  auto write = [&](std::size_t c, z::spare_regions::region_index to, std::int64_t v) {
    if (to == home) {
      at_home[c] = v;
    } else {
      in_region.at(to) = v;
    }
  };
  for (int step = 0; step < 300; ++step) {
    // Chunks in the pipeline's order (a random start of them before the decision).
    std::vector<std::size_t> order(chunks);
    for (std::size_t c = 0; c < chunks; ++c) { order[c] = c; }
    std::shuffle(order.begin(), order.end(), rng);
    std::size_t const before = rng() % (chunks + 1);
    bool const adopt         = rng() % 3 != 0;
    std::vector<std::uint8_t> done(chunks, 0);
    std::vector<std::int64_t> wrote(chunks, 0);
    std::size_t ahead = 0;
    std::set<z::spare_regions::region_index> current_regions;
    for (std::size_t c = 0; c < chunks; ++c) {
      if (s.current(c) != home) { current_regions.insert(s.current(c)); }
    }
    REQUIRE(current_regions.size() == s.away());
    for (std::size_t i = 0; i < before; ++i) {
      std::size_t const c = order[i];
      auto const to       = s.ahead(c);
      if (!to.has_value()) { break; }  // the pipeline waits for the decision
      REQUIRE(*to != s.current(c));    // never over the current values
      if (*to != home) { REQUIRE(current_regions.count(*to) == 0); }
      wrote[c] = read(c) + 1;
      write(c, *to, wrote[c]);
      done[c] = 1;
      ++ahead;
    }
    REQUIRE(ahead <= regions);
    REQUIRE(s.pending() == ahead);
    REQUIRE(s.in_use() <= regions);
    // Every chunk still reads its old values.
    for (std::size_t c = 0; c < chunks; ++c) { REQUIRE(read(c) == expected[c]); }
    if (adopt) {
      s.commit();
      for (std::size_t c = 0; c < chunks; ++c) {
        if (done[c] != 0) { expected[c] = wrote[c]; }
      }
      // The rest in place after the decision.
      for (std::size_t c = 0; c < chunks; ++c) {
        if (done[c] != 0) { continue; }
        auto const from      = s.settle(c);
        std::int64_t const v = (from == home ? at_home[c] : in_region.at(from)) + 1;
        at_home[c]           = v;
        expected[c]          = v;
      }
    } else {
      s.drop();
      if (rng() % 2 == 0) {  // redone: every chunk read where it is, written home
        for (std::size_t c = 0; c < chunks; ++c) {
          auto const from      = s.settle(c);
          std::int64_t const v = (from == home ? at_home[c] : in_region.at(from)) + 1;
          at_home[c]           = v;
          expected[c]          = v;
        }
      }  // else skipped: nothing changes
    }
    REQUIRE(s.pending() == 0u);
    REQUIRE(s.free_regions() + s.away() == regions);
    for (std::size_t c = 0; c < chunks; ++c) { REQUIRE(read(c) == expected[c]); }
    if (rng() % 7 == 0) {  // master_shard: everything copied back home
      for (std::size_t c = 0; c < chunks; ++c) {
        auto const from = s.current(c);
        if (from == home) { continue; }
        at_home[c] = in_region.at(from);
        REQUIRE(s.settle(c) == from);
      }
      REQUIRE(s.away() == 0u);
      REQUIRE(s.free_regions() == regions);
      for (std::size_t c = 0; c < chunks; ++c) { REQUIRE(read(c) == expected[c]); }
    }
  }
  REQUIRE(s.peak_in_use() <= regions);
}
