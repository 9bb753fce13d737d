#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""PyTorch peer of bench/embedding_bench.cu: the same training step, written the way a PyTorch user would.

One GPU: nn.Embedding(10M, 128, sparse=True) (float32, 5.12 GB), 1M int64 keys per step and
1M x 128 float32 gradients (uniform in [-1, 1), the same every step). A step is
    out = emb(keys); out.backward(grads); opt.step(); opt.zero_grad()
with opt = torch.optim.SparseAdam, SGD or Adagrad (lr 0.01; torch's RMSprop takes no sparse
gradients). Keys: read from --uniform / --zipf (raw little-endian int64 files that
embedding_bench writes: its rank 0 keys, so both time the very same data); without them, made here
from the same distributions (uniform; discrete Zipf(1.05) over ranks 1..10M, rank k-1 scattered to
row (k-1) * 7368787 mod 10M), with other samples.

Each optimizer is checked once (the first key's row moves and stays finite), then timed with CUDA
events: 2 warm-up steps, the median of 10.
Usage: python3 bench/peers/torch_embedding.py [--json] [--uniform FILE] [--zipf FILE]
"""
import argparse
import gc
import json
import os

ROWS = 10_000_000
DIM = 128
BATCH = 1_000_000
ALPHA = 1.05
SCATTER = 7_368_787
LR = 0.01

for _var, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1"), ("PYTHONUNBUFFERED", "1")):
    os.environ[_var] = _value  # NVLink multicast stays off (the GPU machine's rule)

import torch  # noqa: E402  (after the environment is set)

from peer_common import log, median_ms  # noqa: E402


def read_keys(path, dev):
    with open(path, "rb") as f:
        data = f.read()
    if len(data) != BATCH * 8:
        raise SystemExit(f"torch_embedding: {path}: {len(data)} bytes, expected {BATCH * 8}")
    keys = torch.frombuffer(bytearray(data), dtype=torch.int64).to(dev)
    if int(keys.min()) < 0 or int(keys.max()) >= ROWS:
        raise SystemExit(f"torch_embedding: {path}: keys outside [0, {ROWS})")
    return keys


def make_keys(kind, dev):
    gen = torch.Generator(device=dev)
    gen.manual_seed(1234 if kind == "uniform" else 5678)
    if kind == "uniform":
        return torch.randint(0, ROWS, (BATCH,), device=dev, dtype=torch.int64, generator=gen)
    cdf = torch.cumsum(torch.arange(1, ROWS + 1, device=dev, dtype=torch.float64).pow_(-ALPHA), 0)
    u = torch.rand(BATCH, device=dev, dtype=torch.float64, generator=gen) * cdf[-1]
    rank = torch.searchsorted(cdf, u, right=True).clamp_(max=ROWS - 1)
    return rank * SCATTER % ROWS


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=LR, foreach=False),
    "adam": lambda params: torch.optim.SparseAdam(params, lr=LR),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=LR, foreach=False),
}


def optimizer_cases(name, keys, grads, dev):
    """Times one optimizer on each key set; returns {f"{name}_{kind}_ms": ms}."""
    emb = torch.nn.Embedding(ROWS, DIM, sparse=True, device=dev)
    opt = OPTIMIZERS[name](emb.parameters())
    res = {}
    for kind, k in keys.items():
        def step(k=k):
            out = emb(k)
            out.backward(grads)
            opt.step()
            opt.zero_grad(set_to_none=True)

        row = int(k[0])
        before = emb.weight.detach()[row].clone()
        step()
        after = emb.weight.detach()[row]
        if torch.equal(before, after) or not bool(torch.isfinite(after).all()):
            raise RuntimeError(f"torch_embedding: {name} {kind}: row {row} did not move or is not finite")
        res[f"{name}_{kind}_ms"] = ms = median_ms(step)
        log(f"torch_embedding: {name:8s} {kind:8s} {ms:8.3f} ms/step")
    del emb, opt
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return res


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line on stdout")
    parser.add_argument("--uniform", help="file of 1M int64 uniform keys (else made here)")
    parser.add_argument("--zipf", help="file of 1M int64 Zipf keys (else made here)")
    args = parser.parse_args()
    if torch.cuda.device_count() == 0:
        raise SystemExit("torch_embedding: no GPU")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    keys = {}
    for kind in ("uniform", "zipf"):
        path = getattr(args, kind)
        keys[kind] = read_keys(path, dev) if path else make_keys(kind, dev)
    gen = torch.Generator(device=dev)
    gen.manual_seed(77)
    grads = torch.rand(BATCH, DIM, device=dev, generator=gen) * 2 - 1
    res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
           "keys": "files" if args.uniform and args.zipf else "generated"}
    for name in OPTIMIZERS:
        res.update(optimizer_cases(name, keys, grads, dev))
    if args.json:
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
