#!/usr/bin/env python3
"""Lloyd-Max scalar quantizers for a unit Gaussian (the tables in src/core/quantizer.hpp).

Lloyd's iteration on the exact Gaussian integrals: thresholds are the midpoints of adjacent
levels, each level is the centroid E[X | X in its cell] = (pdf(a) - pdf(b)) / (cdf(b) - cdf(a)).
Prints the positive half of the levels and thresholds and the MSE per coordinate
(1 - sum_i p_i l_i^2 at a fixed point), for 2, 3 and 4 bits.
"""
import math


def pdf(x):
    return 0.0 if math.isinf(x) else math.exp(-x * x / 2) / math.sqrt(2 * math.pi)


def cdf(x):
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def lloyd_max(levels_count, iterations=20000):
    levels = [-3 + 6 * (i + 0.5) / levels_count for i in range(levels_count)]
    for _ in range(iterations):
        bounds = [-math.inf] + [(levels[i] + levels[i + 1]) / 2 for i in range(levels_count - 1)] + [math.inf]
        new = [(pdf(bounds[i]) - pdf(bounds[i + 1])) / (cdf(bounds[i + 1]) - cdf(bounds[i])) for i in range(levels_count)]
        done = max(abs(a - b) for a, b in zip(new, levels)) < 1e-15
        levels = new
        if done:
            break
    bounds = [-math.inf] + [(levels[i] + levels[i + 1]) / 2 for i in range(levels_count - 1)] + [math.inf]
    mse = 1 - sum((cdf(bounds[i + 1]) - cdf(bounds[i])) * levels[i] ** 2 for i in range(levels_count))
    return levels, bounds[1:-1], mse


if __name__ == "__main__":
    for bits in (2, 3, 4):
        levels, thresholds, mse = lloyd_max(1 << bits)
        half = len(levels) // 2
        print(f"{bits} bits: levels {', '.join(f'{x:.6f}' for x in levels[half:])}; "
              f"thresholds {', '.join(f'{x:.6f}' for x in thresholds[half:])}; mse {mse:.6f}")
