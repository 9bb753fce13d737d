#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Plots cache_bench's CSV: Adam ms/step against device-cache ratio, wm and WholeGraph, Zipf and uniform.

Usage: python3 bench/plot_cache.py CSV [PNG]   (PNG defaults to the CSV's name with .png)

The CSV (bench/cache_bench.cu writes it) has the columns system,dist,case,ratio,ms_per_step,
hit_rate; system is wm or wg, dist uniform or zipf, case cached (at its ratio), host (the uncached
host table, ratio 0) or device (the device table, ratio 1). Cached cases are drawn as lines with
points against the ratio (log y); the uncached host step as a dashed and the device-table step as
a dotted horizontal line in the same colour. Empty ms (a case that did not run) are skipped.

With matplotlib the PNG has one panel per key distribution, axes, and each line named in a
column beside its panel (bench/plot_labels.py: the script fails rather than write labels that
overlap). Without it a small pure-python writer
(zlib + struct) draws the same lines and points on a raster with tick marks and digit labels; it
has no legend: the colour code is in the PNG's Title text chunk and printed on stdout.
"""
import csv
import math
import struct
import sys
import zlib

COLOURS = {("wm", "zipf"): (31, 119, 180), ("wm", "uniform"): (44, 160, 44),
           ("wg", "zipf"): (214, 39, 40), ("wg", "uniform"): (255, 127, 14)}
NAMES = {"wm": "wm", "wg": "WholeGraph"}
CODE = ("blue = wm zipf, green = wm uniform, red = WholeGraph zipf, orange = WholeGraph uniform; "
        "solid + points = device cache (x = ratio), dashed = uncached host table, "
        "dotted = device table; y = ms/step (log)")


def read(path):
    series = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            ms = row.get("ms_per_step", "").strip()
            if not ms:
                continue
            key = (row["system"].strip(), row["dist"].strip())
            series.setdefault(key, {}).setdefault(row["case"].strip(), []).append(
                (float(row["ratio"]), float(ms)))
    for cases in series.values():
        for points in cases.values():
            points.sort()
    return series


def plot_matplotlib(series, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    from plot_labels import check_no_overlap, label_column
    dists = sorted({dist for _, dist in series}, key=lambda d: (d != "uniform", d))
    fig, axes = plt.subplots(1, len(dists), figsize=(6.2 * len(dists), 4.6), dpi=120,
                             squeeze=False)
    panels = []
    for ax, dist in zip(axes[0], dists):
        items, flat = [], []  # labels: (x, y, text, colour); flat: the horizontal lines
        for key, cases in sorted(series.items()):
            if key[1] != dist:
                continue
            colour = tuple(c / 255 for c in COLOURS.get(key, (0, 0, 0)))
            name = NAMES.get(key[0], key[0])
            if "cached" in cases:
                xs, ys = zip(*cases["cached"])
                ax.plot(xs, ys, "o-", color=colour)
                items.append((xs[-1], ys[-1], f"{name}, device cache", colour))
            for case, style, what in (("host", "--", "uncached host table"),
                                      ("device", ":", "device table")):
                if case in cases:
                    ms = cases[case][0][1]
                    ax.axhline(ms, linestyle=style, color=colour, linewidth=1.2)
                    flat.append((ms, f"{name}, {what}: {ms:.3g} ms", colour))
        right = ax.get_xlim()[1]
        ax.set_xlim(ax.get_xlim())  # fixed, so that the lines' right ends stay where labelled
        items += [(right, ms, text, colour) for ms, text, colour in flat]
        ax.set_yscale("log")
        plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_xlabel("device cache ratio (fraction of the table's rows)")
        ax.set_ylabel("Adam step, ms (log)")
        ax.set_title(f"{dist} keys", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        panels.append((ax, items))
    fig.suptitle("cache_bench: 10M x 128 float host table, Adam, 1M fresh keys per step",
                 fontsize=10)
    fig.tight_layout()
    fig.subplots_adjust(wspace=0.8, right=0.8)  # room for each panel's label column
    texts = [t for ax, items in panels for t in label_column(ax, items)]
    check_no_overlap(fig, texts, [ax for ax, _ in panels])
    fig.savefig(out, bbox_inches="tight")


# ---- the pure-python fallback ---------------------------------------------------------------

FONT = {  # 3 x 5 pixel glyphs, rows top to bottom, 3 bits each (MSB left)
    "0": (7, 5, 5, 5, 7), "1": (2, 6, 2, 2, 7), "2": (7, 1, 7, 4, 7), "3": (7, 1, 7, 1, 7),
    "4": (5, 5, 7, 1, 1), "5": (7, 4, 7, 1, 7), "6": (7, 4, 7, 5, 7), "7": (7, 1, 1, 1, 1),
    "8": (7, 5, 7, 5, 7), "9": (7, 5, 7, 1, 7), ".": (0, 0, 0, 0, 2), "-": (0, 0, 7, 0, 0),
}


class Raster:
    def __init__(self, w, h):
        self.w, self.h = w, h
        self.px = bytearray(b"\xff" * (w * h * 3))

    def set(self, x, y, c):
        if 0 <= x < self.w and 0 <= y < self.h:
            i = (y * self.w + x) * 3
            self.px[i:i + 3] = bytes(c)

    def line(self, x0, y0, x1, y1, c, width=2, dash=None):
        n = max(abs(x1 - x0), abs(y1 - y0), 1)
        for i in range(n + 1):
            if dash and (i // dash) % 2 == 1:  # gaps of a dashed line
                continue
            x = round(x0 + (x1 - x0) * i / n)
            y = round(y0 + (y1 - y0) * i / n)
            for dx in range(width):
                for dy in range(width):
                    self.set(x + dx - width // 2, y + dy - width // 2, c)

    def disc(self, cx, cy, r, c):
        for y in range(-r, r + 1):
            for x in range(-r, r + 1):
                if x * x + y * y <= r * r:
                    self.set(cx + x, cy + y, c)

    def text(self, x, y, s, c=(0, 0, 0), scale=2):
        for ch in s:
            for row, bits in enumerate(FONT.get(ch, (0, 0, 0, 0, 0))):
                for col in range(3):
                    if bits >> (2 - col) & 1:
                        for dx in range(scale):
                            for dy in range(scale):
                                self.set(x + col * scale + dx, y + row * scale + dy, c)
            x += 4 * scale

    def png(self, path, title):
        raw = b"".join(b"\x00" + bytes(self.px[y * self.w * 3:(y + 1) * self.w * 3])
                       for y in range(self.h))

        def chunk(kind, data):
            body = kind + data
            return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

        with open(path, "wb") as f:
            f.write(b"\x89PNG\r\n\x1a\n")
            f.write(chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)))
            f.write(chunk(b"tEXt", b"Title\x00" + title.encode("latin-1", "replace")))
            f.write(chunk(b"IDAT", zlib.compress(raw, 9)))
            f.write(chunk(b"IEND", b""))


def label(v):
    return f"{v:g}" if v >= 0.01 else f"{v:.3f}"


def plot_raw(series, out):
    w, h, left, right, top, bottom = 900, 560, 70, 20, 20, 50
    img = Raster(w, h)
    ys = [ms for cases in series.values() for pts in cases.values() for _, ms in pts if ms > 0]
    xs = [r for cases in series.values() for r, _ in cases.get("cached", [])]
    if not ys:
        raise SystemExit("plot_cache: no ms/step in the CSV")
    lo = 10 ** math.floor(math.log10(min(ys)))
    hi = 10 ** math.ceil(math.log10(max(ys)))
    if hi <= lo:
        hi = lo * 10
    xmax = max(xs + [0.25]) * 1.1

    def px(r):
        return round(left + (w - left - right) * min(r, xmax) / xmax)

    def py(ms):
        return round(h - bottom - (h - top - bottom) * (math.log10(ms) - math.log10(lo)) /
                     (math.log10(hi) - math.log10(lo)))

    black, grey = (0, 0, 0), (210, 210, 210)
    decade = lo
    while decade <= hi * 1.0001:  # y grid and labels at 1, 2, 5 x 10^k
        for m in (1, 2, 5):
            v = decade * m
            if lo <= v <= hi * 1.0001:
                img.line(left, py(v), w - right, py(v), grey, width=1)
                img.text(4, py(v) - 5, label(v))
        decade *= 10
    for r in sorted(set(xs)) or [0.1]:  # x ticks at the ratios measured
        img.line(px(r), h - bottom, px(r), h - bottom + 6, black, width=1)
        img.text(px(r) - 10, h - bottom + 12, label(r))
    img.line(left, top, left, h - bottom, black, width=1)
    img.line(left, h - bottom, w - right, h - bottom, black, width=1)
    for key, cases in sorted(series.items()):
        colour = COLOURS.get(key, (0, 0, 0))
        for case, dash in (("host", 10), ("device", 3)):
            if case in cases:
                y = py(cases[case][0][1])
                img.line(left, y, w - right, y, colour, width=2, dash=dash)
        pts = [(px(r), py(ms)) for r, ms in cases.get("cached", []) if ms > 0]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            img.line(x0, y0, x1, y1, colour, width=3)
        for x, y in pts:
            img.disc(x, y, 5, colour)
    img.png(out, "cache_bench ms/step against cache ratio: " + CODE)


def main():
    if len(sys.argv) not in (2, 3):
        raise SystemExit(__doc__.splitlines()[2])
    src = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) == 3 else (src[:-4] if src.endswith(".csv") else src) + ".png"
    series = read(src)
    try:
        import matplotlib  # noqa: F401
        plot_matplotlib(series, out)
        print(f"plot_cache: {out} (matplotlib)")
    except ImportError:
        plot_raw(series, out)
        print(f"plot_cache: {out} (no matplotlib: pure-python PNG without legend; {CODE})")


if __name__ == "__main__":
    main()
