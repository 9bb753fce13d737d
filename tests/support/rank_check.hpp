// SPDX-License-Identifier: Apache-2.0
// Checks inside forked ranks: Catch2's assertion state lives in the parent, so a rank reports a
// failed check by throwing; wm::launch then names the rank and the check in its launch_error.
#pragma once

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
