// SPDX-License-Identifier: Apache-2.0
// Bodies of wm::unique_id (declared in <wm/comm.hpp>). Host-only.
#pragma once

#include <wm/comm.hpp>
#include <wm/detail/base/deadline.hpp>
#include <wm/detail/base/hash.hpp>
#include <wm/detail/comm/nccl.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <unistd.h>

namespace wm {

inline unique_id unique_id::create() {
  unique_id id;
  WM_NCCL_TRY(ncclGetUniqueId(&id.nccl_));
  id.magic_ = magic;
  id.token_ = random_token();
  return id;
}

inline unique_id unique_id::from_parts(std::uint64_t token, ncclUniqueId const& nccl) noexcept {
  unique_id id;
  id.magic_ = magic;
  id.token_ = token;
  id.nccl_  = nccl;
  return id;
}

inline std::array<std::byte, unique_id::size_bytes> unique_id::bytes() const noexcept {
  std::array<std::byte, size_bytes> out{};
  std::memcpy(out.data(), &magic_, 8);
  std::memcpy(out.data() + 8, &token_, 8);
  std::memcpy(out.data() + 16, &nccl_, sizeof(nccl_));
  return out;
}

inline unique_id unique_id::from_bytes(std::span<std::byte const> b) {
  WM_EXPECTS(b.size() == size_bytes, "a wm::unique_id has " + std::to_string(size_bytes) +
                                         " bytes, got " + std::to_string(b.size()));
  unique_id id;
  std::memcpy(&id.magic_, b.data(), 8);
  std::memcpy(&id.token_, b.data() + 8, 8);
  std::memcpy(&id.nccl_, b.data() + 16, sizeof(id.nccl_));
  WM_EXPECTS(id.magic_ == magic, "these bytes are not a wm::unique_id (format marker differs)");
  return id;
}

inline std::string unique_id::to_string() const {
  static constexpr char digits[] = "0123456789abcdef";
  std::string s;
  s.reserve(2 * size_bytes);
  for (std::byte b : bytes()) {
    s.push_back(digits[std::to_integer<unsigned>(b) >> 4]);
    s.push_back(digits[std::to_integer<unsigned>(b) & 15]);
  }
  return s;
}

inline unique_id unique_id::from_string(std::string_view s) {
  WM_EXPECTS(s.size() == 2 * size_bytes, "a wm::unique_id string has " +
                                             std::to_string(2 * size_bytes) + " hex digits, got " +
                                             std::to_string(s.size()));
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') { return c - '0'; }
    if (c >= 'a' && c <= 'f') { return c - 'a' + 10; }
    if (c >= 'A' && c <= 'F') { return c - 'A' + 10; }
    return -1;
  };
  std::array<std::byte, size_bytes> b{};
  for (std::size_t i = 0; i < size_bytes; ++i) {
    int const hi = nibble(s[2 * i]);
    int const lo = nibble(s[2 * i + 1]);
    WM_EXPECTS(hi >= 0 && lo >= 0, "a wm::unique_id string holds only hex digits");
    b[i] = static_cast<std::byte>(hi * 16 + lo);
  }
  return from_bytes(b);
}

inline std::uint64_t unique_id::random_token() {
  std::random_device rd;
  return (std::uint64_t{rd()} << 32) ^ rd() ^
         detail::mix64(
             static_cast<std::uint64_t>(::getpid()),
             static_cast<std::uint64_t>(detail::clock_type::now().time_since_epoch().count()));
}

}  // namespace wm
