"""PyTorch side of the exchange contract: the :class:`~hvd_quant.exchange.Collectives` table over
``horovod.torch`` and the :class:`~hvd_quant.exchange.ArrayOps` table over torch tensors.

Everything here runs on the caller's device and on ``torch.cuda.current_stream()``; nothing reads a
device value on the host except the one-off configuration handshake (``to_bytes``).
"""
import torch

from ..exchange import AVERAGE, ArrayOps, Collectives, SUM

__all__ = ["OPS", "collectives", "hvd_op", "core_op"]


def _flatten(tensors):
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])


def _zeros(numel, like):
    return torch.zeros(numel, dtype=torch.float32, device=like.device)


def _empty(numel, like):
    return torch.empty(numel, dtype=torch.float32, device=like.device)


def _rsub_(out, a):
    return torch.sub(a, out, out=out)


def _to_like(t, like):
    return t if t.device == like.device else t.to(like.device)


OPS = ArrayOps(
    flatten=_flatten,
    zeros=_zeros,
    empty=_empty,
    slice=lambda buf, a, b: buf[a:b],
    empty_bytes=lambda nbytes, like: torch.empty(nbytes, dtype=torch.uint8, device=like.device),
    add_=lambda a, b: a.add_(b),
    scale_=lambda a, s: a.mul_(s),
    rsub_=_rsub_,
    numel=lambda t: t.numel(),
    from_bytes=lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8),
    to_bytes=lambda t: t.detach().cpu().numpy().tobytes(),
    to_like=_to_like,
    clone=lambda t: t.detach().clone(),
    reusable=True,
)


def hvd_op(op):
    """Core op name -> horovod.torch op constant."""
    import horovod.torch as hvd
    return {AVERAGE: hvd.Average, SUM: hvd.Sum}[op]


def core_op(op):
    """horovod.torch op constant (or a core op name) -> core op name; Adasum raises."""
    import horovod.torch as hvd
    from ..plan import core_op as plan_core_op
    return plan_core_op(op, hvd.Average, hvd.Sum, hvd.Adasum)


def _alltoall_result(handle):
    import horovod.torch as hvd
    out = hvd.synchronize(handle)
    return out[0] if isinstance(out, tuple) else out


_CACHE = {}


def collectives(process_set=None):
    """The Collectives table for ``process_set`` (default: the global one)."""
    import horovod.torch as hvd
    ps = hvd.global_process_set if process_set is None else process_set
    key = (ps.process_set_id, ps.rank(), ps.size())
    coll = _CACHE.get(key)
    if coll is None:
        def allgather_async(t, name):
            return hvd.allgather_async(t, name=name, process_set=ps)

        def alltoall_async(t, splits, name):
            return hvd.alltoall_async(t, splits=torch.tensor(splits, dtype=torch.int32), name=name,
                                      process_set=ps)

        def allreduce_async(t, name, op=AVERAGE, prescale_factor=1.0, postscale_factor=1.0):
            return hvd.allreduce_async_(t, name=name, op=hvd_op(op), prescale_factor=prescale_factor,
                                        postscale_factor=postscale_factor, process_set=ps)

        def synchronize(handle):
            return _alltoall_result(handle)

        coll = Collectives(rank=ps.rank(), size=ps.size(), allgather_async=allgather_async,
                           alltoall_async=alltoall_async, allreduce_async=allreduce_async,
                           synchronize=synchronize, process_set=ps)
        _CACHE[key] = coll
    return coll


def stock_backend(process_set=None):
    """(Collectives, ArrayOps) for hvd_quant._stock's dispatch on tensor type."""
    return collectives(process_set), OPS


# Dtypes horovod.torch 0.28.1 can allreduce (bfloat16 raises "Tensor type ... is not supported").
HOROVOD_FLOAT_DTYPES = (torch.float16, torch.float32, torch.float64)


def sendable_dtype(dtype):
    """``dtype`` if Horovod can allreduce it, else float32 (hvd_quant sums those in float32)."""
    return dtype if dtype in HOROVOD_FLOAT_DTYPES or not dtype.is_floating_point else torch.float32


class _Info:
    __slots__ = ("numel", "shape", "dtype", "is_float", "itemsize")

    def __init__(self, t):
        self.numel = t.numel()
        self.shape = tuple(t.shape)
        self.dtype = t.dtype
        self.is_float = t.is_floating_point() and not t.is_sparse
        self.itemsize = t.element_size()


class _StockAdapter:
    """What hvd_quant._stock needs beyond the two tables."""

    @staticmethod
    def describe(t):
        return _Info(t)

    @staticmethod
    def placeholder(t):
        # 1.0 in the gradient's dtype (exact in fp16) so that Horovod's grouped allreduce, which wants
        # one dtype per group, sees the same dtypes as without hvd_quant; float32 for dtypes Horovod
        # cannot reduce (bfloat16).
        return torch.ones(1, dtype=sendable_dtype(t.dtype), device=t.device)

    @staticmethod
    def sendable(t):
        """``t`` itself, or a float32 copy when Horovod cannot reduce its dtype (bfloat16)."""
        return t if sendable_dtype(t.dtype) == t.dtype else t.to(torch.float32)

    @staticmethod
    def cast_back(t, info):
        return t if t.dtype == info.dtype else t.to(info.dtype)

    @staticmethod
    def as_float(t):
        return t.to(torch.float32)

    @staticmethod
    def restore(flat, info):
        return flat.view(info.shape).to(info.dtype)


_ADAPTER = _StockAdapter()


def stock_adapter():
    return _ADAPTER
