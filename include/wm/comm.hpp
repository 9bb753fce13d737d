// SPDX-License-Identifier: Apache-2.0
/**
 * @file comm.hpp
 * @brief `wm::communicator`: a fixed group of ranks, one process per GPU.
 *
 * - `wm::unique_id`: created by one rank, carried to all by any launcher.
 * - `wm::communicator`: NCCL for everything that crosses GPUs; a host-side all-gather of small
 *   byte buffers; barriers; node-local rank and size; `split`; device all-to-all-v; typed device
 *   collectives (`all_reduce`, `reduce_scatter`, `all_gather`, `broadcast`).
 * - `wm::node_channel`: passes POSIX file descriptors between the ranks of one node.
 *
 * Every collective member function must be called by all ranks in the same order. The host-side
 * collectives (construction, `barrier`, `all_gather`, `split`, `expect_same`) exchange a small
 * descriptor first, so ranks that call different collectives, or the same one with different
 * arguments, get a `wm::comm_error` on every rank instead of a hang. Waits for peers end with a
 * `wm::comm_error` after the communicator's timeout (a dead peer does not hang the others). The
 * device exchanges (`send_recv`, `all_to_all_v`) are the exception: they check nothing across
 * ranks and do not wait for their transfers, so sizes that two ranks disagree on hang the stream.
 *
 * A communicator holds two NCCL communicators over the same ranks: a nonblocking one for
 * everything that waits with a deadline (creation, host-side collectives, finalize; `nccl()`),
 * and a blocking twin, split from it at creation, for the device exchanges. NCCL launches each
 * nonblocking group from a new thread (60-110 us of host time per call on an H100), a blocking
 * one in ~10 us; the distributed gather makes several exchanges per call. The twin connects to
 * every peer at creation (one byte each way), so an exchange never waits for a peer on the host;
 * NCCL connects a collective's algorithm at its first use instead, so the first typed collective
 * of each shape meets every rank with the deadline first (see `communicator::all_reduce`).
 * It costs a second NCCL communicator's GPU memory; `communicator_options::exchange_twin` (or
 * `WM_EXCHANGE_TWIN=0`) leaves it out, and the exchanges then use the nonblocking one; if any
 * rank leaves it out, every rank does. Do not set `NCCL_COMM_BLOCKING=1`: it overrides the
 * nonblocking configuration, and the deadlines above stop applying.
 *
 * Destroying a communicator waits (up to the timeout) for the node's other ranks to destroy it
 * too: destroy communicators (and their splits) in the same order on every rank.
 *
 * Host code only: this header compiles with a plain C++20 compiler as well as with nvcc.
 */
#pragma once

#include <wm/decl/comm.hpp>
#include <wm/detail/comm/agreement.hpp>
#include <wm/detail/comm/collectives.hpp>
#include <wm/detail/comm/lifecycle.hpp>
#include <wm/detail/comm/node_channel.hpp>
#include <wm/detail/comm/unique_id.hpp>
