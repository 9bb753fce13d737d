// SPDX-License-Identifier: Apache-2.0
// Bodies of wm::launch, wm::local_device_count, wm::read_launch_env and
// wm::communicator_from_env (declared in <wm/launch.hpp>). Host-only.
#pragma once

#include <wm/comm.hpp>
#include <wm/detail/base/posix.hpp>
#include <wm/detail/launch/fork.hpp>
#include <wm/detail/launch/id_file.hpp>
#include <wm/error.hpp>
#include <wm/launch.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <functional>
#include <optional>
#include <string>
#include <sys/wait.h>
#include <unistd.h>

namespace wm {

inline void launch(int n, std::function<void(communicator&)> const& fn, launch_options options) {
  detail::fork_ranks(
      n,
      [&](detail::rank_context& ctx) {
        int devices = 0;
        WM_CUDA_TRY(cudaGetDeviceCount(&devices));
        WM_CUDA_TRY(cudaSetDevice(ctx.rank() % devices));
        if (ctx.rank() == 0) { ctx.publish(unique_id::create().to_string()); }
        // The id wait is a wait for a peer: the communicator's timeout, or the run's if shorter.
        auto const wait = std::min(options.timeout, communicator_options::default_timeout());
        auto const id   = unique_id::from_string(ctx.receive_published(wait));
        communicator comm{id, ctx.rank(), ctx.size()};
        fn(comm);
      },
      options);
}

namespace detail {

/// What the child of `local_device_count` learnt, sent to the parent through a pipe as raw
/// bytes (the parent calls no CUDA function, so the child fills in the error's name and text).
struct device_report {
  int status{0};          ///< what cudaGetDeviceCount returned (a cudaError_t)
  int count{0};           ///< the devices it counted, when it succeeded
  int driver_version{0};  ///< cudaDriverGetVersion: 0 when no driver is installed at all
  char name[64]{};        ///< cudaGetErrorName(status)
  char text[192]{};       ///< cudaGetErrorString(status)
};

/**
 * @brief Whether @p status, returned by cudaGetDeviceCount, means that this process has no GPU
 * (true) rather than a CUDA stack that is present and broken (false).
 *
 * No GPU: `cudaErrorNoDevice` (none present, or `CUDA_VISIBLE_DEVICES` hides them all), and
 * `cudaErrorInsufficientDriver` when @p driver_version is 0, i.e. no driver library could be
 * loaded at all (what a machine without the NVIDIA driver answers). Everything else is broken:
 * the same error with a driver present (a driver older than the runtime), a failed
 * initialization, a driver mismatch, unavailable devices, the link-time stub `libcuda`.
 */
[[nodiscard]] constexpr bool means_no_gpu(cudaError_t status, int driver_version) noexcept {
  switch (status) {
    case cudaErrorNoDevice: return true;
    case cudaErrorInsufficientDriver: return driver_version == 0;
    default: return false;
  }
}

/// The child's side: asks the CUDA runtime (this initializes CUDA in the calling process).
[[nodiscard]] inline device_report query_devices() noexcept {
  device_report r;
  cudaError_t const status = cudaGetDeviceCount(&r.count);
  r.status                 = static_cast<int>(status);
  if (status != cudaSuccess) { r.count = 0; }
  if (cudaDriverGetVersion(&r.driver_version) != cudaSuccess) { r.driver_version = 0; }
  std::snprintf(r.name, sizeof(r.name), "%s", cudaGetErrorName(status));
  std::snprintf(r.text, sizeof(r.text), "%s", cudaGetErrorString(status));
  return r;
}

/**
 * @brief The parent's side: the device count in @p r, or a `wm::cuda_error` naming the error
 * when it is not one of those that mean "no GPU" (`means_no_gpu`). Calls no CUDA function.
 */
[[nodiscard]] inline int device_count_from(device_report const& r) {
  auto const status = static_cast<cudaError_t>(r.status);
  if (status == cudaSuccess) { return r.count; }
  if (means_no_gpu(status, r.driver_version)) { return 0; }
  std::string const name{r.name, ::strnlen(r.name, sizeof(r.name))};
  std::string const text{r.text, ::strnlen(r.text, sizeof(r.text))};
  throw cuda_error{"wm::local_device_count: CUDA error " + name + " (" + text +
                       ") in `cudaGetDeviceCount` (driver version " +
                       std::to_string(r.driver_version) +
                       "): the CUDA stack is present but does not work, so the GPUs cannot be "
                       "counted",
                   r.status};
}

/**
 * @brief Runs @p query in a forked child and returns its report, so that this process does not
 * initialize CUDA. Tests pass a query that fakes an error.
 * @throw wm::cuda_error (code cudaErrorUnknown) if the child dies or ends before it answers
 * @throw std::runtime_error if the pipe or the child cannot be made
 */
[[nodiscard]] inline device_report query_devices_in_child(device_report (*query)() noexcept) {
  int fds[2] = {-1, -1};
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    throw std::runtime_error{"wm::local_device_count: pipe(): " + errno_text()};
  }
  unique_fd const from_child{fds[0]};
  unique_fd to_parent{fds[1]};
  std::fflush(nullptr);
  pid_t const pid = ::fork();
  if (pid < 0) { throw std::runtime_error{"wm::local_device_count: fork(): " + errno_text()}; }
  if (pid == 0) {
    // A crash in the driver ends this child with its signal, reported below; the caller's crash
    // handlers (a test framework's, say) would report it as their own process's.
    for (int const sig : {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT}) { std::signal(sig, SIG_DFL); }
    device_report const r = query();
    ::_exit(write_all(fds[1], &r, sizeof(r)) ? 0 : 1);
  }
  to_parent.reset();  // the read below then ends when the child does, whatever it did
  device_report r;
  std::size_t const got = read_all(from_child.get(), &r, sizeof(r));
  int status            = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  if (got != sizeof(r) || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::string const how = describe_status(status);
    throw cuda_error{"wm::local_device_count: the child process that asks cudaGetDeviceCount " +
                         how + " before it answered (a broken CUDA driver?)",
                     static_cast<int>(cudaErrorUnknown)};
  }
  return r;
}

}  // namespace detail

inline int local_device_count() {
  return detail::device_count_from(detail::query_devices_in_child(&detail::query_devices));
}

inline launch_env read_launch_env(std::function<char const*(char const*)> const& getenv) {
  auto first = [&](std::initializer_list<char const*> names) -> std::optional<std::string> {
    for (char const* n : names) {
      if (char const* v = getenv(n); v != nullptr && *v != '\0') { return std::string{v}; }
    }
    return std::nullopt;
  };
  auto to_int = [](std::string const& s, char const* what) {
    std::size_t used = 0;
    int v            = -1;
    try {
      v = std::stoi(s, &used);
    } catch (std::exception const&) { used = 0; }
    WM_EXPECTS(used == s.size() && v >= 0,
               std::string{what} + " must be a non-negative integer, got '" + s + "'");
    return v;
  };
  launch_env env;
  auto rank = first({"WM_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"});
  auto size =
      first({"WM_WORLD_SIZE", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"});
  WM_EXPECTS(rank.has_value() && size.has_value(),
             "set WM_RANK and WM_WORLD_SIZE (or RANK/WORLD_SIZE, or run under mpirun or srun)");
  env.rank = to_int(*rank, "the rank");
  env.size = to_int(*size, "the world size");
  auto lr  = first({"WM_LOCAL_RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                    "SLURM_LOCALID"});
  env.local_rank = lr ? to_int(*lr, "the local rank") : env.rank;
  WM_EXPECTS(env.size >= 1 && env.rank < env.size, "rank " + std::to_string(env.rank) +
                                                       " is not below the world size " +
                                                       std::to_string(env.size));
  env.id      = first({"WM_UNIQUE_ID"}).value_or("");
  env.id_file = first({"WM_ID_FILE"}).value_or("");
  WM_EXPECTS(!env.id.empty() || !env.id_file.empty(),
             "set WM_UNIQUE_ID (hex from unique_id::to_string) or WM_ID_FILE (a path every rank "
             "can read; rank 0 writes it)");
  // The job: a value every rank of this run shares and the next run does not. A Slurm job id
  // alone is shared by every step of an allocation; the step tells them apart.
  if (auto j = first({"WM_JOB_ID"})) {
    env.job = *j;
  } else if (auto slurm = first({"SLURM_JOB_ID"})) {
    env.job = "slurm:" + *slurm + "." + first({"SLURM_STEP_ID"}).value_or("-");
  } else if (auto pmix = first({"PMIX_NAMESPACE"})) {
    env.job = "pmix:" + *pmix;
  } else if (auto ompi = first({"OMPI_MCA_ess_base_jobid"})) {
    env.job = "ompi:" + *ompi;
  }
  std::replace_if(
      env.job.begin(), env.job.end(), [](char c) { return c == '\n' || c == '\r'; },
      '_');  // one line in the id file
  return env;
}

inline communicator communicator_from_env(communicator_options options) {
  launch_env const env = read_launch_env();
  int devices          = 0;
  WM_CUDA_TRY(cudaGetDeviceCount(&devices));
  WM_CUDA_TRY(cudaSetDevice(env.local_rank % devices));
  if (!env.id.empty()) {
    return communicator{unique_id::from_string(env.id), env.rank, env.size, options};
  }
  // Rank 0's lease removes the file when this returns (every rank has joined: construction is
  // collective) and when anything throws.
  auto joined = detail::exchange_id_file(env, &unique_id::create, options.timeout);
  return communicator{joined.id, env.rank, env.size, options};
}

}  // namespace wm
