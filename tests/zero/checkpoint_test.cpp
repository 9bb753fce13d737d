// SPDX-License-Identifier: Apache-2.0
// Host tests: the checkpoint files of wm::zero_optimizer (detail/zero/checkpoint.hpp), each rank
// a thread that agrees with the others through a fake all-gather. States saved by W ranks with
// one bucket size load into W' ranks with another: every element of every parameter arrives
// where the new plan wants it, in every stream; corrupt files are refused. A save is all or
// nothing: a rank that cannot write, or a communicator that fails at any step, leaves a whole
// checkpoint (the previous one until the manifest names the new one), never a mix.
#include <wm/detail/zero/checkpoint.hpp>

#include <barrier>
#include <cstddef>
#include <exception>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
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

constexpr std::size_t streams = 3;  // master, m, v

// W ranks as threads; gather() is their all-gather (every rank calls it the same number of
// times). A round from `fail_round` on (1-based) throws on every rank, as a communicator that
// failed would.
struct fake_world {
  explicit fake_world(int n) : world{n}, sync{n}, slots(static_cast<std::size_t>(n)) {}
  int world;
  std::barrier<> sync;
  std::vector<std::vector<std::byte>> slots;
  int fail_round{0};

  std::vector<std::vector<std::byte>> gather(int rank, int round, std::span<std::byte const> mine) {
    if (fail_round != 0 && round >= fail_round) { throw std::runtime_error{"communicator failed"}; }
    sync.arrive_and_wait();  // the previous round's results are read
    slots[static_cast<std::size_t>(rank)].assign(mine.begin(), mine.end());
    sync.arrive_and_wait();  // every rank's contribution is in
    return slots;
  }
};

// One save by `world` ranks of the state of `plan` (values of `salt`, `applied` steps); what
// each rank threw (empty: nothing).
std::vector<std::string> save_all(std::filesystem::path const& dir, z::plan const& plan, int world,
                                  std::int64_t applied, std::uint32_t salt, int fail_round = 0) {
  fake_world w{world};
  w.fail_round = fail_round;
  std::vector<std::string> errors(static_cast<std::size_t>(world));
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.emplace_back([&, r] {
      std::vector<std::vector<float>> data(streams, std::vector<float>(plan.state_elements, -1.0f));
      for (auto const& f : plan.fragments(r)) {
        for (std::size_t j = 0; j < f.elements; ++j) {
          for (std::size_t s = 0; s < streams; ++s) {
            data[s][f.state_offset + j] = value(f.param, f.param_offset + j, s, salt);
          }
        }
      }
      std::vector<std::span<float const>> spans(data.begin(), data.end());
      z::shard_header const h{static_cast<std::uint64_t>(world),
                              static_cast<std::uint64_t>(r),
                              plan.state_elements,
                              streams,
                              applied,
                              "adam",
                              "tag",
                              {},
                              0};
      int round = 0;
      try {
        (void)z::save_shards(
            dir, h, z::fragment_table_of(plan, r), spans,
            [&](std::span<std::byte const> mine) { return w.gather(r, ++round, mine); });
      } catch (std::exception const& e) { errors[static_cast<std::size_t>(r)] = e.what(); }
    });
  }
  for (auto& t : ranks) { t.join(); }
  return errors;
}

// Loads the checkpoint in dir into every rank of `plan` and checks it holds the values of
// `salt` and `applied` steps, padding zero.
void require_checkpoint(std::filesystem::path const& dir, z::plan const& plan, int world,
                        std::int64_t applied, std::uint32_t salt) {
  auto const stored = z::read_checkpoint(dir);
  REQUIRE(!stored.headers.empty());
  REQUIRE(stored.headers[0].applied == applied);
  REQUIRE(stored.headers[0].optimizer == "adam");
  REQUIRE(stored.headers[0].tag == "tag");
  std::vector<z::fragment_table> tables;
  for (auto const& h : stored.headers) { tables.push_back(h.table); }
  for (int r = 0; r < world; ++r) {
    auto const reads = z::plan_shard_reads(tables, plan, r);
    std::vector<std::vector<float>> out(streams, std::vector<float>(plan.state_elements, 0));
    std::vector<std::span<float>> spans(out.begin(), out.end());
    z::read_shards(stored.files, stored.headers, reads, spans);
    std::vector<char> covered(plan.state_elements, 0);
    for (auto const& f : plan.fragments(r)) {
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
}

// The names in dir.
std::set<std::string> names_in(std::filesystem::path const& dir) {
  std::set<std::string> out;
  for (auto const& e : std::filesystem::directory_iterator{dir}) {
    out.insert(e.path().filename().string());
  }
  return out;
}

// The names a committed save of `world` ranks in `generation` leaves.
std::set<std::string> committed_names(int world, std::uint64_t generation) {
  std::set<std::string> out{"manifest"};
  for (int r = 0; r < world; ++r) {
    out.insert("shard-" + std::to_string(r) + ".g" + std::to_string(generation) + ".zero");
  }
  return out;
}

std::filesystem::path fresh_dir(std::string const& what) {
  auto const dir = std::filesystem::temp_directory_path() /
                   ("wm-zero-ckpt-test-" + what + "-" + std::to_string(std::random_device{}()));
  std::filesystem::remove_all(dir);
  return dir;
}

}  // namespace

TEST_CASE("zero checkpoint: save with W ranks, load with W' ranks and another bucket size",
          "[host]") {
  auto const params        = model();
  std::uint32_t const salt = std::random_device{}() % 1000;
  int const from           = GENERATE(1, 3, 4);
  int const to             = GENERATE(1, 2, 3, 8);
  auto const dir = fresh_dir("reshard-" + std::to_string(from) + "-" + std::to_string(to) + "-" +
                             std::to_string(salt));
  auto const old_plan = z::make_plan(params, 1024, from);
  auto const errors   = save_all(dir, old_plan, from, 5, salt);
  for (auto const& e : errors) { REQUIRE(e.empty()); }
  REQUIRE(names_in(dir) == committed_names(from, 1));
  auto const new_plan = z::make_plan(params, 4096, to);
  require_checkpoint(dir, new_plan, to, 5, salt);
  // A truncated file and a foreign file are refused.
  {
    auto const f    = z::shard_file(dir, 0, 1);
    auto const size = std::filesystem::file_size(f);
    std::filesystem::resize_file(f, size - 4);
    REQUIRE_THROWS_AS(z::read_shard_header(f), wm::io_error);
    std::ofstream{f, std::ios::binary | std::ios::trunc} << "not a shard at all";
    REQUIRE_THROWS_AS(z::read_shard_header(f), wm::io_error);
    REQUIRE_THROWS_AS(z::read_shard_header(dir / "missing.zero"), wm::io_error);
    REQUIRE_THROWS_AS(z::read_checkpoint(dir), wm::io_error);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE(
    "zero checkpoint: a rank that cannot write fails the save on every rank and keeps the "
    "previous checkpoint",
    "[host]") {
  int const world      = GENERATE(1, 2, 3);
  int const failing    = GENERATE_COPY(values({0, world - 1}));  // the first, the last
  bool const same_step = GENERATE(false, true);  // the mix could not be told from the step count
  INFO("world " << world << ", rank " << failing << " fails, same step " << same_step);
  auto const plan = z::make_plan(model(), 1024, world);
  auto const dir  = fresh_dir("fail");
  for (auto const& e : save_all(dir, plan, world, 1, 11)) { REQUIRE(e.empty()); }
  // The failing rank cannot create its temporary file: a directory has its name.
  auto const blocker = z::shard_temp_file(dir, failing);
  std::filesystem::create_directory(blocker);
  auto const errors = save_all(dir, plan, world, same_step ? 1 : 2, 22);
  for (int r = 0; r < world; ++r) {
    INFO("rank " << r << ": " << errors[static_cast<std::size_t>(r)]);
    auto const& e = errors[static_cast<std::size_t>(r)];
    REQUIRE(e.find("zero_optimizer::save failed") != std::string::npos);
    REQUIRE(e.find("rank " + std::to_string(failing) + ": wm: cannot write '" + blocker.string() +
                   "'") != std::string::npos);
    REQUIRE(e.find("previous checkpoint") != std::string::npos);
  }
  require_checkpoint(dir, plan, world, 1, 11);
  auto expected = committed_names(world, 1);
  expected.insert(blocker.filename().string());  // no other rank's temporary file is left
  REQUIRE(names_in(dir) == expected);
  // The next save, once the rank can write, replaces the checkpoint whole.
  std::filesystem::remove(blocker);
  for (auto const& e : save_all(dir, plan, world, 3, 33)) { REQUIRE(e.empty()); }
  require_checkpoint(dir, plan, world, 3, 33);
  REQUIRE(names_in(dir) == committed_names(world, 2));
  std::filesystem::remove_all(dir);
}

TEST_CASE(
    "zero checkpoint: a communicator that fails at any step of a save leaves a whole "
    "checkpoint",
    "[host]") {
  int const world = GENERATE(1, 3);
  int const round = GENERATE(1, 2, 3);  // the exchange after writing, renaming, the manifest
  INFO("world " << world << ", exchange " << round << " fails");
  auto const plan = z::make_plan(model(), 1024, world);
  auto const dir  = fresh_dir("abort");
  for (auto const& e : save_all(dir, plan, world, 1, 11)) { REQUIRE(e.empty()); }
  for (auto const& e : save_all(dir, plan, world, 2, 22, round)) {
    REQUIRE(e == "communicator failed");
  }
  // Until rank 0 has renamed the manifest (before the third exchange) the old one loads.
  if (round < 3) {
    require_checkpoint(dir, plan, world, 1, 11);
  } else {
    require_checkpoint(dir, plan, world, 2, 22);
  }
  // What the failed save left behind (its renamed files, whose fate was unknown) goes with the
  // next one, whose generation is past theirs.
  for (auto const& e : save_all(dir, plan, world, 3, 33)) { REQUIRE(e.empty()); }
  require_checkpoint(dir, plan, world, 3, 33);
  REQUIRE(names_in(dir) == committed_names(world, round == 1 ? 2 : 3));
  std::filesystem::remove_all(dir);
}

TEST_CASE("zero checkpoint: files the manifest does not name are never read", "[host]") {
  auto const plan = z::make_plan(model(), 1024, 2);
  auto const dir  = fresh_dir("stray");
  for (auto const& e : save_all(dir, plan, 2, 1, 11)) { REQUIRE(e.empty()); }
  // What a crashed save could leave: a later generation's file, a temporary file, garbage.
  std::ofstream{dir / "shard-0.g7.zero", std::ios::binary} << "half a shard";
  std::ofstream{dir / "shard-1.zero.tmp", std::ios::binary} << "half a shard";
  std::ofstream{dir / "shard-0.zero", std::ios::binary} << "an old layout's file";
  require_checkpoint(dir, plan, 2, 1, 11);
  // The next save's generation is past every one in the directory, and it removes the others.
  for (auto const& e : save_all(dir, plan, 2, 2, 22)) { REQUIRE(e.empty()); }
  require_checkpoint(dir, plan, 2, 2, 22);
  REQUIRE(names_in(dir) == committed_names(2, 8));
  // A manifest whose files are missing, or of another save, is refused.
  std::filesystem::remove(z::shard_file(dir, 1, 8));
  REQUIRE_THROWS_AS(z::read_checkpoint(dir), wm::io_error);
  std::filesystem::remove(z::manifest_file(dir));
  REQUIRE_THROWS_AS(z::read_checkpoint(dir), wm::io_error);  // no checkpoint
  std::ofstream{z::manifest_file(dir)} << "wm-zero-manifest 1\ngeneration 8\nworld 1\napplied 5\n";
  REQUIRE_THROWS_AS(z::read_checkpoint(dir), wm::io_error);  // shard-0 says step 2
  std::ofstream{z::manifest_file(dir)} << "not a manifest";
  REQUIRE_THROWS_AS(z::read_checkpoint(dir), wm::io_error);
  std::filesystem::remove_all(dir);
}

TEST_CASE("zero checkpoint: a directory saved before manifests loads", "[host]") {
  auto const plan = z::make_plan(model(), 1024, 2);
  auto const dir  = fresh_dir("legacy");
  std::filesystem::create_directories(dir);
  for (int r = 0; r < 2; ++r) {
    std::vector<std::vector<float>> data(streams, std::vector<float>(plan.state_elements, 0));
    for (auto const& f : plan.fragments(r)) {
      for (std::size_t j = 0; j < f.elements; ++j) {
        for (std::size_t s = 0; s < streams; ++s) {
          data[s][f.state_offset + j] = value(f.param, f.param_offset + j, s, 44);
        }
      }
    }
    std::vector<std::span<float const>> spans(data.begin(), data.end());
    z::shard_header const h{
        2, static_cast<std::uint64_t>(r), plan.state_elements, streams, 4, "adam", "tag", {}, 0};
    z::write_shard(z::legacy_shard_file(dir, r), h, z::fragment_table_of(plan, r), spans);
  }
  require_checkpoint(dir, z::make_plan(model(), 4096, 3), 3, 4, 44);
  // A new save replaces it (and removes its files).
  for (auto const& e : save_all(dir, plan, 2, 5, 55)) { REQUIRE(e.empty()); }
  require_checkpoint(dir, plan, 2, 5, 55);
  REQUIRE(names_in(dir) == committed_names(2, 1));
  std::filesystem::remove_all(dir);
}

TEST_CASE("zero checkpoint: a shard that cannot be written in full is removed", "[host]") {
  // /dev/full takes the open and fails every write (ENOSPC): write_shard throws and removes
  // what it began, here the link.
  if (!std::filesystem::exists("/dev/full")) {
    WARN("no /dev/full here: the case is not run");
    return;
  }
  auto const dir = fresh_dir("enospc");
  std::filesystem::create_directories(dir);
  auto const file = dir / "shard-0.zero.tmp";
  std::filesystem::create_symlink("/dev/full", file);
  std::vector<float> data(1 << 16, 1.0f);
  std::vector<std::span<float const>> spans{data};
  z::shard_header const h{1, 0, data.size(), 1, 1, "sgd", "", {}, 0};
  REQUIRE_THROWS_AS(z::write_shard(file, h, {}, spans), wm::io_error);
  REQUIRE(!std::filesystem::exists(std::filesystem::symlink_status(file)));
  std::filesystem::remove_all(dir);
}
