# SPDX-License-Identifier: Apache-2.0
# Finds what the wm interface target needs: the CUDA toolkit (runtime), NCCL and CCCL.
# Shared by the build tree (CMakeLists.txt) and the package (wmConfig.cmake). Inside
# find_package(wm) a missing dependency makes wm "not found" (find_dependency passes on the
# caller's REQUIRED and QUIET); in wm's own configure step it is an error.
include(CMakeFindDependencyMacro)

# The oldest NCCL wm supports (README's requirements); include/wm/error.hpp checks the same at
# compile time, for users who pass include/ by hand.
set(wm_nccl_min_version 2.19)

macro(_wm_find_dependency name)
  if(CMAKE_FIND_PACKAGE_NAME STREQUAL "wm")
    find_dependency(${name} ${ARGN})
  else()
    find_package(${name} ${ARGN} REQUIRED)
  endif()
endmacro()

_wm_find_dependency(CUDAToolkit)

# Found without the version first, so that an old NCCL gets wm's message instead of "not found".
find_package(NCCL QUIET)
if(NCCL_FOUND AND NCCL_VERSION VERSION_LESS wm_nccl_min_version)
  string(CONCAT _wm_nccl_message
         "wm needs NCCL ${wm_nccl_min_version} or newer; found NCCL ${NCCL_VERSION} "
         "(${NCCL_INCLUDE_DIR}/nccl.h). Point NCCL_ROOT at a newer NCCL and clear "
         "NCCL_INCLUDE_DIR and NCCL_LIBRARY from the cache.")
  if(CMAKE_FIND_PACKAGE_NAME STREQUAL "wm")
    set(wm_NOT_FOUND_MESSAGE "${_wm_nccl_message}")
    set(wm_FOUND FALSE)
    return()
  endif()
  message(FATAL_ERROR "${_wm_nccl_message}")
endif()
_wm_find_dependency(NCCL ${wm_nccl_min_version})

if(NOT TARGET CCCL::CCCL)
  # CUDA 13 ships CCCL's package files under the toolkit's lib/cmake.
  _wm_find_dependency(CCCL CONFIG HINTS "${CUDAToolkit_LIBRARY_DIR}/cmake"
                      "${CUDAToolkit_LIBRARY_ROOT}/lib/cmake" "${CUDAToolkit_TARGET_DIR}/lib/cmake")
endif()
