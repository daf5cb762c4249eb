"""Codecs as stock Horovod's ``compression=`` argument.

Horovod's optimizers call ``compress(grad) -> (t, ctx)``, **sum** ``t`` across ranks with allreduce
(applying ``op``, ``prescale_factor`` and ``postscale_factor``), then ``decompress(summed_t, ctx)``.
Summing quantized codes is wrong (DESIGN.md), so here:

1. ``compress`` starts hvd_quant's own exchange for the tensor (:class:`hvd_quant.exchange.Exchange`,
   asynchronous, named after the tensor) and hands Horovod a 1-element placeholder holding 1.0;
2. Horovod allreduces the placeholders: the result is exactly the factor Horovod would have applied to
   (sum of gradients) * N -- 1 for Average, N for Sum, times the pre/post-scale factors;
3. ``decompress`` finishes the exchange and returns ``decoded_sum * (placeholder / N)``, computed on
   the device (no host synchronisation), cast back to the gradient's dtype and shape.

Tensors with fewer than ``min_compress_numel`` elements, 1-D tensors (unless ``compress_1d``) and
non-floating tensors are returned as they are, with a passthrough context, and Horovod allreduces them.

Names. ``compress`` is not told the tensor's name. It takes it from the calling frame: Horovod 0.28.1's
``_allreduce_grad_async`` (torch) and ``allreduce`` (TensorFlow, torch) hold a ``name`` local; in the
grouped path the parameter's own name is found through ``self._parameter_names``. When no name is found
it falls back to the call order within the step. The name and shape go into every payload header, so
a rank that receives another tensor's payload raises instead of mixing data; exchanges are matched
across ranks by name, so ranks may call hooks in different orders. The first exchange of each name
carries a configuration handshake (codec spec, reduction, size thresholds, shape).

Frameworks. ``compress`` dispatches on the tensor's type through :data:`FRONTENDS` (top-level module of
``type(tensor)`` -> backend module). A backend module provides ``stock_backend(process_set)`` ->
``(Collectives, ArrayOps)`` and ``stock_adapter()`` -> an object with ``describe(t)``,
``placeholder(t)``, ``restore(flat, info)``, ``as_float(t)``, ``sendable(t)`` and ``cast_back(t, info)``
(see ``hvd_quant/torch/_backend.py``). Optionally ``stock_compress(stock_compression, tensor)``: return
``(tensor, ctx)`` to take over ``compress`` (TensorFlow does for symbolic tensors) or None to let the
generic path run; a ctx with a ``stock_decompress(summed)`` method then finishes in ``decompress``.
"""
import importlib
import sys
import weakref

from .exchange import (Exchange, Traffic, handshake_record, is_passthrough_codec, REDUCTIONS)
from .memory import Memory

__all__ = ["StockCompression", "compress", "decompress", "FRONTENDS", "register_frontend",
           "stock_compression"]

# Registration point for frameworks: top-level module of type(tensor) -> backend module path.
FRONTENDS = {
    "torch": "hvd_quant.torch._backend",
    "tensorflow": "hvd_quant.tensorflow._backend",
}


def register_frontend(top_module, backend_module):
    """Route tensors whose type lives under ``top_module`` to ``backend_module`` (see module doc)."""
    FRONTENDS[top_module] = backend_module


def _backend_for(tensor):
    top = type(tensor).__module__.split(".", 1)[0]
    path = FRONTENDS.get(top)
    if path is None:
        raise TypeError(f"hvd_quant: no frontend for tensors of type {type(tensor)!r}; known: "
                        f"{sorted(FRONTENDS)} (hvd_quant._stock.register_frontend adds one)")
    return importlib.import_module(path)


class _Passthrough:
    """ctx of a tensor Horovod allreduces itself."""
    __slots__ = ()


PASSTHROUGH = _Passthrough()


class _Cast:
    """ctx of a tensor sent uncompressed in float32 because Horovod cannot reduce its dtype."""
    __slots__ = ("adapter", "info")

    def __init__(self, adapter, info):
        self.adapter, self.info = adapter, info


class _Ctx:
    __slots__ = ("session", "pending", "info", "size")

    def __init__(self, session, pending, info, size):
        self.session, self.pending, self.info, self.size = session, pending, info, size


class _Session:
    """One Exchange (and its error-feedback memory) per framework backend and process set."""

    def __init__(self, backend, process_set, codec, reduction, error_feedback):
        coll, ops = backend.stock_backend(process_set)
        self.adapter = backend.stock_adapter()
        self.ops = ops
        self.memory = Memory(ops) if error_feedback else None
        self.exchange = Exchange(codec, coll, ops, reduction=reduction, memory=self.memory)


def _frame_context(tensor):
    """(name, process_set) from the Horovod function that called compress, or (None, None)."""
    f = sys._getframe(1)
    while f is not None and f.f_globals.get("__name__", "").startswith("hvd_quant"):
        f = f.f_back
    for _ in range(4):
        if f is None:
            break
        loc = f.f_locals
        name = loc.get("name")
        if isinstance(name, str):
            owner = loc.get("self")
            ps = loc.get("process_set")
            if not hasattr(ps, "process_set_id"):
                ps = getattr(owner, "process_set", None)
                ps = ps if hasattr(ps, "process_set_id") else None
            group = loc.get("ps")
            if isinstance(group, (tuple, list)):
                # Horovod's grouped allreduce: one name for the group; find this tensor's parameter.
                names = getattr(owner, "_parameter_names", {})
                for i, p in enumerate(group):
                    g = getattr(p, "grad", None)
                    if g is tensor:
                        return names.get(p, f"{name}.{i}"), ps
                return None, ps
            return name, ps
        f = f.f_back
    return None, None


def _key_str(key):
    return "/".join(map(str, key))


class StockCompression:
    """A codec wrapped for stock Horovod's ``compression=`` argument (module doc).

    ``hvd.DistributedOptimizer(opt, named_parameters=..., compression=hvd_quant.QSGD(bits=4))`` uses a
    default ``StockCompression`` of the codec; build one yourself to change the defaults::

        compression = hvd_quant.StockCompression(hvd_quant.QSGD(bits=4), reduction="allgather")

    ``error_feedback`` defaults to ``codec.wants_error_feedback``; residuals are kept per tensor name
    and exposed by :meth:`state_dict` / :meth:`load_state_dict`.
    """

    def __init__(self, codec, reduction="sra", min_compress_numel=1024, compress_1d=False,
                 error_feedback=None):
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        self.codec = codec
        self.reduction = reduction
        self.min_compress_numel = int(min_compress_numel)
        self.compress_1d = bool(compress_1d)
        self.error_feedback = (bool(getattr(codec, "wants_error_feedback", False))
                               if error_feedback is None else bool(error_feedback))
        self._sessions = {}
        self._pending = {}      # exchange name -> Pending, all sessions
        self._steps = {}        # exchange name -> how many exchanges of that name were started
        self._anon = 0          # fallback names: call order since nothing was pending
        self._restored = {}     # residuals loaded before their session existed

    # -- configuration ----------------------------------------------------------------------------
    def summary(self):
        return (f"{self.codec.spec()} reduction={self.reduction} min_compress_numel="
                f"{self.min_compress_numel} compress_1d={self.compress_1d} "
                f"error_feedback={self.error_feedback}")

    def _session(self, backend, process_set):
        key = (backend.__name__, getattr(process_set, "process_set_id", 0))
        s = self._sessions.get(key)
        if s is None:
            s = self._sessions[key] = _Session(backend, process_set, self.codec, self.reduction,
                                               self.error_feedback)
            saved = self._restored.pop(_key_str(key), None)
            if saved is not None and s.memory is not None:
                s.memory.load_state_dict(saved)
        else:
            coll = backend.stock_backend(process_set)[0]
            if coll is not s.exchange.coll:     # the process set's rank or size changed (elastic)
                s.exchange.coll = coll
        return s

    def _compressible(self, info):
        return (info.is_float and info.numel >= self.min_compress_numel
                and (self.compress_1d or len(info.shape) > 1)
                and not is_passthrough_codec(self.codec))

    # -- Horovod Compressor protocol --------------------------------------------------------------
    def compress(self, tensor):
        backend = _backend_for(tensor)
        hook = getattr(backend, "stock_compress", None)   # a frontend's graph mode (TensorFlow)
        if hook is not None:
            out = hook(self, tensor)
            if out is not None:
                return out
        adapter = backend.stock_adapter()
        info = adapter.describe(tensor)
        name, ps = _frame_context(tensor)
        session = self._session(backend, ps)
        if not self._compressible(info):
            sendable = adapter.sendable(tensor)
            session.exchange.traffic.add_allreduce(info.numel * adapter.describe(sendable).itemsize, info.numel,
                                                   session.exchange.coll.size)
            if sendable is tensor:
                return tensor, PASSTHROUGH
            return sendable, _Cast(adapter, info)   # a dtype Horovod cannot reduce: float32 on the wire
        if name is None:
            if not self._pending:
                self._anon = 0
            name = f"hvdq.anon.{self._anon}"
            self._anon += 1
        if name in self._pending:
            raise RuntimeError(f"hvd_quant: tensor {name!r} was compressed twice before its "
                               f"decompress; names must be unique among tensors in flight")
        step = self._steps.get(name, 0)
        self._steps[name] = step + 1
        # The shape goes into the payload headers (not the collective's name, which must match
        # across ranks for a mismatch to be reported instead of stalling).
        header = f"{name}[{'x'.join(map(str, info.shape))}]"
        record = None
        if step == 0:
            record = handshake_record(self.summary(), (name,))
        flat = session.ops.flatten([tensor])
        pending = session.exchange.start(name, flat, step=step, record=record, header=header)
        self._pending[name] = (session, pending)
        return adapter.placeholder(tensor), _Ctx(session, pending, info, session.exchange.coll.size)

    def decompress(self, tensor, ctx):
        if isinstance(ctx, _Cast):
            return ctx.adapter.cast_back(tensor, ctx.info)
        if not isinstance(ctx, _Ctx):
            finish = getattr(ctx, "stock_decompress", None)   # made by a backend's stock_compress
            return tensor if finish is None else finish(tensor)
        # Overlap: move every exchange still in its first phase to its second before waiting.
        for session, pending in list(self._pending.values()):
            session.exchange.advance(pending)
        session, pending = ctx.session, ctx.pending
        self._pending.pop(pending.name, None)
        flat = session.exchange.finish(pending)
        flat = session.ops.scale_(flat, ctx.session.adapter.as_float(tensor) / ctx.size)
        return session.adapter.restore(flat, ctx.info)

    # -- state ------------------------------------------------------------------------------------
    @property
    def traffic(self):
        """Bytes sent since the last :meth:`reset_traffic`, summed over sessions."""
        total = Traffic()
        for s in self._sessions.values():
            t = s.exchange.traffic
            total.sent_bytes += t.sent_bytes
            total.fp32_bytes += t.fp32_bytes
            total.payload_bytes += t.payload_bytes
            total.numel += t.numel
        return total

    def reset_traffic(self):
        for s in self._sessions.values():
            s.exchange.traffic.reset()

    def state_dict(self):
        """``{"residuals": {session key: {name: tensor}}, "steps": {name: count}}``."""
        residuals = dict(self._restored)
        residuals.update({_key_str(k): s.memory.state_dict()
                          for k, s in self._sessions.items() if s.memory is not None})
        return {"residuals": residuals, "steps": dict(self._steps)}

    def load_state_dict(self, state):
        self._steps = dict(state.get("steps", {}))
        self._restored = dict(state.get("residuals", {}))
        for k, s in self._sessions.items():
            if s.memory is not None:
                s.memory.load_state_dict(self._restored.pop(_key_str(k), {}))


# The default StockCompression of each codec object (what codec.compress / decompress use).
_DEFAULTS = {}


def stock_compression(codec):
    """The StockCompression that ``codec.compress`` / ``codec.decompress`` use (created on first use)."""
    sc = _DEFAULTS.get(id(codec))
    if sc is None or sc.codec is not codec:
        sc = _DEFAULTS[id(codec)] = StockCompression(codec)
        try:
            weakref.finalize(codec, _DEFAULTS.pop, id(codec), None)
        except TypeError:       # not weak-referenceable: keep it for the process's lifetime
            pass
    return sc


def compress(codec, tensor):
    return stock_compression(codec).compress(tensor)


def decompress(codec, tensor, ctx):
    return stock_compression(codec).decompress(tensor, ctx)
