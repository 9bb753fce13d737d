#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# README's two commands as a new user runs them, timed, in this tree (on a fresh copy the build
# is a fresh build): the first (configure, build the examples, run them), then the second
# (`bash scripts/test.sh`: build everything, run every test). Then, on a machine whose
# `nvidia-smi` lists GPUs, scripts/gpu-check.sh with CUDA_VISIBLE_DEVICES hiding them must fail:
# a GPU machine may not pass by skipping. Each step writes its log under $OUT (default
# /tmp/wm-readme-check) as it runs, so a run stopped by a time limit still leaves what it did;
# the summary (summary.txt) is printed last. Exit status: non-zero when a command failed or the
# hidden-GPU check passed.
# Usage: bash scripts/readme-check.sh [first] [second] [hidden]   (default: all three, in order)
#   A second call with `second` on the same tree reruns ctest without rebuilding (README's second
#   command is incremental), e.g. when the first call's time ran out during the tests.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PATH=/usr/local/cuda/bin:$PATH
out=${OUT:-/tmp/wm-readme-check}
mkdir -p "$out"
summary=$out/summary.txt
steps=("$@")
((${#steps[@]})) || steps=(first second hidden)
failures=0
note() { echo "$*" | tee -a "$summary"; }

note "readme-check $(date -u +%FT%TZ): $(nproc) cores; $(nvidia-smi -L 2>/dev/null | wc -l) GPUs listed by nvidia-smi"
for step in "${steps[@]}"; do
  start=$(date +%s)
  case $step in
    first)
      # README's first command, each example's status and last line kept.
      {
        cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release &&
          cmake --build build --target examples &&
          for e in build/examples/[0-9]*; do
            "$e" >"$out/example.log" 2>&1
            echo "example $(basename "$e"): rc $? ($(tail -1 "$out/example.log"))"
          done
      } >"$out/first.log" 2>&1
      rc=$?
      grep -q '^example .*: rc [1-9]' "$out/first.log" && rc=1
      note "README first command: rc $rc, $(($(date +%s) - start)) s wall"
      grep '^example ' "$out/first.log" | sed 's/^/  /' | tee -a "$summary"
      ;;
    second)
      bash scripts/test.sh >"$out/second.log" 2>&1
      rc=$?
      note "README second command: rc $rc, $(($(date +%s) - start)) s wall"
      grep -E 'tests passed|tests failed' "$out/second.log" | sed 's/^/  /' | tee -a "$summary"
      grep -E '\*\*\*(Skipped|Failed|Timeout)|\(Failed\)|\(Timeout\)|Not Run' "$out/second.log" |
        sed 's/^/  /' | tee -a "$summary"
      note "  ten slowest units:"
      bash scripts/compile-times.sh build 10 2>&1 | sed 's/^/  /' | tee -a "$summary"
      ;;
    hidden)
      if ! nvidia-smi -L >/dev/null 2>&1; then
        note "hidden-GPU check: not run (nvidia-smi lists no GPU here)"
        continue
      fi
      CUDA_VISIBLE_DEVICES=-1 OUT="$out/hidden" BUILD_DIR=build TESTS_ONLY=1 ONE_GPU=0 \
        TESTS='^cache_gpu$' bash scripts/gpu-check.sh >"$out/hidden.log" 2>&1
      hrc=$?
      if [[ $hrc -ne 0 ]]; then
        note "hidden-GPU check: gpu-check.sh failed as it must (rc $hrc):"
        rc=0
      else
        note "hidden-GPU check: FAILED: gpu-check.sh passed with the GPU hidden"
        rc=1
      fi
      grep -E 'FAILED|RESULT' "$out/hidden.log" | sed 's/^/  /' | tee -a "$summary"
      ;;
    *)
      echo "readme-check.sh: unknown step '$step' (first, second, hidden)" >&2
      exit 2
      ;;
  esac
  [[ $rc -ne 0 ]] && failures=$((failures + 1))
done
note "RESULT: $([[ $failures -eq 0 ]] && echo ok || echo "FAILED ($failures)")"
[[ $failures -eq 0 ]]
