"""Bytes each rank sends per optimizer step, for a codec and a reduction, beside fp32's.

This is the one place the traffic formula lives; the examples, the sweep summary and the docs all
call :func:`bytes_per_step`. It needs no framework: give it the gradient shapes and the codec's
``wire_nbytes`` (``hvd_quant`` codecs have it: ``c.wire_nbytes(numel)`` is the payload size).

What one rank sends per step, with ``N`` ranks:

1. Tensors that are 1-D (biases, norm weights) or smaller than ``min_compress_numel`` go uncompressed
   through Horovod's fp32 ring allreduce: ``2 (N-1)/N * 4 * numel`` bytes.
2. The other tensors are fused as hvd_quant fuses them (``hvd_quant.plan.fuse``): in reverse parameter
   order (the order backward produces gradients), into groups of at most ``bucket_bytes`` of fp32
   (a tensor larger than that is a group on its own; ``bucket_bytes=None`` fuses them all). Per group
   of ``numel`` elements:

   - ``allgather``: the rank sends its payload to each of the ``N-1`` peers:
     ``(N-1) * wire_nbytes(numel)``.
   - ``two_level`` (``local_size`` L ranks on each of C = N/L nodes): two fp32 ring allreduces over
     the node, ``2 * 2 (L-1)/L * 4 * numel``, and across nodes this rank's part of ``ceil(numel/L)``
     elements by allgather (C = 2) or scatter-reduce-allgather (C > 2).
   - ``sra`` (scatter-reduce-allgather): the flat group is split into ``N`` chunks of
     ``ceil(numel/N)``; the ``alltoall`` sends the ``N-1`` chunks this rank does not own, and the
     ``allgather`` sends its reduced, requantized chunk to the ``N-1`` peers:
     ``2 (N-1) * wire_nbytes(ceil(numel/N))``. For a codec with fixed bytes per element that is
     ``2 (N-1)/N`` of the payload, the same factor as the fp32 ring, so the ratio to fp32 is about
     ``32 / (bits + 32/bucket_size)`` whatever ``N`` is.
3. The fp32 baseline is the ring allreduce of every gradient: ``2 (N-1)/N * 4 * numel`` summed.

These are bytes put on the wire by one rank (what the network must carry from it), not bytes a rank
receives; for allgather the two are equal, for the rings they are equal too. Headers are included
because ``wire_nbytes`` includes them. With ``N = 1`` nothing is sent and both numbers are 0.
"""
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, List, Optional, Sequence

FP32_ITEMSIZE = 4
REDUCTIONS = ("sra", "allgather", "two_level")


def ring_allreduce_bytes(numel: int, world_size: int, itemsize: int = FP32_ITEMSIZE) -> float:
    """Bytes one rank sends in a ring allreduce of ``numel`` elements of ``itemsize`` bytes."""
    if world_size <= 1 or numel <= 0:
        return 0.0
    return 2.0 * (world_size - 1) / world_size * itemsize * numel


def allgather_bytes(numel: int, world_size: int, wire_nbytes: Callable[[int], int]) -> float:
    """Bytes one rank sends when every rank allgathers every rank's payload of ``numel`` elements."""
    if world_size <= 1 or numel <= 0:
        return 0.0
    return float((world_size - 1) * wire_nbytes(numel))


def sra_bytes(numel: int, world_size: int, wire_nbytes: Callable[[int], int]) -> float:
    """Bytes one rank sends in scatter-reduce-allgather of a group of ``numel`` elements."""
    if world_size <= 1 or numel <= 0:
        return 0.0
    chunk = int(math.ceil(numel / world_size))
    return float(2 * (world_size - 1) * wire_nbytes(chunk))


def two_level_bytes(numel: int, world_size: int, wire_nbytes: Callable[[int], int], local_size: int) -> float:
    """Bytes one rank sends in ``reduction="two_level"`` of a group of ``numel`` elements."""
    nodes = world_size // local_size
    if nodes <= 1:
        return ring_allreduce_bytes(numel, local_size)
    part = int(math.ceil(numel / local_size))
    cross = (allgather_bytes if nodes == 2 else sra_bytes)(part, nodes, wire_nbytes)
    return 2 * ring_allreduce_bytes(numel, local_size) + cross


REDUCTION_BYTES = {"allgather": allgather_bytes, "sra": sra_bytes}


def is_compressed(shape: Sequence[int], min_compress_numel: int) -> bool:
    """Whether a gradient of this shape goes through the codec (else fp32 allreduce)."""
    numel = int(math.prod(shape)) if len(shape) else 1
    return len(shape) > 1 and numel >= min_compress_numel


def fuse_groups(numels: Iterable[int], bucket_bytes: Optional[int]) -> List[int]:
    """Element counts of the buckets ``hvd_quant.plan.fuse_buckets`` makes of tensors of ``numels``
    (given in parameter order; fused in reverse, as hvd_quant does)."""
    from hvd_quant.plan import fuse_buckets
    numels = [n for n in numels if n > 0]
    return [sum(numels[i] for i in g) for g in fuse_buckets(list(reversed(range(len(numels)))), numels, bucket_bytes)]


@dataclass
class Traffic:
    """Bytes one rank sends per step, and how the gradients were split."""
    sent: float
    fp32: float
    world_size: int
    reduction: str
    numel_compressed: int = 0
    numel_fp32: int = 0
    tensors_compressed: int = 0
    tensors_fp32: int = 0
    groups: List[int] = field(default_factory=list)
    source: str = "examples.common.traffic"

    @property
    def ratio(self) -> float:
        """fp32 bytes / sent bytes (how many times less); 1.0 when nothing is sent."""
        return self.fp32 / self.sent if self.sent else 1.0

    def describe(self) -> str:
        if self.world_size <= 1:
            return "0 B (1 rank: nothing to exchange)"
        return (f"{fmt_bytes(self.sent)} vs {fmt_bytes(self.fp32)} fp32 ring allreduce "
                f"({self.ratio:.2f}x less; {self.tensors_compressed} tensors / {self.numel_compressed} "
                f"elements compressed, {self.tensors_fp32} tensors / {self.numel_fp32} elements fp32)")

    def as_dict(self):
        return {"bytes_sent_per_step": self.sent, "bytes_fp32_per_step": self.fp32,
                "traffic_ratio": self.ratio, "numel_compressed": self.numel_compressed,
                "numel_fp32": self.numel_fp32, "tensors_compressed": self.tensors_compressed,
                "tensors_fp32": self.tensors_fp32, "traffic_source": self.source}


def bytes_per_step(shapes: Iterable[Sequence[int]], world_size: int,
                   wire_nbytes: Optional[Callable[[int], int]] = None, reduction: str = "sra",
                   min_compress_numel: int = 1024, bucket_bytes: Optional[int] = None,
                   local_size: Optional[int] = None) -> Traffic:
    """Bytes one rank sends per step for gradients of ``shapes`` (see the module docstring);
    ``local_size``: ranks per node, for ``two_level`` (default: one node of every rank).

    ``wire_nbytes=None`` means no codec: everything goes through fp32 ring allreduce (stock Horovod),
    so ``sent == fp32``.
    """
    shapes = [tuple(int(d) for d in s) for s in shapes]
    numels = [int(math.prod(s)) if len(s) else 1 for s in shapes]
    fp32 = sum(ring_allreduce_bytes(n, world_size) for n in numels)
    if wire_nbytes is None:
        return Traffic(sent=fp32, fp32=fp32, world_size=world_size, reduction="allreduce",
                       numel_fp32=sum(numels), tensors_fp32=len(numels))
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    compressed = [n for s, n in zip(shapes, numels) if is_compressed(s, min_compress_numel)]
    plain = [n for s, n in zip(shapes, numels) if not is_compressed(s, min_compress_numel)]
    groups = fuse_groups(compressed, bucket_bytes)
    if reduction == "two_level":
        def per_group(numel, n, wire):
            return two_level_bytes(numel, n, wire, local_size or n)
    else:
        per_group = REDUCTION_BYTES[reduction]
    sent = sum(per_group(g, world_size, wire_nbytes) for g in groups)
    sent += sum(ring_allreduce_bytes(n, world_size) for n in plain)
    return Traffic(sent=sent, fp32=fp32, world_size=world_size, reduction=reduction,
                   numel_compressed=sum(compressed), numel_fp32=sum(plain),
                   tensors_compressed=len(compressed), tensors_fp32=len(plain), groups=groups)


def powersgd_bytes_per_step(shapes: Iterable[Sequence[int]], world_size: int, rank: int,
                            min_compression_rate: float = 2.0) -> Traffic:
    """Bytes one rank sends per step with torch DDP's PowerSGD hook at ``matrix_approximation_rank``
    ``rank``, after its fp32 start: a gradient seen as an n x m matrix (n its first dimension) sends
    its factors P (n x r) and Q (m x r), r = min(n, m, rank), through fp32 ring allreduces where
    (n + m) * r * ``min_compression_rate`` < n * m (the hook's own rule); the others go in one fp32
    ring allreduce."""
    shapes = [tuple(int(d) for d in s) for s in shapes]
    numels = [int(math.prod(s)) if len(s) else 1 for s in shapes]
    fp32 = sum(ring_allreduce_bytes(n, world_size) for n in numels)
    factors, compressed, plain = 0, [], []
    for s, n in zip(shapes, numels):
        rows = s[0] if s else 1
        cols = n // rows if rows else 0
        r = min(rows, cols, rank)
        if n and (rows + cols) * r * min_compression_rate < n:
            factors += (rows + cols) * r
            compressed.append(n)
        else:
            plain.append(n)
    sent = ring_allreduce_bytes(factors, world_size) + ring_allreduce_bytes(sum(plain), world_size)
    return Traffic(sent=sent, fp32=fp32, world_size=world_size, reduction=f"powersgd rank {rank}",
                   numel_compressed=sum(compressed), numel_fp32=sum(plain),
                   tensors_compressed=len(compressed), tensors_fp32=len(plain))


def fmt_gbps(gbps) -> str:
    """", their collectives at X GB/s" for the examples' bytes line; "" when hvd_quant timed none."""
    return "" if gbps is None else f", collectives at {gbps:.3g} GB/s effective"


def fmt_bytes(n: float) -> str:
    """Human bytes in decimal units (1 MB = 10^6 B)."""
    n = float(n)
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"

