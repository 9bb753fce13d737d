// SPDX-License-Identifier: Apache-2.0
// Host tests: the block partition plan, VMM chunk boundaries, file read plans and size checks.
#include <wm/detail/memory/plan.hpp>
#include <wm/partition.hpp>

#include <random>
#include <vector>

#include "catch.hpp"

namespace {
std::vector<std::size_t> counts_of(wm::block_partition const& p) {
  std::vector<std::size_t> c;
  for (int r = 0; r < p.world(); ++r) { c.push_back(p.count(r)); }
  return c;
}

// Reference plan written from the formula of docs/design.md, "Partition plan", entry by entry.
void check_against_reference(std::size_t entries, int world, wm::block_partition const& p) {
  std::size_t const per = (entries + world - 1) / world;
  for (int r = 0; r < world; ++r) {
    CHECK(p.begin(r) == std::min(r * per, entries));
    CHECK(p.end(r) == std::min((r + 1) * per, entries));
  }
  for (std::size_t e = 0; e < entries; e += 1 + entries / 97) {
    int const o = p.owner(e);
    CHECK(p.begin(o) <= e);
    CHECK(e < p.end(o));
  }
}
}  // namespace

TEST_CASE("block partition follows the plan for 1 to 8 ranks", "[host]") {
  CHECK(counts_of(wm::block_partition{15, 4}) == std::vector<std::size_t>{4, 4, 4, 3});
  CHECK(counts_of(wm::block_partition{9, 8}) == std::vector<std::size_t>{2, 2, 2, 2, 1, 0, 0, 0});
  CHECK(counts_of(wm::block_partition{0, 3}) == std::vector<std::size_t>{0, 0, 0});
  CHECK(counts_of(wm::block_partition{1, 2}) == std::vector<std::size_t>{1, 0});
  CHECK(counts_of(wm::block_partition{16, 4}) == std::vector<std::size_t>{4, 4, 4, 4});
  std::mt19937_64 rng{std::random_device{}()};
  for (int world = 1; world <= 8; ++world) {
    for (std::size_t entries :
         {std::size_t{0}, std::size_t{1}, std::size_t(world), std::size_t(world) * 7 + 3,
          std::size_t(rng() % 100000), std::size_t{1} << 40}) {
      wm::block_partition const p{entries, world};
      check_against_reference(entries, world, p);
      CHECK(p.end(world - 1) == entries);
    }
  }
  CHECK_THROWS_AS(wm::block_partition(10, 0), wm::logic_error);
  CHECK_THROWS_AS((wm::block_partition{15, 4}.owner(15)), wm::logic_error);
}

TEST_CASE("a user-given entry list replaces the plan", "[host]") {
  std::vector<std::size_t> const counts{0, 5, 0, 2};
  wm::block_partition const p{7, 4, counts};
  CHECK(counts_of(p) == counts);
  CHECK(p.per_rank() == 0);
  for (std::size_t e = 0; e < 5; ++e) { CHECK(p.owner(e) == 1); }
  CHECK(p.owner(5) == 3);
  CHECK(p.owner(6) == 3);
  std::vector<std::size_t> const first_only{3, 0, 0};
  wm::block_partition const q{3, 3, first_only};
  for (std::size_t e = 0; e < 3; ++e) { CHECK(q.owner(e) == 0); }
  // A list equal to the default plan is the default plan (owner() divides instead of searching).
  for (int world = 1; world <= 8; ++world) {
    for (std::size_t entries :
         {std::size_t{0}, std::size_t{1}, std::size_t{9}, std::size_t{15}, std::size_t{1000}}) {
      wm::block_partition const plan{entries, world};
      wm::block_partition const listed{entries, world, wm::block::counts(entries, world)};
      CHECK(listed == plan);
      CHECK(listed.per_rank() == plan.per_rank());
      CHECK(listed.per_rank() > 0);
    }
  }
  std::vector<std::size_t> const almost{4, 4, 3, 4};  // not the plan of 15 over 4
  CHECK(wm::block_partition{15, 4, almost}.per_rank() == 0);
  CHECK(wm::block_partition{15, 4, almost}.owner(11) == 3);
  CHECK_THROWS_AS((wm::block_partition{8, 4, counts}), wm::logic_error);  // sum differs
  CHECK_THROWS_AS((wm::block_partition{7, 3, counts}), wm::logic_error);  // wrong length
}

TEST_CASE("VMM chunk boundaries are granule-aligned and follow the partition", "[host]") {
  std::size_t const G = std::size_t{2} << 20;
  for (int world = 1; world <= 8; ++world) {
    for (std::size_t gran :
         {std::size_t{1}, std::size_t{12}, std::size_t{1000}, std::size_t{4096}}) {
      for (std::size_t entries : {std::size_t{0}, std::size_t{1}, std::size_t{9},
                                  std::size_t{123457}, std::size_t{10'000'019}}) {
        wm::block_partition const p{entries, world};
        auto const total = entries * gran;
        auto const b     = wm::detail::vmm_boundaries(p.starts(), gran, G, total);
        REQUIRE(b.size() == static_cast<std::size_t>(world) + 1);
        CHECK(b.front() == 0);
        CHECK(b.back() >= total);
        CHECK(b.back() < total + G);
        for (int r = 0; r < world; ++r) {
          CHECK(b[r] % G == 0);
          CHECK(b[r] <= b[r + 1]);
          // Rank r's logical part starts in its own chunk or less than one granule before it.
          if (p.count(r) > 0 && r > 0) {
            CHECK(b[r] <= p.begin(r) * gran);
            CHECK(p.begin(r) * gran - b[r] < G);
          }
        }
      }
    }
  }
}

TEST_CASE("file lists are read as one concatenated range", "[host]") {
  std::vector<std::uint64_t> const sizes{10, 0, 5, 20};
  using seg = wm::detail::file_segment;
  CHECK(wm::detail::plan_reads(sizes, 0, 35) ==
        std::vector<seg>{{0, 0, 10, 0}, {2, 0, 5, 10}, {3, 0, 20, 15}});
  CHECK(wm::detail::plan_reads(sizes, 8, 12) == std::vector<seg>{{0, 8, 2, 0}, {2, 0, 2, 2}});
  CHECK(wm::detail::plan_reads(sizes, 15, 35) == std::vector<seg>{{3, 0, 20, 0}});
  CHECK(wm::detail::plan_reads(sizes, 12, 12).empty());
  CHECK_THROWS_AS(wm::detail::plan_reads(sizes, 30, 36), wm::logic_error);

  // Random lists: every byte of the range comes from the right file offset, exactly once.
  std::mt19937_64 rng{std::random_device{}()};
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<std::uint64_t> sz(1 + rng() % 6);
    std::uint64_t total = 0;
    for (auto& s : sz) {
      s = rng() % 3 == 0 ? 0 : rng() % 1000;
      total += s;
    }
    std::uint64_t const a = total == 0 ? 0 : rng() % (total + 1);
    std::uint64_t const b = a + (total == a ? 0 : rng() % (total - a + 1));
    std::vector<std::uint64_t> got(b - a, ~0ull);
    for (auto const& s : wm::detail::plan_reads(sz, a, b)) {
      std::uint64_t file_start = 0;
      for (std::size_t f = 0; f < s.file; ++f) { file_start += sz[f]; }
      for (std::uint64_t i = 0; i < s.length; ++i) {
        REQUIRE(got[s.dest + i] == ~0ull);
        got[s.dest + i] = file_start + s.offset + i;
      }
    }
    for (std::uint64_t i = 0; i < got.size(); ++i) { REQUIRE(got[i] == a + i); }
  }
}

TEST_CASE("file sizes must fit the memory and its granularity", "[host]") {
  std::vector<std::string> const names{"a.bin", "b.bin"};
  std::vector<std::uint64_t> ok{24, 12};
  CHECK(wm::detail::check_file_sizes(ok, names, 36, 12).empty());
  std::vector<std::uint64_t> odd{25, 11};
  CHECK(wm::detail::check_file_sizes(odd, names, 36, 12).find("a.bin") != std::string::npos);
  CHECK(wm::detail::check_file_sizes(ok, names, 48, 12).find("36 bytes") != std::string::npos);
}

#include <filesystem>
#include <fstream>

TEST_CASE("files are checked and read as one concatenated byte range", "[host]") {
  namespace fs = std::filesystem;
  std::mt19937_64 rng{std::random_device{}()};
  auto const dir = fs::temp_directory_path() / ("wm-files-test-" + std::to_string(rng()));
  fs::create_directories(dir);
  // Random contents split into files of random sizes that are multiples of 12 bytes (some empty).
  std::size_t const gran = 12;
  std::vector<std::byte> all;
  std::vector<fs::path> files;
  for (int f = 0; f < 5; ++f) {
    std::size_t const bytes = f == 2 ? 0 : gran * (rng() % 300);
    std::vector<std::byte> part(bytes);
    for (auto& b : part) { b = static_cast<std::byte>(rng()); }
    files.push_back(dir / ("part" + std::to_string(f)));
    std::ofstream{files.back(), std::ios::binary}.write(reinterpret_cast<char const*>(part.data()),
                                                        static_cast<std::streamsize>(bytes));
    all.insert(all.end(), part.begin(), part.end());
  }
  auto const sizes = wm::detail::checked_sizes(files, all.size(), gran);
  for (int trial = 0; trial < 30; ++trial) {
    std::uint64_t const a = all.empty() ? 0 : rng() % (all.size() + 1);
    std::uint64_t const b = a + (all.size() == a ? 0 : rng() % (all.size() - a + 1));
    std::vector<std::byte> got(b - a, std::byte{0xA5});
    wm::detail::read_concatenated(files, sizes, a, b, got.data());
    REQUIRE(std::equal(got.begin(), got.end(), all.begin() + static_cast<std::ptrdiff_t>(a)));
  }
  // Wrong total, a size off the granularity, a missing file: clear errors naming the problem.
  CHECK_THROWS_AS(wm::detail::checked_sizes(files, all.size() + gran, gran), wm::io_error);
  CHECK_THROWS_AS(wm::detail::checked_sizes(files, all.size(), 7 * gran + 1), wm::io_error);
  std::vector<fs::path> missing{dir / "nope"};
  try {
    (void)wm::detail::checked_sizes(missing, 0, gran);
    FAIL("no error");
  } catch (wm::io_error const& e) {
    CHECK(std::string{e.what()}.find("nope") != std::string::npos);
  }
  std::vector<fs::path> none;
  CHECK_THROWS_AS(wm::detail::checked_sizes(none, 0, gran), wm::logic_error);
  // A file shorter than its recorded size: the read reports the end of file.
  std::vector<std::uint64_t> lying = sizes;
  lying.back() += gran;
  std::vector<std::byte> buf(all.size() + gran);
  CHECK_THROWS_AS(wm::detail::read_concatenated(files, lying, 0, all.size() + gran, buf.data()),
                  wm::io_error);
  // Row pieces cover the largest rank's share.
  CHECK(wm::detail::row_pieces(0, 4, 10) == 0);
  CHECK(wm::detail::row_pieces(15, 4, 4) == 1);
  CHECK(wm::detail::row_pieces(17, 4, 4) == 2);
  CHECK(wm::detail::row_pieces(1000, 1, 64) == 16);
  fs::remove_all(dir);
}
