#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""PyTorch peer of bench/gather_bench.cu: the same gathers, written the way a PyTorch user would.

(a) torch.index_select on one GPU: a 10M x 128 float32 table (5.12 GB), 4M uniform random int64
    indices; output GB/s = 4M x 512 B / time.
(d) the model-parallel lookup on W GPUs (--world W, default: every GPU present; skipped if W < 2;
    W processes, torch.multiprocessing spawn, NCCL): a 10M x 128 float32 table split in
    contiguous blocks of ceil(10M / W) rows, 1M uniform random int64 keys per rank;
    owner = key // rows_per_rank, argsort by owner, bincount counts, all_to_all_single of the
    counts, .tolist() splits, all_to_all_single of the keys, local index_select,
    all_to_all_single of the rows back, inverse permutation. ms per lookup: the max over ranks of
    each rank's median.

Both are checked once, then timed with CUDA events: 2 warm-ups, the median of 10 runs.
Usage: python3 bench/peers/torch_gather.py [--json] [--world W]   (--json: one JSON line on stdout)
"""
import argparse
import json
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from peer_common import log, median_ms

ROWS = 10_000_000
COLS = 128
BATCH = 4_000_000  # (a)
KEYS = 1_000_000  # (d), per rank


def index_select_case():
    dev = torch.device("cuda", 0)
    table = torch.randn(ROWS, COLS, device=dev)
    idx = torch.randint(0, ROWS, (BATCH,), device=dev, dtype=torch.int64)
    out = torch.empty(BATCH, COLS, device=dev)
    torch.index_select(table, 0, idx, out=out)
    sample = torch.randint(0, BATCH, (4096,), device=dev)
    if not torch.equal(out[sample], table[idx[sample]]):
        raise RuntimeError("index_select: wrong rows")
    ms = median_ms(lambda: torch.index_select(table, 0, idx, out=out))
    del table, idx, out
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return ms, BATCH * COLS * 4 / ms / 1e6


def lookup_worker(rank, world, queue):
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    try:
        per_rank = -(-ROWS // world)
        begin, end = rank * per_rank, min(ROWS, (rank + 1) * per_rank)
        shard = torch.randn(end - begin, COLS, device=dev)
        shard[:, 0] = torch.arange(begin, end, device=dev, dtype=torch.float32)  # exact < 2^24
        gen = torch.Generator(device=dev)
        gen.manual_seed(1234 + rank)
        keys = torch.randint(0, ROWS, (KEYS,), device=dev, dtype=torch.int64, generator=gen)

        def lookup():
            owner = keys // per_rank
            order = torch.argsort(owner)
            send_counts = torch.bincount(owner, minlength=world)
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts)
            send_splits = send_counts.tolist()
            recv_splits = recv_counts.tolist()
            recv_keys = keys.new_empty(sum(recv_splits))
            dist.all_to_all_single(recv_keys, keys[order], recv_splits, send_splits)
            rows = shard.index_select(0, recv_keys - begin)
            back = shard.new_empty(KEYS, COLS)
            dist.all_to_all_single(back, rows, send_splits, recv_splits)
            out = torch.empty_like(back)
            out[order] = back
            return out

        if not torch.equal(lookup()[:, 0], keys.to(torch.float32)):
            raise RuntimeError(f"rank {rank}: all-to-all lookup returned wrong rows")
        dist.barrier()
        ms = median_ms(lookup)
        both = torch.tensor([ms], device=dev, dtype=torch.float64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        if rank == 0:
            queue.put((both.item(), ms))
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def a2a_case(world):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(lookup_worker, args=(world, queue), nprocs=world, join=True)
    return queue.get()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line on stdout")
    parser.add_argument("--world", type=int, default=None,
                        help="ranks of the all-to-all lookup (default: every GPU present)")
    args = parser.parse_args()
    for var, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ[var] = value  # NVLink multicast stays off (the GPU machine's rule)
    gpus = torch.cuda.device_count()
    if gpus == 0:
        raise SystemExit("torch_gather: no GPU")
    world = gpus if args.world is None else args.world
    if not 1 <= world <= gpus:
        raise SystemExit(f"torch_gather: --world {world}: expected 1 to the {gpus} GPUs present")
    res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "gpus": gpus}
    res["index_select_ms"], res["index_select_gbps"] = index_select_case()
    log(f"torch_gather: index_select {res['index_select_ms']:.3f} ms, "
        f"{res['index_select_gbps']:.1f} GB/s out")
    res["a2a_ms"] = res["a2a_r0_ms"] = None
    res["world"] = world
    if world >= 2:
        res["a2a_ms"], res["a2a_r0_ms"] = a2a_case(world)
        log(f"torch_gather: all-to-all lookup {res['a2a_ms']:.3f} ms (max over {world} ranks; "
            f"rank 0 {res['a2a_r0_ms']:.3f} ms)")
    else:
        log("torch_gather: all-to-all lookup skipped (needs --world >= 2)")
    if args.json:
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
