// SPDX-License-Identifier: Apache-2.0
// Host-only checkpoint files of wm::zero_optimizer (docs/design.md, "ZeRO memory"): one file per
// rank, `shard-<rank>.zero`, holding the rank's fp32 state buffer as it is (master weights, then
// each optimizer state, padding included) after a header and the fragment table that names what
// each range holds. Loading into any rank count, bucket size or stage reads every file's table and
// intersects it with the new plan (reshard.hpp). Tested in tests/zero/checkpoint_test.cpp.
//
// Format (little-endian, as the host writes it): "wm-zero1", then u64 world, rank,
// state_elements, streams (1 + optimizer states), i64 applied steps, the optimizer's name and
// checkpoint tag (u64 length + bytes each), u64 fragment count and each fragment (name as
// length + bytes, u64 param_elements, param_offset, elements, file_offset); then `streams`
// blocks of `state_elements` floats.
#pragma once

#include <wm/detail/zero/reshard.hpp>
#include <wm/error.hpp>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <vector>

namespace wm::detail::zero {

inline constexpr char checkpoint_magic[8] = {'w', 'm', '-', 'z', 'e', 'r', 'o', '1'};

/// What a shard file says about itself.
struct shard_header {
  std::uint64_t world{};
  std::uint64_t rank{};
  std::uint64_t state_elements{};
  std::uint64_t streams{};  ///< 1 (master weights) + optimizer states
  std::int64_t applied{};   ///< optimizer steps applied when it was saved
  std::string optimizer;    ///< the optimizer policy's name
  std::string tag;          ///< its checkpoint tag (settings that give the states a meaning)
  fragment_table table;
  std::uint64_t data_offset{};  ///< byte offset of the first float block
};

/// The file of rank @p rank in @p dir.
[[nodiscard]] inline std::filesystem::path shard_file(std::filesystem::path const& dir, int rank) {
  return dir / ("shard-" + std::to_string(rank) + ".zero");
}

namespace io {
inline void put(std::ofstream& out, std::uint64_t v) {
  out.write(reinterpret_cast<char const*>(&v), sizeof v);
}
inline void put(std::ofstream& out, std::string const& s) {
  put(out, static_cast<std::uint64_t>(s.size()));
  out.write(s.data(), static_cast<std::streamsize>(s.size()));
}
inline std::uint64_t get_u64(std::ifstream& in, std::string const& where) {
  std::uint64_t v{};
  if (!in.read(reinterpret_cast<char*>(&v), sizeof v)) {
    throw io_error{"wm: '" + where + "' is truncated (not a complete zero_optimizer shard)"};
  }
  return v;
}
inline std::string get_string(std::ifstream& in, std::string const& where) {
  std::uint64_t const n = get_u64(in, where);
  if (n > (std::uint64_t{1} << 20)) {
    throw io_error{"wm: '" + where + "' holds a name of " + std::to_string(n) + " bytes (corrupt)"};
  }
  std::string s(n, '\0');
  if (!in.read(s.data(), static_cast<std::streamsize>(n))) {
    throw io_error{"wm: '" + where + "' is truncated (not a complete zero_optimizer shard)"};
  }
  return s;
}
}  // namespace io

/**
 * @brief Writes @p file (through a temporary name, renamed at the end): the header fields of
 * @p h (its table and data offset are ignored; @p table is written) and @p streams, each of
 * `h.state_elements` floats.
 * @throw wm::io_error if the file cannot be written
 */
inline void write_shard(std::filesystem::path const& file, shard_header const& h,
                        fragment_table const& table,
                        std::span<std::span<float const> const> streams) {
  WM_EXPECTS(streams.size() == h.streams, "write_shard: one span per stream");
  std::filesystem::path const tmp{file.string() + ".tmp"};
  {
    std::ofstream out{tmp, std::ios::binary | std::ios::trunc};
    if (!out) { throw io_error{"wm: cannot write '" + tmp.string() + "'"}; }
    out.write(checkpoint_magic, sizeof checkpoint_magic);
    io::put(out, h.world);
    io::put(out, h.rank);
    io::put(out, h.state_elements);
    io::put(out, h.streams);
    io::put(out, static_cast<std::uint64_t>(h.applied));
    io::put(out, h.optimizer);
    io::put(out, h.tag);
    io::put(out, static_cast<std::uint64_t>(table.size()));
    for (auto const& f : table) {
      io::put(out, f.name);
      io::put(out, static_cast<std::uint64_t>(f.param_elements));
      io::put(out, static_cast<std::uint64_t>(f.param_offset));
      io::put(out, static_cast<std::uint64_t>(f.elements));
      io::put(out, static_cast<std::uint64_t>(f.file_offset));
    }
    for (auto const& s : streams) {
      WM_EXPECTS(s.size() == h.state_elements, "write_shard: streams of state_elements floats");
      out.write(reinterpret_cast<char const*>(s.data()),
                static_cast<std::streamsize>(s.size() * sizeof(float)));
    }
    out.flush();
    if (!out) { throw io_error{"wm: writing '" + tmp.string() + "' failed"}; }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, file, ec);
  if (ec) { throw io_error{"wm: cannot rename '" + tmp.string() + "': " + ec.message()}; }
}

/// Reads @p file's header and fragment table. @throw wm::io_error if it is missing or malformed
[[nodiscard]] inline shard_header read_shard_header(std::filesystem::path const& file) {
  std::string const where = file.string();
  std::ifstream in{file, std::ios::binary};
  if (!in) { throw io_error{"wm: cannot read '" + where + "'"}; }
  char magic[sizeof checkpoint_magic]{};
  if (!in.read(magic, sizeof magic) || std::memcmp(magic, checkpoint_magic, sizeof magic) != 0) {
    throw io_error{"wm: '" + where + "' is not a zero_optimizer shard (bad format marker)"};
  }
  shard_header h;
  h.world               = io::get_u64(in, where);
  h.rank                = io::get_u64(in, where);
  h.state_elements      = io::get_u64(in, where);
  h.streams             = io::get_u64(in, where);
  h.applied             = static_cast<std::int64_t>(io::get_u64(in, where));
  h.optimizer           = io::get_string(in, where);
  h.tag                 = io::get_string(in, where);
  std::uint64_t const n = io::get_u64(in, where);
  for (std::uint64_t i = 0; i < n; ++i) {
    stored_fragment f;
    f.name           = io::get_string(in, where);
    f.param_elements = io::get_u64(in, where);
    f.param_offset   = io::get_u64(in, where);
    f.elements       = io::get_u64(in, where);
    f.file_offset    = io::get_u64(in, where);
    if (f.file_offset + f.elements > h.state_elements) {
      throw io_error{"wm: '" + where + "' has a fragment past its state buffer (corrupt)"};
    }
    h.table.push_back(std::move(f));
  }
  h.data_offset = static_cast<std::uint64_t>(in.tellg());
  in.seekg(0, std::ios::end);
  auto const size = static_cast<std::uint64_t>(in.tellg());
  if (size != h.data_offset + h.streams * h.state_elements * sizeof(float)) {
    throw io_error{"wm: '" + where + "' has " + std::to_string(size) + " bytes, its header says " +
                   std::to_string(h.data_offset + h.streams * h.state_elements * sizeof(float))};
  }
  return h;
}

/**
 * @brief Carries out @p reads (from plan_shard_reads) for every stream: stream s of the new
 * buffer (@p out[s], zeroed by the caller) gets its elements from stream s of the files.
 * @param files the shard files, indexed as the reads' `file`
 * @param headers their headers (read_shard_header)
 * @throw wm::io_error on a read error
 */
inline void read_shards(std::span<std::filesystem::path const> files,
                        std::span<shard_header const> headers, std::span<shard_read const> reads,
                        std::span<std::span<float> const> out) {
  std::vector<std::ifstream> in(files.size());
  for (auto const& r : reads) {
    WM_EXPECTS(r.file < files.size(), "read_shards: reads name known files");
    auto& f = in[r.file];
    if (!f.is_open()) {
      f.open(files[r.file], std::ios::binary);
      if (!f) { throw io_error{"wm: cannot read '" + files[r.file].string() + "'"}; }
    }
    auto const& h = headers[r.file];
    for (std::size_t s = 0; s < out.size(); ++s) {
      WM_EXPECTS(r.dest_offset + r.elements <= out[s].size(), "read_shards: reads fit the buffer");
      auto const at = h.data_offset + (s * h.state_elements + r.file_offset) * sizeof(float);
      f.seekg(static_cast<std::streamoff>(at));
      if (!f.read(reinterpret_cast<char*>(out[s].data() + r.dest_offset),
                  static_cast<std::streamsize>(r.elements * sizeof(float)))) {
        throw io_error{"wm: reading '" + files[r.file].string() + "' failed"};
      }
    }
  }
}

}  // namespace wm::detail::zero
