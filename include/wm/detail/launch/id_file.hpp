// SPDX-License-Identifier: Apache-2.0
// The WM_ID_FILE bootstrap of wm::communicator_from_env: rank 0 writes the unique id to a file
// bound to its run (job id, time written); the other ranks wait for a file of their run. Host-only.
#pragma once

#include <wm/comm.hpp>
#include <wm/detail/base/deadline.hpp>
#include <wm/error.hpp>
#include <wm/launch.hpp>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <sys/stat.h>
#include <system_error>
#include <thread>
#include <unistd.h>
#include <utility>

namespace wm::detail {

/// First line of an id file (format and version).
inline constexpr char const* id_file_format = "wm-id-file 2";

/// Without a job id, a reader takes a file written at most this long before its process started.
inline constexpr std::chrono::milliseconds id_file_max_skew{std::chrono::seconds{30}};

/// Milliseconds since the Unix epoch, now.
[[nodiscard]] inline std::int64_t unix_ms_now() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

/// When this process started, in milliseconds since the Unix epoch (Linux: /proc/stat's boot
/// time plus /proc/self/stat's start time); now if that cannot be read.
[[nodiscard]] inline std::int64_t process_start_unix_ms() {
  std::ifstream stat{"/proc/self/stat"};
  std::string all{std::istreambuf_iterator<char>{stat}, std::istreambuf_iterator<char>{}};
  auto const close = all.rfind(')');  // the command name may hold spaces and parentheses
  std::ifstream proc{"/proc/stat"};
  std::string key;
  long long boot = -1;
  while (proc >> key) {
    if (key == "btime") {
      proc >> boot;
      break;
    }
  }
  long const ticks = ::sysconf(_SC_CLK_TCK);
  if (close == std::string::npos || boot < 0 || ticks <= 0) { return unix_ms_now(); }
  std::istringstream fields{all.substr(close + 1)};
  std::string field;
  // After the name: state (field 3) ... starttime (field 22): the 20th word.
  for (int i = 3; i < 22 && fields >> field; ++i) {}
  unsigned long long start = 0;
  if (!(fields >> start)) { return unix_ms_now(); }
  return boot * 1000 +
         static_cast<std::int64_t>(start * 1000 / static_cast<unsigned long long>(ticks));
}

/// What an id file holds.
struct id_file_contents {
  std::string job;            ///< the writer's job id (may be empty)
  std::int64_t written_ms{};  ///< when it was written (Unix milliseconds)
  std::string id;             ///< the unique id as hex
};

[[nodiscard]] inline std::string format_id_file(id_file_contents const& c) {
  return std::string{id_file_format} + "\njob " + c.job + "\nwritten_ms " +
         std::to_string(c.written_ms) + "\nid " + c.id + "\n";
}

/// Parses an id file; nothing if it is not one (partly written files never appear: see
/// `id_file_lease`).
[[nodiscard]] inline std::optional<id_file_contents> parse_id_file(std::string const& text) {
  std::istringstream in{text};
  std::string line;
  if (!std::getline(in, line) || line != id_file_format) { return std::nullopt; }
  id_file_contents c;
  bool job     = false;
  bool written = false;
  bool id      = false;
  while (std::getline(in, line)) {
    auto const space        = line.find(' ');
    std::string const key   = line.substr(0, space);
    std::string const value = space == std::string::npos ? std::string{} : line.substr(space + 1);
    if (key == "job") {
      c.job = value;
      job   = true;
    } else if (key == "written_ms") {
      try {
        c.written_ms = std::stoll(value);
        written      = true;
      } catch (std::exception const&) { return std::nullopt; }
    } else if (key == "id") {
      c.id = value;
      id   = value.size() == 2 * unique_id::size_bytes;
    }
  }
  if (!job || !written || !id) { return std::nullopt; }
  return c;
}

/// Why `read_id_file` did not take a file that is there, or empty when it took it.
struct id_file_read {
  std::optional<id_file_contents> contents;
  std::string refused;  ///< set when a file is there but must not be trusted
};

/**
 * @brief Reads an id file, trusting it only as its owner wrote it: a regular file (not a
 * symbolic link) owned by this process's effective user and writable by nobody else. The id
 * lets whoever holds it join the group, so a file another local user wrote or could change is
 * refused, with the reason.
 */
[[nodiscard]] inline id_file_read read_id_file_checked(std::filesystem::path const& p) {
  int const fd = ::open(p.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    if (errno == ELOOP) { return {std::nullopt, "it is a symbolic link"}; }
    return {};
  }
  struct close_fd {
    int fd;
    ~close_fd() { ::close(fd); }
  } const closer{fd};
  struct ::stat st {};
  if (::fstat(fd, &st) != 0) { return {}; }
  if (!S_ISREG(st.st_mode)) { return {std::nullopt, "it is not a regular file"}; }
  if (st.st_uid != ::geteuid()) {
    return {std::nullopt, "it is owned by uid " + std::to_string(st.st_uid) + ", not by uid " +
                              std::to_string(::geteuid()) + " that runs this rank"};
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return {std::nullopt,
            "it is writable by group or others (mode " + std::to_string((st.st_mode >> 6) & 7) +
                std::to_string((st.st_mode >> 3) & 7) + std::to_string(st.st_mode & 7) + ")"};
  }
  std::string text;
  char buf[4096];
  for (;;) {
    auto const n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) { continue; }
    if (n <= 0) { break; }
    text.append(buf, static_cast<std::size_t>(n));
    if (text.size() > (1u << 16)) { return {std::nullopt, "it is too large for an id file"}; }
  }
  return {parse_id_file(text), {}};
}

[[nodiscard]] inline std::optional<id_file_contents> read_id_file(std::filesystem::path const& p) {
  return read_id_file_checked(p).contents;
}

/**
 * @brief Rank 0's hold on the id file: writes it atomically (a temporary file, then a rename)
 * and removes it when destroyed, on every path out of the bootstrap, unless the file no longer
 * holds this lease's id (another run replaced it).
 */
class id_file_lease {
 public:
  id_file_lease() = default;
  /// Writes @p contents to @p path. @throw wm::io_error if it cannot
  id_file_lease(std::filesystem::path path, id_file_contents const& contents)
      : path_{std::move(path)}, id_{contents.id} {
    namespace fs = std::filesystem;
    std::random_device rd;
    fs::path const tmp =
        path_.string() + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(rd());
    // Readable by this user only (the id admits whoever holds it), created here and now
    // (O_EXCL: never an existing file or a link planted under this name), durable before the
    // rename publishes it.
    int const fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {
      throw io_error{"wm: cannot create '" + tmp.string() +
                     "' for the unique id: " + std::system_category().message(errno)};
    }
    std::string const text = format_id_file(contents);
    bool ok                = ::fchmod(fd, 0600) == 0;
    for (std::size_t done = 0; ok && done < text.size();) {
      auto const n = ::write(fd, text.data() + done, text.size() - done);
      if (n < 0 && errno == EINTR) { continue; }
      ok = n > 0;
      if (ok) { done += static_cast<std::size_t>(n); }
    }
    int const err = ok ? (::fsync(fd) == 0 ? 0 : errno) : errno;
    ::close(fd);
    if (!ok || err != 0) {
      std::error_code ec;
      fs::remove(tmp, ec);
      throw io_error{"wm: cannot write the unique id to '" + tmp.string() +
                     "': " + std::system_category().message(err != 0 ? err : errno)};
    }
    std::error_code ec;
    fs::rename(tmp, path_, ec);
    if (ec) {
      std::error_code ignored;
      fs::remove(tmp, ignored);
      throw io_error{"wm: cannot rename '" + tmp.string() + "' to '" + path_.string() +
                     "': " + ec.message()};
    }
  }
  id_file_lease(id_file_lease&& o) noexcept
      : path_{std::exchange(o.path_, {})}, id_{std::exchange(o.id_, {})} {}
  id_file_lease& operator=(id_file_lease&& o) noexcept {
    if (this != &o) {
      release();
      path_ = std::exchange(o.path_, {});
      id_   = std::exchange(o.id_, {});
    }
    return *this;
  }
  id_file_lease(id_file_lease const&)            = delete;
  id_file_lease& operator=(id_file_lease const&) = delete;
  ~id_file_lease() { release(); }

  /// Removes the file now (if it still holds this lease's id).
  void release() noexcept {
    if (path_.empty()) { return; }
    try {
      if (auto c = read_id_file(path_); c && c->id == id_) {
        std::error_code ec;
        std::filesystem::remove(path_, ec);
      }
    } catch (...) {  // never throws: runs during unwinding
    }
    path_.clear();
  }

 private:
  std::filesystem::path path_;
  std::string id_;
};

/// What `exchange_id_file` gives: the id, and on rank 0 the lease that removes the file.
struct id_file_exchange {
  unique_id id;
  id_file_lease lease;
};

/**
 * @brief Rank 0 writes `make()` to `env.id_file` (with `env.job` and the time) and keeps the
 * lease; the other ranks wait up to @p timeout for a file of their run and read it: same job id,
 * or with no job id, written no earlier than @p not_before_ms (Unix milliseconds; by default
 * `id_file_max_skew` before this process started). Files of other runs are skipped.
 * @throw wm::comm_error if no file of this run appears in time (naming a stale one if seen)
 */
[[nodiscard]] inline id_file_exchange exchange_id_file(
    launch_env const& env, std::function<unique_id()> const& make,
    std::chrono::milliseconds timeout, std::optional<std::int64_t> not_before_ms = std::nullopt) {
  namespace fs = std::filesystem;
  fs::path const path{env.id_file};
  if (env.rank == 0) {
    unique_id const id = make();
    id_file_lease lease{path, {env.job, unix_ms_now(), id.to_string()}};
    return {id, std::move(lease)};
  }
  std::int64_t const not_before =
      not_before_ms.value_or(process_start_unix_ms() - id_file_max_skew.count());
  auto const deadline = deadline_after(timeout);
  std::string stale;  // why the last file seen was not taken
  while (true) {
    if (auto r = read_id_file_checked(path); !r.refused.empty()) {
      stale = "not trusted: " + r.refused;
    } else if (auto const& c = r.contents) {
      if (c->job != env.job) {
        stale = "it holds job '" + c->job + "', this run is job '" + env.job + "'";
      } else if (env.job.empty() && c->written_ms < not_before) {
        stale = "it was written " + std::to_string((not_before - c->written_ms) / 1000) +
                " s before this run started, and no job id tells the runs apart";
      } else {
        return {unique_id::from_string(c->id), {}};
      }
    }
    if (clock_type::now() >= deadline) {
      throw comm_error{"wm: rank " + std::to_string(env.rank) + " waited " + timeout_text(timeout) +
                       " for the id file '" + path.string() + "' that rank 0 writes" +
                       (stale.empty() ? std::string{}
                        : stale.starts_with("not trusted")
                            ? "; the file there is " + stale +
                                  ": rank 0 writes it with mode 0600 as the "
                                  "user that runs the job"
                            : "; the file there is from another run (" + stale +
                                  "): stale from an earlier run? Set WM_JOB_ID "
                                  "to a value unique to each run")};
    }
    std::this_thread::sleep_for(std::chrono::milliseconds{20});
  }
}

}  // namespace wm::detail
