// SPDX-License-Identifier: Apache-2.0
// Host-only layout of wm::zero_optimizer (docs/design.md, "ZeRO memory"): the one contiguous arena
// of compute weights (and gradients), its buckets in backward order, each rank's equal shard of
// each bucket and the parameter fragments a shard holds; and the memory formula of that section.
// Compiles with a plain C++20 compiler; tests/zero/plan_test.cpp checks it on the CPU.
//
// Layout rules (Megatron's distributed optimizer is the anchor):
// - Parameters are placed from the last to the first (the order backward produces gradients),
//   each starting at a multiple of `alignment` bytes. A bucket holds parameters of one element
//   type; it closes when the next parameter would end past `bucket_bytes` or has another type.
// - A parameter never spans buckets: a bucket's gradients are complete when its parameters'
//   backward is done, and a stage-3 gather hands out whole parameters. A parameter larger than
//   `bucket_bytes` gets a bucket of its own, so a bucket holds at most max(bucket_bytes, largest
//   aligned parameter) bytes before padding.
// - Each bucket is padded to a multiple of world × alignment bytes and split into `world` equal
//   shards, rank r owning elements [r·S, (r+1)·S): gradients take a true reduce-scatter and
//   weights an in-place all-gather on equal, aligned shards. Padding (between parameters and at
//   the end) belongs to no parameter; a rank's shard may hold only padding (it owns nothing).
// - Parameters with no elements take no space and belong to no bucket.
// - Every rank keeps its fp32 state (master weights, m, v) as one buffer: its shards of all
//   buckets in bucket order; bucket b's shard starts at `buckets[b].state_offset` (the same on
//   every rank, since shards are equal).
#pragma once

#include <wm/error.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace wm::detail::zero {

/// Element type of a parameter's compute weights and gradients.
enum class element_type : std::uint8_t { f32, bf16, f16 };

/// Bytes per element of @p t.
[[nodiscard]] constexpr std::size_t size_of(element_type t) noexcept {
  return t == element_type::f32 ? 4 : 2;
}

[[nodiscard]] constexpr std::size_t ceil_to(std::size_t x, std::size_t m) noexcept {
  return (x + m - 1) / m * m;
}

/// One parameter as the model declares it (forward order).
struct param_spec {
  std::string name;                       ///< unique name (checkpoints match by it)
  std::size_t elements{};                 ///< number of elements (product of the shape)
  element_type type{element_type::bf16};  ///< compute weight / gradient type
};

/// Marks a parameter that lies in no bucket (it has no elements).
inline constexpr std::size_t no_bucket = std::numeric_limits<std::size_t>::max();

/// Where one parameter lives.
struct param_place {
  std::size_t bucket{no_bucket};  ///< bucket index, or `no_bucket` for an empty parameter
  std::size_t offset{};           ///< first element, counted from the bucket's start
};

/// One bucket of the arena.
struct bucket_layout {
  element_type type{};              ///< element type of every parameter in it
  std::size_t byte_offset{};        ///< start in the arena (a multiple of the alignment)
  std::size_t elements{};           ///< padded element count: world × shard_elements
  std::size_t used_elements{};      ///< end of its last parameter (before the tail padding)
  std::size_t shard_elements{};     ///< elements of each rank's shard (a multiple of the alignment)
  std::size_t state_offset{};       ///< where each rank's shard starts in its fp32 state buffer
  std::vector<std::size_t> params;  ///< parameter indices in arena order (descending index)

  /// Bytes the bucket takes in the arena.
  [[nodiscard]] std::size_t bytes() const noexcept { return elements * size_of(type); }
};

/// A piece of one parameter inside one rank's shard of one bucket.
struct fragment {
  std::size_t bucket{};        ///< bucket index
  std::size_t param{};         ///< parameter index (forward order)
  std::size_t param_offset{};  ///< first element, counted from the parameter's start
  std::size_t elements{};      ///< length (> 0)
  std::size_t shard_offset{};  ///< first element, counted from the start of the rank's shard
  std::size_t state_offset{};  ///< first element in the rank's fp32 state buffer
};

/// The layout every rank computes identically from the same inputs.
struct plan {
  int world{1};                        ///< ranks sharing the buckets
  std::size_t alignment{};             ///< bytes; shard and parameter starts are multiples
  std::size_t bucket_bytes{};          ///< requested bucket size
  std::vector<param_spec> params;      ///< as given (forward order)
  std::vector<param_place> places;     ///< one per parameter
  std::vector<bucket_layout> buckets;  ///< backward order: bucket 0 holds the last parameters
  std::size_t arena_bytes{};           ///< sum of the buckets' bytes
  std::size_t state_elements{};        ///< each rank's fp32 state buffer length (sum of shards)

  /// Byte offset of parameter @p p in the arena (meaningless for an empty parameter).
  [[nodiscard]] std::size_t byte_offset(std::size_t p) const {
    auto const& pl = places.at(p);
    if (pl.bucket == no_bucket) { return 0; }
    auto const& b = buckets[pl.bucket];
    return b.byte_offset + pl.offset * size_of(b.type);
  }

  /// Largest bucket in bytes (the size of a staging buffer that fits any bucket).
  [[nodiscard]] std::size_t max_bucket_bytes() const noexcept {
    std::size_t m = 0;
    for (auto const& b : buckets) { m = std::max(m, b.bytes()); }
    return m;
  }

  /**
   * @brief The parameter fragments of rank @p rank's shard of bucket @p b, in shard order.
   * Empty when the shard holds only padding.
   */
  [[nodiscard]] std::vector<fragment> fragments(std::size_t b, int rank) const {
    WM_EXPECTS(b < buckets.size(), "a bucket index below the plan's bucket count");
    WM_EXPECTS(rank >= 0 && rank < world, "a rank in [0, world)");
    auto const& bk          = buckets[b];
    std::size_t const first = static_cast<std::size_t>(rank) * bk.shard_elements;
    std::size_t const last  = first + bk.shard_elements;
    // Parameters are in ascending offset order: the first one ending past `first`.
    auto it = std::partition_point(bk.params.begin(), bk.params.end(), [&](std::size_t p) {
      return places[p].offset + params[p].elements <= first;
    });
    std::vector<fragment> out;
    for (; it != bk.params.end() && places[*it].offset < last; ++it) {
      std::size_t const p   = *it;
      std::size_t const lo  = std::max(first, places[p].offset);
      std::size_t const hi  = std::min(last, places[p].offset + params[p].elements);
      std::size_t const off = lo - first;
      out.push_back({b, p, lo - places[p].offset, hi - lo, off, bk.state_offset + off});
    }
    return out;
  }

  /// Every fragment rank @p rank holds, bucket after bucket (ascending state offset).
  [[nodiscard]] std::vector<fragment> fragments(int rank) const {
    std::vector<fragment> out;
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      auto f = fragments(b, rank);
      out.insert(out.end(), f.begin(), f.end());
    }
    return out;
  }
};

/**
 * @brief Lays out @p params (forward order) in buckets of about @p bucket_bytes for @p world
 * ranks, shards and parameter starts aligned to @p alignment bytes (the rules at the top).
 * @throw wm::logic_error world < 1, alignment not a power of two or not a multiple of 4,
 * bucket_bytes 0, duplicate or empty names.
 */
[[nodiscard]] inline plan make_plan(std::span<param_spec const> params, std::size_t bucket_bytes,
                                    int world, std::size_t alignment = 128) {
  WM_EXPECTS(world >= 1, "a world of at least one rank");
  WM_EXPECTS(alignment >= 4 && (alignment & (alignment - 1)) == 0,
             "an alignment that is a power of two of at least 4 bytes");
  WM_EXPECTS(bucket_bytes > 0, "a bucket size above 0 bytes");
  {
    std::vector<std::string_view> names;
    for (auto const& p : params) {
      WM_EXPECTS(!p.name.empty(), "every parameter named (checkpoints match by name)");
      names.emplace_back(p.name);
    }
    std::sort(names.begin(), names.end());
    WM_EXPECTS(std::adjacent_find(names.begin(), names.end()) == names.end(),
               "unique parameter names (checkpoints match by name)");
  }
  plan pl;
  pl.world        = world;
  pl.alignment    = alignment;
  pl.bucket_bytes = bucket_bytes;
  pl.params.assign(params.begin(), params.end());
  pl.places.resize(params.size());

  auto const w   = static_cast<std::size_t>(world);
  auto close_one = [&] {
    auto& b                   = pl.buckets.back();
    std::size_t const align_e = alignment / size_of(b.type);
    b.elements                = ceil_to(b.used_elements, w * align_e);
    b.shard_elements          = b.elements / w;
    b.byte_offset             = pl.arena_bytes;
    b.state_offset            = pl.state_elements;
    pl.arena_bytes += b.bytes();
    pl.state_elements += b.shard_elements;
  };
  bool open = false;
  for (std::size_t i = params.size(); i-- > 0;) {
    auto const& p = params[i];
    if (p.elements == 0) { continue; }
    std::size_t const es      = size_of(p.type);
    std::size_t const align_e = alignment / es;
    if (open) {
      auto const& b           = pl.buckets.back();
      std::size_t const start = ceil_to(b.used_elements, align_e);
      if (b.type != p.type || (start + p.elements) * es > bucket_bytes) {
        close_one();
        open = false;
      }
    }
    if (!open) {
      pl.buckets.push_back({});
      pl.buckets.back().type = p.type;
      open                   = true;
    }
    auto& b                 = pl.buckets.back();
    std::size_t const start = ceil_to(b.used_elements, align_e);
    pl.places[i]            = {pl.buckets.size() - 1, start};
    b.used_elements         = start + p.elements;
    b.params.push_back(i);
  }
  if (open) { close_one(); }
  return pl;
}

/// Device and host bytes per rank that the memory formula gives (docs/design.md, "ZeRO memory").
struct memory_estimate {
  double device_bytes{};  ///< weights + gradients + states kept on each GPU
  double host_bytes{};    ///< fp32 states (and the gradient shard) kept on the host (offload)
};

/**
 * @brief The memory formula of docs/design.md, "ZeRO memory" (the ZeRO paper's), for @p params
 * parameters over @p world ranks: stage 0 (plain data parallel) (w+g+K)Ψ, stage 1 (w+g)Ψ + KΨ/N,
 * stage 2 wΨ + (g+K)Ψ/N, stage 3 (w+g+K)Ψ/N, with w = @p weight_bytes, g = @p grad_bytes and K =
 * @p state_bytes per parameter (2, 2 and 12 for bf16 weights and fp32 Adam). With @p offload
 * the KΨ/N term moves to the host, which also holds a gradient shard gΨ/N (the CPU update's
 * input). Communication buffers (the two buckets in flight) are not included.
 */
[[nodiscard]] constexpr memory_estimate zero_memory_estimate(int stage, double params, int world,
                                                             bool offload        = false,
                                                             double weight_bytes = 2,
                                                             double grad_bytes   = 2,
                                                             double state_bytes  = 12) {
  WM_EXPECTS(stage >= 0 && stage <= 3, "a ZeRO stage in 0..3 (0: plain data parallel)");
  WM_EXPECTS(world >= 1, "a world of at least one rank");
  double const n      = world;
  double const shards = stage >= 1 ? n : 1.0;  // states are sharded from stage 1 on
  double const w      = weight_bytes * params / (stage >= 3 ? n : 1.0);
  double const g      = grad_bytes * params / (stage >= 2 ? n : 1.0);
  double const k      = state_bytes * params / shards;
  if (!offload) { return {w + g + k, 0.0}; }
  return {w + g, k + grad_bytes * params / shards};
}

/// The formula for a parameter list: Ψ is its element count, w = g its bytes per element.
[[nodiscard]] inline memory_estimate zero_memory_estimate(int stage,
                                                          std::span<param_spec const> params,
                                                          int world, bool offload = false,
                                                          double state_bytes = 12) {
  double n = 0, bytes = 0;
  for (auto const& p : params) {
    n += static_cast<double>(p.elements);
    bytes += static_cast<double>(p.elements * size_of(p.type));
  }
  double const per = n > 0 ? bytes / n : 2.0;
  return zero_memory_estimate(stage, n, world, offload, per, per, state_bytes);
}

}  // namespace wm::detail::zero
