# SPDX-License-Identifier: Apache-2.0
"""Which path of a C++ error into Python works in this process environment (no GPU needed).

The bridge's extension (examples/pytorch/wm_torch.cpp) binds `_error_probe(kind)`, which raises one
error by one path. Each kind runs here in its own process, so that a kind that kills its process
(a segmentation fault: exit -11) does not hide the others; with a GPU, each runs a second time
after the state of test_bridge.py (CUDA, a communicator, a table, a gather and its backward):

  expect          the bridge's checks: PyErr_SetString + py::error_already_set      -> ValueError
  guarded_wm      a wm::logic_error caught by the bridge's `guarded`                -> RuntimeError
  guarded_c10     a c10::ValueError (TORCH_CHECK_VALUE) caught by `guarded`         -> ValueError
  translator_std  a std::runtime_error through pybind11's and torch's translators  -> RuntimeError
  translator_c10  TORCH_CHECK_VALUE through the translators (the bridge's old path)  -> ValueError

The bridge itself uses only the first three paths; the last two are diagnostics (DIAG, not a
failure, when they do not raise). Usage: python3 tests/pytorch/error_probe.py (exit 0: every path
the bridge uses raised its exception; 1: one did not or killed its process; 77: skipped).
"""
import faulthandler
import os
import pathlib
import subprocess
import sys

# kind: (the exception expected, whether the bridge relies on the path). A failure of a path the
# bridge does not use (the translators) is reported as DIAG and does not fail the run: it tells
# which part of the old path kills the process here.
KINDS = {"expect": ("ValueError", True), "guarded_wm": ("RuntimeError", True), "guarded_c10": ("ValueError", True),
         "translator_std": ("RuntimeError", False), "translator_c10": ("ValueError", False)}


def child(kind, setup):
    faulthandler.enable()
    import torch

    import wm_torch

    ext = wm_torch.load()  # built by the parent: reused
    if setup == "cuda":  # the state of tests/pytorch/test_bridge.py: CUDA, NCCL, a table, a gather
        emb = wm_torch.Embedding(100, 8, optimizer=wm_torch.SGD())
        emb(torch.arange(10, device=emb.device)).sum().backward()
        torch.cuda.synchronize()
    try:
        ext._error_probe(kind)
    except Exception as e:  # noqa: BLE001  (the type is what we report)
        print(f"{type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
        return 0
    print("no exception", flush=True)
    return 1


def main():
    try:
        import torch  # noqa: F401
        from torch.utils import cpp_extension
    except ImportError as e:
        print(f"SKIPPED: {e}")
        return 77
    if cpp_extension.CUDA_HOME is None or not cpp_extension.is_ninja_available():
        print("SKIPPED: torch.utils.cpp_extension needs the CUDA toolkit and ninja")
        return 77
    repo = pathlib.Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(repo / "examples" / "pytorch"))
    import wm_torch

    wm_torch.load()
    setups = ["plain"] + (["cuda"] if torch.cuda.is_available() else [])
    failed = total = 0
    for setup in setups:
        for kind, (expected, required) in KINDS.items():
            r = subprocess.run([sys.executable, __file__, "--child", kind, setup], capture_output=True, text=True,
                               timeout=600, env=dict(os.environ))
            out = r.stdout.strip().splitlines()
            got = out[-1] if out else ""
            ok = r.returncode == 0 and got.startswith(expected + ":")
            total += required
            failed += required and not ok
            detail = got if r.returncode == 0 else f"process exit {r.returncode}; stderr: {r.stderr.strip()[-1500:]}"
            verdict = "PASS" if ok else ("FAIL" if required else "DIAG")
            print(f"{verdict} {kind} after {setup} setup (expects {expected}): {detail}", flush=True)
    print(f"{total - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples" / "pytorch"))
        sys.exit(child(sys.argv[2], sys.argv[3]))
    sys.exit(main())
