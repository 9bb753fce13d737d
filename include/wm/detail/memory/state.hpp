// SPDX-License-Identifier: Apache-2.0
// What every kind of wm::memory shares: sizes, partition, and the pointers its views show. The
// resource types (vmm.hpp, ipc.hpp, shared_host.hpp, private.hpp) fill the pointers.
#pragma once

#include <wm/comm.hpp>
#include <wm/error.hpp>
#include <wm/partition.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace wm::detail {

/// The sizes, partition and view pointers of one rank's part of one allocation.
struct memory_state {
  communicator* comm{};
  block_partition part;
  std::size_t total{};   // bytes in all
  std::size_t gran{};    // bytes per entry
  int device{};          // this rank's GPU
  std::uint64_t args{};  // what every rank agreed on at construction (names releases)

  std::byte* local{};              // device-accessible start of this rank's part
  std::byte* local_host{};         // host-accessible start of this rank's part (host locations)
  std::byte* base{};               // continuous layouts: the whole range
  std::vector<std::byte*> chunks;  // mapped layouts: start of each rank's part (null if empty)

  [[nodiscard]] int rank() const noexcept { return comm->rank(); }
  [[nodiscard]] int world() const noexcept { return comm->size(); }
  [[nodiscard]] std::size_t local_bytes() const { return part.count(rank()) * gran; }

  /// Every rank's part inside one range at @p whole (continuous and host layouts).
  void chunks_from_base(std::byte* whole) {
    base = whole;
    chunks.assign(static_cast<std::size_t>(world()), nullptr);
    for (int p = 0; p < world(); ++p) {
      if (whole != nullptr) { chunks[static_cast<std::size_t>(p)] = whole + part.begin(p) * gran; }
    }
    local = chunks[static_cast<std::size_t>(rank())];
  }
};

/// Makes @p device current for a scope (releases may run on any thread); restores the previous.
class device_scope {
 public:
  explicit device_scope(int device) noexcept {
    restore_ = cudaGetDevice(&previous_) == cudaSuccess;
    (void)cudaSetDevice(device);
  }
  device_scope(device_scope const&)            = delete;
  device_scope& operator=(device_scope const&) = delete;
  ~device_scope() {
    if (restore_) { (void)cudaSetDevice(previous_); }
  }

 private:
  int previous_{};
  bool restore_{false};
};

/**
 * Device copy of the partition starts (world + 1) followed by the chunk pointers (world), for
 * `partition_ref` and `chunked_view` in kernels.
 */
class partition_table {
 public:
  partition_table() = default;
  /// Copies @p s's starts and chunk pointers to the device. @throw wm::cuda_error
  explicit partition_table(memory_state const& s) : device_{s.device} {
    auto const world = static_cast<std::size_t>(s.world());
    std::vector<std::size_t> meta(2 * world + 1, 0);
    std::copy(s.part.starts().begin(), s.part.starts().end(), meta.begin());
    for (std::size_t p = 0; p < s.chunks.size(); ++p) {
      meta[world + 1 + p] = reinterpret_cast<std::uintptr_t>(s.chunks[p]);
    }
    WM_CUDA_TRY(cudaMalloc(&table_, meta.size() * sizeof(std::size_t)));
    cudaError_t const copied =
        cudaMemcpy(table_, meta.data(), meta.size() * sizeof(std::size_t), cudaMemcpyHostToDevice);
    if (copied != cudaSuccess) { reset(); }
    WM_CUDA_TRY(copied);
  }
  partition_table(partition_table&& o) noexcept
      : table_{std::exchange(o.table_, nullptr)}, device_{o.device_} {}
  partition_table& operator=(partition_table&& o) noexcept {
    if (this != &o) {
      reset();
      table_  = std::exchange(o.table_, nullptr);
      device_ = o.device_;
    }
    return *this;
  }
  partition_table(partition_table const&)            = delete;
  partition_table& operator=(partition_table const&) = delete;
  ~partition_table() { reset(); }

  [[nodiscard]] std::size_t const* starts() const noexcept { return table_; }
  [[nodiscard]] std::byte* const* chunks(int world) const noexcept {
    return reinterpret_cast<std::byte* const*>(table_ + world + 1);
  }

 private:
  void reset() noexcept {
    if (table_ == nullptr) { return; }
    device_scope const on{device_};
    (void)cudaFree(table_);
    table_ = nullptr;
  }
  std::size_t* table_{};
  int device_{};
};

}  // namespace wm::detail
