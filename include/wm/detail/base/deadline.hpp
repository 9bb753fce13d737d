// SPDX-License-Identifier: Apache-2.0
// Deadlines and waits: the clock every wait in wm uses, the saturating deadline arithmetic, the
// WM_TIMEOUT_S parser, and the back-off between polls. Host-only.
#pragma once

#include <wm/error.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

namespace wm::detail {

using clock_type = std::chrono::steady_clock;

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

}  // namespace wm::detail
