"""The CPU kernels' shared parts: compilation (``_Kernel``, ``_Widths``: parallel and serial twins,
one per QSGD bit width), chunking, the lane sums of the scales, header writing, and the code packing
and unpacking every bucketed codec uses (see :mod:`numba_kernels.cpu`).
"""
import hashlib
import math
import os
import types

import numba
import numpy as np
from numba import njit, prange
from numba.core import types as nbtypes
from numba.extending import intrinsic

from ._scalar import F0, FNAN, GAMMA, SEGMENT, U8, U24M, U40, UFF, build


def _source_stamp():
    """A hash of ``_scalar.py`` and ``_cpu_*.py``, put in every cached kernel's name: Numba's disk cache
    watches only the file a kernel is defined in, and the kernels inline code from the others."""
    here = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for name in sorted(os.listdir(here)):
        if name == "_scalar.py" or (name.startswith("_cpu_") and name.endswith(".py")):
            with open(os.path.join(here, name), "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:12]


_STAMP = _source_stamp()

_inline = njit(inline="always", error_model="numpy")


@njit(inline="always")
def _fmul(a, b):
    return a * b


@intrinsic
def _wide(typingctx):
    """Asks LLVM for 512-bit vectors in the calling function (``prefer-vector-width``; on AVX-512 Intel
    CPUs it prefers 256-bit otherwise). Emits no code; called first in each parallel task's body."""
    def codegen(context, builder, sig, args):
        # llvmlite checks attribute names against a fixed list; set.add writes this string one as it is
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
(_mix64, _uniform24, _qsgd_level, _sqrt32, _onebit_scales, _hdr_err, _sq_level, _sq_value, _km_draw, _km_scale,
 _km_fixed, _km_mean, _km_mids, _km_index, _km_starts) = (getattr(_ops, name) for name in (
    "mix64 uniform24 qsgd_level sqrt32 onebit_scales header_errors sortquant_level sortquant_value kmeans_draw "
    "kmeans_scale kmeans_fixed kmeans_mean kmeans_mids kmeans_index kmeans_starts").split())

_KERNEL = dict(cache=True, error_model="numpy", nogil=True)
_TARGET_CHUNK = 16384       # elements per parallel task
I31 = np.int32(0x7FFFFFFF)
INF_BITS = np.int32(0x7F800000)     # +inf's bits: |x|'s bits reach them only where x is not finite


def _renamed(fn, suffix, glob=None):
    """``fn`` under another qualified name (Numba names its cache files after it), with globals ``glob``."""
    twin = types.FunctionType(fn.__code__, fn.__globals__ if glob is None else glob, fn.__name__ + suffix,
                              fn.__defaults__, fn.__closure__)
    twin.__qualname__ = fn.__qualname__ + suffix
    twin.__module__ = fn.__module__
    return twin


class _Kernel:
    """A kernel compiled twice from one function, ``parallel=True`` for several chunks and serial for one,
    both named with :data:`_STAMP`. ``glob`` replaces globals the function reads: ``_BITS`` (the code
    width, a constant in shifts and masks) and ``_DEC`` (the decode templates' range decoder); ``tag``
    names the instance."""

    def __init__(self, fn, tag="", **glob):
        tag = f"{tag}_{_STAMP}"
        glob = dict(fn.__globals__, **glob) if glob else None
        self.parallel = njit(parallel=True, **_KERNEL)(_renamed(fn, "_par" + tag, glob))
        self.serial = njit(parallel=False, **_KERNEL)(_renamed(fn, "_ser" + tag, glob))

    def pick(self, nchunks):
        return self.parallel if nchunks > 1 and numba.get_num_threads() > 1 else self.serial


class _Widths:
    """``_Kernel`` per bit width (``kernel[bits]``), made on first use."""

    def __init__(self, fn, tag="", **glob):
        self.fn, self.tag, self.glob = fn, tag, glob
        self.made = {}

    def __getitem__(self, bits):
        k = self.made.get(bits)
        if k is None:
            k = self.made[bits] = _Kernel(self.fn, f"{self.tag}_b{bits}", _BITS=bits, **self.glob)
        return k


_BITS = 0       # replaced in each instance's globals (see _Kernel)
_DEC = None


def chunk_buckets(bucket_size, numel):
    """Buckets per parallel chunk: a multiple of 8 / gcd(bucket_size, 8), about 16k elements."""
    g = 8 // math.gcd(bucket_size, 8)
    per = max(1, _TARGET_CHUNK // (g * bucket_size))
    return g * per


def task_span(bucket_size, numel):
    """Elements per parallel task of the decodes and the 1-bit encode, a multiple of 8: whole buckets
    (:func:`chunk_buckets`) up to SEGMENT elements a bucket, else whole segments (one long bucket still
    spreads over the threads)."""
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
    x >= 0 for kind 2 (counted per lane, so the loop vectorises). Rows of 32 are sliced out so the
    compiler sees 32 independent lanes."""
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
    :func:`_tree` is its sum: one segment's lanes, or the lanes of its segments' sums. Returns the
    count of x >= 0 for kind 2."""
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
    """The bits of max |x| over the bucket (``xi``: x as int32): an integer max, which vectorises, gives
    the max, or a NaN when there is one (NaN's bits lie above +inf's)."""
    m = np.int32(0)
    xb = xi[st:en]
    for j in range(xb.size):
        m = max(m, xb[j] & I31)
    return m


@_inline
def _draws24(key, st, en, r):
    """r[j] = the 24 random bits of element st + j (``_scalar.uniform24``) for the elements [st, en).
    An aligned group of 64 elements takes its 32 draws in one vectorised loop (draw l serves elements
    l and l + 32); the rest draw one at a time."""
    i = st
    while i < en:
        if (i & 63) == 0 and i + 64 <= en:
            kb = key + np.uint64(i >> 1) * GAMMA            # draw p = (i >> 6) * 32 + l
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
def _int_order(v):
    """The float32 bits ``v`` (int32) mapped to an int32 of the same order (-0.0 just below +0.0) and
    back: the negatives' low 31 bits flipped."""
    return v ^ ((v >> np.int32(31)) & I31)


@_inline
def _extremes(x, st, en):
    """(bits of max |x|, min, max) of x[st:en]; the first is at least +inf's bits where a value is not
    finite, and only then are min and max meaningless (-0.0 counts below +0.0). Integer extremes of
    :func:`_int_order`, which vectorise where float ones do not."""
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
def _nan_bucket(scales, codes, x, st, residual, has_res):
    """A bucket (from element ``st``) holding NaN or Inf: NaN scales, codes 0, residual x - NaN."""
    for k in range(scales.size):
        scales[k] = FNAN
    for j in range(codes.size):
        codes[j] = 0
        if has_res:
            residual[st + j] = x[st + j] - FNAN


@_inline
def _write_header(payload, header):
    for k in range(64):
        payload[k] = np.uint8((header[k >> 3] >> (U8 * np.uint64(k & 7))) & UFF)


@_inline
def _encode_preamble(payload, header, codes_end, scales_off, nscales, numel, bs):
    """What every encode does first: writes the header and zeroes the padding after the codes;
    returns (the scales as float32, the number of buckets)."""
    _write_header(payload, header)
    for k in range(codes_end, scales_off):
        payload[k] = 0
    return payload[scales_off:scales_off + 4 * nscales].view(np.float32), (numel + bs - 1) // bs


@_inline
def _byte_of(lo, hi, j):
    """Byte j of the 128-bit little-endian number hi:lo."""
    if j < 8:
        return np.uint8((lo >> np.uint64(8 * j)) & UFF)
    return np.uint8((hi >> np.uint64(8 * j - 64)) & UFF)


@_inline
def _pack_groups(codes, g0, g1, payload, base, BITS):
    """Groups [g0, g1) of eight codes, each into its BITS bytes at payload[base + g*BITS:], a byte at
    a time from the codes that overlap it (decided at compile time)."""
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
    if BITS == 2:                                   # a byte's four codes read as one uint64 (one
        cq = codes.view(np.uint64)                  # load instead of four 16-bit reads)
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
    # groups [head, head + 8*nsg) as BITS 64-bit words per 64 codes (wide stores instead of a byte at
    # a time); the groups before head bring the words to an 8-byte boundary
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
    """The codes of elements st .. min(en, st + _DEC_BLOCK) - 1 into ``codes`` (codes[j]: element st + j);
    returns that slice of ``out``, for their values. From a block starting on a byte, groups of eight
    fields come from the 64-bit words of their BITS bytes (merged loads), where those fit in the
    payload; the rest field by field (:func:`_field`)."""
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
    """ob[j] (+)= book[code of element st + j] for every j of ``ob`` (BITS <= 8). From element st on a
    byte, eight codes at a time from their BITS bytes, each looked up as it is cut out (no code array
    between: that made the reads gathers); the rest field by field."""
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


# ---- decode templates: one per kind, instantiated per codec with its range decoder -------------------
# ``_DEC(payload, out, codes_off, scales, bs, param, e0, e1, accumulate, BITS)``: out[i] (+)= the value
# of element i of the payload for i in [e0, e1); ``param`` is the codec's (1-bit: two_mean; SortQuant:
# split_bits). Tasks split by elements, ``span`` each (:func:`task_span`).

def _decode(payload, out, codes_off, scales_off, nscales, bs, param, accumulate, span):
    numel = out.size
    scales = payload[scales_off:scales_off + 4 * nscales].view(np.float32)
    for t in prange((numel + span - 1) // span):
        _wide()
        _DEC(payload, out, codes_off, scales, bs, param, t * span, min(numel, t * span + span), accumulate,
             _BITS)


def _decode_sum(payloads, npay, total, out, codes_off, scales_off, nscales, bs, param, span, addend, has_add):
    """out = the float32 sum of the npay payloads' decodes, in payload order (+ addend[i] last)."""
    numel = out.size
    for t in prange((numel + span - 1) // span):
        _wide()
        e0 = t * span
        e1 = min(numel, e0 + span)
        for k in range(npay):
            p = payloads[k * total:(k + 1) * total]
            scales = p[scales_off:scales_off + 4 * nscales].view(np.float32)
            _DEC(p, out, codes_off, scales, bs, param, e0, e1, k > 0, _BITS)
        if has_add:
            for i in range(e0, e1):
                out[i] = out[i] + addend[i]


def _decode_chunks(gathered, out, chunk, total, scales_off, nscales, last_total, last_scales_off,
                   last_nscales, codes_off, bs, param, span):
    """Chunk j's payload (at j*total in gathered) decoded into out[j*chunk:(j+1)*chunk]; the last
    chunk has its own layout (last_*)."""
    numel = out.size
    nch = (numel + chunk - 1) // chunk
    per = (chunk + span - 1) // span          # tasks per chunk
    for t in prange(nch * per):
        _wide()
        j = t // per
        e0 = (t - j * per) * span
        o = out[j * chunk:min(numel, j * chunk + chunk)]
        if j == nch - 1:
            p = gathered[j * total:j * total + last_total]
            scales = p[last_scales_off:last_scales_off + 4 * last_nscales].view(np.float32)
        else:
            p = gathered[j * total:(j + 1) * total]
            scales = p[scales_off:scales_off + 4 * nscales].view(np.float32)
        if e0 < o.size:
            _DEC(p, o, codes_off, scales, bs, param, e0, min(o.size, e0 + span), False, _BITS)


def decoders(dec, tag, widths=True):
    """The decode, decode_sum and decode_chunks kernels of a codec whose range decoder is ``dec``:
    :class:`_Widths` (``widths``) or :class:`_Kernel`."""
    make = _Widths if widths else _Kernel
    return tuple(make(fn, "_" + tag, _DEC=dec) for fn in (_decode, _decode_sum, _decode_chunks))
