// SPDX-License-Identifier: Apache-2.0
// Small POSIX helpers shared by the node channel, the launcher and file I/O: an owning file
// descriptor, errno messages, whole reads and writes. Host-only.
#pragma once

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <string>
#include <unistd.h>
#include <utility>

namespace wm::detail {

/// Owning POSIX file descriptor; closes on destruction.
class unique_fd {
 public:
  unique_fd() = default;
  explicit unique_fd(int fd) noexcept : fd_{fd} {}
  unique_fd(unique_fd&& other) noexcept : fd_{std::exchange(other.fd_, -1)} {}
  unique_fd& operator=(unique_fd&& other) noexcept {
    if (this != &other) { reset(std::exchange(other.fd_, -1)); }
    return *this;
  }
  unique_fd(unique_fd const&)            = delete;
  unique_fd& operator=(unique_fd const&) = delete;
  ~unique_fd() { reset(); }

  [[nodiscard]] int get() const noexcept { return fd_; }
  [[nodiscard]] bool valid() const noexcept { return fd_ >= 0; }
  [[nodiscard]] int release() noexcept { return std::exchange(fd_, -1); }
  void reset(int fd = -1) noexcept {
    if (fd_ >= 0) { ::close(fd_); }
    fd_ = fd;
  }

 private:
  int fd_{-1};
};

[[nodiscard]] inline std::string errno_text(int err = errno) {
  return std::strerror(err);
}

/// Writes all of @p n bytes, retrying on EINTR and short writes. Returns false on error.
[[nodiscard]] inline bool write_all(int fd, void const* data, std::size_t n) noexcept {
  auto const* p = static_cast<char const*>(data);
  while (n > 0) {
    auto const w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) { continue; }
    if (w <= 0) { return false; }
    p += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}

/// Reads exactly @p n bytes unless EOF or an error comes first. Returns the bytes read.
[[nodiscard]] inline std::size_t read_all(int fd, void* data, std::size_t n) noexcept {
  auto* p          = static_cast<char*>(data);
  std::size_t done = 0;
  while (done < n) {
    auto const r = ::read(fd, p + done, n - done);
    if (r < 0 && errno == EINTR) { continue; }
    if (r <= 0) { break; }
    done += static_cast<std::size_t>(r);
  }
  return done;
}

}  // namespace wm::detail
