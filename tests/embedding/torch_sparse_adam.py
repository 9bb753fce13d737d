"""wm's global-step Adam against torch.optim.SparseAdam on the same data (GPU machine only).

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


def main(binary):
    rng = np.random.default_rng()
    with tempfile.TemporaryDirectory(prefix="wm-sparse-adam-") as d:
        w0 = rng.uniform(-0.5, 0.5, size=(ROWS, DIM)).astype(np.float32)
        w0.tofile(os.path.join(d, "weights.bin"))
        batches = []
        for k in range(STEPS):
            hot = rng.integers(0, 20, size=BATCH // 4)            # many duplicates
            cold = rng.integers(0, ROWS, size=BATCH - BATCH // 4)
            keys = rng.permutation(np.concatenate([hot, cold])).astype(np.int64)
            grads = rng.uniform(-1, 1, size=(BATCH, DIM)).astype(np.float32)
            keys.tofile(os.path.join(d, f"keys{k}.bin"))
            grads.tofile(os.path.join(d, f"grads{k}.bin"))
            batches.append((keys, grads))
        with open(os.path.join(d, "meta.txt"), "w") as f:
            f.write(f"{ROWS} {DIM} {STEPS} {LR} {B1} {B2} {EPS}\n")
        r = subprocess.run([binary, d], capture_output=True, text=True)
        if r.returncode == 77:
            print("SKIPPED: the check program found no GPU")
            return 77
        if r.returncode != 0:
            print(r.stdout, r.stderr)
            return 1
        ours = np.fromfile(os.path.join(d, "wm_result.bin"), dtype=np.float32).reshape(ROWS, DIM)

    emb = torch.nn.Embedding(ROWS, DIM, sparse=True, device="cuda")
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(w0))
    opt = torch.optim.SparseAdam(emb.parameters(), lr=LR, betas=(B1, B2), eps=EPS)
    for keys, grads in batches:
        opt.zero_grad()
        out = emb(torch.from_numpy(keys).cuda())
        out.backward(torch.from_numpy(grads).cuda())
        opt.step()
    ref = emb.weight.detach().cpu().numpy()
    err = np.abs(ours - ref)
    tol = 1e-5 * np.maximum(np.abs(ref), 0.5)
    bad = int((err > tol).sum())
    print(f"wm vs torch.optim.SparseAdam: max abs diff {err.max():.3e}, {bad} of {err.size} values off")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
