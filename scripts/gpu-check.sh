#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# On the GPU machine: build here with all cores, run every test (all GPUs, then one GPU), every
# example and every benchmark; print a short summary last and exit non-zero when any build,
# test, example, benchmark or sanitizer run failed. Logs go to $OUT when it is set (else
# /tmp/wm-gpu-check).
#
# A GPU machine must not pass by skipping: when `nvidia-smi -L` lists GPUs, a ctest entry
# labelled gpu that reports "skipped" fails the run (multi_gpu ones too in the pass with all
# GPUs when it lists two or more), and so do tests that found 0 GPUs and an example or benchmark
# that says "no GPU found". Without nvidia-smi (a machine with no GPU) skipping is expected and
# is only listed. `embedding_vs_torch` (label gpu) skips without PyTorch: install it, or leave
# it out with TESTS.
#
# The summary gives the GPUs nvidia-smi lists, the build's wall time (configure and build; fresh
# or incremental), its ten slowest steps (scripts/compile-times.sh), ctest's result line per
# pass and the entries that skipped.
#
# Usage: bash scripts/gpu-check.sh [--no-bench]
#   TESTS=regex    run only the ctest entries whose name matches (ctest -R; default: all)
#   TESTS_ONLY=1   build and run the tests; no examples, no benchmarks
#   BENCH=regex    run only the benchmarks whose name matches (default: all)
#   BENCH_ONLY=1   build and run the benchmarks (BENCH filter); no tests, no examples
#   ONE_GPU=0      skip the second test pass with CUDA_VISIBLE_DEVICES=0
#   SANITIZE=1     instead of the runs above: run each 1-GPU test program (the ctest entries
#                  labelled gpu, TESTS filter) under compute-sanitizer memcheck and report
#                  "sanitizer <test>: N errors"; SANITIZE_TIMEOUT=s per program (default 540);
#                  the entries ctest may run beside each other run SANITIZE_JOBS at a time
#                  (default 4), the RUN_SERIAL ones alone
#   BUILD_DIR=dir  where to build (default build-gpu); an existing tree is built incrementally
#   FRESH=1        remove BUILD_DIR first, so that the build time is the whole build's
#   JOBS=n         parallel build and ctest jobs (default: every core, nproc)
#   TARGETS="a b"  build only these targets (quick iterations; the summary says so)
#   PREBUILT=dir   quick iterations only: use a build tree made elsewhere (e.g. on the CPU machine,
#                  carried along) instead of building here; it must sit where it was configured
#                  (absolute paths). The summary then says that nothing was built here.
#   .whl/          WholeGraph's wheels (../shared/peers/wholegraph/fetch-wheels.sh), carried along:
#                  installed into /tmp/site so that the benchmarks run their WholeGraph peers
#   WERROR=1       build with warnings as errors (default off here: CI checks warnings; a
#                  warning only this machine's compiler gives should not stop the GPU runs)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PATH=/usr/local/cuda/bin:$PATH
out=${OUT:-/tmp/wm-gpu-check}
mkdir -p "$out"
rm -f "$out"/ctest-*.lines "$out"/ctest-*.full.log "$out/compile-times.txt"
run_tests=1 run_examples=1 run_bench=1
[[ "${1:-}" == "--no-bench" ]] && run_bench=0
[[ "${TESTS_ONLY:-0}" == 1 ]] && run_examples=0 run_bench=0
[[ "${BENCH_ONLY:-0}" == 1 ]] && run_tests=0 run_examples=0 run_bench=1
[[ "${SANITIZE:-0}" == 1 ]] && run_tests=0 run_examples=0 run_bench=0
summary=()
failures=0
fail() { summary+=("$1"); failures=$((failures + 1)); }
jobs=${JOBS:-$(nproc)}

# The GPUs this machine has, by the driver's own tool (independent of what the tests find).
ngpu=0
if command -v nvidia-smi >/dev/null; then
  if smi=$(nvidia-smi -L 2>&1); then
    ngpu=$(grep -cE '^GPU [0-9]+:' <<<"$smi")
    nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$out/gpus.txt"
    summary+=("gpus: nvidia-smi -L lists $ngpu")
  elif grep -q 'No devices were found' <<<"$smi"; then
    summary+=("gpus: nvidia-smi -L: no devices were found")
  else
    echo "$smi"
    fail "gpus: nvidia-smi -L failed: $(head -1 <<<"$smi")"
  fi
else
  summary+=("gpus: no nvidia-smi on PATH: no GPU expected here, GPU tests report skipped")
fi

bdir=${PREBUILT:-${BUILD_DIR:-build-gpu}}
if [[ -n "${PREBUILT:-}" ]]; then
  carried="carried tree $bdir (PREBUILT): no build time measured; step times are from elsewhere"
  summary+=("build: NOT built here: $carried")
else
  [[ "${FRESH:-0}" == 1 ]] && rm -rf "$bdir"
  kind=fresh
  [[ -f "$bdir/.ninja_log" ]] && kind=incremental
  targets=()
  [[ -n "${TARGETS:-}" ]] && read -r -a targets <<<"$TARGETS"
  what="all targets"
  [[ ${#targets[@]} -gt 0 ]] && what="only ${targets[*]} (TARGETS)"
  werror=OFF
  [[ "${WERROR:-0}" == 1 ]] && werror=ON
  t0=$(date +%s)
  cmake -S . -B "$bdir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DWM_WARNINGS_AS_ERRORS=$werror >"$out/build.log" 2>&1
  brc=$?
  t1=$(date +%s)
  # -k 0: a target that fails to build does not keep the others from building and running.
  if [[ $brc -eq 0 ]]; then
    cmake --build "$bdir" -j "$jobs" ${targets[@]:+--target "${targets[@]}"} -- -k 0 \
      >>"$out/build.log" 2>&1
    brc=$?
  fi
  t2=$(date +%s)
  times="$((t2 - t0)) s wall (configure $((t1 - t0)) s, build $((t2 - t1)) s;"
  times+=" $kind, -j $jobs, $what)"
  nwarn=$(grep -c -E 'warning[: #]' "$out/build.log")
  if [[ $brc -ne 0 ]]; then
    grep -E '^FAILED:|error' "$out/build.log" | head -30
    nfailed=$(grep -c '^FAILED:' "$out/build.log")
    fail "build: FAILED after $times: $nfailed targets failed (build.log), $nwarn warning lines"
  else
    summary+=("build: ok in $times, $nwarn warning lines (build.log)")
  fi
fi
if [[ -f "$bdir/.ninja_log" ]]; then
  bash scripts/compile-times.sh "$bdir" 10 >"$out/compile-times.txt" 2>&1
fi
if ! grep -q '^WM_TESTS_CONFIGURED:INTERNAL=ON$' "$bdir/CMakeCache.txt" 2>/dev/null; then
  fail "build: tests not configured (Catch2 not found?)"
fi

run_ctest() {  # $1: tag, $2: the GPUs nvidia-smi says the tests can use, rest: env
  local tag=$1 visible=$2; shift 2
  # The entries that must not skip in this pass: those labelled gpu when a GPU is there, and
  # those labelled multi_gpu too when two are.
  local must=() labels='^gpu$'
  [[ $visible -ge 2 ]] && labels='^(gpu|multi_gpu)$'
  if [[ $visible -ge 1 ]]; then
    mapfile -t must < <(ctest --test-dir "$bdir" -N -L "$labels" ${TESTS:+-R "$TESTS"} |
                          sed -nE 's/^ *Test +#[0-9]+: +([^ ]+)$/\1/p')
  fi
  env "$@" ctest --test-dir "$bdir" --output-on-failure -j "$jobs" ${TESTS:+-R "$TESTS"} \
    >"$out/ctest-$tag.log" 2>&1
  local rc=$?
  # Every entry's output, the skipped ones' included (--output-on-failure shows failures only).
  cp "$bdir/Testing/Temporary/LastTest.log" "$out/ctest-$tag.full.log" 2>/dev/null
  local line
  line=$(grep -E 'tests passed|tests failed|No tests were found' "$out/ctest-$tag.log" | tail -1)
  grep -E "^ *[0-9]+/[0-9]+ Test" "$out/ctest-$tag.log" | sed 's/^/    /' >"$out/ctest-$tag.lines"
  if [[ $rc -ne 0 || -z $line || $line == *"No tests"* ]]; then
    tail -60 "$out/ctest-$tag.log"
    fail "ctest ($tag): FAILED: ${line:-no result line}"
  else
    summary+=("ctest ($tag): $line")
  fi
  local skipped=() wrong=() s
  local pattern='s/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: ([^ ]+) +\.*\*\*\*Skipped.*/\1/p'
  mapfile -t skipped < <(sed -nE "$pattern" "$out/ctest-$tag.log")
  for s in "${skipped[@]}"; do
    if printf '%s\n' "${must[@]}" | grep -qxF -- "$s"; then wrong+=("$s"); fi
  done
  if [[ ${#wrong[@]} -gt 0 ]]; then
    fail "ctest ($tag): FAILED: skipped with $visible GPU(s) listed by nvidia-smi: ${wrong[*]}"
  elif [[ ${#skipped[@]} -gt 0 ]]; then
    summary+=("ctest ($tag): skipped (expected with $visible GPU(s)): ${skipped[*]}")
  fi
  local zero
  zero=$(grep -cE '^SKIPPED: this test needs [0-9]+ GPU\(s\); 0 found' "$out/ctest-$tag.full.log" \
           2>/dev/null)
  if [[ $visible -ge 1 && ${zero:-0} -gt 0 ]]; then
    fail "ctest ($tag): FAILED: $zero entries found 0 GPUs where nvidia-smi lists $visible"
  fi
}
if [[ $run_tests -eq 1 ]]; then
  run_ctest "all-$ngpu-gpus" "$ngpu"
  if [[ $ngpu -gt 1 && "${ONE_GPU:-1}" != 0 ]]; then run_ctest one-gpu 1 CUDA_VISIBLE_DEVICES=0; fi
fi

if [[ "${SANITIZE:-0}" == 1 ]]; then
  # The gpu-labelled entries whose command is one of our programs (not the PyTorch comparison),
  # read from ctest's JSON: one line per test, name TAB command (NUL-free, tab-separated args).
  ctest --test-dir "$bdir" -L '^gpu$' ${TESTS:+-R "$TESTS"} --show-only=json-v1 >"$out/tests.json"
  # name TAB serial(0/1) TAB command...: entries that ctest runs alone (RUN_SERIAL) run alone
  # under the sanitizer too; the others run SANITIZE_JOBS at a time, as under `ctest -j`.
  mapfile -t entries < <(python3 - "$out/tests.json" "$(cd "$bdir" && pwd)" <<'PY'
import json, sys
for t in json.load(open(sys.argv[1]))["tests"]:
    cmd = t.get("command") or []
    props = {p["name"]: p["value"] for p in t.get("properties", [])}
    if cmd and cmd[0].startswith(sys.argv[2] + "/"):
        print("\t".join([t["name"], "1" if props.get("RUN_SERIAL") else "0"] + cmd))
PY
  )
  [[ ${#entries[@]} -eq 0 ]] && fail "sanitizer: no gpu test programs found"
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/compute-sanitizer/compute-sanitizer)
  if [[ ! -x $sanitizer ]]; then
    fail "sanitizer: compute-sanitizer not found (PATH, /usr/local/cuda/compute-sanitizer)"
    entries=()
  fi
  sanitize_one() {  # $1: name, rest: command; writes $out/sanitize-<name>.result
    local name=$1; shift
    local log="$out/sanitize-$name.log" rc errs
    CUDA_VISIBLE_DEVICES=0 timeout "${SANITIZE_TIMEOUT:-540}" "$sanitizer" --tool memcheck \
      --report-api-errors no --target-processes all "$@" >"$log" 2>&1
    rc=$?
    # One "ERROR SUMMARY" per process (ranks are forked): add them up.
    errs=$(grep -oE 'ERROR SUMMARY: [0-9]+' "$log" | awk '{s += $3} END {print s + 0}')
    if [[ $rc -eq 0 && $errs -eq 0 ]]; then
      echo "ok sanitizer $name: 0 errors" >"$out/sanitize-$name.result"
    else
      { grep -m 20 -E '=========  *(Invalid|Program hit|Uninitialized|Leaked|Race)|FAILED|failed' "$log"
        tail -5 "$log"; } >"$out/sanitize-$name.excerpt"
      echo "FAILED sanitizer $name: $errs errors, exit code $rc$([[ $rc -eq 124 ]] && echo ' (timed out)')" \
        >"$out/sanitize-$name.result"
    fi
  }
  rm -f "$out"/sanitize-*.result "$out"/sanitize-*.excerpt
  names=()
  for pass in 0 1; do  # the entries that share the GPU first, beside each other; then the others
    for e in "${entries[@]}"; do
      IFS=$'\t' read -r -a f <<<"$e"
      [[ ${f[1]} == "$pass" ]] || continue
      names+=("${f[0]}")
      if [[ $pass == 0 ]]; then
        while [[ $(jobs -rp | wc -l) -ge ${SANITIZE_JOBS:-4} ]]; do wait -n; done
        sanitize_one "${f[0]}" "${f[@]:2}" &
      else
        wait
        sanitize_one "${f[0]}" "${f[@]:2}"
      fi
    done
    wait
  done
  for name in "${names[@]}"; do
    r=$(cat "$out/sanitize-$name.result" 2>/dev/null || echo "FAILED sanitizer $name: no result")
    if [[ $r == ok* ]]; then
      summary+=("${r#ok }")
    else
      cat "$out/sanitize-$name.excerpt" 2>/dev/null
      fail "${r#FAILED }"
    fi
  done
fi

if [[ $run_examples -eq 1 ]]; then
  for ex in "$bdir"/examples/[0-9]*; do
    [[ -x "$ex" ]] || continue
    log="$out/$(basename "$ex").log"
    if ! timeout 300 "$ex" >"$log" 2>&1; then
      fail "example $(basename "$ex"): FAILED"; tail -20 "$log"
    elif [[ $ngpu -gt 0 ]] && grep -q 'no GPU found' "$log"; then
      fail "example $(basename "$ex"): FAILED: says no GPU found, nvidia-smi lists $ngpu"
    else
      summary+=("example $(basename "$ex"): ok — $(tail -1 "$log")")
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
    log="$out/$(basename "$b").log"
    if ! timeout 500 "$b" >"$log" 2>&1; then
      fail "bench $(basename "$b"): FAILED"
    elif [[ $ngpu -gt 0 ]] && grep -q 'no GPU found' "$log"; then
      fail "bench $(basename "$b"): FAILED: says no GPU found, nvidia-smi lists $ngpu"
    fi
    echo "== $(basename "$b")"; tail -40 "$log"
  done
fi

echo
echo "== SUMMARY"
for f in "$out"/ctest-*.lines; do [[ -f $f ]] && { echo "${f##*/}:"; cat "$f"; }; done
if [[ -s "$out/compile-times.txt" ]]; then
  echo "slowest build steps ($bdir/.ninja_log):"
  sed 's/^/    /' "$out/compile-times.txt"
fi
printf '%s\n' "${summary[@]}"
if [[ $failures -ne 0 ]]; then
  echo "== RESULT: FAILED ($failures)"
  exit 1
fi
echo "== RESULT: ok"
