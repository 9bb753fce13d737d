// SPDX-License-Identifier: Apache-2.0
// Test oracle of the cache set (detail/cache/set.hpp): one plain access with write-allocate, the
// sequential model the tests run beside the batch accesses the library uses. Host and device.
#pragma once

#include <wm/config.hpp>
#include <wm/detail/cache/set.hpp>

#include <cstdint>

namespace wm::detail::cache {

/**
 * One access with write-allocate: a hit touches the line; a miss admits the key. With
 * @p write the line is marked dirty.
 */
template <class Impl>
WM_HOST_DEVICE access_result access(set_ref<Impl> const& s, std::uint32_t key,
                                    bool write) noexcept {
  access_result r;
  r.way = s.find(key);
  r.hit = r.way != no_way;
  if (r.hit) {
    s.touch(r.way);
  } else {
    r.admitted = s.admit(key);
    r.way      = r.admitted.way;
  }
  if (write) { s.mark_dirty(r.way); }
  return r;
}

}  // namespace wm::detail::cache
