"""NumPy arrays (host). bfloat16 arrays come from ml_dtypes (what TensorFlow's ``.numpy()`` gives)."""
import numpy as np

from .._arrays import HostAdapter, UnsupportedInputError, check_float, numpy_dtype

__all__ = ["adapter", "NumpyAdapter"]


class NumpyAdapter(HostAdapter):
    kind = "numpy"

    def describe(self, x):
        if not isinstance(x, np.ndarray):
            x = np.asarray(x)
        name = x.dtype.name
        check_float(name)
        return tuple(x.shape), name

    def input_np(self, x):
        return np.ascontiguousarray(x).reshape(-1)

    def input_f32(self, x):
        return np.ascontiguousarray(x, dtype=np.float32).reshape(-1)

    def payload_np(self, payload):
        p = np.asarray(payload)
        if p.dtype != np.uint8 or p.ndim != 1:
            raise UnsupportedInputError(f"a payload is a 1-D uint8 array; got {p.dtype} with shape {p.shape}")
        return p

    def wrap_payload(self, arr, like):
        return arr

    def out_np(self, out):
        if not isinstance(out, np.ndarray) or out.dtype != np.float32 or not out.flags.c_contiguous \
                or not out.flags.writeable:
            raise UnsupportedInputError("decode_into needs a writable C-contiguous float32 NumPy array; "
                                        f"got {type(out).__name__} {getattr(out, 'dtype', '')}")
        return out.reshape(-1), None

    def wrap_result(self, arr_f32, dtype_name, shape, like):
        if dtype_name != "float32":
            arr_f32 = arr_f32.astype(numpy_dtype(dtype_name))
        return arr_f32.reshape(shape)


_ADAPTER = NumpyAdapter()


def adapter(obj):
    return _ADAPTER
