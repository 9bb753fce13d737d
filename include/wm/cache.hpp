// SPDX-License-Identifier: Apache-2.0
/**
 * @file cache.hpp
 * @brief Embedding cache policies: `wm::device_cache<Access, Replacement>`,
 * `wm::group_cache<Replacement>`, the access types `wm::read_only` / `wm::read_write`, the
 * replacement types `wm::lfu` / `wm::lru`, run-time `wm::cache_options` and host-readable
 * `wm::cache_statistics`.
 *
 * - `device_cache` (device-cached host memory): the cache's group is the table's; each GPU
 *   caches rows of its own part of the table in its own memory. With `wm::read_write` a line
 *   carries a dirty bit and is written back on eviction and on `flush()`; with `wm::read_only`
 *   nothing is ever written back, and an optimizer with it does not compile.
 * - `group_cache` (local-cached global memory): the cache's group is a subset of the
 *   table's (e.g. one node's ranks from `communicator::split`; by default the table's
 *   communicator); together they cache the whole table, each rank the rows hashed to it, and
 *   every rank reads its peers' lines directly. Read-only by nature.
 *
 * Structure (docs/design.md, "Cache structure"): 32-way sets probed by one warp, set index =
 * hash of the key (not a
 * contiguous id range, so renumbered hot ids spread), a 4-byte tag plus valid/dirty bits and a
 * replacement word per line, nothing per table row. The set bookkeeping lives in
 * <wm/detail/cache/set.hpp> and compiles with a plain C++20 compiler as well as nvcc.
 *
 * Host and device; no CUDA headers: compiles with plain g++.
 */
#pragma once

#include <wm/decl/cache.hpp>
#include <wm/detail/cache/set.hpp>
