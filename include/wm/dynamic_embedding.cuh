// SPDX-License-Identifier: Apache-2.0
/**
 * @file dynamic_embedding.cuh
 * @brief `wm::dynamic_embedding<T, Optimizer, Eviction>`: a hash embedding for 64-bit keys of any
 * value, rows inserted on demand into a table of fixed capacity, trained with the same fused
 * sparse optimizers as `wm::embedding`, evicting by score when a bucket is full.
 *
 * - Lookup: `find` (read-only; missing keys give the initializer's row or zeros and a found
 *   mask), `find_or_insert` / `gather` (missing keys are inserted with the initializer's row and
 *   fresh optimizer state), and `ref().find(key)` in user kernels.
 * - Writes: `insert_or_assign`, `insert_and_evict` (hands evicted keys, rows, states, steps and
 *   scores back), `erase`, `clear`.
 * - Training: `apply_gradients(keys, grads, lr)` with the embedding's update kernels over rows
 *   in slot order.
 * - Eviction policies: `wm::lru`, `wm::lfu`, `wm::epoch_lru`, `wm::epoch_lfu`,
 *   `wm::custom_score`, `wm::no_eviction`.
 * - Inspection: `size`, `load_factor`, `export_batch` with a predicate on the score.
 *
 * One rank for now (docs/design.md, "Dynamic embeddings"); the reserved keys are
 * `wm::dynamic_empty_key` and `wm::dynamic_locked_key` (-1 and -2 as `std::int64_t`).
 */
#pragma once

#include <wm/comm.hpp>
#include <wm/decl/dynamic_embedding.cuh>
#include <wm/detail/dynamic/dynamic_embedding.cuh>
#include <wm/embedding.cuh>
