# SPDX-License-Identifier: Apache-2.0
# FindNCCL: locates NCCL's header and library and defines the imported target NCCL::nccl.
# Sets NCCL_FOUND, NCCL_VERSION (e.g. 2.28.9, read from nccl.h), NCCL_INCLUDE_DIR, NCCL_LIBRARY.
#
# Looks in NCCL_ROOT / $ENV{NCCL_ROOT} / NCCL_HOME, beside the CUDA toolkit (e.g. /usr/local/cuda),
# and in the system paths (e.g. /usr/include + /usr/lib/x86_64-linux-gnu), so that neither the
# toolkit-bundled nor the distribution-packaged NCCL needs a hand-set path.
include(FindPackageHandleStandardArgs)

if(NOT CUDAToolkit_FOUND)
  find_package(CUDAToolkit QUIET)
endif()

set(_nccl_hints ${NCCL_ROOT} $ENV{NCCL_ROOT} $ENV{NCCL_HOME})
if(CUDAToolkit_FOUND)
  list(APPEND _nccl_hints "${CUDAToolkit_LIBRARY_ROOT}" "${CUDAToolkit_TARGET_DIR}")
endif()

find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} ${CUDAToolkit_INCLUDE_DIRS}
          PATH_SUFFIXES include)
find_library(NCCL_LIBRARY NAMES nccl HINTS ${_nccl_hints} ${CUDAToolkit_LIBRARY_DIR}
             PATH_SUFFIXES lib lib64)

# NCCL_VERSION (and NCCL_VERSION_MAJOR/MINOR/PATCH) from nccl.h's NCCL_MAJOR, NCCL_MINOR and
# NCCL_PATCH; find_package(NCCL 2.19) and find_package(NCCL 2.19 EXACT) compare against it.
unset(NCCL_VERSION)
if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_version_lines
       REGEX "^#define[ \t]+NCCL_(MAJOR|MINOR|PATCH)[ \t]+[0-9]+")
  foreach(_nccl_part IN ITEMS MAJOR MINOR PATCH)
    unset(NCCL_VERSION_${_nccl_part})
    foreach(_nccl_line IN LISTS _nccl_version_lines)
      if(_nccl_line MATCHES "^#define[ \t]+NCCL_${_nccl_part}[ \t]+([0-9]+)")
        set(NCCL_VERSION_${_nccl_part} "${CMAKE_MATCH_1}")
      endif()
    endforeach()
  endforeach()
  if(DEFINED NCCL_VERSION_MAJOR AND DEFINED NCCL_VERSION_MINOR AND DEFINED NCCL_VERSION_PATCH)
    set(NCCL_VERSION "${NCCL_VERSION_MAJOR}.${NCCL_VERSION_MINOR}.${NCCL_VERSION_PATCH}")
  endif()
  unset(_nccl_version_lines)
  unset(_nccl_line)
  unset(_nccl_part)
endif()

find_package_handle_standard_args(NCCL REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR
                                  VERSION_VAR NCCL_VERSION)

if(NCCL_FOUND AND NOT TARGET NCCL::nccl)
  add_library(NCCL::nccl UNKNOWN IMPORTED)
  set_target_properties(NCCL::nccl PROPERTIES IMPORTED_LOCATION "${NCCL_LIBRARY}"
                        INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
