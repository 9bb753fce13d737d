// SPDX-License-Identifier: Apache-2.0
/**
 * @file wm.cuh
 * @brief Umbrella header: the declarations of every public wm module, without their bodies.
 *
 * Include it where your own headers name wm's types (a struct holding a `wm::embedding`, a
 * function taking a `wm::communicator&`): it compiles in seconds. In each `.cu` file that calls
 * a module's operations, include that module's header (`<wm/embedding.cuh>`, `<wm/zero.cuh>`,
 * `<wm/launch.hpp>`, ...), which adds the definitions: the bodies of templates and inline
 * functions must be seen where they are used (docs/design.md, "Compile time").
 */
#pragma once

#include <wm/decl/comm.hpp>
#include <wm/decl/dynamic_embedding.cuh>
#include <wm/decl/embedding.cuh>
#include <wm/decl/launch.hpp>
#include <wm/decl/memory.cuh>
#include <wm/decl/swap.cuh>
#include <wm/decl/tensor.cuh>
#include <wm/decl/zero.cuh>
#include <wm/decl/zero_codec.cuh>
#include <wm/error.hpp>
#include <wm/optimizer.hpp>
#include <wm/partition.hpp>
