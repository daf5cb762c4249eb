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
import ctypes
import re
import threading

import numpy as np
import tensorflow as tf

from .._arrays import DeviceAdapter, HostAdapter, UnsupportedInputError, check_float, numpy_dtype
from ..exchange import AVERAGE, SUM, ArrayOps, Collectives, collectives_for

__all__ = ["OPS", "collectives", "hvd_op", "core_op", "op_name", "stock_backend", "stock_adapter",
           "to_numpy", "adapter"]


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
    return collectives_for(_CACHE, hvd.global_process_set if process_set is None else process_set,
                           _make_collectives)


def _make_collectives(ps):
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

    return Collectives(rank=ps.rank(), size=ps.size(), allgather_async=allgather_async,
                       alltoall_async=alltoall_async, allreduce_async=allreduce_async,
                       synchronize=lambda h: h.result(), process_set=ps)


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
    def split(flat, sizes):
        return tf.split(flat, list(sizes)) if len(sizes) > 1 else [flat]

    @staticmethod
    def restore(flat, info):
        with tf.device(info.device):
            out = tf.reshape(tf.convert_to_tensor(flat), info.shape)
            return out if info.dtype == tf.float32 else tf.cast(out, info.dtype)


_ADAPTER = _StockAdapter()


def stock_adapter():
    return _ADAPTER


# --------------------------------------------------------------------------------------------------
# The codecs' array adapters
# TensorFlow tensors.
#
# CPU (tested): EagerTensors go through NumPy (``.numpy()`` copies: TensorFlow exposes no writable view),
# payloads and results come back with ``tf.convert_to_tensor``. TensorFlow tensors are immutable, so
# ``decode_into`` needs a ``tf.Variable`` as ``out`` (decoded into a NumPy temporary, then
# ``assign`` / ``assign_add``); a plain tensor is refused with a clear error.
#
# GPU (written, NOT tested here: the CPU machines have no GPU and the GPU machines no TensorFlow):
# tensors are shared with Numba through DLPack (``tf.experimental.dlpack.to_dlpack``, read with ctypes
# into a ``__cuda_array_interface__``). TensorFlow does not expose its CUDA stream, so this path is
# synchronous: it waits for TensorFlow's queued work (``tf.test.experimental.sync_devices``) before the
# kernels and for the kernels (``numba.cuda.synchronize``) before returning.


_FROM_NAME = {"float32": tf.float32, "float16": tf.float16, "bfloat16": tf.bfloat16, "float64": tf.float64}


def _describe(x):
    name = x.dtype.name
    check_float(name)
    return tuple(int(d) for d in x.shape), name


def _is_variable(x):
    return isinstance(x, tf.Variable)


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
    kind = "tensorflow"
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
        if not _is_variable(out):
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


# ---- GPU through DLPack (untested here) -------------------------------------------------------------

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.CFUNCTYPE(None, ctypes.c_void_p))]


_GET_POINTER = ctypes.pythonapi.PyCapsule_GetPointer
_GET_POINTER.restype = ctypes.c_void_p
_GET_POINTER.argtypes = [ctypes.py_object, ctypes.c_char_p]
_TYPESTR = {(0, 8): "|i1", (0, 32): "<i4", (1, 8): "|u1", (2, 16): "<f2", (2, 32): "<f4", (2, 64): "<f8"}


class _DLPackView:
    """A ``__cuda_array_interface__`` over a TensorFlow GPU tensor's DLPack capsule (kept alive)."""

    def __init__(self, tensor):
        self._tensor = tensor
        self._capsule = tf.experimental.dlpack.to_dlpack(tensor)
        ptr = _GET_POINTER(self._capsule, b"dltensor")
        t = _DLManagedTensor.from_address(ptr).dl_tensor
        shape = tuple(t.shape[k] for k in range(t.ndim))
        n = int(np.prod(shape)) if shape else 1
        typestr = _TYPESTR[(t.dtype.code, t.dtype.bits)]
        self.__cuda_array_interface__ = {
            "shape": (n,), "typestr": typestr, "data": ((t.data or 0) + t.byte_offset, False),
            "version": 3, "strides": None, "stream": None}


class TFGpuAdapter(DeviceAdapter):
    kind = "tensorflow"
    views = False

    def __init__(self):
        from numba import cuda
        self._cuda = cuda

    def describe(self, x):
        return _describe(x)

    def device_key(self, x):
        return ("tensorflow", x.device)

    def _index(self, x):
        return tf.DeviceSpec.from_string(x.device).device_index or 0

    def stream(self, x):
        tf.test.experimental.sync_devices()        # TF's stream is not exposed: wait for its work
        return 0

    def context(self, x):
        return self._cuda.gpus[self._index(x)]

    def _dev(self, t):
        return self._cuda.as_cuda_array(_DLPackView(t), sync=False)

    def _empty(self, n, dtype, like):
        with tf.device(like.device):
            return tf.raw_ops.Empty(shape=[n], dtype=dtype, init=False)

    def input_f32(self, x):
        t = tf.reshape(tf.cast(x, tf.float32), [-1])
        return t, self._dev(t)

    def new_bytes(self, nbytes, like):
        t = self._empty(nbytes, tf.uint8, like)
        return t, self._dev(t)

    def new_f32(self, numel, like):
        t = self._empty(numel, tf.float32, like)
        return t, self._dev(t)

    def new_status(self, like):
        with tf.device(like.device):
            t = tf.raw_ops.Empty(shape=[2], dtype=tf.int32, init=True)
        return t, self._dev(t)

    def bytes_dev(self, payload):
        return self._dev(payload)

    def numba(self, t):
        return self._dev(t)

    def payload_nbytes(self, payload):
        return int(payload.shape[0])

    def numel(self, t):
        return int(np.prod(t.shape))

    def out_dev(self, out):
        if not _is_variable(out):
            raise _immutable_error(out)
        n = int(np.prod(out.shape))
        tmp, dev = self.new_f32(n, out)

        def commit(accumulate=False):
            self._cuda.synchronize()
            v = tf.reshape(tmp, out.shape)
            out.assign_add(v) if accumulate else out.assign(v)
        return dev, commit

    def read_header(self, payload):
        return payload[:64].numpy()

    def read_status(self, status):
        bits = int(status.numpy()[1])
        if bits:
            self._cuda.as_cuda_array(_DLPackView(status), sync=False)[1:2].copy_to_device(
                np.zeros(1, np.int32))
        return bits

    def result(self, f32, dtype_name, shape):
        self._cuda.synchronize()
        if dtype_name != "float32":
            f32 = tf.cast(f32, _FROM_NAME[dtype_name])
        return tf.reshape(f32, shape)

    def raw_encode_into(self, x, value_dtype, payload):
        # TensorFlow tensors are immutable: the values go in through a device-to-device copy
        vals = tf.reshape(tf.bitcast(tf.cast(tf.reshape(x, [-1]), _FROM_NAME[value_dtype]), tf.uint8), [-1])
        pdev = self._dev(payload)
        n = int(vals.shape[0])
        tf.test.experimental.sync_devices()
        pdev[64:64 + n].copy_to_device(self._dev(vals))
        pdev[64 + n:].copy_to_device(np.zeros(int(pdev.size) - 64 - n, np.uint8))
        return pdev

    def raw_residual(self, x, payload, value_dtype, residual):
        raise UnsupportedInputError("TensorFlow tensors are immutable: error feedback on TensorFlow GPU "
                                    "tensors runs in the device exchange (hvd_quant/tensorflow/_device.py)")

    def raw_decode_into(self, payload, offset, numel, value_dtype, out, accumulate, bad):
        w = 2 if value_dtype == "float16" else 4
        raw = tf.reshape(payload[offset:offset + w * numel], [numel, w])
        vals = tf.cast(tf.bitcast(raw, _FROM_NAME[value_dtype]), tf.float32)
        if bad is not None:
            vals = tf.where(bad, tf.fill([numel], float("nan")), vals)
        if not _is_variable(out):
            if accumulate:
                raise _immutable_error(out)
            return vals                     # decode(): the new tensor is the result
        v = tf.reshape(vals, out.shape)
        out.assign_add(v) if accumulate else out.assign(v)
        return None

    def status_bad(self, status):
        self._cuda.synchronize()
        return status[0] != 0


_HOST = TFHostAdapter()
_GPU = None


def adapter(obj):
    global _GPU
    dev = getattr(obj, "device", "") or ""
    if "GPU" in dev.upper():
        if _GPU is None:
            _GPU = TFGpuAdapter()
        return _GPU
    return _HOST
