# SPDX-License-Identifier: Apache-2.0
# The compile requirements of wm::wm, decided in one place for the build tree (CMakeLists.txt)
# and the installed package (wmConfig.cmake), so a user's build gets exactly the flags wm's own
# tests are built with:
# - C++20 in host and device code. CMake before 3.30 does not know nvcc 13's C++20 (cuda_std_20
#   fails, CMAKE_CUDA_STANDARD 20 adds nothing), so older CMake gets the flag directly; the
#   consumer's CMake decides, which is why the package applies this at find_package time.
# - --expt-relaxed-constexpr: device code calls constexpr host functions (std::numeric_limits,
#   std::max, ...) in wm's kernels and in CCCL's.
function(wm_add_compile_requirements target scope)
  target_compile_features(${target} ${scope} cxx_std_20)
  if(CMAKE_VERSION VERSION_GREATER_EQUAL 3.30)
    target_compile_features(${target} ${scope} cuda_std_20)
  else()
    target_compile_options(${target} ${scope} $<$<COMPILE_LANG_AND_ID:CUDA,NVIDIA>:-std=c++20>)
  endif()
  target_compile_options(${target} ${scope}
                         $<$<COMPILE_LANG_AND_ID:CUDA,NVIDIA>:--expt-relaxed-constexpr>)
endfunction()
