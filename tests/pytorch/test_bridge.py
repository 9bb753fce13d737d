# SPDX-License-Identifier: Apache-2.0
"""The PyTorch bridge (examples/pytorch) on a GPU: builds the extension and checks it.

1. Forward: rows written with load_weights_ come back from the gather bitwise, for keys of any
   shape with repeats, int64 and int32, through a device table and a cached host table.
2. Training against torch.nn.Embedding(sparse=True) + torch.optim.SparseAdam / torch.optim.SGD
   on the same fresh random data for several steps (device table; host table with a read-write
   device cache so small that rows are evicted, written back and bypassed), both against a
   float64 reference of the documented update (tolerance reasoning at TOL below).
3. Swap hooks: a small bf16 MLP trained with wm_torch.SwapHooks gives bitwise the losses and
   gradients of the same training without hooks, in both modes: "pool" (pool smaller than the
   saved activations, so buffers go out and come back; explicit and automatic prefetch) and
   "direct" (page-outs from the tensors' own memory, page-ins into torch's memory; with and
   without the forward's page-out pacing, one or two tensors staged ahead); the direct mode's
   peak (torch.cuda.max_memory_allocated + the scope's device pool) is below the pool mode's on
   the same MLP; a storage freed and reused by a new tensor of the same shape is not mistaken for
   the old one (both modes); a pool (or slab) too small for a tensor keeps it in place.
4. Bad input raises: CPU keys, float keys, wrong dtypes and devices, non-contiguous tensors, an
   optimizer on a read-only cache, a key out of range.
5. load_weights_ over cached rows, one process per rank (this file run as a rank: --rank-worker):
   a host table with a read-write cache is trained so that the owners' caches hold dirty lines,
   each rank writes new values for trained rows that another rank owns (one rank: its own), and
   gathers on every rank return the written rows bitwise, also after a flush. With 2 ranks
   (skipped with fewer GPUs) and with 1.

Usage: python3 tests/pytorch/test_bridge.py   (exit 0 pass, 1 fail, 77 skipped: no torch, no
CUDA toolkit or ninja for torch.utils.cpp_extension, or no GPU). The extension is built into
WM_TORCH_BUILD_DIR (default <repo>/build/wm_torch); the first build takes a few minutes.
"""
import faulthandler
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import traceback

for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1"),
             ("CUBLAS_WORKSPACE_CONFIG", ":4096:8")):
    os.environ.setdefault(k, v)
faulthandler.enable()  # a crash in the extension prints the Python stack of the case that died

try:
    import torch
    from torch.utils import cpp_extension
except ImportError as e:
    print(f"SKIPPED: {e}")
    sys.exit(77)
if not torch.cuda.is_available():
    print("SKIPPED: no CUDA device")
    sys.exit(77)
if cpp_extension.CUDA_HOME is None:
    print("SKIPPED: no CUDA toolkit for torch.utils.cpp_extension (set CUDA_HOME)")
    sys.exit(77)
if not cpp_extension.is_ninja_available():
    print("SKIPPED: torch.utils.cpp_extension needs ninja (pip install ninja)")
    sys.exit(77)

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples" / "pytorch"))
import wm_torch  # noqa: E402

# A rank of a multi-process case (section 5): `--rank-worker CASE RANK WORLD STORE SEED`. Its GPU
# is selected before anything touches CUDA.
WORKER = sys.argv[2:7] if len(sys.argv) >= 7 and sys.argv[1] == "--rank-worker" else None
if WORKER is not None:
    torch.cuda.set_device(int(WORKER[1]))
DEV = torch.device("cuda", torch.cuda.current_device())

# Tolerance of the training comparisons, against a float64 reference of the documented update.
# Both wm and torch compute in float32 (unit roundoff u = 2^-24 = 6.0e-8). A step changes a
# weight by one update: Adam's m, v, bias corrections, sqrt, division and the step size are
# ~20 roundings, each relative to |update| <= lr * |m_hat / sqrt(v_hat)| <= lr * 3.2 (the
# first step gives exactly lr; later |m_hat| / sqrt(v_hat) <= (1 - b1) / sqrt(1 - b2) after
# bias correction), plus the sum of a key's duplicate gradients (at most ~12 terms here, all of
# one sign per element: the noise R below shares its sign among a key's positions, so the sum
# never cancels and its relative error stays <= 12 u), plus one rounding of the stored weight
# (u |w|). Per step: <= u |w| + 32 u lr * 3.2; over STEPS = 6 with |w| <= 1.5 and lr = 0.01:
# <= 6 (9.0e-8 + 6.1e-8) ~= 9e-7. The gradient of the next step depends on the weights, so an
# error feeds back, damped by 1/B. TOL = 4e-6 (1 + |w|) leaves a factor > 4 (torch's SparseAdam
# and SGD on the CPU stay below 0.04 TOL against this reference). What the test must catch moves
# weights by far more: a lost duplicate (last wins: > 6000 TOL), per-row instead of global steps
# (> 2000 TOL), a stale cached row (~lr). Epsilon's placement does not show at gradients of this
# size (tests/embedding/torch_sparse_adam.py covers it).
TOL_ABS, TOL_REL = 4e-6, 4e-6
ROWS, STEPS, BATCH, HOT = 3000, 6, 2000, 150
LR_ADAM, LR_SGD = 0.01, 0.01
B1, B2, EPS = 0.9, 0.999, 1e-8

results = []


def check(name, ok, detail=""):
    results.append(bool(ok))
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)


def run_case(name, fn):
    try:
        fn()
    except Exception:  # a case that throws fails; the others still run
        traceback.print_exc()
        check(name, False, "raised")


# ---------------------------------------------------------------------------------------------
# 1. Forward


def keys_with_repeats(g, n, rows, hot):
    k = torch.randint(0, rows, (n,), generator=g)
    h = torch.randint(0, hot, (n // 3,), generator=g)
    k[torch.randperm(n, generator=g)[: n // 3]] = h  # a third of the keys from a small hot set
    return k


def test_forward():
    g = torch.Generator().manual_seed(int(time.time_ns() % 2**31))
    for location, cache, dim in (("device", None, 32), ("device", None, 20), ("host", "read_write", 32),
                                 ("host", "read_only", 24), ("host", None, 24)):
        opt = wm_torch.SGD() if cache != "read_only" else None
        emb = wm_torch.Embedding(ROWS, dim, location=location, cache=cache, cache_ratio=0.05, optimizer=opt,
                                 init="uniform", init_a=-0.25, init_b=0.75, seed=int(torch.randint(0, 2**31, (1,), generator=g)))
        init = emb.rows().cpu()
        spread_ok = bool(init.min() >= -0.25) and bool(init.max() <= 0.75) and float(init.std()) > 0.2
        w = torch.rand(ROWS, dim, generator=g) * 2 - 1
        emb.load_weights_(w)
        keys = keys_with_repeats(g, 3 * 700, ROWS, 50).view(3, 700)
        ok = True
        for rep in range(2):  # the second time through a cache: hits
            for kk in (keys, keys.int()):
                out = emb(kk.to(DEV))
                ok &= out.shape == (3, 700, dim) and out.dtype == torch.float32
                ok &= torch.equal(out.cpu(), w[keys])
        check(f"forward {emb._table.description} dim {dim}", ok and spread_ok,
              f"init in [{float(init.min()):.3f}, {float(init.max()):.3f}], rows bitwise W[keys]")


# ---------------------------------------------------------------------------------------------
# 2. Training against torch


def make_batches(g, dim):
    """Keys with repeats; per step a target table T (loss 0.5 |out - T[k]|^2 / B) and noise
    R = S[k] * U added to the gradient, S a random sign per (row, column) and step, U in [0.5, 1]
    per position: a key's duplicates share their sign, so their sum never cancels."""
    batches = []
    T = torch.rand(ROWS, dim, generator=g, dtype=torch.float64) * 2 - 1
    for _ in range(STEPS):
        k = keys_with_repeats(g, BATCH, ROWS, HOT)
        S = torch.where(torch.rand(ROWS, dim, generator=g) < 0.5, -1.0, 1.0).double()
        U = 0.5 + 0.5 * torch.rand(BATCH, dim, generator=g, dtype=torch.float64)
        batches.append((k, T[k].clone(), (S[k] * U)))
    return batches


def loss_of(out, target, noise):
    return 0.5 * ((out - target) ** 2).sum() / BATCH + (out * noise).sum()


def reference(w0, batches, kind, lr):
    """float64 SparseAdam / SGD on rows: duplicates summed, absent rows untouched; SparseAdam's
    one step count and its epsilon: w -= lr sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)."""
    w = w0.double().clone()
    m = torch.zeros_like(w)
    v = torch.zeros_like(w)
    for t, (k, target, noise) in enumerate(batches, start=1):
        gout = (w[k] - target) / BATCH + noise
        g = torch.zeros_like(w).index_add_(0, k, gout)
        rows = torch.unique(k)
        gr = g[rows]
        if kind == "sgd":
            w[rows] -= lr * gr
        else:
            m[rows] = B1 * m[rows] + (1 - B1) * gr
            v[rows] = B2 * v[rows] + (1 - B2) * gr * gr
            step = lr * (1 - B2 ** t) ** 0.5 / (1 - B1 ** t)
            w[rows] -= step * m[rows] / (v[rows].sqrt() + EPS)
    return w


def train_torch(w0, batches, kind, lr):
    emb = torch.nn.Embedding(ROWS, w0.shape[1], sparse=True, device=DEV)
    with torch.no_grad():
        emb.weight.copy_(w0)
    opt = (torch.optim.SparseAdam(emb.parameters(), lr=lr, betas=(B1, B2), eps=EPS) if kind == "adam"
           else torch.optim.SGD(emb.parameters(), lr=lr))
    for k, target, noise in batches:
        opt.zero_grad()
        loss_of(emb(k.to(DEV)), target.float().to(DEV), noise.float().to(DEV)).backward()
        opt.step()
    return emb.weight.detach().cpu().double()


def train_wm(w0, batches, kind, lr, location, cache):
    spec = wm_torch.SparseAdam(betas=(B1, B2), eps=EPS) if kind == "adam" else wm_torch.SGD()
    emb = wm_torch.Embedding(ROWS, w0.shape[1], location=location, cache=cache, cache_ratio=0.05, optimizer=spec)
    emb.load_weights_(w0)
    opt = wm_torch.EmbeddingOptimizer(emb, lr=lr)
    losses = []
    for k, target, noise in batches:
        opt.zero_grad()
        out = emb(k.to(DEV))
        assert out.requires_grad
        loss = loss_of(out, target.float().to(DEV), noise.float().to(DEV))
        loss.backward()
        assert emb._anchor.grad is None and len(emb._pending) == 1
        opt.step()
        losses.append(float(loss.detach()))
    stats = emb.cache_stats() if cache else None
    return emb.rows().cpu().double(), emb.global_step, stats


def test_training():
    g = torch.Generator().manual_seed(int(time.time_ns() % 2**31) + 1)
    for location, cache in (("device", None), ("host", "read_write")):
        for kind, lr, dim in (("adam", LR_ADAM, 32), ("sgd", LR_SGD, 20)):
            w0 = (torch.rand(ROWS, dim, generator=g) - 0.5)  # float32, in [-0.5, 0.5)
            batches = make_batches(g, dim)
            ref = reference(w0, batches, kind, lr)
            ours, steps, stats = train_wm(w0, batches, kind, lr, location, cache)
            theirs = train_torch(w0, batches, kind, lr)
            tol = TOL_ABS + TOL_REL * ref.abs()
            d_wm = (ours - ref).abs()
            d_torch = (theirs - ref).abs()
            moved = float((ref - w0.double()).abs().max())
            ok = bool((d_wm <= tol).all()) and bool((d_torch <= tol).all()) and moved > 1e-2 and steps == STEPS
            detail = (f"max |wm - f64| {float(d_wm.max()):.2e}, max |torch - f64| {float(d_torch.max()):.2e}, "
                      f"max |wm - torch| {float((ours - theirs).abs().max()):.2e}, weights moved {moved:.3f}, "
                      f"global step {steps}")
            if stats is not None:  # the cache must have been used: lines replaced
                ok &= stats["evictions"] > 0 and stats["hits"] + stats["misses"] == stats["requests"]
                ok &= isinstance(stats["hit_first_gathers"], int) and stats["hit_first_gathers"] >= 0
                detail += (f"; cache: {stats['hits']} hits, {stats['misses']} misses, {stats['evictions']} evictions,"
                           f" {stats['write_backs']} write-backs, {stats['bypasses']} bypasses,"
                           f" {stats['hit_first_gathers']} hit-first gathers")
            name = "torch.optim.SparseAdam" if kind == "adam" else "torch.optim.SGD(sparse)"
            check(f"training vs {name}: {location} table, cache {cache}", ok, detail)


# ---------------------------------------------------------------------------------------------
# 3. Swap hooks


def make_mlp(layers, width, seed):
    torch.manual_seed(seed)
    mods = []
    for _ in range(layers):
        lin = torch.nn.Linear(width, width, bias=False)
        torch.nn.init.uniform_(lin.weight, -1.7 / width ** 0.5, 1.7 / width ** 0.5)
        mods += [lin, torch.nn.ReLU()]
    return torch.nn.Sequential(*mods).to(device=DEV, dtype=torch.bfloat16)


def train_mlp(make_hooks, steps, layers, width, batch, explicit_prefetch):
    model = make_mlp(layers, width, 7)
    hooks = None if make_hooks is None else make_hooks(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator(device=DEV).manual_seed(11)
    x = torch.empty(batch, width, device=DEV, dtype=torch.bfloat16)
    losses, grads = [], []
    for _ in range(steps):
        x.uniform_(-1.0, 1.0, generator=g)
        opt.zero_grad(set_to_none=False)
        if hooks is None:
            y = model(x)
            loss = 0.5 * y.float().pow(2).sum() / batch
        else:
            with hooks:
                y = model(x)
                loss = 0.5 * y.float().pow(2).sum() / batch
            if explicit_prefetch:
                hooks.prefetch_all()
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        opt.step()
        del y, loss
    torch.cuda.synchronize()
    return losses, grads


SWAP_LAYERS, SWAP_WIDTH, SWAP_BATCH, SWAP_STEPS = 6, 1024, 4096, 3
SWAP_ACT = SWAP_BATCH * SWAP_WIDTH * 2  # 8 MiB per bf16 activation; the float32 output is 16 MiB


def test_swap_hooks_direct():
    """Direct mode: bitwise as no hooks; every saved tensor paged out from its own memory; the
    scope has no device pool; page-ins go into torch's memory (staged ahead, or at the unpack),
    except for saved tensors still alive and unchanged at their unpack (the input, the output)."""
    layers, width, batch, steps, act = SWAP_LAYERS, SWAP_WIDTH, SWAP_BATCH, SWAP_STEPS, SWAP_ACT
    base_losses, base_grads = train_mlp(None, steps, layers, width, batch, False)
    for explicit, max_out, stage in ((True, 0, 2 * act), (False, 0, 0), (True, act, act), (False, 2 * act, 2 * act)):
        scope = wm_torch.SwapScope(0, 16 * act)
        losses, grads = train_mlp(
            lambda model: wm_torch.SwapHooks(scope, skip=model, mode="direct", max_outstanding_bytes=max_out,
                                             stage_bytes=stage, host_pacing=False),
            steps, layers, width, batch, explicit)
        st = scope.statistics()
        same_loss = all(torch.equal(a, b) for a, b in zip(losses, base_losses))
        same_grad = all(torch.equal(a, b) for ga, gb in zip(grads, base_grads) for a, b in zip(ga, gb))
        copies = steps * (layers + 2)  # x_0 .. x_L and y.float(), as in the pool mode
        counts_ok = (st["shared"] == steps * (layers - 1) and st["copies"] == copies and st["pageouts_from"] == copies
                     and st["bytes_out"] > 0 and st["direct"] and st["device_pool_bytes"] == 0)
        # x_0 (the input, alive) and x_L (y, alive until the step ends) come back as themselves.
        reuse_ok = st["reused_sources"] >= 2 * steps and st["pageins_to"] > 0
        unpacked = st["reused_sources"] + st["staged_unpacks"] + st["unstaged_unpacks"]
        pacing_ok = (st["throttle_waits"] > 0) == (max_out > 0) and st["host_waits"] == 0
        check(f"swap hooks direct: bf16 MLP bitwise ({'explicit' if explicit else 'automatic'} prefetch_all, "
              f"out <= {max_out // act} act, staged {stage // act})",
              same_loss and same_grad and counts_ok and reuse_ok and pacing_ok and unpacked == copies
              and st["live_buffers"] == 0 and st["host_blocking_syncs"] == 0,
              f"losses {[round(float(v), 5) for v in losses]}, {st['copies']} page-outs from tensors, "
              f"{st['shared']} shared, {st['kept']} kept, {st['bytes_out'] >> 20} MiB out, {st['bytes_in'] >> 20} MiB in; "
              f"unpacks: {st['reused_sources']} the saved tensor itself, {st['staged_unpacks']} staged, "
              f"{st['unstaged_unpacks']} paged in at the unpack; {st['throttle_waits']} pacing waits, "
              f"{st['host_blocking_syncs']} host syncs, {st['live_buffers']} buffers alive after the steps")

    # keep_last: the newest k saves wait and go out only when newer ones come; the k still held
    # when backward starts are never copied (their unpack returns them).
    for explicit, keep in ((True, 1), (False, 3)):  # 3: x_{L-1} (saved twice) is held too
        scope = wm_torch.SwapScope(0, 16 * act)
        losses, grads = train_mlp(
            lambda model: wm_torch.SwapHooks(scope, skip=model, mode="direct", stage_bytes=act, keep_last=keep),
            steps, layers, width, batch, explicit)
        st = scope.statistics()
        same_loss = all(torch.equal(a, b) for a, b in zip(losses, base_losses))
        same_grad = all(torch.equal(a, b) for ga, gb in zip(grads, base_grads) for a, b in zip(ga, gb))
        copies = steps * (layers + 2)
        unpacked = st["reused_sources"] + st["staged_unpacks"] + st["unstaged_unpacks"] + st["kept_last"]
        check(f"swap hooks direct, keep_last {keep}: bf16 MLP bitwise ({'explicit' if explicit else 'automatic'} "
              f"prefetch_all), the last {keep} saves never paged out",
              same_loss and same_grad and st["copies"] == copies and st["kept_last"] == steps * keep
              and st["pageouts_from"] == copies - steps * keep and unpacked == copies
              and st["live_buffers"] == 0 and st["host_blocking_syncs"] == 0,
              f"losses {[round(float(v), 5) for v in losses]}, {st['copies']} saves, {st['pageouts_from']} paged out, "
              f"{st['kept_last']} unpacks of held tensors, {unpacked} unpacks, {st['live_buffers']} alive after")
    try:
        wm_torch.SwapHooks(wm_torch.SwapScope(0, 16 * act), mode="direct", keep_last=-1)
        check("swap hooks: keep_last=-1 raises ValueError", False, "no exception")
    except ValueError as e:
        check("swap hooks: keep_last=-1 raises ValueError", True, str(e))


class _Probe(torch.autograd.Function):
    """Saves `payload` for backward; backward records what its unpack returned."""
    seen = []

    @staticmethod
    def forward(ctx, x, payload):
        ctx.save_for_backward(payload)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        (p,) = ctx.saved_tensors
        _Probe.seen.append(p.clone())
        return g, None


def _bits(t):
    """A tensor comparable bit for bit (NaN == NaN, -0.0 != 0.0)."""
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _payload(dtype, n, zeros, g):
    """n random elements of dtype, a `zeros` fraction exactly zero, with -0.0, NaN and inf
    sprinkled into floating types."""
    if dtype == torch.bool:
        return torch.rand(n, device=DEV, generator=g) >= zeros
    if dtype.is_floating_point:
        t = (torch.rand(n, device=DEV, generator=g) * 2 - 1).to(dtype)
        idx = torch.randint(0, n, (max(n // 1000, 4),), device=DEV, generator=g)
        t[idx[0::4]] = -0.0
        t[idx[1::4]] = float("nan")
        t[idx[2::4]] = float("inf")
        t[idx[3::4]] = float("-inf")
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(max(info.min, -(1 << 30)), min(info.max, 1 << 30), (n,), device=DEV, generator=g,
                          dtype=torch.int64).to(dtype)
    t[torch.rand(n, device=DEV, generator=g) < zeros] = 0
    return t


def test_swap_hooks_compress():
    """compress=True: every saved tensor goes out zero-encoded and comes back bit for bit: the
    bf16 MLP (gradients bitwise as no hooks, fewer bytes out than raw), with and without host
    pacing and keep_last; then payloads of every element size (bool, uint8, int16, bf16, fp16,
    float32, int32, float64, int64) with -0.0, NaN and inf, all zeros, no zeros, a transposed
    (dense, not contiguous) tensor and a size that is not a multiple of 32."""
    layers, width, batch, steps, act = SWAP_LAYERS, SWAP_WIDTH, SWAP_BATCH, SWAP_STEPS, SWAP_ACT
    base_losses, base_grads = train_mlp(None, steps, layers, width, batch, False)
    for explicit, host, max_out, keep in ((True, False, 0, 0), (False, True, act, 0), (False, True, 0, 0),
                                          (True, True, 2 * act, 1)):
        scope = wm_torch.SwapScope(0, 16 * act)
        losses, grads = train_mlp(
            lambda model: wm_torch.SwapHooks(scope, skip=model, mode="direct", max_outstanding_bytes=max_out,
                                             stage_bytes=act, keep_last=keep, compress=True, host_pacing=host),
            steps, layers, width, batch, explicit)
        st = scope.statistics()
        same_loss = all(torch.equal(a, b) for a, b in zip(losses, base_losses))
        same_grad = all(torch.equal(a, b) for ga, gb in zip(grads, base_grads) for a, b in zip(ga, gb))
        copies = steps * (layers + 2)
        sent = copies - steps * keep
        ratio = st["encoded_bytes"] / max(st["encoded_raw_bytes"], 1)
        check(f"swap hooks compress: bf16 MLP bitwise ({'explicit' if explicit else 'automatic'} prefetch_all, "
              f"{'host' if host else 'stream'} pacing, out <= {max_out // act} act, keep_last {keep})",
              same_loss and same_grad and st["encoded"] == sent and st["pageouts_from"] == sent
              and st["bytes_out"] == st["encoded_bytes"] and 0.3 < ratio < 0.9 and st["live_buffers"] == 0
              # the hooks' host waits have their own key; host_wait_seconds stays the scope's syncs
              and (st["hooks_host_wait_seconds"] > 0) == (st["host_waits"] > 0)
              and (st["host_blocking_syncs"] > 0 or st["host_wait_seconds"] == 0),
              f"losses {[round(float(v), 5) for v in losses]}, {st['encoded']} encoded of {sent} paged out, "
              f"{st['encoded_bytes'] >> 20} of {st['encoded_raw_bytes'] >> 20} MiB ({ratio:.3f}), "
              f"{st['bytes_out'] >> 20} MiB out, {st['host_waits']} host waits "
              f"({st['hooks_host_wait_seconds']:.4f} s; scope: {st['host_blocking_syncs']} syncs, "
              f"{st['host_wait_seconds']:.4f} s), {st['live_buffers']} alive after")

    for kw in ({"compress": True}, {"host_pacing": True}):
        try:
            wm_torch.SwapHooks(wm_torch.SwapScope(act, 16 * act), mode="pool", **kw)
            check(f"swap hooks: mode='pool' with {kw} raises ValueError", False, "no exception")
        except ValueError as e:
            check(f"swap hooks: mode='pool' with {kw} raises ValueError", True, str(e))

    g = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))
    n = (1 << 20) + 37  # over min_bytes for 1-byte elements, not a multiple of 32
    cases = [(dt, z) for dt in (torch.bool, torch.uint8, torch.int16, torch.bfloat16, torch.float16, torch.float32,
                                torch.int32, torch.float64, torch.int64) for z in (0.5,)]
    cases += [(torch.bfloat16, 0.0), (torch.bfloat16, 1.0), (torch.float32, 0.9), ("transposed", 0.5)]
    for dt, z in cases:
        if dt == "transposed":
            payload = _payload(torch.bfloat16, 1031 * 1029, z, g).view(1031, 1029).t()  # dense, strides (1, 1029)
        else:
            payload = _payload(dt, n, z, g)
        want = payload.clone()
        scope = wm_torch.SwapScope(0, 8 * payload.numel() * payload.element_size() + (1 << 20))
        hooks = wm_torch.SwapHooks(scope, mode="direct", compress=True, host_pacing=True)
        x = torch.ones(4, device=DEV, requires_grad=True)
        _Probe.seen.clear()
        with hooks:
            y = _Probe.apply(x, payload)
        del payload  # not alive at the unpack: it must come back from the slab
        y.sum().backward()
        st = scope.statistics()
        got = _Probe.seen[0] if _Probe.seen else None
        ok = (got is not None and got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
              and torch.equal(_bits(got), _bits(want)) and st["encoded"] == 1 and st["reused_sources"] == 0)
        check(f"swap hooks compress: {dt} payload, {z:.0%} zeros, bit for bit",
              ok, f"{st['encoded']} encoded, {st['encoded_bytes']} of {st['encoded_raw_bytes']} bytes, "
                  f"{st['reused_sources']} returned as themselves")


def swap_peak(make_hooks):
    """Peak device bytes of SWAP_STEPS steps of the swap MLP above what the model and the input
    hold: the peak of torch's active bytes over the steps (allocated, plus freed blocks that wait
    for a record_stream event: memory the allocator cannot hand out yet; max_memory_allocated
    counts those as free), plus the scope's device pool (a cudaMalloc outside torch's allocator,
    for the scope's life)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_stats()["active_bytes.all.current"]
    pool = 0

    def hooks_of(model):
        nonlocal pool
        hooks = make_hooks(model)
        pool = hooks.scope.device_budget
        return hooks

    losses, _ = train_mlp(None if make_hooks is None else hooks_of, SWAP_STEPS, SWAP_LAYERS, SWAP_WIDTH, SWAP_BATCH,
                          make_hooks is not None)
    torch.cuda.synchronize()
    return torch.cuda.memory_stats()["active_bytes.all.peak"] - base + pool, losses


def test_swap_peak():
    """The direct mode with host pacing adds less to the peak than the pool mode: no pool for the
    scope's life, no copy of each activation in the forward pass, and the saved tensors' memory
    free for torch's allocator once their copies are done (the host waits for them)."""
    act = SWAP_ACT
    pool_peak, pool_losses = swap_peak(lambda m: wm_torch.SwapHooks(
        wm_torch.SwapScope(4 * act, 16 * act, prefetch_lookahead=2 * act), skip=m, mode="pool"))
    direct_peak, direct_losses = swap_peak(lambda m: wm_torch.SwapHooks(
        wm_torch.SwapScope(0, 16 * act), skip=m, mode="direct", max_outstanding_bytes=act, stage_bytes=act,
        host_pacing=True))
    same = all(torch.equal(a, b) for a, b in zip(pool_losses, direct_losses))
    check("swap hooks: the direct mode's peak (host pacing) is below the pool mode's (torch active peak + device pool)",
          direct_peak < pool_peak and same,
          f"direct {direct_peak / 2 ** 20:.1f} MiB, pool (4 activations) {pool_peak / 2 ** 20:.1f} MiB, "
          f"activation {act / 2 ** 20:.0f} MiB; losses {'equal' if same else 'DIFFERENT'}")
    # Against no hooks: the saved activations (6 ReLU outputs of 8 MiB, the float32 output) must
    # leave the peak, by torch's active bytes (a record_stream-ed block still copying counts).
    none_peak, none_losses = swap_peak(None)
    zc_peak, zc_losses = swap_peak(lambda m: wm_torch.SwapHooks(
        wm_torch.SwapScope(0, 16 * act), skip=m, mode="direct", stage_bytes=act, compress=True))
    same = all(torch.equal(a, b) for a, b in zip(none_losses, direct_losses)) and all(
        torch.equal(a, b) for a, b in zip(none_losses, zc_losses))
    check("swap hooks: the direct mode (host pacing, plain and compressed) lowers the active peak of no hooks by "
          "at least 2 activations",
          direct_peak <= none_peak - 2 * act and zc_peak <= none_peak - 2 * act and same,
          f"no hooks {none_peak / 2 ** 20:.1f} MiB, direct {direct_peak / 2 ** 20:.1f} MiB, compressed "
          f"{zc_peak / 2 ** 20:.1f} MiB, activation {act / 2 ** 20:.0f} MiB; losses {'equal' if same else 'DIFFERENT'}")


def test_swap_hooks():
    layers, width, batch, steps = SWAP_LAYERS, SWAP_WIDTH, SWAP_BATCH, SWAP_STEPS
    act = SWAP_ACT
    base_losses, base_grads = train_mlp(None, steps, layers, width, batch, False)
    for explicit in (True, False):
        # A pool of 3 activations for 8 saved buffers a step (the float32 output takes 2 of them).
        scope = wm_torch.SwapScope(3 * act, 16 * act, prefetch_lookahead=2 * act)
        losses, grads = train_mlp(lambda model: wm_torch.SwapHooks(scope, skip=model, mode="pool"), steps, layers,
                                  width, batch, explicit)
        st = scope.statistics()
        same_loss = all(torch.equal(a, b) for a, b in zip(losses, base_losses))
        same_grad = all(torch.equal(a, b) for ga, gb in zip(grads, base_grads) for a, b in zip(ga, gb))
        moved = st["bytes_out"] > 0 and st["bytes_in"] > 0
        # Per step: x_0 .. x_L and y.float() copied once each; the ReLU outputs x_1 .. x_{L-1} are
        # saved by their ReLU and again by the next Linear (shared, not copied twice); the weights
        # (W^T, saved by the Linears that need the gradient of their input) are skipped, or the
        # copies would count them.
        shared_ok = st["shared"] == steps * (layers - 1) and st["copies"] == steps * (layers + 2)
        check(f"swap hooks pool: bf16 MLP bitwise ({'explicit' if explicit else 'automatic'} prefetch_all)",
              same_loss and same_grad and moved and shared_ok and st["live_buffers"] == 0,
              f"losses {[round(float(v), 5) for v in losses]}, {st['copies']} copies, {st['shared']} shared, "
              f"{st['kept']} kept, {st['bytes_out'] >> 20} MiB out, {st['bytes_in'] >> 20} MiB in, "
              f"{st['prefetches']} prefetches, {st['passive_pageins']} passive page-ins, "
              f"{st['live_buffers']} buffers alive after the steps")


def test_swap_storage_reuse():
    """a_i = randn(n) saved by a_i * w, then freed: the caching allocator hands its block to
    a_{i+1} (same size, same stream), a tensor of the same shape and version at the same address.
    w.grad must be the sum of the a_i, not copies of a_0."""
    n = 1 << 19  # 2 MiB of float32

    def run(hooks):
        w = torch.ones(n, device=DEV, requires_grad=True)
        g = torch.Generator(device=DEV).manual_seed(5)
        total = torch.zeros((), device=DEV)
        ptrs = set()
        for _ in range(4):
            a = torch.randn(n, device=DEV, generator=g)
            ptrs.add(a.data_ptr())
            if hooks is None:
                total = total + (a * w).sum()
            else:
                with hooks:
                    total = total + (a * w).sum()
            del a
        total.backward()
        torch.cuda.synchronize()
        return w.grad.clone(), len(ptrs)

    ref, _ = run(None)
    for mode in ("pool", "direct"):
        scope = wm_torch.SwapScope(8 << 20 if mode == "pool" else 0, 64 << 20)
        got, distinct = run(wm_torch.SwapHooks(scope, mode=mode))
        st = scope.statistics()
        check(f"swap hooks {mode}: a freed storage reused by a new tensor is a new save",
              torch.equal(ref, got) and st["copies"] == 4 and st["shared"] == 0 and st["reused_sources"] == 0,
              f"{distinct} distinct address(es) for 4 tensors, {st['copies']} copies, {st['shared']} shared, "
              f"{st['reused_sources']} unpacked as the (freed) tensor itself")


def test_swap_no_room():
    for mode, scope in (("pool", wm_torch.SwapScope(1 << 20, 16 << 20)),  # a 1 MiB pool: 4 MiB cannot go in
                        ("direct", wm_torch.SwapScope(0, 1 << 20))):  # a 1 MiB slab
        w = torch.randn(1 << 20, device=DEV, requires_grad=True)
        a = torch.randn(1 << 20, device=DEV)
        with wm_torch.SwapHooks(scope, mode=mode):
            loss = (a * w).sum()
        loss.backward()
        st = scope.statistics()
        check(f"swap hooks {mode}: a tensor larger than the {mode if mode == 'pool' else 'slab'} is kept",
              torch.equal(w.grad, a) and st["kept_no_room"] == 1,
              f"{st['kept']} kept ({st['kept_no_room']} for want of room)")


# ---------------------------------------------------------------------------------------------
# 4. Bad input


def raises(fn, types):
    try:
        fn()
    except types as e:
        return str(e).splitlines()[0][:140]
    except Exception as e:  # the wrong kind of error
        return f"WRONG {type(e).__name__}: {e}"
    return None


def test_bad_input():
    emb = wm_torch.Embedding(100, 8, optimizer=wm_torch.SGD())
    t = emb._table
    k = torch.arange(10, device=DEV)
    cases = [
        ("CPU keys", lambda: emb(torch.arange(10)), ValueError),
        ("float keys", lambda: emb(torch.arange(10, device=DEV).float()), TypeError),
        ("keys not a tensor", lambda: emb([1, 2, 3]), TypeError),
        ("gather into a CPU tensor", lambda: t.gather(k, torch.empty(10, 8)), ValueError),
        ("gather into float64", lambda: t.gather(k, torch.empty(10, 8, device=DEV, dtype=torch.float64)), TypeError),
        ("gather into a tensor of the wrong size", lambda: t.gather(k, torch.empty(10, 7, device=DEV)), ValueError),
        ("int32 keys at the table", lambda: t.gather(k.int(), torch.empty(10, 8, device=DEV)), TypeError),
        ("non-contiguous keys", lambda: t.gather(torch.arange(20, device=DEV)[::2], torch.empty(10, 8, device=DEV)),
         ValueError),
        ("float64 gradients", lambda: t.apply_gradients(k, torch.zeros(10, 8, device=DEV, dtype=torch.float64), 0.1),
         TypeError),
        ("CPU gradients", lambda: t.apply_gradients(k, torch.zeros(10, 8), 0.1), ValueError),
        ("a key out of range", lambda: emb(torch.tensor([3, 100], device=DEV)), RuntimeError),
        ("an optimizer on a read-only cache",
         lambda: wm_torch.Embedding(100, 8, location="host", cache="read_only", optimizer=wm_torch.SGD()), ValueError),
        ("a cache on a device table", lambda: wm_torch.Embedding(100, 8, cache="read_write", optimizer=wm_torch.SGD()),
         ValueError),
        ("an optimizer step on a frozen table", lambda: wm_torch.EmbeddingOptimizer(
            [wm_torch.Embedding(100, 8, location="host", cache="read_only")], lr=0.1), ValueError),
    ]
    for name, fn, types in cases:
        msg = raises(fn, types)
        check(f"bad input raises {types.__name__}: {name}", msg is not None and not msg.startswith("WRONG"),
              msg or "did not raise")
    # The table still works after the errors.
    out = emb(k)
    check("the table works after the errors", torch.equal(out, emb.rows()[:10]))


# ---------------------------------------------------------------------------------------------
# 5. load_weights_ over cached rows on several ranks


def skip(name, reason):
    """A case that cannot run here: said, and counted neither passed nor failed."""
    print(f"SKIPPED {name}: {reason}", flush=True)


def rank_write_rows_over_dirty_lines(rank, world, seed):
    """One rank of the write-rows case (every rank runs it alike, with the same seed).

    A host table (block mapping: rank r owns rows [r * per, (r + 1) * per)) with a read-write
    device cache of ratio 1. Three training steps gather random keys (their owners admit them)
    and apply gradients to them. The rows no rank will write are gathered (their reference).
    A last step gathers and updates exactly the rows each rank will write, so that their owners'
    cache lines hold them dirty. Then each rank writes fresh values to half of the trained rows
    of the next rank (one rank: its own), in several load_weights_ calls. Every rank must then
    gather every row bitwise as written (or as before, for the others): right after the write,
    after a flush on every rank, after invalidate. The old write_rows emptied the writer's cache
    only: the owner served its dirty line instead of the new row, and its flush wrote the line
    over it."""
    rows, dim, lr = 4001, 16, 0.5
    per = (rows + world - 1) // world
    g = torch.Generator().manual_seed(seed)
    emb = wm_torch.Embedding(rows, dim, location="host", cache="read_write", cache_ratio=1.0,
                             optimizer=wm_torch.SGD(), init="uniform", init_a=-1.0, init_b=1.0,
                             seed=seed % 2**31)

    def step(keys, grads):  # collective: every rank gathers and updates its own batch
        k = keys.to(DEV)
        with torch.no_grad():
            emb(k)  # the owners admit the rows
        emb._table.apply_gradients(k, grads.to(DEV), lr)  # rows in lines: updated there, dirty

    trained = []
    for _ in range(3):  # every rank draws every rank's batch; each steps with its own
        batches = [torch.randint(0, rows, (1500,), generator=g) for _ in range(world)]
        grads = [torch.rand(1500, dim, generator=g) * 2 - 1 for _ in range(world)]
        step(batches[rank], grads[rank])
        trained += batches
    trained = torch.unique(torch.cat(trained))

    def writes_of(r):  # the rows rank r writes: half of the trained rows of the next rank
        o = trained[(trained // per) == (r + 1) % world]
        p = torch.randperm(o.numel(), generator=torch.Generator().manual_seed(seed + 7 + r))
        return o[p[: max(1, o.numel() // 2)]]

    mine = writes_of(rank)
    written = torch.zeros(rows, dtype=torch.bool)
    for r in range(world):
        written[writes_of(r)] = True
    others = torch.nonzero(~written).flatten()
    want = torch.empty(rows, dim)
    want[others] = emb.rows(others.to(DEV)).cpu()  # through the caches: the current rows
    step(mine, torch.rand(mine.numel(), dim, generator=torch.Generator().manual_seed(seed + 9 + rank)))
    values = torch.rand(rows, dim, generator=torch.Generator().manual_seed(seed + 11)) * 4 + 2  # in [2, 6)
    want[written] = values[written]
    emb.cache_stats(reset=True)
    emb.load_weights_(values[mine], keys=mine.to(DEV), chunk=97)  # several calls, more on some ranks
    write_backs = emb.cache_stats()["write_backs"]
    results = []

    def same(what):
        bad = (emb.rows().cpu() != want).any(dim=1)
        results.append((what, not bool(bad.any()),
                        f"{int(bad.sum())} of {rows} rows differ ({int((bad & written).sum())} of the "
                        f"{int(written.sum())} written, {int(mine.numel())} by this rank)"))

    same("every row gathered as written (or as before) after load_weights_")
    emb.flush()  # this rank's lines (admitted by that gather) go back to the table
    same("every row gathered as written after a flush")
    emb._table.invalidate()
    same("every row gathered as written after invalidate (lines flushed and emptied)")
    results.append(("the owners' caches held dirty lines when load_weights_ began", write_backs > 0,
                    f"{write_backs} lines written back on rank {rank}"))
    return results


RANK_CASES = {"write_rows": rank_write_rows_over_dirty_lines}


def rank_worker(case, rank, world, store, seed):
    """Runs one rank of a case; prints RESULT lines for the parent; exit 0 when all passed."""
    import torch.distributed as dist

    rank, world, seed = int(rank), int(world), int(seed)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    ok = True
    try:
        wm_torch.default_communicator()  # collective: every rank makes it first
        for what, passed, detail in RANK_CASES[case](rank, world, seed):
            ok &= bool(passed)
            print(f"RESULT {'PASS' if passed else 'FAIL'} rank {rank}: {what}: {detail}", flush=True)
    except Exception:
        traceback.print_exc()
        ok = False
    torch.cuda.synchronize()
    return 0 if ok else 1


def run_ranks(name, case, world, checks, timeout_s=600):
    """Runs `case` in `world` processes (rank r on GPU r); each must report `checks` results,
    all passed."""
    if torch.cuda.device_count() < world:
        skip(name, f"needs {world} GPUs, {torch.cuda.device_count()} visible")
        return
    seed = int.from_bytes(os.urandom(4), "little")
    env = dict(os.environ, WM_TIMEOUT_S="120")  # a rank that fails leaves the others waiting no longer
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        logs = [open(os.path.join(tmp, f"rank{r}.log"), "w+") for r in range(world)]  # no pipe to fill
        procs = [subprocess.Popen([sys.executable, __file__, "--rank-worker", case, str(r), str(world), store, str(seed)],
                                  stdout=logs[r], stderr=subprocess.STDOUT, text=True, env=env) for r in range(world)]
        deadline = time.time() + timeout_s
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        outs = []
        for r, f in enumerate(logs):
            f.seek(0)
            outs.append(f.read() + (f"\n(killed after {timeout_s} s)" if procs[r].returncode == -9 else ""))
            f.close()
    ok = all(p.returncode == 0 for p in procs)
    lines = [ln for out in outs for ln in out.splitlines() if ln.startswith("RESULT ")]
    for ln in lines:
        print(f"  {ln[len('RESULT '):]}", flush=True)
    if not ok or len(lines) != checks * world:
        for r, out in enumerate(outs):
            print(f"--- rank {r} (exit {procs[r].returncode}) ---\n{out}", flush=True)
    check(name, ok and len(lines) == checks * world and all(ln.startswith("RESULT PASS") for ln in lines),
          f"{world} rank(s), seed {seed}, {len(lines)} checks, exit codes {[p.returncode for p in procs]}")


def test_write_rows_ranks():
    run_ranks("load_weights_ over dirty cache lines, 1 rank: gathers see the written rows, also after a flush",
              "write_rows", 1, 4)
    run_ranks("load_weights_ over dirty cache lines of other ranks (2 ranks): every rank gathers the written rows, "
              "also after a flush", "write_rows", 2, 4)


def main():
    t0 = time.time()
    try:
        wm_torch.load()
    except Exception:
        traceback.print_exc()
        print("FAIL building the extension")
        print("0 passed, 1 failed")
        return 1
    print(f"extension ready in {time.time() - t0:.1f} s ({torch.cuda.get_device_name()}, torch {torch.__version__})",
          flush=True)
    for name, fn in (("forward", test_forward), ("training", test_training), ("swap hooks", test_swap_hooks),
                     ("swap hooks direct", test_swap_hooks_direct), ("swap hooks compress", test_swap_hooks_compress),
                     ("swap peak", test_swap_peak),
                     ("swap storage reuse", test_swap_storage_reuse), ("swap no room", test_swap_no_room),
                     ("bad input", test_bad_input), ("write_rows on ranks", test_write_rows_ranks)):
        run_case(name, fn)
    passed = sum(results)
    failed = len(results) - passed
    print(f"{passed} passed, {failed} failed  ({time.time() - t0:.1f} s)")
    return 0 if failed == 0 and passed > 0 else 1


if __name__ == "__main__":
    sys.exit(rank_worker(*WORKER) if WORKER is not None else main())
