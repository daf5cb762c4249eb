"""The TensorFlow frontend: :data:`FRONTEND`, the one object through which the core reaches
TensorFlow (``hvd_quant.frontend.Frontend``, registered in ``hvd_quant.dispatch``).

TensorFlow tensors are immutable and have no views, while the core decodes into slices of a buffer
(``decode_into(payload, ops.slice(out, a, b))``). So the TensorFlow frontend runs the core on **NumPy
arrays in host memory**, reached without copying where TensorFlow allows it:

* reading a CPU tensor: ``np.asarray(eager_tensor)`` and the arrays ``tf.numpy_function`` hands its
  Python body are read-only views of TensorFlow's own buffer (no copy); the core only ever writes
  into buffers it allocated (``flatten``, ``zeros``, ``empty``, residuals);
* writing back: the decoded float32 sum is handed to TensorFlow as the NumPy array it is
  (``tf.numpy_function`` / ``tf.convert_to_tensor`` adopt aligned NumPy memory).

:data:`OPS` is that :class:`~hvd_quant.exchange.ArrayOps` table. The eager
:class:`~hvd_quant.exchange.Collectives` tables (:meth:`TensorFlowFrontend.make_collectives`) run
``allgather`` / ``alltoall`` / ``allreduce`` of ``horovod.tensorflow`` on uint8 or float arrays,
asynchronously (each call on its own thread; ``synchronize`` joins it), returning NumPy arrays.
Horovod's TensorFlow ops ignore ``name=`` in eager mode (every eager allgather is called
``HorovodAllgather``, so two in flight collide), so each (collective, name, dtype) is a small cached
``tf.function`` in which the name holds. Inside ``tf.function`` the frontend does not use this table:
the collectives become graph ops between ``tf.numpy_function`` steps of the same core
(``hvd_quant/tensorflow/_graph.py``, which also builds the stock path's exchanges of symbolic
tensors: its ``stock_compress``, registered in ``hvd_quant.dispatch.STOCK_HOOKS``).

GPU tensors: the codecs refuse them (:data:`GPU_REFUSED`; docs/TENSORFLOW.md, "GPU"). No machine we
test on has TensorFlow with a GPU, so no TensorFlow GPU path is offered; the reducer's and the stock
path's steps read GPU gradients through NumPy, which copies them to the host.
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
    "the GPU (device_exchange=True): no machine it is tested on has TensorFlow with a GPU, so that "
    "path was never run (docs/TENSORFLOW.md, \"GPU\"). hvd_quant.tensorflow's tape and optimizers "
    "reduce GPU gradients through host steps; for a codec, copy the tensor to the host first "
    "(with tf.device(\"/cpu:0\"): tf.identity(t)) or pass its NumPy value")


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


OPS = ArrayOps(
    flatten=_flatten,
    zeros=lambda numel, like: np.zeros(numel, np.float32),
    empty=lambda numel, like: np.empty(numel, np.float32),
    slice=lambda buf, a, b: buf[a:b],
    empty_bytes=lambda nbytes, like: np.empty(nbytes, np.uint8),
    add_=_add_,
    scale_=_scale_,
    numel=lambda t: int(np.size(t)),
    from_bytes=lambda b: np.frombuffer(bytes(b), dtype=np.uint8).copy(),
    to_bytes=lambda t: to_numpy(t, np.uint8).tobytes(),
    to_like=lambda t, like: np.array(to_numpy(t, np.float32).reshape(-1), copy=True),
    clone=lambda t: np.array(to_numpy(t), copy=True),
)


# --------------------------------------------------------------------------------------------------
# Op names


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
            hop = FRONTEND.hvd_op(op)

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


FLOATS = (tf.float16, tf.bfloat16, tf.float32, tf.float64)     # the dtypes the codecs take


class TensorFlowFrontend(Frontend):
    """TensorFlow's primitives for :class:`hvd_quant.frontend.Frontend`; eager and symbolic tensors
    alike for the stock path (a symbolic tensor's shape may be unknown: ``describe`` says so)."""
    name, horovod = "tensorflow", "horovod.tensorflow"
    float32 = tf.float32
    horovod_floats = (tf.float16, tf.float32, tf.float64)      # no bfloat16

    def adapter(self, obj):
        """The codecs' adapter for a TensorFlow tensor or variable: host; GPU tensors are refused."""
        if "GPU" in (getattr(obj, "device", "") or "").upper():
            raise UnsupportedInputError(GPU_REFUSED)
        return self.host_adapter

    def make_collectives(self, ps):
        def allgather_async(t, name, sizes=None):      # (Horovod gathers the lengths itself)
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

        return Collectives(rank=ps.rank(), size=ps.size(), allgather_async=allgather_async,
                           alltoall_async=alltoall_async, allreduce_async=allreduce_async,
                           synchronize=lambda h: h.result(), process_set=ps,
                           levels=(lambda probe=False: self.node_levels(ps, probe)) if ps.process_set_id == 0 else None)

    # -- primitives of the stock path -------------------------------------------------------------
    @staticmethod
    def is_floating(dtype):
        return dtype.is_floating

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

    @staticmethod
    def cast(t, dtype):
        return tf.cast(t, dtype)

    @staticmethod
    def as_float(t):
        return to_numpy(t, np.float32).reshape(-1)

    @staticmethod
    def split(flat, sizes):
        return tf.split(flat, list(sizes)) if len(sizes) > 1 else [flat]

    def restore(self, flat, info):
        with tf.device(info.device):
            return self.cast_back(tf.reshape(tf.convert_to_tensor(flat), info.shape), info)


# --------------------------------------------------------------------------------------------------
# The codecs' array adapter: eager CPU tensors through NumPy (``.numpy()`` copies: TensorFlow exposes
# no writable view); payloads and results come back with ``tf.convert_to_tensor``. TensorFlow tensors
# are immutable, so ``decode_into`` needs a ``tf.Variable`` as ``out`` (decoded into a NumPy
# temporary, then ``assign``); a plain tensor is refused with a clear error.


def _describe(x):
    name = x.dtype.name
    check_float(name)
    return tuple(int(d) for d in x.shape), name


def _immutable_error(out):
    return UnsupportedInputError(
        "TensorFlow tensors are immutable: decoding a TensorFlow payload into out needs a float32 "
        f"tf.Variable (got {type(out).__name__}); or use decode(), or decode the payload's NumPy value "
        "(payload.numpy()) into a NumPy array")


def _value(t):
    """An eager tensor's (or variable's) NumPy value; a clear error for a graph's symbolic tensor."""
    try:
        return t.numpy()
    except (AttributeError, NotImplementedError):
        raise UnsupportedInputError(
            "hvd_quant codecs take eager TensorFlow tensors; inside a tf.function use "
            "hvd_quant.tensorflow.GradientReducer / DistributedGradientTape (or Horovod's, with "
            "compression=codec), or call the codec through tf.py_function") from None


class TFHostAdapter(HostAdapter):
    views = False

    def describe(self, x):
        return _describe(x)

    def input_np(self, x):
        return np.asarray(_value(x)).reshape(-1)

    def input_f32(self, x):
        if x.dtype != tf.float32:
            x = tf.cast(x, tf.float32)
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
            raise _immutable_error(out)
        if out.dtype != tf.float32:
            raise UnsupportedInputError(f"decode_into needs a float32 tf.Variable; got {out.dtype.name}")
        tmp = np.ascontiguousarray(_value(out), dtype=np.float32).reshape(-1)

        def commit():
            out.assign(tmp.reshape(tuple(out.shape)))
        return tmp, commit

    def wrap_result(self, arr_f32, dtype_name, shape, like):
        if dtype_name == "bfloat16":
            t = tf.cast(tf.convert_to_tensor(arr_f32), tf.bfloat16)
        else:
            t = tf.convert_to_tensor(arr_f32.astype(numpy_dtype(dtype_name), copy=False))
        return tf.reshape(t, shape)


FRONTEND = TensorFlowFrontend(OPS, TFHostAdapter())
collectives, hvd_op, core_op = FRONTEND.collectives, FRONTEND.hvd_op, FRONTEND.core_op
resolve_codec, sendable_dtype = FRONTEND.resolve_codec, FRONTEND.sendable_dtype
