// SPDX-License-Identifier: Apache-2.0
// 64-bit sizes on one GPU: tables past 2^31 and 2^32 rows, files past 4 GiB, an embedding whose
// local rows fill 32-bit keys. Every byte row holds a hash of its row number, so a row read
// from the wrong place (an offset cut to 32 bits) shows. Needs ~21 GiB of GPU memory, ~7 GiB of
// host memory and 4 GiB in the temporary directory (removed at the end).
#include <wm/embedding.cuh>
#include <wm/launch.hpp>

#include <cub/device/device_for.cuh>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <unistd.h>
#include <unordered_map>
#include <vector>

#include "catch.hpp"
#include "device_array.cuh"
#include "rank_check.hpp"

namespace {

constexpr std::size_t two31 = std::size_t{1} << 31;
constexpr std::size_t two32 = std::size_t{1} << 32;

/// The byte every row starts with (splitmix64's finalizer, low byte).
__host__ __device__ inline std::uint8_t row_hash(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return static_cast<std::uint8_t>(x ^ (x >> 31));
}

struct fill_rows {
  wm::matrix_view<std::uint8_t> v;
  __device__ void operator()(std::uint64_t i) const { v(i, 0) = row_hash(i); }
};

using wm_test::device_array;

/// Fills a tensor's rows with their hash (all rows are this rank's: one rank).
template <class Tensor>
void fill_with_hash(Tensor& t, cudaStream_t s) {
  auto const v = t.local_view();
  RANK_REQUIRE(v.rows == t.rows());
  WM_CUDA_TRY(cub::DeviceFor::Bulk(static_cast<std::uint64_t>(v.rows), fill_rows{v}, s));
  WM_CUDA_TRY(cudaStreamSynchronize(s));
}

/// The rows a test reads: the edges around 2^31 and 2^32 below @p rows, then @p random keys.
std::vector<std::int64_t> keys_for(std::size_t rows, std::size_t random, std::mt19937_64& rng) {
  std::vector<std::int64_t> k;
  for (std::size_t r :
       {std::size_t{0}, two31 - 1, two31, two31 + 1, two32 - 1, two32, two32 + 1, rows - 1}) {
    if (r < rows) { k.push_back(static_cast<std::int64_t>(r)); }
  }
  for (std::size_t i = 0; i < random; ++i) { k.push_back(static_cast<std::int64_t>(rng() % rows)); }
  return k;
}

/// Gathers @p keys from @p t twice (outputs poisoned with 0x00, then 0xff) and checks each
/// byte against @p want(row).
template <class Tensor, class Index, class Want>
void check_gather(Tensor& t, std::vector<Index> const& keys, Want&& want, cudaStream_t s,
                  std::string const& what) {
  device_array<Index> dk{keys};
  device_array<std::uint8_t> out{keys.size()};
  for (int poison : {0x00, 0xff}) {
    WM_CUDA_TRY(cudaMemset(out.ptr, poison, keys.size()));
    t.gather(std::span<Index const>{dk.ptr, keys.size()}, out.ptr, cuda::stream_ref{s});
    auto const got = out.to_host();
    for (std::size_t i = 0; i < keys.size(); ++i) {
      auto const row = static_cast<std::uint64_t>(keys[i]);
      RANK_REQUIRE_MSG(got[i] == want(row), what << ": row " << row << " read " << int{got[i]}
                                                 << ", " << int{want(row)} << " expected (poison "
                                                 << poison << ")");
    }
  }
}

/// Removes a directory however the test ends.
struct scoped_dir {
  std::filesystem::path path;
  explicit scoped_dir(std::string const& name)
      : path{std::filesystem::temp_directory_path() /
             (name + "-" + std::to_string(std::random_device{}()))} {
    std::filesystem::create_directories(path);
  }
  ~scoped_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  scoped_dir(scoped_dir const&) = delete;
};

}  // namespace

TEST_CASE("a device table of 2^32 + 4,097 byte rows: gather, scatter above 2^32, a 4 GiB file",
          "[gpu]") {
  std::uint64_t const seed = std::random_device{}();
  wm::launch(1, [&](wm::communicator& comm) {
    std::size_t const rows = two32 + 4097;
    cudaStream_t s{};
    WM_CUDA_TRY(cudaStreamCreate(&s));
    std::mt19937_64 rng{seed};
    scoped_dir const dir{"wm-large"};
    std::vector<std::filesystem::path> files;
    std::unordered_map<std::uint64_t, std::uint8_t> written;  // rows scattered, last value
    auto want = [&](std::uint64_t row) {
      auto const it = written.find(row);
      return it != written.end() ? it->second : row_hash(row);
    };
    {
      wm::tensor<std::uint8_t, wm::device, wm::continuous> t{comm, rows, 1};
      fill_with_hash(t, s);
      check_gather(t, keys_for(rows, 100'000, rng), want, s, "device.continuous gather");

      // Scatter with duplicates above 2^32: the last occurrence wins. A short batch, then one
      // of 100,000 keys in the top 4,097 rows (the sorted path).
      std::vector<std::int64_t> keys{
          static_cast<std::int64_t>(two32 + 5), static_cast<std::int64_t>(two32 + 7),
          static_cast<std::int64_t>(two32 + 5), static_cast<std::int64_t>(two32 + 5),
          static_cast<std::int64_t>(rows - 1),  static_cast<std::int64_t>(two32 + 7)};
      std::vector<std::uint8_t> values{1, 2, 3, 4, 5, 6};
      for (std::size_t i = 0; i < keys.size(); ++i) {
        written[static_cast<std::uint64_t>(keys[i])] = values[i];
      }
      {
        device_array<std::int64_t> dk{keys};
        device_array<std::uint8_t> dv{values};
        t.scatter(std::span<std::int64_t const>{dk.ptr, keys.size()}, dv.ptr, cuda::stream_ref{s});
      }
      RANK_REQUIRE(want(two32 + 5) == 4 && want(two32 + 7) == 6 && want(rows - 1) == 5);
      std::vector<std::int64_t> many(100'000);
      std::vector<std::uint8_t> many_values(many.size());
      for (std::size_t i = 0; i < many.size(); ++i) {
        many[i]        = static_cast<std::int64_t>(two32 + rng() % 4097);
        many_values[i] = static_cast<std::uint8_t>(rng());
        written[static_cast<std::uint64_t>(many[i])] = many_values[i];
      }
      {
        device_array<std::int64_t> dk{many};
        device_array<std::uint8_t> dv{many_values};
        t.scatter(std::span<std::int64_t const>{dk.ptr, many.size()}, dv.ptr, cuda::stream_ref{s});
      }
      std::vector<std::int64_t> top;
      for (std::size_t r = two32 - 64; r < rows; ++r) {
        top.push_back(static_cast<std::int64_t>(r));
      }
      check_gather(t, top, want, s, "after the scatters, rows 2^32 - 64 .. rows - 1");
      check_gather(t, keys_for(rows, 100'000, rng), want, s, "after the scatters");

      // The 4 GiB table to a file: bytes past 4 GiB land at their offsets.
      files = t.store(dir.path / "table");
    }
    RANK_REQUIRE(files.size() == 1);
    RANK_REQUIRE_MSG(std::filesystem::file_size(files[0]) == rows,
                     "file size " << std::filesystem::file_size(files[0]));
    {
      int const fd = ::open(files[0].c_str(), O_RDONLY | O_CLOEXEC);
      RANK_REQUIRE(fd >= 0);
      for (std::uint64_t row :
           {std::uint64_t{0}, std::uint64_t{two31 + 1}, std::uint64_t{two32 - 1},
            std::uint64_t{two32}, std::uint64_t{two32 + 5}, std::uint64_t{two32 + 7},
            std::uint64_t{rows - 1}}) {
        std::uint8_t b     = 0;
        bool const read_ok = ::pread(fd, &b, 1, static_cast<off_t>(row)) == 1;
        if (!read_ok || b != want(row)) { ::close(fd); }
        RANK_REQUIRE_MSG(read_ok && b == want(row), "file byte " << row << " is " << int{b} << ", "
                                                                 << int{want(row)} << " expected");
      }
      ::close(fd);
    }
    // ... and back into a host table of another layout.
    {
      wm::tensor<std::uint8_t, wm::host, wm::distributed> h{comm, rows, 1};
      h.load(std::span<std::filesystem::path const>{files});
      check_gather(h, keys_for(rows, 100'000, rng), want, s, "host.distributed after load");
      std::vector<std::int64_t> top;
      for (std::size_t r = two32 - 64; r < rows; ++r) {
        top.push_back(static_cast<std::int64_t>(r));
      }
      check_gather(h, top, want, s, "host.distributed after load, the top rows");
    }
    // ... and into a mapped host table: its long gathers read each distinct row once, with 64-bit
    // keys and positions (2^32 - 1 rows or more do not fit the 32-bit plan); hot rows above 2^32
    // make long runs.
    {
      wm::tensor<std::uint8_t, wm::host, wm::continuous> h{comm, rows, 1};
      h.load(std::span<std::filesystem::path const>{files});
      check_gather(h, keys_for(rows, 100'000, rng), want, s, "host.continuous after load");
      std::vector<std::int64_t> hot;
      for (int i = 0; i < 20'000; ++i) {
        hot.push_back(static_cast<std::int64_t>(i % 3 == 0 ? rng() % rows : two32 + rng() % 8));
      }
      check_gather(h, hot, want, s, "host.continuous, hot rows above 2^32");
    }
    WM_CUDA_TRY(cudaStreamDestroy(s));
  });
}

TEST_CASE("a host chunked table of 2^31 + 4,097 byte rows: 64- and 32-bit keys, the sorted path",
          "[gpu]") {
  std::uint64_t const seed = std::random_device{}();
  wm::launch(1, [&](wm::communicator& comm) {
    std::size_t const rows = two31 + 4097;
    cudaStream_t s{};
    WM_CUDA_TRY(cudaStreamCreate(&s));
    std::mt19937_64 rng{seed};
    wm::tensor<std::uint8_t, wm::host, wm::chunked> t{comm, rows, 1};
    fill_with_hash(t, s);
    auto const want = [](std::uint64_t row) { return row_hash(row); };
    check_gather(t, keys_for(rows, 100'000, rng), want, s, "host.chunked, 64-bit keys");
    // 32-bit keys up to the largest one, 2^31 - 1.
    std::vector<std::int32_t> k32{0, static_cast<std::int32_t>(two31 - 1),
                                  static_cast<std::int32_t>(two31 - 2)};
    for (int i = 0; i < 100'000; ++i) { k32.push_back(static_cast<std::int32_t>(rng() % two31)); }
    check_gather(t, k32, want, s, "host.chunked, 32-bit keys");
    WM_CUDA_TRY(cudaStreamDestroy(s));
  });
}

TEST_CASE("an embedding of 2^32 - 1 rows x 1: a row near the top hit 301 times; 2^32 rows refused",
          "[gpu]") {
  wm::launch(1, [&](wm::communicator& comm) {
    cudaStream_t s{};
    WM_CUDA_TRY(cudaStreamCreate(&s));
    {
      // The constructor's documented limit: more than 2^32 - 1 rows on one rank is refused
      // before anything is allocated.
      bool refused = false;
      try {
        wm::embedding<float, wm::no_cache, wm::sgd> e{comm, two32, 1};
      } catch (wm::logic_error const&) { refused = true; }
      RANK_REQUIRE_MSG(refused,
                       "an embedding of 2^32 rows on one rank was not refused with a logic_error");
    }
    std::size_t const rows = two32 - 1;
    wm::embedding<float, wm::no_cache, wm::sgd> e{comm, rows, 1, wm::sgd{},
                                                  wm::embedding_init::uniform(-0.5f, 0.5f, 7)};
    std::vector<std::int64_t> const watched{
        static_cast<std::int64_t>(rows - 1), static_cast<std::int64_t>(rows - 2),
        static_cast<std::int64_t>(rows - 3), static_cast<std::int64_t>(two32 - (1u << 20)),
        static_cast<std::int64_t>(two31),    0};
    auto read = [&] {
      device_array<std::int64_t> dk{watched};
      device_array<float> out{std::vector<float>(watched.size(), -1000.0f)};  // poisoned
      e.gather(std::span<std::int64_t const>{dk.ptr, watched.size()}, out.ptr, cuda::stream_ref{s});
      return out.to_host();
    };
    auto const before = read();
    for (std::size_t i = 0; i < watched.size(); ++i) {
      auto const init = wm::embedding_init::uniform(-0.5f, 0.5f, 7)
                            .value(static_cast<std::size_t>(watched[i]), 0, 1);
      RANK_REQUIRE_MSG(std::abs(before[i] - init) <= 1e-6f, "row " << watched[i] << " starts at "
                                                                   << before[i] << ", " << init
                                                                   << " expected");
    }
    // rows - 1 hit 301 times (a long run, summed in segments), rows - 2 once, 2^31 twice, 0 once;
    // rows - 3 and 2^32 - 2^20 not at all. Gradients are multiples of 1/8: every sum is exact.
    std::vector<std::int64_t> keys;
    std::vector<float> grads;
    std::mt19937_64 rng{std::random_device{}()};
    std::unordered_map<std::int64_t, double> sums;
    auto add = [&](std::int64_t k, int times, bool any_sign) {
      for (int i = 0; i < times; ++i) {
        float const g =
            static_cast<float>(1 + rng() % 15) / 8.0f * (any_sign && rng() % 2 == 0 ? -1.0f : 1.0f);
        keys.push_back(k);
        grads.push_back(g);
        sums[k] += g;
      }
    };
    add(watched[0], 301, false);  // a sum between 37.6 and 564: the row moves by 0.04 .. 0.56
    add(watched[1], 1, true);
    add(watched[4], 2, true);
    add(watched[5], 1, true);
    std::vector<std::size_t> order(keys.size());
    for (std::size_t i = 0; i < order.size(); ++i) { order[i] = i; }
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<std::int64_t> k2(keys.size());
    std::vector<float> g2(keys.size());
    for (std::size_t i = 0; i < order.size(); ++i) {
      k2[i] = keys[order[i]];
      g2[i] = grads[order[i]];
    }
    float const lr = 0.001f;
    {
      device_array<std::int64_t> dk{k2};
      device_array<float> dg{g2};
      e.apply_gradients(std::span<std::int64_t const>{dk.ptr, k2.size()}, dg.ptr, lr,
                        cuda::stream_ref{s});
    }
    RANK_REQUIRE(e.global_step() == 1);
    auto const after = read();
    for (std::size_t i = 0; i < watched.size(); ++i) {
      double const want =
          static_cast<double>(before[i]) - static_cast<double>(lr) * sums[watched[i]];
      RANK_REQUIRE_MSG(std::abs(after[i] - want) <= 2e-7,
                       "row " << watched[i] << " is " << after[i] << " after the update, " << want
                              << " expected (gradient sum " << sums[watched[i]] << ")");
    }
    RANK_REQUIRE(after[2] == before[2] && after[3] == before[3]);
    WM_CUDA_TRY(cudaStreamDestroy(s));
  });
}
