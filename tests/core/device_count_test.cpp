// SPDX-License-Identifier: Apache-2.0
// Host tests of wm::local_device_count: which answers of cudaGetDeviceCount mean "no GPU" (0)
// and which a broken CUDA stack gives (thrown), the child's report through the pipe, and that
// the calling process does not initialize CUDA. No GPU needed.
#include <wm/launch.hpp>

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "catch.hpp"

namespace {

using wm::detail::device_report;

// A report as the child would write it for @p status.
device_report report(cudaError_t status, int count, int driver_version) {
  device_report r;
  r.status         = static_cast<int>(status);
  r.count          = count;
  r.driver_version = driver_version;
  std::snprintf(r.name, sizeof(r.name), "%s", cudaGetErrorName(status));
  std::snprintf(r.text, sizeof(r.text), "%s", cudaGetErrorString(status));
  return r;
}

bool mapped(std::string const& library) {
  std::ifstream maps{"/proc/self/maps"};
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find(library) != std::string::npos) { return true; }
  }
  return false;
}

}  // namespace

TEST_CASE("means_no_gpu: no device, or no driver at all; every other error is a broken stack",
          "[host]") {
  using wm::detail::means_no_gpu;
  static_assert(means_no_gpu(cudaErrorNoDevice, 0));
  CHECK(means_no_gpu(cudaErrorNoDevice, 0));
  CHECK(means_no_gpu(cudaErrorNoDevice, 12080));        // CUDA_VISIBLE_DEVICES hides every GPU
  CHECK(means_no_gpu(cudaErrorInsufficientDriver, 0));  // no libcuda.so.1 to load
  // A driver that is there but older than the runtime is a broken stack.
  CHECK_FALSE(means_no_gpu(cudaErrorInsufficientDriver, 12020));
  for (cudaError_t const broken :
       {cudaErrorInitializationError, cudaErrorSystemDriverMismatch,
        cudaErrorCompatNotSupportedOnDevice, cudaErrorDevicesUnavailable, cudaErrorStubLibrary,
        cudaErrorSystemNotReady, cudaErrorNotPermitted, cudaErrorOperatingSystem,
        cudaErrorInvalidDevice, cudaErrorUnknown}) {
    CAPTURE(cudaGetErrorName(broken));
    CHECK_FALSE(means_no_gpu(broken, 0));
    CHECK_FALSE(means_no_gpu(broken, 13000));
  }
  CHECK_FALSE(means_no_gpu(cudaSuccess, 13000));  // success is a count, not "no GPU"
}

TEST_CASE("device_count_from: the count, 0 for no GPU, and a cuda_error naming any other error",
          "[host]") {
  using wm::detail::device_count_from;
  CHECK(device_count_from(report(cudaSuccess, 8, 13000)) == 8);
  CHECK(device_count_from(report(cudaErrorNoDevice, 0, 13000)) == 0);
  CHECK(device_count_from(report(cudaErrorInsufficientDriver, 0, 0)) == 0);
  for (cudaError_t const broken : {cudaErrorInitializationError, cudaErrorSystemDriverMismatch,
                                   cudaErrorCompatNotSupportedOnDevice, cudaErrorDevicesUnavailable,
                                   cudaErrorInsufficientDriver}) {
    std::string const name = cudaGetErrorName(broken);
    CAPTURE(name);
    try {
      (void)device_count_from(report(broken, 0, 12020));
      FAIL("no exception");
    } catch (wm::cuda_error const& e) {
      std::string const what = e.what();
      CHECK(e.code() == static_cast<int>(broken));
      CHECK(what.find(name) != std::string::npos);
      CHECK(what.find(cudaGetErrorString(broken)) != std::string::npos);
      CHECK(what.find("cudaGetDeviceCount") != std::string::npos);
      CHECK(what.find("12020") != std::string::npos);
    }
  }
}

TEST_CASE("the child's report comes back through the pipe; a child that dies is an error",
          "[host]") {
  using wm::detail::query_devices_in_child;
  // The child fills in the error's name: the parent calls no CUDA function.
  device_report const r = query_devices_in_child([]() noexcept {
    device_report fake;
    fake.status         = static_cast<int>(cudaErrorSystemDriverMismatch);
    fake.driver_version = 12040;
    std::snprintf(fake.name, sizeof(fake.name), "%s", "from the child");
    return fake;
  });
  CHECK(r.status == static_cast<int>(cudaErrorSystemDriverMismatch));
  CHECK(r.driver_version == 12040);
  CHECK(std::string{r.name} == "from the child");
  CHECK_THROWS_AS(wm::detail::device_count_from(r), wm::cuda_error);

  device_report const two =
      query_devices_in_child([]() noexcept { return report(cudaSuccess, 2, 13000); });
  CHECK(two.count == 2);

  try {
    (void)query_devices_in_child([]() noexcept -> device_report { std::_Exit(3); });
    FAIL("no exception");
  } catch (wm::cuda_error const& e) {
    CHECK(e.code() == static_cast<int>(cudaErrorUnknown));
    CHECK(std::string{e.what()}.find("exited with code 3") != std::string::npos);
  }
  try {
    // The child dies of its signal, not through the caller's handlers (Catch's, here).
    (void)query_devices_in_child([]() noexcept -> device_report { std::abort(); });
    FAIL("no exception");
  } catch (wm::cuda_error const& e) {
    CHECK(std::string{e.what()}.find("killed by signal 6") != std::string::npos);
  }
}

TEST_CASE("local_device_count answers without initializing CUDA in the calling process", "[host]") {
  // The runtime loads the driver (libcuda) when it initializes; the count is asked in a child.
  bool const before = mapped("libcuda.so");
  int const n       = wm::local_device_count();  // throws on a machine whose CUDA is broken
  CHECK(n >= 0);
  if (before) {
    WARN("libcuda was loaded before this case: the check below proves nothing here");
  } else {
    CHECK_FALSE(mapped("libcuda.so"));
  }
}
