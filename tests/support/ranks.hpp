// SPDX-License-Identifier: Apache-2.0
// Test programs whose cases run inside every rank. Run a program with `--ranks N` (or
// `--ranks all`: one rank per GPU) and its main forks N ranks once, before any CUDA call; each
// rank builds its communicator and runs the Catch cases tagged [ranked] in declaration order, so
// every combination of types and policies is a case of its own and a failure names it. Without
// `--ranks` the program runs the other cases, as before.
//
// After each case the ranks agree on its outcome: a case that failed on some rank is reported,
// with the failing ranks, by rank 0 and counts as failed on every rank. Rank 0's Catch output
// goes to the terminal; the other ranks' output is shown only when that rank failed.
//
// Cases that need at least two ranks carry the tag [multi] as well; the one-rank entries filter
// them out.
#pragma once

#include <wm/comm.hpp>

#include <cstdint>
#include <random>

namespace wm_test {

/// This rank's communicator (only inside a [ranked] case of a program run with --ranks).
[[nodiscard]] wm::communicator& comm();

/// A fresh seed drawn on rank 0, the same on every rank of @p comm (a collective: every rank
/// calls it).
[[nodiscard]] inline std::uint64_t shared_seed(wm::communicator& comm) {
  std::uint64_t const mine =
      (std::uint64_t{std::random_device{}()} << 32) ^ std::uint64_t{std::random_device{}()};
  return comm.all_gather(mine)[0];
}

}  // namespace wm_test
