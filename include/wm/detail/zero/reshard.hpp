// SPDX-License-Identifier: Apache-2.0
// Host-only checkpoint resharding of wm::zero_optimizer (docs/design.md, "ZeRO memory"): each rank
// stores its fp32 state buffer as it is (the shards of every bucket, padding included) with a
// fragment table naming what each range holds; loading into any rank count, bucket size or
// stage is a range intersection of the stored tables with the new plan's fragments. The state
// layout does not depend on the stage, so one function serves all of them. Offsets and lengths
// are in elements; a caller reading several streams (master weights, m, v) of one file applies
// the same reads to each with its element size. Tested in tests/zero/reshard_test.cpp.
#pragma once

#include <wm/detail/zero/plan.hpp>
#include <wm/error.hpp>

#include <algorithm>
#include <cstddef>
#include <map>
#include <span>
#include <string>
#include <vector>

namespace wm::detail::zero {

/// One stored range: elements [param_offset, +elements) of a parameter, at file_offset.
struct stored_fragment {
  std::string name;              ///< parameter name
  std::size_t param_elements{};  ///< the parameter's whole size (a shape check on load)
  std::size_t param_offset{};    ///< first element, counted from the parameter's start
  std::size_t elements{};        ///< length (> 0)
  std::size_t file_offset{};     ///< first element in the stored shard file
};

/// A stored shard's table, in file order.
using fragment_table = std::vector<stored_fragment>;

/// The table of rank @p rank's state buffer of plan @p p, stored as it is (file offset = state
/// offset).
[[nodiscard]] inline fragment_table fragment_table_of(plan const& p, int rank) {
  fragment_table t;
  for (auto const& f : p.fragments(rank)) {
    t.push_back({p.params[f.param].name, p.params[f.param].elements, f.param_offset, f.elements,
                 f.state_offset});
  }
  return t;
}

/// One read: @p elements from stored file @p file at @p file_offset to @p dest_offset of the
/// loading rank's state buffer.
struct shard_read {
  std::size_t file{};         ///< index of the stored shard (its old rank)
  std::size_t file_offset{};  ///< first element in that file
  std::size_t elements{};     ///< length (> 0)
  std::size_t dest_offset{};  ///< first element in the new state buffer

  friend bool operator==(shard_read const&, shard_read const&) = default;
};

/**
 * @brief The reads that fill rank @p rank's state buffer of plan @p target from the stored
 * shards @p stored (one table per file): every element of every parameter fragment the rank
 * holds, in ascending destination order, adjacent reads merged. Padding is not read (the
 * caller zeroes the buffer first). Parameters present in the checkpoint but not in the plan are
 * left out.
 * @throw wm::io_error a parameter of the plan is missing from the checkpoint, has another size
 * there, or some of its elements are stored in no file or in two.
 */
[[nodiscard]] inline std::vector<shard_read> plan_shard_reads(
    std::span<fragment_table const> stored, plan const& target, int rank) {
  struct piece {
    std::size_t param_offset, elements, file, file_offset;
  };
  struct stored_param {
    std::size_t elements;
    std::vector<piece> pieces;
  };
  std::map<std::string, stored_param, std::less<>> index;
  for (std::size_t file = 0; file < stored.size(); ++file) {
    for (auto const& s : stored[file]) {
      auto [it, fresh] = index.try_emplace(s.name, stored_param{s.param_elements, {}});
      if (it->second.elements != s.param_elements ||
          s.param_offset + s.elements > s.param_elements) {
        throw wm::io_error{"wm: checkpoint fragment tables disagree on the size of parameter '" +
                           s.name + "'"};
      }
      if (s.elements > 0) {
        it->second.pieces.push_back({s.param_offset, s.elements, file, s.file_offset});
      }
    }
  }
  for (auto& [name, sp] : index) {
    std::sort(sp.pieces.begin(), sp.pieces.end(),
              [](piece const& a, piece const& b) { return a.param_offset < b.param_offset; });
    for (std::size_t i = 1; i < sp.pieces.size(); ++i) {
      auto const& prev = sp.pieces[i - 1];
      if (prev.param_offset + prev.elements > sp.pieces[i].param_offset) {
        throw wm::io_error{"wm: checkpoint stores elements of parameter '" + name +
                           "' in two fragments (overlap at element " +
                           std::to_string(sp.pieces[i].param_offset) + ")"};
      }
    }
  }

  std::vector<shard_read> reads;
  auto emit = [&](shard_read r) {
    if (!reads.empty()) {
      auto& l = reads.back();
      if (l.file == r.file && l.file_offset + l.elements == r.file_offset &&
          l.dest_offset + l.elements == r.dest_offset) {
        l.elements += r.elements;
        return;
      }
    }
    reads.push_back(r);
  };
  for (auto const& f : target.fragments(rank)) {
    auto const& spec = target.params[f.param];
    auto const it    = index.find(spec.name);
    if (it == index.end()) {
      throw wm::io_error{"wm: the checkpoint has no parameter '" + spec.name + "'"};
    }
    if (it->second.elements != spec.elements) {
      throw wm::io_error{"wm: parameter '" + spec.name + "' has " +
                         std::to_string(it->second.elements) + " elements in the checkpoint, " +
                         std::to_string(spec.elements) + " in the model"};
    }
    auto const& pieces    = it->second.pieces;
    std::size_t at        = f.param_offset;  // next element to find
    std::size_t const end = f.param_offset + f.elements;
    // The last piece starting at or before `at`.
    auto p = std::upper_bound(pieces.begin(), pieces.end(), at,
                              [](std::size_t x, piece const& q) { return x < q.param_offset; });
    if (p != pieces.begin()) { --p; }
    for (; at < end && p != pieces.end(); ++p) {
      if (p->param_offset + p->elements <= at) { continue; }
      if (p->param_offset > at) { break; }  // a gap
      std::size_t const hi = std::min(end, p->param_offset + p->elements);
      emit({p->file, p->file_offset + (at - p->param_offset), hi - at,
            f.state_offset + (at - f.param_offset)});
      at = hi;
    }
    if (at < end) {
      throw wm::io_error{"wm: the checkpoint lacks element " + std::to_string(at) +
                         " of parameter '" + spec.name + "'"};
    }
  }
  return reads;
}

}  // namespace wm::detail::zero
