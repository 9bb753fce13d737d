// SPDX-License-Identifier: Apache-2.0
// The eviction policies' score rules for wm::dynamic_embedding: each engine says what score a key
// gets when a call inserts it and when a call finds it again, whether a full bucket may evict,
// whether a newcomer may replace the lowest-scored slot, and whether the caller supplies scores.
// A bucket's victim is always its lowest score (lowest slot on ties) among the slots the call has
// not used (docs/design.md, "Dynamic embeddings"). Host and device, so the host model of the tests
// runs the same rules.
#pragma once

#include <wm/config.hpp>

#include <cstdint>

namespace wm::detail::dynamic {

/// What a score rule may read besides the slot's old score.
struct score_context {
  std::uint64_t tick{};   ///< the table's call counter: 1 for the first inserting call, +1 per call
  std::uint32_t epoch{};  ///< the user's epoch (dynamic_embedding::set_epoch)
};

/// Largest count of the frequency rules (the low 32 bits of an epoch-LFU score saturate).
inline constexpr std::uint64_t count_limit = 0xffffffffull;

/// LRU: the score is the number of the last call that inserted or found the key.
struct lru_score {
  static constexpr bool evicts      = true;
  static constexpr bool user_scores = false;
  [[nodiscard]] WM_HOST_DEVICE static constexpr std::uint64_t inserted(score_context c,
                                                                       std::uint64_t) noexcept {
    return c.tick;
  }
  [[nodiscard]] WM_HOST_DEVICE static constexpr std::uint64_t hit(std::uint64_t, score_context c,
                                                                  std::uint64_t) noexcept {
    return c.tick;
  }
  [[nodiscard]] WM_HOST_DEVICE static constexpr bool admits(std::uint64_t, std::uint64_t) noexcept {
    return true;
  }
};

/// LFU: the number of calls that inserted or found the key (one per call, duplicates included
/// once), saturating at 2^64 - 1.
struct lfu_score {
  static constexpr bool evicts      = true;
  static constexpr bool user_scores = false;
  [[nodiscard]] WM_HOST_DEVICE static constexpr std::uint64_t inserted(score_context,
                                                                       std::uint64_t) noexcept {
    return 1;
  }
  [[nodiscard]] WM_HOST_DEVICE static constexpr std::uint64_t hit(std::uint64_t old, score_context,
                                                                  std::uint64_t) noexcept {
    return old + (old != ~std::uint64_t{0} ? 1 : 0);
  }
  [[nodiscard]] WM_HOST_DEVICE static constexpr bool admits(std::uint64_t, std::uint64_t) noexcept {
    return true;
  }
};

/// Epoch-LRU: epoch in the high 32 bits, the low 32 bits of the call counter in the low ones.
struct epoch_lru_score {
  static constexpr bool evicts      = true;
  static constexpr bool user_scores = false;
  [[nodiscard]] WM_HOST_DEVICE static constexpr std::uint64_t inserted(score_context c,
                                                                       std::uint64_t) noexcept {
    return (std::uint64_t{c.epoch} << 32) | (c.tick & count_limit);
  }
  [[nodiscard]] WM_HOST_DEVICE static constexpr std::uint64_t hit(std::uint64_t, score_context c,
                                                                  std::uint64_t u) noexcept {
    return inserted(c, u);
  }
  [[nodiscard]] WM_HOST_DEVICE static constexpr bool admits(std::uint64_t, std::uint64_t) noexcept {
    return true;
  }
};

/// Epoch-LFU: epoch in the high 32 bits, the key's call count in the low 32 (saturating); a hit
/// moves the key to the current epoch and keeps counting.
struct epoch_lfu_score {
  static constexpr bool evicts      = true;
  static constexpr bool user_scores = false;
  [[nodiscard]] WM_HOST_DEVICE static constexpr std::uint64_t inserted(score_context c,
                                                                       std::uint64_t) noexcept {
    return (std::uint64_t{c.epoch} << 32) | 1u;
  }
  [[nodiscard]] WM_HOST_DEVICE static constexpr std::uint64_t hit(std::uint64_t old,
                                                                  score_context c,
                                                                  std::uint64_t) noexcept {
    std::uint64_t const count = old & count_limit;
    return (std::uint64_t{c.epoch} << 32) | (count + (count != count_limit ? 1 : 0));
  }
  [[nodiscard]] WM_HOST_DEVICE static constexpr bool admits(std::uint64_t, std::uint64_t) noexcept {
    return true;
  }
};

/// The caller's score: given with every inserting call, stored on insertion and on a hit; a
/// newcomer replaces the lowest-scored slot only if its score is not lower.
struct custom_score {
  static constexpr bool evicts      = true;
  static constexpr bool user_scores = true;
  [[nodiscard]] WM_HOST_DEVICE static constexpr std::uint64_t inserted(score_context,
                                                                       std::uint64_t u) noexcept {
    return u;
  }
  [[nodiscard]] WM_HOST_DEVICE static constexpr std::uint64_t hit(std::uint64_t, score_context,
                                                                  std::uint64_t u) noexcept {
    return u;
  }
  [[nodiscard]] WM_HOST_DEVICE static constexpr bool admits(std::uint64_t incoming,
                                                            std::uint64_t victim) noexcept {
    return incoming >= victim;
  }
};

/// No eviction: scores as LRU (for export_batch); an insertion into a full bucket is refused.
struct no_eviction_score : lru_score {
  static constexpr bool evicts = false;
};

}  // namespace wm::detail::dynamic
