// SPDX-License-Identifier: Apache-2.0
// The host form of the dispatch plan moved to the exchange engine; kept for existing includes.
#pragma once

#include <wm/detail/exchange/plan.hpp>
