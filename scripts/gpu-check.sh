#!/usr/bin/env bash
# On the GPU machine: build with all cores, run every test (all GPUs, then one GPU), every
# example and every benchmark; print a short summary last and exit non-zero when any build,
# test, example, benchmark or sanitizer run failed. Logs go to $OUT when it is set.
# Usage: bash scripts/gpu-check.sh [--no-bench]
#   TESTS=regex    run only the ctest entries whose name matches (ctest -R; default: all)
#   TESTS_ONLY=1   build and run the tests; no examples, no benchmarks
#   BENCH=regex    run only the benchmarks whose name matches (default: all)
#   BENCH_ONLY=1   build and run the benchmarks (BENCH filter); no tests, no examples
#   ONE_GPU=0      skip the second test pass with CUDA_VISIBLE_DEVICES=0
#   SANITIZE=1     instead of the runs above: run each 1-GPU test program (the ctest entries
#                  labelled gpu, TESTS filter) under compute-sanitizer memcheck and report
#                  "sanitizer <test>: N errors"; SANITIZE_TIMEOUT=s per program (default 540)
#   PREBUILT=dir   use a build tree made elsewhere (e.g. on the CPU machine, carried along) instead
#                  of building here; it must sit where it was configured (absolute paths)
#   .whl/          WholeGraph's wheels (../shared/peers/wholegraph/fetch-wheels.sh), carried along:
#                  installed into /tmp/site so that the benchmarks run their WholeGraph peers
#   WERROR=1       build with warnings as errors (default off here: CI checks warnings; a
#                  warning only this machine's compiler gives should not stop the GPU runs)
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PATH=/usr/local/cuda/bin:$PATH
out=${OUT:-/tmp/wm-gpu-check}
mkdir -p "$out"
rm -f "$out"/ctest-*.lines
run_tests=1 run_examples=1 run_bench=1
[[ "${1:-}" == "--no-bench" ]] && run_bench=0
[[ "${TESTS_ONLY:-0}" == 1 ]] && run_examples=0 run_bench=0
[[ "${BENCH_ONLY:-0}" == 1 ]] && run_tests=0 run_examples=0 run_bench=1
[[ "${SANITIZE:-0}" == 1 ]] && run_tests=0 run_examples=0 run_bench=0
summary=()
failures=0
fail() { summary+=("$1"); failures=$((failures + 1)); }
jobs=$(nproc)

nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$out/gpus.txt"
ngpu=$(nvidia-smi -L | wc -l)

t0=$(date +%s)
bdir=${PREBUILT:-build-gpu}
if [[ -n "${PREBUILT:-}" ]]; then
  summary+=("build: prebuilt tree $bdir")
else
  werror=OFF
  [[ "${WERROR:-0}" == 1 ]] && werror=ON
  # -k 0: a target that fails to build does not keep the others from building and running.
  { cmake -S . -B "$bdir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DWM_WARNINGS_AS_ERRORS=$werror && cmake --build "$bdir" -j "$jobs" -- -k 0; } \
    >"$out/build.log" 2>&1
  brc=$?
  nwarn=$(grep -c -E 'warning[: #]' "$out/build.log")
  if [[ $brc -ne 0 ]]; then
    grep -E '^FAILED:|error' "$out/build.log" | head -30
    fail "build: FAILED ($(grep -c '^FAILED:' "$out/build.log") targets; see build.log), $nwarn warning lines"
  else
    summary+=("build: ok in $(($(date +%s) - t0)) s, $nwarn warning lines (build.log)")
  fi
  if ! grep -q '^WM_TESTS_CONFIGURED:INTERNAL=ON$' "$bdir/CMakeCache.txt" 2>/dev/null; then
    fail "build: tests not configured (Catch2 not found?)"
  fi
fi

run_ctest() {  # $1: tag, rest: env
  local tag=$1; shift
  env "$@" ctest --test-dir "$bdir" --output-on-failure -j 1 ${TESTS:+-R "$TESTS"} \
    >"$out/ctest-$tag.log" 2>&1
  local rc=$?
  local line
  line=$(grep -E 'tests passed|tests failed|No tests were found' "$out/ctest-$tag.log" | tail -1)
  grep -E "^ *[0-9]+/[0-9]+ Test" "$out/ctest-$tag.log" | sed 's/^/    /' >"$out/ctest-$tag.lines"
  if [[ $rc -ne 0 || -z $line || $line == *"No tests"* ]]; then
    tail -60 "$out/ctest-$tag.log"
    fail "ctest ($tag): FAILED: ${line:-no result line}"
  else
    summary+=("ctest ($tag): $line")
  fi
}
if [[ $run_tests -eq 1 ]]; then
  run_ctest "all-$ngpu-gpus"
  if [[ $ngpu -gt 1 && "${ONE_GPU:-1}" != 0 ]]; then run_ctest one-gpu CUDA_VISIBLE_DEVICES=0; fi
fi

if [[ "${SANITIZE:-0}" == 1 ]]; then
  # The gpu-labelled entries whose command is one of our programs (not the PyTorch comparison),
  # read from ctest's JSON: one line per test, name TAB command (NUL-free, tab-separated args).
  ctest --test-dir "$bdir" -L '^gpu$' ${TESTS:+-R "$TESTS"} --show-only=json-v1 >"$out/tests.json"
  mapfile -t entries < <(python3 - "$out/tests.json" "$(cd "$bdir" && pwd)" <<'PY'
import json, sys
for t in json.load(open(sys.argv[1]))["tests"]:
    cmd = t.get("command") or []
    if cmd and cmd[0].startswith(sys.argv[2] + "/"):
        print("\t".join([t["name"]] + cmd))
PY
  )
  [[ ${#entries[@]} -eq 0 ]] && fail "sanitizer: no gpu test programs found"
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/compute-sanitizer/compute-sanitizer)
  if [[ ! -x $sanitizer ]]; then
    fail "sanitizer: compute-sanitizer not found (PATH, /usr/local/cuda/compute-sanitizer)"
    entries=()
  fi
  for e in "${entries[@]}"; do
    IFS=$'\t' read -r -a f <<<"$e"
    name=${f[0]}; cmd=("${f[@]:1}")
    log="$out/sanitize-$name.log"
    CUDA_VISIBLE_DEVICES=0 timeout "${SANITIZE_TIMEOUT:-540}" "$sanitizer" --tool memcheck \
      --report-api-errors no --target-processes all "${cmd[@]}" >"$log" 2>&1
    rc=$?
    # One "ERROR SUMMARY" per process (ranks are forked): add them up.
    errs=$(grep -oE 'ERROR SUMMARY: [0-9]+' "$log" | awk '{s += $3} END {print s + 0}')
    if [[ $rc -eq 0 && $errs -eq 0 ]]; then
      summary+=("sanitizer $name: 0 errors")
    else
      grep -m 20 -E '=========  *(Invalid|Program hit|Uninitialized|Leaked|Race)|FAILED|failed' "$log"
      tail -5 "$log"
      fail "sanitizer $name: $errs errors, exit code $rc$([[ $rc -eq 124 ]] && echo ' (timed out)')"
    fi
  done
fi

if [[ $run_examples -eq 1 ]]; then
  for ex in "$bdir"/examples/[0-9]*; do
    [[ -x "$ex" ]] || continue
    if timeout 300 "$ex" >"$out/$(basename "$ex").log" 2>&1; then
      summary+=("example $(basename "$ex"): ok — $(tail -1 "$out/$(basename "$ex").log")")
    else
      fail "example $(basename "$ex"): FAILED"; tail -20 "$out/$(basename "$ex").log"
    fi
  done
fi

if [[ $run_bench -eq 1 && -d .whl ]] && ls .whl/*.whl >/dev/null 2>&1; then
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl >"$out/wheels.log" 2>&1; then
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    export LD_LIBRARY_PATH=/tmp/site/libwholegraph/lib64:/tmp/site/librmm/lib64:/tmp/site/rapids_logger/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    summary+=("peers: WholeGraph wheels installed (/tmp/site)")
  else
    fail "peers: WholeGraph wheels did not install (wheels.log)"
  fi
fi
if [[ $run_bench -eq 1 ]]; then
  for b in "$bdir"/bench/*_bench; do
    [[ -x "$b" ]] || continue
    [[ "$(basename "$b")" =~ ${BENCH:-.} ]] || continue
    timeout 500 "$b" >"$out/$(basename "$b").log" 2>&1 || fail "bench $(basename "$b"): FAILED"
    echo "== $(basename "$b")"; tail -40 "$out/$(basename "$b").log"
  done
fi

echo
echo "== SUMMARY"
for f in "$out"/ctest-*.lines; do [[ -f $f ]] && { echo "${f##*/}:"; cat "$f"; }; done
printf '%s\n' "${summary[@]}"
if [[ $failures -ne 0 ]]; then
  echo "== RESULT: FAILED ($failures)"
  exit 1
fi
echo "== RESULT: ok"
