// SPDX-License-Identifier: Apache-2.0
/*
 * The embedding tables of the PyTorch bridge behind one interface (`wm_torch::table`), so that
 * the extension's bindings (wm_torch.cpp, which includes torch) know no wm template, and each
 * group of wm::embedding instantiations compiles in its own translation unit
 * (wm_torch_tables_*.cu, without torch's headers), in parallel.
 *
 * Raw pointers and a cudaStream_t cross this interface: the bindings check the torch tensors
 * (device, dtype, contiguity, sizes) and pass `data_ptr()` and the current stream.
 */
#pragma once

#include <wm/cache.hpp>
#include <wm/comm.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace wm_torch {

/// What a table is made of; the Python class `wm_torch.Embedding` fills it.
struct table_options {
  std::size_t rows{0};
  std::size_t dim{0};
  std::string location{"device"};  ///< "device" or "host" (pinned host memory)
  std::string cache{"none"};       ///< "none", "read_write" or "read_only" (host tables only)
  double cache_ratio{0.1};         ///< fraction of the rows the cache holds
  std::uint32_t cache_hash_seed{0};
  std::string optimizer{"sgd"};  ///< "sgd", "adam" or "none"
  // SGD and Adam
  float weight_decay{0.0f};
  // Adam
  float beta1{0.9f};
  float beta2{0.999f};
  float eps{1e-8f};
  bool decoupled{false};    ///< AdamW's decay
  bool global_step{false};  ///< one step count for the table (torch.optim.SparseAdam), else per row
  bool sparse_adam_epsilon{false};  ///< SparseAdam's epsilon placement, else torch.optim.Adam's
  // Initial weights (wm::embedding_init)
  std::string init{"uniform"};  ///< "zeros", "uniform" (a, b = low, high), "normal" (mean, std)
  float init_a{-0.05f};
  float init_b{0.05f};
  std::uint64_t init_seed{42};
};

/// One wm::embedding<float, ...>, whatever its policies. Keys are int64 on the device.
class table {
 public:
  virtual ~table() = default;

  /// out[i, :] = row keys[i] (see wm::embedding::gather).
  virtual void gather(std::int64_t const* keys, std::size_t n, float* out, cudaStream_t s) = 0;
  /// Backward + update (collective; synchronizes @p s). @throw wm::logic_error without optimizer
  virtual void apply_gradients(std::int64_t const* keys, std::size_t n, float const* grads,
                               float lr, cudaStream_t s) = 0;
  /// Writes rows (last occurrence wins). Collective: every rank calls it, each with its own keys
  /// (any rows, or none). Every rank's cache is flushed and emptied first, and every rank's rows
  /// are in the table when it returns, so every rank's gathers see the new rows (a key written
  /// by several ranks gets one of their values). Optimizer states are left as they are.
  /// Synchronizes @p s. @throw wm::logic_error on every rank if a rank passed a key out of range
  virtual void write_rows(std::int64_t const* keys, std::size_t n, float const* values,
                          cudaStream_t s) = 0;
  /// Admits the rows of the next batch (cached tables; a no-op without cache).
  virtual void prefetch(std::int64_t const* keys, std::size_t n, cudaStream_t s) = 0;
  /// Writes dirty lines back (read_write cache; a no-op otherwise).
  virtual void flush(cudaStream_t s) = 0;
  /// flush(), then empties the cache (a no-op without cache).
  virtual void invalidate(cudaStream_t s) = 0;
  /// The cache's counters (zeros without cache). @throw wm::logic_error after an invalid key
  [[nodiscard]] virtual wm::cache_statistics cache_stats() = 0;
  virtual void reset_cache_stats()                         = 0;
  [[nodiscard]] virtual std::size_t cache_lines() const    = 0;
  [[nodiscard]] virtual std::int64_t global_step() const   = 0;
  /// Checkpoints (collective; see wm::embedding::store / load).
  virtual void store(std::string const& prefix) = 0;
  virtual void load(std::string const& prefix)  = 0;

  [[nodiscard]] std::size_t rows() const noexcept { return rows_; }
  [[nodiscard]] std::size_t dim() const noexcept { return dim_; }
  [[nodiscard]] bool trainable() const noexcept { return trainable_; }
  [[nodiscard]] bool cached() const noexcept { return cached_; }
  [[nodiscard]] std::string const& description() const noexcept { return description_; }

 protected:
  std::size_t rows_{0};
  std::size_t dim_{0};
  bool trainable_{false};
  bool cached_{false};
  std::string description_;
};

/// Tables in device memory without cache: optimizer sgd, adam or none
/// (wm_torch_tables_device.cu).
[[nodiscard]] std::unique_ptr<table> make_device_table(wm::communicator& comm,
                                                       table_options const& o);
/// Tables in pinned host memory, with a read_write cache (sgd, adam), a read_only cache (none)
/// or no cache (sgd, adam, none) (wm_torch_tables_host.cu).
[[nodiscard]] std::unique_ptr<table> make_host_table(wm::communicator& comm,
                                                     table_options const& o);

}  // namespace wm_torch
