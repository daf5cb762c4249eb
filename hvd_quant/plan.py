"""The static plan of a compressed gradient reduction, for every frontend (docs/ARCHITECTURE.md)."""
import itertools
import math
import numbers
import zlib
from dataclasses import dataclass, fields
from typing import Any, Optional

import numpy as np

from .exchange import AVERAGE, REDUCTIONS, SUM, Memory, handshake_record, is_passthrough_codec

__all__ = ["Config", "Tensor", "Bucket", "Plan", "AUTO", "ALLREDUCE", "configure", "core_op",
           "check_reduction", "check_groups", "check_backward_passes", "fuse", "fuse_buckets",
           "plain_groups", "split_even", "bucket_header", "digest", "make_plan", "save_residuals",
           "restore_residuals"]

AUTO = "auto"
ALLREDUCE = "allreduce"


def core_op(op, average, sum_, adasum):
    """A framework's Horovod op constant (``average``, ``sum_``, ``adasum``: its own), a core op name
    or None (Average) -> :data:`~hvd_quant.exchange.AVERAGE` / :data:`~hvd_quant.exchange.SUM`."""
    if isinstance(op, str) and op in (AVERAGE, SUM):
        return op
    if op is None or op == average:
        return AVERAGE
    if op == sum_:
        return SUM
    if op == adasum:
        raise ValueError("hvd_quant: op=hvd.Adasum is not supported: Adasum combines gradients "
                         "pairwise with dot products, which quantized payloads do not provide. "
                         "Use op=hvd.Average or op=hvd.Sum.")
    raise ValueError(f"hvd_quant: unsupported op {op!r}; use hvd.Average or hvd.Sum")


def check_reduction(reduction, auto=True):
    allowed = REDUCTIONS + ((AUTO,) if auto else ())
    if reduction not in allowed:
        raise ValueError(f"reduction must be one of {allowed}, got {reduction!r}")


def check_backward_passes(passes):
    if passes <= 0:
        raise ValueError("backward_passes_per_step must be > 0")


def _count(value, name, allow_none=False):
    """``value`` as a non-negative int (a float that is a whole number passes: ``2.5e7``)."""
    if value is None and allow_none:
        return None
    if (isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or value != int(value) or value < 0):
        raise ValueError(f"{name} must be a non-negative whole number; got {value!r}")
    return int(value)


def _flag(value, name, allow_none=False):
    """``value`` as a bool (NumPy's too) or, where allowed, None; a string or number would pass as true."""
    if value is None and allow_none:
        return None
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True{', False or None' if allow_none else ' or False'}; got {value!r}")
    return bool(value)


def check_groups(groups, what):
    """None, a positive count or a list of lists (of ``what``)."""
    if groups is not None and not (isinstance(groups, (list, tuple)) or int(groups) > 0):
        raise ValueError(f"groups should be a non-negative integer or a list of list of {what}.")


# Default fusion bucket: float32 bytes per compressed bucket (torch DDP's bucket_cap_mb). Each bucket
# costs collectives and host work per step whatever its size (docs/BENCHMARKS.md).
BUCKET_BYTES = 25 << 20


@dataclass(frozen=True)
class Config:
    """What every rank must agree on. None: does not apply (the stock path has no buckets, warm-up or
    op), left out of :meth:`summary`; ``extra``: a frontend's own ``(label, value)`` pairs."""
    codec: Any
    reduction: str = "sra"
    bucket_bytes: Optional[int] = BUCKET_BYTES
    min_compress_numel: int = 1024
    compress_1d: bool = False
    warmup_steps: Optional[int] = 0
    error_feedback: bool = False
    op: Optional[str] = AVERAGE
    predivide: Optional[float] = 1.0
    extra: tuple = ()

    def summary(self):
        """One line; it travels in the handshake and is printed when ranks differ."""
        pairs = [(f.name, getattr(self, f.name)) for f in fields(self)[1:-1]] + list(self.extra)
        return " ".join([self.codec.spec()] + [f"{k}={v}" for k, v in pairs if v is not None])

    def compressible(self, shape, floating):
        """Whether a tensor of ``shape`` (a tuple; None if not static) is compressed."""
        if not floating or shape is None or is_passthrough_codec(self.codec):
            return False
        return (len(shape) > 1 or self.compress_1d) and math.prod(shape) >= self.min_compress_numel

    def allreduce_factors(self):
        """(prescale, postscale) for the uncompressed allreduce: Horovod's predivide rule."""
        if self.op == AVERAGE and self.predivide is not None:
            return 1.0 / self.predivide, self.predivide
        return 1.0, 1.0


def configure(codec, *, reduction="sra", bucket_bytes=BUCKET_BYTES, min_compress_numel=1024,
              compress_1d=False, warmup_steps=0, error_feedback=None, op=AVERAGE, predivide=1.0,
              extra=()):
    """A checked :class:`Config`; ``codec``: resolved by the frontend (its ``resolve_codec``), ``op``:
    a core op, ``error_feedback``: None for the codec's wish."""
    check_reduction(reduction)
    if predivide is not None and predivide != 1.0 and op != AVERAGE:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    bucket_bytes = _count(bucket_bytes, "bucket_bytes", allow_none=True)
    min_compress_numel = _count(min_compress_numel, "min_compress_numel")
    warmup_steps = _count(warmup_steps, "warmup_steps", allow_none=True)
    compress_1d = _flag(compress_1d, "compress_1d")
    error_feedback = _flag(error_feedback, "error_feedback", allow_none=True)
    if error_feedback is None:
        error_feedback = getattr(codec, "wants_error_feedback", False)
    return Config(codec=codec, reduction=reduction, bucket_bytes=bucket_bytes,
                  min_compress_numel=min_compress_numel, compress_1d=compress_1d,
                  warmup_steps=warmup_steps, error_feedback=bool(error_feedback), op=op,
                  predivide=None if predivide is None else float(predivide), extra=tuple(extra))


@dataclass(frozen=True)
class Tensor:
    """A gradient: ``shape`` None where not static; ``floating``: dense floating point."""
    name: str
    shape: Optional[tuple]
    floating: bool


@dataclass(frozen=True)
class Bucket:
    """Tensor ``k`` of the bucket is ``flat[offsets[k]:offsets[k + 1]]`` reshaped to ``shapes[k]``."""
    index: int
    name: str           # the exchange's name: prefix + header
    header: str         # from the members' names alone (payload headers, seeded noise, checkpoints)
    members: tuple      # indices into the planned tensors, in bucket order
    names: tuple
    shapes: tuple
    offsets: tuple

    @property
    def numel(self):
        return self.offsets[-1]

    @property
    def numels(self):
        return tuple(b - a for a, b in zip(self.offsets, self.offsets[1:]))


@dataclass(frozen=True)
class Plan:
    config: Config
    tensors: tuple      # as given (None: an absent gradient, neither compressed nor plain)
    buckets: tuple
    plain: tuple        # indices of the tensors sent uncompressed, in order
    record: bytes       # the handshake record of this plan

    @property
    def compressed(self):       # indices, in bucket order
        return tuple(i for b in self.buckets for i in b.members)

    @property
    def compressed_numel(self):
        return sum(b.numel for b in self.buckets)

    @property
    def key(self):
        """Names this plan in saved state (``reduction="auto"``'s, per plan)."""
        return self.record[:8].hex()


def fuse(idxs, numels, bucket_bytes):
    """Greedy, in the given order: groups of at most ``bucket_bytes`` of float32 (a bigger tensor
    alone); one group for 0 or None."""
    groups, size = [], 0
    limit = max(1, int(bucket_bytes) // 4) if bucket_bytes else None
    for i in idxs:
        n = numels[i]
        if not groups or (limit is not None and size + n > limit):
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += n
    return groups


# The last bucket in backward order has nothing left to overlap it, so the greedy fusion's last bucket
# gives its last-produced tensors, up to 1/TAIL_SHARE of bucket_bytes, a bucket of their own: the
# rest of it travels while backward computes them.
TAIL_SHARE = 8


def fuse_buckets(idxs, numels, bucket_bytes):
    """:func:`fuse` for compressed buckets (``idxs`` in backward order), the last group's tail split
    off as described at :data:`TAIL_SHARE` where the group is larger than that share."""
    groups = fuse(idxs, numels, bucket_bytes)
    if not bucket_bytes or not groups:
        return groups
    last, limit = groups[-1], max(1, int(bucket_bytes) // 4 // TAIL_SHARE)
    if sum(numels[i] for i in last) <= limit:
        return groups
    k, size = len(last), 0
    while k > 1 and size + numels[last[k - 1]] <= limit:
        k -= 1
        size += numels[last[k]]
    return groups if k == len(last) else groups[:-1] + [last[:k], last[k:]]


def plain_groups(plan, float32, bucket_bytes):
    """The plain tensors of ``plan`` whose ``float32[i]`` is true, fused as :func:`fuse` does in
    reverse order: each group is one allreduce of a flat buffer instead of one per tensor."""
    numels = {i: math.prod(plan.tensors[i].shape) for i in plan.plain if float32[i]}
    return fuse([i for i in reversed(plan.plain) if float32[i]], numels, bucket_bytes)


def split_even(items, n):
    """``items`` in ``n`` contiguous parts, longer ones first (Horovod's ``split_list``)."""
    d, r = divmod(len(items), n)
    return [items[i * d + min(i, r):(i + 1) * d + min(i + 1, r)] for i in range(n)]


def digest(names):
    return f"{zlib.crc32(repr(list(names)).encode()) & 0xffffffff:08x}"


def bucket_header(names):
    """One name itself; else the first and last names, the count and a checksum of all."""
    names = list(names)
    if len(names) == 1:
        return names[0]
    return f"{names[0]}..{names[-1]}({len(names)},{digest(names)})"


def make_plan(config, tensors, groups=None, prefix="hvdq"):
    """``tensors``: :class:`Tensor` records (None: no gradient) in parameter order. ``groups``: None,
    a count, or lists of tensor indices (one bucket each, of their compressible members)."""
    tensors = tuple(tensors)
    comp = [i for i, t in enumerate(tensors) if t is not None and config.compressible(t.shape, t.floating)]
    is_comp = set(comp)
    plain = tuple(i for i, t in enumerate(tensors) if t is not None and i not in is_comp)
    numels = {i: math.prod(tensors[i].shape) for i in comp}
    if isinstance(groups, (list, tuple)):
        seen, members = set(), []
        for grp in groups:
            m = [i for i in grp if i in is_comp and i not in seen]
            seen.update(m)
            if m:
                members.append(m)
        members += fuse_buckets([i for i in reversed(comp) if i not in seen], numels, config.bucket_bytes)
    elif groups:
        members = [g for g in split_even(comp, int(groups)) if g]
    else:
        members = fuse_buckets(list(reversed(comp)), numels, config.bucket_bytes)
    buckets = []
    for k, m in enumerate(members):
        names = tuple(tensors[i].name for i in m)
        header = bucket_header(names)
        buckets.append(Bucket(k, f"{prefix}.{header}", header, tuple(m), names,
                              tuple(tuple(tensors[i].shape) for i in m),
                              tuple(itertools.accumulate((numels[i] for i in m), initial=0))))
    summary = (f"{config.summary()} buckets={len(buckets)} "
               f"compressed_numel={sum(b.numel for b in buckets)} tensors={len(comp) + len(plain)}")
    layout = (tuple((b.name, b.names, b.shapes) for b in buckets),
              tuple((tensors[i].name, tensors[i].shape) for i in plain))
    return Plan(config, tensors, tuple(buckets), plain, handshake_record(summary, layout))


def save_residuals(memory, buckets, copy):
    """``({tensor name: residual shaped like it}, {(bucket header, rank, size): flat residual})`` for
    ``buckets``; ``copy(t)``: an independent float32 copy (with ``reshape``) of a flat residual."""
    worker, server = {}, {}
    for b in buckets:
        flat = memory.get(Memory.WORKER, b.name)
        if flat is not None:
            for k, name in enumerate(b.names):
                worker[name] = copy(flat[b.offsets[k]:b.offsets[k + 1]]).reshape(b.shapes[k])
    by_name = {b.name: b for b in buckets}
    for (name, rank, size), residual in memory.items(Memory.SERVER):
        b = by_name.get(name)
        if b is not None:
            server[(b.header, rank, size)] = copy(residual)
    return worker, server


def restore_residuals(memory, buckets, worker, server, join):
    """Move the entries of ``buckets`` out of :func:`save_residuals`'s dicts into ``memory`` (a
    bucket's worker residual once every member's is there); ``join(arrays)``: one flat float32."""
    for b in buckets:
        if all(n in worker for n in b.names):
            flat = join([worker.pop(n) for n in b.names])
            if memory.ops.numel(flat) != b.numel:
                raise ValueError(f"hvd_quant: restored residuals of bucket {b.name} have "
                                 f"{memory.ops.numel(flat)} elements, the bucket {b.numel}")
            memory.set(Memory.WORKER, b.name, flat)
        for key in [k for k in server if k[0] == b.header]:
            memory.set(Memory.SERVER, (b.name,) + tuple(key[1:]), join([server.pop(key)]))
