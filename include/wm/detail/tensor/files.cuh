// SPDX-License-Identifier: Apache-2.0
// wm::tensor's file I/O (declared in <wm/tensor.cuh>): rows between raw files and the tensor.
#pragma once

#include <wm/detail/base/cuda.cuh>
#include <wm/detail/base/posix.hpp>
#include <wm/detail/base/resources.hpp>
#include <wm/tensor.cuh>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <fcntl.h>
#include <filesystem>
#include <span>
#include <string>
#include <unistd.h>
#include <vector>

namespace wm {

// ---- files ----------------------------------------------------------------------------------
//
// Files hold packed rows (cols elements each) in global row order, whatever the layout, mapping,
// stride or rank count: rank r stores and loads the rows [begin, end) of the block plan of
// `rows` over the ranks, moving them in bounded pieces through gather/scatter. Every rank runs
// the same number of pieces (the distributed layout's gather/scatter are collective); a file
// error on one rank is reported on every rank at the end.

namespace detail {

/// What moving rows between files and a tensor needs, one staging piece at a time: pinned host
/// and device rows, the rows' global indices, and a stream of its own (freed however load or
/// store ends).
struct row_piece_buffers {
  std::size_t piece;  // rows per piece
  pinned_buffer<std::byte> host_rows;
  device_buffer<std::byte> dev_rows;
  device_buffer<std::int64_t> indices;
  unique_stream own;
  std::byte* host;
  std::byte* dev;
  std::int64_t* idx;
  cudaStream_t stream;
  explicit row_piece_buffers(std::size_t row_bytes)
      : piece{std::max<std::size_t>(1, staging_buffer::piece / row_bytes)},
        host_rows{piece * row_bytes},
        dev_rows{piece * row_bytes},
        indices{piece},
        own{unique_stream::make()},
        host{host_rows.data()},
        dev{dev_rows.data()},
        idx{indices.data()},
        stream{own.get()} {}
  /// Indices first .. first + n - 1 into idx.
  void number_rows(std::size_t first, std::size_t n) const { iota_async(idx, n, first, stream); }
};

/// Every rank learns whether a rank's file work failed (collective); @p failure: this rank's.
inline void agree_on_failure(communicator& comm, char const* what, std::string const& failure) {
  collective_step<io_error>(comm, what, [&] {
    if (!failure.empty()) { throw io_error{failure}; }
  });
}

/**
 * Calls f(first, n) for the pieces of this rank's share of rows [0, rows) in global order (file
 * order: a block partition), `piece` rows at a time; every rank makes the same number of calls
 * (n = 0 once its share is done), so f may run collectives.
 */
template <class F>
void for_each_row_piece(std::size_t rows, communicator const& comm, std::size_t piece, F&& f) {
  block_partition const plan{rows, comm.size()};
  std::size_t const begin = plan.begin(comm.rank());
  std::size_t const end   = plan.end(comm.rank());
  for (std::size_t it = 0, pieces = row_pieces(rows, comm.size(), piece); it < pieces; ++it) {
    std::size_t const first = begin + it * piece;
    f(first, first < end ? std::min(piece, end - first) : std::size_t{0});
  }
}

}  // namespace detail

template <class T, location Location, layout Layout, mapping Mapping>
requires std::is_trivially_copyable_v<T>
void tensor<T, Location, Layout, Mapping>::load(std::span<std::filesystem::path const> files) {
  auto& comm = *comm_;
  scratch_->wait_idle("tensor load");  // this tensor's own async work first
  comm.expect_same("tensor.load", files.size());
  std::size_t const rb = row_bytes();
  std::vector<std::uint64_t> sizes;
  detail::collective_step<io_error>(comm, "tensor load (checking files)",
                                    [&] { sizes = detail::checked_sizes(files, rows_ * rb, rb); });
  detail::row_piece_buffers const buf{rb};
  std::string failure;
  detail::for_each_row_piece(rows_, comm, buf.piece, [&](std::size_t first, std::size_t n) {
    if (!failure.empty()) { n = 0; }  // keep taking part in the collective scatters
    try {
      if (n > 0) {
        detail::read_concatenated(files, sizes, first * rb, (first + n) * rb, buf.host);
      }
    } catch (std::exception const& e) {
      failure = e.what();
      n       = 0;
    }
    if (n > 0) {
      WM_CUDA_TRY(cudaMemcpyAsync(buf.dev, buf.host, n * rb, cudaMemcpyHostToDevice, buf.stream));
    }
    buf.number_rows(first, n);
    scatter(std::span<std::int64_t const>{buf.idx, n}, reinterpret_cast<T const*>(buf.dev),
            cuda::stream_ref{buf.stream});
  });
  detail::agree_on_failure(comm, "tensor load (reading)", failure);
}

template <class T, location Location, layout Layout, mapping Mapping>
requires std::is_trivially_copyable_v<T>
void tensor<T, Location, Layout, Mapping>::store(std::span<std::filesystem::path const> files) {
  auto& comm = *comm_;
  scratch_->wait_idle("tensor store");  // rows written by this tensor's async calls are stored
  comm.expect_same("tensor.store", files.size());
  std::size_t const rb = row_bytes();
  detail::unique_fd fd;
  detail::collective_step<io_error>(comm, "tensor store (creating files)", [&] {
    WM_EXPECTS(files.size() == static_cast<std::size_t>(comm.size()),
               "store needs one file per rank (" + std::to_string(comm.size()) + "), got " +
                   std::to_string(files.size()));
    auto const& f = files[static_cast<std::size_t>(comm.rank())];
    fd.reset(::open(f.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!fd.valid()) {
      throw io_error{"cannot create '" + f.string() + "': " + detail::errno_text()};
    }
  });
  detail::row_piece_buffers const buf{rb};
  std::string failure;
  detail::for_each_row_piece(rows_, comm, buf.piece, [&](std::size_t first, std::size_t n) {
    buf.number_rows(first, n);
    gather(std::span<std::int64_t const>{buf.idx, n}, reinterpret_cast<T*>(buf.dev),
           cuda::stream_ref{buf.stream});
    if (n > 0 && failure.empty()) {
      WM_CUDA_TRY(cudaMemcpy(buf.host, buf.dev, n * rb, cudaMemcpyDeviceToHost));
      if (!detail::write_all(fd.get(), buf.host, n * rb)) {
        failure = "writing '" + files[static_cast<std::size_t>(comm.rank())].string() +
                  "': " + detail::errno_text();
      }
    }
  });
  if (failure.empty() && ::close(fd.release()) != 0) {
    failure = "closing the file: " + detail::errno_text();
  }
  detail::agree_on_failure(comm, "tensor store (writing)", failure);
}

template <class T, location Location, layout Layout, mapping Mapping>
requires std::is_trivially_copyable_v<T> std::vector<std::filesystem::path>
tensor<T, Location, Layout, Mapping>::store(std::filesystem::path const& prefix) {
  auto files = memory<Location, Layout>::part_files(prefix, comm_->size());
  store(std::span<std::filesystem::path const>{files});
  return files;
}

}  // namespace wm
