#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""WholeGraph peer of bench/cache_bench.cu: the same Adam training steps on the same fresh keys.

One process, one GPU, RAPIDS WholeGraph (pylibwholegraph; see shared/peers/wholegraph/README.md
for its wheels, PYTHONPATH and LD_LIBRARY_PATH). Table: 10M x 128 float32, Adam (WholeGraph's
defaults), lr 0.01, 1M int64 keys per step from a ring of 16 batches that cache_bench writes
(raw little-endian int64 files, --uniform FILE and --zipf FILE, 16M keys each: batch i is keys
[i * 1M, (i + 1) * 1M)), gradients uniform in [-1, 1) (the same every step). A step is
    out = module(keys); out.backward(grads); optimizer.step(lr)
with module = WholeMemoryEmbeddingModule(embedding) and optimizer = create_wholememory_optimizer(
embedding, "adam", {}), as shared/peers/wholegraph/wg_peer_reference.py does, but the keys of
step s are batch s mod 16 of the ring (fresh keys every step; the reference reuses one batch).

Cases, each a fresh table:
  cache R:  create_embedding(comm, "chunked", "cpu", ...) with
            create_builtin_cache_policy("all_devices", "chunked", "cpu", "readwrite", R),
            R in --ratios (default 0.05 0.1 0.25): a device-cached host table;
  host:     the same table without a cache (uncached host step);
  device:   create_embedding(comm, "chunked", "cuda", ...) (the device-table step).
Timing: a warm-up pass over the ring (16 steps: the cache fills), then --steps steps (default
32) timed one by one with CUDA events, the median. Prints one line per case on stderr and, with
--json, one JSON line on stdout: {"cache_<kind>_<R>_ms": ..., "host_<kind>_ms": ...,
"device_<kind>_ms": ...} with kind uniform / zipf and R as given (e.g. 0.1).
Usage: python3 bench/peers/wg_cache.py --uniform FILE --zipf FILE [--ratios R ...] [--steps N]
       [--cases cache host device] [--json]
"""
import argparse
import gc
import json
import os
import statistics
import sys

ROWS = 10_000_000
DIM = 128
BATCH = 1_000_000
RING = 16
LR = 0.01

for _var, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1"), ("PYTHONUNBUFFERED", "1")):
    os.environ[_var] = _value  # NVLink multicast stays off (the GPU machine's rule)

import torch  # noqa: E402  (after the environment is set)
import pylibwholegraph.torch as wgth  # noqa: E402


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def read_ring(path, dev):
    with open(path, "rb") as f:
        data = f.read()
    if len(data) != RING * BATCH * 8:
        raise SystemExit(f"wg_cache: {path}: {len(data)} bytes, expected {RING * BATCH * 8}")
    keys = torch.frombuffer(bytearray(data), dtype=torch.int64).to(dev)
    if int(keys.min()) < 0 or int(keys.max()) >= ROWS:
        raise SystemExit(f"wg_cache: {path}: keys outside [0, {ROWS})")
    return keys.view(RING, BATCH)


def time_steps(step, steps):
    """Warm-up pass over the ring, then the median ms of `steps` steps (CUDA events)."""
    for s in range(RING):
        step(s % RING)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(steps)]
    for s, (start, stop) in enumerate(events):
        start.record()
        step(s % RING)
        stop.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(stop) for start, stop in events)


def train_case(comm, name, location, ratio, rings, grads, steps, res):
    cache = None
    if ratio is not None:
        cache = wgth.create_builtin_cache_policy("all_devices", "chunked", location, "readwrite",
                                                 ratio)
    emb = wgth.create_embedding(comm, "chunked", location, torch.float32, [ROWS, DIM],
                                cache_policy=cache)
    opt = wgth.create_wholememory_optimizer(emb, "adam", {})
    mod = wgth.WholeMemoryEmbeddingModule(emb)
    mod.train()
    for kind, ring in rings.items():
        def step(s, ring=ring):
            out = mod(ring[s])
            out.backward(grads)
            opt.step(LR)

        key = f"{name}_{kind}_ms" if ratio is None else f"{name}_{kind}_{ratio:g}_ms"
        try:
            res[key] = ms = time_steps(step, steps)
            log(f"wg_cache: {key:24s} {ms:9.3f} ms/step")
        except Exception as e:  # a failed case is reported, the others still run
            res[key] = None
            log(f"wg_cache: {key} FAILED: {e}")
    wgth.destroy_wholememory_optimizer(opt)
    wgth.destroy_embedding(emb)
    del mod, opt, emb
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uniform", required=True, help="ring of 16 x 1M int64 uniform keys")
    parser.add_argument("--zipf", required=True, help="ring of 16 x 1M int64 Zipf keys")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.05, 0.1, 0.25])
    parser.add_argument("--steps", type=int, default=32, help="timed steps per case")
    parser.add_argument("--cases", nargs="+", default=["cache", "host", "device"],
                        choices=["cache", "host", "device"])
    parser.add_argument("--json", action="store_true", help="print one JSON line on stdout")
    args = parser.parse_args()
    if torch.cuda.device_count() == 0:
        raise SystemExit("wg_cache: no GPU")
    comm, _local = wgth.init_torch_env_and_create_wm_comm(0, 1, 0, 1)
    dev = torch.device("cuda", torch.cuda.current_device())
    rings = {"uniform": read_ring(args.uniform, dev), "zipf": read_ring(args.zipf, dev)}
    gen = torch.Generator(device=dev)
    gen.manual_seed(77)
    grads = torch.rand(BATCH, DIM, device=dev, generator=gen) * 2 - 1
    res = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
           "steps": args.steps}
    if "cache" in args.cases:
        for ratio in args.ratios:
            train_case(comm, "cache", "cpu", ratio, rings, grads, args.steps, res)
    if "host" in args.cases:
        train_case(comm, "host", "cpu", None, rings, grads, args.steps, res)
    if "device" in args.cases:
        train_case(comm, "device", "cuda", None, rings, grads, args.steps, res)
    wgth.finalize()
    if args.json:
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
