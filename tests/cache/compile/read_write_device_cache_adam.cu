// SPDX-License-Identifier: Apache-2.0
// Must compile: the control of the two read-only cases (a writable cache, same header).
// Built by ctest (tests/CMakeLists.txt, cache_compile_*), never by `all`.
#include <wm/embedding.cuh>

static_assert(sizeof(wm::embedding<float, wm::device_cache<wm::read_write, wm::lru>, wm::adam>) >
              0);
