// SPDX-License-Identifier: Apache-2.0
/**
 * @file launch.hpp
 * @brief Starting ranks: `wm::launch` forks local ranks (tests, examples, single-node jobs);
 * `wm::communicator_from_env` joins a group started by an external launcher (mpirun, a
 * scheduler, torchrun-style variables).
 *
 * Limits: `wm::launch` kills no rank for running long unless `launch_options::timeout` asks
 * for it (default: no limit); after a rank fails, the others get `launch_options::grace` to
 * finish. Waits for peers (the id, the communicator's collectives) end after the communicator's
 * timeout (`WM_TIMEOUT_S`, default 300 s). `std::chrono::milliseconds::max()`, or any duration
 * too long for the clock, means "no limit" wherever wm takes a timeout.
 *
 * Host code only.
 */
#pragma once

#include <wm/comm.hpp>
#include <wm/decl/launch.hpp>
#include <wm/detail/launch/fork.hpp>
#include <wm/detail/launch/id_file.hpp>
#include <wm/detail/launch/launch.hpp>
