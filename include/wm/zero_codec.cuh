// SPDX-License-Identifier: Apache-2.0
/**
 * @file zero_codec.cuh
 * @brief A lossless zero-suppressing encoding (a bitmask, then the nonzero elements), for pages
 * of activations that are mostly zeros (ReLU outputs) before they cross PCIe: the idea of
 * NVIDIA's cDMA and of Gist.
 *
 * Encoded layout (bytes; the start 16-byte aligned) of n elements of `Word`:
 * - the mask: ceil(n / 32) little-endian `uint32` words; bit j of word w is set iff element
 *   32 w + j's bit pattern is not all zeros (so -0.0 and NaNs are kept), padded with zero bytes to
 *   a multiple of 16 bytes (`mask_bytes(n)`);
 * - then the nonzero elements in index order (`nonzeros * sizeof(Word)` bytes).
 *
 * Encoding reads the source twice (the mask, then the values), decoding reads the encoding once
 * (and the mask twice) and writes every element once. Both run stream-ordered, without host
 * synchronization, in tiles of 4096 elements (one warp each), with a scan of the tiles' counts.
 *
 * The declarations compile with a host compiler too (wm/swap.cuh includes this header, and
 * host-compiled bindings include that); the bodies only with nvcc: a host-compiled translation
 * unit calls them through an explicit instantiation in a .cu file of the same program, e.g.
 * `template struct wm::zero_codec<std::uint16_t>;`.
 */
#pragma once

#include <wm/decl/zero_codec.cuh>

// The bodies are kernels: nvcc only. A translation unit of the host compiler (e.g. PyTorch
// bindings in a .cpp file, which include wm/swap.cuh) sees the declarations above and links
// against an explicit instantiation in a .cu file: `template struct wm::zero_codec<std::uint16_t>;`
#if defined(__CUDACC__)
#include <wm/detail/codec/zero_codec.cuh>
#endif
