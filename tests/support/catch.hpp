// SPDX-License-Identifier: Apache-2.0
// Catch2 v2 (Debian's package) or v3: the tests use the subset both have, through this header.
// - v3: only the headers the tests use (test and template-test macros, generators, Approx), not
//   catch_all.hpp; the test main includes what else it needs.
// - `Catch::Approx` and `Catch::getSeed()` on both (v2 spells them `Catch::Detail::Approx` and
//   `Catch::rngSeed()`).
// - v3 under nvcc wraps every assertion and test case in `nv_diagnostic push`/`pop` and
//   `nv_diag_suppress` pragmas, which cost cudafe++ time that grows with the number of
//   assertions times the number of test cases in a file (a test file of 200 assertions ran over
//   ten minutes in cudafe++; 40 s without them): they are defined empty here. The macros expand
//   where the assertions are written, so redefining them after the include is enough.
#pragma once
#if __has_include(<catch2/catch_test_macros.hpp>)
#include <catch2/catch_approx.hpp>
#include <catch2/catch_get_random_seed.hpp>
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/generators/catch_generators_all.hpp>
#if defined(__CUDACC__)
#undef CATCH_INTERNAL_START_WARNINGS_SUPPRESSION
#undef CATCH_INTERNAL_STOP_WARNINGS_SUPPRESSION
#undef CATCH_INTERNAL_SUPPRESS_UNUSED_VARIABLE_WARNINGS
#define CATCH_INTERNAL_START_WARNINGS_SUPPRESSION
#define CATCH_INTERNAL_STOP_WARNINGS_SUPPRESSION
#define CATCH_INTERNAL_SUPPRESS_UNUSED_VARIABLE_WARNINGS
#endif
#else
#include <catch2/catch.hpp>
namespace Catch {
using Detail::Approx;
inline std::uint32_t getSeed() {
  return rngSeed();
}
}  // namespace Catch
#endif
