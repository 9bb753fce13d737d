// SPDX-License-Identifier: Apache-2.0
/**
 * @file decl/memory.cuh
 * @brief The declarations of `<wm/memory.cuh>` without their bodies, for `<wm/wm.cuh>`: every
 * type and signature, none of the definitions (docs/design.md, "Compile time").
 */
#pragma once

#include <wm/decl/comm.hpp>
#include <wm/detail/memory/plan.hpp>
#include <wm/error.hpp>
#include <wm/partition.hpp>

#include <concepts>
#include <cstddef>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace wm {

namespace detail {  // the resource types that allocate each kind (detail/memory/)
class vmm_resource;
class ipc_resource;
class shared_host_resource;
template <bool Host>
class private_resource;
template <class Location, class Layout>
struct memory_impl;
}  // namespace detail

// ---- Policies ---------------------------------------------------------------------------------
//
// Each layout names, for each location, the resource type that allocates it (as cuco's storage
// policies name their implementation): the pair is chosen at compile time and the code of each
// kind lives in its own file under detail/memory/. The set is closed: `wm::location` and
// `wm::layout` accept these five types and no other.

/** @brief Location policy: pinned host memory, mapped into every GPU's address space. */
struct host {
  static constexpr bool is_host     = true;    ///< pinned host memory
  static constexpr char const* name = "host";  ///< for messages
};
/** @brief Location policy: GPU memory. */
struct device {
  static constexpr bool is_host     = false;     ///< GPU memory
  static constexpr char const* name = "device";  ///< for messages
};

/** @brief Layout policy: one pointer reaches the whole memory on every rank. */
struct continuous {
  static constexpr bool mapped      = true;          ///< peers' parts are mapped on every rank
  static constexpr char const* name = "continuous";  ///< for messages
  /// device: driver VMM, every rank's GPU memory mapped into one range; host: a shared memfd.
  template <class Location>
  using resource =
      std::conditional_t<Location::is_host, detail::shared_host_resource, detail::vmm_resource>;
};
/** @brief Layout policy: every rank maps every rank's part; one pointer per rank. */
struct chunked {
  static constexpr bool mapped      = true;       ///< peers' parts are mapped on every rank
  static constexpr char const* name = "chunked";  ///< for messages
  /// device: cudaMalloc + CUDA IPC handles; host: a shared memfd.
  template <class Location>
  using resource =
      std::conditional_t<Location::is_host, detail::shared_host_resource, detail::ipc_resource>;
};
/** @brief Layout policy: each rank reaches only its own part. */
struct distributed {
  static constexpr bool mapped      = false;          ///< no peer maps this rank's part
  static constexpr char const* name = "distributed";  ///< for messages
  /// device: cudaMalloc; host: cudaMallocHost. No peer maps it.
  template <class Location>
  using resource = detail::private_resource<Location::is_host>;
};

/** @brief A memory location policy: `wm::host` or `wm::device` (no other type). */
template <class T>
concept location = std::same_as<T, host> || std::same_as<T, device>;

/**
 * @brief A memory layout (mapping strategy) policy: `wm::continuous`, `wm::chunked` or
 * `wm::distributed` (no other type: each one comes with its allocation code).
 */
template <class T>
concept layout =
    std::same_as<T, continuous> || std::same_as<T, chunked> || std::same_as<T, distributed>;

/** @brief Layouts whose peers' parts are mapped on every rank (continuous, chunked). */
template <class T>
concept mapped_layout = layout<T> && T::mapped;

// ---- Views ------------------------------------------------------------------------------------

/** @brief This rank's own part; directly accessible from this rank's GPU (every layout). */
struct local_view {
  std::byte* data{};          ///< first byte of this rank's part (device-accessible)
  std::size_t first_entry{};  ///< global index of the first local entry
  std::size_t entries{};      ///< number of local entries
  std::size_t granularity{};  ///< bytes per entry

  /// Bytes of this rank's part.
  [[nodiscard]] WM_HOST_DEVICE std::size_t bytes() const noexcept { return entries * granularity; }
  /// Address of global entry @p e, which must be local.
  [[nodiscard]] WM_HOST_DEVICE std::byte* entry(std::size_t e) const noexcept {
    return data + (e - first_entry) * granularity;
  }
};

/** @brief Every rank's part through one pointer per rank (continuous and chunked layouts). */
struct chunked_view {
  std::byte* const* chunks{};  ///< device array: start of each rank's part (null if empty)
  partition_ref partition{};   ///< which rank owns which entries (starts in device memory)
  std::size_t granularity{};   ///< bytes per entry

#if defined(__CUDACC__)
  /// Address of global entry @p e (device code).
  [[nodiscard]] __device__ std::byte* entry(std::size_t e) const noexcept {
    int const r = partition.owner(e);
    return chunks[r] + (e - partition.begin(r)) * granularity;
  }
#endif
};

/** @brief The whole memory at one pointer (continuous layout). */
struct continuous_view {
  std::byte* data{};          ///< first byte of the whole memory
  std::size_t entries{};      ///< total entries
  std::size_t granularity{};  ///< bytes per entry

  /// Bytes of the whole memory.
  [[nodiscard]] WM_HOST_DEVICE std::size_t bytes() const noexcept { return entries * granularity; }
  /// Address of global entry @p e.
  [[nodiscard]] WM_HOST_DEVICE std::byte* entry(std::size_t e) const noexcept {
    return data + e * granularity;
  }
};

/** @brief A half-open range [begin, end). */
struct index_range {
  std::size_t begin{};  ///< first index
  std::size_t end{};    ///< one past the last index
  /// `end - begin`.
  [[nodiscard]] constexpr std::size_t size() const noexcept { return end - begin; }
  friend constexpr bool operator==(index_range, index_range) = default;
};

// ---- memory -----------------------------------------------------------------------------------

/**
 * @brief One logical allocation of `total_bytes` owned by all ranks of a communicator.
 *
 * The memory is `total_bytes / granularity` entries of `granularity` bytes, partitioned over the
 * ranks by `wm::block_partition` (or a user-given per-rank entry list); an entry is never split.
 * Construction and destruction are collective. The communicator must outlive the memory.
 * Move-only.
 *
 * @tparam Location `wm::host` or `wm::device`
 * @tparam Layout `wm::continuous`, `wm::chunked` or `wm::distributed`
 */
template <location Location, layout Layout>
class memory {
 public:
  using location_type = Location;  ///< `wm::host` or `wm::device`
  using layout_type   = Layout;    ///< `wm::continuous`, `wm::chunked` or `wm::distributed`

  /**
   * @brief Allocates collectively with the default block partition.
   * @param comm the owning group; every rank calls with the same sizes
   * @param total_bytes total size; a multiple of @p granularity (0 is allowed)
   * @param granularity bytes per entry (> 0)
   * @throw wm::logic_error on bad sizes, or a mapped layout over several nodes
   * @throw wm::comm_error if ranks pass different arguments
   * @throw wm::cuda_error if an allocation or mapping fails
   */
  memory(communicator& comm, std::size_t total_bytes, std::size_t granularity = 1);

  /// As above, with rank r owning `entries_per_rank[r]` entries.
  memory(communicator& comm, std::size_t total_bytes, std::size_t granularity,
         std::span<std::size_t const> entries_per_rank);

  /// Deduction form: `wm::memory m{comm, bytes, granularity, wm::device{}, wm::chunked{}};`
  memory(communicator& comm, std::size_t total_bytes, std::size_t granularity, Location, Layout)
      : memory(comm, total_bytes, granularity) {}

  /// Takes @p other's allocation; @p other is left empty (its destructor frees nothing).
  memory(memory&&) noexcept;
  /// Frees this memory (collective, as the destructor), then takes @p other's allocation.
  memory& operator=(memory&&) noexcept;
  memory(memory const&)            = delete;
  memory& operator=(memory const&) = delete;
  /**
   * @brief Collective: frees mappings, handles, shared and registered memory. Never throws.
   * The release barriers carry a descriptor of their own ("memory release"), never that of
   * `communicator::barrier`. Destroyed by stack unwinding (this rank is failing), it waits for
   * its peers at most 5 s (peers failing with it, after an error every rank saw, meet it at
   * once and the communicator stays usable); when a peer does not reach its release in time
   * (gone, busy elsewhere, or in another collective), the communicator is aborted, so that the
   * peers' waits fail at once, and the memory is freed without waiting further.
   */
  ~memory();

  [[nodiscard]] std::size_t total_bytes() const noexcept;           ///< bytes in all
  [[nodiscard]] std::size_t granularity() const noexcept;           ///< bytes per entry
  [[nodiscard]] std::size_t entries() const noexcept;               ///< entries in all
  [[nodiscard]] block_partition const& partition() const noexcept;  ///< who owns what
  [[nodiscard]] int rank() const noexcept;                          ///< this rank
  [[nodiscard]] int world() const noexcept;                         ///< number of ranks
  /// Entries owned by @p rank.
  [[nodiscard]] index_range entry_range(int rank) const;
  /// Bytes owned by @p rank (offsets into the whole memory).
  [[nodiscard]] index_range byte_range(int rank) const;
  /// Entries owned by this rank.
  [[nodiscard]] index_range local_entry_range() const { return entry_range(rank()); }
  /// Bytes owned by this rank (offsets into the whole memory).
  [[nodiscard]] index_range local_byte_range() const { return byte_range(rank()); }

  /// This rank's part (every layout).
  [[nodiscard]] wm::local_view local_view() const noexcept;
  /// Every rank's part, one pointer per rank (continuous and chunked only).
  [[nodiscard]] wm::chunked_view chunked_view() const noexcept requires mapped_layout<Layout>;
  /// Start of @p rank's part as this rank's GPU addresses it, for host code that hands it to
  /// kernels (continuous and chunked only; null if that rank owns nothing).
  [[nodiscard]] std::byte* part_data(int rank) const requires mapped_layout<Layout>;
  /// The partition with its starts in device memory, for kernels (every layout).
  [[nodiscard]] partition_ref device_partition() const noexcept;
  /// The whole memory at one pointer (continuous only).
  [[nodiscard]] wm::continuous_view continuous_view()
      const noexcept requires std::same_as<Layout, continuous>;

  /**
   * @brief Fills the memory from raw binary files, logically concatenated (collective).
   * Each rank reads only the bytes it owns, in large sequential reads; device memory is filled
   * through a bounded pinned staging buffer.
   * @throw wm::io_error on every rank if any file is missing or unreadable, a file's size is not
   * a multiple of the granularity, or the sizes do not add up to `total_bytes()`
   */
  void load(std::span<std::filesystem::path const> files);
  /// As above, from one file.
  void load(std::filesystem::path const& file) { load(std::span{&file, 1}); }

  /**
   * @brief Writes each rank's part to its own file (collective): rank r writes `files[r]`.
   * A rank that owns nothing writes an empty file, so the list loads back as it is.
   * @throw wm::io_error on every rank if any rank could not write
   */
  void store(std::span<std::filesystem::path const> files) const;
  /// As above, into `<prefix>.rank<r>-of-<world>.bin`; returns every rank's file, in rank order.
  std::vector<std::filesystem::path> store(std::filesystem::path const& prefix) const;

  /// The file names `store(prefix)` writes for @p world ranks.
  [[nodiscard]] static std::vector<std::filesystem::path> part_files(
      std::filesystem::path const& prefix, int world);

 private:
  void release() noexcept;  // the collective part of destruction
  std::unique_ptr<detail::memory_impl<Location, Layout>> r_;
};

/// Deduces `wm::memory<Location, Layout>` from tag objects: `wm::memory m{comm, n, g, wm::device{},
/// wm::chunked{}};`.
template <location Location, layout Layout>
memory(communicator&, std::size_t, std::size_t, Location, Layout) -> memory<Location, Layout>;

}  // namespace wm
