// SPDX-License-Identifier: Apache-2.0
/**
 * @file transfer_queue.hpp
 * @brief `wm::transfer_queue`: the task queue of a swap scope (docs/design.md, "Swap state
 * machine"), one per direction, drained by its own worker thread through a copier policy.
 *
 * A task names a buffer (`id`) and its size. `enqueue` puts it at the back (page-outs, active
 * prefetch), `enqueue_front` at the front (a passive page-in: highest priority), `erase` takes a
 * task back while it waits, `promote` moves a waiting task to the front, `dequeue` pops the next
 * one by hand. The worker forms batches from
 * the front and hands them to the copier, which starts, defers or drops each task and returns a
 * ticket for what it started; the worker polls the ticket and completes it.
 *
 * - Passive tasks (enqueued at the front) always go first, whether or not the queue is started,
 *   and are not held back by the in-flight or lookahead limits.
 * - Tasks at the back go only once `start()` was called (or while `wait` / `wait_and_stop`
 *   drain), with at most `max_in_flight` batches in flight and, for a queue with a lookahead,
 *   at most `lookahead_bytes` started and not yet released (a drain submits everything, the
 *   lookahead aside).
 * - Consecutive tasks smaller than `coalesce_below` travel as one batch of up to
 *   `coalesce_limit` bytes: the copier may merge their copies.
 * - `wait_and_stop(deadline)` locks the queue against new tasks and drains it; `wait(deadline)`
 *   does the same and unlocks afterwards. Both return false if the deadline passed first.
 *
 * No CUDA in here: the copier (`wm::transfer_copier`) does the copies, so the CPU tests drive
 * the queue with a fake one. Compiles with a plain C++20 compiler as well as nvcc.
 */
#pragma once

#include <wm/decl/transfer_queue.hpp>
#include <wm/detail/swap/transfer_queue.hpp>
