/**
 * @file launch.hpp
 * @brief Starting ranks: `wm::launch` forks local ranks (tests, examples, single-node jobs);
 * `wm::communicator_from_env` joins a group started by an external launcher (mpirun, a
 * scheduler, torchrun-style variables).
 *
 * Host code only.
 */
#pragma once

#include <wm/comm.hpp>
#include <wm/detail/launch/fork.hpp>
#include <wm/error.hpp>

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <thread>

namespace wm {

/**
 * @brief Runs @p fn on @p n local ranks, one forked process each, and waits for all of them.
 *
 * The calling process forks before it makes any CUDA call (so it may not have touched CUDA
 * itself). Each rank selects GPU `rank % device_count`, rank 0 creates the unique id, the
 * launcher passes it to every rank through a pipe, every rank builds its communicator and calls
 * `fn(comm)`. If a rank throws, exits non-zero or dies, the other ranks get `options.grace` to
 * finish and are then killed.
 *
 * @throw wm::launch_error naming every rank that failed and why (exception text, signal, exit
 * code, timeout)
 */
inline void launch(int n, std::function<void(communicator&)> const& fn, launch_options options = {})
{
  detail::fork_ranks(
    n,
    [&](detail::rank_context& ctx) {
      int devices = 0;
      WM_CUDA_TRY(cudaGetDeviceCount(&devices));
      WM_CUDA_TRY(cudaSetDevice(ctx.rank() % devices));
      if (ctx.rank() == 0) { ctx.publish(unique_id::create().to_string()); }
      auto const id = unique_id::from_string(ctx.receive_published(options.timeout));
      communicator comm{id, ctx.rank(), ctx.size()};
      fn(comm);
    },
    options);
}

/**
 * @brief Number of CUDA devices visible to this process, found without initializing CUDA in it
 * (a short-lived child process asks), so the caller may still fork ranks afterwards.
 * @return 0 if there is no GPU or no driver
 */
[[nodiscard]] inline int local_device_count()
{
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

/** @brief Rank layout read from the environment by `read_launch_env`. */
struct launch_env {
  int rank{0};        ///< this process's rank
  int size{1};        ///< number of ranks
  int local_rank{0};  ///< rank on this host; selects the GPU (`local_rank % device_count`)
  std::string id;       ///< the unique id as hex (`WM_UNIQUE_ID`), if given
  std::string id_file;  ///< where rank 0 writes the id and the others read it (`WM_ID_FILE`)
};

/**
 * @brief Reads the rank layout from the environment.
 *
 * rank: `WM_RANK`, `RANK`, `OMPI_COMM_WORLD_RANK`, `PMI_RANK`, `SLURM_PROCID` (first set wins);
 * size: `WM_WORLD_SIZE`, `WORLD_SIZE`, `OMPI_COMM_WORLD_SIZE`, `PMI_SIZE`, `SLURM_NTASKS`;
 * local rank: `WM_LOCAL_RANK`, `LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_RANK`, `MPI_LOCALRANKID`,
 * `SLURM_LOCALID` (default: rank); the id: `WM_UNIQUE_ID` (hex), else `WM_ID_FILE` (a path on a
 * file system every rank sees).
 *
 * @param getenv lookup function (the process environment by default; tests pass their own)
 * @throw wm::logic_error if a variable is missing or malformed
 */
[[nodiscard]] inline launch_env read_launch_env(
  std::function<char const*(char const*)> const& getenv = [](char const* k) {
    return std::getenv(k);
  })
{
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
    } catch (std::exception const&) {
      used = 0;
    }
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
  env.rank  = to_int(*rank, "the rank");
  env.size  = to_int(*size, "the world size");
  auto lr   = first({"WM_LOCAL_RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                     "MPI_LOCALRANKID", "SLURM_LOCALID"});
  env.local_rank = lr ? to_int(*lr, "the local rank") : env.rank;
  WM_EXPECTS(env.size >= 1 && env.rank < env.size,
             "rank " + std::to_string(env.rank) + " is not below the world size " +
               std::to_string(env.size));
  env.id      = first({"WM_UNIQUE_ID"}).value_or("");
  env.id_file = first({"WM_ID_FILE"}).value_or("");
  WM_EXPECTS(!env.id.empty() || !env.id_file.empty(),
             "set WM_UNIQUE_ID (hex from unique_id::to_string) or WM_ID_FILE (a path every rank "
             "can read; rank 0 writes it)");
  return env;
}

namespace detail {

/**
 * @brief Rank 0 writes `make()` to `env.id_file` atomically (write + rename); the other ranks
 * wait up to @p timeout for the file and read it. Returns the id every rank uses.
 */
[[nodiscard]] inline unique_id exchange_id_file(launch_env const& env,
                                                std::function<unique_id()> const& make,
                                                std::chrono::milliseconds timeout)
{
  namespace fs = std::filesystem;
  fs::path const path{env.id_file};
  if (env.rank == 0) {
    unique_id const id = make();
    fs::path const tmp = path.string() + ".tmp." + std::to_string(::getpid());
    {
      std::ofstream out{tmp, std::ios::trunc};
      out << id.to_string() << '\n';
      if (!out) { throw io_error{"wm: cannot write the unique id to '" + tmp.string() + "'"}; }
    }
    std::error_code ec;
    fs::rename(tmp, path, ec);
    if (ec) {
      throw io_error{"wm: cannot rename '" + tmp.string() + "' to '" + path.string() +
                     "': " + ec.message()};
    }
    return id;
  }
  auto const deadline = clock_type::now() + timeout;
  while (true) {
    std::ifstream in{path};
    std::string hex;
    if (in >> hex && hex.size() == 2 * unique_id::size_bytes) { return unique_id::from_string(hex); }
    if (clock_type::now() >= deadline) {
      throw comm_error{"wm: rank " + std::to_string(env.rank) + " waited " +
                       std::to_string(timeout.count()) + " ms for the id file '" +
                       path.string() + "' that rank 0 writes"};
    }
    std::this_thread::sleep_for(std::chrono::milliseconds{20});
  }
}

}  // namespace detail

/**
 * @brief Joins the group described by the environment (see `read_launch_env`): selects GPU
 * `local_rank % device_count`, obtains the id (from `WM_UNIQUE_ID`, or through `WM_ID_FILE`,
 * which rank 0 writes and removes again once every rank has joined) and builds the communicator.
 * @throw wm::logic_error on a malformed environment; wm::comm_error if the group cannot form
 */
[[nodiscard]] inline communicator communicator_from_env(communicator_options options = {})
{
  launch_env const env = read_launch_env();
  int devices          = 0;
  WM_CUDA_TRY(cudaGetDeviceCount(&devices));
  WM_CUDA_TRY(cudaSetDevice(env.local_rank % devices));
  unique_id const id = env.id.empty()
                         ? detail::exchange_id_file(env, &unique_id::create, options.timeout)
                         : unique_id::from_string(env.id);
  communicator comm{id, env.rank, env.size, options};
  if (env.id.empty() && env.rank == 0) {
    std::error_code ec;
    std::filesystem::remove(env.id_file, ec);  // every rank has read it: no stale id for a rerun
  }
  return comm;
}

}  // namespace wm
