"""The compressed gradient exchange, written once for every framework: ``"sra"``, ``"allgather"`` and
``"two_level"`` (:mod:`hvd_quant.two_level`, registered in :data:`LEVELLED`) move quantized payloads,
which cannot be summed, with ``alltoall`` and ``allgather`` and return the float32 **sum** over ranks
(docs/EXCHANGE.md, "The reductions"). Frameworks are reached only through :class:`Collectives` and
:class:`ArrayOps` (docs/ARCHITECTURE.md).

An exchange (:class:`Pending`) is ``start`` (encode, submit the first collective) -> ``advance``
(SRA: reduce, requantize, submit the allgather) -> ``finish`` (wait, decode); callers advance every
exchange before finishing any, so the second phases are in flight together. Collectives match across
ranks by name; a ``channel`` (``start``) matches by order, so exchanges start on it in one order.
While SRA exchanges of *other* Exchange objects (process sets) are in their first phase, a wait
advances those whose alltoall completed: their ranks may be waiting for them (:func:`_wait`).
"""
import hashlib
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

from numba_kernels.wire import MASK64, describe_error_bits

from ._arrays import adapter_for
from ._noise import fresh_seed, noise_base

__all__ = [
    "AVERAGE", "SUM", "REDUCTIONS", "Collectives", "ArrayOps", "Memory", "Exchange", "Pending", "Traffic",
    "ConfigMismatchError", "PayloadMismatchError", "chunk_bounds", "codec_alignment",
    "handshake_record", "check_handshake", "handshake", "is_passthrough_codec",
    "HANDSHAKE_NAME", "TWO_LEVEL",
]

AVERAGE = "average"
SUM = "sum"
TWO_LEVEL = "two_level"
LEVELLED = {}    # reduction -> the class that runs it over process-set levels (hvd_quant/two_level.py)
REDUCTIONS = ("sra", "allgather", TWO_LEVEL)

HANDSHAKE_NAME = "hvdq.handshake"
_HANDSHAKE_BYTES = 512          # 32-byte digest + a readable summary, fixed size on every rank
_DIGEST_BYTES = 32


class ConfigMismatchError(RuntimeError):
    """Ranks were configured differently (codec, reduction, bucketing, grouping, ...)."""


class PayloadMismatchError(ValueError):
    """A payload does not belong to the exchange that received it (wrong tensor, size or codec)."""


@dataclass(frozen=True)
class Collectives:
    """A framework's collectives on one process set (docs/ARCHITECTURE.md, "Exchange contract")."""
    rank: int
    size: int
    allgather_async: Callable[..., Any]
    alltoall_async: Callable[[Any, Sequence[int], str], Any]
    allreduce_async: Callable[..., Any]
    synchronize: Callable[[Any], Any]
    process_set: Any = None
    poll: Callable[[Any], bool] = None
    levels: Callable[..., tuple] = None


def collectives_for(cache, process_set, make):
    """The :class:`Collectives` of ``process_set`` kept in ``cache``, made by ``make(process_set)`` at
    first use; keyed by the set's id, rank and size, so a set that changes size (elastic) gets a new one."""
    key = (process_set.process_set_id, process_set.rank(), process_set.size())
    coll = cache.get(key)
    if coll is None:
        coll = cache[key] = make(process_set)
    return coll


@dataclass(frozen=True)
class ArrayOps:
    """Array operations the reductions need, on the framework's tensors and device
    (docs/ARCHITECTURE.md, "Exchange contract"); callers use what ``*_`` methods return."""
    flatten: Callable[[Sequence[Any]], Any]          # tensors -> new flat float32 buffer (cast, concat)
    zeros: Callable[[int, Any], Any]                 # (numel, like) -> float32 zeros on like's device
    empty: Callable[[int, Any], Any]                 # (numel, like) -> float32, contents undefined
    slice: Callable[[Any, int, int], Any]            # (buf, start, stop) -> 1-D view
    empty_bytes: Callable[[int, Any], Any]           # (nbytes, like) -> uint8, contents undefined
    add_: Callable[[Any, Any], Any]                  # a += b
    scale_: Callable[[Any, Any], Any]                # a *= s; s a float or a 1-element tensor
    numel: Callable[[Any], int]
    from_bytes: Callable[[bytes], Any]               # host bytes -> 1-D uint8 host tensor (handshake)
    to_bytes: Callable[[Any], bytes]                 # uint8 tensor -> host bytes (handshake only)
    to_like: Callable[[Any, Any], Any]               # move t to like's device (restored residuals)
    clone: Callable[[Any], Any]
    reusable: bool = False      # buffers may be kept and rewritten across steps (not handed to the framework)
    mark: Callable[[Any], Any] = None                # (like) -> a timestamp, not waited for; None: perf_counter


class Memory:
    """Error-feedback residuals (docs/EXCHANGE.md, "Error feedback") on the frontend's :class:`ArrayOps`:
    :attr:`WORKER` by exchange name, :attr:`SERVER` (SRA's requantized chunk) by ``(name, rank, size)``."""

    WORKER = "worker"
    SERVER = "server"
    NAMESPACES = (WORKER, SERVER)

    def __init__(self, ops):
        self.ops = ops
        self._residuals = {ns: {} for ns in self.NAMESPACES}
        self._ready = {}        # (ns, key) -> (id, numel) of the residual last found right (size, device)

    def _ns(self, ns):
        try:
            return self._residuals[ns]
        except KeyError:
            raise ValueError(f"hvd_quant: unknown residual namespace {ns!r}; use Memory.WORKER or "
                             f"Memory.SERVER") from None

    def names(self, ns):
        return list(self._ns(ns))

    def items(self, ns):
        return list(self._ns(ns).items())

    def get(self, ns, key, default=None):
        return self._ns(ns).get(key, default)

    def _fetch(self, ns, key, numel, like):
        res = self._ns(ns).get(key)
        if res is None:
            return None
        if self._ready.get((ns, key)) == (id(res), numel):     # checked and moved: the steady state
            return res
        if self.ops.numel(res) != numel:
            raise ValueError(f"hvd_quant: the error-feedback residual for {key!r} ({ns}) has "
                             f"{self.ops.numel(res)} elements, the tensor {numel}: the model or the "
                             f"bucketing changed since it was saved")
        res = self.ops.to_like(res, like)
        self._residuals[ns][key] = res
        self._ready[(ns, key)] = (id(res), numel)
        return res

    def compensate(self, ns, key, flat):
        """Step 1: ``flat + residual`` (in place where the framework allows; use the return value)."""
        res = self._fetch(ns, key, self.ops.numel(flat), flat)
        return flat if res is None else self.ops.add_(flat, res)

    def current(self, ns, key, numel, like):
        """The residual (zeros if none yet) on ``like``'s device, for a kernel that adds and overwrites it."""
        res = self._fetch(ns, key, numel, like)
        return self.ops.zeros(numel, like) if res is None else res

    def buffer(self, ns, key, numel, like):
        """A float32 buffer of ``numel`` elements to decode into for step 3 (the old residual, reused)."""
        res = self._fetch(ns, key, numel, like)
        return self.ops.empty(numel, like) if res is None else res

    def set(self, ns, key, residual):
        """Step 3: store ``compensated - decoded``."""
        d = self._ns(ns)
        if d.get(key) is not residual:
            self._ready.pop((ns, key), None)
        d[key] = residual

    def clear(self):
        self.load_state_dict({})

    def state_dict(self):
        """``{Memory.WORKER: {key: copy}, Memory.SERVER: {key: copy}}`` (tensors: ``torch.save`` keeps them)."""
        return {ns: {k: self.ops.clone(v) for k, v in d.items()} for ns, d in self._residuals.items()}

    def load_state_dict(self, state):
        state = dict(state)
        self._ready.clear()
        self._residuals = {ns: {k: self.ops.clone(v) for k, v in dict(state.get(ns, {})).items()}
                           for ns in self.NAMESPACES}


def codec_alignment(codec):
    """Chunk bounds fall on multiples of this (the codec's bucket size; 1 for element-wise codecs)."""
    return max(1, int(getattr(codec, "bucket_size", 1) or 1))


def is_passthrough_codec(codec):
    """True for codecs whose payload Horovod can sum itself (NoCompression): plain allreduce is best."""
    return codec is None or codec.spec().split(":", 1)[0] in ("none", "nocompression")


def _chunk_len(numel, size, align):
    """The length of :func:`chunk_bounds`' chunks (the last non-empty one may be shorter)."""
    buckets = -(-numel // align)
    return -(-buckets // size) * align


def chunk_bounds(numel, size, align):
    """N contiguous (start, stop) ranges covering ``numel``, each a whole number of ``align`` buckets
    except the last non-empty one; trailing ranges may be empty when numel < size * align."""
    per = _chunk_len(numel, size, align)
    return [(min(j * per, numel), min((j + 1) * per, numel)) for j in range(size)]


KINDS = ("alltoall", "allgather")     # the collectives an exchange times (Traffic.bandwidth)
_FOLD_AT = 4096                       # timed collectives kept unread before the complete ones are folded


@dataclass
class Traffic:
    """Bytes this rank sends beside an fp32 ring allreduce's, and the time of the collectives that
    sent them (docs/EXCHANGE.md, "Traffic" and "Measured bandwidth"); nothing is read on the hot path."""
    sent_bytes: float = 0.0
    fp32_bytes: float = 0.0
    payload_bytes: int = 0
    numel: int = 0
    seconds: Optional[float] = None    # the step's exchange, first gradient in to last result out
    timed: list = field(default_factory=list)     # (kind, bytes sent, start mark, stop mark)
    folded: dict = field(default_factory=dict)    # kind or "total" -> [count, bytes, seconds]

    def reset(self):
        self.__init__()

    def copy(self):
        return replace(self, timed=list(self.timed), folded={k: list(v) for k, v in self.folded.items()})

    @property
    def ratio(self):
        """fp32 bytes / bytes sent (how many times fewer bytes); inf when nothing was sent."""
        return self.fp32_bytes / self.sent_bytes if self.sent_bytes else float("inf")

    def add(self, other):
        """Add ``other``'s bytes (a setup's traffic of a step, or another step's record)."""
        self.sent_bytes += other.sent_bytes
        self.fp32_bytes += other.fp32_bytes
        self.payload_bytes += other.payload_bytes
        self.numel += other.numel
        if len(self.timed) >= _FOLD_AT:
            self.fold()
        if other.timed or other.folded:
            self.timed.extend(other.timed)
            for k, (c, b, s) in other.folded.items():
                f = self.folded.setdefault(k, [0, 0, 0.0])
                f[:] = f[0] + c, f[1] + b, f[2] + s

    def add_allreduce(self, nbytes, numel, size):
        ring = 2.0 * (size - 1) / size if size > 1 else 0.0
        self.sent_bytes += ring * nbytes
        self.fp32_bytes += ring * 4 * numel
        self.payload_bytes += nbytes
        self.numel += numel

    def fold(self):
        """Read the marks of the completed collectives in ``timed`` into ``folded``; the rest stay."""
        spans, self.timed = _spans(self.timed)
        for kind in {s[0] for s in spans}:
            _fold_into(self.folded, kind, [s for s in spans if s[0] == kind])
        if spans:
            _fold_into(self.folded, "total", spans)

    def bandwidth(self):
        """``{kind: {"count", "bytes", "seconds", "gbps"}}`` (docs/EXCHANGE.md, "Measured bandwidth")."""
        self.fold()
        out = {}
        for kind in KINDS + ("total",):
            if kind in self.folded:
                c, b, s = self.folded[kind]
                out[kind] = {"count": c, "bytes": b, "seconds": s, "gbps": b / s / 1e9 if s > 0 else None}
        return out


def _spans(timed):
    """Records -> ([(kind, bytes, a, b, on device)] in seconds, the records not complete yet); device
    marks (events) go on an axis of their own, measured from the first complete one."""
    spans, waiting, base = [], [], None
    for rec in timed:
        kind, nbytes, start, stop = rec
        if isinstance(start, float):
            spans.append((kind, nbytes, start, stop, False))
        elif start.query() and stop.query():
            base = start if base is None else base
            spans.append((kind, nbytes, base.elapsed_time(start) / 1e3, base.elapsed_time(stop) / 1e3, True))
        else:
            waiting.append(rec)
    return spans, waiting


def _fold_into(folded, kind, spans):
    """Add ``spans``' count, bytes and the length of the union of their intervals (per axis)."""
    f = folded.setdefault(kind, [0, 0, 0.0])
    f[0] += len(spans)
    f[1] += sum(s[1] for s in spans)
    for device in (False, True):
        end = float("-inf")
        for a, b in sorted((s[2], s[3]) for s in spans if s[4] is device):
            if b > end:
                f[2] += b - max(a, end)
                end = b


# --------------------------------------------------------------------------------------------------
# Configuration handshake


def handshake_record(summary, details=()):
    """A fixed-size record: sha256 of (summary, details) then the summary, UTF-8, padded with zeros."""
    digest = hashlib.sha256(repr((summary, tuple(details))).encode()).digest()
    text = summary.encode()[:_HANDSHAKE_BYTES - _DIGEST_BYTES]
    return digest + text + b"\0" * (_HANDSHAKE_BYTES - _DIGEST_BYTES - len(text))


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
    lines = [f"  rank {i}: {r[_DIGEST_BYTES:].rstrip(bytes(1)).decode(errors='replace')} [{r[:4].hex()}]"
             for i, r in enumerate(records)]
    summaries = {r[_DIGEST_BYTES:] for r in records}
    hint = ("their summaries agree, so they differ in the parameter layout (names, sizes, grouping "
            "or order of the tensors)" if len(summaries) == 1 else "see the summaries")
    raise ConfigMismatchError(
        f"hvd_quant: ranks are configured differently for {what} ({hint}); this rank is "
        f"{coll.rank}. Every rank must use the same compression, reduction, bucket_bytes, "
        f"min_compress_numel and parameter grouping.\n" + "\n".join(lines))


def handshake(coll, ops, record, what, name=HANDSHAKE_NAME):
    """Blocking handshake: allgather ``record`` and raise on every rank if any rank differs."""
    check_handshake(coll, ops, record, coll.synchronize(coll.allgather_async(ops.from_bytes(record), name)), what)


# --------------------------------------------------------------------------------------------------
# The reductions


class _Chunk:
    """One payload of a setup: elements [a, b) of the flat buffer, ``size`` bytes at byte ``off`` of
    the buffer it travels in, with its codec launches bound once (``decode`` writes, ``accumulate`` adds)."""
    __slots__ = ("a", "b", "off", "size", "words", "lay", "nh", "expect", "noise", "encode", "decode",
                 "accumulate")

    def __init__(self, ex, setup, a, b, off, tag, like):
        codec, arrays = ex.codec, setup.arrays
        self.a, self.b, self.off = a, b, off
        self.nh, self.words, self.lay = codec.header_plan((b - a,), "float32", tag)
        self.size = self.lay.total if b > a else 0      # an empty chunk sends nothing
        self.expect = codec.expectation(b - a, tag)
        seed = setup.fresh if codec.seed is None else codec.seed
        self.noise = noise_base(seed, ex.coll.rank, self.nh) if codec.stochastic else None
        self.encode = codec.bind_encode(arrays, self.lay, self.words, like)
        self.decode = codec.bind_decode(arrays, b - a, False, self.expect, like, setup.status)
        self.accumulate = codec.bind_decode(arrays, b - a, True, self.expect, like, setup.status)

    def key(self, step):
        """The noise key of this payload at ``step`` (``_noise.noise_key``); 0 without noise."""
        return 0 if self.noise is None else self.noise ^ (step & MASK64)


class _Setup:
    """What one exchange name needs every step, built once per world: its chunks (``send``, ``own``: this
    rank's chunk as received, ``reduced``: it requantized, ``gather``), the codec's fused launches, the
    step's traffic, reusable buffers and, on a device, the status word its decodes report errors to."""
    __slots__ = ("coll", "numel", "arrays", "send", "own", "reduced", "gather", "send_nbytes",
                 "gather_nbytes", "gather_sizes", "fresh", "steps", "traffic", "buffers", "server_key",
                 "decode_sum", "reduce", "decode_chunks", "keep", "sent", "splits", "status")

    def __init__(self, ex, name, header, numel, like):
        codec, coll, r, size = ex.codec, ex.coll, ex.coll.rank, ex.coll.size
        self.coll, self.numel = coll, numel
        arrays = self.arrays = adapter_for(like)
        self.status = arrays.new_status(like) if arrays.device else None
        self.fresh = fresh_seed()          # unseeded noise: this setup's base, mixed with the step

        # Payloads are tagged header#all (allgather), header#c<j> (SRA's chunk j), header#r<j> (chunk j
        # reduced), the same every step; chunks(): back to back, chunk j tagged header#part.format(j).
        def chunks(bounds, part):
            out, off = [], 0
            for j, (a, b) in enumerate(bounds):
                out.append(_Chunk(ex, self, a, b, off, f"{header}#{part.format(j)}", like))
                off += out[-1].size
            return out

        self.decode_sum = self.reduce = self.decode_chunks = self.keep = self.reduced = None
        if ex.reduction == "allgather":
            self.send = chunks([(0, numel)], "all")
            self.own = self.send[0]
            self.gather = chunks([(0, numel)] * size, "all")
            self.decode_sum = codec.bind_decode_sum(arrays, numel, self.own.expect, like, self.status)
        else:
            bounds = chunk_bounds(numel, size, ex.align)
            self.send = chunks(bounds, "c{}")
            a, b = bounds[r]
            self.own = _Chunk(ex, self, a, b, 0, f"{header}#c{r}", like)
            red = self.reduced = _Chunk(ex, self, 0, b - a, 0, f"{header}#r{r}", like)
            self.gather = chunks(bounds, "r{}")
            self.reduce = codec.bind_reduce_requantize(arrays, red.lay, red.words, self.own.expect, like,
                                                       self.status)
            full = [c for c in self.gather if c.b > c.a]
            if full:
                self.keep, hashes = arrays.constant_u32([c.nh for c in full], like)
                self.decode_chunks = codec.bind_decode_chunks(
                    arrays, numel, _chunk_len(numel, size, ex.align), hashes, full[0].expect, like,
                    self.status)
        self.send_nbytes = sum(c.size for c in self.send)
        self.splits = [c.size for c in self.send]          # the alltoall's pieces, one per rank
        self.gather_sizes = [c.size for c in self.gather]  # what each rank sends in the allgather
        self.gather_nbytes = sum(self.gather_sizes)
        self.steps = 0
        self.server_key = (name, r, size)     # the chunk this rank owns, at this world size
        # bytes this rank sends in its (alltoall, allgather), and the step's Traffic
        if self.reduced is None:
            self.sent, payload = (0, (size - 1) * self.send_nbytes), self.send_nbytes
        else:
            self.sent = (self.send_nbytes - self.send[r].size, (size - 1) * self.own.size)
            payload = self.send_nbytes + self.own.size
        self.traffic = Traffic(sent_bytes=sum(self.sent), fp32_bytes=(2.0 * (size - 1) / size) * 4 * numel,
                               payload_bytes=payload, numel=numel)
        self.buffers = {} if ex.ops.reusable else None

    def buffer(self, key, make):
        """A buffer made by ``make()``: kept and reused across steps where the frontend allows it."""
        if self.buffers is None:
            return make()
        buf = self.buffers.get(key)
        if buf is None:
            buf = self.buffers[key] = make()
        return buf


# SRA exchanges of this process in their first phase, over every Exchange, held weakly (a step its
# owner abandoned leaves nothing behind): added by start, removed by advance (module doc).
_FIRST_PHASE = weakref.WeakValueDictionary()
_POLL_FIRST_S, _POLL_MAX_S = 2e-5, 1e-3     # _wait's sleep between polls: first, longest


def _wait(exchange, handle):
    """``exchange.coll.synchronize(handle)``, advancing other Exchanges' first-phase SRA ones (module doc)."""
    coll = exchange.coll
    if coll.poll is not None and any(q.owner is not exchange for q in _FIRST_PHASE.values()):
        delay = _POLL_FIRST_S
        while not coll.poll(handle):
            others = [q for q in list(_FIRST_PHASE.values()) if q.owner is not exchange]
            if not others:
                break
            for q in others:
                try:
                    done = q.owner.coll.poll(q.handle)
                except Exception:           # a handle from before Horovod re-initialised: drop it
                    _FIRST_PHASE.pop(id(q), None)
                    continue
                if done:
                    q.owner.advance(q)
            time.sleep(delay)
            delay = min(2 * delay, _POLL_MAX_S)
    return coll.synchronize(handle)


class Pending:
    """One exchange in flight; ``stage``: "first" (alltoall or allgather sent), "second" (SRA's allgather), "done"."""
    __slots__ = ("name", "setup", "step", "like", "handle", "stage", "hs", "record", "result", "key",
                 "owner", "t0", "channel", "__weakref__")

    def __init__(self, name, setup, step, like, owner=None):
        self.name, self.setup, self.step, self.like, self.owner = name, setup, step, like, owner
        self.handle = self.hs = self.record = self.result = self.t0 = self.channel = None
        self.stage = "first"


class Exchange:
    """The reductions for one codec, collectives and array-ops table; a :class:`_Setup` per exchange name.

    ``memory`` (:class:`Memory`): error feedback, residuals under ``(WORKER, name)``
    and SRA's ``(SERVER, (name, r, N))``. ``reuse_result``: :meth:`finish` returns the setup's buffer,
    rewritten by the name's next step. ``timing``: docs/EXCHANGE.md, "Measured bandwidth".
    """

    def __init__(self, codec, collectives, ops, reduction="sra", memory=None, prefix="hvdq",
                 reuse_result=False, timing=True):
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        self.codec, self.coll, self.ops, self.reduction = codec, collectives, ops, reduction
        self.memory, self.prefix, self.reuse_result = memory, prefix, bool(reuse_result)
        self.align = codec_alignment(codec)
        self.traffic = Traffic()
        self._mark = (ops.mark or (lambda like: time.perf_counter())) if timing else None
        self._setups = {}           # (name, header, numel) -> _Setup
        self._verified = set()      # exchange names whose first payloads were checked on the device
        self._two = LEVELLED[TWO_LEVEL](self) if reduction == TWO_LEVEL else None

    def _payloads(self, setup, chunks, nbytes, flat, step, name, residual=None):
        """Encode ``flat``'s chunks into one uint8 buffer, each payload at its offset; with
        ``residual`` (a memory's (namespace, key)) the encode also writes the new residual."""
        ops, mem = self.ops, self.memory
        numel = ops.numel(flat)
        buf = setup.buffer(name, lambda: ops.empty_bytes(nbytes, flat))
        res = None if residual is None else mem.buffer(*residual, numel, flat)
        for c in chunks:
            if c.b == c.a:
                continue
            if c.a == 0 and c.b == numel and c.size == nbytes:      # one payload: no slicing
                c.encode(flat, buf, c.key(step), res)
            else:
                c.encode(ops.slice(flat, c.a, c.b), ops.slice(buf, c.off, c.off + c.size), c.key(step),
                         None if res is None else ops.slice(res, c.a, c.b))
        if res is not None:
            mem.set(*residual, res)
        return buf

    # -- phase 1 ----------------------------------------------------------------------------------
    def start(self, name, flat, step=None, record=None, header=None, channel=None):
        """Encode ``flat`` (float32, 1-D, may be overwritten) and submit the first collective.
        ``header`` (default ``name``): in the payload headers; ``step``: the noise key (default: this
        name's count); ``record``: a handshake checked before decoding; ``channel``: a torch
        ``PayloadGroup`` that carries the payloads instead (``alltoall``, ``allgather``, ``waiting``)."""
        if self._two is not None:
            return self._two.start(name, flat, step, record, header)
        ops, coll, allgather = self.ops, self.coll, self.reduction == "allgather"
        key = (name, name if header is None else header, ops.numel(flat))
        setup = self._setups.get(key)
        if setup is None or setup.coll is not coll:     # first use, or another world
            setup = self._setups[key] = _Setup(self, name, *key[1:], flat)
        if step is None:
            step = setup.steps
        setup.steps += 1
        p = Pending(name, setup, step, flat, self)
        if record is not None:
            p.record = record
            p.hs = coll.allgather_async(ops.from_bytes(record), f"{self.prefix}.hs.{name}")
        mem = self.memory
        if mem is not None:
            flat = mem.compensate(mem.WORKER, name, flat)
        send = self._payloads(setup, setup.send, setup.send_nbytes, flat, step, "send",
                              None if mem is None else (mem.WORKER, name))
        self.traffic.add(setup.traffic)
        if self._mark is not None:
            p.t0 = self._mark(flat)
        p.channel = channel
        if channel is not None:
            p.handle = channel.allgather(send) if allgather else channel.alltoall(send, setup.splits)
        elif allgather:
            p.handle = coll.allgather_async(send, f"{self.prefix}.ag.{name}", sizes=setup.gather_sizes)
        else:
            p.handle = coll.alltoall_async(send, setup.splits, f"{self.prefix}.a2a.{name}")
        if not allgather:
            _FIRST_PHASE[id(p)] = p
            if channel is not None:
                channel.waiting.append(p)
        return p

    def _check_hs(self, p):
        hs, p.hs = p.hs, None
        check_handshake(self.coll, self.ops, p.record, self.coll.synchronize(hs), f"tensor {p.name!r}")

    def _decode(self, p, src, decode, *args):
        """``decode(*args)`` (a bound decode) of what rank ``src`` sent (None: several ranks)."""
        try:
            decode(*args)
        except ValueError as e:
            who = "a payload" if src is None else f"the payload rank {src} sent"
            raise PayloadMismatchError(
                f"hvd_quant: {who} for {p.name!r} was refused ({e}); ranks "
                f"disagree on the tensor, its size or the codec ({self.codec.spec()})") from e

    def _received(self, p, kind, handle, sent, expected):
        """Wait for ``p``'s ``kind`` collective; time it; its data, checked to be ``expected`` bytes."""
        data = _wait(self, handle)
        if p.t0 is not None:
            self.traffic.timed.append((kind, sent, p.t0, self._mark(p.like)))
        n = self.ops.numel(data)
        if n != expected:
            raise PayloadMismatchError(
                f"hvd_quant: the {kind} for {p.name!r} received {n} bytes, expected {expected}: ranks "
                f"disagree on the tensor's size or on the codec ({self.codec.spec()})")
        return data

    # -- phase 2 (SRA) ----------------------------------------------------------------------------
    def advance_ready(self, pendings):
        """SRA: :meth:`advance` those of ``pendings`` whose alltoall has already completed (never
        waits; nothing where the frontend cannot poll), so that second phases start during backward."""
        if self._two is not None:
            return self._two.advance_ready(pendings)
        poll = self.coll.poll
        if poll is None or self.reduction != "sra":
            return
        for p in pendings:
            if p is not None and p.stage == "first" and poll(p.handle):
                self.advance(p)

    def advance(self, p):
        """SRA: wait for the alltoall, sum in float32, requantize, submit the allgather (on a channel,
        after advancing the exchanges started on it before ``p``); a no-op otherwise."""
        if self._two is not None:
            return self._two.advance(p)
        if p.stage != "first" or self.reduction != "sra":
            return
        _FIRST_PHASE.pop(id(p), None)
        channel = p.channel
        if channel is not None:
            waiting = channel.waiting
            while waiting[0] is not p:
                q = waiting[0]
                if q.stage == "first":
                    q.owner.advance(q)      # takes q off the queue
                else:
                    waiting.popleft()
            waiting.popleft()
        ops, coll, setup = self.ops, self.coll, p.setup
        data = self._scattered(p)
        red, n = setup.reduced, setup.reduced.b
        mem = self.memory
        if n and setup.reduce is not None:
            # one launch: sum the received payloads, add the residual, requantize, new residual
            res = None if mem is None else mem.current(mem.SERVER, setup.server_key, n, p.like)
            payload = setup.buffer("reduced", lambda: ops.empty_bytes(red.size, p.like))
            self._decode(p, None, setup.reduce, data, coll.size, res, payload, red.key(p.step))
            if mem is not None:
                mem.set(mem.SERVER, setup.server_key, res)
        elif n:
            acc = self._sum_own(p, data, setup.buffer("acc", lambda: ops.empty(n, p.like)))
            if mem is not None:
                acc = mem.compensate(mem.SERVER, setup.server_key, acc)
            payload = self._payloads(setup, (red,), red.size, acc, p.step, "reduced",
                                     None if mem is None else (mem.SERVER, setup.server_key))
        else:
            payload = ops.empty_bytes(0, p.like)
        if self._mark is not None:
            p.t0 = self._mark(p.like)
        if channel is not None:
            p.handle = channel.allgather(payload, setup.gather[0].size, setup.gather_nbytes)
        else:
            p.handle = coll.allgather_async(payload, f"{self.prefix}.ag.{p.name}", sizes=setup.gather_sizes)
        p.stage = "second"

    def _scattered(self, p):
        """SRA: wait for ``p``'s alltoall; the payloads of the chunk this rank owns, in rank order."""
        if p.hs is not None:        # the first step's handshake only
            self._check_hs(p)
        setup = p.setup
        return self._received(p, "alltoall", p.handle, setup.sent[0], self.coll.size * setup.own.size)

    def _sum_own(self, p, data, acc):
        """Decode and sum, in rank order and in float32, the payloads of this rank's chunk into ``acc``."""
        own, ops = p.setup.own, self.ops
        each = own.size
        for j in range(self.coll.size):
            self._decode(p, j, own.accumulate if j else own.decode, ops.slice(data, j * each, (j + 1) * each), acc)
        return acc

    # -- last phase -------------------------------------------------------------------------------
    def finish(self, p):
        """Wait and decode; returns the float32 **sum** over ranks (flat, ``numel`` elements)."""
        if p.stage == "done":
            return p.result
        if self._two is not None:
            return self._two.finish(p)
        ops, setup = self.ops, p.setup
        if self.reduction == "sra":
            self.advance(p)
        elif p.hs is not None:
            self._check_hs(p)
        data = self._received(p, "allgather", p.handle, setup.sent[1], setup.gather_nbytes)
        out = (setup.buffer("out", lambda: ops.empty(setup.numel, p.like)) if self.reuse_result
               else ops.empty(setup.numel, p.like))
        if setup.decode_chunks is not None:
            self._decode(p, None, setup.decode_chunks, data, out)
        elif setup.decode_sum is not None:
            self._decode(p, None, setup.decode_sum, data, self.coll.size, out)
        else:       # one payload per rank: SRA's chunks each into its place, allgather's summed
            for j, c in enumerate(setup.gather):
                if c.b > c.a:
                    decode = c.accumulate if j and setup.reduced is None else c.decode
                    self._decode(p, j, decode, ops.slice(data, c.off, c.off + c.size), ops.slice(out, c.a, c.b))
        if setup.status is not None and p.name not in self._verified:
            # a device decode writes NaN on a bad header: read the status word at each name's first step
            self._verified.add(p.name)
            bits = setup.arrays.read_status(setup.status[0])
            if bits:
                raise PayloadMismatchError(f"hvd_quant: a payload for {p.name!r} was refused on the device "
                                           f"(its decode wrote NaN): {describe_error_bits(bits)}")
        p.result, p.stage, p.like, p.handle = out, "done", None, None
        return out

    def finish_all(self, pendings):
        """Advance every exchange to its last phase first, then finish each: the overlap rule."""
        pendings = list(pendings)
        for p in pendings:
            self.advance(p)
        return [self.finish(p) for p in pendings]
