// SPDX-License-Identifier: Apache-2.0
/**
 * @file decl/launch.hpp
 * @brief The declarations of `<wm/launch.hpp>` without their bodies, for `<wm/wm.cuh>`: every
 * type and signature, none of the definitions (docs/design.md, "Compile time").
 */
#pragma once

#include <wm/decl/comm.hpp>
#include <wm/error.hpp>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace wm {

/** @brief Why one rank of a `wm::launch` did not succeed. */
struct rank_failure {
  int rank;            ///< the rank
  std::string reason;  ///< exception text, signal, exit code, timeout, or "stopped by launcher"
  bool primary;        ///< true if this rank failed on its own; false if the launcher stopped it
};

/** @brief Thrown by `wm::launch` when any rank failed; names every rank that did not succeed. */
class launch_error : public std::runtime_error {
 public:
  /// @param failures one entry per rank that did not succeed, primary failures first
  explicit launch_error(std::vector<rank_failure> failures);
  /// Every rank that did not succeed, those that failed on their own first.
  [[nodiscard]] std::vector<rank_failure> const& failures() const noexcept { return failures_; }

 private:
  static std::string describe(std::vector<rank_failure> const& f);
  std::vector<rank_failure> failures_;
};

/** @brief Limits for `wm::launch`. */
struct launch_options {
  /// Whole-run limit: ranks still running then are killed and reported as timed out. Default:
  /// no limit (`milliseconds::max()`; any duration too long for the clock means the same).
  std::chrono::milliseconds timeout{std::chrono::milliseconds::max()};
  /// After a rank fails, how long the others may take to finish before they are killed.
  std::chrono::milliseconds grace{std::chrono::seconds{3}};
};

/**
 * @brief Runs @p fn on @p n local ranks, one forked process each, and waits for all of them.
 *
 * The calling process forks before it makes any CUDA call (so it may not have touched CUDA
 * itself). Each rank selects GPU `rank % device_count`, rank 0 creates the unique id, the
 * launcher passes it to every rank through a pipe (a rank waits for it at most the
 * communicator's default timeout, `WM_TIMEOUT_S`), every rank builds its communicator and calls
 * `fn(comm)`. If a rank throws, exits non-zero or dies, the other ranks get `options.grace` to
 * finish and are then killed. No rank is killed for running long unless `options.timeout` is
 * set. The caller's SIGPIPE disposition is the same after the call as before (the launcher
 * ignores SIGPIPE while it runs); if the launcher cannot make its pipes or processes, it stops
 * and reaps the ranks already started, closes what it opened and throws `std::runtime_error`.
 *
 * @throw wm::launch_error naming every rank that failed and why (exception text, signal, exit
 * code, timeout)
 */
inline void launch(int n, std::function<void(communicator&)> const& fn,
                   launch_options options = {});

/**
 * @brief Number of CUDA devices visible to this process, found without initializing CUDA in it
 * (a short-lived child process asks), so the caller may still fork ranks afterwards.
 *
 * 0 means "no GPU here", and only that: `cudaGetDeviceCount` answered `cudaErrorNoDevice` (no
 * device, or `CUDA_VISIBLE_DEVICES` hides them all), or `cudaErrorInsufficientDriver` with no
 * driver installed at all (`cudaDriverGetVersion` gives 0: the runtime found no `libcuda.so.1`
 * to load). Every other error is a CUDA stack that is present but broken, and throws, so that a
 * GPU machine that cannot use its GPUs is never taken for one without GPUs: a driver older than
 * the runtime, a failed initialization (`cudaErrorInitializationError`), a user-mode and
 * kernel-mode driver mismatch (`cudaErrorSystemDriverMismatch`), forward compatibility not
 * supported (`cudaErrorCompatNotSupportedOnDevice`), devices busy or unavailable
 * (`cudaErrorDevicesUnavailable`), the link-time stub `libcuda` found instead of the driver
 * (`cudaErrorStubLibrary`), ...
 *
 * @return the number of devices; 0 if there is no GPU or no driver
 * @throw wm::cuda_error for any other CUDA error, naming it (its code in `code()`), and
 * (code `cudaErrorUnknown`) when the child dies before it answers
 * @throw std::runtime_error if the pipe or the child process cannot be made
 */
[[nodiscard]] inline int local_device_count();

/** @brief Rank layout read from the environment by `read_launch_env`. */
struct launch_env {
  int rank{0};          ///< this process's rank
  int size{1};          ///< number of ranks
  int local_rank{0};    ///< rank on this host; selects the GPU (`local_rank % device_count`)
  std::string id;       ///< the unique id as hex (`WM_UNIQUE_ID`), if given
  std::string id_file;  ///< where rank 0 writes the id and the others read it (`WM_ID_FILE`)
  /// This run's job id (empty if none is known); binds the id file to the run: see
  /// `read_launch_env`.
  std::string job;
};

/**
 * @brief Reads the rank layout from the environment.
 *
 * rank: `WM_RANK`, `RANK`, `OMPI_COMM_WORLD_RANK`, `PMI_RANK`, `SLURM_PROCID` (first set wins);
 * size: `WM_WORLD_SIZE`, `WORLD_SIZE`, `OMPI_COMM_WORLD_SIZE`, `PMI_SIZE`, `SLURM_NTASKS`;
 * local rank: `WM_LOCAL_RANK`, `LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_RANK`, `MPI_LOCALRANKID`,
 * `SLURM_LOCALID` (default: rank); the id: `WM_UNIQUE_ID` (hex), else `WM_ID_FILE` (a path on a
 * file system every rank sees); the job: `WM_JOB_ID`, else `SLURM_JOB_ID` with
 * `SLURM_STEP_ID`, else `PMIX_NAMESPACE`, else `OMPI_MCA_ess_base_jobid` (empty if none).
 *
 * @param getenv lookup function (the process environment by default; tests pass their own)
 * @throw wm::logic_error if a variable is missing or malformed
 */
[[nodiscard]] inline launch_env read_launch_env(
    std::function<char const*(char const*)> const& getenv = [](char const* k) {
      return std::getenv(k);
    });

/**
 * @brief Joins the group described by the environment (see `read_launch_env`): selects GPU
 * `local_rank % device_count`, obtains the id and builds the communicator.
 *
 * The id comes from `WM_UNIQUE_ID`, or through `WM_ID_FILE`: rank 0 writes it there (with the
 * job id and the time), the other ranks wait (up to the timeout) for a file of this run and
 * read it. A file of this run is one with the same job id; with no job id known, one written at
 * most 30 s before this process started (the ranks must then start within 30 s of each other).
 * A file left by an earlier run is never taken. Rank 0 removes the file when it returns or
 * throws.
 * @throw wm::logic_error on a malformed environment; wm::comm_error if the group cannot form
 */
[[nodiscard]] inline communicator communicator_from_env(communicator_options options = {});

}  // namespace wm
