"""The TensorFlow frontend :data:`FRONTEND`. TensorFlow tensors are immutable and have no views, so
the core runs on **NumPy arrays in host memory** (:data:`OPS`). The eager Collectives run each Horovod
collective on a thread of its own (eager Horovod ops block their caller) through a cached
``tf.function`` per name (Horovod's eager ops ignore ``name=``). Graphs: ``_graph.py``.
"""
import concurrent.futures
import re
import threading

import numpy as np
import tensorflow as tf

from .._arrays import HostAdapter, UnsupportedInputError, check_float, numpy_dtype
from ..exchange import AVERAGE, ArrayOps, Collectives
from ..frontend import Frontend, TensorInfo

__all__ = ["FRONTEND", "TensorFlowFrontend", "OPS", "collectives", "hvd_op", "core_op", "resolve_codec",
           "sendable_dtype", "op_name", "to_numpy", "GPU_REFUSED"]

GPU_REFUSED = (
    "hvd_quant does not take TensorFlow GPU tensors in its codecs, nor keep a TensorFlow exchange on "
    "the GPU (device_exchange=True): that path was never run (docs/TENSORFLOW.md, \"GPU\"). Its tape "
    "and optimizers reduce GPU gradients through host steps; for a codec, copy the tensor to the host "
    "(with tf.device(\"/cpu:0\"): tf.identity(t)) or pass its NumPy value")

FLOATS = (tf.float16, tf.bfloat16, tf.float32, tf.float64)     # the dtypes the codecs take


def to_numpy(t, dtype=None):
    """A NumPy view of an eager tensor / array (no copy for CPU tensors of the same dtype)."""
    a = np.asarray(t)
    return a if dtype is None or a.dtype == dtype else a.astype(dtype)


def _flatten(tensors):
    parts = [to_numpy(t).reshape(-1) for t in tensors]
    return np.concatenate(parts, dtype=np.float32) if parts else np.empty(0, np.float32)


def _in_place(ufunc, a, b):
    """``a`` (op)= ``b`` in ``a`` where it is writable (the core's buffers), else a new array."""
    return ufunc(a, b, out=a) if a.flags.writeable else ufunc(a, b)


OPS = ArrayOps(
    flatten=_flatten,
    zeros=lambda numel, like: np.zeros(numel, np.float32),
    empty=lambda numel, like: np.empty(numel, np.float32),
    slice=lambda buf, a, b: buf[a:b],
    empty_bytes=lambda nbytes, like: np.empty(nbytes, np.uint8),
    add_=lambda a, b: _in_place(np.add, a, to_numpy(b, np.float32)),
    scale_=lambda a, s: _in_place(np.multiply, a, np.float32(s) if np.isscalar(s)
                                  else to_numpy(s, np.float32).reshape(-1)[:1]),
    numel=lambda t: int(np.size(t)),
    from_bytes=lambda b: np.frombuffer(bytes(b), dtype=np.uint8).copy(),
    to_bytes=lambda t: to_numpy(t, np.uint8).tobytes(),
    to_like=lambda t, like: np.array(to_numpy(t, np.float32).reshape(-1), copy=True),
    clone=lambda t: np.array(to_numpy(t), copy=True),
)

_BAD = re.compile(r"[^A-Za-z0-9_.\-]")


def op_name(text):
    """``text`` as a TensorFlow op name Horovod keeps whole (no '/', which name scopes cut at)."""
    s = _BAD.sub("_", str(text))
    return s if s and s[0].isalnum() else "h" + s


# --------------------------------------------------------------------------------------------------
# Eager collectives

_FNS = {}
_FNS_LOCK = threading.Lock()


def _graph_fn(kind, name, dtype, ps, *args):
    """A cached tf.function running one Horovod collective under ``name`` (honoured in graphs);
    ``args``: the allreduce's ``(op, prescale, postscale)``."""
    key = (kind, name, dtype, ps.process_set_id) + args
    with _FNS_LOCK:
        if key not in _FNS:
            import horovod.tensorflow as hvd
            kw = dict(name=op_name(name), ignore_name_scope=True, process_set=ps)
            vec = tf.TensorSpec([None], dtype)
            if kind == "allgather":
                body, sig = (lambda t: hvd.allgather(t, **kw)), [vec]
            elif kind == "alltoall":
                body = lambda t, splits: hvd.alltoall(t, splits=splits, **kw)[0]    # noqa: E731
                sig = [vec, tf.TensorSpec([None], tf.int32)]
            else:
                op, pre, post = args
                body = lambda t: hvd.allreduce(t, op=FRONTEND.hvd_op(op), prescale_factor=pre,  # noqa: E731
                                               postscale_factor=post, **kw)
                sig = [tf.TensorSpec(None, dtype)]
            _FNS[key] = tf.function(body, input_signature=sig, autograph=False)
        return _FNS[key]


def _start(kind, name, ps, t, *args, more=()):
    """Run collective ``kind`` of ``t`` (and ``more`` tensors) on a thread of its own; a Future."""
    if not isinstance(t, (tf.Tensor, tf.Variable)):
        with tf.device("/cpu:0"):
            t = tf.convert_to_tensor(np.ascontiguousarray(t))
    fn, future = _graph_fn(kind, name, t.dtype, ps, *args), concurrent.futures.Future()

    def run():
        try:
            future.set_result(fn(t, *more))
        except BaseException as e:  # noqa: BLE001 - raised by synchronize()
            future.set_exception(e)
    threading.Thread(target=run, daemon=True, name="hvd_quant-collective").start()
    return future


class TensorFlowFrontend(Frontend):
    """TensorFlow's primitives for :class:`hvd_quant.frontend.Frontend`; symbolic tensors too (stock path)."""
    name, horovod = "tensorflow", "horovod.tensorflow"
    float32 = tf.float32
    horovod_floats = (tf.float16, tf.float32, tf.float64)      # no bfloat16

    def adapter(self, obj):
        """The codecs' adapter for a TensorFlow tensor or variable: host; GPU tensors are refused."""
        if "GPU" in (getattr(obj, "device", "") or "").upper():
            raise UnsupportedInputError(GPU_REFUSED)
        return self.host_adapter

    def make_collectives(self, ps):
        def alltoall_async(t, splits, name):
            return _start("alltoall", name, ps, t, more=(tf.constant(list(map(int, splits)), tf.int32),))

        def allreduce_async(t, name, op=AVERAGE, prescale_factor=1.0, postscale_factor=1.0):
            return _start("allreduce", name, ps, t, op, float(prescale_factor), float(postscale_factor))

        levels = (lambda probe=False: self.node_levels(ps, probe)) if ps.process_set_id == 0 else None
        return Collectives(rank=ps.rank(), size=ps.size(), process_set=ps, levels=levels,
                           allgather_async=lambda t, name, sizes=None: _start("allgather", name, ps, t),
                           alltoall_async=alltoall_async, allreduce_async=allreduce_async,
                           synchronize=lambda future: to_numpy(future.result()))

    # -- primitives of the stock path -------------------------------------------------------------
    is_floating = staticmethod(lambda dtype: dtype.is_floating)
    cast = staticmethod(tf.cast)
    as_float = staticmethod(lambda t: to_numpy(t, np.float32).reshape(-1))
    split = staticmethod(lambda flat, sizes: tf.split(flat, list(sizes)) if len(sizes) > 1 else [flat])

    @staticmethod
    def describe(t):
        shape = t.shape
        static = shape.rank is not None and shape.is_fully_defined()
        return TensorInfo(tuple(int(d) for d in shape) if static else None, t.dtype,
                          t.dtype in FLOATS, t.dtype.size, getattr(t, "device", "") or "")

    @staticmethod
    def ones(n, dtype, like):
        with tf.device(getattr(like, "device", "") or ""):
            return tf.ones([n], dtype=dtype, name="hvdq_placeholder")

    def restore(self, flat, info):
        with tf.device(info.device):
            return self.cast_back(tf.reshape(tf.convert_to_tensor(flat), info.shape), info)


def _value(t):
    """An eager tensor's (or variable's) NumPy value; a clear error for a graph's symbolic tensor."""
    try:
        return t.numpy()
    except (AttributeError, NotImplementedError):
        raise UnsupportedInputError(
            "hvd_quant codecs take eager TensorFlow tensors; inside a tf.function use hvd_quant.tensorflow's "
            "GradientReducer / DistributedGradientTape (or Horovod's, compression=codec), or tf.py_function") from None


class TFHostAdapter(HostAdapter):
    """The codecs' adapter: eager CPU tensors through NumPy; ``decode_into`` needs a ``tf.Variable``
    as ``out`` (decoded into a NumPy temporary, then ``assign``): TensorFlow tensors are immutable."""
    views = False

    def describe(self, x):
        check_float(x.dtype.name)
        return tuple(int(d) for d in x.shape), x.dtype.name

    def input_np(self, x):
        return np.asarray(_value(x)).reshape(-1)

    def input_f32(self, x):
        return np.ascontiguousarray(_value(x), dtype=np.float32).reshape(-1)

    def payload_np(self, payload):
        if payload.dtype != tf.uint8 or len(payload.shape) != 1:
            raise UnsupportedInputError(f"a payload is a 1-D uint8 tensor; got {payload.dtype.name} "
                                        f"with shape {tuple(payload.shape)}")
        return _value(payload)

    def wrap_payload(self, arr, like):
        return tf.convert_to_tensor(arr)

    def out_np(self, out):
        if not isinstance(out, tf.Variable):
            raise UnsupportedInputError(
                "TensorFlow tensors are immutable: decoding a TensorFlow payload into out needs a float32 "
                f"tf.Variable (got {type(out).__name__}); or use decode(), or decode the payload's NumPy "
                "value (payload.numpy()) into a NumPy array")
        if out.dtype != tf.float32:
            raise UnsupportedInputError(f"decode_into needs a float32 tf.Variable; got {out.dtype.name}")
        tmp = np.ascontiguousarray(_value(out), dtype=np.float32).reshape(-1)
        return tmp, lambda: out.assign(tmp.reshape(tuple(out.shape)))

    def wrap_result(self, arr_f32, dtype_name, shape, like):
        return tf.reshape(tf.convert_to_tensor(arr_f32.astype(numpy_dtype(dtype_name), copy=False)), shape)


FRONTEND = TensorFlowFrontend(OPS, TFHostAdapter())
collectives, hvd_op, core_op = FRONTEND.collectives, FRONTEND.hvd_op, FRONTEND.core_op
resolve_codec, sendable_dtype = FRONTEND.resolve_codec, FRONTEND.sendable_dtype
