// SPDX-License-Identifier: Apache-2.0
// wm::zero_codec chosen by the element size at run time (1, 2, 4 or 8 bytes: the bit pattern is
// what is compared with zero), for saved_tensors, whose sources carry their element size. Host
// code; the codec's bodies come from nvcc or an explicit instantiation (docs/design.md, "Codec").
#pragma once

#include <wm/decl/zero_codec.cuh>
#include <wm/error.hpp>

#include <cuda/stream_ref>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace wm::detail {

/// Calls @p f with a value of the codec word of @p elem bytes.
/// @throw wm::logic_error for any other size
template <class F>
decltype(auto) with_codec_word(std::size_t elem, F&& f) {
  switch (elem) {
    case 1: return f(std::uint8_t{});
    case 2: return f(std::uint16_t{});
    case 4: return f(std::uint32_t{});
    case 8: return f(std::uint64_t{});
    default:
      throw wm::logic_error{"saved_tensors: no zero encoding for elements of " +
                            std::to_string(elem) + " bytes (1, 2, 4 or 8)"};
  }
}

/// Whether elements of @p elem bytes can be encoded.
[[nodiscard]] inline bool codec_supports(std::size_t elem) noexcept {
  return elem == 1 || elem == 2 || elem == 4 || elem == 8;
}

/// `zero_codec::encoded_bytes` of @p n elements of @p elem bytes, @p nonzeros of them nonzero.
[[nodiscard]] inline std::size_t codec_encoded_bytes(std::size_t n, std::size_t nonzeros,
                                                     std::size_t elem) {
  return with_codec_word(
      elem, [&](auto word) { return zero_codec<decltype(word)>::encoded_bytes(n, nonzeros); });
}

/// `zero_codec::max_encoded_bytes` of @p n elements of @p elem bytes.
[[nodiscard]] inline std::size_t codec_max_encoded_bytes(std::size_t n, std::size_t elem) {
  return with_codec_word(
      elem, [&](auto word) { return zero_codec<decltype(word)>::max_encoded_bytes(n); });
}

/// `zero_codec::scratch_bytes` of @p n elements of @p elem bytes.
[[nodiscard]] inline std::size_t codec_scratch_bytes(std::size_t n, std::size_t elem) {
  return with_codec_word(elem,
                         [&](auto word) { return zero_codec<decltype(word)>::scratch_bytes(n); });
}

/// `zero_codec::encode` of @p n elements of @p elem bytes at @p src on @p s.
inline void codec_encode(void const* src, std::size_t n, std::size_t elem, void* dst,
                         std::uint64_t* nonzeros, void* scratch, std::size_t scratch_bytes,
                         cudaStream_t s) {
  with_codec_word(elem, [&](auto word) {
    using W = decltype(word);
    zero_codec<W>::encode(static_cast<W const*>(src), n, static_cast<std::byte*>(dst), nonzeros,
                          scratch, scratch_bytes, cuda::stream_ref{s});
  });
}

/// `zero_codec::decode` of @p n elements of @p elem bytes into @p dst on @p s.
inline void codec_decode(void const* src, std::size_t n, std::size_t elem, void* dst, void* scratch,
                         std::size_t scratch_bytes, cudaStream_t s) {
  with_codec_word(elem, [&](auto word) {
    using W = decltype(word);
    zero_codec<W>::decode(static_cast<std::byte const*>(src), n, static_cast<W*>(dst), scratch,
                          scratch_bytes, cuda::stream_ref{s});
  });
}

}  // namespace wm::detail
