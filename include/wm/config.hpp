// SPDX-License-Identifier: Apache-2.0
/**
 * @file config.hpp
 * @brief Compiler configuration shared by every wm header.
 *
 * - `WM_HOST_DEVICE`: marks a function callable from host and device code under nvcc
 *   (`__host__ __device__`); empty under a plain C++ compiler, so host-only headers that use it
 *   still compile with g++ or clang.
 */
#pragma once

#if defined(__CUDACC__)
/// `__host__ __device__` under nvcc; empty under a plain C++ compiler.
#define WM_HOST_DEVICE __host__ __device__
#else
#define WM_HOST_DEVICE
#endif
