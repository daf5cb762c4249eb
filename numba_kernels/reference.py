"""NumPy references (``*_ref``): the specification the CPU and CUDA kernels are held equal to, bit for bit.

Same signatures as the kernel launchers in ``numba_kernels.cpu`` / ``numba_kernels.cuda``
(``stream`` and ``status`` are accepted and ignored). Written for clarity and vectorised; not fast.

Encoders' ``residual`` (``x - decode(payload)``, float32, may be ``x``) and decoders' ``expect`` (a
``wire.Expect``: ``PayloadError`` before anything is written) are as docs/CODECS.md ("Kernels") says.

Every float32 sum (l2, two_mean, mean_abs) is taken in the canonical order of docs/CODECS.md
("Canonical summation order"): :func:`lane_sum_ref`.
"""
import numpy as np

from . import wire
from ._scalar import F0, F2_24, FHALF, FINF, GAMMA, KMEANS_SAMPLE, SEGMENT, U40, mix64_np, mix64_py

__all__ = ["lane_sum_ref", "bucket_scales_ref", "qsgd_encode_ref", "qsgd_decode_ref",
           "onebit_encode_ref", "onebit_decode_ref", "write_header_ref", "uniform24_ref",
           "header_errors_ref", "check_expect_ref", "levels", "qsgd_decode_sum_ref",
           "onebit_decode_sum_ref", "qsgd_reduce_requantize_ref", "onebit_reduce_requantize_ref",
           "qsgd_decode_chunks_ref", "onebit_decode_chunks_ref", "chunk_ranges", "chunk_expects", "check_payloads",
           "sortquant_encode_ref", "sortquant_decode_ref", "sortquant_groups", "kmeans_encode_ref",
           "kmeans_decode_ref", "KMEANS_SAMPLE"]


def levels(bits):
    """s = 2**(bits-1) - 1 magnitude levels per sign."""
    return (1 << (bits - 1)) - 1


def _buckets(a, bs):
    """(nb, R*32) zero-padded copy of the buckets of ``a`` (R = ceil(bs/32)) and the validity mask."""
    n = a.size
    nb = -(-n // bs)
    out = np.zeros((nb, -(-bs // 32) * 32), dtype=a.dtype)
    valid = np.zeros(out.shape, dtype=bool)
    flat = np.zeros(nb * bs, dtype=a.dtype)
    flat[:n] = a
    out[:, :bs] = flat.reshape(nb, bs)
    valid[:, :bs] = (np.arange(nb * bs) < n).reshape(nb, bs)
    return out, valid


def _lanes(terms):
    """The lane sum of each row of ``terms`` (float32, shape (nb, R*32), zero padded)."""
    nb, width = terms.shape
    t = terms.astype(np.float32, copy=False).reshape(nb, width // 32, 32)
    if nb == 0:
        return np.zeros(0, np.float32)
    p = np.cumsum(t, axis=1, dtype=np.float32)[:, -1, :].copy()   # sequential per lane
    for stride in (16, 8, 4, 2, 1):
        p[:, :stride] = p[:, :stride] + p[:, stride:2 * stride]
    return p[:, 0]


def lane_sum_ref(terms):
    """Canonical sum of each row of ``terms`` (float32, shape (nb, R*32), zero padded): the lane sum
    of its segments' lane sums (one segment: its lane sum)."""
    nb, width = terms.shape
    if width <= SEGMENT:
        return _lanes(terms)
    nseg = -(-width // SEGMENT)
    t = np.zeros((nb, nseg * SEGMENT), np.float32)
    t[:, :width] = terms
    parts = np.zeros((nb, -(-nseg // 32) * 32), np.float32)
    parts[:, :nseg] = _lanes(t.reshape(nb * nseg, SEGMENT)).reshape(nb, nseg)
    return _lanes(parts)


def bucket_scales_ref(x, bucket_size, kind):
    """Per-bucket scales. kind: "max", "l2" (QSGD), "two_mean" ((nb, 2): mean of x >= 0, mean of x < 0),
    "mean_abs" (sum|x| / bucket length)."""
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    X, valid = _buckets(x, bucket_size)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        if kind == "max":
            return np.max(np.abs(X), axis=1, initial=F0)
        if kind == "l2":
            return np.sqrt(lane_sum_ref(X * X)).astype(np.float32)
        lengths = valid.sum(axis=1)
        if kind == "mean_abs":
            return (lane_sum_ref(np.abs(X)) / lengths.astype(np.float32)).astype(np.float32)
        if kind == "two_mean":
            means = []
            for side in (valid & (X >= 0), valid & ~(X >= 0)):     # NaN is negative: its bit (x >= 0) is 0
                cnt = side.sum(axis=1)
                total = lane_sum_ref(np.where(side, X, F0))
                means.append(np.where(cnt > 0, total / np.maximum(cnt, 1).astype(np.float32), F0).astype(np.float32))
            means = np.stack(means, axis=1)
            means[~np.all(np.abs(means) < FINF, axis=1)] = np.nan     # a non-finite mean: both NaN
            return means
    raise ValueError(f"unknown scale kind {kind!r}")


def uniform24_ref(key, idx):
    """24 random bits per element index (uint64 array), the same counter-based hash as the kernels:
    elements ``i`` and ``i ^ 32`` share the splitmix64 draw of ``p = (i >> 6) * 32 + i % 32``; bit 5 of
    ``i`` picks its bits 40..63 (1) or 8..31 (0)."""
    i = idx.astype(np.uint64)
    p = ((i >> np.uint64(6)) << np.uint64(5)) | (i & np.uint64(31))
    z = mix64_np(np.uint64(key) + p * GAMMA)
    return np.where((i & np.uint64(32)) != 0, z >> U40, (z >> np.uint64(8)) & np.uint64(0xFFFFFF))


def _round(v, top, stochastic, key, idx):
    """``_scalar.round_level`` of ``v`` (float32, >= 0 or NaN) with the random bits of the elements
    ``idx``; at most ``top``."""
    v = np.where(v <= top, v, top).astype(np.float32)
    q = v.astype(np.int64)
    frac = (v - q.astype(np.float32)).astype(np.float32)
    if stochastic:
        q = q + (uniform24_ref(key, idx).astype(np.float32) < frac * F2_24)
    else:
        q = q + (frac >= FHALF)
    return np.minimum(q, int(top))


def _qsgd_codes(x, scales, bits, bucket_size, stochastic, key):
    s = levels(bits)
    sf = np.float32(s)
    idx = np.arange(x.size, dtype=np.int64)
    b = idx // bucket_size
    sc = scales[b]
    unit = (scales / sf).astype(np.float32)[b]
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        v = (np.abs(x) / unit).astype(np.float32)
    q = np.where((sc > F0) & (sc < FINF), _round(v, sf, stochastic, key, idx), 0)
    return np.where(x < F0, s - q, s + q).astype(np.int64)


def _pack(codes, bits):
    """Little-endian bit stream of ``bits``-bit codes, ceil(n*bits/8) bytes."""
    n = codes.size
    nbytes = (n * bits + 7) // 8
    if n == 0:
        return np.zeros(0, np.uint8)
    stream = ((codes[:, None].astype(np.uint64) >> np.arange(bits, dtype=np.uint64)) & np.uint64(1))
    return np.packbits(stream.astype(np.uint8).reshape(-1), bitorder="little")[:nbytes]


def _unpack(data, n, bits):
    if n == 0:
        return np.zeros(0, np.int64)
    stream = np.unpackbits(np.asarray(data, np.uint8), bitorder="little")[:n * bits].reshape(n, bits)
    return (stream.astype(np.int64) << np.arange(bits, dtype=np.int64)).sum(axis=1)


def write_header_ref(payload, header, stream=None):
    """Write the 64-byte header (8 little-endian uint64 words) at the start of ``payload``."""
    payload[:wire.HEADER_NBYTES] = np.array([int(w) for w in header], dtype="<u8").view(np.uint8)


def _write(payload, header, lay, codes, bits, scales, x, residual, decode):
    """The payload of an encode: header, ``codes`` packed at ``bits``, padding, ``scales``; then the
    residual: ``residual = x - (what decode(payload, d) writes)``, float32 (``residual`` may be ``x``)."""
    assert payload.size == lay.total, (payload.size, lay)
    write_header_ref(payload, header)
    payload[lay.codes_offset:lay.codes_offset + lay.codes_nbytes] = _pack(codes, bits)
    payload[lay.codes_offset + lay.codes_nbytes:lay.scales_offset] = 0
    payload[lay.scales_offset:lay.scales_offset + 4 * lay.nscales] = \
        np.ascontiguousarray(scales, dtype="<f4").reshape(-1).view(np.uint8)
    if residual is not None:
        d = np.empty(x.size, np.float32)
        decode(payload, d)
        with np.errstate(invalid="ignore", over="ignore"):
            residual.reshape(-1)[...] = (x - d).astype(np.float32)


def _store(out, val, accumulate):
    if accumulate:
        out += val
    else:
        out[...] = val


def _read(payload, n, expect, method, bits, bucket_size, mode=0, param=0):
    """(codes, scales, each element's bucket) of a payload of ``n`` elements, its header checked against
    ``expect`` first (:func:`check_expect_ref`)."""
    check_expect_ref(payload, expect)
    lay = wire.layout(wire.METHODS[method], n, bits, bucket_size, mode, param)
    codes = _unpack(payload[lay.codes_offset:lay.codes_offset + lay.codes_nbytes], n, bits)
    raw = np.ascontiguousarray(payload[lay.scales_offset:lay.scales_offset + 4 * lay.nscales])
    return codes, raw.view("<f4").astype(np.float32), np.arange(n) // (bucket_size or max(n, 1))


def check_expect_ref(payload, expect):
    """Raise ``PayloadError`` when ``payload``'s header fails the check against ``expect`` (a
    ``wire.Expect``; None: no check)."""
    if expect is not None:
        err = header_errors_ref(payload, *expect)
        if err:
            raise wire.PayloadError(wire.describe_error_bits(err))


def qsgd_encode_ref(x, payload, header, bits, bucket_size, stochastic, norm_l2, key, stream=None,
                    residual=None):
    """Bucketed QSGD of float32 ``x`` into ``payload`` (header words, codes, padding, scales)."""
    key = mix64_py(key)         # every encode first finishes the caller's key (docs/CODECS.md)
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    lay = wire.layout(wire.METHODS["qsgd"], x.size, bits, bucket_size)
    scales = bucket_scales_ref(x, bucket_size, "l2" if norm_l2 else "max")
    _write(payload, header, lay, _qsgd_codes(x, scales, bits, bucket_size, stochastic, key), bits, scales,
           x, residual, lambda p, d: qsgd_decode_ref(p, d, bits, bucket_size, False))


def qsgd_decode_ref(payload, out, bits, bucket_size, accumulate, stream=None, status=None, expect=None):
    """out (+)= dequantized values of a QSGD payload (header checked against ``expect`` if given)."""
    codes, sc, b = _read(payload, out.size, expect, "qsgd", bits, bucket_size)
    s = levels(bits)
    unit = (sc / np.float32(s)).astype(np.float32)
    with np.errstate(invalid="ignore"):
        _store(out, ((codes - s).astype(np.float32) * unit[b]).astype(np.float32), accumulate)


def sortquant_groups(n, split_bits):
    """(start, stop) of each of the ``2**split_bits`` groups of a bucket of ``n`` sorted values: the
    value of rank p (0-based, ties in index order) is in group ``(p * G) // n``, G = 2**split_bits, so
    the groups hold n/G values each (give or take one); a group is empty where n < G."""
    G = 1 << split_bits
    return [(-(-g * n // G), -(-(g + 1) * n // G)) for g in range(G)]


def _sortquant_bucket(xb, idx, split_bits, lb, stochastic, key):
    """(codes, scales) of one bucket: float32 values ``xb`` at indices ``idx``, ``lb`` level bits."""
    n = xb.size
    G = 1 << split_bits
    L = (1 << lb) - 1
    codes = np.zeros(n, np.int64)
    scales = np.zeros(2 * G, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        finite = bool(np.all(np.abs(xb) < FINF)) and (n == 0 or abs(xb.max() - xb.min()) < FINF)
    if not finite:              # NaN, Inf, or a range float32 cannot hold: the bucket decodes to NaN
        scales[:] = np.nan
        return codes, scales
    order = np.argsort(xb, kind="stable")
    srt = xb[order]
    Lf = np.float32(L)
    for g, (p0, p1) in enumerate(sortquant_groups(n, split_bits)):
        if p0 == p1:
            continue
        lo, hi = srt[p0], srt[p1 - 1]
        scales[2 * g], scales[2 * g + 1] = lo, hi
        members = order[p0:p1]
        unit = np.float32(np.float32(hi - lo) / Lf)
        if unit > F0:
            with np.errstate(over="ignore"):
                v = ((xb[members] - lo) / unit).astype(np.float32)
            q = _round(v, Lf, stochastic, key, idx[members])
        else:                   # every value of the group equals lo
            q = np.zeros(p1 - p0, np.int64)
        codes[members] = (g << lb) | q
    return codes, scales


def sortquant_encode_ref(x, payload, header, bits, split_bits, bucket_size, stochastic, key, stream=None,
                         residual=None):
    """Sort quantization of float32 ``x`` into ``payload`` (header words, codes, padding, scales)."""
    key = mix64_py(key)
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    lay = wire.layout(wire.METHODS["sortquant"], x.size, bits, bucket_size, 0, split_bits)
    codes = np.zeros(x.size, np.int64)
    scales = np.zeros((lay.nbuckets, 2 << split_bits), np.float32)
    for b in range(lay.nbuckets):
        st, en = b * bucket_size, min(x.size, (b + 1) * bucket_size)
        codes[st:en], scales[b] = _sortquant_bucket(x[st:en], np.arange(st, en), split_bits,
                                                    bits - split_bits, stochastic, key)
    _write(payload, header, lay, codes, bits, scales, x, residual,
           lambda p, d: sortquant_decode_ref(p, d, bits, split_bits, bucket_size, False))


def sortquant_decode_ref(payload, out, bits, split_bits, bucket_size, accumulate, stream=None, status=None,
                         expect=None):
    """out (+)= lo + level * (hi - lo) / L of each element's group (header checked against ``expect``)."""
    codes, sc, b = _read(payload, out.size, expect, "sortquant", bits, bucket_size, 0, split_bits)
    sc = sc.reshape(-1, 2 << split_bits)
    lb = bits - split_bits
    L = (1 << lb) - 1
    g = codes >> lb
    lo = sc[b, 2 * g]
    hi = sc[b, 2 * g + 1]
    with np.errstate(invalid="ignore", over="ignore"):
        unit = ((hi - lo).astype(np.float32) / np.float32(L)).astype(np.float32)
        _store(out, (lo + ((codes & L).astype(np.float32) * unit).astype(np.float32)).astype(np.float32),
               accumulate)


def _kmeans_mids(c):
    """The boundaries a/2 + b/2 between neighbouring centroids, made non-decreasing by a running max."""
    return np.maximum.accumulate((c[:-1] * FHALF + c[1:] * FHALF).astype(np.float32))


def _kmeans_index(mids, x):
    """Each value's centroid: how many boundaries lie below it."""
    return np.searchsorted(mids, x, side="left").astype(np.int64)


def _kmeans_starts(srt, K):
    """The sample ranks the centroids start from: centroid j at the first rank whose companded rank
    (the float64 running sum of sqrt(gap) over the sorted sample) reaches (2j + 1) / 2K of the total."""
    gaps = np.sqrt(srt[1:].astype(np.float64) - srt[:-1].astype(np.float64))
    comp = np.concatenate([[0.0], np.cumsum(gaps)])
    t = (np.float64(2) * np.arange(K) + 1) * comp[-1] / np.float64(2 * K)
    return np.minimum(np.searchsorted(comp, t, side="left"), srt.size - 1)


def _kmeans_bucket(xb, b, bits, iters, key):
    """(codebook, codes) of bucket ``b`` holding the float32 values ``xb``, as docs/CODECS.md ("K-means
    quantization") specifies: the sampled start, ``iters`` Lloyd steps with exact fixed-point means
    (``_scalar.kmeans_scale``), the assignment. A bucket holding NaN or Inf: NaN codebook, codes 0."""
    K = 1 << bits
    n = xb.size
    amax = int((xb.view(np.uint32) & np.uint32(0x7FFFFFFF)).max())
    if amax >= 0x7F800000:
        return np.full(K, np.nan, np.float32), np.zeros(n, np.int64)
    scale = float(np.ldexp(1.0, 157 - (amax >> 23)))
    if n <= KMEANS_SAMPLE:
        sample = xb
    else:
        k = np.arange(KMEANS_SAMPLE - 2, dtype=np.uint64)
        p = (np.uint64(b) * np.uint64(KMEANS_SAMPLE) + k) * GAMMA
        sample = np.concatenate([xb[(mix64_np(np.uint64(key) + p) % np.uint64(n)).astype(np.int64)],
                                 [xb.min(), xb.max()]])
    srt = np.sort((sample + F0).astype(np.float32))
    c = srt[_kmeans_starts(srt, K)].astype(np.float32)
    fixed = (xb.astype(np.float64) * scale).astype(np.int64)
    for _ in range(iters):
        j = _kmeans_index(_kmeans_mids(c), xb)
        total = np.zeros(K, np.int64)
        np.add.at(total, j, fixed)
        count = np.bincount(j, minlength=K)
        some = count > 0
        c = c.copy()
        c[some] = ((total[some].astype(np.float64) / count[some].astype(np.float64)) / scale).astype(np.float32)
    return c, _kmeans_index(_kmeans_mids(c), xb)


def kmeans_encode_ref(x, payload, header, bits, bucket_size, iters, key, stream=None, residual=None):
    """KMeans encode of float32 ``x`` into ``payload``: per bucket (``bucket_size`` 0: one per tensor)
    a codebook of 2**bits centroids (:func:`_kmeans_bucket`) and each element's centroid index."""
    key = mix64_py(key)
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    lay = wire.layout(wire.METHODS["kmeans"], x.size, bits, bucket_size)
    bs = bucket_size or max(x.size, 1)
    codes = np.zeros(x.size, np.int64)
    book = np.zeros((lay.nbuckets, 1 << bits), np.float32)
    for b in range(lay.nbuckets):
        st, en = b * bs, min(x.size, (b + 1) * bs)
        book[b], codes[st:en] = _kmeans_bucket(x[st:en], b, bits, iters, key)
    _write(payload, header, lay, codes, bits, book, x, residual,
           lambda p, d: kmeans_decode_ref(p, d, bits, bucket_size, False))


def kmeans_decode_ref(payload, out, bits, bucket_size, accumulate, stream=None, status=None, expect=None):
    """out (+)= the codebook entry of each element's code (header checked against ``expect``)."""
    codes, book, b = _read(payload, out.size, expect, "kmeans", bits, bucket_size)
    _store(out, book.reshape(-1, 1 << bits)[b, codes], accumulate)


def onebit_encode_ref(x, payload, header, bucket_size, two_mean, stream=None, residual=None):
    """1-bit SGD: bit = (x >= 0) (NaN -> 0); scales two_mean (2 per bucket) or mean_abs (1 per bucket).

    ``bucket_size`` 0: one bucket for the whole tensor."""
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    scales = bucket_scales_ref(x, bucket_size or max(x.size, 1), "two_mean" if two_mean else "mean_abs")
    lay = wire.layout(wire.METHODS["onebit"], x.size, 1, bucket_size, wire.onebit_mode(two_mean))
    _write(payload, header, lay, (x >= F0).astype(np.int64), 1, scales, x, residual,
           lambda p, d: onebit_decode_ref(p, d, bucket_size, two_mean, False))


def onebit_decode_ref(payload, out, bucket_size, two_mean, accumulate, stream=None, status=None,
                      expect=None):
    """out (+)= 1-bit decoded values (header checked against ``expect`` if given)."""
    bits, sc, b = _read(payload, out.size, expect, "onebit", 1, bucket_size, wire.onebit_mode(two_mean))
    hi, lo = (sc[0::2], sc[1::2]) if two_mean else (sc, -sc)      # what bits 1 and 0 decode to
    _store(out, np.where(bits.astype(bool), hi[b], lo[b]).astype(np.float32), accumulate)


def header_errors_ref(payload, method, bits, mode, param, bucket_size, numel, name_hash, check_name):
    """Error bits (``wire.ERROR_BITS``) of a payload header against what the receiver expects.

    The reference of the CUDA check kernel, which cannot raise and reports these bits instead."""
    h = bytes(np.asarray(payload[:wire.HEADER_NBYTES], np.uint8))
    magic, ver, m, bi, mo, pa, _, _, _, bs, n, *_, nh, cfg, crc = wire.HEADER_STRUCT.unpack(h)
    bad = [magic != wire.MAGIC, ver != wire.VERSION, m != method, bi != bits, mo != mode, pa != param,
           bs != bucket_size, n != numel, check_name and nh != name_hash,
           crc != wire.fold16(wire.fnv1a32(h[0:62])), cfg != wire.fold16(wire.fnv1a32(h[4:9] + h[12:16]))]
    return sum(1 << k for k, b in enumerate(bad) if b)     # bit k: the k-th of wire.ERROR_BITS


# ---- fused operations: several payloads in one launch, defined by the single-payload references ------
# ``payloads``: one uint8 buffer of ``n`` payloads of one layout back to back.


def check_payloads(payloads, n, total, expect, check=None):
    """Refuses ``n`` < 1 or a ``payloads`` of other than ``n`` payloads of ``total`` bytes, then checks
    each payload's header against ``expect`` with ``check`` (default :func:`check_expect_ref`)."""
    if n < 1:
        raise ValueError(f"n must be at least 1; got {n}")
    if payloads.size != n * total:
        raise wire.PayloadError(f"payloads has {payloads.size} bytes, {n} payloads of {total} need {n * total}")
    if expect is not None:
        for k in range(n):
            (check or check_expect_ref)(payloads[k * total:(k + 1) * total], expect)


def chunk_ranges(numel, bucket_size, chunk):
    """The chunks ``[j*chunk, min((j+1)*chunk, numel))`` of a decode_chunks: a list of (start, stop).
    ``chunk`` must be a positive multiple of ``bucket_size``; with ``bucket_size`` 0 (OneBit's one
    bucket per tensor) there is one chunk, so ``chunk >= numel``."""
    if chunk < 1 or (bucket_size and chunk % bucket_size) or (not bucket_size and chunk < numel):
        raise ValueError(f"chunk {chunk} must be a positive multiple of bucket_size {bucket_size} "
                         f"(bucket_size 0: at least numel {numel})")
    return [(a, min(a + chunk, numel)) for a in range(0, numel, chunk)]


def chunk_expects(numel, bucket_size, chunk, method, bits, mode, expect=None, name_hashes=None):
    """The ``wire.Expect`` of each chunk of a decode_chunks (None: no check). The configuration comes
    from ``expect`` (QSGD: it gives mode and norm) or, for OneBit, from the decoder's arguments; each
    chunk's numel is its own; ``name_hashes[j]`` (when given) is chunk j's expected name hash."""
    ranges = chunk_ranges(numel, bucket_size, chunk)
    if expect is None and name_hashes is None:
        return [None] * len(ranges)
    if expect is None:
        if method == wire.METHODS["qsgd"]:
            raise ValueError("checking QSGD chunks needs expect (it gives the mode and norm)")
        expect = wire.Expect(method, bits, mode, 0, bucket_size, 0)
    if name_hashes is not None:
        nh = np.asarray(name_hashes).reshape(-1)
        if nh.size < len(ranges):          # (entries past the last non-empty chunk are unused)
            raise ValueError(f"name_hashes has {nh.size} entries for {len(ranges)} chunks")
        return [expect._replace(numel=b - a, name_hash=int(nh[j]), check_name=True)
                for j, (a, b) in enumerate(ranges)]
    return [expect._replace(numel=b - a) for a, b in ranges]


class _Fused:
    """The fused references over QSGD (``two_mean`` None) or 1-bit payloads; each method is the
    ``*_ref`` function of its name (below)."""

    def __init__(self, bits, bucket_size, two_mean=None):
        self.bits, self.bucket_size = bits, bucket_size
        if two_mean is None:
            self.method, self.mode = wire.METHODS["qsgd"], 0
            self.decode = lambda p, out, acc: qsgd_decode_ref(p, out, bits, bucket_size, acc)
        else:
            self.method = wire.METHODS["onebit"]
            self.mode = wire.onebit_mode(two_mean)
            self.decode = lambda p, out, acc: onebit_decode_ref(p, out, bucket_size, two_mean, acc)

    def layout(self, m):
        return wire.layout(self.method, m, self.bits, self.bucket_size, self.mode)

    def decode_sum(self, payloads, n, out, expect):
        out = out.reshape(-1)
        total = self.layout(out.size).total
        check_payloads(payloads, n, total, expect)
        for k in range(n):
            self.decode(payloads[k * total:(k + 1) * total], out, k > 0)

    def reduce_requantize(self, payloads, n, residual, encode, numel, expect):
        c = np.empty(numel, np.float32)
        self.decode_sum(payloads, n, c, expect)
        if residual is not None:
            residual = residual.reshape(-1)
            with np.errstate(invalid="ignore", over="ignore"):
                c = (c + residual).astype(np.float32)
        encode(c, residual)

    def decode_chunks(self, gathered, out, chunk, name_hashes, expect):
        out = out.reshape(-1)
        ranges = chunk_ranges(out.size, self.bucket_size, chunk)
        expects = chunk_expects(out.size, self.bucket_size, chunk, self.method, self.bits, self.mode, expect,
                                name_hashes)
        offs = np.cumsum([0] + [self.layout(b - a).total for a, b in ranges])
        if gathered.size != offs[-1]:
            raise wire.PayloadError(f"gathered has {gathered.size} bytes, the {len(ranges)} chunks need "
                                    f"{offs[-1]}")
        for j in range(len(ranges)):          # every header before anything is written
            check_expect_ref(gathered[offs[j]:offs[j + 1]], expects[j])
        for j, (a, b) in enumerate(ranges):
            self.decode(gathered[offs[j]:offs[j + 1]], out[a:b], False)


def qsgd_decode_sum_ref(payloads, n, out, bits, bucket_size, stream=None, status=None, expect=None):
    """out = decode(p_0) + decode(p_1) + ... + decode(p_{n-1}) (float32, in that order) of the ``n``
    QSGD payloads held back to back in ``payloads``; every header checked against ``expect`` first."""
    _Fused(bits, bucket_size).decode_sum(payloads, n, out, expect)


def onebit_decode_sum_ref(payloads, n, out, bucket_size, two_mean, stream=None, status=None,
                          expect=None):
    """:func:`qsgd_decode_sum_ref` for 1-bit payloads."""
    _Fused(1, bucket_size, two_mean).decode_sum(payloads, n, out, expect)


def qsgd_reduce_requantize_ref(payloads, n, residual, out_payload, header, bits, bucket_size, stochastic,
                               norm_l2, key, stream=None, status=None, expect=None):
    """SRA's phase 2: ``c = decode_sum(payloads) (+ residual)``, ``out_payload = encode(c, header, key)``
    and, with ``residual``, ``residual = c - decode(out_payload)``. ``numel`` is the header's (word 2)."""
    _Fused(bits, bucket_size).reduce_requantize(
        payloads, n, residual, lambda c, r: qsgd_encode_ref(c, out_payload, header, bits, bucket_size,
                                                            stochastic, norm_l2, key, residual=r),
        int(header[2]), expect)


def onebit_reduce_requantize_ref(payloads, n, residual, out_payload, header, bucket_size, two_mean,
                                 stream=None, status=None, expect=None):
    """:func:`qsgd_reduce_requantize_ref` for 1-bit payloads."""
    _Fused(1, bucket_size, two_mean).reduce_requantize(
        payloads, n, residual, lambda c, r: onebit_encode_ref(c, out_payload, header, bucket_size, two_mean,
                                                              residual=r),
        int(header[2]), expect)


def qsgd_decode_chunks_ref(gathered, out, bits, bucket_size, chunk, stream=None, status=None,
                           name_hashes=None, expect=None):
    """Decode chunk j's payload (back to back in ``gathered``) into ``out[j*chunk:(j+1)*chunk]``, the
    last chunk maybe shorter; headers checked as :func:`chunk_expects` says."""
    _Fused(bits, bucket_size).decode_chunks(gathered, out, chunk, name_hashes, expect)


def onebit_decode_chunks_ref(gathered, out, bucket_size, two_mean, chunk, stream=None, status=None,
                             name_hashes=None, expect=None):
    """:func:`qsgd_decode_chunks_ref` for 1-bit payloads (``bucket_size`` 0: one chunk)."""
    _Fused(1, bucket_size, two_mean).decode_chunks(gathered, out, chunk, name_hashes, expect)
