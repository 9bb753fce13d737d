// SPDX-License-Identifier: Apache-2.0
/**
 * @file embedding.cuh
 * @brief `wm::embedding<T, CachePolicy, Optimizer, Location, Layout, Mapping>`: an embedding
 * table over a `wm::tensor`, trained with a fused sparse optimizer.
 *
 * - Forward: `gather(indices, out, stream)` (the tensor's gather: mapped kernel or NCCL dispatch).
 * - Backward + update: `apply_gradients(indices, grads, lr, stream)` (collective). Gradients
 *   travel to the rank that owns each row (the reverse of the gather path, as a model-parallel
 *   lookup's backward), the owner sorts them by row and sums duplicates, then one fused kernel
 *   reads each unique row's weight, optimizer state and summed gradient once and writes them once.
 *   Optimizer state (and Adam's per-row step) lives in tensors with the table's partition, so
 *   updates never cross GPUs. State and gradient sums are float whatever T is.
 * - Checkpoints: `store(prefix)` / `load(prefix)` write and read weights, states, steps and the
 *   global step in global row order; they load into any rank count, layout or mapping. All or
 *   nothing: `load` checks every file first, `store` writes temporaries and renames them.
 *
 * Cache policies (<wm/cache.hpp>), the second template argument:
 * - `wm::no_cache`: every gather reads the table; the update writes the table.
 * - `wm::device_cache<wm::read_write, R>` (device-cached host table, trainable): each rank keeps
 *   rows of its own part in 32-way sets of device memory (replacement R = `wm::lfu` or `wm::lru`);
 *   a line holds the weight row, its optimizer state and Adam's per-row step, so a hit never
 *   reads the table. The gather serves hits from lines, reads each distinct missing row once and
 *   admits it (write-allocate); `apply_gradients` updates cached rows in their lines (marked
 *   dirty) and other rows in the table (write-around), in one fused pass with the same
 *   arithmetic, so results are bitwise those of `wm::no_cache`. Dirty lines go back to the table
 *   on eviction and on `flush()`; `store()` flushes first, `load()` invalidates.
 * - `wm::device_cache<wm::read_only, R>`: the same for a table that is only read.
 * - `wm::group_cache<R>` (group-cached global table, read-only): the ranks of a group
 *   (`cache_options::group`, by default the table's communicator; one node) cache the whole
 *   table together, each rank the rows whose key hashes to it, in lines of its device memory
 *   that every rank of the group maps. A gather reads each distinct key once, from its holder's
 *   line (a peer's over NVLink) or else from the table through the mapping, and hints the misses
 *   to their holders, which admit them in their own next gather. Nothing in it is collective or
 *   waits for the host: each rank gathers on its own. On one rank (a group of one), a read-only
 *   device cache of the whole table. On several ranks the table's layout must be mapped
 *   (`wm::continuous`, `wm::chunked`); a `wm::distributed` table is refused (not built yet).
 *   After changing the table's rows, every rank calls `invalidate()` (then synchronize and meet
 *   at a barrier) before gathering again.
 * Read-only policies do not compile with an optimizer. On several ranks a device cache holds rows
 * of each rank's own part: gathers of any row go through its owner (the exchange engine; the
 * owner serves them from its cache), updates happen at the owner as without a cache.
 */
#pragma once

#include <wm/cache.hpp>
#include <wm/comm.hpp>
#include <wm/decl/embedding.cuh>
#include <wm/detail/embedding/embedding.cuh>
#include <wm/tensor.cuh>
