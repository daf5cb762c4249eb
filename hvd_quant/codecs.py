"""Gradient codecs: bucketed QSGD, 1-bit SGD, fp16 and no compression, on one self-describing wire format.

Every codec turns a float tensor into a 1-D uint8 *payload* of the same kind (NumPy array, torch
tensor on the same device, TensorFlow tensor) and back::

    c = hvd_quant.QSGD(bits=4, bucket_size=512)
    payload = c.encode(grad, name="layer1.weight")     # 1-D uint8, c.wire_nbytes(grad.numel()) bytes
    g = c.decode(payload, name="layer1.weight")        # grad's shape and dtype (quantized values)
    c.decode_into(payload, acc, accumulate=True)       # acc (flat float32) += decoded values

A payload is a 64-byte header (format version, method, bits, mode, param (norm or split_bits),
bucket size, numel, dtype, shape, name hash, checksums), the bit-packed codes and the float32 per-bucket scales
(``numba_kernels/wire.py``, ``docs/CODECS.md``). Any instance of an equal configuration decodes it
(that is what a receiving rank does); a payload of another configuration, a truncated or corrupt one,
or (when ``decode`` is given a ``name``) another tensor's, raises :class:`PayloadError` saying what is
wrong.

Codecs are picked from the :class:`Compression` namespace (``Compression.qsgd(bits=4)``) or from a
string spec through the registry (``from_spec("qsgd:bits=4,bucket_size=512")``);
``from_spec(c.spec()) == c`` and codecs compare equal by configuration.

Host arrays (NumPy, torch CPU, TensorFlow CPU) run the Numba CPU kernels; CUDA tensors run the Numba
CUDA kernels on the framework's current stream without synchronising with the host (see
:meth:`Codec.decode_into` for how errors in device payloads surface).
"""
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
from numba_kernels._memo import memo
from numba_kernels.wire import PayloadError

from ._arrays import UnsupportedInputError, adapter_for, device_statuses, status_for
from ._noise import fresh_seed, noise_key

__all__ = ["Codec", "QSGD", "OneBit", "SortQuant", "KMeans", "FP16", "NoCompression", "Compression", "REGISTRY",
           "register", "from_spec", "resolve_codec", "PayloadError", "UnsupportedInputError"]

REGISTRY = {}


def register(name, *aliases):
    """Class decorator: make a codec available to :func:`from_spec` under ``name`` (and ``aliases``).
    Names are matched without regard to case, as :func:`from_spec` reads them; a name holding
    ``:``, ``,``, ``=`` or white space could not be read back from a spec and is refused."""
    for key in (name,) + aliases:
        if not isinstance(key, str) or not key or any(c in key for c in ":,=") or key != "".join(key.split()):
            raise ValueError(f"a codec name is a non-empty str without ':', ',', '=' or white space; got {key!r}")

    def deco(cls):
        cls.name = name
        for key in (k.lower() for k in (name,) + aliases):
            if key in REGISTRY:
                raise ValueError(f"codec name {key!r} is already registered to {REGISTRY[key].__name__}")
            REGISTRY[key] = cls
        return cls
    return deco


# ---- spec value parsers: each raises ValueError naming the parameter and the value -----------------

def _p_int(key, text):
    try:
        return int(text, 10) if text.lstrip("+-").isdigit() else int(text, 0)     # "08", "0x200"
    except ValueError:
        raise ValueError(f"{key}={text!r} is not an integer") from None


def _p_opt_int(key, text):
    return None if text.lower() == "none" else _p_int(key, text)


def _p_bool(key, text):
    t = text.lower()
    if t in ("true", "1", "yes", "on"):
        return True
    if t in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"{key}={text!r} is not a boolean (true/false)")


def _p_str(key, text):
    return text.lower()         # the modes and norms: as the codec names, without regard to case


def _fmt(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    return "none" if v is None else str(v)


def from_spec(spec):
    """Build a codec from a string spec: ``"name"`` or ``"name:key=value,key=value"``.

    Examples: ``"none"``, ``"fp16"``, ``"qsgd:bits=4,bucket_size=512,mode=deterministic"``,
    ``"onebit:bucket_size=64,scale=mean_abs"``. A codec instance is returned as it is. Unknown names,
    unknown keys, malformed items and bad values raise ``ValueError`` naming the bad part."""
    if isinstance(spec, Codec):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"a codec spec is a string such as 'qsgd:bits=4'; got {type(spec).__name__}")
    name, _, rest = spec.strip().partition(":")
    name = name.strip().lower()
    cls = REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown codec {name!r} in spec {spec!r}; known codecs: {', '.join(sorted(REGISTRY))}")
    kwargs = {}
    for item in (rest.split(",") if rest.strip() else []):
        key, eq, text = item.partition("=")
        key, text = key.strip(), text.strip()
        if not eq or not key:
            raise ValueError(f"bad item {item!r} in codec spec {spec!r}: expected key=value")
        parser = cls.PARAMS.get(key)
        if parser is None:
            known = ", ".join(cls.PARAMS) or "none"
            raise ValueError(f"unknown parameter {key!r} for codec {name!r} in spec {spec!r}; "
                             f"known parameters: {known}")
        if key in kwargs:
            raise ValueError(f"parameter {key!r} given twice in codec spec {spec!r}")
        try:
            kwargs[key] = parser(key, text)
        except ValueError as e:
            raise ValueError(f"bad value in codec spec {spec!r}: {e}") from None
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ValueError(f"bad value in codec spec {spec!r}: {e}") from None


def _name_arg(name):
    """A tensor name given to encode/decode: a str (a subclass as its str)."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str or None; got {type(name).__name__} {name!r}")
    return str(name)


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
    """What direct :meth:`Codec.encode` / :meth:`Codec.decode_into` calls keep between calls, one per
    thread, so that the codec stays an immutable value and threads never share it:

    * ``calls``: id(codec) -> (weak reference to the codec, {name hash: seeded encodes so far}): the
      ``k`` of :func:`noise_key` counts one codec object's encodes of a name on this thread;
    * ``launches``: prepared kernel launches; each writes its parameter buffer (and, on a device,
      its scratch) on every call, so each thread prepares its own."""

    def __init__(self):
        self.calls = {}
        self.launches = {}


_THREAD = _ThreadState()


def _direct_count(codec, nh):
    """How many direct encodes ``codec`` (this object) made for name hash ``nh`` on this thread
    before this one."""
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


def _thread_launch(key, make, *args):
    """``make(*args)``, built once per ``key`` on this thread (:class:`_ThreadState`)."""
    return memo(_THREAD.launches, key, make, *args)


@functools.lru_cache(maxsize=4096)
def _prepared(codec, shape, dtype_name, name):
    """(name hash, header words, layout) of an input: a pure function of its arguments, memoised."""
    method, bits, mode, param, bs = codec._fields()
    header = wire.Header(method, bits, mode, param, bs, wire.DTYPES[dtype_name], shape,
                         name_hash=wire.name_hash(name))
    words = header.words()              # validates rank and dims before any work
    return header.name_hash, words, codec._layout(header.numel)


@functools.lru_cache(maxsize=4096)
def _layout_of(codec, numel):
    """The payload layout of ``numel`` elements (``wire.layout``; memoised, layouts are never modified)."""
    method, bits, mode, param, bs = codec._fields()
    return wire.layout(method, numel, bits, bs, mode, param)


@functools.lru_cache(maxsize=4096)
def _validated(codec, header_bytes, nbytes, name):
    """The header of a payload of ``nbytes`` bytes starting with ``header_bytes``, checked against
    ``codec`` and ``name`` (PayloadError otherwise). Pure, so memoised: an exchange receives the same
    headers every step."""
    h = wire.parse_header(header_bytes, nbytes)
    codec._check_header(h, name)
    return h


@functools.lru_cache(maxsize=4096)
def _expectation(codec, numel, name):
    """What a receiver expects of a payload header (``wire.Expect``), for the on-device check."""
    method, bits, mode, param, bs = codec._fields()
    return wire.Expect(method, bits, mode, param, bs, int(numel), wire.name_hash(name), name is not None)


class Codec:
    """Base class: the payload plumbing shared by every codec (see the module docstring).

    A codec is an immutable value: its configuration is set once by ``__init__``, it compares and
    hashes by that configuration, and it holds no runtime state, so one instance can be shared by
    any number of optimizers, threads and ranks (``Compression.fp16`` is a global). What a run needs
    (noise counters, prepared launches, device status words, buffers) lives with whoever runs it:
    the exchange's per-bucket plans, or for direct calls the calling thread (:class:`_ThreadState`).

    Subclasses define ``PARAMS`` (spec parameter -> parser, in canonical order), ``_config()`` (the
    values of those parameters), ``_fields()`` (the header's method/bits/mode/param/bucket_size) and
    the host/device encode and decode steps."""

    name = None
    PARAMS = {}
    _method = None
    stochastic = False          # whether encode draws noise (then ``noise_key`` keys it)
    seed = None

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
        return {}

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

    @property
    def wants_error_feedback(self):
        """Whether the caller should keep an error-feedback residual for this codec (biased codecs)."""
        return False

    # -- wire ----------------------------------------------------------------------------------------
    def _fields(self):
        """(method, bits, mode, param, bucket_size) as written in the header."""
        raise NotImplementedError

    def _layout(self, numel):
        return _layout_of(self, numel)

    def wire_nbytes(self, numel):
        """Size in bytes of the payload of a tensor of ``numel`` elements (header included)."""
        return self._layout(_check_int("numel", numel, 0)).total

    def header_plan(self, shape, dtype_name, name):
        """(name hash, header words, layout) of an input of ``shape`` and dtype ``dtype_name`` sent
        under ``name``: what :meth:`encode_into` takes, built once per input and memoised."""
        return _prepared(self, shape, dtype_name, name)

    def expectation(self, numel, name):
        """What a receiver expects of the header of a payload of ``numel`` elements sent under
        ``name`` (``wire.Expect``, the decoders' ``expect``; memoised)."""
        return _expectation(self, numel, name)

    def _check_header(self, h, name):
        """Raise PayloadError if header ``h`` is not of this configuration (or not ``name``'s)."""
        method, bits, mode, param, bs = self._fields()
        if h.method != method:
            raise PayloadError(f"payload was made by the {h.method_name!r} codec; this codec is {self.spec()!r}")
        for field, got, want in (("bits", h.bits, bits), ("mode", h.mode, mode), ("param", h.param, param),
                                 ("bucket_size", h.bucket_size, bs)):
            if got != want:
                have, need = self._field_text(field, got), self._field_text(field, want)
                raise PayloadError(f"payload configuration differs in {have.split('=')[0]}: payload has "
                                   f"{have}, this codec ({self.spec()}) has {need}")
        if name is not None:
            nh = wire.name_hash(name)
            if h.name_hash != nh:
                what = "carries no name" if h.name_hash == 0 else f"has name hash {h.name_hash:#010x}"
                raise PayloadError(f"name mismatch: payload {what}, expected {name!r} (hash {nh:#010x}): "
                                   "it belongs to another tensor")

    def _field_text(self, field, code):
        return f"{field}={code}"

    def _parse(self, pay, name):
        """The validated header of host payload ``pay`` (a NumPy uint8 array), for ``name``."""
        return _validated(self, pay[:wire.HEADER_NBYTES].tobytes(), pay.size, name)

    # -- noise ---------------------------------------------------------------------------------------
    def _direct_key(self, nh, step, rank):
        """The noise key of a direct :meth:`encode` call (see the codec's docstring on seeds). ``step``
        and ``rank`` are checked even where they choose nothing (no seed, no noise)."""
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
        """Encode ``x`` (NumPy array, torch tensor on CPU/CUDA, eager TensorFlow tensor; float32, float16,
        bfloat16 or float64) into a 1-D uint8 payload of the same kind and device. ``name`` is hashed
        into the header so that ``decode(..., name=...)`` can refuse another tensor's payload.

        Seeded stochastic rounding draws with the key :func:`noise_key` (seed, k, rank, name hash):
        k is this codec object's count of encodes of ``name`` on this thread unless ``step`` is given, rank the
        process's Horovod rank (environment) unless ``rank`` is given. ``step=s, rank=r`` gives the
        payload the exchange sends for that name at step s from rank r."""
        if name is not None and type(name) is not str:
            name = _name_arg(name)
        arrays = adapter_for(x)
        shape, dtype = arrays.describe(x)
        direct = _direct_encoder(self, arrays, shape, dtype, name)
        if direct is not None:          # a prepared kernel launch: nothing else to resolve
            nh, total, words, launch = direct
            key = self._direct_key(nh, step, rank)
            if arrays.device:
                t, px = arrays.input_f32(x)
                pt, pp = arrays.new_bytes(total, t)
                launch(px, pp, words, key, arrays.stream(t), None)
                return pt
            pay = np.empty(total, np.uint8)
            launch(arrays.input_f32(x), pay, words, key, None, None)
            return arrays.wrap_payload(pay, x)
        nh, words, lay = _prepared(self, shape, dtype, name)
        key = self._direct_key(nh, step, rank)
        if arrays.device:
            with arrays.context(x):
                pt, pdev = arrays.new_bytes(lay.total, x)
                self._encode_dev(arrays, x, pt, pdev, words, lay, key, arrays.stream(x))
                return pt
        pay = np.empty(lay.total, np.uint8)
        self._encode_host(arrays, x, pay, words, lay, key)
        return arrays.wrap_payload(pay, x)

    def encode_into(self, x, payload, words, lay, key, arrays=None, residual=None):
        """Encode ``x`` (``lay.numel`` elements) into ``payload``, a uint8 buffer (or a slice of one)
        of ``lay.total`` bytes of the same kind and device, with header ``words`` and noise ``key``
        prepared by the caller (:meth:`header_plan`, :func:`noise_key`): the exchange's hot path, with
        no allocation and no per-call preparation. ``arrays``: the adapter of ``x``, if known.

        ``residual`` (a flat float32 buffer of ``x``'s kind, or None): also write ``x - decode(payload)``
        there, from the encode itself (error feedback without a second pass); bit-identical to
        decoding the payload and subtracting."""
        arrays = arrays or adapter_for(x)
        if arrays.numel(x) != lay.numel or arrays.payload_nbytes(payload) != lay.total:
            raise PayloadError(f"encode_into: x has {arrays.numel(x)} elements and the payload "
                               f"{arrays.payload_nbytes(payload)} bytes; the layout is for {lay.numel} "
                               f"elements in {lay.total} bytes")
        if arrays.device:
            with arrays.context(x):
                self._encode_dev(arrays, x, payload, arrays.bytes_dev(payload), words, lay, key,
                                 arrays.stream(x), residual)
        else:
            self._encode_host(arrays, x, arrays.payload_np(payload), words, lay, key,
                              None if residual is None else arrays.out_np(residual)[0])
        return payload

    def bind_encode(self, arrays, lay, words, like):
        """``f(x, payload, key, residual=None)``: :meth:`encode_into` for inputs of ``lay.numel``
        elements like ``like`` with header ``words``, everything else resolved now (the kernel's
        prepared launch, the adapter). Sizes are the caller's promise: the exchange's plans hold them.
        Device tensors: one device per process (Horovod's model), on the framework's current stream."""
        launch = self._bound_kernel(arrays, lay.numel, None) if lay.numel else None
        if launch is None:
            return lambda x, payload, key, residual=None: self.encode_into(
                x, payload, words, lay, key, arrays=arrays, residual=residual)
        if arrays.device:
            f32, pay, out_dev, stream = arrays.input_f32, arrays.bytes_dev, arrays.out_dev, arrays.stream

            def encode(x, payload, key, residual=None):
                launch(f32(x)[1], pay(payload), words, key, stream(x),
                       None if residual is None else out_dev(residual)[0])
        else:
            f32, pay, out_np = arrays.input_f32, arrays.payload_np, arrays.out_np

            def encode(x, payload, key, residual=None):
                launch(f32(x), pay(payload), words, key, None,
                       None if residual is None else out_np(residual)[0])
        return encode

    def bind_decode(self, arrays, numel, accumulate, expect, like, status=None):
        """``f(payload, out)``: :meth:`decode_into` of payloads of ``numel`` elements checked against
        ``expect``, resolved now as :meth:`bind_encode` does (device: the check runs in the decode
        kernel and reports through ``status``, the caller's ``arrays.new_status(like)``, or else
        through the status word of this codec on ``like``'s device that :meth:`check_device_errors`
        reads)."""
        launch = self._bound_kernel(arrays, numel, bool(accumulate)) if numel else None
        if arrays.device and status is None:
            status = status_for(self, arrays, like)
        if launch is None:
            if arrays.device:
                return lambda payload, out: self._decode_into_device(arrays, payload, out, accumulate, None,
                                                                     expect, status)
            return lambda payload, out: self.decode_into(payload, out, accumulate=accumulate, expect=expect,
                                                         arrays=arrays)
        if arrays.device:
            status_dev = status[1]
            pay, out_dev, stream = arrays.bytes_dev, arrays.out_dev, arrays.stream

            def decode(payload, out):
                launch(pay(payload), out_dev(out)[0], stream(out), status_dev, expect)
        else:
            total = self._layout(numel).total
            payload_np, out_np = arrays.payload_np, arrays.out_np

            def decode(payload, out):
                p = payload_np(payload)
                if p.size != total:
                    raise PayloadError(f"payload has {p.size} bytes; {numel} elements take {total}")
                h = _validated(self, p[:wire.HEADER_NBYTES].tobytes(), total, None)
                if h.numel != numel or (expect.check_name and h.name_hash != expect.name_hash):
                    raise PayloadError(f"payload holds {h.numel} elements with name hash "
                                       f"{h.name_hash:#010x}; expected {numel} with "
                                       f"{expect.name_hash:#010x}: it belongs to another tensor")
                launch(p, out_np(out)[0])
        return decode

    # -- fused launches: one per exchange phase ------------------------------------------------------
    def bind_decode_sum(self, arrays, numel, expect, like, status=None):
        """``f(payloads, n, out)``: ``out`` = the sum, in order, of the ``n`` payloads of ``numel``
        elements held back to back in ``payloads``, each checked against ``expect``: one launch (the
        allgather's decode). None where this codec has no fused kernel (the caller loops)."""
        launch = _fused(self, arrays.device, "sum", numel, 0) if numel and arrays.views else None
        if launch is None:
            return None
        if arrays.device:
            status = (status or status_for(self, arrays, like))[1]
            pay, out_dev, stream = arrays.bytes_dev, arrays.out_dev, arrays.stream
            return lambda payloads, n, out: launch(pay(payloads), n, out_dev(out)[0], stream(out), status,
                                                   expect)
        pay, out_np = arrays.payload_np, arrays.out_np
        return lambda payloads, n, out: launch(pay(payloads), n, out_np(out)[0], None, None, expect)

    def bind_reduce_requantize(self, arrays, lay, words, expect, like, status=None):
        """``f(payloads, n, residual, out_payload, key)``: SRA's middle phase in one launch: sum the
        ``n`` received payloads of ``lay.numel`` elements (checked against ``expect``), add
        ``residual`` if given, encode the result into ``out_payload`` with header ``words`` and noise
        ``key``, and overwrite ``residual`` with what that encode lost. None where unfused."""
        launch = _fused(self, arrays.device, "reduce", lay.numel, 0) if lay.numel and arrays.views else None
        if launch is None:
            return None
        if arrays.device:
            status = (status or status_for(self, arrays, like))[1]
            pay, out_dev, stream = arrays.bytes_dev, arrays.out_dev, arrays.stream

            def reduce(payloads, n, residual, out_payload, key):
                launch(pay(payloads), n, None if residual is None else out_dev(residual)[0], pay(out_payload),
                       words, key, stream(out_payload), status, expect)
            return reduce
        pay, out_np = arrays.payload_np, arrays.out_np

        def reduce(payloads, n, residual, out_payload, key):
            launch(pay(payloads), n, None if residual is None else out_np(residual)[0], pay(out_payload),
                   words, key, None, None, expect)
        return reduce

    def bind_decode_chunks(self, arrays, numel, chunk, name_hashes, expect, like, status=None):
        """``f(gathered, out)``: SRA's last phase in one launch: chunk j of ``out`` (elements
        [j*chunk, (j+1)*chunk)) decoded from the j-th payload of ``gathered``, each checked against
        ``expect`` and its own name hash. ``name_hashes``: the chunks' hashes, on ``like``'s device,
        built once by the caller. None where unfused."""
        launch = (_fused(self, arrays.device, "chunks", numel, chunk)
                  if numel and arrays.views and getattr(self, "bucket_size", None) else None)
        if launch is None:
            return None
        if arrays.device:
            status = (status or status_for(self, arrays, like))[1]
            pay, out_dev, stream = arrays.bytes_dev, arrays.out_dev, arrays.stream
            return lambda gathered, out: launch(pay(gathered), out_dev(out)[0], stream(out), status, name_hashes,
                                                expect)
        pay, out_np = arrays.payload_np, arrays.out_np
        return lambda gathered, out: launch(pay(gathered), out_np(out)[0], None, None, name_hashes, expect)

    def _fused_prepare(self, K, kind, numel, chunk):
        """The kernel module ``K``'s prepared fused launch ``kind`` ("sum", "reduce", "chunks"), or
        None (codecs without fused kernels)."""
        return None

    def _bound_kernel(self, arrays, numel, accumulate):
        """The prepared kernel launch behind :meth:`bind_encode` (``accumulate`` None) or
        :meth:`bind_decode`, or None where the generic path serves (raw codecs, fake mode, TensorFlow
        tensors, which are immutable)."""
        return None

    def decode(self, payload, name=None, shape=None, dtype=None):
        """Decode a payload to a tensor of the encoded shape and dtype (same kind/device as ``payload``).

        Host payloads are fully validated (PayloadError). For a device payload, passing ``shape`` and
        ``dtype`` avoids any host synchronisation: the header is then checked on the device (as in
        :meth:`decode_into`); without them the 64-byte header is copied to the host (one
        synchronisation) and validated there."""
        if name is not None and type(name) is not str:
            name = _name_arg(name)
        if shape is not None:
            shape = _shape_arg(shape)
        arrays = adapter_for(payload)
        if arrays.device:
            return self._decode_device(arrays, payload, name, shape, dtype)
        pay = arrays.payload_np(payload)
        h = self._parse(pay, name)
        if shape is not None and shape != h.shape:
            raise PayloadError(f"payload holds shape {h.shape}, caller expected {tuple(shape)}")
        if dtype is not None and _dtype_text(dtype) != h.dtype_name:
            raise PayloadError(f"payload holds dtype {h.dtype_name}, caller expected {_dtype_text(dtype)}")
        out = np.empty(h.numel, np.float32)
        self._decode_host(pay, out, False)
        return arrays.wrap_result(out, h.dtype_name, h.shape, payload)

    def decode_into(self, payload, out, accumulate=False, name=None, expect=None, arrays=None):
        """Write (``accumulate=False``) or add (``True``) the decoded values into ``out``, a flat
        float32 array/tensor of the payload's kind with the payload's element count; no temporary of
        that size is allocated (except for TensorFlow, whose tensors are immutable: ``out`` must be a
        ``tf.Variable``). Returns ``out``.

        Errors. Host payloads raise :class:`PayloadError` before anything is written. For device
        payloads only sizes are checked on the host (a wrong size raises at once); the header is
        checked on the device, in the same stream order: if it is wrong (magic, version,
        configuration, numel, checksums, or the name when ``name`` is given) the decode writes NaN
        into ``out`` (so a bad payload can never pass silently into a sum) and the reason is kept in a
        device status word; :meth:`check_device_errors` reads it (synchronising) and raises.

        ``expect`` (a ``wire.Expect`` from :meth:`expectation`, given instead of ``name``) and
        ``arrays`` (the payload's adapter) let a caller that decodes the same layout every step skip
        the per-call preparation."""
        if name is not None and type(name) is not str:
            name = _name_arg(name)
        arrays = arrays or adapter_for(payload)
        if arrays.device:
            return self._decode_into_device(arrays, payload, out, accumulate, name, expect)
        pay = arrays.payload_np(payload)
        h = self._parse(pay, name)
        if expect is not None and expect.check_name and h.name_hash != expect.name_hash:
            raise PayloadError(f"name mismatch: payload has name hash {h.name_hash:#010x}, expected "
                               f"{expect.name_hash:#010x}: it belongs to another tensor")
        out_np, commit = arrays.out_np(out)
        if out_np.size != h.numel:
            raise PayloadError(f"payload holds {h.numel} elements but out has {out_np.size}")
        launch = _prepared_launch(self, arrays, h.numel, bool(accumulate))
        if launch is None:
            self._decode_host(pay, out_np, accumulate)
        else:
            launch(pay, out_np)
        if commit is not None:
            commit()
        return out

    def check_device_errors(self):
        """Raise PayloadError if any device payload decoded by this codec since the last call failed
        its on-device header check (reads the device status words: synchronises). Resets them."""
        problems = []
        for key, arrays, status_t in device_statuses(self):
            bits = arrays.read_status(status_t)
            if bits:
                problems.append(f"{key}: {wire.describe_error_bits(bits)}")
        if problems:
            raise PayloadError("device payload(s) refused (their decode wrote NaN): " + "; ".join(problems))

    # -- stock Horovod Compressor protocol -----------------------------------------------------------
    def compress(self, tensor):
        from . import _stock        # _stock builds on the exchange, which builds on the codecs
        return _stock.compress(self, tensor)

    def decompress(self, tensor, ctx):
        from . import _stock
        return _stock.decompress(self, tensor, ctx)

    # -- device plumbing -----------------------------------------------------------------------------
    def _decode_device(self, arrays, payload, name, shape, dtype):
        nbytes = arrays.payload_nbytes(payload)
        if shape is None or dtype is None:
            h = wire.parse_header(arrays.read_header(payload), nbytes)     # synchronises (64 bytes)
            self._check_header(h, name)
            shape, dtype_name, expect = h.shape, h.dtype_name, None
        else:
            dtype_name = _dtype_text(dtype)
            expect = self.expectation(math.prod(shape), name)
        numel = math.prod(shape)
        if nbytes != self.wire_nbytes(numel):
            raise PayloadError(f"payload has {nbytes} bytes; {numel} elements take {self.wire_nbytes(numel)}")
        with arrays.context(payload):
            stream = arrays.stream(payload)
            pdev = arrays.bytes_dev(payload)
            if expect is not None:
                status_t, status_dev = status_for(self, arrays, payload)
            else:
                status_t = status_dev = None        # checked on the host already
            out_t, out_dev = arrays.new_f32(numel, payload)
            res = self._decode_dev(arrays, payload, pdev, out_t, out_dev, False, stream, status_t,
                                   status_dev, expect)
            return arrays.result(out_t if res is None else res, dtype_name, shape)

    def _decode_into_device(self, arrays, payload, out, accumulate, name, expect, status=None):
        if arrays.views and status is None:
            numel = arrays.numel(out)
            total, bound = _device_decoder(self, arrays, payload, numel, bool(accumulate), name, expect)
            if arrays.payload_nbytes(payload) != total:
                raise PayloadError(f"payload has {arrays.payload_nbytes(payload)} bytes; out has {numel} "
                                   f"elements, which take {total}")
            if bound is not None:       # a prepared kernel launch: nothing else to resolve
                bound(payload, out)
                return out
        with arrays.context(payload):
            numel = arrays.numel(out)
            nbytes = arrays.payload_nbytes(payload)
            if nbytes != self.wire_nbytes(numel):
                raise PayloadError(f"payload has {nbytes} bytes; out has {numel} elements, which take "
                                   f"{self.wire_nbytes(numel)}")
            if expect is None:
                expect = self.expectation(numel, name)
            stream = arrays.stream(payload)
            pdev = arrays.bytes_dev(payload)
            status_t, status_dev = status or status_for(self, arrays, payload)
            self._decode_into_dev(arrays, payload, pdev, out, accumulate, stream, status_t, status_dev,
                                  expect)
        return out

    def _decode_into_dev(self, arrays, payload, pdev, out, accumulate, stream, status_t, status_dev,
                         expect):
        """Kernel codecs: decode into a device view of ``out`` (or into the adapter's temporary, then
        commit, for frameworks whose tensors are immutable)."""
        out_dev, commit = arrays.out_dev(out)
        self._decode_dev(arrays, payload, pdev, out, out_dev, accumulate and commit is None, stream,
                         status_t, status_dev, expect)
        if commit is not None:
            commit(accumulate)

    # -- subclass steps ------------------------------------------------------------------------------
    def _encode_host(self, arrays, x, pay, words, lay, key, residual=None):
        """Write the payload of host input ``x`` into the NumPy uint8 array ``pay`` (and, given a
        float32 NumPy ``residual``, ``x - decode(pay)`` into it)."""
        raise NotImplementedError

    def _decode_host(self, pay, out, accumulate):
        raise NotImplementedError

    def _encode_dev(self, arrays, x, pt, pdev, words, lay, key, stream, residual=None):
        """Write the payload of device input ``x`` into ``pt`` (framework tensor) / ``pdev`` (its
        device-array view), and the residual into ``residual`` (a flat float32 tensor) if given."""
        raise NotImplementedError

    def _decode_dev(self, arrays, payload, pdev, out_t, out_dev, accumulate, stream, status_t, status_dev,
                    expect):
        """Decode (and, when ``expect`` is given, check on the device) into ``out_dev``."""
        raise NotImplementedError


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


def _f32_view(pay, offset, numel):
    """float32 values stored at ``offset`` (copied if the payload is not 4-byte aligned)."""
    raw = pay[offset:offset + 4 * numel]
    if raw.ctypes.data % 4:
        raw = raw.copy()
    return raw.view(np.float32)


# ---- QSGD ---------------------------------------------------------------------------------------------

_MODE_NAMES = {v: k for k, v in wire.MODES.items()}
_NORM_NAMES = {v: k for k, v in wire.NORMS.items()}


@register("qsgd")
class QSGD(Codec):
    """Bucketed QSGD (Alistarh et al., 2017): ``bits``-bit codes with one float32 scale per bucket.

    Per bucket of ``bucket_size`` consecutive elements, ``scale`` = max|x| (``norm="max"``) or
    ||x||_2 (``norm="l2"``); with s = 2**(bits-1) - 1 levels per sign and unit = scale / s, element x
    gets the level q = round(|x| / unit) in [0, s] with its sign, stored offset-binary (q + s) in
    ``bits`` bits; decode gives q * unit.

    * ``mode="stochastic"``: q = floor(v) + (u < v - floor(v)), u uniform: **unbiased**
      (E[decode] = x, up to 2**-24 of a level from 24-bit uniforms); variance per bucket at most
      min(d/s^2, sqrt(d)/s) ||x||^2 with the l2 norm (the paper's bound).
    * ``mode="deterministic"``: round half up: **biased**, error at most unit/2 per element.
    * ``mode="fake"``: quantize (stochastic rounding) and dequantize locally and put the float32
      result on the wire: the numerics of "stochastic" with **no savings** (4 bytes per element);
      for accuracy studies only.

    Noise: ``seed=None`` draws fresh noise on every call. With a fixed ``seed`` the uniforms are a
    counter-based hash of the key :func:`noise_key` (seed, k, rank, name hash) and the element index.
    For a direct :meth:`encode`, k counts this codec object's encode calls for that name on the
    calling thread and rank is ``HOROVOD_RANK`` (or ``OMPI_COMM_WORLD_RANK``, ``PMI_RANK``, else 0): the k-th
    call on the same input gives the same payload in every run. Inside the exchange, k is the
    training step and rank the process set rank, so ranks draw independent noise.

    Wire: 64-byte header, ceil(numel*bits/8) code bytes (zero padded to 4), 4*ceil(numel/bucket_size)
    scale bytes. A zero bucket decodes to zeros; a bucket holding NaN or Inf decodes to NaN (only
    that bucket). bits 2..16, bucket_size >= 1.
    """

    PARAMS = {"bits": _p_int, "bucket_size": _p_int, "mode": _p_str, "norm": _p_str, "seed": _p_opt_int}
    _method = wire.METHODS["qsgd"]

    def __init__(self, bits=4, bucket_size=512, mode="stochastic", norm="max", seed=None):
        mode = _check_choice("mode", mode, tuple(wire.MODES))
        self._freeze(bits=_check_int("bits", bits, 2, 16),
                     bucket_size=_check_int("bucket_size", bucket_size, 1, 2 ** 32 - 1),
                     mode=mode, norm=_check_choice("norm", norm, tuple(wire.NORMS)),
                     seed=None if seed is None else _check_int("seed", seed, 0, 2 ** 64 - 1),
                     stochastic=mode != "deterministic")

    @property
    def levels(self):
        """s = 2**(bits-1) - 1 magnitude levels per sign."""
        return (1 << (self.bits - 1)) - 1

    def _config(self):
        return {"bits": self.bits, "bucket_size": self.bucket_size, "mode": self.mode, "norm": self.norm,
                "seed": self.seed}

    def __repr__(self):
        r = super().__repr__()
        if self.mode == "fake":
            r += "  # fake: quantize+dequantize locally, payload carries fp32 (same numerics, no savings)"
        return r

    def _fields(self):
        return (self._method, self.bits, wire.MODES[self.mode], wire.NORMS[self.norm], self.bucket_size)

    def _field_text(self, field, code):
        if field == "mode":
            return f"mode={_MODE_NAMES.get(code, code)}"
        if field == "param":
            return f"norm={_NORM_NAMES.get(code, code)}"
        return super()._field_text(field, code)

    def _qlayout(self, numel):
        return wire.layout(self._method, numel, self.bits, self.bucket_size, wire.MODES["stochastic"])

    def _encode_host(self, arrays, x, pay, words, lay, key, residual=None):
        K = numba_kernels.cpu
        xf = arrays.input_f32(x)
        if self.mode == "fake":
            tmp = np.empty(self._qlayout(xf.size).total, np.uint8)
            K.qsgd_encode_cpu(xf, tmp, words, self.bits, self.bucket_size, True, self.norm == "l2", key,
                              residual=residual)
            K.qsgd_decode_cpu(tmp, pay[64:64 + 4 * xf.size].view(np.float32), self.bits,
                              self.bucket_size, False)
            K.write_header_cpu(pay, words)
        else:
            K.qsgd_encode_cpu(xf, pay, words, self.bits, self.bucket_size, self.stochastic,
                              self.norm == "l2", key, residual=residual)

    def _decode_host(self, pay, out, accumulate):
        if self.mode == "fake":
            vals = _f32_view(pay, 64, out.size)
            if accumulate:
                out += vals
            else:
                out[...] = vals
            return
        K = numba_kernels.cpu
        K.qsgd_decode_cpu(pay, out, self.bits, self.bucket_size, accumulate)

    def _encode_dev(self, arrays, x, pt, pdev, words, lay, key, stream, residual=None):
        xt, xdev = arrays.input_f32(x)
        if self.mode == "fake":     # through Numba's dispatcher: an accuracy-study mode, not a hot path
            K = numba_kernels.cuda
            n = lay.numel
            tt, _ = arrays.new_bytes(self._qlayout(n).total, x)
            tn, pn = arrays.numba(tt), arrays.numba(pt)
            K.qsgd_encode_cuda(arrays.numba(xt), tn, words, self.bits, self.bucket_size, True,
                               self.norm == "l2", key, stream, None if residual is None else arrays.numba(residual))
            K.qsgd_decode_cuda(tn, pn[64:64 + 4 * n].view(np.float32), self.bits, self.bucket_size,
                               False, stream)
            K.write_header_cuda(pn, words, stream)
        else:
            _cuda_encoder(self, lay.numel)(xdev, pdev, words, key, stream, _dev_view(arrays, residual))

    def _bound_kernel(self, arrays, numel, accumulate):
        if self.mode == "fake" or not arrays.views:
            return None
        if arrays.device:
            K = numba_kernels.cuda
            return (self._cuda_prepare_encode(K, numel) if accumulate is None
                    else self._cuda_prepare_decode(K, numel, accumulate))
        K = numba_kernels.cpu
        if accumulate is None:
            return K.prepare_qsgd_encode(numel, self.bits, self.bucket_size, self.stochastic,
                                         self.norm == "l2")
        return K.prepare_qsgd_decode(numel, self.bits, self.bucket_size, accumulate)

    def _fused_prepare(self, K, kind, numel, chunk):
        if self.mode == "fake":
            return None
        if kind == "sum":
            return K.prepare_qsgd_decode_sum(numel, self.bits, self.bucket_size)
        if kind == "chunks":
            return K.prepare_qsgd_decode_chunks(numel, self.bits, self.bucket_size, chunk)
        return K.prepare_qsgd_reduce_requantize(numel, self.bits, self.bucket_size, self.stochastic,
                                                self.norm == "l2")

    def _cuda_prepare_encode(self, K, numel):
        return K.prepare_qsgd_encode(numel, self.bits, self.bucket_size, self.stochastic, self.norm == "l2")

    def _cuda_prepare_decode(self, K, numel, accumulate):
        return K.prepare_qsgd_decode(numel, self.bits, self.bucket_size, accumulate)

    def _decode_into_dev(self, arrays, payload, pdev, out, accumulate, stream, status_t, status_dev,
                         expect):
        if self.mode == "fake":
            _raw_decode_dev(arrays, payload, pdev, out, "float32", accumulate, stream, status_t,
                            status_dev, expect)
        else:
            super()._decode_into_dev(arrays, payload, pdev, out, accumulate, stream, status_t, status_dev,
                                     expect)

    def _decode_dev(self, arrays, payload, pdev, out_t, out_dev, accumulate, stream, status_t, status_dev,
                    expect):
        if self.mode == "fake":
            return _raw_decode_dev(arrays, payload, pdev, out_t, "float32", accumulate, stream, status_t,
                                   status_dev, expect)
        _cuda_decoder(self, arrays.numel(out_t), accumulate)(pdev, out_dev, stream, status_dev, expect)


def _prepared_launch(codec, arrays, numel, accumulate):
    """This thread's prepared launch of ``codec`` for ``numel`` elements on ``arrays``' device or the
    CPU (``Codec._bound_kernel``: the encode when ``accumulate`` is None); None where the generic
    path serves."""
    if not numel:
        return None
    return _thread_launch(("bound", codec, arrays, numel, accumulate), codec._bound_kernel, arrays, numel,
                          accumulate)


def _direct_encoder(codec, arrays, shape, dtype_name, name):
    """A direct ``encode``'s (name hash, payload bytes, header words, prepared launch
    ``f(x, payload, words, key, stream, residual)`` taking the adapter's device handles or NumPy
    arrays), or None (generic path); this thread's."""
    def make():
        nh, words, lay = _prepared(codec, shape, dtype_name, name)
        launch = _prepared_launch(codec, arrays, lay.numel, None)
        return None if launch is None else (nh, lay.total, words, launch)
    return _thread_launch(("encode", codec, arrays, shape, dtype_name, name), make)


def _device_decoder(codec, arrays, payload, numel, accumulate, name, expect):
    """A direct device ``decode_into``'s (payload bytes, bound launch ``f(payload, out)`` or None for
    the generic path), this thread's, per device (the launch reports to that device's status word of
    ``codec``)."""
    def make():
        exp = codec.expectation(numel, name) if expect is None else expect
        bound = None
        if numel and _prepared_launch(codec, arrays, numel, accumulate) is not None:
            bound = codec.bind_decode(arrays, numel, accumulate, exp, None,
                                      status=status_for(codec, arrays, payload))
        return codec.wire_nbytes(numel), bound
    key = ("decode", codec, arrays, arrays.device_key(payload), numel, accumulate, name, expect)
    return _thread_launch(key, make)


def _fused(codec, device, kind, numel, chunk):
    """A new prepared fused launch of the codec (``Codec._fused_prepare``) on the CPU or a CUDA
    device, owned by the caller (an exchange's plan)."""
    return codec._fused_prepare(numba_kernels.cuda if device else numba_kernels.cpu, kind, numel, chunk)


def _cuda_encoder(codec, numel):
    """This thread's prepared CUDA encode of ``codec`` for ``numel`` elements."""
    return _thread_launch(("cuda encode", codec, numel), codec._cuda_prepare_encode, numba_kernels.cuda, numel)


def _cuda_decoder(codec, numel, accumulate):
    """This thread's prepared CUDA decode of ``codec`` for ``numel`` elements."""
    return _thread_launch(("cuda decode", codec, numel, bool(accumulate)), codec._cuda_prepare_decode,
                          numba_kernels.cuda, numel, bool(accumulate))


def _dev_view(arrays, t):
    """The device-array view of a flat float32 tensor (None stays None)."""
    return None if t is None else arrays.out_dev(t)[0]


def _raw_decode_dev(arrays, payload, pdev, out, value_dtype, accumulate, stream, status_t, status_dev,
                    expect):
    """Raw float values on a device, with framework ops; NaN where the header check failed."""
    bad = None
    if expect is not None:
        K = numba_kernels.cuda
        K.check_header_cuda(arrays.numba(payload), arrays.numba(status_t), expect, stream)
        bad = arrays.status_bad(status_t)
    return arrays.raw_decode_into(payload, 64, arrays.numel(out), value_dtype, out, accumulate, bad)


# ---- 1-bit --------------------------------------------------------------------------------------------

_SCALE_NAMES = {v: k for k, v in wire.ONEBIT_SCALES.items()}


@register("onebit", "1bit")
class OneBit(Codec):
    """1-bit SGD (Seide et al., 2014): one sign bit per element and float32 scales per bucket.

    bit = (x >= 0) (zeros count as positive). ``scale="two_mean"``: per bucket the mean of its
    non-negative elements and the mean of its negative elements; they decode to those means, so each
    bucket's **sum is preserved** (up to float32 rounding). ``scale="mean_abs"``: (||x||_1/d)·sign(x)
    of EF-SignSGD, one scale per bucket. Both are **biased**: use error feedback, which
    ``wants_error_feedback`` asks of the caller (``error_feedback=True``); the residual lives where
    tensor names are known (``hvd_quant.memory``). ``bucket_size=None``: one bucket per tensor (its sums
    are taken over segments of 8192 elements, docs/CODECS.md, so on a GPU a large tensor's reduction
    is spread over the whole device).

    Wire: 64-byte header, ceil(numel/8) bit bytes (zero padded to 4), then 8 (two_mean) or 4
    (mean_abs) bytes of scales per bucket. A bucket holding NaN/Inf decodes to NaN (two_mean) or to a
    non-finite value (mean_abs), only that bucket.
    """

    PARAMS = {"bucket_size": _p_opt_int, "scale": _p_str, "error_feedback": _p_bool}
    _method = wire.METHODS["onebit"]

    def __init__(self, bucket_size=None, scale="two_mean", error_feedback=True):
        if not isinstance(error_feedback, (bool, np.bool_)):
            raise ValueError(f"error_feedback must be True or False; got {error_feedback!r}")
        self._freeze(
            bucket_size=None if bucket_size is None else _check_int("bucket_size", bucket_size, 1, 2 ** 32 - 1),
            scale=_check_choice("scale", scale, tuple(wire.ONEBIT_SCALES)),
            error_feedback=bool(error_feedback))

    @property
    def wants_error_feedback(self):
        return self.error_feedback

    def _config(self):
        return {"bucket_size": self.bucket_size, "scale": self.scale, "error_feedback": self.error_feedback}

    def _fields(self):
        return (self._method, 1, wire.ONEBIT_SCALES[self.scale], 0, self.bucket_size or 0)

    def _field_text(self, field, code):
        if field == "mode":
            return f"scale={_SCALE_NAMES.get(code, code)}"
        if field == "bucket_size":
            return f"bucket_size={code or None}"
        return super()._field_text(field, code)

    @property
    def _two_mean(self):
        return self.scale == "two_mean"

    def _encode_host(self, arrays, x, pay, words, lay, key, residual=None):
        K = numba_kernels.cpu
        K.onebit_encode_cpu(arrays.input_f32(x), pay, words, self.bucket_size or 0, self._two_mean,
                            residual=residual)

    def _decode_host(self, pay, out, accumulate):
        K = numba_kernels.cpu
        K.onebit_decode_cpu(pay, out, self.bucket_size or 0, self._two_mean, accumulate)

    def _encode_dev(self, arrays, x, pt, pdev, words, lay, key, stream, residual=None):
        _, xdev = arrays.input_f32(x)
        _cuda_encoder(self, lay.numel)(xdev, pdev, words, 0, stream, _dev_view(arrays, residual))

    def _decode_dev(self, arrays, payload, pdev, out_t, out_dev, accumulate, stream, status_t, status_dev,
                    expect):
        _cuda_decoder(self, arrays.numel(out_t), accumulate)(pdev, out_dev, stream, status_dev, expect)

    def _bound_kernel(self, arrays, numel, accumulate):
        if not arrays.views:
            return None
        if arrays.device:
            K = numba_kernels.cuda
            return (self._cuda_prepare_encode(K, numel) if accumulate is None
                    else self._cuda_prepare_decode(K, numel, accumulate))
        K = numba_kernels.cpu
        if accumulate is None:
            enc = K.prepare_onebit_encode(numel, self.bucket_size or 0, self._two_mean)
            return lambda x, payload, header, key, stream, residual: enc(x, payload, header, stream, residual)
        return K.prepare_onebit_decode(numel, self.bucket_size or 0, self._two_mean, accumulate)

    def _fused_prepare(self, K, kind, numel, chunk):
        bs = self.bucket_size or 0
        if kind == "sum":
            return K.prepare_onebit_decode_sum(numel, bs, self._two_mean)
        if kind == "chunks":
            return K.prepare_onebit_decode_chunks(numel, bs, self._two_mean, chunk)
        return K.prepare_onebit_reduce_requantize(numel, bs, self._two_mean)

    def _cuda_prepare_encode(self, K, numel):
        return K.prepare_onebit_encode(numel, self.bucket_size or 0, self._two_mean)

    def _cuda_prepare_decode(self, K, numel, accumulate):
        return K.prepare_onebit_decode(numel, self.bucket_size or 0, self._two_mean, accumulate)


# ---- sort quantization ---------------------------------------------------------------------------------

@register("sortquant")
class SortQuant(Codec):
    """Sort quantization: per bucket, ``2**split_bits`` groups of equal count by rank, each quantized
    uniformly within its own range (reference/004 in the project's sources).

    Within each bucket of ``bucket_size`` consecutive elements the values are ranked by **value**
    (ties in index order) and the element of rank p (of n) goes to group ``g = (p * 2**split_bits) //
    n``: the groups are consecutive value intervals of n / 2**split_bits elements each (give or take
    one). Each group sends its (min, max) as two float32 scales; each element sends ``g`` in
    ``split_bits`` bits and a level q in [0, L], L = 2**(bits - split_bits) - 1, in the remaining
    ``bits - split_bits``: with unit = (max - min) / L, x = min + v * unit, ``mode="stochastic"``
    rounds v up with probability v - floor(v) (**unbiased** within the group, up to 2**-24 of a level),
    ``"deterministic"`` to nearest (half up; error at most unit/2). Decode gives min + q * unit.

    Why by value, not by magnitude: the groups are then disjoint intervals of the values, each as
    narrow as its count allows; ranked by magnitude a group would hold values of both signs and span
    twice its width. Where values bunch near zero and a few are large (gradients), the outer groups
    take the large values and the inner ones resolve the bulk finely, where QSGD's one scale per
    bucket spends every level on the largest value.

    Kernels: Numba CPU (a stable radix sort per bucket) and CUDA (a block per bucket sorts it in shared
    memory with a bitonic network: on CUDA ``bucket_size`` is at most 4096), both bit-identical to the
    NumPy reference; not tuned yet (no fused reduce kernels: SRA and allgather decode and sum payload
    by payload). Wire: 64-byte header (``param`` holds split_bits), ceil(numel*bits/8) code bytes (zero
    padded to 4), then 8 * 2**split_bits scale bytes per bucket. A bucket holding NaN or Inf, or whose
    range overflows float32, decodes to NaN (only that bucket). bits 2..16, split_bits 1..bits-1,
    bucket_size >= 1. Noise and ``seed`` as :class:`QSGD`.
    """

    PARAMS = {"bits": _p_int, "split_bits": _p_int, "bucket_size": _p_int, "mode": _p_str,
              "seed": _p_opt_int}
    _method = wire.METHODS["sortquant"]

    def __init__(self, bits=4, split_bits=2, bucket_size=512, mode="stochastic", seed=None):
        bits = _check_int("bits", bits, 2, 16)
        self._freeze(bits=bits, split_bits=_check_int("split_bits", split_bits, 1, bits - 1,
                                                      f" (below bits={bits})"),
                     bucket_size=_check_int("bucket_size", bucket_size, 1, 2 ** 32 - 1),
                     mode=_check_choice("mode", mode, ("stochastic", "deterministic")),
                     seed=None if seed is None else _check_int("seed", seed, 0, 2 ** 64 - 1))
        self.__dict__["stochastic"] = self.mode == "stochastic"

    def _config(self):
        return {"bits": self.bits, "split_bits": self.split_bits, "bucket_size": self.bucket_size,
                "mode": self.mode, "seed": self.seed}

    def _fields(self):
        return (self._method, self.bits, wire.MODES[self.mode], self.split_bits, self.bucket_size)

    def _field_text(self, field, code):
        if field == "mode":
            return f"mode={_MODE_NAMES.get(code, code)}"
        if field == "param":
            return f"split_bits={code}"
        return super()._field_text(field, code)

    def _encode_host(self, arrays, x, pay, words, lay, key, residual=None):
        K = numba_kernels.cpu
        K.sortquant_encode_cpu(arrays.input_f32(x), pay, words, self.bits, self.split_bits, self.bucket_size,
                               self.stochastic, key, residual=residual)

    def _decode_host(self, pay, out, accumulate):
        K = numba_kernels.cpu
        K.sortquant_decode_cpu(pay, out, self.bits, self.split_bits, self.bucket_size, accumulate)

    def _bound_kernel(self, arrays, numel, accumulate):
        if arrays.device or not arrays.views:
            return None
        K = numba_kernels.cpu
        if accumulate is None:
            return K.prepare_sortquant_encode(numel, self.bits, self.split_bits, self.bucket_size,
                                              self.stochastic)
        return K.prepare_sortquant_decode(numel, self.bits, self.split_bits, self.bucket_size, accumulate)

    def _encode_dev(self, arrays, x, pt, pdev, words, lay, key, stream, residual=None):
        K = numba_kernels.cuda     # (through Numba's dispatcher: device arrays, not pointers)
        xt, xdev = arrays.input_f32(x)
        K.sortquant_encode_cuda(_nb(arrays, xt, xdev), _nb(arrays, pt, pdev), words, self.bits,
                                self.split_bits, self.bucket_size, self.stochastic, key, stream,
                                None if residual is None else
                                _nb(arrays, residual, _dev_view(arrays, residual)))

    def _decode_dev(self, arrays, payload, pdev, out_t, out_dev, accumulate, stream, status_t, status_dev,
                    expect):
        K = numba_kernels.cuda
        K.sortquant_decode_cuda(_nb(arrays, payload, pdev), _nb(arrays, out_t, out_dev), self.bits,
                                self.split_bits, self.bucket_size, accumulate, stream,
                                None if status_t is None else _nb(arrays, status_t, status_dev), expect)


@register("kmeans")
class KMeans(Codec):
    """K-means quantization: per bucket a codebook of ``2**bits`` float32 centroids fitted by Lloyd
    iterations, each element sent as the ``bits``-bit index of its nearest centroid (reference/004 in
    the project's sources).

    The fit is one-dimensional and exact. **Start**: a sample of the bucket (all of it up to 1024
    values, else its min, its max and 1022 values drawn at positions keyed by ``seed`` with the rank,
    the tensor's name and the step, as :class:`QSGD`'s noise, so every rank and every run is
    reproducible), sorted; the centroids start at equal steps of its companded rank (the running sum
    of sqrt(gap) between neighbours), which spreads them into the tails, where a gradient's squared
    error is made. **Iterations**: each value goes to the nearest centroid (the
    boundaries are the midpoints between neighbours, ties to the lower one) and each centroid moves to
    the mean of its values; a centroid left without values stays where it was. The means are exact
    integer sums in a per-bucket fixed point (|x| scaled below 2**31), so they do not depend on the
    order of the additions: the CPU and CUDA kernels and the NumPy reference agree bit for bit. The
    CPU kernel stops early once a step moves no centroid (the result is the same). Nearest-centroid
    rounding is **biased** (like ``QSGD(mode="deterministic")``); the bias is small where the
    codebook fits the bucket.

    ``bucket_size=None``: one codebook per tensor (per chunk on SRA's middle phase), the source's
    setting; a bucket_size gives one per bucket, which costs ``2**bits * 4`` bytes each. bits 1..8
    (a 2**bits codebook beyond that outweighs the codes it replaces), iters 0..1000 (0: the sample's
    quantiles as they are). Wire: 64-byte header (bucket_size 0 for None), ceil(numel*bits/8) code
    bytes (zero padded to 4), then the codebooks. A bucket holding NaN or Inf decodes to NaN (only that
    bucket). Kernels: Numba CPU (the assignment vectorised over K - 1 comparisons, one thread per
    bucket) and CUDA (``iters + 5`` launches, most over the whole input; fixed-point sums by atomic
    adds); no fused reduce kernels (SRA and allgather decode and sum payload by payload).
    """

    PARAMS = {"bits": _p_int, "iters": _p_int, "bucket_size": _p_opt_int, "seed": _p_opt_int}
    _method = wire.METHODS["kmeans"]
    stochastic = True           # the sample is drawn with the noise key

    def __init__(self, bits=4, iters=20, bucket_size=None, seed=0):
        self._freeze(bits=_check_int("bits", bits, 1, 8), iters=_check_int("iters", iters, 0, 1000),
                     bucket_size=None if bucket_size is None else _check_int("bucket_size", bucket_size, 1,
                                                                               2 ** 32 - 1),
                     seed=None if seed is None else _check_int("seed", seed, 0, 2 ** 64 - 1))

    def _config(self):
        return {"bits": self.bits, "iters": self.iters, "bucket_size": self.bucket_size, "seed": self.seed}

    def _fields(self):
        return (self._method, self.bits, 0, 0, self.bucket_size or 0)

    def _field_text(self, field, code):
        if field == "bucket_size":
            return f"bucket_size={code or None}"
        return super()._field_text(field, code)

    def _encode_host(self, arrays, x, pay, words, lay, key, residual=None):
        K = numba_kernels.cpu
        K.kmeans_encode_cpu(arrays.input_f32(x), pay, words, self.bits, self.bucket_size or 0, self.iters, key,
                            residual=residual)

    def _decode_host(self, pay, out, accumulate):
        K = numba_kernels.cpu
        K.kmeans_decode_cpu(pay, out, self.bits, self.bucket_size or 0, accumulate)

    def _bound_kernel(self, arrays, numel, accumulate):
        if arrays.device or not arrays.views:
            return None
        K = numba_kernels.cpu
        if accumulate is None:
            return K.prepare_kmeans_encode(numel, self.bits, self.bucket_size or 0, self.iters)
        return K.prepare_kmeans_decode(numel, self.bits, self.bucket_size or 0, accumulate)

    def _encode_dev(self, arrays, x, pt, pdev, words, lay, key, stream, residual=None):
        K = numba_kernels.cuda     # (through Numba's dispatcher: device arrays, not pointers)
        xt, xdev = arrays.input_f32(x)
        K.kmeans_encode_cuda(_nb(arrays, xt, xdev), _nb(arrays, pt, pdev), words, self.bits, self.bucket_size or 0,
                             self.iters, key, stream,
                             None if residual is None else _nb(arrays, residual, _dev_view(arrays, residual)))

    def _decode_dev(self, arrays, payload, pdev, out_t, out_dev, accumulate, stream, status_t, status_dev,
                    expect):
        K = numba_kernels.cuda
        K.kmeans_decode_cuda(_nb(arrays, payload, pdev), _nb(arrays, out_t, out_dev), self.bits,
                             self.bucket_size or 0, accumulate, stream,
                             None if status_t is None else _nb(arrays, status_t, status_dev), expect)


def _nb(arrays, t, dev):
    """A Numba device array of ``t``, whose device handle is ``dev`` (torch's is a raw pointer)."""
    return arrays.numba(t) if type(dev) is int else dev


# ---- raw: fp16 and none ---------------------------------------------------------------------------------

class _Raw(Codec):
    _value_dtype = None

    def __init__(self):
        self._freeze()

    def _fields(self):
        return (self._method, 16 if self._value_dtype == "float16" else 32, 0, 0, 0)

    def _encode_host(self, arrays, x, pay, words, lay, key, residual=None):
        K = numba_kernels.cpu
        xs = arrays.input_np(x)
        K.write_header_cpu(pay, words)
        w = 2 if self._value_dtype == "float16" else 4
        vals = pay[64:64 + w * xs.size].view(self._value_dtype)
        pay[64 + w * xs.size:] = 0
        if w == 2 and xs.dtype == np.float32 and vals.ctypes.data % 2 == 0:
            K.half_encode_cpu(xs, vals.view(np.uint16), residual)      # NumPy's rounding, 4x faster
            return
        vals[...] = xs
        if residual is not None:
            np.subtract(xs, vals, out=residual, dtype=np.float32)

    def _decode_host(self, pay, out, accumulate):
        w = 2 if self._value_dtype == "float16" else 4
        raw = pay[64:64 + w * out.size]
        if w == 2 and raw.ctypes.data % 2 == 0:
            K = numba_kernels.cpu
            K.half_decode_cpu(raw.view(np.uint16), out, accumulate)    # NumPy's values, 9x faster
            return
        if raw.ctypes.data % w:
            raw = raw.copy()
        vals = raw.view(self._value_dtype)
        if accumulate:
            np.add(out, vals, out=out, casting="unsafe")
        else:
            out[...] = vals

    def _encode_dev(self, arrays, x, pt, pdev, words, lay, key, stream, residual=None):
        K = numba_kernels.cuda
        arrays.raw_encode_into(x, self._value_dtype, pt)
        K.write_header_cuda(arrays.numba(pt), words, stream)
        if residual is not None:
            arrays.raw_residual(x, pt, self._value_dtype, residual)

    def _decode_dev(self, arrays, payload, pdev, out_t, out_dev, accumulate, stream, status_t, status_dev,
                    expect):
        return _raw_decode_dev(arrays, payload, pdev, out_t, self._value_dtype, accumulate, stream,
                               status_t, status_dev, expect)

    def _decode_into_dev(self, arrays, payload, pdev, out, accumulate, stream, status_t, status_dev,
                         expect):
        _raw_decode_dev(arrays, payload, pdev, out, self._value_dtype, accumulate, stream, status_t,
                        status_dev, expect)


@register("fp16", "float16")
class FP16(_Raw):
    """Half precision on the wire (Horovod's ``Compression.fp16`` as a payload): 2 bytes per element.

    Round to nearest (biased only by rounding; values beyond ±65504 become ±inf). Wire: 64-byte
    header, numel float16 values, zero padding to a multiple of 4."""
    _method = wire.METHODS["fp16"]
    _value_dtype = "float16"


@register("none", "nocompression", "fp32")
class NoCompression(_Raw):
    """No compression: float32 values on the wire (4 bytes per element), exact for float32 input.

    Wire: 64-byte header, numel float32 values."""
    _method = wire.METHODS["none"]
    _value_dtype = "float32"


class Compression:
    """Horovod-style namespace: ``Compression.none``, ``Compression.fp16`` (instances),
    ``Compression.qsgd(...)``, ``Compression.onebit(...)``, ``Compression.sortquant(...)``,
    ``Compression.kmeans(...)`` (factories)."""
    none = NoCompression()
    fp16 = FP16()
    qsgd = QSGD              # Compression.qsgd(bits=4) is QSGD(bits=4), and so on
    onebit = OneBit
    sortquant = SortQuant
    kmeans = KMeans


def resolve_codec(compression, horovod_compression=None):
    """A codec from what users pass as ``compression=``: an hvd_quant codec, a spec string, a
    :class:`hvd_quant.StockCompression` (its codec), None (no compression), or Horovod's
    ``Compression.none`` / ``Compression.fp16`` of the framework whose ``Compression`` namespace is
    given as ``horovod_compression`` (``horovod.torch.compression.Compression`` and so on)."""
    if compression is None:
        return NoCompression()
    if isinstance(compression, str):
        return from_spec(compression)
    inner = getattr(compression, "codec", None)
    if inner is not None and hasattr(inner, "encode"):
        return inner
    if hasattr(compression, "encode") and hasattr(compression, "wire_nbytes"):
        return compression
    if horovod_compression is not None:
        for hvd_cls, ours in ((horovod_compression.none, NoCompression), (horovod_compression.fp16, FP16)):
            if compression is hvd_cls or isinstance(compression, hvd_cls):
                return ours()
    raise TypeError(f"hvd_quant: compression must be an hvd_quant codec, a spec string or "
                    f"hvd.Compression.none/fp16, got {compression!r}")
