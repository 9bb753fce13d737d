// SPDX-License-Identifier: Apache-2.0
// wm::detail::range_allocator: first-fit sub-allocation of one range of bytes (offsets only),
// used by a swap scope for its pinned host slab and its device pool, and by ZeRO stage 3 for its
// gather pool (detail/zero/residency.hpp). Lowest address first, so
// buffers allocated one after another sit side by side and their copies can be merged. Freed
// neighbours are joined. Host-only; compiles with a plain C++20 compiler.
#pragma once

#include <wm/error.hpp>

#include <cstddef>
#include <iterator>
#include <limits>
#include <map>
#include <unordered_map>

namespace wm::detail {

class range_allocator {
 public:
  static constexpr std::size_t npos = std::numeric_limits<std::size_t>::max();

  range_allocator() = default;  ///< an empty range (every allocation fails)
  /// A range of @p capacity bytes handed out in multiples of @p alignment (a power of two).
  range_allocator(std::size_t capacity, std::size_t alignment) : alignment_{alignment} {
    WM_EXPECTS(alignment != 0 && (alignment & (alignment - 1)) == 0,
               "range_allocator: the alignment must be a power of two");
    capacity_ = capacity / alignment * alignment;
    if (capacity_ != 0) { free_.emplace(0, capacity_); }
  }

  /// Offset of @p bytes (rounded up to the alignment; 0 counts as one unit), or npos if no free
  /// range is large enough (always for a size that cannot be rounded, see round()).
  [[nodiscard]] std::size_t allocate(std::size_t bytes) {
    std::size_t const size = round(bytes);
    if (size == npos || size > capacity_) { return npos; }
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second >= size) {
        std::size_t const offset = it->first;
        std::size_t const rest   = it->second - size;
        free_.erase(it);
        if (rest != 0) { free_.emplace(offset + size, rest); }
        used_.emplace(offset, size);
        in_use_ += size;
        if (in_use_ > peak_) { peak_ = in_use_; }
        return offset;
      }
    }
    return npos;
  }

  /// Returns the range at @p offset (from allocate); joins it with free neighbours.
  void free(std::size_t offset) {
    auto const u = used_.find(offset);
    WM_EXPECTS(u != used_.end(), "range_allocator: free of an offset that is not allocated");
    std::size_t begin = offset;
    std::size_t size  = u->second;
    in_use_ -= size;
    used_.erase(u);
    auto next = free_.lower_bound(begin);
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == begin) {
        begin = prev->first;
        size += prev->second;
        free_.erase(prev);
      }
    }
    if (next != free_.end() && begin + size == next->first) {
      size += next->second;
      free_.erase(next);
    }
    free_.emplace(begin, size);
  }

  /// Size of the range at @p offset as handed out (rounded), or 0 if it is not allocated.
  [[nodiscard]] std::size_t size_of(std::size_t offset) const noexcept {
    auto const it = used_.find(offset);
    return it == used_.end() ? 0 : it->second;
  }

  /// @p bytes rounded up to the alignment (0 counts as one unit), or npos if that is past the
  /// largest size_t: npos is larger than any capacity, so a size that cannot be rounded never
  /// fits (rounded with wrap-around, 2^64 - 11 would be 0 and alias the next allocation).
  [[nodiscard]] std::size_t round(std::size_t bytes) const noexcept {
    std::size_t const b = bytes == 0 ? 1 : bytes;
    if (b > npos - (alignment_ - 1)) { return npos; }
    return (b + alignment_ - 1) / alignment_ * alignment_;
  }
  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }
  [[nodiscard]] std::size_t in_use() const noexcept { return in_use_; }  ///< bytes handed out
  [[nodiscard]] std::size_t peak() const noexcept { return peak_; }      ///< most in use at once
  void reset_peak() noexcept { peak_ = in_use_; }
  [[nodiscard]] std::size_t allocations() const noexcept { return used_.size(); }
  /// Whether ranges of each of @p sizes could be allocated now, one after the other.
  template <class Sizes>
  [[nodiscard]] bool fits_all(Sizes const& sizes) const {
    range_allocator copy = *this;
    for (std::size_t const s : sizes) {
      if (copy.allocate(s) == npos) { return false; }
    }
    return true;
  }
  /// The largest range allocate() could hand out now.
  [[nodiscard]] std::size_t largest_free() const noexcept {
    std::size_t m = 0;
    for (auto const& [o, s] : free_) { m = s > m ? s : m; }
    return m;
  }

 private:
  std::size_t alignment_{1};
  std::size_t capacity_{0};
  std::size_t in_use_{0};
  std::size_t peak_{0};
  std::map<std::size_t, std::size_t> free_;            // offset -> size, by address
  std::unordered_map<std::size_t, std::size_t> used_;  // offset -> size
};

}  // namespace wm::detail
