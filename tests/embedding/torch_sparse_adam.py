# SPDX-License-Identifier: Apache-2.0
"""wm's Adam against PyTorch's on the same data (GPU machine only).

1. Global-step Adam with SparseAdam's epsilon against torch.optim.SparseAdam: random batches
   with many duplicate keys (rows absent from a batch keep their moments).
2. wm::adam with torch's epsilon against torch.optim.Adam (no decay; L2 decay) and
   torch.optim.AdamW (decoupled decay): every batch holds every row once (so lazy Adam is
   dense Adam and per-row steps are the global step), gradients from 1e-6 to 1 in size (where
   the placement of epsilon shows: at step 1, g = 1e-6 moves a weight by 0.990 lr in torch's
   form and by 0.760 lr in SparseAdam's).

Usage: python3 torch_sparse_adam.py PATH_TO_sparse_adam_check
Exit codes: 0 match, 1 mismatch or failure, 77 skipped (no torch, no CUDA).
"""
import os
import subprocess
import sys
import tempfile

for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(k, v)

try:
    import numpy as np
    import torch
except ImportError as e:
    print(f"SKIPPED: {e}")
    sys.exit(77)
if not torch.cuda.is_available():
    print("SKIPPED: no CUDA device")
    sys.exit(77)

ROWS, DIM, STEPS, BATCH = 5000, 24, 6, 4000
LR, B1, B2, EPS = 0.01, 0.9, 0.999, 1e-8
WD = 0.1  # large enough that the decay shows against the tolerance


class Skipped(Exception):
    pass


def run_wm(binary, w0, batches, mode, wd, bias):
    """Runs the check program on the data; returns its weights."""
    rows, dim = w0.shape
    with tempfile.TemporaryDirectory(prefix="wm-adam-") as d:
        w0.tofile(os.path.join(d, "weights.bin"))
        for k, (keys, grads) in enumerate(batches):
            keys.tofile(os.path.join(d, f"keys{k}.bin"))
            grads.tofile(os.path.join(d, f"grads{k}.bin"))
        with open(os.path.join(d, "meta.txt"), "w") as f:
            f.write(f"{rows} {dim} {len(batches)} {LR} {B1} {B2} {EPS} {mode} {wd} {bias}\n")
        r = subprocess.run([binary, d], capture_output=True, text=True)
        if r.returncode == 77:
            raise Skipped()
        if r.returncode != 0:
            print(r.stdout, r.stderr)
            raise RuntimeError(f"{binary} failed with exit code {r.returncode}")
        return np.fromfile(os.path.join(d, "wm_result.bin"), dtype=np.float32).reshape(rows, dim)


def run_torch(w0, batches, make_opt, sparse):
    rows, dim = w0.shape
    emb = torch.nn.Embedding(rows, dim, sparse=sparse, device="cuda")
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(w0))
    opt = make_opt(emb.parameters())
    for keys, grads in batches:
        opt.zero_grad()
        out = emb(torch.from_numpy(keys).cuda())
        out.backward(torch.from_numpy(grads).cuda())
        opt.step()
    return emb.weight.detach().cpu().numpy()


def compare(name, ours, ref, w0):
    err = np.abs(ours - ref)
    tol = 1e-5 * np.maximum(np.abs(ref), 0.5)
    bad = int((err > tol).sum())
    moved = float(np.abs(ref - w0).max())
    print(f"wm vs {name}: max abs diff {err.max():.3e} (weights moved up to {moved:.3e}), {bad} of {err.size} values off")
    return bad == 0 and moved > 1e-3


def sparse_batches(rng):
    batches = []
    for _ in range(STEPS):
        hot = rng.integers(0, 20, size=BATCH // 4)  # many duplicates
        cold = rng.integers(0, ROWS, size=BATCH - BATCH // 4)
        keys = rng.permutation(np.concatenate([hot, cold])).astype(np.int64)
        grads = rng.uniform(-1, 1, size=(BATCH, DIM)).astype(np.float32)
        batches.append((keys, grads))
    return batches


def dense_batches(rng):
    """Every row once per batch; gradient sizes log-uniform in [1e-6, 1], random signs; the
    first 50 rows get exactly +-1e-6 in every element (the documented step-1 case)."""
    batches = []
    for _ in range(STEPS):
        keys = rng.permutation(ROWS).astype(np.int64)
        size = 10.0 ** rng.uniform(-6, 0, size=(ROWS, DIM))
        sign = np.where(rng.random((ROWS, DIM)) < 0.5, -1.0, 1.0)
        grads = (sign * size).astype(np.float32)
        tiny = keys < 50
        grads[tiny] = (sign[tiny] * 1e-6).astype(np.float32)
        batches.append((keys, grads))
    return batches


def main(binary):
    rng = np.random.default_rng()
    w0 = rng.uniform(-0.5, 0.5, size=(ROWS, DIM)).astype(np.float32)
    ok = True
    try:
        b = sparse_batches(rng)
        ours = run_wm(binary, w0, b, "sparse_adam", 0.0, "global_step")
        ref = run_torch(w0, b, lambda p: torch.optim.SparseAdam(p, lr=LR, betas=(B1, B2), eps=EPS), sparse=True)
        ok &= compare("torch.optim.SparseAdam", ours, ref, w0)

        d = dense_batches(rng)
        cases = [
            ("torch.optim.Adam", "adam", 0.0, "per_row",
             lambda p: torch.optim.Adam(p, lr=LR, betas=(B1, B2), eps=EPS)),
            ("torch.optim.Adam(weight_decay)", "adam", WD, "global_step",
             lambda p: torch.optim.Adam(p, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)),
            ("torch.optim.AdamW(weight_decay)", "adamw", WD, "per_row",
             lambda p: torch.optim.AdamW(p, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)),
        ]
        for name, mode, wd, bias, make in cases:
            ours = run_wm(binary, w0, d, mode, wd, bias)
            ref = run_torch(w0, d, make, sparse=False)
            ok &= compare(name, ours, ref, w0)
        # The placement of epsilon is what these cases see: SparseAdam's form on the same
        # dense data must be far off torch.optim.Adam on the rows with 1e-6 gradients.
        other = run_wm(binary, w0, d, "sparse_adam", 0.0, "global_step")
        ref = run_torch(w0, d, cases[0][4], sparse=False)
        gap = float(np.abs(other - ref)[:50].max())  # rows 0..49: gradients of +-1e-6
        print(f"SparseAdam's epsilon on the same data: {gap:.3e} off torch.optim.Adam on the 1e-6 rows (expected > 1e-4)")
        ok &= gap > 1e-4
    except Skipped:
        print("SKIPPED: the check program found no GPU")
        return 77
    except RuntimeError as e:
        print(e)
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
