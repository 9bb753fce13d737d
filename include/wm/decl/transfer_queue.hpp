// SPDX-License-Identifier: Apache-2.0
/**
 * @file decl/transfer_queue.hpp
 * @brief The declarations of `<wm/transfer_queue.hpp>` without their bodies, for `<wm/wm.cuh>`:
 * every type and signature, none of the definitions (docs/design.md, "Compile time").
 */
#pragma once

#include <chrono>
#include <concepts>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <limits>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <utility>
#include <vector>

namespace wm {

/** @brief What a copier does with one task of a batch. */
enum class transfer_admission : std::uint8_t {
  start,  ///< the copy is part of the ticket returned
  defer,  ///< not now (no room): the task goes back to the front of the queue
  drop    ///< not needed any more: the task is forgotten
};

/** @brief One transfer waiting in a `transfer_queue`. */
struct transfer_task {
  std::uint64_t id{};                                       ///< the buffer it moves (owner's key)
  std::size_t bytes{};                                      ///< bytes it moves
  bool passive{};                                           ///< enqueued at the front
  transfer_admission admission{transfer_admission::start};  ///< set by the copier's submit
};

/**
 * @brief A copier policy: starts the copies of a batch and reports when they are done.
 *
 * - `submit(batch)`: for each task, sets `admission`; issues the copies of the started ones
 *   (may merge contiguous ones) and returns a ticket for them, or `std::nullopt` if none started.
 * - `poll(ticket)`: true once the ticket's copies are done (must not block).
 * - `complete(ticket)`: called once per ticket after `poll` said true, by the worker thread.
 *
 * `submit` and `complete` run on the worker thread without the queue's lock held, so they may
 * call back into the queue (`enqueue`, `erase`, `notify`).
 */
template <class C>
concept transfer_copier = requires(C& c, std::span<transfer_task> batch,
                                   typename C::ticket_type const& t) {
  typename C::ticket_type;
  { c.submit(batch) } -> std::same_as<std::optional<typename C::ticket_type>>;
  { c.poll(t) } -> std::same_as<bool>;
  {c.complete(t)};
};

/** @brief Limits of a `transfer_queue`. */
struct transfer_queue_options {
  int max_in_flight{4};                               ///< batches of back tasks in flight at once
  std::size_t coalesce_below{std::size_t{4} << 20};   ///< tasks smaller than this are batched
  std::size_t coalesce_limit{std::size_t{32} << 20};  ///< bytes of one batch of small tasks
  /// Bytes of back tasks started and not yet `release`d (0: no limit).
  std::size_t lookahead_bytes{0};
  /// true: bytes count against the lookahead until their copy completes (then released by the
  /// queue itself); false: until the owner calls `release` (what a prefetch brought in is used).
  bool release_on_completion{true};
  /// How often the worker polls tickets in flight and retries deferred tasks.
  std::chrono::microseconds poll_interval{50};
};

/**
 * @brief A queue of transfers in one direction, drained by a worker thread through @p Copier.
 * @tparam Copier satisfies `wm::transfer_copier`; the queue keeps a reference to it, which
 * must outlive the queue.
 *
 * Thread-safe: any thread may enqueue, erase, wait. Move-only semantics are not offered (the
 * worker holds `this`). The destructor calls `close()`.
 */
template <transfer_copier Copier>
class transfer_queue {
 public:
  using ticket_type = typename Copier::ticket_type;  ///< what the copier returns per batch
  using clock       = std::chrono::steady_clock;     ///< the clock of the deadlines

  /** @brief A queue feeding @p copier; the worker thread starts here, idle until tasks come. */
  explicit transfer_queue(Copier& copier, transfer_queue_options options = {});
  transfer_queue(transfer_queue const&)            = delete;
  transfer_queue& operator=(transfer_queue const&) = delete;
  /** @brief `close()`: drops waiting tasks, waits for the copies in flight, joins the worker. */
  ~transfer_queue();

  /** @brief Puts @p t at the back. @return false (task refused) while the queue is locked. */
  bool enqueue(transfer_task t);
  /** @brief Puts @p t at the back even while the queue is locked: a follow-up a copier queues
   * from `complete` belongs to the drain in progress. @return false only once closed. */
  bool requeue(transfer_task t);
  /** @brief Puts @p t at the front as a passive task. @return false while locked. */
  bool enqueue_front(transfer_task t);
  /** @brief Removes the waiting task of buffer @p id. @return false if none waits (started,
   * done, being submitted, or never queued). */
  bool erase(std::uint64_t id);
  /** @brief Moves the waiting task of buffer @p id to the front as a passive task: it goes next,
   * past the in-flight limit and whether or not the queue is started (a copy whose completion
   * someone waits for). Works while locked. @return false if none waits. */
  bool promote(std::uint64_t id);
  /** @brief Pops the task the worker would take next (first passive, else the front), without
   * running it. */
  [[nodiscard]] std::optional<transfer_task> dequeue();

  /** @brief Unlocks the queue and lets back tasks go (start_actions). */
  void start();
  /** @brief Unlocks the queue and holds back tasks until the next `start` (passive ones still go).
   */
  void pause();
  /**
   * @brief Locks the queue against new tasks and drains it (every waiting task is submitted and
   * every copy completed); the queue stays locked and paused afterwards.
   * @return true if drained before @p deadline. @throw whatever a copier threw on the worker.
   */
  bool wait_and_stop(clock::time_point deadline);
  /** @brief Locks, drains, then unlocks and restores whether back tasks go. @return as above. */
  bool wait(clock::time_point deadline);
  /** @brief Stops for good: refuses tasks, drops waiting ones, waits for the copies in flight,
   * joins the worker. Idempotent; never throws. */
  void close() noexcept;

  /** @brief Gives back @p bytes of the lookahead (queues with `release_on_completion` false). */
  void release(std::size_t bytes);
  /** @brief Wakes the worker to retry deferred tasks (the copier has room again). */
  void notify();

  [[nodiscard]] std::size_t waiting() const;         ///< tasks queued, not yet submitted
  [[nodiscard]] std::size_t in_flight() const;       ///< tickets not yet completed
  [[nodiscard]] bool locked() const;                 ///< new tasks are refused
  [[nodiscard]] std::uint64_t batches() const;       ///< tickets submitted so far
  [[nodiscard]] std::size_t lookahead_used() const;  ///< bytes counted against the lookahead

 private:
  /// Queues @p t at the front (passive) or back; refused while closing, or while locked unless
  /// @p even_if_locked.
  bool push(transfer_task t, bool front, bool even_if_locked);
  struct flight {
    ticket_type ticket;
    std::size_t lookahead_bytes;  // back-task bytes it holds against the lookahead
  };

  [[nodiscard]] bool idle_locked() const;
  [[nodiscard]] std::vector<transfer_task> pick_locked();
  bool drain(clock::time_point deadline, bool unlock_after);
  void run();

  Copier& copier_;
  transfer_queue_options options_;
  mutable std::mutex mutex_;
  std::condition_variable work_;  // the worker sleeps here
  std::condition_variable done_;  // drains sleep here
  std::deque<transfer_task> tasks_;
  std::vector<flight> flights_;
  std::size_t submitting_{0};  // tasks taken by the worker, not yet started or returned
  std::size_t lookahead_used_{0};
  std::uint64_t batches_{0};
  int drains_{0};  // drains in progress (back tasks go while > 0)
  bool started_{false};
  bool locked_{false};
  bool closing_{false};
  bool blocked_{false};  // the last submit deferred: retry after the poll interval or a notify
  std::exception_ptr error_;
  std::thread worker_;
};

}  // namespace wm
