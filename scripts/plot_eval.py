#!/usr/bin/env python3
"""Plots of `anchorkv eval` output (matplotlib):

  fidelity CDF  from `anchorkv eval --cells-csv CELLS.csv`: per method and ratio, the
                cumulative distribution of the cell fidelity, log y axis, dashed line at 0.9
                (paper App. D.1, Fig. 10); one panel per target ratio. A cell is what the
                eval table counts: one (layer, query head), its fidelity the mean over the
                held-out queries of cos(compressed, exact attention output), so the
                legend's "% < 0.9" is the table's cos<0.9. The x axis is 1 - cos on a log
                scale (labelled in cos), which spreads the range 0.9-1 where the methods
                differ; the legend sits below each panel.
  reach grid    from `anchorkv eval --reach-grid --csv > GRID.csv`: per method and ratio a
                heatmap of the share of needles reached, context length by needle depth
                (paper Fig. 4).

Usage:
  plot_eval.py --cells CELLS.csv --fidelity-png fidelity.png
  plot_eval.py --grid GRID.csv --reach-png reach.png
"""
import argparse
import csv
import math
from collections import defaultdict

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

METHOD_ORDER = ["FullKV", "AnchorKV", "AnchorKV-paper", "SnapKV", "PyramidKV", "AdaKV", "AnDPro", "Quantized",
                "Quantized-2b"]
# Colour, line style and marker per method: no two curves look alike, so one lying on
# another (SnapKV and PyramidKV often do) still shows through its markers and dashes.
METHOD_STYLES = {
    "FullKV": ("black", "-", None),
    "AnchorKV": ("tab:red", "-", "o"),
    "AnchorKV-paper": ("tab:pink", (0, (6, 2)), "P"),
    "SnapKV": ("tab:blue", (0, (4, 2)), "s"),
    "PyramidKV": ("tab:orange", (0, (1, 1.5)), "^"),
    "AdaKV": ("tab:green", (0, (6, 2, 1, 2)), "v"),
    "AnDPro": ("tab:purple", (0, (2, 2)), "D"),
    "Quantized": ("tab:brown", (0, (8, 2, 1, 2, 1, 2)), "x"),
    "Quantized-2b": ("tab:gray", (0, (3, 1, 1, 1)), "*"),
}
EXTRA_STYLES = [("tab:olive", (0, (5, 3)), "h"), ("tab:cyan", (0, (1, 3)), "<"), ("gold", (0, (7, 1)), ">")]


def method_key(name):
    return (METHOD_ORDER.index(name) if name in METHOD_ORDER else len(METHOD_ORDER), name)


def read_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def method_style(name, index):
    """(colour, line style, marker) of a method; methods not listed take the extras in turn."""
    return METHOD_STYLES.get(name) or EXTRA_STYLES[index % len(EXTRA_STYLES)]


def cell_fidelity(rows):
    """{(method, target): [fidelity of each cell]}: the eval table's cells, one per (layer,
    query head), each the mean over its held-out queries of the per-query cosine."""
    sums = defaultdict(lambda: [0.0, 0])
    for r in rows:
        cell = sums[(r["method"], r["target"], r["layer"], r["q_head"])]
        cell[0] += float(r["cosine"])
        cell[1] += 1
    by = defaultdict(list)
    for (method, target, _, _), (total, count) in sums.items():
        by[(method, target)].append(total / count)
    return by


def plot_fidelity(cells_path, png):
    by = cell_fidelity(read_rows(cells_path))
    # Rows without a sweep ("1x" FullKV, "-" Quantized) appear in every panel.
    targets = sorted({t for _, t in by if t not in ("1x", "-")}, key=lambda t: float(t.rstrip("x"))) or ["1x"]
    methods = sorted({m for m, _ in by}, key=method_key)
    styles = {m: method_style(m, i) for i, m in enumerate(m for m in methods if m not in METHOD_STYLES)}
    styles.update({m: METHOD_STYLES[m] for m in methods if m in METHOD_STYLES})
    # x = 1 - cos on a log axis, from the worst cell to a little past the best compressed
    # one; the exact reference (FullKV, 1 - cos ~ 1e-7) sits at that right edge.
    gaps = [1.0 - v for (m, t), values in by.items() if t != "1x" for v in values]
    floor = max(min(gaps, default=1e-4) / 3, 1e-6)
    worst = min(2.0, max(gaps, default=1.0) * 1.5)
    ticks = [t for t in (2.0, 1.0, 0.3, 0.1, 0.03, 0.01, 3e-3, 1e-3, 3e-4, 1e-4, 3e-5, 1e-5) if floor <= t <= worst]
    fig, axes = plt.subplots(1, len(targets), figsize=(5.0 * len(targets), 5.6), squeeze=False, sharey=True)
    for ax, target in zip(axes[0], targets):
        for m in methods:
            for t in (target, "1x", "-"):
                values = by.get((m, t))
                if values is None:
                    continue
                cos = np.sort(np.clip(np.array(values), -1.0, 1.0))
                share = np.arange(1, len(cos) + 1) / len(cos)  # share of cells with fidelity <= cos
                below = float(np.mean(cos < 0.9))
                suffix = "" if t == target else " (" + ("ref" if t == "1x" else "own bits") + ")"
                color, dashes, marker = styles[m]
                ax.step(np.maximum(1.0 - cos, floor), share, where="post", color=color, ls=dashes, lw=1.5,
                        marker=marker, markevery=max(1, len(cos) // 8), ms=4, mfc="none",
                        label=f"{m}{suffix}: {100 * below:.1f}% of cells < 0.9")
                break
        ax.axvline(0.1, color="k", ls="--", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlim(worst, floor * 0.8)  # reversed: better (cos -> 1) to the right
        ax.set_xticks(ticks, [f"{1 - x:g}" for x in ticks])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_yscale("log")
        ax.set_ylim(1e-3 if max(len(v) for v in by.values()) >= 1000 else 5e-3, 1.05)
        ax.set_xlabel("cell fidelity (cos)")
        ax.set_title(f"fidelity at {target}")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1, frameon=False)
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("share of cells with fidelity <= x (log)")
    fig.suptitle("Attention-output fidelity on held-out queries; a cell is a (layer, query head) as in the "
                 "eval table,\nits fidelity the mean over its queries of cos(compressed, exact attention output)", y=1.04)
    fig.savefig(png, dpi=130, bbox_inches="tight")
    print(f"wrote {png}")


def plot_reach(grid_path, png):
    rows = read_rows(grid_path)
    panels = defaultdict(dict)  # (method, target) -> {(seq_len, depth): reach}
    ratios = {}
    for r in rows:
        key = (r["method"], r["target"])
        panels[key][(int(r["seq_len"]), float(r["depth_percent"]))] = float(r["reach"])
        ratios.setdefault(key, []).append(float(r["ratio"]))
    def target_value(t):
        try:
            return float(t.rstrip("x"))
        except ValueError:
            return 0.0

    keys = sorted(panels, key=lambda k: (method_key(k[0]), target_value(k[1])))
    lengths = sorted({s for p in panels.values() for s, _ in p})
    depths = sorted({d for p in panels.values() for _, d in p})
    cols = min(4, len(keys))
    nrows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.6 * cols, 3.4 * nrows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, key in zip(axes.flat, keys):
        ax.axis("on")
        grid = np.full((len(depths), len(lengths)), np.nan)
        for (s, d), v in panels[key].items():
            grid[depths.index(d), lengths.index(s)] = v
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
        for i in range(len(depths)):
            for j in range(len(lengths)):
                if not np.isnan(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=6)
        ax.set_xticks(range(len(lengths)), [f"{s // 1024}K" if s % 1024 == 0 else str(s) for s in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:g}%" for d in depths], fontsize=7)
        mean_ratio = np.nanmean(ratios[key])
        ax.set_title(f"{key[0]} {key[1]} ({mean_ratio:.1f}x) mean {np.nanmean(grid):.2f}", fontsize=9)
        ax.set_xlabel("context length", fontsize=8)
        ax.set_ylabel("needle depth", fontsize=8)
    fig.subplots_adjust(hspace=0.45, wspace=0.35)
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.6, label="share of needles reached")
    fig.suptitle("Needle reach: cos(probe output, needle value) >= threshold", y=0.93 if nrows > 2 else 1.0)
    fig.savefig(png, dpi=130, bbox_inches="tight")
    print(f"wrote {png}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", help="CSV from anchorkv eval --cells-csv")
    p.add_argument("--fidelity-png", default="fidelity_cdf.png")
    p.add_argument("--grid", help="CSV from anchorkv eval --reach-grid --csv")
    p.add_argument("--reach-png", default="reach_grid.png")
    args = p.parse_args()
    if not args.cells and not args.grid:
        p.error("give --cells and/or --grid")
    if args.cells:
        plot_fidelity(args.cells, args.fidelity_png)
    if args.grid:
        plot_reach(args.grid, args.reach_png)


if __name__ == "__main__":
    main()
