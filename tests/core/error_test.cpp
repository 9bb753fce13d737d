// SPDX-License-Identifier: Apache-2.0
#include <wm/detail/comm/nccl.hpp>
#include <wm/error.hpp>

#include <string>

#include "catch.hpp"

TEST_CASE("WM_EXPECTS throws logic_error with the message and the location", "[host]") {
  int const rows = -3;
  REQUIRE_NOTHROW([&] { WM_EXPECTS(rows < 0, "never thrown"); }());
  try {
    WM_EXPECTS(rows >= 0, "rows must be non-negative, got " + std::to_string(rows));
    FAIL("no exception");
  } catch (wm::logic_error const& e) {
    std::string const what = e.what();
    CHECK(what.find("rows must be non-negative, got -3") != std::string::npos);
    CHECK(what.find("rows >= 0") != std::string::npos);
    CHECK(what.find("error_test.cpp:") != std::string::npos);
  }
}

TEST_CASE("WM_CUDA_TRY and WM_NCCL_TRY name the error and the call", "[host]") {
  try {
    WM_CUDA_TRY(cudaErrorInvalidValue);
    FAIL("no exception");
  } catch (wm::cuda_error const& e) {
    std::string const what = e.what();
    CHECK(e.code() == static_cast<int>(cudaErrorInvalidValue));
    CHECK(what.find("cudaErrorInvalidValue") != std::string::npos);
    CHECK(what.find("error_test.cpp:") != std::string::npos);
  }
  REQUIRE_NOTHROW([] { WM_CUDA_TRY(cudaSuccess); }());
  try {
    WM_NCCL_TRY(ncclInvalidArgument);
    FAIL("no exception");
  } catch (wm::comm_error const& e) {
    std::string const what = e.what();
    CHECK(what.find("NCCL error") != std::string::npos);
    CHECK(what.find("NCCL error 4") != std::string::npos);
  }
  REQUIRE_NOTHROW([] { WM_NCCL_TRY(ncclInProgress); }());  // nonblocking calls report progress
}
