// SPDX-License-Identifier: Apache-2.0
/*
 * The zero-suppressing encoding of saved activations (wm::zero_codec) behind plain functions,
 * so that the bindings (wm_torch.cpp, which includes torch) need no CUDA compiler: the kernels
 * are instantiated in wm_torch_codec.cu. The element is chosen by its size in bytes (1, 2, 4 or
 * 8: its bit pattern is what is compared with zero, so -0.0 and NaN are kept as they are).
 */
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace wm_torch {

/// Whether elements of @p elem bytes can be encoded (1, 2, 4 or 8).
[[nodiscard]] bool codec_supports(std::size_t elem) noexcept;
/// The encoding's size for @p n elements of which @p nonzeros are not zero.
[[nodiscard]] std::size_t codec_encoded_bytes(std::size_t n, std::size_t nonzeros,
                                              std::size_t elem);
/// The largest encoding of @p n elements (no zeros: the mask adds 1 bit per element).
[[nodiscard]] std::size_t codec_max_encoded_bytes(std::size_t n, std::size_t elem);
/// Device scratch that encode and decode of @p n elements need.
[[nodiscard]] std::size_t codec_scratch_bytes(std::size_t n, std::size_t elem);
/// Encodes @p n elements at @p src into @p dst (codec_max_encoded_bytes writable) on @p s and
/// writes the count of nonzero elements to @p nonzeros (device or pinned host memory).
void codec_encode(void const* src, std::size_t n, std::size_t elem, void* dst,
                  std::uint64_t* nonzeros, void* scratch, std::size_t scratch_bytes,
                  cudaStream_t s);
/// Decodes codec_encode's output at @p src into @p n elements at @p dst on @p s.
void codec_decode(void const* src, std::size_t n, std::size_t elem, void* dst, void* scratch,
                  std::size_t scratch_bytes, cudaStream_t s);

}  // namespace wm_torch
