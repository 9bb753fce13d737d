// SPDX-License-Identifier: Apache-2.0
// Host tests of the rank launcher (fork, failure reporting, id relay) and the environment
// entry point. No GPU: the bodies below do not touch CUDA.
#include <wm/launch.hpp>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <signal.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include "catch.hpp"
#include "rank_check.hpp"

using namespace std::chrono_literals;

namespace {
wm::launch_options quick() {
  return {std::chrono::seconds{20}, std::chrono::milliseconds{500}};
}

wm::rank_failure const* failure_of(wm::launch_error const& e, int rank) {
  for (auto const& f : e.failures()) {
    if (f.rank == rank) { return &f; }
  }
  return nullptr;
}
}  // namespace

TEST_CASE("fork_ranks runs every rank and relays what rank 0 publishes", "[host]") {
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

TEST_CASE("fork_ranks names a rank that throws and stops the others quickly", "[host]") {
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

TEST_CASE("fork_ranks reports signals, exit codes and timeouts", "[host]") {
  SECTION("a rank dies of a signal and another exits non-zero") {
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
  SECTION("every rank hangs: the whole-run timeout, when asked for, ends them") {
    auto const start = std::chrono::steady_clock::now();
    try {
      wm::detail::fork_ranks(2, [](wm::detail::rank_context&) { std::this_thread::sleep_for(60s); },
                             {std::chrono::milliseconds{700}, std::chrono::milliseconds{100}});
      FAIL("no launch_error");
    } catch (wm::launch_error const& e) {
      CHECK(std::chrono::steady_clock::now() - start < 10s);
      REQUIRE(e.failures().size() == 2);
      for (auto const& f : e.failures()) { CHECK(f.reason.find("timed out") != std::string::npos); }
    }
  }
  SECTION("rank 0 dies before publishing: the waiting ranks do not hang") {
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
  CHECK_THROWS_AS(wm::detail::fork_ranks(
                      0, [](wm::detail::rank_context&) {}, quick()),
                  wm::logic_error);
}

TEST_CASE("read_launch_env reads rank, size, local rank and the id source", "[host]") {
  std::map<std::string, std::string> vars;
  auto get = [&](char const* k) -> char const* {
    auto it = vars.find(k);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
  SECTION("wm's own variables win over torchrun-style ones") {
    vars           = {{"WM_RANK", "3"},    {"WM_WORLD_SIZE", "8"}, {"RANK", "1"},
                      {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"},    {"WM_ID_FILE", "/tmp/x"}};
    auto const env = wm::read_launch_env(get);
    CHECK(env.rank == 3);
    CHECK(env.size == 8);
    CHECK(env.local_rank == 1);
    CHECK(env.id_file == "/tmp/x");
    CHECK(env.id.empty());
  }
  SECTION("Open MPI variables; the local rank defaults to the rank") {
    vars = {{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "4"}, {"WM_UNIQUE_ID", "ab"}};
    auto const env = wm::read_launch_env(get);
    CHECK(env.rank == 2);
    CHECK(env.size == 4);
    CHECK(env.local_rank == 2);
    CHECK(env.id == "ab");
  }
  SECTION("bad or missing values are rejected") {
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

TEST_CASE("the id file carries rank 0's id to every rank", "[host]") {
  std::mt19937_64 rng{std::random_device{}()};
  auto const path =
      std::filesystem::temp_directory_path() / ("wm-id-test-" + std::to_string(rng()) + ".txt");
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
        auto const env    = wm::read_launch_env();
        auto const joined = wm::detail::exchange_id_file(
            env, [&] { return expected; }, 10s);
        RANK_REQUIRE(joined.id == expected);
        if (ctx.rank() == 0) { std::this_thread::sleep_for(1s); }  // holds the file while they read
      },
      quick()));
  CHECK_FALSE(std::filesystem::exists(path));  // rank 0 removed it

  // Nobody writes the file: a reader gives up with a clear error after its timeout.
  wm::launch_env env;
  env.rank    = 1;
  env.size    = 2;
  env.id_file = path.string();
  try {
    (void)wm::detail::exchange_id_file(
        env, [&] { return expected; }, 300ms)
        .id;
    FAIL("no exception");
  } catch (wm::comm_error const& e) {
    CHECK(std::string{e.what()}.find(path.string()) != std::string::npos);
  }
}

namespace {
std::size_t open_descriptors() {
  std::size_t n = 0;
  for ([[maybe_unused]] auto const& e : std::filesystem::directory_iterator{"/proc/self/fd"}) {
    ++n;
  }
  return n;
}

// A pipe2 / fork that fail at a chosen call, and remember the processes they made.
int pipe_calls    = 0;
int pipe_fails_at = 0;
int fork_calls    = 0;
int fork_fails_at = 0;
std::vector<pid_t> forked;

int failing_pipe(int fds[2], int flags) {
  if (++pipe_calls == pipe_fails_at) {
    errno = EMFILE;
    return -1;
  }
  return ::pipe2(fds, flags);
}

pid_t failing_fork() {
  if (++fork_calls == fork_fails_at) {
    errno = EAGAIN;
    return -1;
  }
  pid_t const pid = ::fork();
  if (pid > 0) { forked.push_back(pid); }
  return pid;
}

bool process_gone(pid_t pid) {
  return ::kill(pid, 0) != 0 && errno == ESRCH;
}  // not even a zombie

void on_sigpipe(int) {}
}  // namespace

TEST_CASE("launch: no whole-run limit by default; milliseconds::max() runs ranks normally",
          "[host]") {
  CHECK(wm::launch_options{}.timeout == std::chrono::milliseconds::max());
  CHECK(wm::launch_options{}.grace == 3s);
  auto const huge = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::hours{24 * 365 * 1000});  // beyond the clock: no limit as well
  for (auto limit : {std::chrono::milliseconds::max(), huge}) {
    wm::launch_options opts;
    opts.timeout     = limit;
    auto const start = std::chrono::steady_clock::now();
    REQUIRE_NOTHROW(wm::detail::fork_ranks(
        3,
        [&](wm::detail::rank_context& ctx) {
          std::this_thread::sleep_for(300ms);  // a deadline in the past would kill it first
          if (ctx.rank() == 0) { ctx.publish("go"); }
          RANK_REQUIRE(ctx.receive_published(std::chrono::milliseconds::max()) == "go");
        },
        opts));
    CHECK(std::chrono::steady_clock::now() - start >= 300ms);
  }
}

TEST_CASE("fork_ranks cleans up when a pipe or a fork fails part-way", "[host]") {
  struct plan {
    int pipe_at;
    int fork_at;
    char const* what;
  };
  // 4 ranks make pipes 1-8 and forks 1-4; fail in the middle of rank 2's set-up.
  auto const p = GENERATE(plan{5, 0, "first pipe of rank 2"}, plan{6, 0, "second pipe of rank 2"},
                          plan{0, 3, "fork of rank 2"}, plan{0, 1, "fork of rank 0"});
  INFO(p.what);
  pipe_calls    = 0;
  fork_calls    = 0;
  pipe_fails_at = p.pipe_at;
  fork_fails_at = p.fork_at;
  forked.clear();
  std::size_t const fds_before = open_descriptors();
  auto const start             = std::chrono::steady_clock::now();
  try {
    wm::detail::fork_ranks(
        4, [](wm::detail::rank_context&) { std::this_thread::sleep_for(60s); }, quick(),
        wm::detail::fork_system{&failing_pipe, &failing_fork});
    FAIL("no exception");
  } catch (wm::launch_error const&) {
    FAIL("a set-up failure is not a rank failure");
  } catch (std::runtime_error const& e) {
    CHECK(std::string{e.what()}.find("rank ") != std::string::npos);
  }
  CHECK(std::chrono::steady_clock::now() - start < 5s);  // the sleeping ranks were killed
  CHECK(open_descriptors() == fds_before);               // every pipe end closed
  CHECK(forked.size() == (p.fork_at == 1 ? 0u : 2u));
  for (pid_t pid : forked) {
    CHECK(process_gone(pid));  // killed and reaped
  }
  int status{};
  CHECK(::waitpid(-1, &status, WNOHANG) == -1);  // no child of this process is left
}

TEST_CASE("fork_ranks gives the caller its SIGPIPE disposition back", "[host]") {
  struct sigaction original {};
  REQUIRE(::sigaction(SIGPIPE, nullptr, &original) == 0);
  auto current = [] {
    struct sigaction now {};
    ::sigaction(SIGPIPE, nullptr, &now);
    return now.sa_handler;
  };
  for (auto handler : {&on_sigpipe, static_cast<void (*)(int)>(SIG_DFL)}) {
    struct sigaction mine {};
    mine.sa_handler = handler;
    ::sigemptyset(&mine.sa_mask);
    REQUIRE(::sigaction(SIGPIPE, &mine, nullptr) == 0);
    // A normal run, a run in which a rank fails, and a run whose set-up fails.
    wm::detail::fork_ranks(
        2, [](wm::detail::rank_context&) {}, quick());
    CHECK(current() == handler);
    CHECK_THROWS_AS(
        wm::detail::fork_ranks(
            2, [](wm::detail::rank_context&) { throw std::runtime_error{"x"}; }, quick()),
        wm::launch_error);
    CHECK(current() == handler);
    pipe_calls    = 0;
    fork_calls    = 0;
    pipe_fails_at = 0;
    fork_fails_at = 2;
    forked.clear();
    CHECK_THROWS_AS(wm::detail::fork_ranks(
                        2, [](wm::detail::rank_context&) {}, quick(),
                        wm::detail::fork_system{&failing_pipe, &failing_fork}),
                    std::runtime_error);
    CHECK(current() == handler);
  }
  // The ranks themselves start with the caller's disposition, not the launcher's SIG_IGN.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  ::sigemptyset(&dfl.sa_mask);
  REQUIRE(::sigaction(SIGPIPE, &dfl, nullptr) == 0);
  REQUIRE_NOTHROW(wm::detail::fork_ranks(
      1,
      [](wm::detail::rank_context&) {
        struct sigaction now {};
        ::sigaction(SIGPIPE, nullptr, &now);
        RANK_REQUIRE(now.sa_handler == SIG_DFL);
      },
      quick()));
  ::sigaction(SIGPIPE, &original, nullptr);
}

namespace {
void write_text(std::filesystem::path const& p, std::string const& text) {
  std::ofstream out{p, std::ios::trunc};
  out << text;
}

// Each rank of these tests sees only the variables of its run.
void set_rank_env(int rank, int n, std::filesystem::path const& path, char const* job) {
  for (char const* v : {"WM_JOB_ID", "SLURM_JOB_ID", "SLURM_STEP_ID", "PMIX_NAMESPACE",
                        "OMPI_MCA_ess_base_jobid", "WM_UNIQUE_ID"}) {
    ::unsetenv(v);
  }
  ::setenv("WM_RANK", std::to_string(rank).c_str(), 1);
  ::setenv("WM_WORLD_SIZE", std::to_string(n).c_str(), 1);
  ::setenv("WM_ID_FILE", path.c_str(), 1);
  if (job != nullptr) { ::setenv("WM_JOB_ID", job, 1); }
}

wm::unique_id random_id(std::mt19937_64& rng) {
  ncclUniqueId raw{};
  for (auto& c : raw.internal) { c = static_cast<char>(rng()); }
  return wm::unique_id::from_parts(rng(), raw);
}
}  // namespace

TEST_CASE("read_launch_env names the job that binds the id file", "[host]") {
  std::map<std::string, std::string> vars{
      {"WM_RANK", "0"}, {"WM_WORLD_SIZE", "2"}, {"WM_ID_FILE", "/tmp/x"}};
  auto get = [&](char const* k) -> char const* {
    auto it = vars.find(k);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
  CHECK(wm::read_launch_env(get).job.empty());
  vars["OMPI_MCA_ess_base_jobid"] = "77";
  CHECK(wm::read_launch_env(get).job == "ompi:77");
  vars["PMIX_NAMESPACE"] = "prterun-host-123@1";
  CHECK(wm::read_launch_env(get).job == "pmix:prterun-host-123@1");
  vars["SLURM_JOB_ID"] = "4242";
  CHECK(wm::read_launch_env(get).job == "slurm:4242.-");
  vars["SLURM_STEP_ID"] = "3";
  CHECK(wm::read_launch_env(get).job == "slurm:4242.3");
  vars["WM_JOB_ID"] = "mine\nsecond line";
  CHECK(wm::read_launch_env(get).job == "mine_second line");
}

TEST_CASE("a stale id file from an earlier run is never taken", "[host]") {
  std::mt19937_64 rng{std::random_device{}()};
  auto const path =
      std::filesystem::temp_directory_path() / ("wm-id-stale-" + std::to_string(rng()) + ".txt");
  auto const stale_id = random_id(rng);
  auto const fresh_id = random_id(rng);
  REQUIRE_FALSE(stale_id == fresh_id);
  int const n = 4;
  // Readers start before rank 0 writes: the stale file is all they see at first.
  auto run = [&](char const* job) {
    wm::detail::fork_ranks(
        n,
        [&](wm::detail::rank_context& ctx) {
          set_rank_env(ctx.rank(), n, path, job);
          auto const env = wm::read_launch_env();
          if (ctx.rank() == 0) { std::this_thread::sleep_for(500ms); }
          auto const joined = wm::detail::exchange_id_file(
              env, [&] { return fresh_id; }, 10s);
          RANK_REQUIRE_MSG(joined.id == fresh_id, "rank " << ctx.rank() << " took the stale id");
          if (ctx.rank() == 0) {
            RANK_REQUIRE(std::filesystem::exists(path));
            std::this_thread::sleep_for(1s);  // readers take it meanwhile
          }
        },
        quick());
  };
  SECTION("the file of another job") {
    write_text(path, wm::detail::format_id_file(
                         {"old-run", wm::detail::unix_ms_now(), stale_id.to_string()}));
    REQUIRE_NOTHROW(run("new-run"));
    CHECK_FALSE(std::filesystem::exists(path));
  }
  SECTION("no job id: a file written before this run started") {
    write_text(path, wm::detail::format_id_file(
                         {"", wm::detail::unix_ms_now() - 3'600'000, stale_id.to_string()}));
    REQUIRE_NOTHROW(run(nullptr));
    CHECK_FALSE(std::filesystem::exists(path));
  }
  SECTION("a file of the old format, and one half written") {
    write_text(path, stale_id.to_string() + "\n");  // what earlier versions wrote
    REQUIRE_NOTHROW(run("new-run"));
    write_text(path, std::string{wm::detail::id_file_format} + "\njob new-run\n");
    REQUIRE_NOTHROW(run("new-run"));
    CHECK_FALSE(std::filesystem::exists(path));
  }
  SECTION("a reader that sees only a stale file gives up at its deadline and says why") {
    write_text(path, wm::detail::format_id_file(
                         {"old-run", wm::detail::unix_ms_now(), stale_id.to_string()}));
    wm::launch_env env;
    env.rank         = 1;
    env.size         = 2;
    env.id_file      = path.string();
    env.job          = "new-run";
    auto const start = std::chrono::steady_clock::now();
    try {
      (void)wm::detail::exchange_id_file(
          env, [&] { return fresh_id; }, 400ms)
          .id;
      FAIL("took the stale file");
    } catch (wm::comm_error const& e) {
      CHECK(std::string{e.what()}.find("old-run") != std::string::npos);
      CHECK(std::string{e.what()}.find("WM_JOB_ID") != std::string::npos);
    }
    auto const took = std::chrono::steady_clock::now() - start;
    CHECK(took >= 400ms);
    CHECK(took < 3s);
    // Without a job id: too old for this process (the check's reference point is a parameter).
    write_text(path, wm::detail::format_id_file(
                         {"", wm::detail::unix_ms_now() - 60'000, stale_id.to_string()}));
    env.job = "";
    CHECK_THROWS_AS((void)wm::detail::exchange_id_file(
                        env, [&] { return fresh_id; }, 200ms, wm::detail::unix_ms_now() - 30'000),
                    wm::comm_error);
    // ... and taken when recent enough.
    CHECK(wm::detail::exchange_id_file(
              env, [&] { return fresh_id; }, 200ms, wm::detail::unix_ms_now() - 90'000)
              .id == stale_id);
    std::filesystem::remove(path);
  }
  SECTION("rank 0 removes its file on every exit path, and only its own file") {
    wm::launch_env env;
    env.rank    = 0;
    env.size    = 2;
    env.id_file = path.string();
    env.job     = std::string{"j"};  // (GCC 12 -Wrestrict misfires on = "j" at -O3)
    {
      auto joined = wm::detail::exchange_id_file(
          env, [&] { return fresh_id; }, 1s);
      CHECK(joined.id == fresh_id);
      auto const c = wm::detail::read_id_file(path);
      REQUIRE(c.has_value());
      CHECK(c->job == "j");
      CHECK(c->id == fresh_id.to_string());
      CHECK(std::abs(c->written_ms - wm::detail::unix_ms_now()) < 5000);
    }
    CHECK_FALSE(std::filesystem::exists(path));
    try {
      auto joined = wm::detail::exchange_id_file(
          env, [&] { return fresh_id; }, 1s);
      REQUIRE(std::filesystem::exists(path));
      throw std::runtime_error{"communicator construction failed"};
    } catch (std::runtime_error const&) {}
    CHECK_FALSE(std::filesystem::exists(path));
    // make() throws: nothing is written.
    CHECK_THROWS_AS((void)wm::detail::exchange_id_file(
                        env, []() -> wm::unique_id { throw wm::comm_error{"no id"}; }, 1s),
                    wm::comm_error);
    CHECK_FALSE(std::filesystem::exists(path));
    // A later run replaced the file: this run's lease leaves it alone.
    {
      auto joined = wm::detail::exchange_id_file(
          env, [&] { return fresh_id; }, 1s);
      write_text(path, wm::detail::format_id_file(
                           {"other", wm::detail::unix_ms_now(), stale_id.to_string()}));
    }
    CHECK(std::filesystem::exists(path));
    std::filesystem::remove(path);
    // No temporary files are left beside it.
    for (auto const& e : std::filesystem::directory_iterator{path.parent_path()}) {
      CHECK(e.path().filename().string().rfind(path.filename().string(), 0) != 0);
    }
  }
  // This process's start time is known and in the past (the no-job-id check relies on it).
  auto const started = wm::detail::process_start_unix_ms();
  CHECK(started <= wm::detail::unix_ms_now());
  CHECK(started > wm::detail::unix_ms_now() - 24 * 3'600'000);
}
