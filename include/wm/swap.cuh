// SPDX-License-Identifier: Apache-2.0
/**
 * @file swap.cuh
 * @brief Swap scopes (docs/design.md, "Swap state machine"): buffers paged out to pinned host
 * memory and back, asynchronously, with the scope as an RAII context.
 *
 * - `wm::swap_scope` (construction = create_swap_env, destruction = wait and close) owns a device
 *   pool (the residency budget: one `cudaMalloc`), a pinned host slab (one `cudaHostAlloc`), both
 *   sub-allocated, one copy stream and one `wm::transfer_queue` (with its worker thread) per
 *   direction. Nothing is allocated on the hot path.
 * - `wm::swappable<T>` buffers come from `scope.allocate<T>(count, stream)`:
 *   - `pageout(stream)`: queued at the back of the page-out queue; the copy waits on an event
 *     recorded on @p stream at the call (after the kernels that produced the data); the device
 *     memory goes back to the pool once the copy's event has completed.
 *   - `pageout_begin(stream)` ... `pageout(stream)`: the copy starts at the first call while the
 *     buffer stays readable on the device; the second releases the memory after the readers.
 *   - `need_prefetch()`: queued at the back of the page-in queue, which runs from
 *     `scope.prefetch_all()` on, within the budget and the prefetch lookahead.
 *   - `data(stream)`: the device pointer. Not resident: a passive page-in at the FRONT of the
 *     queue, and @p stream waits on its copy's event (the host waits only for the worker to
 *     issue it). A page-out still in flight is waited for by @p stream; one still queued is
 *     cancelled.
 *   - `pin(stream)` / `unpin()`: an in-use count; a pinned buffer is never paged out.
 * - Buffers that never take a pool block (a framework's own tensors, e.g. PyTorch's saved
 *   activations):
 *   - `scope.pageout_from(src, count, stream)`: a buffer that starts paged out from caller
 *     memory: the copy to the slab goes on the page-out copy stream after the work queued so far
 *     on @p stream, and is issued before the call returns (a wait on the worker only), so that an
 *     allocator told about `pageout_stream()` (PyTorch's `record_stream`) keeps @p src until it is
 *     done. `wait_pageout(stream)`: @p stream waits for that copy (the source may then change).
 *   - `pagein_to(dst, stream)`: copies the data into caller memory on the page-in copy stream
 *     after the work queued so far on @p stream (dst allocated there), without giving the buffer
 *     device memory; `wait_pagein(stream)`: a consumer stream waits for that copy.
 * - Pool blocks change hands stream-ordered: a block whose page-out copy is enqueued, or whose
 *   buffer was released, goes at once to a new buffer or to a page-in, whose stream (a consumer
 *   stream, or the page-in copy stream) waits on the copy's or the release's event; a queued
 *   page-out whose block is needed is issued first. The host waits on the GPU (counted in
 *   `host_blocking_syncs`) only when no block can change hands that way: the pool fragmented, or
 *   every block held by buffers nobody pages out.
 * - Page-outs, prefetches and passive page-ins of buffers smaller than 4 MiB travel in batches;
 *   the copies of neighbours in both memories are merged. Several batches are in flight per
 *   direction. The scope counts what it did (`statistics()`): bytes and GB/s per direction,
 *   how long consumer streams waited, peak resident bytes, allocations and host-blocking syncs.
 * - `wm::zero_codec<Word>` (zero_codec.cuh, included here): a lossless bitmask-plus-nonzeros
 *   encoding that shrinks mostly-zero pages (ReLU activations) before they cross PCIe.
 *
 * Threads: one user thread at a time per buffer; the scope itself is thread-safe. Buffers must be
 * destroyed before their scope. Every host wait has the scope's deadline (`swap_options::timeout`).
 */
#pragma once

#include <wm/decl/swap.cuh>
#include <wm/detail/swap/swap.cuh>
#include <wm/transfer_queue.hpp>
#include <wm/zero_codec.cuh>
