// SPDX-License-Identifier: Apache-2.0
// A user's file that uses one module: one embedding<float, no_cache, adam> gather and update.
// scripts/user-compile-times.sh compiles it alone and reports nvcc's phases (bench/NOTES.md,
// "Compile time"): the cost every such file of a user's pays.
#include <wm/embedding.cuh>

#include <cstdint>
#include <span>

void train_step(wm::embedding<float, wm::no_cache, wm::adam>& table,
                std::span<std::int64_t const> keys, float* rows, float const* grads,
                cudaStream_t stream) {
  table.gather(keys, rows, stream);
  table.apply_gradients(keys, grads, 0.01f, stream);
}

wm::embedding<float, wm::no_cache, wm::adam> make_table(wm::communicator& comm) {
  return wm::embedding<float, wm::no_cache, wm::adam>{comm, 1000, 16};
}
