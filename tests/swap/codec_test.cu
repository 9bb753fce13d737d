// SPDX-License-Identifier: Apache-2.0
// GPU tests of wm::zero_codec (the swap_test program): encode matches the documented layout byte
// for byte and decode restores the bits, for every element width, aligned and not, with device
// and pinned host counts; n = 0 and bad arguments; sizes past 2^32 bytes checked on the GPU.
#include <wm/error.hpp>
#include <wm/zero_codec.cuh>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "skip.hpp"
#include "stream_guard.hpp"

// ---- wm::zero_codec: a bitmask plus the nonzero elements -----------------------------------

static_assert(wm::zero_codec<std::uint16_t>::mask_bytes(0) == 0);
static_assert(wm::zero_codec<std::uint16_t>::mask_bytes(1) == 16);
static_assert(wm::zero_codec<std::uint16_t>::mask_bytes(128) == 16);
static_assert(wm::zero_codec<std::uint16_t>::mask_bytes(129) == 32);
static_assert(wm::zero_codec<std::uint8_t>::mask_bytes(1025) == 144);
static_assert(wm::zero_codec<std::uint16_t>::encoded_bytes(1024, 10) == 128 + 20);
static_assert(wm::zero_codec<std::uint64_t>::max_encoded_bytes(33) == 16 + 33 * 8);
static_assert(wm::zero_codec<std::uint32_t>::encoded_bytes(0, 0) == 0);

namespace {

using wm_test::stream_guard;

// Memory of @p bytes (at least 1) from @p Alloc, given back by @p Free at scope exit.
template <cudaError_t (*Alloc)(void**, std::size_t), cudaError_t (*Free)(void*)>
struct cuda_bytes {
  std::byte* p{nullptr};
  explicit cuda_bytes(std::size_t bytes) {
    WM_CUDA_TRY(Alloc(reinterpret_cast<void**>(&p), std::max<std::size_t>(bytes, 1)));
  }
  cuda_bytes(cuda_bytes const&)            = delete;
  cuda_bytes& operator=(cuda_bytes const&) = delete;
  ~cuda_bytes() { (void)Free(p); }
};

using device_bytes = cuda_bytes<cudaMalloc, cudaFree>;
using pinned_bytes = cuda_bytes<cudaMallocHost, cudaFreeHost>;

constexpr std::uint64_t poison64 = 0xdeadbeefcafef00dull;

// Transcribed from the documented layout: ceil(n/32) little-endian uint32 words (bit j of word w
// set iff element 32w+j is not all zero bits), zero bytes up to a multiple of 16, then the
// nonzero elements in order.
template <class Word>
std::vector<std::byte> reference_encode(std::vector<Word> const& x, std::size_t& nonzeros) {
  std::size_t const n     = x.size();
  std::size_t const words = (n + 31) / 32;
  std::size_t const mask  = (words * 4 + 15) / 16 * 16;
  std::vector<std::uint32_t> bits(words, 0);
  std::vector<Word> values;
  for (std::size_t i = 0; i < n; ++i) {
    if (x[i] != 0) {
      bits[i / 32] |= std::uint32_t{1} << (i % 32);
      values.push_back(x[i]);
    }
  }
  std::vector<std::byte> out(mask + values.size() * sizeof(Word), std::byte{0});
  for (std::size_t w = 0; w < words; ++w) {
    for (std::size_t b = 0; b < 4; ++b) {
      out[4 * w + b] = static_cast<std::byte>((bits[w] >> (8 * b)) & 0xffu);
    }
  }
  for (std::size_t k = 0; k < values.size(); ++k) {  // little-endian elements
    for (std::size_t b = 0; b < sizeof(Word); ++b) {
      out[mask + k * sizeof(Word) + b] =
          static_cast<std::byte>((static_cast<std::uint64_t>(values[k]) >> (8 * b)) & 0xffu);
    }
  }
  nonzeros = values.size();
  return out;
}

// n random elements, a fraction @p zeros of them 0, the others nonzero bit patterns, among them
// -0.0 (the sign bit alone) and NaNs where the width has them.
template <class Word>
std::vector<Word> codec_data(std::size_t n, double zeros, std::mt19937_64& rng) {
  std::bernoulli_distribution is_zero{zeros};
  std::vector<Word> x(n);
  for (auto& v : x) {
    if (is_zero(rng)) {
      v = 0;
    } else {
      do { v = static_cast<Word>(rng()); } while (v == 0);
    }
  }
  std::vector<std::uint64_t> special;
  if constexpr (sizeof(Word) == 1) { special = {0x80, 0x01}; }
  if constexpr (sizeof(Word) == 2) { special = {0x8000, 0x7fc0, 0xffc1, 0x7e00, 0xfe01}; }
  if constexpr (sizeof(Word) == 4) { special = {0x80000000u, 0x7fc00000u, 0xffc00001u}; }
  if constexpr (sizeof(Word) == 8) { special = {0x8000000000000000ull, 0x7ff8000000000000ull}; }
  if (n > 0) {
    std::uniform_int_distribution<std::size_t> at{0, n - 1};
    for (int k = 0; k < 8; ++k) {
      for (auto sp : special) {
        std::size_t const i = at(rng);
        if (x[i] != 0) { x[i] = static_cast<Word>(sp); }
      }
    }
  }
  return x;
}

// Index of the first byte where a and b differ (a.size() when none).
std::size_t first_difference(std::byte const* a, std::byte const* b, std::size_t n) {
  return static_cast<std::size_t>(std::mismatch(a, a + n, b).first - a);
}

// Encode x on the GPU (src at @p offset elements past a 256-byte boundary: offset 1 takes the
// element-wise path), compare with the reference byte for byte, decode into poisoned memory.
template <class Word>
void codec_round_trip(std::vector<Word> const& x, std::size_t offset, bool pinned_count,
                      cudaStream_t s) {
  using codec         = wm::zero_codec<Word>;
  std::size_t const n = x.size();
  INFO("n = " << n << ", offset = " << offset << ", pinned count = " << pinned_count);
  std::size_t nz_ref = 0;
  auto const ref     = reference_encode(x, nz_ref);
  REQUIRE(ref.size() == codec::encoded_bytes(n, nz_ref));
  std::size_t const guard     = 4096;  // elements of poison past dst[n - 1], bytes past dst
  std::size_t const enc_bytes = codec::max_encoded_bytes(n) + guard;
  std::size_t const sb        = codec::scratch_bytes(n);
  device_bytes src{(n + offset) * sizeof(Word)};
  device_bytes enc{enc_bytes};
  device_bytes dst{(n + offset + guard) * sizeof(Word)};
  device_bytes scratch{sb + 8};  // given at an 8-byte offset: any alignment works
  device_bytes nz_dev{8};
  pinned_bytes nz_host{8};
  auto* const src_w = reinterpret_cast<Word*>(src.p) + offset;
  auto* const dst_w = reinterpret_cast<Word*>(dst.p) + offset;
  auto* const nz    = reinterpret_cast<std::uint64_t*>(pinned_count ? nz_host.p : nz_dev.p);
  if (n > 0) {
    WM_CUDA_TRY(cudaMemcpyAsync(src_w, x.data(), n * sizeof(Word), cudaMemcpyHostToDevice, s));
  }
  WM_CUDA_TRY(cudaMemsetAsync(enc.p, 0xFF, enc_bytes, s));
  WM_CUDA_TRY(cudaMemsetAsync(dst.p, 0xFF, (n + offset + guard) * sizeof(Word), s));
  WM_CUDA_TRY(cudaMemcpyAsync(nz_dev.p, &poison64, 8, cudaMemcpyHostToDevice, s));
  WM_CUDA_TRY(cudaStreamSynchronize(s));
  std::memcpy(nz_host.p, &poison64, 8);

  codec::encode(src_w, n, enc.p, nz, scratch.p + 8, sb, s);
  codec::decode(enc.p, n, dst_w, scratch.p + 8, sb, s);

  std::vector<std::byte> enc_h(enc_bytes);
  std::vector<std::byte> dst_h((n + offset + guard) * sizeof(Word));
  std::uint64_t nz_h = 0;
  WM_CUDA_TRY(cudaMemcpyAsync(enc_h.data(), enc.p, enc_bytes, cudaMemcpyDeviceToHost, s));
  WM_CUDA_TRY(cudaMemcpyAsync(dst_h.data(), dst.p, dst_h.size(), cudaMemcpyDeviceToHost, s));
  if (!pinned_count) {
    WM_CUDA_TRY(cudaMemcpyAsync(&nz_h, nz_dev.p, 8, cudaMemcpyDeviceToHost, s));
  }
  WM_CUDA_TRY(cudaStreamSynchronize(s));
  if (pinned_count) { std::memcpy(&nz_h, nz_host.p, 8); }

  CHECK(nz_h == nz_ref);
  CHECK(first_difference(enc_h.data(), ref.data(), ref.size()) == ref.size());
  CHECK(std::all_of(enc_h.begin() + static_cast<std::ptrdiff_t>(ref.size()), enc_h.end(),
                    [](std::byte b) { return b == std::byte{0xFF}; }));  // nothing past it
  std::size_t const lead = offset * sizeof(Word);
  std::size_t const body = n * sizeof(Word);
  CHECK(std::all_of(dst_h.begin(), dst_h.begin() + static_cast<std::ptrdiff_t>(lead),
                    [](std::byte b) { return b == std::byte{0xFF}; }));
  CHECK(first_difference(dst_h.data() + lead, reinterpret_cast<std::byte const*>(x.data()), body) ==
        body);
  CHECK(std::all_of(dst_h.begin() + static_cast<std::ptrdiff_t>(lead + body), dst_h.end(),
                    [](std::byte b) { return b == std::byte{0xFF}; }));
}

}  // namespace

TEMPLATE_TEST_CASE("zero_codec: encode matches the layout byte for byte, decode restores the bits",
                   "[gpu][codec]", std::uint8_t, std::uint16_t, std::uint32_t, std::uint64_t) {
  std::mt19937_64 rng{std::random_device{}()};
  stream_guard st;
  double const zeros       = GENERATE(0.0, 0.5, 0.9, 1.0);
  std::size_t const offset = GENERATE(std::size_t{0}, std::size_t{1});
  INFO("zero fraction = " << zeros);
  std::vector<std::size_t> sizes{0, 1, 31, 32, 33, 1023, 1024, 1025, 4095, 4096, 4097, 8193};
  std::uniform_int_distribution<std::size_t> any{1, 5'000'000};
  for (int k = 0; k < 3; ++k) { sizes.push_back(any(rng)); }
  bool pinned = false;
  for (std::size_t const n : sizes) {
    codec_round_trip(codec_data<TestType>(n, zeros, rng), offset, pinned, st.s);
    pinned = !pinned;  // device and pinned host counts, alternately
  }
}

TEST_CASE("zero_codec: n = 0 writes only the count; bad arguments throw", "[gpu][codec]") {
  using codec = wm::zero_codec<std::uint16_t>;
  stream_guard st;
  cuda::stream_ref const s{st.s};
  std::size_t const n  = 5000;
  std::size_t const sb = codec::scratch_bytes(n);
  CHECK(codec::scratch_bytes(0) == 0);
  CHECK(sb > 0);
  CHECK(sb <= 256 + 2 * 256 + (std::size_t{1} << 20));
  device_bytes src{n * 2 + 16};
  device_bytes enc{codec::max_encoded_bytes(n) + 16};
  device_bytes scratch{sb};
  pinned_bytes nz_host{8};
  auto* const nz  = reinterpret_cast<std::uint64_t*>(nz_host.p);
  auto* const x   = reinterpret_cast<std::uint16_t*>(src.p);
  auto* const out = reinterpret_cast<std::uint16_t*>(src.p);

  std::memcpy(nz_host.p, &poison64, 8);
  codec::encode(nullptr, 0, nullptr, nz, nullptr, 0, s);
  codec::decode(nullptr, 0, nullptr, nullptr, 0, s);
  WM_CUDA_TRY(cudaStreamSynchronize(st.s));
  std::uint64_t nz_h = 1;
  std::memcpy(&nz_h, nz_host.p, 8);
  CHECK(nz_h == 0);

  CHECK_THROWS_AS(codec::encode(nullptr, n, enc.p, nz, scratch.p, sb, s), wm::logic_error);
  CHECK_THROWS_AS(codec::encode(x, n, nullptr, nz, scratch.p, sb, s), wm::logic_error);
  CHECK_THROWS_AS(codec::encode(x, n, enc.p, nullptr, scratch.p, sb, s), wm::logic_error);
  CHECK_THROWS_AS(codec::encode(x, n, enc.p + 8, nz, scratch.p, sb, s), wm::logic_error);
  CHECK_THROWS_AS(codec::encode(reinterpret_cast<std::uint16_t const*>(src.p + 1), n, enc.p, nz,
                                scratch.p, sb, s),
                  wm::logic_error);
  CHECK_THROWS_AS(codec::encode(x, n, enc.p, nz, nullptr, sb, s), wm::logic_error);
  CHECK_THROWS_AS(codec::encode(x, n, enc.p, nz, scratch.p, sb - 1, s), wm::logic_error);
  std::string what;
  try {
    codec::encode(x, n, enc.p, nz, scratch.p, sb - 1, s);
  } catch (wm::logic_error const& e) { what = e.what(); }
  INFO(what);
  CHECK(what.find(std::to_string(sb)) != std::string::npos);  // names the size needed

  CHECK_THROWS_AS(codec::decode(nullptr, n, out, scratch.p, sb, s), wm::logic_error);
  CHECK_THROWS_AS(codec::decode(enc.p, n, nullptr, scratch.p, sb, s), wm::logic_error);
  CHECK_THROWS_AS(codec::decode(enc.p + 8, n, out, scratch.p, sb, s), wm::logic_error);
  CHECK_THROWS_AS(
      codec::decode(enc.p, n, reinterpret_cast<std::uint16_t*>(src.p + 1), scratch.p, sb, s),
      wm::logic_error);
  CHECK_THROWS_AS(codec::decode(enc.p, n, out, scratch.p, sb / 2, s), wm::logic_error);
  WM_CUDA_TRY(cudaStreamSynchronize(st.s));
  std::memcpy(&nz_h, nz_host.p, 8);
  CHECK(nz_h == 0);  // nothing was enqueued by the failed calls
}

namespace {

__host__ __device__ inline std::uint64_t mix64(std::uint64_t z) {
  z ^= z >> 31;
  z *= 0x94d049bb133111ebull;
  z ^= z >> 29;
  z *= 0xbf58476d1ce4e5b9ull;
  return z ^ (z >> 32);
}

// About half zeros, the other half random nonzero patterns.
template <class Word>
__global__ void codec_fill_kernel(Word* p, std::size_t n, std::uint64_t seed) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    std::uint64_t const h = mix64(i * 0x9E3779B97F4A7C15ull + seed);
    Word v                = static_cast<Word>(h >> 8);
    if (v == 0) { v = static_cast<Word>(0x80); }
    p[i] = (h & 1) != 0 ? v : Word{0};
  }
}

template <class Word>
__global__ void codec_count_kernel(Word const* p, std::size_t n, unsigned long long* count) {
  unsigned long long c = 0;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    c += p[i] != 0 ? 1 : 0;
  }
  atomicAdd(count, c);
}

template <class Word>
__global__ void codec_mismatch_kernel(Word const* a, Word const* b, std::size_t n,
                                      unsigned long long* bad) {
  unsigned long long c = 0;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    c += a[i] != b[i] ? 1 : 0;
  }
  atomicAdd(bad, c);
}

// n elements, half zeros: nonzeros against an independent count, decode == src, both on the
// GPU; the poison past dst[n - 1] stays. Prints the encode and decode times of a second run.
template <class Word>
void codec_large(std::size_t n) {
  using codec = wm::zero_codec<Word>;
  INFO("sizeof(Word) = " << sizeof(Word) << ", n = " << n);
  std::size_t const guard  = 4096;
  std::size_t const sb     = codec::scratch_bytes(n);
  std::size_t const needed = n * sizeof(Word) * 2 + guard + codec::max_encoded_bytes(n) + sb;
  std::size_t free_b = 0, total_b = 0;
  WM_CUDA_TRY(cudaMemGetInfo(&free_b, &total_b));
  if (free_b < needed + (std::size_t{1} << 29)) {
    // Reported as skipped (exit 77), never as passed.
    return wm_test::skip("zero_codec n = " + std::to_string(n) + ": needs " +
                         std::to_string(needed) + " bytes of GPU memory and 512 MiB more, " +
                         std::to_string(free_b) + " free");
  }
  CHECK(sb <= n / 256 + (std::size_t{64} << 20));  // small: per-tile numbers + CUB's room
  stream_guard st;
  cudaStream_t const s = st.s;
  std::mt19937_64 rng{std::random_device{}()};
  device_bytes src{n * sizeof(Word)};
  device_bytes enc{codec::max_encoded_bytes(n)};
  device_bytes dst{n * sizeof(Word) + guard};
  device_bytes scratch{sb};
  device_bytes counters{3 * 8};  // nonzeros (codec), nonzeros (count kernel), mismatches
  auto* const cnt  = reinterpret_cast<unsigned long long*>(counters.p);
  auto* const nz   = reinterpret_cast<std::uint64_t*>(counters.p);
  auto* const x    = reinterpret_cast<Word*>(src.p);
  auto* const y    = reinterpret_cast<Word*>(dst.p);
  int const blocks = 2048;
  codec_fill_kernel<Word><<<blocks, 256, 0, s>>>(x, n, rng());
  WM_CHECK_LAUNCH();
  WM_CUDA_TRY(cudaMemsetAsync(counters.p, 0, 3 * 8, s));
  WM_CUDA_TRY(cudaMemsetAsync(dst.p, 0xFF, n * sizeof(Word) + guard, s));
  codec_count_kernel<Word><<<blocks, 256, 0, s>>>(x, n, cnt + 1);
  WM_CHECK_LAUNCH();

  codec::encode(x, n, enc.p, nz, scratch.p, sb, s);
  codec::decode(enc.p, n, y, scratch.p, sb, s);
  codec_mismatch_kernel<Word><<<blocks, 256, 0, s>>>(x, y, n, cnt + 2);
  WM_CHECK_LAUNCH();
  std::vector<unsigned long long> h(3);
  std::vector<std::byte> tail(guard);
  WM_CUDA_TRY(cudaMemcpyAsync(h.data(), counters.p, 3 * 8, cudaMemcpyDeviceToHost, s));
  WM_CUDA_TRY(
      cudaMemcpyAsync(tail.data(), dst.p + n * sizeof(Word), guard, cudaMemcpyDeviceToHost, s));
  WM_CUDA_TRY(cudaStreamSynchronize(s));
  CHECK(h[1] > n / 2 - n / 100);
  CHECK(h[1] < n / 2 + n / 100);
  CHECK(h[0] == h[1]);
  CHECK(h[2] == 0);
  CHECK(std::all_of(tail.begin(), tail.end(), [](std::byte b) { return b == std::byte{0xFF}; }));

  // Timing of a second run (information for bench/NOTES.md, not a check).
  cudaEvent_t ev[3];
  for (auto& e : ev) { WM_CUDA_TRY(cudaEventCreate(&e)); }
  WM_CUDA_TRY(cudaEventRecord(ev[0], s));
  codec::encode(x, n, enc.p, nz, scratch.p, sb, s);
  WM_CUDA_TRY(cudaEventRecord(ev[1], s));
  codec::decode(enc.p, n, y, scratch.p, sb, s);
  WM_CUDA_TRY(cudaEventRecord(ev[2], s));
  WM_CUDA_TRY(cudaEventSynchronize(ev[2]));
  float enc_ms = 0, dec_ms = 0;
  WM_CUDA_TRY(cudaEventElapsedTime(&enc_ms, ev[0], ev[1]));
  WM_CUDA_TRY(cudaEventElapsedTime(&dec_ms, ev[1], ev[2]));
  for (auto e : ev) { WM_CUDA_TRY(cudaEventDestroy(e)); }
  double const gb = static_cast<double>(n * sizeof(Word)) / 1e9;
  std::printf(
      "zero_codec<uint%zu> n=%zu (half zeros): encode %.2f ms (%.0f GB/s of input), "
      "decode %.2f ms (%.0f GB/s of output)\n",
      sizeof(Word) * 8, n, static_cast<double>(enc_ms), gb / enc_ms * 1e3,
      static_cast<double>(dec_ms), gb / dec_ms * 1e3);
}

}  // namespace

TEST_CASE("zero_codec: 2^32 + 4133 bytes and 2^31 + 77 halves, checked on the GPU",
          "[gpu][codec][large]") {
  SECTION("uint8, n = 2^32 + 4133") {
    codec_large<std::uint8_t>((std::size_t{1} << 32) + 4133);
  }
  SECTION("uint16, n = 2^31 + 77") {
    codec_large<std::uint16_t>((std::size_t{1} << 31) + 77);
  }
  SECTION("uint16, n = 2^27 (256 MiB)") {
    codec_large<std::uint16_t>(std::size_t{1} << 27);
  }
}
