// SPDX-License-Identifier: Apache-2.0
// The host side of embedding checkpoints (used by detail/embedding/checkpoint.cuh): the `.meta`
// text, its checks against a table, and the sizes every part file must have. Plain C++20, so
// that tests/embedding/checkpoint_test.cpp runs it on the CPU.
#pragma once

#include <wm/error.hpp>
#include <wm/partition.hpp>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <span>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

namespace wm::detail {

/**
 * What a checkpoint holds and what gives it meaning. `<prefix>.meta` is this as text, one
 * `key value` per line after the `wm-embedding <version>` line; `optimizer_tag` is the rest of
 * its line (the optimizer's `checkpoint_tag()`, possibly empty).
 */
struct checkpoint_meta {
  static constexpr int version = 2;
  std::size_t rows{};
  std::size_t dim{};
  int world{};  // ranks that wrote it: the part files are per rank of this count
  std::int64_t global_step{};
  std::string dtype;  // weights' element type, e.g. float32
  std::size_t dtype_bytes{};
  std::string optimizer;      // the optimizer's name
  std::string optimizer_tag;  // its checkpoint_tag()
  int states{};  // float state slots per weight (states files hold states × dim per row)
  bool steps{};  // a per-row step count (int64) was stored

  [[nodiscard]] std::size_t weight_row_bytes() const noexcept { return dim * dtype_bytes; }
  [[nodiscard]] std::size_t state_row_bytes() const noexcept {
    return static_cast<std::size_t>(states) * dim * sizeof(float);
  }
};

/// The `.meta` text of @p m.
[[nodiscard]] inline std::string format_meta(checkpoint_meta const& m) {
  std::ostringstream out;
  out << "wm-embedding " << checkpoint_meta::version << "\nrows " << m.rows << "\ndim " << m.dim
      << "\nworld " << m.world << "\nglobal_step " << m.global_step << "\ndtype " << m.dtype << " "
      << m.dtype_bytes << "\noptimizer " << m.optimizer << "\noptimizer_tag " << m.optimizer_tag
      << "\nstates " << m.states << "\nsteps " << (m.steps ? 1 : 0) << "\n";
  return out.str();
}

/**
 * Parses `.meta` text; @p where names the file in messages.
 * @throw wm::io_error if it is not a version-2 wm checkpoint or a field is missing or malformed
 */
[[nodiscard]] inline checkpoint_meta parse_meta(std::string const& text, std::string const& where) {
  auto bad = [&](std::string const& why) {
    return io_error{"'" + where + "' is not a wm embedding checkpoint of version " +
                    std::to_string(checkpoint_meta::version) + ": " + why};
  };
  std::istringstream in{text};
  std::string magic;
  int version = 0;
  if (!(in >> magic >> version) || magic != "wm-embedding") {
    throw bad("no 'wm-embedding' header");
  }
  if (version != checkpoint_meta::version) {
    throw bad("it is version " + std::to_string(version) +
              (version == 1 ? " (written before the meta recorded the optimizer's settings)" : ""));
  }
  std::map<std::string, std::string> fields;
  std::string line;
  std::getline(in, line);  // the rest of the header line
  while (std::getline(in, line)) {
    if (line.empty()) { continue; }
    auto const space = line.find(' ');
    auto const key   = line.substr(0, space);
    if (fields.contains(key)) { throw bad("'" + key + "' appears twice"); }
    fields[key] = space == std::string::npos ? std::string{} : line.substr(space + 1);
  }
  auto field = [&](char const* key) -> std::string const& {
    auto const it = fields.find(key);
    if (it == fields.end()) { throw bad(std::string{"no '"} + key + "' line"); }
    return it->second;
  };
  auto number = [&](char const* key, auto& to) {
    std::istringstream v{field(key)};
    std::string rest;
    if (!(v >> to) || (v >> rest)) { throw bad(std::string{"'"} + key + "' is not a number"); }
  };
  checkpoint_meta m;
  number("rows", m.rows);
  number("dim", m.dim);
  number("world", m.world);
  number("global_step", m.global_step);
  {
    std::istringstream v{field("dtype")};
    std::string rest;
    if (!(v >> m.dtype >> m.dtype_bytes) || (v >> rest)) {
      throw bad("'dtype' is not '<name> <bytes>'");
    }
  }
  m.optimizer = field("optimizer");
  if (m.optimizer.empty()) { throw bad("no optimizer name"); }
  m.optimizer_tag = field("optimizer_tag");
  number("states", m.states);
  int steps = 0;
  number("steps", steps);
  if (m.world < 1 || m.world > (1 << 20) || m.states < 0 || m.global_step < 0 ||
      m.dtype_bytes == 0 || (steps != 0 && steps != 1)) {
    throw bad("a field is out of range");
  }
  m.steps = steps == 1;
  return m;
}

/**
 * Checks that the checkpoint @p found loads into a table described by @p table (everything but
 * `world` and `global_step` must agree); @p where names the checkpoint in messages.
 * @throw wm::io_error naming every difference
 */
inline void check_meta_fits(checkpoint_meta const& found, checkpoint_meta const& table,
                            std::string const& where) {
  std::string diff;
  auto differs = [&](char const* what, auto const& in_file, auto const& in_table) {
    if (in_file == in_table) { return; }
    std::ostringstream o;
    o << (diff.empty() ? "" : "; ") << what << " is '" << in_file << "' there, '" << in_table
      << "' here";
    diff += o.str();
  };
  differs("rows", found.rows, table.rows);
  differs("dim", found.dim, table.dim);
  differs("dtype", found.dtype, table.dtype);
  differs("dtype bytes", found.dtype_bytes, table.dtype_bytes);
  differs("optimizer", found.optimizer, table.optimizer);
  differs("optimizer settings", found.optimizer_tag, table.optimizer_tag);
  differs("optimizer states", found.states, table.states);
  differs("per-row steps", found.steps, table.steps);
  if (!diff.empty()) {
    throw io_error{"checkpoint '" + where + "' does not fit this table: " + diff};
  }
}

/// The size of each of the @p world part files of @p rows rows of @p row_bytes (rank r stores
/// rows [begin(r), end(r)) of the block plan, as `tensor::store` does).
[[nodiscard]] inline std::vector<std::uint64_t> part_sizes(std::size_t rows, int world,
                                                           std::size_t row_bytes) {
  block_partition const plan{rows, world};
  std::vector<std::uint64_t> sizes;
  for (int r = 0; r < world; ++r) { sizes.push_back((plan.end(r) - plan.begin(r)) * row_bytes); }
  return sizes;
}

/// Checks that each of @p files is a regular file of exactly @p sizes[i] bytes.
/// @throw wm::io_error naming the first file that is missing or has another size
inline void check_part_files(std::span<std::filesystem::path const> files,
                             std::span<std::uint64_t const> sizes) {
  WM_EXPECTS(files.size() == sizes.size(), "one size per file");
  for (std::size_t f = 0; f < files.size(); ++f) {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(files[f], ec)) {
      throw io_error{"checkpoint file '" + files[f].string() + "' is missing" +
                     (ec ? " (" + ec.message() + ")" : "")};
    }
    auto const size = std::filesystem::file_size(files[f], ec);
    if (ec) {
      throw io_error{"cannot read the size of '" + files[f].string() + "': " + ec.message()};
    }
    if (size != sizes[f]) {
      throw io_error{"checkpoint file '" + files[f].string() + "' has " + std::to_string(size) +
                     " bytes; " + std::to_string(sizes[f]) + " expected"};
    }
  }
}

/// The whole text of @p file. @throw wm::io_error if it cannot be read
[[nodiscard]] inline std::string read_text_file(std::filesystem::path const& file) {
  std::ifstream in{file, std::ios::binary};
  if (!in) { throw io_error{"cannot read '" + file.string() + "'"}; }
  std::ostringstream s;
  s << in.rdbuf();
  if (in.bad()) { throw io_error{"reading '" + file.string() + "' failed"}; }
  return s.str();
}

/// @p file's name with `.tmp` appended: where `store` writes before it renames.
[[nodiscard]] inline std::filesystem::path temporary_name(std::filesystem::path const& file) {
  return std::filesystem::path{file.string() + ".tmp"};
}

}  // namespace wm::detail
