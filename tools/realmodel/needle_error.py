#!/usr/bin/env python3
"""How well a compressed cache keeps the pass-key needle: per layer, the relative error of the
reconstructed (pre-RoPE) keys and values of the key's digit tokens (a word needle's pieces
with --haystack prose-word), against the prompt's
average, for AnchorKV at the given ratios on cached pass-key prefills (passkey.py's prompts).

    tools/realmodel/needle_error.py --haystack prose repeat --trials 0 3 --ratios 5 10

An exact token has error 0; the needle is lost when its digits' error approaches the
prompt's average. Prints one line per (haystack, trial, ratio): mean over layers and the worst
layer.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import passkey  # noqa: E402
import smollm2  # noqa: E402


def relative_error(approx, exact):
    return np.linalg.norm(approx - exact, axis=-1) / (np.linalg.norm(exact, axis=-1) + 1e-9)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--haystack", nargs="+", choices=passkey.HAYSTACKS, default=["prose", "repeat"])
    ap.add_argument("--trials", type=int, nargs="+", default=[0, 3])
    ap.add_argument("--depths-of", type=int, default=10, help="depths as passkey.py --trials N spreads them")
    ap.add_argument("--ratios", type=float, nargs="+", default=[5, 10])
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="AnchorKV option")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    anchorkv = smollm2.import_anchorkv()
    net, tok = smollm2.load_model(), smollm2.load_tokenizer()
    options = passkey.parse_options(args.option)
    depths = passkey.default_depths(args.depths_of)
    with anchorkv.Context(num_threads=args.threads) as ctx:
        for haystack in args.haystack:
            for trial in args.trials:
                data = passkey.load_trial(net, tok, smollm2.default_cache_dir(), args.length, trial, 0,
                                          passkey.trial_depth(depths, trial), False, haystack=haystack)
                # The answer's tokens inside the needle: the key's digits, or the word's pieces.
                start, answer = data.prompt.needle_start, data.prompt.answer
                digits = [i for i in range(start, start + 24)
                          if (piece := tok.decode([data.prompt.tokens[i]]).strip()) and
                          (piece.isdigit() if answer.isdigit() else piece.isalpha() and piece in answer and
                           piece not in ("The", "is", "secret", "word"))]
                for ratio in args.ratios:
                    caches = passkey.compress_layers(anchorkv, ctx, net, data,
                                                     passkey.Spec("anchorkv", "anchorkv", ratio, dict(options)))
                    rows = []  # per layer: keys all, keys digits, values all, values digits
                    for layer, cache in enumerate(caches):
                        k, v, _ = cache.reconstruct(rotated=False)
                        K, V = np.asarray(data.keys[layer]), np.asarray(data.values[layer])
                        rk, rv = relative_error(k[:, :K.shape[1]], K), relative_error(v[:, :V.shape[1]], V)
                        rows.append((rk.mean(), rk[:, digits].mean(), rv.mean(), rv[:, digits].mean()))
                        cache.close()
                    r = np.array(rows)
                    print(f"{haystack} trial {trial} {ratio:g}x: keys {r[:, 0].mean():.3f} all, {r[:, 1].mean():.3f} "
                          f"digits (worst layer {r[:, 1].max():.3f}); values {r[:, 2].mean():.3f} all, "
                          f"{r[:, 3].mean():.3f} digits (worst layer {r[:, 3].max():.3f})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
