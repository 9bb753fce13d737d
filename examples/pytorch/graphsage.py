# SPDX-License-Identifier: Apache-2.0
"""GraphSAGE (PyTorch Geometric) with the node features in a wm host table behind a device cache.

What it teaches:
  - A feature store that does not have to fit the GPU: the features of every node live in a
    `wm_torch.Embedding(..., location="host", cache="read_only")`, i.e. a wm::embedding<float,
    wm::device_cache<wm::read_only, wm::lfu>, wm::no_optimizer, wm::host> (pinned host table, each
    GPU caches the rows it reads most; read-only: features are not trained, and wm refuses an
    optimizer on a read-only cache at compile time). A mini-batch's features are one gather of
    its sampled nodes: hits come from device memory, misses from the host table (each distinct
    row read once), and the cache admits them.
  - Mini-batch neighbour sampling written in torch ops on the GPU (PyG's NeighborLoader needs
    pyg-lib or torch-sparse): CSR (rowptr, col); a node n's k-th sample is
    col[rowptr[n] + floor(rand * deg[n])] (uniform with replacement); the sampled nodes are
    renumbered with torch.unique, and SAGEConv runs on the sampled edges.
  - `--features cuda` keeps the same features in a plain CUDA tensor instead; with the same seed
    both runs draw the same batches (sampling uses its own generator, the feature store none), and
    with deterministic algorithms on (default) the loss curves agree bitwise. `--compare` runs
    both and prints both curves and their largest difference.

The graph: N nodes with C planted classes; edges (N * avg_degree / 2, made undirected) start at a
power-law node (hubs: a few nodes take many edges, which is what makes a cache pay) and end, with
probability `homophily`, at a random node of the same class, else anywhere. A node's features are
its class's mean plus Gaussian noise: its own features say something about its class, its
neighbours' (mostly of its class) say more, so the loss falls well below log(C).

Run (one GPU):  python3 examples/pytorch/graphsage.py [--nodes 3000000] [--steps 200] [--compare]
The first run builds the extension (see README.md). Exit status 1 if the loss did not fall (or,
with --compare, if the curves differ by more than --tolerance).
"""
import argparse
import math
import os
import pathlib
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (before CUDA init)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import wm_torch  # noqa: E402


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=3_000_000)
    ap.add_argument("--avg-degree", type=int, default=10)
    ap.add_argument("--classes", type=int, default=16)
    ap.add_argument("--homophily", type=float, default=0.8)
    ap.add_argument("--feat-dim", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--fanout", default="10,5")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--cache-ratio", type=float, default=0.1)
    ap.add_argument("--features", choices=["wm", "cuda"], default="wm")
    ap.add_argument("--compare", action="store_true", help="run with wm features and with CUDA features")
    ap.add_argument("--tolerance", type=float, default=1e-4,
                    help="--compare: largest allowed loss difference (0 expected with deterministic algorithms)")
    ap.add_argument("--no-deterministic", action="store_true",
                    help="leave torch's nondeterministic scatter kernels on (the curves then differ slightly)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--print-every", type=int, default=20)
    return ap.parse_args()


# ---------------------------------------------------------------------------------------------
# The graph, its labels and its features (all made on the GPU from one seed)


class Graph:
    def __init__(self, a, dev):
        t0 = time.time()
        n, c = a.nodes, a.classes
        g = torch.Generator(device=dev).manual_seed(a.seed)
        self.labels = torch.randint(0, c, (n,), device=dev, generator=g)
        # Nodes grouped by class: class k's nodes are by_class[start[k] : start[k] + count[k]].
        by_class = torch.argsort(self.labels)
        count = torch.bincount(self.labels, minlength=c)
        start = torch.cumsum(count, 0) - count
        e = n * a.avg_degree // 2
        perm = torch.randperm(n, device=dev, generator=g)  # hubs spread over the ids
        u = torch.rand(e, device=dev, generator=g)
        src = perm[(n * u.pow(2.5)).long().clamp_(max=n - 1)]  # power law: P(rank < r) = (r/n)^0.4
        same = torch.rand(e, device=dev, generator=g) < a.homophily
        k = self.labels[src]
        pick = start[k] + (torch.rand(e, device=dev, generator=g) * count[k]).long()
        dst = torch.where(same, by_class[pick.clamp_(max=n - 1)], torch.randint(0, n, (e,), device=dev, generator=g))
        del u, same, k, pick, perm
        row = torch.cat([src, dst])
        col = torch.cat([dst, src])
        del src, dst
        order = torch.argsort(row)
        self.col = col[order]
        self.deg = torch.bincount(row, minlength=n)
        self.rowptr = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), torch.cumsum(self.deg, 0)])
        del row, col, order
        self.n, self.edges = n, self.col.numel()
        self.feature_gen_seed = a.seed + 1
        # Class means: small against the unit noise, so one node's features are a weak hint.
        gm = torch.Generator(device=dev).manual_seed(a.seed + 2)
        self.means = 0.12 * torch.randn(c, a.feat_dim, device=dev, generator=gm)
        torch.cuda.synchronize()
        self.seconds = time.time() - t0

    def feature_chunks(self, dim, chunk=1 << 20):
        """(first node, features) in order; the same values on every call."""
        dev = self.labels.device
        g = torch.Generator(device=dev).manual_seed(self.feature_gen_seed)
        for lo in range(0, self.n, chunk):
            hi = min(lo + chunk, self.n)
            yield lo, self.means[self.labels[lo:hi]] + torch.randn(hi - lo, dim, device=dev, generator=g)


def sample(graph, seeds, fanouts, gen):
    """Two-hop (or more) uniform sampling with replacement. Returns the sampled nodes (sorted,
    unique), the edges (source -> target) in local ids, and the seeds' local ids."""
    frontier = seeds
    layers = [seeds]
    for f in fanouts:
        d = graph.deg[frontier]
        r = torch.rand(frontier.numel(), f, device=seeds.device, generator=gen)
        idx = graph.rowptr[frontier].unsqueeze(1) + (r * d.unsqueeze(1)).long()
        nbr = graph.col[idx.clamp_(max=graph.edges - 1)]
        nbr = torch.where(d.unsqueeze(1) > 0, nbr, frontier.unsqueeze(1))  # isolated: itself
        layers.append(nbr.reshape(-1))
        frontier = layers[-1]
    nodes, inv = torch.unique(torch.cat(layers), return_inverse=True)
    offs = [0]
    for part in layers:
        offs.append(offs[-1] + part.numel())
    srcs, dsts = [], []
    for h, f in enumerate(fanouts):
        dst_local = inv[offs[h]:offs[h + 1]].repeat_interleave(f)
        src_local = inv[offs[h + 1]:offs[h + 2]]
        srcs.append(src_local)
        dsts.append(dst_local)
    edge_index = torch.stack([torch.cat(srcs), torch.cat(dsts)])
    return nodes, edge_index, inv[:seeds.numel()]


# ---------------------------------------------------------------------------------------------
# Feature stores


class WmFeatures:
    """Node features in a host wm table with a read-only device cache."""

    def __init__(self, graph, dim, ratio):
        t0 = time.time()
        self.table = wm_torch.Embedding(graph.n, dim, location="host", cache="read_only", cache_ratio=ratio,
                                        optimizer=None, init="zeros")
        for lo, x in graph.feature_chunks(dim):
            self.table.load_weights_(x, keys=torch.arange(lo, lo + x.shape[0], device=x.device))
        torch.cuda.synchronize()
        self.seconds = time.time() - t0
        self.name = f"wm host table + read-only device cache ({self.table.cache_lines} lines, ratio {ratio})"
        self.table.cache_stats(reset=True)

    def __call__(self, nodes):
        return self.table(nodes)

    def report(self):
        s = self.table.cache_stats()
        hit = s["hits"] / max(s["requests"], 1)
        return (f"cache: {s['requests']} requests, hit rate {hit:.3f}, {s['distinct_keys']} distinct keys per batch summed, "
                f"{s['evictions']} evictions, {s['bytes_from_host'] / 1e9:.2f} GB read from the host table")


class CudaFeatures:
    """The same features in a plain CUDA tensor."""

    def __init__(self, graph, dim):
        t0 = time.time()
        self.x = torch.empty(graph.n, dim, device=graph.labels.device)
        for lo, x in graph.feature_chunks(dim):
            self.x[lo:lo + x.shape[0]] = x
        torch.cuda.synchronize()
        self.seconds = time.time() - t0
        self.name = "CUDA tensor"

    def __call__(self, nodes):
        return self.x[nodes]

    def report(self):
        return ""


# ---------------------------------------------------------------------------------------------
# Training


class SAGE(torch.nn.Module):
    def __init__(self, dim, hidden, classes):
        super().__init__()
        from torch_geometric.nn import SAGEConv

        self.conv1 = SAGEConv(dim, hidden)
        self.conv2 = SAGEConv(hidden, classes)

    def forward(self, x, edge_index):
        return self.conv2(F.relu(self.conv1(x, edge_index)), edge_index)


def train(a, graph, store):
    dev = graph.labels.device
    torch.manual_seed(a.seed + 3)
    model = SAGE(a.feat_dim, a.hidden, a.classes).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    gen = torch.Generator(device=dev).manual_seed(a.seed + 4)  # batches and samples
    fanouts = [int(f) for f in a.fanout.split(",")]
    losses, correct, seen, sampled = [], 0, 0, 0
    torch.cuda.synchronize()
    t0 = time.time()
    for step in range(a.steps):
        seeds = torch.randint(0, graph.n, (a.batch,), device=dev, generator=gen)
        nodes, edge_index, seed_local = sample(graph, seeds, fanouts, gen)
        x = store(nodes)  # the feature store's gather
        out = model(x, edge_index)[seed_local]
        # Cross entropy without nll_loss (no deterministic CUDA kernel for it).
        logp = F.log_softmax(out, dim=1)
        loss = -logp.gather(1, graph.labels[seeds].unsqueeze(1)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        if step >= a.steps - 20:
            correct += int((out.argmax(1) == graph.labels[seeds]).sum())
            seen += a.batch
        sampled += nodes.numel()
        if a.print_every and (step % a.print_every == 0 or step == a.steps - 1):
            print(f"  [{a.features}] step {step:4d}  loss {float(losses[-1]):.4f}  sampled nodes {nodes.numel()}", flush=True)
    torch.cuda.synchronize()
    secs = time.time() - t0
    return [float(v) for v in losses], correct / max(seen, 1), secs, sampled / a.steps


def run(a, graph, which):
    a.features = which
    store = WmFeatures(graph, a.feat_dim, a.cache_ratio) if which == "wm" else CudaFeatures(graph, a.feat_dim)
    print(f"[{which}] features: {store.name}, {graph.n} x {a.feat_dim} float32 "
          f"({graph.n * a.feat_dim * 4 / 2**30:.2f} GiB) filled in {store.seconds:.1f} s", flush=True)
    losses, acc, secs, avg_nodes = train(a, graph, store)
    print(f"[{which}] {a.steps} steps in {secs:.1f} s ({1e3 * secs / a.steps:.1f} ms/step, {avg_nodes:.0f} sampled nodes "
          f"per batch); training accuracy over the last 20 batches {acc:.3f}")
    rep = store.report()
    if rep:
        print(f"[{which}] {rep}")
    del store
    torch.cuda.empty_cache()
    return losses


def fell(losses, classes):
    k = max(1, min(20, len(losses) // 5))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    return first, last, last < 0.8 * first and last < 0.9 * math.log(classes)


def main():
    a = parse()
    if not torch.cuda.is_available():
        print("graphsage: no GPU found, nothing to run")
        return 0
    if not a.no_deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    dev = torch.device("cuda", torch.cuda.current_device())
    wm_torch.load()
    graph = Graph(a, dev)
    print(f"graph: {graph.n} nodes, {graph.edges} directed edges, max degree {int(graph.deg.max())}, "
          f"{int((graph.deg == 0).sum())} isolated; made in {graph.seconds:.1f} s on {torch.cuda.get_device_name()}",
          flush=True)
    runs = ["wm", "cuda"] if a.compare else [a.features]
    curves = {w: run(a, graph, w) for w in runs}
    ok = True
    for w, c in curves.items():
        first, last, good = fell(c, a.classes)
        print(f"[{w}] loss {first:.4f} (first batches) -> {last:.4f} (last batches), log(C) = {math.log(a.classes):.4f}: "
              f"{'falls' if good else 'DOES NOT FALL'}")
        ok &= good
    if a.compare:
        wmc, cuc = curves["wm"], curves["cuda"]
        print("step  loss (wm features)  loss (CUDA features)")
        for i in range(0, len(wmc), max(1, a.print_every // 2)):
            print(f"{i:4d}  {wmc[i]:.6f}            {cuc[i]:.6f}")
        diff = max(abs(x - y) for x, y in zip(wmc, cuc))
        print(f"largest loss difference over {len(wmc)} steps: {diff:.3e} (tolerance {a.tolerance:.0e})")
        ok &= diff <= a.tolerance
    print("graphsage: OK" if ok else "graphsage: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
