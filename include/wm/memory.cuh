// SPDX-License-Identifier: Apache-2.0
/**
 * @file memory.cuh
 * @brief `wm::memory<Location, Layout>`: one logical allocation owned by all ranks of a
 * communicator, partitioned by a granularity that is never split.
 *
 * Location: `wm::host` (pinned host memory mapped into every GPU) or `wm::device`.
 * Layout: `wm::continuous` (every rank maps the whole range at one pointer), `wm::chunked`
 * (every rank maps every rank's part: one pointer per rank), `wm::distributed` (a rank reaches
 * only its own part; others need explicit communication). The six combinations are allocated
 * so (docs/design.md, "Memory kinds"):
 * - continuous·device: each rank; driver VMM: `cuMemCreate`, fd export over the node channel,
 *   import, `cuMemMap` into one reserved range;
 * - chunked·device: each rank; `cudaMalloc` + CUDA IPC handles;
 * - continuous·host, chunked·host: the first rank; `memfd_create` shared with every rank, `mmap`
 *   + `cudaHostRegister(Mapped)` on every rank;
 * - distributed·device: each rank, `cudaMalloc`; distributed·host: each rank, `cudaMallocHost`.
 *
 * Mapped layouts (continuous, chunked) need every rank on one node; distributed works anywhere.
 * Views are trivially copyable and are passed to kernels by value. A view that a layout cannot
 * serve does not compile.
 */
#pragma once

#include <wm/comm.hpp>
#include <wm/decl/memory.cuh>
#include <wm/detail/memory/memory.hpp>
