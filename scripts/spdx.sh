#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Every source file carries the licence's SPDX line (LICENSE: Apache-2.0).
#   bash scripts/spdx.sh          add it where missing (after a #! line)
#   bash scripts/spdx.sh --check  list the files without it and exit 1 if there are any
set -euo pipefail
cd "$(dirname "$0")/.."
tag='SPDX-License-Identifier: Apache-2.0'
check=0
[[ "${1:-}" == "--check" ]] && check=1
missing=0
while IFS= read -r f; do
  case "$f" in
    *.cu | *.cuh | *.hpp | *.cpp | *.h | *.in.cu) prefix='//' ;;
    *.cmake | *CMakeLists.txt | *.sh | *.py | *.cmake.in | .ci/run) prefix='#' ;;
    *) continue ;;
  esac
  head -3 "$f" | grep -q "$tag" && continue
  if ((check)); then
    echo "spdx: $f has no '$tag' line"
    missing=$((missing + 1))
  elif head -1 "$f" | grep -q '^#!'; then
    sed -i "1a $prefix $tag" "$f"
  else
    sed -i "1i $prefix $tag" "$f"
  fi
done < <(git ls-files)
((missing == 0)) || exit 1
