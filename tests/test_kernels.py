"""Kernels against their NumPy references: bit-exact, CPU always, CUDA in the simulator.

* CPU (``numba_kernels.prepare(..., device=False)``, Numba ``njit(parallel=True)``) == ``*_ref`` byte
  for byte (payload) and bit for bit (decoded float32), one case per code path: sizes on either side
  of the group (8), lane (32) and bucket sizes, every bit width, both roundings and both norms;
  stochastic cases use the same key, hence the same uniforms.
  The encoders' residuals (in place and into another array) equal the reference's bit for bit, and
  the decoders' ``expect`` raises before writing.
* CUDA (the same ops with ``device=True``) runs in a subprocess with ``NUMBA_ENABLE_CUDASIM=1`` (it
  must be set before ``numba.cuda`` is imported) on small sizes; each case is reported back and checked here by name.
  On a GPU machine ``HVDQ_REAL_CUDA=1`` runs the same child on the real device.
"""
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from numba_kernels import prepare, reference as R, wire

sys.path.insert(0, os.path.dirname(__file__))   # (the simulator's child imports this module too)
import children  # noqa: E402
from data import make_x  # noqa: E402,F401  (re-exported for the simulator's child)

ROOT = Path(__file__).resolve().parents[1]

SIZES = [0, 1, 7, 8, 9, 31, 32, 33, 511, 512, 513, 1000, 4097]
BUCKETS = [1, 7, 64, 512]
BITS = [2, 3, 4, 5, 8, 12, 16]
KEY = 0x1234_5678_9ABC_DEF0


def op(method, kind, numel, device=False, **params):
    """The prepared op of one call (``numba_kernels.prepare``)."""
    return prepare(method, kind, device, numel, **params)


def bits_equal(a, b):
    return np.array_equal(np.asarray(a, np.float32).view(np.uint32), np.asarray(b, np.float32).view(np.uint32))


def nan_bits_equal(a, b):
    """Equal bit for bit, except that NaNs need only be NaN in both (their payload bits may differ)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return bool(np.array_equal(np.isnan(a), np.isnan(b))
                and bits_equal(np.where(np.isnan(a), 0, a), np.where(np.isnan(b), 0, b)))


def qsgd_case(n, bs, bits, stochastic, l2, x=None):
    x = make_x(n, n * 7919 + bs * 31 + bits) if x is None else x
    h = wire.Header(2, bits, 0 if stochastic else 1, int(l2), bs, 0, (n,), name_hash=7).words()
    lay = wire.layout(2, n, bits, bs)
    return x, h, lay


def _ids(n, bs, bits, st, l2):
    return f"n{n}-bs{bs}-b{bits}-{'stoch' if st else 'det'}-{'l2' if l2 else 'max'}"


_ROUNDINGS = [(True, False), (False, False), (True, True), (False, True)]     # (stochastic, l2)
# What each part proves: (1) the sizes around a group (8), a lane (32) and a bucket (0, 1, fewer
# elements than one bucket, a partial last bucket) at one configuration; (2) every bit width the
# kernels pack differently (2, 4, 8, 16: their own pack; 3, 5, 12: the 64-bit word pack; decodes by
# table up to 7 bits, byte at 8, unpacked above) at every bucket size (1, 7: buckets off byte
# boundaries, 64, 512), with a partial last bucket, the four roundings and norms taking turns;
# (3) the four roundings and norms at each of two sizes. Every width alone: test_cpu_every_width.
QSGD_CASES = ([(n, 64, 4, True, False) for n in SIZES]
              + [(1000, bs, b) + _ROUNDINGS[k % 4] for k, (b, bs) in enumerate(
                  (b, bs) for b in BITS for bs in BUCKETS)]
              + [(n, 7, 3) + r for n in (33, 4097) for r in _ROUNDINGS])


@pytest.fixture(scope="module")
def cpu():
    from numba_kernels import cpu
    return cpu


@pytest.mark.parametrize("n,bs,bits,stochastic,l2", QSGD_CASES, ids=[_ids(*c) for c in QSGD_CASES])
def test_qsgd_cpu_equals_reference(cpu, n, bs, bits, stochastic, l2):
    x, h, lay = qsgd_case(n, bs, bits, stochastic, l2)
    want = np.zeros(lay.total, np.uint8)
    got = np.full(lay.total, 0xA5, np.uint8)          # garbage: every byte must be written
    rref = np.full(n, np.nan, np.float32)
    R.qsgd_encode_ref(x, want, h, bits, bs, stochastic, l2, KEY, residual=rref)
    xin = x.copy()                                    # residual in place: x becomes x - decode(payload)
    op("qsgd", "encode", xin.size, bits=bits, bucket_size=bs, stochastic=stochastic, norm_l2=l2)(
        xin, got, h, KEY, residual=xin)
    assert np.array_equal(want, got), f"first differing byte {np.flatnonzero(want != got)[:5]} of {lay}"
    assert bits_equal(rref, xin)
    d = np.empty(n, np.float32)
    R.qsgd_decode_ref(want, d, bits, bs, False)
    assert bits_equal(rref, x - d)                    # the reference's residual is x minus its decode
    base = make_x(n, 99)
    for accumulate in (False, True):
        a, b = base.copy(), base.copy()
        R.qsgd_decode_ref(want, a, bits, bs, accumulate)
        op("qsgd", "decode", b.size, bits=bits, bucket_size=bs, accumulate=accumulate)(want, b)
        assert bits_equal(a, b)


# NaN, Inf, denormals and huge values through each pack family (2, 8, 16 bits) and each rounding and
# norm, in a short input and in one of partial last bucket
SPECIAL_CASES = [((33, 7), (1000, 64))[k % 2] + (b,) + r for k, (b, r) in enumerate(
    (b, r) for b in (2, 8, 16) for r in _ROUNDINGS)]


@pytest.mark.parametrize("n,bs,bits,stochastic,l2", SPECIAL_CASES, ids=[_ids(*c) for c in SPECIAL_CASES])
def test_qsgd_cpu_equals_reference_special_values(cpu, n, bs, bits, stochastic, l2):
    x, h, lay = qsgd_case(n, bs, bits, stochastic, l2, x=make_x(n, n + bs, special=True))
    want = np.zeros(lay.total, np.uint8)
    got = np.full(lay.total, 0xA5, np.uint8)
    rref, rcpu = np.empty(n, np.float32), np.empty(n, np.float32)
    with np.errstate(all="ignore"):
        R.qsgd_encode_ref(x, want, h, bits, bs, stochastic, l2, KEY, residual=rref)
    op("qsgd", "encode", x.size, bits=bits, bucket_size=bs, stochastic=stochastic, norm_l2=l2)(
        x, got, h, KEY, residual=rcpu)
    assert np.array_equal(want, got)
    assert nan_bits_equal(rref, rcpu)
    a, b = np.empty(n, np.float32), np.empty(n, np.float32)
    R.qsgd_decode_ref(want, a, bits, bs, False)
    op("qsgd", "decode", b.size, bits=bits, bucket_size=bs, accumulate=False)(want, b)
    assert bits_equal(a, b)


def _cpu_equals_reference(x, lay, encode_ref, encode_cpu, decode_ref, decode_cpu):
    """The CPU encode writes the reference's bytes into a garbage-filled payload and its residual in
    place (NaN where the reference's is); its decodes, writing and adding, equal the reference's.
    Returns (the last decode, the array it was added to)."""
    want = np.zeros(lay.total, np.uint8)
    got = np.full(lay.total, 0xA5, np.uint8)          # garbage: every byte must be written
    rref = np.full(x.size, 7, np.float32)
    with np.errstate(all="ignore"):
        encode_ref(x, want, rref)
    xin = x.copy()                                    # residual in place
    encode_cpu(xin, got, xin)
    assert np.array_equal(want, got), f"first differing byte {np.flatnonzero(want != got)[:5]} of {lay}"
    assert nan_bits_equal(rref, xin)
    base = make_x(x.size, 99)
    for accumulate in (False, True):
        a, b = base.copy(), base.copy()
        with np.errstate(all="ignore"):
            decode_ref(want, a, accumulate)
        decode_cpu(want, b, accumulate)
        assert nan_bits_equal(a, b)
    return a, base


def _sortquant_cpu_equals_reference(cpu, x, bits, split_bits, bs, stochastic):
    """:func:`_cpu_equals_reference` for a SortQuant encode of ``x`` and its decodes (``cpu``: the kernel
    module)."""
    h = wire.Header(4, bits, 0 if stochastic else 1, split_bits, bs, 0, (x.size,), name_hash=7).words()
    return _cpu_equals_reference(
        x, wire.layout(4, x.size, bits, bs, 0, split_bits),
        lambda x_, p, r: R.sortquant_encode_ref(x_, p, h, bits, split_bits, bs, stochastic, KEY, residual=r),
        lambda x_, p, r: op("sortquant", "encode", x_.size, bits=bits, split_bits=split_bits, bucket_size=bs,
                            stochastic=stochastic)(
            x_, p, h, KEY, residual=r),
        lambda p, o, acc: R.sortquant_decode_ref(p, o, bits, split_bits, bs, acc),
        lambda p, o, acc: op("sortquant", "decode", o.size, bits=bits, split_bits=split_bits, bucket_size=bs,
                             accumulate=acc)(
            p, o))


def _kmeans_cpu_equals_reference(cpu, x, bits, bs, iters):
    """:func:`_cpu_equals_reference` for a KMeans encode of ``x`` and its decodes (``cpu``: the kernel
    module)."""
    h = wire.Header(5, bits, 0, 0, bs, 0, (x.size,), name_hash=7).words()
    return _cpu_equals_reference(
        x, wire.layout(5, x.size, bits, bs),
        lambda x_, p, r: R.kmeans_encode_ref(x_, p, h, bits, bs, iters, KEY, residual=r),
        lambda x_, p, r: op("kmeans", "encode", x_.size, bits=bits, bucket_size=bs, iters=iters)(
            x_, p, h, KEY, residual=r),
        lambda p, o, acc: R.kmeans_decode_ref(p, o, bits, bs, acc),
        lambda p, o, acc: op("kmeans", "decode", o.size, bits=bits, bucket_size=bs, accumulate=acc)(p, o))


# (1) the sizes (empty, one element, fewer than a bucket, a partial last bucket, several chunks) at
# one configuration, plain and special-valued; (2) each width and split (the level and group fields
# of other widths) at each bucket size, with a partial last bucket, both roundings and both inputs
# taking turns
_SQ_WIDTHS = ((2, 1), (4, 2), (5, 3), (8, 2), (16, 4))
SORTQUANT_CASES = ([(n, 64, 4, 2, True, sp) for n in (0, 1, 9, 33, 513, 4097) for sp in (False, True)]
                   + [(513, bs, b, sb, k % 2 == 0, k % 4 < 2) for k, (bs, (b, sb)) in enumerate(
                       (bs, w) for bs in (1, 7, 64, 512) for w in _SQ_WIDTHS)])


@pytest.mark.parametrize("n,bs,bits,split_bits,stochastic,special", SORTQUANT_CASES,
                         ids=[f"n{n}-bs{bs}-b{b}s{sb}-{'stoch' if st else 'det'}-{'special' if sp else 'plain'}"
                              for n, bs, b, sb, st, sp in SORTQUANT_CASES])
def test_sortquant_cpu_equals_reference(cpu, n, bs, bits, split_bits, stochastic, special):
    """Bytes, residuals (NaN where the bucket is) and decodes, with ties, zeros, -0.0 and (special)
    NaN, Inf and huge values."""
    x = make_x(n, n * 31 + bs + bits, special=special)
    if n > 40:
        x[10:30] = x[5]                               # a run of equal values across group bounds
    a, base = _sortquant_cpu_equals_reference(cpu, x, bits, split_bits, bs, stochastic)
    if not special:
        assert np.all(np.isfinite(a - base))


@pytest.mark.parametrize("shape", ["spread", "crowded", "equal", "many_groups"])
def test_sortquant_cpu_group_paths(cpu, shape):
    """The CPU encode finds the groups from bins of equal width by value where the values spread
    (Gaussian, with a run of ties across a group bound), and sorts the bucket where a bound's bin
    holds many values (an outlier crowding the rest into one bin), where all values share one bin
    (all equal, -0.0 and +0.0 mixed) and above 16 groups: every path gives the reference's bytes,
    residuals and decodes."""
    n, bs = 2048, 512
    x = np.random.default_rng(5).standard_normal(n).astype(np.float32)
    bits, split_bits = 4, 2
    if shape == "spread":
        x[100:160] = x[7]
    elif shape == "crowded":
        x[::bs] = np.float32(1e30)
    elif shape == "equal":
        x[:] = 0.0
        x[1::3] = -0.0
    else:
        bits, split_bits = 8, 5
    for stochastic in (True, False):
        _sortquant_cpu_equals_reference(cpu, x, bits, split_bits, bs, stochastic)


_KM_VARIANTS = ("plain", "special", "wide")
# (1) the sizes (empty, one element, fewer values than the sample, a partial bucket, samples drawn
# above 1024 values) at one configuration, each input kind; (2) each width at each bucket size (one
# per tensor, 7, 512 with a partial last bucket, 2000: one bucket, sampled), the input kinds taking
# turns; (3) 0 iterations (the sample's quantiles) and 60 (the CPU kernel's early stop)
KMEANS_CASES = ([(n, 0, 3, 7, v) for n in (0, 1, 9, 33, 513, 4097) for v in _KM_VARIANTS]
                + [(1100, bs, b, 7, _KM_VARIANTS[k % 3]) for k, (bs, b) in enumerate(
                    (bs, b) for bs in (0, 7, 512, 2000) for b in (1, 3, 4, 8))]
                + [(4097, 0, 4, 0, "plain"), (4097, 0, 2, 60, "plain"), (600, 64, 5, 60, "special")])


@pytest.mark.parametrize("n,bs,bits,iters,variant", KMEANS_CASES,
                         ids=[f"n{n}-bs{bs or 'tensor'}-b{b}-it{it}-{v}" for n, bs, b, it, v in KMEANS_CASES])
def test_kmeans_cpu_equals_reference(cpu, n, bs, bits, iters, variant):
    """Bytes, residuals (NaN where the bucket is) and decodes, with ties, zeros, -0.0, (special) NaN,
    Inf, denormals and huge values, (wide) values over 165 binades; samples drawn above 1024 values;
    60 steps reach the CPU kernel's early stop."""
    x = make_x(n, n * 29 + bs + bits, special=variant == "special", wide=variant == "wide")
    if n > 40:
        x[10:30] = x[5]                               # a run of equal values
    _kmeans_cpu_equals_reference(cpu, x, bits, bs, iters)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_kmeans_cpu_boundaries_inside_one_run(cpu, bits):
    """Values a few ulps apart (4096 consecutive floats above 1.0, shuffled, and a few far ones), so
    that every boundary falls among values the CPU kernel's ordering does not separate (the same top
    18 bits of their sort keys): its counts within such a run still give the reference's bytes."""
    n = 5000
    x = (np.float32(1.0) + np.arange(n, dtype=np.float32) * np.finfo(np.float32).eps).astype(np.float32)
    x[4096:] = np.random.default_rng(3).standard_normal(n - 4096).astype(np.float32) * np.float32(4)
    x = x[np.random.default_rng(4).permutation(n)]
    _kmeans_cpu_equals_reference(cpu, x, bits, 0, 9)


@pytest.mark.parametrize("bs", [0, 20000, 7], ids=["tensor", "bs20000", "bs7"])
def test_kmeans_cpu_decode_in_spans(cpu, bs):
    """The KMeans decode splits by elements (spans of 16384 within a long bucket, whole buckets
    otherwise), so inputs of several spans take the prange path (when Numba has more than one
    thread); the decodes equal the reference's, overwriting and accumulating."""
    n = 70001
    assert n > cpu.task_span(bs or n, n)
    x = make_x(n, 11)
    h = wire.Header(5, 3, 0, 0, bs, 0, (n,)).words()
    p = np.zeros(wire.layout(5, n, 3, bs).total, np.uint8)
    op("kmeans", "encode", x.size, bits=3, bucket_size=bs, iters=2)(x, p, h, KEY)
    for accumulate in (False, True):
        a, b = make_x(n, 12), make_x(n, 12)
        R.kmeans_decode_ref(p, a, 3, bs, accumulate)
        op("kmeans", "decode", b.size, bits=3, bucket_size=bs, accumulate=accumulate)(p, b)
        assert nan_bits_equal(a, b)


# (1) the sizes at buckets of 64 (fewer elements than a bucket, partial last buckets, whole words of
# 64 bits and their tail) and one bucket per tensor, both scales taking turns, plain and special
# values taking turns; (2) each bucket size with each scale, plain and special
ONEBIT_CASES = ([(n, bs, k % 2 == 0, k % 4 < 2) for k, (n, bs) in enumerate(
                    (n, bs) for n in SIZES for bs in (0, 64))]
                + [(1000, bs, tm, sp) for bs in (0, 1, 7, 64, 512) for tm in (True, False) for sp in (False, True)])


def onebit_case(n, bs, two_mean, special=False):
    x = make_x(n, n * 13 + bs, special)
    mode = 0 if two_mean else 1
    h = wire.Header(3, 1, mode, 0, bs, 0, (n,)).words()
    return x, h, wire.layout(3, n, 1, bs, mode)


@pytest.mark.parametrize("n,bs,two_mean,special", ONEBIT_CASES,
                         ids=[f"n{n}-bs{bs or 'tensor'}-{'two_mean' if t else 'mean_abs'}-"
                              f"{'special' if sp else 'plain'}" for n, bs, t, sp in ONEBIT_CASES])
def test_onebit_cpu_equals_reference(cpu, n, bs, two_mean, special):
    x, h, lay = onebit_case(n, bs, two_mean, special)
    want = np.zeros(lay.total, np.uint8)
    got = np.full(lay.total, 0xA5, np.uint8)
    rref = np.empty(n, np.float32)
    with np.errstate(all="ignore"):
        R.onebit_encode_ref(x, want, h, bs, two_mean, residual=rref)
    xin = x.copy()
    op("onebit", "encode", xin.size, bucket_size=bs, two_mean=two_mean)(xin, got, h, 0, residual=xin)
    assert np.array_equal(want, got)
    assert nan_bits_equal(rref, xin)
    base = make_x(n, 5)
    for accumulate in (False, True):
        a, b = base.copy(), base.copy()
        with np.errstate(all="ignore"):
            R.onebit_decode_ref(want, a, bs, two_mean, accumulate)
        op("onebit", "decode", b.size, bucket_size=bs, two_mean=two_mean, accumulate=accumulate)(want, b)
        assert bits_equal(a, b)


PAR_CASES = [(70001, 1, 3, True, True), (70001, 7, 4, True, False), (100000, 512, 8, False, True),
             (65536, 64, 2, False, False)]


@pytest.mark.parametrize("n,bs,bits,stochastic,l2", PAR_CASES, ids=[_ids(*c) for c in PAR_CASES])
def test_cpu_parallel_chunks_equal_reference(cpu, n, bs, bits, stochastic, l2):
    """Inputs of several chunks take the prange path (when Numba has more than one thread)."""
    assert -(-n // bs) > cpu.chunk_buckets(bs, n)
    x, h, lay = qsgd_case(n, bs, bits, stochastic, l2)
    want = np.zeros(lay.total, np.uint8)
    got = np.full(lay.total, 0xA5, np.uint8)
    R.qsgd_encode_ref(x, want, h, bits, bs, stochastic, l2, KEY)
    op("qsgd", "encode", x.size, bits=bits, bucket_size=bs, stochastic=stochastic, norm_l2=l2)(x, got, h, KEY)
    assert np.array_equal(want, got)
    a, b = np.ones(n, np.float32), np.ones(n, np.float32)
    R.qsgd_decode_ref(want, a, bits, bs, True)
    op("qsgd", "decode", b.size, bits=bits, bucket_size=bs, accumulate=True)(want, b)
    assert bits_equal(a, b)
    for tm in (True, False):
        x1, h1, lay1 = onebit_case(n, bs, tm)
        want = np.zeros(lay1.total, np.uint8)
        got = np.full(lay1.total, 0xA5, np.uint8)
        R.onebit_encode_ref(x1, want, h1, bs, tm)
        op("onebit", "encode", x1.size, bucket_size=bs, two_mean=tm)(x1, got, h1, 0)
        assert np.array_equal(want, got)
        a, b = np.ones(n, np.float32), np.ones(n, np.float32)
        R.onebit_decode_ref(want, a, bs, tm, True)
        op("onebit", "decode", b.size, bucket_size=bs, two_mean=tm, accumulate=True)(want, b)
        assert bits_equal(a, b)


LONG_CASES = [(70001, 0), (70001, 20000), (40000, 8193), (8192, 0), (8193, 0)]


@pytest.mark.parametrize("n,bs", LONG_CASES, ids=[f"n{n}-bs{bs or 'tensor'}" for n, bs in LONG_CASES])
@pytest.mark.parametrize("special", [False, True], ids=["plain", "special"])
def test_cpu_long_buckets_equal_reference(cpu, n, bs, special):
    """Buckets of more than 8192 elements: sums over segments (reference.lane_sum_ref), on the two
    codecs whose scales are sums (QSGD with the L2 norm, both 1-bit scales). The 1-bit kernels split
    such buckets into several tasks (cpu.task_span): encode, residual, decode and the fused decodes."""
    assert n < 40000 or -(-n // cpu.task_span(bs or n, n)) > 1
    for tm in (True, False):
        x, h, lay = onebit_case(n, bs, tm, special)
        want = np.zeros(lay.total, np.uint8)
        got = np.full(lay.total, 0xA5, np.uint8)
        rref, rcpu = np.empty(n, np.float32), np.empty(n, np.float32)
        with np.errstate(all="ignore"):
            R.onebit_encode_ref(x, want, h, bs, tm, residual=rref)
        op("onebit", "encode", x.size, bucket_size=bs, two_mean=tm)(x, got, h, 0, residual=rcpu)
        assert np.array_equal(want, got), tm
        assert nan_bits_equal(rref, rcpu)
        for accumulate in (False, True):
            a, b = make_x(n, 5), make_x(n, 5)
            with np.errstate(all="ignore"):
                R.onebit_decode_ref(want, a, bs, tm, accumulate)
            op("onebit", "decode", b.size, bucket_size=bs, two_mean=tm, accumulate=accumulate)(want, b)
            assert bits_equal(a, b)
        two = np.concatenate([want, got])
        a, b = np.empty(n, np.float32), np.empty(n, np.float32)
        with np.errstate(all="ignore"):
            R.onebit_decode_sum_ref(two, 2, a, bs, tm)
        op("onebit", "decode_sum", b.size, bucket_size=bs, two_mean=tm)(two, 2, b)
        assert bits_equal(a, b)
    qbs = bs or n
    x, h, lay = qsgd_case(n, qbs, 4, True, True, make_x(n, n * 13 + qbs, special))
    want = np.zeros(lay.total, np.uint8)
    got = np.full(lay.total, 0xA5, np.uint8)
    with np.errstate(all="ignore"):
        R.qsgd_encode_ref(x, want, h, 4, qbs, True, True, KEY)
    op("qsgd", "encode", x.size, bits=4, bucket_size=qbs, stochastic=True, norm_l2=True)(x, got, h, KEY)
    assert np.array_equal(want, got)


WIDTH_CASES = [(4097, 7, bits) for bits in range(2, 17)] + [(70001, 512, 7), (70001, 512, 13)]


@pytest.mark.parametrize("n,bs,bits", WIDTH_CASES, ids=[f"n{n}-bs{bs}-b{b}" for n, bs, b in WIDTH_CASES])
def test_cpu_every_width_equal_reference(cpu, n, bs, bits):
    """The CPU kernels are compiled per bit width (constant shifts): every width, encode with error
    feedback and both decodes, against the reference; bucket 7 starts buckets off byte boundaries (one
    chunk: the serial kernels); 70001 elements at bucket 512 span several chunks (the parallel ones,
    also held by test_cpu_parallel_chunks_equal_reference at other widths)."""
    x, h, lay = qsgd_case(n, bs, bits, True, False)
    want = np.zeros(lay.total, np.uint8)
    got = np.full(lay.total, 0xA5, np.uint8)
    r_want, r_got = np.empty(n, np.float32), np.empty(n, np.float32)
    R.qsgd_encode_ref(x, want, h, bits, bs, True, False, KEY, residual=r_want)
    op("qsgd", "encode", x.size, bits=bits, bucket_size=bs, stochastic=True, norm_l2=False)(
        x, got, h, KEY, residual=r_got)
    assert np.array_equal(want, got)
    assert nan_bits_equal(r_want, r_got)
    for acc in (False, True):
        a, b = np.ones(n, np.float32), np.ones(n, np.float32)
        R.qsgd_decode_ref(want, a, bits, bs, acc)
        op("qsgd", "decode", b.size, bits=bits, bucket_size=bs, accumulate=acc)(want, b)
        assert nan_bits_equal(a, b)


# the 64-bit word pack's head depends on gcd(bits, 8): an odd width (3), 2 (6) and 4 (12), each at
# every offset class of the payload; at 70001 elements (parallel chunks) odd widths of three classes
# mod 8, those whose parallel kernels the cases above compile anyway (each width is a compile)
ALIGN_CASES = ([(4097, bits, off) for bits in (3, 6, 12) for off in (0, 1, 4, 6)]
               + [(70001, 3, 1), (70001, 13, 4), (70001, 7, 6)])


@pytest.mark.parametrize("n,bits,off", ALIGN_CASES, ids=[f"n{n}-b{b}-at{o}" for n, b, o in ALIGN_CASES])
def test_cpu_pack_at_any_alignment(cpu, n, bits, off):
    """The odd widths' encode packs 64 codes at a time as 64-bit words from the first group that
    starts on an 8-byte boundary, the groups before it and after the last whole 64 byte by byte: a
    payload starting at any byte offset of its buffer (and, at 70001 elements, chunks starting at
    every offset) holds the reference's bytes and decodes (written and accumulated) to the
    reference's values, and nothing outside the payload is written."""
    for bs in (7, 512):
        x, h, lay = qsgd_case(n, bs, bits, True, False)
        want = np.zeros(lay.total, np.uint8)
        R.qsgd_encode_ref(x, want, h, bits, bs, True, False, KEY)
        buf = np.full(lay.total + 16, 0xA5, np.uint8)
        got = buf[off:off + lay.total]
        op("qsgd", "encode", x.size, bits=bits, bucket_size=bs, stochastic=True, norm_l2=False)(x, got, h, KEY)
        assert np.array_equal(want, got), f"bs {bs}: first differing byte {np.flatnonzero(want != got)[:5]}"
        assert (buf[:off] == 0xA5).all() and (buf[off + lay.total:] == 0xA5).all()
        for accumulate in (False, True):
            a, b = np.ones(n, np.float32), np.ones(n, np.float32)
            R.qsgd_decode_ref(want, a, bits, bs, accumulate)
            op("qsgd", "decode", b.size, bits=bits, bucket_size=bs, accumulate=accumulate)(got, b)
            assert bits_equal(a, b), f"bs {bs}: decode differs at {np.flatnonzero(a != b)[:5]}"


def test_half_conversions_equal_numpy(cpu):
    """The fp16 codec's CPU kernels convert as NumPy's astype does, bit for bit: every float16 pattern
    back to float32 (written and accumulated), and float32 patterns of every exponent with the
    significands around each rounding tie, NaN payloads and random bits, to float16, with the
    residual x - float32(float16(x)) written in place."""
    hb = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    want = hb.view(np.float16).astype(np.float32)
    out = np.full(hb.size, np.nan, np.float32)
    cpu.half_decode_cpu(hb, out, False)
    assert bits_equal(want, out)
    acc = np.full(hb.size, 1.5, np.float32)
    cpu.half_decode_cpu(hb, acc, True)
    with np.errstate(invalid="ignore"):              # inf + -inf
        assert nan_bits_equal(np.float32(1.5) + want, acc)
    rng = np.random.default_rng(11)
    ties = np.array([0, 1, 0x7FF, 0x800, 0xFFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x2FFF, 0x3000, 0x3001,
                     0x7FE000, 0x7FEFFF, 0x7FF000, 0x7FF001, 0x7FFFFF, 0x400000, 0x400001], np.uint32)
    sigs = np.concatenate([ties, rng.integers(0, 1 << 23, 200, dtype=np.uint32)])
    bits = ((np.arange(256, dtype=np.uint32) << 23)[:, None] | sigs[None, :]).ravel()
    bits = np.concatenate([bits, bits | np.uint32(1 << 31),
                           rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)])
    x = bits.view(np.float32)
    with np.errstate(all="ignore"):
        h_want = x.astype(np.float16)
        r_want = x - h_want.astype(np.float32)
    h = np.zeros(x.size, np.uint16)
    xin = x.copy()
    cpu.half_encode_cpu(xin, h, residual=xin)
    assert np.array_equal(h_want.view(np.uint16), h), f"first differing input {bits[np.flatnonzero(h_want.view(np.uint16) != h)[:3]]}"
    assert nan_bits_equal(r_want, xin)


def test_canonical_sum_order():
    """lane_sum_ref is exactly: 32 sequential lane sums, then the stride-16..1 tree; above 8192 terms,
    that lane sum taken over the lane sums of the runs of 8192."""
    def lanes(t):
        p = [np.float32(0)] * 32
        for i, v in enumerate(t):
            p[i % 32] = np.float32(p[i % 32] + v)
        for stride in (16, 8, 4, 2, 1):
            for l in range(stride):
                p[l] = np.float32(p[l] + p[l + stride])
        return p[0]

    rng = np.random.default_rng(3)
    for n in (1, 31, 32, 33, 100, 1000, 8192, 8193, 20000, 300000):
        t = (rng.standard_normal(n) * 10 ** rng.uniform(-3, 3, n)).astype(np.float32)
        want = lanes(t) if n <= 8192 else lanes([lanes(t[i:i + 8192]) for i in range(0, n, 8192)])
        padded = np.zeros((1, -(-n // 32) * 32), np.float32)
        padded[0, :n] = t
        assert bits_equal(R.lane_sum_ref(padded), [want]), n


def _fast_quotient_mismatches():
    """(quotients that differ from a / unit, positivity tests that differ, cases) for the v3 encode's
    division (numba_kernels/_scalar.py, DIV_*): q = fma(fma(-q0, unit, a), y, q0) with q0 = RN(a*y),
    y = RN(1/unit), against the IEEE quotient where a / unit >= 2**-40; and a > RD(unit * 2**-150)
    against a / unit rounding to a positive float32 below that. Every float32 significand of the unit
    (exponents drawn in [-60, 59]), 8 quotients each over 2**-40 .. 2**16 (two of them nudged by up
    to 1e-7 relative), and 4 tiny ones around the positivity boundary."""
    import llvmlite.ir as lir
    from numba import njit, types
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def fma32(typingctx, a, b, c):
        def codegen(context, builder, sig, args):
            f32 = lir.FloatType()
            fn = cgutils.get_or_insert_function(builder.module, lir.FunctionType(f32, [f32] * 3),
                                                "llvm.fma.f32")
            return builder.call(fn, args)
        return types.float32(types.float32, types.float32, types.float32), codegen

    @njit(cache=False)
    def run(seed):
        np.random.seed(seed)
        one = np.float32(1.0)
        bad_q = 0
        bad_pos = 0
        cases = 0
        for m in range(1 << 23):
            e = np.random.randint(-60, 60)
            unit = np.float32((1.0 + m / 8388608.0) * 2.0 ** e)
            y = one / unit
            for t in range(8):
                qe = np.random.uniform(-40.0, 16.0)
                a = np.float32(np.float64(unit) * 2.0 ** qe * (1.0 + np.random.random() * 1e-7 * (t < 2)))
                if a / unit < np.float32(2.0 ** -40) or not np.isfinite(a):
                    continue
                q0 = a * y
                q = fma32(fma32(-q0, unit, a), y, q0)
                cases += 1
                if q != a / unit:
                    bad_q += 1
            # positivity below 2**-40: a / unit > 0  <=>  a > RD(unit * 2**-150)
            p = np.float64(unit * np.float32(2.0 ** -50)) * 2.0 ** -100      # exact in float64
            thr = np.float32(p)
            if np.float64(thr) > p:
                thr = np.float32(np.nextafter(thr, np.float32(0.0)))
            for t in range(4):
                a = np.float32(p * (1.0 + (np.random.random() - 0.5) * 0.5 ** (t * 6)))
                cases += 1
                if (a / unit > 0) != (a > thr):
                    bad_pos += 1
        return bad_q, bad_pos, cases

    return run(7)


def test_fast_quotient_identity():
    bad_q, bad_pos, cases = _fast_quotient_mismatches()
    assert cases > 40_000_000
    assert (bad_q, bad_pos) == (0, 0)


@pytest.mark.parametrize("where", ["ref", "cpu"])
def test_decode_expect_raises_before_writing(cpu, where):
    """A header that fails the check against ``expect`` raises PayloadError naming the fault, and
    ``out`` is untouched; a matching ``expect`` decodes as without one."""
    dec = {"ref": (R.qsgd_decode_ref, R.onebit_decode_ref),
           "cpu": (lambda p, o, bits, bs, acc, *rest: op("qsgd", "decode", o.size, bits=bits, bucket_size=bs,
                                                          accumulate=acc)(p, o, *rest),
                   lambda p, o, bs, tm, acc, *rest: op("onebit", "decode", o.size, bucket_size=bs, two_mean=tm,
                                                        accumulate=acc)(p, o, *rest))}[where]
    x, h, lay = qsgd_case(100, 64, 4, True, False)
    p = np.zeros(lay.total, np.uint8)
    R.qsgd_encode_ref(x, p, h, 4, 64, True, False, KEY)
    good = wire.Expect(2, 4, 0, 0, 64, 100, 7, True)
    a, b = np.zeros(100, np.float32), np.zeros(100, np.float32)
    R.qsgd_decode_ref(p, a, 4, 64, False)
    dec[0](p, b, 4, 64, False, None, None, good)
    assert bits_equal(a, b)
    for exp, words in ((good._replace(bits=8), "bits differ"), (good._replace(name_hash=8), "name hash"),
                       (good._replace(numel=101), "numel differs")):
        out = np.full(100, 5.0, np.float32)
        with pytest.raises(wire.PayloadError, match=words):
            dec[0](p, out, 4, 64, False, None, None, exp)
        assert (out == 5.0).all()
    q = p.copy()
    q[30] ^= 1
    with pytest.raises(wire.PayloadError, match="bad header checksum"):
        dec[0](q, np.zeros(100, np.float32), 4, 64, False, None, None, good)
    x1, h1, lay1 = onebit_case(100, 0, True)
    p1 = np.zeros(lay1.total, np.uint8)
    R.onebit_encode_ref(x1, p1, h1, 0, True)
    e1 = wire.Expect(3, 1, 0, 0, 0, 100)
    dec[1](p1, np.zeros(100, np.float32), 0, True, False, None, None, e1)
    with pytest.raises(wire.PayloadError, match="mode differs"):
        dec[1](p1, np.zeros(100, np.float32), 0, True, False, None, None, e1._replace(mode=1))


def test_wide_marks_only_the_function_that_calls_it():
    """``_wide()`` (called first in every CPU kernel's parallel task) gives the function it is
    compiled into LLVM's ``prefer-vector-width=512`` attribute and emits no code; a function without
    the call keeps LLVM's default."""
    from numba import njit
    from numba_kernels._cpu_base import _wide

    @njit(cache=False)
    def wide(x):
        _wide()
        return x + 1

    @njit(cache=False)
    def plain(x):
        return x + 1

    assert wide(1) == plain(1) == 2
    assert '"prefer-vector-width"="512"' in wide.inspect_llvm(wide.signatures[0])
    assert "prefer-vector-width" not in plain.inspect_llvm(plain.signatures[0])


def test_header_check_reference():
    h = wire.Header(2, 4, 0, 0, 512, 0, (10, 3), name_hash=wire.name_hash("w"))
    lay = wire.layout(2, 30, 4, 512)
    p = np.zeros(lay.total, np.uint8)
    p[:64] = np.frombuffer(h.to_bytes(), np.uint8)
    args = (2, 4, 0, 0, 512, 30, wire.name_hash("w"), True)
    assert R.header_errors_ref(p, *args) == 0
    assert R.header_errors_ref(p, 2, 8, 0, 1, 64, 31, 5, True) == 8 | 32 | 64 | 128 | 256
    q = p.copy()
    q[30] ^= 1                                  # shape byte: only the header checksum sees it
    assert R.header_errors_ref(q, *args) == 512
    q = p.copy()
    q[0] = 0
    assert R.header_errors_ref(q, *args) & 1


# ---- CUDA kernels, in a subprocess (simulator by default) ------------------------------------------------

# (n, bucket, bits, stochastic, l2): both kernel paths' cases
SIM_QSGD = [(0, 7, 4, True, False), (1, 7, 2, True, True), (9, 7, 3, False, False), (33, 64, 5, True, True),
            (33, 1, 16, False, True), (100, 64, 8, True, False), (100, 7, 12, False, True),
            (300, 16, 4, True, False), (300, 9000, 3, True, True), (70, 3, 7, True, False),
            # general path, buckets above FUSE_MAX over several pack-only blocks
            (3000, 9000, 3, True, True), (2500, 10000, 5, False, False),
            # a bucket of 2 segments (its scale summed in two levels)
            (8200, 8200, 4, True, True),
            # warp per bucket: bits dividing 32, buckets of >= 32 elements holding whole words (the
            # kernel follows bits, bucket and scale, not the length), partial last buckets
            (310, 96, 4, True, True), (257, 32, 2, False, False), (65, 32, 2, False, False),
            (130, 64, 16, True, False), (130, 64, 16, True, True), (600, 512, 8, True, False),
            (65, 40, 4, False, True), (700, 640, 4, True, False), (300, 128, 4, True, False),
            # code words assembled by recursive halving (steps in registers >= codes per word)
            (301, 256, 4, True, False), (600, 512, 2, True, True), (300, 128, 8, False, False),
            (400, 352, 4, True, True)]
# (n, bucket (0: the tensor), two_mean)
SIM_ONEBIT = [(0, 64, True), (1, 0, True), (33, 7, False), (100, 0, False), (100, 64, True), (70, 1, True),
              (200, 9000, False), (300, 96, False), (100, 32, True), (3000, 0, True), (5000, 0, False),
              (8200, 0, True), (8300, 8250, False)]          # (the last two: sums over segments)


SIM_SORTQUANT = [(0, 7, 4, 2, True), (1, 7, 4, 2, True), (9, 7, 5, 3, False), (33, 64, 2, 1, True),
                 (100, 64, 8, 2, False), (130, 32, 16, 4, True), (300, 100, 3, 1, True), (70, 1, 4, 2, False),
                 (200, 200, 12, 4, False)]


# (n, bucket (0: the tensor), bits, iters): samples drawn above 1024 values, tiles of 4096 per block
SIM_KMEANS = [(0, 0, 4, 3), (1, 0, 2, 3), (9, 7, 3, 2), (100, 0, 4, 5), (300, 64, 2, 3), (200, 0, 8, 2),
              (1500, 0, 3, 2), (5000, 4500, 1, 2)]


def _km_id(n, bs, bits, iters):
    return f"kmeans-n{n}-bs{bs or 'tensor'}-b{bits}-it{iters}"


def _sq_id(n, bs, bits, sb, st):
    return f"sortquant-n{n}-bs{bs}-b{bits}s{sb}-{'stoch' if st else 'det'}"


def _variants(n):
    """Plain, special-valued and wide-range inputs up to 300 elements; above, plain only (slow in the
    simulator; the data variants run the same kernels at the smaller sizes), but special values in the
    buckets of two segments too."""
    return ("", "-special", "-wide") if n <= 300 else ("", "-special") if n > 8000 else ("",)


def _child():
    """Runs in the subprocess: every case, results as JSON on stdout (plus the kernels compiled)."""
    import warnings
    warnings.simplefilter("ignore")
    from numba import cuda
    import numba_kernels.cuda as K
    out = {}
    dev = cuda.to_device

    def nan_eq(a, b):
        return nan_bits_equal(a, b)

    def encoded_alike(x, lay, encode_ref, encode_cuda):
        """(the reference's payload, whether the CUDA encode wrote the same bytes and, in place, the
        same residual); NaN scales may differ in NaN payload bits only (CUDA makes canonical NaNs)."""
        want = np.zeros(lay.total, np.uint8)
        rref = np.empty(x.size, np.float32)
        with np.errstate(all="ignore"):
            encode_ref(x, want, rref)
        d = dev(np.full(lay.total, 0xA5, np.uint8))
        xd = dev(x)
        encode_cuda(xd, d, xd)                          # residual in place
        got = d.copy_to_host()
        sc = slice(lay.scales_offset, lay.total)
        return want, bool(np.array_equal(want[:lay.scales_offset], got[:lay.scales_offset]) and nan_eq(
            want[sc].view(np.float32), got[sc].view(np.float32)) and nan_eq(rref, xd.copy_to_host()))

    for case in SIM_QSGD:
        n, bs, bits, st, l2 = case
        for variant in _variants(n):
            x, h, lay = qsgd_case(n, bs, bits, st, l2, x=make_x(n, n + bs, variant == "-special",
                                                                variant == "-wide") if variant else None)
            want, ok = encoded_alike(
                x, lay, lambda x_, p, r: R.qsgd_encode_ref(x_, p, h, bits, bs, st, l2, KEY, residual=r),
                lambda x_, p, r: op("qsgd", "encode", x_.size, bits=bits, bucket_size=bs, stochastic=st,
                                    norm_l2=l2, device=True)(
                    x_, p, h, KEY, residual=r))
            a = make_x(n, 5)
            o = dev(a.copy())
            with np.errstate(all="ignore"):
                R.qsgd_decode_ref(want, a, bits, bs, True)
            op("qsgd", "decode", o.size, bits=bits, bucket_size=bs, accumulate=True, device=True)(dev(want), o)
            out["qsgd-" + _ids(*case) + variant] = [bool(ok), nan_eq(a, o.copy_to_host())]
    for case in SIM_SORTQUANT:
        n, bs, bits, sb, st = case
        for variant in _variants(n):
            x = make_x(n, n + bs + bits, variant == "-special", variant == "-wide")
            if n > 40:
                x[10:30] = x[5]                       # ties across group bounds
            h = wire.Header(4, bits, 0 if st else 1, sb, bs, 0, (n,), name_hash=7).words()
            lay = wire.layout(4, n, bits, bs, 0, sb)
            want, ok = encoded_alike(
                x, lay, lambda x_, p, r: R.sortquant_encode_ref(x_, p, h, bits, sb, bs, st, KEY, residual=r),
                lambda x_, p, r: op("sortquant", "encode", x_.size, bits=bits, split_bits=sb, bucket_size=bs,
                                    stochastic=st, device=True)(
                    x_, p, h, KEY, residual=r))
            a = make_x(n, 5)
            o = dev(a.copy())
            with np.errstate(all="ignore"):
                R.sortquant_decode_ref(want, a, bits, sb, bs, True)
            status = dev(np.zeros(2, np.int32))
            op("sortquant", "decode", o.size, bits=bits, split_bits=sb, bucket_size=bs, accumulate=True,
               device=True)(
                dev(want), o, 0, status, wire.Expect(4, bits, 0 if st else 1, sb, bs, n, 7, True))
            dec = nan_eq(a, o.copy_to_host()) and int(status.copy_to_host()[0]) == 0
            if n:           # another tensor's payload: NaN everywhere, the reason in the status
                o = dev(np.zeros(n, np.float32))
                op("sortquant", "decode", o.size, bits=bits, split_bits=sb, bucket_size=bs, accumulate=False,
                   device=True)(
                    dev(want), o, 0, status, wire.Expect(4, bits, 0 if st else 1, sb, bs, n, 8, True))
                dec = dec and bool(np.isnan(o.copy_to_host()).all()) and int(status.copy_to_host()[0]) == 256
            out[_sq_id(*case) + variant] = [bool(ok), bool(dec)]
    for case in SIM_KMEANS:
        n, bs, bits, iters = case
        for variant in _variants(n):
            x = make_x(n, n + bs + bits, variant == "-special", variant == "-wide")
            h = wire.Header(5, bits, 0, 0, bs, 0, (n,), name_hash=7).words()
            lay = wire.layout(5, n, bits, bs)
            want, ok = encoded_alike(
                x, lay, lambda x_, p, r: R.kmeans_encode_ref(x_, p, h, bits, bs, iters, KEY, residual=r),
                lambda x_, p, r: op("kmeans", "encode", x_.size, bits=bits, bucket_size=bs, iters=iters,
                                    device=True)(
                    x_, p, h, KEY, residual=r))
            a = make_x(n, 5)
            o = dev(a.copy())
            with np.errstate(all="ignore"):
                R.kmeans_decode_ref(want, a, bits, bs, True)
            status = dev(np.zeros(2, np.int32))
            op("kmeans", "decode", o.size, bits=bits, bucket_size=bs, accumulate=True, device=True)(
                dev(want), o, 0, status, wire.Expect(5, bits, 0, 0, bs, n, 7, True))
            dec = nan_eq(a, o.copy_to_host()) and int(status.copy_to_host()[0]) == 0
            if n:           # another tensor's payload: NaN everywhere, the reason in the status
                o = dev(np.zeros(n, np.float32))
                op("kmeans", "decode", o.size, bits=bits, bucket_size=bs, accumulate=False, device=True)(
                    dev(want), o, 0, status, wire.Expect(5, bits, 0, 0, bs, n, 8, True))
                dec = dec and bool(np.isnan(o.copy_to_host()).all()) and int(status.copy_to_host()[0]) == 256
            out[_km_id(*case) + variant] = [bool(ok), bool(dec)]
    for n, bs, tm in SIM_ONEBIT:
        x, h, lay = onebit_case(n, bs, tm, special=n > 50)
        want, ok = encoded_alike(x, lay, lambda x_, p, r: R.onebit_encode_ref(x_, p, h, bs, tm, residual=r),
                                 lambda x_, p, r: op("onebit", "encode", x_.size, bucket_size=bs, two_mean=tm,
                                                     device=True)(
                                     x_, p, h, 0, residual=r))
        a = make_x(n, 5)
        o = dev(a.copy())
        with np.errstate(all="ignore"):
            R.onebit_decode_ref(want, a, bs, tm, False)
        op("onebit", "decode", o.size, bucket_size=bs, two_mean=tm, accumulate=False, device=True)(dev(want), o)
        out[f"onebit-n{n}-bs{bs}-{'two_mean' if tm else 'mean_abs'}"] = [bool(ok), nan_eq(a, o.copy_to_host())]
    # header check kernel == header_errors_ref, and a failed check makes the decode write NaN: by the
    # standalone check kernel before a decode that reads status[0] ("check"), or inside the decode
    # ("expect"); status[1] keeps the bits it had and gains the new ones
    h = wire.Header(2, 4, 0, 0, 64, 0, (100,), name_hash=wire.name_hash("w"))
    lay = wire.layout(2, 100, 4, 64)
    p = np.zeros(lay.total, np.uint8)
    R.qsgd_encode_ref(make_x(100, 1), p, h.words(), 4, 64, True, False, KEY)
    variants = {"good": p}
    for name, idx in (("magic", 1), ("version", 4), ("shape", 25), ("hdr_crc", 63), ("cfg_crc", 60)):
        q = p.copy()
        q[idx] ^= 0x10
        variants[name] = q
    expectations = {"as-sent": (2, 4, 0, 0, 64, 100, wire.name_hash("w"), True),
                    "other-config": (2, 8, 1, 1, 128, 101, wire.name_hash("v"), True),
                    "no-name-check": (2, 4, 0, 0, 64, 100, 0, False),
                    "raw-method": (1, 16, 0, 0, 0, 100, 0, False)}
    for vname, q in variants.items():
        for ename, exp in expectations.items():
            want = R.header_errors_ref(q, *exp)
            for how in ("check", "expect"):
                status = dev(np.array([0, 4096], np.int32))
                dq = dev(q)
                o = dev(np.zeros(100, np.float32))
                if how == "check":
                    K.check_header_cuda(dq, status, wire.Expect(*exp))
                    op("qsgd", "decode", o.size, bits=4, bucket_size=64, accumulate=False, device=True)(
                        dq, o, 0, status)
                else:
                    op("qsgd", "decode", o.size, bits=4, bucket_size=64, accumulate=False, device=True)(
                        dq, o, 0, status, wire.Expect(*exp))
                st = status.copy_to_host()
                y = o.copy_to_host()
                nan_ok = bool(np.isnan(y).all()) if want else not np.isnan(y).any()
                out[f"{how}-{vname}-{ename}"] = [int(st[0]) == want and int(st[1]) == want | 4096, nan_ok]
    # nothing to decode: the check still runs and reports
    p0 = np.zeros(wire.layout(2, 0, 4, 64).total, np.uint8)
    R.qsgd_encode_ref(np.zeros(0, np.float32), p0, wire.Header(2, 4, 0, 0, 64, 0, (0,)).words(), 4, 64,
                      True, False, KEY)
    status = dev(np.zeros(2, np.int32))
    op("qsgd", "decode", (dev(np.zeros(0, np.float32))).size, bits=4, bucket_size=64, accumulate=False,
       device=True)(
        dev(p0), dev(np.zeros(0, np.float32)), 0, status, wire.Expect(2, 4, 0, 0, 64, 0, 5, True))
    out["expect-empty"] = [int(status.copy_to_host()[0]) == 256, True]
    out["compiled"] = [list(k) for k in K.kernels]
    json.dump(out, sys.stdout)


@pytest.fixture(scope="module")
def cuda_results():
    return children.json_result("test_kernels", "cuda_results")


CUDA_NAMES = ([f"qsgd-{_ids(*c)}{v}" for c in SIM_QSGD for v in _variants(c[0])]
              + [f"onebit-n{n}-bs{bs}-{'two_mean' if tm else 'mean_abs'}" for n, bs, tm in SIM_ONEBIT]
              + [_sq_id(*c) + v for c in SIM_SORTQUANT for v in _variants(c[0])]
              + [_km_id(*c) + v for c in SIM_KMEANS for v in _variants(c[0])]
              + [f"{how}-{v}-{e}" for how in ("check", "expect")
                 for v in ("good", "magic", "version", "shape", "hdr_crc", "cfg_crc")
                 for e in ("as-sent", "other-config", "no-name-check", "raw-method")]
              + ["expect-empty"])


@pytest.mark.parametrize("case", CUDA_NAMES)
def test_cuda_kernel_equals_reference(cuda_results, case):
    """[payload/check equal, decode equal / NaN-on-error] for each CUDA case."""
    assert case in cuda_results, sorted(cuda_results)[:5]
    assert cuda_results[case] == [True, True]


def test_cuda_both_kernel_paths_ran(cuda_results):
    """The cases above went through the kernels of both paths (warp: qsgd at 2, 4, 8, 16 bits with
    every scale, and 1-bit with both scales, buckets kept in registers (up to 512 elements) and re-read
    (above), paired hash draws, code words assembled by recursive halving (steps in registers >= codes
    per word), decodes of whole and partial buckets; general: its fused encode and decode, the reduce
    + pack-only encode), with residuals (without: tests/test_codec_cuda_sim.py)."""
    got = {tuple(k) for k in cuda_results["compiled"]}
    # warp_encode_<bits>_<scale>_<pack>_<steps in registers: 0 = run-time loop>_<paired>_<residual>
    want = {("warp_encode", 4, 1, 1, 4, False, True), ("warp_encode", 2, 0, 0, 1, False, True),
            ("warp_encode", 16, 0, 1, 2, True, True), ("warp_encode", 8, 0, 1, 2, True, True),
            ("warp_encode", 8, 0, 1, 16, True, True), ("warp_encode", 4, 1, 0, 2, False, True),
            ("warp_encode", 4, 0, 1, 0, False, True), ("warp_encode", 4, 0, 1, 4, True, True),
            ("warp_encode", 1, 3, 2, 4, False, True), ("warp_encode", 1, 2, 2, 1, False, True),
            ("warp_encode", 1, 2, 2, 2, False, True), ("warp_encode", 4, 0, 1, 8, True, True),
            ("warp_encode", 2, 1, 1, 16, True, True), ("warp_encode", 8, 0, 0, 4, False, True),
            ("warp_encode", 4, 1, 1, 16, False, True),
            ("warp_decode", 4, 0, 4), ("warp_decode", 2, 0, 1), ("warp_decode", 16, 0, 2),
            ("warp_decode", 8, 0, 2),
            ("warp_decode", 8, 0, 16), ("warp_decode", 4, 0, 2), ("warp_decode", 4, 0, 0),
            ("warp_decode", 4, 0, 8), ("warp_decode", 4, 0, 11), ("warp_decode", 2, 0, 16),
            ("warp_decode", 1, 1, 1), ("warp_decode", 1, 1, 2), ("warp_decode", 1, 2, 3),
            ("block_encode", 3, 1, 1, True), ("block_encode", 5, 0, 0, True), ("block_encode", 1, 2, 2, True),
            ("block_encode", 1, 3, 2, True), ("block_decode", 3, 0),
            ("block_decode", 1, 1), ("reduce", 1), ("reduce", 0), ("check",)}
    assert want <= got, sorted(want - got)
