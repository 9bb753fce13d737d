# Finds what the wm interface target needs: the CUDA toolkit (runtime), NCCL and CCCL.
# Shared by the build tree (CMakeLists.txt) and the installed package (wmConfig.cmake).
include(CMakeFindDependencyMacro)
find_dependency(CUDAToolkit)
find_dependency(NCCL)
if(NOT TARGET CCCL::CCCL)
  # CUDA 13 ships CCCL's package files under the toolkit's lib/cmake.
  find_dependency(CCCL CONFIG HINTS "${CUDAToolkit_LIBRARY_DIR}/cmake"
                  "${CUDAToolkit_LIBRARY_ROOT}/lib/cmake" "${CUDAToolkit_TARGET_DIR}/lib/cmake")
endif()
