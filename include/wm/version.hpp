// SPDX-License-Identifier: Apache-2.0
/**
 * @file version.hpp
 * @brief wm's version, for the preprocessor and for C++.
 *
 * `WM_VERSION` is `major * 10000 + minor * 100 + patch` (0.1.0 is 100), so versions compare as
 * integers: `#if WM_VERSION >= 100`. The numbers equal the package's `project(VERSION)`: the
 * top-level CMakeLists.txt stops the configure step when they differ.
 *
 * Host code only, no dependencies: this header compiles with a plain C++ compiler as well as
 * with nvcc.
 */
#pragma once

/// Major version: changes that need users to change their code.
#define WM_VERSION_MAJOR 0
/// Minor version: additions.
#define WM_VERSION_MINOR 1
/// Patch version: fixes.
#define WM_VERSION_PATCH 0
/// The version as one integer: `major * 10000 + minor * 100 + patch`.
#define WM_VERSION (WM_VERSION_MAJOR * 10000 + WM_VERSION_MINOR * 100 + WM_VERSION_PATCH)

namespace wm {

inline constexpr int version_major = WM_VERSION_MAJOR;  ///< WM_VERSION_MAJOR
inline constexpr int version_minor = WM_VERSION_MINOR;  ///< WM_VERSION_MINOR
inline constexpr int version_patch = WM_VERSION_PATCH;  ///< WM_VERSION_PATCH
/// `major * 10000 + minor * 100 + patch`, the same as WM_VERSION.
inline constexpr int version = WM_VERSION;

}  // namespace wm
