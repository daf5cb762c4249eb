"""The PyTorch frontend in one module: what the core needs of torch, resolved once per tensor type
(``hvd_quant._arrays.adapter_for``, ``hvd_quant._stock``):

* the codecs' array adapters (:func:`adapter`): CPU tensors through ``Tensor.numpy()`` (zero-copy);
  CUDA tensors as raw device pointers and torch's current raw stream handle, which the prepared
  kernel launches take (a Numba device-array view only for the few dispatcher launches); outputs from
  torch's caching allocator; float16 / bfloat16 / float64 inputs converted to float32 by torch first;
* the exchange's :class:`~hvd_quant.exchange.ArrayOps` table (:data:`OPS`) and
  :class:`~hvd_quant.exchange.Collectives` tables over ``horovod.torch`` (:func:`collectives`,
  imported only when called);
* the stock path's adapter (:func:`stock_adapter`, :func:`stock_backend`).

Everything runs on the caller's device and on ``torch.cuda.current_stream()``; nothing reads a device
value on the host except the one-off configuration handshake (``to_bytes``) and
``Codec.check_device_errors``.
"""
import collections
import contextlib
import datetime
import os
import socket
import time

import numpy as np
import torch
from torch._utils import _flatten_dense_tensors

from .._arrays import DeviceAdapter, HostAdapter, UnsupportedInputError, check_float
from ..exchange import AVERAGE, ArrayOps, Collectives, SUM, collectives_for, handshake

__all__ = ["OPS", "collectives", "hvd_op", "core_op", "adapter", "stock_adapter", "stock_backend",
           "PayloadGroup", "PAYLOAD_GROUP", "payload_group"]


def _flatten(tensors):
    """A new float32 buffer holding ``tensors`` end to end (never a view of one: the exchange writes
    into it). torch's ``_flatten_dense_tensors`` makes the views and the cat in one C++ call (ResNet-50's
    107 biases and norms: 73 us on the CPU VM against 383 us for a detach, reshape and cast per tensor
    in Python); it returns a lone tensor's own view, so one tensor is copied instead. Mixed dtypes
    promote (to float32 at least, or float64) before the cast, so each element rounds as it would
    alone."""
    if len(tensors) == 1:
        return tensors[0].detach().reshape(-1).to(torch.float32, copy=True)
    flat = _flatten_dense_tensors(tensors).detach()
    return flat if flat.dtype == torch.float32 else flat.to(torch.float32)


def _zeros(numel, like):
    return torch.zeros(numel, dtype=torch.float32, device=like.device)


def _empty(numel, like):
    return torch.empty(numel, dtype=torch.float32, device=like.device)


def _to_like(t, like):
    return t if t.device == like.device else t.to(like.device)


def _mark(like):
    """Host seconds for CPU tensors; for CUDA tensors an event recorded on the current stream of
    ``like``'s device (where the payload was written and the result is read), never waited for."""
    if not like.is_cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(like.device))
    return event


OPS = ArrayOps(
    flatten=_flatten,
    zeros=_zeros,
    empty=_empty,
    slice=lambda buf, a, b: buf[a:b],
    empty_bytes=lambda nbytes, like: torch.empty(nbytes, dtype=torch.uint8, device=like.device),
    add_=lambda a, b: a.add_(b),
    scale_=lambda a, s: a.mul_(s),
    numel=lambda t: t.numel(),
    from_bytes=lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8),
    to_bytes=lambda t: t.detach().cpu().numpy().tobytes(),
    to_like=_to_like,
    clone=lambda t: t.detach().clone(),
    reusable=True,
    mark=_mark,
)


def hvd_op(op):
    """Core op name -> horovod.torch op constant."""
    import horovod.torch as hvd
    return {AVERAGE: hvd.Average, SUM: hvd.Sum}[op]


def core_op(op):
    """horovod.torch op constant (or a core op name) -> core op name; Adasum raises."""
    import horovod.torch as hvd
    from ..plan import core_op as plan_core_op
    return plan_core_op(op, hvd.Average, hvd.Sum, hvd.Adasum)


def _alltoall_result(handle):
    import horovod.torch as hvd
    out = hvd.synchronize(handle)
    return out[0] if isinstance(out, tuple) else out


# Device type -> torch.distributed backend of the optimizer's payload group (payload_group); a
# device type not listed gathers through Horovod.
PAYLOAD_GROUP = {"cuda": "nccl"}
STORE_TIMEOUT_S = 120


class PayloadGroup:
    """hvd_quant's own torch.distributed process groups among a Horovod process set's ranks, for one
    optimizer's compressed payloads (:func:`payload_group`): the channel an
    :class:`~hvd_quant.exchange.Exchange` takes instead of Horovod's alltoall and allgather.

    Why: Horovod 0.28.1 allocates an allgather's output on its background thread and orders its GPU
    stream after an event it records there, on the device's default stream, which is the stream
    training runs on (``TorchOpContext::AllocateOutput``); the host runs far ahead of the GPU, so each
    allgather starts only when backward reaches the kernels the host had queued by the time Horovod
    ran it, not when its bucket is encoded (docs/RESULTS.md, "Two GPUs, fourth session"). And a
    Horovod collective that depends on another waits for Horovod's next cycle (1 ms by default),
    which SRA's second phase did at every bucket. A collective on an output allocated here, on the
    caller's stream, is ordered after the bucket's encode and nothing else, and its result is waited
    for by the stream, not the host. Made collectively (a TCP store on the set's rank 0, whose
    address, :func:`_store_host`, travels by Horovod broadcast). Two groups, because their
    collectives match by order: ``first`` carries each bucket's first collective (the alltoall of
    SRA, the allgather of the allgather reduction), which the caller starts in plan order on every
    rank; ``second`` carries SRA's allgathers of the reduced chunks, which the exchange starts in the
    order of the alltoalls (:meth:`~hvd_quant.exchange.Exchange.advance`), whenever each rank gets
    to them.

    A route's first step in a world goes through Horovod's collectives, not the groups (the
    frontends' ``_channel_for`` / ``payload_channel``): with CUDA's lazy module loading (the default)
    a kernel's first launch may wait for every kernel running on the device, and a collective of
    these groups, started as soon as its bucket is encoded, spins until the peers start theirs.
    Two groups and Horovod's communicator start their collectives in orders that differ from rank to
    rank (SRA's second phase starts when its alltoall is seen complete), so two ranks each loading a
    kernel, each with a collective spinning for the other, wait forever: ResNet-50 with SRA hung in
    its first step on 2 and 4 GPUs, and ran with ``CUDA_MODULE_LOADING=EAGER`` (docs/RESULTS.md,
    "ResNet-50 with SRA hung"). Horovod's collectives start only when every rank has asked, in one
    order; after a route's first step its kernels and the model's are loaded.
    """

    def __init__(self, store, process_set, backend, device):
        import torch.distributed as dist
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
        # The first collective creates NCCL's communicator: a host call that blocks until every rank
        # joins. Here every rank is at the same point; in a gradient hook a rank would block there
        # while another waits in synchronize() for something this rank submits later.
        one = torch.zeros(1, device=device)
        for pg in (self.first, self.second):
            pg._allgather_base(one.new_empty(self.size), one).wait()
        if one.is_cuda:
            torch.cuda.current_stream(device).synchronize()

    @classmethod
    def make(cls, process_set, backend, label, device):
        """The group, made collectively; None on every rank where rank 0's ``HVD_QUANT_PAYLOAD_GROUP``
        is ``0`` (rank 0 decides, so the ranks cannot disagree). A store that cannot be made or
        reached raises on every rank, naming both variables."""
        import horovod.torch as hvd
        import torch.distributed as dist
        timeout = datetime.timedelta(seconds=STORE_TIMEOUT_S)
        name, size = f"{label}.payload_group", process_set.size()
        root = min(process_set.ranks) if process_set.ranks else 0   # the set's rank 0, as a global rank
        way_out = ("set HVD_QUANT_STORE_ADDR on rank 0 to an address of its host that every rank "
                   "reaches, or HVD_QUANT_PAYLOAD_GROUP=0 to carry the payloads through Horovod")
        on = os.environ.get("HVD_QUANT_PAYLOAD_GROUP", "1").strip() != "0"
        if size == 1:       # nobody to reach: a store in this process
            return cls(dist.HashStore(), process_set, backend, device) if on else None
        if process_set.rank() == 0:
            store = where = None
            if on:
                host = _store_host()
                try:
                    store = dist.TCPStore(host, 0, size, is_master=True, wait_for_workers=False,
                                          timeout=timeout)
                    where = (host, store.port)
                except Exception as e:  # noqa: BLE001 -- torch raises several kinds; tell every rank
                    where = f"rank 0 could not serve its payload group's store at {host} ({e}); {way_out}"
            hvd.broadcast_object(where, root_rank=root, process_set=process_set, name=name)
        else:
            where = hvd.broadcast_object(None, root_rank=root, process_set=process_set, name=name)
            if isinstance(where, tuple):
                try:
                    store = dist.TCPStore(*where, size, is_master=False, timeout=timeout)
                except Exception as e:  # noqa: BLE001
                    raise RuntimeError(f"hvd_quant: this rank could not reach rank 0's payload group "
                                       f"store at {where[0]}:{where[1]} ({e}); {way_out}") from e
        if isinstance(where, str):
            raise RuntimeError(f"hvd_quant: {where}")
        return None if where is None else cls(store, process_set, backend, device)

    def allgather(self, t, each=None, total=None):
        """The concatenation of every rank's ``t`` in rank order, as a handle, on ``first``: the
        allgather reduction's payloads, of equal lengths. With ``each`` (bytes), on ``second``: SRA's
        reduced chunks, whose lengths differ (every chunk but the last nonempty one is ``each``
        long): each rank sends its chunk padded to ``each`` and the result is the first ``total``
        bytes, the chunks back to back (the padding falls after the last nonempty chunk)."""
        if each is None:
            out = t.new_empty(t.numel() * self.size)
            return _GroupWork(self.first._allgather_base(out, t), out)
        if t.numel() != each:
            # the padding's bytes are never read (a copy, not a kernel: nothing loads while a
            # collective of these groups may spin, see the class doc)
            padded = t.new_empty(each)
            padded[:t.numel()].copy_(t)
            t = padded
        out = t.new_empty(each * self.size)
        return _GroupWork(self.second._allgather_base(out, t), out[:total])

    def alltoall(self, t, splits):
        """Rank r receives piece r of every rank's ``t`` (``splits``: the pieces' lengths, the one
        for each rank equal on every rank), concatenated in rank order, as a handle; on ``first``."""
        mine = splits[self.rank]
        out = t.new_empty(mine * self.size)
        return _GroupWork(self.first.alltoall_base(out, t, [mine] * self.size, list(splits)), out)


def _store_host():
    """An address of this host that the set's other ranks reach: ``HVD_QUANT_STORE_ADDR`` where set;
    else, under a Gloo launch, this host's address on the route to Horovod's rendezvous server (which
    every rank reaches); else the address of the host name."""
    addr = os.environ.get("HVD_QUANT_STORE_ADDR")
    if addr:
        return addr
    peer = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
    if peer:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))        # no packet is sent: this only picks the route
            return s.getsockname()[0]
    return socket.gethostbyname(socket.gethostname())


class _GroupWork:
    __slots__ = ("work", "out")

    def __init__(self, work, out):
        self.work, self.out = work, out

    def wait(self):
        """The result; on CUDA the current stream waits for the collective, the host does not."""
        self.work.wait()
        return self.out


def payload_group(process_set, device, label, record=None, what=None):
    """The channel of an :class:`~hvd_quant.exchange.Exchange` for one optimizer's payloads on
    ``device`` (``label``: the optimizer's collective prefix): a :class:`PayloadGroup` of its own,
    made now, its NCCL communicators included. A collective (Horovod broadcast, the store, the
    groups' first allgathers): call it where every rank comes to the same point with nothing of its
    step left waiting on this rank (the optimizer's ``_connect``, beside its handshake; the stock
    path's first result of a taken-over step, after launching its complete buckets); made inside a
    gradient hook, it could wait for a rank that waits for this rank's next Horovod op. None where
    :data:`PAYLOAD_GROUP` has no backend for the device type or rank 0 turned the group off. At
    world size 1 the exchange runs only where forced (``HOROVOD_ELASTIC=1``, the benchmarks' way to
    time it), and there it runs on the group as it does at size N. ``record`` (the handshake record
    of ``what``, where no handshake has compared the ranks yet): compared first, under a name every
    rank shares, so that ranks configured differently raise
    :class:`~hvd_quant.exchange.ConfigMismatchError` instead of waiting for each other under
    different labels."""
    backend = PAYLOAD_GROUP.get(device.type)
    if backend is None:
        return None
    if record is not None:
        handshake(collectives(process_set), OPS, record, what or label,
                  name="hvdq.payload_group.handshake")
    return PayloadGroup.make(process_set, backend, label, device)


_CACHE = {}


def collectives(process_set=None):
    """The Collectives table for ``process_set`` (default: the global one)."""
    import horovod.torch as hvd
    return collectives_for(_CACHE, hvd.global_process_set if process_set is None else process_set,
                           _make_collectives)


def _make_collectives(ps):
    import horovod.torch as hvd

    def allgather_async(t, name):
        return hvd.allgather_async(t, name=name, process_set=ps)

    def alltoall_async(t, splits, name):
        return hvd.alltoall_async(t, splits=torch.tensor(splits, dtype=torch.int32), name=name,
                                  process_set=ps)

    def allreduce_async(t, name, op=AVERAGE, prescale_factor=1.0, postscale_factor=1.0):
        return hvd.allreduce_async_(t, name=name, op=hvd_op(op), prescale_factor=prescale_factor,
                                    postscale_factor=postscale_factor, process_set=ps)

    def synchronize(handle):
        return handle.wait() if type(handle) is _GroupWork else _alltoall_result(handle)

    def poll(handle):
        return handle.work.is_completed() if type(handle) is _GroupWork else hvd.poll(handle)

    return Collectives(rank=ps.rank(), size=ps.size(), allgather_async=allgather_async,
                       alltoall_async=alltoall_async, allreduce_async=allreduce_async,
                       synchronize=synchronize, process_set=ps, poll=poll)


def wait_for(device):
    """Wait on the host until ``device`` finished its queued work (CUDA; nothing to wait for on CPU)."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def host_one():
    """A host int32 tensor holding 1 (:class:`hvd_quant.plan.Presence`)."""
    return torch.ones(1, dtype=torch.int32)


def stock_backend(process_set=None):
    """(Collectives, ArrayOps) for hvd_quant._stock's dispatch on tensor type."""
    return collectives(process_set), OPS


# Dtypes horovod.torch 0.28.1 can allreduce (bfloat16 raises "Tensor type ... is not supported").
HOROVOD_FLOAT_DTYPES = (torch.float16, torch.float32, torch.float64)


def sendable_dtype(dtype):
    """``dtype`` if Horovod can allreduce it, else float32 (hvd_quant sums those in float32)."""
    return dtype if dtype in HOROVOD_FLOAT_DTYPES or not dtype.is_floating_point else torch.float32


class _Info:
    __slots__ = ("numel", "shape", "dtype", "is_float", "itemsize")

    def __init__(self, t):
        self.numel = t.numel()
        self.shape = tuple(t.shape)
        self.dtype = t.dtype
        self.is_float = t.is_floating_point() and not t.is_sparse
        self.itemsize = t.element_size()


class _StockAdapter:
    """What hvd_quant._stock needs beyond the two tables."""

    @staticmethod
    def describe(t):
        return _Info(t)

    @staticmethod
    def placeholder(t, n=1):
        # 1.0 in the gradient's dtype (exact in fp16) so that Horovod's grouped allreduce, which wants
        # one dtype per group, sees the same dtypes as without hvd_quant; float32 for dtypes Horovod
        # cannot reduce (bfloat16).
        return torch.ones(n, dtype=sendable_dtype(t.dtype), device=t.device)

    @staticmethod
    def sendable(t):
        """``t`` itself, or a float32 copy when Horovod cannot reduce its dtype (bfloat16)."""
        return t if sendable_dtype(t.dtype) == t.dtype else t.to(torch.float32)

    @staticmethod
    def cast_back(t, info):
        return t if t.dtype == info.dtype else t.to(info.dtype)

    @staticmethod
    def as_float(t):
        return t.to(torch.float32)

    @staticmethod
    def split(flat, sizes):
        return flat.split(sizes)

    @staticmethod
    def restore(flat, info):
        out = flat if flat.shape == info.shape else flat.view(info.shape)   # (a view: about 2 us)
        return out if out.dtype == info.dtype else out.to(info.dtype)


_ADAPTER = _StockAdapter()


def stock_adapter():
    return _ADAPTER


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
        return ("torch", x.get_device())

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

    def bytes_dev(self, payload):
        if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
            raise UnsupportedInputError(f"a payload is a 1-D uint8 tensor; got {type(payload).__name__} "
                                        f"{getattr(payload, 'dtype', '')}")
        if not payload.is_contiguous():
            payload = payload.contiguous()
        ptr = payload.data_ptr()
        if ptr % 4:
            from numba_kernels.wire import PayloadError
            raise PayloadError("a device payload must start on a 4-byte boundary (payload sizes are "
                               "multiples of 4, so slices of concatenated payloads are)")
        return ptr

    def payload_nbytes(self, payload):
        return payload.numel()

    def numel(self, t):
        return t.numel()

    def out_dev(self, out):
        if not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or not out.is_contiguous() \
                or not out.is_cuda:
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
    if getattr(obj, "is_cuda", False) and _CUDA is not None:
        return _CUDA
    dev = getattr(obj, "device", None)
    if dev is not None and dev.type == "cuda":
        if _CUDA is None:
            _CUDA = TorchCudaAdapter()
        return _CUDA
    if dev is not None and dev.type != "cpu":
        raise UnsupportedInputError(f"torch tensors on {dev.type} are not supported (CPU and CUDA are)")
    return _HOST
