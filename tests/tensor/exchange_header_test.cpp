// SPDX-License-Identifier: Apache-2.0
// Host tests: the header each rank sends beside its counts, and the check every rank makes of
// all ranks' headers after the count exchange (same verdict and text on every rank), and the
// exchange ids that name a call's tensor in its header.
#include <wm/detail/exchange/plan.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "catch.hpp"

namespace {
using wm::detail::exchange_fault;
using wm::detail::exchange_header;
using wm::detail::exchange_op;

std::vector<std::uint64_t> words_of(exchange_header const& h) {
  return {wm::detail::header_tag(h), h.row_bytes, h.batch, h.invalid, h.tensor};
}
}  // namespace

TEST_CASE("exchange headers survive their words", "[host]") {
  std::mt19937_64 rng{std::random_device{}()};
  for (int i = 0; i < 1000; ++i) {
    exchange_header h;
    h.op          = static_cast<exchange_op>(1 + rng() % 4);
    h.fault       = static_cast<exchange_fault>(rng() % 5);
    h.index_bytes = rng() % 2 == 0 ? 4 : 8;
    h.row_bytes   = rng() >> (rng() % 64);
    h.batch       = rng();
    h.invalid     = rng() % 3 == 0 ? 0 : rng();
    h.tensor      = rng() % 3 == 0 ? 1 + rng() % 100 : rng();
    auto const w  = words_of(h);
    REQUIRE(w.size() == wm::detail::header_words);
    auto const r = wm::detail::read_header(w.data());
    REQUIRE(r.op == h.op);
    REQUIRE(r.fault == h.fault);
    REQUIRE(r.index_bytes == h.index_bytes);
    REQUIRE(r.row_bytes == h.row_bytes);
    REQUIRE(r.batch == h.batch);
    REQUIRE(r.invalid == h.invalid);
    REQUIRE(r.tensor == h.tensor);
  }
  // Words that are not a header (a peer in another call, garbage) read as a fault.
  std::uint64_t const garbage[wm::detail::header_words] = {0x1234, 1, 2, 3, 4};
  REQUIRE(wm::detail::read_header(garbage).fault != exchange_fault::none);
}

TEST_CASE("every rank's check of the headers finds faults and calls that differ", "[host]") {
  exchange_header const fine{exchange_op::gather, exchange_fault::none, 8, 512, 1000, 0};
  for (std::size_t world : {1u, 2u, 5u}) {
    std::vector<exchange_header> all(world, fine);
    REQUIRE(wm::detail::check_headers(all).empty());
    // Invalid indices and batch sizes may differ: not an error of the exchange.
    all[0].invalid = 7;
    all[0].batch   = 0;
    REQUIRE(wm::detail::check_headers(all).empty());
    for (std::size_t bad = 0; bad < world; ++bad) {
      auto h         = all;
      h[bad].fault   = exchange_fault::null_pointer;
      auto const msg = wm::detail::check_headers(h);
      REQUIRE(msg.find("rank " + std::to_string(bad) + " (gather)") != std::string::npos);
      REQUIRE(msg.find("null") != std::string::npos);
      h[bad].fault = exchange_fault::cuda;
      REQUIRE(wm::detail::check_headers(h).find("CUDA") != std::string::npos);
      if (world == 1) { continue; }
      h            = all;
      h[bad].op    = exchange_op::scatter;
      auto const d = wm::detail::check_headers(h);
      REQUIRE(d.find("different calls") != std::string::npos);
      REQUIRE(d.find("rank " + std::to_string(bad) + " scatter") != std::string::npos);
      h                = all;
      h[bad].row_bytes = 384;
      REQUIRE(wm::detail::check_headers(h).find("384-byte rows") != std::string::npos);
      h                  = all;
      h[bad].index_bytes = 4;
      REQUIRE(wm::detail::check_headers(h).find("4-byte indices") != std::string::npos);
    }
  }
}

TEST_CASE("the same call on different tensors fails on every rank, naming each rank's tensor",
          "[host]") {
  exchange_header fine{exchange_op::gather, exchange_fault::none, 8, 512, 1000, 0};
  fine.tensor = 3;
  for (std::size_t world : {2u, 5u}) {
    std::vector<exchange_header> all(world, fine);
    REQUIRE(wm::detail::check_headers(all).empty());
    for (std::size_t bad = 0; bad < world; ++bad) {
      auto h         = all;
      h[bad].tensor  = 7;  // same operation, row bytes and indices: only the tensor differs
      auto const msg = wm::detail::check_headers(h);
      auto const bads =
          "rank " + std::to_string(bad) + " gather (512-byte rows, 8-byte indices, " + "tensor 7)";
      auto const good = "rank " + std::to_string(bad == 0 ? 1 : 0) +
                        " gather (512-byte rows, 8-byte indices, tensor 3)";
      REQUIRE(msg.find("different calls") != std::string::npos);
      REQUIRE(msg.find(bads) != std::string::npos);
      REQUIRE(msg.find(good) != std::string::npos);
      // The text depends on the headers only: every rank throws the same error.
      REQUIRE(wm::detail::check_headers(h) == msg);
    }
  }
}

TEST_CASE("exchange ids are never repeated in a process, from any thread", "[host]") {
  std::vector<std::uint64_t> ids;
  for (int i = 0; i < 1000; ++i) { ids.push_back(wm::detail::next_exchange_id()); }
  REQUIRE(ids.front() != 0);
  REQUIRE(std::ranges::adjacent_find(ids, std::greater_equal<>{}) == ids.end());  // increasing
  std::vector<std::uint64_t> a, b;
  std::thread ta{[&] {
    for (int i = 0; i < 10'000; ++i) { a.push_back(wm::detail::next_exchange_id()); }
  }};
  std::thread tb{[&] {
    for (int i = 0; i < 10'000; ++i) { b.push_back(wm::detail::next_exchange_id()); }
  }};
  ta.join();
  tb.join();
  a.insert(a.end(), b.begin(), b.end());
  std::ranges::sort(a);
  REQUIRE(std::ranges::adjacent_find(a) == a.end());
  REQUIRE(a.front() > ids.back());
}
