// SPDX-License-Identifier: Apache-2.0
/*
 * The MLP of mlp.cuh (bf16 Linear(width, width, no bias) + ReLU layers through cuBLASLt, loss
 * 0.5 · Σ y_L² / batch) with its weights and gradients in the arena of a wm::zero_optimizer, for
 * the ZeRO example and benchmark. Layer i's weight is parameter i ("layer<i>.weight"); stage 3
 * uses the optimizer's default groups (one per parameter, so one per layer) and gathers each
 * layer before its forward and again before its backward-data GEMM, releasing it right after.
 * Each bucket is reduced as soon as backward has written its last gradient (buckets are in
 * backward order). Activations stay in device memory allocated once.
 */
#pragma once

#include <wm/zero.cuh>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "mlp.cuh"

namespace wm_workload {

/// The MLP's parameter list for a wm::zero_optimizer: `layers` bf16 weights of width × width.
[[nodiscard]] inline std::vector<wm::zero_parameter> zero_mlp_parameters(int layers, int width) {
  std::vector<wm::zero_parameter> params;
  for (int i = 0; i < layers; ++i) {
    params.push_back({"layer" + std::to_string(i) + ".weight",
                      {static_cast<std::size_t>(width), static_cast<std::size_t>(width)}});
  }
  return params;
}

template <class Optimizer>
class zero_mlp {
 public:
  zero_mlp(Optimizer& opt, int layers, int width, int batch)
      : opt_{opt},
        layers_{layers},
        width_{width},
        batch_{batch},
        x_(static_cast<std::size_t>(layers) + 1) {
    WM_MLP_CUBLAS_TRY(cublasLtCreate(&handle_));
    std::size_t const a = activation_elements();
    for (auto& x : x_) { WM_CUDA_TRY(cudaMalloc(&x, a * sizeof(bf16))); }
    WM_CUDA_TRY(cudaMalloc(&dy_[0], a * sizeof(bf16)));
    WM_CUDA_TRY(cudaMalloc(&dy_[1], a * sizeof(bf16)));
    WM_CUDA_TRY(cudaMalloc(&workspace_, mlp::workspace_bytes));
    WM_CUDA_TRY(cudaMalloc(&sum_, 2 * sizeof(float)));
    WM_CUDA_TRY(cub::DeviceReduce::TransformReduce(nullptr, reduce_bytes_, x_[0], sum_, a,
                                                   plus_op{}, square_op{}, 0.0f));
    WM_CUDA_TRY(cudaMalloc(&reduce_temp_, reduce_bytes_));
    auto const W = static_cast<std::uint64_t>(width);
    auto const B = static_cast<std::uint64_t>(batch);
    auto gemm    = [&](cublasOperation_t ta, cublasOperation_t tb, std::uint64_t m, std::uint64_t n,
                    std::uint64_t k, std::uint64_t ar, std::uint64_t ac, std::uint64_t br,
                    std::uint64_t bc, cublasLtEpilogue_t e) {
      return lt_gemm{handle_, ta, tb, m, n, k, ar, ac, br, bc, e, mlp::workspace_bytes};
    };
    // The three GEMM shapes of mlp.cuh (column-major views of row-major matrices).
    forward_       = gemm(CUBLAS_OP_T, CUBLAS_OP_N, W, B, W, W, W, W, B, CUBLASLT_EPILOGUE_RELU);
    backward_data_ = gemm(CUBLAS_OP_N, CUBLAS_OP_N, W, B, W, W, W, W, B, CUBLASLT_EPILOGUE_DEFAULT);
    backward_weight_ =
        gemm(CUBLAS_OP_N, CUBLAS_OP_T, W, W, B, W, B, W, B, CUBLASLT_EPILOGUE_DEFAULT);
  }
  zero_mlp(zero_mlp const&)            = delete;
  zero_mlp& operator=(zero_mlp const&) = delete;
  ~zero_mlp() {
    (void)cudaDeviceSynchronize();
    for (auto* x : x_) { (void)cudaFree(x); }
    (void)cudaFree(dy_[0]);
    (void)cudaFree(dy_[1]);
    (void)cudaFree(workspace_);
    (void)cudaFree(sum_);
    (void)cudaFree(reduce_temp_);
    if (handle_ != nullptr) { (void)cublasLtDestroy(handle_); }
  }

  [[nodiscard]] std::size_t activation_elements() const noexcept {
    return static_cast<std::size_t>(batch_) * width_;
  }
  /// FLOPs of one step (as mlp.cuh counts them).
  [[nodiscard]] double step_flops() const noexcept {
    return 2.0 * batch_ * static_cast<double>(width_) * width_ * (3.0 * layers_ - 1.0);
  }

  /// Sets the weights as mlp.cuh draws them from @p seed (the same on every rank).
  void init_weights(std::uint64_t seed, cudaStream_t s) {
    std::size_t const w = static_cast<std::size_t>(width_) * width_;
    bf16* init          = nullptr;
    WM_CUDA_TRY(cudaMalloc(&init, w * sizeof(bf16)));
    for (int i = 0; i < layers_; ++i) {
      fill_uniform_kernel<<<1024, 256, 0, s>>>(init, w, mix(seed + 1 + static_cast<unsigned>(i)),
                                               1.7f / std::sqrt(static_cast<float>(width_)));
      WM_CHECK_LAUNCH();
      opt_.set_weights(static_cast<std::size_t>(i), static_cast<bf16 const*>(init),
                       cuda::stream_ref{s});
    }
    WM_CUDA_TRY(cudaStreamSynchronize(s));  // no collective is pending: set_weights copies only
    WM_CUDA_TRY(cudaFree(init));
  }

  /// Forward and backward on a batch drawn from @p seed, each bucket reduced as soon as its last
  /// gradient is written. The loss goes to device memory (`loss()`, read after the step).
  void forward_backward(std::uint64_t seed, cudaStream_t s) {
    cuda::stream_ref const sr{s};
    std::size_t const n = activation_elements();
    fill_uniform_kernel<<<1024, 256, 0, s>>>(x_[0], n, mix(seed), 1.0f);
    WM_CHECK_LAUNCH();
    for (int i = 1; i <= layers_; ++i) {
      // Offload with zero_options::offload_overlap_forward: the layer's weights may still be on
      // their way from the CPU Adam of the last step (a no-op otherwise; stage 3: gather).
      if constexpr (!stage3) {
        opt_.weights_ready(opt_.bucket_of(static_cast<std::size_t>(i - 1)), sr);
      }
      acquire(i - 1, sr);
      forward_.run(handle_, weight(i - 1), x_[i - 1], x_[i], workspace_, mlp::workspace_bytes, s);
      drop(i - 1);
    }
    float const scale = 1.0f / static_cast<float>(batch_);
    WM_CUDA_TRY(cub::DeviceReduce::TransformReduce(reduce_temp_, reduce_bytes_, x_[layers_], sum_,
                                                   n, plus_op{}, square_op{}, 0.0f, s));
    finish_loss_kernel<<<1, 1, 0, s>>>(sum_, sum_ + 1, scale);
    WM_CHECK_LAUNCH();
    loss_grad_kernel<<<1024, 256, 0, s>>>(dy_[0], x_[layers_], n, scale);
    WM_CHECK_LAUNCH();
    auto const& plan = opt_.layout();
    int cur          = 0;
    for (int i = layers_; i >= 1; --i) {
      relu_backward_kernel<<<1024, 256, 0, s>>>(dy_[cur], x_[i], n);
      WM_CHECK_LAUNCH();
      auto const p = static_cast<std::size_t>(i - 1);
      backward_weight_.run(handle_, x_[i - 1], dy_[cur], opt_.template gradients<bf16>(p).data(),
                           workspace_, mlp::workspace_bytes, s);
      // The bucket is complete once its lowest-numbered parameter has its gradient.
      std::size_t const b = opt_.bucket_of(p);
      if (plan.buckets[b].params.back() == p) { opt_.reduce_gradients(b, sr); }
      if (i > 1) {
        acquire(i - 1, sr);
        backward_data_.run(handle_, weight(i - 1), dy_[cur], dy_[1 - cur], workspace_,
                           mlp::workspace_bytes, s);
        drop(i - 1);
        cur = 1 - cur;
      }
    }
  }

  [[nodiscard]] float const* loss() const noexcept { return sum_ + 1; }

 private:
  static constexpr bool stage3 = Optimizer::stage == 3;

  void acquire(int layer, cuda::stream_ref s) {
    if constexpr (stage3) { opt_.gather(static_cast<std::size_t>(layer), s); }
  }
  void drop(int layer) {
    if constexpr (stage3) { opt_.release(static_cast<std::size_t>(layer)); }
  }
  bf16* weight(int i) { return opt_.template weights<bf16>(static_cast<std::size_t>(i)).data(); }

  Optimizer& opt_;
  int layers_;
  int width_;
  int batch_;
  cublasLtHandle_t handle_{nullptr};
  std::vector<bf16*> x_;
  bf16* dy_[2]{};
  void* workspace_{nullptr};
  float* sum_{nullptr};  // [0]: Σ y², [1]: the loss
  void* reduce_temp_{nullptr};
  std::size_t reduce_bytes_{0};
  lt_gemm forward_;
  lt_gemm backward_data_;
  lt_gemm backward_weight_;
};

}  // namespace wm_workload
