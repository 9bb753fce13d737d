// SPDX-License-Identifier: Apache-2.0
// Small POSIX helpers shared by the node channel, the launcher and file I/O: an owning file
// descriptor, deadlines, and errno messages. Host-only.
#pragma once

#include <wm/error.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <thread>
#include <unistd.h>
#include <utility>

namespace wm::detail {

using clock_type = std::chrono::steady_clock;

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

/// Pauses between polls of something that usually finishes within microseconds (an NCCL enqueue,
/// a short stream): yields for the first millisecond, then sleeps @p nap between polls.
class backoff {
 public:
  explicit backoff(std::chrono::microseconds nap) : nap_{nap} {}
  void pause() {
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

/// The deadline @p timeout after @p now, saturating: a timeout that would pass the clock's end
/// (`std::chrono::milliseconds::max()`, or any huge value) gives `time_point::max()`, "no
/// limit"; a timeout of zero or less gives @p now. Every wait in wm computes its deadline here.
[[nodiscard]] constexpr clock_type::time_point deadline_after(std::chrono::milliseconds timeout,
                                                              clock_type::time_point now) noexcept {
  using std::chrono::milliseconds;
  if (timeout <= milliseconds::zero()) { return now; }
  // Compared in milliseconds: converting a huge timeout to the clock's nanoseconds would overflow.
  auto const room = std::chrono::duration_cast<milliseconds>(clock_type::time_point::max() - now);
  if (timeout >= room) { return clock_type::time_point::max(); }
  return now + std::chrono::duration_cast<clock_type::duration>(timeout);
}

/// As above, from now.
[[nodiscard]] inline clock_type::time_point deadline_after(
    std::chrono::milliseconds timeout) noexcept {
  return deadline_after(timeout, clock_type::now());
}

/// True if @p timeout means "no limit" (its deadline saturates; e.g. `milliseconds::max()`).
[[nodiscard]] inline bool unlimited(std::chrono::milliseconds timeout) noexcept {
  return deadline_after(timeout) == clock_type::time_point::max();
}

/// "N ms", or "no limit", for messages.
[[nodiscard]] inline std::string timeout_text(std::chrono::milliseconds timeout) {
  return unlimited(timeout) ? std::string{"no limit"} : std::to_string(timeout.count()) + " ms";
}

/**
 * @brief Parses a timeout in seconds (`WM_TIMEOUT_S`): a positive decimal number ("300", "0.5",
 * "1e9"); `inf`, `none` or a value too large for the clock mean "no limit"
 * (`milliseconds::max()`).
 * @throw wm::logic_error on anything else (empty, not a number, zero, negative)
 */
[[nodiscard]] inline std::chrono::milliseconds parse_timeout_seconds(std::string const& text,
                                                                     char const* what) {
  using std::chrono::milliseconds;
  if (text == "inf" || text == "infinity" || text == "none") { return milliseconds::max(); }
  char* end         = nullptr;
  errno             = 0;
  double const s    = std::strtod(text.c_str(), &end);
  bool const number = !text.empty() && end == text.c_str() + text.size() && s == s;  // not NaN
  WM_EXPECTS(
      number && s > 0,
      std::string{what} + " must be a positive number of seconds (or 'inf'), got '" + text + "'");
  // 2^62 ms (~146 million years) and more, an overflow (errno = ERANGE, s = HUGE_VAL) included:
  // no limit. Below that, the product is exact enough and fits in a long long.
  double const ms = s * 1000.0;
  if (errno == ERANGE || ms >= 4.6e18) { return milliseconds::max(); }
  return milliseconds{std::max<long long>(1, static_cast<long long>(ms))};
}

/// Milliseconds left until @p deadline, at least 0, at most 2^29 (for poll(); a longer or
/// unlimited wait polls again).
[[nodiscard]] inline int millis_left(clock_type::time_point deadline) {
  auto const left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock_type::now()).count();
  if (left <= 0) { return 0; }
  return left > (1 << 29) ? (1 << 29) : static_cast<int>(left);
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

/// 64-bit FNV-1a, used to turn names and host identities into compact keys.
[[nodiscard]] constexpr std::uint64_t fnv1a(std::string_view s,
                                            std::uint64_t h = 1469598103934665603ull) noexcept {
  for (char c : s) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return h;
}

/// Mixes two 64-bit values (splitmix64 finalizer over their combination).
[[nodiscard]] constexpr std::uint64_t mix64(std::uint64_t a, std::uint64_t b) noexcept {
  std::uint64_t z = a + 0x9e3779b97f4a7c15ull * (b + 1);
  z               = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z               = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/// SipHash-2-4 of @p data under the 128-bit key (@p k0, @p k1) (Aumasson and Bernstein, 2012):
/// a keyed hash whose output does not reveal the key. Names node-local sockets from the token.
[[nodiscard]] constexpr std::uint64_t siphash24(std::uint64_t k0, std::uint64_t k1,
                                                std::string_view data) noexcept {
  auto rotl        = [](std::uint64_t x, int b) { return (x << b) | (x >> (64 - b)); };
  std::uint64_t v0 = k0 ^ 0x736f6d6570736575ull;
  std::uint64_t v1 = k1 ^ 0x646f72616e646f6dull;
  std::uint64_t v2 = k0 ^ 0x6c7967656e657261ull;
  std::uint64_t v3 = k1 ^ 0x7465646279746573ull;
  auto round       = [&] {
    v0 += v1;
    v1 = rotl(v1, 13);
    v1 ^= v0;
    v0 = rotl(v0, 32);
    v2 += v3;
    v3 = rotl(v3, 16);
    v3 ^= v2;
    v0 += v3;
    v3 = rotl(v3, 21);
    v3 ^= v0;
    v2 += v1;
    v1 = rotl(v1, 17);
    v1 ^= v2;
    v2 = rotl(v2, 32);
  };
  auto compress = [&](std::uint64_t m) {
    v3 ^= m;
    round();
    round();
    v0 ^= m;
  };
  std::size_t const n = data.size();
  std::size_t i       = 0;
  for (; i + 8 <= n; i += 8) {
    std::uint64_t m = 0;
    for (int b = 0; b < 8; ++b) {
      m |= std::uint64_t{static_cast<unsigned char>(data[i + static_cast<std::size_t>(b)])}
           << (8 * b);
    }
    compress(m);
  }
  std::uint64_t last = std::uint64_t{n & 0xff} << 56;
  for (int b = 0; i + static_cast<std::size_t>(b) < n; ++b) {
    last |= std::uint64_t{static_cast<unsigned char>(data[i + static_cast<std::size_t>(b)])}
            << (8 * b);
  }
  compress(last);
  v2 ^= 0xff;
  round();
  round();
  round();
  round();
  return v0 ^ v1 ^ v2 ^ v3;
}

}  // namespace wm::detail
