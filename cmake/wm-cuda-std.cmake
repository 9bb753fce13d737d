# wm needs C++20 in host and device code. CMake before 3.30 does not know nvcc 13's C++20
# (cuda_std_20 fails, CMAKE_CUDA_STANDARD 20 adds nothing), so older CMake gets the flag directly.
function(wm_require_cxx20 target scope)
  target_compile_features(${target} ${scope} cxx_std_20)
  if(CMAKE_VERSION VERSION_GREATER_EQUAL 3.30)
    target_compile_features(${target} ${scope} cuda_std_20)
  else()
    target_compile_options(${target} ${scope} $<$<COMPILE_LANG_AND_ID:CUDA,NVIDIA>:-std=c++20>)
  endif()
endfunction()
