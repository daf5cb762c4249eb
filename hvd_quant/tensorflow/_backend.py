"""TensorFlow side of the exchange contract (docs/ARCHITECTURE.md, "Exchange contract").

TensorFlow tensors are immutable and have no views, while the core decodes into slices of a buffer
(``decode_into(payload, ops.slice(out, a, b))``). So the TensorFlow frontend runs the core on **NumPy
arrays in host memory**, reached without copying where TensorFlow allows it:

* reading a CPU tensor: ``np.asarray(eager_tensor)`` and the arrays ``tf.numpy_function`` hands its
  Python body are read-only views of TensorFlow's own buffer (no copy); the core only ever writes
  into buffers it allocated (``flatten``, ``zeros``, ``empty``, residuals);
* writing back: the decoded float32 sum is handed to TensorFlow as the NumPy array it is
  (``tf.numpy_function`` / ``tf.convert_to_tensor`` adopt aligned NumPy memory).

:data:`OPS` is that :class:`~hvd_quant.exchange.ArrayOps` table. :func:`collectives` is the eager
:class:`~hvd_quant.exchange.Collectives` table over ``horovod.tensorflow``: ``allgather`` /
``alltoall`` / ``allreduce`` of uint8 or float arrays, asynchronous (each call runs on its own
thread; ``synchronize`` joins it) and returning NumPy arrays. Horovod's TensorFlow ops ignore
``name=`` in eager mode (every eager allgather is called ``HorovodAllgather``, so two in flight
collide), so each (collective, name, dtype) is a small cached ``tf.function`` in which the name
holds. Inside ``tf.function`` the frontend does not use this table at all: the collectives become
graph ops between ``tf.numpy_function`` steps of the same core (``hvd_quant/tensorflow/_graph.py``).

The module also serves ``hvd_quant._stock`` (stock Horovod with an hvd_quant codec as
``compression=``): :func:`stock_backend` and :func:`stock_adapter` for eager tensors (``_graph.py``,
the module ``_stock`` dispatches TensorFlow tensors to, hands them here; it builds symbolic ones
into the graph).
"""
import concurrent.futures
import re
import threading

import numpy as np
import tensorflow as tf

from ..exchange import AVERAGE, SUM, ArrayOps, Collectives

__all__ = ["OPS", "collectives", "hvd_op", "core_op", "op_name", "stock_backend", "stock_adapter",
           "to_numpy"]


# --------------------------------------------------------------------------------------------------
# NumPy array ops (host)


def to_numpy(t, dtype=None):
    """A NumPy view of an eager tensor / array (no copy for CPU tensors of the same dtype)."""
    a = np.asarray(t)
    if dtype is not None and a.dtype != dtype:
        a = a.astype(dtype)
    return a


def _flatten(tensors):
    parts = [to_numpy(t).reshape(-1) for t in tensors]
    if not parts:
        return np.empty(0, np.float32)
    if len(parts) == 1:
        return np.array(parts[0], dtype=np.float32, copy=True)
    return np.concatenate(parts).astype(np.float32, copy=False)


def _add_(a, b):
    b = to_numpy(b, np.float32)
    if a.flags.writeable:
        return np.add(a, b, out=a)
    return a + b


def _scale_(a, s):
    s = np.float32(s) if np.isscalar(s) else to_numpy(s, np.float32).reshape(-1)[:1]
    if a.flags.writeable:
        return np.multiply(a, s, out=a)
    return a * s


def _rsub_(out, a):
    return np.subtract(a, out, out=out)


OPS = ArrayOps(
    flatten=_flatten,
    zeros=lambda numel, like: np.zeros(numel, np.float32),
    empty=lambda numel, like: np.empty(numel, np.float32),
    slice=lambda buf, a, b: buf[a:b],
    empty_bytes=lambda nbytes, like: np.empty(nbytes, np.uint8),
    add_=_add_,
    scale_=_scale_,
    rsub_=_rsub_,
    numel=lambda t: int(np.size(t)),
    from_bytes=lambda b: np.frombuffer(bytes(b), dtype=np.uint8).copy(),
    to_bytes=lambda t: to_numpy(t, np.uint8).tobytes(),
    to_like=lambda t, like: np.array(to_numpy(t, np.float32).reshape(-1), copy=True),
    clone=lambda t: np.array(to_numpy(t), copy=True),
)


# --------------------------------------------------------------------------------------------------
# Ops and names


def hvd_op(op):
    """Core op name -> horovod.tensorflow op constant."""
    import horovod.tensorflow as hvd
    return {AVERAGE: hvd.Average, SUM: hvd.Sum}[op]


def core_op(op):
    """horovod.tensorflow op constant (or a core op name) -> core op name; Adasum & co. raise."""
    import horovod.tensorflow as hvd
    from ..plan import core_op as plan_core_op
    return plan_core_op(op, hvd.Average, hvd.Sum, hvd.Adasum)


_BAD = re.compile(r"[^A-Za-z0-9_.\-]")


def op_name(text):
    """``text`` as a TensorFlow op name Horovod keeps whole (no '/', which name scopes cut at)."""
    s = _BAD.sub("_", str(text))
    return s if s and s[0].isalnum() else "h" + s


# --------------------------------------------------------------------------------------------------
# Eager collectives


_FNS = {}
_FNS_LOCK = threading.Lock()


def _graph_fn(kind, name, dtype, ps, op=None, pre=1.0, post=1.0):
    """A cached tf.function running one Horovod collective under ``name`` (honoured in graphs)."""
    key = (kind, name, dtype, ps.process_set_id, op, pre, post)
    with _FNS_LOCK:
        fn = _FNS.get(key)
        if fn is not None:
            return fn
        import horovod.tensorflow as hvd
        nm = op_name(name)
        if kind == "allgather":
            def body(t):
                return hvd.allgather(t, name=nm, ignore_name_scope=True, process_set=ps)
            sig = [tf.TensorSpec([None], dtype)]
        elif kind == "alltoall":
            def body(t, splits):
                return hvd.alltoall(t, splits=splits, name=nm, ignore_name_scope=True,
                                    process_set=ps)[0]
            sig = [tf.TensorSpec([None], dtype), tf.TensorSpec([None], tf.int32)]
        elif kind == "allreduce":
            hop = hvd_op(op)

            def body(t):
                return hvd.allreduce(t, op=hop, prescale_factor=pre, postscale_factor=post, name=nm,
                                     ignore_name_scope=True, process_set=ps)
            sig = [tf.TensorSpec(None, dtype)]
        else:  # pragma: no cover
            raise ValueError(kind)
        fn = _FNS[key] = tf.function(body, input_signature=sig, autograph=False)
        return fn


def _as_tensor(t):
    if isinstance(t, (tf.Tensor, tf.Variable)):
        return t
    with tf.device("/cpu:0"):
        return tf.convert_to_tensor(np.ascontiguousarray(t))


class _Handle:
    """One collective running on its own thread (eager Horovod ops block their caller)."""
    __slots__ = ("future",)

    def __init__(self, fn, *args):
        self.future = concurrent.futures.Future()
        threading.Thread(target=self._run, args=(fn, args), daemon=True,
                         name="hvd_quant-collective").start()

    def _run(self, fn, args):
        try:
            self.future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to synchronize()
            self.future.set_exception(e)

    def result(self):
        out = self.future.result()
        return to_numpy(out)


_CACHE = {}


def collectives(process_set=None):
    """The eager :class:`~hvd_quant.exchange.Collectives` table for ``process_set`` (default: global).

    Takes NumPy arrays or eager tensors; ``synchronize`` returns NumPy arrays (see module doc).
    """
    import horovod.tensorflow as hvd
    ps = hvd.global_process_set if process_set is None else process_set
    key = (ps.process_set_id, ps.rank(), ps.size())
    coll = _CACHE.get(key)
    if coll is None:
        def allgather_async(t, name):
            t = _as_tensor(t)
            return _Handle(_graph_fn("allgather", name, t.dtype, ps), t)

        def alltoall_async(t, splits, name):
            t = _as_tensor(t)
            return _Handle(_graph_fn("alltoall", name, t.dtype, ps), t,
                           tf.constant(list(map(int, splits)), tf.int32))

        def allreduce_async(t, name, op=AVERAGE, prescale_factor=1.0, postscale_factor=1.0):
            t = _as_tensor(t)
            return _Handle(_graph_fn("allreduce", name, t.dtype, ps, op, float(prescale_factor),
                                     float(postscale_factor)), t)

        coll = Collectives(rank=ps.rank(), size=ps.size(), allgather_async=allgather_async,
                           alltoall_async=alltoall_async, allreduce_async=allreduce_async,
                           synchronize=lambda h: h.result(), process_set=ps)
        _CACHE[key] = coll
    return coll


# --------------------------------------------------------------------------------------------------
# hvd_quant._stock: codecs as stock Horovod's compression= (eager tensors here, graph in _graph.py)


def stock_backend(process_set=None):
    """(Collectives, ArrayOps) for eager tensors, for hvd_quant._stock's dispatch on tensor type."""
    return collectives(process_set), OPS


_FLOATS = (tf.float16, tf.bfloat16, tf.float32, tf.float64)


class _Info:
    __slots__ = ("numel", "shape", "dtype", "is_float", "itemsize", "device", "static")

    def __init__(self, t):
        shape = t.shape
        self.static = shape.rank is not None and shape.is_fully_defined()
        self.shape = tuple(int(d) for d in shape) if self.static else None
        self.numel = int(np.prod(self.shape, dtype=np.int64)) if self.static else -1
        self.dtype = t.dtype
        self.is_float = t.dtype in _FLOATS and self.static
        self.itemsize = t.dtype.size
        self.device = getattr(t, "device", "") or ""


# dtypes Horovod's TensorFlow allreduce takes (no bfloat16); others are sent as float32.
HOROVOD_FLOAT_DTYPES = (tf.float16, tf.float32, tf.float64)


def sendable_dtype(dtype):
    """``dtype`` if Horovod can allreduce it, else float32 (hvd_quant sums those in float32)."""
    return dtype if dtype in HOROVOD_FLOAT_DTYPES or not dtype.is_floating else tf.float32


class _StockAdapter:
    """What hvd_quant._stock needs beyond the two tables (eager and symbolic tensors)."""

    @staticmethod
    def describe(t):
        return _Info(t)

    @staticmethod
    def placeholder(t):
        # 1.0 (exact in fp16) that Horovod allreduces with op, prescale and postscale: the factor
        # decompress applies to the decoded sum. Same dtype Horovod would have seen.
        with tf.device(getattr(t, "device", "") or ""):
            return tf.ones([1], dtype=sendable_dtype(t.dtype), name="hvdq_placeholder")

    @staticmethod
    def sendable(t):
        """``t`` itself, or a float32 copy when Horovod cannot reduce its dtype (bfloat16)."""
        return t if sendable_dtype(t.dtype) == t.dtype else tf.cast(t, tf.float32)

    @staticmethod
    def cast_back(t, info):
        return t if t.dtype == info.dtype else tf.cast(t, info.dtype)

    @staticmethod
    def as_float(t):
        return to_numpy(t, np.float32).reshape(-1)

    @staticmethod
    def restore(flat, info):
        with tf.device(info.device):
            out = tf.reshape(tf.convert_to_tensor(flat), info.shape)
            return out if info.dtype == tf.float32 else tf.cast(out, info.dtype)


_ADAPTER = _StockAdapter()


def stock_adapter():
    return _ADAPTER
