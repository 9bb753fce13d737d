#!/usr/bin/env bash
# On the GPU machine: build with all cores, run every test (all GPUs, then one GPU), every
# example and every benchmark; print a short summary last. Logs go to $OUT when it is set.
# Usage: bash scripts/gpu-check.sh [--no-bench]
#   BENCH=regex   run only the benchmarks whose name matches (default: all)
#   ONE_GPU=0     skip the second test pass with CUDA_VISIBLE_DEVICES=0
#   PREBUILT=dir  use a build tree made elsewhere (e.g. on the CPU machine, carried along) instead
#                 of building here; it must sit where it was configured (absolute paths)
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PATH=/usr/local/cuda/bin:$PATH
out=${OUT:-/tmp/wm-gpu-check}
mkdir -p "$out"
bench=1
[[ "${1:-}" == "--no-bench" ]] && bench=0
summary=()
jobs=$(nproc)

nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$out/gpus.txt"
ngpu=$(nvidia-smi -L | wc -l)

t0=$(date +%s)
bdir=${PREBUILT:-build-gpu}
if [[ -n "${PREBUILT:-}" ]]; then
  summary+=("build: prebuilt tree $bdir")
elif ! { cmake -S . -B "$bdir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 &&
         cmake --build "$bdir" -j "$jobs"; } >"$out/build.log" 2>&1; then
  tail -40 "$out/build.log"
  echo "== SUMMARY: build FAILED (see build.log)"
  exit 1
else
  summary+=("build: ok in $(( $(date +%s) - t0 )) s")
fi

run_ctest() {  # $1: tag, rest: env
  local tag=$1; shift
  env "$@" ctest --test-dir "$bdir" --output-on-failure -j 1 >"$out/ctest-$tag.log" 2>&1
  local rc=$?
  summary+=("ctest ($tag): $(grep -E 'tests passed|tests failed' "$out/ctest-$tag.log" | tail -1)")
  grep -E "^ *[0-9]+/[0-9]+ Test" "$out/ctest-$tag.log" | sed 's/^/    /' >"$out/ctest-$tag.lines"
  [[ $rc -ne 0 ]] && tail -60 "$out/ctest-$tag.log"
  return 0
}
run_ctest "all-$ngpu-gpus"
if [[ $ngpu -gt 1 && "${ONE_GPU:-1}" != 0 ]]; then run_ctest one-gpu CUDA_VISIBLE_DEVICES=0; fi

for ex in "$bdir"/examples/[0-9]*; do
  [[ -x "$ex" ]] || continue
  if timeout 300 "$ex" >"$out/$(basename "$ex").log" 2>&1; then
    summary+=("example $(basename "$ex"): ok — $(tail -1 "$out/$(basename "$ex").log")")
  else
    summary+=("example $(basename "$ex"): FAILED"); tail -20 "$out/$(basename "$ex").log"
  fi
done

if [[ $bench -eq 1 ]]; then
  for b in "$bdir"/bench/*_bench; do
    [[ -x "$b" ]] || continue
    [[ "$(basename "$b")" =~ ${BENCH:-.} ]] || continue
    timeout 500 "$b" >"$out/$(basename "$b").log" 2>&1 || summary+=("bench $(basename "$b"): FAILED")
    echo "== $(basename "$b")"; tail -40 "$out/$(basename "$b").log"
  done
fi

echo
echo "== SUMMARY"
for f in "$out"/ctest-*.lines; do echo "${f##*/}:"; cat "$f"; done
printf '%s\n' "${summary[@]}"
