/*
 * Example 07: data-parallel training with ZeRO stage 2 (issue 20, DESIGN.md §8).
 *
 * What it teaches:
 *  - `wm::zero_optimizer<wm::zero_stage<2>, wm::adam>` takes the model's parameter list (names,
 *    shapes, bf16) and a bucket size, and owns every byte of the model state from then on: the
 *    bf16 weights (one arena, every rank), the gradients (each rank keeps its shard; backward
 *    writes into two bucket staging buffers), and the fp32 master weights and Adam moments of
 *    the rank's shard only. `memory()` reports them; nothing is allocated while training.
 *  - The model reads `opt.weights<bf16>(p)` and writes `opt.gradients<bf16>(p)`. Buckets are in
 *    backward order: as soon as backward has produced the last gradient of a bucket,
 *    `reduce_gradients(bucket, stream)` reduce-scatters it (it overlaps the rest of backward).
 *  - `step(lr, stream)`: the global gradient norm and the inf check from one scalar all-reduce,
 *    one fused Adam kernel per shard writing bf16 weights, then the in-place all-gather.
 *
 * The model: the MLP of bench/workloads/mlp.cuh (bf16 Linear + ReLU layers through cuBLASLt,
 * loss 0.5 · Σ y² / batch), its GEMMs and kernels reused here with the weights and gradients in
 * the optimizer's arena. Each rank trains on its own batches; the mean loss over the ranks is
 * printed and must fall.
 *
 * The same training runs twice: with the update on the GPU, then with `wm::offload_host` (fp32
 * master weights and Adam moments in pinned host memory, the CPU Adam updating each bucket while
 * the previous bucket's weights go back to the GPU); the two loss curves must agree.
 *
 * Run: ./07_zero_training [ranks]     (default: one rank per GPU)
 */
#include <wm/wm.cuh>
#include <wm/zero.cuh>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "workloads/mlp.cuh"

constexpr int layers              = 8;
constexpr int width               = 2048;
constexpr int batch               = 4096;
constexpr int steps               = 30;
constexpr float lr                = 1e-3f;
constexpr std::size_t bucket_size = std::size_t{16} << 20;  // two layers of 8 MiB per bucket

using bf16   = __nv_bfloat16;
namespace wl = wm_workload;

// The MLP of bench/workloads/mlp.cuh, its weights and gradients living in the ZeRO arena.
template <class Offload>
class zero_mlp {
 public:
  using optimizer = wm::zero_optimizer<wm::zero_stage<2>, wm::adam, Offload>;

  explicit zero_mlp(optimizer& opt) : opt_{opt} {
    WM_MLP_CUBLAS_TRY(cublasLtCreate(&handle_));
    std::size_t const a = static_cast<std::size_t>(batch) * width;
    for (auto& x : x_) { WM_CUDA_TRY(cudaMalloc(&x, a * sizeof(bf16))); }
    WM_CUDA_TRY(cudaMalloc(&dy_[0], a * sizeof(bf16)));
    WM_CUDA_TRY(cudaMalloc(&dy_[1], a * sizeof(bf16)));
    WM_CUDA_TRY(cudaMalloc(&workspace_, wl::mlp::workspace_bytes));
    WM_CUDA_TRY(cudaMalloc(&sum_, 2 * sizeof(float)));
    WM_CUDA_TRY(cub::DeviceReduce::TransformReduce(nullptr, reduce_bytes_, x_[0], sum_, a,
                                                   wl::plus_op{}, wl::square_op{}, 0.0f));
    WM_CUDA_TRY(cudaMalloc(&reduce_temp_, reduce_bytes_));
    auto const W = static_cast<std::uint64_t>(width);
    auto const B = static_cast<std::uint64_t>(batch);
    // The three GEMM shapes of mlp.cuh (column-major views of row-major matrices).
    forward_         = wl::lt_gemm{handle_,
                           CUBLAS_OP_T,
                           CUBLAS_OP_N,
                           W,
                           B,
                           W,
                           W,
                           W,
                           W,
                           B,
                           CUBLASLT_EPILOGUE_RELU,
                           wl::mlp::workspace_bytes};
    backward_data_   = wl::lt_gemm{handle_,
                                 CUBLAS_OP_N,
                                 CUBLAS_OP_N,
                                 W,
                                 B,
                                 W,
                                 W,
                                 W,
                                 W,
                                 B,
                                 CUBLASLT_EPILOGUE_DEFAULT,
                                 wl::mlp::workspace_bytes};
    backward_weight_ = wl::lt_gemm{handle_,
                                   CUBLAS_OP_N,
                                   CUBLAS_OP_T,
                                   W,
                                   W,
                                   B,
                                   W,
                                   B,
                                   W,
                                   B,
                                   CUBLASLT_EPILOGUE_DEFAULT,
                                   wl::mlp::workspace_bytes};
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
    (void)cublasLtDestroy(handle_);
  }

  // Forward and backward on a batch drawn from @p seed; each bucket is reduced as soon as its
  // last gradient is written. The loss goes to device memory (read it after the step).
  void forward_backward(std::uint64_t seed, cudaStream_t s) {
    std::size_t const n = static_cast<std::size_t>(batch) * width;
    wl::fill_uniform_kernel<<<1024, 256, 0, s>>>(x_[0], n, wl::mix(seed), 1.0f);
    WM_CHECK_LAUNCH();
    for (int i = 1; i <= layers; ++i) {
      forward_.run(handle_, weight(i - 1), x_[i - 1], x_[i], workspace_, wl::mlp::workspace_bytes,
                   s);
    }
    float const scale = 1.0f / static_cast<float>(batch);
    WM_CUDA_TRY(cub::DeviceReduce::TransformReduce(reduce_temp_, reduce_bytes_, x_[layers], sum_, n,
                                                   wl::plus_op{}, wl::square_op{}, 0.0f, s));
    wl::finish_loss_kernel<<<1, 1, 0, s>>>(sum_, sum_ + 1, scale);
    WM_CHECK_LAUNCH();
    wl::loss_grad_kernel<<<1024, 256, 0, s>>>(dy_[0], x_[layers], n, scale);
    WM_CHECK_LAUNCH();
    auto const& plan = opt_.layout();
    int cur          = 0;
    for (int i = layers; i >= 1; --i) {
      wl::relu_backward_kernel<<<1024, 256, 0, s>>>(dy_[cur], x_[i], n);
      WM_CHECK_LAUNCH();
      auto const p = static_cast<std::size_t>(i - 1);
      backward_weight_.run(handle_, x_[i - 1], dy_[cur], opt_.template gradients<bf16>(p).data(),
                           workspace_, wl::mlp::workspace_bytes, s);
      // The bucket is complete once its lowest-numbered parameter has its gradient.
      std::size_t const b = opt_.bucket_of(p);
      if (plan.buckets[b].params.back() == p) { opt_.reduce_gradients(b, cuda::stream_ref{s}); }
      if (i > 1) {
        backward_data_.run(handle_, weight(i - 1), dy_[cur], dy_[1 - cur], workspace_,
                           wl::mlp::workspace_bytes, s);
        cur = 1 - cur;
      }
    }
  }

  [[nodiscard]] float const* loss() const noexcept { return sum_ + 1; }

 private:
  bf16* weight(int i) { return opt_.template weights<bf16>(static_cast<std::size_t>(i)).data(); }

  optimizer& opt_;
  cublasLtHandle_t handle_{nullptr};
  bf16* x_[layers + 1]{};
  bf16* dy_[2]{};
  void* workspace_{nullptr};
  float* sum_{nullptr};  // [0]: Σ y², [1]: the loss
  void* reduce_temp_{nullptr};
  std::size_t reduce_bytes_{0};
  wl::lt_gemm forward_;
  wl::lt_gemm backward_data_;
  wl::lt_gemm backward_weight_;
};

// Trains a fresh model (same seed every time) and returns the mean loss of every step.
template <class Offload>
std::vector<double> train(wm::communicator& comm, cudaStream_t stream) {
  cuda::stream_ref const s{stream};
  using model_type = zero_mlp<Offload>;
  // 1. The parameter list, forward order: one width × width bf16 weight per layer.
  std::vector<wm::zero_parameter> params;
  for (int i = 0; i < layers; ++i) {
    params.push_back({"layer" + std::to_string(i) + ".weight",
                      {static_cast<std::size_t>(width), static_cast<std::size_t>(width)}});
  }
  // 2. The optimizer: plan, arena, shards, all allocated now (collective).
  wm::zero_options options;
  options.max_grad_norm = 1.0f;
  typename model_type::optimizer opt{comm, params, bucket_size, wm::adam{}, options};
  auto const mem = opt.memory();
  if (comm.rank() == 0) {
    std::printf(
        "ZeRO-2%s on %d rank(s), %zu buckets, per rank: weights %.1f MiB, gradient shard "
        "%.1f MiB, fp32 master + Adam states %.1f MiB, staging %.1f MiB; pinned host %.1f "
        "MiB\n",
        Offload::host ? " with offload" : "", comm.size(), opt.buckets(), mem.weights / 1048576.0,
        mem.gradients / 1048576.0, (mem.master_weights + mem.optimizer_states) / 1048576.0,
        mem.buffers / 1048576.0, mem.host / 1048576.0);
  }

  // 3. Initial weights, the same on every rank (as mlp.cuh draws them).
  bf16* init          = nullptr;
  std::size_t const w = static_cast<std::size_t>(width) * width;
  WM_CUDA_TRY(cudaMalloc(&init, w * sizeof(bf16)));
  for (int i = 0; i < layers; ++i) {
    wl::fill_uniform_kernel<<<1024, 256, 0, stream>>>(
        init, w, wl::mix(42 + 1 + static_cast<std::uint64_t>(i)),
        1.7f / std::sqrt(static_cast<float>(width)));
    WM_CHECK_LAUNCH();
    opt.set_weights(static_cast<std::size_t>(i), static_cast<bf16 const*>(init), s);
  }
  comm.synchronize(s);
  WM_CUDA_TRY(cudaFree(init));

  // 4. Train: forward, backward with per-bucket reduce-scatters, one ZeRO step.
  model_type model{opt};
  std::vector<double> losses;
  double first = 0, last = 0;
  for (int step = 0; step < steps; ++step) {
    std::uint64_t const seed =
        1000003ull * static_cast<std::uint64_t>(step) + static_cast<std::uint64_t>(comm.rank());
    model.forward_backward(seed, stream);
    opt.step(lr, s);
    float loss = 0;
    WM_CUDA_TRY(
        cudaMemcpyAsync(&loss, model.loss(), sizeof(float), cudaMemcpyDeviceToHost, stream));
    comm.synchronize(s);
    double mean = 0;
    for (float l : comm.all_gather(loss)) { mean += l; }
    mean /= comm.size();
    if (step == 0) { first = mean; }
    last = mean;
    losses.push_back(mean);
    if (comm.rank() == 0 && (step % 5 == 0 || step == steps - 1)) {
      std::printf("step %2d  loss %.6g%s\n", step, mean,
                  opt.last_step_skipped(s) ? "  (skipped: inf/NaN gradient)" : "");
    }
  }
  // 5. The loss must have fallen.
  if (!(std::isfinite(last) && last < 0.5 * first)) {
    throw std::runtime_error{"the loss did not fall: " + std::to_string(first) + " -> " +
                             std::to_string(last)};
  }
  if (comm.rank() == 0) {
    std::printf("loss fell from %.6g to %.6g (%lld steps applied)\n", first, last,
                static_cast<long long>(opt.applied_steps(s)));
  }
  return losses;
}

int main(int argc, char** argv) {
  int const gpus  = wm::local_device_count();
  int const ranks = argc > 1 ? std::atoi(argv[1]) : gpus;
  if (gpus == 0) {
    std::printf("07_zero_training: no GPU found, nothing to run\n");
    return 0;
  }
  if (ranks < 1 || ranks > gpus) {
    std::fprintf(stderr, "07_zero_training: ranks must be in [1, %d]\n", gpus);
    return 2;
  }
  try {
    wm::launch(ranks, [](wm::communicator& comm) {
      cudaStream_t stream{};
      WM_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

      auto const device  = train<wm::no_offload>(comm, stream);
      auto const offload = train<wm::offload_host>(comm, stream);
      // 6. Offload moves the update to the CPU, not what it computes: the losses agree.
      for (int step = 0; step < steps; ++step) {
        double const a = device[static_cast<std::size_t>(step)];
        double const b = offload[static_cast<std::size_t>(step)];
        if (!(std::abs(a - b) <= 0.02 * std::abs(a))) {
          throw std::runtime_error{"step " + std::to_string(step) + ": loss " + std::to_string(a) +
                                   " on the GPU, " + std::to_string(b) + " with offload"};
        }
      }
      if (comm.rank() == 0) { std::printf("offload follows the on-device run within 2%%\n"); }
      WM_CUDA_TRY(cudaStreamDestroy(stream));
    });
  } catch (wm::launch_error const& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  std::printf("07_zero_training: OK on %d rank(s)\n", ranks);
  return 0;
}
