#!/usr/bin/env python3
"""Plot the memory curve of `anchorkv eval --generate N --curve CURVE.csv` (the figure of docs/compaction.md).

    plot_generate.py CURVE.csv OUT.png [--title TEXT]
"""
import argparse
import csv

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LABELS = {
    "full": "FullKV (M_full)",
    "anchorkv_dense_suffix": "AnchorKV, dense suffix",
    "anchorkv_compacted": "AnchorKV, compacted",
    "snapkv_dense_suffix": "SnapKV, dense suffix",
    "snapkv_decode_time": "SnapKV, decode-time",
    "andpro_decode_time": "AnDPro, decode-time",
    "theta_full": "theta x M_full (budget)",
}


# Dense-suffix and compacted curves of different methods coincide (same bytes): dashes and
# widths keep both visible.
STYLES = {
    "theta_full": dict(linestyle="--", color="black"),
    "anchorkv_dense_suffix": dict(linewidth=3, alpha=0.6),
    "anchorkv_compacted": dict(linewidth=3, alpha=0.6),
    "snapkv_dense_suffix": dict(linestyle=":"),
    "snapkv_decode_time": dict(linestyle=":"),
    "andpro_decode_time": dict(linestyle="-.", linewidth=0.8),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("curve")
    parser.add_argument("out")
    parser.add_argument("--title", default="")
    args = parser.parse_args()
    with open(args.curve) as f:
        rows = list(csv.DictReader(f))
    tokens = [int(r["tokens"]) for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    for column, label in LABELS.items():
        if column not in rows[0]:
            continue
        style = STYLES.get(column, {})
        ax.plot(tokens, [float(r[column]) / 2**20 for r in rows], label=label, **style)
    ax.set_xlabel("cached tokens (prompt + generated)")
    ax.set_ylabel("bytes held (MiB, all layers)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    if args.title:
        ax.set_title(args.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
