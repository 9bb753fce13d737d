#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""WholeGraph peer of bench/gather_bench.cu (e): host-table gathers on the very same keys.

One GPU, one process: for each case a WholeGraph embedding of ROWS x 128 float32 in pinned host
memory (memory type "chunked", location "cpu", as ../shared/peers/wholegraph/wg_peer_reference.py
times WholeGraph's host gather), then `embedding.gather(keys)` timed with CUDA events: 2 warm-ups,
the median of 10. Cases with the same row count share one table. Keys come from raw
little-endian int64 files that gather_bench writes (its (e) keys), so both time the same data.

Usage: python3 bench/peers/wg_gather.py [--json] --case NAME:ROWS:FILE [--case ...]
Needs pylibwholegraph (../shared/peers/wholegraph/README.md: PYTHONPATH and LD_LIBRARY_PATH).
With --json the last stdout line is {"NAME_ms": ms, ...}; progress goes to stderr.
"""
import argparse
import json
import os

DIM = 128

for _var, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1"), ("PYTHONUNBUFFERED", "1")):
    os.environ[_var] = _value  # NVLink multicast stays off (the GPU machine's rule)

import torch  # noqa: E402  (after the environment is set)
import pylibwholegraph.torch as wgth  # noqa: E402

from peer_common import log, median_ms  # noqa: E402


def read_keys(path, rows, dev):
    with open(path, "rb") as f:
        data = f.read()
    if len(data) == 0 or len(data) % 8 != 0:
        raise SystemExit(f"wg_gather: {path}: {len(data)} bytes, not a list of int64 keys")
    keys = torch.frombuffer(bytearray(data), dtype=torch.int64).to(dev)
    if int(keys.min()) < 0 or int(keys.max()) >= rows:
        raise SystemExit(f"wg_gather: {path}: keys outside [0, {rows})")
    return keys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON line with the figures")
    ap.add_argument("--case", action="append", default=[], metavar="NAME:ROWS:FILE",
                    help="a table of ROWS rows gathered at the keys in FILE")
    args = ap.parse_args()
    cases = []
    for c in args.case:
        name, rows, path = c.split(":", 2)
        cases.append((name, int(rows), path))
    if not cases:
        raise SystemExit("wg_gather: no --case given")

    global_comm, _ = wgth.init_torch_env_and_create_wm_comm(0, 1, 0, 1)
    dev = torch.device("cuda", 0)
    res = {}
    done = set()
    for i, (_, rows, _) in enumerate(cases):
        if rows in done:
            continue
        done.add(rows)
        emb = wgth.create_embedding(global_comm, "chunked", "cpu", torch.float32, [rows, DIM])
        for name, rows_j, path in cases[i:]:
            if rows_j != rows:
                continue
            keys = read_keys(path, rows, dev)
            out = emb.gather(keys)
            if tuple(out.shape) != (keys.numel(), DIM):
                raise SystemExit(f"wg_gather: {name}: output shape {tuple(out.shape)}")
            del out
            ms = median_ms(lambda: emb.gather(keys))
            res[f"{name}_ms"] = ms
            log(f"WG host gather {name}: {keys.numel()} keys of {rows} x {DIM} f32: {ms:.3f} ms, "
                f"{keys.numel() * DIM * 4 / ms / 1e6:.1f} GB/s out")
        wgth.destroy_embedding(emb)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    wgth.finalize()
    if args.json:
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
