"""Zero-copy adapters from the caller's arrays to what the kernels take (docs/ARCHITECTURE.md, "Array
adapters"): :func:`adapter_for` gives an object's frontend's; NumPy's is at the end of this module."""
import threading

import numpy as np

from .dispatch import frontend_for

__all__ = ["adapter_for", "status_for", "device_statuses", "UnsupportedInputError", "HostAdapter",
           "DeviceAdapter", "FLOAT_DTYPES", "numpy_dtype", "check_float"]

FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")


class UnsupportedInputError(TypeError, ValueError):
    """The input is not an array we can encode (wrong type or a non-floating dtype)."""


def adapter_for(obj):
    """The adapter for ``obj`` (NumPy array, torch tensor, TF tensor/Variable) from its frontend."""
    frontend = frontend_for(obj)
    if frontend is None:
        raise UnsupportedInputError(
            f"hvd_quant codecs take NumPy arrays, torch tensors or TensorFlow tensors; got "
            f"{type(obj).__module__}.{type(obj).__name__} (hvd_quant.dispatch.register_frontend adds one)")
    return frontend.adapter(obj)


# The int32[2] status words (wire.ERROR_BITS) of direct device decodes, one per codec configuration and
# device, read by ``Codec.check_device_errors`` (docs/CODECS.md, "Errors"); exchange plans own theirs.
_STATUS = {}            # (codec, device key) -> (adapter, status tensor, device array)
_status_lock = threading.Lock()


def status_for(codec, arrays, like):
    """(status tensor, device array) for ``codec``'s decodes on ``like``'s device."""
    key = (codec, arrays.device_key(like))
    with _status_lock:
        if key not in _STATUS:
            _STATUS[key] = (arrays, *arrays.new_status(like))
        return _STATUS[key][1:]


def device_statuses(codec):
    """[(device key, adapter, status tensor)] of ``codec``'s device decodes so far."""
    return [(k[1], e[0], e[1]) for k, e in list(_STATUS.items()) if k[0] == codec]


def numpy_dtype(name):
    """NumPy dtype for a header dtype name (bfloat16 needs ml_dtypes)."""
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
    """Host memory: the codec works on NumPy arrays; a subclass converts (docs/ARCHITECTURE.md, "Array adapters")."""
    device = False
    views = True        # out_np gives out's own memory (TensorFlow: a temporary, then a commit)

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


class DeviceAdapter:
    """Device memory: kernels on the framework's memory and stream (docs/ARCHITECTURE.md, "Array adapters")."""
    device = True
    views = True        # out_dev gives out's own memory


# ---- NumPy arrays (host; bfloat16 arrays come from ml_dtypes, what TensorFlow's .numpy() gives) ----

_DTYPE_NAMES = {}       # dtype -> its name (dtype.name is built anew on every access)
# built-in dtypes are singletons: ``a.dtype is _F32`` is a pointer test (``!=`` converts np.float32)
_F32, _U8 = np.dtype(np.float32), np.dtype(np.uint8)


class NumpyAdapter(HostAdapter):

    def describe(self, x):
        if not isinstance(x, np.ndarray):
            x = np.asarray(x)
        name = _DTYPE_NAMES.get(x.dtype)
        if name is None:
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
                or not out.flags.c_contiguous or not out.flags.writeable:
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
