// SPDX-License-Identifier: Apache-2.0
// GPU tests of the host path that reads each distinct row once (detail/rows/distinct.cuh):
// plan_distinct against a host model (stable sort on the low bits, runs of equal keys),
// replicate_runs, and host-table gathers through wm::tensor on every host layout and mapping
// (one rank and one rank per GPU: [ranked]), with skewed keys of both index types, batch sizes
// around the distinct threshold, 0 and 1 keys, all-equal keys and invalid keys mixed in. Tables
// hold fresh random bytes; outputs are poisoned first; results are compared byte for byte with a
// host reference.
#include <wm/detail/rows/distinct.cuh>
#include <wm/tensor.cuh>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "catch.hpp"
#include "device_array.cuh"
#include "gather_common.cuh"
#include "ranks.hpp"

namespace {

using wm_test::device_array;
using wm_test::device_bytes;
using wm_test::shared_seed;

// The byte device_bytes are poisoned with, and host rows that must stay untouched.
constexpr std::byte poison = wm_test::poison_byte;

template <class T>
std::vector<T> copy_to_host(T const* d, std::size_t n) {
  std::vector<T> h(n);
  if (n > 0) { WM_CUDA_TRY(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost)); }
  return h;
}

using gather_tests::random_bytes;

/// Skewed keys: rank r of a discrete power law (exponent 1.05, ranks 0..rows-1, inverse CDF)
/// scattered to row (r * 7919 + 13) mod rows, so hot rows lie anywhere in the table.
template <class Index>
std::vector<Index> zipf_keys(std::mt19937_64& rng, std::size_t n, std::size_t rows) {
  std::vector<double> cdf(rows);
  double sum = 0;
  for (std::size_t r = 0; r < rows; ++r) {
    cdf[r] = sum += std::pow(static_cast<double>(r + 1), -1.05);
  }
  std::uniform_real_distribution<double> u{0.0, sum};
  std::vector<Index> k(n);
  for (auto& x : k) {
    auto const r =
        static_cast<std::size_t>(std::upper_bound(cdf.begin(), cdf.end(), u(rng)) - cdf.begin());
    x = static_cast<Index>((std::min(r, rows - 1) * 7919 + 13) % rows);
  }
  return k;
}

// ---- plan_distinct and replicate_runs against a host model -------------------------------------

/// What plan_distinct must give for @p idx: the stable order by the low @p bits bits (all bits:
/// the key's own order), and the first element of each run of equal keys.
template <class Index>
struct distinct_model {
  std::vector<Index> keys;
  std::vector<std::size_t> positions;
  std::vector<std::size_t> run_begin;  // with n at the end

  distinct_model(std::vector<Index> const& idx, int bits) : positions(idx.size()) {
    using U = std::make_unsigned_t<Index>;
    std::iota(positions.begin(), positions.end(), std::size_t{0});
    bool const all_bits = bits >= static_cast<int>(sizeof(Index) * 8);
    U const mask        = all_bits ? ~U{0} : static_cast<U>((U{1} << bits) - 1);
    std::stable_sort(positions.begin(), positions.end(), [&](std::size_t a, std::size_t b) {
      if (all_bits) { return idx[a] < idx[b]; }
      return (static_cast<U>(idx[a]) & mask) < (static_cast<U>(idx[b]) & mask);
    });
    for (std::size_t i = 0; i < positions.size(); ++i) {
      keys.push_back(idx[positions[i]]);
      if (i == 0 || keys[i] != keys[i - 1]) { run_begin.push_back(i); }
    }
    run_begin.push_back(idx.size());
  }
};

/// Row content of key k for the replicate test: bytes that differ by key and by column.
std::byte row_byte(std::int64_t k, std::size_t j) {
  return static_cast<std::byte>((static_cast<std::uint64_t>(k) * 2654435761u + j * 40503u) >> 7);
}

/// Checks a plan @p b of @p idx against @p m (keys as the plan holds them), its list of long runs,
/// and replicate_runs on it.
template <class Index, class Key, class Pos>
void check_plan(std::vector<Index> const& idx, wm::detail::distinct_batch<Key, Pos> const& b,
                distinct_model<Key> const& m, std::size_t row_bytes, cudaStream_t s) {
  std::size_t const n = idx.size();
  REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
  std::size_t const runs = copy_to_host(b.runs, 1)[0];
  REQUIRE(b.n == n);
  REQUIRE(runs + 1 == m.run_begin.size());
  CHECK(copy_to_host(b.keys, n) == m.keys);
  auto const as_size = [](std::vector<Pos> const& v) {
    return std::vector<std::size_t>(v.begin(), v.end());
  };
  CHECK(as_size(copy_to_host(b.positions, n)) == m.positions);
  CHECK(as_size(copy_to_host(b.run_begin, runs + 1)) == m.run_begin);
  // The long runs (more than fused_copies keys), listed in any order.
  std::vector<std::size_t> want_long;
  for (std::size_t r = 0; r + 1 < m.run_begin.size(); ++r) {
    if (m.run_begin[r + 1] - m.run_begin[r] > wm::detail::fused_copies) {
      want_long.push_back(m.run_begin[r]);
    }
  }
  std::size_t const long_count = copy_to_host(b.long_count, 1)[0];
  REQUIRE(long_count == want_long.size());
  auto got_long = as_size(copy_to_host(b.long_runs, long_count));
  std::sort(got_long.begin(), got_long.end());
  CHECK(got_long == want_long);

  // replicate_runs: the heads' rows are in place, every other row poisoned; afterwards every
  // row holds its key's row and nothing beyond the rows was written.
  std::vector<std::byte> rows((n + 1) * row_bytes, poison);
  for (std::size_t r = 0; r < runs; ++r) {
    std::size_t const i = m.run_begin[r];
    for (std::size_t j = 0; j < row_bytes; ++j) {
      rows[m.positions[i] * row_bytes + j] = row_byte(static_cast<std::int64_t>(m.keys[i]), j);
    }
  }
  device_bytes out{rows};
  wm::detail::replicate_runs(b, out.ptr, row_bytes, s);
  REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
  REQUIRE(cudaGetLastError() == cudaSuccess);
  auto const got    = out.to_host();
  std::size_t wrong = 0;
  // Each position holds the row of its key as the plan holds it.
  std::vector<std::int64_t> key_at(n);
  for (std::size_t i = 0; i < n; ++i) {
    key_at[m.positions[i]] = static_cast<std::int64_t>(m.keys[i]);
  }
  for (std::size_t p = 0; p < n; ++p) {
    for (std::size_t j = 0; j < row_bytes; ++j) {
      wrong += got[p * row_bytes + j] == row_byte(key_at[p], j) ? 0 : 1;
    }
  }
  CHECK(wrong == 0);
  bool tail_untouched = true;
  for (std::size_t j = 0; j < row_bytes; ++j) {
    tail_untouched = tail_untouched && got[n * row_bytes + j] == poison;
  }
  CHECK(tail_untouched);
}

/// plan_distinct on the low @p bits bits and, when @p rows is not 0, plan_distinct_narrow over
/// @p rows rows (keys narrowed to 32 bits, invalid ones to rows), each against its host model.
template <class Index>
void check_plan_and_replicate(std::vector<Index> const& idx, int bits, std::size_t row_bytes,
                              std::string const& what, std::size_t rows = 0) {
  INFO(what << ": n=" << idx.size() << " bits=" << bits << " row bytes=" << row_bytes);
  std::size_t const n = idx.size();
  device_array<Index> d_idx{idx};
  cudaStream_t s{};
  REQUIRE(cudaStreamCreate(&s) == cudaSuccess);
  {
    INFO("plan_distinct");
    wm::detail::workspace ws;
    auto const b = wm::detail::plan_distinct(d_idx.ptr, n, bits, ws, s);
    check_plan(idx, b, distinct_model<Index>{idx, bits}, row_bytes, s);
  }
  if (rows != 0) {
    INFO("plan_distinct_narrow over " << rows << " rows");
    REQUIRE(wm::detail::narrow_fits(rows, n));
    std::vector<std::uint32_t> narrowed(n);
    for (std::size_t i = 0; i < n; ++i) {
      bool const valid = idx[i] >= 0 && static_cast<std::size_t>(idx[i]) < rows;
      narrowed[i] = static_cast<std::uint32_t>(valid ? static_cast<std::size_t>(idx[i]) : rows);
    }
    wm::detail::workspace ws;
    auto const b = wm::detail::plan_distinct_narrow(d_idx.ptr, n, rows, ws, s);
    check_plan(idx, b, distinct_model<std::uint32_t>{narrowed, 32}, row_bytes, s);
  }
  REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
}

TEMPLATE_TEST_CASE("plan_distinct and replicate_runs match a host model", "[gpu]", std::int32_t,
                   std::int64_t) {
  using Index = TestType;
  std::mt19937_64 rng{std::random_device{}()};
  std::size_t const n  = GENERATE(std::size_t{0}, std::size_t{1}, std::size_t{2}, std::size_t{777},
                                  std::size_t{100'003});
  std::size_t const rb = GENERATE(std::size_t{512}, std::size_t{36}, std::size_t{6});
  SECTION("heavy repeats of few keys") {
    std::size_t const rows = 1000;
    auto keys              = zipf_keys<Index>(rng, n, rows);
    check_plan_and_replicate(keys, wm::detail::row_bits(rows), rb, "zipf over 1000 rows", rows);
  }
  SECTION("uniform keys over a large range, every bit") {
    std::vector<Index> keys(n);
    for (auto& k : keys) {
      k = static_cast<Index>(rng() % (std::size_t{1} << (sizeof(Index) * 8 - 2)));
    }
    check_plan_and_replicate(keys, int{sizeof(Index) * 8}, rb, "uniform, all bits");
  }
  SECTION("uniform keys up to the largest table of 32-bit keys (2^32 - 2 rows)") {
    std::size_t const rows = sizeof(Index) == 4 ? (std::size_t{1} << 31) : 0xfffffffeu;
    std::vector<Index> keys(n);
    for (auto& k : keys) { k = static_cast<Index>(rng() % rows); }
    if (n > 0) { keys[0] = static_cast<Index>(rows - 1); }
    check_plan_and_replicate(keys, wm::detail::row_bits(rows), rb, "uniform up to 2^32 - 2", rows);
  }
  SECTION("all keys equal") {
    std::vector<Index> keys(n, static_cast<Index>(rng() % 1000));
    check_plan_and_replicate(keys, 10, rb, "all equal", 1000);
  }
  SECTION("invalid keys sharing low bits with valid ones split runs, never merge them") {
    std::size_t const rows = 256;  // 8 bits
    std::vector<Index> keys(n);
    for (auto& k : keys) {
      auto const low = static_cast<Index>(rng() % 16);
      switch (rng() % 4) {
        case 0: k = static_cast<Index>(low + 256); break;   // same low bits, out of range
        case 1: k = static_cast<Index>(-256 + low); break;  // negative, same low bits
        default: k = low; break;
      }
    }
    check_plan_and_replicate(keys, wm::detail::row_bits(rows), rb, "invalid mixed in", rows);
  }
}

// ---- read_distinct at the run-length boundaries ------------------------------------------------

/// read_distinct over a device table of @p rows rows (fresh random bytes) for @p idx, through the
/// 64-bit plan on the low row bits (invalid keys may split runs there) and the 32-bit plan, with
/// and without an order: every output row (poisoned first) holds its key's row, invalid keys a
/// zero row and the error flag; nothing else is written.
template <class Index>
void check_read_distinct(std::vector<Index> const& idx, std::size_t rows, std::size_t row_bytes,
                         std::mt19937_64& rng, std::string const& what) {
  std::size_t const n = idx.size();
  INFO(what << ": n=" << n << " rows=" << rows << " row bytes=" << row_bytes);
  auto const table = random_bytes(rng, rows * row_bytes);
  device_bytes d_table{table};
  device_array<Index> d_idx{idx};
  std::vector<std::size_t> order(n);  // a permutation of the output rows
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::shuffle(order.begin(), order.end(), rng);
  device_array<std::size_t> d_order{order};
  bool any_invalid = false;
  for (Index k : idx) { any_invalid = any_invalid || k < 0 || static_cast<std::size_t>(k) >= rows; }
  cudaStream_t s{};
  REQUIRE(cudaStreamCreate(&s) == cudaSuccess);
  device_bytes err{sizeof(unsigned)};
  wm::detail::local_rows const source{d_table.ptr, rows, row_bytes};
  auto const check = [&](auto const& b, bool ordered, char const* plan) {
    INFO(plan << (ordered ? ", ordered" : ", in batch order"));
    device_bytes out{(n + 1) * row_bytes};  // one poisoned row past the end
    REQUIRE(cudaMemset(err.ptr, 0, sizeof(unsigned)) == cudaSuccess);
    auto const* ord = ordered ? d_order.ptr : nullptr;
    wm::detail::read_distinct(source, b, ord, wm::detail::packed_rows{out.ptr, row_bytes},
                              row_bytes, row_bytes, reinterpret_cast<unsigned*>(err.ptr), s, false);
    REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
    REQUIRE(cudaGetLastError() == cudaSuccess);
    auto const got        = out.to_host();
    std::size_t wrong     = 0;
    std::size_t first_bad = n;
    std::vector<std::byte> const zero(row_bytes, std::byte{0});
    for (std::size_t p = 0; p < n; ++p) {
      bool const valid = idx[p] >= 0 && static_cast<std::size_t>(idx[p]) < rows;
      std::byte const* want =
          valid ? table.data() + static_cast<std::size_t>(idx[p]) * row_bytes : zero.data();
      std::size_t const at = ordered ? order[p] : p;
      if (std::memcmp(got.data() + at * row_bytes, want, row_bytes) != 0) {
        ++wrong;
        first_bad = std::min(first_bad, p);
      }
    }
    INFO("first wrong position " << first_bad);
    CHECK(wrong == 0);
    CHECK(std::memcmp(got.data() + n * row_bytes, std::vector<std::byte>(row_bytes, poison).data(),
                      row_bytes) == 0);
    CHECK((copy_to_host(reinterpret_cast<unsigned const*>(err.ptr), 1)[0] != 0) == any_invalid);
  };
  for (bool ordered : {false, true}) {
    {
      wm::detail::workspace ws;
      auto const b = wm::detail::plan_distinct(d_idx.ptr, n, wm::detail::row_bits(rows), ws, s);
      check(b, ordered, "64-bit plan on the low row bits");
    }
    {
      wm::detail::workspace ws;
      auto const b = wm::detail::plan_distinct_narrow(d_idx.ptr, n, rows, ws, s);
      check(b, ordered, "32-bit plan");
    }
  }
  REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
}

/// Runs of the given lengths (keys drawn from rows without repeats; an invalid key when
/// @p invalid_too: below 0 or at/above rows with the low bits of a valid one), shuffled.
template <class Index>
std::vector<Index> runs_of(std::vector<std::size_t> const& lengths, std::size_t rows,
                           bool invalid_too, std::mt19937_64& rng) {
  std::vector<Index> keys;
  std::vector<std::size_t> pool(rows);
  std::iota(pool.begin(), pool.end(), std::size_t{0});
  std::shuffle(pool.begin(), pool.end(), rng);
  std::size_t const above = std::size_t{1} << wm::detail::row_bits(rows);
  for (std::size_t r = 0; r < lengths.size(); ++r) {
    Index k = static_cast<Index>(pool[r % rows]);
    if (invalid_too && r % 5 == 4) {
      k = r % 2 == 0 ? static_cast<Index>(-1 - static_cast<Index>(r % 7))
                     : static_cast<Index>(pool[r % rows] + above);
    }
    keys.insert(keys.end(), lengths[r], k);
  }
  std::shuffle(keys.begin(), keys.end(), rng);
  return keys;
}

TEMPLATE_TEST_CASE("read_distinct: runs of 16 and 17 keys, long runs at the list's capacity",
                   "[gpu]", std::int32_t, std::int64_t) {
  using Index = TestType;
  std::mt19937_64 rng{std::random_device{}()};
  std::size_t const rows = 4099;
  std::size_t const rb   = GENERATE(std::size_t{512}, std::size_t{36});
  SECTION("runs of 1, 15, 16, 17, 18 and 33 keys") {
    std::vector<std::size_t> lengths;
    for (int i = 0; i < 300; ++i) {
      for (std::size_t len : {1, 15, 16, 17, 18, 33}) { lengths.push_back(len); }
    }
    check_read_distinct(runs_of<Index>(lengths, rows, false, rng), rows, rb, rng, "mixed");
  }
  SECTION("only runs of 17: as many long runs as the list holds") {
    check_read_distinct(runs_of<Index>(std::vector<std::size_t>(500, 17), rows, false, rng), rows,
                        rb, rng, "17 each");
  }
  SECTION("only runs of 16: no long run") {
    check_read_distinct(runs_of<Index>(std::vector<std::size_t>(500, 16), rows, false, rng), rows,
                        rb, rng, "16 each");
  }
  SECTION("invalid keys among runs of 16 and 17 (they split runs in the 64-bit plan)") {
    std::vector<std::size_t> lengths;
    for (int i = 0; i < 400; ++i) { lengths.push_back(i % 2 == 0 ? 16 : 17); }
    check_read_distinct(runs_of<Index>(lengths, rows, true, rng), rows, rb, rng, "invalid");
  }
  SECTION("one key 20,000 times") {
    check_read_distinct(runs_of<Index>({20'000}, rows, false, rng), rows, rb, rng, "one hot key");
  }
  SECTION("16 and 17 keys in all") {
    check_read_distinct(runs_of<Index>({16}, rows, false, rng), rows, rb, rng, "n = 16");
    check_read_distinct(runs_of<Index>({17}, rows, false, rng), rows, rb, rng, "n = 17");
  }
}

// ---- host-table gathers through wm::tensor ----------------------------------------------------

/// A host tensor of @p rows x @p cols floats (row stride @p stride) holding @p table (dense rows).
template <class Y, class M>
struct host_table {
  wm::tensor<float, wm::host, Y, M> t;
  host_table(wm::communicator& comm, std::vector<std::byte> const& table, std::size_t rows,
             std::size_t cols, std::size_t stride)
      : t{comm, rows, cols, stride} {
    gather_tests::fill_local_rows<M>(comm, t, table, cols * sizeof(float));
  }
};

/// Gathers @p batch (poisoned output) and compares it with @p table: valid keys give their row,
/// invalid ones a zero row and an error (thrown by gather, when @p expect_error).
template <class Y, class M, class Index>
void check_host_gather(host_table<Y, M>& h, std::vector<std::byte> const& table, std::size_t rb,
                       std::vector<Index> const& batch, bool expect_error, cudaStream_t s,
                       std::string const& what) {
  INFO(what << ": " << batch.size() << " keys, index " << sizeof(Index) << " B, row " << rb
            << " B, " << h.t.rows() << " rows");
  std::size_t const n = batch.size();
  device_array<Index> keys{batch};
  device_bytes out{(n + 1) * rb};  // one poisoned row past the end
  bool threw = false;
  try {
    h.t.gather(keys.span(), reinterpret_cast<float*>(out.ptr), cuda::stream_ref{s});
  } catch (wm::logic_error const&) { threw = true; }
  CHECK(threw == expect_error);
  auto const got    = out.to_host();
  std::size_t wrong = 0, first_wrong = n;
  std::vector<std::byte> const zero(rb, std::byte{0});
  for (std::size_t i = 0; i < n; ++i) {
    bool const valid = batch[i] >= 0 && static_cast<std::size_t>(batch[i]) < h.t.rows();
    std::byte const* want =
        valid ? table.data() + static_cast<std::size_t>(batch[i]) * rb : zero.data();
    if (std::memcmp(got.data() + i * rb, want, rb) != 0) {
      first_wrong = std::min(first_wrong, i);
      ++wrong;
    }
  }
  INFO("first wrong row " << first_wrong);
  CHECK(wrong == 0);
  bool tail_untouched = true;
  for (std::size_t j = 0; j < rb; ++j) {
    tail_untouched = tail_untouched && got[n * rb + j] == poison;
  }
  CHECK(tail_untouched);
}

template <class Y, class M, class Index>
void host_gathers(wm::communicator& comm, std::uint64_t seed, std::size_t rows, std::size_t cols,
                  std::size_t stride) {
  std::size_t const rb = cols * sizeof(float);
  std::mt19937_64 shared{seed};  // the table: the same on every rank
  auto const table = random_bytes(shared, rows * rb);
  host_table<Y, M> h{comm, table, rows, cols, stride};
  std::mt19937_64 rng{seed + 1 + static_cast<std::uint64_t>(comm.rank())};  // batches by rank
  cudaStream_t s{};
  REQUIRE(cudaStreamCreate(&s) == cudaSuccess);
  std::size_t const t = wm::detail::host_distinct_threshold;
  // Every rank makes the same calls (distributed gathers are collective); lengths differ by rank.
  std::size_t const extra = static_cast<std::size_t>(comm.rank()) * 3;
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{100} + extra, t - 1, t,
                        t + 1 + extra, std::size_t{70'001} + extra}) {
    auto const label = std::to_string(n) + " keys";
    check_host_gather(h, table, rb, zipf_keys<Index>(rng, n, rows), false, s, "zipf " + label);
    std::vector<Index> uniform(n);
    for (auto& k : uniform) { k = static_cast<Index>(rng() % rows); }
    check_host_gather(h, table, rb, uniform, false, s, "uniform " + label);
    check_host_gather(h, table, rb, std::vector<Index>(n, static_cast<Index>(rng() % rows)), false,
                      s, "all equal " + label);
    if (n >= 2) {
      // Invalid keys mixed in, some sharing low bits with valid hot keys: an error, zero rows
      // for them, the right rows for the others.
      // (k + 2^bits has the low bits of k: the sort puts it among the k's.)
      std::size_t const above = std::size_t{1} << wm::detail::row_bits(rows);
      auto bad                = zipf_keys<Index>(rng, n, rows);
      for (std::size_t i = 0; i < n; i += 1 + rng() % 97) {
        auto const k = static_cast<std::size_t>(bad[i]);
        bad[i]       = rng() % 2 == 0 ? static_cast<Index>(-1 - static_cast<Index>(rng() % 5))
                                      : static_cast<Index>(k + above);
      }
      bad[n - 1] = static_cast<Index>(rows);
      check_host_gather(h, table, rb, bad, true, s, "invalid mixed in " + label);
      // The error was cleared: the next gather is clean.
      check_host_gather(h, table, rb, zipf_keys<Index>(rng, n, rows), false, s,
                        "after an error " + label);
    }
  }
  REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
  comm.barrier();
}

}  // namespace

#define WM_HOST_KINDS                                                                     \
  (std::tuple<wm::continuous, wm::block>), (std::tuple<wm::chunked, wm::block>),          \
      (std::tuple<wm::distributed, wm::block>), (std::tuple<wm::continuous, wm::cyclic>), \
      (std::tuple<wm::chunked, wm::cyclic>), (std::tuple<wm::distributed, wm::cyclic>)

TEMPLATE_TEST_CASE("ranked: host gathers read distinct rows once and match the table", "[ranked]",
                   WM_HOST_KINDS) {
  using Y                  = std::tuple_element_t<0, TestType>;
  using M                  = std::tuple_element_t<1, TestType>;
  auto& comm               = wm_test::comm();
  std::uint64_t const seed = shared_seed(comm);
  // 512-byte rows (16-byte vectors); 33 floats in a stride of 36 (4-byte vectors, padding).
  host_gathers<Y, M, std::int32_t>(comm, seed, 50'021, 128, 0);
  host_gathers<Y, M, std::int64_t>(comm, seed + 1, 50'021, 128, 0);
  host_gathers<Y, M, std::int64_t>(comm, seed + 2, 3'001, 33, 36);
  host_gathers<Y, M, std::int32_t>(comm, seed + 3, 1, 4, 0);  // one row: other ranks own none
}
