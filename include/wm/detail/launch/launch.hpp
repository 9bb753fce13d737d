// Bodies of wm::launch, wm::local_device_count, wm::read_launch_env and
// wm::communicator_from_env (declared in <wm/launch.hpp>). Host-only.
#pragma once

#include <wm/comm.hpp>
#include <wm/detail/launch/fork.hpp>
#include <wm/detail/launch/id_file.hpp>
#include <wm/error.hpp>
#include <wm/launch.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
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

inline int local_device_count() {
  std::fflush(nullptr);
  pid_t const pid = ::fork();
  if (pid < 0) { throw std::runtime_error{"wm: fork(): " + detail::errno_text()}; }
  if (pid == 0) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) { n = 0; }
    ::_exit(n > 100 ? 100 : n);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  return WIFEXITED(status) ? WEXITSTATUS(status) : 0;
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
