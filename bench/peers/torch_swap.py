#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""PyTorch peer of bench/swap_bench.cu: the same MLP, trained the way a PyTorch user would.

16 x (Linear(8192, 8192, bias=False) -> ReLU), bf16, batch 16,384; loss 0.5 * sum(y^2) / batch
(in float32); SGD on every weight; input uniform(-1, 1). Two ways: plain, and with every saved
tensor kept on the host through torch.autograd.graph.save_on_cpu(pin_memory=True).

Per way: 2 warm-up steps, then the median of the timed steps (CUDA events around each step);
peak = torch.cuda.max_memory_allocated over the timed steps (weights, grads, activations).
Usage: python3 bench/peers/torch_swap.py [--json] [--layers L] [--width W] [--batch B] [--steps S]
"""
import argparse
import json
import statistics

import torch

from peer_common import log


def build(layers, width, seed=2024):
    torch.manual_seed(seed)
    mods = []
    for _ in range(layers):
        lin = torch.nn.Linear(width, width, bias=False)
        torch.nn.init.uniform_(lin.weight, -1.7 / width ** 0.5, 1.7 / width ** 0.5)
        mods += [lin, torch.nn.ReLU()]
    return torch.nn.Sequential(*mods).to(device="cuda", dtype=torch.bfloat16)


def run(model, batch, width, steps, offload, lr=0.05):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x = torch.empty(batch, width, device="cuda", dtype=torch.bfloat16)

    def step(i):
        x.uniform_(-1.0, 1.0)
        opt.zero_grad(set_to_none=False)
        if offload:
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                y = model(x)
        else:
            y = model(x)
        loss = 0.5 * y.float().pow(2).sum() / batch
        loss.backward()
        opt.step()
        return loss

    for i in range(2):
        step(i)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(steps)]
    losses = []
    for i, (a, b) in enumerate(events):
        a.record()
        losses.append(step(i + 2))
        b.record()
    torch.cuda.synchronize()
    ms = statistics.median(a.elapsed_time(b) for a, b in events)
    peak = torch.cuda.max_memory_allocated() / 2 ** 30
    log(f"torch_swap: {'save_on_cpu' if offload else 'plain'}: {ms:.1f} ms/step, peak {peak:.2f} GiB,"
        f" last loss {losses[-1].item():.5f}")
    return ms, peak


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    model = build(a.layers, a.width)
    plain_ms, plain_peak = run(model, a.batch, a.width, a.steps, False)
    del model
    torch.cuda.empty_cache()
    model = build(a.layers, a.width)
    off_ms, off_peak = run(model, a.batch, a.width, a.steps, True)
    out = {"torch_ms": plain_ms, "torch_peak_gib": plain_peak,
           "save_on_cpu_ms": off_ms, "save_on_cpu_peak_gib": off_peak}
    if a.json:
        print(json.dumps(out), flush=True)
    else:
        log(out)


if __name__ == "__main__":
    main()
