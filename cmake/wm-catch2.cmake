# SPDX-License-Identifier: Apache-2.0
# Finds Catch2 for wm's tests: v3 or v2 through their CMake packages, else the plain headers
# (v2's single header, v3's amalgamated one). Defines Catch2::Catch2 when found and nothing
# otherwise (no error: the examples and benchmarks need no test framework).
# -DCMAKE_DISABLE_FIND_PACKAGE_Catch2=ON hides every form, which is how the no-Catch2 path is
# checked on a machine that has it.
if(NOT CMAKE_DISABLE_FIND_PACKAGE_Catch2)
  find_package(Catch2 QUIET CONFIG)
  if(NOT TARGET Catch2::Catch2)
    find_path(WM_CATCH2_INCLUDE NAMES catch2/catch_all.hpp catch2/catch.hpp)
    if(WM_CATCH2_INCLUDE)
      find_library(WM_CATCH2_LIBRARY NAMES Catch2)
      add_library(Catch2::Catch2 INTERFACE IMPORTED)
      target_include_directories(Catch2::Catch2 INTERFACE ${WM_CATCH2_INCLUDE})
      if(WM_CATCH2_LIBRARY)
        target_link_libraries(Catch2::Catch2 INTERFACE ${WM_CATCH2_LIBRARY})
      endif()
    endif()
  endif()
endif()
