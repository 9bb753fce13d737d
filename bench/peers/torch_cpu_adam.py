#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""PyTorch peer of bench/cpu_adam_bench.cpp: torch.optim.AdamW on CPU tensors of the same size.

N fp32 parameters (one tensor, or --tensors K of N/K each) with fp32 gradients of magnitude ~1e-3,
AdamW defaults (lr 1e-3, betas 0.9/0.999, eps 1e-8, weight_decay 0.01), torch.set_num_threads(T).
Three implementations: default (foreach=False, fused=False: the single-tensor loop), foreach=True,
fused=True; and DeepSpeed's DeepSpeedCPUAdam (adamw_mode, the same hyper-parameters) where
`deepspeed` imports (its CPU Adam op builds on first use), after one step checked against torch's
AdamW on the same data (result key deepspeed_max_diff; deepspeed -1 when it is not there). Each:
2 warm-up steps, then the median of R timed opt.step() calls (perf_counter); params/s = N /
median. The same 28 bytes per parameter move as in the wm benchmark's fp32 case.

Usage: python3 bench/peers/torch_cpu_adam.py [--params N] [--threads T] [--tensors K] [--reps R]
                                             [--json]   (--json: one JSON line on stdout)
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def time_steps(opt, reps):
    for _ in range(2):
        opt.step()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def deepspeed_peer(sizes, args, result):
    """DeepSpeedCPUAdam on the same sizes: one step compared with torch's AdamW, then timed."""
    result["deepspeed"] = -1.0
    try:
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as e:  # not installed, or its CPU Adam op did not build
        log(f"torch_cpu_adam: DeepSpeedCPUAdam not available: {type(e).__name__}: {e}")
        return
    hyper = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    params = [torch.nn.Parameter(torch.empty(s).uniform_(-1, 1)) for s in sizes]
    for p in params:
        p.grad = torch.empty_like(p).uniform_(-1e-3, 1e-3)
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for r, p in zip(reference, params):
        r.grad = p.grad.clone()
    try:
        opt = DeepSpeedCPUAdam(params, adamw_mode=True, **hyper)
        opt.step()
    except Exception as e:
        log(f"torch_cpu_adam: DeepSpeedCPUAdam failed: {type(e).__name__}: {e}")
        return
    torch.optim.AdamW(reference, **hyper).step()
    diff = max(float((p.detach() - r.detach()).abs().max()) for p, r in zip(params, reference))
    del reference
    result["deepspeed_version"] = deepspeed.__version__
    result["deepspeed_max_diff"] = diff
    if diff > 1e-6:  # one step moves a weight by ~lr: a different rule shows at once
        log(f"torch_cpu_adam: DeepSpeedCPUAdam differs from torch AdamW by {diff} after one step")
        return
    sec = time_steps(opt, args.reps)
    result["deepspeed"] = args.params / sec
    log(f"DeepSpeedCPUAdam {deepspeed.__version__}: {sec * 1e3:.2f} ms, "
        f"{args.params / sec / 1e9:.3f} Gparams/s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=1 << 27)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--tensors", type=int, default=1)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    sizes = [args.params // args.tensors] * args.tensors
    sizes[-1] += args.params - sum(sizes)
    result = {"params": args.params, "threads": torch.get_num_threads(), "tensors": args.tensors,
              "torch": torch.__version__}
    for name, kw in (("default", {"foreach": False, "fused": False}),
                     ("foreach", {"foreach": True}),
                     ("fused", {"fused": True})):
        params = [torch.nn.Parameter(torch.empty(s).uniform_(-1, 1)) for s in sizes]
        for p in params:
            p.grad = torch.empty_like(p).uniform_(-1e-3, 1e-3)
        try:
            opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **kw)
            sec = time_steps(opt, args.reps)
        except (RuntimeError, TypeError) as e:  # an implementation this torch lacks on CPU
            log(f"torch_cpu_adam: {name}: {e}")
            result[name] = -1.0
            continue
        result[name] = args.params / sec
        log(f"torch AdamW {name}: {sec * 1e3:.2f} ms, {args.params / sec / 1e9:.3f} Gparams/s, "
            f"{28 * args.params / sec / 1e9:.1f} GB/s at 28 B/param")
        del opt, params
    deepspeed_peer(sizes, args, result)
    if args.json:
        print(json.dumps(result), flush=True)
    else:
        print(result)


if __name__ == "__main__":
    main()
