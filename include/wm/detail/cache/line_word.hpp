// SPDX-License-Identifier: Apache-2.0
// The word of a group-cache line (detail/cache/group_ref.cuh) that readers on every GPU of the
// group check before and after they copy the line's row: key + 1 in the low half while the line
// holds that key's whole row (0: it holds none), a generation in the high half that the holder
// advances each time it empties the line. A reader serves its copy only if the word it loaded after
// the copy is the word it loaded before, and that word named its key: a copy made while the holder
// replaced the row, even through other keys and back to the same one, is never served. Host and
// device: the host tests (tests/cache/set_test.cpp) run the protocol on these functions.
#pragma once

#include <wm/config.hpp>

#include <cstdint>

namespace wm::detail::cache {

/// The key + 1 of a line word (0: no whole row).
[[nodiscard]] WM_HOST_DEVICE constexpr std::uint32_t word_key(std::uint64_t word) noexcept {
  return static_cast<std::uint32_t>(word);
}

/// Whether @p word says its line holds @p key's whole row.
[[nodiscard]] WM_HOST_DEVICE constexpr bool word_holds(std::uint64_t word,
                                                       std::uint32_t key) noexcept {
  return word_key(word) == key + 1u;
}

/// What the holder stores to empty a line whose word is @p word (before it writes a new row): no
/// key, the next generation.
[[nodiscard]] WM_HOST_DEVICE constexpr std::uint64_t emptied_word(std::uint64_t word) noexcept {
  return ((word >> 32) + 1) << 32;
}

/// What the holder stores to publish @p key's row (written after @p empty was stored); keys
/// stay below 2^32 - 1.
[[nodiscard]] WM_HOST_DEVICE constexpr std::uint64_t published_word(std::uint64_t empty,
                                                                    std::uint32_t key) noexcept {
  return empty | (key + 1u);
}

/// Whether a reader that loaded @p before, copied the line's row, then (after a fence) loaded
/// @p after may serve its copy as @p key's row.
[[nodiscard]] WM_HOST_DEVICE constexpr bool copy_stands(std::uint64_t before, std::uint64_t after,
                                                        std::uint32_t key) noexcept {
  return word_holds(before, key) && after == before;
}

}  // namespace wm::detail::cache
