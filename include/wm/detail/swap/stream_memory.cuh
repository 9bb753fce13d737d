// SPDX-License-Identifier: Apache-2.0
// Bodies of wm::stream_block and wm::stream_memory (declared in <wm/swap.cuh>): device memory
// from cudaMallocAsync, freed by cudaFreeAsync on its stream after the streams it was recorded
// on, with a version counter; the saved_memory of plain CUDA code. Host code only.
#pragma once

#include <wm/decl/swap.cuh>
#include <wm/error.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <utility>

namespace wm {

inline stream_block::stream_block(std::size_t bytes, std::size_t element_bytes, cudaStream_t stream)
    : bytes_{bytes}, element_bytes_{element_bytes}, stream_{stream} {
  WM_EXPECTS(element_bytes > 0 && bytes % element_bytes == 0,
             "stream_block: " + std::to_string(bytes) + " bytes are not a whole number of " +
                 std::to_string(element_bytes) + "-byte elements");
  if (bytes > 0) { WM_CUDA_TRY(cudaMallocAsync(&data_, bytes, stream)); }
}

inline stream_block::~stream_block() {
  for (auto const& [s, e] : recorded_) {
    (void)cudaStreamWaitEvent(stream_, e, 0);
    (void)cudaEventDestroy(e);
  }
  if (data_ != nullptr) { (void)cudaFreeAsync(data_, stream_); }
}

inline void stream_block::record_stream(cudaStream_t s) {
  if (s == stream_) { return; }  // freed in that stream's order anyway
  for (auto const& [r, e] : recorded_) {
    if (r == s) {
      WM_CUDA_TRY(cudaEventRecord(e, s));  // the later record covers the earlier one
      return;
    }
  }
  cudaEvent_t e = nullptr;
  WM_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  if (cudaError_t const r = cudaEventRecord(e, s); r != cudaSuccess) {
    (void)cudaEventDestroy(e);
    WM_CUDA_TRY(r);
  }
  recorded_.emplace_back(s, e);
}

inline stream_memory::handle_type stream_memory::make(std::size_t bytes, std::size_t element_bytes,
                                                      cudaStream_t stream) {
  return std::make_shared<stream_block>(bytes, element_bytes, stream);
}

inline std::size_t stream_memory::bytes(handle_type const& h) const noexcept {
  return h ? h->bytes() : 0;
}
inline std::size_t stream_memory::element_bytes(handle_type const& h) const noexcept {
  return h ? h->element_bytes() : 1;
}
inline void* stream_memory::data(handle_type const& h) const noexcept {
  return h ? h->data() : nullptr;
}
inline void const* stream_memory::base(handle_type const& h) const noexcept {
  return h ? h->data() : nullptr;
}

inline stream_memory::watch_type stream_memory::watch(handle_type const& h) const {
  return watch_type{h, bytes(h), element_bytes(h), h ? h->version() : 0};
}

inline std::optional<stream_memory::handle_type> stream_memory::reuse(watch_type const& w) const {
  handle_type h = w.block.lock();
  if (!h || h->version() != w.version) { return std::nullopt; }
  return h;
}

inline bool stream_memory::same(watch_type const& a, watch_type const& b) const {
  handle_type const x = a.block.lock();
  return x && x == b.block.lock() && a.version == b.version && a.bytes == b.bytes &&
         a.element_bytes == b.element_bytes;
}

inline bool stream_memory::unchanged(handle_type const& h, watch_type const& w) const noexcept {
  return h && h->version() == w.version;
}

inline stream_memory::handle_type stream_memory::allocate(std::size_t bytes, cudaStream_t s) {
  return make(bytes, 1, s);
}

inline stream_memory::handle_type stream_memory::allocate_like(watch_type const& w,
                                                               cudaStream_t s) {
  return make(w.bytes, w.element_bytes, s);
}

inline void stream_memory::record_stream(handle_type const& h, cudaStream_t s) {
  if (h) { h->record_stream(s); }
}

}  // namespace wm
