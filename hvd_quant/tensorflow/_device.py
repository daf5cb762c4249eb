"""Device-resident exchange for TensorFlow GPU gradients: opt-in (``device_exchange=True``).

**Status: written; its Numba half is tested (CUDA simulator here, and on a real GPU where available:
``tests/test_tf_device.py``); its TensorFlow half has never run (the CPU machines have no GPU, the
GPU machines have no TensorFlow).** Without the option GPU gradients take the host path of
``_graph.py`` (``tf.numpy_function``: TensorFlow copies each bucket to the host and back).

Design. The core (``hvd_quant.exchange.Exchange``) decodes into *slices* of buffers it allocates, so
its buffers must be views-capable device arrays: here Numba device arrays.

* Numba half (no TensorFlow import): :data:`DEVICE_OPS`, the core's ArrayOps over Numba device
  arrays (slices are views; add / scale / a - out are small elementwise kernels, the codec's math
  stays in ``numba_kernels``), and :class:`NumbaDeviceAdapter`, the codec adapter for Numba device
  arrays, registered with ``hvd_quant._arrays.register_backend`` (the codecs then encode and decode
  them with their CUDA kernels). Everything runs on Numba's default stream of the current device.
* TensorFlow half: each exchange step is a ``tf.py_function`` placed on the gradient's GPU, whose
  inputs arrive as GPU EagerTensors. :func:`tf_view` reads one through DLPack
  (``tf.experimental.dlpack.to_dlpack``; the capsule is parsed with ctypes into a
  ``__cuda_array_interface__``: ``hvd_quant/tensorflow/_backend.py``) without copying; the first step
  copies the gradient into a Numba-owned buffer (the core may write into it), and every step's result
  is copied into a fresh TensorFlow tensor (:func:`to_tf`). TensorFlow does not expose its CUDA
  stream, so each step waits for TensorFlow's queued work first (``tf.test.experimental.sync_devices``)
  and for Numba's kernels before returning (``cuda.synchronize``).
"""
import contextlib

import numpy as np

from .._arrays import DeviceAdapter, UnsupportedInputError, check_float
from ..exchange import ArrayOps

__all__ = ["DEVICE_OPS", "NumbaDeviceAdapter", "adapter", "register", "is_device_array", "tf_view",
           "to_tf"]

_THREADS = 256
_KERNELS = {}


def _cuda():
    from numba import cuda
    return cuda


def is_device_array(a):
    """A Numba device array (or the CUDA simulator's stand-in)."""
    if isinstance(a, np.ndarray) or not hasattr(a, "copy_to_host"):
        return False
    return hasattr(a, "__cuda_array_interface__") or type(a).__name__ == "FakeCUDAArray"


cuda = None        # numba.cuda, bound on first use (a module global, as the CUDA simulator needs)


def _kernels():
    global cuda
    if _KERNELS:
        return _KERNELS
    cuda = _cuda()

    @cuda.jit
    def add(a, b, n):
        i = cuda.grid(1)
        if i < n:
            a[i] += b[i]

    @cuda.jit
    def scale_by(a, s, n):            # s: 1-element device array
        i = cuda.grid(1)
        if i < n:
            a[i] *= s[0]

    @cuda.jit
    def scale_const(a, s, n):
        i = cuda.grid(1)
        if i < n:
            a[i] *= s

    @cuda.jit
    def fill(a, v, n):
        i = cuda.grid(1)
        if i < n:
            a[i] = v

    _KERNELS.update(add=add, scale_by=scale_by, scale_const=scale_const, fill=fill)
    return _KERNELS


def _launch(name, n, *args):
    if n:
        _kernels()[name][(n + _THREADS - 1) // _THREADS, _THREADS](*args, n)


def _empty(n, dtype):
    return _cuda().device_array(int(n), dtype=dtype)


def _copy(dst, src):
    if src.size:
        dst.copy_to_device(src)


# --------------------------------------------------------------------------------------------------
# ArrayOps over Numba device arrays


def _flatten(arrays):
    parts = [a.reshape(-1) if is_device_array(a) else _cuda().to_device(np.ascontiguousarray(a, np.float32).reshape(-1))
             for a in arrays]
    out = _empty(sum(p.size for p in parts), np.float32)
    off = 0
    for p in parts:
        if np.dtype(p.dtype) != np.float32:
            raise UnsupportedInputError("device flatten takes float32 device arrays")
        _copy(out[off:off + p.size], p)
        off += p.size
    return out


def _zeros(n, like):
    out = _empty(n, np.float32)
    _launch("fill", out.size, out, np.float32(0))
    return out


def _add_(a, b):
    if not is_device_array(b):
        b = _cuda().to_device(np.ascontiguousarray(b, np.float32).reshape(-1))
    _launch("add", a.size, a, b)
    return a


def _scale_(a, s):
    if is_device_array(s):
        _launch("scale_by", a.size, a, s)
    else:
        s = np.asarray(s, np.float32).reshape(-1)
        _launch("scale_const", a.size, a, np.float32(s[0]))
    return a


def _to_host(t):
    return t.copy_to_host() if is_device_array(t) else np.asarray(t)


def _to_like(t, like):
    if is_device_array(t):
        return t
    return _cuda().to_device(np.ascontiguousarray(t, np.float32).reshape(-1))


def _clone(t):
    if not is_device_array(t):
        return _cuda().to_device(np.ascontiguousarray(t))
    out = _cuda().device_array(t.shape, dtype=t.dtype)
    _copy(out, t)
    return out


DEVICE_OPS = ArrayOps(
    flatten=_flatten,
    zeros=_zeros,
    empty=lambda n, like: _empty(n, np.float32),
    slice=lambda buf, a, b: buf[a:b],
    empty_bytes=lambda n, like: _empty(n, np.uint8),
    add_=_add_,
    scale_=_scale_,
    numel=lambda t: int(t.size),
    from_bytes=lambda b: _cuda().to_device(np.frombuffer(bytes(b), dtype=np.uint8).copy()),
    to_bytes=lambda t: _to_host(t).astype(np.uint8, copy=False).tobytes(),
    to_like=_to_like,
    clone=_clone,
)


# --------------------------------------------------------------------------------------------------
# The codec adapter for Numba device arrays


class NumbaDeviceAdapter(DeviceAdapter):
    """Codecs on Numba device arrays (float32 inputs, uint8 payloads), Numba's default stream."""
    kind = "numba"

    def describe(self, x):
        name = np.dtype(x.dtype).name
        check_float(name)
        return tuple(int(d) for d in x.shape), name

    def device_key(self, x):
        try:
            return ("numba", _cuda().get_current_device().id)
        except Exception:       # the CUDA simulator
            return ("numba", 0)

    def stream(self, x):
        # numba-cuda 0.30's launcher takes a Stream object, not 0 (the simulator has no streams)
        default = getattr(_cuda(), "default_stream", None)
        return default() if default is not None else 0

    def context(self, x):
        return contextlib.nullcontext()

    def input_f32(self, x):
        if np.dtype(x.dtype) != np.float32:
            raise UnsupportedInputError("the Numba device adapter encodes float32 device arrays")
        return x, x.reshape(-1)

    def new_bytes(self, nbytes, like):
        d = _empty(nbytes, np.uint8)
        return d, d

    def new_f32(self, numel, like):
        d = _empty(numel, np.float32)
        return d, d

    def new_status(self, like):
        d = _cuda().to_device(np.zeros(2, np.int32))
        return d, d

    def bytes_dev(self, payload):
        if np.dtype(payload.dtype) != np.uint8 or len(payload.shape) != 1:
            raise UnsupportedInputError(f"a payload is a 1-D uint8 device array; got {payload.dtype} "
                                        f"{payload.shape}")
        ptr = getattr(getattr(payload, "device_ctypes_pointer", None), "value", None)
        if ptr is not None and ptr % 4:
            from numba_kernels.wire import PayloadError
            raise PayloadError("a device payload must start on a 4-byte boundary")
        return payload

    def payload_nbytes(self, payload):
        return int(payload.size)

    def numba(self, t):
        return t

    def numel(self, t):
        return int(t.size)

    def out_dev(self, out):
        if np.dtype(out.dtype) != np.float32:
            raise UnsupportedInputError("decode_into needs a float32 device array")
        return out.reshape(-1), None

    def read_header(self, payload):
        return payload[:64].copy_to_host()

    def read_status(self, status):
        st = status.copy_to_host()
        bits = int(st[1])
        if bits:
            st[1] = 0
            status.copy_to_device(st)
        return bits

    def result(self, f32, dtype_name, shape):
        if dtype_name != "float32":
            raise UnsupportedInputError("the Numba device adapter decodes to float32 only")
        return f32.reshape(shape)

    # fp16 / none payloads: through the host (small codecs; this path is not the fast one)
    def raw_encode_into(self, x, value_dtype, payload):
        vals = x.copy_to_host().reshape(-1).astype(value_dtype)
        p = np.zeros(int(payload.size), np.uint8)
        p[64:64 + vals.nbytes] = vals.view(np.uint8)
        payload.copy_to_device(p)
        return payload

    def raw_residual(self, x, payload, value_dtype, residual):
        n = int(x.size)
        w = np.dtype(value_dtype).itemsize
        vals = payload[64:64 + w * n].copy_to_host().view(value_dtype).astype(np.float32)
        residual.copy_to_device(x.copy_to_host().reshape(-1).astype(np.float32) - vals)

    def raw_decode_into(self, payload, offset, numel, value_dtype, out, accumulate, bad):
        w = np.dtype(value_dtype).itemsize
        raw = payload[offset:offset + w * numel].copy_to_host()
        vals = raw.view(value_dtype).astype(np.float32)
        o = out.reshape(-1)
        host = o.copy_to_host() + vals if accumulate else vals
        if bad is not None:
            if int(bad.copy_to_host()[0]) != 0:
                host = np.full_like(host, np.nan)
        o.copy_to_device(np.ascontiguousarray(host, np.float32))
        return None

    def status_bad(self, status):
        return status


_ADAPTER = None


def adapter(obj):
    global _ADAPTER
    if not is_device_array(obj):
        raise UnsupportedInputError(f"{type(obj).__name__} is not a Numba device array")
    if _ADAPTER is None:
        _ADAPTER = NumbaDeviceAdapter()
    return _ADAPTER


def register():
    """Route Numba device arrays to :class:`NumbaDeviceAdapter` (numba and numba-cuda packagings)."""
    from .. import _arrays
    cuda = _cuda()
    tops = {"numba", "numba_cuda", type(cuda.device_array(1)).__module__.split(".", 1)[0]}
    for top in tops:
        _arrays.register_backend(top, __name__)


# --------------------------------------------------------------------------------------------------
# TensorFlow half (never run: no TensorFlow on the GPU machines)


def tf_view(t):
    """A Numba device array over a TensorFlow GPU tensor's memory (DLPack; keeps ``t`` alive)."""
    from ._backend import _DLPackView
    return _cuda().as_cuda_array(_DLPackView(t), sync=False)


def to_tf(dev, dtype, device):
    """A new TensorFlow tensor on ``device`` holding a copy of the Numba device array ``dev``."""
    import tensorflow as tf
    with tf.device(device):
        t = tf.zeros([int(dev.size)], dtype=dtype)
    if dev.size:
        tf_view(t).copy_to_device(dev)
    _cuda().synchronize()
    return t


def sync_tensorflow():
    import tensorflow as tf
    sync = getattr(getattr(tf.test, "experimental", None), "sync_devices", None)
    if sync is not None:
        sync()
