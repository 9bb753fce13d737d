// SPDX-License-Identifier: Apache-2.0
/**
 * @file wm.cuh
 * @brief Umbrella header: includes every public wm module.
 */
#pragma once

#include <wm/comm.hpp>
#include <wm/embedding.cuh>
#include <wm/error.hpp>
#include <wm/launch.hpp>
#include <wm/memory.cuh>
#include <wm/optimizer.hpp>
#include <wm/partition.hpp>
#include <wm/swap.cuh>
#include <wm/tensor.cuh>
#include <wm/zero.cuh>
#include <wm/zero_codec.cuh>
