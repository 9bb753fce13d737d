// SPDX-License-Identifier: Apache-2.0
// Kernels and launches of wm::zero_codec. One warp per tile of 4096 elements (128 mask words);
// each lane moves V consecutive elements per step (one 16-byte access where the elements' pointer
// is 16-byte aligned, else V = 1). Encode: mask_kernel (mask words + one count per tile), an
// exclusive scan of the counts, scatter_kernel (each tile's nonzeros, compacted through shared
// memory, stored from the tile's offset on), total_kernel (*nonzeros). Decode: count_kernel (the
// counts from the mask), the same scan, expand_kernel.
#pragma once

#include <wm/detail/base/cuda.cuh>
#include <wm/error.hpp>

#include <cub/device/device_scan.cuh>
#include <cuda/cmath>
#include <cuda/stream_ref>

#include <cuda_runtime_api.h>

#include <climits>
#include <cstddef>
#include <cstdint>
#include <string>

namespace wm::detail::codec {

inline constexpr int block_threads    = 256;  ///< 8 warps, one tile each
inline constexpr int warps_per_block  = block_threads / 32;
inline constexpr std::size_t tile     = 4096;  ///< elements per tile
inline constexpr unsigned tile_words  = 128;   ///< mask words per tile (4 per lane)
inline constexpr unsigned full_warp   = 0xffffffffu;
inline constexpr std::size_t align_to = 256;  ///< alignment of the scratch regions

[[nodiscard]] constexpr std::size_t mask_words(std::size_t n) noexcept {
  return n / 32 + (n % 32 != 0 ? 1 : 0);
}
[[nodiscard]] constexpr std::size_t tiles_of(std::size_t n) noexcept {
  return n / tile + (n % tile != 0 ? 1 : 0);
}
[[nodiscard]] constexpr std::size_t round_up(std::size_t b) noexcept {
  return (b + align_to - 1) / align_to * align_to;
}

[[nodiscard]] __device__ inline unsigned warp_sum(unsigned v) {
  for (int o = 16; o > 0; o /= 2) { v += __shfl_xor_sync(full_warp, v, o); }
  return v;
}

[[nodiscard]] __device__ inline unsigned warp_exclusive_sum(unsigned v, unsigned lane) {
  unsigned inc = v;
  for (unsigned o = 1; o < 32; o *= 2) {
    unsigned const y = __shfl_up_sync(full_warp, inc, o);
    if (lane >= o) { inc += y; }
  }
  return inc - v;
}

/// e = p[base, base + V), one vector access when all V are below n, else element by element
/// (elements at or past n read as 0).
template <class Word, int V>
__device__ inline void load_elements(Word const* __restrict__ p, std::size_t base, std::size_t n,
                                     Word (&e)[V]) {
  if (base + V <= n) {
    auto const v = *reinterpret_cast<vec_of<Word, V> const*>(p + base);
#pragma unroll
    for (int j = 0; j < V; ++j) { e[j] = v.v[j]; }
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) { e[j] = base + j < n ? p[base + j] : Word{0}; }
  }
}

/// p[base, base + V) = e, one vector access when all V are below n, else only those below n.
template <class Word, int V>
__device__ inline void store_elements(Word* __restrict__ p, std::size_t base, std::size_t n,
                                      Word const (&e)[V]) {
  if (base + V <= n) {
    vec_of<Word, V> v;
#pragma unroll
    for (int j = 0; j < V; ++j) { v.v[j] = e[j]; }
    *reinterpret_cast<vec_of<Word, V>*>(p + base) = v;
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (base + j < n) { p[base + j] = e[j]; }
    }
  }
}

/// v[i] = in[from + lane + 32 i] for the i with lane + 32 i < @p count (0 for the others).
template <class Word, int V>
__device__ inline void load_chunk_values(Word const* __restrict__ in, unsigned from, unsigned count,
                                         unsigned lane, Word (&v)[V]) {
#pragma unroll
  for (int i = 0; i < V; ++i) {
    unsigned const k = lane + 32u * static_cast<unsigned>(i);
    v[i]             = k < count ? in[from + k] : Word{0};
  }
}

/**
 * Tile @p t's mask words into @p words_s (words at or past @p words_total read as 0) and, for
 * each word, the set bits of the tile's words before it into @p before_s. Returns the tile's set
 * bits (in every lane).
 */
__device__ inline unsigned load_tile_mask(std::uint32_t const* __restrict__ mask, std::size_t t,
                                          std::size_t words_total, unsigned lane,
                                          std::uint32_t* words_s, std::uint32_t* before_s) {
  std::size_t const first = t * tile_words + 4 * lane;
  uint4 q{0, 0, 0, 0};
  if (first < words_total) {
    q = *reinterpret_cast<uint4 const*>(mask + first);
    if (first + 1 >= words_total) { q.y = 0; }
    if (first + 2 >= words_total) { q.z = 0; }
    if (first + 3 >= words_total) { q.w = 0; }
  }
  unsigned const c0 = __popc(q.x), c1 = __popc(q.y), c2 = __popc(q.z), c3 = __popc(q.w);
  unsigned const mine                           = c0 + c1 + c2 + c3;
  unsigned const before                         = warp_exclusive_sum(mine, lane);
  *reinterpret_cast<uint4*>(words_s + 4 * lane) = q;
  before_s[4 * lane]                            = before;
  before_s[4 * lane + 1]                        = before + c0;
  before_s[4 * lane + 2]                        = before + c0 + c1;
  before_s[4 * lane + 3]                        = before + c0 + c1 + c2;
  __syncwarp();
  return __shfl_sync(full_warp, before + mine, 31);
}

/// Pass 1 of encode: tile t's 128 mask words (to @p mask, within mask_bytes) and its count.
template <class Word, int V>
__global__ void __launch_bounds__(block_threads)
    mask_kernel(Word const* __restrict__ src, std::size_t n, std::uint32_t* __restrict__ mask,
                std::uint64_t* __restrict__ counts, std::size_t tiles) {
  __shared__ __align__(16) std::uint32_t words_s[warps_per_block][tile_words];
  unsigned const lane = threadIdx.x % 32;
  unsigned const warp = threadIdx.x / 32;
  std::size_t const t = blockIdx.x * std::size_t{warps_per_block} + warp;
  if (t >= tiles) { return; }  // the whole warp
  std::uint32_t* const w_s = words_s[warp];
  std::size_t const first  = t * tile;
  constexpr int group      = 32 / V;  // lanes whose elements make one mask word
  constexpr int chunks     = static_cast<int>(tile) / (32 * V);
#pragma unroll 4
  for (int c = 0; c < chunks; ++c) {
    Word e[V];
    load_elements<Word, V>(src, first + static_cast<std::size_t>(c) * 32 * V + lane * V, n, e);
    std::uint32_t bits = 0;
#pragma unroll
    for (int j = 0; j < V; ++j) { bits |= (e[j] != Word{0} ? 1u : 0u) << j; }
    if constexpr (V == 1) {
      std::uint32_t const word = __ballot_sync(full_warp, bits != 0);
      if (lane == 0) { w_s[c] = word; }
    } else {
      std::uint32_t word = bits << (lane * V % 32);
#pragma unroll
      for (int o = 1; o < group; o *= 2) { word |= __shfl_xor_sync(full_warp, word, o); }
      if (lane % group == 0) { w_s[c * V + lane / group] = word; }
    }
  }
  __syncwarp();
  uint4 const q = *reinterpret_cast<uint4 const*>(w_s + 4 * lane);
  // Words past the last one are zeros inside the mask's 16-byte padding.
  if (t * tile_words + 4 * lane < mask_words(n)) {
    *reinterpret_cast<uint4*>(mask + t * tile_words + 4 * lane) = q;
  }
  unsigned const count = warp_sum(__popc(q.x) + __popc(q.y) + __popc(q.z) + __popc(q.w));
  if (lane == 0) { counts[t] = count; }
}

/// A warp's tile in scatter_kernel and expand_kernel: its index, lane, mask words and the set
/// bits before each word (shared memory), its set bits, and a staging row of 32 V elements.
template <class Word, int V>
struct warp_tile {
  std::size_t t;
  unsigned lane;
  std::uint32_t* words;
  std::uint32_t* before;
  Word* stage;
  unsigned total;
};

/// Opens the calling warp's tile into @p w (its mask from @p mask); false past the last tile.
template <class Word, int V>
__device__ inline bool open_tile(std::uint32_t const* __restrict__ mask, std::size_t n,
                                 std::size_t tiles, warp_tile<Word, V>& w) {
  __shared__ __align__(16) std::uint32_t words_s[warps_per_block][tile_words];
  __shared__ std::uint32_t before_s[warps_per_block][tile_words];
  __shared__ Word stage_s[warps_per_block][32 * V];
  unsigned const lane = threadIdx.x % 32;
  unsigned const warp = threadIdx.x / 32;
  std::size_t const t = blockIdx.x * std::size_t{warps_per_block} + warp;
  if (t >= tiles) { return false; }
  w = {t,
       lane,
       words_s[warp],
       before_s[warp],
       stage_s[warp],
       load_tile_mask(mask, t, mask_words(n), lane, words_s[warp], before_s[warp])};
  return true;
}

/// Pass 2 of encode: tile t's nonzeros, in order, to values[offsets[t], ...).
template <class Word, int V>
__global__ void __launch_bounds__(block_threads)
    scatter_kernel(Word const* __restrict__ src, std::size_t n,
                   std::uint32_t const* __restrict__ mask, Word* __restrict__ values,
                   std::uint64_t const* __restrict__ offsets, std::size_t tiles) {
  warp_tile<Word, V> tile_of_warp;
  if (!open_tile(mask, n, tiles, tile_of_warp)) { return; }
  auto const [t, lane, w_s, b_s, stage, total] = tile_of_warp;
  Word* const out                              = values + offsets[t];
  std::size_t const first                      = t * tile;
  constexpr int group                          = 32 / V;
  constexpr int chunks                         = static_cast<int>(tile) / (32 * V);
  unsigned const shift                         = lane * V % 32;
  std::size_t const lane_first                 = first + lane * V;
  Word e[V];
  load_elements<Word, V>(src, lane_first, n, e);
  for (int c = 0; c < chunks; ++c) {
    Word next[V]{};  // the next chunk's elements, in flight while this one is compacted
    if (c + 1 < chunks) {
      load_elements<Word, V>(src, lane_first + static_cast<std::size_t>(c + 1) * 32 * V, n, next);
    }
    unsigned const w           = static_cast<unsigned>(c) * V + lane / group;
    std::uint32_t const word   = w_s[w];
    unsigned const chunk_first = b_s[c * V];
    unsigned const chunk_end   = c + 1 < chunks ? b_s[(c + 1) * V] : total;
    unsigned rank              = b_s[w] - chunk_first + __popc(word & ((1u << shift) - 1));
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (((word >> (shift + j)) & 1u) != 0) { stage[rank++] = e[j]; }
    }
    __syncwarp();
    for (unsigned k = lane; k < chunk_end - chunk_first; k += 32) {
      out[chunk_first + k] = stage[k];
    }
    __syncwarp();
#pragma unroll
    for (int j = 0; j < V; ++j) { e[j] = next[j]; }
  }
}

/// Decode's counts: set bits of each tile's mask words.
template <class Word>
__global__ void __launch_bounds__(block_threads)
    count_kernel(std::uint32_t const* __restrict__ mask, std::size_t words_total,
                 std::uint64_t* __restrict__ counts, std::size_t tiles) {
  unsigned const lane = threadIdx.x % 32;
  std::size_t const t = blockIdx.x * std::size_t{warps_per_block} + threadIdx.x / 32;
  if (t >= tiles) { return; }
  std::size_t const first = t * tile_words + 4 * lane;
  unsigned c              = 0;
  if (first < words_total) {
    uint4 const q = *reinterpret_cast<uint4 const*>(mask + first);
    c             = __popc(q.x) + (first + 1 < words_total ? __popc(q.y) : 0) +
        (first + 2 < words_total ? __popc(q.z) : 0) + (first + 3 < words_total ? __popc(q.w) : 0);
  }
  c = warp_sum(c);
  if (lane == 0) { counts[t] = c; }
}

/// Decode: tile t's elements from its mask and values[offsets[t], ...).
template <class Word, int V>
__global__ void __launch_bounds__(block_threads)
    expand_kernel(std::uint32_t const* __restrict__ mask, Word const* __restrict__ values,
                  std::uint64_t const* __restrict__ offsets, std::size_t n, Word* __restrict__ dst,
                  std::size_t tiles) {
  warp_tile<Word, V> tile_of_warp;
  if (!open_tile(mask, n, tiles, tile_of_warp)) { return; }
  auto const [t, lane, w_s, b_s, stage, total] = tile_of_warp;
  Word const* const in                         = values + offsets[t];
  std::size_t const first                      = t * tile;
  constexpr int group                          = 32 / V;
  constexpr int chunks                         = static_cast<int>(tile) / (32 * V);
  unsigned const shift                         = lane * V % 32;
  unsigned chunk_first                         = 0;  // b_s[0]
  unsigned chunk_end                           = chunks > 1 ? b_s[V] : total;
  Word v[V];  // this lane's values of the chunk: stage[lane + 32 i]
  load_chunk_values<Word, V>(in, chunk_first, chunk_end - chunk_first, lane, v);
  for (int c = 0; c < chunks; ++c) {
    unsigned const next_first = chunk_end;
    unsigned const next_end   = c + 2 < chunks ? b_s[(c + 2) * V] : total;
    Word next[V]{};  // the next chunk's values, in flight while this one is expanded
    if (c + 1 < chunks) {
      load_chunk_values<Word, V>(in, next_first, next_end - next_first, lane, next);
    }
#pragma unroll
    for (int i = 0; i < V; ++i) {
      unsigned const k = lane + 32u * static_cast<unsigned>(i);
      if (k < chunk_end - chunk_first) { stage[k] = v[i]; }
    }
    __syncwarp();
    unsigned const w         = static_cast<unsigned>(c) * V + lane / group;
    std::uint32_t const word = w_s[w];
    unsigned rank            = b_s[w] - chunk_first + __popc(word & ((1u << shift) - 1));
    Word e[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      e[j] = ((word >> (shift + j)) & 1u) != 0 ? stage[rank++] : Word{0};
    }
    store_elements<Word, V>(dst, first + static_cast<std::size_t>(c) * 32 * V + lane * V, n, e);
    __syncwarp();
#pragma unroll
    for (int i = 0; i < V; ++i) { v[i] = next[i]; }
    chunk_first = next_first;
    chunk_end   = next_end;
  }
}

/// *out = offsets[tiles - 1] + counts[tiles - 1] (0 without tiles): the number of nonzeros.
template <class Word>
__global__ void total_kernel(std::uint64_t const* offsets, std::uint64_t const* counts,
                             std::size_t tiles, std::uint64_t* out) {
  *out = tiles == 0 ? 0 : offsets[tiles - 1] + counts[tiles - 1];
}

/// Bytes of cub::DeviceScan::ExclusiveSum's temporary storage for @p tiles 64-bit counts.
[[nodiscard]] inline std::size_t scan_temp_bytes(std::size_t tiles) {
  std::size_t bytes = 0;
  WM_CUDA_TRY(
      cub::DeviceScan::ExclusiveSum(nullptr, bytes, static_cast<std::uint64_t const*>(nullptr),
                                    static_cast<std::uint64_t*>(nullptr), static_cast<int>(tiles)));
  return bytes;
}

/// The scratch regions: counts and offsets (one per tile), then the scan's temporary storage.
struct scratch_regions {
  std::uint64_t* counts;
  std::uint64_t* offsets;
  void* temp;
  std::size_t temp_bytes;
};

[[nodiscard]] inline std::size_t scratch_size(std::size_t n) {
  if (n == 0) { return 0; }
  std::size_t const tiles = tiles_of(n);
  WM_EXPECTS(tiles <= static_cast<std::size_t>(INT_MAX),
             "zero_codec: at most 2^31 - 1 tiles of 4096 elements (n = " + std::to_string(n) + ")");
  return align_to + 2 * round_up(tiles * sizeof(std::uint64_t)) + scan_temp_bytes(tiles);
}

[[nodiscard]] inline scratch_regions carve_scratch(void* scratch, std::size_t bytes,
                                                   std::size_t n) {
  std::size_t const needed = scratch_size(n);
  WM_EXPECTS(scratch != nullptr && bytes >= needed,
             "zero_codec: the scratch must have at least scratch_bytes(n) = " +
                 std::to_string(needed) + " bytes (got " + std::to_string(bytes) +
                 (scratch == nullptr ? " at a null pointer" : "") + ")");
  std::size_t const tiles = tiles_of(n);
  auto const addr         = reinterpret_cast<std::uintptr_t>(scratch);
  std::size_t const skip  = (align_to - addr % align_to) % align_to;
  auto* const base        = static_cast<std::byte*>(scratch) + skip;
  std::size_t const part  = round_up(tiles * sizeof(std::uint64_t));
  return {reinterpret_cast<std::uint64_t*>(base), reinterpret_cast<std::uint64_t*>(base + part),
          base + 2 * part, bytes - skip - 2 * part};
}

[[nodiscard]] inline unsigned blocks_for(std::size_t tiles) {
  return static_cast<unsigned>(cuda::ceil_div(tiles, std::size_t{warps_per_block}));
}

/// Calls f.template operator()<V>() with V = 16 / sizeof(Word) when @p p is 16-byte aligned, else
/// with V = 1.
template <class Word, class F>
void with_elements_per_lane(void const* p, F&& f) {
  if (reinterpret_cast<std::uintptr_t>(p) % 16 == 0) {
    f.template operator()<static_cast<int>(16 / sizeof(Word))>();
  } else {
    f.template operator()<1>();
  }
}

}  // namespace wm::detail::codec

namespace wm {

template <codec_word Word>
std::size_t zero_codec<Word>::scratch_bytes(std::size_t n) {
  return detail::codec::scratch_size(n);
}

template <codec_word Word>
void zero_codec<Word>::encode(Word const* src, std::size_t n, std::byte* dst,
                              std::uint64_t* nonzeros, void* scratch, std::size_t scratch_bytes,
                              cuda::stream_ref stream) {
  namespace c = detail::codec;
  WM_EXPECTS(nonzeros != nullptr, "zero_codec::encode: nonzeros must not be null");
  WM_EXPECTS(reinterpret_cast<std::uintptr_t>(nonzeros) % alignof(std::uint64_t) == 0,
             "zero_codec::encode: nonzeros must be 8-byte aligned");
  cudaStream_t const s = stream.get();
  if (n == 0) {
    c::total_kernel<Word><<<1, 1, 0, s>>>(nullptr, nullptr, 0, nonzeros);
    WM_CHECK_LAUNCH();
    return;
  }
  WM_EXPECTS(src != nullptr && dst != nullptr,
             "zero_codec::encode: src and dst must not be null when n > 0");
  WM_EXPECTS(reinterpret_cast<std::uintptr_t>(src) % alignof(Word) == 0,
             "zero_codec::encode: src must be aligned to sizeof(Word) = " +
                 std::to_string(sizeof(Word)) + " bytes");
  WM_EXPECTS(reinterpret_cast<std::uintptr_t>(dst) % 16 == 0,
             "zero_codec::encode: dst must be 16-byte aligned");
  c::scratch_regions const r = c::carve_scratch(scratch, scratch_bytes, n);
  std::size_t const tiles    = c::tiles_of(n);
  auto* const mask           = reinterpret_cast<std::uint32_t*>(dst);
  auto* const values         = reinterpret_cast<Word*>(dst + mask_bytes(n));
  unsigned const blocks      = c::blocks_for(tiles);
  c::with_elements_per_lane<Word>(src, [&]<int V>() {
    c::mask_kernel<Word, V><<<blocks, c::block_threads, 0, s>>>(src, n, mask, r.counts, tiles);
    WM_CHECK_LAUNCH();
    std::size_t temp_bytes = r.temp_bytes;
    WM_CUDA_TRY(cub::DeviceScan::ExclusiveSum(r.temp, temp_bytes, r.counts, r.offsets,
                                              static_cast<int>(tiles), s));
    c::scatter_kernel<Word, V>
        <<<blocks, c::block_threads, 0, s>>>(src, n, mask, values, r.offsets, tiles);
    WM_CHECK_LAUNCH();
  });
  c::total_kernel<Word><<<1, 1, 0, s>>>(r.offsets, r.counts, tiles, nonzeros);
  WM_CHECK_LAUNCH();
}

template <codec_word Word>
void zero_codec<Word>::decode(std::byte const* src, std::size_t n, Word* dst, void* scratch,
                              std::size_t scratch_bytes, cuda::stream_ref stream) {
  namespace c = detail::codec;
  if (n == 0) { return; }
  WM_EXPECTS(src != nullptr && dst != nullptr,
             "zero_codec::decode: src and dst must not be null when n > 0");
  WM_EXPECTS(reinterpret_cast<std::uintptr_t>(src) % 16 == 0,
             "zero_codec::decode: src must be 16-byte aligned");
  WM_EXPECTS(reinterpret_cast<std::uintptr_t>(dst) % alignof(Word) == 0,
             "zero_codec::decode: dst must be aligned to sizeof(Word) = " +
                 std::to_string(sizeof(Word)) + " bytes");
  c::scratch_regions const r = c::carve_scratch(scratch, scratch_bytes, n);
  cudaStream_t const s       = stream.get();
  std::size_t const tiles    = c::tiles_of(n);
  auto const* const mask     = reinterpret_cast<std::uint32_t const*>(src);
  auto const* const values   = reinterpret_cast<Word const*>(src + mask_bytes(n));
  unsigned const blocks      = c::blocks_for(tiles);
  c::count_kernel<Word>
      <<<blocks, c::block_threads, 0, s>>>(mask, c::mask_words(n), r.counts, tiles);
  WM_CHECK_LAUNCH();
  std::size_t temp_bytes = r.temp_bytes;
  WM_CUDA_TRY(cub::DeviceScan::ExclusiveSum(r.temp, temp_bytes, r.counts, r.offsets,
                                            static_cast<int>(tiles), s));
  c::with_elements_per_lane<Word>(dst, [&]<int V>() {
    c::expand_kernel<Word, V>
        <<<blocks, c::block_threads, 0, s>>>(mask, values, r.offsets, n, dst, tiles);
    WM_CHECK_LAUNCH();
  });
}

}  // namespace wm
