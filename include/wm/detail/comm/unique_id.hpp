// wm::unique_id: what one rank creates and the launcher hands to every rank. Host-only.
#pragma once

#include <wm/detail/comm/posix.hpp>
#include <wm/error.hpp>

#include <nccl.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <string_view>

namespace wm {

/**
 * @brief Identity of a communicator before it exists: an NCCL unique id plus a random token
 * that names the group's node-local sockets.
 *
 * One rank calls `unique_id::create()`; the launcher carries `bytes()` or `to_string()` to every
 * rank (MPI broadcast, a file, a pipe, an environment variable), which rebuilds it with
 * `from_bytes` / `from_string`.
 */
class unique_id {
 public:
  static constexpr std::size_t size_bytes = 16 + sizeof(ncclUniqueId);  ///< serialized size

  unique_id() = default;  ///< an invalid id (all zero)

  /**
   * @brief Creates a fresh id (calls `ncclGetUniqueId`; touches no GPU).
   * @throw wm::comm_error if NCCL cannot create an id
   */
  [[nodiscard]] static unique_id create()
  {
    unique_id id;
    WM_NCCL_TRY(ncclGetUniqueId(&id.nccl_));
    id.magic_ = magic;
    id.token_ = random_token();
    return id;
  }

  /// Builds an id from @p token and raw NCCL id bytes (tests, custom bootstraps).
  [[nodiscard]] static unique_id from_parts(std::uint64_t token, ncclUniqueId const& nccl)
  {
    unique_id id;
    id.magic_ = magic;
    id.token_ = token;
    id.nccl_  = nccl;
    return id;
  }

  /// The serialized form: exactly `size_bytes` bytes.
  [[nodiscard]] std::array<std::byte, size_bytes> bytes() const noexcept
  {
    std::array<std::byte, size_bytes> out{};
    std::memcpy(out.data(), &magic_, 8);
    std::memcpy(out.data() + 8, &token_, 8);
    std::memcpy(out.data() + 16, &nccl_, sizeof(nccl_));
    return out;
  }

  /**
   * @brief Rebuilds an id from `bytes()`.
   * @throw wm::logic_error if the size or the format marker is wrong
   */
  [[nodiscard]] static unique_id from_bytes(std::span<std::byte const> b)
  {
    WM_EXPECTS(b.size() == size_bytes, "a wm::unique_id has " + std::to_string(size_bytes) +
                                         " bytes, got " + std::to_string(b.size()));
    unique_id id;
    std::memcpy(&id.magic_, b.data(), 8);
    std::memcpy(&id.token_, b.data() + 8, 8);
    std::memcpy(&id.nccl_, b.data() + 16, sizeof(id.nccl_));
    WM_EXPECTS(id.magic_ == magic, "these bytes are not a wm::unique_id (format marker differs)");
    return id;
  }

  /// Lower-case hexadecimal of `bytes()` (2 * size_bytes characters), e.g. for an env variable.
  [[nodiscard]] std::string to_string() const
  {
    static constexpr char digits[] = "0123456789abcdef";
    std::string s;
    s.reserve(2 * size_bytes);
    for (std::byte b : bytes()) {
      s.push_back(digits[std::to_integer<unsigned>(b) >> 4]);
      s.push_back(digits[std::to_integer<unsigned>(b) & 15]);
    }
    return s;
  }

  /// Parses `to_string()`. @throw wm::logic_error on a wrong length or a non-hex character
  [[nodiscard]] static unique_id from_string(std::string_view s)
  {
    WM_EXPECTS(s.size() == 2 * size_bytes,
               "a wm::unique_id string has " + std::to_string(2 * size_bytes) +
                 " hex digits, got " + std::to_string(s.size()));
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

  [[nodiscard]] bool valid() const noexcept { return magic_ == magic; }
  [[nodiscard]] std::uint64_t token() const noexcept { return token_; }
  [[nodiscard]] ncclUniqueId const& nccl_id() const noexcept { return nccl_; }

  friend bool operator==(unique_id const& a, unique_id const& b) noexcept
  {
    return a.bytes() == b.bytes();
  }

 private:
  static constexpr std::uint64_t magic = 0x31302d64692d6d77ull;  // "wm-id-01"

  static std::uint64_t random_token()
  {
    std::random_device rd;
    return (std::uint64_t{rd()} << 32) ^ rd() ^
           detail::mix64(static_cast<std::uint64_t>(::getpid()),
                         static_cast<std::uint64_t>(detail::clock_type::now().time_since_epoch().count()));
  }

  std::uint64_t magic_{};
  std::uint64_t token_{};
  ncclUniqueId nccl_{};
};

}  // namespace wm
