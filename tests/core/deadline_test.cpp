// SPDX-License-Identifier: Apache-2.0
// Host tests of the shared deadline arithmetic (every wait in wm computes its deadline with
// detail::deadline_after), the WM_TIMEOUT_S parser, and the keyed hash that names sockets.
#include <wm/comm.hpp>
#include <wm/detail/base/deadline.hpp>
#include <wm/detail/base/hash.hpp>

#include <chrono>
#include <cstdlib>
#include <optional>
#include <string>

#include "catch.hpp"

using namespace std::chrono_literals;
using ms         = std::chrono::milliseconds;
using clock_type = wm::detail::clock_type;

TEST_CASE("deadline_after saturates at the clock's end instead of wrapping", "[host]") {
  auto const now = clock_type::now();
  // Plain values: exact.
  CHECK(wm::detail::deadline_after(ms{10'000}, now) == now + 10s);
  CHECK(wm::detail::deadline_after(ms{1}, now) == now + 1ms);
  // Zero and negative: now.
  CHECK(wm::detail::deadline_after(ms{0}, now) == now);
  CHECK(wm::detail::deadline_after(ms{-5}, now) == now);
  CHECK(wm::detail::deadline_after(ms::min(), now) == now);
  // milliseconds::max() and values beyond the clock's range (steady_clock counts nanoseconds:
  // about 292 years) mean "no limit", never a time in the past.
  CHECK(wm::detail::deadline_after(ms::max(), now) == clock_type::time_point::max());
  CHECK(wm::detail::deadline_after(ms::max()) == clock_type::time_point::max());
  auto const thousand_years = std::chrono::duration_cast<ms>(std::chrono::hours{24 * 365 * 1000});
  CHECK(wm::detail::deadline_after(thousand_years, now) == clock_type::time_point::max());
  CHECK(wm::detail::deadline_after(thousand_years) > now);
  // Near the end of the clock even a small step saturates.
  auto const late = clock_type::time_point::max() - 1us;
  CHECK(wm::detail::deadline_after(ms{1}, late) == clock_type::time_point::max());
  auto const close = clock_type::time_point::max() - 5s;
  CHECK(wm::detail::deadline_after(ms{1000}, close) == close + 1s);

  CHECK(wm::detail::unlimited(ms::max()));
  CHECK(wm::detail::unlimited(thousand_years));
  CHECK_FALSE(wm::detail::unlimited(std::chrono::duration_cast<ms>(std::chrono::hours{24 * 365})));
  CHECK_FALSE(wm::detail::unlimited(ms{300'000}));
  CHECK(wm::detail::timeout_text(ms::max()) == "no limit");
  CHECK(wm::detail::timeout_text(ms{250}) == "250 ms");
  // A wait with no limit polls in long slices; one in the past does not wait.
  CHECK(wm::detail::millis_left(clock_type::time_point::max()) == (1 << 29));
  CHECK(wm::detail::millis_left(now - 1s) == 0);
  auto const left = wm::detail::millis_left(clock_type::now() + 2s);
  CHECK(left > 1900);
  CHECK(left <= 2000);
}

TEST_CASE("WM_TIMEOUT_S: seconds, 'inf' or a huge value for no limit, errors for the rest",
          "[host]") {
  auto parse = [](std::string const& s) { return wm::detail::parse_timeout_seconds(s, "X"); };
  CHECK(parse("300") == ms{300'000});
  CHECK(parse("0.5") == ms{500});
  CHECK(parse("2.25") == ms{2250});
  CHECK(parse("0.0001") == ms{1});  // never rounds down to zero
  CHECK(parse("86400") == ms{86'400'000});
  for (char const* none : {"inf", "infinity", "none", "1e30", "1e300", "1e400", "9.3e15", "INF"}) {
    INFO(none);
    CHECK(parse(none) == ms::max());
  }
  for (char const* bad : {"", "abc", "0", "-1", "-inf", "5s", "nan", "1e-9999"}) {
    INFO(bad);
    CHECK_THROWS_AS(parse(bad), wm::logic_error);
  }

  // Through the environment, as communicator_options reads it.
  std::optional<std::string> saved;
  if (char const* s = std::getenv("WM_TIMEOUT_S")) { saved = s; }
  ::setenv("WM_TIMEOUT_S", "1e30", 1);
  CHECK(wm::communicator_options::default_timeout() == ms::max());
  CHECK(wm::communicator_options{}.timeout == ms::max());
  CHECK(wm::detail::deadline_after(wm::communicator_options{}.timeout) ==
        clock_type::time_point::max());
  ::setenv("WM_TIMEOUT_S", "12.5", 1);
  CHECK(wm::communicator_options::default_timeout() == ms{12'500});
  ::setenv("WM_TIMEOUT_S", "soon", 1);
  CHECK_THROWS_AS(wm::communicator_options::default_timeout(), wm::logic_error);
  ::unsetenv("WM_TIMEOUT_S");
  CHECK(wm::communicator_options::default_timeout() == ms{300'000});
  if (saved) { ::setenv("WM_TIMEOUT_S", saved->c_str(), 1); }
}

TEST_CASE("siphash24 matches the reference vectors of its paper", "[host]") {
  // Key 00 01 .. 0f; messages 00 01 .. (n-1); outputs from SipHash's reference test vectors.
  std::uint64_t const k0 = 0x0706050403020100ull;
  std::uint64_t const k1 = 0x0f0e0d0c0b0a0908ull;
  std::string msg;
  for (int i = 0; i < 16; ++i) { msg.push_back(static_cast<char>(i)); }
  CHECK(wm::detail::siphash24(k0, k1, std::string_view{}) == 0x726fdb47dd0e0e31ull);
  CHECK(wm::detail::siphash24(k0, k1, std::string_view{msg}.substr(0, 1)) == 0x74f839c593dc67fdull);
  CHECK(wm::detail::siphash24(k0, k1, std::string_view{msg}.substr(0, 8)) == 0x93f5f5799a932462ull);
  CHECK(wm::detail::siphash24(k0, k1, std::string_view{msg}.substr(0, 15)) ==
        0xa129ca6149be45e5ull);
  // Another key or one more byte changes the output.
  CHECK(wm::detail::siphash24(k0 ^ 1, k1, "wm") != wm::detail::siphash24(k0, k1, "wm"));
  CHECK(wm::detail::siphash24(k0, k1, "wm") != wm::detail::siphash24(k0, k1, "wm!"));
}
