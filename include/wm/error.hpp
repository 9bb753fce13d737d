// SPDX-License-Identifier: Apache-2.0
/**
 * @file error.hpp
 * @brief Exception types and the checking macros used by every wm module.
 *
 * - `WM_EXPECTS(cond, what)` validates user input and throws `wm::logic_error`.
 * - `WM_CUDA_TRY(call)` checks a CUDA runtime call and throws `wm::cuda_error`.
 * - `WM_NCCL_TRY(call)` checks an NCCL call and throws `wm::comm_error` (with <wm/comm.hpp>:
 *   this header needs no NCCL).
 *
 * Every message carries the file and line where the check failed and says what was expected.
 * This header compiles with a plain host compiler as well as with nvcc.
 */
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>
#include <string_view>

namespace wm {

/** @brief A precondition on user input or API usage was violated. */
class logic_error : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

/** @brief A CUDA runtime or driver call failed. */
class cuda_error : public std::runtime_error {
 public:
  /// @param what the message; @param code the `cudaError_t` (or `CUresult`) value
  cuda_error(std::string const& what, int code) : std::runtime_error{what}, code_{code} {}
  [[nodiscard]] int code() const noexcept { return code_; }  ///< the CUDA error code

 private:
  int code_;
};

/** @brief A communication step failed: NCCL error, peer gone, timeout, mismatched collective. */
class comm_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/** @brief A file could not be read or written, or its contents do not fit what was asked. */
class io_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {

[[nodiscard]] inline std::string where(char const* file, int line) {
  std::string_view f{file};
  if (auto const pos = f.rfind("include/wm/"); pos != std::string_view::npos) {
    f.remove_prefix(pos + 8);
  }
  return std::string{f} + ":" + std::to_string(line);
}

[[noreturn]] inline void throw_logic_error(char const* file, int line, char const* condition,
                                           std::string_view what) {
  throw wm::logic_error{"wm: " + std::string{what} + " (check `" + condition + "` failed at " +
                        where(file, line) + ")"};
}

[[noreturn]] inline void throw_cuda_error(char const* file, int line, char const* call,
                                          cudaError_t code) {
  // The error is reported here, once: clear the runtime's last-error slot, or the next
  // WM_CHECK_LAUNCH would throw a recoverable error (an allocation that failed) again. A sticky
  // error (a kernel fault) stays: every later call reports it anyway.
  (void)cudaGetLastError();
  throw wm::cuda_error{"wm: CUDA error " + std::string{cudaGetErrorName(code)} + " (" +
                           cudaGetErrorString(code) + ") in `" + call + "` at " + where(file, line),
                       static_cast<int>(code)};
}

}  // namespace detail
}  // namespace wm

/**
 * @brief Throws `wm::logic_error` with @p what and the location unless @p cond holds.
 * @p what may be a string literal or a `std::string` built from the offending values.
 */
#define WM_EXPECTS(cond, what)                                                           \
  do {                                                                                   \
    if (!(cond)) { ::wm::detail::throw_logic_error(__FILE__, __LINE__, #cond, (what)); } \
  } while (0)

/** @brief Runs a CUDA runtime call and throws `wm::cuda_error` if it did not succeed. */
#define WM_CUDA_TRY(call)                                                         \
  do {                                                                            \
    cudaError_t const wm_cuda_status_ = (call);                                   \
    if (wm_cuda_status_ != cudaSuccess) {                                         \
      ::wm::detail::throw_cuda_error(__FILE__, __LINE__, #call, wm_cuda_status_); \
    }                                                                             \
  } while (0)

/** @brief Checks the last kernel launch (configuration and launch errors). */
#define WM_CHECK_LAUNCH() WM_CUDA_TRY(cudaPeekAtLastError())
