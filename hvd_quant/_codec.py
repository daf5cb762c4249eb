"""The codec base class: argument checks, the payload header, what direct calls keep per thread, and
encode, decode and the binds over a codec's kernels (the codecs themselves: :mod:`hvd_quant.codecs`)."""
import functools
import inspect
import math
import operator
import os
import threading
import weakref

import numpy as np

import numba_kernels
from numba_kernels import wire
from numba_kernels.wire import HEADER_NBYTES as _HDR, PayloadError

from ._arrays import adapter_for, device_statuses, status_for, UnsupportedInputError
from ._noise import fresh_seed, noise_key


# Horovod's ``compress(codec, tensor) -> (tensor, ctx)``, installed by ``hvd_quant._stock`` (built on the codecs)
STOCK_COMPRESS = None


def _fmt(v):
    return str(v).lower() if v is None or isinstance(v, bool) else str(v)      # true, false, none


def _name_arg(name):
    """A tensor name: None or a str (a subclass as its str)."""
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str or None; got {type(name).__name__} {name!r}")
    return name if name is None or type(name) is str else str(name)


def _shape_arg(shape):
    """``decode``'s expected shape: an int or a sequence of ints, as NumPy takes it."""
    try:
        if not hasattr(shape, "__len__"):
            return (operator.index(shape),)
        return tuple(operator.index(d) for d in shape)
    except TypeError:
        raise TypeError(f"shape must be an int or a sequence of ints; got {shape!r}") from None


def _env_rank():
    for var in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        v = os.environ.get(var)
        if v is not None and v.strip().lstrip("-").isdigit():
            return int(v)
    return 0


def _check_int(key, v, lo, hi=None, why=""):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{key} must be an integer; got {v!r}")
    v = int(v)
    if v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise ValueError(f"{key} must be {rng}{why}; got {v}")
    return v


def _check_choice(key, v, choices):
    if v not in choices:
        raise ValueError(f"{key} must be one of {', '.join(repr(c) for c in choices)}; got {v!r}")
    return v


class _ThreadState(threading.local):
    """Direct calls' state: ``calls``, id(codec) -> (weak reference, {name hash: seeded encodes so far}),
    the ``k`` of :func:`noise_key`; ``ops``, prepared ops (they write their buffers on every call)."""

    def __init__(self):
        self.calls, self.ops = {}, {}


_THREAD = _ThreadState()


def _direct_count(codec, nh):
    """Direct encodes ``codec`` (this object) made for name hash ``nh`` on this thread so far."""
    table = _THREAD.calls
    entry = table.get(id(codec))
    if entry is None or entry[0]() is not codec:        # new, or another object under a reused id
        if len(table) >= 1024:
            for key in [key for key, (ref, _) in table.items() if ref() is None]:
                del table[key]
        entry = table[id(codec)] = (weakref.ref(codec), {})
    calls = entry[1]
    k = calls.get(nh, 0)
    calls[nh] = k + 1
    return k


def _per_thread(key, make, *args):
    """This thread's ``make(*args)`` under ``key``, built once; the table is emptied at 4096 entries."""
    table = _THREAD.ops
    f = table.get(key, table)           # (the table itself: not built yet; None is a result)
    if f is table:
        if len(table) >= 4096:
            table.clear()
        f = table[key] = make(*args)
    return f


def _thread_op(codec, kind, device, numel, accumulate=None):
    """This thread's :meth:`Codec._op`."""
    return _per_thread((kind, codec, device, numel, accumulate), codec._op, kind, device, numel, accumulate)


def _handles(arrays, status=(None, None)):
    """What a prepared op's ``bind`` takes: the adapter's converters of a float32 input, a uint8 payload
    and a float32 out, its stream getter and the status word's device array (the last two None on the host)."""
    if arrays.device:
        return arrays.input_f32, arrays.bytes_dev, arrays.out_dev, arrays.stream, status[1]
    return arrays.input_f32, arrays.payload_np, arrays.out_np, None, None


def _nb(arrays, t, dev):
    """A Numba device array of ``t``, whose device handle is ``dev`` (torch's is a raw pointer)."""
    return arrays.numba(t) if type(dev) is int else dev


class Codec:
    """Base class: the payload plumbing of every codec, an immutable value compared and hashed by its
    configuration (runtime state lives with whoever runs it). Subclasses define ``PARAMS`` (spec
    parameter -> parser, in canonical order), ``_fields()``, ``_kernel_table()`` or the encode steps."""

    name = None
    PARAMS = {}
    _method = None
    stochastic = False          # whether encode draws noise (then ``noise_key`` keys it)
    seed = None
    _raw_values = None          # the dtype of a raw payload's values (fp16, none, fake mode); None: codes
    _FIELD_TEXT = {}            # how PayloadError spells a header field: field -> (parameter, {code: value})
    _device_pointers = True     # whether the CUDA ops take device pointers, or Numba arrays (SortQuant, KMeans)

    def _freeze(self, **config):
        self.__dict__.update(config)
        self.__dict__["_hash"] = hash((type(self).__name__, tuple(self._config().items())))

    def __setattr__(self, key, value):
        raise AttributeError(f"{type(self).__name__} is an immutable configuration; build a new codec "
                             f"(e.g. from_spec(...)) instead of setting {key!r}")

    def __delattr__(self, key):
        raise AttributeError(f"{type(self).__name__} is an immutable configuration")

    # -- configuration -------------------------------------------------------------------------------
    def _config(self):
        return {k: getattr(self, k) for k in self.PARAMS}

    def spec(self):
        """Canonical string spec; ``from_spec(c.spec()) == c`` (built once: the codec is immutable)."""
        s = self.__dict__.get("_spec")
        if s is None:
            default = {k: p.default for k, p in inspect.signature(type(self)).parameters.items()}
            items = [f"{k}={_fmt(v)}" for k, v in self._config().items()
                     if v is not None or default.get(k) is not None]    # None spelled out where not the default
            s = self.__dict__["_spec"] = self.name + (":" + ",".join(items) if items else "")
        return s

    def __eq__(self, other):
        return type(self) is type(other) and self._config() == other._config()

    def __hash__(self):
        return self._hash

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self._config().items())
        return f"{type(self).__name__}({args})"

    # -- Horovod's Compressor protocol ---------------------------------------------------------------
    def compress(self, tensor):
        """Horovod's ``compress(tensor) -> (tensor, ctx)``: the stock path's (``hvd_quant._stock``)."""
        return STOCK_COMPRESS(self, tensor)

    def decompress(self, tensor, ctx):
        """Horovod's ``decompress``: ``ctx.stock_decompress(summed)``, else what Horovod reduced."""
        finish = getattr(ctx, "stock_decompress", None)
        return tensor if finish is None else finish(tensor)

    wants_error_feedback = False    # whether the caller should keep an error-feedback residual

    # -- wire (memoised: pure functions of the configuration and the arguments) -----------------------
    def _fields(self):
        """(method, bits, mode, param, bucket_size) as written in the header."""
        raise NotImplementedError

    @functools.lru_cache(maxsize=4096)
    def _layout(self, numel):
        method, bits, mode, param, bs = self._fields()
        return wire.layout(method, numel, bits, bs, mode, param)

    def wire_nbytes(self, numel):
        """Size in bytes of the payload of a tensor of ``numel`` elements (header included)."""
        return self._layout(_check_int("numel", numel, 0)).total

    @functools.lru_cache(maxsize=4096)
    def header_plan(self, shape, dtype_name, name):
        """(name hash, header words, layout) of an input sent under ``name``: :meth:`encode_into`'s."""
        header = wire.Header(*self._fields(), wire.DTYPES[dtype_name], shape, name_hash=wire.name_hash(name))
        words = header.words()              # validates rank and dims before any work
        return header.name_hash, words, self._layout(header.numel)

    @functools.lru_cache(maxsize=4096)
    def expectation(self, numel, name):
        """The ``wire.Expect`` (decoders' ``expect``) of a payload of ``numel`` elements sent under ``name``."""
        return wire.Expect(*self._fields(), int(numel), wire.name_hash(name), name is not None)

    @functools.lru_cache(maxsize=4096)
    def _header(self, header_bytes, nbytes, name):
        """The header of a payload of ``nbytes`` bytes, checked against this configuration and ``name``."""
        h = wire.parse_header(header_bytes, nbytes)
        method, bits, mode, param, bs = self._fields()
        if h.method != method:
            raise PayloadError(f"payload was made by the {h.method_name!r} codec; this codec is {self.spec()!r}")
        for field, got, want in (("bits", h.bits, bits), ("mode", h.mode, mode), ("param", h.param, param),
                                 ("bucket_size", h.bucket_size, bs)):
            if got != want:
                key, values = self._FIELD_TEXT.get(field, (field, {}))
                raise PayloadError(f"payload configuration differs in {key}: payload has "
                                   f"{key}={values.get(got, got)}, this codec ({self.spec()}) has "
                                   f"{key}={values.get(want, want)}")
        if name is not None:
            nh = wire.name_hash(name)
            if h.name_hash != nh:
                what = "carries no name" if h.name_hash == 0 else f"has name hash {h.name_hash:#010x}"
                raise PayloadError(f"name mismatch: payload {what}, expected {name!r} (hash {nh:#010x}): "
                                   "it belongs to another tensor")
        return h

    # -- noise ---------------------------------------------------------------------------------------
    def _direct_key(self, nh, step, rank):
        """The noise key of a direct :meth:`encode` call; ``step`` and ``rank`` are checked always."""
        if step is not None:
            step = _check_int("step", step, 0)
        if rank is not None:
            rank = _check_int("rank", rank, 0)
        if not self.stochastic:
            return 0
        if self.seed is None:
            return fresh_seed()
        k = _direct_count(self, nh) if step is None else step
        return noise_key(self.seed, k, _env_rank() if rank is None else rank, nh)

    # -- public API ----------------------------------------------------------------------------------
    def encode(self, x, name=None, step=None, rank=None):
        """Float ``x`` as a 1-D uint8 payload of its kind and device (docs/CODECS.md, "Noise and seeds")."""
        if name is not None and type(name) is not str:
            name = _name_arg(name)
        arrays = adapter_for(x)
        shape, dtype_name = arrays.describe(x)
        nh, words, lay = self.header_plan(shape, dtype_name, name)
        key = self._direct_key(nh, step, rank)
        if arrays.device:               # the exchange's bound launch, this thread's (the host cost)
            encode = _per_thread(("direct encode", self, arrays, shape, dtype_name, name), self.bind_encode,
                                   arrays, lay, words, x)
            payload = arrays.new_bytes(lay.total, x)[0]
            encode(x, payload, key)
            return payload
        pay = np.empty(lay.total, np.uint8)
        self._encode_host(arrays, x, pay, words, lay, key)
        return arrays.wrap_payload(pay, x)

    def encode_into(self, x, payload, words, lay, key, arrays=None, residual=None):
        """Encode ``x`` (``lay.numel`` elements) into ``payload`` (``lay.total`` bytes, same kind and
        device) with header ``words`` and noise ``key``; ``residual`` (flat float32): also write
        ``x - decode(payload)`` there, bit-identical to decoding and subtracting."""
        arrays = arrays or adapter_for(x)
        if arrays.numel(x) != lay.numel or arrays.payload_nbytes(payload) != lay.total:
            raise PayloadError(f"encode_into: x has {arrays.numel(x)} elements and the payload "
                               f"{arrays.payload_nbytes(payload)} bytes; the layout is for {lay.numel} "
                               f"elements in {lay.total} bytes")
        if arrays.device:
            with arrays.context(x):
                self._encode_dev(arrays, x, payload, words, lay, key, residual)
        else:
            self._encode_host(arrays, x, arrays.payload_np(payload), words, lay, key,
                              None if residual is None else arrays.out_np(residual)[0])
        return payload

    def decode(self, payload, name=None, shape=None, dtype=None):
        """A payload as a tensor of the encoded shape and dtype (docs/CODECS.md, "Errors")."""
        name = _name_arg(name)
        shape = None if shape is None else _shape_arg(shape)
        arrays = adapter_for(payload)
        expect = None
        if arrays.device and shape is not None and dtype is not None:
            dtype_name = _dtype_text(dtype)
            expect = self.expectation(math.prod(shape), name)
        else:
            pay = arrays.read_header(payload) if arrays.device else arrays.payload_np(payload)
            h = self._header(bytes(pay[:_HDR]), arrays.payload_nbytes(payload), name)
            if shape is not None and shape != h.shape:
                raise PayloadError(f"payload holds shape {h.shape}, caller expected {tuple(shape)}")
            if dtype is not None and _dtype_text(dtype) != h.dtype_name:
                raise PayloadError(f"payload holds dtype {h.dtype_name}, caller expected {_dtype_text(dtype)}")
            shape, dtype_name = h.shape, h.dtype_name
        if not arrays.device:
            out = np.empty(h.numel, np.float32)
            self._decode_host(pay, out, False)
            return arrays.wrap_result(out, dtype_name, shape, payload)
        out = arrays.new_f32(math.prod(shape), payload)[0]
        self._decode_into_dev(arrays, payload, out, False, expect,
                              None if expect is None else status_for(self, arrays, payload))
        return arrays.result(out, dtype_name, shape)

    def decode_into(self, payload, out, accumulate=False, name=None, expect=None, arrays=None):
        """``out`` (+)= the decoded values; ``out``: flat float32 of the payload's kind and element count
        (TensorFlow: a ``tf.Variable``); returns ``out`` (docs/CODECS.md, "Errors"). ``expect`` (for
        ``name``) and ``arrays`` (the adapter) spare the per-call preparation."""
        if name is not None and type(name) is not str:
            name = _name_arg(name)
        arrays = arrays or adapter_for(payload)
        if arrays.device:               # the exchange's bound launch, this thread's (the host cost)
            numel = arrays.numel(out)
            nbytes, decode = _per_thread(
                ("direct decode", self, arrays, arrays.device_key(payload), numel, bool(accumulate), name, expect),
                self._direct_decode, arrays, payload, numel, accumulate, name, expect)
            if arrays.payload_nbytes(payload) != nbytes:
                raise PayloadError(f"payload has {arrays.payload_nbytes(payload)} bytes; out has {numel} "
                                   f"elements, which take {nbytes}")
            decode(payload, out)
            return out
        pay = arrays.payload_np(payload)
        h = self._header(pay[:_HDR].tobytes(), pay.size, name)
        if expect is not None and expect.check_name and h.name_hash != expect.name_hash:
            raise PayloadError(f"name mismatch: payload has name hash {h.name_hash:#010x}, expected "
                               f"{expect.name_hash:#010x}: it belongs to another tensor")
        out_np, commit = arrays.out_np(out)
        if out_np.size != h.numel:
            raise PayloadError(f"payload holds {h.numel} elements but out has {out_np.size}")
        self._decode_host(pay, out_np, accumulate)
        if commit is not None:
            commit()
        return out

    def _direct_decode(self, arrays, payload, numel, accumulate, name, expect):
        """(payload bytes, bound decode) of a direct device :meth:`decode_into`."""
        expect = self.expectation(numel, name) if expect is None else expect
        return self.wire_nbytes(numel), self.bind_decode(arrays, numel, accumulate, expect, payload)

    def check_device_errors(self):
        """Raise PayloadError if a device payload decoded since the last call failed its header check."""
        bits = [(key, arrays.read_status(status_t)) for key, arrays, status_t in device_statuses(self)]
        problems = [f"{key}: {wire.describe_error_bits(b)}" for key, b in bits if b]
        if problems:
            raise PayloadError("device payload(s) refused (their decode wrote NaN): " + "; ".join(problems))

    # -- the exchange's hot path: everything resolved once, then called every step --------------------
    def bind_encode(self, arrays, lay, words, like):
        """``f(x, payload, key, residual=None)``: :meth:`encode_into` for inputs of ``lay.numel`` elements
        like ``like`` with header ``words``, resolved now (sizes unchecked); on the framework's stream."""
        launch = self._bound_kernel(arrays, lay.numel, None)
        if launch is None:
            return lambda x, payload, key, residual=None: self.encode_into(
                x, payload, words, lay, key, arrays=arrays, residual=residual)
        return launch.bind(_handles(arrays), words)

    def bind_decode(self, arrays, numel, accumulate, expect, like, status=None):
        """``f(payload, out)``: :meth:`decode_into` of payloads of ``numel`` elements checked against
        ``expect``, resolved now; on a device into ``status``, else the word :meth:`check_device_errors` reads."""
        launch = self._bound_kernel(arrays, numel, bool(accumulate))
        status = self._status(arrays, like, status)
        if launch is None:
            if arrays.device:
                return lambda payload, out: self._decode_into_dev(arrays, payload, out, accumulate, expect,
                                                                  status)
            return lambda payload, out: self.decode_into(payload, out, accumulate=accumulate, expect=expect,
                                                         arrays=arrays)
        return launch.bind(_handles(arrays, status), expect)

    # fused launches, one per exchange phase: None where this codec has no fused kernel (the caller loops)
    def bind_decode_sum(self, arrays, numel, expect, like, status=None):
        """``f(payloads, n, out)``: ``out`` = the sum, in order, of the ``n`` payloads of ``numel``
        elements held back to back in ``payloads``, each checked against ``expect`` (the allgather's)."""
        return self._bind_fused("decode_sum", arrays, numel, like, status, expect)

    def bind_reduce_requantize(self, arrays, lay, words, expect, like, status=None):
        """``f(payloads, n, residual, out_payload, key)``: SRA's middle phase: sum the ``n`` received payloads
        of ``lay.numel`` elements (checked against ``expect``) and ``residual`` if given, encode the sum into
        ``out_payload`` with header ``words`` and noise ``key``, and overwrite ``residual`` with its loss."""
        return self._bind_fused("reduce_requantize", arrays, lay.numel, like, status, words, expect)

    def bind_decode_chunks(self, arrays, numel, chunk, name_hashes, expect, like, status=None):
        """``f(gathered, out)``: SRA's last phase: chunk j of ``out`` (elements [j*chunk, (j+1)*chunk))
        from the j-th payload of ``gathered``, checked against ``expect`` and ``name_hashes[j]`` (on the device)."""
        if not getattr(self, "bucket_size", None):
            return None
        return self._bind_fused("decode_chunks", arrays, numel, like, status, name_hashes, expect, chunk=chunk)

    def _bind_fused(self, kind, arrays, numel, like, status, *args, chunk=None):
        launch = self._op(kind, arrays.device, numel, chunk=chunk) if numel and arrays.views else None
        return None if launch is None else launch.bind(_handles(arrays, self._status(arrays, like, status)), *args)

    def _status(self, arrays, like, status):
        """A device bind's status word: the caller's, else this codec's on ``like``'s device."""
        return (status or status_for(self, arrays, like)) if arrays.device else (None, None)

    # -- kernels -------------------------------------------------------------------------------------
    def _kernel_table(self):
        """Kind ("encode", "decode", ...) -> :func:`numba_kernels.prepare`'s parameters; none: no kernel."""
        return {}

    def _op(self, kind, device, numel, accumulate=None, chunk=None):
        """A new prepared op ``kind`` for ``numel`` elements, owned by the caller; None: no such kernel."""
        params = self._kernel_table().get(kind)
        if params is None:
            return None
        extra = {k: v for k, v in (("accumulate", accumulate), ("chunk", chunk)) if v is not None}
        return numba_kernels.prepare(self.name, kind, device, numel, **params, **extra)

    def _bound_kernel(self, arrays, numel, accumulate):
        """The prepared op behind :meth:`bind_encode` (``accumulate`` None) or :meth:`bind_decode`; None
        where the generic path serves (no elements or kernel, immutable tensors, Numba-array ops)."""
        if not numel or not arrays.views or (arrays.device and not self._device_pointers):
            return None
        return self._op("encode" if accumulate is None else "decode", arrays.device, numel, accumulate)

    # -- the steps over the kernel table (raw codecs and QSGD's fake mode override the encodes) -------
    def _encode_host(self, arrays, x, pay, words, lay, key, residual=None):
        """Host input ``x`` into NumPy payload ``pay`` (and ``x - decode(pay)`` into ``residual``)."""
        _thread_op(self, "encode", False, lay.numel)(arrays.input_f32(x), pay, words, key, None, residual)

    def _encode_dev(self, arrays, x, payload, words, lay, key, residual=None):
        """Device input ``x`` into ``payload`` (and the residual into ``residual``), on ``x``'s stream."""
        xt, xdev = arrays.input_f32(x)
        pdev = arrays.bytes_dev(payload)
        res = None if residual is None else arrays.out_dev(residual)[0]
        if not self._device_pointers:
            xdev, pdev = _nb(arrays, xt, xdev), _nb(arrays, payload, pdev)
            res = None if residual is None else _nb(arrays, residual, res)
        _thread_op(self, "encode", True, lay.numel)(xdev, pdev, words, key, arrays.stream(x), res)

    def _decode_host(self, pay, out, accumulate):
        """out (+)= the values of host payload ``pay`` (validated), both NumPy arrays."""
        if not self._raw_values:
            return _thread_op(self, "decode", False, out.size, bool(accumulate))(pay, out)
        w = 2 if self._raw_values == "float16" else 4
        raw = pay[_HDR:_HDR + w * out.size]
        if w == 2 and raw.ctypes.data % 2 == 0:
            numba_kernels.cpu.half_decode_cpu(raw.view(np.uint16), out, accumulate)    # NumPy's values, faster
            return
        if raw.ctypes.data % w:
            raw = raw.copy()
        vals = raw.view(self._raw_values)
        if accumulate:
            np.add(out, vals, out=out, casting="unsafe")
        else:
            out[...] = vals

    def _decode_into_dev(self, arrays, payload, out, accumulate, expect, status):
        """out (+)= the values of device ``payload``, its header checked against ``expect`` into
        ``status`` (``expect`` None: checked on the host already)."""
        numel, nbytes = arrays.numel(out), arrays.payload_nbytes(payload)
        if nbytes != self.wire_nbytes(numel):
            raise PayloadError(f"payload has {nbytes} bytes; out has {numel} elements, which take "
                               f"{self.wire_nbytes(numel)}")
        with arrays.context(payload):
            stream = arrays.stream(payload)
            status_t, status_dev = status or (None, None)
            if self._raw_values:
                bad = None
                if expect is not None:
                    numba_kernels.cuda.check_header_cuda(arrays.numba(payload), arrays.numba(status_t), expect,
                                                         stream)
                    bad = arrays.status_bad(status_t)
                arrays.raw_decode_into(payload, _HDR, numel, self._raw_values, out, accumulate, bad)
                return out
            pdev = arrays.bytes_dev(payload)
            out_dev, commit = arrays.out_dev(out)
            if not self._device_pointers:
                pdev, out_dev = _nb(arrays, payload, pdev), _nb(arrays, out, out_dev)
                status_dev = None if status_t is None else _nb(arrays, status_t, status_dev)
            _thread_op(self, "decode", True, numel, bool(accumulate and commit is None))(
                pdev, out_dev, stream, status_dev, expect)
            if commit is not None:
                commit(accumulate)
        return out


def _dtype_text(dtype):
    """Normalise a dtype given as text, NumPy, torch or TF dtype to 'float32' | 'float16' | ..."""
    if isinstance(dtype, str):
        name = dtype
    elif type(dtype).__module__.split(".")[0] in ("torch", "tensorflow"):
        name = getattr(dtype, "name", None) or str(dtype)
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = str(dtype)
    name = name.replace("torch.", "")
    name = {"half": "float16", "float": "float32", "double": "float64"}.get(name, name)
    if name not in wire.DTYPES:
        raise UnsupportedInputError(f"unsupported dtype {dtype!r}")
    return name
