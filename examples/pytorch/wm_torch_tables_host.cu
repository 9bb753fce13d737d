// SPDX-License-Identifier: Apache-2.0
// The bridge's host tables (pinned host memory, wm::chunked): with a read_write device cache
// (SGD, Adam), a read_only device cache (no optimizer: e.g. GNN features), or no cache. Kept apart
// from wm_torch.cpp so that it compiles without torch's headers and beside the other table units.
#include "wm_torch_tables.cuh"

namespace wm_torch {

std::unique_ptr<table> make_host_table(wm::communicator& comm, table_options const& o) {
  using rw = wm::device_cache<wm::read_write, wm::lfu>;
  using ro = wm::device_cache<wm::read_only, wm::lfu>;
  if (o.cache == "read_write") {
    if (o.optimizer == "sgd") {
      return make_table<wm::embedding<float, rw, wm::sgd, wm::host, wm::chunked>>(comm, o);
    }
    if (o.optimizer == "adam") {
      return make_table<wm::embedding<float, rw, wm::adam, wm::host, wm::chunked>>(comm, o);
    }
  } else if (o.cache == "read_only") {
    if (o.optimizer == "none") {
      return make_table<wm::embedding<float, ro, wm::no_optimizer, wm::host, wm::chunked>>(comm, o);
    }
  } else if (o.cache == "none") {
    if (o.optimizer == "sgd") {
      return make_table<wm::embedding<float, wm::no_cache, wm::sgd, wm::host, wm::chunked>>(comm,
                                                                                            o);
    }
    if (o.optimizer == "adam") {
      return make_table<wm::embedding<float, wm::no_cache, wm::adam, wm::host, wm::chunked>>(comm,
                                                                                             o);
    }
    if (o.optimizer == "none") {
      return make_table<
          wm::embedding<float, wm::no_cache, wm::no_optimizer, wm::host, wm::chunked>>(comm, o);
    }
  }
  throw std::invalid_argument{unsupported(o)};
}

}  // namespace wm_torch
