// SPDX-License-Identifier: Apache-2.0
/**
 * @file decl/zero_codec.cuh
 * @brief The declarations of `<wm/zero_codec.cuh>` without their bodies, for `<wm/wm.cuh>`: every
 * type and signature, none of the definitions (docs/design.md, "Compile time").
 */
#pragma once

#include <wm/error.hpp>

#include <cuda/stream_ref>

#include <concepts>
#include <cstddef>
#include <cstdint>

namespace wm {

/// The element types of `zero_codec`: the bit patterns of 1-, 2-, 4- and 8-byte elements (bf16
/// and fp16 use `std::uint16_t`, float `std::uint32_t`, double `std::uint64_t`).
template <class Word>
concept codec_word = std::same_as<Word, std::uint8_t> || std::same_as<Word, std::uint16_t> ||
    std::same_as<Word, std::uint32_t> || std::same_as<Word, std::uint64_t>;

/**
 * @brief Lossless zero-suppressing encoding of n elements of `Word` (see the file comment for
 * the layout).
 *
 * @tparam Word the element's bit pattern: `std::uint8_t`, `std::uint16_t`, `std::uint32_t` or
 * `std::uint64_t`.
 */
template <codec_word Word>
struct zero_codec {
  /// Elements per tile (one warp each); the scratch holds two 64-bit numbers per tile.
  static constexpr std::size_t tile_elements = 4096;

  /// Bytes of the mask region of @p n elements: ceil(n / 32) words, rounded up to 16 bytes.
  [[nodiscard]] static constexpr std::size_t mask_bytes(std::size_t n) noexcept {
    return (n / 32 + (n % 32 != 0 ? 1 : 0) + 3) / 4 * 16;
  }
  /// Bytes of the encoding of @p n elements of which @p nonzeros are not all-zero bit patterns.
  [[nodiscard]] static constexpr std::size_t encoded_bytes(std::size_t n,
                                                           std::size_t nonzeros) noexcept {
    return mask_bytes(n) + nonzeros * sizeof(Word);
  }
  /// The largest encoding of @p n elements: `encoded_bytes(n, n)`.
  [[nodiscard]] static constexpr std::size_t max_encoded_bytes(std::size_t n) noexcept {
    return encoded_bytes(n, n);
  }

  /**
   * @brief Bytes of device scratch that `encode` and `decode` of @p n elements need: 0 for
   * n = 0, else 256 + 2 * round_up(8 * ceil(n / 4096), 256) + the temporary storage of
   * `cub::DeviceScan::ExclusiveSum` over ceil(n / 4096) 64-bit values (about n / 256 bytes).
   * Any alignment of the scratch pointer is accepted.
   */
  [[nodiscard]] static std::size_t scratch_bytes(std::size_t n);

  /**
   * @brief Encodes @p src[0, n) into @p dst, stream-ordered on @p stream (no host
   * synchronization).
   *
   * @param src the elements (aligned to `sizeof(Word)`; 16-byte aligned is fastest)
   * @param n elements (0 works: writes *nonzeros = 0 and nothing else)
   * @param dst 16-byte aligned; `max_encoded_bytes(n)` writable bytes, of which the first
   * `encoded_bytes(n, *nonzeros)` are written
   * @param nonzeros receives the number of nonzero elements (an address the GPU can write: device
   * memory or pinned host memory), the call's last write
   * @param scratch, scratch_bytes device memory of at least `scratch_bytes(n)` bytes
   * @param stream where the kernels run
   * @throw wm::logic_error on null pointers (n > 0; @p nonzeros always), a misaligned @p src or
   * @p dst, or a scratch smaller than `scratch_bytes(n)` (the message names the size needed)
   */
  static void encode(Word const* src, std::size_t n, std::byte* dst, std::uint64_t* nonzeros,
                     void* scratch, std::size_t scratch_bytes, cuda::stream_ref stream);

  /**
   * @brief Decodes `encode`'s output @p src into @p dst[0, n), stream-ordered on @p stream (no
   * host synchronization). Nothing past dst[n - 1] is written.
   *
   * @param src the encoding of n elements (16-byte aligned)
   * @param n elements
   * @param dst the elements (aligned to `sizeof(Word)`; 16-byte aligned is fastest)
   * @param scratch, scratch_bytes device memory of at least `scratch_bytes(n)` bytes
   * @param stream where the kernels run
   * @throw wm::logic_error on null pointers (n > 0), a misaligned @p src or @p dst, or a scratch
   * smaller than `scratch_bytes(n)` (the message names the size needed)
   */
  static void decode(std::byte const* src, std::size_t n, Word* dst, void* scratch,
                     std::size_t scratch_bytes, cuda::stream_ref stream);
};

}  // namespace wm
