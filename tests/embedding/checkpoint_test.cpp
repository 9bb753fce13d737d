// SPDX-License-Identifier: Apache-2.0
// Host tests of the checkpoint checks (detail/embedding/checkpoint_meta.hpp): the meta text
// round trip, refusals of malformed metas, every field that must match a table, and the part
// files' exact sizes.
#include <wm/detail/embedding/checkpoint_meta.hpp>
#include <wm/optimizer.hpp>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"

namespace {

wm::detail::checkpoint_meta sample() {
  wm::detail::checkpoint_meta m;
  m.rows          = 5'000'000'123;
  m.dim           = 19;
  m.world         = 3;
  m.global_step   = 77;
  m.dtype         = "float16";
  m.dtype_bytes   = 2;
  m.optimizer     = "adam";
  m.optimizer_tag = wm::checkpoint_tag(wm::adam{});
  m.states        = 2;
  m.steps         = true;
  return m;
}

std::string replace_line(std::string text, std::string const& key, std::string const& line) {
  auto const at  = text.find("\n" + key + " ");
  auto const end = text.find('\n', at + 1);
  return text.replace(at + 1, end - at - 1, line);
}

}  // namespace

TEST_CASE("checkpoint meta: format and parse round trip", "[host]") {
  auto const m    = sample();
  auto const back = wm::detail::parse_meta(wm::detail::format_meta(m), "x.meta");
  CHECK(back.rows == m.rows);
  CHECK(back.dim == m.dim);
  CHECK(back.world == m.world);
  CHECK(back.global_step == m.global_step);
  CHECK(back.dtype == m.dtype);
  CHECK(back.dtype_bytes == m.dtype_bytes);
  CHECK(back.optimizer == m.optimizer);
  CHECK(back.optimizer_tag == "bias_correction=per_row epsilon=torch_adam");
  CHECK(back.states == m.states);
  CHECK(back.steps == m.steps);
  CHECK(back.weight_row_bytes() == 38);
  CHECK(back.state_row_bytes() == 2 * 19 * 4);
  // An optimizer without a tag: the empty tag survives.
  auto s          = m;
  s.optimizer     = "sgd";
  s.optimizer_tag = "";
  s.states        = 0;
  s.steps         = false;
  auto const b2   = wm::detail::parse_meta(wm::detail::format_meta(s), "x.meta");
  CHECK(b2.optimizer_tag.empty());
  CHECK_NOTHROW(wm::detail::check_meta_fits(b2, s, "x"));
}

TEST_CASE("checkpoint meta: malformed texts are refused with io_error", "[host]") {
  auto const good = wm::detail::format_meta(sample());
  auto refused    = [](std::string const& text) {
    try {
      (void)wm::detail::parse_meta(text, "x.meta");
    } catch (wm::io_error const& e) {
      return std::string{e.what()}.find("x.meta") != std::string::npos;
    }
    return false;
  };
  CHECK(!refused(good));
  CHECK(refused(""));
  CHECK(refused("not-wm 2\n"));
  CHECK(refused(
      "wm-embedding 1\nrows 5\ndim 2\nworld 1\nglobal_step 0\noptimizer sgd\nstates 0\nsteps 0\n"));
  for (char const* key : {"rows", "dim", "world", "global_step", "dtype", "optimizer",
                          "optimizer_tag", "states", "steps"}) {
    INFO(key);
    auto const at  = good.find(std::string{"\n"} + key + " ");
    auto const end = good.find('\n', at + 1);
    CHECK(refused(std::string{good}.erase(at + 1, end - at)));  // the line removed
  }
  CHECK(refused(replace_line(good, "rows", "rows 12x")));
  CHECK(refused(replace_line(good, "world", "world 0")));
  CHECK(refused(replace_line(good, "world", "world 99999999")));
  CHECK(refused(replace_line(good, "steps", "steps 2")));
  CHECK(refused(replace_line(good, "dtype", "dtype float16")));
  CHECK(refused(replace_line(good, "optimizer", "optimizer ")));
  CHECK(refused(good + "rows 5\n"));  // a key twice
}

TEST_CASE("checkpoint meta: every field a table depends on must match", "[host]") {
  auto const table  = sample();
  auto found        = table;
  found.world       = 8;  // any rank count loads
  found.global_step = 5;
  CHECK_NOTHROW(wm::detail::check_meta_fits(found, table, "ck"));
  auto mismatch = [&](auto change, char const* word) {
    auto f = table;
    change(f);
    try {
      wm::detail::check_meta_fits(f, table, "ck");
    } catch (wm::io_error const& e) {
      INFO(e.what());
      CHECK(std::string{e.what()}.find(word) != std::string::npos);
      return true;
    }
    return false;
  };
  CHECK(mismatch([](auto& f) { f.rows += 1; }, "rows"));
  CHECK(mismatch([](auto& f) { f.dim = 20; }, "dim"));
  CHECK(mismatch([](auto& f) { f.dtype = "float32"; }, "dtype"));
  CHECK(mismatch([](auto& f) { f.dtype_bytes = 4; }, "dtype bytes"));
  CHECK(mismatch([](auto& f) { f.optimizer = "rmsprop"; }, "optimizer"));
  CHECK(mismatch([](auto& f) { f.states = 1; }, "states"));
  CHECK(mismatch([](auto& f) { f.steps = false; }, "steps"));
  wm::adam global;
  global.bias_correction = wm::adam_bias_correction::global_step;
  CHECK(mismatch([&](auto& f) { f.optimizer_tag = wm::checkpoint_tag(global); }, "global_step"));
  wm::adam sparse_eps;
  sparse_eps.epsilon = wm::adam_epsilon::sparse_adam;
  CHECK(
      mismatch([&](auto& f) { f.optimizer_tag = wm::checkpoint_tag(sparse_eps); }, "sparse_adam"));
}

TEST_CASE("checkpoint parts: exact sizes per rank; a missing or short file is refused", "[host]") {
  using sizes = std::vector<std::uint64_t>;
  CHECK(wm::detail::part_sizes(15, 4, 3) == sizes{12, 12, 12, 9});
  CHECK(wm::detail::part_sizes(9, 8, 1) == sizes{2, 2, 2, 2, 1, 0, 0, 0});
  CHECK(wm::detail::part_sizes(0, 2, 8) == sizes{0, 0});
  CHECK(wm::detail::part_sizes((std::size_t{1} << 32) + 1, 1, 1) ==
        sizes{(std::uint64_t{1} << 32) + 1});

  auto const dir = std::filesystem::temp_directory_path() /
                   ("wm-ckpt-host-" + std::to_string(std::random_device{}()));
  std::filesystem::create_directories(dir);
  std::vector<std::filesystem::path> files{dir / "a.bin", dir / "b.bin"};
  std::ofstream{files[0], std::ios::binary} << std::string(12, 'x');
  std::ofstream{files[1], std::ios::binary} << std::string(9, 'y');
  sizes const want{12, 9};
  CHECK_NOTHROW(wm::detail::check_part_files(files, want));
  CHECK_THROWS_AS(wm::detail::check_part_files(files, sizes{12, 10}), wm::io_error);
  std::filesystem::remove(files[1]);
  CHECK_THROWS_AS(wm::detail::check_part_files(files, want), wm::io_error);
  CHECK_THROWS_AS((void)wm::detail::read_text_file(dir / "none.meta"), wm::io_error);
  CHECK(wm::detail::temporary_name(files[0]).string() == files[0].string() + ".tmp");
  std::filesystem::remove_all(dir);
}
