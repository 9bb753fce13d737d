#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Plots swap_bench's CSV: step time against peak device memory, wm's swap policies and PyTorch's.

Usage: python3 bench/plot_swap.py CSV [PNG]   (PNG defaults to the CSV's name with .png)

The CSV (bench/swap_bench.cu --csv writes it) has the columns system,policy,step_ms,ratio,peak_gib;
system is wm or torch, policy the row's name in swap_bench's table. Each row is one point,
named in a column beside its panel (bench/plot_labels.py: the script fails rather than write
labels that overlap); wm's no-swap run is the reference (dashed lines at its time and peak, and
the target box: <= 1.10x its time at >= 35% lower peak). Needs matplotlib.
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
    import matplotlib.ticker
    from plot_labels import check_no_overlap, label_column
    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(12, 5.2), dpi=110,
                                   gridspec_kw={"width_ratios": [1, 1.3]})
    colours = {"wm": "tab:blue", "torch": "tab:red"}
    # Left: every run (log time). Right: the runs near the no-swap step. Every point is named in
    # a column beside its panel; runs at the same place share a name.
    near = [r for r in rows if float(r["step_ms"]) <= 1.2 * base_ms]
    panels = []
    for axis, pts in ((ax, rows), (zoom, near)):
        for system in ("wm", "torch"):
            mine = [r for r in pts if r["system"] == system]
            axis.scatter([float(r["peak_gib"]) for r in mine],
                         [float(r["step_ms"]) for r in mine], color=colours[system], zorder=3, s=22)
        axis.axhline(base_ms, color="grey", ls="--", lw=0.8)
        axis.axvline(base_gib, color="grey", ls="--", lw=0.8)
        axis.fill_between([0, 0.65 * base_gib], base_ms, 1.10 * base_ms, color="tab:green",
                          alpha=0.15)
        axis.set_xlabel("peak device memory (GiB)")
        axis.grid(True, which="both", alpha=0.3)
        places = {}
        for r in pts:
            key = (round(float(r["peak_gib"]), 2), round(float(r["step_ms"]), 0))
            name = r["policy"].replace("wm, ", "").replace("swap ", "")
            if axis is ax and r["system"] == "wm" and "no swap" not in r["policy"]:
                continue  # the left panel names PyTorch's runs and wm's no-swap run
            places.setdefault(key, [float(r["peak_gib"]), float(r["step_ms"]), [],
                                    colours[r["system"]]])[2].append(name)
        panels.append((axis, [(x, y, " / ".join(names) + f": {y:.1f} ms, {x:.2f} GiB", c)
                              for x, y, names, c in places.values()]))
    ax.set_yscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.set_xlim(0, 1.15 * max(float(r["peak_gib"]) for r in rows))
    ax.set_ylabel("ms per step (log)")
    ax.set_title("all runs (blue: wm swap_scope, red: PyTorch)", fontsize=9)
    zoom.set_xlim(0.6 * base_gib, 1.22 * max(float(r["peak_gib"]) for r in near))
    zoom.set_ylim(0.97 * base_ms, 1.15 * base_ms)
    zoom.set_ylabel("ms per step")
    zoom.set_title("near the no-swap step; green: the target (<= 1.10x the no-swap time at "
                   ">= 35% lower peak)", fontsize=8)
    fig.suptitle("16 x Linear(8192) bf16 MLP, batch 16,384: saved activations swapped to host "
                 "memory", fontsize=10)
    fig.tight_layout()
    fig.subplots_adjust(wspace=0.9, right=0.78)  # room for each panel's label column
    texts = [t for axis, items in panels for t in label_column(axis, items, fontsize=6.5)]
    check_no_overlap(fig, texts, [axis for axis, _ in panels])
    fig.savefig(out, bbox_inches="tight")
    print("plot_swap: wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
