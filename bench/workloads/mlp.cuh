// SPDX-License-Identifier: Apache-2.0
/*
 * A training workload for the swap and ZeRO benchmarks: an MLP of `layers` bf16 Linear(width,
 * width, no bias) + ReLU layers on a batch of `batch` rows, forward and backward through
 * cuBLASLt (fp32 accumulation; ReLU fused into the forward GEMM's epilogue), loss
 * 0.5 · Σ y_L² / batch, SGD on every weight at the end of the step, gradients kept per layer (as
 * PyTorch's .grad).
 *
 * Saved activations go through an `activation_store` (the hooks): x_0 (the input) ... x_L (the
 * last ReLU output). Layer i's forward reads x_{i-1} and writes x_i; its backward reads x_{i-1}
 * (for dW) and x_i (the ReLU mask). The store says where they live: `resident_store` keeps all of
 * them in device memory allocated once; the swap example and benchmark page them out.
 *
 * Nothing is allocated and nothing waits on the host inside `step`: losses go to a device array
 * that the caller reads afterwards. Results are deterministic for a given store-independent
 * sequence of kernels: the same seed gives the bitwise same losses whatever the store does.
 */
#pragma once

#include <wm/error.hpp>

#include <cub/device/device_reduce.cuh>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cublasLt.h>
#include <stdexcept>
#include <string>
#include <vector>

#define WM_MLP_CUBLAS_TRY(call)                                                             \
  do {                                                                                      \
    cublasStatus_t const wm_mlp_status_ = (call);                                           \
    if (wm_mlp_status_ != CUBLAS_STATUS_SUCCESS) {                                          \
      throw std::runtime_error{std::string{"cuBLASLt error "} +                             \
                               std::to_string(static_cast<int>(wm_mlp_status_)) + " in `" + \
                               #call + "` at " __FILE__ ":" + std::to_string(__LINE__)};    \
    }                                                                                       \
  } while (0)

namespace wm_workload {

using bf16 = __nv_bfloat16;

/// Where the MLP's saved activations x_0..x_L live (the hooks).
template <class S>
concept activation_store = requires(S& s, int i, cudaStream_t st) {
  { s.create(i, st) } -> std::same_as<bf16*>;  // x_i is about to be written
  { s.get(i, st) } -> std::same_as<bf16*>;     // x_i is about to be read
  {s.forward_done(i, st)};                     // the forward pass has read x_i for good
  {s.backward_begin(st)};                      // the backward pass starts
  {s.backward_done(i, st)};                    // the backward pass has read x_i for good
};

__host__ __device__ inline std::uint64_t mix(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/// p[i] = uniform(-scale, scale) from (seed, i).
__global__ void fill_uniform_kernel(bf16* p, std::size_t n, std::uint64_t seed, float scale) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    float const u = static_cast<float>(mix(seed ^ (i * 0x9E3779B97F4A7C15ull)) >> 40) / 16777216.0f;
    p[i]          = __float2bfloat16((2.0f * u - 1.0f) * scale);
  }
}

/// dy[i] = y[i] > 0 ? dy[i] : 0 (ReLU backward from the output).
__global__ void relu_backward_kernel(bf16* dy, bf16 const* y, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    if (!(__bfloat162float(y[i]) > 0.0f)) { dy[i] = __float2bfloat16(0.0f); }
  }
}

/// dy[i] = y[i] · scale (the gradient of 0.5 · Σ y² · scale).
__global__ void loss_grad_kernel(bf16* dy, bf16 const* y, std::size_t n, float scale) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    dy[i] = __float2bfloat16(__bfloat162float(y[i]) * scale);
  }
}

/// w[i] -= lr · g[i].
__global__ void sgd_kernel(bf16* w, bf16 const* g, std::size_t n, float lr) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    w[i] = __float2bfloat16(__bfloat162float(w[i]) - lr * __bfloat162float(g[i]));
  }
}

struct square_op {
  __host__ __device__ float operator()(bf16 v) const {
    float const f = __bfloat162float(v);
    return f * f;
  }
};
struct plus_op {
  __host__ __device__ float operator()(float a, float b) const { return a + b; }
};

/// Writes 0.5 · *sum · scale to *loss (one thread).
__global__ void finish_loss_kernel(float const* sum, float* loss, float scale) {
  *loss = 0.5f * *sum * scale;
}

/// One cuBLASLt GEMM shape, its descriptors and the algorithm picked once.
class lt_gemm {
 public:
  lt_gemm() = default;
  lt_gemm(cublasLtHandle_t h, cublasOperation_t ta, cublasOperation_t tb, std::uint64_t m,
          std::uint64_t n, std::uint64_t k, std::uint64_t lda_rows, std::uint64_t lda_cols,
          std::uint64_t ldb_rows, std::uint64_t ldb_cols, cublasLtEpilogue_t epilogue,
          std::size_t workspace) {
    WM_MLP_CUBLAS_TRY(cublasLtMatmulDescCreate(&op_, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    WM_MLP_CUBLAS_TRY(
        cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    WM_MLP_CUBLAS_TRY(
        cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    WM_MLP_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                                     sizeof epilogue));
    WM_MLP_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&a_, CUDA_R_16BF, lda_rows, lda_cols, lda_rows));
    WM_MLP_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&b_, CUDA_R_16BF, ldb_rows, ldb_cols, ldb_rows));
    WM_MLP_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&c_, CUDA_R_16BF, m, n, m));
    (void)k;
    cublasLtMatmulPreference_t pref{};
    WM_MLP_CUBLAS_TRY(cublasLtMatmulPreferenceCreate(&pref));
    WM_MLP_CUBLAS_TRY(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof workspace));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    cublasStatus_t const st =
        cublasLtMatmulAlgoGetHeuristic(h, op_, a_, b_, c_, c_, pref, 1, &result, &found);
    (void)cublasLtMatmulPreferenceDestroy(pref);
    WM_MLP_CUBLAS_TRY(st);
    if (found == 0) { throw std::runtime_error{"cuBLASLt found no algorithm for an MLP GEMM"}; }
    algo_ = result.algo;
  }
  lt_gemm(lt_gemm const&)            = delete;
  lt_gemm& operator=(lt_gemm const&) = delete;
  lt_gemm(lt_gemm&& o) noexcept { *this = std::move(o); }
  lt_gemm& operator=(lt_gemm&& o) noexcept {
    std::swap(op_, o.op_);
    std::swap(a_, o.a_);
    std::swap(b_, o.b_);
    std::swap(c_, o.c_);
    algo_ = o.algo_;
    return *this;
  }
  ~lt_gemm() {
    if (op_ != nullptr) { (void)cublasLtMatmulDescDestroy(op_); }
    if (a_ != nullptr) { (void)cublasLtMatrixLayoutDestroy(a_); }
    if (b_ != nullptr) { (void)cublasLtMatrixLayoutDestroy(b_); }
    if (c_ != nullptr) { (void)cublasLtMatrixLayoutDestroy(c_); }
  }

  /// C = op(A) op(B) (column-major).
  void run(cublasLtHandle_t h, bf16 const* a, bf16 const* b, bf16* c, void* workspace,
           std::size_t workspace_bytes, cudaStream_t s) const {
    float const alpha = 1.0f;
    float const beta  = 0.0f;
    WM_MLP_CUBLAS_TRY(cublasLtMatmul(h, op_, &alpha, a, a_, b, b_, &beta, c, c_, c, c_, &algo_,
                                     workspace, workspace_bytes, s));
  }

 private:
  cublasLtMatmulDesc_t op_{nullptr};
  cublasLtMatrixLayout_t a_{nullptr};
  cublasLtMatrixLayout_t b_{nullptr};
  cublasLtMatrixLayout_t c_{nullptr};
  cublasLtMatmulAlgo_t algo_{};
};

/// The MLP: weights, gradients, two gradient buffers for the activations, cuBLASLt state.
class mlp {
 public:
  static constexpr std::size_t workspace_bytes = std::size_t{32} << 20;

  mlp(int layers, int width, int batch, std::uint64_t seed, int max_steps = 1024)
      : layers_{layers}, width_{width}, batch_{batch}, max_steps_{max_steps} {
    if (layers < 1 || width < 1 || batch < 1 || max_steps < 1) {
      throw std::invalid_argument{"mlp: layers, width, batch and max_steps must be positive"};
    }
    WM_MLP_CUBLAS_TRY(cublasLtCreate(&handle_));
    std::size_t const w = weight_elements();
    std::size_t const a = activation_elements();
    weights_.resize(layers);
    grads_.resize(layers);
    for (int i = 0; i < layers; ++i) {
      WM_CUDA_TRY(cudaMalloc(&weights_[i], w * sizeof(bf16)));
      WM_CUDA_TRY(cudaMalloc(&grads_[i], w * sizeof(bf16)));
      fill_uniform_kernel<<<1024, 256>>>(weights_[i], w, mix(seed + 1 + i),
                                         1.7f / std::sqrt(static_cast<float>(width)));
      WM_CHECK_LAUNCH();
    }
    WM_CUDA_TRY(cudaMalloc(&dy_[0], a * sizeof(bf16)));
    WM_CUDA_TRY(cudaMalloc(&dy_[1], a * sizeof(bf16)));
    WM_CUDA_TRY(cudaMalloc(&workspace_, workspace_bytes));
    WM_CUDA_TRY(cudaMalloc(&losses_, (max_steps + 1) * sizeof(float)));
    WM_CUDA_TRY(cub::DeviceReduce::TransformReduce(nullptr, reduce_bytes_, dy_[0], losses_, a,
                                                   plus_op{}, square_op{}, 0.0f));
    WM_CUDA_TRY(cudaMalloc(&reduce_temp_, reduce_bytes_));
    std::uint64_t const W = static_cast<std::uint64_t>(width);
    std::uint64_t const B = static_cast<std::uint64_t>(batch);
    // Row-major X[B×W], weight[W×W] (out × in) are column-major X^T[W×B], weight^T[W×W].
    // forward  Y^T = weight · X^T:       A = weight^T (W×W) transposed, B = X^T (W×B).
    forward_ = lt_gemm{
        handle_,        CUBLAS_OP_T, CUBLAS_OP_N, W, B, W, W, W, W, B, CUBLASLT_EPILOGUE_RELU,
        workspace_bytes};
    // dX^T = weight^T · dP^T:            A = weight^T (W×W), B = dP^T (W×B).
    backward_data_ = lt_gemm{
        handle_,        CUBLAS_OP_N, CUBLAS_OP_N, W, B, W, W, W, W, B, CUBLASLT_EPILOGUE_DEFAULT,
        workspace_bytes};
    // dweight^T = X^T · dP:              A = X^T (W×B), B = dP^T (W×B) transposed.
    backward_weight_ = lt_gemm{
        handle_,        CUBLAS_OP_N, CUBLAS_OP_T, W, W, B, W, B, W, B, CUBLASLT_EPILOGUE_DEFAULT,
        workspace_bytes};
    WM_CUDA_TRY(cudaDeviceSynchronize());
  }
  mlp(mlp const&)            = delete;
  mlp& operator=(mlp const&) = delete;
  ~mlp() {
    (void)cudaDeviceSynchronize();
    for (auto* p : weights_) { (void)cudaFree(p); }
    for (auto* p : grads_) { (void)cudaFree(p); }
    (void)cudaFree(dy_[0]);
    (void)cudaFree(dy_[1]);
    (void)cudaFree(workspace_);
    (void)cudaFree(losses_);
    (void)cudaFree(reduce_temp_);
    if (handle_ != nullptr) { (void)cublasLtDestroy(handle_); }
  }

  [[nodiscard]] int layers() const noexcept { return layers_; }
  [[nodiscard]] std::size_t weight_elements() const noexcept {
    return static_cast<std::size_t>(width_) * width_;
  }
  [[nodiscard]] std::size_t activation_elements() const noexcept {
    return static_cast<std::size_t>(batch_) * width_;
  }
  [[nodiscard]] std::size_t activation_bytes() const noexcept {
    return activation_elements() * sizeof(bf16);
  }
  /// FLOPs of one step (3 GEMMs per layer but 2 for the first, which needs no dX).
  [[nodiscard]] double step_flops() const noexcept {
    return 2.0 * batch_ * static_cast<double>(width_) * width_ * (3.0 * layers_ - 1.0);
  }

  /**
   * @brief One training step on @p s: input x_0 from @p seed, forward, loss into losses()[@p
   * step], backward, SGD with @p lr. Enqueues only (no host wait).
   */
  template <activation_store S>
  void step(S& store, int step, std::uint64_t seed, float lr, cudaStream_t s) {
    if (step < 0 || step >= max_steps_) { throw std::out_of_range{"mlp::step: step out of range"}; }
    std::size_t const n = activation_elements();
    bf16* x0            = store.create(0, s);
    fill_uniform_kernel<<<1024, 256, 0, s>>>(x0, n, mix(seed), 1.0f);
    WM_CHECK_LAUNCH();
    // Forward: x_i = relu(x_{i-1} · weight_i^T).
    for (int i = 1; i <= layers_; ++i) {
      bf16* in  = store.get(i - 1, s);
      bf16* out = store.create(i, s);
      forward_.run(handle_, weights_[i - 1], in, out, workspace_, workspace_bytes, s);
      store.forward_done(i - 1, s);
    }
    // Loss 0.5 Σ y² / batch and its gradient.
    bf16* y           = store.get(layers_, s);
    float const scale = 1.0f / static_cast<float>(batch_);
    WM_CUDA_TRY(cub::DeviceReduce::TransformReduce(
        reduce_temp_, reduce_bytes_, y, losses_ + max_steps_, n, plus_op{}, square_op{}, 0.0f, s));
    finish_loss_kernel<<<1, 1, 0, s>>>(losses_ + max_steps_, losses_ + step, scale);
    WM_CHECK_LAUNCH();
    loss_grad_kernel<<<1024, 256, 0, s>>>(dy_[0], y, n, scale);
    WM_CHECK_LAUNCH();
    store.forward_done(layers_, s);
    store.backward_begin(s);
    // Backward: dP = dY ∘ [x_i > 0]; dweight_i = dP^T x_{i-1}; dX_{i-1} = dP · weight_i.
    int cur = 0;
    for (int i = layers_; i >= 1; --i) {
      bf16* xi = store.get(i, s);
      relu_backward_kernel<<<1024, 256, 0, s>>>(dy_[cur], xi, n);
      WM_CHECK_LAUNCH();
      store.backward_done(i, s);
      bf16* xin = store.get(i - 1, s);
      backward_weight_.run(handle_, xin, dy_[cur], grads_[i - 1], workspace_, workspace_bytes, s);
      if (i > 1) {
        backward_data_.run(handle_, weights_[i - 1], dy_[cur], dy_[1 - cur], workspace_,
                           workspace_bytes, s);
        cur = 1 - cur;
      } else {
        store.backward_done(0, s);
      }
    }
    for (int i = 0; i < layers_; ++i) {
      sgd_kernel<<<1024, 256, 0, s>>>(weights_[i], grads_[i], weight_elements(), lr);
      WM_CHECK_LAUNCH();
    }
  }

  /// The losses of steps [0, @p count) (synchronizes the device).
  [[nodiscard]] std::vector<float> losses(int count) const {
    std::vector<float> h(static_cast<std::size_t>(count));
    WM_CUDA_TRY(cudaDeviceSynchronize());
    WM_CUDA_TRY(cudaMemcpy(h.data(), losses_, h.size() * sizeof(float), cudaMemcpyDeviceToHost));
    return h;
  }

 private:
  int layers_;
  int width_;
  int batch_;
  int max_steps_;
  cublasLtHandle_t handle_{nullptr};
  std::vector<bf16*> weights_;
  std::vector<bf16*> grads_;
  bf16* dy_[2]{nullptr, nullptr};
  void* workspace_{nullptr};
  float* losses_{nullptr};
  void* reduce_temp_{nullptr};
  std::size_t reduce_bytes_{0};
  lt_gemm forward_;
  lt_gemm backward_data_;
  lt_gemm backward_weight_;
};

/// Every activation in device memory, allocated once (no swap).
class resident_store {
 public:
  resident_store(int layers, std::size_t bytes) : x_(static_cast<std::size_t>(layers) + 1) {
    for (auto& p : x_) { WM_CUDA_TRY(cudaMalloc(&p, bytes)); }
  }
  resident_store(resident_store const&)            = delete;
  resident_store& operator=(resident_store const&) = delete;
  ~resident_store() {
    for (auto* p : x_) { (void)cudaFree(p); }
  }
  bf16* create(int i, cudaStream_t) { return x_.at(static_cast<std::size_t>(i)); }
  bf16* get(int i, cudaStream_t) { return x_.at(static_cast<std::size_t>(i)); }
  void forward_done(int, cudaStream_t) {}
  void backward_begin(cudaStream_t) {}
  void backward_done(int, cudaStream_t) {}

 private:
  std::vector<bf16*> x_;
};

}  // namespace wm_workload
