"""torch tensors: CPU tensors through ``Tensor.numpy()`` (zero-copy), CUDA tensors through
``__cuda_array_interface__`` (``numba.cuda.as_cuda_array(t, sync=False)``: zero-copy, no host
synchronisation), kernels launched on ``torch.cuda.current_stream(device)`` via
``numba.cuda.external_stream``. Outputs are allocated by torch's caching allocator (no cudaMalloc, no
synchronisation). float16 / bfloat16 / float64 inputs are converted to float32 by torch first.

The per-call host work is small: device-array views are cached by (device, pointer, size, dtype)
instead of being rebuilt through ``as_cuda_array`` on every call (torch's caching allocator hands the
same blocks back, so steady-state calls hit the cache; the views hold no reference to the tensor,
whose memory they describe only while a tensor of that pointer, size and dtype is being used), the
current stream is read with one call, and with a single visible GPU no device context is pushed and
popped around each call."""
import contextlib

import numpy as np
import torch

from .._arrays import DeviceAdapter, HostAdapter, UnsupportedInputError, check_float

__all__ = ["adapter", "TorchHostAdapter", "TorchCudaAdapter"]

_TORCH_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
                 torch.float64: "float64"}
_FROM_NAME = {v: k for k, v in _TORCH_DTYPES.items()}


def _describe(x):
    name = _TORCH_DTYPES.get(x.dtype)
    if name is None:
        check_float(str(x.dtype).replace("torch.", ""))
    return tuple(x.shape), name


def _flat(x):
    return x.detach().reshape(-1)


class TorchHostAdapter(HostAdapter):
    kind = "torch"

    def describe(self, x):
        return _describe(x)

    def input_np(self, x):
        x = _flat(x).contiguous()
        if x.dtype == torch.bfloat16:
            return x.float().numpy()
        return x.numpy()

    def input_f32(self, x):
        return _flat(x).to(torch.float32).contiguous().numpy()

    def payload_np(self, payload):
        if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
            raise UnsupportedInputError(f"a payload is a 1-D uint8 tensor; got {type(payload).__name__} "
                                        f"{getattr(payload, 'dtype', '')}")
        return payload.detach().contiguous().numpy()

    def wrap_payload(self, arr, like):
        return torch.from_numpy(arr)

    def out_np(self, out):
        if not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or not out.is_contiguous() \
                or out.device.type != "cpu":
            raise UnsupportedInputError("decode_into needs a contiguous float32 tensor of the payload's "
                                        f"kind and device; got {type(out).__name__} {getattr(out, 'dtype', '')}")
        return out.detach().view(-1).numpy(), None

    def wrap_result(self, arr_f32, dtype_name, shape, like):
        t = torch.from_numpy(arr_f32)
        if dtype_name != "float32":
            t = t.to(_FROM_NAME[dtype_name])
        return t.reshape(shape)


_TYPESTR = {torch.float32: "<f4", torch.uint8: "|u1", torch.int32: "<i4"}
_VIEW_CACHE_MAX = 1024


class TorchCudaAdapter(DeviceAdapter):
    """Kernels get raw device pointers (``Tensor.data_ptr()``) and the raw handle of torch's current
    stream: what the prepared launches of ``numba_kernels.cuda`` take, with nothing built per call.
    :meth:`numba` gives a Numba device-array view for the few launches that go through Numba's
    dispatcher (header write and check of the raw codecs, fake mode)."""
    kind = "torch"

    def __init__(self):
        from numba import cuda
        self._cuda = cuda
        self._views = {}
        self._single = None
        self._raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

    def describe(self, x):
        return _describe(x)

    def device_key(self, x):
        return ("torch", x.device.index)

    def stream(self, x):
        if self._raw_stream is not None:
            try:
                return self._raw_stream(x.device.index)
            except Exception:           # pragma: no cover - private torch API changed
                self._raw_stream = None
        return torch.cuda.current_stream(x.device).cuda_stream

    def context(self, x):
        if self._single is None:
            self._single = torch.cuda.device_count() == 1
        if self._single:                # Numba attaches to the device's primary context by itself
            return contextlib.nullcontext()
        return self._cuda.gpus[x.device.index]

    def _dev(self, t):
        return t.data_ptr()

    def numba(self, t):
        ptr = t.data_ptr()
        key = (t.device.index, ptr, t.numel(), t.dtype)
        d = self._views.get(key)
        if d is None:
            typestr = _TYPESTR.get(t.dtype)
            if typestr is None or not t.is_contiguous():
                return self._cuda.as_cuda_array(t, sync=False)
            if len(self._views) >= _VIEW_CACHE_MAX:
                self._views.clear()
            desc = {"shape": (t.numel(),), "strides": None, "typestr": typestr, "data": (ptr, False),
                    "version": 3}
            d = self._views[key] = self._cuda.from_cuda_array_interface(desc, owner=None, sync=False)
        return d

    def constant_u32(self, values, like):
        t = torch.from_numpy(np.asarray(values, np.uint32).view(np.int32)).to(like.device)
        return t, t.data_ptr()

    def input_f32(self, x):
        if x.dtype == torch.float32 and x.is_contiguous():
            t = x
        else:
            t = _flat(x).to(torch.float32).contiguous()
        return t, self._dev(t)

    def new_bytes(self, nbytes, like):
        t = torch.empty(nbytes, dtype=torch.uint8, device=like.device)
        return t, self._dev(t)

    def new_f32(self, numel, like):
        t = torch.empty(numel, dtype=torch.float32, device=like.device)
        return t, self._dev(t)

    def new_status(self, like):
        t = torch.zeros(2, dtype=torch.int32, device=like.device)
        return t, self._dev(t)

    def _check_payload(self, payload):
        if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
            raise UnsupportedInputError(f"a payload is a 1-D uint8 tensor; got {type(payload).__name__} "
                                        f"{getattr(payload, 'dtype', '')}")
        if not payload.is_contiguous():
            payload = payload.contiguous()
        if payload.data_ptr() % 4:
            from numba_kernels.wire import PayloadError
            raise PayloadError("a device payload must start on a 4-byte boundary (payload sizes are "
                               "multiples of 4, so slices of concatenated payloads are)")
        return payload

    def bytes_dev(self, payload):
        payload = self._check_payload(payload)
        return self._dev(payload)

    def payload_nbytes(self, payload):
        return payload.numel()

    def numel(self, t):
        return t.numel()

    def out_dev(self, out):
        if not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or not out.is_contiguous() \
                or out.device.type != "cuda":
            raise UnsupportedInputError("decode_into needs a contiguous float32 CUDA tensor; got "
                                        f"{type(out).__name__} {getattr(out, 'dtype', '')} "
                                        f"{getattr(out, 'device', '')}")
        return self._dev(out), None

    def read_header(self, payload):
        return payload[:64].cpu().numpy()

    def read_status(self, status):
        bits = int(status[1].item())
        if bits:
            status[1].zero_()
        return bits

    def result(self, f32, dtype_name, shape):
        if dtype_name != "float32":
            f32 = f32.to(_FROM_NAME[dtype_name])
        return f32.reshape(shape)

    def raw_encode_into(self, x, value_dtype, payload):
        """x as ``value_dtype`` ('float16' | 'float32') at byte 64 of ``payload``, zero padding after;
        the codec writes the header (a kernel, no host->device copy)."""
        n = x.numel()
        w = 2 if value_dtype == "float16" else 4
        payload[64:64 + w * n].view(_FROM_NAME[value_dtype]).copy_(_flat(x))
        payload[64 + w * n:].zero_()
        return self._dev(payload)

    def raw_residual(self, x, payload, value_dtype, residual):
        n = x.numel()
        w = 2 if value_dtype == "float16" else 4
        vals = payload[64:64 + w * n].view(_FROM_NAME[value_dtype])
        torch.sub(_flat(x).float(), vals.float(), out=residual.view(-1))

    def raw_decode_into(self, payload, offset, numel, value_dtype, out, accumulate, bad):
        """out (+)= values; ``bad`` a 0-d bool device tensor (header check failed) -> NaN."""
        w = 2 if value_dtype == "float16" else 4
        vals = payload[offset:offset + w * numel].view(_FROM_NAME[value_dtype])
        out = out.view(-1)
        if accumulate:
            out.add_(vals)
        else:
            out.copy_(vals)
        if bad is not None:
            out.masked_fill_(bad, float("nan"))
        return None

    def status_bad(self, status):
        return status[0] != 0


_HOST = TorchHostAdapter()
_CUDA = None


def adapter(obj):
    global _CUDA
    dev = getattr(obj, "device", None)
    if dev is not None and dev.type == "cuda":
        if _CUDA is None:
            _CUDA = TorchCudaAdapter()
        return _CUDA
    if dev is not None and dev.type != "cpu":
        raise UnsupportedInputError(f"torch tensors on {dev.type} are not supported (CPU and CUDA are)")
    return _HOST
