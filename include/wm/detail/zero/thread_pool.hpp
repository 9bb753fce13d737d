// SPDX-License-Identifier: Apache-2.0
// A small persistent thread pool for host work of wm::zero_optimizer (the CPU Adam of the
// offload path): `run(tasks, fn)` calls fn(task) for every task over the workers and the calling
// thread and returns when all are done. Task k always runs on thread k mod size(), so memory a
// caller first touches with the same split stays on the thread (and NUMA node) that uses it;
// `run_claimed` instead lets each free thread take the next task (load balance).
// One caller at a time: `run` is not reentrant and two threads must not call it at once.
// Optionally each worker is pinned to one CPU of those the constructing thread may run on.
// Host-only, no dependency beyond the standard library (and the OS's affinity calls on Linux).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

namespace wm::detail::zero {

/// The CPUs the calling thread may run on (its affinity mask, which a launcher's binding or
/// `taskset` narrows), in increasing order; where the platform does not say, 0 to
/// hardware_concurrency() - 1.
inline std::vector<int> allowed_cpus() {
  std::vector<int> cpus;
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &set)) { cpus.push_back(c); }
    }
  }
#endif
  if (cpus.empty()) {
    unsigned const n = std::max(1u, std::thread::hardware_concurrency());
    for (unsigned c = 0; c < n; ++c) { cpus.push_back(static_cast<int>(c)); }
  }
  return cpus;
}

class thread_pool {
 public:
  /// A pool of @p threads threads in all, the caller's included (0: one per CPU the constructing
  /// thread may run on, allowed_cpus()). With @p pin, worker k (1 <= k < size()) runs only on
  /// allowed_cpus()[k mod their count]; the calling thread, which runs task share 0, is never
  /// pinned (it may be the user's). Throws std::system_error if a worker cannot be pinned, or
  /// where pinning is not supported.
  explicit thread_pool(unsigned threads = 0, bool pin = false) {
    auto const cpus = allowed_cpus();
    if (threads == 0) { threads = static_cast<unsigned>(cpus.size()); }
    workers_.reserve(threads - 1);
    try {
      for (unsigned i = 1; i < threads; ++i) {
        workers_.emplace_back([this, i] { work_(i); });
        if (pin) { pin_(workers_.back(), cpus[i % cpus.size()]); }
      }
    } catch (...) {
      stop_all_();
      throw;
    }
  }
  thread_pool(thread_pool const&)            = delete;
  thread_pool& operator=(thread_pool const&) = delete;
  ~thread_pool() { stop_all_(); }

  /// Threads in all, the caller's included.
  [[nodiscard]] unsigned size() const noexcept {
    return static_cast<unsigned>(workers_.size()) + 1;
  }

  /// Calls @p fn(task) for task in [0, tasks); task k on thread k mod size(). Rethrows the first
  /// exception a task threw, after every task has ended.
  template <class F>
  void run(std::size_t tasks, F&& fn) {
    run_(tasks, std::forward<F>(fn), false);
  }

  /// As run(), but each thread claims the next task not yet taken when it is free (in increasing
  /// order), so a thread that shares its core with others (the caller's, the CUDA driver's) does
  /// fewer tasks instead of holding up the rest. For work with no tie between a task and a thread.
  template <class F>
  void run_claimed(std::size_t tasks, F&& fn) {
    run_(tasks, std::forward<F>(fn), true);
  }

 private:
  template <class F>
  void run_(std::size_t tasks, F&& fn, bool claimed) {
    if (tasks == 0) { return; }
    auto call = [](void* ctx, std::size_t task) {
      (*static_cast<std::remove_reference_t<F>*>(ctx))(task);
    };
    {
      std::lock_guard lock{mu_};
      call_    = call;
      ctx_     = static_cast<void*>(&fn);
      tasks_   = tasks;
      claimed_ = claimed;
      next_.store(0, std::memory_order_relaxed);
      pending_ = workers_.size();
      error_   = nullptr;
      ++generation_;
    }
    if (!workers_.empty()) { wake_.notify_all(); }
    run_share_(0);
    std::unique_lock lock{mu_};
    done_.wait(lock, [&] { return pending_ == 0; });
    if (error_) { std::rethrow_exception(std::exchange(error_, nullptr)); }
  }

  static void pin_(std::thread& t, int cpu) {
#if defined(__linux__)
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    int const rc = pthread_setaffinity_np(t.native_handle(), sizeof set, &set);
    if (rc != 0) {
      throw std::system_error{rc, std::generic_category(),
                              "wm: cannot pin a CPU Adam thread to CPU " + std::to_string(cpu)};
    }
#else
    (void)t;
    throw std::system_error{
        std::make_error_code(std::errc::function_not_supported),
        "wm: pinning CPU threads (cpu " + std::to_string(cpu) + ") is supported on Linux only"};
#endif
  }

  void stop_all_() noexcept {
    {
      std::lock_guard lock{mu_};
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) { t.join(); }
  }

  void run_share_(std::size_t thread) noexcept {
    auto const call = [this](std::size_t t) noexcept {
      try {
        call_(ctx_, t);
      } catch (...) {
        std::lock_guard lock{mu_};
        if (!error_) { error_ = std::current_exception(); }
      }
    };
    if (claimed_) {
      for (std::size_t t; (t = next_.fetch_add(1, std::memory_order_relaxed)) < tasks_;) {
        call(t);
      }
      return;
    }
    std::size_t const stride = workers_.size() + 1;
    for (std::size_t t = thread; t < tasks_; t += stride) { call(t); }
  }

  void work_(std::size_t thread) {
    std::uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock lock{mu_};
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) { return; }
        seen = generation_;
      }
      run_share_(thread);
      std::lock_guard lock{mu_};
      if (--pending_ == 0) { done_.notify_one(); }
    }
  }

  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::vector<std::thread> workers_;
  void (*call_)(void*, std::size_t){};
  void* ctx_{};
  std::size_t tasks_{};
  bool claimed_{};                   // run_claimed: tasks taken from next_
  std::atomic<std::size_t> next_{};  // the next task not yet claimed
  std::size_t pending_{};
  std::uint64_t generation_{};
  bool stop_{};
  std::exception_ptr error_;
};

}  // namespace wm::detail::zero
