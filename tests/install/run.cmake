# SPDX-License-Identifier: Apache-2.0
# wm's packages and subproject use, seen from a user's project. Fails on the first error.
#   1. Installs wm from the build tree WM_BINARY into a fresh prefix, then configures and builds
#      the consumer project beside this script against that prefix (CMAKE_PREFIX_PATH), with a
#      CMAKE_MODULE_PATH of its own that find_package(wm) must leave unchanged; the consumer
#      must not see wm's source tree.
#   2. The same consumer against the build tree itself (-Dwm_DIR=WM_BINARY, no install), with no
#      CMAKE_MODULE_PATH, which must stay undefined.
#   3. An NCCL older than 2.19 (a fake nccl.h) is refused when the consumer is configured.
#   4. subproject/ builds wm through add_subdirectory: its `cmake --install` installs its own
#      program and none of wm's files; with -DWM_INSTALL=ON, wm's headers, package and licence.
# Arguments: WM_SOURCE, WM_BINARY, WORK (scratch directory, emptied first), CUDA_ARCHS.
file(REMOVE_RECURSE ${WORK})

function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed")
  endif()
endfunction()

# 1. Installed package.
run("install" ${CMAKE_COMMAND} --install ${WM_BINARY} --prefix ${WORK}/prefix)
run("configuring the consumer project against the install prefix"
    ${CMAKE_COMMAND} -S ${WM_SOURCE}/tests/install -B ${WORK}/build
    -DCMAKE_PREFIX_PATH=${WORK}/prefix -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHS}
    -DCONSUMER_MODULE_PATH=${WORK}/consumer-modules)
run("building the consumer project against the install prefix"
    ${CMAKE_COMMAND} --build ${WORK}/build)
run("running consumer_version (installed package)" ${WORK}/build/consumer_version)
# The consumer must not see wm's source tree: its include path comes from the prefix.
file(STRINGS ${WORK}/build/CMakeCache.txt src_refs REGEX "${WM_SOURCE}/include")
if(src_refs)
  message(FATAL_ERROR "the consumer build refers to wm's source tree: ${src_refs}")
endif()
foreach(f include/wm/version.hpp share/doc/wm/LICENSE)
  if(NOT EXISTS ${WORK}/prefix/${f})
    message(FATAL_ERROR "the install lacks ${f}")
  endif()
endforeach()
message(STATUS "consumer built against ${WORK}/prefix")

# 2. Build-tree package.
run("configuring the consumer project against the build tree (-Dwm_DIR=${WM_BINARY})"
    ${CMAKE_COMMAND} -S ${WM_SOURCE}/tests/install -B ${WORK}/build-tree
    -Dwm_DIR=${WM_BINARY} -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHS})
run("building the consumer project against the build tree"
    ${CMAKE_COMMAND} --build ${WORK}/build-tree)
run("running consumer_version (build tree)" ${WORK}/build-tree/consumer_version)
message(STATUS "consumer built against the build tree ${WM_BINARY}")

# 3. NCCL 2.18 is refused, with wm's message. The library file only has to exist.
file(WRITE ${WORK}/old-nccl/include/nccl.h
     "#define NCCL_MAJOR 2\n#define NCCL_MINOR 18\n#define NCCL_PATCH 6\n")
file(WRITE ${WORK}/old-nccl/lib/libnccl.so "")
execute_process(COMMAND ${CMAKE_COMMAND} -S ${WM_SOURCE}/tests/install -B ${WORK}/build-old-nccl
                        -DCMAKE_PREFIX_PATH=${WORK}/prefix -DNCCL_ROOT=${WORK}/old-nccl
                        -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHS}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0)
  message(FATAL_ERROR "the consumer project configured against NCCL 2.18.6")
endif()
string(REGEX REPLACE "[ \n]+" " " err "${err}")  # CMake wraps its messages
if(NOT err MATCHES "wm needs NCCL 2\\.19 or newer; found NCCL 2\\.18\\.6")
  message(FATAL_ERROR "NCCL 2.18.6 was refused without wm's message:\n${out}\n${err}")
endif()
message(STATUS "NCCL 2.18.6 refused")

# 4. Subproject: nothing of wm in the parent's install unless asked for.
run("configuring the subproject" ${CMAKE_COMMAND} -S ${WM_SOURCE}/tests/install/subproject
    -B ${WORK}/sub -DWM_SOURCE=${WM_SOURCE})
run("building the subproject" ${CMAKE_COMMAND} --build ${WORK}/sub)
run("installing the subproject" ${CMAKE_COMMAND} --install ${WORK}/sub --prefix ${WORK}/sub-prefix)
file(GLOB_RECURSE installed RELATIVE ${WORK}/sub-prefix ${WORK}/sub-prefix/*)
if(NOT installed MATCHES "(^|;)bin/app(;|$)")
  message(FATAL_ERROR "the subproject's install lacks bin/app: ${installed}")
endif()
list(FILTER installed EXCLUDE REGEX "^bin/app$")
if(installed)
  message(FATAL_ERROR "installing a project that adds wm as a subdirectory installed wm's "
                      "files (WM_INSTALL is meant to be OFF there): ${installed}")
endif()
run("configuring the subproject with WM_INSTALL=ON" ${CMAKE_COMMAND}
    -S ${WM_SOURCE}/tests/install/subproject -B ${WORK}/sub -DWM_INSTALL=ON)
run("installing the subproject with WM_INSTALL=ON"
    ${CMAKE_COMMAND} --install ${WORK}/sub --prefix ${WORK}/sub-prefix-on)
foreach(f include/wm/version.hpp lib*/cmake/wm/wmConfig.cmake share/doc/wm/LICENSE)
  file(GLOB found ${WORK}/sub-prefix-on/${f})
  if(NOT found)
    message(FATAL_ERROR "the subproject's install with WM_INSTALL=ON lacks ${f}")
  endif()
endforeach()
message(STATUS "subproject: wm installs nothing by default, its package with WM_INSTALL=ON")
