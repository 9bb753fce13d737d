# Installs wm from the build tree into a fresh prefix, then configures and builds the consumer
# project beside this script against that prefix. Fails on any error.
file(REMOVE_RECURSE ${WORK})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${WM_BINARY} --prefix ${WORK}/prefix
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "install failed")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${WM_SOURCE}/tests/install -B ${WORK}/build
                        -DCMAKE_PREFIX_PATH=${WORK}/prefix -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHS}
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring the consumer project failed")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK}/build RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building the consumer project failed")
endif()
# The consumer must not see wm's source tree: its include path comes from the prefix.
file(STRINGS ${WORK}/build/CMakeCache.txt src_refs REGEX "${WM_SOURCE}/include")
if(src_refs)
  message(FATAL_ERROR "the consumer build refers to wm's source tree: ${src_refs}")
endif()
message(STATUS "consumer built against ${WORK}/prefix")
