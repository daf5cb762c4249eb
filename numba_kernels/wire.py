"""The hvd_quant wire format: a 64-byte self-describing header, then the codes, then the scales.

Pure Python + NumPy (no Numba, no framework): the codecs build headers here, the kernels receive them
as 8 little-endian uint64 words and write them; the host validates received headers here and the
CUDA check kernel (``numba_kernels.cuda``) re-implements the same comparisons on the device.

Header, little-endian, 64 bytes::

    off size field
      0   4  magic           b"HVDQ"
      4   1  version         1
      5   1  method          0 none, 1 fp16, 2 qsgd, 3 onebit, 4 sortquant, 5 kmeans
      6   1  bits            bits per code (qsgd, sortquant 2..16, kmeans 1..8, onebit 1, fp16 16, none 32)
      7   1  mode            qsgd: 0 stochastic, 1 deterministic, 2 fake; onebit: 0 two_mean, 1 mean_abs;
                             sortquant: 0 stochastic, 1 deterministic; kmeans 0
      8   1  param           the method's second parameter: qsgd's norm (0 max, 1 l2), sortquant's
                             split_bits (1..bits-1); otherwise 0
      9   1  dtype           original dtype: 0 float32, 1 float16, 2 bfloat16, 3 float64
     10   1  ndim            0..8
     11   1  flags           bit 0: a name hash is present
     12   4  bucket_size     uint32; 0 means "one bucket per tensor" (onebit, kmeans bucket_size=None)
     16   8  numel           uint64
     24  32  shape           8 x uint32 (unused dims 0)
     56   4  name_hash       uint32 FNV-1a of the UTF-8 name (0 = no name; a real hash of 0 is stored as 1)
     60   2  config_crc      uint16: FNV-1a over bytes 4..8 and 12..15 (version, method, bits, mode, param,
                             bucket_size), folded to 16 bits
     62   2  header_crc      uint16: FNV-1a over bytes 0..61, folded to 16 bits

Body (offsets from the start of the payload; every section starts on a multiple of 4 and the total
size is a multiple of 4, so payloads concatenated back to back stay 4-byte aligned):

* qsgd stochastic/deterministic, onebit: ``codes`` = ceil(numel*bits/8) bytes at 64 (element i
  occupies bits [i*bits, (i+1)*bits) of a little-endian bit stream: stream bit k is bit k%8 of byte
  k//8; padding bits are 0), zero padding to a multiple of 4, then float32 ``scales``: one per bucket
  (qsgd, onebit mean_abs) or two per bucket (onebit two_mean: mean of positives, mean of negatives).
* sortquant: ``codes`` as above, each code ``(group << (bits - split_bits)) | level``, zero padding to
  a multiple of 4, then float32 ``scales``: ``2 * 2**split_bits`` per bucket, the (min, max) of each
  of the bucket's groups in group order.
* kmeans: ``codes`` as above (each the index of the element's centroid), zero padding to a multiple
  of 4, then float32 ``scales``: the bucket's codebook, ``2**bits`` centroids per bucket.
* qsgd fake: numel float32 values at 64 (already quantized and dequantized).
* fp16: numel float16 values at 64, zero padding to a multiple of 4.
* none: numel float32 values at 64.
"""
import functools
import math
import struct
from typing import NamedTuple

import numpy as np

__all__ = [
    "PayloadError", "HEADER_NBYTES", "HEADER_STRUCT", "MAGIC", "VERSION", "MAX_NDIM", "METHODS", "DTYPES", "MODES",
    "NORMS", "ONEBIT_SCALES", "Header", "Layout", "layout", "fnv1a32", "fold16", "name_hash",
    "config_crc", "parse_header", "ERROR_BITS", "describe_error_bits", "Expect",
]

HEADER_NBYTES = 64
MASK64 = (1 << 64) - 1     # the noise keys and header words are 64-bit unsigned
MAGIC = b"HVDQ"
VERSION = 1
MAX_NDIM = 8

METHODS = {"none": 0, "fp16": 1, "qsgd": 2, "onebit": 3, "sortquant": 4, "kmeans": 5}
DTYPES = {"float32": 0, "float16": 1, "bfloat16": 2, "float64": 3}
MODES = {"stochastic": 0, "deterministic": 1, "fake": 2}
NORMS = {"max": 0, "l2": 1}
ONEBIT_SCALES = {"two_mean": 0, "mean_abs": 1}

_METHOD_NAMES = {v: k for k, v in METHODS.items()}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

# the header's fields in order (see the table above); bytes 62..63 are the header checksum
HEADER_STRUCT = struct.Struct("<4s8BIQ8IIHH")
# (bits, bucket_size, mode, param) a method allows
_VALID_FIELDS = {
    METHODS["qsgd"]: lambda b, bs, m, p: 2 <= b <= 16 and bs >= 1 and m in (0, 1, 2) and p in (0, 1),
    METHODS["onebit"]: lambda b, bs, m, p: m in (0, 1),
    METHODS["sortquant"]: lambda b, bs, m, p: 2 <= b <= 16 and bs >= 1 and m in (0, 1) and 1 <= p < b,
    METHODS["kmeans"]: lambda b, bs, m, p: 1 <= b <= 8 and m == 0 and p == 0,
}

_FNV_OFFSET = 0x811C9DC5
_FNV_PRIME = 0x01000193

# Error bits reported by the CUDA check kernel (and used in host messages).
ERROR_BITS = {
    1: "bad magic (not an hvd_quant payload)",
    2: "unsupported format version",
    4: "method differs",
    8: "bits differ",
    16: "mode differs",
    32: "norm/split_bits differs",
    64: "bucket_size differs",
    128: "numel differs",
    256: "name hash differs (payload of another tensor)",
    512: "bad header checksum",
    1024: "bad configuration checksum",
}


class Expect(NamedTuple):
    """What a receiver expects in a payload header (the decoders' ``expect``): ``ERROR_BITS`` names each
    field that differs; ``name_hash`` is compared only with ``check_name``; magic, version and both
    checksums always."""
    method: int
    bits: int
    mode: int
    param: int
    bucket_size: int
    numel: int
    name_hash: int = 0
    check_name: bool = False


class PayloadError(ValueError):
    """A payload was refused: not a payload, another configuration, wrong size, corrupt, wrong tensor."""


def onebit_mode(two_mean):
    """The header's mode of a 1-bit payload: two means per bucket, else the mean of |x|."""
    return ONEBIT_SCALES["two_mean" if two_mean else "mean_abs"]


def describe_error_bits(bits):
    """Human-readable list of the problems encoded in a device error word."""
    return "; ".join(msg for b, msg in ERROR_BITS.items() if bits & b) or "no error"


def fnv1a32(data, h=_FNV_OFFSET):
    for b in bytes(data):
        h = ((h ^ b) * _FNV_PRIME) & 0xFFFFFFFF
    return h


def fold16(h):
    return ((h >> 16) ^ h) & 0xFFFF


@functools.lru_cache(maxsize=16384)
def name_hash(name):
    """uint32 hash of a tensor name (``str(name)``) put in the header; 0 means "no name"."""
    return 0 if name is None else fnv1a32(str(name).encode("utf-8")) or 1


def config_crc(version, method, bits, mode, param, bucket_size):
    cfg = bytes([version, method, bits, mode, param]) + int(bucket_size).to_bytes(4, "little")
    return fold16(fnv1a32(cfg))


class Layout:
    """Byte offsets of one payload. ``total`` is the payload size (== the codec's wire_nbytes)."""
    __slots__ = ("numel", "nbuckets", "codes_offset", "codes_nbytes", "scales_offset", "nscales", "total")

    def __init__(self, numel, nbuckets=0, codes_nbytes=0, nscales=0, values_nbytes=0):
        self.numel = numel
        self.nbuckets = nbuckets
        self.codes_offset = HEADER_NBYTES
        self.codes_nbytes = codes_nbytes
        self.scales_offset = HEADER_NBYTES + _align4(codes_nbytes)
        self.nscales = nscales
        self.total = self.scales_offset + 4 * nscales + _align4(values_nbytes)

    def __repr__(self):
        return (f"Layout(numel={self.numel}, nbuckets={self.nbuckets}, codes={self.codes_offset}+"
                f"{self.codes_nbytes}, scales={self.scales_offset}+4x{self.nscales}, total={self.total})")


def _align4(n):
    return (n + 3) & ~3


def layout(method, numel, bits=0, bucket_size=0, mode=0, param=0):
    """Where everything sits in a payload of ``numel`` elements; ``bucket_size`` 0 (onebit, kmeans) is one
    bucket for the whole tensor, ``param`` sortquant's split_bits."""
    numel = int(numel)
    if method in (METHODS["none"], METHODS["fp16"]) or (method == METHODS["qsgd"] and mode == MODES["fake"]):
        return Layout(numel, values_nbytes=(2 if method == METHODS["fp16"] else 4) * numel)
    nb = (1 if numel else 0) if bucket_size == 0 else -(-numel // bucket_size)
    if method == METHODS["onebit"]:
        return Layout(numel, nb, (numel + 7) // 8, (2 if mode == ONEBIT_SCALES["two_mean"] else 1) * nb)
    per_bucket = {METHODS["qsgd"]: 1, METHODS["sortquant"]: 2 << param, METHODS["kmeans"]: 1 << bits}.get(method)
    if per_bucket is None:
        raise ValueError(f"unknown method code {method}")
    return Layout(numel, nb, (numel * bits + 7) // 8, per_bucket * nb)


class Header:
    """The decoded fields of a payload header (see the module docstring)."""
    __slots__ = ("version", "method", "bits", "mode", "param", "dtype", "shape", "flags",
                 "bucket_size", "numel", "name_hash")

    def __init__(self, method, bits, mode, param, bucket_size, dtype, shape, name_hash=0,
                 version=VERSION, numel=None):
        self.version = version
        self.method = method
        self.bits = bits
        self.mode = mode
        self.param = param
        self.bucket_size = bucket_size
        self.dtype = dtype
        self.shape = tuple(int(d) for d in shape)
        self.numel = math.prod(self.shape) if numel is None else int(numel)
        self.name_hash = name_hash
        self.flags = 1 if name_hash else 0

    @property
    def dtype_name(self):
        return _DTYPE_NAMES.get(self.dtype, f"<dtype code {self.dtype}>")

    @property
    def method_name(self):
        return _METHOD_NAMES.get(self.method, f"<method code {self.method}>")

    def config_crc(self):
        return config_crc(self.version, self.method, self.bits, self.mode, self.param, self.bucket_size)

    def to_bytes(self):
        if len(self.shape) > MAX_NDIM:
            raise ValueError(f"tensors of rank {len(self.shape)} are not supported (at most {MAX_NDIM} dims)")
        if not all(0 <= v < 2 ** 32 for v in self.shape + (self.bucket_size,)):
            raise ValueError(f"shape {self.shape} or bucket_size {self.bucket_size} does not fit the header "
                             f"(each < 2**32)")
        b = HEADER_STRUCT.pack(MAGIC, self.version, self.method, self.bits, self.mode, self.param, self.dtype,
                               len(self.shape), self.flags, self.bucket_size, self.numel,
                               *self.shape, *(0,) * (MAX_NDIM - len(self.shape)), self.name_hash,
                               self.config_crc(), 0)
        return b[:62] + fold16(fnv1a32(b[:62])).to_bytes(2, "little")

    def words(self):
        """The header as 8 little-endian uint64 words: how kernels receive it."""
        return tuple(np.frombuffer(self.to_bytes(), dtype="<u8").astype(np.uint64))

    def __repr__(self):
        return (f"Header({self.method_name}, bits={self.bits}, mode={self.mode}, param={self.param}, "
                f"bucket_size={self.bucket_size}, dtype={self.dtype_name}, shape={self.shape}, "
                f"name_hash={self.name_hash:#010x})")


def parse_header(buf, nbytes):
    """The :class:`Header` of a payload of ``nbytes`` bytes whose first 64 (at least) ``buf`` holds
    (bytes-like or uint8 array), after checking magic, version, both checksums, the fields' ranges,
    shape against numel and ``nbytes`` against the layout; raises :class:`PayloadError` naming what is
    wrong. The configuration's values are compared by the codec, which knows what it expects."""
    if nbytes < HEADER_NBYTES:
        raise PayloadError(f"payload truncated: {nbytes} bytes, shorter than the {HEADER_NBYTES}-byte header")
    b = bytes(np.asarray(buf, dtype=np.uint8).reshape(-1)[:HEADER_NBYTES]) if not isinstance(
        buf, (bytes, bytearray)) else bytes(buf[:HEADER_NBYTES])
    if len(b) < HEADER_NBYTES:
        raise PayloadError(f"payload truncated: header has {len(b)} of {HEADER_NBYTES} bytes")
    (magic, version, method, bits, mode, param, dtype, ndim, flags, bucket_size, numel, *dims, name_hash, cfg,
     crc) = HEADER_STRUCT.unpack(b)
    if magic != MAGIC:
        raise PayloadError(f"bad magic {magic!r} (expected {MAGIC!r}): not an hvd_quant payload")
    if version != VERSION:
        raise PayloadError(f"unsupported payload format version {version} (this hvd_quant reads version {VERSION})")
    if crc != fold16(fnv1a32(b[0:62])):
        raise PayloadError("bad header checksum: the payload header is corrupt")
    if ndim > MAX_NDIM:
        raise PayloadError(f"corrupt header: ndim {ndim} > {MAX_NDIM}")
    shape = tuple(dims[:ndim])
    h = Header(method, bits, mode, param, bucket_size, dtype, shape, name_hash=name_hash, version=version,
               numel=numel)
    if cfg != h.config_crc():
        raise PayloadError("bad configuration checksum: the payload header is corrupt")
    if method not in _METHOD_NAMES:
        raise PayloadError(f"corrupt header: unknown method code {method}")
    if dtype not in _DTYPE_NAMES:
        raise PayloadError(f"corrupt header: unknown dtype code {dtype}")
    n = math.prod(shape)
    if n != numel:
        raise PayloadError(f"corrupt header: shape {shape} has {n} elements but numel says {numel}")
    if not _VALID_FIELDS.get(method, lambda *fields: True)(bits, bucket_size, mode, param):
        raise PayloadError(f"corrupt header: invalid {_METHOD_NAMES[method]} fields bits={bits} "
                           f"bucket_size={bucket_size} mode={mode} param={param}")
    expected = layout(method, numel, bits, bucket_size, mode, param).total
    if nbytes != expected:
        what = "truncated" if nbytes < expected else "too long"
        raise PayloadError(f"payload {what}: {nbytes} bytes, but its header (numel={numel}) implies {expected}")
    return h
