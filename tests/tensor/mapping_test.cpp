// SPDX-License-Identifier: Apache-2.0
// Host tests: block, cyclic and a user-written (hashed) mapping, and the dispatch plan, against
// plain references.
#include <wm/detail/exchange/plan.hpp>
#include <wm/partition.hpp>

#include <algorithm>
#include <cstdint>
#include <random>
#include <type_traits>
#include <vector>

#include "catch.hpp"
#include "dispatch_model.hpp"
#include "hashed_mapping.hpp"

namespace {
struct host_block {
  wm::block_partition part;
  wm::mapping_ref<wm::block> ref() const {
    return wm::make_mapping_ref<wm::block>(part.ref(part.starts().data()));
  }
};

// The cyclic mapping over its own partition (host starts), as a tensor makes it.
wm::mapping_ref<wm::cyclic> cyclic_ref(std::size_t rows, int world) {
  wm::block_partition const p{rows, world, wm::cyclic::counts(rows, world)};
  return wm::make_mapping_ref<wm::cyclic>(p.ref(p.starts().data()));
}

// Compile-time: what the mapping concept accepts.
struct no_ref {  // counts but no ref: not a mapping
  static constexpr char const* name = "no_ref";
  static std::vector<std::size_t> counts(std::size_t, int) { return {}; }
};
struct bad_owner {  // a ref whose owner is not an int rank
  static constexpr char const* name = "bad_owner";
  static std::vector<std::size_t> counts(std::size_t, int) { return {}; }
  struct ref_type {
    std::size_t rows() const { return 0; }
    std::size_t owner(std::size_t) const { return 0; }
    std::size_t local(std::size_t) const { return 0; }
  };
  static ref_type make_ref(wm::partition_ref) { return {}; }
};
static_assert(wm::mapping<wm::block> && wm::mapping<wm::cyclic> && wm::mapping<wm_test::hashed>);
static_assert(!wm::mapping<no_ref> && !wm::mapping<bad_owner> && !wm::mapping<int>);
static_assert(wm::contiguous_mapping<wm::block> && !wm::contiguous_mapping<wm::cyclic>);
static_assert(std::is_trivially_copyable_v<wm::mapping_ref<wm::block>>);
static_assert(std::is_trivially_copyable_v<wm::mapping_ref<wm_test::hashed>>);
}  // namespace

TEST_CASE("block and cyclic mappings place every row once", "[host]") {
  std::mt19937_64 rng{std::random_device{}()};
  for (int world = 1; world <= 8; ++world) {
    for (std::size_t rows : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{15},
                             std::size_t(rng() % 5000)}) {
      auto const bc = wm::block::counts(rows, world);
      auto const cc = wm::cyclic::counts(rows, world);
      host_block const hb{wm::block_partition{rows, world}};
      auto const b = hb.ref();
      auto const c = cyclic_ref(rows, world);
      std::vector<std::vector<bool>> seen_b(world), seen_c(world);
      for (int r = 0; r < world; ++r) {
        seen_b[r].assign(bc[r], false);
        seen_c[r].assign(cc[r], false);
      }
      for (std::size_t k = 0; k < rows; ++k) {
        auto const lb = b.locate(k);
        REQUIRE(lb.rank == hb.part.owner(k));
        REQUIRE(lb.local == k - hb.part.begin(lb.rank));
        REQUIRE(!seen_b[lb.rank][lb.local]);
        seen_b[lb.rank][lb.local] = true;
        auto const lc             = c.locate(k);
        REQUIRE(lc.rank == static_cast<int>(k % world));  // the seed's rule: key % world
        REQUIRE(lc.local == k / world);                   // ... at local row key / world
        REQUIRE(lc.local < cc[lc.rank]);
        REQUIRE(!seen_c[lc.rank][lc.local]);
        seen_c[lc.rank][lc.local] = true;
      }
      std::size_t sb = 0, sc = 0;
      for (int r = 0; r < world; ++r) {
        sb += bc[r];
        sc += cc[r];
      }
      CHECK(sb == rows);
      CHECK(sc == rows);
    }
  }
  CHECK(wm::cyclic::counts(9, 4) == std::vector<std::size_t>{3, 2, 2, 2});
  CHECK(wm::block::counts(9, 8) == std::vector<std::size_t>{2, 2, 2, 2, 1, 0, 0, 0});
}

TEST_CASE("a user-written mapping (hashed) places every row once, densely", "[host]") {
  std::mt19937_64 rng{std::random_device{}()};
  for (int world = 1; world <= 8; ++world) {
    for (std::size_t rows : {std::size_t{0}, std::size_t{1}, std::size_t{2}, std::size_t{7},
                             std::size_t{64}, std::size_t(1 + rng() % 5000)}) {
      INFO("rows " << rows << ", world " << world);
      auto const counts = wm_test::hashed::counts(rows, world);
      REQUIRE(counts.size() == static_cast<std::size_t>(world));
      wm::block_partition const part{rows, world, counts};
      auto const m = wm::make_mapping_ref<wm_test::hashed>(part.ref(part.starts().data()));
      REQUIRE(m.rows() == rows);
      // Reference from the definition: p = mix walked below rows, owner p % world, local p / world.
      auto const p_of = [&](std::size_t k) {
        std::uint64_t x = m.impl.mix(k);
        while (x >= rows) { x = m.impl.mix(x); }
        return static_cast<std::size_t>(x);
      };
      std::vector<bool> image(rows, false);  // p is a bijection of [0, rows)
      std::vector<std::vector<bool>> seen(static_cast<std::size_t>(world));
      for (int r = 0; r < world; ++r) {
        seen[static_cast<std::size_t>(r)].assign(counts[static_cast<std::size_t>(r)], false);
      }
      std::size_t in_order =
          0;  // rows whose owner is the cyclic one: not all, or it is not a third mapping
      for (std::size_t k = 0; k < rows; ++k) {
        std::size_t const p = p_of(k);
        REQUIRE(p < rows);
        REQUIRE(!image[p]);
        image[p]      = true;
        auto const at = m.locate(k);
        REQUIRE(at.rank == static_cast<int>(p % static_cast<std::size_t>(world)));
        REQUIRE(at.local == p / static_cast<std::size_t>(world));
        REQUIRE(at.rank == m.owner(k));
        REQUIRE(at.local == m.local(k));
        REQUIRE(at.local <
                counts[static_cast<std::size_t>(at.rank)]);  // dense: within the rank's count
        REQUIRE(
            !seen[static_cast<std::size_t>(at.rank)][at.local]);  // and each local row used once
        seen[static_cast<std::size_t>(at.rank)][at.local] = true;
        in_order += at.rank == static_cast<int>(k % static_cast<std::size_t>(world)) ? 1 : 0;
      }
      if (rows >= 64 && world > 1) { CHECK(in_order < rows); }
    }
  }
  // A rank that owns nothing (fewer rows than ranks) is fine.
  CHECK(wm_test::hashed::counts(3, 8) == std::vector<std::size_t>{1, 1, 1, 0, 0, 0, 0, 0});
}

TEST_CASE("the dispatch plan through a user-written mapping matches its ref", "[host]") {
  std::mt19937_64 rng{std::random_device{}()};
  int const world        = 3;
  std::size_t const rows = 101;
  wm::block_partition const part{rows, world, wm_test::hashed::counts(rows, world)};
  auto const m = wm::make_mapping_ref<wm_test::hashed>(part.ref(part.starts().data()));
  std::vector<std::int64_t> idx(500);
  for (auto& k : idx) { k = static_cast<std::int64_t>(rng() % rows); }
  auto const p   = wm_test::plan_dispatch<wm_test::hashed, std::int64_t>(idx, m, world);
  std::size_t at = 0;
  for (int r = 0; r < world; ++r) {
    for (std::size_t j = 0; j < p.send_counts[static_cast<std::size_t>(r)]; ++j, ++at) {
      auto const k = static_cast<std::size_t>(idx[p.order[at]]);
      REQUIRE(m.owner(k) == r);
      REQUIRE(static_cast<std::size_t>(p.send_keys[at]) == m.local(k));
    }
  }
  CHECK(at == idx.size());
}

TEMPLATE_TEST_CASE("the dispatch plan groups indices by owner, stably", "[host]", std::int32_t,
                   std::int64_t) {
  using Index = TestType;
  std::mt19937_64 rng{std::random_device{}()};
  for (int world : {1, 2, 3, 8}) {
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{1000}}) {
      std::size_t const rows = 1 + rng() % 500;
      std::vector<Index> idx(n);
      for (auto& k : idx) {
        auto const pick = rng() % 20;
        k               = pick == 0   ? Index(-1 - static_cast<Index>(rng() % 5))
                          : pick == 1 ? static_cast<Index>(rows + rng() % 3)
                                      : static_cast<Index>(rng() % rows);
      }
      auto const c = cyclic_ref(rows, world);
      auto const p = wm_test::plan_dispatch<wm::cyclic, Index>(idx, c, world);
      // Reference: walk owners in order, positions ascending within each owner.
      std::vector<std::size_t> order;
      std::vector<Index> keys;
      std::vector<std::size_t> counts(world, 0);
      for (int r = 0; r < world; ++r) {
        for (std::size_t i = 0; i < n; ++i) {
          if (idx[i] >= 0 && static_cast<std::size_t>(idx[i]) < rows &&
              static_cast<int>(idx[i] % world) == r) {
            order.push_back(i);
            keys.push_back(static_cast<Index>(idx[i] / world));
            ++counts[r];
          }
        }
      }
      std::size_t invalid = 0;
      for (std::size_t i = 0; i < n; ++i) {
        if (idx[i] < 0 || static_cast<std::size_t>(idx[i]) >= rows) {
          order.push_back(i);
          ++invalid;
        }
      }
      CHECK(p.order == order);
      CHECK(p.send_keys == keys);
      CHECK(p.send_counts == counts);
      CHECK(p.invalid == invalid);
    }
  }
  // A batch whose rows all live on one rank: the others receive nothing.
  std::vector<Index> const only_zero{0, 4, 8, 4};
  auto const p = wm_test::plan_dispatch<wm::cyclic, Index>(only_zero, cyclic_ref(12, 4), 4);
  CHECK(p.send_counts == std::vector<std::size_t>{4, 0, 0, 0});
  CHECK(p.send_keys == std::vector<Index>{0, 1, 2, 1});
}

TEST_CASE("the distributed gather's pieces cover each peer's rows once, the same at both ends",
          "[host]") {
  std::mt19937_64 rng{Catch::getSeed()};
  std::size_t const mib = std::size_t{1} << 20;
  // Edge counts (none, one row, exactly 32 MiB, one row more, huge) and random ones.
  std::vector<std::pair<std::size_t, std::size_t>> cases{
      {0, 512}, {1, 512}, {65536, 512}, {65537, 512}, {std::size_t{1} << 31, 4}, {3, 64 * mib}};
  for (int i = 0; i < 200; ++i) {
    cases.emplace_back(rng() % 2'000'000, std::size_t{4} << (rng() % 10));
  }
  for (auto const& [count, rb] : cases) {
    int const n = wm::detail::pieces_of(count, rb);
    INFO("count " << count << ", row bytes " << rb << ", pieces " << n);
    REQUIRE(n >= (count > 0 ? 1 : 0));
    REQUIRE(n <= wm::detail::max_pieces);
    // One piece per started 32 MiB, up to the cap.
    std::size_t const want =
        std::min({(count * rb + 32 * mib - 1) / (32 * mib), std::size_t{6}, count});
    REQUIRE(static_cast<std::size_t>(n) == want);
    std::size_t next = 0;
    std::vector<std::size_t> sizes;
    for (int k = 0; k < wm::detail::max_pieces + 1; ++k) {
      auto const p = wm::detail::piece_of(count, rb, k);
      REQUIRE(p.first == next);  // in order, no gap, no overlap
      REQUIRE(p.last >= p.first);
      if (k >= n) { REQUIRE(p.first == p.last); }
      if (k < n && count > 0) { REQUIRE(p.last > p.first); }
      if (k < n) { sizes.push_back(p.last - p.first); }
      next = p.last;
    }
    REQUIRE(next == count);
    // From three pieces on (with rows enough), the first and the last are about a quarter of
    // each middle one: pure latency at both ends of the pipeline.
    if (n >= 3 && count >= 2 * (4 * (static_cast<std::size_t>(n) - 2) + 2)) {
      for (std::size_t k = 1; k + 1 < sizes.size(); ++k) {
        REQUIRE(4 * sizes.front() <= sizes[k] + 4);
        REQUIRE(4 * sizes.back() <= sizes[k] + 8);
        REQUIRE(sizes[k] <= 4 * std::min(sizes.front(), sizes.back()) + 8);
      }
    }
  }
}
