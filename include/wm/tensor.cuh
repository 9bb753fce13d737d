// SPDX-License-Identifier: Apache-2.0
/**
 * @file tensor.cuh
 * @brief `wm::tensor<T, Location, Layout, Mapping>`: a 1D or 2D tensor over `wm::memory`, rows
 * partitioned over the ranks (a row is never split), with `gather` and `scatter` by row index.
 *
 * - Mapped layouts (continuous, chunked): one kernel reads or writes the rows directly through
 *   the per-rank mappings (NVLink/PCIe do the transport), 16-byte accesses where alignment
 *   allows, several rows in flight per group of lanes. Not collective.
 * - Distributed layout: the model-parallel lookup — indices are bucketed by owner,
 *   counts and indices exchanged with NCCL, rows gathered by their owners and sent back, then put
 *   back in the caller's order; scatter is the mirror image. Collective: every rank calls, with
 *   its own (possibly empty) batch; the call synchronizes the stream once to size its buffers.
 *   When every rank shares one node, the gather's owners gather the rows locally (a staging
 *   buffer of the rows this rank sends, as on the NCCL path) and the GPU's copy engines move them
 *   straight into the asking rank's receive buffer (a "mailbox": device memory mapped into every
 *   peer over CUDA IPC, sized to the largest request seen, made at the first gather); only a flag
 *   crosses NCCL. With `WM_DISPATCH_ROWS=put` on some rank the owners' gather kernels store the
 *   rows into the mailboxes themselves (no staging buffer; slower on 2 H200s: 1.03 against 0.84
 *   ms for 1M keys of 512 B per rank). Across nodes, when the mailbox cannot be made (no peer
 *   access), or with `WM_DISPATCH_ROWS=nccl` on some rank, the rows cross through NCCL. A tensor
 *   takes its path at its first gather (`gather_path`).
 *
 * Indices are `int32_t` or `int64_t` in device memory. An index outside [0, rows) is an input
 * error: the synchronous forms throw `wm::logic_error`; the `_async` forms record it, and
 * `check_errors(stream)` throws it. A gathered row for a bad index is zero; a bad index in a
 * scatter writes nothing.
 *
 * A tensor's calls run one after another, whatever their streams: each waits on the device for
 * the last one's end (they share buffers and the error state). `store`, `load`, move-assignment
 * and destruction wait for the last call's end on the host, at most the communicator's timeout
 * (past it, or in a destructor run by stack unwinding with exchanges pending, the communicator is
 * aborted so that no rank waits for peers that will not come). `check_errors` on any stream
 * reports a bad index of any earlier call once that call has run. Not thread-safe:
 * call a tensor from one host thread at a time. A bad index makes only the rank that passed it
 * throw; on the distributed layout every rank still completes the exchange. A distributed call
 * that one rank cannot make (a null pointer with a nonzero count, a CUDA failure before the
 * exchange) or that the ranks make differently (gather here, scatter there; other row sizes or
 * index types) throws the same error on every rank right after the count exchange, which every
 * rank still joins; nothing is moved and the communicator stays usable.
 *
 * Duplicate indices in `scatter`: the row receives the values of the last occurrence in the
 * caller's batch. Across ranks scattering to the same row at the same time: on mapped layouts
 * one of them wins (unspecified which); on the distributed layout the highest rank wins.
 */
#pragma once

#include <wm/comm.hpp>
#include <wm/decl/tensor.cuh>
#include <wm/detail/tensor/ref.cuh>
#include <wm/detail/tensor/tensor.cuh>
#include <wm/memory.cuh>
