#!/usr/bin/env python3
"""Plots swap_bench's CSV: step time against peak device memory, wm's swap policies and PyTorch's.

Usage: python3 bench/plot_swap.py CSV [PNG]   (PNG defaults to the CSV's name with .png)

The CSV (bench/swap_bench.cu --csv writes it) has the columns system,policy,step_ms,ratio,peak_gib;
system is wm or torch, policy the row's name in swap_bench's table. Each row is one point,
labelled with its policy; wm's no-swap run is the reference (dashed lines at its time and peak,
and the issue's target box: <= 1.10x its time at >= 35% lower peak). Needs matplotlib (the GPU
machine has it).
"""
import csv
import sys


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    path = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) > 2 else path.rsplit(".", 1)[0] + ".png"
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["step_ms"].strip()]
    base = next(r for r in rows if r["system"] == "wm" and "no swap" in r["policy"])
    base_ms, base_gib = float(base["step_ms"]), float(base["peak_gib"])
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=110)
    colours = {"wm": "tab:blue", "torch": "tab:red"}
    for system in ("wm", "torch"):
        pts = [r for r in rows if r["system"] == system]
        ax.scatter([float(r["peak_gib"]) for r in pts], [float(r["step_ms"]) for r in pts],
                   color=colours[system], label="wm swap_scope" if system == "wm" else "PyTorch",
                   zorder=3)
        for r in pts:
            name = r["policy"].replace("wm, ", "").replace("torch ", "")
            ax.annotate(name, (float(r["peak_gib"]), float(r["step_ms"])), fontsize=7,
                        xytext=(4, 3), textcoords="offset points")
    ax.axhline(base_ms, color="grey", ls="--", lw=0.8)
    ax.axvline(base_gib, color="grey", ls="--", lw=0.8)
    ax.fill_between([0, 0.65 * base_gib], base_ms, 1.10 * base_ms, color="tab:green", alpha=0.15,
                    label="target: <= 1.10x time at >= 35% lower peak")
    ax.set_yscale("log")
    ax.set_xlim(left=0)
    ax.set_xlabel("peak device memory (GiB)")
    ax.set_ylabel("ms per step (log)")
    ax.set_title("16 x Linear(8192) bf16 MLP, batch 16,384: activations swapped to host")
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    print("plot_swap: wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
