#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# wm's headers are layers, and a layer never includes a layer above it. This script maps every
# file under include/wm/ to its layer, reads its `#include <wm/...>` and `#include "..."` lines,
# and fails on an include of a higher layer, of a layer outside the allowed edges below, or of a
# header that does not exist; it also fails on a detail/ file longer than max_lines unless the
# allow-list names it.
# Usage: bash scripts/layers.sh           print the edges in use (layer -> layers it includes), then check
#        bash scripts/layers.sh --check   check only (CI); exit 1 naming file, line and edge
set -euo pipefail
cd "$(dirname "$0")/.."

check=0
case "${1:-}" in
  --check) check=1 ;;
  "") ;;
  *) echo "usage: bash scripts/layers.sh [--check]" >&2; exit 2 ;;
esac

# The stack, lowest first: each layer may include the layers before it. base: what every module
# uses (CUDA launch helpers, RAII, workspaces, the one hash family, POSIX helpers, deadlines) and
# the vocabulary headers that have no module of their own; rows: generic row code (views, the one
# row mover, the distinct-key plan); comm and memory side by side (memory's allocations are
# collective, so memory may use comm, not the other way round); exchange: the model-parallel
# engine; then tensor, cache, embedding; dynamic (hash) embeddings on top, using the embedding's
# update kernels.
stack=(base rows comm memory exchange tensor cache embedding dynamic)

# Modules beside the stack, and the layers each may include (besides itself). They may use the
# lower layers they need; nothing of the stack above memory, and not each other, except that the
# swap scopes compress with the codec.
declare -A beside=(
  [zero]="base rows comm memory"
  [codec]="base rows"
  [swap]="base rows codec"
  [launch]="base comm"
  [umbrella]="*"  # wm.cuh: every public header
)

# The layer of a path under include/ ("?" for none: a new module must be added here).
layer_of() {
  case $1 in
    wm/detail/base/* | wm/config.hpp | wm/error.hpp | wm/version.hpp | wm/partition.hpp | \
      wm/optimizer.hpp) echo base ;;
    wm/detail/rows/*) echo rows ;;
    wm/detail/comm/* | wm/comm.hpp | wm/decl/comm.hpp) echo comm ;;
    wm/detail/memory/* | wm/memory.cuh | wm/decl/memory.cuh) echo memory ;;
    wm/detail/exchange/*) echo exchange ;;
    wm/detail/tensor/* | wm/tensor.cuh | wm/decl/tensor.cuh) echo tensor ;;
    wm/detail/cache/* | wm/cache.hpp | wm/decl/cache.hpp) echo cache ;;
    wm/detail/embedding/* | wm/embedding.cuh | wm/decl/embedding.cuh) echo embedding ;;
    wm/detail/dynamic/* | wm/dynamic_embedding.cuh | wm/decl/dynamic_embedding.cuh) echo dynamic ;;
    wm/detail/zero/* | wm/zero.cuh | wm/decl/zero.cuh | wm/zero_policy.hpp) echo zero ;;
    wm/detail/codec/* | wm/zero_codec.cuh | wm/decl/zero_codec.cuh) echo codec ;;
    wm/detail/swap/* | wm/swap.cuh | wm/decl/swap.cuh | wm/transfer_queue.hpp | \
      wm/decl/transfer_queue.hpp) echo swap ;;
    wm/detail/launch/* | wm/launch.hpp | wm/decl/launch.hpp) echo launch ;;
    wm/wm.cuh) echo umbrella ;;
    *) echo "?" ;;
  esac
}

# detail/ files longer than this fail unless listed below (one idea per file: views, kernels and
# host orchestration apart; cuCollections' rule that a large file holds one layer of one structure).
max_lines=650
# Allowed to be longer, each with the reason. Keep it empty.
allow_long=(
)

declare -A rank=()
for i in "${!stack[@]}"; do rank[${stack[$i]}]=$i; done

# Whether layer $1 may include layer $2; sets why on refusal.
why=""
allowed() {
  local from=$1 to=$2
  [[ $from == "$to" ]] && return 0
  if [[ -n ${rank[$from]:-} && -n ${rank[$to]:-} ]]; then
    ((rank[$to] < rank[$from])) && return 0
    why="$to is above $from"
    return 1
  fi
  local may
  if [[ -n ${rank[$from]:-} ]]; then
    may="${stack[*]:0:${rank[$from]}}"
  else
    may=${beside[$from]}
  fi
  [[ $may == "*" ]] && return 0
  for m in $may; do [[ $m == "$to" ]] && return 0; done
  why="$from -> $to is not an allowed edge ($from may include: ${may:-nothing})"
  return 1
}

fail=0
declare -A edges=()
while IFS= read -r f; do
  rel=${f#include/}
  from=$(layer_of "$rel")
  if [[ $from == "?" ]]; then
    echo "layers: $f: no layer for this file (add it to layer_of in scripts/layers.sh)"
    fail=1
    continue
  fi
  # "line:target:quote" for each #include of a wm header (angle brackets) or a quoted header.
  while IFS=: read -r line target quote; do
    [[ -z $line ]] && continue
    if [[ $quote == '"' ]]; then
      resolved=$(realpath -m --relative-to=include "$(dirname "$f")/$target")
      [[ -f include/$resolved ]] || resolved=$target
    else
      resolved=$target
    fi
    if [[ ! -f include/$resolved ]]; then
      echo "layers: $f:$line: includes $target, which is not a header of include/"
      fail=1
      continue
    fi
    to=$(layer_of "$resolved")
    edges["$from -> $to"]=$((${edges["$from -> $to"]:-0} + 1))
    if ! allowed "$from" "$to"; then
      echo "layers: $f:$line: includes $resolved: $why"
      fail=1
    fi
  done < <(awk '
    /^[ \t]*#[ \t]*include[ \t]*<wm\// {
      t = $0; sub(/^[^<]*</, "", t); sub(/>.*$/, "", t); print FNR ":" t ":<"; next
    }
    /^[ \t]*#[ \t]*include[ \t]*"/ {
      t = $0; sub(/^[^"]*"/, "", t); sub(/".*$/, "", t); print FNR ":" t ":\""
    }' "$f")
done < <(find include/wm -type f \( -name '*.hpp' -o -name '*.cuh' -o -name '*.h' \) | sort)

while IFS= read -r f; do
  n=$(wc -l < "$f")
  ((n <= max_lines)) && continue
  listed=0
  for a in "${allow_long[@]}"; do [[ $a == "$f" ]] && listed=1; done
  if ((!listed)); then
    echo "layers: $f: $n lines, more than $max_lines (split it by topic, or list it in allow_long with the reason)"
    fail=1
  fi
done < <(find include/wm/detail -type f | sort)

if ((!check)); then
  echo "Edges in use (includes counted):"
  for e in "${!edges[@]}"; do printf '  %-24s %4d\n' "$e" "${edges[$e]}"; done | sort
fi
if ((fail)); then
  echo "layers.sh: layering violated (the stack: ${stack[*]}; see scripts/layers.sh)"
  exit 1
fi
echo "layers.sh: $(find include/wm -type f | wc -l) headers, every include within the allowed layers"
