// SPDX-License-Identifier: Apache-2.0
// A host-only translation unit (the C++ compiler, no nvcc) that includes <wm/version.hpp>. With
// PACKAGE_VERSION_* defined (the install test's consumer passes find_package's wm_VERSION_*), the
// header's numbers must equal the package's.
#include <wm/version.hpp>

#include <cstdio>

static_assert(wm::version == WM_VERSION);
static_assert(WM_VERSION == WM_VERSION_MAJOR * 10000 + WM_VERSION_MINOR * 100 + WM_VERSION_PATCH);
static_assert(wm::version_major == WM_VERSION_MAJOR && wm::version_minor == WM_VERSION_MINOR &&
              wm::version_patch == WM_VERSION_PATCH);
#if defined(PACKAGE_VERSION_MAJOR)
static_assert(WM_VERSION_MAJOR == PACKAGE_VERSION_MAJOR &&
                  WM_VERSION_MINOR == PACKAGE_VERSION_MINOR &&
                  WM_VERSION_PATCH == PACKAGE_VERSION_PATCH,
              "<wm/version.hpp> differs from the version of the package find_package(wm) found");
#endif

int main() {
  std::printf("wm %d.%d.%d (WM_VERSION %d)\n", wm::version_major, wm::version_minor,
              wm::version_patch, wm::version);
  return 0;
}
