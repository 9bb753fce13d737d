// SPDX-License-Identifier: Apache-2.0
// Bodies of wm::tensor_ref and tensor::ref() (declared in <wm/tensor.cuh>).
#pragma once

#include <wm/tensor.cuh>

#include <cstddef>

namespace wm {

template <class T, layout Layout, mapping Mapping>
tensor_ref<T, Layout, Mapping>::tensor_ref(std::byte* const* parts, T* local,
                                           std::size_t local_rows, mapping_ref<Mapping> map,
                                           std::size_t cols, std::size_t stride, int rank) noexcept
    : parts_{parts},
      local_{local},
      local_rows_{local_rows},
      map_{map},
      cols_{cols},
      stride_{stride},
      rank_{rank} {}

template <class T, layout Layout, mapping Mapping>
template <class U>
tensor_ref<T, Layout, Mapping>::tensor_ref(
    tensor_ref<U, Layout, Mapping> const& other) noexcept requires std::same_as<T, U const>
    : parts_{other.parts_},
      local_{other.local_},
      local_rows_{other.local_rows_},
      map_{other.map_},
      cols_{other.cols_},
      stride_{other.stride_},
      rank_{other.rank_} {}

template <class T, layout Layout, mapping Mapping>
WM_HOST_DEVICE std::size_t tensor_ref<T, Layout, Mapping>::rows() const noexcept {
  return map_.rows();
}
template <class T, layout Layout, mapping Mapping>
WM_HOST_DEVICE std::size_t tensor_ref<T, Layout, Mapping>::cols() const noexcept {
  return cols_;
}
template <class T, layout Layout, mapping Mapping>
WM_HOST_DEVICE std::size_t tensor_ref<T, Layout, Mapping>::stride() const noexcept {
  return stride_;
}
template <class T, layout Layout, mapping Mapping>
WM_HOST_DEVICE std::size_t tensor_ref<T, Layout, Mapping>::local_rows() const noexcept {
  return local_rows_;
}
template <class T, layout Layout, mapping Mapping>
WM_HOST_DEVICE int tensor_ref<T, Layout, Mapping>::rank() const noexcept {
  return rank_;
}

template <class T, layout Layout, mapping Mapping>
WM_HOST_DEVICE row_location tensor_ref<T, Layout, Mapping>::locate(std::size_t k) const noexcept {
  return map_.locate(k);
}

template <class T, layout Layout, mapping Mapping>
WM_HOST_DEVICE T* tensor_ref<T, Layout, Mapping>::local_row(std::size_t l) const noexcept {
  return local_ + l * stride_;
}

#if defined(__CUDACC__)
template <class T, layout Layout, mapping Mapping>
__device__ T* tensor_ref<T, Layout, Mapping>::row(std::size_t k) const noexcept requires
    mapped_layout<Layout> {
  auto const at = map_.locate(k);
  return reinterpret_cast<T*>(parts_[at.rank]) + at.local * stride_;
}
#endif

// ---- tensor::ref ------------------------------------------------------------------------------

namespace detail {
/// A ref with elements of type U (T or T const) over @p parts (every rank's first row, mapped
/// layouts) and @p local (this rank's first row, @p entries rows).
template <class U, class Layout, class Mapping>
[[nodiscard]] tensor_ref<U, Layout, Mapping> make_tensor_ref(std::byte* const* parts,
                                                             std::byte* local, std::size_t entries,
                                                             mapping_ref<Mapping> map,
                                                             std::size_t cols, std::size_t stride,
                                                             int rank) noexcept {
  return {parts, reinterpret_cast<U*>(local), entries, map, cols, stride, rank};
}
}  // namespace detail

template <class T, location Location, layout Layout, mapping Mapping>
requires std::is_trivially_copyable_v<T> tensor_ref<T, Layout, Mapping>
tensor<T, Location, Layout, Mapping>::ref()
noexcept {
  return detail::make_tensor_ref<T, Layout>(parts(), local_data(), local_rows(), map_ref(), cols_,
                                            stride_, mem_->rank());
}

template <class T, location Location, layout Layout, mapping Mapping>
requires std::is_trivially_copyable_v<T> tensor_ref<T const, Layout, Mapping>
tensor<T, Location, Layout, Mapping>::ref()
const noexcept {
  return detail::make_tensor_ref<T const, Layout>(parts(), local_data(), local_rows(), map_ref(),
                                                  cols_, stride_, mem_->rank());
}

}  // namespace wm
