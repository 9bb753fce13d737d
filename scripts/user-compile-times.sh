#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Compiles the user files of bench/compile/ alone, as a user's build would (nvcc, C++20, sm_90,
# -O3), and prints each one's wall and CPU time and nvcc's phases (--time). No GPU needed.
# Usage: bash scripts/user-compile-times.sh [file.cu ...]   (default: bench/compile/*.cu)
#   WM_INCLUDE=dir   the headers to compile against (default: include; e.g. an older checkout's)
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
files=("$@")
((${#files[@]})) || files=(bench/compile/*.cu)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for f in "${files[@]}"; do
  rm -f "$tmp/t.csv"  # nvcc --time appends
  start=$(date +%s.%N)
  cpu=$( { /usr/bin/time -f '%U %S' nvcc -std=c++20 --expt-relaxed-constexpr -O3 \
    -arch=sm_90 -I"${WM_INCLUDE:-include}" -c "$f" -o "$tmp/o.o" --time "$tmp/t.csv" 2>&1 >/dev/null; } | tail -1)
  wall=$(echo "$(date +%s.%N) - $start" | bc)
  read -r user sys <<<"$cpu"
  printf '%-36s wall %6.1f s  cpu %6.1f s  ' "$f" "$wall" "$(echo "$user + $sys" | bc)"
  awk -F, 'NR > 1 && $2 !~ /driver|fatbinary/ {
             gsub(/^ +| +$/, "", $2); t[$2] += $7 }
           END { for (p in t) printf "%s %.1f  ", p, t[p] / 1000; print "" }' "$tmp/t.csv"
done
