// SPDX-License-Identifier: Apache-2.0
// Host tests: the shard files of wm::zero_optimizer (detail/zero/checkpoint.hpp). States saved
// by W ranks with one bucket size load into W' ranks with another: every element of every
// parameter arrives where the new plan wants it, in every stream; corrupt files are refused.
#include <wm/detail/zero/checkpoint.hpp>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"

namespace z = wm::detail::zero;

namespace {

// The value of element i of parameter p in stream s: unique, exact in float.
float value(std::size_t p, std::size_t i, std::size_t s, std::uint32_t salt) {
  return static_cast<float>((p * 100003 + i * 7 + s * 1000 + salt) % 8388593);
}

std::vector<z::param_spec> model() {
  return {
      {"emb", 185}, {"w1", 2112}, {"b1", 33},  {"empty", 0}, {"scale", 19, z::element_type::f32},
      {"w2", 231},  {"s", 1},     {"w3", 1000}};
}

}  // namespace

TEST_CASE("zero checkpoint: save with W ranks, load with W' ranks and another bucket size",
          "[host]") {
  auto const params         = model();
  std::uint32_t const salt  = std::random_device{}() % 1000;
  int const from            = GENERATE(1, 3, 4);
  int const to              = GENERATE(1, 2, 3, 8);
  std::size_t const streams = 3;  // master, m, v
  auto const dir =
      std::filesystem::temp_directory_path() / ("wm-zero-ckpt-test-" + std::to_string(salt) + "-" +
                                                std::to_string(from) + "-" + std::to_string(to));
  std::filesystem::create_directories(dir);
  auto const old_plan = z::make_plan(params, 1024, from);
  for (int r = 0; r < from; ++r) {
    std::vector<std::vector<float>> data(streams,
                                         std::vector<float>(old_plan.state_elements, -1.0f));
    for (auto const& f : old_plan.fragments(r)) {
      for (std::size_t j = 0; j < f.elements; ++j) {
        for (std::size_t s = 0; s < streams; ++s) {
          data[s][f.state_offset + j] = value(f.param, f.param_offset + j, s, salt);
        }
      }
    }
    std::vector<std::span<float const>> spans(data.begin(), data.end());
    z::shard_header h{static_cast<std::uint64_t>(from),
                      static_cast<std::uint64_t>(r),
                      old_plan.state_elements,
                      streams,
                      5,
                      "adam",
                      "tag",
                      {},
                      0};
    z::write_shard(z::shard_file(dir, r), h, z::fragment_table_of(old_plan, r), spans);
  }
  auto const new_plan = z::make_plan(params, 4096, to);
  auto const h0       = z::read_shard_header(z::shard_file(dir, 0));
  REQUIRE(h0.world == static_cast<std::uint64_t>(from));
  REQUIRE(h0.applied == 5);
  REQUIRE(h0.optimizer == "adam");
  REQUIRE(h0.tag == "tag");
  std::vector<std::filesystem::path> files;
  std::vector<z::shard_header> headers;
  std::vector<z::fragment_table> tables;
  for (int r = 0; r < from; ++r) {
    files.push_back(z::shard_file(dir, r));
    headers.push_back(z::read_shard_header(files.back()));
    tables.push_back(headers.back().table);
  }
  for (int r = 0; r < to; ++r) {
    auto const reads = z::plan_shard_reads(tables, new_plan, r);
    std::vector<std::vector<float>> out(streams, std::vector<float>(new_plan.state_elements, 0));
    std::vector<std::span<float>> spans(out.begin(), out.end());
    z::read_shards(files, headers, reads, spans);
    std::vector<char> covered(new_plan.state_elements, 0);
    for (auto const& f : new_plan.fragments(r)) {
      for (std::size_t j = 0; j < f.elements; ++j) {
        covered[f.state_offset + j] = 1;
        for (std::size_t s = 0; s < streams; ++s) {
          REQUIRE(out[s][f.state_offset + j] == value(f.param, f.param_offset + j, s, salt));
        }
      }
    }
    for (std::size_t i = 0; i < covered.size(); ++i) {
      if (covered[i] == 0) {
        for (std::size_t s = 0; s < streams; ++s) { REQUIRE(out[s][i] == 0.0f); }  // padding
      }
    }
  }
  // A truncated file and a foreign file are refused.
  {
    auto const f    = z::shard_file(dir, 0);
    auto const size = std::filesystem::file_size(f);
    std::filesystem::resize_file(f, size - 4);
    REQUIRE_THROWS_AS(z::read_shard_header(f), wm::io_error);
    std::ofstream{f, std::ios::binary | std::ios::trunc} << "not a shard at all";
    REQUIRE_THROWS_AS(z::read_shard_header(f), wm::io_error);
    REQUIRE_THROWS_AS(z::read_shard_header(dir / "missing.zero"), wm::io_error);
  }
  std::filesystem::remove_all(dir);
}
