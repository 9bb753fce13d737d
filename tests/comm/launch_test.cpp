// Host tests of the rank launcher (fork, failure reporting, id relay) and the environment
// entry point. No GPU: the bodies below do not touch CUDA.
#include "catch.hpp"
#include "rank_check.hpp"

#include <wm/launch.hpp>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <random>
#include <thread>

using namespace std::chrono_literals;

namespace {
wm::launch_options quick() { return {std::chrono::seconds{20}, std::chrono::milliseconds{500}}; }

wm::rank_failure const* failure_of(wm::launch_error const& e, int rank)
{
  for (auto const& f : e.failures()) {
    if (f.rank == rank) { return &f; }
  }
  return nullptr;
}
}  // namespace

TEST_CASE("fork_ranks runs every rank and relays what rank 0 publishes", "[host]")
{
  int const n = GENERATE(1, 2, 5);
  std::mt19937_64 rng{std::random_device{}()};
  std::string const secret = std::to_string(rng());
  REQUIRE_NOTHROW(wm::detail::fork_ranks(
    n,
    [&](wm::detail::rank_context& ctx) {
      RANK_REQUIRE(ctx.size() == n);
      if (ctx.rank() == 0) { ctx.publish(secret + "/from-0"); }
      RANK_REQUIRE(ctx.receive_published(5s) == secret + "/from-0");
    },
    quick()));
}

TEST_CASE("fork_ranks names a rank that throws and stops the others quickly", "[host]")
{
  auto const start = std::chrono::steady_clock::now();
  try {
    wm::detail::fork_ranks(
      3,
      [](wm::detail::rank_context& ctx) {
        if (ctx.rank() == 1) { throw std::runtime_error{"boom from rank one"}; }
        if (ctx.rank() == 2) { std::this_thread::sleep_for(60s); }  // a rank stuck waiting
      },
      quick());
    FAIL("no launch_error");
  } catch (wm::launch_error const& e) {
    auto const took = std::chrono::steady_clock::now() - start;
    CHECK(took < 10s);
    auto const* one = failure_of(e, 1);
    REQUIRE(one != nullptr);
    CHECK(one->primary);
    CHECK(one->reason.find("boom from rank one") != std::string::npos);
    auto const* two = failure_of(e, 2);
    REQUIRE(two != nullptr);
    CHECK_FALSE(two->primary);
    CHECK(two->reason.find("after rank 1 failed") != std::string::npos);
    CHECK(failure_of(e, 0) == nullptr);  // rank 0 finished normally
    CHECK(std::string{e.what()}.find("rank 1: threw") != std::string::npos);
  }
}

TEST_CASE("fork_ranks reports signals, exit codes and timeouts", "[host]")
{
  SECTION("a rank dies of a signal and another exits non-zero")
  {
    try {
      wm::detail::fork_ranks(
        3,
        [](wm::detail::rank_context& ctx) {
          if (ctx.rank() == 0) {
            std::signal(SIGABRT, SIG_DFL);  // not Catch2's handler, inherited by fork
            std::abort();
          }
          if (ctx.rank() == 2) { std::_Exit(3); }
        },
        quick());
      FAIL("no launch_error");
    } catch (wm::launch_error const& e) {
      REQUIRE(failure_of(e, 0) != nullptr);
      CHECK(failure_of(e, 0)->reason.find("signal 6") != std::string::npos);
      REQUIRE(failure_of(e, 2) != nullptr);
      CHECK(failure_of(e, 2)->reason.find("exited with code 3") != std::string::npos);
      CHECK(failure_of(e, 1) == nullptr);
    }
  }
  SECTION("every rank hangs: the whole-run timeout ends them")
  {
    auto const start = std::chrono::steady_clock::now();
    try {
      wm::detail::fork_ranks(
        2, [](wm::detail::rank_context&) { std::this_thread::sleep_for(60s); },
        {std::chrono::milliseconds{700}, std::chrono::milliseconds{100}});
      FAIL("no launch_error");
    } catch (wm::launch_error const& e) {
      CHECK(std::chrono::steady_clock::now() - start < 10s);
      REQUIRE(e.failures().size() == 2);
      for (auto const& f : e.failures()) {
        CHECK(f.reason.find("timed out") != std::string::npos);
      }
    }
  }
  SECTION("rank 0 dies before publishing: the waiting ranks do not hang")
  {
    auto const start = std::chrono::steady_clock::now();
    CHECK_THROWS_AS(wm::detail::fork_ranks(
                      3,
                      [](wm::detail::rank_context& ctx) {
                        if (ctx.rank() == 0) { std::_Exit(9); }
                        (void)ctx.receive_published(60s);
                      },
                      quick()),
                    wm::launch_error);
    CHECK(std::chrono::steady_clock::now() - start < 10s);
  }
  CHECK_THROWS_AS(wm::detail::fork_ranks(0, [](wm::detail::rank_context&) {}, quick()),
                  wm::logic_error);
}

TEST_CASE("read_launch_env reads rank, size, local rank and the id source", "[host]")
{
  std::map<std::string, std::string> vars;
  auto get = [&](char const* k) -> char const* {
    auto it = vars.find(k);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
  SECTION("wm's own variables win over torchrun-style ones")
  {
    vars = {{"WM_RANK", "3"}, {"WM_WORLD_SIZE", "8"}, {"RANK", "1"}, {"WORLD_SIZE", "2"},
            {"LOCAL_RANK", "1"}, {"WM_ID_FILE", "/tmp/x"}};
    auto const env = wm::read_launch_env(get);
    CHECK(env.rank == 3);
    CHECK(env.size == 8);
    CHECK(env.local_rank == 1);
    CHECK(env.id_file == "/tmp/x");
    CHECK(env.id.empty());
  }
  SECTION("Open MPI variables; the local rank defaults to the rank")
  {
    vars = {{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "4"}, {"WM_UNIQUE_ID", "ab"}};
    auto const env = wm::read_launch_env(get);
    CHECK(env.rank == 2);
    CHECK(env.size == 4);
    CHECK(env.local_rank == 2);
    CHECK(env.id == "ab");
  }
  SECTION("bad or missing values are rejected")
  {
    vars = {{"WM_RANK", "1"}, {"WM_ID_FILE", "/tmp/x"}};
    CHECK_THROWS_AS(wm::read_launch_env(get), wm::logic_error);  // no size
    vars = {{"WM_RANK", "2"}, {"WM_WORLD_SIZE", "2"}, {"WM_ID_FILE", "/tmp/x"}};
    CHECK_THROWS_AS(wm::read_launch_env(get), wm::logic_error);  // rank >= size
    vars = {{"WM_RANK", "1x"}, {"WM_WORLD_SIZE", "2"}, {"WM_ID_FILE", "/tmp/x"}};
    CHECK_THROWS_AS(wm::read_launch_env(get), wm::logic_error);  // not a number
    vars = {{"WM_RANK", "-1"}, {"WM_WORLD_SIZE", "2"}, {"WM_ID_FILE", "/tmp/x"}};
    CHECK_THROWS_AS(wm::read_launch_env(get), wm::logic_error);
    vars = {{"WM_RANK", "0"}, {"WM_WORLD_SIZE", "2"}};
    CHECK_THROWS_AS(wm::read_launch_env(get), wm::logic_error);  // no id source
  }
}

TEST_CASE("the id file carries rank 0's id to every rank", "[host]")
{
  std::mt19937_64 rng{std::random_device{}()};
  auto const path = std::filesystem::temp_directory_path() /
                    ("wm-id-test-" + std::to_string(rng()) + ".txt");
  ncclUniqueId raw{};
  for (auto& c : raw.internal) { c = static_cast<char>(rng()); }
  auto const expected = wm::unique_id::from_parts(rng(), raw);
  int const n         = 4;
  REQUIRE_NOTHROW(wm::detail::fork_ranks(
    n,
    [&](wm::detail::rank_context& ctx) {
      // Each rank sees only its environment, as under an external launcher.
      ::setenv("WM_RANK", std::to_string(ctx.rank()).c_str(), 1);
      ::setenv("WM_WORLD_SIZE", std::to_string(n).c_str(), 1);
      ::setenv("WM_ID_FILE", path.c_str(), 1);
      if (ctx.rank() == 0) { std::this_thread::sleep_for(200ms); }  // readers wait for it
      auto const env = wm::read_launch_env();
      auto const id  = wm::detail::exchange_id_file(env, [&] { return expected; }, 10s);
      RANK_REQUIRE(id == expected);
    },
    quick()));
  std::filesystem::remove(path);

  // Nobody writes the file: a reader gives up with a clear error after its timeout.
  wm::launch_env env;
  env.rank    = 1;
  env.size    = 2;
  env.id_file = path.string();
  try {
    (void)wm::detail::exchange_id_file(env, [&] { return expected; }, 300ms);
    FAIL("no exception");
  } catch (wm::comm_error const& e) {
    CHECK(std::string{e.what()}.find(path.string()) != std::string::npos);
  }
}
