// SPDX-License-Identifier: Apache-2.0
// Must not compile: a group cache is read-only; Adam would write through it.
// Built by ctest (tests/CMakeLists.txt, cache_compile_*), never by `all`.
#include <wm/embedding.cuh>

static_assert(sizeof(wm::embedding<float, wm::group_cache<>, wm::adam>) > 0);
