// SPDX-License-Identifier: Apache-2.0
// Host tests: the failure latch of wm::zero_optimizer's offload (detail/zero/failure_latch.hpp).
// Once a failure is recorded, every check throws a wm::logic_error that names the operation, says
// the optimizer is unusable, and carries the first failure's message (not a later one's).
#include <wm/detail/zero/failure_latch.hpp>

#include <stdexcept>
#include <string>

#include "catch.hpp"

namespace {

// The message of the wm::logic_error that latch.check(operation) throws ("" if none).
std::string check_message(wm::detail::zero::failure_latch const& latch, char const* operation) {
  try {
    latch.check(operation);
  } catch (wm::logic_error const& e) { return e.what(); }
  return {};
}

}  // namespace

TEST_CASE("zero failure latch: the first failure makes every check throw and names it", "[host]") {
  wm::detail::zero::failure_latch latch;
  REQUIRE_FALSE(latch.failed());
  REQUIRE_NOTHROW(latch.check("step"));

  try {
    throw wm::comm_error{"waited for step longer than the communicator's timeout"};
  } catch (...) { latch.record_current(); }
  REQUIRE(latch.failed());
  REQUIRE(latch.what() == "waited for step longer than the communicator's timeout");
  for (char const* op : {"step", "gather", "weights_ready", "save"}) {
    INFO(op);
    std::string const m = check_message(latch, op);
    REQUIRE(m.find(std::string{"zero_optimizer::"} + op + ":") != std::string::npos);
    REQUIRE(m.find("unusable because an earlier offload step failed") != std::string::npos);
    REQUIRE(m.find("waited for step longer than the communicator's timeout") != std::string::npos);
  }
  REQUIRE_THROWS_AS(latch.check("step"), wm::logic_error);

  // What follows from the first failure does not replace it.
  try {
    throw std::runtime_error{"the offload pipeline ended without bucket 3's weights"};
  } catch (...) { latch.record_current(); }
  latch.record("a third one");
  REQUIRE(latch.what() == "waited for step longer than the communicator's timeout");
  REQUIRE(check_message(latch, "step").find("bucket 3") == std::string::npos);
}

TEST_CASE("zero failure latch: exceptions of any type, and no exception at all", "[host]") {
  wm::detail::zero::failure_latch thrown_int;
  try {
    throw 7;
  } catch (...) { thrown_int.record_current(); }
  REQUIRE(thrown_int.failed());
  REQUIRE(check_message(thrown_int, "load").find("not a std::exception") != std::string::npos);

  wm::detail::zero::failure_latch outside;  // not inside a handler: recorded, no terminate
  outside.record_current();
  REQUIRE(outside.failed());
  REQUIRE_THROWS_AS(outside.check("master_shard"), wm::logic_error);

  wm::detail::zero::failure_latch empty;  // an exception without a message still fails it
  empty.record("");
  REQUIRE(empty.failed());
  REQUIRE(check_message(empty, "step").find("(no message)") != std::string::npos);
}
