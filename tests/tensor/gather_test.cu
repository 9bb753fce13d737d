// SPDX-License-Identifier: Apache-2.0
// GPU tests of wm::tensor gather/scatter: every layout x location x element type x index type
// (block mapping), every kind with the cyclic mapping, each combination a [ranked] case or
// section run inside every rank (one rank, and one rank per GPU); misaligned values,
// back-to-back async gathers, and the suite on each path rows of a distributed gather can take.
// Tables hold fresh random bytes; results are compared byte for byte with a host reference;
// outputs are poisoned first; batches have duplicates, empty batches, bad indices.
// The cases' per-kind bodies are in gather_kinds.cuh, compiled in kind_<location>_<layout>_test.cu
// (gather_common.cuh says why); tensor_test's other cases are in gather_path_test.cu,
// unwind_test.cu and ranked_test.cu.
#include <cstdint>
#include <string>
#include <string_view>
#include <tuple>

#include "catch.hpp"
#include "gather_common.cuh"
#include "gather_paths.cuh"
#include "rank_check.hpp"
#include "ranks.hpp"

using namespace gather_tests;

namespace {

// Every element type, a section each: 16-byte rows, odd rows, padded rows, 1D, one row (the other
// ranks own nothing); row counts not divisible by the rank count.
template <class L, class Y, class M, class Index>
void element_type_sections(wm::communicator& comm, std::uint64_t seed) {
  SECTION("float, 16-byte rows: 1001 x 128") {
    exercise<float, L, Y, M, Index>(comm, seed + 1, 1001, 128, 0);
  }
  SECTION("float, padded rows: 777 x 33, stride 36") {
    exercise<float, L, Y, M, Index>(comm, seed + 2, 777, 33, 36);
  }
  SECTION("half, odd rows: 513 x 7") {
    exercise<__half, L, Y, M, Index>(comm, seed + 3, 513, 7, 0);
  }
  SECTION("bfloat16, padded rows: 300 x 64, stride 72") {
    exercise<__nv_bfloat16, L, Y, M, Index>(comm, seed + 4, 300, 64, 72);
  }
  SECTION("int32, 1D: 1003 rows") {
    exercise<std::int32_t, L, Y, M, Index>(comm, seed + 5, 1003, 1, 0);
  }
  SECTION("int64, odd rows: 99 x 5") {
    exercise<std::int64_t, L, Y, M, Index>(comm, seed + 6, 99, 5, 0);
  }
  SECTION("float, one row: the other ranks own nothing") {
    exercise<float, L, Y, M, Index>(comm, seed + 7, 1, 4, 0);
  }
}

static_assert(wm::mapping<wm::block> && wm::mapping<wm::cyclic>);

}  // namespace

// ---- cases run inside every rank (--ranks; tests/support/ranks.hpp) ----------------------------

// Block mapping: every location x layout x index type a case, every element type a section.
TEMPLATE_TEST_CASE(
    "ranked: gather/scatter on a kind (block mapping) and index type on every element type",
    "[ranked]", WM_TENSOR_EVERY_LAYOUT(wm::block, std::int32_t),
    WM_TENSOR_EVERY_LAYOUT(wm::block, std::int64_t)) {
  using L    = std::tuple_element_t<0, TestType>;
  using Y    = std::tuple_element_t<1, TestType>;
  using M    = std::tuple_element_t<2, TestType>;
  using I    = std::tuple_element_t<3, TestType>;
  auto& comm = wm_test::comm();
  element_type_sections<L, Y, M, I>(comm, shared_seed(comm));
}

// Cyclic mapping: every location x layout a case; float rows with int32 indices, int64 rows with
// int64 indices.
TEMPLATE_TEST_CASE("ranked: gather/scatter on a kind (cyclic mapping)", "[ranked]",
                   WM_TENSOR_EVERY_LAYOUT(wm::cyclic)) {
  using L                  = std::tuple_element_t<0, TestType>;
  using Y                  = std::tuple_element_t<1, TestType>;
  auto& comm               = wm_test::comm();
  std::uint64_t const seed = shared_seed(comm);
  SECTION("float rows, int32 indices: 1001 x 32") {
    exercise<float, L, Y, wm::cyclic, std::int32_t>(comm, seed + 1, 1001, 32, 0);
  }
  SECTION("int64 rows, int64 indices: 5 x 3") {
    exercise<std::int64_t, L, Y, wm::cyclic, std::int64_t>(comm, seed + 2, 5, 3, 0);
  }
}

TEMPLATE_TEST_CASE("ranked: scatter from and gather to half values not aligned to 16 bytes",
                   "[ranked]", WM_TENSOR_EVERY_KIND) {
  using L                  = std::tuple_element_t<0, TestType>;
  using Y                  = std::tuple_element_t<1, TestType>;
  using M                  = std::tuple_element_t<2, TestType>;
  auto& comm               = wm_test::comm();
  std::uint64_t const seed = shared_seed(comm);
  SECTION("32-byte rows: 1003 x 16") {
    misaligned_values<L, Y, M>(comm, seed + 1, 1003, 16);
  }
  SECTION("18-byte rows: 517 x 9") {
    misaligned_values<L, Y, M>(comm, seed + 2, 517, 9);
  }
}

// The kinds WM_TENSOR_BACK_TO_BACK instantiates (kind_*_test.cu).
TEMPLATE_TEST_CASE("ranked: async gathers back to back on one stream and on several", "[ranked]",
                   (std::tuple<wm::device, wm::distributed, wm::block>),
                   (std::tuple<wm::device, wm::distributed, wm::cyclic>),
                   (std::tuple<wm::device, wm::chunked, wm::block>),
                   (std::tuple<wm::host, wm::continuous, wm::block>),
                   (std::tuple<wm::host, wm::chunked, wm::block>),
                   (std::tuple<wm::host, wm::chunked, wm::cyclic>)) {
  using L    = std::tuple_element_t<0, TestType>;
  using Y    = std::tuple_element_t<1, TestType>;
  using M    = std::tuple_element_t<2, TestType>;
  auto& comm = wm_test::comm();
  back_to_back<L, Y, M>(comm, shared_seed(comm));
}

// The same on each path rows of a distributed gather can take between ranks.
TEMPLATE_TEST_CASE("ranked: async distributed gathers back to back on each path", "[ranked][multi]",
                   wm::block, wm::cyclic) {
  auto& comm               = wm_test::comm();
  std::uint64_t const seed = shared_seed(comm);
  for (char const* how : {"put", "copy", "nccl"}) {
    DYNAMIC_SECTION("WM_DISPATCH_ROWS=" << how) {
      dispatch_rows_setting const setting{how};
      back_to_back<wm::device, wm::distributed, TestType>(comm, seed);
    }
  }
}

// On one node the distributed gather's owners gather rows locally and the copy engines move them
// into the asking rank's mailbox (the default). With WM_DISPATCH_ROWS=put their gather kernels
// store the rows into the mailbox; across nodes, without peer access, or with
// WM_DISPATCH_ROWS=nccl the rows cross through NCCL instead: the same gathers, on each path.
TEST_CASE("ranked: distributed gathers with rows put by kernels or through NCCL",
          "[ranked][multi]") {
  auto& comm               = wm_test::comm();
  std::uint64_t const seed = shared_seed(comm);
  bool const peers         = peers_reach_each_other();
  for (char const* how : {"put", "nccl"}) {
    DYNAMIC_SECTION("WM_DISPATCH_ROWS=" << how) {
      dispatch_rows_setting const setting{how};  // this rank's process only
      auto const want =
          peers && std::string_view{how} == "put" ? wm::row_path::put : wm::row_path::nccl;
      RANK_REQUIRE(path_of_fresh_tensor(comm) == want);  // the sections below run on that path
      SECTION("device.distributed.block, float rows, int64 indices: 140,001 x 256") {
        exercise<float, wm::device, wm::distributed, wm::block, std::int64_t>(comm, seed, 140'001,
                                                                              256, 0);
      }
      SECTION("host.distributed.cyclic, float rows, int32 indices: 70,003 x 512, stride 520") {
        exercise<float, wm::host, wm::distributed, wm::cyclic, std::int32_t>(comm, seed + 1, 70'003,
                                                                             512, 520);
      }
      SECTION("device.distributed.block, int32 indices") {
        element_type_sections<wm::device, wm::distributed, wm::block, std::int32_t>(comm,
                                                                                    seed + 10);
      }
    }
  }
}
