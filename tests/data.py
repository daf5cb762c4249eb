"""Test inputs shared by the kernel checks (CPU, simulator, GPU); no pytest import: the GPU
machines run tests/test_codec_gpu.py as a script."""
import numpy as np

from numba_kernels import reference as R, wire

KEY_FUSED = 0x0DDB_1A5E_5BAD_5EED       # the noise keys of the fused kernels' payloads: KEY_FUSED + k


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


# ---- payloads for the fused kernels ---------------------------------------------------------------

def qsgd_payloads(n, numel, bits, bs, stochastic, l2, special=False, seed=0, name="w"):
    """``n`` QSGD payloads of ``numel`` elements, back to back, and their Expect."""
    mode = 0 if stochastic else 1
    h = wire.Header(2, bits, mode, int(l2), bs, 0, (numel,), name_hash=wire.name_hash(name)).words()
    lay = wire.layout(2, numel, bits, bs)
    buf = np.zeros(n * lay.total, np.uint8)
    for k in range(n):
        x = make_x(numel, seed * 101 + k * 7 + numel, special=special and k == n - 1)
        with np.errstate(all="ignore"):
            R.qsgd_encode_ref(x, buf[k * lay.total:(k + 1) * lay.total], h, bits, bs, stochastic, l2,
                              KEY_FUSED + k)
    return buf, h, lay, wire.Expect(2, bits, mode, int(l2), bs, numel, wire.name_hash(name), True)


def onebit_payloads(n, numel, bs, two_mean, special=False, seed=0, name="w"):
    mode = 0 if two_mean else 1
    h = wire.Header(3, 1, mode, 0, bs, 0, (numel,), name_hash=wire.name_hash(name)).words()
    lay = wire.layout(3, numel, 1, bs, mode)
    buf = np.zeros(n * lay.total, np.uint8)
    for k in range(n):
        x = make_x(numel, seed * 101 + k * 7 + numel, special=special and k == n - 1)
        with np.errstate(all="ignore"):
            R.onebit_encode_ref(x, buf[k * lay.total:(k + 1) * lay.total], h, bs, two_mean)
    return buf, h, lay, wire.Expect(3, 1, mode, 0, bs, numel, wire.name_hash(name), True)


def chunk_payloads(numel, chunk, bits, bs, stochastic, l2, two_mean=None, special=False):
    """The gathered payloads of ``numel`` elements split into chunks of ``chunk`` (name r<j>), the
    name hashes and the configuration's Expect (QSGD; 1-bit when ``two_mean`` is not None)."""
    parts, hashes = [], []
    for j, (a, b) in enumerate(R.chunk_ranges(numel, bs, chunk)):
        if two_mean is None:
            p, _, _, e = qsgd_payloads(1, b - a, bits, bs, stochastic, l2, special and j == 0, j, f"r{j}")
        else:
            p, _, _, e = onebit_payloads(1, b - a, bs, two_mean, special and j == 0, j, f"r{j}")
        parts.append(p)
        hashes.append(e.name_hash)
    g = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    if two_mean is None:
        exp = wire.Expect(2, bits, 0 if stochastic else 1, int(l2), bs, 0)
    else:
        exp = wire.Expect(3, 1, 0 if two_mean else 1, 0, bs, 0)
    return g, np.array(hashes, np.uint32), exp
