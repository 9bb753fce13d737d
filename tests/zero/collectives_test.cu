// SPDX-License-Identifier: Apache-2.0
// GPU tests of the communicator's device collectives that wm::zero_optimizer uses (the zero_test
// program): all_reduce (sum, max, in place), reduce_scatter, all_gather and broadcast against a
// host sum, for float, double and bf16; bad arguments.
// Every case is [ranked]: it runs inside every rank (tests/support/ranks.hpp), with one rank
// (ctest zero_ranked_gpu) and with one rank per GPU (zero_ranked_multi_gpu), so the same code
// checks world 1 and world N.
#include <wm/comm.hpp>
#include <wm/error.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "catch.hpp"
#include "device_array.cuh"
#include "ranks.hpp"
#include "zero_common.cuh"

using namespace zero_cases;

namespace {

using wm_test::device_array;

// Outputs are poisoned with this byte first (all ones: NaN in float and double).
constexpr std::byte poison{0xff};

template <class T>
void check_collectives(wm::communicator& comm, std::uint64_t seed, std::size_t count) {
  stream_holder s;
  int const n  = comm.size();
  int const me = comm.rank();
  auto value   = [&](int r, std::size_t i) {  // small integers: exact sums in every type
    return static_cast<double>(static_cast<int>(mix(seed ^ (r * 1000003ull + i)) % 31) - 15);
  };
  auto const total = count * static_cast<std::size_t>(n);
  // all_reduce, sum and max, out of place and in place.
  {
    std::vector<T> h(total);
    for (std::size_t i = 0; i < total; ++i) { h[i] = from_double<T>(value(me, i)); }
    device_array<T> a(total, poison), sum(total, poison), mx(total, poison);
    a.upload(h);
    comm.all_reduce(a.ptr, sum.ptr, total, s);
    comm.all_reduce(static_cast<T const*>(a.ptr), mx.ptr, total, s, wm::reduce_op::max);
    comm.all_reduce(a.ptr, a.ptr, total, s);  // in place
    comm.synchronize(s);
    auto const hs = sum.to_host(), hm = mx.to_host(), ha = a.to_host();
    for (std::size_t i = 0; i < total; ++i) {
      double es = 0, em = -1e30;
      for (int r = 0; r < n; ++r) {
        es += value(r, i);
        em = std::max(em, value(r, i));
      }
      REQUIRE(to_double(hs[i]) == es);
      REQUIRE(to_double(ha[i]) == es);
      REQUIRE(to_double(hm[i]) == em);
    }
  }
  // reduce_scatter in place (each rank's block is its own part of the send buffer).
  {
    std::vector<T> h(total);
    for (std::size_t i = 0; i < total; ++i) { h[i] = from_double<T>(value(me, i)); }
    device_array<T> a(total, poison);
    a.upload(h);
    comm.reduce_scatter(a.ptr, a.ptr + static_cast<std::size_t>(me) * count, count, s);
    comm.synchronize(s);
    auto const ha = a.to_host();
    for (std::size_t i = 0; i < count; ++i) {
      std::size_t const at = static_cast<std::size_t>(me) * count + i;
      double e             = 0;
      for (int r = 0; r < n; ++r) { e += value(r, at); }
      REQUIRE(to_double(ha[at]) == e);
    }
  }
  // all_gather in place, and broadcast from the last rank.
  {
    std::vector<T> h(total);
    for (std::size_t i = 0; i < total; ++i) { h[i] = from_double<T>(value(me, i)); }
    device_array<T> a(total, poison), b(count, poison), c(count, poison);
    a.upload(h);  // this rank's block is in place, the others' blocks are overwritten
    comm.all_gather(a.ptr + static_cast<std::size_t>(me) * count, a.ptr, count, s);
    std::vector<T> hb(count);
    for (std::size_t i = 0; i < count; ++i) { hb[i] = from_double<T>(value(me, 7 * i)); }
    b.upload(hb);
    comm.broadcast(b.ptr, c.ptr, count, n - 1, s);
    comm.synchronize(s);
    auto const ha = a.to_host(), hc = c.to_host();
    for (int r = 0; r < n; ++r) {
      for (std::size_t i = 0; i < count; ++i) {
        std::size_t const at = static_cast<std::size_t>(r) * count + i;
        REQUIRE(to_double(ha[at]) == value(r, at));
      }
    }
    for (std::size_t i = 0; i < count; ++i) { REQUIRE(to_double(hc[i]) == value(n - 1, 7 * i)); }
  }
}

}  // namespace

TEMPLATE_TEST_CASE("communicator device collectives against a host sum", "[ranked]", float, double,
                   bf16) {
  auto& comm              = wm_test::comm();
  std::size_t const count = GENERATE(1, 7, 1000);
  check_collectives<TestType>(comm, shared_seed(comm), count);
}

TEST_CASE("communicator device collectives reject bad arguments", "[ranked]") {
  auto& comm = wm_test::comm();
  stream_holder s;
  float* null = nullptr;
  REQUIRE_THROWS_AS(comm.all_reduce(null, null, 4, s), wm::logic_error);
  REQUIRE_THROWS_AS(comm.broadcast(null, null, 4, comm.size(), s), wm::logic_error);
  REQUIRE_NOTHROW(comm.all_gather(null, null, 0, s));  // nothing to move: no NCCL call
}
