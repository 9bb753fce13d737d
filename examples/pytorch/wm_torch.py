# SPDX-License-Identifier: Apache-2.0
"""wm_torch: wm's tables, communicators and swap scopes inside a PyTorch training loop.

A tutorial module (see README.md beside it): `load()` builds the extension (wm_torch.cpp and the
table units) with torch.utils.cpp_extension against the source tree's include/ and returns it;
the classes below wrap it the way a PyTorch user expects.

- `Communicator()`: the rank group of torch.distributed (rank 0 makes the wm unique id, every
  rank gets it through broadcast_object_list); without torch.distributed, a group of one.
- `Embedding(rows, dim, ...)`: a torch.nn.Module around a wm::embedding<float, ...>. Forward is
  the gather (keys of any shape -> keys.shape + (dim,)); backward gives the table no .grad but
  hands keys and gradients to `EmbeddingOptimizer`, whose `step()` calls apply_gradients (each
  touched row updated once, duplicate keys summed) and `zero_grad()` drops them.
- `SwapScope(...)` and `SwapHooks(scope, skip=model)`: saved_tensors_hooks whose pack pages a
  saved CUDA tensor out to the scope's pinned slab straight from the tensor's memory (mode
  "direct", the default; mode "pool" copies it into the scope's device pool first), and whose
  unpack returns it on the device again. Call `hooks.prefetch_all()` (or let the first unpack do
  it) between forward and backward.

CUDA tensors cross by data pointer and torch.cuda.current_stream(); nothing is copied.
"""
import os
import pathlib
import threading

import torch

_HERE = pathlib.Path(__file__).resolve().parent
_REPO = _HERE.parent.parent
_ext = None
_lock = threading.Lock()

_SOURCES = ["wm_torch.cpp", "wm_torch_tables_device.cu", "wm_torch_tables_host.cu", "wm_torch_codec.cu"]


def _torch_nccl():
    """The nvidia-nccl wheel torch depends on: (include dir, lib dir), or None."""
    try:
        import nvidia.nccl  # noqa: F401
    except ImportError:
        return None
    for base in nvidia.nccl.__path__:
        base = pathlib.Path(base)
        if (base / "lib" / "libnccl.so.2").exists() and (base / "include" / "nccl.h").exists():
            return base / "include", base / "lib"
    return None


def _nccl_flags():
    """Compile and link against the NCCL that torch loads (the nvidia-nccl wheel) when there is
    one, so that the process holds one NCCL whose header is the one wm was compiled with; else
    the toolkit's or the system's nccl.h and -lnccl."""
    found = _torch_nccl()
    if found is None:
        return [], ["-lnccl"]
    inc, lib = found
    return [str(inc)], [f"-L{lib}", "-l:libnccl.so.2", f"-Wl,-rpath,{lib}"]


def build_flags(arch=None):
    """The nvcc flags of the extension: those of the repository's CMake build for CUDA (C++20,
    --expt-relaxed-constexpr, -O3, sm_90 unless WM_TORCH_ARCH says otherwise), plus the undoing
    of torch's __CUDA_NO_HALF*__ defines (wm's headers use half and bfloat16 operators)."""
    arch = arch or os.environ.get("WM_TORCH_ARCH", "90")
    return [
        "-O3", "-DNDEBUG", "-std=c++20", "--expt-relaxed-constexpr",
        f"-gencode=arch=compute_{arch},code=sm_{arch}",
        "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
        "-Xcudafe", "--diag_suppress=3189",  # torch's headers use `module` as a name (C++20)
    ]


def host_flags():
    """The host compiler's flags for wm_torch.cpp, the bindings: C++20, -O3, and libcu++'s headers
    (cuda/stream_ref), which nvcc finds by itself under the toolkit's include/cccl.

    The bindings (pybind11, torch's headers, the checks that raise Python errors) are compiled
    by the host compiler alone, as a CPU extension of torch is, not by nvcc: they hold no device
    code (the table units hold the kernels)."""
    from torch.utils import cpp_extension

    flags = ["-O3", "-DNDEBUG", "-std=c++20"]
    if cpp_extension.CUDA_HOME is not None:
        cccl = pathlib.Path(cpp_extension.CUDA_HOME) / "include" / "cccl"
        if cccl.is_dir():
            flags.append(f"-isystem{cccl}")
    return flags


def load(build_dir=None, verbose=None):
    """Builds (once; later calls reuse the build directory) and imports the extension.

    build_dir: WM_TORCH_BUILD_DIR, else <repo>/build/wm_torch. The wm headers come from
    WM_INCLUDE_DIR, else the source tree's include/. MAX_JOBS bounds ninja's parallel jobs.
    """
    global _ext
    with _lock:
        if _ext is not None:
            return _ext
        from torch.utils import cpp_extension

        build_dir = pathlib.Path(build_dir or os.environ.get("WM_TORCH_BUILD_DIR")
                                 or _REPO / "build" / "wm_torch")
        build_dir.mkdir(parents=True, exist_ok=True)
        include = pathlib.Path(os.environ.get("WM_INCLUDE_DIR", _REPO / "include"))
        if not (include / "wm" / "wm.cuh").exists():
            raise FileNotFoundError(f"wm_torch: no wm headers under {include} (set WM_INCLUDE_DIR)")
        if verbose is None:
            verbose = os.environ.get("WM_TORCH_VERBOSE", "0") == "1"
        nccl_include, nccl_link = _nccl_flags()
        _ext = cpp_extension.load(
            name="wm_torch_ext",
            sources=[str(_HERE / s) for s in _SOURCES],
            extra_include_paths=[str(include), str(_HERE)] + nccl_include,
            extra_cflags=host_flags(),
            extra_cuda_cflags=build_flags(),
            extra_ldflags=nccl_link,
            build_directory=str(build_dir),
            verbose=verbose,
            with_cuda=True,
        )
        return _ext


def _device_of(comm):
    return torch.device("cuda", comm.device)


# ---------------------------------------------------------------------------------------------
# Communicator


class Communicator:
    """A wm::communicator over the ranks of torch.distributed (or of `group`).

    Collective: every rank constructs it, after torch.cuda.set_device(local GPU). Rank 0 of the
    group creates the wm unique id; broadcast_object_list carries it to the others. Without an
    initialized torch.distributed it is a group of one on the current GPU.
    """

    def __init__(self, group=None):
        ext = load()
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank(group)
            size = dist.get_world_size(group)
            src = dist.get_global_rank(group, 0) if group is not None else 0
            box = [ext.create_unique_id() if rank == 0 else None]
            dist.broadcast_object_list(box, src=src, group=group)
            uid = box[0]
        else:
            rank, size, uid = 0, 1, ext.create_unique_id()
        self._c = ext.Communicator(uid, rank, size)

    rank = property(lambda self: self._c.rank)
    size = property(lambda self: self._c.size)
    device = property(lambda self: torch.device("cuda", self._c.device))
    local_rank = property(lambda self: self._c.local_rank)

    def barrier(self):
        self._c.barrier()

    def all_gather_int(self, value):
        """Every rank's int, in rank order (collective)."""
        return list(self._c.all_gather_int(int(value)))


_default_comm = None


def default_communicator():
    """One Communicator per process, made on first use (collective on first use)."""
    global _default_comm
    if _default_comm is None:
        _default_comm = Communicator()
    return _default_comm


# ---------------------------------------------------------------------------------------------
# Embedding tables


class SGD:
    """Sparse SGD of a wm table: w -= lr (g + weight_decay w) on the rows of a batch."""

    name = "sgd"

    def __init__(self, weight_decay=0.0):
        self.weight_decay = weight_decay

    def fill(self, o):
        o.optimizer = "sgd"
        o.weight_decay = float(self.weight_decay)


class Adam:
    """Adam of a wm table on the rows of a batch (lazy: rows absent keep their moments).

    global_step=False: each row counts its own steps (lazy Adam); True: one count for the table.
    sparse_adam_epsilon: eps added to sqrt(v) before the bias correction (SparseAdam, TF) instead
    of after it (torch.optim.Adam). decoupled: AdamW's decay. See include/wm/optimizer.hpp.
    """

    name = "adam"

    def __init__(self, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=False,
                 global_step=False, sparse_adam_epsilon=False):
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        self.decoupled, self.global_step, self.sparse_adam_epsilon = decoupled, global_step, sparse_adam_epsilon

    def fill(self, o):
        o.optimizer = "adam"
        o.beta1, o.beta2 = float(self.betas[0]), float(self.betas[1])
        o.eps, o.weight_decay = float(self.eps), float(self.weight_decay)
        o.decoupled, o.global_step = bool(self.decoupled), bool(self.global_step)
        o.sparse_adam_epsilon = bool(self.sparse_adam_epsilon)


def SparseAdam(betas=(0.9, 0.999), eps=1e-8):
    """The semantics of torch.optim.SparseAdam: one step count, SparseAdam's epsilon."""
    return Adam(betas=betas, eps=eps, global_step=True, sparse_adam_epsilon=True)


class _Gather(torch.autograd.Function):
    """Forward: the table's gather. Backward: keys and gradient rows go to the module's pending
    list (the optimizer's step applies them); the table gets no dense .grad."""

    @staticmethod
    def forward(ctx, keys, anchor, module):
        flat = module._flat_keys(keys)
        out = torch.empty(flat.numel(), module.embedding_dim, device=module.device, dtype=torch.float32)
        module._table.gather(flat, out)
        ctx.module = module
        ctx.keys = flat  # not save_for_backward: keys never go through saved-tensor hooks
        return out.view(*keys.shape, module.embedding_dim)

    @staticmethod
    def backward(ctx, grad):
        m = ctx.module
        g = grad.reshape(-1, m.embedding_dim)
        if g.dtype != torch.float32:
            g = g.float()
        m._pending.append((ctx.keys, g.contiguous()))
        return None, None, None


class Embedding(torch.nn.Module):
    """A wm embedding table as a torch.nn.Module (float32 rows).

    location: "device" (GPU memory) or "host" (pinned host memory).
    cache: None, "read_write" (trainable host table with a device cache) or "read_only" (a host
    table that is only read, e.g. node features; optimizer must be None); cache_ratio is the
    fraction of rows each GPU caches.
    optimizer: SGD(), Adam(...), SparseAdam() or None (no training). The learning rate is the
    EmbeddingOptimizer's.
    init: "uniform" (init_a, init_b = low, high), "normal" (mean, std) or "zeros", seeded: the same
    seed gives the same table on any rank count.
    """

    def __init__(self, num_embeddings, embedding_dim, *, comm=None, location="device", cache=None,
                 cache_ratio=0.1, optimizer=None, init="uniform", init_a=-0.05, init_b=0.05,
                 seed=42, cache_hash_seed=0):
        super().__init__()
        ext = load()
        if not torch.cuda.is_available():
            raise RuntimeError("wm_torch.Embedding needs a CUDA GPU")
        self.comm = comm if comm is not None else default_communicator()
        o = ext.TableOptions()
        o.rows, o.dim = int(num_embeddings), int(embedding_dim)
        o.location = location
        o.cache = "none" if cache is None else cache
        o.cache_ratio = float(cache_ratio)
        o.cache_hash_seed = int(cache_hash_seed)
        if optimizer is None:
            o.optimizer = "none"
        else:
            optimizer.fill(o)
        o.init, o.init_a, o.init_b, o.init_seed = init, float(init_a), float(init_b), int(seed)
        self.num_embeddings, self.embedding_dim = o.rows, o.dim
        self.device = self.comm.device
        with torch.cuda.device(self.device):
            self._table = ext.Table(self.comm._c, o)
        self.trainable = self._table.trainable
        # A leaf that requires grad, so that autograd calls _Gather.backward; never a Parameter
        # (dense optimizers must not see it) and it never gets a .grad.
        self._anchor = torch.empty(0, device=self.device, requires_grad=True)
        self._pending = []

    def extra_repr(self):
        return f"{self.num_embeddings}, {self.embedding_dim}, {self._table.description}"

    def _flat_keys(self, keys):
        if not isinstance(keys, torch.Tensor):
            raise TypeError(f"wm_torch.Embedding: keys must be a torch.Tensor, got {type(keys).__name__}")
        if keys.device != self.device:
            raise ValueError(f"wm_torch.Embedding: keys must be on {self.device}, got {keys.device}")
        if keys.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"wm_torch.Embedding: keys must be int64 or int32, got {keys.dtype}")
        flat = keys.reshape(-1)
        if flat.dtype != torch.int64:
            flat = flat.long()  # the tables take int64 keys: int32 keys cost one small cast
        return flat.contiguous()

    def forward(self, keys):
        if self.trainable and torch.is_grad_enabled():
            return _Gather.apply(keys, self._anchor, self)
        flat = self._flat_keys(keys)
        out = torch.empty(flat.numel(), self.embedding_dim, device=self.device, dtype=torch.float32)
        self._table.gather(flat, out)
        return out.view(*keys.shape, self.embedding_dim)

    # Utilities ----------------------------------------------------------------------------------
    def rows(self, keys=None, chunk=1 << 20):
        """The rows of `keys` (default: every row) through the table's gather, as a CUDA tensor."""
        with torch.no_grad():
            if keys is None:
                keys = torch.arange(self.num_embeddings, device=self.device)
            parts = [self.forward(keys[i:i + chunk]) for i in range(0, keys.numel(), chunk)]
            return torch.cat(parts) if parts else torch.empty(0, self.embedding_dim, device=self.device)

    def load_weights_(self, values, keys=None, chunk=1 << 20):
        """Overwrites rows `keys` (default: all, in order) with `values` (float32, any device).
        Optimizer states are untouched.

        Collective, like forward and step: with several ranks every rank calls it, each with its
        own rows (keys=None: every row; an empty `keys` to write nothing), and each rank's
        cache is flushed and emptied first, since it holds rows that other ranks may write.
        When it returns on a rank, every rank's rows are in the table and later gathers on any
        rank see them. A row written by several ranks in one call gets one of their values.
        Rows go in chunks of `chunk`; the ranks agree on the number of calls."""
        if keys is None:
            keys = torch.arange(self.num_embeddings, device=self.device)
        if values.shape != (keys.numel(), self.embedding_dim):
            raise ValueError(f"wm_torch.Embedding.load_weights_: values must be {(keys.numel(), self.embedding_dim)}, "
                             f"got {tuple(values.shape)}")
        calls = (keys.numel() + chunk - 1) // chunk
        if self.comm.size > 1:  # write_rows is collective: as many calls on every rank
            calls = max(self.comm.all_gather_int(calls))
        for c in range(calls):
            i = c * chunk
            v = values[i:i + chunk].to(device=self.device, dtype=torch.float32).contiguous()
            self._table.write_rows(self._flat_keys(keys[i:i + chunk]), v)

    def prefetch(self, keys):
        """Admits the rows of the next batch into the cache (cached tables)."""
        self._table.prefetch(self._flat_keys(keys))

    def flush(self):
        """Writes this rank's dirty cache lines back to the table (not collective)."""
        self._table.flush()

    def cache_stats(self, reset=False):
        s = self._table.cache_stats()
        if reset:
            self._table.reset_cache_stats()
        return s

    @property
    def cache_lines(self):
        return self._table.cache_lines

    @property
    def global_step(self):
        return self._table.global_step

    def store(self, prefix):
        self._table.store(str(prefix))

    def load(self, prefix):
        self._table.load(str(prefix))


class EmbeddingOptimizer:
    """step() applies the gradients that backward handed to each Embedding (apply_gradients:
    collective, synchronizes the current stream); zero_grad() drops them. `lr` may change
    between steps (schedulers: set optimizer.lr)."""

    def __init__(self, modules, lr):
        if isinstance(modules, torch.nn.Module):
            modules = [m for m in modules.modules() if isinstance(m, Embedding)]
        self.modules = list(modules)
        for m in self.modules:
            if not isinstance(m, Embedding) or not m.trainable:
                raise ValueError("wm_torch.EmbeddingOptimizer: every module must be a trainable wm_torch.Embedding")
        self.lr = float(lr)

    def zero_grad(self, set_to_none=True):
        for m in self.modules:
            m._pending.clear()

    @torch.no_grad()
    def step(self):
        for m in self.modules:
            p = m._pending
            if len(p) == 1:
                keys, grads = p[0]
            elif p:
                keys = torch.cat([k for k, _ in p])
                grads = torch.cat([g for _, g in p])
            else:  # collective: every rank calls it, with or without keys
                keys = torch.empty(0, dtype=torch.int64, device=m.device)
                grads = torch.empty(0, m.embedding_dim, dtype=torch.float32, device=m.device)
            m._table.apply_gradients(keys, grads, self.lr)
            p.clear()


# ---------------------------------------------------------------------------------------------
# Swap scopes as saved-tensor hooks


class SwapScope:
    """A wm::swap_scope on the current GPU: a device pool of `device_budget` bytes (the residency
    budget: one cudaMalloc, outside torch's allocator; 0 for none, which the direct hooks do not
    need) and a pinned host slab of `host_bytes` (every saved tensor of a step must fit).
    Saved tensors smaller than `min_bytes` stay where they are. prefetch_lookahead: bytes the
    backward prefetch may run ahead of use (pool mode: 0 means the pool only; direct mode: the
    default of SwapHooks' stage_bytes, 0 meaning one tensor ahead)."""

    def __init__(self, device_budget, host_bytes, *, min_bytes=1 << 20, prefetch_lookahead=0,
                 max_in_flight=4, timeout_s=60.0):
        ext = load()
        self._h = ext.SwapScope(int(device_budget), int(host_bytes), max_in_flight=max_in_flight,
                                prefetch_lookahead=int(prefetch_lookahead), timeout_s=float(timeout_s),
                                min_bytes=int(min_bytes))
        self.device_budget = int(device_budget)
        self.host_bytes = int(host_bytes)
        self.prefetch_lookahead = int(prefetch_lookahead)

    def prefetch_all(self):
        self._h.prefetch_all()

    def statistics(self):
        return self._h.statistics()

    def reset_statistics(self):
        self._h.reset_statistics()


class SwapHooks(torch.autograd.graph.saved_tensors_hooks):
    """Saved activations as wm swappable buffers.

        hooks = wm_torch.SwapHooks(scope, skip=model)   # never copy model's parameters
        with hooks:
            loss = loss_fn(model(x))
        hooks.prefetch_all()        # optional: the first unpack does it otherwise
        loss.backward()

    pack: a tensor on the scope's GPU, dense, at least min_bytes, and not in `skip` is paged out;
    a second save of the same tensor (same storage, offset, shape, strides, version) shares its
    buffer. Anything else is kept as autograd would.
    - mode="direct" (default): the page-out copies the tensor's own memory on the scope's copy
      stream, after the current stream's work (swap_scope::pageout_from); the tensor is
      record_stream-ed on that copy stream, so torch's allocator reuses its memory only once the
      copy is done, and the scope's device pool is not used (SwapScope(0, host_bytes)).
      max_outstanding_bytes: the host (host_pacing, the default) or else the current stream waits
      for the oldest page-outs whenever more bytes than that may still be copying, so the
      forward pass goes at the link's pace and the saved tensors it frees do not pile up (with
      stream waits 0 means no wait; see host_pacing below). unpack returns the saved tensor
      itself while it is still alive and unchanged; else a tensor from torch's allocator that the
      scope's page-in copy stream filled (swappable::pagein_to), staged in backward order up to
      stage_bytes ahead of use (default: the scope's prefetch_lookahead; at least one tensor)
      from prefetch_all on. keep_last=k > 0: the k newest saved tensors are held and paged out
      only when newer ones are saved; those still held when backward starts (the first unpack or
      prefetch_all) are never copied: backward needs them first, and in a training loop the
      last ones would otherwise go out and straight back in (their memory stays in use until
      their unpack, as without hooks).
      compress=True: each saved tensor of 1, 2, 4 or 8-byte elements is encoded on the current
      stream before it goes out (wm::zero_codec: a bit per element, then the elements whose bit
      pattern is not zero; lossless, -0.0 and NaN included), so a ReLU output sends about half
      its bytes each way (0.47-0.57 of them on the bench and the tests' MLPs, bf16); backward decodes it on the page-in stream. The
      tensor itself is then only read on the current stream (its memory is free for torch's
      allocator in that stream's order); its encoding goes out at the next save, at backward or
      when the `with` block ends: the host waits for the encoding then (to learn its size),
      one save behind the forward pass.
      host_pacing (default True in the direct mode): the waits of max_outstanding_bytes are
      host waits (0: all but the newest page-out), and leaving the `with` block waits on the host
      for every page-out. A record_stream-ed tensor is free for torch's allocator only once the
      host has seen its copy end: with host_pacing=False (the stream waits instead), a host that
      runs ahead of the GPU gets new memory for everything that comes next while the saved
      tensors are still being copied, and the step needs MORE memory than without hooks
      (torch.cuda.memory_stats()["active_bytes.all.peak"] shows it, max_memory_allocated does not:
      +116% on bench/torch_swap_bench.py).
    - mode="pool": pack copies the tensor into a buffer of the scope's device pool on the current
      stream and queues its page-out; unpack returns a tensor over the pool buffer, paged in if
      needed, whose memory returns to the pool once autograd drops it and the saved handle.
    prefetch_all: starts the page-ins of every buffer saved since the last call, latest first.
    """

    def __init__(self, scope, skip=(), auto_prefetch=True, mode="direct", max_outstanding_bytes=0,
                 stage_bytes=None, keep_last=0, compress=False, host_pacing=None):
        if mode not in ("direct", "pool"):
            raise ValueError(f"wm_torch.SwapHooks: mode must be 'direct' or 'pool', not {mode!r}")
        self.scope = scope
        self.mode = mode
        h = scope._h
        h.set_auto_prefetch(bool(auto_prefetch))
        stage = scope.prefetch_lookahead if stage_bytes is None else int(stage_bytes)
        if int(keep_last) < 0:
            raise ValueError(f"wm_torch.SwapHooks: keep_last must be >= 0, not {keep_last}")
        if (compress or host_pacing) and mode != "direct":
            raise ValueError("wm_torch.SwapHooks: compress and host_pacing need mode='direct'")
        if host_pacing is None:
            host_pacing = mode == "direct"
        h.set_direct(mode == "direct", int(max_outstanding_bytes), stage, int(keep_last), bool(compress),
                     bool(host_pacing))
        if isinstance(skip, (torch.nn.Module, torch.Tensor)):
            skip = [skip]
        ptrs = []
        for s in skip:
            tensors = list(s.parameters()) + list(s.buffers()) if isinstance(s, torch.nn.Module) else [s]
            ptrs += [t.untyped_storage().data_ptr() for t in tensors if t.is_cuda]
        h.set_skip(ptrs)

        def pack(t):
            saved = h.pack(t)
            return t if saved is None else saved

        def unpack(x):
            return x if isinstance(x, torch.Tensor) else h.unpack(x)

        super().__init__(pack, unpack)

    def __exit__(self, *exc):
        try:
            self.scope._h.end_forward()
        finally:
            super().__exit__(*exc)

    def prefetch_all(self):
        self.scope.prefetch_all()
