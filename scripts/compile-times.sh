#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Prints the N slowest steps (compiles, links) of a Ninja build from its .ninja_log, slowest
# first: seconds and the output each step made (its path inside the build tree). For each
# output only its latest entry counts, so a step rebuilt several times is listed once, with
# the time it took last. A last line gives the number of steps and the sum of their times.
# Usage: bash scripts/compile-times.sh BUILD_DIR [N]     (N: default 10; 0 lists every step)
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 ]]; then
  echo "usage: bash scripts/compile-times.sh BUILD_DIR [N]" >&2
  exit 2
fi
log=$1/.ninja_log
n=${2:-10}
if [[ ! $n =~ ^[0-9]+$ ]]; then
  echo "compile-times.sh: N must be a number, got '$n'" >&2
  exit 2
fi
if [[ ! -f $log ]]; then
  echo "compile-times.sh: no $log (not a Ninja build tree, or nothing built yet)" >&2
  exit 1
fi

# .ninja_log (v5, v6): a '# ninja log vN' header, then one line per output, tab-separated:
# start ms, end ms, mtime, output, command hash. Later lines for the same output replace
# earlier ones.
steps=$(awk -F '\t' '/^#/ || NF < 4 { next } { ms[$4] = $2 - $1 }
                     END { for (o in ms) printf "%d\t%s\n", ms[o], o }' "$log" |
          sort -t $'\t' -k1,1nr)
if [[ -z $steps ]]; then
  echo "compile-times.sh: $log lists no steps"
  exit 0
fi
if ((n > 0)); then head -n "$n" <<<"$steps"; else cat <<<"$steps"; fi |
  awk -F '\t' '{ printf "%8.1f s  %s\n", $1 / 1000, $2 }'
awk -F '\t' '{ s += $1 }
  END { printf "%d steps, %.1f s in all (the sum of step times: parallel steps overlap)\n", NR,
               s / 1000 }' <<<"$steps"
