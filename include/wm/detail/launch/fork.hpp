// SPDX-License-Identifier: Apache-2.0
// Forks local ranks, relays one broadcast from rank 0, and reports every failure (the machinery
// of wm::launch, declared in <wm/launch.hpp>). Host-only: the parent never touches CUDA; what
// the children do is up to the body.
#pragma once

#include <wm/detail/base/deadline.hpp>
#include <wm/detail/base/posix.hpp>
#include <wm/error.hpp>
#include <wm/launch.hpp>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fcntl.h>
#include <functional>
#include <poll.h>
#include <signal.h>
#include <string>
#include <sys/wait.h>
#include <typeinfo>
#include <vector>

namespace wm {

inline launch_error::launch_error(std::vector<rank_failure> failures)
    : std::runtime_error{describe(failures)}, failures_{std::move(failures)} {}

inline std::string launch_error::describe(std::vector<rank_failure> const& f) {
  std::string s = "wm::launch: ";
  int primary   = 0;
  for (auto const& x : f) { primary += x.primary ? 1 : 0; }
  s += std::to_string(primary) + " rank(s) failed";
  for (auto const& x : f) { s += "; rank " + std::to_string(x.rank) + ": " + x.reason; }
  return s;
}

namespace detail {

/// What a forked rank sees of the launcher.
class rank_context {
 public:
  rank_context(int rank, int size, int from_parent, int to_parent)
      : rank_{rank}, size_{size}, from_parent_{from_parent}, to_parent_{to_parent} {}
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }

  /// Rank 0 hands @p bytes to the launcher, which relays them to every rank (rank 0 included).
  void publish(std::string const& bytes) const {
    WM_EXPECTS(rank_ == 0, "only rank 0 publishes");
    send_message(to_parent_, 'B', bytes);
  }

  /// Waits up to @p timeout for what rank 0 published.
  [[nodiscard]] std::string receive_published(std::chrono::milliseconds timeout) const {
    auto const deadline = deadline_after(timeout);
    pollfd p{from_parent_, POLLIN, 0};
    while (true) {
      int const r = ::poll(&p, 1, millis_left(deadline));
      if (r > 0) { break; }
      if ((r < 0 && errno == EINTR) || (r == 0 && clock_type::now() < deadline)) { continue; }
      throw comm_error{"wm::launch: rank " + std::to_string(rank_) +
                       " got no unique id from rank 0 within " + timeout_text(timeout)};
    }
    std::uint64_t n{};
    if (read_all(from_parent_, &n, sizeof(n)) != sizeof(n)) {
      throw comm_error{"wm::launch: the launcher closed the id pipe (rank 0 failed?)"};
    }
    std::string bytes(n, '\0');
    if (read_all(from_parent_, bytes.data(), n) != n) {
      throw comm_error{"wm::launch: short read of the unique id"};
    }
    return bytes;
  }

  /// Child side of failure reporting: the text is shown in the launch_error.
  void report_error(std::string const& text) const noexcept { send_message(to_parent_, 'E', text); }

  static void send_message(int fd, char kind, std::string const& bytes) noexcept {
    std::uint64_t const n = bytes.size();
    (void)write_all(fd, &kind, 1);
    (void)write_all(fd, &n, sizeof(n));
    (void)write_all(fd, bytes.data(), bytes.size());
  }

 private:
  int rank_;
  int size_;
  int from_parent_;
  int to_parent_;
};

[[nodiscard]] inline std::string describe_current_exception() {
  try {
    throw;
  } catch (std::exception const& e) {
    return std::string{"threw "} + typeid(e).name() + ": " + e.what();
  } catch (...) { return "threw an exception not derived from std::exception"; }
}

[[nodiscard]] inline std::string describe_status(int status) {
  if (WIFSIGNALED(status)) {
    int const sig = WTERMSIG(status);
    char const* n = ::strsignal(sig);
    return "killed by signal " + std::to_string(sig) + " (" + (n ? n : "?") + ")";
  }
  if (WIFEXITED(status)) { return "exited with code " + std::to_string(WEXITSTATUS(status)); }
  return "ended with status " + std::to_string(status);
}

/// The system calls `fork_ranks` makes its pipes and processes with; tests put in ones that
/// fail part-way.
struct fork_system {
  int (*make_pipe)(int fds[2], int flags) = ::pipe2;
  pid_t (*make_process)()                 = ::fork;
};

/// Sets SIGPIPE to be ignored and puts the caller's disposition back when it goes.
class sigpipe_ignored {
 public:
  sigpipe_ignored() noexcept {
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    ::sigemptyset(&ignore.sa_mask);
    saved_ = ::sigaction(SIGPIPE, &ignore, &previous_) == 0;
  }
  ~sigpipe_ignored() {
    if (saved_) { (void)::sigaction(SIGPIPE, &previous_, nullptr); }
  }
  sigpipe_ignored(sigpipe_ignored const&)            = delete;
  sigpipe_ignored& operator=(sigpipe_ignored const&) = delete;

 private:
  struct sigaction previous_ {};
  bool saved_{false};
};

/**
 * @brief Forks @p n ranks that each run @p body, relays rank 0's `publish` to all ranks, waits,
 * and throws `wm::launch_error` naming every rank that failed (and why) if any did.
 *
 * The parent calls no CUDA function. A rank fails if its body throws, it exits non-zero, or it
 * dies of a signal; the others then get `grace` to finish and are killed after that. Whatever
 * ends the call (success, a failed pipe or fork part-way, an exception), every rank it started
 * has been reaped (killed first if still running), every pipe it made is closed, and SIGPIPE
 * has the caller's disposition again.
 * @throw std::runtime_error if a pipe or a process cannot be made (the ranks already started
 * are killed and reaped first)
 */
inline void fork_ranks(int n, std::function<void(rank_context&)> const& body, launch_options opts,
                       fork_system const& sys = {}) {
  WM_EXPECTS(n >= 1, "the number of ranks must be at least 1, got " + std::to_string(n));
  struct child {
    pid_t pid{-1};
    unique_fd to_child;    // parent writes the published bytes
    unique_fd from_child;  // child writes messages ('B' publish, 'E' error)
    std::string inbox;     // bytes read from from_child, not yet parsed
    std::string error;     // error text the child reported
    bool done{false};
    int status{0};
  };
  std::vector<child> kids(static_cast<std::size_t>(n));
  // Whatever way this function is left, no rank outlives it: those not reaped yet are killed
  // and reaped (a no-op after a normal run). Declared after `kids`, so it runs first.
  struct reaper {
    std::vector<child>& kids;
    ~reaper() {
      for (auto& k : kids) {
        if (k.pid <= 0 || k.done) { continue; }
        (void)::kill(k.pid, SIGKILL);
        int status{};
        while (::waitpid(k.pid, &status, 0) < 0 && errno == EINTR) {}
        k.done = true;
      }
    }
  } const reap{kids};
  std::fflush(nullptr);  // unflushed stdio buffers would be printed twice after fork()

  for (int r = 0; r < n; ++r) {
    int down[2]{-1, -1};
    int up[2]{-1, -1};
    if (sys.make_pipe(down, O_CLOEXEC) != 0) {
      throw std::runtime_error{"wm::launch: pipe() for rank " + std::to_string(r) + ": " +
                               errno_text()};
    }
    unique_fd down_read{down[0]};
    unique_fd down_write{down[1]};
    if (sys.make_pipe(up, O_CLOEXEC) != 0) {
      throw std::runtime_error{"wm::launch: pipe() for rank " + std::to_string(r) + ": " +
                               errno_text()};
    }
    unique_fd up_read{up[0]};
    unique_fd up_write{up[1]};
    pid_t const pid = sys.make_process();
    if (pid < 0) {
      throw std::runtime_error{"wm::launch: fork() for rank " + std::to_string(r) + ": " +
                               errno_text()};
    }
    if (pid == 0) {
      // Child: drop the parent's ends of earlier ranks' pipes, run the body, never return.
      for (int k = 0; k < r; ++k) {
        kids[static_cast<std::size_t>(k)].to_child.reset();
        kids[static_cast<std::size_t>(k)].from_child.reset();
        kids[static_cast<std::size_t>(k)].pid = -1;  // not this process's children
      }
      down_write.reset();
      up_read.reset();
      rank_context ctx{r, n, down_read.get(), up_write.get()};
      int code = 0;
      try {
        body(ctx);
      } catch (...) {
        ctx.report_error(describe_current_exception());
        code = 1;
      }
      std::fflush(nullptr);
      ::_exit(code);
    }
    auto& k      = kids[static_cast<std::size_t>(r)];
    k.pid        = pid;
    k.to_child   = std::move(down_write);
    k.from_child = std::move(up_read);
  }

  auto const hard_deadline = deadline_after(opts.timeout);
  auto stop_deadline       = clock_type::time_point::max();
  int first_failed         = -1;
  bool timed_out           = false;
  std::vector<bool> stopped(kids.size(), false);

  auto parse_inbox = [&](int r) {
    auto& k = kids[static_cast<std::size_t>(r)];
    while (k.inbox.size() >= 1 + sizeof(std::uint64_t)) {
      std::uint64_t len{};
      std::memcpy(&len, k.inbox.data() + 1, sizeof(len));
      if (k.inbox.size() < 1 + sizeof(len) + len) { break; }
      std::string payload = k.inbox.substr(1 + sizeof(len), len);
      char const kind     = k.inbox[0];
      k.inbox.erase(0, 1 + sizeof(len) + len);
      if (kind == 'E') {
        k.error = payload;
      } else if (kind == 'B') {
        for (auto& other : kids) {
          if (!other.to_child.valid()) { continue; }
          std::uint64_t const m = payload.size();
          if (!write_all(other.to_child.get(), &m, sizeof(m)) ||
              !write_all(other.to_child.get(), payload.data(), payload.size())) {
            other.to_child.reset();  // that rank is gone; waitpid reports it
          }
        }
      }
    }
  };

  // A rank that died makes writes to its pipe fail with EPIPE instead of killing the launcher.
  // The children were forked before this, with the caller's disposition.
  sigpipe_ignored const no_sigpipe;
  int running = n;
  while (running > 0) {
    // Read whatever the ranks sent (errors, the published id).
    std::vector<pollfd> fds;
    std::vector<int> owner;
    for (int r = 0; r < n; ++r) {
      if (kids[static_cast<std::size_t>(r)].from_child.valid()) {
        fds.push_back({kids[static_cast<std::size_t>(r)].from_child.get(), POLLIN, 0});
        owner.push_back(r);
      }
    }
    if (!fds.empty()) {
      (void)::poll(fds.data(), fds.size(), 10);
    } else {
      ::usleep(10000);
    }
    for (std::size_t i = 0; i < fds.size(); ++i) {
      if ((fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) { continue; }
      auto& k = kids[static_cast<std::size_t>(owner[i])];
      char buf[4096];
      auto const got = ::read(k.from_child.get(), buf, sizeof(buf));
      if (got > 0) {
        k.inbox.append(buf, static_cast<std::size_t>(got));
        parse_inbox(owner[i]);
      } else if (got == 0 || errno != EINTR) {
        k.from_child.reset();
      }
    }
    // Reap ranks that ended.
    for (int r = 0; r < n; ++r) {
      auto& k = kids[static_cast<std::size_t>(r)];
      if (k.done) { continue; }
      int status{};
      if (::waitpid(k.pid, &status, WNOHANG) == k.pid) {
        k.done   = true;
        k.status = status;
        --running;
        k.to_child.reset();
        bool const ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        if (!ok && first_failed < 0 && !stopped[static_cast<std::size_t>(r)]) {
          first_failed  = r;
          stop_deadline = deadline_after(opts.grace);
        }
      }
    }
    auto const now = clock_type::now();
    if (running > 0 && (now >= stop_deadline || now >= hard_deadline)) {
      timed_out = timed_out || now >= hard_deadline;
      for (std::size_t r = 0; r < kids.size(); ++r) {
        if (!kids[r].done && !stopped[r]) {
          stopped[r] = true;
          ::kill(kids[r].pid, SIGKILL);
        }
      }
    }
  }
  // Drain what is left in the pipes (error texts written just before exit).
  for (int r = 0; r < n; ++r) {
    auto& k = kids[static_cast<std::size_t>(r)];
    if (!k.from_child.valid()) { continue; }
    ::fcntl(k.from_child.get(), F_SETFL, O_NONBLOCK);
    char buf[4096];
    ssize_t got{};
    while ((got = ::read(k.from_child.get(), buf, sizeof(buf))) > 0) {
      k.inbox.append(buf, static_cast<std::size_t>(got));
    }
    parse_inbox(r);
  }

  std::vector<rank_failure> failures;
  for (int r = 0; r < n; ++r) {
    auto const& k = kids[static_cast<std::size_t>(r)];
    bool const ok = WIFEXITED(k.status) && WEXITSTATUS(k.status) == 0;
    if (ok) { continue; }
    if (stopped[static_cast<std::size_t>(r)]) {
      std::string why =
          timed_out
              ? "timed out after " + timeout_text(opts.timeout) + " and was killed by the launcher"
              : "stopped by the launcher after rank " + std::to_string(first_failed) + " failed";
      failures.push_back({r, why, timed_out});
    } else {
      failures.push_back({r, k.error.empty() ? describe_status(k.status) : k.error, true});
    }
  }
  if (!failures.empty()) {
    std::stable_partition(failures.begin(), failures.end(),
                          [](rank_failure const& f) { return f.primary; });
    throw launch_error{std::move(failures)};
  }
}

}  // namespace detail
}  // namespace wm
