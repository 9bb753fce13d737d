// SPDX-License-Identifier: Apache-2.0
/**
 * @file decl/tensor.cuh
 * @brief The declarations of `<wm/tensor.cuh>` without their bodies, for `<wm/wm.cuh>`: every
 * type and signature, none of the definitions (docs/design.md, "Compile time").
 */
#pragma once

#include <wm/decl/comm.hpp>
#include <wm/decl/memory.cuh>
#include <wm/partition.hpp>

#include <cuda/stream_ref>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <type_traits>

namespace wm {

/** @brief Index types accepted by gather/scatter. */
template <class I>
concept index_type = std::same_as<I, std::int32_t> || std::same_as<I, std::int64_t>;

/** @brief A strided 2D view of rows (`stride >= cols` elements between row starts). */
template <class T>
struct matrix_view {
  T* data{};             ///< first element of row 0
  std::size_t rows{};    ///< number of rows
  std::size_t cols{};    ///< elements per row
  std::size_t stride{};  ///< elements between row starts
  /// First element of row @p r.
  [[nodiscard]] WM_HOST_DEVICE T* row(std::size_t r) const noexcept { return data + r * stride; }
  /// Element @p c of row @p r.
  [[nodiscard]] WM_HOST_DEVICE T& operator()(std::size_t r, std::size_t c) const noexcept {
    return data[r * stride + c];
  }
};

/**
 * @brief A tensor as user kernels see it: trivially copyable, passed to kernels by value
 * (`t.ref()`; `std::as_const(t).ref()` or `embedding::ref()` for a read-only one).
 *
 * Every layout offers this rank's rows, `local_row(l)`. Mapped layouts (continuous, chunked)
 * also offer any row, `row(k)`, through the per-rank mappings and the tensor's mapping. On the
 * distributed layout another rank's row needs an exchange (`tensor::gather`): `row(k)` does not
 * exist there, and calling it does not compile. With `T const` every row is read-only.
 *
 * @tparam T element type; `const`-qualified for a read-only ref
 * @tparam Layout, Mapping the tensor's
 */
template <class T, layout Layout, mapping Mapping>
class tensor_ref {
 public:
  using value_type   = T;        ///< the element type (`const` for a read-only ref)
  using layout_type  = Layout;   ///< the tensor's layout policy
  using mapping_type = Mapping;  ///< the tensor's mapping policy

  tensor_ref() = default;
  /// Made by `tensor::ref()`. @p parts: device array of each rank's part (mapped layouts;
  /// null otherwise); @p local: this rank's first row; @p map: the tensor's mapping.
  tensor_ref(std::byte* const* parts, T* local, std::size_t local_rows, mapping_ref<Mapping> map,
             std::size_t cols, std::size_t stride, int rank) noexcept;
  /// The read-only form of a writable ref.
  template <class U>
  tensor_ref(
      tensor_ref<U, Layout, Mapping> const& other) noexcept requires std::same_as<T, U const>;

  [[nodiscard]] WM_HOST_DEVICE std::size_t rows() const noexcept;        ///< rows in all
  [[nodiscard]] WM_HOST_DEVICE std::size_t cols() const noexcept;        ///< elements per row
  [[nodiscard]] WM_HOST_DEVICE std::size_t stride() const noexcept;      ///< elements between rows
  [[nodiscard]] WM_HOST_DEVICE std::size_t local_rows() const noexcept;  ///< rows of this rank
  [[nodiscard]] WM_HOST_DEVICE int rank() const noexcept;                ///< this rank
  /// Owner rank and local row of global row @p k (k < rows()); mine if `rank == rank()`.
  [[nodiscard]] WM_HOST_DEVICE row_location locate(std::size_t k) const noexcept;
  /// This rank's local row @p l (l < local_rows()): `cols()` elements in memory this GPU reads.
  [[nodiscard]] WM_HOST_DEVICE T* local_row(std::size_t l) const noexcept;
#if defined(__CUDACC__)
  /// Global row @p k (k < rows()), whichever rank owns it (mapped layouts only; device code).
  [[nodiscard]] __device__ T* row(std::size_t k) const noexcept requires mapped_layout<Layout>;
#endif

 private:
  template <class, layout, mapping>
  friend class tensor_ref;

  std::byte* const* parts_{};
  T* local_{};
  std::size_t local_rows_{};
  mapping_ref<Mapping> map_{};
  std::size_t cols_{};
  std::size_t stride_{};
  int rank_{};
};

/// How other ranks' rows reach a distributed gather (see `tensor::gather_path`).
enum class row_path {
  undecided,  ///< no distributed gather has run yet (the first one decides, collectively)
  direct,     ///< mapped layouts: kernels read rows through the views; nothing is dispatched
  nccl,       ///< through NCCL (across nodes, no peer access, one rank, or WM_DISPATCH_ROWS=nccl)
  put,        ///< owners' gather kernels store rows into the asking rank's mailbox
  copy,       ///< owners gather locally; the copy engines move rows into the mailbox
};

namespace detail {
struct exchange_scratch;  // workspaces, error state and ordering event
                          // (detail/exchange/scratch.cuh)
template <class T, bool Pinned>
class cuda_buffer;  // detail/base/resources.hpp
}  // namespace detail

/**
 * @brief A tensor of `rows` × `cols` elements of T, rows partitioned over the communicator's
 * ranks by @p Mapping and stored in a `wm::memory<Location, Layout>`.
 *
 * Construction and destruction are collective. A 1D tensor is a tensor with `cols == 1`.
 *
 * @tparam T element type (float, half, bfloat16, int32, int64, any trivially copyable type)
 * @tparam Location `wm::device` or `wm::host`
 * @tparam Layout `wm::continuous`, `wm::chunked` or `wm::distributed`
 * @tparam Mapping `wm::block` (contiguous row ranges; default), `wm::cyclic` (row k on rank
 * k % world), or any type satisfying `wm::mapping` (the tensor asks it where each row lives)
 */
template <class T, location Location = device, layout Layout = chunked, mapping Mapping = block>
requires std::is_trivially_copyable_v<T>
class tensor {
 public:
  using value_type    = T;         ///< the element type
  using location_type = Location;  ///< `wm::host` or `wm::device`
  using layout_type   = Layout;    ///< `wm::continuous`, `wm::chunked` or `wm::distributed`
  using mapping_type  = Mapping;   ///< which rank owns which row

  /**
   * @brief Allocates collectively.
   * @param comm the owning group (must outlive the tensor)
   * @param rows number of rows (0 allowed)
   * @param cols elements per row (>= 1)
   * @param stride elements between row starts (>= cols; 0 means cols). A stride that makes rows
   * a multiple of 16 bytes lets gather/scatter use 16-byte accesses.
   * @throw wm::logic_error on bad sizes; see `wm::memory` for the rest
   */
  tensor(communicator& comm, std::size_t rows, std::size_t cols = 1, std::size_t stride = 0);

  /// Takes @p other's memory and buffers; @p other is left empty.
  tensor(tensor&&) noexcept;
  /// Waits for this tensor's last call to end (as `store` does), frees it, then takes @p other's.
  tensor& operator=(tensor&&) noexcept;
  ~tensor();

  /**
   * @brief A tensor of @p cols elements of U at @p byte_offset into each of this tensor's rows,
   * over the same memory: the same rows, mapping and owners, nothing copied (the memory lives
   * while any tensor over it lives). Collective, as construction. An embedding on a host table
   * keeps each row's weights, optimizer state and step in one record so: its states and steps
   * are views into the weight tensor's rows (one scattered host access per row, not three).
   * @throw wm::logic_error unless @p byte_offset is a multiple of `alignof(U)`, the stride in
   * bytes a multiple of `sizeof(U)`, `cols >= 1` and the columns end within the stride
   */
  template <class U>
  [[nodiscard]] tensor<U, Location, Layout, Mapping> view_columns(std::size_t byte_offset,
                                                                  std::size_t cols);

  /// Rows in all.
  [[nodiscard]] std::size_t rows() const noexcept { return rows_; }
  /// Elements per row.
  [[nodiscard]] std::size_t cols() const noexcept { return cols_; }
  /// Elements between row starts (>= cols()).
  [[nodiscard]] std::size_t stride() const noexcept { return stride_; }
  /// The owning group.
  [[nodiscard]] communicator& comm() const noexcept { return *comm_; }
  /// The underlying memory (entries are rows of `stride * sizeof(T)` bytes).
  /// (A `view_columns` tensor's columns start `column_offset()` bytes into each entry.)
  [[nodiscard]] memory<Location, Layout>& storage() noexcept { return *mem_; }
  /// Read-only form of `storage()`.
  [[nodiscard]] memory<Location, Layout> const& storage() const noexcept { return *mem_; }
  /// Bytes into each row where this tensor's columns start (0 but for `view_columns`).
  [[nodiscard]] std::size_t column_offset() const noexcept { return offset_; }
  /// Number of rows this rank owns.
  [[nodiscard]] std::size_t local_rows() const noexcept { return mem_->local_view().entries; }
  /// The mapping in the form kernels take (block: partition starts in device memory).
  [[nodiscard]] mapping_ref<Mapping> device_mapping() const noexcept { return map_ref(); }
  /// Where global row @p k lives (host-side helper).
  [[nodiscard]] row_location locate(std::size_t k) const;
  /// The id of this tensor in its distributed calls' headers: agreed at construction (and by
  /// `view_columns`), the same on every rank and distinct among the communicator's distributed
  /// tensors, so that ranks gathering or scattering on different tensors throw on every rank;
  /// 0 on mapped layouts (they exchange no headers) and for a moved-from tensor.
  [[nodiscard]] std::uint64_t exchange_id() const noexcept;

  /**
   * @brief The tensor for user kernels (see `wm::tensor_ref`): this rank's rows on every
   * layout, any row on mapped layouts. Valid while the tensor lives; writes through it are
   * ordered with the tensor's own calls only by the streams the caller uses.
   */
  [[nodiscard]] tensor_ref<T, Layout, Mapping> ref() noexcept;
  /// Read-only form of `ref()`.
  [[nodiscard]] tensor_ref<T const, Layout, Mapping> ref() const noexcept;

  /**
   * @brief This rank's rows as a strided view (device-accessible). Block mapping: local row l is
   * global row `storage().local_entry_range().begin + l`; cyclic: `l * world + rank`.
   */
  [[nodiscard]] matrix_view<T> local_view() const noexcept;

  /**
   * @brief `out[i, :] = this[indices[i], :]` for every i; @p out is dense (`cols` per row), in
   * device memory. Returns without synchronizing (the distributed path synchronizes twice: for
   * the count words and for the agreement on the workspaces they size).
   * @throw wm::comm_error on a mapped layout if the communicator was aborted (nothing is read);
   * on the distributed layout on every rank if a rank could not make the call (e.g. out of
   * memory for its workspaces; one rank: that `wm::cuda_error`)
   */
  template <index_type Index>
  void gather_async(std::span<Index const> indices, T* out, cuda::stream_ref stream);

  /// As `gather_async`, then synchronizes. @throw wm::logic_error if an index was out of range
  template <index_type Index>
  void gather(std::span<Index const> indices, T* out, cuda::stream_ref stream);

  /// The path this tensor's gathers take for other ranks' rows: fixed at its first distributed
  /// gather, alike on every rank. @throw wm::logic_error (from that gather, on every rank) if
  /// `WM_DISPATCH_ROWS` is set to anything but `nccl`, `put` or `copy` on some rank.
  [[nodiscard]] row_path gather_path() const noexcept;

  /**
   * @brief `this[indices[i], :] = values[i, :]` for every i (last occurrence wins among
   * duplicates); @p values is dense (`cols` per row), in device memory. Returns without
   * synchronizing (the distributed path synchronizes once).
   * @throw wm::comm_error on a mapped layout if the communicator was aborted (nothing is written)
   */
  template <index_type Index>
  void scatter_async(std::span<Index const> indices, T const* values, cuda::stream_ref stream);

  /// As `scatter_async`, then synchronizes. @throw wm::logic_error if an index was out of range
  template <index_type Index>
  void scatter(std::span<Index const> indices, T const* values, cuda::stream_ref stream);

  /**
   * @brief Synchronizes @p stream and throws `wm::logic_error` if any `_async` call since the
   * last check saw an index out of range; clears the error state.
   */
  void check_errors(cuda::stream_ref stream);

  /**
   * @brief Loads rows from raw files: packed rows of `cols` elements in global row order, the
   * files logically concatenated (any layout, mapping, stride and rank count). Collective.
   * @throw wm::io_error on every rank if a file is missing or unreadable, or the sizes do not
   * add up to `rows × cols` elements in whole rows
   */
  void load(std::span<std::filesystem::path const> files);
  /// As above, from one file.
  void load(std::filesystem::path const& file) { load(std::span{&file, 1}); }

  /**
   * @brief Writes the rows in global row order, rank r writing `files[r]` (rows [begin, end) of
   * the block plan of `rows` over the ranks), so that the list loads back into any layout,
   * mapping or rank count. Collective. @throw wm::io_error on every rank if a write failed
   */
  void store(std::span<std::filesystem::path const> files);
  /// As above, into `<prefix>.rank<r>-of-<world>.bin`; returns the files in rank order.
  std::vector<std::filesystem::path> store(std::filesystem::path const& prefix);

 private:
  template <class U, location L, layout Y, mapping M>
  requires std::is_trivially_copyable_v<U>
  friend class tensor;
  struct view_tag {};
  /// A view of @p mem's rows (view_columns).
  tensor(view_tag, communicator& comm, std::size_t rows, std::size_t cols, std::size_t stride,
         std::shared_ptr<memory<Location, Layout>> mem, std::size_t offset);
  /// This rank's first row, at this tensor's columns (null when it owns no row).
  [[nodiscard]] std::byte* local_data() const noexcept;
  /// Device array: every rank's first row at this tensor's columns (mapped layouts).
  [[nodiscard]] std::byte* const* parts() const noexcept;
  [[nodiscard]] std::size_t row_bytes() const noexcept { return cols_ * sizeof(T); }
  [[nodiscard]] std::size_t stride_bytes() const noexcept { return stride_ * sizeof(T); }
  [[nodiscard]] mapping_ref<Mapping> map_ref() const noexcept;
  void throw_if_error(cudaStream_t stream, char const* what);
  template <class Index>
  void gather_dispatch(Index const* idx, std::size_t n, T* out, cudaStream_t stream);
  template <class Index>
  void scatter_dispatch(Index const* idx, std::size_t n, T const* values, cudaStream_t stream);

  communicator* comm_;
  std::size_t rows_;
  std::size_t cols_;
  std::size_t stride_;
  std::shared_ptr<memory<Location, Layout>> mem_;
  std::size_t offset_{};  // bytes into each row (view_columns)
  // view_columns on mapped layouts: every rank's first row at these columns (device array)
  std::unique_ptr<detail::cuda_buffer<std::byte*, false>> parts_;
  std::unique_ptr<detail::exchange_scratch> scratch_;
};

}  // namespace wm
