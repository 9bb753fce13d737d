// SPDX-License-Identifier: Apache-2.0
// Durable file steps of the checkpoints (embedding store, ZeRO save): flush a file, flush a
// directory's entries, rename; each throws wm::io_error naming the path and errno.
#pragma once

#include <wm/detail/base/posix.hpp>
#include <wm/error.hpp>

#include <cerrno>
#include <cstdio>
#include <fcntl.h>
#include <filesystem>
#include <string>
#include <unistd.h>

namespace wm::detail {

/// Flushes @p file to the disk. @throw wm::io_error if it cannot
inline void sync_file(std::filesystem::path const& file) {
  unique_fd fd{::open(file.c_str(), O_RDONLY | O_CLOEXEC)};
  if (!fd.valid() || ::fsync(fd.get()) != 0) {
    throw io_error{"wm: cannot flush '" + file.string() + "' to the disk: " + errno_text()};
  }
}

/// Flushes the entries of the directory @p dir (names created, renamed or removed in it) to the
/// disk: a renamed file is only durable under its new name once its directory is. An empty path
/// is the working directory. A file system that cannot flush directories (EINVAL) has nothing to
/// flush. @throw wm::io_error if it cannot
inline void sync_directory(std::filesystem::path const& dir) {
  std::filesystem::path const d = dir.empty() ? std::filesystem::path{"."} : dir;
  unique_fd fd{::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
  if (!fd.valid()) {
    throw io_error{"wm: cannot open the directory '" + d.string() + "': " + errno_text()};
  }
  if (::fsync(fd.get()) != 0 && errno != EINVAL) {
    throw io_error{"wm: cannot flush the directory '" + d.string() +
                   "' to the disk: " + errno_text()};
  }
}

/// Renames @p from to @p to (replacing it). @throw wm::io_error if it cannot
inline void rename_file(std::filesystem::path const& from, std::filesystem::path const& to) {
  if (std::rename(from.c_str(), to.c_str()) != 0) {
    throw io_error{"wm: cannot rename '" + from.string() + "' to '" + to.string() +
                   "': " + errno_text()};
  }
}

}  // namespace wm::detail
