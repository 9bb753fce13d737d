#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Formats wm's tracked C++/CUDA sources (*.cu *.cuh *.hpp *.cpp) with clang-format 14 and the
# repository's .clang-format (other versions format differently, so no other is used).
# Usage: bash scripts/format.sh           format every file in place
#        bash scripts/format.sh --check   change nothing; list the files that differ, exit 1 if any
#   CLANG_FORMAT=path   the clang-format 14 binary (default: clang-format-14, else clang-format)
set -euo pipefail
cd "$(dirname "$0")/.."

check=0
case "${1:-}" in
  --check) check=1 ;;
  "") ;;
  *) echo "usage: bash scripts/format.sh [--check]" >&2; exit 2 ;;
esac

cf=${CLANG_FORMAT:-}
if [[ -z $cf ]]; then
  for c in clang-format-14 clang-format; do
    if command -v "$c" >/dev/null && "$c" --version | grep -q 'version 14\.'; then cf=$c; break; fi
  done
fi
if [[ -z $cf ]] || ! "$cf" --version | grep -q 'version 14\.'; then
  echo "format.sh: clang-format 14 not found (Debian/Ubuntu: apt-get install clang-format-14;" \
       "or set CLANG_FORMAT=/path/to/clang-format-14)" >&2
  exit 2
fi

mapfile -d '' files < <(git ls-files -z -- '*.cu' '*.cuh' '*.hpp' '*.cpp')
if ((${#files[@]} == 0)); then echo "format.sh: no tracked sources found" >&2; exit 2; fi

if ((check == 0)); then
  printf '%s\0' "${files[@]}" | xargs -0 -n 16 -P "$(nproc)" "$cf" -i --style=file
  echo "format.sh: formatted ${#files[@]} files"
  exit 0
fi

bad=()
for f in "${files[@]}"; do
  "$cf" --style=file "$f" | cmp -s - "$f" || bad+=("$f")
done
if ((${#bad[@]})); then
  echo "format.sh: ${#bad[@]} of ${#files[@]} files are not formatted (bash scripts/format.sh fixes them):"
  printf '  %s\n' "${bad[@]}"
  # The first differences, to show what is meant.
  "$cf" --style=file "${bad[0]}" | diff -u "${bad[0]}" - | head -20 || true
  exit 1
fi
echo "format.sh: ${#files[@]} files formatted as .clang-format says"
