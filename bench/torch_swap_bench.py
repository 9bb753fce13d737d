#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""torch_swap_bench: saved activations of a PyTorch training step in a wm swap scope
(examples/pytorch, wm_torch.SwapHooks) against no offload and torch's save_on_cpu.

Workload (as bench/peers/torch_swap.py and bench/swap_bench.cu): 16 x (Linear(8192, 8192,
bias=False) + ReLU), bf16, batch 16,384, input uniform(-1, 1), loss 0.5 * sum(y.float()^2) /
batch, SGD on every weight. The hooks (or save_on_cpu) wrap the model's forward, not the loss,
as torch_swap.py does. Rows, each on a fresh model from the same seed:
  - torch, no offload;
  - torch.autograd.graph.save_on_cpu(pin_memory=True);
  - "wm hooks, out <= k": wm_torch.SwapHooks in the direct mode (the default) over a SwapScope
    without a device pool: each saved activation is paged out straight from its own memory
    (record_stream on the scope's copy stream keeps it until the copy is done) and the forward
    pass waits for the oldest page-outs when more than k activations may still be copying
    (--outstanding, 0: never); backward pages them into tensors from torch's allocator, staged
    --stage activations ahead, from the first unpack on (--direct-prefetch auto) or from
    hooks.prefetch_all() right after the forward (explicit); the output, still alive, is
    unpacked as itself;
  - "wm hooks, host out <= k" (--host-outstanding): the same with host_pacing=True: the host
    waits instead of the stream, and waits for every page-out when the hooks' block ends, so that
    torch's allocator can reuse the saved tensors' memory (a record_stream-ed block is reused only
    once the host has seen its copy end);
  - "wm hooks zc, host out <= k" (--compress-outstanding): compress=True (each activation
    zero-encoded on the forward's stream, wm::zero_codec; its encoding goes out) with host pacing;
    "wm hooks zc, keep last k" (--keep-last): the same with the last k saves held on the GPU;
  - "wm hooks pool, pool P" (the first mode, for comparison): a SwapScope whose device pool holds
    P activations (--pools), pack copies each activation into it, prefetch lookahead of 2
    activations, hooks.prefetch_all() right after the forward.
  The model's parameters and the input buffer are skipped (they stay on the device anyway).
Columns: median step ms over the timed steps (CUDA events, after the warm-ups); ratio to no
offload; alloc / active / rsvd GiB = peaks over the timed steps (each row from an empty cache)
of torch's allocated bytes, active bytes (allocated + freed blocks that wait for a record_stream
event, which the allocator cannot hand out yet) and reserved bytes; wm dev GiB = the scope's
device pool (one cudaMalloc outside torch's allocator, for the scope's life; 0 in the direct
mode); peak GiB = active + pool (the target's measure), and its reduction against no offload;
the same reduction by allocated bytes (which count a record_stream-ed tensor free before its copy
ends) and by reserved bytes; zc = encoded / raw bytes; host waits per step; GB/s of the wm page-outs / page-ins while
copying (scope statistics), against pinned D2H / H2D copies of one activation measured in this
run (torch copy_ between a pinned host tensor and a device tensor); host-blocking syncs per step;
per step, the pool mode's passive page-ins, or the direct mode's unpacks as "itself / staged /
paged in at the unpack" and its pacing waits; whether the losses are bitwise those of no offload.
The table is printed last, then the issue's target: a wm row at <= 1.15x no offload with a peak
>= 35% lower.

Usage: python3 bench/torch_swap_bench.py [--layers 16] [--width 8192] [--batch 16384]
       [--steps 6] [--warmups 2] [--outstanding 0,2] [--host-outstanding 1,2]
       [--compress-outstanding 1,2] [--keep-last 1,2] [--stage 2]
       [--direct-prefetch auto|explicit] [--pools 2,4] [--no-save-on-cpu]
The first run builds the extension (examples/pytorch/README.md), a few minutes.
"""
import argparse
import os
import pathlib
import statistics
import sys
import time

for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(k, v)

import torch  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples" / "pytorch"))
import wm_torch  # noqa: E402

GIB = 2 ** 30


def build(layers, width, seed=2024):
    """The same weights on every call (made on the GPU: 16 x 8192^2 on the CPU takes seconds)."""
    torch.manual_seed(seed)
    mods = []
    for _ in range(layers):
        lin = torch.nn.Linear(width, width, bias=False, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.uniform_(-1.7 / width ** 0.5, 1.7 / width ** 0.5)
        mods += [lin, torch.nn.ReLU()]
    return torch.nn.Sequential(*mods)


def pinned_gbps(nbytes, reps=10):
    """Median GB/s of pinned D2H and H2D copies of nbytes (torch copy_, non_blocking)."""
    d = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(1)
    h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    out = []
    for dst, src in ((h, d), (d, h)):
        for _ in range(2):
            dst.copy_(src, non_blocking=True)
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for a, b in ev:
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
        torch.cuda.synchronize()
        out.append(nbytes / (statistics.median(a.elapsed_time(b) for a, b in ev) * 1e-3) / 1e9)
    del d, h
    return out  # [d2h, h2d]


def run(a, mode, pool=0, outstanding=0, keep_last=0, compress=False, host_pacing=False):
    """One row: mode "plain", "save_on_cpu", "wm" (pool mode, `pool` activations) or "direct"
    (direct mode, at most `outstanding` activations copying before the forward (stream pacing) or
    the host (host_pacing) waits; the last `keep_last` saved activations held on the GPU, never
    paged out; compress: the zero encoding before each page-out)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    model = build(a.layers, a.width)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.empty(a.batch, a.width, device="cuda", dtype=torch.bfloat16)
    act = a.batch * a.width * 2
    scope = hooks = None
    if mode == "wm":
        scope = wm_torch.SwapScope(pool * act, (a.layers + 2) * act, prefetch_lookahead=2 * act)
        hooks = wm_torch.SwapHooks(scope, skip=[model, x], mode="pool")
    elif mode == "direct":
        scope = wm_torch.SwapScope(0, (a.layers + 2) * act)
        hooks = wm_torch.SwapHooks(scope, skip=[model, x], mode="direct", max_outstanding_bytes=outstanding * act,
                                   stage_bytes=a.stage * act, auto_prefetch=True, keep_last=keep_last,
                                   compress=compress, host_pacing=host_pacing)
    gen = torch.Generator(device="cuda").manual_seed(7)

    def step():
        x.uniform_(-1.0, 1.0, generator=gen)
        opt.zero_grad(set_to_none=False)
        if mode == "plain":
            y = model(x)
        elif mode == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                y = model(x)
        else:
            with hooks:
                y = model(x)
            if mode == "wm" or a.direct_prefetch == "explicit":
                hooks.prefetch_all()  # page-ins start now, latest activation first
        loss = 0.5 * y.float().pow(2).sum() / a.batch
        loss.backward()
        opt.step()
        return loss.detach()

    for _ in range(a.warmups):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    if scope is not None:
        scope.reset_statistics()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(a.steps)]
    losses = []
    for s, e in ev:
        s.record()
        losses.append(step())
        e.record()
    torch.cuda.synchronize()
    r = {
        "ms": statistics.median(s.elapsed_time(e) for s, e in ev),
        "torch_peak": torch.cuda.max_memory_allocated() / GIB,
        "reserved": torch.cuda.max_memory_reserved() / GIB,
        "active": torch.cuda.memory_stats()["active_bytes.all.peak"] / GIB,
        "pool": scope.device_budget / GIB if scope is not None else 0.0,
        "losses": torch.stack(losses).cpu(),
    }
    if scope is not None:
        st = scope.statistics()
        r.update(out=st["out_gbps"], inn=st["in_gbps"], syncs=st["host_blocking_syncs"] / a.steps,
                 passive=st["passive_pageins"] / a.steps, pool_peak=st["peak_resident_bytes"] / GIB,
                 copies=st["copies"] / a.steps, shared=st["shared"] / a.steps,
                 mib_out=st["bytes_out"] / a.steps / 2 ** 20, mib_in=st["bytes_in"] / a.steps / 2 ** 20,
                 direct=st["direct"], reused=(st["reused_sources"] + st["kept_last"]) / a.steps, staged=st["staged_unpacks"] / a.steps,
                 unstaged=st["unstaged_unpacks"] / a.steps, paced=st["throttle_waits"] / a.steps,
                 zc=(st["encoded_bytes"] / st["encoded_raw_bytes"]) if st["encoded_raw_bytes"] else 0.0,
                 host_waits=st["host_waits"] / a.steps)
    r["peak"] = r["active"] + r["pool"]
    return r  # the model, the scope and its pinned slab go with this frame


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmups", type=int, default=2)
    ap.add_argument("--outstanding", default="0,2",
                    help="direct rows, stream pacing: activations that may still be copying before the forward waits "
                         "(0: never)")
    ap.add_argument("--host-outstanding", default="1,2",
                    help="direct rows, host pacing: activations that may still be copying before the host waits")
    ap.add_argument("--compress-outstanding", default="1,2",
                    help="direct rows with the zero encoding and host pacing")
    ap.add_argument("--stage", type=int, default=2, help="direct rows: activations paged in ahead of backward's use")
    ap.add_argument("--direct-prefetch", choices=("auto", "explicit"), default="auto",
                    help="direct rows: page-ins start at the first unpack (auto) or right after the forward")
    ap.add_argument("--pools", default="2,4", help="pool-mode rows (the first mode): pool sizes in activations")
    ap.add_argument("--keep-last", default="1,2",
                    help="direct rows with the zero encoding and host pacing (out <= 2): the last k saved activations "
                         "stay on the GPU (SwapHooks keep_last)")
    ap.add_argument("--no-save-on-cpu", action="store_true")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("torch_swap_bench: no GPU found, nothing to measure")
        return 0
    t0 = time.time()
    wm_torch.load()
    print(f"extension ready in {time.time() - t0:.1f} s", flush=True)
    act = a.batch * a.width * 2
    d2h, h2d = pinned_gbps(act)
    rows = [("torch, no offload", run(a, "plain"))]
    print(f"  {rows[-1][0]}: {rows[-1][1]['ms']:.1f} ms", flush=True)
    if not a.no_save_on_cpu:
        rows.append(("torch save_on_cpu(pinned)", run(a, "save_on_cpu")))
        print(f"  {rows[-1][0]}: {rows[-1][1]['ms']:.1f} ms", flush=True)
    for k in [int(v) for v in a.outstanding.split(",") if v]:
        rows.append((f"wm hooks, out <= {k}" if k else "wm hooks, out unpaced", run(a, "direct", outstanding=k)))
        print(f"  {rows[-1][0]}: {rows[-1][1]['ms']:.1f} ms", flush=True)
    for k in [int(v) for v in a.host_outstanding.split(",") if v]:
        rows.append((f"wm hooks, host out <= {k}", run(a, "direct", outstanding=k, host_pacing=True)))
        print(f"  {rows[-1][0]}: {rows[-1][1]['ms']:.1f} ms", flush=True)
    for k in [int(v) for v in a.compress_outstanding.split(",") if v]:
        rows.append((f"wm hooks zc, host out <= {k}", run(a, "direct", outstanding=k, host_pacing=True, compress=True)))
        print(f"  {rows[-1][0]}: {rows[-1][1]['ms']:.1f} ms", flush=True)
    for k in [int(v) for v in a.keep_last.split(",") if v]:
        rows.append((f"wm hooks zc, keep last {k}",
                     run(a, "direct", outstanding=2, host_pacing=True, compress=True, keep_last=k)))
        print(f"  {rows[-1][0]}: {rows[-1][1]['ms']:.1f} ms", flush=True)
    for p in [int(v) for v in a.pools.split(",") if v]:
        rows.append((f"wm hooks pool, pool {p}", run(a, "wm", p)))
        print(f"  {rows[-1][0]}: {rows[-1][1]['ms']:.1f} ms", flush=True)

    base = rows[0][1]
    print(f"\n== torch_swap_bench: {torch.cuda.get_device_name()}, torch {torch.__version__}, {a.layers} x Linear({a.width}) "
          f"+ ReLU, bf16, batch {a.batch}; activation {act / 2 ** 20:.0f} MiB; median of {a.steps} steps after "
          f"{a.warmups} warm-ups; direct rows: {a.stage} activations staged, page-ins from "
          f"{'the first unpack' if a.direct_prefetch == 'auto' else 'prefetch_all after the forward'}")
    print(f"   pinned copy of one activation (torch copy_): D2H {d2h:.1f} GB/s, H2D {h2d:.1f} GB/s")
    hdr = (f"{'':29s} {'step ms':>8s} {'ratio':>6s} {'alloc GiB':>9s} {'active':>7s} {'rsvd GiB':>8s} {'wm dev GiB':>10s} "
           f"{'peak GiB':>8s} {'vs none':>8s} {'alloc vs':>8s} {'rsvd vs':>8s} {'zc':>5s} {'hw/st':>5s} "
           f"{'out GB/s':>12s} {'in GB/s':>12s} {'MiB out/in per step':>19s} {'sync/st':>7s} "
           f"{'unpacks/st: itself/staged/now, pacing':>38s} {'loss':>5s}")
    print(hdr)
    met = []
    for name, r in rows:
        ratio = r["ms"] / base["ms"]
        lower = 1 - r["peak"] / base["peak"]
        lower_alloc = 1 - (r["torch_peak"] + r["pool"]) / base["torch_peak"]
        lower_rsvd = 1 - (r["reserved"] + r["pool"]) / base["reserved"]
        same = "same" if torch.equal(r["losses"], base["losses"]) else "DIFF"
        if "out" in r:
            gb = (f"{r['out']:5.1f} ({r['out'] / d2h:.2f})", f"{r['inn']:5.1f} ({r['inn'] / h2d:.2f})")
            traffic = f"{r['mib_out']:.0f} / {r['mib_in']:.0f}"
            if r["direct"]:
                kinds = f"{r['reused']:.1f}/{r['staged']:.1f}/{r['unstaged']:.1f}, {r['paced']:.1f}"
            else:
                kinds = f"pool: {r['passive']:.2f} passive page-ins"
            extra = f"{r['syncs']:7.2f} {kinds:>38s}"
            zc = (f"{r['zc']:5.2f}" if r["zc"] else f"{'-':>5s}") + f" {r['host_waits']:5.1f}"
            if ratio <= 1.15 and lower >= 0.35:
                met.append(name)
        else:
            gb, traffic, extra = ("-", "-"), "-", f"{'-':>7s} {'-':>38s}"
            zc = f"{'-':>5s} {'-':>5s}"
        print(f"{name:29s} {r['ms']:8.1f} {ratio:6.3f} {r['torch_peak']:9.2f} {r['active']:7.2f} {r['reserved']:8.2f} "
              f"{r['pool']:10.2f} {r['peak']:8.2f} {-100 * lower:+7.1f}% {-100 * lower_alloc:+7.1f}% "
              f"{-100 * lower_rsvd:+7.1f}% {zc} {gb[0]:>12s} {gb[1]:>12s} "
              f"{traffic:>19s} {extra} {same:>5s}")
    print("   alloc / active / rsvd GiB = peaks over the timed steps (each row starts from empty_cache) of torch's "
          "allocated bytes, active bytes (allocated + freed blocks still waiting for a record_stream event: memory the "
          "allocator cannot hand out yet) and reserved bytes (+ its cached, fragmented segments); peak GiB = active + "
          "the wm device pool (cudaMalloc'd by the scope, outside torch's allocator; none in the direct mode): the "
          "target's measure; vs none: its change against no offload; alloc vs / rsvd vs: the same by allocated bytes "
          "(which count a record_stream-ed tensor free before its copy ends) and by reserved bytes; zc: encoded / raw bytes (compress rows); hw/st: host waits per "
          "step (host pacing, encodings); out/in GB/s: achieved while copying (ratio to "
          "the pinned copy); sync/st: host-blocking syncs of the scope per step; unpacks per step (direct): the saved "
          "tensor itself (still alive), staged ahead, paged in at the unpack; pacing: forward waits for page-outs; "
          "pool rows: page-ins that backward waited for without a prefetch; loss: bitwise equal to no offload")
    print(f"   target (issue 22): a wm row at <= 1.15x no offload with a peak >= 35% lower: "
          f"{'met by ' + ', '.join(met) if met else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
