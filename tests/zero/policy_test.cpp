// SPDX-License-Identifier: Apache-2.0
// Host tests: the ZeRO policy types of zero_policy.hpp (no CUDA code in it, so the host compiler
// reads it): stages 1 to 3 only, the offload policies, and the concepts that accept exactly them.
#include <wm/zero_policy.hpp>

#include <type_traits>

#include "catch.hpp"

namespace {
template <int N>
concept stage_exists = requires {
  typename wm::zero_stage<N>;
};
struct not_a_stage {
  static constexpr int value = 2;
};
}  // namespace

TEST_CASE("zero policies: stages 1 to 3, two offload kinds", "[host]") {
  STATIC_REQUIRE(stage_exists<1>);
  STATIC_REQUIRE(stage_exists<3>);
  STATIC_REQUIRE(!stage_exists<0>);
  STATIC_REQUIRE(!stage_exists<4>);
  STATIC_REQUIRE(wm::zero_stage<2>::value == 2);
  STATIC_REQUIRE(wm::zero_stage_policy<wm::zero_stage<1>>);
  STATIC_REQUIRE(!wm::zero_stage_policy<not_a_stage>);
  STATIC_REQUIRE(!wm::zero_stage_policy<int>);
  STATIC_REQUIRE(wm::offload_policy<wm::no_offload>);
  STATIC_REQUIRE(wm::offload_policy<wm::offload_host>);
  STATIC_REQUIRE(!wm::offload_policy<wm::zero_stage<1>>);
  STATIC_REQUIRE(wm::offload_host::host);
  STATIC_REQUIRE(!wm::no_offload::host);
}

TEST_CASE("zero policies name the engine the optimizer holds", "[host]") {
  struct owner {};
  STATIC_REQUIRE(
      std::is_same_v<wm::no_offload::engine<owner>, wm::detail::zero::device_update<owner>>);
  STATIC_REQUIRE(
      std::is_same_v<wm::offload_host::engine<owner>, wm::detail::zero::host_offload<owner>>);
}

TEST_CASE("zero_parameter: elements is the product of the shape", "[host]") {
  REQUIRE(wm::zero_parameter{"s", {}}.elements() == 1);
  REQUIRE(wm::zero_parameter{"w", {3, 5, 7}}.elements() == 105);
  REQUIRE(wm::zero_parameter{"e", {4, 0}}.elements() == 0);
  wm::zero_memory m{1, 2, 3, 4, 5, 6};
  REQUIRE(m.model_states() == 10);
  REQUIRE(m.total() == 21);
}
