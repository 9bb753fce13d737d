// SPDX-License-Identifier: Apache-2.0
// Host-only checkpoint files of wm::zero_optimizer (docs/design.md, "Checkpoints"): one file per
// rank holding the rank's fp32 state buffer as it is (master weights, then each optimizer state,
// padding included) after a header and the fragment table that names what each range holds, and
// a `manifest` that names the files of the checkpoint. Loading into any rank count, bucket size
// or stage reads every file's table and intersects it with the new plan (reshard.hpp). Tested in
// tests/zero/checkpoint_test.cpp.
//
// All or nothing (save_shards): a save is a generation. Every rank writes `shard-<r>.zero.tmp`
// and flushes it to the disk; the ranks agree; each renames its file to `shard-<r>.g<G>.zero`
// (G: one more than any generation in the directory) and flushes the directory; the ranks agree;
// rank 0 writes `manifest` (generation, world, applied steps) under a temporary name, flushes
// it, renames it over the old one and flushes the directory; the ranks agree; rank 0 removes the
// files of other generations. `load` reads only the files the manifest names. No file of the
// generation the manifest names is ever written or removed, so a failure or a crash anywhere
// leaves the old checkpoint (the manifest not renamed yet) or the new one (renamed after every
// new file was on the disk), never a mix. A failure on any rank makes every rank throw, naming
// the failing ranks and their errors, and remove its files of the new generation; an exchange
// that fails (the communicator: a peer killed, a deadline) leaves unknown whether rank 0 went
// on to the manifest, so those files stay, and the next save removes them with every other
// generation's. A directory without a manifest is one saved before manifests existed: its
// `shard-<r>.zero` files load as before (a save there replaces them).
//
// Shard format (little-endian, as the host writes it): "wm-zero1", then u64 world, rank,
// state_elements, streams (1 + optimizer states), i64 applied steps, the optimizer's name and
// checkpoint tag (u64 length + bytes each), u64 fragment count and each fragment (name as
// length + bytes, u64 param_elements, param_offset, elements, file_offset); then `streams`
// blocks of `state_elements` floats. Manifest: text lines "wm-zero-manifest 1", "generation G",
// "world W", "applied A".
#pragma once

#include <wm/detail/base/files.hpp>
#include <wm/detail/base/posix.hpp>
#include <wm/detail/zero/reshard.hpp>
#include <wm/error.hpp>

#include <cerrno>
#include <charconv>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
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

/// The file of rank @p rank in generation @p generation of the checkpoint in @p dir.
[[nodiscard]] inline std::filesystem::path shard_file(std::filesystem::path const& dir, int rank,
                                                      std::uint64_t generation) {
  return dir / ("shard-" + std::to_string(rank) + ".g" + std::to_string(generation) + ".zero");
}

/// The name rank @p rank writes its file under before the ranks agree.
[[nodiscard]] inline std::filesystem::path shard_temp_file(std::filesystem::path const& dir,
                                                           int rank) {
  return dir / ("shard-" + std::to_string(rank) + ".zero.tmp");
}

/// The file of rank @p rank in a directory saved before manifests existed (no generation).
[[nodiscard]] inline std::filesystem::path legacy_shard_file(std::filesystem::path const& dir,
                                                             int rank) {
  return dir / ("shard-" + std::to_string(rank) + ".zero");
}

/// The file that names the checkpoint in @p dir (written last by every save).
[[nodiscard]] inline std::filesystem::path manifest_file(std::filesystem::path const& dir) {
  return dir / "manifest";
}

/// What the manifest says: the generation of the files to read, how many, and their step count.
struct checkpoint_manifest {
  std::uint64_t generation{};
  std::uint64_t world{};
  std::int64_t applied{};
};

/// The generation in a shard file's name (`shard-<r>.g<G>.zero`), if it is one.
[[nodiscard]] inline std::optional<std::uint64_t> generation_of(std::string_view name) {
  auto number = [](std::string_view t, std::uint64_t& v) {
    auto const [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
    return ec == std::errc{} && end == t.data() + t.size() && !t.empty();
  };
  std::string_view const prefix{"shard-"}, suffix{".zero"};
  if (!name.starts_with(prefix) || !name.ends_with(suffix)) { return std::nullopt; }
  name.remove_prefix(prefix.size());
  name.remove_suffix(suffix.size());
  auto const dot = name.find(".g");
  std::uint64_t rank{}, generation{};
  if (dot == std::string_view::npos || !number(name.substr(0, dot), rank) ||
      !number(name.substr(dot + 2), generation)) {
    return std::nullopt;
  }
  return generation;
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

/// Removes @p file if it is a file (never a directory), ignoring errors.
inline void remove_file(std::filesystem::path const& file) noexcept {
  (void)::unlink(file.c_str());
}

/**
 * @brief Writes @p file and flushes it to the disk: the header fields of @p h (its table and data
 * offset are ignored; @p table is written) and @p streams, each of `h.state_elements` floats.
 * A file it began to write is removed if it fails.
 * @throw wm::io_error if the file cannot be written
 */
inline void write_shard(std::filesystem::path const& file, shard_header const& h,
                        fragment_table const& table,
                        std::span<std::span<float const> const> streams) {
  WM_EXPECTS(streams.size() == h.streams, "write_shard: one span per stream");
  for (auto const& s : streams) {
    WM_EXPECTS(s.size() == h.state_elements, "write_shard: streams of state_elements floats");
  }
  std::ofstream out{file, std::ios::binary | std::ios::trunc};
  if (!out) { throw io_error{"wm: cannot write '" + file.string() + "'"}; }
  try {
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
      out.write(reinterpret_cast<char const*>(s.data()),
                static_cast<std::streamsize>(s.size() * sizeof(float)));
    }
    out.close();
    if (!out) { throw io_error{"wm: writing '" + file.string() + "' failed"}; }
    sync_file(file);
  } catch (...) {
    remove_file(file);
    throw;
  }
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

/// Writes @p m to @p file and flushes it to the disk. @throw wm::io_error if it cannot
inline void write_manifest(std::filesystem::path const& file, checkpoint_manifest const& m) {
  {
    std::ofstream out{file, std::ios::trunc};
    if (!out) { throw io_error{"wm: cannot write '" + file.string() + "'"}; }
    out << "wm-zero-manifest 1\ngeneration " << m.generation << "\nworld " << m.world
        << "\napplied " << m.applied << "\n";
    out.close();
    if (!out) {
      remove_file(file);
      throw io_error{"wm: writing '" + file.string() + "' failed"};
    }
  }
  sync_file(file);
}

/// Reads the manifest @p file. @throw wm::io_error if it is missing or malformed
[[nodiscard]] inline checkpoint_manifest read_manifest(std::filesystem::path const& file) {
  std::ifstream in{file};
  if (!in) { throw io_error{"wm: cannot read '" + file.string() + "'"}; }
  std::string magic, version, k1, k2, k3, rest;
  checkpoint_manifest m;
  in >> magic >> version >> k1 >> m.generation >> k2 >> m.world >> k3 >> m.applied;
  bool const good = !in.fail() && magic == "wm-zero-manifest" && version == "1" &&
                    k1 == "generation" && k2 == "world" && k3 == "applied" && !(in >> rest) &&
                    m.generation > 0 && m.world > 0;
  if (!good) { throw io_error{"wm: '" + file.string() + "' is not a zero_optimizer manifest"}; }
  return m;
}

/// One more than every generation in @p dir (its manifest's and its files' names); 1 if none.
[[nodiscard]] inline std::uint64_t next_generation(std::filesystem::path const& dir) {
  std::uint64_t last = 0;
  try {
    last = read_manifest(manifest_file(dir)).generation;
  } catch (io_error const&) {}  // none or unreadable: the files' names still count
  for (auto const& e : std::filesystem::directory_iterator{dir}) {
    if (auto const g = generation_of(e.path().filename().string()); g && *g > last) { last = *g; }
  }
  return last + 1;
}

/// A checkpoint as `load` finds it: each rank's file of the save and its header.
struct stored_checkpoint {
  std::vector<std::filesystem::path> files;  ///< indexed by the saving rank
  std::vector<shard_header> headers;         ///< checked: world, rank and step agree
};

/**
 * @brief The checkpoint in @p dir: the files its manifest names (or, with no manifest, those of
 * a directory saved before manifests existed) with their headers, each checked against the
 * manifest (world, rank, applied steps). Files of other generations are never read.
 * @throw wm::io_error if there is no checkpoint, or a file is missing, malformed or of another
 * save
 */
[[nodiscard]] inline stored_checkpoint read_checkpoint(std::filesystem::path const& dir) {
  stored_checkpoint c;
  std::optional<checkpoint_manifest> m;
  std::error_code ec;
  if (std::filesystem::exists(manifest_file(dir), ec)) {
    m = read_manifest(manifest_file(dir));
  } else if (!std::filesystem::exists(legacy_shard_file(dir, 0), ec)) {
    throw io_error{"wm: '" + dir.string() + "' holds no zero_optimizer checkpoint (no '" +
                   manifest_file(dir).filename().string() + "')"};
  }
  auto file_of = [&](std::uint64_t r) {
    auto const rank = static_cast<int>(r);
    return m ? shard_file(dir, rank, m->generation) : legacy_shard_file(dir, rank);
  };
  c.files.push_back(file_of(0));
  c.headers.push_back(read_shard_header(c.files[0]));
  std::uint64_t const world  = m ? m->world : c.headers[0].world;
  std::int64_t const applied = m ? m->applied : c.headers[0].applied;
  if (world == 0) { throw io_error{"wm: '" + c.files[0].string() + "' says it has no ranks"}; }
  std::string const expected = m ? "'" + manifest_file(dir).string() + "'" : "shard-0";
  for (std::uint64_t r = 0; r < world; ++r) {
    if (r > 0) {
      c.files.push_back(file_of(r));
      c.headers.push_back(read_shard_header(c.files.back()));
    }
    auto const& h = c.headers.back();
    if (h.world != world || h.rank != r || h.applied != applied) {
      throw io_error{"wm: '" + c.files.back().string() + "' belongs to another save than " +
                     expected + " (world " + std::to_string(h.world) + ", rank " +
                     std::to_string(h.rank) + ", step " + std::to_string(h.applied) +
                     "; expected world " + std::to_string(world) + ", rank " + std::to_string(r) +
                     ", step " + std::to_string(applied) + ")"};
    }
  }
  return c;
}

/// How the ranks of a save agree: every rank passes some bytes and gets every rank's, in rank
/// order (zero_optimizer::save: `communicator::all_gather_bytes`, which also checks that every
/// rank is in the same collective).
template <class F>
concept rank_gather = requires(F f, std::span<std::byte const> mine) {
  { f(mine) } -> std::convertible_to<std::vector<std::vector<std::byte>>>;
};

namespace save_step {
/// What a rank says after a step of a save: a word (0: this rank failed) and its error.
struct outcome {
  std::uint64_t word{};
  std::string error;
};

/// Every rank's outcome of a step (collective through @p gather).
template <rank_gather Gather>
[[nodiscard]] std::vector<outcome> exchange(Gather& gather, outcome const& mine) {
  std::vector<std::byte> bytes(sizeof mine.word + mine.error.size());
  std::memcpy(bytes.data(), &mine.word, sizeof mine.word);
  std::memcpy(bytes.data() + sizeof mine.word, mine.error.data(), mine.error.size());
  std::vector<std::vector<std::byte>> const all = gather(std::span<std::byte const>{bytes});
  std::vector<outcome> out(all.size());
  for (std::size_t r = 0; r < all.size(); ++r) {
    WM_EXPECTS(all[r].size() >= sizeof out[r].word, "save_shards: every rank sends a word");
    std::memcpy(&out[r].word, all[r].data(), sizeof out[r].word);
    out[r].error.assign(reinterpret_cast<char const*>(all[r].data()) + sizeof out[r].word,
                        all[r].size() - sizeof out[r].word);
  }
  return out;
}

/// Runs @p body: its outcome is the word it returns, or 0 and what it threw.
template <class F>
[[nodiscard]] outcome attempt(F&& body) {
  try {
    return {body(), {}};
  } catch (std::exception const& e) {
    std::string what = e.what();
    return {0, what.empty() ? "unknown error" : what};
  }
}

/// Whether a rank failed the step whose outcomes are @p all.
[[nodiscard]] inline bool failed(std::vector<outcome> const& all) noexcept {
  for (auto const& o : all) {
    if (o.word == 0) { return true; }
  }
  return false;
}

/// Throws, on every rank alike, if a rank failed the step @p step: the failing ranks and their
/// errors, and that the previous checkpoint in @p dir (if any) is kept.
inline void check(std::vector<outcome> const& all, std::string_view step,
                  std::filesystem::path const& dir) {
  std::string msg;
  for (std::size_t r = 0; r < all.size(); ++r) {
    if (all[r].word != 0) { continue; }
    msg +=
        (msg.empty() ? "" : "; ") + std::string{"rank "} + std::to_string(r) + ": " + all[r].error;
  }
  if (msg.empty()) { return; }
  throw io_error{"wm: zero_optimizer::save failed while " + std::string{step} + " (" + msg +
                 "); the previous checkpoint in '" + dir.string() + "', if any, is kept"};
}
}  // namespace save_step

/// Whether @p name is a shard file of a directory saved before manifests (`shard-<r>.zero`).
[[nodiscard]] inline bool legacy_shard_name(std::string_view name) {
  std::string_view const prefix{"shard-"}, suffix{".zero"};
  if (name.size() <= prefix.size() + suffix.size() || !name.starts_with(prefix) ||
      !name.ends_with(suffix)) {
    return false;
  }
  auto const digits = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  return digits.find_first_not_of("0123456789") == std::string_view::npos;
}

/**
 * @brief This rank's part of saving a checkpoint into @p dir, all or nothing across the ranks
 * that @p gather joins (the protocol: this file's first comment). Creates @p dir.
 * @param h this rank's header (its `rank` and `world` name the rank and the rank count)
 * @return the generation saved
 * @throw wm::io_error on every rank if any rank failed, naming the ranks that failed and what
 * failed there; the previous checkpoint then still loads, and this rank's files of the new
 * generation are removed. One exception: rank 0 renamed the manifest but could not flush the
 * directory; the new checkpoint loads, every file is kept, and every rank throws that it may
 * not survive a crash. What @p gather throws passes through (this rank's temporary file
 * removed; its renamed file kept, since the manifest may name it).
 */
template <rank_gather Gather>
std::uint64_t save_shards(std::filesystem::path const& dir, shard_header const& h,
                          fragment_table const& table,
                          std::span<std::span<float const> const> streams, Gather&& gather) {
  namespace step      = save_step;
  using word          = std::uint64_t;
  auto const rank     = static_cast<int>(h.rank);
  auto const tmp      = shard_temp_file(dir, rank);
  auto const manifest = manifest_file(dir);
  word generation     = 0;
  std::filesystem::path mine;  // this rank's file of the new generation, once renamed
  // Whether `mine` goes if the save fails: only once it is known that the manifest does not
  // name it. An exchange that throws leaves that unknown (rank 0 may have gone on): it stays,
  // and the next save removes it if it is not the checkpoint.
  bool discard = false;
  try {
    // 1. Every rank's file under its temporary name, on the disk. Rank 0's word is the new
    //    generation.
    auto all = step::exchange(gather, step::attempt([&] {
                                std::filesystem::create_directories(dir);
                                word const g = rank == 0 ? next_generation(dir) : 1;
                                write_shard(tmp, h, table, streams);
                                return g;
                              }));
    WM_EXPECTS(all.size() == h.world, "save_shards: one outcome per rank");
    step::check(all, "writing the shards", dir);
    generation = all[0].word;
    // 2. Every rank's file under its name in the new generation, the name on the disk. No file
    //    of the generation the manifest names is touched.
    all     = step::exchange(gather, step::attempt([&] {
                           auto const target = shard_file(dir, rank, generation);
                           rename_file(tmp, target);
                           mine = target;
                           sync_directory(dir);
                           return word{1};
                         }));
    discard = step::failed(all);
    step::check(all, "renaming the shards", dir);
    // 3. Rank 0 points the manifest at the new generation: written and flushed under a
    //    temporary name, renamed over the old one, the rename flushed. Its word 2: renamed, but
    //    the directory could not be flushed.
    step::outcome committed{1, {}};
    if (rank == 0) {
      std::filesystem::path const manifest_tmp{manifest.string() + ".tmp"};
      committed = step::attempt([&] {
        write_manifest(manifest_tmp, {generation, h.world, h.applied});
        rename_file(manifest_tmp, manifest);
        return word{1};
      });
      if (committed.word == 0) {
        discard = true;
        remove_file(manifest_tmp);
      } else if (auto flushed = step::attempt([&] {
                   sync_directory(dir);
                   return word{1};
                 });
                 flushed.word == 0) {
        committed = {2, std::move(flushed.error)};
      }
    }
    all     = step::exchange(gather, committed);
    discard = all[0].word == 0;
    if (all[0].word == 2) {
      throw io_error{"wm: zero_optimizer::save: the new checkpoint in '" + dir.string() +
                     "' is in place, but rank 0 could not flush the directory (" + all[0].error +
                     "): it may not survive a crash; the previous generation's files are kept"};
    }
    step::check(all, "writing the manifest", dir);
  } catch (...) {
    remove_file(tmp);
    if (discard && !mine.empty()) { remove_file(mine); }
    throw;
  }
  // 4. Committed, and every rank is past its rename: rank 0 removes the files of other
  //    generations and those of a directory saved before manifests. Temporary files stay (the
  //    ranks' next save may be writing them already); a file that cannot be removed stays too.
  if (rank == 0) {
    std::vector<std::filesystem::path> stale;
    std::error_code ec;
    for (std::filesystem::directory_iterator it{dir, ec}, end; !ec && it != end; it.increment(ec)) {
      auto const name = it->path().filename().string();
      auto const g    = generation_of(name);
      if ((g && *g != generation) || legacy_shard_name(name)) { stale.push_back(it->path()); }
    }
    for (auto const& f : stale) { remove_file(f); }
  }
  return generation;
}

}  // namespace wm::detail::zero
