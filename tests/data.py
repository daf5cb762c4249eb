"""Test inputs shared by the kernel checks (CPU, simulator, GPU); no pytest import: the GPU
machines run tests/test_codec_gpu.py as a script."""
import numpy as np


def make_x(n, seed, special=False, wide=False):
    """Values over many magnitudes, with exact zeros and -0.0; ``special`` adds NaN, Inf, -Inf,
    denormals and huge values in some buckets; ``wide`` spreads each run of 64 elements over 165
    binades somewhere in 2**-190 .. 2**105 (subnormals and underflows to 0 too), for the quantizer's
    tiny quotients and extreme bucket scales."""
    rng = np.random.default_rng(seed)
    if wide:
        e = rng.uniform(0, 165, n) + np.repeat(rng.uniform(-190, -60, -(-n // 64)), 64)[:n]
        x = (rng.choice([-1.0, 1.0], n) * (1 + rng.random(n)) * np.exp2(e)).astype(np.float32)
    else:
        x = (rng.standard_normal(n) * np.exp(rng.standard_normal(n) * 2)).astype(np.float32)
    if n > 4:
        x[rng.integers(0, n, size=max(1, n // 10))] = 0.0
        x[rng.integers(0, n)] = -0.0
    if special and n:
        picks = rng.integers(0, n, size=5)
        x[picks[0]] = np.nan
        x[picks[1]] = np.inf
        x[picks[2]] = -np.inf
        x[picks[3]] = np.float32(1e-42)
        x[picks[4]] = np.float32(3e38)
    return x
