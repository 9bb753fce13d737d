# SPDX-License-Identifier: Apache-2.0
"""Labels for the benchmark plots that never cover the data or each other.

label_column(ax, items) writes each item's text in a column just outside the axes (right of
them), at the height of its point where it can and pushed apart where two would touch, with a
thin leader line from the text to the point. check_no_overlap(fig, texts) measures the drawn
texts and raises SystemExit when two of them overlap or one enters an axes' data area, so a plot
that would be unreadable fails instead of being written.
"""


def label_column(ax, items, fontsize=7, gap_pt=1.5, pad=0.03):
    """items: (x, y, text, colour) in data coordinates. Returns the text artists."""
    if not items:
        return []
    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    to_axes = ax.transAxes.inverted()
    points_to_px = fig.dpi / 72.0
    placed = []
    for x, y, text, colour in items:
        probe = ax.text(0, 0, text, fontsize=fontsize)
        height = probe.get_window_extent(renderer).height + gap_pt * points_to_px
        probe.remove()
        target = ax.transData.transform((x, y))[1]
        placed.append([target, height, (x, y), text, colour])
    placed.sort(key=lambda p: p[0])
    box = ax.get_window_extent(renderer)
    # Upwards from the lowest, each at least half a height above the one below; then down from
    # the top of the axes where the column ran past it.
    low = box.y0 + placed[0][1] / 2
    for p in placed:
        p[0] = max(p[0], low)
        low = p[0] + p[1]
    high = box.y1 - placed[-1][1] / 2
    for p in reversed(placed):
        p[0] = min(p[0], high)
        high = p[0] - p[1]
    texts = []
    for y_px, _, xy, text, colour in placed:
        y_axes = to_axes.transform((box.x1, y_px))[1]
        texts.append(ax.annotate(
            text, xy=xy, xycoords="data", xytext=(1 + pad, y_axes), textcoords="axes fraction",
            fontsize=fontsize, va="center", ha="left", color="black", annotation_clip=False,
            arrowprops={"arrowstyle": "-", "color": colour, "lw": 0.6, "alpha": 0.7,
                        "shrinkA": 1, "shrinkB": 3}))
    return texts


def check_no_overlap(fig, texts, axes=()):
    """Raises SystemExit naming the first two texts that overlap, or a text inside an axes."""
    from matplotlib.text import Text
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    # The text's own box (an annotation's extent includes its leader line).
    boxes = [(t.get_text(), Text.get_window_extent(t, renderer)) for t in texts]
    for i, (a, box_a) in enumerate(boxes):
        for b, box_b in boxes[i + 1:]:
            if box_a.overlaps(box_b):
                raise SystemExit(f"plot: labels '{a}' and '{b}' overlap")
        for ax in axes:
            if box_a.overlaps(ax.get_window_extent(renderer)):
                raise SystemExit(f"plot: label '{a}' covers the data of '{ax.get_title()}'")
