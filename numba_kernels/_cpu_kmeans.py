"""KMeans's CPU kernels: a 1-D k-means codebook per bucket and a code per element
(``reference.kmeans_*_ref``).
"""
import numpy as np
from numba import prange

from ._cpu_base import (INF_BITS, _BITS, _Widths, _chunk_codes, _extremes, _inline, _km_draw, _km_fixed,
                        _km_index, _mix64, _km_mean, _km_mids, _km_scale, _km_starts, _lookup, _pack, _wide,
                        _encode_preamble, _nan_bucket, decoders)
from ._cpu_sortquant import _sort_key, _sort_values
from ._scalar import F0, KMEANS_SAMPLE


@_inline
def _kmeans_assign(mids, xb, q, K):
    """q[j] = the centroid of xb[j]: the count of boundaries below it; up to 32 centroids by K - 1
    compares that vectorise across elements, above by binary search."""
    if K <= 32:
        for j in range(xb.size):
            xv = xb[j]
            c = 0
            for k in range(K - 1):
                c += np.int32(mids[k] < xv)
            q[j] = c
    else:
        for j in range(xb.size):
            q[j] = _km_index(mids, K, xb[j])


_KM_RUN = 16        # sorted values per partial sum of a KMeans bucket's fixed-point values
_KM_LOW = 14        # the low key bits a KMeans bucket is not ordered by (three radix passes of 6 bits)


@_inline
def _km_first(bits, lo, hi, kt):
    """The first index in [lo, hi) of ``bits`` whose top key bits (above _KM_LOW) reach ``kt``."""
    while lo < hi:
        m = (lo + hi) >> 1
        if (_sort_key(bits[m]) >> np.uint32(_KM_LOW)) < kt:
            lo = m + 1
        else:
            hi = m
    return lo


@_inline
def _km_below(bits, n, pre, t, tb, scale):
    """(count, fixed-point sum) of the values at or below ``t`` (bits ``tb``) among ``bits[:n]``
    (ordered by top key bits; ``pre``: the sums before every _KM_RUN-th value): binary searches for
    the run sharing t's top bits, then a vectorised count of it."""
    vals = bits.view(np.float32)
    kt = _sort_key(tb) >> np.uint32(_KM_LOW)
    a = _km_first(bits, 0, n, kt)
    e = _km_first(bits, a, n, kt + np.uint32(1))
    r = a // _KM_RUN
    s = pre[r]
    for i in range(r * _KM_RUN, a):
        s += _km_fixed(vals[i], scale)
    c = a
    for i in range(a, e):
        le = vals[i] <= t
        c += np.int64(le)
        s += _km_fixed(vals[i], scale) if le else np.int64(0)
    return c, s


@_inline
def _kmeans_fit(x, st, n, b, iters, key, amax, lo, hi, cent, mids, sample, comp, keys, keys2, pre, cnt, K):
    """The codebook ``cent`` (K centroids) of the bucket x[st:st + n] with extremes ``lo``, ``hi``
    (``reference._kmeans_bucket``). The bucket is ordered once by the top 18 bits of its sort keys, so
    a centroid's members are a run between two boundaries (:func:`_km_below`) and a Lloyd step costs K
    searches, not a pass. Stops once a step moves no centroid (later ones would repeat it)."""
    if n <= KMEANS_SAMPLE:
        m = n
        for k in range(n):
            sample[k] = x[st + k] + F0
    else:
        m = KMEANS_SAMPLE
        for k in range(m - 2):
            pos = _km_draw(key, b * KMEANS_SAMPLE + k) % np.uint64(n)
            sample[k] = x[st + np.int64(pos)] + F0
        sample[m - 2] = lo + F0
        sample[m - 1] = hi + F0
    srt = np.sort(sample[:m])
    _km_starts(srt, m, comp, cent, K)
    if iters == 0:
        return
    scale = _km_scale(amax)
    bits, _ = _sort_values(x[st:st + n], n, keys, keys2, keys, keys2, cnt, _KM_LOW, 6, False)
    for j in range(n):       # the keys back to the values' bits
        k = bits[j]
        bits[j] = k ^ np.uint32(0x80000000) if k >> np.uint32(31) else ~k
    vals = bits[:n].view(np.float32)
    s = np.int64(0)
    for r in range(0, n, _KM_RUN):
        pre[r // _KM_RUN] = s
        for i in range(r, min(n, r + _KM_RUN)):
            s += _km_fixed(vals[i], scale)
    pre[(n + _KM_RUN - 1) // _KM_RUN] = s
    mbits = mids.view(np.uint32)
    for _ in range(iters):
        _km_mids(cent, mids)
        c0 = 0
        s0 = np.int64(0)
        moved = False
        for j in range(K):
            c1, s1 = _km_below(bits, n, pre, mids[j], mbits[j], scale) if j < K - 1 else (n, s)
            if c1 > c0:
                c = _km_mean(s1 - s0, c1 - c0, scale)
                moved |= c != cent[j]
                cent[j] = c
            c0 = c1
            s0 = s1
        if not moved:
            break


@_Widths
def _kmeans_encode(x, payload, header, codes_off, codes_end, scales_off, nscales, bs, iters, key, kchunk,
                   residual, has_res):
    """KMeans (``kmeans_encode_ref``): per bucket the codebook, then each element's centroid index."""
    key = _mix64(key)           # the caller's key, finished (docs/CODECS.md, "Noise and seeds")
    numel = x.size
    scales, nb = _encode_preamble(payload, header, codes_end, scales_off, nscales, numel, bs)
    nchunks = (nb + kchunk - 1) // kchunk
    K = 1 << _BITS
    for c in prange(nchunks):
        _wide()
        b0, b1, e0, ng, codes = _chunk_codes(c, kchunk, nb, bs, numel)
        m = min(bs, numel)
        mids = np.empty(K, np.float32)
        keys = np.empty(m, np.uint32)
        keys2 = np.empty(m, np.uint32)
        pre = np.empty(m // _KM_RUN + 2, np.int64)
        cnt = np.empty(256, np.int64)
        sample = np.empty(min(bs, KMEANS_SAMPLE), np.float32)
        comp = np.empty(min(bs, KMEANS_SAMPLE), np.float64)
        for b in range(b0, b1):
            st = b * bs
            n = min(numel, st + bs) - st
            cb = codes[st - e0:st - e0 + n]
            cent = scales[K * b:K * (b + 1)]
            a, lo, hi = _extremes(x, st, st + n)
            if a >= INF_BITS:
                _nan_bucket(cent, cb, x, st, residual, has_res)
                continue
            _kmeans_fit(x, st, n, b, iters, key, np.uint32(a), lo, hi, cent, mids, sample, comp, keys, keys2, pre,
                        cnt, K)
            _km_mids(cent, mids)
            xb = x[st:st + n]
            _kmeans_assign(mids, xb, cb, K)
            if has_res:     # every code found before residual (which may be x) is written
                for j in range(n):
                    residual[st + j] = xb[j] - cent[cb[j]]
        _pack(codes, ng, payload, codes_off + (e0 >> 3) * _BITS, codes_end, _BITS)


@_inline
def _kmeans_dec(payload, out, codes_off, scales, bs, param, e0, e1, accumulate, BITS):
    """out[i] (+)= the centroid of element i, for i in [e0, e1) (a range decoder)."""
    K = 1 << BITS
    a = e0
    while a < e1:
        b = a // bs
        z = min(e1, (b + 1) * bs)
        _lookup(payload, codes_off, out[a:z], a, scales[K * b:K * (b + 1)], accumulate, BITS)
        a = z


_kmeans_decode = decoders(_kmeans_dec, "kmeans")[0]
