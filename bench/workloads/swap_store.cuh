// SPDX-License-Identifier: Apache-2.0
/*
 * The MLP workload's saved activations as wm::swappable buffers of a wm::swap_scope: x_i is paged
 * out once the forward pass has read it for good (when the policy says so; `early`: its copy
 * starts when the forward pass starts reading it, pageout_begin, and its memory goes once the
 * reading is done, pageout; else the copy starts after the reading, pageout), the backward pass
 * prefetches them in the order it needs them (x_{L-1} first), and each buffer goes back to the
 * pool once the backward pass has read it. Policy: page out x_i for i < L - keep_last (x_L, the
 * last output, is used at once by the loss and is never paged out).
 */
#pragma once

#include <wm/swap.cuh>

#include <cstddef>
#include <vector>

#include "mlp.cuh"

namespace wm_workload {

class swap_store {
 public:
  /// Activations of @p elements bf16 each for an MLP of @p layers layers; the last @p keep_last
  /// inputs stay resident besides x_L; @p early: page-out copies start while the forward pass
  /// reads the activation.
  swap_store(wm::swap_scope& scope, int layers, std::size_t elements, int keep_last = 0,
             bool early = true)
      : scope_{scope},
        layers_{layers},
        keep_last_{keep_last},
        early_{early},
        elements_{elements},
        x_(static_cast<std::size_t>(layers) + 1) {}

  /// x_i is paged out after the forward pass.
  [[nodiscard]] bool paged(int i) const noexcept { return i < layers_ - keep_last_; }

  bf16* create(int i, cudaStream_t s) {
    if (i == 0) { forward_ = true; }
    auto& x = x_.at(static_cast<std::size_t>(i));
    x       = scope_.allocate<bf16>(elements_, cuda::stream_ref{s});
    return x.data(cuda::stream_ref{s});
  }
  bf16* get(int i, cudaStream_t s) {
    auto& x = x_.at(static_cast<std::size_t>(i));
    // The forward pass reads x_i (once, in layer i + 1): the copy may start now, after x_i's
    // producer; x_i stays readable until forward_done(i).
    if (early_ && forward_ && paged(i)) { x.pageout_begin(cuda::stream_ref{s}); }
    return x.data(cuda::stream_ref{s});
  }
  void forward_done(int i, cudaStream_t s) {
    if (paged(i)) { x_.at(static_cast<std::size_t>(i)).pageout(cuda::stream_ref{s}); }
  }
  void backward_begin(cudaStream_t) {
    forward_ = false;
    scope_.prefetch_init();
    for (int i = layers_ - 1; i >= 0; --i) {
      if (paged(i)) { x_[static_cast<std::size_t>(i)].need_prefetch(); }
    }
    scope_.prefetch_all();
  }
  void backward_done(int i, cudaStream_t) { x_.at(static_cast<std::size_t>(i)).reset(); }

 private:
  wm::swap_scope& scope_;
  int layers_;
  int keep_last_;
  bool early_;
  bool forward_{false};
  std::size_t elements_;
  std::vector<wm::swappable<bf16>> x_;
};

static_assert(activation_store<swap_store>);
static_assert(activation_store<resident_store>);

}  // namespace wm_workload
