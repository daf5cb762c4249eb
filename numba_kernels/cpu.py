"""Numba CPU kernels (``*_cpu``): ``njit(parallel=True, cache=True)``, bit-identical to ``*_ref``.

Each kernel also has a serial twin, used when the input is a single chunk or Numba has one thread (a
parallel region costs tens of microseconds to start). QSGD kernels are compiled per bit width (on its
first use), so every shift and mask is a constant. Launches are prepared once per configuration
(``prepare_*``: layout, chunking and kernel choice computed once; the plain ``*_cpu`` launchers keep
them in a small cache keyed by ints), so a call costs little more than Numba's dispatch.

Work is split into chunks of whole buckets whose first element is a multiple of 8 (so every chunk
writes whole code bytes and no two threads touch one byte); ``prange`` runs over the chunks. Within a
chunk each bucket's scale is computed, then its elements are quantized into a small code array while
they are still in cache; the chunk's codes are then packed: one pass over ``x`` from memory. The 1-bit
kernels split by elements instead (:func:`task_span`): whole buckets as above for buckets of at most
SEGMENT elements; for longer ones (``OneBit()``'s one bucket per tensor) every segment's sums run in
parallel, each bucket's scales follow from them in the canonical order, then the bits are written a
span at a time, so a tensor of one bucket uses every thread.

Every inner loop is written so the compiler vectorises it: loops run over slices with indices from
zero (a negative index would need a wrap-around check per element), the max scale is an integer max
of the bits, the random draws of a group of 64 elements come from one loop of 32 splitmix64 hashes,
codes are packed and unpacked eight at a time through 64-bit words, and the 1-bit encode builds the
bits of 64 elements in one word. Each parallel task's body asks for 512-bit vectors (:func:`_wide`),
which LLVM does not use by default on Intel CPUs with AVX-512.
"""
import functools
import hashlib
import math
import os
import types

import numba
import numpy as np
from numba import njit, prange
from numba.core import types as nbtypes
from numba.extending import intrinsic

from . import wire
from ._memo import memo
from ._scalar import F0, FINF, FNAN, GAMMA, KMEANS_SAMPLE, SEGMENT, U8, U24M, U32, U40, UFF, build

__all__ = ["qsgd_encode_cpu", "qsgd_decode_cpu", "onebit_encode_cpu", "onebit_decode_cpu",
           "half_encode_cpu", "half_decode_cpu",
           "write_header_cpu", "chunk_buckets", "prepare_qsgd_encode", "prepare_qsgd_decode",
           "prepare_onebit_encode", "prepare_onebit_decode", "header_errors_cpu",
           "qsgd_decode_sum_cpu", "onebit_decode_sum_cpu", "qsgd_reduce_requantize_cpu",
           "onebit_reduce_requantize_cpu", "qsgd_decode_chunks_cpu", "onebit_decode_chunks_cpu",
           "prepare_qsgd_decode_sum", "prepare_onebit_decode_sum", "prepare_qsgd_reduce_requantize",
           "prepare_onebit_reduce_requantize", "prepare_qsgd_decode_chunks",
           "prepare_onebit_decode_chunks", "sortquant_encode_cpu", "sortquant_decode_cpu",
           "prepare_sortquant_encode", "prepare_sortquant_decode", "kmeans_encode_cpu", "kmeans_decode_cpu",
           "prepare_kmeans_encode", "prepare_kmeans_decode"]



def _scalar_stamp():
    """A short hash of ``_scalar.py``, folded into every cached kernel's qualified name: Numba's on-disk
    cache only watches this file's timestamp, and the kernels inline ``_scalar.py``, so a change there
    must select other cache entries (nothing is written here; Numba's cache honours NUMBA_CACHE_DIR)."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_scalar.py"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:12]


_STAMP = _scalar_stamp()

_inline = njit(inline="always", error_model="numpy")


@njit(inline="always")
def _fmul(a, b):
    return a * b


@intrinsic
def _wide(typingctx):
    """Asks LLVM to vectorise the function that calls it with 512-bit registers where the CPU has them
    (the ``prefer-vector-width`` attribute; on Intel CPUs with AVX-512 LLVM otherwise prefers 256-bit).
    Emits no code. Called first in each parallel task's body (the function the loops end up in)."""
    def codegen(context, builder, sig, args):
        # llvmlite validates attribute names against a fixed list; LLVM's string attributes are
        # written into the IR as they are, so the set's own add puts this one in
        set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        return context.get_dummy_value()
    return nbtypes.none(), codegen


@intrinsic
def _as_float(typingctx, v):
    """The float32 whose bits are the int32 ``v``."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], context.get_value_type(nbtypes.float32))
    return nbtypes.float32(nbtypes.int32), codegen


_ops = build(_inline, _fmul)
_qsgd_round = _ops.qsgd_round
_uniform24 = _ops.uniform24
_mix64 = _ops.mix64
_onebit_scales = _ops.onebit_scales
_sqrt32 = _ops.sqrt32
_hdr_err = _ops.header_errors
_sq_level = _ops.sortquant_level
_sq_value = _ops.sortquant_value
_km_draw = _ops.kmeans_draw
_km_scale = _ops.kmeans_scale
_km_fixed = _ops.kmeans_fixed
_km_mean = _ops.kmeans_mean
_km_mids = _ops.kmeans_mids
_km_index = _ops.kmeans_index
_km_starts = _ops.kmeans_starts

_KERNEL = dict(cache=True, error_model="numpy", nogil=True)
_TARGET_CHUNK = 16384       # elements per parallel task
I31 = np.int32(0x7FFFFFFF)
INF_BITS = np.int32(0x7F800000)     # +inf's bits: |x|'s bits reach them only where x is not finite


def _renamed(fn, suffix, glob=None):
    """``fn`` under another qualified name (Numba's cache files are named after it), reading
    ``glob`` for its globals if given."""
    twin = types.FunctionType(fn.__code__, fn.__globals__ if glob is None else glob, fn.__name__ + suffix,
                              fn.__defaults__, fn.__closure__)
    twin.__qualname__ = fn.__qualname__ + suffix
    twin.__module__ = fn.__module__
    return twin


class _Kernel:
    """A kernel compiled twice from one Python function: ``parallel=True`` for inputs of several
    chunks, serial for one chunk. Both carry the hash of ``_scalar.py`` in their qualified names, so
    their on-disk caches never mix with each other or with a build from another ``_scalar.py``.

    ``bits`` (QSGD kernels) is compiled in: the function reads the global ``_BITS``, which its copy of
    the module's globals fixes, so shifts and masks are constants and the pack and unpack loops
    vectorise. Each width is compiled (or loaded from the cache) on its first use."""

    def __init__(self, fn, bits=None):
        tag = _STAMP if bits is None else f"b{bits}_{_STAMP}"
        glob = None if bits is None else dict(fn.__globals__, _BITS=bits)
        self.parallel = njit(parallel=True, **_KERNEL)(_renamed(fn, "_par_" + tag, glob))
        self.serial = njit(parallel=False, **_KERNEL)(_renamed(fn, "_ser_" + tag, glob))

    def pick(self, nchunks):
        return self.parallel if nchunks > 1 and numba.get_num_threads() > 1 else self.serial


class _Widths:
    """A QSGD kernel per bit width (``kernel[bits]``), made on first use."""

    def __init__(self, fn):
        self.fn = fn
        self.made = {}

    def __getitem__(self, bits):
        k = self.made.get(bits)
        if k is None:
            k = self.made[bits] = _Kernel(self.fn, bits)
        return k


_BITS = 0       # replaced in each width's globals (see _Kernel)


def chunk_buckets(bucket_size, numel):
    """Buckets per parallel chunk: a multiple of 8 / gcd(bucket_size, 8), about 16k elements."""
    g = 8 // math.gcd(bucket_size, 8)
    per = max(1, _TARGET_CHUNK // (g * bucket_size))
    return g * per


def task_span(bucket_size, numel):
    """Elements per parallel task of the 1-bit kernels, a multiple of 8 (no byte of codes shared
    between tasks): whole buckets (:func:`chunk_buckets`) for buckets of at most SEGMENT elements,
    whole segments for longer ones, so that one long bucket (``OneBit()``'s default, one per tensor)
    still spreads over the threads."""
    if bucket_size <= SEGMENT:
        return chunk_buckets(bucket_size, numel) * bucket_size
    return SEGMENT * max(1, _TARGET_CHUNK // SEGMENT)


@_inline
def _tree(p):
    stride = 16
    while stride > 0:
        for l in range(stride):
            p[l] = p[l] + p[l + stride]
        stride //= 2
    return p[0]


@_inline
def _lanes():
    """Scratch for the lane sums: p and q (float32) and the counts c (int32), 32 lanes each."""
    return np.empty(32, np.float32), np.empty(32, np.float32), np.empty(32, np.int32)


@_inline
def _lane_add(p, q, c, l, v, kind):
    """Add element ``v`` to lane ``l``: kind 1: v*v to p; 2: v >= 0 to p and to the count c, v < 0
    to q; 3: |v| to p."""
    if kind == 1:
        p[l] = p[l] + v * v
    elif kind == 2:
        # branch-free: adding +0.0 leaves a partial sum unchanged, bit for bit (partials start at
        # +0.0, so none is -0.0)
        pos = v >= F0
        p[l] = p[l] + (v if pos else F0)
        q[l] = q[l] + (F0 if pos else v)
        c[l] += np.int32(pos)
    else:
        p[l] = p[l] + abs(v)


@_inline
def _lane_segment(x, st, en, kind, p, q, c):
    """The lanes of x[st:en] (one segment) into p (and q), by :func:`_lane_add`; returns the count of
    x >= 0 for kind 2 (counted per lane: one count summed across the lanes in the loop kept it from
    vectorising, twice the time). Whole rows of 32 are sliced out so the compiler sees 32 independent
    lanes."""
    for l in range(32):
        p[l] = F0
        q[l] = F0
        c[l] = 0
    full = (en - st) >> 5
    for r in range(full):
        xr = x[st + 32 * r:st + 32 * r + 32]
        for l in range(32):
            _lane_add(p, q, c, l, xr[l], kind)
    xr = x[st + 32 * full:en]
    for l in range(xr.size):
        _lane_add(p, q, c, l, xr[l], kind)
    npos = np.int64(0)
    for l in range(32):
        npos += c[l]
    return npos


@_inline
def _segment_lanes(sp, sq, sn, p, q):
    """The lanes of a bucket's segment sums sp (and sq), segment k on lane k % 32, into p (and q);
    returns the sum of the counts sn."""
    for l in range(32):
        p[l] = F0
        q[l] = F0
    npos = np.int64(0)
    for k in range(sp.size):
        p[k & 31] = p[k & 31] + sp[k]
        q[k & 31] = q[k & 31] + sq[k]
        npos += sn[k]
    return npos


@_inline
def _lane_sums(x, st, en, kind, p, q, c):
    """Canonical lane sums (``reference.lane_sum_ref``) of the bucket x[st:en] into p (and q), whose
    :func:`_tree` is the bucket's sum: one segment's lanes, or, for a bucket of more than SEGMENT
    elements, the lanes of its segments' sums (:func:`_segment_lanes`). Returns the count of x >= 0
    for kind 2."""
    if en - st <= SEGMENT:
        return _lane_segment(x, st, en, kind, p, q, c)
    n = (en - st + SEGMENT - 1) // SEGMENT
    sp = np.empty(n, np.float32)
    sq = np.empty(n, np.float32)
    sn = np.empty(n, np.int64)
    for k in range(n):
        sn[k] = _lane_segment(x, st + k * SEGMENT, min(en, st + k * SEGMENT + SEGMENT), kind, p, q, c)
        sp[k] = _tree(p)
        sq[k] = _tree(q)       # +0.0 unless kind 2
    return _segment_lanes(sp, sq, sn, p, q)


@_inline
def _abs_max_bits(xi, st, en):
    """The bits of max |x| over the bucket (``xi``: x viewed as int32). Non-negative floats order as
    their bits do and every NaN's bits lie above +inf's, so an integer max (which vectorises; a float
    max that propagates NaN does not) gives the max, or a NaN when there is one."""
    m = np.int32(0)
    xb = xi[st:en]
    for j in range(xb.size):
        m = max(m, xb[j] & I31)
    return m


@_inline
def _int_order(v):
    """The float32 bits ``v`` (int32) mapped to an int32 of the same order (-0.0 just below +0.0) and
    back: the negatives' low 31 bits flipped."""
    return v ^ ((v >> np.int32(31)) & I31)


@_inline
def _extremes(x, st, en):
    """(bits of max |x|, min, max) of x[st:en]: the first at or above +inf's bits where a value is not
    finite (as :func:`_abs_max_bits`); the min and max mean something only where all are (-0.0 counts
    below +0.0). Integer maxima and minima of :func:`_int_order`, which vectorise; a float min and max
    did not (a chain of selects that may meet NaN): 3.3 times the time over 4M values, 6.4 times over
    buckets of 512."""
    xi = x.view(np.int32)
    a = np.int32(0)
    kmin = I31
    kmax = ~I31
    for j in range(st, en):
        v = xi[j]
        a = max(a, v & I31)
        k = _int_order(v)
        kmin = min(kmin, k)
        kmax = max(kmax, k)
    return a, _as_float(_int_order(kmin)), _as_float(_int_order(kmax))


@_inline
def _write_header(payload, header):
    for k in range(64):
        payload[k] = np.uint8((header[k >> 3] >> (U8 * np.uint64(k & 7))) & UFF)


@_inline
def _level(xv, unit, sf, s, stochastic, r):
    return np.int32(_qsgd_round(abs(xv) / unit, xv < F0, sf, s, stochastic, r))


@_inline
def _qsgd_levels(x, st, en, codes, c0, unit, sf, s, stochastic, key):
    """codes[i - c0] = the code of x[i] for the elements [st, en) of a bucket whose scale is positive
    and finite. Stochastic: each aligned group of 64 elements takes its 32 splitmix64 draws in one loop
    the compiler vectorises (``_scalar.uniform24``: draw l serves elements l and l + 32); elements of
    partial groups draw one at a time."""
    if not stochastic:
        xb = x[st:en]
        cb = codes[st - c0:en - c0]
        for j in range(xb.size):
            cb[j] = _level(xb[j], unit, sf, s, False, np.uint32(0))
        return
    i = st
    while i < en:
        if (i & 63) == 0 and i + 64 <= en:
            kb = key + np.uint64(i >> 1) * GAMMA            # draw p = (i >> 6) * 32 + l
            xg = x[i:i + 64]
            cg = codes[i - c0:i - c0 + 64]
            for l in range(32):
                z = _mix64(kb + np.uint64(l) * GAMMA)
                cg[l] = _level(xg[l], unit, sf, s, True, np.uint32((z >> U8) & U24M))
                cg[l + 32] = _level(xg[l + 32], unit, sf, s, True, np.uint32(z >> U40))
            i += 64
        else:
            stop = min(en, (i | 63) + 1)
            for j in range(i, stop):
                codes[j - c0] = _level(x[j], unit, sf, s, True, np.uint32(_uniform24(key, j)))
            i = stop


@_inline
def _byte_of(lo, hi, j):
    """Byte j of the 128-bit little-endian number hi:lo."""
    if j < 8:
        return np.uint8((lo >> np.uint64(8 * j)) & UFF)
    return np.uint8((hi >> np.uint64(8 * j - 64)) & UFF)


@_inline
def _pack_groups(codes, g0, g1, payload, base, BITS):
    """Groups [g0, g1) of eight codes, each into its BITS bytes at payload[base + g*BITS:], a byte at
    a time from the codes that overlap its bits: with BITS a constant, which codes and shifts is
    decided at compile time."""
    for g in range(g0, g1):
        cg = codes[8 * g:8 * g + 8]
        pg = payload[base + g * BITS:base + g * BITS + BITS]
        if BITS < 8:                               # up to 4 codes per byte
            for j in range(BITS):
                v = np.uint32(0)
                for k in range(8):
                    off = k * BITS - 8 * j         # where code k starts, relative to byte j
                    if off > -BITS and off < 8:
                        if off >= 0:
                            v |= np.uint32(cg[k]) << np.uint32(off)
                        else:
                            v |= np.uint32(cg[k]) >> np.uint32(-off)
                pg[j] = np.uint8(v & np.uint32(0xFF))
        else:                                      # one or two codes per byte
            for j in range(BITS):
                k = (8 * j) // BITS
                sh = 8 * j - k * BITS
                v = np.uint32(cg[k]) >> np.uint32(sh)
                if sh + 8 > BITS:
                    v |= np.uint32(cg[k + 1]) << np.uint32(BITS - sh)
                pg[j] = np.uint8(v & np.uint32(0xFF))


@_inline
def _pack(codes, ng, payload, base, lim, BITS):
    """codes[0:8*ng] as BITS-bit little-endian fields into payload[base:lim] (lim - base <= ng*BITS
    bytes): eight codes fill exactly BITS bytes. ``BITS`` is a compile-time constant, so the shifts
    are constants. ``codes`` is scratch: the odd widths' pack overwrites it."""
    lim = min(lim, base + ng * BITS)
    pb = payload[base:lim]
    if BITS == 8:
        for j in range(pb.size):
            pb[j] = np.uint8(codes[j])
        return
    if BITS == 4:                                   # a byte's two codes read as one uint32
        cw = codes.view(np.uint32)
        for j in range(pb.size):
            w = cw[j]
            pb[j] = np.uint8((w | (w >> np.uint32(12))) & np.uint32(0xFF))
        return
    if BITS == 2:                                   # a byte's four codes read as one uint64 (2.6x
        cq = codes.view(np.uint64)                  # faster than four 16-bit reads)
        for j in range(pb.size):
            w = cq[j]
            pb[j] = np.uint8((w | (w >> np.uint64(14)) | (w >> np.uint64(28)) | (w >> np.uint64(42))) & UFF)
        return
    if BITS == 16:                                  # the codes' own little-endian bytes
        cb = codes.view(np.uint8)
        for j in range(pb.size):
            pb[j] = cb[j]
        return
    whole = min(ng, (lim - base) // BITS)          # groups whose BITS bytes all lie before lim
    # groups [head, head + 8*nsg) as BITS 64-bit words per 64 codes (1.6-2.9x faster than a byte at a
    # time, BENCHMARKS); the groups before head bring the words to an 8-byte boundary
    head = 0
    addr = payload.ctypes.data + base
    while head < 8 and (addr + head * BITS) & 7:
        head += 1
    if head == 8:                                  # no group starts on one: bytes only
        head = whole
    head = min(head, whole)
    nsg = (whole - head) >> 3
    _pack_groups(codes, 0, head, payload, base, BITS)
    if nsg:
        # each 64-bit word of four codes (16 bits apart) squeezed into its low 4*BITS bits in place
        # (two shift-mask-or steps the compiler vectorises; codes are below 2**BITS, so the fields
        # each step joins never overlap), then 16 such units per 64 codes shifted into the BITS words
        cw = codes.view(np.uint64)
        m = np.uint64((1 << BITS) - 1)
        lo1 = m | (m << np.uint64(32))
        hi1 = lo1 << np.uint64(BITS)
        lo2 = np.uint64((1 << (2 * BITS)) - 1)
        hi2 = lo2 << np.uint64(2 * BITS)
        u0 = 2 * head
        cu = cw[u0:u0 + 16 * nsg]
        for k in range(cu.size):
            a = cu[k]
            a = (a & lo1) | ((a >> np.uint64(16 - BITS)) & hi1)
            cu[k] = (a & lo2) | ((a >> np.uint64(32 - 2 * BITS)) & hi2)
        pw = payload[base + head * BITS:base + (head + 8 * nsg) * BITS].view(np.uint64)
        for sg in range(nsg):
            ub = cw[u0 + 16 * sg:u0 + 16 * sg + 16]
            wb = pw[sg * BITS:sg * BITS + BITS]
            acc = np.uint64(0)
            for k in range(16):                    # unrolled: every offset a constant
                off = (k * 4 * BITS) & 63
                u = ub[k]
                acc |= u << np.uint64(off)
                if off + 4 * BITS >= 64:
                    wb[(k * 4 * BITS) >> 6] = acc
                    acc = u >> np.uint64(64 - off)
    _pack_groups(codes, head + 8 * nsg, whole, payload, base, BITS)
    for g in range(whole, ng):                     # the group that lim cuts short
        cg = codes[8 * g:8 * g + 8]
        lo = np.uint64(0)
        hi = np.uint64(0)
        for k in range(8):
            off = k * BITS
            uc = np.uint64(cg[k])
            if off < 64:
                lo |= uc << np.uint64(off)
                if off + BITS > 64:
                    hi |= uc >> np.uint64(64 - off)
            else:
                hi |= uc << np.uint64(off - 64)
        b = base + g * BITS
        for j in range(max(0, lim - b)):
            payload[b + j] = _byte_of(lo, hi, j)


@_inline
def _chunk_codes(c, kchunk, nb, bs, numel):
    """Chunk ``c`` of an encode: its buckets [b0, b1), first element e0 (a multiple of 8:
    chunk_buckets), its ng groups of eight codes and their uint16 array (the tail past the input 0)."""
    b0 = c * kchunk
    b1 = min(nb, b0 + kchunk)
    e0 = b0 * bs
    e1 = min(numel, b1 * bs)
    ng = (e1 - e0 + 7) >> 3
    codes = np.empty(8 * ng, np.uint16)
    for k in range(e1 - e0, 8 * ng):
        codes[k] = 0
    return b0, b1, e0, ng, codes


@_Widths
def _qsgd_encode(x, payload, header, codes_off, codes_end, scales_off, nscales, bs, stochastic,
                 norm_l2, key, kchunk, residual, has_res):
    numel = x.size
    scales = payload[scales_off:scales_off + 4 * nscales].view(np.float32)
    scale_bits = scales.view(np.int32)
    xi = x.view(np.int32)
    _write_header(payload, header)
    for k in range(codes_end, scales_off):
        payload[k] = 0
    nb = (numel + bs - 1) // bs
    nchunks = (nb + kchunk - 1) // kchunk
    s = (1 << (_BITS - 1)) - 1
    sf = np.float32(s)
    for c in prange(nchunks):
        _wide()
        p, q, cl = _lanes()
        b0, b1, e0, ng, codes = _chunk_codes(c, kchunk, nb, bs, numel)
        for b in range(b0, b1):
            st = b * bs
            en = min(numel, st + bs)
            if norm_l2:
                _lane_sums(x, st, en, 1, p, q, cl)
                scales[b] = _sqrt32(_tree(p))
            else:
                scale_bits[b] = _abs_max_bits(xi, st, en)
            scale = scales[b]
            unit = scale / sf
            if scale > F0 and scale < FINF:
                _qsgd_levels(x, st, en, codes, e0, unit, sf, s, stochastic, key)
            else:                       # zero or non-finite scale: level 0 (decodes to 0 or NaN)
                for j in range(st - e0, en - e0):
                    codes[j] = s
            if has_res:
                # what the decode writes: float32(code - s) * unit (x[i] is read before residual[i]
                # is written: residual may be x)
                xb = x[st:en]
                rb = residual[st:en]
                cb = codes[st - e0:en - e0]
                for j in range(xb.size):
                    rb[j] = xb[j] - np.float32(cb[j] - s) * unit
        _pack(codes, ng, payload, codes_off + (e0 >> 3) * _BITS, codes_end, _BITS)


@_inline
def _sort_key(u):
    """The float32 bits ``u`` mapped to an unsigned int of the same order (-0.0 as +0.0)."""
    if u == np.uint32(0x80000000):
        u = np.uint32(0)
    return ~u if u >> np.uint32(31) else u | np.uint32(0x80000000)


@_inline
def _sort_values(xb, n, keys, keys2, order, order2, cnt, lo, w, with_order):
    """The :func:`_sort_key` of xb[:n]'s values sorted by their bits ``lo``..31 (0: a full sort), and
    with ``with_order`` their indices, ties in index order (a stable sort): an LSD radix sort, a pass
    per ``w`` bits (``32 - lo`` a multiple of it). Returns the arrays holding the result, (keys,
    order) or (keys2, order2). (Numba's own sort of 512 values took about 30 us, this about a fifth.
    Out of cache, a pass with 8-bit digits took 2.4 times as long as one with 6-bit digits on the
    development VM: 256 output streams against 64; docs/BENCHMARKS.md.)"""
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
def _draws24(key, st, en, r):
    """r[j] = the 24 random bits of element st + j (``_scalar.uniform24``) for the elements [st, en):
    each aligned group of 64 takes its 32 splitmix64 draws in one loop the compiler vectorises, as in
    :func:`_qsgd_levels`; elements of partial groups draw one at a time."""
    i = st
    while i < en:
        if (i & 63) == 0 and i + 64 <= en:
            kb = key + np.uint64(i >> 1) * GAMMA
            rg = r[i - st:i - st + 64]
            for l in range(32):
                z = _mix64(kb + np.uint64(l) * GAMMA)
                rg[l] = np.uint32((z >> U8) & U24M)
                rg[l + 32] = np.uint32(z >> U40)
            i += 64
        else:
            stop = min(en, (i | 63) + 1)
            for j in range(i, stop):
                r[j - st] = np.uint32(_uniform24(key, j))
            i = stop


@_inline
def _first_rank(g, n, G):
    """The first rank of SortQuant group g (0 <= g <= G; G gives n) of a bucket of n values: rank p
    is in group (p * G) // n."""
    return (g * n + G - 1) // G


_SQ_SELECT_GROUPS = 16     # SortQuant finds the group bounds without a full sort for up to this many groups
_SQ_BIN = 64               # ... unless a bin holding a group bound has more values than this


@_inline
def _sq_by_bins(xb, n, G, mn, mx, srt, bn, cnt, tgt, tmp, grp, ends, tw):
    """Each element's group of ranks in the bucket xb[:n] (finite, extremes ``mn``, ``mx``) without a
    full sort: the elements are spread over n bins of equal width by value (a monotone map, so the
    bins in order hold the values in order), and only the bins holding a group's first or last rank
    (the target bins) are gathered and sorted (insertion sort by (sort key, index), the stable sort's
    order). An element outside them is in the group of its bin: the count of groups whose first rank
    lies in a lower bin. Fills ``grp`` and ``ends[2g]``, ``ends[2g + 1]`` (the indices of the
    elements of ranks p0 and p1 - 1 of group g, -1 for an empty group); ``srt`` holds the target
    bins' elements at their ranks. Returns False, having decided nothing, where the values all share
    one bin or a target bin holds more than _SQ_BIN of them (a sort is then cheaper). Scratch:
    ``tgt`` (n flags, zero between calls), ``tw`` (4 rows of 2G: the target bins, their first ranks,
    their counts; the bin of each group's first rank)."""
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
    for g in range(G):
        p0 = _first_rank(g, n, G)
        p1 = _first_rank(g + 1, n, G)
        ends[2 * g] = srt[p0] if p0 < p1 else -1
        ends[2 * g + 1] = srt[p1 - 1] if p0 < p1 else -1
    return True


@_Widths
def _sortquant_encode(x, payload, header, codes_off, codes_end, scales_off, nscales, bs, split_bits,
                      stochastic, key, kchunk, residual, has_res):
    """Sort quantization (``sortquant_encode_ref``): per bucket, each element's group of ranks and the
    groups' (min, max), from the bounds' ranks (:func:`_sq_by_bins`) or the stable order of the
    values (:func:`_sort_values`), then each element's level within its group, in index order."""
    numel = x.size
    scales = payload[scales_off:scales_off + 4 * nscales].view(np.float32)
    _write_header(payload, header)
    for k in range(codes_end, scales_off):
        payload[k] = 0
    nb = (numel + bs - 1) // bs
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
        ends = np.empty(2 * G, np.int64)
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
                for k in range(2 * G):
                    sc[k] = FNAN
                for j in range(n):
                    cb[j] = 0
                    if has_res:
                        residual[st + j] = xb[j] - FNAN
                continue
            if not (G <= _SQ_SELECT_GROUPS and _sq_by_bins(xb, n, G, mn, mx, srt, bn, cnt, tgt, tmp, grp, ends, tw)):
                keys, order = _sort_values(xb, n, keys, keys2, order, order2, cnt, 0, 8, True)
                for g in range(G):
                    p0 = _first_rank(g, n, G)
                    p1 = _first_rank(g + 1, n, G)
                    ends[2 * g] = order[p0] if p0 < p1 else -1
                    ends[2 * g + 1] = order[p1 - 1] if p0 < p1 else -1
                    for p in range(p0, p1):
                        grp[order[p]] = g
            for g in range(G):
                lo = F0
                hi = F0
                if ends[2 * g] >= 0:
                    lo = xb[ends[2 * g]]
                    hi = xb[ends[2 * g + 1]]
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


@_Widths
def _sortquant_decode(payload, out, codes_off, scales_off, nscales, bs, split_bits, accumulate, kchunk):
    numel = out.size
    scales = payload[scales_off:scales_off + 4 * nscales].view(np.float32)
    nb = (numel + bs - 1) // bs
    nchunks = (nb + kchunk - 1) // kchunk
    G = 1 << split_bits
    lb = _BITS - split_bits
    L = (1 << lb) - 1
    Lf = np.float32(L)
    K = 1 << _BITS
    for c in prange(nchunks):
        _wide()
        lo = np.empty(G, np.float32)
        unit = np.empty(G, np.float32)
        book = np.empty(K if K <= 256 else 1, np.float32)
        codes = np.empty(1 if K <= 256 else _DEC_BLOCK, np.int32)
        b0 = c * kchunk
        for b in range(b0, min(nb, b0 + kchunk)):
            sc = scales[2 * G * b:2 * G * (b + 1)]
            for g in range(G):
                lo[g] = sc[2 * g]
                unit[g] = np.float32(sc[2 * g + 1] - sc[2 * g]) / Lf
            en = min(numel, (b + 1) * bs)
            if K <= 256:        # up to 8 bits: every code's value once per bucket, then a lookup
                for g in range(G):
                    bg = book[g << lb:(g + 1) << lb]
                    for q in range(L + 1):
                        bg[q] = _sq_value(lo[g], q, unit[g])
                _lookup(payload, codes_off, out[b * bs:en], b * bs, book, accumulate, _BITS)
                continue
            for st in range(b * bs, en, _DEC_BLOCK):
                ob = _unpack(payload, codes_off, out, st, en, codes, _BITS)
                for j in range(ob.size):
                    g = codes[j] >> lb
                    _put(ob, j, _sq_value(lo[g], codes[j] & L, unit[g]), accumulate)


@_inline
def _kmeans_assign(mids, xb, q, K):
    """q[j] = the centroid of xb[j] (``q``: the bucket's codes): the count of boundaries below it. Up
    to 32 centroids, K - 1 compares that the compiler vectorises across elements (about 13x faster
    than a search and a sum per element); above, the binary search (K is a compile-time constant
    either way)."""
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
    """The first index in [lo, hi) whose value's top key bits (:func:`_sort_key` above _KM_LOW) reach
    ``kt``, ``bits`` ordered by them."""
    while lo < hi:
        m = (lo + hi) >> 1
        if (_sort_key(bits[m]) >> np.uint32(_KM_LOW)) < kt:
            lo = m + 1
        else:
            hi = m
    return lo


@_inline
def _km_below(bits, n, pre, t, tb, scale):
    """(count, fixed-point sum) of the values at or below ``t`` (float32 bits ``tb``) among the float32
    bits ``bits[:n]`` ordered by their top key bits, whose fixed-point sums before every _KM_RUN-th
    value are ``pre``: binary searches for the run of values whose top key bits are t's, then a
    count of it that vectorises."""
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
    """The codebook ``cent`` (K centroids) of the bucket x[st:st + n], whose extremes are ``lo`` and
    ``hi`` (``_kmeans_bucket`` in the reference). The bucket is ordered once, by the top 18 bits of its
    values' sort keys; a centroid's members are then a run of it between two boundaries (binary
    searches and a count of the values sharing the boundary's top bits: :func:`_km_below`), their
    fixed-point sum a difference of partial sums, so a Lloyd step costs K searches instead of a pass
    over the bucket. Stops early once a step leaves every centroid where it was: the later steps
    would repeat it exactly."""
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
    """KMeans (``kmeans_encode_ref``): per bucket the codebook (:func:`_kmeans_fit`), then each
    element's centroid index."""
    numel = x.size
    scales = payload[scales_off:scales_off + 4 * nscales].view(np.float32)
    _write_header(payload, header)
    for k in range(codes_end, scales_off):
        payload[k] = 0
    nb = (numel + bs - 1) // bs
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
                for j in range(K):
                    cent[j] = FNAN
                for j in range(n):
                    cb[j] = 0
                    if has_res:
                        residual[st + j] = x[st + j] - FNAN
                continue
            _kmeans_fit(x, st, n, b, iters, key, np.uint32(a), lo, hi, cent, mids, sample, comp, keys, keys2, pre, cnt, K)
            _km_mids(cent, mids)
            xb = x[st:st + n]
            _kmeans_assign(mids, xb, cb, K)
            if has_res:     # every code found before residual (which may be x) is written
                for j in range(n):
                    residual[st + j] = xb[j] - cent[cb[j]]
        _pack(codes, ng, payload, codes_off + (e0 >> 3) * _BITS, codes_end, _BITS)


@_Widths
def _kmeans_decode(payload, out, codes_off, scales_off, nscales, bs, accumulate, span):
    """Split by elements (:func:`task_span`), so that one codebook per tensor (the default) decodes
    on every thread: each task looks its elements up in their buckets' codebooks."""
    numel = out.size
    scales = payload[scales_off:scales_off + 4 * nscales].view(np.float32)
    K = 1 << _BITS
    for t in prange((numel + span - 1) // span):
        _wide()
        a = t * span
        e = min(numel, a + span)
        while a < e:
            b = a // bs
            z = min(e, (b + 1) * bs)
            _lookup(payload, codes_off, out[a:z], a, scales[K * b:K * (b + 1)], accumulate, _BITS)
            a = z


@_inline
def _put(ob, j, v, accumulate):
    if accumulate:
        ob[j] = ob[j] + v
    else:
        ob[j] = v


@_inline
def _field(payload, o, shift, BITS):
    """The BITS-bit field starting at bit ``shift`` (0..7) of byte ``o``, from the 1 to 3 bytes it
    spans (BITS <= 16). Reading past the codes stays inside the payload (the scales follow them)."""
    if BITS == 8:
        w = np.int32(payload[o])
    elif BITS == 16:
        w = np.int32(payload[o]) | (np.int32(payload[o + 1]) << 8)
    elif 8 % BITS == 0:
        w = np.int32(payload[o]) >> shift
    elif BITS <= 9:
        w = (np.int32(payload[o]) | (np.int32(payload[o + 1]) << 8)) >> shift
    else:
        w = (np.int32(payload[o]) | (np.int32(payload[o + 1]) << 8)
             | (np.int32(payload[o + 2]) << 16)) >> shift
    return w & np.int32((1 << BITS) - 1)


_DEC_BLOCK = 1024       # codes unpacked at a time before their values are written


@_inline
def _unpack(payload, codes_off, out, st, en, codes, BITS):
    """The codes of elements st .. min(en, st + _DEC_BLOCK) - 1 into ``codes`` (codes[j]: element st + j,
    whose BITS-bit field starts at bit (st + j) * BITS of the codes); returns that slice of ``out``, for
    their values. ``BITS`` is a compile-time constant, so shifts and masks are constants. When the
    block starts on a byte, each group of eight fields is read from the 64-bit words of its BITS bytes
    (the compiler merges the byte loads; about twice as fast as field by field); the rest field by
    field, from the 1 to 3 bytes a field spans (BITS <= 16, shift <= 7). Reading past the codes stays
    inside the payload (the scales follow them), and the words are read only where they fit in it."""
    n = min(_DEC_BLOCK, en - st)
    mask = np.uint64((1 << BITS) - 1)
    first = st * BITS
    cb = codes_off + (first >> 3)
    sh = first & 7
    j0 = 0
    if sh == 0:
        width = 16 if BITS > 8 else 8          # bytes read per group of eight fields
        ng = min(n >> 3, max(0, (payload.size - width - cb) // BITS + 1))
        for g in range(ng):
            pg = payload[cb + g * BITS:cb + g * BITS + width]
            lo = np.uint64(0)
            hi = np.uint64(0)
            for k in range(8):
                lo |= np.uint64(pg[k]) << np.uint64(8 * k)
                if BITS > 8:
                    hi |= np.uint64(pg[8 + k]) << np.uint64(8 * k)
            for k in range(8):
                off = k * BITS
                if off >= 64:
                    c = hi >> np.uint64(off - 64)
                elif off + BITS > 64:
                    c = (lo >> np.uint64(off)) | (hi << np.uint64(64 - off))
                else:
                    c = lo >> np.uint64(off)
                codes[8 * g + k] = np.int32(c & mask)
        j0 = 8 * ng
    for j in range(j0, n):
        bp = sh + j * BITS
        codes[j] = _field(payload, cb + (bp >> 3), bp & 7, BITS)
    return out[st:st + n]


@_inline
def _lookup(payload, codes_off, ob, st, book, accumulate, BITS):
    """ob[j] (+)= book[code of element st + j] for every j of ``ob`` (BITS <= 8; ``book`` holds a value
    per code). Where element st starts on a byte, eight codes at a time from the BITS bytes that hold
    them, each value read from the book as its code is cut out (no array of codes between: the
    SortQuant and KMeans decodes took 1.5-2.2x as long unpacking first, their table reads gathers;
    docs/BENCHMARKS.md); the rest field by field."""
    n = ob.size
    first = st * BITS
    cb = codes_off + (first >> 3)
    sh = first & 7
    mask = np.uint64((1 << BITS) - 1)
    j0 = 0
    if sh == 0:
        for g in range(n >> 3):
            pg = payload[cb + g * BITS:cb + (g + 1) * BITS]
            w = np.uint64(0)
            for k in range(BITS):
                w |= np.uint64(pg[k]) << np.uint64(8 * k)
            for k in range(8):
                _put(ob, 8 * g + k, book[(w >> np.uint64(k * BITS)) & mask], accumulate)
        j0 = (n >> 3) << 3
    for j in range(j0, n):
        bp = sh + j * BITS
        _put(ob, j, book[_field(payload, cb + (bp >> 3), bp & 7, BITS)], accumulate)


@_inline
def _qsgd_dec_range(payload, out, codes_off, scales, bs, b0, b1, accumulate, BITS):
    """out[i] (+)= the value of element i of a QSGD payload, for the elements of buckets [b0, b1).
    At 8 bits each value comes from its byte in one loop that vectorises whole; up to 7 bits (and
    buckets of at least half as many elements as codes) each code's value is computed once per
    bucket and looked up (:func:`_lookup`). Both are faster than unpacking the codes into an array and
    computing each element's value from its code, which the other widths do (docs/BENCHMARKS.md)."""
    numel = out.size
    s = np.int32((1 << (BITS - 1)) - 1)
    sf = np.float32(s)
    K = 1 << BITS
    table = K <= 128 and K <= 2 * bs
    book = np.empty(K if table else 1, np.float32)
    codes = np.empty(1 if table or BITS == 8 else _DEC_BLOCK, np.int32)
    for b in range(b0, b1):
        unit = scales[b] / sf
        en = min(numel, (b + 1) * bs)
        if BITS == 8:
            ob = out[b * bs:en]
            pb = payload[codes_off + b * bs:codes_off + en]
            for j in range(ob.size):
                _put(ob, j, np.float32(np.int32(pb[j]) - s) * unit, accumulate)
            continue
        if table:
            for c in range(K):
                book[c] = np.float32(np.int32(c) - s) * unit
            _lookup(payload, codes_off, out[b * bs:en], b * bs, book, accumulate, BITS)
            continue
        for st in range(b * bs, en, _DEC_BLOCK):
            ob = _unpack(payload, codes_off, out, st, en, codes, BITS)
            for j in range(ob.size):
                _put(ob, j, np.float32(codes[j] - s) * unit, accumulate)


@_Widths
def _qsgd_decode(payload, out, codes_off, scales_off, nscales, bs, accumulate, kchunk):
    numel = out.size
    scales = payload[scales_off:scales_off + 4 * nscales].view(np.float32)
    nb = (numel + bs - 1) // bs
    nchunks = (nb + kchunk - 1) // kchunk
    for c in prange(nchunks):
        _wide()
        b0 = c * kchunk
        _qsgd_dec_range(payload, out, codes_off, scales, bs, b0, min(nb, b0 + kchunk), accumulate, _BITS)


@_Widths
def _qsgd_decode_sum(payloads, npay, total, out, codes_off, scales_off, nscales, bs, kchunk,
                     addend, has_add):
    """out = the float32 sum of the npay payloads' decodes, in payload order (+ addend[i] last)."""
    numel = out.size
    nb = (numel + bs - 1) // bs
    nchunks = (nb + kchunk - 1) // kchunk
    for c in prange(nchunks):
        _wide()
        b0 = c * kchunk
        b1 = min(nb, b0 + kchunk)
        for k in range(npay):
            p = payloads[k * total:(k + 1) * total]
            scales = p[scales_off:scales_off + 4 * nscales].view(np.float32)
            _qsgd_dec_range(p, out, codes_off, scales, bs, b0, b1, k > 0, _BITS)
        if has_add:
            for i in range(b0 * bs, min(numel, b1 * bs)):
                out[i] = out[i] + addend[i]


@_Widths
def _qsgd_decode_chunks(gathered, out, chunk, total, scales_off, nscales, last_total, last_scales_off,
                        last_nscales, codes_off, bs, kchunk):
    """Chunk j's payload (at j*total in gathered) decoded into out[j*chunk:(j+1)*chunk]; the last
    chunk has its own layout (last_*)."""
    numel = out.size
    nch = (numel + chunk - 1) // chunk
    per = (chunk // bs + kchunk - 1) // kchunk          # tasks per full chunk
    for t in prange(nch * per):
        _wide()
        j = t // per
        c = t - j * per
        a = j * chunk
        o = out[a:min(numel, a + chunk)]
        if j == nch - 1:
            p = gathered[j * total:j * total + last_total]
            scales = p[last_scales_off:last_scales_off + 4 * last_nscales].view(np.float32)
        else:
            p = gathered[j * total:(j + 1) * total]
            scales = p[scales_off:scales_off + 4 * nscales].view(np.float32)
        nb = (o.size + bs - 1) // bs
        b0 = c * kchunk
        if b0 < nb:
            _qsgd_dec_range(p, o, codes_off, scales, bs, b0, min(nb, b0 + kchunk), False, _BITS)


@_inline
def _onebit_store(scales, b, two_mean, sp, sq, npos, n):
    """Stores bucket b's scales (:func:`_onebit_scales`) from its sums and count of x >= 0."""
    hi, lo = _onebit_scales(two_mean, sp, sq, npos, n)
    if two_mean:
        scales[2 * b] = hi
        scales[2 * b + 1] = lo
    else:
        scales[b] = hi


@_inline
def _onebit_scale(x, scales, b, bs, two_mean, p, q, c):
    """Bucket b's scales from its canonical sums (:func:`_lane_sums`)."""
    st = b * bs
    en = min(x.size, st + bs)
    if two_mean:        # (the kind a literal: each loop compiled for its own)
        npos = _lane_sums(x, st, en, 2, p, q, c)
    else:
        npos = _lane_sums(x, st, en, 3, p, q, c)
    _onebit_store(scales, b, two_mean, _tree(p), _tree(q), npos, en - st)


@_inline
def _onebit_pair(scales, b, two_mean):
    """(hi, lo): what bucket b's bits 1 and 0 decode to."""
    if two_mean:
        return scales[2 * b], scales[2 * b + 1]
    return scales[b], -scales[b]


@_inline
def _onebit_bits(x, payload, codes_off, scales, bs, two_mean, e0, e1, residual, has_res):
    """The bits (x >= 0) of x[e0:e1], eight to a byte (e0 a multiple of 8), and their residual."""
    xs = x[e0:e1]
    pb = payload[codes_off + (e0 >> 3):codes_off + ((e1 + 7) >> 3)]
    nw = xs.size >> 6
    for w in range(nw):       # 64 bits in a word, then its 8 bytes (4.6x faster than byte by byte)
        xg = xs[64 * w:64 * w + 64]
        v = np.uint64(0)
        for k in range(64):
            v |= np.uint64(xg[k] >= F0) << np.uint64(k)
        pg = pb[8 * w:8 * w + 8]
        for k in range(8):
            pg[k] = np.uint8((v >> np.uint64(8 * k)) & UFF)
    for j in range(8 * nw, pb.size):
        u = np.int32(0)
        for k in range(min(8, xs.size - 8 * j)):
            u |= np.int32(xs[8 * j + k] >= F0) << k
        pb[j] = np.uint8(u)
    if has_res:
        # what the decode writes for the bit (x >= 0) of each element
        st = e0
        while st < e1:
            b = st // bs
            en = min(e1, b * bs + bs)
            hi, lo = _onebit_pair(scales, b, two_mean)
            xb = x[st:en]
            rb = residual[st:en]
            for j in range(xb.size):
                xv = xb[j]
                rb[j] = xv - (hi if xv >= F0 else lo)
            st = en


@_inline
def _onebit_header_pad(payload, header, codes_end, scales_off, nscales):
    """Writes the header, zeroes the padding after the codes; returns the scales (float32)."""
    _write_header(payload, header)
    for k in range(codes_end, scales_off):
        payload[k] = 0
    return payload[scales_off:scales_off + 4 * nscales].view(np.float32)


@_Kernel
def _onebit_encode(x, payload, header, codes_off, codes_end, scales_off, nscales, bs, two_mean, span,
                   residual, has_res):
    """Buckets of at most SEGMENT elements: each task (``span`` elements, whole buckets) takes its
    buckets' sums, then their bits, while they are in cache."""
    numel = x.size
    scales = _onebit_header_pad(payload, header, codes_end, scales_off, nscales)
    nb = (numel + bs - 1) // bs
    per = span // bs
    for c in prange((numel + span - 1) // span):
        _wide()
        p, q, cl = _lanes()
        for b in range(c * per, min(nb, c * per + per)):
            _onebit_scale(x, scales, b, bs, two_mean, p, q, cl)
        _onebit_bits(x, payload, codes_off, scales, bs, two_mean, c * span, min(numel, c * span + span),
                     residual, has_res)


@_Kernel
def _onebit_encode_long(x, payload, header, codes_off, codes_end, scales_off, nscales, bs, two_mean,
                        span, residual, has_res):
    """Buckets of more than SEGMENT elements (``OneBit()``'s one bucket per tensor): every segment's
    sums in parallel, each bucket's scales from them in the canonical order (:func:`_lane_sums`),
    then the bits, ``span`` elements (whole segments) per task."""
    numel = x.size
    scales = _onebit_header_pad(payload, header, codes_end, scales_off, nscales)
    nb = (numel + bs - 1) // bs
    nseg = (bs + SEGMENT - 1) // SEGMENT
    sp = np.zeros(nb * nseg, np.float32)
    sq = np.zeros(nb * nseg, np.float32)
    sn = np.zeros(nb * nseg, np.int64)
    for t in prange(nb * nseg):
        _wide()
        b = t // nseg
        st = b * bs + (t - b * nseg) * SEGMENT
        en = min(min(numel, b * bs + bs), st + SEGMENT)
        if st < en:
            tp, tq, tc = _lanes()
            if two_mean:
                sn[t] = _lane_segment(x, st, en, 2, tp, tq, tc)
            else:
                sn[t] = _lane_segment(x, st, en, 3, tp, tq, tc)
            sp[t] = _tree(tp)
            sq[t] = _tree(tq)
    # a short last bucket's missing segments add +0.0 (count 0): no lane changes (docs/CODECS.md)
    p = np.empty(32, np.float32)
    q = np.empty(32, np.float32)
    for b in range(nb):
        t = b * nseg
        npos = _segment_lanes(sp[t:t + nseg], sq[t:t + nseg], sn[t:t + nseg], p, q)
        _onebit_store(scales, b, two_mean, _tree(p), _tree(q), npos, min(numel, b * bs + bs) - b * bs)
    for c in prange((numel + span - 1) // span):
        _wide()
        _onebit_bits(x, payload, codes_off, scales, bs, two_mean, c * span, min(numel, c * span + span),
                     residual, has_res)


@_inline
def _onebit_unpack(payload, codes_off, st, ob, hi, lo, accumulate):
    """ob[j] (+)= hi or lo, as bit st + j of the codes is 1 or 0: eight at a time from each byte when
    the bucket starts on one, the rest bit by bit."""
    j0 = 0
    if (st & 7) == 0:
        pb = payload[codes_off + (st >> 3):codes_off + ((st + ob.size) >> 3)]
        for g in range(pb.size):
            v = pb[g]
            og = ob[8 * g:8 * g + 8]
            for k in range(8):
                _put(og, k, hi if (v >> k) & 1 else lo, accumulate)
        j0 = 8 * pb.size
    for j in range(j0, ob.size):
        i = st + j
        _put(ob, j, hi if (payload[codes_off + (i >> 3)] >> (i & 7)) & 1 else lo, accumulate)


@_inline
def _onebit_dec_range(payload, out, codes_off, scales, bs, two_mean, e0, e1, accumulate):
    """out[i] (+)= the value of element i of a 1-bit payload, for i in [e0, e1)."""
    st = e0
    while st < e1:
        b = st // bs
        en = min(e1, b * bs + bs)
        hi, lo = _onebit_pair(scales, b, two_mean)
        if accumulate:
            _onebit_unpack(payload, codes_off, st, out[st:en], hi, lo, True)
        else:
            _onebit_unpack(payload, codes_off, st, out[st:en], hi, lo, False)
        st = en


@_Kernel
def _onebit_decode(payload, out, codes_off, scales_off, nscales, bs, two_mean, accumulate, span):
    numel = out.size
    scales = payload[scales_off:scales_off + 4 * nscales].view(np.float32)
    for c in prange((numel + span - 1) // span):
        _wide()
        _onebit_dec_range(payload, out, codes_off, scales, bs, two_mean, c * span,
                          min(numel, c * span + span), accumulate)


@_Kernel
def _onebit_decode_sum(payloads, npay, total, out, codes_off, scales_off, nscales, bs, two_mean, span,
                       addend, has_add):
    numel = out.size
    for c in prange((numel + span - 1) // span):
        _wide()
        e0 = c * span
        e1 = min(numel, e0 + span)
        for k in range(npay):
            p = payloads[k * total:(k + 1) * total]
            scales = p[scales_off:scales_off + 4 * nscales].view(np.float32)
            _onebit_dec_range(p, out, codes_off, scales, bs, two_mean, e0, e1, k > 0)
        if has_add:
            for i in range(e0, e1):
                out[i] = out[i] + addend[i]


@_Kernel
def _onebit_decode_chunks(gathered, out, chunk, total, scales_off, nscales, last_total, last_scales_off,
                          last_nscales, codes_off, bs, two_mean, span):
    numel = out.size
    nch = (numel + chunk - 1) // chunk
    per = (chunk + span - 1) // span
    for t in prange(nch * per):
        _wide()
        j = t // per
        e0 = (t - j * per) * span
        a = j * chunk
        o = out[a:min(numel, a + chunk)]
        if j == nch - 1:
            p = gathered[j * total:j * total + last_total]
            scales = p[last_scales_off:last_scales_off + 4 * last_nscales].view(np.float32)
        else:
            p = gathered[j * total:(j + 1) * total]
            scales = p[scales_off:scales_off + 4 * nscales].view(np.float32)
        if e0 < o.size:
            _onebit_dec_range(p, o, codes_off, scales, bs, two_mean, e0, min(o.size, e0 + span), False)


# ---- half precision (the fp16 codec) ----------------------------------------------------------------
# NumPy converts float32 <-> float16 one element at a time through branches (about 2.5 ns an element
# on this project's CPU VM, 11x a copy); these are the same conversions, bit for bit (NumPy's
# npy_floatbits_to_halfbits / npy_halfbits_to_floatbits), written as selects the compiler vectorises.

_H = np.uint32
_F16_CHUNK = 65536          # elements per parallel task


@_inline
def _half_bits(v):
    """float32 ``v`` -> its float16 bits: round to nearest even, overflow to inf, a NaN keeps its top
    ten significand bits (one if that would leave none). (Numba widens uint32 arithmetic to 64 bits:
    the results are cast back.)"""
    f = np.float32(v).view(np.uint32)
    sign = _H((f >> _H(16)) & _H(0x8000))
    a = _H(f & _H(0x7FFFFFFF))
    fexp = _H(a & _H(0x7F800000))
    sig = _H(a & _H(0x7FFFFF))
    # normal: round on the 13 dropped bits (ties to even), carrying into the exponent
    n = _H(sig + _H(0x1000)) if (sig & _H(0x3FFF)) != _H(0x1000) else sig
    h = _H((n >> _H(13)) + _H(_H(fexp - _H(0x38000000)) >> _H(13)))
    # subnormal: the significand with its hidden bit, shifted by 1..11 more, then rounded likewise
    sh = min(max(np.int32(113) - np.int32(fexp >> _H(23)), np.int32(0)), np.int32(31))
    m = _H(_H(_H(0x800000) + sig) >> _H(sh))
    m = _H(m + _H(0x1000)) if ((m & _H(0x3FFF)) != _H(0x1000)) or (a & _H(0x7FF)) != _H(0) else m
    h = _H(m >> _H(13)) if fexp <= _H(0x38000000) else h
    h = _H(0) if fexp < _H(0x33000000) else h
    h = _H(0x7C00) if fexp >= _H(0x47800000) else h
    h = _H(_H(0x7C00) + max(_H(sig >> _H(13)), _H(1))) if a > _H(0x7F800000) else h
    return np.uint16(sign | h)


@_inline
def _half_value(hb):
    """float16 bits ``hb`` -> their float32 value (exact; a NaN keeps its significand)."""
    h = _H(hb)
    o = _H(_H(h & _H(0x7FFF)) << _H(13))
    e = _H(o & _H(0x0F800000))
    bits = _H(o + _H(0x38000000))
    bits = _H(bits + _H(0x38000000)) if e == _H(0x0F800000) else bits
    sub = np.float32(np.float32(h & _H(0x3FF)) * np.float32(2.0 ** -24)).view(np.uint32)
    bits = sub if e == _H(0) else bits
    return _H(bits | _H(_H(h & _H(0x8000)) << _H(16))).view(np.float32)


@_Kernel
def _half_encode(x, vals, residual, has_res, kchunk):
    n = x.size
    for c in prange((n + kchunk - 1) // kchunk):
        _wide()
        e0 = c * kchunk
        xb = x[e0:min(n, e0 + kchunk)]
        vb = vals[e0:min(n, e0 + kchunk)]
        for j in range(xb.size):
            vb[j] = _half_bits(xb[j])
        if has_res:
            rb = residual[e0:min(n, e0 + kchunk)]
            for j in range(xb.size):
                rb[j] = xb[j] - _half_value(vb[j])


@_Kernel
def _half_decode(vals, out, accumulate, kchunk):
    n = out.size
    for c in prange((n + kchunk - 1) // kchunk):
        _wide()
        e0 = c * kchunk
        vb = vals[e0:min(n, e0 + kchunk)]
        ob = out[e0:min(n, e0 + kchunk)]
        if accumulate:
            for j in range(vb.size):
                ob[j] = ob[j] + _half_value(vb[j])
        else:
            for j in range(vb.size):
                ob[j] = _half_value(vb[j])


def half_encode_cpu(x, vals, residual=None):
    """``vals`` (uint16, x.size) = the float16 bits of float32 ``x`` (NumPy's ``astype(float16)``, bit
    for bit); ``residual`` (float32, x.size, may be ``x``), if given, = x - float32(float16(x))."""
    x, vals = _flat(x), _flat(vals)
    if vals.size != x.size or (residual is not None and residual.size != x.size):
        raise ValueError(f"half_encode_cpu: x has {x.size} elements, vals {vals.size}")
    kernel = _half_encode.pick(-(-x.size // _F16_CHUNK))
    if residual is None:
        kernel(x, vals, _NO_RESIDUAL, False, _F16_CHUNK)
    else:
        kernel(x, vals, _flat(residual), True, _F16_CHUNK)


def half_decode_cpu(vals, out, accumulate):
    """``out`` (float32) = (``accumulate``: +=) the float32 values of the float16 bits ``vals``."""
    vals, out = _flat(vals), _flat(out)
    if vals.size != out.size:
        raise ValueError(f"half_decode_cpu: vals has {vals.size} elements, out {out.size}")
    _half_decode.pick(-(-out.size // _F16_CHUNK))(vals, out, bool(accumulate), _F16_CHUNK)


def _write_header_only(payload, header):
    _write_header(payload, header)


def _header_errors(payload, method, bits, mode, param, bucket_size, numel, name_hash, check_name):
    return _hdr_err(payload, method, bits, mode, param, bucket_size, numel, name_hash, check_name)


_header_errors = njit(cache=True)(_renamed(_header_errors, "_" + _STAMP))
_write_header_only = njit(cache=True)(_renamed(_write_header_only, "_" + _STAMP))


# ---- launchers (same signatures as numba_kernels.reference) ----------------------------------------

_U64 = np.uint64


_WORD_ARRAYS = {}       # id(header tuple) -> (the tuple, its words as a uint64 array)


def _words(header):
    """The 8 header words as a uint64 array: Numba types an array argument faster than a tuple of
    8 scalars (about 0.7 us a call). Tuples, which callers keep (memoised per configuration), are
    converted once; the table holds them, so an id is never reused while it is in there."""
    hit = _WORD_ARRAYS.get(id(header))
    if hit is not None and hit[0] is header:
        return hit[1]
    if type(header) is np.ndarray and header.dtype == np.uint64 and header.shape == (8,) \
            and header.flags.c_contiguous:
        return header
    arr = np.array([int(w) for w in header], dtype=np.uint64)
    if arr.size != 8:
        raise ValueError(f"a header is 8 uint64 words; got {arr.size}")
    if type(header) is tuple:
        if len(_WORD_ARRAYS) >= 4096:
            _WORD_ARRAYS.clear()
        _WORD_ARRAYS[id(header)] = (header, arr)
    return arr


def _flat(a):
    return a if a.ndim == 1 else a.reshape(-1)


def _check_size(payload, total):
    if payload.size != total:
        raise wire.PayloadError(f"payload has {payload.size} bytes, the layout needs {total}")


def header_errors_cpu(payload, expect):
    """Error bits (``wire.ERROR_BITS``) of ``payload``'s header against ``expect`` (a ``wire.Expect``)."""
    m, b, mo, no, bs, n, nh, cn = expect
    return int(_header_errors(payload, m, b, mo, no, bs, n, nh, bool(cn)))


def _check_expect(payload, expect):
    if expect is not None:
        err = header_errors_cpu(payload, expect)
        if err:
            raise wire.PayloadError(wire.describe_error_bits(err))


_NO_RESIDUAL = np.empty(0, np.float32)     # the kernels write a residual only when told to


class _PreparedBase:
    __slots__ = ("numel", "total", "k", "nchunks", "_serial", "_kernel")

    def _setup(self, kernel, lay, bs, span=False):
        """``k``: the kernel's task size, buckets (:func:`chunk_buckets`), or elements with ``span``
        (:func:`task_span`, the 1-bit kernels)."""
        self.numel = lay.numel
        self.total = lay.total
        if span:
            self.k = task_span(bs, lay.numel)
            self.nchunks = -(-lay.numel // self.k)
        else:
            self.k = chunk_buckets(bs, lay.numel)
            self.nchunks = -(-lay.nbuckets // self.k)
        self._kernel = kernel
        self._serial = kernel.serial if self.nchunks <= 1 else None

    # The kernel of a call is ``self._serial or self._kernel.pick(self.nchunks)``, written out at
    # each call site: a method call is a measurable part of a small launch.


class _DecodeCPU(_PreparedBase):
    """A prepared decode: ``(payload, out, stream=None, status=None, expect=None)``."""
    __slots__ = ("args",)

    def __call__(self, payload, out, stream=None, status=None, expect=None):
        out = _flat(out)
        if out.size != self.numel:
            raise ValueError(f"out has {out.size} elements, this launch was prepared for {self.numel}")
        if payload.size != self.total:
            _check_size(payload, self.total)
        if expect is not None:
            _check_expect(payload, expect)
        if self.numel:
            kernel = self._serial or self._kernel.pick(self.nchunks)
            kernel(payload, out, *self.args, self.k)


class QsgdEncodeCPU(_PreparedBase):
    """``prepare_qsgd_encode(...)(x, payload, header, key, stream=None, residual=None)``."""
    __slots__ = ("args",)

    def __init__(self, numel, bits, bucket_size, stochastic, norm_l2):
        lay = wire.layout(wire.METHODS["qsgd"], numel, bits, bucket_size)
        self._setup(_qsgd_encode[bits], lay, bucket_size)
        self.args = (lay.codes_offset, lay.codes_offset + lay.codes_nbytes, lay.scales_offset,
                     lay.nscales, int(bucket_size), bool(stochastic), bool(norm_l2))

    def __call__(self, x, payload, header, key, stream=None, residual=None):
        x = _flat(x)
        if x.size != self.numel:
            raise ValueError(f"x has {x.size} elements, this launch was prepared for {self.numel}")
        if payload.size != self.total:
            _check_size(payload, self.total)
        if residual is None:
            res, has = _NO_RESIDUAL, False
        else:
            res, has = _flat(residual), True
            if res.size != self.numel:
                raise ValueError(f"residual has {res.size} elements, x has {self.numel}")
        kernel = self._serial or self._kernel.pick(self.nchunks)
        kernel(x, payload, _words(header), *self.args, _U64(key), self.k, res, has)


class QsgdDecodeCPU(_DecodeCPU):
    """``prepare_qsgd_decode(...)(payload, out, stream=None, status=None, expect=None)``."""
    __slots__ = ()

    def __init__(self, numel, bits, bucket_size, accumulate):
        lay = wire.layout(wire.METHODS["qsgd"], numel, bits, bucket_size)
        self._setup(_qsgd_decode[bits], lay, bucket_size)
        self.args = (lay.codes_offset, lay.scales_offset, lay.nscales, int(bucket_size), bool(accumulate))


class OnebitEncodeCPU(_PreparedBase):
    """``prepare_onebit_encode(...)(x, payload, header, stream=None, residual=None)``."""
    __slots__ = ("args",)

    def __init__(self, numel, bucket_size, two_mean):
        mode = wire.ONEBIT_SCALES["two_mean" if two_mean else "mean_abs"]
        lay = wire.layout(wire.METHODS["onebit"], numel, 1, bucket_size, mode)
        bs = int(bucket_size) or max(numel, 1)
        self._setup(_onebit_encode if bs <= SEGMENT else _onebit_encode_long, lay, bs, span=True)
        self.args = (lay.codes_offset, lay.codes_offset + lay.codes_nbytes, lay.scales_offset,
                     lay.nscales, bs, bool(two_mean))

    def __call__(self, x, payload, header, stream=None, residual=None):
        x = _flat(x)
        if x.size != self.numel:
            raise ValueError(f"x has {x.size} elements, this launch was prepared for {self.numel}")
        if payload.size != self.total:
            _check_size(payload, self.total)
        if residual is None:
            res, has = _NO_RESIDUAL, False
        else:
            res, has = _flat(residual), True
            if res.size != self.numel:
                raise ValueError(f"residual has {res.size} elements, x has {self.numel}")
        kernel = self._serial or self._kernel.pick(self.nchunks)
        kernel(x, payload, _words(header), *self.args, self.k, res, has)


class OnebitDecodeCPU(_DecodeCPU):
    """``prepare_onebit_decode(...)(payload, out, stream=None, status=None, expect=None)``."""
    __slots__ = ()

    def __init__(self, numel, bucket_size, two_mean, accumulate):
        mode = wire.ONEBIT_SCALES["two_mean" if two_mean else "mean_abs"]
        lay = wire.layout(wire.METHODS["onebit"], numel, 1, bucket_size, mode)
        bs = int(bucket_size) or max(numel, 1)
        self._setup(_onebit_decode, lay, bs, span=True)
        self.args = (lay.codes_offset, lay.scales_offset, lay.nscales, bs, bool(two_mean),
                     bool(accumulate))


class SortquantEncodeCPU(QsgdEncodeCPU):
    """``prepare_sortquant_encode(...)(x, payload, header, key, stream=None, residual=None)``."""
    __slots__ = ()

    def __init__(self, numel, bits, split_bits, bucket_size, stochastic):
        lay = wire.layout(wire.METHODS["sortquant"], numel, bits, bucket_size, 0, split_bits)
        self._setup(_sortquant_encode[bits], lay, bucket_size)
        self.args = (lay.codes_offset, lay.codes_offset + lay.codes_nbytes, lay.scales_offset,
                     lay.nscales, int(bucket_size), int(split_bits), bool(stochastic))


class SortquantDecodeCPU(QsgdDecodeCPU):
    """``prepare_sortquant_decode(...)(payload, out, stream=None, status=None, expect=None)``."""
    __slots__ = ()

    def __init__(self, numel, bits, split_bits, bucket_size, accumulate):
        lay = wire.layout(wire.METHODS["sortquant"], numel, bits, bucket_size, 0, split_bits)
        self._setup(_sortquant_decode[bits], lay, bucket_size)
        self.args = (lay.codes_offset, lay.scales_offset, lay.nscales, int(bucket_size), int(split_bits),
                     bool(accumulate))


def prepare_sortquant_encode(numel, bits, split_bits, bucket_size, stochastic):
    return SortquantEncodeCPU(int(numel), int(bits), int(split_bits), int(bucket_size), bool(stochastic))


def prepare_sortquant_decode(numel, bits, split_bits, bucket_size, accumulate):
    return SortquantDecodeCPU(int(numel), int(bits), int(split_bits), int(bucket_size), bool(accumulate))


class KmeansEncodeCPU(QsgdEncodeCPU):
    """``prepare_kmeans_encode(...)(x, payload, header, key, stream=None, residual=None)``."""
    __slots__ = ()

    def __init__(self, numel, bits, bucket_size, iters):
        lay = wire.layout(wire.METHODS["kmeans"], numel, bits, bucket_size)
        bs = bucket_size or max(numel, 1)
        self._setup(_kmeans_encode[bits], lay, bs)
        self.args = (lay.codes_offset, lay.codes_offset + lay.codes_nbytes, lay.scales_offset,
                     lay.nscales, bs, int(iters))


class KmeansDecodeCPU(QsgdDecodeCPU):
    """``prepare_kmeans_decode(...)(payload, out, stream=None, status=None, expect=None)``."""
    __slots__ = ()

    def __init__(self, numel, bits, bucket_size, accumulate):
        lay = wire.layout(wire.METHODS["kmeans"], numel, bits, bucket_size)
        bs = bucket_size or max(numel, 1)
        self._setup(_kmeans_decode[bits], lay, bs, span=True)
        self.args = (lay.codes_offset, lay.scales_offset, lay.nscales, bs, bool(accumulate))


def prepare_kmeans_encode(numel, bits, bucket_size, iters):
    """``bucket_size`` 0: one bucket per tensor."""
    return KmeansEncodeCPU(int(numel), int(bits), int(bucket_size or 0), int(iters))


def prepare_kmeans_decode(numel, bits, bucket_size, accumulate):
    return KmeansDecodeCPU(int(numel), int(bits), int(bucket_size or 0), bool(accumulate))


def prepare_qsgd_encode(numel, bits, bucket_size, stochastic, norm_l2):
    return QsgdEncodeCPU(int(numel), int(bits), int(bucket_size), bool(stochastic), bool(norm_l2))


def prepare_qsgd_decode(numel, bits, bucket_size, accumulate):
    return QsgdDecodeCPU(int(numel), int(bits), int(bucket_size), bool(accumulate))


def prepare_onebit_encode(numel, bucket_size, two_mean):
    return OnebitEncodeCPU(int(numel), int(bucket_size or 0), bool(two_mean))


def prepare_onebit_decode(numel, bucket_size, two_mean, accumulate):
    return OnebitDecodeCPU(int(numel), int(bucket_size or 0), bool(two_mean), bool(accumulate))


_cached = functools.partial(memo, {})     # (key, make, *args) -> the prepared launch


def write_header_cpu(payload, header, stream=None):
    _write_header_only(payload, _words(header))


def qsgd_encode_cpu(x, payload, header, bits, bucket_size, stochastic, norm_l2, key, stream=None,
                    residual=None):
    """Bucketed QSGD encode of float32 ``x`` into ``payload`` (see ``qsgd_encode_ref``)."""
    n = x.size
    _cached((0, n, bits, bucket_size, stochastic, norm_l2), prepare_qsgd_encode, n, bits, bucket_size,
            stochastic, norm_l2)(x, payload, header, key, stream, residual)


def qsgd_decode_cpu(payload, out, bits, bucket_size, accumulate, stream=None, status=None, expect=None):
    """out (+)= dequantized QSGD payload (see ``qsgd_decode_ref``)."""
    n = out.size
    _cached((1, n, bits, bucket_size, accumulate), prepare_qsgd_decode, n, bits, bucket_size,
            accumulate)(payload, out, stream, status, expect)


def sortquant_encode_cpu(x, payload, header, bits, split_bits, bucket_size, stochastic, key, stream=None,
                         residual=None):
    """Sort quantization of float32 ``x`` into ``payload`` (see ``sortquant_encode_ref``)."""
    n = x.size
    _cached((10, n, bits, split_bits, bucket_size, stochastic), prepare_sortquant_encode, n, bits,
            split_bits, bucket_size, stochastic)(x, payload, header, key, stream, residual)


def sortquant_decode_cpu(payload, out, bits, split_bits, bucket_size, accumulate, stream=None, status=None,
                         expect=None):
    """out (+)= decoded sort-quantized payload (see ``sortquant_decode_ref``)."""
    n = out.size
    _cached((11, n, bits, split_bits, bucket_size, accumulate), prepare_sortquant_decode, n, bits,
            split_bits, bucket_size, accumulate)(payload, out, stream, status, expect)


def kmeans_encode_cpu(x, payload, header, bits, bucket_size, iters, key, stream=None, residual=None):
    """KMeans encode of float32 ``x`` into ``payload`` (see ``kmeans_encode_ref``)."""
    n = x.size
    _cached((12, n, bits, bucket_size, iters), prepare_kmeans_encode, n, bits, bucket_size, iters)(
        x, payload, header, key, stream, residual)


def kmeans_decode_cpu(payload, out, bits, bucket_size, accumulate, stream=None, status=None, expect=None):
    """out (+)= decoded KMeans payload (see ``kmeans_decode_ref``)."""
    n = out.size
    _cached((13, n, bits, bucket_size, accumulate), prepare_kmeans_decode, n, bits, bucket_size,
            accumulate)(payload, out, stream, status, expect)


def onebit_encode_cpu(x, payload, header, bucket_size, two_mean, stream=None, residual=None):
    """1-bit encode (see ``onebit_encode_ref``); ``bucket_size`` 0 = one bucket per tensor."""
    n = x.size
    _cached((2, n, bucket_size, two_mean), prepare_onebit_encode, n, bucket_size, two_mean)(
        x, payload, header, stream, residual)


def onebit_decode_cpu(payload, out, bucket_size, two_mean, accumulate, stream=None, status=None,
                      expect=None):
    n = out.size
    _cached((3, n, bucket_size, two_mean, accumulate), prepare_onebit_decode, n, bucket_size, two_mean,
            accumulate)(payload, out, stream, status, expect)


# ---- fused operations (see numba_kernels.reference): several payloads per call ------------------------

def _method_layout(numel, bits, bucket_size, two_mean):
    """(layout, bucket size used by the kernels) of QSGD (``two_mean`` None) or 1-bit payloads."""
    if two_mean is None:
        return wire.layout(wire.METHODS["qsgd"], numel, bits, bucket_size), bucket_size
    mode = wire.ONEBIT_SCALES["two_mean" if two_mean else "mean_abs"]
    return (wire.layout(wire.METHODS["onebit"], numel, 1, bucket_size, mode),
            int(bucket_size) or max(numel, 1))


def _check_all(payloads, n, total, expect):
    if n < 1:
        raise ValueError(f"n must be at least 1; got {n}")
    if payloads.size != n * total:
        raise wire.PayloadError(f"payloads has {payloads.size} bytes, {n} payloads of {total} need "
                                f"{n * total}")
    if expect is not None:
        for k in range(n):
            _check_expect(payloads[k * total:(k + 1) * total], expect)


class _DecodeSumCPU(_PreparedBase):
    """``prepare_*_decode_sum(...)(payloads, n, out, stream=None, status=None, expect=None)``."""
    __slots__ = ("args", "qsgd")

    def __init__(self, numel, bits, bucket_size, two_mean):
        lay, bs = _method_layout(numel, bits, bucket_size, two_mean)
        self.qsgd = two_mean is None
        self._setup(_qsgd_decode_sum[bits] if self.qsgd else _onebit_decode_sum, lay, bs, not self.qsgd)
        if self.qsgd:
            self.args = (lay.codes_offset, lay.scales_offset, lay.nscales, bs)
        else:
            self.args = (lay.codes_offset, lay.scales_offset, lay.nscales, bs, bool(two_mean))

    def _run(self, payloads, n, out, addend):
        if self.numel:
            has = addend is not None
            kernel = self._serial or self._kernel.pick(self.nchunks)
            kernel(payloads, n, self.total, out, *self.args, self.k, addend if has else out, has)

    def __call__(self, payloads, n, out, stream=None, status=None, expect=None):
        out = _flat(out)
        if out.size != self.numel:
            raise ValueError(f"out has {out.size} elements, this launch was prepared for {self.numel}")
        _check_all(payloads, n, self.total, expect)
        self._run(payloads, n, out, None)


class _ReduceRequantizeCPU:
    """``prepare_qsgd_reduce_requantize(...)(payloads, n, residual, out_payload, header, key,
    stream=None, status=None, expect=None)`` (1-bit: ``key`` is ignored). The sum (plus the residual)
    goes to a scratch array, then the encode kernel quantizes it and writes the new residual."""
    __slots__ = ("numel", "sum", "encode")

    def __init__(self, numel, bits, bucket_size, two_mean, stochastic=False, norm_l2=False):
        self.numel = numel
        self.sum = _DecodeSumCPU(numel, bits, bucket_size, two_mean)
        if two_mean is None:
            enc = QsgdEncodeCPU(numel, bits, bucket_size, stochastic, norm_l2)
            self.encode = enc
        else:
            enc = OnebitEncodeCPU(numel, bucket_size, two_mean)
            self.encode = lambda x, p, h, key, stream, residual: enc(x, p, h, stream, residual)

    def __call__(self, payloads, n, residual, out_payload, header, key=0, stream=None, status=None,
                 expect=None):
        _check_all(payloads, n, self.sum.total, expect)
        _check_size(out_payload, self.sum.total)
        if residual is not None:
            residual = _flat(residual)
            if residual.size != self.numel:
                raise ValueError(f"residual has {residual.size} elements, this launch was prepared "
                                 f"for {self.numel}")
        c = np.empty(self.numel, np.float32)
        self.sum._run(payloads, n, c, residual)
        self.encode(c, out_payload, header, key, stream, residual)


class _DecodeChunksCPU:
    """``prepare_*_decode_chunks(...)(gathered, out, stream=None, status=None, name_hashes=None,
    expect=None)``: chunk j's payload decoded into ``out[j*chunk:(j+1)*chunk]``."""
    __slots__ = ("numel", "total", "offsets", "method", "bits", "mode", "bs0", "chunk", "args",
                 "_kernel", "_serial", "ntasks", "kchunk", "_exps")

    def __init__(self, numel, bits, bucket_size, chunk, two_mean):
        from .reference import chunk_ranges
        ranges = chunk_ranges(numel, bucket_size, chunk)
        self.numel, self.bits, self.bs0, self.chunk = numel, bits, bucket_size, chunk
        self._exps = None
        qsgd = two_mean is None
        self.method = wire.METHODS["qsgd" if qsgd else "onebit"]
        self.mode = 0 if qsgd else wire.ONEBIT_SCALES["two_mean" if two_mean else "mean_abs"]
        full, bs = _method_layout(min(chunk, numel), bits, bucket_size, two_mean)
        last, _ = _method_layout(ranges[-1][1] - ranges[-1][0] if ranges else 0, bits, bucket_size,
                                 two_mean)
        self.offsets = [j * full.total for j in range(len(ranges))] + [
            (len(ranges) - 1) * full.total + last.total if ranges else 0]
        self.total = self.offsets[-1]
        if not bucket_size:
            chunk = bs                                   # one chunk of one bucket
        if qsgd:            # a task: kchunk buckets of one chunk; 1-bit: kchunk elements (task_span)
            self.kchunk = chunk_buckets(bs, numel)
            self.ntasks = len(ranges) * -(-(chunk // bs) // self.kchunk)
        else:
            self.kchunk = task_span(bs, numel)
            self.ntasks = len(ranges) * -(-chunk // self.kchunk)
        common = (chunk, full.total, full.scales_offset, full.nscales, last.total, last.scales_offset,
                  last.nscales, full.codes_offset)
        self.args = common + ((bs,) if qsgd else (bs, bool(two_mean)))
        self._kernel = _qsgd_decode_chunks[bits] if qsgd else _onebit_decode_chunks
        self._serial = self._kernel.serial if self.ntasks <= 1 else None

    def __call__(self, gathered, out, stream=None, status=None, name_hashes=None, expect=None):
        from .reference import chunk_expects
        out = _flat(out)
        if out.size != self.numel:
            raise ValueError(f"out has {out.size} elements, this launch was prepared for {self.numel}")
        if gathered.size != self.total:
            raise wire.PayloadError(f"gathered has {gathered.size} bytes, the chunks need {self.total}")
        if expect is not None or name_hashes is not None:
            key = (expect, id(name_hashes))         # a caller passes the same ones every step
            exps = self._exps                       # (read once: another thread may replace it)
            if exps is None or exps[0] != key:
                exps = self._exps = (key, name_hashes, chunk_expects(self.numel, self.bs0, self.chunk,
                                                                     self.method, self.bits, self.mode,
                                                                     expect, name_hashes))
            for j, e in enumerate(exps[2]):
                _check_expect(gathered[self.offsets[j]:self.offsets[j + 1]], e)
        if self.numel:
            k = self._serial if self._serial is not None else self._kernel.pick(self.ntasks)
            k(gathered, out, *self.args, self.kchunk)


def prepare_qsgd_decode_sum(numel, bits, bucket_size):
    return _DecodeSumCPU(int(numel), int(bits), int(bucket_size), None)


def prepare_onebit_decode_sum(numel, bucket_size, two_mean):
    return _DecodeSumCPU(int(numel), 1, int(bucket_size or 0), bool(two_mean))


def prepare_qsgd_reduce_requantize(numel, bits, bucket_size, stochastic, norm_l2):
    return _ReduceRequantizeCPU(int(numel), int(bits), int(bucket_size), None, bool(stochastic),
                                bool(norm_l2))


def prepare_onebit_reduce_requantize(numel, bucket_size, two_mean):
    return _ReduceRequantizeCPU(int(numel), 1, int(bucket_size or 0), bool(two_mean))


def prepare_qsgd_decode_chunks(numel, bits, bucket_size, chunk):
    return _DecodeChunksCPU(int(numel), int(bits), int(bucket_size), int(chunk), None)


def prepare_onebit_decode_chunks(numel, bucket_size, two_mean, chunk):
    return _DecodeChunksCPU(int(numel), 1, int(bucket_size or 0), int(chunk), bool(two_mean))


def qsgd_decode_sum_cpu(payloads, n, out, bits, bucket_size, stream=None, status=None, expect=None):
    """out = the float32 sum of ``n`` QSGD payloads' decodes (see ``qsgd_decode_sum_ref``)."""
    m = out.size
    _cached((4, m, bits, bucket_size), prepare_qsgd_decode_sum, m, bits, bucket_size)(
        payloads, n, out, stream, status, expect)


def onebit_decode_sum_cpu(payloads, n, out, bucket_size, two_mean, stream=None, status=None,
                          expect=None):
    m = out.size
    _cached((5, m, bucket_size, two_mean), prepare_onebit_decode_sum, m, bucket_size, two_mean)(
        payloads, n, out, stream, status, expect)


def qsgd_reduce_requantize_cpu(payloads, n, residual, out_payload, header, bits, bucket_size, stochastic,
                               norm_l2, key, stream=None, status=None, expect=None):
    """SRA's phase 2 (see ``qsgd_reduce_requantize_ref``); numel is the header's."""
    m = int(header[2])
    _cached((6, m, bits, bucket_size, stochastic, norm_l2), prepare_qsgd_reduce_requantize, m, bits,
            bucket_size, stochastic, norm_l2)(payloads, n, residual, out_payload, header, key, stream,
                                              status, expect)


def onebit_reduce_requantize_cpu(payloads, n, residual, out_payload, header, bucket_size, two_mean,
                                 stream=None, status=None, expect=None):
    m = int(header[2])
    _cached((7, m, bucket_size, two_mean), prepare_onebit_reduce_requantize, m, bucket_size, two_mean)(
        payloads, n, residual, out_payload, header, 0, stream, status, expect)


def qsgd_decode_chunks_cpu(gathered, out, bits, bucket_size, chunk, stream=None, status=None,
                           name_hashes=None, expect=None):
    """SRA's phase 3 (see ``qsgd_decode_chunks_ref``)."""
    m = out.size
    _cached((8, m, bits, bucket_size, chunk), prepare_qsgd_decode_chunks, m, bits, bucket_size, chunk)(
        gathered, out, stream, status, name_hashes, expect)


def onebit_decode_chunks_cpu(gathered, out, bucket_size, two_mean, chunk, stream=None, status=None,
                             name_hashes=None, expect=None):
    m = out.size
    _cached((9, m, bucket_size, two_mean, chunk), prepare_onebit_decode_chunks, m, bucket_size, two_mean,
            chunk)(gathered, out, stream, status, name_hashes, expect)
