// SPDX-License-Identifier: Apache-2.0
#include <wm/comm.hpp>

#include <random>

#include "catch.hpp"

namespace {
wm::unique_id random_id(std::mt19937_64& rng) {
  ncclUniqueId raw{};
  for (auto& c : raw.internal) { c = static_cast<char>(rng()); }
  return wm::unique_id::from_parts(rng(), raw);
}
}  // namespace

TEST_CASE("unique_id round-trips through bytes and hex", "[host]") {
  std::mt19937_64 rng{std::random_device{}()};
  for (int i = 0; i < 20; ++i) {
    auto const id = random_id(rng);
    REQUIRE(id.valid());
    auto const bytes = id.bytes();
    CHECK(wm::unique_id::from_bytes(bytes) == id);
    auto const hex = id.to_string();
    CHECK(hex.size() == 2 * wm::unique_id::size_bytes);
    CHECK(wm::unique_id::from_string(hex) == id);
    CHECK(wm::unique_id::from_string(hex).token() == id.token());
    auto other = random_id(rng);
    CHECK_FALSE(other == id);
  }
  CHECK_FALSE(wm::unique_id{}.valid());
}

TEST_CASE("unique_id rejects malformed input", "[host]") {
  std::mt19937_64 rng{std::random_device{}()};
  auto const id  = random_id(rng);
  auto bytes     = id.bytes();
  auto const hex = id.to_string();
  CHECK_THROWS_AS(wm::unique_id::from_bytes(std::span{bytes}.first(10)), wm::logic_error);
  bytes[0] ^= std::byte{1};  // break the format marker
  CHECK_THROWS_AS(wm::unique_id::from_bytes(bytes), wm::logic_error);
  CHECK_THROWS_AS(wm::unique_id::from_string(hex.substr(1)), wm::logic_error);
  auto bad = hex;
  bad[7]   = 'x';
  CHECK_THROWS_AS(wm::unique_id::from_string(bad), wm::logic_error);
  auto upper = hex;
  for (auto& c : upper) { c = static_cast<char>(std::toupper(c)); }
  CHECK(wm::unique_id::from_string(upper) == id);
}
