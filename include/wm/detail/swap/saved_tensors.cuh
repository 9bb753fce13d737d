// SPDX-License-Identifier: Apache-2.0
// Bodies of wm::saved_tensors and wm::saved_tensor (declared in <wm/swap.cuh>): thin forwarders
// to the state in saved_tensors_core.cuh.
#pragma once

#include <wm/decl/swap.cuh>
#include <wm/detail/swap/saved_tensors_core.cuh>

#include <cuda_runtime_api.h>

#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace wm {

template <class Memory>
saved_tensor<Memory>::~saved_tensor() {
  if (!core_) { return; }  // never took a slab range or a pool block
  std::lock_guard lk{core_->mutex()};
  core_->released(*this);
}  // then the memory handles (after the lock), and core_: the last save of a dropped
   // saved_tensors destroys its scope

template <class Memory>
bool saved_tensor<Memory>::resident() const {
  return buf_ && buf_.resident();
}

template <class Memory>
requires saved_memory<Memory> saved_tensors<Memory>::saved_tensors(
    swap_options const& scope_options, saved_tensors_options const& options, Memory memory)
    : core_{std::make_shared<detail::saved_tensors_core<Memory>>(scope_options, options,
                                                                 std::move(memory))} {}

template <class Memory>
requires saved_memory<Memory> saved_tensors<Memory>::~saved_tensors() = default;

template <class Memory>
requires saved_memory<Memory> saved_tensors_options saved_tensors<Memory>::options()
const {
  return core_->options();
}

template <class Memory>
requires saved_memory<Memory>
void saved_tensors<Memory>::set_options(saved_tensors_options const& options) {
  core_->set_options(options);
}

template <class Memory>
requires saved_memory<Memory>
void saved_tensors<Memory>::set_skip(std::vector<void const*> const& bases) {
  core_->set_skip(bases);
}

template <class Memory>
requires saved_memory<Memory>
auto saved_tensors<Memory>::save(handle_type const& source, cudaStream_t stream) -> save_ptr {
  return core_->save(source, stream);
}

template <class Memory>
requires saved_memory<Memory>
auto saved_tensors<Memory>::restore(save_ptr const& save, cudaStream_t stream) -> restored_type {
  return core_->restore(save, stream);
}

template <class Memory>
requires saved_memory<Memory>
void saved_tensors<Memory>::end_forward(cudaStream_t stream) {
  core_->end_forward(stream);
}

template <class Memory>
requires saved_memory<Memory>
void saved_tensors<Memory>::prefetch_all(cudaStream_t stream) {
  core_->prefetch_all(stream);
}

template <class Memory>
requires saved_memory<Memory>
void saved_tensors<Memory>::wait_prefetches() {
  core_->wait_prefetches();
}

template <class Memory>
requires saved_memory<Memory>
bool saved_tensors<Memory>::owns(save_ptr const& save) const noexcept {
  return save != nullptr && core_->owns(*save);
}

template <class Memory>
requires saved_memory<Memory> saved_tensors_statistics saved_tensors<Memory>::statistics()
const {
  return core_->statistics();
}

template <class Memory>
requires saved_memory<Memory>
void saved_tensors<Memory>::reset_statistics() {
  core_->reset_statistics();
}

template <class Memory>
requires saved_memory<Memory> swap_scope& saved_tensors<Memory>::scope() const noexcept {
  return core_->scope();
}

template <class Memory>
requires saved_memory<Memory> std::size_t saved_tensors<Memory>::pool_bytes()
const noexcept {
  return core_->pool_bytes();
}

}  // namespace wm
