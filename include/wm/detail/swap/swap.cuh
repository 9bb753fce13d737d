// SPDX-License-Identifier: Apache-2.0
// Bodies of wm::swap_scope and wm::swappable (declared in <wm/swap.cuh>). The scope's core is
// in swap_core.cuh (its class), swap_blocks.cuh (the device pool), swap_buffers.cuh (buffer
// operations) and swap_copy.cuh (the copiers); saved_tensors on top of a scope in
// saved_tensors.cuh and saved_tensors_core.cuh, its plain-CUDA memory in stream_memory.cuh.
#pragma once

#include <wm/detail/swap/saved_tensors.cuh>
#include <wm/detail/swap/stream_memory.cuh>
#include <wm/detail/swap/swap_blocks.cuh>
#include <wm/detail/swap/swap_buffers.cuh>
#include <wm/detail/swap/swap_copy.cuh>
#include <wm/detail/swap/swap_core.cuh>
#include <wm/error.hpp>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <utility>

namespace wm {

inline swap_scope::swap_scope(swap_options const& options)
    : core_{std::make_unique<detail::swap_core>(options)} {}

inline swap_scope::~swap_scope() = default;

template <class T>
swappable<T> swap_scope::allocate(std::size_t count, cuda::stream_ref stream) {
  WM_EXPECTS(count <= std::numeric_limits<std::size_t>::max() / sizeof(T),
             "swap_scope::allocate: " + std::to_string(count) + " elements overflow a size_t");
  return swappable<T>{core_.get(), core_->allocate(count * sizeof(T), stream.get()), count};
}

template <class T>
swappable<T> swap_scope::pageout_from(T const* src, std::size_t count, cuda::stream_ref stream) {
  WM_EXPECTS(count <= std::numeric_limits<std::size_t>::max() / sizeof(T),
             "swap_scope::pageout_from: " + std::to_string(count) + " elements overflow a size_t");
  WM_EXPECTS(src != nullptr || count == 0, "swap_scope::pageout_from: null source");
  WM_EXPECTS(reinterpret_cast<std::uintptr_t>(src) % alignof(T) == 0,
             "swap_scope::pageout_from: the source is not aligned for its element type");
  return swappable<T>{core_.get(), core_->pageout_from(src, count * sizeof(T), stream.get()),
                      count};
}

inline cudaStream_t swap_scope::pageout_stream() const noexcept {
  return core_->pageout_stream();
}
inline cudaStream_t swap_scope::pagein_stream() const noexcept {
  return core_->pagein_stream();
}

inline void swap_scope::prefetch_init() {
  core_->prefetch_init();
}
inline void swap_scope::wait_pageouts() {
  core_->wait_pageouts();
}
inline void swap_scope::prefetch_all() {
  core_->prefetch_all();
}
inline void swap_scope::wait_prefetches() {
  core_->wait_prefetches();
}
inline swap_statistics swap_scope::statistics() const {
  return core_->statistics();
}
inline void swap_scope::reset_statistics() {
  core_->reset_statistics();
}
inline swap_options const& swap_scope::options() const noexcept {
  return core_->options();
}

template <class T>
swappable<T>::swappable(swappable&& other) noexcept
    : core_{std::exchange(other.core_, nullptr)},
      id_{other.id_},
      count_{std::exchange(other.count_, 0)} {}

template <class T>
swappable<T>& swappable<T>::operator=(swappable&& other) noexcept {
  if (this != &other) {
    reset();
    core_  = std::exchange(other.core_, nullptr);
    id_    = other.id_;
    count_ = std::exchange(other.count_, 0);
  }
  return *this;
}

template <class T>
swappable<T>::~swappable() {
  reset();
}

template <class T>
void swappable<T>::reset() noexcept {
  if (core_ != nullptr) { core_->release(id_); }
  core_  = nullptr;
  count_ = 0;
}

template <class T>
T* swappable<T>::data(cuda::stream_ref stream) {
  WM_EXPECTS(core_ != nullptr, "swappable::data: empty buffer");
  return static_cast<T*>(core_->data(id_, stream.get(), false));
}

template <class T>
bool swappable<T>::pageout(cuda::stream_ref stream) {
  WM_EXPECTS(core_ != nullptr, "swappable::pageout: empty buffer");
  return core_->pageout(id_, stream.get(), false);
}

template <class T>
bool swappable<T>::pageout_begin(cuda::stream_ref stream) {
  WM_EXPECTS(core_ != nullptr, "swappable::pageout_begin: empty buffer");
  return core_->pageout(id_, stream.get(), true);
}

template <class T>
void swappable<T>::need_prefetch() {
  WM_EXPECTS(core_ != nullptr, "swappable::need_prefetch: empty buffer");
  core_->need_prefetch(id_);
}

template <class T>
void swappable<T>::pagein_to(T* dst, cuda::stream_ref stream) {
  WM_EXPECTS(core_ != nullptr, "swappable::pagein_to: empty buffer");
  WM_EXPECTS(dst != nullptr || count_ == 0, "swappable::pagein_to: null destination");
  WM_EXPECTS(reinterpret_cast<std::uintptr_t>(dst) % alignof(T) == 0,
             "swappable::pagein_to: the destination is not aligned for its element type");
  core_->pagein_to(id_, dst, stream.get());
}

template <class T>
void swappable<T>::wait_pagein(cuda::stream_ref stream) {
  WM_EXPECTS(core_ != nullptr, "swappable::wait_pagein: empty buffer");
  core_->wait_pagein(id_, stream.get());
}

template <class T>
void swappable<T>::wait_pageout(cuda::stream_ref stream) {
  WM_EXPECTS(core_ != nullptr, "swappable::wait_pageout: empty buffer");
  core_->wait_pageout(id_, stream.get());
}

template <class T>
T* swappable<T>::pin(cuda::stream_ref stream) {
  WM_EXPECTS(core_ != nullptr, "swappable::pin: empty buffer");
  return static_cast<T*>(core_->data(id_, stream.get(), true));
}

template <class T>
void swappable<T>::unpin() {
  WM_EXPECTS(core_ != nullptr, "swappable::unpin: empty buffer");
  core_->unpin(id_);
}

template <class T>
bool swappable<T>::resident() const {
  WM_EXPECTS(core_ != nullptr, "swappable::resident: empty buffer");
  return core_->resident(id_);
}

template <class T>
int swappable<T>::pins() const {
  WM_EXPECTS(core_ != nullptr, "swappable::pins: empty buffer");
  return core_->pins(id_);
}

}  // namespace wm
