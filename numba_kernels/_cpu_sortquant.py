"""SortQuant's CPU kernels: each bucket's values sorted, split into 2**split_bits groups of equal
rank, and quantized within their group (``reference.sortquant_*_ref``).
"""
import numpy as np
from numba import prange

from ._cpu_base import (INF_BITS, _BITS, _DEC_BLOCK, _Widths, _chunk_codes, _draws24, _extremes,
                        _inline, _lookup, _mix64, _pack, _put, _sq_level, _sq_value, _unpack, _wide, _encode_preamble,
                        _nan_bucket, decoders)
from ._scalar import F0, FINF, U32


@_inline
def _sort_key(u):
    """The float32 bits ``u`` mapped to an unsigned int of the same order (-0.0 as +0.0)."""
    if u == np.uint32(0x80000000):
        u = np.uint32(0)
    return ~u if u >> np.uint32(31) else u | np.uint32(0x80000000)


@_inline
def _sort_values(xb, n, keys, keys2, order, order2, cnt, lo, w, with_order):
    """The :func:`_sort_key` of xb[:n]'s values sorted by their bits ``lo``..31, and with ``with_order``
    their indices (ties in index order): an LSD radix sort, a pass per ``w`` bits (``32 - lo`` a
    multiple of it), faster than Numba's sort at bucket sizes. Returns (keys, order) or (keys2, order2),
    whichever hold the result."""
    D = 1 << w
    mask = np.uint32(D - 1)
    xu = xb.view(np.uint32)
    for j in range(n):
        keys[j] = _sort_key(xu[j])
        if with_order:
            order[j] = j
    for shift in range(lo, 32, w):
        sh = np.uint32(shift)
        for d in range(D):
            cnt[d] = 0
        for j in range(n):
            cnt[(keys[j] >> sh) & mask] += 1
        at = 0
        for d in range(D):
            c = cnt[d]
            cnt[d] = at
            at += c
        for j in range(n):
            d = (keys[j] >> sh) & mask
            k = cnt[d]
            cnt[d] = k + 1
            keys2[k] = keys[j]
            if with_order:
                order2[k] = order[j]
        keys, keys2 = keys2, keys
        order, order2 = order2, order
    return keys, order


@_inline
def _first_rank(g, n, G):
    """The first rank of SortQuant group g (0 <= g <= G; G gives n) of a bucket of n values: rank p
    is in group (p * G) // n."""
    return (g * n + G - 1) // G


_SQ_SELECT_GROUPS = 16     # SortQuant finds the group bounds without a full sort for up to this many groups
_SQ_BIN = 64               # ... unless a bin holding a group bound has more values than this


@_inline
def _sq_by_bins(xb, n, G, mn, mx, srt, bn, cnt, tgt, tmp, grp, tw):
    """Each element's group of ranks in the bucket xb[:n] (finite, extremes ``mn``, ``mx``) without a
    full sort: the values go to n bins of equal width (a monotone map), and only the bins holding a
    group's first or last rank are gathered and insertion-sorted by (sort key, index); any other
    element is in the group of its bin. Fills ``grp``, and ``srt`` at the ranks of those bins. Returns
    False, deciding nothing, where all values share one bin or such a bin holds more than _SQ_BIN
    (a sort is then cheaper). Scratch: ``tgt`` (n flags, zero between calls), ``tw`` (4 rows of 2G:
    the target bins, their first ranks, their counts; the bin of each group's first rank)."""
    lo = np.float64(mn)
    width = np.float64(mx) - lo
    if not width > 0.0:
        return False
    f = np.float64(n) / width
    for j in range(n):
        bn[j] = min(np.int32((np.float64(xb[j]) - lo) * f), np.int32(n - 1))
    for d in range(n):
        cnt[d] = 0
    for j in range(n):
        cnt[bn[j]] += 1
    nt = 0
    d = 0
    at = 0          # the first rank of bin d
    for g in range(G):
        p0 = _first_rank(g, n, G)
        p1 = _first_rank(g + 1, n, G)
        tw[3, g] = n            # no element's bin lies above it: the group starts past the bucket
        for e in range(2):
            pos = p0 if e == 0 else p1 - 1
            if pos >= n or pos < p0:
                continue
            while at + cnt[d] <= pos:   # the bin holding rank pos
                at += cnt[d]
                d += 1
            if e == 0:
                tw[3, g] = d
            if nt == 0 or tw[0, nt - 1] != d:
                if cnt[d] > _SQ_BIN:
                    return False
                tw[0, nt] = d
                tw[1, nt] = at
                tw[2, nt] = cnt[d]
                nt += 1
    for j in range(n):
        grp[j] = 0
    for g in range(1, G):       # one pass per group bound, each vectorised
        bg = np.int32(tw[3, g])
        for j in range(n):
            grp[j] += np.int32(bn[j] > bg)
    for k in range(nt):         # gather the target bins' elements, index order within each
        d = tw[0, k]
        tgt[d] = 1
        cnt[d] = tw[1, k]
    for j in range(n):
        d = bn[j]
        if tgt[d]:
            k = cnt[d]
            cnt[d] = k + 1
            srt[k] = j
    xu = xb.view(np.uint32)
    for k in range(nt):
        tgt[tw[0, k]] = 0
        s0 = tw[1, k]
        m = tw[2, k]
        for i in range(m):
            v = srt[s0 + i]
            pair = (np.uint64(_sort_key(xu[v])) << U32) | np.uint64(v)
            q = i
            while q > 0 and tmp[q - 1] > pair:
                tmp[q] = tmp[q - 1]
                q -= 1
            tmp[q] = pair
        for i in range(m):
            v = np.int32(tmp[i] & np.uint64(0xFFFFFFFF))
            srt[s0 + i] = v
            grp[v] = np.int32(((s0 + i) * G) // n)
    return True


@_Widths
def _sortquant_encode(x, payload, header, codes_off, codes_end, scales_off, nscales, bs, split_bits,
                      stochastic, key, kchunk, residual, has_res):
    """Sort quantization (``sortquant_encode_ref``): per bucket each element's group and the groups'
    (min, max) (:func:`_sq_by_bins`, else :func:`_sort_values`), then the levels in index order."""
    key = _mix64(key)           # the caller's key, finished (docs/CODECS.md, "Noise and seeds")
    numel = x.size
    scales, nb = _encode_preamble(payload, header, codes_end, scales_off, nscales, numel, bs)
    nchunks = (nb + kchunk - 1) // kchunk
    G = 1 << split_bits
    lb = _BITS - split_bits
    L = (1 << lb) - 1
    Lf = np.float32(L)
    for c in prange(nchunks):
        _wide()
        b0, b1, e0, ng, codes = _chunk_codes(c, kchunk, nb, bs, numel)
        m = min(bs, numel)
        keys = np.empty(m, np.uint32)
        keys2 = np.empty(m, np.uint32)
        order = np.empty(m, np.int64)
        order2 = np.empty(m, np.int64)
        cnt = np.empty(max(256, m), np.int64)
        srt = np.empty(m, np.int32)
        bn = np.empty(m, np.int32)
        tgt = np.zeros(m, np.uint8)
        tw = np.empty((4, 2 * G), np.int64)
        tmp = np.empty(_SQ_BIN, np.uint64)
        grp = np.empty(m, np.int32)
        r24 = np.empty(m, np.uint32)
        qj = np.empty(m, np.int32)
        lj = np.empty(m, np.float32)
        uj = np.empty(m, np.float32)
        los = np.empty(G, np.float32)
        units = np.empty(G, np.float32)
        for b in range(b0, b1):
            st = b * bs
            en = min(numel, st + bs)
            n = en - st
            xb = x[st:en]
            cb = codes[st - e0:en - e0]
            sc = scales[2 * G * b:2 * G * (b + 1)]
            a, mn, mx = _extremes(x, st, en)
            if a >= INF_BITS or (n > 0 and not abs(mx - mn) < FINF):
                _nan_bucket(sc, cb, x, st, residual, has_res)
                continue
            if not (G <= _SQ_SELECT_GROUPS and _sq_by_bins(xb, n, G, mn, mx, srt, bn, cnt, tgt, tmp, grp, tw)):
                keys, order = _sort_values(xb, n, keys, keys2, order, order2, cnt, 0, 8, True)
                for p in range(n):
                    srt[p] = order[p]
                    grp[order[p]] = np.int32((p * G) // n)
            for g in range(G):      # a group's (min, max): the values of its first and last rank
                p0 = _first_rank(g, n, G)
                p1 = _first_rank(g + 1, n, G)
                lo = xb[srt[p0]] if p0 < p1 else F0
                hi = xb[srt[p1 - 1]] if p0 < p1 else F0
                sc[2 * g] = lo
                sc[2 * g + 1] = hi
                los[g] = lo
                units[g] = np.float32(hi - lo) / Lf
            for j in range(n):      # the rest in index order, in loops that vectorise
                g = grp[j]
                lj[j] = los[g]
                uj[j] = units[g]
            if stochastic:
                _draws24(key, st, en, r24)
                for j in range(n):
                    qj[j] = _sq_level(xb[j], lj[j], uj[j], Lf, L, True, r24[j])
            else:
                for j in range(n):
                    qj[j] = _sq_level(xb[j], lj[j], uj[j], Lf, L, False, np.uint32(0))
            for j in range(n):
                cb[j] = np.uint16((grp[j] << lb) | qj[j])
            if has_res:
                rb = residual[st:en]
                for j in range(n):  # xb[j] read before rb[j] (which may be it) is written
                    rb[j] = xb[j] - _sq_value(lj[j], qj[j], uj[j])
        _pack(codes, ng, payload, codes_off + (e0 >> 3) * _BITS, codes_end, _BITS)


@_inline
def _sortquant_dec(payload, out, codes_off, scales, bs, split_bits, e0, e1, accumulate, BITS):
    """out[i] (+)= the value of element i of a SortQuant payload, for i in [e0, e1) (a range decoder);
    up to 8 bits every code's value once per bucket, then a lookup."""
    G = 1 << split_bits
    lb = BITS - split_bits
    L = (1 << lb) - 1
    Lf = np.float32(L)
    K = 1 << BITS
    lo = np.empty(G, np.float32)
    unit = np.empty(G, np.float32)
    book = np.empty(K if K <= 256 else 1, np.float32)
    codes = np.empty(1 if K <= 256 else _DEC_BLOCK, np.int32)
    b = e0 // bs
    st = e0
    while st < e1:
        en = min(e1, (b + 1) * bs)
        sc = scales[2 * G * b:2 * G * (b + 1)]
        for g in range(G):
            lo[g] = sc[2 * g]
            unit[g] = np.float32(sc[2 * g + 1] - sc[2 * g]) / Lf
        if K <= 256:
            for g in range(G):
                bg = book[g << lb:(g + 1) << lb]
                for q in range(L + 1):
                    bg[q] = _sq_value(lo[g], q, unit[g])
            _lookup(payload, codes_off, out[st:en], st, book, accumulate, BITS)
        else:
            for s0 in range(st, en, _DEC_BLOCK):
                ob = _unpack(payload, codes_off, out, s0, en, codes, BITS)
                for j in range(ob.size):
                    g = codes[j] >> lb
                    _put(ob, j, _sq_value(lo[g], codes[j] & L, unit[g]), accumulate)
        st = en
        b += 1


_sortquant_decode = decoders(_sortquant_dec, "sortquant")[0]
