"""TensorFlow tensors.

CPU (tested): EagerTensors go through NumPy (``.numpy()`` copies: TensorFlow exposes no writable view),
payloads and results come back with ``tf.convert_to_tensor``. TensorFlow tensors are immutable, so
``decode_into`` needs a ``tf.Variable`` as ``out`` (decoded into a NumPy temporary, then
``assign`` / ``assign_add``); a plain tensor is refused with a clear error.

GPU (written, NOT tested here: the CPU machines have no GPU and the GPU machines no TensorFlow):
tensors are shared with Numba through DLPack (``tf.experimental.dlpack.to_dlpack``, read with ctypes
into a ``__cuda_array_interface__``). TensorFlow does not expose its CUDA stream, so this path is
synchronous: it waits for TensorFlow's queued work (``tf.test.experimental.sync_devices``) before the
kernels and for the kernels (``numba.cuda.synchronize``) before returning.
"""
import ctypes

import numpy as np
import tensorflow as tf

from .._arrays import DeviceAdapter, HostAdapter, UnsupportedInputError, check_float, numpy_dtype

__all__ = ["adapter", "TFHostAdapter", "TFGpuAdapter"]

_FROM_NAME = {"float32": tf.float32, "float16": tf.float16, "bfloat16": tf.bfloat16, "float64": tf.float64}


def _describe(x):
    name = x.dtype.name
    check_float(name)
    return tuple(int(d) for d in x.shape), name


def _is_variable(x):
    return isinstance(x, tf.Variable)


def _immutable_error(out):
    return UnsupportedInputError(
        "TensorFlow tensors are immutable: decode_into needs a float32 tf.Variable as out (got "
        f"{type(out).__name__}); or use decode(), or pass a NumPy array")


class TFHostAdapter(HostAdapter):
    kind = "tensorflow"
    views = False

    def describe(self, x):
        return _describe(x)

    def input_np(self, x):
        return np.asarray(x.numpy()).reshape(-1)

    def input_f32(self, x):
        if x.dtype != tf.float32:
            x = tf.cast(x, tf.float32)
        return np.ascontiguousarray(x.numpy(), dtype=np.float32).reshape(-1)

    def payload_np(self, payload):
        if payload.dtype != tf.uint8 or len(payload.shape) != 1:
            raise UnsupportedInputError(f"a payload is a 1-D uint8 tensor; got {payload.dtype.name} "
                                        f"with shape {tuple(payload.shape)}")
        return payload.numpy()

    def wrap_payload(self, arr, like):
        return tf.convert_to_tensor(arr)

    def out_np(self, out):
        if not _is_variable(out):
            raise _immutable_error(out)
        if out.dtype != tf.float32:
            raise UnsupportedInputError(f"decode_into needs a float32 tf.Variable; got {out.dtype.name}")
        tmp = np.ascontiguousarray(out.numpy(), dtype=np.float32).reshape(-1)

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
