// SPDX-License-Identifier: Apache-2.0
// File I/O of wm::memory: each rank reads its byte range of a logically concatenated file list
// into its part, or writes its part to its own file; device memory goes through a bounded pinned
// double buffer.
#pragma once

#include <wm/detail/base/posix.hpp>
#include <wm/detail/memory/plan.hpp>
#include <wm/detail/memory/state.hpp>
#include <wm/error.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <fcntl.h>
#include <filesystem>
#include <span>
#include <string>
#include <unistd.h>

namespace wm::detail {

/// Pinned double buffer for moving file data to and from device memory in bounded pieces.
class staging_buffer {
 public:
  static constexpr std::size_t piece = std::size_t{32} << 20;

  explicit staging_buffer(bool needed) {
    if (!needed) { return; }
    WM_CUDA_TRY(cudaMallocHost(&buf_, 2 * piece));
    WM_CUDA_TRY(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    for (auto& e : done_) { WM_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming)); }
  }
  staging_buffer(staging_buffer const&)            = delete;
  staging_buffer& operator=(staging_buffer const&) = delete;
  ~staging_buffer() {
    if (stream_ != nullptr) { (void)cudaStreamSynchronize(stream_); }
    for (auto& e : done_) {
      if (e != nullptr) { (void)cudaEventDestroy(e); }
    }
    if (stream_ != nullptr) { (void)cudaStreamDestroy(stream_); }
    if (buf_ != nullptr) { (void)cudaFreeHost(buf_); }
  }
  /// Piece @p i's host buffer, once the copy that last used it has finished.
  [[nodiscard]] std::byte* acquire(std::size_t i) {
    WM_CUDA_TRY(cudaEventSynchronize(done_[i % 2]));
    return buf_ + (i % 2) * piece;
  }
  void copy(void* dst, void const* src, std::size_t n, cudaMemcpyKind kind, std::size_t i) {
    WM_CUDA_TRY(cudaMemcpyAsync(dst, src, n, kind, stream_));
    WM_CUDA_TRY(cudaEventRecord(done_[i % 2], stream_));
  }
  void finish() { WM_CUDA_TRY(cudaStreamSynchronize(stream_)); }

 private:
  std::byte* buf_{};
  cudaStream_t stream_{};
  std::array<cudaEvent_t, 2> done_{};
};

/// Reads this rank's byte range of the concatenated @p files into its part.
inline void read_part(memory_state const& r, std::span<std::filesystem::path const> files,
                      std::span<std::uint64_t const> sizes) {
  auto const me    = r.comm->rank();
  auto const begin = r.part.begin(me) * r.gran;
  auto const end   = r.part.end(me) * r.gran;
  auto const plan  = plan_reads(sizes, begin, end);
  bool const host  = r.local_host != nullptr;
  staging_buffer staging{!host && !plan.empty()};
  std::size_t piece_no = 0;
  for (auto const& s : plan) {
    unique_fd fd{::open(files[s.file].c_str(), O_RDONLY | O_CLOEXEC)};
    if (!fd.valid()) {
      throw io_error{"cannot open '" + files[s.file].string() + "': " + errno_text()};
    }
    ::posix_fadvise(fd.get(), static_cast<off_t>(s.offset), static_cast<off_t>(s.length),
                    POSIX_FADV_SEQUENTIAL);
    std::uint64_t done = 0;
    while (done < s.length) {
      std::size_t const n =
          static_cast<std::size_t>(std::min<std::uint64_t>(s.length - done, staging_buffer::piece));
      std::byte* dst  = host ? r.local_host + s.dest + done : staging.acquire(piece_no);
      std::size_t got = 0;
      while (got < n) {
        auto const k =
            ::pread(fd.get(), dst + got, n - got, static_cast<off_t>(s.offset + done + got));
        if (k < 0 && errno == EINTR) { continue; }
        if (k <= 0) {
          throw io_error{"reading '" + files[s.file].string() + "' at byte " +
                         std::to_string(s.offset + done + got) + ": " +
                         (k == 0 ? std::string{"unexpected end of file"} : errno_text())};
        }
        got += static_cast<std::size_t>(k);
      }
      if (!host) {
        staging.copy(r.local + s.dest + done, dst, n, cudaMemcpyHostToDevice, piece_no++);
      }
      done += n;
    }
  }
  if (!host && !plan.empty()) { staging.finish(); }
}

/// Writes this rank's part to @p file (an empty file if it owns nothing).
inline void write_part(memory_state const& r, std::filesystem::path const& file) {
  auto const bytes = r.part.count(r.comm->rank()) * r.gran;
  unique_fd fd{::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)};
  if (!fd.valid()) { throw io_error{"cannot create '" + file.string() + "': " + errno_text()}; }
  bool const host = r.local_host != nullptr;
  staging_buffer staging{!host && bytes > 0};
  std::size_t const pieces = (bytes + staging_buffer::piece - 1) / staging_buffer::piece;
  auto piece_bytes         = [&](std::size_t i) {
    return std::min(staging_buffer::piece, bytes - i * staging_buffer::piece);
  };
  if (!host && pieces > 0) {
    staging.copy(staging.acquire(0), r.local, piece_bytes(0), cudaMemcpyDeviceToHost, 0);
  }
  for (std::size_t i = 0; i < pieces; ++i) {
    std::byte const* src = host ? r.local_host + i * staging_buffer::piece : staging.acquire(i);
    if (!host && i + 1 < pieces) {  // next piece travels while this one is written
      staging.copy(staging.acquire(i + 1), r.local + (i + 1) * staging_buffer::piece,
                   piece_bytes(i + 1), cudaMemcpyDeviceToHost, i + 1);
    }
    if (!write_all(fd.get(), src, piece_bytes(i))) {
      throw io_error{"writing '" + file.string() + "': " + errno_text()};
    }
  }
  if (::close(fd.release()) != 0) {
    throw io_error{"closing '" + file.string() + "': " + errno_text()};
  }
}

}  // namespace wm::detail
