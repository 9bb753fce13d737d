// SPDX-License-Identifier: Apache-2.0
// Must not compile: a read-only device cache cannot be trained.
// Built by ctest (tests/CMakeLists.txt, cache_compile_*), never by `all`.
#include <wm/embedding.cuh>

static_assert(sizeof(wm::embedding<float, wm::device_cache<wm::read_only>, wm::sgd>) > 0);
