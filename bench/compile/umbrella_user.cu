// SPDX-License-Identifier: Apache-2.0
// A user's file that includes every module and instantiates nothing (a header of the user's own
// that names wm's types): what including <wm/wm.cuh> costs by itself.
#include <wm/wm.cuh>

struct model_state {
  wm::embedding<float, wm::no_cache, wm::adam>* table{nullptr};
};
