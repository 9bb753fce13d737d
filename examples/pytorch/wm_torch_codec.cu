// SPDX-License-Identifier: Apache-2.0
/*
 * wm::zero_codec for the element sizes of torch's dtypes (see wm_torch_codec.hpp).
 */
#include <wm/error.hpp>
#include <wm/zero_codec.cuh>

#include <cuda/stream_ref>

#include <string>

#include "wm_torch_codec.hpp"

namespace wm_torch {
namespace {

/// Calls @p f with a value of the unsigned word type of @p elem bytes.
template <class F>
decltype(auto) with_word(std::size_t elem, F&& f) {
  switch (elem) {
    case 1: return f(std::uint8_t{});
    case 2: return f(std::uint16_t{});
    case 4: return f(std::uint32_t{});
    case 8: return f(std::uint64_t{});
    default:
      throw wm::logic_error{"wm_torch: no zero encoding for elements of " + std::to_string(elem) +
                            " bytes (1, 2, 4 or 8)"};
  }
}

}  // namespace

bool codec_supports(std::size_t elem) noexcept {
  return elem == 1 || elem == 2 || elem == 4 || elem == 8;
}

std::size_t codec_encoded_bytes(std::size_t n, std::size_t nonzeros, std::size_t elem) {
  return with_word(elem, [&]<class W>(W) { return wm::zero_codec<W>::encoded_bytes(n, nonzeros); });
}

std::size_t codec_max_encoded_bytes(std::size_t n, std::size_t elem) {
  return with_word(elem, [&]<class W>(W) { return wm::zero_codec<W>::max_encoded_bytes(n); });
}

std::size_t codec_scratch_bytes(std::size_t n, std::size_t elem) {
  return with_word(elem, [&]<class W>(W) { return wm::zero_codec<W>::scratch_bytes(n); });
}

void codec_encode(void const* src, std::size_t n, std::size_t elem, void* dst,
                  std::uint64_t* nonzeros, void* scratch, std::size_t scratch_bytes,
                  cudaStream_t s) {
  with_word(elem, [&]<class W>(W) {
    wm::zero_codec<W>::encode(static_cast<W const*>(src), n, static_cast<std::byte*>(dst), nonzeros,
                              scratch, scratch_bytes, cuda::stream_ref{s});
  });
}

void codec_decode(void const* src, std::size_t n, std::size_t elem, void* dst, void* scratch,
                  std::size_t scratch_bytes, cudaStream_t s) {
  with_word(elem, [&]<class W>(W) {
    wm::zero_codec<W>::decode(static_cast<std::byte const*>(src), n, static_cast<W*>(dst), scratch,
                              scratch_bytes, cuda::stream_ref{s});
  });
}

}  // namespace wm_torch
