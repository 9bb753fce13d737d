// SPDX-License-Identifier: Apache-2.0
// The bridge's device tables (no cache): wm::embedding<float, wm::no_cache, Optimizer, wm::device,
// wm::chunked> with SGD, Adam or no optimizer. Kept apart from wm_torch.cpp so that it compiles
// without torch's headers and beside the other table units.
#include "wm_torch_tables.cuh"

namespace wm_torch {

std::unique_ptr<table> make_device_table(wm::communicator& comm, table_options const& o) {
  if (o.cache == "none") {
    if (o.optimizer == "sgd") {
      return make_table<wm::embedding<float, wm::no_cache, wm::sgd, wm::device, wm::chunked>>(comm,
                                                                                              o);
    }
    if (o.optimizer == "adam") {
      return make_table<wm::embedding<float, wm::no_cache, wm::adam, wm::device, wm::chunked>>(comm,
                                                                                               o);
    }
    if (o.optimizer == "none") {
      return make_table<
          wm::embedding<float, wm::no_cache, wm::no_optimizer, wm::device, wm::chunked>>(comm, o);
    }
  }
  throw std::invalid_argument{unsupported(o)};
}

}  // namespace wm_torch
