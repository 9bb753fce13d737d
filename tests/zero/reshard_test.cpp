// SPDX-License-Identifier: Apache-2.0
// Host tests: checkpoint resharding by fragment tables. Random parameter lists are laid out for
// W ranks, each rank's state "file" holds a value that names its element (parameter hash and
// index) and poison in the padding; the reads planned for W' ranks (other bucket size and
// alignment) must put every element where the new plan wants it and leave the padding alone.
#include <wm/detail/zero/reshard.hpp>

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"

namespace z = wm::detail::zero;

namespace {

constexpr std::uint64_t file_poison = 0xdeadbeefdeadbeefULL;
constexpr std::uint64_t dest_poison = 0x5a5a5a5a5a5a5a5aULL;

std::uint64_t code(std::string const& name, std::size_t index) {
  return (std::hash<std::string>{}(name)*0x9e3779b97f4a7c15ULL) ^ (index * 0x100000001b3ULL + 1);
}

std::vector<z::param_spec> random_params(std::mt19937_64& rng) {
  std::vector<z::param_spec> ps;
  std::size_t const n = rng() % 25;
  for (std::size_t i = 0; i < n; ++i) {
    std::size_t const k        = rng() % 10;
    std::size_t const elements = k == 0  ? 0
                                 : k < 5 ? 1 + rng() % 50
                                 : k < 9 ? 1 + rng() % 2000
                                         : 2000 + rng() % 20000;
    ps.push_back(
        {"layer" + std::to_string(i) + ".w", elements, static_cast<z::element_type>(rng() % 3)});
  }
  return ps;
}

// The old ranks' files: each state buffer, filled from the plan's fragments.
std::vector<std::vector<std::uint64_t>> write_files(z::plan const& pl) {
  std::vector<std::vector<std::uint64_t>> files(pl.world);
  for (int r = 0; r < pl.world; ++r) {
    files[r].assign(pl.state_elements, file_poison);
    for (auto const& f : pl.fragments(r)) {
      for (std::size_t e = 0; e < f.elements; ++e) {
        files[r][f.state_offset + e] = code(pl.params[f.param].name, f.param_offset + e);
      }
    }
  }
  return files;
}

// Loads rank `rank` of plan `to` from `from`'s files and checks every element.
void check_load(z::plan const& from, z::plan const& to, int rank) {
  auto const files = write_files(from);
  std::vector<z::fragment_table> tables;
  for (int r = 0; r < from.world; ++r) { tables.push_back(z::fragment_table_of(from, r)); }
  auto const reads = z::plan_shard_reads(tables, to, rank);

  std::vector<std::uint64_t> dest(to.state_elements, dest_poison);
  std::vector<int> written(to.state_elements, 0);
  std::size_t prev_end = 0;
  for (auto const& rd : reads) {
    REQUIRE(rd.file < files.size());
    REQUIRE(rd.elements > 0);
    REQUIRE(rd.file_offset + rd.elements <= files[rd.file].size());
    REQUIRE(rd.dest_offset + rd.elements <= dest.size());
    CHECK(rd.dest_offset >= prev_end);  // ascending, disjoint
    prev_end = rd.dest_offset + rd.elements;
    for (std::size_t e = 0; e < rd.elements; ++e) {
      dest[rd.dest_offset + e] = files[rd.file][rd.file_offset + e];
      ++written[rd.dest_offset + e];
    }
  }
  // Merged: no two consecutive reads continue each other.
  for (std::size_t i = 1; i < reads.size(); ++i) {
    auto const& a = reads[i - 1];
    auto const& b = reads[i];
    CHECK(!(a.file == b.file && a.file_offset + a.elements == b.file_offset &&
            a.dest_offset + a.elements == b.dest_offset));
  }
  // Every element the new rank holds is its own value; everything else untouched.
  std::vector<int> wanted(to.state_elements, 0);
  std::size_t bad = 0;
  for (auto const& f : to.fragments(rank)) {
    for (std::size_t e = 0; e < f.elements; ++e) {
      wanted[f.state_offset + e] = 1;
      bad += dest[f.state_offset + e] != code(to.params[f.param].name, f.param_offset + e);
    }
  }
  CHECK(bad == 0);
  CHECK(written == wanted);
  std::size_t untouched_ok = 0, untouched = 0;
  for (std::size_t i = 0; i < dest.size(); ++i) {
    if (!wanted[i]) {
      ++untouched;
      untouched_ok += dest[i] == dest_poison;
    }
  }
  CHECK(untouched_ok == untouched);
}

}  // namespace

TEST_CASE("zero checkpoint: reshard W to W' ranks for W, W' in 1..9", "[host]") {
  std::mt19937_64 rng{std::random_device{}()};
  for (int w_old = 1; w_old <= 9; ++w_old) {
    for (int w_new = 1; w_new <= 9; ++w_new) {
      for (int trial = 0; trial < 3; ++trial) {
        auto const ps       = random_params(rng);
        std::size_t const a = std::size_t{4} << (rng() % 7);
        std::size_t const b = std::size_t{4} << (rng() % 7);
        auto const from     = z::make_plan(ps, 1 + rng() % 30000, w_old, a);
        auto const to       = z::make_plan(ps, 1 + rng() % 30000, w_new, b);
        INFO(w_old << " -> " << w_new << " ranks, " << ps.size() << " parameters, buckets "
                   << from.bucket_bytes << " -> " << to.bucket_bytes);
        for (int r = 0; r < w_new; ++r) { check_load(from, to, r); }
      }
    }
  }
}

TEST_CASE("zero checkpoint: a round trip to the same plan reads each shard whole", "[host]") {
  std::vector<z::param_spec> ps{{"a", 1000, z::element_type::bf16},
                                {"b", 5000, z::element_type::bf16}};
  auto const pl = z::make_plan(ps, 1 << 20, 4);
  std::vector<z::fragment_table> tables;
  for (int r = 0; r < 4; ++r) { tables.push_back(z::fragment_table_of(pl, r)); }
  for (int r = 0; r < 4; ++r) {
    auto const reads = z::plan_shard_reads(tables, pl, r);
    for (auto const& rd : reads) {
      CHECK(rd.file == static_cast<std::size_t>(r));
      CHECK(rd.file_offset == rd.dest_offset);
    }
    check_load(pl, pl, r);
  }
}

TEST_CASE("zero checkpoint: missing, resized and doubly stored parameters are errors", "[host]") {
  std::vector<z::param_spec> ps{{"a", 300, z::element_type::bf16},
                                {"b", 500, z::element_type::f32}};
  auto const pl = z::make_plan(ps, 4096, 2);
  std::vector<z::fragment_table> tables{z::fragment_table_of(pl, 0), z::fragment_table_of(pl, 1)};

  SECTION("a file lost") {
    std::vector<z::fragment_table> one{tables[0]};
    auto const target = z::make_plan(ps, 4096, 1);
    CHECK_THROWS_AS(z::plan_shard_reads(one, target, 0), wm::io_error);
  }
  SECTION("a parameter of another size") {
    std::vector<z::param_spec> grown{{"a", 301, z::element_type::bf16},
                                     {"b", 500, z::element_type::f32}};
    auto const target = z::make_plan(grown, 4096, 3);
    CHECK_THROWS_AS(z::plan_shard_reads(tables, target, 0), wm::io_error);
  }
  SECTION("a parameter the checkpoint lacks") {
    std::vector<z::param_spec> more{{"a", 300, z::element_type::bf16},
                                    {"b", 500, z::element_type::f32},
                                    {"c", 7, z::element_type::f32}};
    auto const target = z::make_plan(more, 4096, 2);
    bool threw        = false;
    for (int r = 0; r < 2; ++r) {  // whichever rank holds c throws
      try {
        (void)z::plan_shard_reads(tables, target, r);
      } catch (wm::io_error const&) { threw = true; }
    }
    CHECK(threw);
  }
  SECTION("the same elements in two files") {
    std::vector<z::fragment_table> twice{tables[0], tables[1], tables[0]};
    CHECK_THROWS_AS(z::plan_shard_reads(twice, pl, 0), wm::io_error);
  }
  SECTION("a parameter the model dropped is left out") {
    std::vector<z::param_spec> fewer{{"b", 500, z::element_type::f32}};
    auto const target = z::make_plan(fewer, 4096, 3);
    for (int r = 0; r < 3; ++r) { check_load(pl, target, r); }
  }
}
