// SPDX-License-Identifier: Apache-2.0
/*
 * `wm_torch::table_impl<Embedding>`: one wm::embedding behind the `wm_torch::table` interface,
 * and the translation of `wm_torch::table_options` into wm's policies and hyper-parameters.
 * Included by wm_torch_tables_device.cu and wm_torch_tables_host.cu only.
 */
#pragma once

#include <wm/detail/memory/collective.hpp>
#include <wm/embedding.cuh>
#include <wm/error.hpp>
#include <wm/optimizer.hpp>

#include <cuda/stream_ref>

#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "wm_torch_tables.hpp"

namespace wm_torch {

[[nodiscard]] inline wm::embedding_init init_of(table_options const& o) {
  if (o.init == "zeros") { return wm::embedding_init::zeros(); }
  if (o.init == "uniform") { return wm::embedding_init::uniform(o.init_a, o.init_b, o.init_seed); }
  if (o.init == "normal") { return wm::embedding_init::normal(o.init_a, o.init_b, o.init_seed); }
  throw std::invalid_argument{"wm_torch: init must be 'zeros', 'uniform' or 'normal', not '" +
                              o.init + "'"};
}

[[nodiscard]] inline wm::sgd sgd_of(table_options const& o) {
  wm::sgd s;
  s.weight_decay = o.weight_decay;
  return s;
}

[[nodiscard]] inline wm::adam adam_of(table_options const& o) {
  wm::adam a;
  a.beta1        = o.beta1;
  a.beta2        = o.beta2;
  a.eps          = o.eps;
  a.weight_decay = o.weight_decay;
  a.decoupled    = o.decoupled;
  a.bias_correction =
      o.global_step ? wm::adam_bias_correction::global_step : wm::adam_bias_correction::per_row;
  a.epsilon = o.sparse_adam_epsilon ? wm::adam_epsilon::sparse_adam : wm::adam_epsilon::torch_adam;
  return a;
}

template <class Optimizer>
[[nodiscard]] Optimizer optimizer_of(table_options const& o) {
  if constexpr (std::is_same_v<Optimizer, wm::adam>) {
    return adam_of(o);
  } else if constexpr (std::is_same_v<Optimizer, wm::sgd>) {
    return sgd_of(o);
  } else {
    return Optimizer{};
  }
}

/// wm::embedding_init, wm::cache_options from the options.
[[nodiscard]] inline wm::cache_options cache_of(table_options const& o) {
  wm::cache_options c;
  c.ratio     = o.cache_ratio;
  c.hash_seed = o.cache_hash_seed;
  return c;
}

template <class Embedding>
class table_impl final : public table {
  using cache_type                = typename Embedding::cache_policy_type;
  using optimizer_type            = typename Embedding::optimizer_type;
  static constexpr bool has_cache = wm::detail::caching_policy<cache_type>;
  static constexpr bool has_opt   = wm::sparse_optimizer<optimizer_type>;

 public:
  table_impl(wm::communicator& comm, table_options const& o)
      : emb_{comm, o.rows, o.dim, optimizer_of<optimizer_type>(o), init_of(o), cache_of(o)} {
    comm_        = &comm;
    rows_        = o.rows;
    dim_         = o.dim;
    trainable_   = has_opt;
    cached_      = has_cache;
    description_ = o.location + " table, cache " + o.cache + ", optimizer " + o.optimizer;
  }

  void gather(std::int64_t const* keys, std::size_t n, float* out, cudaStream_t s) override {
    emb_.gather(std::span<std::int64_t const>{keys, n}, out, cuda::stream_ref{s});
  }

  void apply_gradients(std::int64_t const* keys, std::size_t n, float const* grads, float lr,
                       cudaStream_t s) override {
    if constexpr (has_opt) {
      emb_.apply_gradients(std::span<std::int64_t const>{keys, n}, grads, lr, cuda::stream_ref{s});
    } else {
      throw wm::logic_error{"wm_torch: apply_gradients on a table without optimizer (" +
                            description_ + ")"};
    }
  }

  void write_rows(std::int64_t const* keys, std::size_t n, float const* values,
                  cudaStream_t s) override {
    // Collective. On several ranks each rank caches rows of its own part, while the mapped
    // scatter below writes any rank's rows through the mapping: an owner's dirty line would
    // overwrite a new row at its write-back, a clean one would serve the old row. So (1) every
    // rank writes its dirty lines back and empties its cache, (2) once every rank has (the step
    // is collective: no write-back lands after a new row), each rank writes its rows, and (3) no
    // rank leaves before every rank's rows are in the table (no gather reads an old row). Each
    // step is a collective step, so a failure on one rank (a key out of range) throws the same
    // error on every rank instead of leaving its peers waiting. Nothing is admitted in between:
    // this table's gathers and prefetches are over (flush and invalidate order themselves after
    // them) and every rank is inside this call.
    cuda::stream_ref const stream{s};
    auto const empty_cache = [&] {
      if constexpr (has_cache) { emb_.invalidate(stream); }
      WM_CUDA_TRY(cudaStreamSynchronize(s));
    };
    wm::detail::collective_step<wm::comm_error>(*comm_, "wm_torch write_rows (emptying caches)",
                                                empty_cache);
    wm::detail::collective_step<wm::logic_error>(*comm_, "wm_torch write_rows", [&] {
      emb_.weights().scatter(std::span<std::int64_t const>{keys, n}, values, stream);
    });
  }

  void prefetch(std::int64_t const* keys, std::size_t n, cudaStream_t s) override {
    if constexpr (has_cache) {
      emb_.prefetch(std::span<std::int64_t const>{keys, n}, cuda::stream_ref{s});
    }
  }

  void flush(cudaStream_t s) override {
    if constexpr (has_cache) { emb_.flush(cuda::stream_ref{s}); }
  }

  void invalidate(cudaStream_t s) override {
    if constexpr (has_cache) { emb_.invalidate(cuda::stream_ref{s}); }
  }

  [[nodiscard]] wm::cache_statistics cache_stats() override {
    if constexpr (has_cache) {
      return emb_.cache_stats();
    } else {
      return {};
    }
  }

  void reset_cache_stats() override {
    if constexpr (has_cache) { emb_.reset_cache_stats(); }
  }

  [[nodiscard]] std::size_t cache_lines() const override {
    if constexpr (has_cache) {
      return emb_.cache_lines();
    } else {
      return 0;
    }
  }

  [[nodiscard]] std::int64_t global_step() const override { return emb_.global_step(); }

  void store(std::string const& prefix) override { emb_.store(prefix); }
  void load(std::string const& prefix) override { emb_.load(prefix); }

 private:
  Embedding emb_;
  wm::communicator* comm_{nullptr};  // write_rows' collective steps
};

template <class Embedding>
[[nodiscard]] std::unique_ptr<table> make_table(wm::communicator& comm, table_options const& o) {
  return std::make_unique<table_impl<Embedding>>(comm, o);
}

[[nodiscard]] inline std::string unsupported(table_options const& o) {
  return "wm_torch: no table with location '" + o.location + "', cache '" + o.cache +
         "' and optimizer '" + o.optimizer +
         "' (device: cache 'none' with 'sgd', 'adam' or 'none'; host: cache 'read_write' with "
         "'sgd' or 'adam', 'read_only' with 'none', 'none' with 'sgd', 'adam' or 'none')";
}

}  // namespace wm_torch
