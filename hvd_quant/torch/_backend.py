"""The PyTorch frontend (docs/ARCHITECTURE.md): :data:`FRONTEND`, :data:`OPS`, the codecs' array adapters
(CPU tensors through ``Tensor.numpy()``; CUDA ones as raw pointers and torch's current raw stream), the
Collectives over ``horovod.torch`` and the :class:`PayloadGroup` that carries an optimizer's payloads."""
import collections
import contextlib
import datetime
import os
import socket
import time

import numpy as np
import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors

from numba_kernels.wire import HEADER_NBYTES, PayloadError

from .._arrays import DeviceAdapter, HostAdapter, UnsupportedInputError, check_float
from ..exchange import AVERAGE, ArrayOps, Collectives, handshake
from ..frontend import Frontend, TensorInfo

__all__ = ["FRONTEND", "TorchFrontend", "OPS", "collectives", "hvd_op", "core_op", "resolve_codec", "host_one",
           "wait_for", "PayloadGroup", "GroupWork", "PAYLOAD_GROUP", "STORE_TIMEOUT_S"]


def _flatten(tensors):
    """A new float32 buffer holding ``tensors`` end to end (never a view: the exchange writes into
    it), in one C++ call; mixed dtypes promote before the cast, so each element rounds as alone."""
    if len(tensors) == 1:
        return tensors[0].detach().reshape(-1).to(torch.float32, copy=True)
    flat = _flatten_dense_tensors(tensors).detach()
    return flat if flat.dtype == torch.float32 else flat.to(torch.float32)


def _mark(like):
    """Host seconds for CPU tensors; for CUDA ones an event on the current stream, never waited for."""
    if not like.is_cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(like.device))
    return event


OPS = ArrayOps(
    flatten=_flatten,
    zeros=lambda numel, like: torch.zeros(numel, dtype=torch.float32, device=like.device),
    empty=lambda numel, like: torch.empty(numel, dtype=torch.float32, device=like.device),
    slice=lambda buf, a, b: buf[a:b],
    empty_bytes=lambda nbytes, like: torch.empty(nbytes, dtype=torch.uint8, device=like.device),
    add_=lambda a, b: a.add_(b),
    scale_=lambda a, s: a.mul_(s),
    numel=lambda t: t.numel(),
    from_bytes=lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8),
    to_bytes=lambda t: t.detach().cpu().numpy().tobytes(),
    to_like=lambda t, like: t if t.device == like.device else t.to(like.device),
    clone=lambda t: t.detach().clone(),
    reusable=True,
    mark=_mark,
)


class TorchFrontend(Frontend):
    """torch's primitives for :class:`hvd_quant.frontend.Frontend`, and the PyTorch paths' own."""
    name, horovod = "torch", "horovod.torch"
    float32 = torch.float32
    # dtypes horovod.torch 0.28.1 can allreduce (bfloat16 raises "Tensor type ... is not supported")
    horovod_floats = (torch.float16, torch.float32, torch.float64)
    _cuda = None                        # the CUDA adapter, made at the first CUDA tensor

    def adapter(self, obj):
        """The codecs' adapter for a torch tensor: host (CPU) or CUDA; other devices raise."""
        if getattr(obj, "is_cuda", False) and self._cuda is not None:
            return self._cuda
        dev = getattr(obj, "device", None)
        if dev is not None and dev.type == "cuda":
            if self._cuda is None:
                self._cuda = TorchCudaAdapter()
            return self._cuda
        if dev is not None and dev.type != "cpu":
            raise UnsupportedInputError(f"torch tensors on {dev.type} are not supported (CPU and CUDA are)")
        return self.host_adapter

    def make_collectives(self, ps):
        import horovod.torch as hvd
        hvd_op = self.hvd_op

        def allgather_async(t, name, sizes=None):      # (Horovod gathers the lengths itself)
            return hvd.allgather_async(t, name=name, process_set=ps)

        def alltoall_async(t, splits, name):
            return hvd.alltoall_async(t, splits=torch.tensor(splits, dtype=torch.int32), name=name,
                                      process_set=ps)

        def allreduce_async(t, name, op=AVERAGE, prescale_factor=1.0, postscale_factor=1.0):
            return hvd.allreduce_async_(t, name=name, op=hvd_op(op), prescale_factor=prescale_factor,
                                        postscale_factor=postscale_factor, process_set=ps)

        def synchronize(handle):
            if type(handle) is GroupWork:
                return handle.wait()
            out = hvd.synchronize(handle)
            return out[0] if isinstance(out, tuple) else out      # alltoall: (received, splits)

        def poll(handle):
            if type(handle) is GroupWork:
                return handle.work is None or handle.work.is_completed()
            return hvd.poll(handle)

        return Collectives(rank=ps.rank(), size=ps.size(), allgather_async=allgather_async,
                           alltoall_async=alltoall_async, allreduce_async=allreduce_async,
                           synchronize=synchronize, process_set=ps, poll=poll,
                           levels=(lambda probe=False: self.node_levels(ps, probe)) if ps.process_set_id == 0 else None)

    def payload_group(self, process_set, device, label, record=None, what=None):
        return PayloadGroup.open(process_set, device, label, record, what)

    @staticmethod
    def wait_for(device):
        """Wait on the host until ``device`` finished its queued work (CUDA; nothing to wait for on CPU)."""
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)

    host_one = staticmethod(lambda: torch.ones(1, dtype=torch.int32))     # scheduler.Presence's 1

    # -- primitives of the stock path -------------------------------------------------------------
    is_floating = staticmethod(lambda dtype: dtype.is_floating_point)
    ones = staticmethod(lambda n, dtype, like: torch.ones(n, dtype=dtype, device=like.device))
    cast = staticmethod(lambda t, dtype: t.to(dtype))
    as_float = staticmethod(lambda t: t.to(torch.float32))
    split = staticmethod(lambda flat, sizes: flat.split(sizes))

    @staticmethod
    def describe(t):
        return TensorInfo(tuple(t.shape), t.dtype, t.is_floating_point() and not t.is_sparse,
                          t.element_size(), t.device)

    def restore(self, flat, info):
        return self.cast_back(flat if flat.shape == info.shape else flat.view(info.shape), info)


# --------------------------------------------------------------------------------------------------
# The payload groups: process groups of hvd_quant's own that carry an optimizer's compressed payloads

# Device type -> torch.distributed backend of an optimizer's payload group; other types use Horovod.
PAYLOAD_GROUP = {"cuda": "nccl"}
STORE_TIMEOUT_S = 120


class PayloadGroup:
    """Two torch.distributed process groups of an optimizer's own that carry its payloads, matched by
    order: ``first`` each bucket's first collective, ``second`` SRA's allgathers (docs/EXCHANGE.md,
    "The reductions"). A route's first step goes through Horovod: a kernel's first (lazy) load may
    wait for a collective spinning on the device."""

    def __init__(self, store, process_set, backend, device):
        self.store = store                  # rank 0 serves it for the group's lifetime
        self.size, self.rank = process_set.size(), process_set.rank()
        self.waiting = collections.deque()  # SRA exchanges in their first phase, in start order

        def group(prefix):
            sub = dist.PrefixStore(prefix, store)
            if backend == "nccl":
                # Horovod's NCCL streams have the device's greatest priority (cuda_operations.cc); at
                # the default priority a payload's kernels would queue behind backward's blocks
                return dist.ProcessGroupNCCL(sub, self.rank, self.size,
                                             dist.ProcessGroupNCCL.Options(is_high_priority_stream=True))
            return dist.ProcessGroupGloo(sub, self.rank, self.size)

        self.first, self.second = group("first"), group("second")
        # NCCL's communicator, made by the first collective, blocks the host until every rank joins:
        # here, not in a gradient hook where another rank may wait in synchronize() for this one
        one = torch.zeros(1, device=device)
        for pg in (self.first, self.second):
            pg._allgather_base(one.new_empty(self.size), one).wait()
        if one.is_cuda:
            torch.cuda.current_stream(device).synchronize()

    @classmethod
    def open(cls, process_set, device, label, record=None, what=None):
        """The payload channel of one optimizer (``label``: its prefix) on ``device``, or None (no
        :data:`PAYLOAD_GROUP` backend, or rank 0's ``HVD_QUANT_PAYLOAD_GROUP=0``). A blocking collective,
        never in a gradient hook. ``record``: the handshake record of ``what``, compared first."""
        backend = PAYLOAD_GROUP.get(device.type)
        if backend is None:
            return None
        if record is not None:
            handshake(FRONTEND.collectives(process_set), OPS, record, what or label,
                      name="hvdq.payload_group.handshake")
        import horovod.torch as hvd
        timeout = datetime.timedelta(seconds=STORE_TIMEOUT_S)
        name, size = f"{label}.payload_group", process_set.size()
        root = min(process_set.ranks) if process_set.ranks else 0   # the set's rank 0, as a global rank
        way_out = ("set HVD_QUANT_STORE_ADDR on rank 0 to an address of its host that every rank "
                   "reaches, or HVD_QUANT_PAYLOAD_GROUP=0 to carry the payloads through Horovod")
        on = os.environ.get("HVD_QUANT_PAYLOAD_GROUP", "1").strip() != "0"
        if size == 1:       # nobody to reach: a store in this process
            return cls(dist.HashStore(), process_set, backend, device) if on else None
        store = where = None
        if process_set.rank() == 0 and on:
            host = _store_host()
            try:
                store = dist.TCPStore(host, 0, size, is_master=True, wait_for_workers=False, timeout=timeout)
                where = (host, store.port)
            except Exception as e:  # noqa: BLE001 -- torch raises several kinds; tell every rank
                where = f"rank 0 could not serve its payload group's store at {host} ({e}); {way_out}"
        where = hvd.broadcast_object(where, root_rank=root, process_set=process_set, name=name)
        if isinstance(where, str):
            raise RuntimeError(f"hvd_quant: {where}")
        if where is not None and store is None:        # not rank 0: reach its store
            try:
                store = dist.TCPStore(*where, size, is_master=False, timeout=timeout)
            except Exception as e:  # noqa: BLE001
                raise RuntimeError(f"hvd_quant: this rank could not reach rank 0's payload group "
                                   f"store at {where[0]}:{where[1]} ({e}); {way_out}") from e
        return None if where is None else cls(store, process_set, backend, device)

    def allgather(self, t, each=None, total=None):
        """Every rank's ``t`` in rank order, as a handle: on ``first`` (equal lengths) or, with ``each``,
        on ``second``, each ``t`` padded to ``each`` bytes and the result's first ``total`` bytes."""
        if each is None:
            out = t.new_empty(t.numel() * self.size)
            return GroupWork(self.first._allgather_base(out, t), out)
        if t.numel() != each:
            # a copy, not a kernel: nothing loads while a collective of these groups may spin
            padded = t.new_empty(each)
            padded[:t.numel()].copy_(t)
            t = padded
        out = t.new_empty(each * self.size)
        return GroupWork(self.second._allgather_base(out, t), out[:total])

    def alltoall(self, t, splits):
        """Rank r receives piece r of every rank's ``t`` (``splits``: the pieces' lengths, the one
        for each rank equal on every rank), concatenated in rank order, as a handle; on ``first``."""
        mine = splits[self.rank]
        out = t.new_empty(mine * self.size)
        return GroupWork(self.first.alltoall_base(out, t, [mine] * self.size, list(splits)), out)


def _store_host():
    """An address of this host that the set's other ranks reach (docs/EXCHANGE.md, "The reductions")."""
    addr = os.environ.get("HVD_QUANT_STORE_ADDR")
    if addr:
        return addr
    peer = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
    if peer:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))        # no packet is sent: this only picks the route
            return s.getsockname()[0]
    return socket.gethostbyname(socket.gethostname())


class GroupWork:
    """A torch.distributed collective in flight (of a payload group, or ``ddp.collectives``'): its
    result ``out``. On CUDA the current stream waits for it, the host does not."""
    __slots__ = ("work", "out")

    def __init__(self, work, out):
        self.work, self.out = work, out

    def wait(self):
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.out


# --------------------------------------------------------------------------------------------------
# The codecs' array adapters


_TORCH_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
                 torch.float64: "float64"}
_FROM_NAME = {v: k for k, v in _TORCH_DTYPES.items()}


def _describe(x):
    if x.layout is not torch.strided:
        raise UnsupportedInputError(f"hvd_quant codecs take dense tensors; got a {x.layout} one (x.to_dense() "
                                    "densifies it)")
    name = _TORCH_DTYPES.get(x.dtype)
    if name is None:
        check_float(str(x.dtype).replace("torch.", ""))
    return tuple(x.shape), name


def _flat(x):
    return x.detach().reshape(-1)


def _raw_values(payload, offset, numel, value_dtype):
    """The ``numel`` raw values (``value_dtype``) at byte ``offset`` of a uint8 ``payload``, a view."""
    dtype = _FROM_NAME[value_dtype]
    return payload[offset:offset + dtype.itemsize * numel].view(dtype)


def _payload(payload):
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
        raise UnsupportedInputError(f"a payload is a 1-D uint8 tensor; got {type(payload).__name__} "
                                    f"{getattr(payload, 'dtype', '')}")
    return payload


def _out(out, cuda):
    device = "cuda" if cuda else "cpu"
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or not out.is_contiguous() \
            or out.device.type != device:
        raise UnsupportedInputError(f"decode_into needs a contiguous float32 {device} tensor; got "
                                    f"{type(out).__name__} {getattr(out, 'dtype', '')} {getattr(out, 'device', '')}")
    return out


class TorchHostAdapter(HostAdapter):
    describe = staticmethod(_describe)

    def input_np(self, x):
        x = _flat(x).contiguous()
        return (x.float() if x.dtype == torch.bfloat16 else x).numpy()

    def input_f32(self, x):
        return _flat(x).to(torch.float32).contiguous().numpy()

    def payload_np(self, payload):
        return _payload(payload).detach().contiguous().numpy()

    def wrap_payload(self, arr, like):
        return torch.from_numpy(arr)

    def out_np(self, out):
        return _out(out, False).detach().view(-1).numpy(), None

    def wrap_result(self, arr_f32, dtype_name, shape, like):
        t = torch.from_numpy(arr_f32)
        return (t if dtype_name == "float32" else t.to(_FROM_NAME[dtype_name])).reshape(shape)


def _with_ptr(t):
    return t, t.data_ptr()


_TYPESTR = {torch.float32: "<f4", torch.uint8: "|u1", torch.int32: "<i4"}
_VIEW_CACHE_MAX = 1024


class TorchCudaAdapter(DeviceAdapter):
    """Raw device pointers and torch's current raw stream for the prepared launches; :meth:`numba`: a
    Numba device-array view for the few launches through Numba's dispatcher (raw codecs, fake mode)."""

    def __init__(self):
        from numba import cuda
        self._cuda = cuda
        self._views = {}
        self._single = None
        self._raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

    describe = staticmethod(_describe)
    device_key = staticmethod(lambda x: ("torch", x.get_device()))
    payload_nbytes = numel = staticmethod(lambda t: t.numel())
    read_header = staticmethod(lambda payload: payload[:HEADER_NBYTES].cpu().numpy())
    status_bad = staticmethod(lambda status: status[0] != 0)
    new_bytes = staticmethod(lambda nbytes, like: _with_ptr(torch.empty(nbytes, dtype=torch.uint8, device=like.device)))
    new_f32 = staticmethod(lambda numel, like: _with_ptr(torch.empty(numel, dtype=torch.float32, device=like.device)))
    new_status = staticmethod(lambda like: _with_ptr(torch.zeros(2, dtype=torch.int32, device=like.device)))

    def stream(self, x):
        if self._raw_stream is not None:
            try:
                return self._raw_stream(x.get_device())
            except Exception:           # pragma: no cover - private torch API changed
                self._raw_stream = None
        return torch.cuda.current_stream(x.device).cuda_stream

    def context(self, x):
        if self._single is None:
            self._single = torch.cuda.device_count() == 1
        if self._single:                # Numba attaches to the device's primary context by itself
            return contextlib.nullcontext()
        return self._cuda.gpus[x.device.index]

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
        return _with_ptr(torch.from_numpy(np.asarray(values, np.uint32).view(np.int32)).to(like.device))

    def input_f32(self, x):
        t = x if x.dtype == torch.float32 and x.is_contiguous() else _flat(x).to(torch.float32).contiguous()
        return _with_ptr(t)

    def bytes_dev(self, payload):
        if not _payload(payload).is_contiguous():
            payload = payload.contiguous()
        ptr = payload.data_ptr()
        if ptr % 4:
            raise PayloadError("a device payload must start on a 4-byte boundary (payload sizes are "
                               "multiples of 4, so slices of concatenated payloads are)")
        return ptr

    def out_dev(self, out):
        return _out(out, True).data_ptr(), None

    def read_status(self, status):
        bits = int(status[1].item())
        if bits:
            status[1].zero_()
        return bits

    def result(self, f32, dtype_name, shape):
        return (f32 if dtype_name == "float32" else f32.to(_FROM_NAME[dtype_name])).reshape(shape)

    def raw_encode_into(self, x, value_dtype, payload):
        """x as ``value_dtype`` after ``payload``'s header (the codec writes it), then zero padding."""
        vals = _raw_values(payload, HEADER_NBYTES, x.numel(), value_dtype)
        vals.copy_(_flat(x))
        payload[HEADER_NBYTES + vals.nbytes:].zero_()
        return payload.data_ptr()

    def raw_residual(self, x, payload, value_dtype, residual):
        vals = _raw_values(payload, HEADER_NBYTES, x.numel(), value_dtype)
        torch.sub(_flat(x).float(), vals.float(), out=residual.view(-1))

    def raw_decode_into(self, payload, offset, numel, value_dtype, out, accumulate, bad):
        """out (+)= values; ``bad`` a 0-d bool device tensor (header check failed) -> NaN."""
        vals = _raw_values(payload, offset, numel, value_dtype)
        out = out.view(-1)
        if accumulate:
            out.add_(vals)
        else:
            out.copy_(vals)
        if bad is not None:
            out.masked_fill_(bad, float("nan"))


FRONTEND = TorchFrontend(OPS, TorchHostAdapter())
collectives, hvd_op, core_op = FRONTEND.collectives, FRONTEND.hvd_op, FRONTEND.core_op
resolve_codec, host_one, wait_for = FRONTEND.resolve_codec, FRONTEND.host_one, FRONTEND.wait_for
