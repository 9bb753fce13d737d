// Host tests: the gather pool and the stage-3 residency bookkeeping of wm::zero_optimizer
// (detail/zero/residency.hpp): first-fit ranges that merge when freed, groups that share buckets,
// prefetches that never evict and are dropped when another group is asked for.
#include <wm/detail/zero/residency.hpp>

#include <random>
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
