// SPDX-License-Identifier: Apache-2.0
// Runs wm's Adam on data given as files, for tests/embedding/torch_sparse_adam.py, which runs
// torch.optim.SparseAdam, torch.optim.Adam or torch.optim.AdamW on the same data and compares.
//
// Usage: sparse_adam_check DIR   with DIR/meta.txt ("rows dim steps lr beta1 beta2 eps", then
// optionally "mode weight_decay bias_correction": mode sparse_adam (default: global step,
// SparseAdam's epsilon), adam (L2 decay) or adamw (decoupled decay), both with torch's epsilon;
// bias_correction per_row or global_step), DIR/weights.bin (rows x dim float32),
// DIR/keys<k>.bin (int64), DIR/grads<k>.bin (float32); writes DIR/wm_result.bin.
#include <wm/embedding.cuh>
#include <wm/launch.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

template <class T>
std::vector<T> read_file(std::filesystem::path const& p) {
  std::ifstream in{p, std::ios::binary};
  if (!in) { throw std::runtime_error{"cannot read " + p.string()}; }
  auto const bytes = std::filesystem::file_size(p);
  std::vector<T> v(bytes / sizeof(T));
  in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(bytes));
  return v;
}

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  std::filesystem::path const dir{argv[1]};
  if (wm::local_device_count() == 0) {
    std::printf("no GPU\n");
    return 77;
  }
  try {
    wm::launch(1, [&](wm::communicator& comm) {
      std::ifstream meta{dir / "meta.txt"};
      std::size_t rows = 0, dim = 0;
      int steps = 0;
      float lr = 0, b1 = 0, b2 = 0, eps = 0;
      meta >> rows >> dim >> steps >> lr >> b1 >> b2 >> eps;
      if (!meta) { throw std::runtime_error{"bad meta.txt"}; }
      std::string mode = "sparse_adam", bias = "global_step";
      float wd = 0;
      if (meta >> mode) { meta >> wd >> bias; }
      if (!(mode == "sparse_adam" || mode == "adam" || mode == "adamw") ||
          !(bias == "per_row" || bias == "global_step")) {
        throw std::runtime_error{"bad mode in meta.txt"};
      }
      wm::adam opt;
      opt.beta1           = b1;
      opt.beta2           = b2;
      opt.eps             = eps;
      opt.weight_decay    = wd;
      opt.decoupled       = mode == "adamw";
      opt.bias_correction = bias == "per_row" ? wm::adam_bias_correction::per_row
                                              : wm::adam_bias_correction::global_step;
      // SparseAdam: one step count for the table and eps added to sqrt(v) before the correction.
      opt.epsilon =
          mode == "sparse_adam" ? wm::adam_epsilon::sparse_adam : wm::adam_epsilon::torch_adam;
      std::printf("wm::adam %s: weight decay %g, decoupled %d, %s\n", mode.c_str(),
                  static_cast<double>(wd), opt.decoupled ? 1 : 0, wm::checkpoint_tag(opt).c_str());
      wm::embedding<float, wm::no_cache, wm::adam> e{comm, rows, dim, opt,
                                                     wm::embedding_init::zeros()};
      e.weights().load(dir / "weights.bin");
      cudaStream_t s{};
      WM_CUDA_TRY(cudaStreamCreate(&s));
      for (int k = 0; k < steps; ++k) {
        auto const keys  = read_file<std::int64_t>(dir / ("keys" + std::to_string(k) + ".bin"));
        auto const grads = read_file<float>(dir / ("grads" + std::to_string(k) + ".bin"));
        std::int64_t* dk = nullptr;
        float* dg        = nullptr;
        WM_CUDA_TRY(cudaMalloc(&dk, std::max<std::size_t>(keys.size(), 1) * sizeof(std::int64_t)));
        WM_CUDA_TRY(cudaMalloc(&dg, std::max<std::size_t>(grads.size(), 1) * sizeof(float)));
        WM_CUDA_TRY(cudaMemcpy(dk, keys.data(), keys.size() * sizeof(std::int64_t),
                               cudaMemcpyHostToDevice));
        WM_CUDA_TRY(
            cudaMemcpy(dg, grads.data(), grads.size() * sizeof(float), cudaMemcpyHostToDevice));
        e.apply_gradients(std::span<std::int64_t const>{dk, keys.size()}, dg, lr,
                          cuda::stream_ref{s});
        WM_CUDA_TRY(cudaFree(dk));
        WM_CUDA_TRY(cudaFree(dg));
      }
      auto const files = e.weights().store(dir / "wm_result");
      std::filesystem::rename(files.at(0), dir / "wm_result.bin");
      WM_CUDA_TRY(cudaStreamDestroy(s));
    });
  } catch (std::exception const& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
