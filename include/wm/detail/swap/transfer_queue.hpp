// SPDX-License-Identifier: Apache-2.0
// Bodies of wm::transfer_queue (declared in <wm/transfer_queue.hpp>).
#pragma once

#include <wm/error.hpp>

#include <algorithm>
#include <exception>

namespace wm {

template <transfer_copier Copier>
transfer_queue<Copier>::transfer_queue(Copier& copier, transfer_queue_options options)
    : copier_{copier}, options_{options} {
  WM_EXPECTS(options.max_in_flight >= 1, "transfer_queue: max_in_flight must be at least 1");
  WM_EXPECTS(options.poll_interval.count() > 0, "transfer_queue: poll_interval must be positive");
  worker_ = std::thread{[this] { run(); }};
}

template <transfer_copier Copier>
transfer_queue<Copier>::~transfer_queue() {
  close();
}

template <transfer_copier Copier>
bool transfer_queue<Copier>::push(transfer_task t, bool front, bool even_if_locked) {
  {
    std::lock_guard lock{mutex_};
    if ((locked_ && !even_if_locked) || closing_) { return false; }
    t.passive   = front;
    t.admission = transfer_admission::start;
    if (front) {
      tasks_.push_front(t);
    } else {
      tasks_.push_back(t);
    }
    blocked_ = false;
  }
  work_.notify_one();
  return true;
}

template <transfer_copier Copier>
bool transfer_queue<Copier>::enqueue(transfer_task t) {
  return push(t, false, false);
}

template <transfer_copier Copier>
bool transfer_queue<Copier>::requeue(transfer_task t) {
  return push(t, false, true);  // a copier's follow-up goes in while a drain runs
}

template <transfer_copier Copier>
bool transfer_queue<Copier>::enqueue_front(transfer_task t) {
  return push(t, true, false);
}

template <transfer_copier Copier>
bool transfer_queue<Copier>::erase(std::uint64_t id) {
  bool found = false;
  {
    std::lock_guard lock{mutex_};
    auto const it = std::find_if(tasks_.begin(), tasks_.end(),
                                 [id](transfer_task const& t) { return t.id == id; });
    if (it != tasks_.end()) {
      tasks_.erase(it);
      found = true;
    }
  }
  if (found) { done_.notify_all(); }
  return found;
}

template <transfer_copier Copier>
bool transfer_queue<Copier>::promote(std::uint64_t id) {
  {
    std::lock_guard lock{mutex_};
    auto const it = std::find_if(tasks_.begin(), tasks_.end(),
                                 [id](transfer_task const& t) { return t.id == id; });
    if (it == tasks_.end()) { return false; }
    transfer_task t = *it;
    tasks_.erase(it);
    t.passive = true;
    tasks_.push_front(t);
    blocked_ = false;
  }
  work_.notify_one();
  return true;
}

template <transfer_copier Copier>
std::optional<transfer_task> transfer_queue<Copier>::dequeue() {
  std::optional<transfer_task> t;
  {
    std::lock_guard lock{mutex_};
    if (tasks_.empty()) { return std::nullopt; }
    auto it = std::find_if(tasks_.begin(), tasks_.end(),
                           [](transfer_task const& x) { return x.passive; });
    if (it == tasks_.end()) { it = tasks_.begin(); }
    t = *it;
    tasks_.erase(it);
  }
  done_.notify_all();
  return t;
}

template <transfer_copier Copier>
void transfer_queue<Copier>::start() {
  {
    std::lock_guard lock{mutex_};
    locked_  = false;
    started_ = true;
    blocked_ = false;
  }
  work_.notify_one();
}

template <transfer_copier Copier>
void transfer_queue<Copier>::pause() {
  std::lock_guard lock{mutex_};
  locked_  = false;
  started_ = false;
}

template <transfer_copier Copier>
bool transfer_queue<Copier>::wait_and_stop(clock::time_point deadline) {
  return drain(deadline, false);
}

template <transfer_copier Copier>
bool transfer_queue<Copier>::wait(clock::time_point deadline) {
  return drain(deadline, true);
}

template <transfer_copier Copier>
bool transfer_queue<Copier>::drain(clock::time_point deadline, bool unlock_after) {
  std::unique_lock lock{mutex_};
  bool const was_locked = locked_;
  locked_               = true;
  ++drains_;
  blocked_ = false;
  work_.notify_one();
  bool const drained = done_.wait_until(lock, deadline, [this] { return idle_locked() || error_; });
  --drains_;
  if (unlock_after) {
    locked_ = was_locked;
  } else {
    started_ = false;
  }
  if (error_) {
    auto e = std::exchange(error_, nullptr);
    std::rethrow_exception(e);
  }
  return drained;
}

// The join waits for the copies in flight as long as the copier's poll says "not yet": a copier
// whose copies may never complete bounds it by throwing from poll past its own deadline (the
// ticket is then dropped uncompleted, see run), as swap_core's copiers do at its teardown.
template <transfer_copier Copier>
void transfer_queue<Copier>::close() noexcept {
  {
    std::lock_guard lock{mutex_};
    if (closing_ && !worker_.joinable()) { return; }
    closing_ = true;
    locked_  = true;
    tasks_.clear();
  }
  work_.notify_one();
  done_.notify_all();
  if (worker_.joinable() && worker_.get_id() != std::this_thread::get_id()) { worker_.join(); }
}

template <transfer_copier Copier>
void transfer_queue<Copier>::release(std::size_t bytes) {
  {
    std::lock_guard lock{mutex_};
    lookahead_used_ -= std::min(bytes, lookahead_used_);
    blocked_ = false;
  }
  work_.notify_one();
}

template <transfer_copier Copier>
void transfer_queue<Copier>::notify() {
  {
    std::lock_guard lock{mutex_};
    blocked_ = false;
  }
  work_.notify_one();
}

template <transfer_copier Copier>
std::size_t transfer_queue<Copier>::waiting() const {
  std::lock_guard lock{mutex_};
  return tasks_.size();
}

template <transfer_copier Copier>
std::size_t transfer_queue<Copier>::in_flight() const {
  std::lock_guard lock{mutex_};
  return flights_.size();
}

template <transfer_copier Copier>
bool transfer_queue<Copier>::locked() const {
  std::lock_guard lock{mutex_};
  return locked_;
}

template <transfer_copier Copier>
std::uint64_t transfer_queue<Copier>::batches() const {
  std::lock_guard lock{mutex_};
  return batches_;
}

template <transfer_copier Copier>
std::size_t transfer_queue<Copier>::lookahead_used() const {
  std::lock_guard lock{mutex_};
  return lookahead_used_;
}

template <transfer_copier Copier>
bool transfer_queue<Copier>::idle_locked() const {
  return tasks_.empty() && flights_.empty() && submitting_ == 0;
}

// The next batch to submit, removed from the queue: the first passive task (with the passive
// small ones right after it), else, when back tasks may go, the front task and the small ones
// after it, within the in-flight and lookahead limits. Empty when nothing may go now.
template <transfer_copier Copier>
std::vector<transfer_task> transfer_queue<Copier>::pick_locked() {
  std::vector<transfer_task> batch;
  if (tasks_.empty()) { return batch; }
  auto first =
      std::find_if(tasks_.begin(), tasks_.end(), [](transfer_task const& t) { return t.passive; });
  bool const passive = first != tasks_.end();
  if (!passive) {
    bool const may_go = (started_ || drains_ > 0) && !blocked_ && !closing_ &&
                        flights_.size() < static_cast<std::size_t>(options_.max_in_flight);
    if (!may_go) { return batch; }
    first = tasks_.begin();
  } else if (blocked_) {
    return batch;
  }
  auto const fits_lookahead = [&](std::size_t used, std::size_t bytes) {
    return passive || drains_ > 0 || options_.lookahead_bytes == 0 || used == 0 ||
           used + bytes <= options_.lookahead_bytes;
  };
  std::size_t used = lookahead_used_;
  if (!fits_lookahead(used, first->bytes)) { return batch; }
  auto last         = first + 1;
  std::size_t total = first->bytes;
  used += passive ? 0 : first->bytes;
  if (first->bytes < options_.coalesce_below) {
    while (last != tasks_.end() && last->passive == passive &&
           last->bytes < options_.coalesce_below &&
           total + last->bytes <= options_.coalesce_limit && fits_lookahead(used, last->bytes)) {
      total += last->bytes;
      used += passive ? 0 : last->bytes;
      ++last;
    }
  }
  batch.assign(first, last);
  tasks_.erase(first, last);
  return batch;
}

template <transfer_copier Copier>
void transfer_queue<Copier>::run() {
  std::unique_lock lock{mutex_};
  std::vector<ticket_type> done;
  while (true) {
    // 1. Complete what has finished (outside the lock: the copier may call back). A poll that
    // throws (the copy failed) drops its ticket uncompleted and the error goes to the next drain.
    bool poll_failed = false;
    for (auto it = flights_.begin(); it != flights_.end();) {
      bool finished = false;
      bool failed   = false;
      try {
        finished = copier_.poll(it->ticket);
      } catch (...) {
        if (!error_) { error_ = std::current_exception(); }
        failed = poll_failed = true;
      }
      if (finished || failed) {
        if (finished) { done.push_back(std::move(it->ticket)); }
        if (options_.release_on_completion) {
          lookahead_used_ -= std::min(it->lookahead_bytes, lookahead_used_);
        }
        it = flights_.erase(it);
      } else {
        ++it;
      }
    }
    if (poll_failed) { done_.notify_all(); }
    if (!done.empty()) {
      ++submitting_;  // not idle while completing
      lock.unlock();
      for (auto& t : done) {
        try {
          copier_.complete(t);
        } catch (...) {
          std::lock_guard g{mutex_};
          if (!error_) { error_ = std::current_exception(); }
        }
      }
      done.clear();
      lock.lock();
      --submitting_;
      blocked_ = false;
      done_.notify_all();
      continue;
    }
    if (closing_ && flights_.empty()) { break; }

    // 2. Submit the next batch, if one may go.
    auto batch = pick_locked();
    if (!batch.empty()) {
      submitting_ += batch.size();
      lock.unlock();
      std::optional<ticket_type> ticket;
      std::exception_ptr failed;
      try {
        ticket = copier_.submit(std::span<transfer_task>{batch});
      } catch (...) { failed = std::current_exception(); }
      lock.lock();
      submitting_ -= batch.size();
      if (failed) {
        if (!error_) { error_ = failed; }
      } else {
        std::size_t held = 0;
        for (auto it = batch.rbegin(); it != batch.rend(); ++it) {
          if (it->admission == transfer_admission::defer) {
            if (!closing_) { tasks_.push_front(*it); }
            blocked_ = true;
          } else if (it->admission == transfer_admission::start && !it->passive) {
            held += it->bytes;
          }
        }
        if (ticket) {
          lookahead_used_ += held;
          flights_.push_back(flight{std::move(*ticket), held});
          ++batches_;
        }
      }
      done_.notify_all();
      continue;
    }

    // 3. Sleep until something happens; poll while copies are in flight or tasks were deferred.
    if (!flights_.empty() || blocked_) {
      work_.wait_for(lock, options_.poll_interval);
      blocked_ = false;
    } else {
      work_.wait_for(lock, std::chrono::milliseconds{100});
    }
  }
}

}  // namespace wm
