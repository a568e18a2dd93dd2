#!/usr/bin/env python3
"""Plots of `anchorkv eval` output (matplotlib):

  fidelity CDF  from `anchorkv eval --cells-csv CELLS.csv`: per method and ratio, the
                cumulative distribution of cos(compressed, exact attention output) over the
                (layer, query head, held-out query) cells, log y axis, dashed line at 0.9
                (paper App. D.1, Fig. 10); one panel per target ratio.
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

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

METHOD_ORDER = ["FullKV", "AnchorKV", "SnapKV", "PyramidKV", "AdaKV", "AnDPro", "Quantized", "Quantized-2b"]


def method_key(name):
    return (METHOD_ORDER.index(name) if name in METHOD_ORDER else len(METHOD_ORDER), name)


def read_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def plot_fidelity(cells_path, png):
    rows = read_rows(cells_path)
    # Rows without a sweep ("1x" FullKV, "-" Quantized) appear in every panel.
    by = defaultdict(list)
    targets = set()
    for r in rows:
        by[(r["method"], r["target"])].append(float(r["cosine"]))
        if r["target"] not in ("1x", "-"):
            targets.add(r["target"])
    targets = sorted(targets, key=lambda t: float(t.rstrip("x"))) or ["1x"]
    fig, axes = plt.subplots(1, len(targets), figsize=(5.2 * len(targets), 4.2), squeeze=False, sharey=True)
    methods = sorted({m for m, _ in by}, key=method_key)
    colors = {m: plt.cm.tab10(i % 10) for i, m in enumerate(methods)}
    for ax, target in zip(axes[0], targets):
        for m in methods:
            for t in (target, "1x", "-"):
                values = by.get((m, t))
                if values is None:
                    continue
                x = np.sort(np.clip(np.array(values), -1.0, 1.0))
                y = np.arange(1, len(x) + 1) / len(x)
                below = float(np.mean(x < 0.9))
                label = f"{m}{'' if t == target else ' (' + ('ref' if t == '1x' else 'own bits') + ')'}: {100 * below:.1f}% < 0.9"
                ax.step(x, y, where="post", color=colors[m], lw=1.6, ls="-" if t == target else ":", label=label)
                break
        ax.axvline(0.9, color="k", ls="--", lw=0.8)
        ax.set_yscale("log")
        ax.set_xlim(max(-0.05, min(0.5, ax.get_xlim()[0])), 1.005)
        ax.set_ylim(1e-3, 1.05)
        ax.set_xlabel("cos(compressed, exact attention output)")
        ax.set_title(f"fidelity at {target}")
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("share of cells with cos <= x (log)")
    fig.suptitle("Attention-output fidelity on held-out queries (cells: layer x query head x query)")
    fig.tight_layout()
    fig.savefig(png, dpi=130)
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
