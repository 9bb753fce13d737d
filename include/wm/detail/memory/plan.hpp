// SPDX-License-Identifier: Apache-2.0
// Host-only planning for wm::memory and wm::tensor: VMM chunk boundaries, file read plans, file
// checks and reads, row pieces. Testable on the CPU.
#pragma once

#include <wm/detail/base/posix.hpp>
#include <wm/error.hpp>

#include <cstddef>
#include <cstdint>
#include <fcntl.h>
#include <filesystem>
#include <span>
#include <string>
#include <unistd.h>
#include <vector>

namespace wm::detail {

[[nodiscard]] constexpr std::size_t round_up(std::size_t x, std::size_t m) noexcept {
  return m == 0 ? x : (x + m - 1) / m * m;
}
[[nodiscard]] constexpr std::size_t round_down(std::size_t x, std::size_t m) noexcept {
  return m == 0 ? x : x / m * m;
}

/**
 * Physical chunk boundaries of a continuous·device (VMM) allocation. Rank r backs the virtual
 * range [b[r], b[r+1]) with its own GPU memory. Boundaries are multiples of the VMM granularity
 * @p vmm (so each chunk maps), follow the logical byte starts rounded down (so a rank's logical
 * part is backed by its own GPU except for less than one granule at each end), and the last one
 * covers the total rounded up. Chunks may be empty.
 */
[[nodiscard]] inline std::vector<std::size_t> vmm_boundaries(
    std::span<std::size_t const> entry_starts, std::size_t granularity, std::size_t vmm,
    std::size_t total_bytes) {
  WM_EXPECTS(entry_starts.size() >= 2, "need world + 1 starts");
  WM_EXPECTS(vmm > 0, "the VMM granularity must be positive");
  std::size_t const world = entry_starts.size() - 1;
  std::vector<std::size_t> b(world + 1);
  b[0]     = 0;
  b[world] = round_up(total_bytes, vmm);
  for (std::size_t r = 1; r < world; ++r) {
    b[r] = std::min(round_down(entry_starts[r] * granularity, vmm), b[world]);
  }
  return b;
}

/// One read of a logically concatenated file list: bytes [offset, offset + length) of file
/// `file` go to `dest` bytes past the start of the reader's range.
struct file_segment {
  std::size_t file;
  std::uint64_t offset;
  std::uint64_t length;
  std::uint64_t dest;
  friend bool operator==(file_segment const&, file_segment const&) = default;
};

/**
 * The reads that bring bytes [begin, end) of the concatenation of files with @p sizes into a
 * buffer, in order; empty files and files outside the range produce no segment.
 */
[[nodiscard]] inline std::vector<file_segment> plan_reads(std::span<std::uint64_t const> sizes,
                                                          std::uint64_t begin, std::uint64_t end) {
  WM_EXPECTS(begin <= end, "read range is reversed");
  std::vector<file_segment> out;
  std::uint64_t file_start = 0;
  for (std::size_t f = 0; f < sizes.size() && file_start < end; ++f) {
    std::uint64_t const file_end = file_start + sizes[f];
    std::uint64_t const lo       = std::max(begin, file_start);
    std::uint64_t const hi       = std::min(end, file_end);
    if (lo < hi) { out.push_back({f, lo - file_start, hi - lo, lo - begin}); }
    file_start = file_end;
  }
  std::uint64_t covered = 0;
  for (auto const& s : out) { covered += s.length; }
  WM_EXPECTS(covered == end - begin, "the files hold " + std::to_string(file_start) +
                                         " bytes, fewer than the range end " + std::to_string(end));
  return out;
}

/**
 * Checks file sizes against the memory: each a multiple of @p granularity, together exactly
 * @p total. Returns an empty string if they fit, else what is wrong.
 */
[[nodiscard]] inline std::string check_file_sizes(std::span<std::uint64_t const> sizes,
                                                  std::span<std::string const> names,
                                                  std::uint64_t total, std::uint64_t granularity) {
  std::uint64_t sum = 0;
  for (std::size_t f = 0; f < sizes.size(); ++f) {
    if (granularity != 0 && sizes[f] % granularity != 0) {
      return "file '" + names[f] + "' has " + std::to_string(sizes[f]) +
             " bytes, not a multiple of the granularity " + std::to_string(granularity);
    }
    sum += sizes[f];
  }
  if (sum != total) {
    return "the files hold " + std::to_string(sum) + " bytes in all; the memory has " +
           std::to_string(total);
  }
  return {};
}

/// Pieces of at most @p piece_rows rows that cover the largest rank's share of @p rows.
[[nodiscard]] inline std::size_t row_pieces(std::size_t rows, int world, std::size_t piece_rows) {
  std::size_t const most =
      (rows + static_cast<std::size_t>(world) - 1) / static_cast<std::size_t>(world);
  return (most + piece_rows - 1) / piece_rows;
}

/// Reads bytes [begin, end) of the concatenation of @p files (sizes known) into @p dst.
inline void read_concatenated(std::span<std::filesystem::path const> files,
                              std::span<std::uint64_t const> sizes, std::uint64_t begin,
                              std::uint64_t end, std::byte* dst) {
  for (auto const& s : plan_reads(sizes, begin, end)) {
    unique_fd fd{::open(files[s.file].c_str(), O_RDONLY | O_CLOEXEC)};
    if (!fd.valid()) {
      throw io_error{"cannot open '" + files[s.file].string() + "': " + errno_text()};
    }
    std::uint64_t got = 0;
    while (got < s.length) {
      auto const k =
          ::pread(fd.get(), dst + s.dest + got, s.length - got, static_cast<off_t>(s.offset + got));
      if (k < 0 && errno == EINTR) { continue; }
      if (k <= 0) {
        throw io_error{"reading '" + files[s.file].string() +
                       "': " + (k == 0 ? std::string{"unexpected end of file"} : errno_text())};
      }
      got += static_cast<std::uint64_t>(k);
    }
  }
}

/// Sizes of @p files, checked against @p total bytes of rows of @p row_bytes.
inline std::vector<std::uint64_t> checked_sizes(std::span<std::filesystem::path const> files,
                                                std::uint64_t total, std::uint64_t row_bytes) {
  WM_EXPECTS(!files.empty(), "load needs at least one file");
  std::vector<std::uint64_t> sizes(files.size());
  std::vector<std::string> names;
  for (std::size_t f = 0; f < files.size(); ++f) {
    names.push_back(files[f].string());
    std::error_code ec;
    if (!std::filesystem::is_regular_file(files[f], ec)) {
      throw io_error{"'" + files[f].string() + "' is not a readable file" +
                     (ec ? ": " + ec.message() : std::string{})};
    }
    sizes[f] = std::filesystem::file_size(files[f], ec);
    if (ec) {
      throw io_error{"cannot read the size of '" + files[f].string() + "': " + ec.message()};
    }
  }
  if (auto const bad = check_file_sizes(sizes, names, total, row_bytes); !bad.empty()) {
    throw io_error{bad};
  }
  return sizes;
}

}  // namespace wm::detail
