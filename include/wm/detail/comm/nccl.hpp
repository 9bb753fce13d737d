// SPDX-License-Identifier: Apache-2.0
// NCCL for wm: the oldest NCCL wm supports, and WM_NCCL_TRY, which checks an NCCL call and
// throws wm::comm_error with the file, the line and NCCL's message. Here rather than in
// <wm/error.hpp>, so that only the headers that talk to NCCL pull in <nccl.h>; <wm/comm.hpp>
// includes it. Host-only.
#pragma once

#include <wm/error.hpp>

#include <nccl.h>

#include <string>

// The oldest NCCL wm supports; cmake/wm-dependencies.cmake checks the same at configure time.
#if NCCL_VERSION_CODE < NCCL_VERSION(2, 19, 0)
#error "wm needs NCCL 2.19 or newer (this nccl.h is older)"
#endif

namespace wm::detail {

[[noreturn]] inline void throw_nccl_error(char const* file, int line, char const* call,
                                          ncclResult_t code) {
  throw wm::comm_error{"wm: NCCL error " + std::to_string(static_cast<int>(code)) + " (" +
                       ncclGetErrorString(code) + ") in `" + call + "` at " + where(file, line)};
}

}  // namespace wm::detail

/** @brief Runs an NCCL call and throws `wm::comm_error` unless it succeeded or is in progress. */
#define WM_NCCL_TRY(call)                                                         \
  do {                                                                            \
    ncclResult_t const wm_nccl_status_ = (call);                                  \
    if (wm_nccl_status_ != ncclSuccess && wm_nccl_status_ != ncclInProgress) {    \
      ::wm::detail::throw_nccl_error(__FILE__, __LINE__, #call, wm_nccl_status_); \
    }                                                                             \
  } while (0)
