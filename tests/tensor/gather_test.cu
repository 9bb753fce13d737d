// GPU tests of wm::tensor gather/scatter: every layout x location x element type x index type
// (block mapping), every kind with the cyclic mapping, with 1 rank ([gpu]) and one rank per GPU
// ([multi_gpu]). Tables hold fresh random bytes; results are compared byte for byte with a host
// reference; outputs are poisoned first; batches have duplicates, empty batches, bad indices.
#include <wm/tensor.cuh>
#include <wm/wm.cuh>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string_view>
#include <thread>
#include <tuple>
#include <vector>

#include "catch.hpp"
#include "rank_check.hpp"
#include "ranks.hpp"

namespace {

// Device buffer of bytes, poisoned on creation.
struct device_bytes {
  std::byte* ptr{};
  std::size_t n{};
  explicit device_bytes(std::size_t bytes) : n{bytes} {
    WM_CUDA_TRY(cudaMalloc(&ptr, std::max<std::size_t>(bytes, 1)));
    WM_CUDA_TRY(cudaMemset(ptr, 0xA5, std::max<std::size_t>(bytes, 1)));
    // cudaMemset of device memory returns before it is done, on the legacy stream, which
    // cudaStreamNonBlocking streams do not wait for: a gather on one could be poisoned after it
    // wrote (seen on an H200 with another process on the GPU).
    WM_CUDA_TRY(cudaDeviceSynchronize());
  }
  ~device_bytes() { (void)cudaFree(ptr); }
  device_bytes(device_bytes const&) = delete;
  std::vector<std::byte> to_host() const {
    std::vector<std::byte> h(n);
    WM_CUDA_TRY(cudaMemcpy(h.data(), ptr, n, cudaMemcpyDeviceToHost));
    return h;
  }
};

template <class Index>
struct device_indices {
  device_bytes buf;
  std::size_t count;
  explicit device_indices(std::vector<Index> const& h)
      : buf{h.size() * sizeof(Index)}, count{h.size()} {
    WM_CUDA_TRY(cudaMemcpy(buf.ptr, h.data(), h.size() * sizeof(Index), cudaMemcpyHostToDevice));
    WM_CUDA_TRY(cudaDeviceSynchronize());  // a pageable copy may return before its DMA ends
  }
  std::span<Index const> span() const { return {reinterpret_cast<Index const*>(buf.ptr), count}; }
};

std::vector<std::byte> random_bytes(std::mt19937_64& rng, std::size_t n) {
  std::vector<std::byte> v(n);
  for (auto& b : v) { b = static_cast<std::byte>(rng()); }
  return v;
}

// Global row of local row l on rank r.
template <class M>
std::size_t global_row(wm::block_partition const& p, int world, int r, std::size_t l) {
  if constexpr (std::is_same_v<M, wm::block>) {
    return p.begin(r) + l;
  } else {
    return l * static_cast<std::size_t>(world) + static_cast<std::size_t>(r);
  }
}

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
    std::vector<std::byte> const& h = mine;
    std::byte* d                    = nullptr;
    Index* di                       = nullptr;
    WM_CUDA_TRY(cudaMalloc(&d, std::max<std::size_t>(h.size(), 1)));
    WM_CUDA_TRY(cudaMalloc(&di, std::max<std::size_t>(mine_rows.size(), 1) * sizeof(Index)));
    WM_CUDA_TRY(cudaMemcpy(d, h.data(), h.size(), cudaMemcpyHostToDevice));
    WM_CUDA_TRY(
        cudaMemcpy(di, mine_rows.data(), mine_rows.size() * sizeof(Index), cudaMemcpyHostToDevice));
    t.scatter(std::span<Index const>{di, mine_rows.size()}, reinterpret_cast<T const*>(d),
              cuda::stream_ref{cudaStream_t{}});
    WM_CUDA_TRY(cudaFree(d));
    WM_CUDA_TRY(cudaFree(di));
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
    device_indices<Index> di{batch};
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
    device_indices<Index> di{targets[me]};
    device_bytes vals{values[me].size()};
    WM_CUDA_TRY(cudaMemcpy(vals.ptr, values[me].data(), values[me].size(), cudaMemcpyHostToDevice));
    WM_CUDA_TRY(cudaDeviceSynchronize());  // a pageable copy may return before its DMA ends
    t.scatter(di.span(), reinterpret_cast<T const*>(vals.ptr), s);
    device_indices<Index> none{std::vector<Index>{}};
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
    device_indices<Index> di{every};
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
    device_indices<Index> di{bad};
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
    device_indices<Index> ds{bad_scatter};
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
    device_indices<std::int64_t> di{mine};
    device_bytes vals{values.size() + shift};
    WM_CUDA_TRY(cudaMemcpy(vals.ptr + shift, values.data(), values.size(), cudaMemcpyHostToDevice));
    WM_CUDA_TRY(cudaDeviceSynchronize());  // a pageable copy may return before its DMA ends
    t.scatter(di.span(), reinterpret_cast<T const*>(vals.ptr + shift), s);
  }
  comm.barrier();
  std::vector<std::int64_t> all(rows);
  for (std::size_t k = 0; k < rows; ++k) { all[k] = static_cast<std::int64_t>(k); }
  device_indices<std::int64_t> di{all};
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
    RANK_REQUIRE_MSG(got[b] == std::byte{0xA5}, what << ": wrote before out");
  }
  WM_CUDA_TRY(cudaStreamDestroy(stream));
  comm.barrier();
}

// Calls run.template operator()<Location, Layout>() for every location and layout.
template <class Run>
void for_every_kind(Run&& run) {
  run.template operator()<wm::device, wm::continuous>();
  run.template operator()<wm::device, wm::chunked>();
  run.template operator()<wm::device, wm::distributed>();
  run.template operator()<wm::host, wm::continuous>();
  run.template operator()<wm::host, wm::chunked>();
  run.template operator()<wm::host, wm::distributed>();
}

template <class M>
void misaligned_all_kinds(wm::communicator& comm, std::uint64_t seed) {
  for_every_kind([&]<class L, class Y>() {
    misaligned_values<L, Y, M>(comm, ++seed, 1003, 16);  // 32-byte rows
    misaligned_values<L, Y, M>(comm, ++seed, 517, 9);    // 18-byte rows
  });
}

template <class L, class Y, class M, class Index>
void all_types(wm::communicator& comm, std::uint64_t& seed) {
  // 16-byte rows, odd rows, padded rows, 1D; row counts not divisible by the rank count.
  exercise<float, L, Y, M, Index>(comm, ++seed, 1001, 128, 0);
  exercise<float, L, Y, M, Index>(comm, ++seed, 777, 33, 36);
  exercise<__half, L, Y, M, Index>(comm, ++seed, 513, 7, 0);
  exercise<__nv_bfloat16, L, Y, M, Index>(comm, ++seed, 300, 64, 72);
  exercise<std::int32_t, L, Y, M, Index>(comm, ++seed, 1003, 1, 0);
  exercise<std::int64_t, L, Y, M, Index>(comm, ++seed, 99, 5, 0);
  exercise<float, L, Y, M, Index>(comm, ++seed, 1, 4, 0);  // one row: other ranks own nothing
}

template <class M, bool all_element_types>
void all_kinds(wm::communicator& comm, std::uint64_t seed) {
  for_every_kind([&]<class L, class Y>() {
    if constexpr (all_element_types) {
      all_types<L, Y, M, std::int32_t>(comm, seed);
      all_types<L, Y, M, std::int64_t>(comm, seed);
    } else {
      exercise<float, L, Y, M, std::int32_t>(comm, ++seed, 1001, 32, 0);
      exercise<std::int64_t, L, Y, M, std::int64_t>(comm, ++seed, 5, 3, 0);
    }
  });
}

void run_suite(int ranks) {
  std::uint64_t const seed = std::random_device{}();
  wm::launch(ranks, [&](wm::communicator& comm) {
    all_kinds<wm::block, true>(comm, seed);
    all_kinds<wm::cyclic, false>(comm, seed + 1000);
  });
}

static_assert(wm::mapping<wm::block> && wm::mapping<wm::cyclic>);

// Whether every pair of this node's GPUs has peer access (the mailboxes need it).
bool peers_reach_each_other() {
  int n = 0;
  WM_CUDA_TRY(cudaGetDeviceCount(&n));
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      int can = 1;
      if (i != j) { WM_CUDA_TRY(cudaDeviceCanAccessPeer(&can, i, j)); }
      if (can == 0) { return false; }
    }
  }
  return true;
}

// The path a fresh distributed tensor takes under this process's WM_DISPATCH_ROWS: undecided
// until its first gather (here of every row, so rows cross), then what every rank agreed on.
wm::row_path path_of_fresh_tensor(wm::communicator& comm) {
  std::size_t const rows = 1000;
  wm::tensor<float, wm::device, wm::distributed> t{comm, rows, 4};
  RANK_REQUIRE(t.gather_path() == wm::row_path::undecided);
  std::vector<std::int32_t> all(rows);
  std::iota(all.begin(), all.end(), 0);
  device_indices<std::int32_t> const di{all};
  device_bytes const out{rows * t.cols() * sizeof(float)};
  t.gather(di.span(), reinterpret_cast<float*>(out.ptr), cuda::stream_ref{cudaStream_t{}});
  return t.gather_path();
}

// Every rank's first distributed gather throws when some rank's WM_DISPATCH_ROWS is unknown.
void bad_path_setting_throws_everywhere(wm::communicator& comm, int bad_rank) {
  if (comm.rank() == bad_rank) { RANK_REQUIRE(::setenv("WM_DISPATCH_ROWS", "Copy", 1) == 0); }
  bool threw = false;
  try {
    (void)path_of_fresh_tensor(comm);
  } catch (wm::logic_error const& e) {
    threw = std::string_view{e.what()}.find("WM_DISPATCH_ROWS") != std::string_view::npos;
  }
  RANK_REQUIRE(threw);
  RANK_REQUIRE(::unsetenv("WM_DISPATCH_ROWS") == 0);
  RANK_REQUIRE(path_of_fresh_tensor(comm) != wm::row_path::undecided);  // the group still works
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
    std::vector<std::unique_ptr<device_indices<Index>>> keys;
    std::vector<std::unique_ptr<device_bytes>> outs;
    cudaStream_t streams[3]{};
    for (int i = 0; i < 3; ++i) {
      WM_CUDA_TRY(cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking));
      std::vector<Index> b(sizes[i]);
      for (auto& k : b) {
        k = static_cast<Index>(rng() % (rows / 2));
      }  // duplicates: half the rows
      batches.push_back(b);
      keys.push_back(std::make_unique<device_indices<Index>>(b));
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

}  // namespace

TEST_CASE("one rank: gather/scatter on every kind, type and index type", "[gpu]") {
  run_suite(1);
}

TEST_CASE("ranks: gather/scatter on every kind, type and index type", "[multi_gpu]") {
  run_suite(wm::local_device_count());
}

TEST_CASE("one rank: the gather path is reported and its setting checked", "[gpu]") {
  wm::launch(1, [&](wm::communicator& comm) {
    RANK_REQUIRE(::unsetenv("WM_DISPATCH_ROWS") == 0);
    RANK_REQUIRE(path_of_fresh_tensor(comm) == wm::row_path::nccl);  // one rank: no mailbox
    RANK_REQUIRE(::setenv("WM_DISPATCH_ROWS", "copy", 1) == 0);
    RANK_REQUIRE(path_of_fresh_tensor(comm) == wm::row_path::nccl);
    RANK_REQUIRE(::unsetenv("WM_DISPATCH_ROWS") == 0);
    wm::tensor<float, wm::device, wm::chunked> const mapped{comm, 10, 4};
    RANK_REQUIRE(mapped.gather_path() == wm::row_path::direct);
    bad_path_setting_throws_everywhere(comm, 0);
  });
}

TEST_CASE("one rank: grouping by owner without a sort puts each index in its owner's group once",
          "[gpu]") {
  std::uint64_t const seed = std::random_device{}();
  wm::launch(1, [&](wm::communicator&) {
    std::mt19937_64 rng{seed};
    for (int const world : {1, 2, 3, 7, wm::detail::place_shared_ranks - 1}) {
      for (std::size_t const n : {std::size_t{0}, std::size_t{1}, std::size_t{31},
                                  std::size_t{2048}, std::size_t{2049}, std::size_t{100'003}}) {
        for (int const max_blocks :
             {1, 3, 1000}) {  // one block taking every tile, a few, one per tile
          // Owners in [0, world], world meaning invalid; some owners get nothing when world is
          // large.
          std::vector<int> owner(n);
          std::vector<std::int64_t> local(n);
          for (auto& o : owner) {
            o = static_cast<int>(rng() % (static_cast<std::uint64_t>(world) + 1));
          }
          for (auto& l : local) {
            l = static_cast<std::int64_t>(rng() >> 1);
          }  // huge values travel intact
          std::vector<unsigned long long> starts(static_cast<std::size_t>(world) + 2, 0);
          for (int o : owner) { ++starts[static_cast<std::size_t>(o) + 1]; }
          std::partial_sum(starts.begin(), starts.end(), starts.begin());
          std::vector<unsigned long long> next(starts.begin(), starts.end() - 1);
          device_bytes d_owner{n * sizeof(int)}, d_local{n * sizeof(std::int64_t)};
          device_bytes d_next{next.size() * sizeof(unsigned long long)};
          device_bytes d_order{n * sizeof(std::size_t)},
              d_keys{n * sizeof(std::int64_t)};  // poisoned
          WM_CUDA_TRY(
              cudaMemcpy(d_owner.ptr, owner.data(), n * sizeof(int), cudaMemcpyHostToDevice));
          WM_CUDA_TRY(cudaMemcpy(d_local.ptr, local.data(), n * sizeof(std::int64_t),
                                 cudaMemcpyHostToDevice));
          WM_CUDA_TRY(cudaMemcpy(d_next.ptr, next.data(), next.size() * sizeof(unsigned long long),
                                 cudaMemcpyHostToDevice));
          wm::detail::launch_place_by_owner(
              reinterpret_cast<int const*>(d_owner.ptr),
              reinterpret_cast<std::int64_t const*>(d_local.ptr), n, world,
              reinterpret_cast<unsigned long long*>(d_next.ptr),
              reinterpret_cast<std::size_t*>(d_order.ptr),
              reinterpret_cast<std::int64_t*>(d_keys.ptr), nullptr, max_blocks);
          WM_CUDA_TRY(cudaDeviceSynchronize());
          std::vector<std::size_t> order(n);
          std::vector<std::int64_t> keys(n);
          WM_CUDA_TRY(cudaMemcpy(order.data(), d_order.ptr, n * sizeof(std::size_t),
                                 cudaMemcpyDeviceToHost));
          WM_CUDA_TRY(cudaMemcpy(keys.data(), d_keys.ptr, n * sizeof(std::int64_t),
                                 cudaMemcpyDeviceToHost));
          WM_CUDA_TRY(cudaMemcpy(next.data(), d_next.ptr, next.size() * sizeof(unsigned long long),
                                 cudaMemcpyDeviceToHost));
          std::vector<char> seen(n, 0);
          std::size_t wrong = 0;
          for (std::size_t r = 0; r <= static_cast<std::size_t>(world); ++r) {
            wrong += next[r] != starts[r + 1];  // every counter moved exactly past its group
            for (auto slot = starts[r]; slot < starts[r + 1]; ++slot) {
              std::size_t const i = order[slot];
              if (i >= n || seen[i] != 0 || static_cast<std::size_t>(owner[i]) != r ||
                  keys[slot] != local[i]) {
                ++wrong;
                continue;
              }
              seen[i] = 1;
            }
          }
          auto const placed = std::count(seen.begin(), seen.end(), 1);
          RANK_REQUIRE_MSG(wrong == 0 && placed == static_cast<std::ptrdiff_t>(n),
                           wrong << " wrong slots, " << placed << " of " << n << " placed; world "
                                 << world << ", at most " << max_blocks << " blocks, seed "
                                 << seed);
        }
      }
    }
  });
}

TEST_CASE("one rank: scatter from and gather to half values not aligned to 16 bytes", "[gpu]") {
  std::uint64_t const seed = std::random_device{}();
  wm::launch(1, [&](wm::communicator& comm) {
    misaligned_all_kinds<wm::block>(comm, seed);
    misaligned_all_kinds<wm::cyclic>(comm, seed + 100);
  });
}

TEST_CASE("ranks: scatter from and gather to half values not aligned to 16 bytes", "[multi_gpu]") {
  std::uint64_t const seed = std::random_device{}();
  wm::launch(wm::local_device_count(), [&](wm::communicator& comm) {
    misaligned_all_kinds<wm::block>(comm, seed);
    misaligned_all_kinds<wm::cyclic>(comm, seed + 100);
  });
}

TEST_CASE("one rank: async gathers back to back, on one stream and on several", "[gpu]") {
  std::uint64_t const seed = std::random_device{}();
  wm::launch(1, [&](wm::communicator& comm) {
    back_to_back<wm::device, wm::distributed, wm::block>(comm, seed);
    back_to_back<wm::host, wm::chunked, wm::cyclic>(comm, seed + 1);  // sorted reads: workspaces
    back_to_back<wm::host, wm::continuous, wm::block>(comm, seed + 2);
  });
}

TEST_CASE("ranks: async gathers back to back, on one stream and on several, on every path",
          "[multi_gpu]") {
  std::uint64_t const seed = std::random_device{}();
  wm::launch(wm::local_device_count(), [&](wm::communicator& comm) {
    for (char const* how : {"put", "copy", "nccl"}) {
      RANK_REQUIRE(::setenv("WM_DISPATCH_ROWS", how, 1) == 0);
      try {
        back_to_back<wm::device, wm::distributed, wm::block>(comm, seed);
        back_to_back<wm::device, wm::distributed, wm::cyclic>(comm, seed + 1);
      } catch (std::exception const& e) {
        ::unsetenv("WM_DISPATCH_ROWS");
        throw std::runtime_error{std::string{"WM_DISPATCH_ROWS="} + how + ": " + e.what()};
      }
    }
    RANK_REQUIRE(::unsetenv("WM_DISPATCH_ROWS") == 0);
    back_to_back<wm::device, wm::chunked, wm::block>(comm, seed + 2);
    back_to_back<wm::host, wm::chunked, wm::block>(comm, seed + 3);
  });
}

// The distributed gather sends each peer's rows in pieces (one per started 32 MiB, at most 6,
// the first and last smaller from three on) while it gathers the next piece: a gather of every
// row of a 140 MB table moves 70 MB per peer on 2 ranks (three pieces) and 35 MB on 4 (two),
// with row counts that do not divide evenly.
// From 5 ranks on each peer's share fits one piece and this test no longer pipelines.
TEST_CASE("ranks: long distributed gathers cross in pieces", "[multi_gpu]") {
  std::uint64_t const seed = std::random_device{}();
  wm::launch(wm::local_device_count(), [&](wm::communicator& comm) {
    exercise<float, wm::device, wm::distributed, wm::block, std::int64_t>(comm, seed, 140'001, 256,
                                                                          0);
    exercise<float, wm::device, wm::distributed, wm::cyclic, std::int32_t>(comm, seed + 1, 70'003,
                                                                           512, 520);
    // ... with the rows copied into the mailboxes (the default on one node with peer access).
    RANK_REQUIRE(path_of_fresh_tensor(comm) ==
                 (peers_reach_each_other() ? wm::row_path::copy : wm::row_path::nccl));
  });
}

// On one node the distributed gather's owners gather rows locally and the copy engines move them
// into the asking rank's mailbox (the cases above). With WM_DISPATCH_ROWS=put their gather
// kernels store the rows into the mailbox; across nodes, without peer access, or with
// WM_DISPATCH_ROWS=nccl the rows cross through NCCL instead: the same gathers, on each path.
TEST_CASE("ranks: distributed gathers with rows put by kernels or through NCCL", "[multi_gpu]") {
  std::uint64_t const seed = std::random_device{}();
  wm::launch(wm::local_device_count(), [&](wm::communicator& comm) {
    bool const peers = peers_reach_each_other();
    for (char const* how : {"put", "nccl"}) {
      RANK_REQUIRE(::setenv("WM_DISPATCH_ROWS", how, 1) == 0);  // this rank's process only
      auto const want =
          peers && std::string_view{how} == "put" ? wm::row_path::put : wm::row_path::nccl;
      RANK_REQUIRE(path_of_fresh_tensor(comm) == want);  // the cases below run on that path
      try {
        exercise<float, wm::device, wm::distributed, wm::block, std::int64_t>(comm, seed, 140'001,
                                                                              256, 0);
        exercise<float, wm::host, wm::distributed, wm::cyclic, std::int32_t>(comm, seed + 1, 70'003,
                                                                             512, 520);
        std::uint64_t more = seed + 2;
        all_types<wm::device, wm::distributed, wm::block, std::int32_t>(comm, more);
      } catch (std::exception const& e) {
        throw std::runtime_error{std::string{"WM_DISPATCH_ROWS="} + how + ": " + e.what()};
      }
    }
    RANK_REQUIRE(::unsetenv("WM_DISPATCH_ROWS") == 0);
    // Ranks that disagree: put where any rank asks for it (copy, the default, needs every rank).
    RANK_REQUIRE(::setenv("WM_DISPATCH_ROWS", comm.rank() == 0 ? "copy" : "put", 1) == 0);
    RANK_REQUIRE(path_of_fresh_tensor(comm) == (peers ? wm::row_path::put : wm::row_path::nccl));
    RANK_REQUIRE(::unsetenv("WM_DISPATCH_ROWS") == 0);
    // And unset on some ranks, put on one: put.
    if (comm.rank() == 0) { RANK_REQUIRE(::setenv("WM_DISPATCH_ROWS", "put", 1) == 0); }
    RANK_REQUIRE(path_of_fresh_tensor(comm) == (peers ? wm::row_path::put : wm::row_path::nccl));
    RANK_REQUIRE(::unsetenv("WM_DISPATCH_ROWS") == 0);
    bad_path_setting_throws_everywhere(comm, comm.size() - 1);
  });
}

// ---- failures every rank sees, lifetime and ordering (issue 16) ---------------------------------

namespace {

// Writes this rank's rows of @p table (rows of rb bytes, global order) into @p t's local rows.
template <class M, class Tensor>
void fill_local_rows(wm::communicator& comm, Tensor& t, std::vector<std::byte> const& table,
                     std::size_t rb) {
  auto const lv = t.local_view();
  if (lv.rows > 0) {
    auto const first = global_row<M>(t.storage().partition(), comm.size(), comm.rank(), 0);
    std::size_t const src_pitch =
        std::is_same_v<M, wm::block> ? rb : static_cast<std::size_t>(comm.size()) * rb;
    WM_CUDA_TRY(cudaMemcpy2D(lv.data, lv.stride * sizeof(*lv.data), table.data() + first * rb,
                             src_pitch, rb, lv.rows, cudaMemcpyDefault));
  }
  WM_CUDA_TRY(cudaDeviceSynchronize());
  comm.barrier();
}

// A gather of fresh random rows on every rank, checked against @p table.
template <class Tensor>
void gather_checks(Tensor& t, std::vector<std::byte> const& table, std::size_t rb,
                   std::uint64_t seed, std::string const& what) {
  std::mt19937_64 rng{seed};
  std::vector<std::int64_t> batch(5000);
  for (auto& k : batch) { k = static_cast<std::int64_t>(rng() % t.rows()); }
  device_indices<std::int64_t> di{batch};
  device_bytes out{batch.size() * rb};
  t.gather(di.span(), reinterpret_cast<typename Tensor::value_type*>(out.ptr),
           cuda::stream_ref{cudaStream_t{}});
  auto const got    = out.to_host();
  std::size_t wrong = 0;
  for (std::size_t j = 0; j < batch.size(); ++j) {
    wrong += std::memcmp(got.data() + j * rb,
                         table.data() + static_cast<std::size_t>(batch[j]) * rb, rb) != 0;
  }
  RANK_REQUIRE_MSG(wrong == 0, what << ": " << wrong << " of " << batch.size() << " rows differ");
}

using clock_type = std::chrono::steady_clock;

// Runs @p call, which must throw E on this rank within 5 s; returns the message.
template <class E, class F>
std::string throws_soon(F&& call, std::string const& what) {
  auto const start = clock_type::now();
  std::string msg;
  bool threw = false;
  try {
    call();
  } catch (E const& e) {
    threw = true;
    msg   = e.what();
  }
  auto const took = std::chrono::duration<double>(clock_type::now() - start).count();
  RANK_REQUIRE_MSG(threw, what << ": no error");
  RANK_REQUIRE_MSG(took < 5.0, what << ": the error took " << took << " s");
  return msg;
}

// Rank @p bad passes a null pointer with a nonzero count (indices, then rows) to a distributed
// gather and scatter; every rank throws the same logic_error at once, and the next calls work.
template <class M>
void null_pointer_everywhere(wm::communicator& comm, int bad, std::uint64_t seed) {
  std::size_t const rows = 10'007, cols = 16, rb = cols * sizeof(float);
  std::mt19937_64 shared{seed};
  auto const table = random_bytes(shared, rows * rb);
  wm::tensor<float, wm::device, wm::distributed, M> t{comm, rows, cols};
  fill_local_rows<M>(comm, t, table, rb);
  std::vector<std::int64_t> batch(1000);
  for (auto& k : batch) { k = static_cast<std::int64_t>(shared() % rows); }
  device_indices<std::int64_t> di{batch};
  device_bytes out{batch.size() * rb};
  auto* const out_rows = reinterpret_cast<float*>(out.ptr);
  bool const me_bad    = comm.rank() == bad;
  std::string const what =
      std::string{"null pointer on rank "} + std::to_string(bad) + " (" + M::name + ")";
  cuda::stream_ref const s = cudaStream_t{};
  for (int round = 0; round < 3; ++round) {
    std::string const step = what + (round == 0   ? ", indices in gather"
                                     : round == 1 ? ", output of gather"
                                                  : ", scatter");
    auto const msg         = throws_soon<wm::logic_error>(
        [&] {
          if (round == 0) {
            t.gather(me_bad
                                 ? std::span<std::int64_t const>{static_cast<std::int64_t const*>(nullptr),
                                                         batch.size()}
                                 : di.span(),
                     out_rows, s);
          } else if (round == 1) {
            t.gather(di.span(), me_bad ? nullptr : out_rows, s);
          } else {
            // The scatter writes the rows the table already holds (those gathered just before).
            t.scatter(di.span(), me_bad ? nullptr : out_rows, s);
          }
        },
        step);
    RANK_REQUIRE_MSG(msg.find("rank " + std::to_string(bad)) != std::string::npos &&
                         msg.find("null") != std::string::npos,
                     step << ": " << msg);
    gather_checks(t, table, rb, seed + 10 + static_cast<std::uint64_t>(round),
                  step + ", the gather after it");
  }
  comm.barrier();
}

// Ranks that make different calls on one tensor (gather / scatter), or on tensors whose rows or
// indices differ: every rank throws, and the communicator stays usable.
void different_calls_everywhere(wm::communicator& comm, std::uint64_t seed) {
  std::size_t const rows = 4099, rb = 8 * sizeof(float);
  std::mt19937_64 shared{seed};
  auto const table = random_bytes(shared, rows * rb);
  wm::tensor<float, wm::device, wm::distributed> t{comm, rows, 8};
  wm::tensor<float, wm::device, wm::distributed> wide{comm, rows, 12};
  fill_local_rows<wm::block>(comm, t, table, rb);
  std::vector<std::int64_t> batch(700);
  for (auto& k : batch) { k = static_cast<std::int64_t>(shared() % rows); }
  std::vector<std::int32_t> const batch32(batch.begin(), batch.end());
  device_indices<std::int64_t> di{batch};
  device_indices<std::int32_t> di32{batch32};
  device_bytes out{batch.size() * 12 * sizeof(float)};
  auto* const rows_out     = reinterpret_cast<float*>(out.ptr);
  cuda::stream_ref const s = cudaStream_t{};
  bool const first         = comm.rank() == 0;
  // Gather here, scatter there (the scatter writes back rows gathered from the table).
  t.gather(di.span(), rows_out, s);
  auto msg = throws_soon<wm::logic_error>(
      [&] {
        if (first) {
          t.gather(di.span(), rows_out, s);
        } else {
          t.scatter(di.span(), rows_out, s);
        }
      },
      "gather on rank 0, scatter on the others");
  RANK_REQUIRE_MSG(
      msg.find("different calls") != std::string::npos && msg.find("scatter") != std::string::npos,
      msg);
  gather_checks(t, table, rb, seed + 1, "gather after gather/scatter");
  // Rows of 8 floats here, 12 there.
  msg = throws_soon<wm::logic_error>([&] { (first ? t : wide).gather(di.span(), rows_out, s); },
                                     "cols differ");
  RANK_REQUIRE_MSG(msg.find("different calls") != std::string::npos, msg);
  gather_checks(t, table, rb, seed + 2, "gather after cols differ");
  // 64-bit indices here, 32-bit there.
  msg = throws_soon<wm::logic_error>(
      [&] {
        if (first) {
          t.gather(di.span(), rows_out, s);
        } else {
          t.gather(di32.span(), rows_out, s);
        }
      },
      "index types differ");
  RANK_REQUIRE_MSG(msg.find("different calls") != std::string::npos, msg);
  gather_checks(t, table, rb, seed + 3, "gather after index types differ");
  comm.barrier();
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
  device_indices<std::int64_t> di{batch};
  device_indices<std::int32_t> di32{batch32};
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

template <class M>
void zero_rows_all_kinds(wm::communicator& comm) {
  for_every_kind([&]<class L, class Y>() { zero_rows<L, Y, M>(comm); });
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
  device_indices<std::int64_t> di{idx};
  device_bytes dv{values.size()};
  WM_CUDA_TRY(cudaMemcpy(dv.ptr, values.data(), values.size(), cudaMemcpyHostToDevice));
  WM_CUDA_TRY(cudaDeviceSynchronize());  // a pageable copy may return before its DMA ends
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
  device_indices<std::int64_t> di{batch};
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

}  // namespace

// ---- cases run inside every rank (--ranks; tests/support/ranks.hpp) ----------------------------

namespace {

// A seed drawn on rank 0, the same on every rank.
std::uint64_t shared_seed(wm::communicator& comm) {
  return comm.all_gather(static_cast<std::uint64_t>(std::random_device{}()))[0];
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
  device_indices<std::int64_t> di{idx};
  device_bytes dv{values.size()};
  WM_CUDA_TRY(cudaMemcpy(dv.ptr, values.data(), values.size(), cudaMemcpyHostToDevice));
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

}  // namespace

#define WM_EVERY_KIND                                        \
  (std::tuple<wm::device, wm::continuous, wm::block>),       \
      (std::tuple<wm::device, wm::chunked, wm::block>),      \
      (std::tuple<wm::device, wm::distributed, wm::block>),  \
      (std::tuple<wm::host, wm::continuous, wm::block>),     \
      (std::tuple<wm::host, wm::chunked, wm::block>),        \
      (std::tuple<wm::host, wm::distributed, wm::block>),    \
      (std::tuple<wm::device, wm::continuous, wm::cyclic>),  \
      (std::tuple<wm::device, wm::chunked, wm::cyclic>),     \
      (std::tuple<wm::device, wm::distributed, wm::cyclic>), \
      (std::tuple<wm::host, wm::continuous, wm::cyclic>),    \
      (std::tuple<wm::host, wm::chunked, wm::cyclic>),       \
      (std::tuple<wm::host, wm::distributed, wm::cyclic>)

TEST_CASE(
    "ranked: a null pointer in a distributed call makes every rank throw within 5 s; the next call "
    "works",
    "[ranked]") {
  auto& comm               = wm_test::comm();
  std::uint64_t const seed = shared_seed(comm);
  null_pointer_everywhere<wm::block>(comm, 0, seed);
  null_pointer_everywhere<wm::cyclic>(comm, comm.size() - 1, seed + 100);
}

TEST_CASE(
    "ranked: gather on one rank and scatter on another, or other rows or indices, throw on every "
    "rank",
    "[ranked][multi]") {
  auto& comm = wm_test::comm();
  different_calls_everywhere(comm, shared_seed(comm));
}

TEMPLATE_TEST_CASE("ranked: 0-row tensors take 70,000-index gathers and scatters", "[ranked]",
                   WM_EVERY_KIND) {
  using L = std::tuple_element_t<0, TestType>;
  using Y = std::tuple_element_t<1, TestType>;
  using M = std::tuple_element_t<2, TestType>;
  zero_rows<L, Y, M>(wm_test::comm());
}

TEMPLATE_TEST_CASE("ranked: scatter_async on a stream, then store() at once, stores the new rows",
                   "[ranked]", WM_EVERY_KIND) {
  using L                  = std::tuple_element_t<0, TestType>;
  using Y                  = std::tuple_element_t<1, TestType>;
  using M                  = std::tuple_element_t<2, TestType>;
  auto& comm               = wm_test::comm();
  std::uint64_t const seed = shared_seed(comm);
  auto const dir =
      std::filesystem::temp_directory_path() / ("wm_scatter_store_" + std::to_string(seed));
  std::filesystem::create_directories(dir);
  scatter_then_store<L, Y, M>(comm, seed, dir);
  comm.barrier();
  if (comm.rank() == 0) { std::filesystem::remove_all(dir); }
}

TEMPLATE_TEST_CASE("ranked: views of a tensor's columns share its memory", "[ranked]",
                   WM_EVERY_KIND) {
  using L    = std::tuple_element_t<0, TestType>;
  using Y    = std::tuple_element_t<1, TestType>;
  using M    = std::tuple_element_t<2, TestType>;
  auto& comm = wm_test::comm();
  column_views<L, Y, M>(comm, shared_seed(comm));
}

TEMPLATE_TEST_CASE("ranked: move-assignment while gathers run", "[ranked]", WM_EVERY_KIND) {
  using L    = std::tuple_element_t<0, TestType>;
  using Y    = std::tuple_element_t<1, TestType>;
  using M    = std::tuple_element_t<2, TestType>;
  auto& comm = wm_test::comm();
  move_during_async<L, Y, M>(comm, shared_seed(comm));
}
