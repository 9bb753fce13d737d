#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# README's test command: sets itself up, then configures, builds every target (tests, examples,
# benchmarks; warnings as errors) and runs every test (ctest -j; the GPU entries that fill the
# device or read its free memory run alone, RUN_SERIAL). Without a GPU the GPU tests report
# "skipped". Catch2, the test framework, is installed when CMake cannot find it: Debian/Ubuntu's
# `catch2` package through apt-get when run as root; otherwise the script says what to install.
# Usage: bash scripts/test.sh [more cmake configure arguments, e.g. -DCMAKE_CUDA_ARCHITECTURES=80]
#   JOBS=n   parallel build and test jobs (default: all cores)
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi

configure() { cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"; }
tests_configured() { grep -q '^WM_TESTS_CONFIGURED:INTERNAL=ON$' build/CMakeCache.txt; }

configure "$@"
if ! tests_configured; then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    echo "test.sh: Catch2 not found; installing Debian's catch2 package"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq catch2 >/dev/null
    configure "$@"
  fi
  if ! tests_configured; then
    cat >&2 <<'MSG'
test.sh: Catch2 (v2 or v3) not found, so the tests cannot be built. Install it, then run again:
  Debian/Ubuntu:  sudo apt-get install catch2
  elsewhere:      build Catch2 v3 from https://github.com/catchorg/Catch2 and install it, e.g.
                  cmake -S Catch2 -B c2 && cmake --build c2 && cmake --install c2 --prefix ~/catch2
                  bash scripts/test.sh -DCMAKE_PREFIX_PATH=$HOME/catch2
MSG
    exit 1
  fi
fi

cmake --build build -j "${JOBS:-$(nproc)}"
ctest --test-dir build --output-on-failure -j "${JOBS:-$(nproc)}"  # see tests/CMakeLists.txt: which entries run alone
