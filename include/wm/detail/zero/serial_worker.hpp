// SPDX-License-Identifier: Apache-2.0
// One background thread that runs posted jobs in order (the offload pipeline of
// wm::zero_optimizer: each bucket's CPU Adam starts as soon as its gradients are on the host,
// while the caller's thread goes on enqueuing backward). `wait_idle` waits, up to a deadline,
// for every job posted so far and rethrows the first exception one of them threw; after a job
// threw, the jobs queued behind it are dropped (they would work on a step that failed).
// `cancelled()` tells a running job to give up (the destructor sets it, then joins).
// Host-only, no dependency beyond the standard library.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

namespace wm::detail::zero {

class serial_worker {
 public:
  using clock = std::chrono::steady_clock;

  serial_worker() : thread_{[this] { work_(); }} {}
  serial_worker(serial_worker const&)            = delete;
  serial_worker& operator=(serial_worker const&) = delete;
  /// Asks the running job to stop (`cancelled()`), drops the queued ones and joins.
  ~serial_worker() {
    {
      std::lock_guard lock{mu_};
      stop_ = true;
      queue_.clear();
    }
    wake_.notify_all();
    thread_.join();
  }

  /// Queues @p job (run on the worker thread after the jobs posted before it).
  void post(std::function<void()> job) {
    {
      std::lock_guard lock{mu_};
      queue_.push_back(std::move(job));
      ++posted_;
    }
    wake_.notify_all();
  }

  /// Waits until every job posted so far has ended (or was dropped), at most until
  /// @p deadline. Returns false at the deadline (the jobs go on); rethrows (once) the first
  /// exception a job threw.
  [[nodiscard]] bool wait_idle(clock::time_point deadline) {
    std::unique_lock lock{mu_};
    if (!idle_.wait_until(lock, deadline, [&] { return ended_ == posted_; })) { return false; }
    if (error_) { std::rethrow_exception(std::exchange(error_, nullptr)); }
    return true;
  }

  /// True once the destructor runs: a job that waits for something should stop waiting.
  [[nodiscard]] bool cancelled() const noexcept {
    std::lock_guard lock{mu_};
    return stop_;
  }

 private:
  void work_() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock lock{mu_};
        wake_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (stop_) { return; }
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      std::exception_ptr failed;
      try {
        job();
      } catch (...) { failed = std::current_exception(); }
      {
        std::lock_guard lock{mu_};
        ++ended_;
        if (failed) {
          if (!error_) { error_ = failed; }
          ended_ += queue_.size();  // dropped: they belong to the step that failed
          queue_.clear();
        }
      }
      idle_.notify_all();
    }
  }

  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable idle_;
  std::deque<std::function<void()>> queue_;
  std::size_t posted_{0};
  std::size_t ended_{0};
  bool stop_{false};
  std::exception_ptr error_;
  std::thread thread_;  // last: starts after the members it reads exist
};

}  // namespace wm::detail::zero
