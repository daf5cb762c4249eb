"""Zero-copy adapters between the caller's arrays and what the kernels take.

The codecs never import a framework. They ask :func:`adapter_for` for the adapter of whatever they
were given: the ``adapter(obj)`` of the object's frontend (``hvd_quant.dispatch``; NumPy's adapter is
at the end of this module), imported on first use, only for the framework the object comes from.

Two kinds of adapters:

* host (:class:`HostAdapter`): NumPy arrays, torch CPU tensors, TensorFlow CPU tensors. The codec does
  all its work on NumPy arrays with the Numba CPU kernels; the adapter converts at the edges
  (zero-copy where the framework allows: ``Tensor.numpy()`` for torch; TensorFlow copies).
* device (:class:`DeviceAdapter`): torch CUDA tensors (raw pointers, on torch's current stream). The
  codec launches the Numba CUDA kernels on the framework's own memory; outputs are allocated by the
  framework. (TensorFlow GPU tensors are refused: docs/TENSORFLOW.md, "GPU".)

Input dtypes: float32 is used in place; float16, bfloat16 and float64 are converted to float32 first
(one extra pass, done by the framework); anything else raises :class:`UnsupportedInputError`.
"""
import threading

import numpy as np

from .dispatch import frontend_for

__all__ = ["adapter_for", "status_for", "device_statuses", "UnsupportedInputError", "HostAdapter",
           "DeviceAdapter", "FLOAT_DTYPES", "numpy_dtype", "check_float"]

FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")


class UnsupportedInputError(TypeError, ValueError):
    """The input is not an array we can encode (wrong type or a non-floating dtype)."""


def adapter_for(obj):
    """The adapter for ``obj`` (NumPy array, torch tensor, TF tensor/Variable): a dict lookup of its
    type's frontend, then the frontend's own dispatch (host or device)."""
    frontend = frontend_for(obj)
    if frontend is None:
        raise UnsupportedInputError(
            f"hvd_quant codecs take NumPy arrays, torch tensors or TensorFlow tensors; got "
            f"{type(obj).__module__}.{type(obj).__name__} (hvd_quant.dispatch.register_frontend adds one)")
    return frontend.adapter(obj)


# ---- device status words ---------------------------------------------------------------------------
# A device decode checks its payload's header on the device and records what was wrong in an int32[2]
# status array (wire.ERROR_BITS): [0] for the payload just decoded, [1] sticky until read. They belong
# to the run, not to the (immutable) codec: here one per (codec configuration, device) for direct
# ``decode_into`` calls, read by ``Codec.check_device_errors``; each exchange plan makes its own
# (``new_status``) and reads it itself.

_STATUS = {}            # (codec, device key) -> (adapter, status tensor, device array)
_status_lock = threading.Lock()


def status_for(codec, arrays, like):
    """(status tensor, device array) for ``codec``'s decodes on ``like``'s device."""
    key = (codec, arrays.device_key(like))
    entry = _STATUS.get(key)
    if entry is None:
        with _status_lock:
            entry = _STATUS.get(key)
            if entry is None:
                t, dev = arrays.new_status(like)
                entry = _STATUS[key] = (arrays, t, dev)
    return entry[1], entry[2]


def device_statuses(codec):
    """[(device key, adapter, status tensor)] of ``codec``'s device decodes so far."""
    return [(k[1], e[0], e[1]) for k, e in list(_STATUS.items()) if k[0] == codec]


def numpy_dtype(name):
    """NumPy dtype for a header dtype name (bfloat16 needs ml_dtypes, which TensorFlow and JAX bring)."""
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError as e:       # pragma: no cover - ml_dtypes comes with TF
            raise UnsupportedInputError("decoding a bfloat16 payload to NumPy needs the ml_dtypes "
                                        "package (pip install ml_dtypes)") from e
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def check_float(dtype_name, what="input"):
    if dtype_name not in FLOAT_DTYPES:
        raise UnsupportedInputError(
            f"hvd_quant codecs encode floating-point tensors (float32, float16, bfloat16, float64); "
            f"the {what} has dtype {dtype_name}")


class HostAdapter:
    """Host memory: everything becomes a NumPy array. Subclasses convert to and from their framework."""
    device = False
    kind = "numpy"
    views = True        # out_np gives out's own memory (TensorFlow: a temporary, then a commit)

    # -- inputs ------------------------------------------------------------------------------------
    def describe(self, x):
        """(shape tuple, dtype name) of an input tensor."""
        raise NotImplementedError

    def input_f32(self, x):
        """``x`` as a flat, C-contiguous float32 NumPy array (no copy when it already is one)."""
        raise NotImplementedError

    def input_np(self, x):
        """``x`` as a flat NumPy array of its own dtype (used by the raw fp16/none codecs)."""
        raise NotImplementedError

    def numel(self, t):
        """Element count of a flat array/tensor of this kind."""
        n = getattr(t, "numel", None)
        return int(n()) if callable(n) else int(np.prod(np.shape(t), dtype=np.int64))

    def payload_nbytes(self, payload):
        return self.numel(payload)

    def constant_u32(self, values, like):
        """(keepalive, handle) of a small uint32 array (host: the NumPy array itself)."""
        a = np.asarray(values, np.uint32)
        return a, a

    # -- payloads ----------------------------------------------------------------------------------
    def payload_np(self, payload):
        """A payload (1-D uint8 of this kind) as a NumPy uint8 array (no copy where possible)."""
        raise NotImplementedError

    def wrap_payload(self, arr, like):
        """A NumPy uint8 array we filled, as a payload of this kind."""
        raise NotImplementedError

    # -- outputs -----------------------------------------------------------------------------------
    def out_np(self, out):
        """(writable flat float32 NumPy view of ``out``, commit()) for decode_into; commit() is called
        after writing (a no-op when the view is ``out``'s own memory)."""
        raise NotImplementedError

    def wrap_result(self, arr_f32, dtype_name, shape, like):
        """Decoded float32 values (NumPy, flat) as a tensor of this kind, dtype and shape."""
        raise NotImplementedError


class DeviceAdapter:
    """Device memory: Numba device-array views of framework tensors, kernels on the framework's stream."""
    device = True
    kind = "device"
    views = True        # out_dev gives out's own memory (TensorFlow: a temporary, then a commit)

    def describe(self, x):
        raise NotImplementedError

    def device_key(self, x):
        """A hashable id of x's device (for per-device state such as the error-status buffer)."""
        raise NotImplementedError

    def stream(self, x):
        """The Numba stream to launch on for tensors like ``x``."""
        raise NotImplementedError

    def context(self, x):
        """Context manager making x's device Numba's current device."""
        raise NotImplementedError

    def input_f32(self, x):
        """(float32 tensor holding x's values, its device handle). A device handle is what the
        prepared kernel launches take: a device pointer (int) or a Numba device array."""
        raise NotImplementedError

    def numba(self, t):
        """A Numba device-array view of a flat tensor (for launches through Numba's dispatcher)."""
        raise NotImplementedError

    def constant_u32(self, values, like):
        """(keepalive, device handle) of a small uint32 array on ``like``'s device, made once."""
        d = self.numba_module().to_device(np.asarray(values, np.uint32))
        return d, d

    @staticmethod
    def numba_module():
        from numba import cuda
        return cuda

    def new_bytes(self, nbytes, like):
        """(framework uint8 tensor, device array) freshly allocated on like's device."""
        raise NotImplementedError

    def new_f32(self, numel, like):
        raise NotImplementedError

    def new_status(self, like):
        """(framework int32[2] zeros, device array) on like's device: the decode error flag."""
        raise NotImplementedError

    def bytes_dev(self, payload):
        """Device array view of a framework uint8 payload."""
        raise NotImplementedError

    def payload_nbytes(self, payload):
        raise NotImplementedError

    def numel(self, t):
        """Element count of a framework tensor."""
        raise NotImplementedError

    def out_dev(self, out):
        """(device array view of a flat float32 ``out``, commit): commit is None when the view is
        ``out``'s memory; otherwise the codec decodes without accumulating into the view and calls
        commit(accumulate) (TensorFlow: tensors are immutable, ``out`` is a tf.Variable)."""
        raise NotImplementedError

    def read_header(self, payload):
        """The first 64 bytes of a device payload, on the host (this synchronises)."""
        raise NotImplementedError

    def read_status(self, status):
        """int error bits from status[1] (synchronises), and reset status[1] to 0."""
        raise NotImplementedError

    def result(self, f32, dtype_name, shape):
        """A framework float32 flat tensor as the decoded tensor of ``dtype_name`` and ``shape``."""
        raise NotImplementedError

    # raw (fp16 / fp32) payloads, written with framework ops
    def raw_encode_into(self, x, value_dtype, payload):
        """Write x as value_dtype at byte 64 of the uint8 ``payload`` (a framework tensor or a slice of
        one), zero the padding after it; the header is left unwritten. Returns the payload's device
        view."""
        raise NotImplementedError

    def raw_residual(self, x, payload, value_dtype, residual):
        """residual = x - (the value_dtype values at byte 64 of ``payload``), in float32."""
        raise NotImplementedError

    def raw_decode_into(self, payload, offset, numel, value_dtype, out, accumulate, bad):
        """out (+)= the payload's raw values; ``bad``: device flag (see status_bad) -> NaN."""
        raise NotImplementedError

    def status_bad(self, status):
        """A device boolean 'status[0] != 0' usable by raw_decode_into (no host read)."""
        raise NotImplementedError


# ---- NumPy arrays (host; bfloat16 arrays come from ml_dtypes, what TensorFlow's .numpy() gives) ----



_DTYPE_NAMES = {}
# NumPy's built-in dtypes are singletons: ``a.dtype is _F32`` is a pointer test, where ``a.dtype !=
# np.float32`` converts the type on every call (a measurable part of a small encode or decode); an
# equal dtype that is another object (with metadata, say) takes the full comparison.
_F32, _U8 = np.dtype(np.float32), np.dtype(np.uint8)


class NumpyAdapter(HostAdapter):
    kind = "numpy"

    def describe(self, x):
        if not isinstance(x, np.ndarray):
            x = np.asarray(x)
        name = _DTYPE_NAMES.get(x.dtype)
        if name is None:                # (dtype.name is built anew on every access)
            name = _DTYPE_NAMES[x.dtype] = x.dtype.name
        check_float(name)
        return x.shape, name

    def input_np(self, x):
        return np.ascontiguousarray(x).reshape(-1)

    def input_f32(self, x):
        if type(x) is np.ndarray and x.dtype is _F32 and x.ndim == 1 and x.flags.c_contiguous:
            return x
        return np.ascontiguousarray(x, dtype=np.float32).reshape(-1)

    def payload_np(self, payload):
        p = np.asarray(payload)
        if (p.dtype is not _U8 and p.dtype != _U8) or p.ndim != 1:
            raise UnsupportedInputError(f"a payload is a 1-D uint8 array; got {p.dtype} with shape {p.shape}")
        return p if p.flags.c_contiguous else np.ascontiguousarray(p)

    def wrap_payload(self, arr, like):
        return arr

    def out_np(self, out):
        if not isinstance(out, np.ndarray) or (out.dtype is not _F32 and out.dtype != _F32) \
                or not out.flags.c_contiguous \
                or not out.flags.writeable:
            raise UnsupportedInputError("decode_into needs a writable C-contiguous float32 NumPy array; "
                                        f"got {type(out).__name__} {getattr(out, 'dtype', '')}")
        return out.reshape(-1), None

    def wrap_result(self, arr_f32, dtype_name, shape, like):
        if dtype_name != "float32":
            arr_f32 = arr_f32.astype(numpy_dtype(dtype_name))
        return arr_f32.reshape(shape)


_NUMPY = NumpyAdapter()


def adapter(obj):
    """The NumPy adapter (this module is NumPy's frontend in ``hvd_quant.dispatch``)."""
    return _NUMPY
