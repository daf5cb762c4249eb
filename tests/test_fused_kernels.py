"""The fused kernels (several payloads per launch) against their NumPy references, bit for bit.

* the references are compositions of the single-payload references; the identities that define them
  are tested here too (decode_sum of one payload == decode; reduce_requantize == decode_sum, add,
  encode with residual; decode_chunks == one decode per chunk);
* CPU (``numba_kernels.prepare(..., device=False)``) == reference, one case per code path: n = 1, 2,
  3 payloads, sizes on either side of the bucket, each pack family's bit width, both roundings and
  norms, NaN/Inf buckets, residual in and out, 1-bit with both scales
  and one bucket per tensor; a bad payload among the n raises ``PayloadError`` before anything is
  written;
* CUDA (the same ops with ``device=True``) in a subprocess with ``NUMBA_ENABLE_CUDASIM=1`` on small
  cases covering both sides of the warp/block boundaries; a bad payload gives NaN and status bits there.
"""
import json
import os
import sys

import numpy as np
import pytest

from numba_kernels import prepare, reference as R, wire
from numba_kernels._scalar import SEGMENT

sys.path.insert(0, os.path.dirname(__file__))
import children  # noqa: E402
from data import KEY_FUSED as KEY, chunk_payloads, make_x, onebit_payloads, qsgd_payloads  # noqa: E402


def op(method, kind, numel, device=False, **params):
    """The prepared op of one call (``numba_kernels.prepare``)."""
    return prepare(method, kind, device, numel, **params)

def bits_equal(a, b):
    return np.array_equal(np.asarray(a, np.float32).view(np.uint32), np.asarray(b, np.float32).view(np.uint32))


def nan_bits_equal(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return bool(np.array_equal(np.isnan(a), np.isnan(b))
                and bits_equal(np.where(np.isnan(a), 0, a), np.where(np.isnan(b), 0, b)))


def payload_equal(want, got, lay):
    """Bytes equal before the scales; scales equal up to NaN payload bits (CUDA's NaNs are canonical)."""
    sc = slice(lay.scales_offset, lay.total)
    return bool(np.array_equal(want[:lay.scales_offset], got[:lay.scales_offset])
                and nan_bits_equal(want[sc].view(np.float32), got[sc].view(np.float32)))


# ---- the references' identities -----------------------------------------------------------------------

@pytest.mark.parametrize("bits,bs", [(4, 64), (3, 7)])
def test_reference_identities(bits, bs):
    numel = 200
    buf, h, lay, exp = qsgd_payloads(3, numel, bits, bs, True, False, special=True)
    one = np.empty(numel, np.float32)
    R.qsgd_decode_sum_ref(buf[:lay.total], 1, one, bits, bs, expect=exp)
    d = np.empty(numel, np.float32)
    R.qsgd_decode_ref(buf[:lay.total], d, bits, bs, False)
    assert bits_equal(one, d)
    s = np.empty(numel, np.float32)
    with np.errstate(all="ignore"):
        R.qsgd_decode_sum_ref(buf, 3, s, bits, bs)
        fold = d.copy()
        for k in (1, 2):
            R.qsgd_decode_ref(buf[k * lay.total:(k + 1) * lay.total], fold, bits, bs, True)
    assert nan_bits_equal(s, fold)
    res = make_x(numel, 3)
    r0 = res.copy()
    outp = np.zeros(lay.total, np.uint8)
    with np.errstate(all="ignore"):
        R.qsgd_reduce_requantize_ref(buf, 3, res, outp, h, bits, bs, True, True, KEY)
        c = (s + r0).astype(np.float32)
        want = np.zeros(lay.total, np.uint8)
        R.qsgd_encode_ref(c, want, h, bits, bs, True, True, KEY)
        dd = np.empty(numel, np.float32)
        R.qsgd_decode_ref(want, dd, bits, bs, False)
    assert np.array_equal(outp, want)
    assert nan_bits_equal(res, c - dd)
    g, nh, cexp = chunk_payloads(numel, 3 * bs * (64 // bs or 1), bits, bs, False, True)
    chunk = 3 * bs * (64 // bs or 1)
    o = np.empty(numel, np.float32)
    R.qsgd_decode_chunks_ref(g, o, bits, bs, chunk, name_hashes=nh, expect=cexp)
    off = 0
    for j, (a, b) in enumerate(R.chunk_ranges(numel, bs, chunk)):
        t = wire.layout(2, b - a, bits, bs).total
        dj = np.empty(b - a, np.float32)
        R.qsgd_decode_ref(g[off:off + t], dj, bits, bs, False)
        assert bits_equal(o[a:b], dj)
        off += t
    assert off == g.size


# ---- CPU == reference ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cpu():
    from numba_kernels import cpu
    return cpu


# (1) sizes on either side of a lane and a bucket (2 payloads, one configuration); (2) one payload
# (the sum is a decode) and three; (3) each pack family's width (2, 3, 4, 8, 16) at both bucket sizes
# (7: off byte boundaries), NaN/Inf buckets (m > 60), the roundings and norms taking turns
QSGD_SUM = ([(2, m, 64, 4, True, False) for m in (1, 31, 33, 64, 65, 200)]
            + [(n, 65, 7, 3, False, True) for n in (1, 3)]
            + [(3, 200, bs, bits) + ((True, False), (False, True))[k % 2] for k, (bits, bs) in enumerate(
                (bits, bs) for bits in (2, 3, 4, 8, 16) for bs in (7, 64))])


def _qid(n, m, bs, bits, st, l2):
    return f"n{n}-m{m}-bs{bs}-b{bits}-{'stoch' if st else 'det'}-{'l2' if l2 else 'max'}"


@pytest.mark.parametrize("n,m,bs,bits,st,l2", QSGD_SUM, ids=[_qid(*c) for c in QSGD_SUM])
def test_qsgd_fused_cpu_equals_reference(cpu, n, m, bs, bits, st, l2):
    special = m > 60
    buf, h, lay, exp = qsgd_payloads(n, m, bits, bs, st, l2, special)
    a, b = np.empty(m, np.float32), np.full(m, 9.0, np.float32)
    with np.errstate(all="ignore"):
        R.qsgd_decode_sum_ref(buf, n, a, bits, bs, expect=exp)
    op("qsgd", "decode_sum", b.size, bits=bits, bucket_size=bs)(buf, n, b, None, None, exp)
    assert nan_bits_equal(a, b)
    for resid in (False, True):
        r0 = make_x(m, 11) if resid else None
        ra, rb = (r0.copy(), r0.copy()) if resid else (None, None)
        pa, pb = np.zeros(lay.total, np.uint8), np.full(lay.total, 0xA5, np.uint8)
        with np.errstate(all="ignore"):
            R.qsgd_reduce_requantize_ref(buf, n, ra, pa, h, bits, bs, st, l2, KEY, expect=exp)
        op("qsgd", "reduce_requantize", int(h[2]), bits=bits, bucket_size=bs, stochastic=st, norm_l2=l2)(
            buf, n, rb, pb, h, KEY, None, None, exp)
        assert payload_equal(pa, pb, lay)
        if resid:
            assert nan_bits_equal(ra, rb)


# each chunk layout (one element, partial last chunks, one chunk, a chunk longer than the input),
# the widths 2, 5 and 8 taking turns
CHUNKS = [(m, bs, ch, (2, 5, 8)[k % 3]) for k, (m, bs, ch) in enumerate(
    ((1, 7, 7), (50, 7, 14), (200, 7, 63), (200, 64, 64), (129, 64, 128), (300, 64, 192), (64, 64, 128)))]


@pytest.mark.parametrize("m,bs,chunk,bits", CHUNKS, ids=[f"m{m}-bs{bs}-chunk{c}-b{b}" for m, bs, c, b in CHUNKS])
def test_qsgd_decode_chunks_cpu_equals_reference(cpu, m, bs, chunk, bits):
    g, nh, exp = chunk_payloads(m, chunk, bits, bs, True, False, special=True)
    a, b = np.empty(m, np.float32), np.full(m, 9.0, np.float32)
    with np.errstate(all="ignore"):
        R.qsgd_decode_chunks_ref(g, a, bits, bs, chunk, name_hashes=nh, expect=exp)
    op("qsgd", "decode_chunks", b.size, bits=bits, bucket_size=bs, chunk=chunk)(g, b, None, None, nh, exp)
    assert nan_bits_equal(a, b)


# one, two and three payloads; each size (one element, a partial bucket, NaN/Inf buckets above 100)
# at each bucket size (0: one per tensor), the scales taking turns; buckets of more than 8192
# elements, several tasks each (cpu.task_span)
ONEBIT_SUM = ([(n, 33, 7, n % 2 == 1) for n in (1, 2, 3)]
              + [(2, m, bs, k % 2 == 0) for k, (m, bs) in enumerate(
                  (m, bs) for m in (1, 33, 200) for bs in (0, 7, 64))]
              + [(2, 40000, 0, True), (2, 70001, 10000, False)])


@pytest.mark.parametrize("n,m,bs,tm", ONEBIT_SUM,
                         ids=[f"n{n}-m{m}-bs{bs or 'tensor'}-{'two_mean' if t else 'mean_abs'}"
                              for n, m, bs, t in ONEBIT_SUM])
def test_onebit_fused_cpu_equals_reference(cpu, n, m, bs, tm):
    buf, h, lay, exp = onebit_payloads(n, m, bs, tm, special=m > 100)
    a, b = np.empty(m, np.float32), np.full(m, 9.0, np.float32)
    with np.errstate(all="ignore"):
        R.onebit_decode_sum_ref(buf, n, a, bs, tm, expect=exp)
    op("onebit", "decode_sum", b.size, bucket_size=bs, two_mean=tm)(buf, n, b, None, None, exp)
    assert nan_bits_equal(a, b)
    for resid in (False, True):
        r0 = make_x(m, 11) if resid else None
        ra, rb = (r0.copy(), r0.copy()) if resid else (None, None)
        pa, pb = np.zeros(lay.total, np.uint8), np.full(lay.total, 0xA5, np.uint8)
        with np.errstate(all="ignore"):
            R.onebit_reduce_requantize_ref(buf, n, ra, pa, h, bs, tm, expect=exp)
        op("onebit", "reduce_requantize", int(h[2]), bucket_size=bs, two_mean=tm)(
            buf, n, rb, pb, h, 0, None, None, exp)
        assert payload_equal(pa, pb, lay)
        if resid:
            assert nan_bits_equal(ra, rb)
    chunk = (bs * 3) if bs else max(m, 1)
    g, nh, cexp = chunk_payloads(m, chunk, 1, bs, False, False, two_mean=tm, special=True)
    a, b = np.empty(m, np.float32), np.full(m, 9.0, np.float32)
    with np.errstate(all="ignore"):
        R.onebit_decode_chunks_ref(g, a, bs, tm, chunk, name_hashes=nh)
    op("onebit", "decode_chunks", b.size, bucket_size=bs, two_mean=tm, chunk=chunk)(g, b, None, None, nh)
    assert nan_bits_equal(a, b)


def test_cpu_parallel_chunks_equal_reference(cpu):
    """Several parallel chunks (prange) in each fused kernel."""
    m, bs, bits = 70001, 64, 4
    buf, h, lay, exp = qsgd_payloads(2, m, bits, bs, True, True)
    a, b = np.empty(m, np.float32), np.empty(m, np.float32)
    R.qsgd_decode_sum_ref(buf, 2, a, bits, bs)
    op("qsgd", "decode_sum", b.size, bits=bits, bucket_size=bs)(buf, 2, b)
    assert bits_equal(a, b)
    ra, rb = make_x(m, 1), make_x(m, 1)
    pa, pb = np.zeros(lay.total, np.uint8), np.zeros(lay.total, np.uint8)
    R.qsgd_reduce_requantize_ref(buf, 2, ra, pa, h, bits, bs, True, True, KEY)
    op("qsgd", "reduce_requantize", int(h[2]), bits=bits, bucket_size=bs, stochastic=True, norm_l2=True)(
        buf, 2, rb, pb, h, KEY)
    assert np.array_equal(pa, pb) and bits_equal(ra, rb)
    chunk = 64 * 300
    g, nh, exp = chunk_payloads(m, chunk, bits, bs, False, False)
    R.qsgd_decode_chunks_ref(g, a, bits, bs, chunk)
    op("qsgd", "decode_chunks", b.size, bits=bits, bucket_size=bs, chunk=chunk)(g, b)
    assert bits_equal(a, b)


@pytest.mark.parametrize("where", ["ref", "cpu"])
def test_bad_payload_raises_before_writing(cpu, where):
    """A bad payload among the n (another tensor's name; a corrupt header) raises PayloadError and
    nothing is written; the same for a bad chunk."""
    if where == "ref":
        dsum, rr, dch = R.qsgd_decode_sum_ref, R.qsgd_reduce_requantize_ref, R.qsgd_decode_chunks_ref
    else:       # the ops, called as their references are
        def dsum(p, n, out, bits, bs, *rest):
            op("qsgd", "decode_sum", out.size, bits=bits, bucket_size=bs)(p, n, out, *rest)

        def rr(p, n, res, q, h, bits, bs, st, l2, key, *rest):
            op("qsgd", "reduce_requantize", int(h[2]), bits=bits, bucket_size=bs, stochastic=st,
               norm_l2=l2)(p, n, res, q, h, key, *rest)

        def dch(g, out, bits, bs, chunk, *rest):
            op("qsgd", "decode_chunks", out.size, bits=bits, bucket_size=bs, chunk=chunk)(g, out, *rest)
    m, bs, bits = 100, 64, 4
    buf, h, lay, exp = qsgd_payloads(3, m, bits, bs, True, False)
    other, _, _, _ = qsgd_payloads(1, m, bits, bs, True, False, name="v")
    bad = buf.copy()
    bad[lay.total:2 * lay.total] = other
    corrupt = buf.copy()
    corrupt[2 * lay.total + 30] ^= 1
    for b_, words in ((bad, "name hash"), (corrupt, "bad header checksum")):
        out = np.full(m, 5.0, np.float32)
        with pytest.raises(wire.PayloadError, match=words):
            dsum(b_, 3, out, bits, bs, None, None, exp)
        assert (out == 5.0).all()
        res = np.full(m, 5.0, np.float32)
        p = np.full(lay.total, 7, np.uint8)
        with pytest.raises(wire.PayloadError, match=words):
            rr(b_, 3, res, p, h, bits, bs, True, False, KEY, None, None, exp)
        assert (res == 5.0).all() and (p == 7).all()
    g, nh, cexp = chunk_payloads(m, 64, bits, bs, True, False)
    out = np.full(m, 5.0, np.float32)
    with pytest.raises(wire.PayloadError, match="name hash"):
        dch(g, out, bits, bs, 64, None, None, nh[::-1].copy(), cexp)
    with pytest.raises(wire.PayloadError, match="mode differs"):
        dch(g, out, bits, bs, 64, None, None, None, cexp._replace(mode=1))
    assert (out == 5.0).all()
    with pytest.raises(wire.PayloadError, match="bytes"):
        dsum(buf[:-4], 3, out, bits, bs)


# ---- CUDA, in a subprocess (simulator unless HVDQ_REAL_CUDA=1) ------------------------------------------
# Simulator sizes: BLOCK 64, decode chunks of 128 elements, fused encode blocks of ~256 elements;
# buckets of 32/64 elements with 2/4/8/16 bits are what the warp path takes for single payloads;
# 9000 > FUSE_MAX takes the reduce + pack encode.

SIM_SUM = [(1, 65, 64, 4, True, False), (2, 129, 32, 2, False, True), (3, 57, 7, 3, True, True),
           (2, 300, 64, 8, True, False), (3, 100, 9000, 3, False, False), (2, 128, 16, 16, True, True),
           (1, 1, 7, 5, False, False), (2, 0, 7, 4, True, False), (2, 600, 576, 4, True, False),
           (2, 8200, 8200, 4, True, True)]   # (the last: a bucket's sums over two segments, 8192 + 8)
SIM_ONEBIT = [(2, 100, 0, True), (3, 70, 7, False), (1, 130, 64, True), (2, 200, 9000, False),
              (2, 65, 32, False), (2, 8200, 0, True)]      # (the last: a sum over two segments)


def _sum_variants(m):
    """Plain and special-valued payloads; a bucket over segments (slow in the simulator) only the latter."""
    return ("-special",) if m > SEGMENT else ("", "-special")
SIM_CHUNKS = [(100, 7, 21, 3, None), (129, 64, 64, 4, None), (300, 32, 96, 2, None),
              (257, 16, 128, 8, None), (100, 0, 100, 1, True), (130, 64, 64, 1, False),
              (2100, 1024, 1024, 4, None)]


def _sim_sum_names():
    names = []
    for c in SIM_SUM:
        for sp in _sum_variants(c[1]):
            names += [f"{what}-{_qid(*c)}{sp}" for what in ("sum", "rr", "rr-resid")]
        names += [f"bad-sum-{_qid(*c)}", f"bad-rr-{_qid(*c)}"]
    for n, m, bs, tm in SIM_ONEBIT:
        i = f"n{n}-m{m}-bs{bs}-{'two_mean' if tm else 'mean_abs'}"
        names += [f"onebit-{what}-{i}" for what in ("sum", "rr", "rr-resid", "bad-sum", "bad-rr")]
    for m, bs, ch, bits, tm in SIM_CHUNKS:
        i = f"m{m}-bs{bs}-chunk{ch}-b{bits}-{tm}"
        names += [f"chunks-{i}", f"chunks-bad-{i}", f"chunks-nocheck-{i}"]
    return names


def _child():
    import warnings
    warnings.simplefilter("ignore")
    from numba import cuda
    import numba_kernels.cuda as K
    dev = cuda.to_device
    out = {}

    def status_ok(st, want, preset):
        return int(st[0]) == want and int(st[1]) == (want | preset)

    def run_sum(tag, buf, n, m, lay, exp, dsum, rr, ref_sum, ref_rr, ref_enc, special):
        a = np.empty(m, np.float32)
        with np.errstate(all="ignore"):
            ref_sum(buf, n, a)
        o = dev(np.full(m, 9.0, np.float32))
        dsum(dev(buf), n, o, 0, None, exp)
        out[f"{pre}sum-{tag}{special}"] = nan_bits_equal(a, o.copy_to_host())
        for resid in (False, True):
            r0 = make_x(m, 11)
            ra = r0.copy() if resid else None
            pa = np.zeros(lay.total, np.uint8)
            with np.errstate(all="ignore"):
                ref_rr(buf, n, ra, pa)
            rd = dev(r0.copy()) if resid else None
            pd = dev(np.full(lay.total, 0xA5, np.uint8))
            rr(dev(buf), n, rd, pd, 0, None, exp)
            ok = payload_equal(pa, pd.copy_to_host(), lay)
            if resid:
                ok = ok and nan_bits_equal(ra, rd.copy_to_host())
            out[f"{pre}rr{'-resid' if resid else ''}-{tag}{special}"] = bool(ok)

    def run_bad(tag, buf, n, m, lay, exp, other, dsum, rr, ref_enc):
        """Payload n-1 replaced by another tensor's: NaN everywhere, status bits; the requantized
        payload is the encode of NaN."""
        bad = buf.copy()
        bad[(n - 1) * lay.total:] = other
        want = R.header_errors_ref(other, *exp)
        st = dev(np.array([0, 4096], np.int32))
        o = dev(np.zeros(m, np.float32))
        dsum(dev(bad), n, o, 0, st, exp)
        out[f"{pre}bad-sum-{tag}"] = bool(want != 0 and np.isnan(o.copy_to_host()).all()
                                          and status_ok(st.copy_to_host(), want, 4096))
        st = dev(np.array([0, 4096], np.int32))
        rd = dev(make_x(m, 11))
        pd = dev(np.full(lay.total, 0xA5, np.uint8))
        rr(dev(bad), n, rd, pd, 0, st, exp)
        pa = np.zeros(lay.total, np.uint8)
        ra = np.empty(m, np.float32)
        with np.errstate(all="ignore"):
            ref_enc(np.full(m, np.nan, np.float32), pa, ra)
        out[f"{pre}bad-rr-{tag}"] = bool(payload_equal(pa, pd.copy_to_host(), lay)
                                         and nan_bits_equal(ra, rd.copy_to_host())
                                         and status_ok(st.copy_to_host(), want, 4096))

    pre = ""
    for c in SIM_SUM:
        n, m, bs, bits, st_, l2 = c
        tag = _qid(*c)
        dsum = op("qsgd", "decode_sum", m, bits=bits, bucket_size=bs, device=True)
        for special in _sum_variants(m):
            buf, h, lay, exp = qsgd_payloads(n, m, bits, bs, st_, l2, special=bool(special))
            rr_op = op("qsgd", "reduce_requantize", m, bits=bits, bucket_size=bs, stochastic=st_, norm_l2=l2,
                       device=True)
            rr = lambda p, k, r, q, s, stt, e: rr_op(p, k, r, q, h, KEY, s, stt, e)  # noqa: E731
            run_sum(tag, buf, n, m, lay, exp, dsum, rr,
                    lambda p, k, o: R.qsgd_decode_sum_ref(p, k, o, bits, bs),
                    lambda p, k, r, q: R.qsgd_reduce_requantize_ref(p, k, r, q, h, bits, bs, st_, l2, KEY),
                    None, special)
        other, _, _, _ = qsgd_payloads(1, m, bits, bs, st_, l2, name="v")
        run_bad(tag, buf, n, m, lay, exp, other, dsum, rr,
                lambda x, p, r: R.qsgd_encode_ref(x, p, h, bits, bs, st_, l2, KEY, residual=r))
    pre = "onebit-"
    for n, m, bs, tm in SIM_ONEBIT:
        tag = f"n{n}-m{m}-bs{bs}-{'two_mean' if tm else 'mean_abs'}"
        buf, h, lay, exp = onebit_payloads(n, m, bs, tm, special=m > 60)
        dsum = op("onebit", "decode_sum", m, bucket_size=bs, two_mean=tm, device=True)
        rr_op = op("onebit", "reduce_requantize", m, bucket_size=bs, two_mean=tm, device=True)
        rr = lambda p, k, r, q, s, stt, e: rr_op(p, k, r, q, h, 0, s, stt, e)  # noqa: E731
        run_sum(tag, buf, n, m, lay, exp, dsum, rr,
                lambda p, k, o: R.onebit_decode_sum_ref(p, k, o, bs, tm),
                lambda p, k, r, q: R.onebit_reduce_requantize_ref(p, k, r, q, h, bs, tm), None, "")
        other, _, _, _ = onebit_payloads(1, m, bs, tm, name="v")
        run_bad(tag, buf, n, m, lay, exp, other, dsum, rr,
                lambda x, p, r: R.onebit_encode_ref(x, p, h, bs, tm, residual=r))
    for m, bs, ch, bits, tm in SIM_CHUNKS:
        tag = f"m{m}-bs{bs}-chunk{ch}-b{bits}-{tm}"
        g, nh, exp = chunk_payloads(m, ch, bits, bs, True, True, two_mean=tm, special=True)
        if tm is None:
            dch = op("qsgd", "decode_chunks", m, bits=bits, bucket_size=bs, chunk=ch, device=True)
            ref = lambda gg, o, hh, e: R.qsgd_decode_chunks_ref(gg, o, bits, bs, ch, None, None, hh, e)  # noqa
        else:
            dch = op("onebit", "decode_chunks", m, bucket_size=bs, two_mean=tm, chunk=ch, device=True)
            ref = lambda gg, o, hh, e: R.onebit_decode_chunks_ref(gg, o, bs, tm, ch, None, None, hh, e)  # noqa
        a = np.empty(m, np.float32)
        with np.errstate(all="ignore"):
            ref(g, a, nh, exp)
        st = dev(np.zeros(2, np.int32))
        o = dev(np.full(m, 9.0, np.float32))
        dch(dev(g), o, 0, st, dev(nh), exp)
        out[f"chunks-{tag}"] = bool(nan_bits_equal(a, o.copy_to_host()) and not st.copy_to_host().any())
        o = dev(np.full(m, 9.0, np.float32))
        dch(dev(g), o, 0, None, None, None)
        out[f"chunks-nocheck-{tag}"] = nan_bits_equal(a, o.copy_to_host())
        # the last chunk expected under another name: it alone decodes to NaN
        ranges = R.chunk_ranges(m, bs, ch)
        nh2 = nh.copy()
        nh2[-1] ^= 1
        lo, hi = ranges[-1]
        off = g.size - R.wire.layout(exp.method, hi - lo, bits, bs, exp.mode).total
        want = R.header_errors_ref(g[off:], *exp._replace(numel=hi - lo, name_hash=int(nh2[-1]),
                                                          check_name=True))
        b_ = a.copy()
        b_[lo:hi] = np.nan
        st = dev(np.array([0, 4096], np.int32))
        o = dev(np.full(m, 9.0, np.float32))
        dch(dev(g), o, 0, st, dev(nh2), exp)
        out[f"chunks-bad-{tag}"] = bool(want == 256 and nan_bits_equal(b_, o.copy_to_host())
                                        and status_ok(st.copy_to_host(), want, 4096))
    out["compiled"] = [list(k) for k in K.kernels]
    json.dump(out, sys.stdout)


@pytest.fixture(scope="module")
def cuda_results():
    return children.json_result("test_fused_kernels", "cuda_results")


@pytest.mark.parametrize("case", _sim_sum_names())
def test_cuda_fused_equals_reference(cuda_results, case):
    assert cuda_results.get(case) is True, case


def test_cuda_fused_kernels_built(cuda_results):
    """The fused operations take the kernel path their configuration selects: the warp decode in its
    sum and chunks modes (whole buckets in registers, and the run-time loop above 512 elements) and
    the warp encode with its payload-summing source; elsewhere the general path's decode_multi, the
    encode and, above FUSE_MAX, the reduce with the same source."""
    got = {tuple(k) for k in cuda_results["compiled"]}
    want = {("block_decode_multi", 4, 0, 0), ("block_decode_multi", 3, 0, 1),
            ("block_decode_multi", 1, 1, 1), ("block_reduce_requantize", 4, 0, 1, True, True),
            ("block_reduce_requantize", 1, 2, 2, False, True),
            ("reduce_sum", 0, 3, 0, True),
            # warp_decode_multi_<bits>_<kind>_<steps in registers>_<0 sum, 1 chunks>
            ("warp_decode_multi", 4, 0, 2, 0), ("warp_decode_multi", 4, 0, 2, 1),
            ("warp_decode_multi", 4, 0, 0, 0),
            ("warp_decode_multi", 4, 0, 0, 1), ("warp_decode_multi", 1, 2, 2, 1),
            # warp_reduce_requantize_<warp_encode's spec>_True
            ("warp_reduce_requantize", 4, 0, 1, 2, True, True, True),
            ("warp_reduce_requantize", 4, 0, 1, 0, False, True, True),
            ("warp_reduce_requantize", 1, 2, 2, 2, False, True, True)}
    assert want <= got, sorted(want - got)
