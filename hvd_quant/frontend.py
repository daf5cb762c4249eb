"""One object per framework (``FRONTEND`` of ``hvd_quant.torch._backend`` and ``hvd_quant.tensorflow._backend``):
what the core asks of it, the glue both share written once (:class:`Frontend`)."""
import importlib
import math

from . import _stock
from .codecs import resolve_codec
from .exchange import AVERAGE, SUM, collectives_for
from .plan import core_op
from .two_level import node_levels, node_ranks  # noqa: F401  (node_ranks: re-exported)

__all__ = ["Frontend", "TensorInfo", "bytes_sent_per_step", "node_ranks"]


class TensorInfo:
    """What the stock path keeps of a tensor: ``shape`` and ``numel`` (None and -1 where not static), ``dtype``
    and ``device`` (the framework's), ``itemsize`` (bytes), ``is_float`` (dense, floating, static: codecs take it)."""
    __slots__ = ("numel", "shape", "dtype", "is_float", "itemsize", "device")

    def __init__(self, shape, dtype, is_float, itemsize, device):
        self.shape, self.dtype, self.itemsize, self.device = shape, dtype, itemsize, device
        self.numel = -1 if shape is None else math.prod(shape)
        self.is_float = is_float and shape is not None


class Frontend:
    """One framework as the core sees it (its ArrayOps table and host adapter). A subclass sets ``name`` (its
    tensors' top-level module), ``horovod`` (its Horovod module), ``float32``, ``horovod_floats`` (the dtypes
    Horovod's allreduce takes), ``make_collectives``, ``adapter`` and the stock path's primitives
    (``is_floating``, ``describe`` -> :class:`TensorInfo`, ``ones``, ``cast``, ``split``, ``as_float``, ``restore``)."""
    name = horovod = None
    float32 = None
    horovod_floats = ()

    def __init__(self, ops, host_adapter):
        self.ops, self.host_adapter = ops, host_adapter
        self._collectives = {}          # process set -> Collectives
        self._hvd_ops = None            # core op name -> Horovod's op constant

    def __repr__(self):
        return f"<hvd_quant frontend {self.name}>"

    # -- Horovod --------------------------------------------------------------------------------------
    def hvd(self):
        """The framework's Horovod module (imported on use: the codecs need no Horovod)."""
        return importlib.import_module(self.horovod)

    def hvd_op(self, op):
        """Core op name -> Horovod's op constant (the table built on first use)."""
        if self._hvd_ops is None:
            self._hvd_ops = {AVERAGE: self.hvd().Average, SUM: self.hvd().Sum}
        return self._hvd_ops[op]

    def core_op(self, op):
        """Horovod's op constant (or a core op name, or None: Average) -> core op name; Adasum raises."""
        hvd = self.hvd()
        return core_op(op, hvd.Average, hvd.Sum, hvd.Adasum)

    def resolve_codec(self, compression):
        """:func:`hvd_quant.codecs.resolve_codec` with this framework's ``hvd.Compression``."""
        return resolve_codec(compression, importlib.import_module(f"{self.horovod}.compression").Compression)

    def collectives(self, process_set=None):
        """The Collectives table of ``process_set`` (default: Horovod's global one)."""
        ps = self.hvd().global_process_set if process_set is None else process_set
        return collectives_for(self._collectives, ps, self.make_collectives)

    node_levels = node_levels           # reduction="two_level"'s levels (hvd_quant.two_level)

    # -- dtypes ---------------------------------------------------------------------------------------
    def sendable_dtype(self, dtype):
        """``dtype`` if Horovod can allreduce it, else float32 (hvd_quant sums those in float32)."""
        if dtype in self.horovod_floats or not self.is_floating(dtype):
            return dtype
        return self.float32

    # -- the stock path -------------------------------------------------------------------------------
    def stock_backend(self, process_set=None):
        return self.collectives(process_set), self.ops

    def stock_adapter(self):
        return self

    def placeholder(self, t, n=1):
        """``n`` ones on ``t``'s device, in ``t``'s dtype where Horovod can reduce it (its grouped
        allreduce wants one dtype per group): docs/EXCHANGE.md, "The placeholder trick"."""
        return self.ones(n, self.sendable_dtype(t.dtype), t)

    def sendable(self, t):
        """``t`` itself, or a float32 copy when Horovod cannot reduce its dtype (bfloat16)."""
        return t if self.sendable_dtype(t.dtype) == t.dtype else self.cast(t, self.float32)

    def cast_back(self, t, info):
        """``t`` in the dtype :meth:`describe` saw (``info``)."""
        return t if t.dtype == info.dtype else self.cast(t, info.dtype)


def bytes_sent_per_step(obj):
    """``{"sent": bytes, "fp32": bytes, "ratio": fp32/sent, "gbps": GB/s}`` of ``obj``'s last step: what
    this rank sent, what an fp32 ring allreduce would have sent, and the effective bandwidth (None
    where untimed). ``obj``: anything with ``bytes_per_step()`` (or its ``hvd_quant_reducer``); a stock
    Horovod optimizer whose ``compression=`` is ours, or that codec: the bytes since the last call."""
    own = getattr(obj, "hvd_quant_reducer", obj)
    t = own.bytes_per_step() if hasattr(own, "bytes_per_step") else None
    if t is None:
        t = _stock.take_traffic(obj)
    return {"sent": t.sent_bytes, "fp32": t.fp32_bytes, "ratio": t.ratio,
            "gbps": t.bandwidth().get("total", {}).get("gbps")}
