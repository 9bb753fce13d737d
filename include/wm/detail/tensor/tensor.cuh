// SPDX-License-Identifier: Apache-2.0
// Bodies of wm::tensor's public API (declared in <wm/tensor.cuh>): construction and lifetime,
// the mapped layouts' gather/scatter kernels, and the distributed layout's calls into the
// exchange engine (detail/dispatch). File I/O is in files.cuh.
#pragma once

#include <wm/detail/base/cuda.cuh>
#include <wm/detail/base/resources.hpp>
#include <wm/detail/exchange/engine.cuh>
#include <wm/detail/exchange/plan.cuh>
#include <wm/detail/exchange/scratch.cuh>
#include <wm/detail/memory/plan.hpp>
#include <wm/detail/rows/distinct.cuh>
#include <wm/detail/rows/move.cuh>
#include <wm/detail/rows/views.cuh>
#include <wm/detail/tensor/mapped.cuh>
#include <wm/tensor.cuh>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <exception>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace wm {

template <class T, location Location, layout Layout, mapping Mapping>
requires std::is_trivially_copyable_v<T> tensor<T, Location, Layout, Mapping>::tensor(
    communicator& comm, std::size_t rows, std::size_t cols, std::size_t stride)
    : comm_{&comm},
      rows_{rows},
      cols_{cols},
      stride_{stride == 0 ? cols : stride},
      mem_{std::make_shared<memory<Location, Layout>>([&]() -> memory<Location, Layout> {
        WM_EXPECTS(cols >= 1, "a tensor row needs at least one element");
        WM_EXPECTS(stride == 0 || stride >= cols, "the row stride (" + std::to_string(stride) +
                                                      ") must be at least the row width (" +
                                                      std::to_string(cols) + ")");
        std::size_t const s = stride == 0 ? cols : stride;
        auto const counts   = Mapping::counts(rows, comm.size());  // the mapping sizes the parts
        return memory<Location, Layout>{comm, rows * s * sizeof(T), s * sizeof(T), counts};
      }())},
      scratch_{
          std::make_unique<detail::exchange_scratch>(comm, std::same_as<Layout, distributed>)} {}

template <class T, location Location, layout Layout, mapping Mapping>
requires std::is_trivially_copyable_v<T> tensor<T, Location, Layout, Mapping>::tensor(
    view_tag, communicator& comm, std::size_t rows, std::size_t cols, std::size_t stride,
    std::shared_ptr<memory<Location, Layout>> mem, std::size_t offset)
    : comm_{&comm},
      rows_{rows},
      cols_{cols},
      stride_{stride},
      mem_{std::move(mem)},
      offset_{offset},
      scratch_{
          std::make_unique<detail::exchange_scratch>(comm, std::same_as<Layout, distributed>)} {
  if constexpr (mapped_layout<Layout>) {
    if (offset_ == 0) { return; }
    // Every rank's first row at these columns, for the mapped gathers and refs.
    std::vector<std::byte*> host(static_cast<std::size_t>(mem_->world()));
    for (int r = 0; r < mem_->world(); ++r) {
      std::byte* const p                = mem_->part_data(r);
      host[static_cast<std::size_t>(r)] = p != nullptr ? p + offset_ : nullptr;
    }
    parts_ = std::make_unique<detail::device_buffer<std::byte*>>(host.size());
    WM_CUDA_TRY(cudaMemcpy(parts_->data(), host.data(), host.size() * sizeof(std::byte*),
                           cudaMemcpyHostToDevice));
  }
}

template <class T, location Location, layout Layout, mapping Mapping>
requires std::is_trivially_copyable_v<T>
template <class U>
tensor<U, Location, Layout, Mapping> tensor<T, Location, Layout, Mapping>::view_columns(
    std::size_t byte_offset, std::size_t cols) {
  std::size_t const stride = stride_bytes();
  WM_EXPECTS(cols >= 1, "view_columns: a row needs at least one element");
  WM_EXPECTS((offset_ + byte_offset) % alignof(U) == 0 && stride % sizeof(U) == 0,
             "view_columns: offset " + std::to_string(byte_offset) + " and row stride " +
                 std::to_string(stride) + " bytes must be multiples of the element's alignment (" +
                 std::to_string(alignof(U)) + ") and size (" + std::to_string(sizeof(U)) + ")");
  WM_EXPECTS(offset_ + byte_offset + cols * sizeof(U) <= stride,
             "view_columns: " + std::to_string(cols) + " elements of " + std::to_string(sizeof(U)) +
                 " bytes at offset " + std::to_string(byte_offset) +
                 " end past the row stride of " + std::to_string(stride) + " bytes");
  using view_type = tensor<U, Location, Layout, Mapping>;
  return view_type{typename view_type::view_tag{}, *comm_, rows_, cols, stride / sizeof(U), mem_,
                   offset_ + byte_offset};
}

template <class T, location Location, layout Layout, mapping Mapping>
requires std::is_trivially_copyable_v<T> tensor<T, Location, Layout, Mapping>::tensor(tensor&&)
noexcept = default;
template <class T, location Location, layout Layout, mapping Mapping>
requires std::is_trivially_copyable_v<T> tensor<T, Location, Layout, Mapping>
&tensor<T, Location, Layout, Mapping>::operator=(tensor&& other) noexcept {
  if (this == &other) { return *this; }
  // This tensor's async work ends, and its scratch (mailboxes into peers included) goes, before
  // its memory is freed; then it takes the other's memory and scratch (whose work goes on).
  if (scratch_) { (void)scratch_->drain(); }
  scratch_.reset();
  comm_    = other.comm_;
  rows_    = other.rows_;
  cols_    = other.cols_;
  stride_  = other.stride_;
  mem_     = std::move(other.mem_);
  offset_  = other.offset_;
  parts_   = std::move(other.parts_);
  scratch_ = std::move(other.scratch_);
  return *this;
}

template <class T, location Location, layout Layout, mapping Mapping>
requires std::is_trivially_copyable_v<T> tensor<T, Location, Layout, Mapping>::~tensor() {
  // The scratch (declared after the memory) goes first; its destructor waits for this tensor's
  // async work with the communicator's deadline (aborting it past the deadline, or while
  // unwinding from a call of this tensor that threw half-way: exchange_scratch::drain).
  if (scratch_) { (void)scratch_->drain(); }
}

template <class T, location Location, layout Layout, mapping Mapping>
requires std::is_trivially_copyable_v<T> std::uint64_t
tensor<T, Location, Layout, Mapping>::exchange_id()
const noexcept {
  return scratch_ ? scratch_->id : 0;
}

template <class T, location Location, layout Layout, mapping Mapping>
requires std::is_trivially_copyable_v<T> mapping_ref<Mapping>
tensor<T, Location, Layout, Mapping>::map_ref()
const noexcept {
  return make_mapping_ref<Mapping>(mem_->device_partition());
}

template <class T, location Location, layout Layout, mapping Mapping>
requires std::is_trivially_copyable_v<T> std::byte*
tensor<T, Location, Layout, Mapping>::local_data() const noexcept {
  auto const v = mem_->local_view();
  return v.data != nullptr && v.entries != 0 ? v.data + offset_ : nullptr;
}

template <class T, location Location, layout Layout, mapping Mapping>
requires std::is_trivially_copyable_v<T> std::byte* const*
tensor<T, Location, Layout, Mapping>::parts() const noexcept {
  if constexpr (mapped_layout<Layout>) {
    return offset_ == 0 ? mem_->chunked_view().chunks : parts_->data();
  } else {
    return nullptr;
  }
}

template <class T, location Location, layout Layout, mapping Mapping>
requires std::is_trivially_copyable_v<T> row_location
tensor<T, Location, Layout, Mapping>::locate(std::size_t k)
const {
  WM_EXPECTS(k < rows_,
             "row " + std::to_string(k) + " is out of range [0, " + std::to_string(rows_) + ")");
  auto const& p = mem_->partition();
  return make_mapping_ref<Mapping>(p.ref(p.starts().data())).locate(k);  // host starts
}

template <class T, location Location, layout Layout, mapping Mapping>
requires std::is_trivially_copyable_v<T> matrix_view<T>
tensor<T, Location, Layout, Mapping>::local_view()
const noexcept {
  return {reinterpret_cast<T*>(local_data()), mem_->local_view().entries, cols_, stride_};
}

template <class T, location Location, layout Layout, mapping Mapping>
requires std::is_trivially_copyable_v<T>
void tensor<T, Location, Layout, Mapping>::throw_if_error(cudaStream_t stream, char const* what) {
  WM_CUDA_TRY(cudaMemcpyAsync(scratch_->err_host.data(), scratch_->err.data(), sizeof(unsigned),
                              cudaMemcpyDeviceToHost, stream));
  if constexpr (std::same_as<Layout, distributed>) {
    comm_->synchronize(cuda::stream_ref{stream},
                       what);  // exchanges with peers: a peer that failed is an error
  } else {
    WM_CUDA_TRY(cudaStreamSynchronize(stream));  // local work: no deadline
  }
  if (*scratch_->err_host.data() != 0) {
    WM_CUDA_TRY(cudaMemsetAsync(scratch_->err.data(), 0, sizeof(unsigned), stream));
    WM_CUDA_TRY(cudaStreamSynchronize(stream));
    throw logic_error{std::string{"wm: "} + what +
                      ": an index was negative or not below the row count " +
                      std::to_string(rows_) + " (its output row is zero / nothing was written)"};
  }
}

template <class T, location Location, layout Layout, mapping Mapping>
requires std::is_trivially_copyable_v<T>
void tensor<T, Location, Layout, Mapping>::check_errors(cuda::stream_ref stream) {
  throw_if_error(stream.get(), "tensor gather/scatter");
}

template <class T, location Location, layout Layout, mapping Mapping>
requires std::is_trivially_copyable_v<T>
template <index_type Index>
void tensor<T, Location, Layout, Mapping>::gather_async(std::span<Index const> indices, T* out,
                                                        cuda::stream_ref stream) {
  if constexpr (Layout::mapped) {
    detail::expect_group_alive(*comm_, "gather");
    WM_EXPECTS(indices.empty() || (indices.data() != nullptr && out != nullptr),
               "gather: null indices or output");
    // Every call orders itself after the last one and records its end (store, load, move and
    // destruction wait for it), also when it uses no buffer.
    detail::scratch_use const use{*scratch_, stream.get()};
    detail::mapped_rows<Mapping> const rows{parts(), map_ref(), stride_bytes()};
    detail::packed_rows const dst{reinterpret_cast<std::byte*>(out), row_bytes()};
    std::size_t const n  = indices.size();
    cudaStream_t const s = stream.get();
    // Host memory and CUDA IPC mappings (chunked device) are slow to translate for random reads
    // over many GiB; reading long batches in ascending row order keeps the pages in flight few.
    // Output order is kept by writing each row to its original position.
    // One rank's chunked memory is its own plain allocation: nothing to translate.
    bool const sort_long =
        Location::is_host || (std::same_as<Layout, chunked> && comm_->size() > 1);
    // Other GPUs may have written host rows: compiled in only for host tables.
    constexpr std::bool_constant<Location::is_host> fresh{};
    if constexpr (Location::is_host) {
      if (n >= detail::host_distinct_threshold) {
        // Host rows: each distinct row crosses PCIe once (fresh, ascending rows), then is copied
        // on the device to the other positions that asked for it (hot keys of skewed batches),
        // those copies made while later rows cross. Batches and tables under 2^32 sort 32-bit
        // keys and positions (half the plan's bytes).
        auto const read = [&](auto const& b) {
          detail::read_distinct(rows, b, static_cast<std::size_t const*>(nullptr), dst, row_bytes(),
                                stride_bytes(), scratch_->err.data(), s, fresh);
        };
        if (detail::narrow_fits(rows_, n)) {
          read(detail::plan_distinct_narrow(indices.data(), n, rows_, scratch_->a, s));
        } else {
          read(detail::plan_distinct(indices.data(), n, detail::row_bits(rows_), scratch_->a, s));
        }
        return;
      }
    }
    if (sort_long && n >= detail::host_sort_threshold) {
      // Chunked device rows with block mapping: ascending order starts at the next rank's rows
      // and wraps around; ranks that all began at row 0 read the same owner at the same time
      // (seen with 4 ranks: chunked gathers at 0.59 of the peer-copy floor, continuous ones at
      // 0.87). Host rows have one home: nothing to spread. Rotated rows must fit in Index.
      std::size_t start = 0;
      if constexpr (contiguous_mapping<Mapping> && !Location::is_host) {
        if (rows_ > 0 && rows_ <= static_cast<std::size_t>(std::numeric_limits<Index>::max())) {
          start = mem_->entry_range((comm_->rank() + 1) % comm_->size()).begin % rows_;
        }
      }
      Index const* keys = indices.data();
      if (start != 0) {
        auto* rotated = reinterpret_cast<Index*>(scratch_->b.reserve(n * sizeof(Index), s));
        detail::rotate_rows(keys, rotated, n, rows_, rows_ - start, s);
        keys = rotated;
      }
      auto const sorted =
          detail::sort_with_positions(keys, n, detail::row_bits(rows_), scratch_->a, s);
      if (start != 0) { detail::rotate_rows(sorted.keys, sorted.keys, n, rows_, start, s); }
      detail::launch_gather(rows, sorted.keys, sorted.positions, n, dst, row_bytes(),
                            stride_bytes(), scratch_->err.data(), s, fresh);
    } else {
      detail::launch_gather(rows, indices.data(), static_cast<std::size_t const*>(nullptr), n, dst,
                            row_bytes(), stride_bytes(), scratch_->err.data(), s, fresh);
    }
  } else {
    detail::scratch_use const use{*scratch_, stream.get()};
    gather_dispatch(indices.data(), indices.size(), out, stream.get());
  }
}

template <class T, location Location, layout Layout, mapping Mapping>
requires std::is_trivially_copyable_v<T>
template <index_type Index>
void tensor<T, Location, Layout, Mapping>::gather(std::span<Index const> indices, T* out,
                                                  cuda::stream_ref stream) {
  gather_async(indices, out, stream);
  throw_if_error(stream.get(), "gather");
}

template <class T, location Location, layout Layout, mapping Mapping>
requires std::is_trivially_copyable_v<T>
template <index_type Index>
void tensor<T, Location, Layout, Mapping>::scatter_async(std::span<Index const> indices,
                                                         T const* values, cuda::stream_ref stream) {
  if constexpr (Layout::mapped) {
    detail::expect_group_alive(*comm_, "scatter");
    WM_EXPECTS(indices.empty() || (indices.data() != nullptr && values != nullptr),
               "scatter: null indices or values");
    std::size_t const n  = indices.size();
    cudaStream_t const s = stream.get();
    detail::scratch_use const use{*scratch_, s};
    if (n == 0) { return; }
    // Sort (index, position) stably on every bit: the last occurrence of each index is the last
    // of its run (an invalid index sharing a valid one's low bits must not split the run).
    auto const sorted =
        detail::sort_with_positions(indices.data(), n, int{sizeof(Index) * 8}, scratch_->a, s);
    detail::launch_scatter(
        detail::mapped_rows<Mapping>{parts(), map_ref(), stride_bytes()}, sorted.keys,
        sorted.positions, n,
        detail::packed_rows{reinterpret_cast<std::byte*>(const_cast<T*>(values)), row_bytes()},
        row_bytes(), stride_bytes(), scratch_->err.data(), s,
        std::bool_constant<Location::is_host>{});
  } else {
    detail::scratch_use const use{*scratch_, stream.get()};
    scatter_dispatch(indices.data(), indices.size(), values, stream.get());
  }
}

template <class T, location Location, layout Layout, mapping Mapping>
requires std::is_trivially_copyable_v<T>
template <index_type Index>
void tensor<T, Location, Layout, Mapping>::scatter(std::span<Index const> indices, T const* values,
                                                   cuda::stream_ref stream) {
  scatter_async(indices, values, stream);
  throw_if_error(stream.get(), "scatter");
}

template <class T, location Location, layout Layout, mapping Mapping>
requires std::is_trivially_copyable_v<T> row_path
tensor<T, Location, Layout, Mapping>::gather_path()
const noexcept {
  if constexpr (!std::same_as<Layout, distributed>) {
    return row_path::direct;
  } else {
    switch (scratch_->mail.mode) {
      case detail::mailbox::state::unknown: return row_path::undecided;
      case detail::mailbox::state::off: return row_path::nccl;
      default: return scratch_->mail.copy ? row_path::copy : row_path::put;
    }
  }
}

// ---- the distributed (model-parallel) path: the exchange engine -------------------------------

template <class T, location Location, layout Layout, mapping Mapping>
requires std::is_trivially_copyable_v<T>
template <class Index>
void tensor<T, Location, Layout, Mapping>::gather_dispatch(Index const* idx, std::size_t n, T* out,
                                                           cudaStream_t s) {
  auto& comm = *comm_;
  auto& sc   = *scratch_;
  // A null pointer is this rank's fault, reported to every rank by the count exchange.
  detail::exchange_call const call{detail::exchange_op::gather, row_bytes(),
                                   n > 0 && out == nullptr ? detail::exchange_fault::null_pointer
                                                           : detail::exchange_fault::none};
  // The last call's mailbox reads (joined into its stream before it ended; the caller's
  // scratch_use waits for that end) come before peers' writes of this call, which follow this
  // rank's keys. The order inside each owner's group does not matter here: every row finds its
  // place by p.order.
  auto const p = detail::plan_exchange(comm, map_ref(), idx, n, sc, s, call, false);
  detail::local_rows const table{local_data(), local_rows(), stride_bytes()};
  if constexpr (Location::is_host) {
    // Host rows: the owner reads each distinct row of a batch once. Only this GPU writes its
    // local rows (owner-side scatters and updates), so its L2 may serve them: not fresh.
    detail::distinct_reader<detail::local_rows> const read{table,
                                                           stride_bytes(),
                                                           row_bytes(),
                                                           sc.err.data(),
                                                           detail::row_bits(local_rows()),
                                                           &sc.reads,
                                                           s,
                                                           &sc.reads_aux,
                                                           std::false_type{}};
    detail::gather_rows(comm, sc, p, read, n, reinterpret_cast<std::byte*>(out), row_bytes(), s);
  } else {
    detail::gather_rows(comm, sc, p, table, stride_bytes(), n, reinterpret_cast<std::byte*>(out),
                        row_bytes(), s);
  }
}

template <class T, location Location, layout Layout, mapping Mapping>
requires std::is_trivially_copyable_v<T>
template <class Index>
void tensor<T, Location, Layout, Mapping>::scatter_dispatch(Index const* idx, std::size_t n,
                                                            T const* values, cudaStream_t s) {
  auto& comm = *comm_;
  auto& sc   = *scratch_;
  detail::exchange_call const call{detail::exchange_op::scatter, row_bytes(),
                                   n > 0 && values == nullptr ? detail::exchange_fault::null_pointer
                                                              : detail::exchange_fault::none};
  auto const p     = detail::plan_exchange(comm, map_ref(), idx, n, sc, s, call);
  auto const batch = detail::send_to_owners(comm, p, reinterpret_cast<std::byte const*>(values), n,
                                            row_bytes(), sc.b, sc.err.data(), s);
  // Owner side: stable sort by row; the last of each run (highest rank, then last position) wins.
  detail::scatter_owner_rows(batch, detail::local_rows{local_data(), local_rows(), stride_bytes()},
                             row_bytes(), stride_bytes(), sc.a, sc.err.data(), s);
}

}  // namespace wm

#include <wm/detail/tensor/files.cuh>
