// Small POSIX helpers shared by the node channel, the launcher and file I/O: an owning file
// descriptor, deadlines, and errno messages. Host-only.
#pragma once

#include <wm/error.hpp>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <utility>

#include <unistd.h>

namespace wm::detail {

using clock_type = std::chrono::steady_clock;

/// Owning POSIX file descriptor; closes on destruction.
class unique_fd {
 public:
  unique_fd() = default;
  explicit unique_fd(int fd) noexcept : fd_{fd} {}
  unique_fd(unique_fd&& other) noexcept : fd_{std::exchange(other.fd_, -1)} {}
  unique_fd& operator=(unique_fd&& other) noexcept
  {
    if (this != &other) { reset(std::exchange(other.fd_, -1)); }
    return *this;
  }
  unique_fd(unique_fd const&)            = delete;
  unique_fd& operator=(unique_fd const&) = delete;
  ~unique_fd() { reset(); }

  [[nodiscard]] int get() const noexcept { return fd_; }
  [[nodiscard]] bool valid() const noexcept { return fd_ >= 0; }
  [[nodiscard]] int release() noexcept { return std::exchange(fd_, -1); }
  void reset(int fd = -1) noexcept
  {
    if (fd_ >= 0) { ::close(fd_); }
    fd_ = fd;
  }

 private:
  int fd_{-1};
};

[[nodiscard]] inline std::string errno_text(int err = errno) { return std::strerror(err); }

/// Pauses between polls of something that usually finishes within microseconds (an NCCL enqueue,
/// a short stream): yields for the first millisecond, then sleeps @p nap between polls.
class backoff {
 public:
  explicit backoff(std::chrono::microseconds nap) : nap_{nap} {}
  void pause()
  {
    if (clock_type::now() < spin_until_) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(nap_);
    }
  }

 private:
  clock_type::time_point spin_until_{clock_type::now() + std::chrono::milliseconds{1}};
  std::chrono::microseconds nap_;
};

/// Milliseconds left until @p deadline, at least 0, at most INT_MAX/2 (for poll()).
[[nodiscard]] inline int millis_left(clock_type::time_point deadline)
{
  auto const left =
    std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock_type::now()).count();
  if (left <= 0) { return 0; }
  return left > (1 << 29) ? (1 << 29) : static_cast<int>(left);
}

/// Writes all of @p n bytes, retrying on EINTR and short writes. Returns false on error.
[[nodiscard]] inline bool write_all(int fd, void const* data, std::size_t n) noexcept
{
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
[[nodiscard]] inline std::size_t read_all(int fd, void* data, std::size_t n) noexcept
{
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

/// 64-bit FNV-1a, used to turn names and host identities into compact keys.
[[nodiscard]] constexpr std::uint64_t fnv1a(std::string_view s,
                                            std::uint64_t h = 1469598103934665603ull) noexcept
{
  for (char c : s) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return h;
}

/// Mixes two 64-bit values (splitmix64 finalizer over their combination).
[[nodiscard]] constexpr std::uint64_t mix64(std::uint64_t a, std::uint64_t b) noexcept
{
  std::uint64_t z = a + 0x9e3779b97f4a7c15ull * (b + 1);
  z               = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z               = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace wm::detail
