"""The compressed gradient exchange, written once for every framework.

Horovod sums what it is given, and quantized codes cannot be summed (DESIGN.md). This module builds
the two reductions that can, out of Horovod's public ``alltoall``, ``allgather`` and ``allreduce``:

``reduction="sra"`` (scatter-reduce-allgather, the default)
    1. split the flat float32 buffer into N chunks whose bounds fall on the codec's buckets;
    2. encode chunk j (header name ``<name>#c<j>@<step>``), concatenate, ``alltoall``: rank r receives
       every rank's chunk r;
    3. decode and sum the N payloads in rank order, in float32;
    4. requantize the reduced chunk (header ``<name>#r<r>@<step>``) and ``allgather`` it;
    5. every rank, the owner too, decodes the same gathered bytes, so replicas stay bit-identical.
    Traffic per rank is about 2(N-1)/N * payload(n), flat in N (``docs/EXCHANGE.md``).

``reduction="allgather"``
    encode the whole buffer, ``allgather`` every rank's payload, decode each in rank order and sum in
    float32. Traffic per rank is (N-1) * payload(n): pays off for small N or 1-bit codes.

Both return the **sum** over ranks in float32; the caller divides by N (``Op``) afterwards, never on
codes. The frameworks are reached only through two small tables, :class:`Collectives` and
:class:`ArrayOps`, which each frontend fills (``hvd_quant/torch/_backend.py``); see
"Exchange contract" in docs/ARCHITECTURE.md.

An exchange is a small state machine (:class:`Pending`): ``start`` encodes and submits the first
collective without waiting, ``advance`` (SRA only) waits for the alltoall, reduces, requantizes and
submits the allgather, ``finish`` waits and decodes. Callers with several exchanges in flight advance
all of them before finishing any, so every rank's second-phase collectives are in flight together.
Exchanges are matched across ranks by name, as Horovod matches its collectives, so the order in which
a rank starts them does not matter.
"""
import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

__all__ = [
    "AVERAGE", "SUM", "REDUCTIONS", "Collectives", "ArrayOps", "Exchange", "Pending", "Traffic",
    "ConfigMismatchError", "PayloadMismatchError", "chunk_bounds", "codec_alignment",
    "handshake_record", "handshake_async", "check_handshake", "handshake", "is_passthrough_codec",
    "HANDSHAKE_NAME",
]

AVERAGE = "average"
SUM = "sum"
REDUCTIONS = ("sra", "allgather")

HANDSHAKE_NAME = "hvdq.handshake"
_HANDSHAKE_BYTES = 512          # 32-byte digest + a readable summary, fixed size on every rank
_DIGEST_BYTES = 32


class ConfigMismatchError(RuntimeError):
    """Ranks were configured differently (codec, reduction, bucketing, grouping, ...)."""


class PayloadMismatchError(ValueError):
    """A payload does not belong to the exchange that received it (wrong tensor, size or codec)."""


@dataclass(frozen=True)
class Collectives:
    """How the core reaches Horovod's collectives; one instance per framework and process set.

    ``allgather_async(t, name)``: ``t`` a 1-D uint8 tensor; ranks may contribute different lengths;
    the result is their concatenation in rank order.
    ``alltoall_async(t, splits, name)``: ``t`` 1-D uint8, ``splits`` a list of ``size`` Python ints
    (bytes for each destination rank, in rank order); the result is the received bytes in rank order.
    ``allreduce_async(t, name, op, prescale_factor, postscale_factor)``: in place where the framework
    allows, ``op`` one of :data:`AVERAGE` / :data:`SUM`.
    ``synchronize(handle)``: waits and returns the result tensor (alltoall: the data, not the splits).
    """
    rank: int
    size: int
    allgather_async: Callable[[Any, str], Any]
    alltoall_async: Callable[[Any, Sequence[int], str], Any]
    allreduce_async: Callable[..., Any]
    synchronize: Callable[[Any], Any]
    process_set: Any = None


@dataclass(frozen=True)
class ArrayOps:
    """Array operations the reductions need, on the framework's tensors and device.

    Methods named ``*_`` may work in place; callers always use the value they return, so a
    framework without in-place ops (TensorFlow eager) can return a new tensor.
    """
    flatten: Callable[[Sequence[Any]], Any]          # tensors -> new flat float32 buffer (cast, concat)
    zeros: Callable[[int, Any], Any]                 # (numel, like) -> float32 zeros on like's device
    empty: Callable[[int, Any], Any]                 # (numel, like) -> float32, contents undefined
    slice: Callable[[Any, int, int], Any]            # (buf, start, stop) -> 1-D view
    cat_bytes: Callable[[Sequence[Any], Any], Any]   # (uint8 tensors, like) -> one uint8 tensor
    add_: Callable[[Any, Any], Any]                  # a += b
    scale_: Callable[[Any, Any], Any]                # a *= s; s a float or a 1-element tensor
    rsub_: Callable[[Any, Any], Any]                 # out = a - out   (residual = compensated - decoded)
    numel: Callable[[Any], int]
    from_bytes: Callable[[bytes], Any]               # host bytes -> 1-D uint8 host tensor (handshake)
    to_bytes: Callable[[Any], bytes]                 # uint8 tensor -> host bytes (handshake only)
    to_like: Callable[[Any, Any], Any]               # move t to like's device (restored residuals)
    clone: Callable[[Any], Any]


def codec_alignment(codec):
    """Chunk bounds fall on multiples of this (the codec's bucket size; 1 for element-wise codecs)."""
    return max(1, int(getattr(codec, "bucket_size", 1) or 1))


def is_passthrough_codec(codec):
    """True for codecs whose payload Horovod can sum itself (NoCompression): plain allreduce is best."""
    return codec is None or codec.spec().split(":", 1)[0] in ("none", "nocompression")


def chunk_bounds(numel, size, align):
    """N contiguous (start, stop) ranges covering ``numel``, each a whole number of ``align`` buckets
    except the last non-empty one; trailing ranges may be empty when numel < size * align."""
    buckets = -(-numel // align)
    per = -(-buckets // size) * align
    return [(min(j * per, numel), min((j + 1) * per, numel)) for j in range(size)]


@dataclass
class Traffic:
    """Bytes this rank sends, beside what an fp32 ring allreduce of the same elements would send.

    Model (docs/EXCHANGE.md): alltoall sends each destination its part; allgather sends the own payload
    to N-1 ranks; a ring allreduce of b bytes sends 2(N-1)/N * b. ``payload_bytes`` is the encoded size
    of everything this rank put into a collective (its own chunks included), ``numel`` the elements.
    """
    sent_bytes: float = 0.0
    fp32_bytes: float = 0.0
    payload_bytes: int = 0
    numel: int = 0

    def reset(self):
        self.sent_bytes = self.fp32_bytes = 0.0
        self.payload_bytes = self.numel = 0

    def copy(self):
        return Traffic(self.sent_bytes, self.fp32_bytes, self.payload_bytes, self.numel)

    @property
    def ratio(self):
        """fp32 bytes / bytes sent (how many times fewer bytes); inf when nothing was sent."""
        return self.fp32_bytes / self.sent_bytes if self.sent_bytes else float("inf")

    def add_allreduce(self, nbytes, numel, size):
        ring = 2.0 * (size - 1) / size if size > 1 else 0.0
        self.sent_bytes += ring * nbytes
        self.fp32_bytes += ring * 4 * numel
        self.payload_bytes += nbytes
        self.numel += numel


# --------------------------------------------------------------------------------------------------
# Configuration handshake


def handshake_record(summary, details=()):
    """A fixed-size record: sha256 of (summary, details) then the summary, UTF-8, padded with zeros."""
    digest = hashlib.sha256(repr((summary, tuple(details))).encode()).digest()
    text = summary.encode()[:_HANDSHAKE_BYTES - _DIGEST_BYTES]
    return digest + text + b"\0" * (_HANDSHAKE_BYTES - _DIGEST_BYTES - len(text))


def handshake_async(coll, ops, record, name=HANDSHAKE_NAME):
    return coll.allgather_async(ops.from_bytes(record), name)


def check_handshake(coll, ops, record, gathered, what):
    """Raise :class:`ConfigMismatchError` on every rank when any rank's record differs."""
    data = ops.to_bytes(gathered)
    if len(data) != coll.size * _HANDSHAKE_BYTES:
        raise ConfigMismatchError(
            f"hvd_quant: configuration handshake for {what} received {len(data)} bytes, expected "
            f"{coll.size} x {_HANDSHAKE_BYTES}: ranks run different hvd_quant versions or setups")
    records = [data[i * _HANDSHAKE_BYTES:(i + 1) * _HANDSHAKE_BYTES] for i in range(coll.size)]
    if all(r == records[0] for r in records):
        return
    lines = []
    for i, r in enumerate(records):
        summary = r[_DIGEST_BYTES:].rstrip(b"\0").decode(errors="replace")
        lines.append(f"  rank {i}: {summary} [{r[:4].hex()}]")
    summaries = {r[_DIGEST_BYTES:] for r in records}
    hint = ("their summaries agree, so they differ in the parameter layout (names, sizes, grouping "
            "or order of the tensors)" if len(summaries) == 1 else "see the summaries")
    raise ConfigMismatchError(
        f"hvd_quant: ranks are configured differently for {what} ({hint}); this rank is "
        f"{coll.rank}. Every rank must use the same compression, reduction, bucket_bytes, "
        f"min_compress_numel and parameter grouping.\n" + "\n".join(lines))


def handshake(coll, ops, record, what, name=HANDSHAKE_NAME):
    """Blocking handshake: allgather ``record`` and raise on every rank if any rank differs."""
    check_handshake(coll, ops, record, coll.synchronize(handshake_async(coll, ops, record, name)), what)


# --------------------------------------------------------------------------------------------------
# The reductions


class Pending:
    """One exchange in flight. ``stage``: "first" (alltoall or allgather submitted), "second" (SRA
    allgather submitted), "done"."""
    __slots__ = ("name", "header", "step", "numel", "like", "bounds", "handle", "stage", "hs", "record",
                 "result")

    def __init__(self, name, header, step, numel, like, bounds):
        self.name, self.header, self.step, self.numel = name, header, step, numel
        self.like, self.bounds = like, bounds
        self.handle = self.hs = self.record = self.result = None
        self.stage = "first"


class Exchange:
    """The reductions for one codec, one set of collectives and one array-ops table.

    ``memory`` (a :class:`hvd_quant.memory.Memory`, optional) turns on error feedback: the residual of
    this rank's own quantization is kept under ``(Memory.WORKER, name)`` and, for SRA, the residual of
    the requantization of the chunk this rank owns under ``(Memory.SERVER, (name, r, N))`` (the "server"
    error feedback of 1-bit Adam: the requantization's error is carried to the next step too, not lost).
    """

    def __init__(self, codec, collectives, ops, reduction="sra", memory=None, prefix="hvdq"):
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        self.codec = codec
        self.coll = collectives
        self.ops = ops
        self.reduction = reduction
        self.memory = memory
        self.prefix = prefix
        self.align = codec_alignment(codec)
        self.traffic = Traffic()
        self._verified = set()      # exchange names whose first payloads were checked on the device
        # Independent noise across ranks: the codec keys its stochastic rounding on its rank.
        if hasattr(codec, "rank"):
            codec.rank = collectives.rank

    # -- sizes ------------------------------------------------------------------------------------
    def payload_nbytes(self, numel):
        return self.codec.wire_nbytes(numel) if numel else 0

    def bounds(self, numel):
        if self.reduction == "allgather":
            return [(0, numel)]
        return chunk_bounds(numel, self.coll.size, self.align)

    @staticmethod
    def tag(name, part, step):
        """The name put in a payload header: which tensor/bucket, which chunk, which step."""
        return f"{name}#{part}@{step}" if step is not None else f"{name}#{part}"

    # -- phase 1 ----------------------------------------------------------------------------------
    def start(self, name, flat, step=None, record=None, header=None):
        """Encode ``flat`` (a float32 1-D buffer this exchange may overwrite) and submit the first
        collective, named after ``name`` (what Horovod matches across ranks). ``header`` (default
        ``name``) is what goes into the payload headers, with the chunk and the step: a receiver
        expecting another header raises. With ``record`` (see :func:`handshake_record`), a
        configuration handshake travels with the exchange and is checked before anything is decoded."""
        ops, coll, codec = self.ops, self.coll, self.codec
        numel = ops.numel(flat)
        p = Pending(name, name if header is None else header, step, numel, flat, self.bounds(numel))
        if record is not None:
            p.record = record
            p.hs = handshake_async(coll, ops, record, f"{self.prefix}.hs.{name}")
        if step is not None and hasattr(codec, "reset_counters"):
            # Headers name the step and chunk, so every encode has its own name and seeded noise is
            # keyed by (seed, rank, name) alone: reproducible after a restore, and the codec's per-name
            # call counters do not grow without bound.
            codec.reset_counters()
        mem = self.memory
        if mem is not None:
            flat = mem.compensate(mem.WORKER, name, flat)
        payloads = []
        for j, (a, b) in enumerate(p.bounds):
            if b > a:
                part = "all" if self.reduction == "allgather" else f"c{j}"
                payloads.append(codec.encode(ops.slice(flat, a, b), name=self.tag(p.header, part, step)))
            else:
                payloads.append(None)
        if mem is not None:
            res = mem.buffer(mem.WORKER, name, numel, flat)
            for j, (a, b) in enumerate(p.bounds):
                if b > a:
                    codec.decode_into(payloads[j], ops.slice(res, a, b), accumulate=False)
            mem.set(mem.WORKER, name, ops.rsub_(res, flat))
        t = self.traffic
        t.numel += numel
        size = coll.size
        t.fp32_bytes += (2.0 * (size - 1) / size) * 4 * numel
        if self.reduction == "allgather":
            nbytes = self.payload_nbytes(numel)
            t.payload_bytes += nbytes
            t.sent_bytes += (size - 1) * nbytes
            payload = payloads[0] if payloads[0] is not None else ops.cat_bytes([], flat)
            p.handle = coll.allgather_async(payload, f"{self.prefix}.ag.{name}")
        else:
            splits = [self.payload_nbytes(b - a) for a, b in p.bounds]
            t.payload_bytes += sum(splits)
            t.sent_bytes += sum(splits) - splits[coll.rank]
            send = ops.cat_bytes([x for x in payloads if x is not None], flat)
            p.handle = coll.alltoall_async(send, splits, f"{self.prefix}.a2a.{name}")
        return p

    def _check_hs(self, p):
        if p.hs is not None:
            hs, p.hs = p.hs, None
            check_handshake(self.coll, self.ops, p.record, self.coll.synchronize(hs), f"tensor {p.name!r}")

    def _decode(self, p, src, payload, out, accumulate, tag):
        try:
            self.codec.decode_into(payload, out, accumulate=accumulate, name=tag)
        except ValueError as e:
            raise PayloadMismatchError(
                f"hvd_quant: the payload rank {src} sent for {p.name!r} was refused ({e}); ranks "
                f"disagree on the tensor, its size or the codec ({self.codec.spec()})") from e

    def _received(self, p, data, expected, what):
        n = self.ops.numel(data)
        if n != expected:
            raise PayloadMismatchError(
                f"hvd_quant: {what} for {p.name!r} received {n} bytes, expected {expected}: ranks "
                f"disagree on the tensor's size or on the codec ({self.codec.spec()})")

    # -- phase 2 (SRA) ----------------------------------------------------------------------------
    def advance(self, p):
        """SRA: wait for the alltoall, sum the received chunks in float32, requantize the reduced chunk
        and submit its allgather. A no-op for allgather exchanges and after the first call."""
        if p.stage != "first" or self.reduction != "sra":
            return
        self._check_hs(p)
        ops, coll, codec = self.ops, self.coll, self.codec
        data = coll.synchronize(p.handle)
        r, size = coll.rank, coll.size
        a, b = p.bounds[r]
        n = b - a
        each = self.payload_nbytes(n)
        self._received(p, data, size * each, "the alltoall")
        payload = ops.cat_bytes([], p.like)
        if n:
            acc = ops.zeros(n, p.like)
            for j in range(size):
                self._decode(p, j, ops.slice(data, j * each, (j + 1) * each), acc, True,
                             self.tag(p.header, f"c{r}", p.step))
            mem = self.memory
            key = (p.name, r, size)     # the chunk this rank owns, for this world size
            if mem is not None:
                acc = mem.compensate(mem.SERVER, key, acc)
            payload = codec.encode(acc, name=self.tag(p.header, f"r{r}", p.step))
            if mem is not None:
                res = mem.buffer(mem.SERVER, key, n, acc)
                codec.decode_into(payload, res, accumulate=False)
                mem.set(mem.SERVER, key, ops.rsub_(res, acc))
        t = self.traffic
        t.payload_bytes += each
        t.sent_bytes += (size - 1) * each
        p.handle = coll.allgather_async(payload, f"{self.prefix}.ag.{p.name}")
        p.stage = "second"

    # -- last phase -------------------------------------------------------------------------------
    def finish(self, p):
        """Wait and decode; returns the float32 **sum** over ranks (flat, ``numel`` elements)."""
        if p.stage == "done":
            return p.result
        ops, coll = self.ops, self.coll
        if self.reduction == "sra":
            self.advance(p)
            data = coll.synchronize(p.handle)
            sizes = [self.payload_nbytes(b - a) for a, b in p.bounds]
            self._received(p, data, sum(sizes), "the allgather")
            out = ops.empty(p.numel, p.like)
            off = 0
            for j, (a, b) in enumerate(p.bounds):
                if b > a:
                    self._decode(p, j, ops.slice(data, off, off + sizes[j]), ops.slice(out, a, b), False,
                                 self.tag(p.header, f"r{j}", p.step))
                off += sizes[j]
        else:
            self._check_hs(p)
            data = coll.synchronize(p.handle)
            each = self.payload_nbytes(p.numel)
            self._received(p, data, coll.size * each, "the allgather")
            out = ops.zeros(p.numel, p.like)
            tag = self.tag(p.header, "all", p.step)
            if p.numel:
                for j in range(coll.size):
                    self._decode(p, j, ops.slice(data, j * each, (j + 1) * each), out, True, tag)
        if p.name not in self._verified:
            # Device payloads are checked by a kernel that writes NaN on a bad header; read its status
            # word once per exchange name (one synchronisation, on the first step only) so that a
            # misconfiguration raises instead of showing up as NaN.
            self._verified.add(p.name)
            check = getattr(self.codec, "check_device_errors", None)
            if check is not None:
                try:
                    check()
                except ValueError as e:
                    raise PayloadMismatchError(f"hvd_quant: a payload for {p.name!r} was refused on "
                                               f"the device: {e}") from e
        p.result, p.stage, p.like, p.handle = out, "done", None, None
        return out

    def finish_all(self, pendings):
        """Advance every exchange to its last phase first, then finish each: the overlap rule."""
        pendings = list(pendings)
        for p in pendings:
            self.advance(p)
        return [self.finish(p) for p in pendings]
