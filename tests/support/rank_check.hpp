// SPDX-License-Identifier: Apache-2.0
// Checks inside forked ranks: Catch2's assertion state lives in the parent, so a rank reports a
// failed check by throwing; wm::launch then names the rank and the check in its launch_error.
#pragma once

#include <chrono>
#include <sstream>
#include <stdexcept>
#include <string>

#define RANK_REQUIRE(cond)                                                                       \
  do {                                                                                           \
    if (!(cond)) {                                                                               \
      throw std::runtime_error{std::string{"check failed: "} + #cond + " at " + __FILE__ + ":" + \
                               std::to_string(__LINE__)};                                        \
    }                                                                                            \
  } while (0)

#define RANK_REQUIRE_MSG(cond, msg)                                                                \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      std::ostringstream wm_os_;                                                                   \
      wm_os_ << "check failed: " << #cond << " at " << __FILE__ << ":" << __LINE__ << ": " << msg; \
      throw std::runtime_error{wm_os_.str()};                                                      \
    }                                                                                              \
  } while (0)

namespace wm_test {

/// Runs @p call, which must throw E on this rank within 5 s (a failure every rank sees is not a
/// hang); returns the message.
template <class E, class F>
std::string throws_soon(F&& call, std::string const& what) {
  using clock_type = std::chrono::steady_clock;
  auto const start = clock_type::now();
  std::string msg;
  bool threw = false;
  try {
    call();
  } catch (E const& e) {
    threw = true;
    msg   = e.what();
  }
  auto const took = std::chrono::duration<double>(clock_type::now() - start).count();
  RANK_REQUIRE_MSG(threw, what << ": no error");
  RANK_REQUIRE_MSG(took < 5.0, what << ": the error took " << took << " s");
  return msg;
}

}  // namespace wm_test
