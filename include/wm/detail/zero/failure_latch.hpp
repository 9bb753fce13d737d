// SPDX-License-Identifier: Apache-2.0
// The first failure of wm::zero_optimizer's offload machinery, kept. Once a step of the offload
// pipeline failed (a wait past the communicator's deadline, an exception from the CPU Adam, a
// cancelled wait), the host copies of the master weights and moments may be half updated and the
// step's bookkeeping half done: the optimizer records the failure here and every later operation
// that would read or write that state throws a wm::logic_error that names it, instead of going on
// from a state that no step produced. Host-only (the CPU-side tests read it with the host
// compiler); used on the caller's thread only.
#pragma once

#include <wm/error.hpp>

#include <exception>
#include <string>
#include <string_view>

namespace wm::detail::zero {

class failure_latch {
 public:
  /// Keeps @p what as the cause unless a failure is kept already (the first one is the cause;
  /// what follows from it says less).
  void record(std::string_view what) noexcept {
    if (failed_) { return; }
    failed_ = true;
    try {
      what_ = what;
    } catch (...) {  // no memory for the message: the failure is kept all the same
    }
  }

  /// Records the exception being handled (call it inside a catch block).
  void record_current() noexcept {
    std::exception_ptr const current = std::current_exception();
    if (!current) {
      record("a failure outside an exception handler");
      return;
    }
    try {
      std::rethrow_exception(current);
    } catch (std::exception const& e) { record(e.what()); } catch (...) {
      record("an exception that is not a std::exception");
    }
  }

  [[nodiscard]] bool failed() const noexcept { return failed_; }
  /// The first failure's message (empty while none was recorded).
  [[nodiscard]] std::string const& what() const noexcept { return what_; }

  /// @throw wm::logic_error naming @p operation and the first failure, once one was recorded
  void check(std::string_view operation) const {
    if (!failed_) { return; }
    throw logic_error{"wm: zero_optimizer::" + std::string{operation} +
                      ": the optimizer is unusable because an earlier offload step failed: " +
                      (what_.empty() ? std::string{"(no message)"} : what_) +
                      ". Destroy it; a checkpoint saved before the failure loads into a new one"};
  }

 private:
  bool failed_{false};
  std::string what_;
};

}  // namespace wm::detail::zero
