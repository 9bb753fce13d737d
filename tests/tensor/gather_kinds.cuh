// SPDX-License-Identifier: Apache-2.0
// The per-kind bodies of tensor_test's cases (declared in gather_common.cuh), included only by
// the kind_<location>_<layout>_test.cu files, which instantiate them explicitly: each once in the
// program, with every kernel of its kind.
#pragma once

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <optional>
#include <sstream>
#include <thread>

#include "gather_common.cuh"

namespace gather_tests {

template <class T, class L, class Y, class M, class Index>
void exercise(wm::communicator& comm, std::uint64_t seed, std::size_t rows, std::size_t cols,
              std::size_t stride) {
  std::string const what =
      std::string{L::name} + "." + Y::name + "." + M::name + " T=" + std::to_string(sizeof(T)) +
      "B index=" + std::to_string(sizeof(Index)) + "B rows=" + std::to_string(rows) +
      " cols=" + std::to_string(cols) + " stride=" + std::to_string(stride) +
      " ranks=" + std::to_string(comm.size());
  int const me         = comm.rank();
  int const world      = comm.size();
  std::size_t const rb = cols * sizeof(T);
  std::mt19937_64 shared{seed};  // the same on every rank: table and every rank's batches
  auto table = random_bytes(shared, rows * rb);

  wm::tensor<T, L, Y, M> t{comm, rows, cols, stride};
  RANK_REQUIRE(t.rows() == rows && t.cols() == cols && t.stride() == (stride == 0 ? cols : stride));
  // Each rank writes its rows from the reference table through the tensor's own scatter.
  auto const lv = t.local_view();
  RANK_REQUIRE(lv.rows == t.local_rows());
  std::vector<std::byte> mine(lv.rows * rb);
  std::vector<Index> mine_rows(lv.rows);
  for (std::size_t l = 0; l < lv.rows; ++l) {
    auto const k = global_row<M>(t.storage().partition(), world, me, l);
    RANK_REQUIRE(t.locate(k).rank == me && t.locate(k).local == l);
    std::memcpy(mine.data() + l * rb, table.data() + k * rb, rb);
    mine_rows[l] = static_cast<Index>(k);
  }
  {
    device_bytes const d{mine};
    device_array<Index> const di{mine_rows};
    t.scatter(di.span(), reinterpret_cast<T const*>(d.ptr), cuda::stream_ref{cudaStream_t{}});
  }
  comm.barrier();
  cudaStream_t stream{};
  WM_CUDA_TRY(cudaStreamCreate(&stream));
  cuda::stream_ref const s{stream};

  auto batch_of = [&](std::mt19937_64& rng, std::size_t n, int only_rank) {
    std::vector<Index> b;
    while (b.size() < n) {
      auto k = static_cast<Index>(rng() % rows);
      if (only_rank >= 0 && t.locate(static_cast<std::size_t>(k)).rank != only_rank) { continue; }
      b.push_back(k);
      if (rng() % 4 == 0) { b.push_back(k); }  // duplicates
    }
    b.resize(n);
    return b;
  };
  auto check_gather = [&](std::vector<Index> const& batch, std::string const& step) {
    device_array<Index> di{batch};
    device_bytes out{batch.size() * rb};
    t.gather(di.span(), reinterpret_cast<T*>(out.ptr), s);
    auto const got  = out.to_host();
    auto wrong_rows = [&](std::vector<std::byte> const& g) {
      std::vector<std::size_t> w;
      for (std::size_t i = 0; i < batch.size(); ++i) {
        if (std::memcmp(g.data() + i * rb, table.data() + static_cast<std::size_t>(batch[i]) * rb,
                        rb) != 0) {
          w.push_back(i);
        }
      }
      return w;
    };
    auto const wrong = wrong_rows(got);
    if (wrong.empty()) { return; }
    // Say enough to tell a wrong write from a late one: which rows, whose, what bytes, and
    // whether a second gather after a device sync and a barrier-free pause still differs.
    std::ostringstream os;
    os << what << " " << step << ": " << wrong.size() << " of " << batch.size()
       << " output rows differ;";
    auto hex = [&](std::byte const* p) {
      std::ostringstream h;
      for (std::size_t b = 0; b < std::min<std::size_t>(rb, 8); ++b) {
        h << std::hex << static_cast<unsigned>(p[b])
          << (b + 1 < std::min<std::size_t>(rb, 8) ? "." : "");
      }
      return h.str();
    };
    for (std::size_t q = 0; q < std::min<std::size_t>(wrong.size(), 4); ++q) {
      auto const i = wrong[q];
      auto const k = static_cast<std::size_t>(batch[i]);
      os << " [row " << i << " index " << k << " owner " << t.locate(k).rank << " got "
         << hex(got.data() + i * rb) << " want " << hex(table.data() + k * rb) << "]";
    }
    if constexpr (Y::mapped) {  // a distributed gather is collective: a lone rank cannot repeat it
      WM_CUDA_TRY(cudaDeviceSynchronize());
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      device_bytes again{batch.size() * rb};
      t.gather(di.span(), reinterpret_cast<T*>(again.ptr), s);
      os << "; a second gather 200 ms later: " << wrong_rows(again.to_host()).size()
         << " rows differ";
    }
    RANK_REQUIRE_MSG(wrong.empty(), os.str());
  };

  // 1. First a batch of this rank's own rows only (on a fresh distributed tensor nothing
  //    crosses in its first gather), then a random batch with duplicates (sizes differ by
  //    rank), and an empty one.
  {
    std::mt19937_64 own{seed + 77 +
                        static_cast<std::uint64_t>(me)};  // not `shared`: lengths differ by rank
    check_gather(t.local_rows() > 0 ? batch_of(own, 200 + 31 * static_cast<std::size_t>(me), me)
                                    : std::vector<Index>{},
                 "gather of own rows first");
  }
  std::vector<std::vector<Index>> batches(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) {
    batches[r] = batch_of(shared, rows == 0 ? 0 : 700 + 131 * r, -1);
  }
  check_gather(batches[me], "gather");
  check_gather({}, "empty gather");
  // Long batches of host tables, and of chunked device tables over several ranks, are read in
  // sorted order, starting at the next rank's rows (block mapping).
  if ((L::is_host || std::is_same_v<Y, wm::chunked>)&&Y::mapped && rows > 0) {
    // The same length on every rank: `shared` must stay in step across ranks (it draws every
    // rank's batches below); a rank-dependent length here once made the scatter references differ.
    check_gather(batch_of(shared, 70000, -1), "long gather (sorted)");
  }

  // Every rank has checked its gathers against the unchanged table before anyone scatters
  // (without this a fast rank's scatter below rewrote rows a slow rank was still checking).
  comm.barrier();

  // 2. Scatter: rank r writes rows whose owner is (r + 1) % world, so writes cross ranks;
  //    batches of different ranks touch disjoint rows. Last occurrence wins.
  std::vector<std::vector<Index>> targets(static_cast<std::size_t>(world));
  std::vector<std::vector<std::byte>> values(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) {
    int const dest = (r + 1) % world;
    bool const has = rows > 0 && t.storage().partition().count(dest) > 0 &&
                     (std::is_same_v<M, wm::block> || wm::cyclic::counts(rows, world)[dest] > 0);
    targets[r] = has ? batch_of(shared, 300 + 17 * r, dest) : std::vector<Index>{};
    values[r]  = random_bytes(shared, targets[r].size() * rb);
  }
  {
    device_array<Index> di{targets[me]};
    device_bytes vals{values[me]};
    t.scatter(di.span(), reinterpret_cast<T const*>(vals.ptr), s);
    device_array<Index> none{std::vector<Index>{}};
    t.scatter(none.span(), reinterpret_cast<T const*>(vals.ptr), s);  // empty scatter
  }
  for (int r = 0; r < world; ++r) {
    for (std::size_t i = 0; i < targets[r].size(); ++i) {  // in order: the last occurrence wins
      std::memcpy(table.data() + static_cast<std::size_t>(targets[r][i]) * rb,
                  values[r].data() + i * rb, rb);
    }
  }
  comm.barrier();
  std::vector<Index> all(rows);
  for (std::size_t k = 0; k < rows; ++k) { all[k] = static_cast<Index>(k); }
  check_gather(all, "gather of every row after scatter");

  // 3. Files: store in global row order, load into another kind (other location, layout and
  //    mapping) with a different stride; every row must come back. A short file fails everywhere.
  if constexpr (sizeof(Index) == 8) {
    auto const dir =
        std::filesystem::temp_directory_path() / ("wm-tensor-test-" + std::to_string(seed));
    std::filesystem::create_directories(dir);
    auto const files = t.store(dir / "t");
    using L2         = std::conditional_t<L::is_host, wm::device, wm::host>;
    using Y2 = std::conditional_t<std::is_same_v<Y, wm::distributed>, wm::chunked, wm::distributed>;
    using M2 = std::conditional_t<std::is_same_v<M, wm::block>, wm::cyclic, wm::block>;
    wm::tensor<T, L2, Y2, M2> copy{comm, rows, cols, cols + 1};
    copy.load(files);
    std::vector<Index> every(rows);
    for (std::size_t k = 0; k < rows; ++k) { every[k] = static_cast<Index>(k); }
    device_array<Index> di{every};
    device_bytes out{rows * rb};
    copy.gather(di.span(), reinterpret_cast<T*>(out.ptr), s);
    auto const got = out.to_host();
    RANK_REQUIRE_MSG(std::memcmp(got.data(), table.data(), rows * rb) == 0,
                     what << ": store/load round trip differs");
    if (rows > 0) {
      comm.barrier();
      if (me == 0) {
        std::filesystem::resize_file(files.back(), std::filesystem::file_size(files.back()) + 1);
      }
      comm.barrier();
      bool threw = false;
      try {
        copy.load(files);
      } catch (wm::io_error const&) { threw = true; }
      RANK_REQUIRE_MSG(threw, what << ": a file one byte too long was accepted");
    }
    comm.barrier();
    if (me == 0) { std::filesystem::remove_all(dir); }
  }

  // 4. Bad indices: the synchronous forms throw; the async form records it for check_errors.
  if (rows > 0) {
    std::vector<Index> bad = batch_of(shared, 50, -1);
    bad[7]                 = static_cast<Index>(rows);
    bad[20]                = static_cast<Index>(-3);
    device_array<Index> di{bad};
    device_bytes out{bad.size() * rb};
    bool threw = false;
    try {
      t.gather(di.span(), reinterpret_cast<T*>(out.ptr), s);
    } catch (wm::logic_error const&) { threw = true; }
    RANK_REQUIRE_MSG(threw, what << ": no error for an out-of-range gather index");
    auto const got = out.to_host();
    for (std::size_t i = 0; i < bad.size(); ++i) {
      if (i == 7 || i == 20) {
        for (std::size_t b = 0; b < rb; ++b) { RANK_REQUIRE(got[i * rb + b] == std::byte{0}); }
      } else {
        RANK_REQUIRE(std::memcmp(got.data() + i * rb,
                                 table.data() + static_cast<std::size_t>(bad[i]) * rb, rb) == 0);
      }
    }
    t.gather_async(di.span(), reinterpret_cast<T*>(out.ptr), s);
    threw = false;
    try {
      t.check_errors(s);
    } catch (wm::logic_error const&) { threw = true; }
    RANK_REQUIRE_MSG(threw, what << ": check_errors missed an out-of-range index");
    t.check_errors(s);  // cleared
    std::vector<Index> const bad_scatter{static_cast<Index>(rows + 5)};
    device_array<Index> ds{bad_scatter};
    device_bytes vals{rb};
    threw = false;
    try {
      t.scatter(ds.span(), reinterpret_cast<T const*>(vals.ptr), s);
    } catch (wm::logic_error const&) { threw = true; }
    RANK_REQUIRE_MSG(threw, what << ": no error for an out-of-range scatter index");
    comm.barrier();
    check_gather(all, "gather after a rejected scatter");  // nothing was written
  }
  WM_CUDA_TRY(cudaStreamDestroy(stream));
  comm.barrier();
}

// Values and outputs one element past an aligned address, as an odd-element slice of half
// values is: rows of 16 halves would allow 16-byte vectors, the address only 2-byte ones. Rank r
// scatters the rows k with k % world == r (in a shuffled order, so writes cross ranks) from
// values + 1, then every rank gathers every row into out + 1; both against a host reference.
template <class L, class Y, class M>
void misaligned_values(wm::communicator& comm, std::uint64_t seed, std::size_t rows,
                       std::size_t cols) {
  using T                = __half;
  std::string const what = std::string{L::name} + "." + Y::name + "." + M::name +
                           " misaligned halves rows=" + std::to_string(rows) +
                           " cols=" + std::to_string(cols) +
                           " ranks=" + std::to_string(comm.size());
  int const me            = comm.rank();
  int const world         = comm.size();
  std::size_t const rb    = cols * sizeof(T);
  std::size_t const shift = sizeof(T);  // one element: 2 bytes past a 256-byte aligned allocation
  std::mt19937_64 shared{seed};
  auto const table = random_bytes(shared, rows * rb);  // every row is written once, by one rank
  std::vector<std::int64_t> mine;
  for (std::size_t k = static_cast<std::size_t>(me); k < rows;
       k += static_cast<std::size_t>(world)) {
    mine.push_back(static_cast<std::int64_t>(k));
  }
  std::mt19937_64 local{seed + 1 + static_cast<std::uint64_t>(me)};
  std::shuffle(mine.begin(), mine.end(), local);
  std::vector<std::byte> values(mine.size() * rb);
  for (std::size_t i = 0; i < mine.size(); ++i) {
    std::memcpy(values.data() + i * rb, table.data() + static_cast<std::size_t>(mine[i]) * rb, rb);
  }

  wm::tensor<T, L, Y, M> t{comm, rows, cols};
  cudaStream_t stream{};
  WM_CUDA_TRY(cudaStreamCreate(&stream));
  cuda::stream_ref const s{stream};
  {
    device_array<std::int64_t> di{mine};
    device_bytes vals{values.size() + shift};
    WM_CUDA_TRY(cudaMemcpy(vals.ptr + shift, values.data(), values.size(), cudaMemcpyHostToDevice));
    WM_CUDA_TRY(cudaDeviceSynchronize());  // a pageable copy may return before its DMA ends
    t.scatter(di.span(), reinterpret_cast<T const*>(vals.ptr + shift), s);
  }
  comm.barrier();
  std::vector<std::int64_t> all(rows);
  for (std::size_t k = 0; k < rows; ++k) { all[k] = static_cast<std::int64_t>(k); }
  device_array<std::int64_t> di{all};
  device_bytes out{rows * rb + shift};  // poisoned
  t.gather(di.span(), reinterpret_cast<T*>(out.ptr + shift), s);
  auto const got    = out.to_host();
  std::size_t wrong = 0;
  for (std::size_t k = 0; k < rows; ++k) {
    wrong += std::memcmp(got.data() + shift + k * rb, table.data() + k * rb, rb) != 0 ? 1 : 0;
  }
  RANK_REQUIRE_MSG(wrong == 0, what << ": " << wrong << " of " << rows
                                    << " rows differ after scatter and gather");
  for (std::size_t b = 0; b < shift; ++b) {
    RANK_REQUIRE_MSG(got[b] == wm_test::poison_byte, what << ": wrote before out");
  }
  WM_CUDA_TRY(cudaStreamDestroy(stream));
  comm.barrier();
}

// Back-to-back async gathers reuse the tensor's workspaces (and mailboxes): three calls with
// growing batches (the buffers grow between calls; the last rank asks for nothing in the second),
// synchronized once at the end, on a fresh tensor each time: first each call on its own stream
// with nothing ordering them but the tensor itself, then all on one stream.
template <class L, class Y, class M>
void back_to_back(wm::communicator& comm, std::uint64_t seed) {
  using Index            = std::int64_t;
  int const me           = comm.rank();
  int const world        = comm.size();
  std::size_t const rows = 100'003;
  std::size_t const cols = 64;
  std::size_t const rb   = cols * sizeof(float);
  std::string const what = std::string{"back to back "} + L::name + "." + Y::name + "." + M::name;
  std::mt19937_64 shared{seed};  // the table, the same on every rank
  auto const table = random_bytes(shared, rows * rb);
  std::mt19937_64 rng{seed + 1 + static_cast<std::uint64_t>(me)};  // batches differ by rank
  std::size_t const sizes[3] = {1000 + 37 * static_cast<std::size_t>(me),
                                me == world - 1 ? 0 : 60'000 + 1001 * static_cast<std::size_t>(me),
                                200'000};
  for (bool const own_streams : {true, false}) {
    wm::tensor<float, L, Y, M> t{comm, rows, cols};
    auto const lv = t.local_view();
    if (lv.rows > 0) {  // this rank's rows of the table: every world-th (cyclic) or a range (block)
      auto const first = global_row<M>(t.storage().partition(), world, me, 0);
      std::size_t const src_pitch =
          std::is_same_v<M, wm::block> ? rb : static_cast<std::size_t>(world) * rb;
      WM_CUDA_TRY(cudaMemcpy2D(lv.data, lv.stride * sizeof(float), table.data() + first * rb,
                               src_pitch, rb, lv.rows, cudaMemcpyDefault));
    }
    WM_CUDA_TRY(cudaDeviceSynchronize());
    comm.barrier();
    std::vector<std::vector<Index>> batches;
    std::vector<std::unique_ptr<device_array<Index>>> keys;
    std::vector<std::unique_ptr<device_bytes>> outs;
    cudaStream_t streams[3]{};
    for (int i = 0; i < 3; ++i) {
      WM_CUDA_TRY(cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking));
      std::vector<Index> b(sizes[i]);
      for (auto& k : b) {
        k = static_cast<Index>(rng() % (rows / 2));
      }  // duplicates: half the rows
      batches.push_back(b);
      keys.push_back(std::make_unique<device_array<Index>>(b));
      outs.push_back(std::make_unique<device_bytes>(b.size() * rb));
    }
    WM_CUDA_TRY(cudaDeviceSynchronize());  // the inputs are in place before the gathers
    for (int i = 0; i < 3; ++i) {
      cuda::stream_ref const s{streams[own_streams ? i : 0]};
      t.gather_async(keys[static_cast<std::size_t>(i)]->span(),
                     reinterpret_cast<float*>(outs[static_cast<std::size_t>(i)]->ptr), s);
    }
    for (auto st : streams) { t.check_errors(cuda::stream_ref{st}); }
    for (std::size_t i = 0; i < 3; ++i) {
      auto const got    = outs[i]->to_host();
      std::size_t wrong = 0;
      for (std::size_t j = 0; j < batches[i].size(); ++j) {
        wrong += std::memcmp(got.data() + j * rb,
                             table.data() + static_cast<std::size_t>(batches[i][j]) * rb, rb) != 0;
      }
      RANK_REQUIRE_MSG(wrong == 0, what << (own_streams ? " (a stream each)" : " (one stream)")
                                        << " call " << i << ": " << wrong << " of "
                                        << batches[i].size() << " rows differ");
    }
    for (auto st : streams) { WM_CUDA_TRY(cudaStreamDestroy(st)); }
    comm.barrier();  // every rank has checked before the tensor goes
  }
}

// 0-row tensors: gathers of 70,000 indices (all out of range: zero rows and an error) and
// scatters (an error, nothing written), on every kind and both mappings.
template <class L, class Y, class M>
void zero_rows(wm::communicator& comm) {
  std::string const what = std::string{"0 rows, "} + L::name + "." + Y::name + "." + M::name;
  wm::tensor<float, L, Y, M> t{comm, 0, 4};
  RANK_REQUIRE(t.rows() == 0 && t.local_rows() == 0);
  std::vector<std::int64_t> batch(70'000);
  for (std::size_t j = 0; j < batch.size(); ++j) { batch[j] = static_cast<std::int64_t>(j % 5); }
  std::vector<std::int32_t> const batch32(batch.begin(), batch.end());
  device_array<std::int64_t> di{batch};
  device_array<std::int32_t> di32{batch32};
  device_bytes out{batch.size() * 4 * sizeof(float)};  // poisoned
  cuda::stream_ref const s = cudaStream_t{};
  bool threw               = false;
  try {
    t.gather(di.span(), reinterpret_cast<float*>(out.ptr), s);
  } catch (wm::logic_error const&) { threw = true; }
  RANK_REQUIRE_MSG(threw, what << ": a gather of 70,000 indices into 0 rows did not throw");
  auto const got = out.to_host();
  RANK_REQUIRE_MSG(
      std::all_of(got.begin(), got.end(), [](std::byte b) { return b == std::byte{0}; }),
      what << ": rows gathered for bad indices are not zero");
  threw = false;
  try {
    t.gather(di32.span(), reinterpret_cast<float*>(out.ptr), s);
  } catch (wm::logic_error const&) { threw = true; }
  RANK_REQUIRE_MSG(threw, what << ": a gather of 70,000 int32 indices into 0 rows did not throw");
  threw = false;
  try {
    t.scatter(di.span(), reinterpret_cast<float const*>(out.ptr), s);
  } catch (wm::logic_error const&) { threw = true; }
  RANK_REQUIRE_MSG(threw, what << ": a scatter of 70,000 indices into 0 rows did not throw");
  t.gather(std::span<std::int64_t const>{}, reinterpret_cast<float*>(out.ptr), s);  // empty: fine
  comm.barrier();
}

// scatter_async on a stream of the caller's, then store() at once: the files hold the new rows.
template <class L, class Y, class M>
void scatter_then_store(wm::communicator& comm, std::uint64_t seed,
                        std::filesystem::path const& dir) {
  std::string const what =
      std::string{"scatter_async then store, "} + L::name + "." + Y::name + "." + M::name;
  std::size_t const rows = 200'003, cols = 32, rb = cols * sizeof(float);
  std::mt19937_64 shared{seed};
  auto const old_rows = random_bytes(shared, rows * rb);
  auto const new_rows = random_bytes(shared, rows * rb);
  wm::tensor<float, L, Y, M> t{comm, rows, cols};
  fill_local_rows<M>(comm, t, old_rows, rb);
  // Every rank scatters the new rows of its block share (the distributed scatter is collective).
  wm::block_partition const share{rows, comm.size()};
  std::size_t const first = share.begin(comm.rank()), n = share.end(comm.rank()) - first;
  std::vector<std::int64_t> idx(n);
  std::iota(idx.begin(), idx.end(), static_cast<std::int64_t>(first));
  std::shuffle(idx.begin(), idx.end(), shared);
  std::vector<std::byte> values(n * rb);
  for (std::size_t j = 0; j < n; ++j) {
    std::memcpy(values.data() + j * rb, new_rows.data() + static_cast<std::size_t>(idx[j]) * rb,
                rb);
  }
  device_array<std::int64_t> di{idx};
  device_bytes dv{values};
  cudaStream_t stream{};
  WM_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  t.scatter_async(di.span(), reinterpret_cast<float const*>(dv.ptr), cuda::stream_ref{stream});
  auto const files =
      t.store(dir / (std::string{L::name} + Y::name + M::name));  // no sync in between
  t.check_errors(cuda::stream_ref{stream});
  WM_CUDA_TRY(cudaStreamDestroy(stream));
  comm.barrier();
  std::vector<std::byte> stored;
  for (auto const& f : files) {
    std::ifstream in{f, std::ios::binary};
    std::vector<std::byte> part(std::filesystem::file_size(f));
    in.read(reinterpret_cast<char*>(part.data()), static_cast<std::streamsize>(part.size()));
    stored.insert(stored.end(), part.begin(), part.end());
  }
  RANK_REQUIRE_MSG(stored.size() == new_rows.size(),
                   what << ": " << stored.size() << " bytes stored");
  std::size_t wrong = 0;
  for (std::size_t k = 0; k < rows; ++k) {
    wrong += std::memcmp(stored.data() + k * rb, new_rows.data() + k * rb, rb) != 0;
  }
  RANK_REQUIRE_MSG(wrong == 0, what << ": " << wrong << " of " << rows
                                    << " stored rows are not the scattered ones");
  comm.barrier();
}

// A tensor moved onto while its own gathers are still running (and onto one whose gathers run):
// the old memory goes only after its work, and the moved-in tensor serves its rows.
template <class L, class Y, class M>
void move_during_async(wm::communicator& comm, std::uint64_t seed) {
  std::string const what =
      std::string{"move-assignment during async work, "} + L::name + "." + Y::name + "." + M::name;
  std::size_t const rows = 100'003, cols = 64, rb = cols * sizeof(float);
  std::mt19937_64 shared{seed};
  auto const table_a = random_bytes(shared, rows * rb);
  auto const table_b = random_bytes(shared, rows * rb);
  wm::tensor<float, L, Y, M> a{comm, rows, cols};
  wm::tensor<float, L, Y, M> b{comm, rows, cols};
  fill_local_rows<M>(comm, a, table_a, rb);
  fill_local_rows<M>(comm, b, table_b, rb);
  std::vector<std::int64_t> batch(400'000);
  for (auto& k : batch) { k = static_cast<std::int64_t>(shared() % rows); }
  device_array<std::int64_t> di{batch};
  device_bytes out_a{batch.size() * rb};
  device_bytes out_b{batch.size() * rb};
  cudaStream_t streams[2]{};
  for (auto& st : streams) { WM_CUDA_TRY(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking)); }
  a.gather_async(di.span(), reinterpret_cast<float*>(out_a.ptr), cuda::stream_ref{streams[0]});
  b.gather_async(di.span(), reinterpret_cast<float*>(out_b.ptr), cuda::stream_ref{streams[1]});
  a = std::move(b);  // a's gather may still run; b's goes on under a's name
  for (auto st : streams) { WM_CUDA_TRY(cudaStreamSynchronize(st)); }
  auto check = [&](device_bytes const& out, std::vector<std::byte> const& table,
                   char const* which) {
    auto const got    = out.to_host();
    std::size_t wrong = 0;
    for (std::size_t j = 0; j < batch.size(); ++j) {
      wrong += std::memcmp(got.data() + j * rb,
                           table.data() + static_cast<std::size_t>(batch[j]) * rb, rb) != 0;
    }
    RANK_REQUIRE_MSG(wrong == 0, what << ", " << which << ": " << wrong << " of " << batch.size()
                                      << " rows differ");
  };
  check(out_a, table_a, "the gather from the old tensor");
  check(out_b, table_b, "the gather from the moved tensor");
  a.check_errors(cuda::stream_ref{streams[1]});
  gather_checks(a, table_b, rb, seed + 1, what + ", a gather after the move");
  for (auto st : streams) { WM_CUDA_TRY(cudaStreamDestroy(st)); }
  comm.barrier();
}

// Views of a tensor's columns (view_columns): int64 columns in the padding of a float tensor's
// 64-byte rows and, through a view of that view, float columns after them; each filled and
// gathered on its own with the others' bytes untouched, a scatter into the inner view, the views
// outliving the tensor they came from, and the misuses refused.
template <class L, class Y, class M>
void column_views(wm::communicator& comm, std::uint64_t seed) {
  std::string const what = std::string{"view_columns, "} + L::name + "." + Y::name + "." + M::name;
  std::size_t const rows = 70'001;  // not a multiple of the rank count
  std::mt19937_64 shared{seed};
  auto const base_rows = random_bytes(shared, rows * 32);  // 8 floats
  auto const a_rows    = random_bytes(shared, rows * 16);  // 2 int64
  auto const b_rows    = random_bytes(shared, rows * 16);  // 4 floats
  auto const b_new     = random_bytes(shared, rows * 16);
  std::optional<wm::tensor<float, L, Y, M>> base;
  base.emplace(comm, rows, 8, 16);
  auto a = base->template view_columns<std::int64_t>(32, 2);
  auto b = a.template view_columns<float>(16, 4);
  RANK_REQUIRE_MSG(a.column_offset() == 32 && b.column_offset() == 48 && a.stride() == 8 &&
                       b.stride() == 16 && a.rows() == rows && a.cols() == 2 && b.cols() == 4 &&
                       b.local_rows() == base->local_rows(),
                   what << ": the views' shapes");
  auto const* const first = reinterpret_cast<std::byte const*>(base->local_view().data);
  if (base->local_rows() > 0) {
    RANK_REQUIRE_MSG(reinterpret_cast<std::byte const*>(a.local_view().data) == first + 32 &&
                         reinterpret_cast<std::byte const*>(b.ref().local_row(0)) == first + 48,
                     what << ": the views' local rows");
  } else {
    RANK_REQUIRE_MSG(a.local_view().data == nullptr, what << ": a rank without rows");
  }
  fill_local_rows<M>(comm, *base, base_rows, 32);
  fill_local_rows<M>(comm, a, a_rows, 16);
  fill_local_rows<M>(comm, b, b_rows, 16);
  gather_checks(*base, base_rows, 32, seed + 1, what + ": the tensor's own columns");
  gather_checks(a, a_rows, 16, seed + 2, what + ": int64 columns");
  gather_checks(b, b_rows, 16, seed + 3, what + ": float columns of the view");
  // Each rank scatters the new rows of its block share into b (collective when distributed).
  wm::block_partition const share{rows, comm.size()};
  std::size_t const from = share.begin(comm.rank()), n = share.end(comm.rank()) - from;
  std::vector<std::int64_t> idx(n);
  std::iota(idx.begin(), idx.end(), static_cast<std::int64_t>(from));
  std::shuffle(idx.begin(), idx.end(), shared);
  std::vector<std::byte> values(n * 16);
  for (std::size_t j = 0; j < n; ++j) {
    std::memcpy(values.data() + j * 16, b_new.data() + static_cast<std::size_t>(idx[j]) * 16, 16);
  }
  device_array<std::int64_t> di{idx};
  device_bytes dv{values};
  b.scatter(di.span(), reinterpret_cast<float const*>(dv.ptr), cuda::stream_ref{cudaStream_t{}});
  comm.barrier();
  gather_checks(*base, base_rows, 32, seed + 4, what + ": the tensor after the view's scatter");
  base.reset();  // the views keep the memory
  gather_checks(b, b_new, 16, seed + 5, what + ": scattered rows, the tensor gone");
  gather_checks(a, a_rows, 16, seed + 6, what + ": the other view, the tensor gone");
  auto refused = [&](auto&& f) {
    try {
      f();
    } catch (wm::logic_error const&) { return true; }
    return false;
  };
  RANK_REQUIRE_MSG(refused([&] { (void)a.template view_columns<std::int64_t>(4, 1); }),
                   what << ": a misaligned offset was accepted");
  RANK_REQUIRE_MSG(refused([&] { (void)a.template view_columns<float>(28, 2); }),
                   what << ": columns past the stride were accepted");
  RANK_REQUIRE_MSG(refused([&] { (void)b.template view_columns<float>(0, 0); }),
                   what << ": zero columns were accepted");
  comm.barrier();
}

}  // namespace gather_tests

// Explicit instantiations for a kind_<location>_<layout>_test.cu file.

// The gather/scatter suite on L.Y: every element type with both index types (block mapping),
// float rows with int32 and int64 rows with int64 indices (cyclic mapping).
#define WM_TENSOR_SUITE_TYPE(T, L, Y, M, I)                                             \
  template void gather_tests::exercise<T, L, Y, M, I>(wm::communicator&, std::uint64_t, \
                                                      std::size_t, std::size_t, std::size_t)
#define WM_TENSOR_SUITE_INDEX(L, Y, I)                     \
  WM_TENSOR_SUITE_TYPE(float, L, Y, wm::block, I);         \
  WM_TENSOR_SUITE_TYPE(__half, L, Y, wm::block, I);        \
  WM_TENSOR_SUITE_TYPE(__nv_bfloat16, L, Y, wm::block, I); \
  WM_TENSOR_SUITE_TYPE(std::int32_t, L, Y, wm::block, I);  \
  WM_TENSOR_SUITE_TYPE(std::int64_t, L, Y, wm::block, I)
#define WM_TENSOR_SUITE(L, Y)                                  \
  WM_TENSOR_SUITE_INDEX(L, Y, std::int32_t);                   \
  WM_TENSOR_SUITE_INDEX(L, Y, std::int64_t);                   \
  WM_TENSOR_SUITE_TYPE(float, L, Y, wm::cyclic, std::int32_t); \
  WM_TENSOR_SUITE_TYPE(std::int64_t, L, Y, wm::cyclic, std::int64_t)

// The bodies every kind L.Y.M runs: misaligned halves and the [ranked] cases of ranked_test.cu.
#define WM_TENSOR_KIND(L, Y, M)                                                             \
  template void gather_tests::misaligned_values<L, Y, M>(wm::communicator&, std::uint64_t,  \
                                                         std::size_t, std::size_t);         \
  template void gather_tests::zero_rows<L, Y, M>(wm::communicator&);                        \
  template void gather_tests::scatter_then_store<L, Y, M>(wm::communicator&, std::uint64_t, \
                                                          std::filesystem::path const&);    \
  template void gather_tests::move_during_async<L, Y, M>(wm::communicator&, std::uint64_t); \
  template void gather_tests::column_views<L, Y, M>(wm::communicator&, std::uint64_t)

// back_to_back on L.Y.M (the kinds gather_test.cu's back-to-back cases name).
#define WM_TENSOR_BACK_TO_BACK(L, Y, M) \
  template void gather_tests::back_to_back<L, Y, M>(wm::communicator&, std::uint64_t)
