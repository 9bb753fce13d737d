#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""PyTorch peer of bench/zero_bench.cu: the same MLP trained with PyTorch's data-parallel tools.

Model (bench/workloads/zero_mlp.cuh): L x (Linear(W, W, bias=False) -> ReLU), weights uniform
+-1.7/sqrt(W), input uniform(-1, 1) of B rows per rank (bf16), loss 0.5 * sum(y^2) / B in
float32; Adam lr 1e-4, betas (0.9, 0.999), eps 1e-8, no weight decay, no clipping (wm::adam{} as
zero_bench builds it), fused=True (falls back to foreach=True if the fused step fails), gradients
averaged over the ranks.

Mixed precision, as close to wm's as torch's own tools allow (wm: bf16 compute weights and bf16
gradients, reduced in bf16; fp32 master weights and Adam moments):
  - ddp, zero_redundancy: fp32 parameters (the master weights) under
    torch.autocast("cuda", torch.bfloat16): bf16 GEMMs on bf16 copies of the weights, gradients
    stored in fp32 (bf16 values), all-reduced in bf16 through DDP's bf16_compress_hook;
    gradient_as_bucket_view=True; buckets of the same element count as wm's (bucket_cap_mb = 2 x
    --bucket-mib, the fp32 size). zero_redundancy: torch.distributed.optim.ZeroRedundancyOptimizer
    over the DDP model (Adam states sharded, updated fp32 parameters broadcast).
  - fsdp2: torch.distributed.fsdp.fully_shard on every Linear and on the root with
    MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16): fp32 sharded parameters (the
    master weights) and moments, bf16 all-gather, compute and reduce-scatter.
    reshard_after_forward=True (gathered again for backward: wm's stage 3);
    fsdp2_keep: reshard_after_forward=False (kept from forward to backward).
Per row: 2 warm-up steps, then the median of the timed steps (CUDA events around forward,
backward and optimizer step, the slowest rank's median); peak = torch.cuda.max_memory_allocated
over the timed steps, the largest over the ranks. A row that fails gets "<row>_error" and null
numbers; the other rows still run.

Runs under `python3 -m torch.distributed.run --standalone --nproc_per_node N` (one process per
GPU) or alone as plain python3 (world size 1).
Usage: torch_zero.py [--json] [--layers L] [--width W] [--batch B] [--steps S] [--bucket-mib M]
                     [--rows ddp,zero_redundancy,fsdp2,fsdp2_keep]
"""
import os

# Before torch is imported: NVLink multicast stays off (see the GPU machine's notes).
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402

ROWS = ("ddp", "zero_redundancy", "fsdp2", "fsdp2_keep")


def single_process_defaults():
    """The rendezvous variables torchrun sets, for a run as plain python3 (world size 1)."""
    if "RANK" in os.environ:
        return
    os.environ["RANK"] = "0"
    os.environ["LOCAL_RANK"] = "0"
    os.environ["WORLD_SIZE"] = "1"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])


single_process_defaults()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from peer_common import log  # noqa: E402


def build(layers, width, seed=2024):
    """The MLP in fp32 on the current GPU, the same weights on every rank."""
    torch.manual_seed(seed)
    mods = []
    bound = 1.7 / width ** 0.5
    for _ in range(layers):
        lin = torch.nn.Linear(width, width, bias=False, device="cuda", dtype=torch.float32)
        with torch.no_grad():
            lin.weight.uniform_(-bound, bound)
        mods += [lin, torch.nn.ReLU()]
    return torch.nn.Sequential(*mods)


def adam(params, fused, zero_redundancy):
    kw = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    kw.update(dict(fused=True) if fused else dict(foreach=True))
    if zero_redundancy:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Adam, **kw)
    return torch.optim.Adam(params, **kw)


def wrap(row, model, a, local_rank):
    """(the wrapped model, a callable giving the context forward runs in) of one row."""
    if row in ("ddp", "zero_redundancy"):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel
        ddp = DistributedDataParallel(model, device_ids=[local_rank],
                                      bucket_cap_mb=2 * a.bucket_mib,
                                      gradient_as_bucket_view=True)
        ddp.register_comm_hook(dist.group.WORLD, default_hooks.bf16_compress_hook)
        return ddp, lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    reshard = row == "fsdp2"
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mp_policy=mp, reshard_after_forward=reshard)
    return model, contextlib.nullcontext


def train(row, a, local_rank, fused):
    """Median step ms, peak GiB (allocated, reserved) and the last loss of one row, this rank."""
    model, ctx = wrap(row, build(a.layers, a.width), a, local_rank)
    opt = adam(model.parameters(), fused, row == "zero_redundancy")
    torch.manual_seed(1000003 + dist.get_rank())  # each rank its own batches, as in zero_bench
    x = torch.empty(a.batch, a.width, device="cuda", dtype=torch.bfloat16)

    def step():
        x.uniform_(-1.0, 1.0)
        with ctx():
            y = model(x)
        loss = 0.5 * y.float().pow(2).sum() / a.batch
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.reset_peak_memory_stats()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(a.steps)]
    loss = None
    for start, stop in events:
        start.record()
        loss = step()
        stop.record()
    torch.cuda.synchronize()
    ms = statistics.median(start.elapsed_time(stop) for start, stop in events)
    return (ms, torch.cuda.max_memory_allocated() / 2 ** 30,
            torch.cuda.max_memory_reserved() / 2 ** 30, loss.item())


def release():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def all_ranks_ok(ok):
    """True if every rank's `ok` is true (one all-reduce)."""
    t = torch.tensor([0.0 if ok else 1.0], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item() == 0.0


def run_row(row, a, local_rank, out):
    """Runs one row (fused Adam, then foreach Adam if that failed) and fills out[row_*]."""
    err = None
    for fused in (True, False):
        try:
            ms, peak, reserved, loss = train(row, a, local_rank, fused)
            err = None
        except Exception as e:  # noqa: BLE001 (a failed row is reported, the others still run)
            err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            log(f"torch_zero: {row} (rank {dist.get_rank()}, "
                f"{'fused' if fused else 'foreach'} Adam) failed: {err}")
        release()
        if all_ranks_ok(err is None):
            break
        err = err or "failed on another rank"
    if err is not None:
        out.update({f"{row}_ms": None, f"{row}_peak_gib": None, f"{row}_error": err})
        return
    # The slowest rank's median and the largest peak.
    t = torch.tensor([ms, peak, reserved], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    ms, peak, reserved = t.tolist()
    out.update({f"{row}_ms": ms, f"{row}_peak_gib": peak, f"{row}_reserved_gib": reserved,
                f"{row}_adam": "fused" if fused else "foreach", f"{row}_loss": loss})
    if dist.get_rank() == 0:
        log(f"torch_zero: {row}: {ms:.2f} ms/step, peak {peak:.2f} GiB (reserved "
            f"{reserved:.2f}), {'fused' if fused else 'foreach'} Adam, last loss {loss:.5f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--bucket-mib", type=int, default=256)
    ap.add_argument("--rows", default=",".join(ROWS))
    a = ap.parse_args()
    rows = [r for r in a.rows.split(",") if r]
    for r in rows:
        if r not in ROWS:
            ap.error(f"unknown row {r!r}; rows: {','.join(ROWS)}")

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank),
                            timeout=datetime.timedelta(seconds=300))
    world = dist.get_world_size()
    if dist.get_rank() == 0:
        log(f"torch_zero: torch {torch.__version__}, {world} rank(s), {a.layers} x "
            f"Linear({a.width}, {a.width}) + ReLU, batch {a.batch} per rank, "
            f"{torch.cuda.get_device_name()}")
    out = {"world": world, "torch": torch.__version__}
    for r in rows:
        run_row(r, a, local_rank, out)
    if dist.get_rank() == 0:
        if a.json:
            print(json.dumps(out), flush=True)
        else:
            log(out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
