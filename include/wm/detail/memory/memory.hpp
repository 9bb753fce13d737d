// SPDX-License-Identifier: Apache-2.0
// Bodies of wm::memory (declared in <wm/memory.cuh>). Each Location × Layout pair names its
// resource type (`Layout::resource<Location>`: vmm.hpp, ipc.hpp, shared_host.hpp, private.hpp);
// this file holds what every kind shares: construction, the collective release, and file I/O
// (io.hpp).
#pragma once

#include <wm/comm.hpp>
#include <wm/detail/base/hash.hpp>
#include <wm/detail/memory/collective.hpp>
#include <wm/detail/memory/io.hpp>
#include <wm/detail/memory/ipc.hpp>
#include <wm/detail/memory/plan.hpp>
#include <wm/detail/memory/private.hpp>
#include <wm/detail/memory/shared_host.hpp>
#include <wm/detail/memory/state.hpp>
#include <wm/detail/memory/vmm.hpp>
#include <wm/error.hpp>
#include <wm/partition.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace wm {
namespace detail {

/**
 * What one rank holds for one allocation of kind (Location, Layout): the shared state, the
 * kind's resource (allocated collectively in the constructor, freed locally in the destructor)
 * and the device partition table. `release` is the collective part of destruction.
 */
template <class Location, class Layout>
struct memory_impl {
  using resource_type = typename Layout::template resource<Location>;

  memory_state state;
  resource_type resource;
  partition_table table;
  int uncaught{std::uncaught_exceptions()};  // at construction: more at destruction = unwinding

  explicit memory_impl(memory_state s) : state{std::move(s)}, resource{state} {
    try {
      collective_step(*state.comm, "memory: partition table",
                      [&] { table = partition_table{state}; });
    } catch (...) {
      // The step failed on every rank together.
      close_and_wait(state.comm->valid() ? state.comm->timeout() : std::chrono::milliseconds{0});
      throw;
    }
  }
  memory_impl(memory_impl const&)            = delete;
  memory_impl& operator=(memory_impl const&) = delete;

  /**
   * The collective part of destruction (never throws): nobody may still be reading a peer's
   * part, and an owner whose part peers opened frees it only after every peer closed it. Run
   * by stack unwinding (this rank is failing), it waits for its peers at most
   * `unwinding_release_limit`; when a release barrier fails (then the communicator is aborted)
   * the rest are skipped, this rank closes what it opened and frees what it may: a part that
   * peers open and that does not outlive their mappings by itself (chunked·device, CUDA IPC) is
   * kept until the process ends, since peers may still read it (docs/design.md, "Memory kinds").
   */
  void release() noexcept {
    bool const unwinding = std::uncaught_exceptions() > uncaught;
    auto const timeout = state.comm->valid() ? state.comm->timeout() : std::chrono::milliseconds{0};
    auto const limit   = unwinding ? std::min(timeout, unwinding_release_limit) : timeout;
    if (!release_barrier(*state.comm, state.args, limit)) {
      resource.close_imports();
      keep_for_peers();
      return;
    }
    close_and_wait(limit);
  }

 private:
  void close_and_wait(std::chrono::milliseconds limit) noexcept {
    resource.close_imports();
    if constexpr (resource_type::peers_import) {
      if (!release_barrier(*state.comm, state.args, limit)) { keep_for_peers(); }
    }
  }
  /// The release agreement failed: peers may not have closed this rank's part yet.
  void keep_for_peers() noexcept {
    if constexpr (resource_type::peers_import) { resource.keep_for_peers(); }
  }
};

}  // namespace detail

// ---- memory members ---------------------------------------------------------------------------

template <location Location, layout Layout>
memory<Location, Layout>::memory(communicator& comm, std::size_t total_bytes,
                                 std::size_t granularity)
    : memory(comm, total_bytes, granularity, std::span<std::size_t const>{}) {}

template <location Location, layout Layout>
memory<Location, Layout>::memory(communicator& comm, std::size_t total_bytes,
                                 std::size_t granularity,
                                 std::span<std::size_t const> entries_per_rank) {
  WM_EXPECTS(comm.valid(), "the communicator is empty");
  WM_EXPECTS(granularity > 0, "the granularity must be at least 1 byte");
  WM_EXPECTS(total_bytes % granularity == 0, "the total size " + std::to_string(total_bytes) +
                                                 " is not a multiple of the granularity " +
                                                 std::to_string(granularity));
  if constexpr (Layout::mapped) {
    WM_EXPECTS(comm.single_node(),
               std::string{"the "} + Layout::name +
                   " layout maps every rank's memory and needs all ranks on one "
                   "node; use wm::distributed across nodes");
  }
  std::uint64_t args = detail::mix64(total_bytes, granularity);
  args               = detail::fnv1a(Location::name, detail::fnv1a(Layout::name, args));
  for (auto c : entries_per_rank) { args = detail::mix64(args, c); }
  comm.expect_same("memory", args);

  detail::memory_state s;
  s.comm  = &comm;
  s.total = total_bytes;
  s.gran  = granularity;
  s.args  = args;
  s.part  = entries_per_rank.empty()
                ? block_partition{total_bytes / granularity, comm.size()}
                : block_partition{total_bytes / granularity, comm.size(), entries_per_rank};
  WM_CUDA_TRY(cudaGetDevice(&s.device));
  r_ = std::make_unique<detail::memory_impl<Location, Layout>>(std::move(s));
}

template <location Location, layout Layout>
memory<Location, Layout>::memory(memory&&) noexcept = default;

template <location Location, layout Layout>
memory<Location, Layout>& memory<Location, Layout>::operator=(memory&& other) noexcept {
  if (this != &other) {
    release();
    r_ = std::move(other.r_);
  }
  return *this;
}

template <location Location, layout Layout>
memory<Location, Layout>::~memory() {
  release();
}

template <location Location, layout Layout>
void memory<Location, Layout>::release() noexcept {
  if (!r_) { return; }
  r_->release();
  r_.reset();
}

template <location Location, layout Layout>
std::size_t memory<Location, Layout>::total_bytes() const noexcept {
  return r_->state.total;
}
template <location Location, layout Layout>
std::size_t memory<Location, Layout>::granularity() const noexcept {
  return r_->state.gran;
}
template <location Location, layout Layout>
std::size_t memory<Location, Layout>::entries() const noexcept {
  return r_->state.part.entries();
}
template <location Location, layout Layout>
block_partition const& memory<Location, Layout>::partition() const noexcept {
  return r_->state.part;
}
template <location Location, layout Layout>
int memory<Location, Layout>::rank() const noexcept {
  return r_->state.comm->rank();
}
template <location Location, layout Layout>
int memory<Location, Layout>::world() const noexcept {
  return r_->state.comm->size();
}

template <location Location, layout Layout>
index_range memory<Location, Layout>::entry_range(int rank) const {
  WM_EXPECTS(rank >= 0 && rank < world(), "rank " + std::to_string(rank) + " is out of range");
  return {r_->state.part.begin(rank), r_->state.part.end(rank)};
}

template <location Location, layout Layout>
index_range memory<Location, Layout>::byte_range(int rank) const {
  auto const e = entry_range(rank);
  return {e.begin * r_->state.gran, e.end * r_->state.gran};
}

template <location Location, layout Layout>
wm::local_view memory<Location, Layout>::local_view() const noexcept {
  int const me = rank();
  return {r_->state.local, r_->state.part.begin(me), r_->state.part.count(me), r_->state.gran};
}

template <location Location, layout Layout>
wm::chunked_view memory<Location, Layout>::chunked_view() const noexcept requires
    mapped_layout<Layout> {
  return {r_->table.chunks(world()), r_->state.part.ref(r_->table.starts()), r_->state.gran};
}

template <location Location, layout Layout>
std::byte* memory<Location, Layout>::part_data(int rank) const requires mapped_layout<Layout> {
  WM_EXPECTS(rank >= 0 && rank < world(), "part_data: rank " + std::to_string(rank) +
                                              " is not in [0, " + std::to_string(world()) + ")");
  return r_->state.chunks[static_cast<std::size_t>(rank)];
}

template <location Location, layout Layout>
partition_ref memory<Location, Layout>::device_partition() const noexcept {
  return r_->state.part.ref(r_->table.starts());
}

template <location Location, layout Layout>
wm::continuous_view memory<Location, Layout>::continuous_view()
    const noexcept requires std::same_as<Layout, continuous> {
  return {r_->state.base, r_->state.part.entries(), r_->state.gran};
}

template <location Location, layout Layout>
void memory<Location, Layout>::load(std::span<std::filesystem::path const> files) {
  auto& comm = *r_->state.comm;
  comm.expect_same("memory.load", files.size());
  std::vector<std::uint64_t> sizes(files.size());
  detail::collective_step<io_error>(comm, "memory load (checking files)", [&] {
    sizes = detail::checked_sizes(files, r_->state.total, r_->state.gran);
  });
  detail::collective_step<io_error>(comm, "memory load (reading)",
                                    [&] { detail::read_part(r_->state, files, sizes); });
}

template <location Location, layout Layout>
void memory<Location, Layout>::store(std::span<std::filesystem::path const> files) const {
  auto& comm = *r_->state.comm;
  comm.expect_same("memory.store", files.size());
  detail::collective_step<io_error>(comm, "memory store", [&] {
    WM_EXPECTS(files.size() == static_cast<std::size_t>(comm.size()),
               "store needs one file per rank (" + std::to_string(comm.size()) + "), got " +
                   std::to_string(files.size()));
    detail::write_part(r_->state, files[static_cast<std::size_t>(comm.rank())]);
  });
}

template <location Location, layout Layout>
std::vector<std::filesystem::path> memory<Location, Layout>::part_files(
    std::filesystem::path const& prefix, int world) {
  std::vector<std::filesystem::path> out;
  for (int r = 0; r < world; ++r) {
    out.emplace_back(prefix.string() + ".rank" + std::to_string(r) + "-of-" +
                     std::to_string(world) + ".bin");
  }
  return out;
}

template <location Location, layout Layout>
std::vector<std::filesystem::path> memory<Location, Layout>::store(
    std::filesystem::path const& prefix) const {
  auto files = part_files(prefix, world());
  store(std::span<std::filesystem::path const>{files});
  return files;
}

}  // namespace wm
