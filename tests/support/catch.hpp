// Catch2 v2 (Debian's package, CI) or v3 (the GPU machine): the tests use the common subset.
#pragma once
#if __has_include(<catch2/catch_all.hpp>)
#include <catch2/catch_all.hpp>
#else
#include <catch2/catch.hpp>
#endif
