"""The core exchange inside a TensorFlow graph, as ``tf.numpy_function`` steps around Horovod's graph
collectives, on a *recording* Collectives table (docs/TENSORFLOW.md, "Graph mode and eager mode"); and
the backend of ``hvd_quant._stock``'s graph sessions (:func:`stock_compress`).
"""
import functools
import os
import sys
import threading
import time
import types
import weakref

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from .. import plan as _plan
from ..exchange import (HANDSHAKE_NAME, TWO_LEVEL, Collectives, Exchange, check_handshake, chunk_bounds,
                        collectives_for)
from ..scheduler import AutoChoice
from . import _backend
from ._backend import OPS, op_name, to_numpy
from .two_level import GraphTwoLevel

__all__ = ["GraphExchange", "graph_collectives", "horovod_context", "stock_compress",
           "stock_backend", "stock_adapter"]


def _deferred(t, *args, **kwargs):
    """What the core asked to send (a handle); ``result`` is filled by the numpy step after the graph op."""
    return types.SimpleNamespace(tensor=t, result=None)


def _no_allreduce(*args, **kwargs):
    raise RuntimeError("hvd_quant: the in-graph exchange uses Horovod's graph allreduce directly")


_GRAPH_COLL = {}


def graph_collectives(process_set=None):
    """The recording Collectives table (rank and size of ``process_set``) used inside graphs."""
    return collectives_for(_GRAPH_COLL, hvd.global_process_set if process_set is None else process_set,
                           lambda ps: Collectives(rank=ps.rank(), size=ps.size(), allgather_async=_deferred,
                                                  alltoall_async=_deferred, allreduce_async=_no_allreduce,
                                                  synchronize=lambda h: h.result, process_set=ps))


def numpy_step(fn, inputs, dtype, shape, name):
    """A stateful ``tf.numpy_function`` step on the host, its output of static ``shape``."""
    with tf.device("/cpu:0"):
        out = tf.numpy_function(fn, inputs, dtype, stateful=True, name=name)
    out.set_shape(shape)
    return out


def _gather_then(record, nbytes, name, ps, then, dtype, label):
    """Graph ops: Horovod's allgather of the bytes ``record()`` returns, then the numpy step
    ``then(gathered)``. The record comes from a stateful step, not a constant: Grappler would fold an
    allgather of a constant once, and a new (elastic) world would never see it."""
    rec = numpy_step(lambda: np.frombuffer(record(), np.uint8), [], tf.uint8, [nbytes], f"{label}_record")
    gathered = hvd.allgather(rec, name=name, ignore_name_scope=True, process_set=ps)
    return numpy_step(then, [gathered], dtype, [], f"{label}_check")


def allreduce(t, name, **kwargs):
    """Horovod's allreduce of ``t`` under op name ``name`` (a bfloat16 tensor travels as float32)."""
    send = _backend.FRONTEND.sendable(t) if isinstance(t, tf.Tensor) else t
    out = hvd.allreduce(send, name=op_name(name), ignore_name_scope=True, **kwargs)
    return out if send is t else tf.cast(out, t.dtype)


def _bytes(arr):
    return np.ascontiguousarray(np.asarray(arr, dtype=np.uint8).reshape(-1))


class GraphExchange:
    """Builds exchanges of one :class:`~hvd_quant.exchange.Exchange` (on a :func:`graph_collectives`
    table) into the graph being traced."""

    def __init__(self, exchange, process_set, steps=None):
        self.exchange, self.process_set = exchange, process_set
        self.lock = threading.RLock()
        self.steps = {} if steps is None else steps     # exchange name -> executions started
        self.verified = set()      # names whose handshake passed
        self.t_first = self.t_last = None      # host clock at the step's first start and last finish
        self._keys = weakref.WeakKeyDictionary()   # outermost graph -> names used in it
        self._levels = None        # reduction="two_level": its GraphTwoLevel

    def rebind(self):
        """Bind the exchange to the process set's rank and size now (under ``lock``): elastic Horovod
        changes them under a trace. A new world runs the handshakes again, its counters from zero."""
        coll = graph_collectives(self.process_set)
        if coll is self.exchange.coll:
            return
        self.exchange.coll = coll
        self.verified.clear()
        self.steps.clear()

    def take_seconds(self):
        """Seconds from the first exchange start to the last finish since the last call, or None."""
        with self.lock:
            t0, t1 = self.t_first, self.t_last
            self.t_first = self.t_last = None
        return None if t0 is None or t1 is None else t1 - t0

    def unique_key(self, base):
        """``base``, or ``base#k`` if this traced function already holds an exchange of that name."""
        g = tf.compat.v1.get_default_graph()
        while getattr(g, "outer_graph", None) is not None:
            g = g.outer_graph
        return _numbered(self._keys.setdefault(g, {}), base)

    def handshake(self, key, record, what):
        """A scalar bool op: the first execution of ``key`` (also the allgather's name) allgathers
        ``record``; ConfigMismatchError on every rank if the records differ."""
        def need():
            with self.lock:
                self.rebind()
                return np.bool_(key not in self.verified)

        def check(gathered):
            with self.lock:
                check_handshake(self.exchange.coll, OPS, record, gathered, what)
                self.verified.add(key)
            return np.bool_(True)

        flag = numpy_step(need, [], tf.bool, [], "hvdq_handshake_needed")
        return tf.cond(flag, lambda: _gather_then(lambda: record, len(record), op_name(key), self.process_set,
                                                  check, tf.bool, "hvdq_handshake"),
                       lambda: tf.constant(True))

    def build_buckets(self, buckets, grads, scale=None):
        """Graph ops of ``buckets`` (of a :func:`hvd_quant.plan.make_plan` plan) over ``grads``:
        ``{gradient index: float32 sum over ranks (times ``scale``), in the gradient's shape}``."""
        out = {}
        for b in buckets:
            parts = [tf.reshape(tf.cast(grads[i], tf.float32), [-1]) for i in b.members]
            total = self.build(b.name, parts[0] if len(parts) == 1 else tf.concat(parts, 0), header=b.header)
            if scale is not None:
                total = total * scale
            pieces = tf.split(total, list(b.numels)) if len(b.members) > 1 else [total]
            for i, piece, shape in zip(b.members, pieces, b.shapes):
                out[i] = tf.reshape(piece, shape)
        return out

    def build(self, key, flat, header, deps=()):
        """Graph ops of the float32 **sum over ranks** of the 1-D float32 ``flat`` (static size), by
        the core's reduction, in host steps (docs/TENSORFLOW.md, "GPU")."""
        ex, ps = self.exchange, self.process_set
        numel = int(flat.shape[0])
        if ex.reduction == TWO_LEVEL:
            if self._levels is None:
                self._levels = GraphTwoLevel(self, lambda cross, reduction: GraphExchange(
                    Exchange(ex.codec, graph_collectives(cross), OPS, reduction=reduction, prefix=ex.prefix), cross))
            return self._levels.build(key, flat, header, deps)
        # SRA's payload sizes follow the world, which elastic Horovod changes under a trace: they
        # are computed when the steps run, and the shapes left open
        sra = ex.reduction == "sra"
        shape = [None] if sra else [ex.codec.wire_nbytes(numel) if numel else 0]
        flight = types.SimpleNamespace(pending=None)     # from the start step to the finish step
        nm = op_name(key)
        with tf.control_dependencies(list(deps)):
            send = numpy_step(functools.partial(self._start, flight, key, header), [flat], tf.uint8, shape,
                               "hvdq_start")
        if sra:
            with tf.control_dependencies([send]):      # after start has bound the current world
                splits = numpy_step(functools.partial(self._splits, numel), [], tf.int32, [None],
                                     "hvdq_splits")
            recv, _ = hvd.alltoall(send, splits=splits, name=op_name(f"{ex.prefix}.a2a.{nm}"),
                                   ignore_name_scope=True, process_set=ps)
            send = numpy_step(functools.partial(self._advance, flight), [recv], tf.uint8, shape,
                               "hvdq_advance")
        gathered = hvd.allgather(send, name=op_name(f"{ex.prefix}.ag.{nm}"), ignore_name_scope=True,
                                 process_set=ps)
        return numpy_step(functools.partial(self._finish, flight, numel), [gathered], tf.float32,
                           [numel], "hvdq_finish")

    # The numpy steps, run at execution time under the engine's lock (the core keeps per-name state).
    def _start(self, flight, key, header, flat):
        with self.lock:
            self.rebind()
            if self.t_first is None:
                self.t_first = time.perf_counter()
            step = self.steps.get(key, 0)
            self.steps[key] = step + 1
            x = to_numpy(flat, np.float32).reshape(-1).view()
            x.flags.writeable = False          # the core must not write into TensorFlow's buffer
            flight.pending = self.exchange.start(key, x, step=step, header=header)
            return _bytes(flight.pending.handle.tensor)

    def _splits(self, numel):
        with self.lock:
            ex = self.exchange
            return np.array([ex.codec.wire_nbytes(b - a) if b > a else 0
                             for a, b in chunk_bounds(numel, ex.coll.size, ex.align)], np.int32)

    def _advance(self, flight, recv):
        with self.lock:
            p = flight.pending
            p.handle.result = np.asarray(recv).reshape(-1)
            self.exchange.advance(p)
            return _bytes(p.handle.tensor)

    def _finish(self, flight, numel, gathered):
        with self.lock:
            p, flight.pending = flight.pending, None
            p.handle.result = np.asarray(gathered).reshape(-1)
            out = self.exchange.finish(p)
            self.t_last = time.perf_counter()
            return np.ascontiguousarray(out, dtype=np.float32).reshape(numel)


def stock_backend(process_set=None):
    """(recording Collectives, ArrayOps): this module is hvd_quant._stock's backend in graphs."""
    return graph_collectives(process_set), OPS


stock_adapter = _backend.FRONTEND.stock_adapter


_CONTEXT = ("name", "process_set", "variable", "grads", "variables", "index", "op", "prescale", "postscale")


@tf.autograph.experimental.do_not_convert
def horovod_context(tensor):
    """What Horovod's frames (autograph's converted copies included) say of the gradient it compresses:
    ``allreduce`` / ``grouped_allreduce``'s arguments, then ``allreduce_grads(grads, vars)``'s lists
    and the gradient's index (by identity, else the ``i`` of the comprehension over ``enumerate(grads)``)."""
    ctx = types.SimpleNamespace(**dict.fromkeys(_CONTEXT))
    seen, index = False, None
    f = sys._getframe(1)
    for _ in range(150):
        if f is None:
            break
        if f.f_globals.get("__name__") == "horovod.tensorflow":
            base = f.f_code.co_name.removeprefix("tf__")      # autograph's converted copy
            loc = f.f_locals
            if not seen:
                if base in ("allreduce", "grouped_allreduce"):
                    seen = True
                    ctx.process_set = loc.get("process_set")
                    ctx.op = loc.get("op")
                    ctx.prescale = loc.get("prescale_factor", 1.0)
                    ctx.postscale = loc.get("postscale_factor", 1.0)
                    n = loc.get("name")
                    if base == "grouped_allreduce":
                        group = loc.get("tensor_list") or loc.get("tensors") or ()
                        idx = next((k for k, t in enumerate(group) if t is tensor), None)
                        n = f"{n}.{idx}" if isinstance(n, str) and idx is not None else None
                    if isinstance(n, str):
                        ctx.name = n
            elif base == "allreduce_grads":
                grads, variables = loc.get("grads"), loc.get("vars")
                if isinstance(grads, (list, tuple)):
                    index = next((k for k, g in enumerate(grads) if g is tensor), index)
                    if index is not None:
                        ctx.grads, ctx.index = grads, index
                        if variables is not None and len(variables) == len(grads):
                            ctx.variables = variables
                if index is not None and variables is not None and 0 <= index < len(variables):
                    ctx.variable = getattr(variables[index], "name", None)
                break
            elif index is None and "grad" in loc and isinstance(loc.get("i"), int):
                index = loc["i"]
        f = f.f_back
    return ctx


def gradient_names(grads, variables):
    """One name per gradient: its variable's (``"dense/kernel:0"``), else ``grad_<i>``; repeats get ``#k``."""
    names = ([getattr(v, "name", None) or f"grad_{i}" for i, v in enumerate(variables)]
             if variables is not None else [f"grad_{i}" for i in range(len(grads))])
    seen = {}
    return tuple(_numbered(seen, n) for n in names)


def _numbered(seen, name):
    """``name`` the first time, ``name#k`` at its k-th repeat (``seen``: name -> count, updated)."""
    k = seen.get(name, 0)
    seen[name] = k + 1
    return name if k == 0 else f"{name}#{k}"


def plan_gradients(config, grads, names, prefix, groups=None):
    """``(plan, handshake name)`` of ``grads`` named ``names`` (:func:`hvd_quant.plan.make_plan`), their
    exchanges named under ``prefix``. The handshake is named after every gradient: ranks configured
    differently meet in it and raise."""
    def describe(name, g):          # tf.IndexedSlices are not dense: never compressed
        info = _backend.FRONTEND.describe(g)
        return _plan.Tensor(name, info.shape, info.is_float and isinstance(g, tf.Tensor))

    plan = _plan.make_plan(config, [None if g is None else describe(n, g) for n, g in zip(names, grads)],
                           groups, prefix=prefix)
    return plan, f"{HANDSHAKE_NAME}.{prefix.removeprefix('hvdq.')}.{_plan.digest(names)}"


_ENGINES = weakref.WeakKeyDictionary()      # stock session -> {reduction: its GraphExchange}
_ENGINES_LOCK = threading.Lock()


def _engine(sc, process_set, reduction=None):
    """The GraphExchange of ``sc``'s session on ``process_set`` for ``reduction`` (default: the session's)."""
    session = sc.session(sys.modules[__name__], process_set)
    exchange = session.exchange if reduction is None else session.exchange_for(reduction)
    with _ENGINES_LOCK:
        engines = _ENGINES.setdefault(session, {})
        if exchange.reduction not in engines:
            engines[exchange.reduction] = GraphExchange(exchange, exchange.coll.process_set)
        return engines[exchange.reduction]


# reduction="auto" of the stock path: StockCompression -> {(process set id, plan record): GraphAuto}
_AUTOS = weakref.WeakKeyDictionary()


def _decompress(result, info, size, plain, summed_placeholder):
    """``decompress`` of a gradient whose exchange is in the graph: ``result`` times the placeholder's
    sum / ``size``, the factor Horovod would apply (op, pre/postscale). ``size``: a Python int (this path
    refuses elastic Horovod; a stateful size op would order the branches). ``plain``: under
    ``reduction="auto"``, :meth:`GraphAuto.plain`'s allreduce (one of the two is empty: the way not taken)."""
    factor = tf.cast(tf.reshape(summed_placeholder, [-1])[:1], tf.float32) / np.float32(size)
    out = _backend.FRONTEND.cast_back(result * factor, info)
    if plain is not None:
        out = tf.concat([plain, tf.reshape(out, [-1])], 0)
    return tf.reshape(out, info.shape)


class GraphAuto:
    """``reduction="auto"`` in a graph (:class:`hvd_quant.scheduler.AutoChoice`): :meth:`route`, run once
    a step (the host time between two runs), gives the index in ``CANDIDATES`` of the step's way."""
    CANDIDATES = AutoChoice.CANDIDATES

    def __init__(self, name, process_set, engines):
        self.name, self.process_set, self.engines = name, process_set, engines    # engines: reduction -> GraphExchange
        self.choice = AutoChoice()
        self.ticked = False
        self.lock = threading.Lock()

    def route(self):
        cands = self.CANDIDATES

        def tick():       # a step begins; the one before it (if any) ends
            with self.lock:
                due = self.ticked and self.choice.end_step()
                self.ticked = True
                return np.int32(-1 if due else cands.index(self.choice.current()))

        def choose(gathered):
            with self.lock:
                c = self.choice.choose(np.asarray(gathered).tobytes())
                if graph_collectives(self.process_set).rank == 0:
                    print(f"hvd_quant (compression=): {self.choice.summary()}", flush=True)
                return np.int32(cands.index(c))

        def decide():
            return _gather_then(self.choice.record, 8 * len(cands), op_name(f"{self.name}.auto"),
                                self.process_set, choose, tf.int32, "hvdq_auto")

        r = numpy_step(tick, [], tf.int32, [], "hvdq_auto_tick")
        return tf.cond(r < 0, decide, lambda: tf.identity(r))

    def bucket(self, route, b, grads):
        """Bucket ``b``'s members' float32 sums over ranks (a list) by the compressed way ``route``
        says; empty tensors on Horovod's allreduce way, which :meth:`plain` takes."""
        def way(c):
            if c == _plan.ALLREDUCE:
                return lambda: [tf.zeros([0], tf.float32) for _ in b.members]
            return lambda: list(self.engines[c].build_buckets([b], grads).values())
        return tf.switch_case(route, [way(c) for c in self.CANDIDATES])

    def plain(self, route, tensor, hctx, name):
        """Horovod's allreduce of ``tensor`` flattened (with ``hctx``, Horovod's own call's arguments)
        when ``route`` says so, else of an empty slice of it (cheaper than a ``tf.cond``)."""
        use = tf.equal(route, self.CANDIDATES.index(_plan.ALLREDUCE))
        flat = tf.reshape(tensor, [-1])
        part = tf.slice(flat, [0], tf.where(use, tf.shape(flat), tf.zeros([1], tf.int32)))
        return allreduce(part, f"{name}.ar", op=hctx.op, prescale_factor=hctx.prescale,
                         postscale_factor=hctx.postscale, process_set=self.process_set)


# outermost graph -> {(id(grads), id(sc), process set id): (grads, what _fused returns)}
_FUSED = weakref.WeakKeyDictionary()


def _fused(sc, ps, hctx):
    """``({gradient index: float32 sum over ranks}, GraphAuto or None, its route op, the names)`` of
    ``hctx``'s ``allreduce_grads`` call, built once, at its first ``compress``, in the graph that holds
    the gradients (not in Horovod's ``tf.cond`` branch). A :class:`GraphAuto` serves every trace."""
    grads = hctx.grads
    outer = next(g.graph for g in grads if isinstance(g, tf.Tensor))
    key = (id(grads), id(sc), ps.process_set_id)
    built = _FUSED.setdefault(outer, {})
    entry = built.get(key)
    if entry is not None and entry[0] is grads:
        return entry[1:]
    names = gradient_names(grads, hctx.variables)
    plan, hs = plan_gradients(sc.config, grads, names, "hvdq.stock")
    eng = _engine(sc, ps)
    with outer.as_default():
        ok = eng.handshake(hs, plan.record, "compression= of Horovod's TensorFlow gradients")
        with tf.control_dependencies([ok]):
            auto = route = None
            if not plan.buckets:
                out = {}
            elif sc.reduction == _plan.AUTO:
                autos, akey = _AUTOS.setdefault(sc, {}), (ps.process_set_id, plan.record)
                if akey not in autos:
                    engines = {r: _engine(sc, ps, r) for r in ("allgather", "sra")}
                    autos[akey] = GraphAuto(f"hvdq.stock.{plan.key}", ps, engines)
                    sc.adopt_auto(plan.key, autos[akey].choice)
                auto = autos[akey]
                route = auto.route()
                out = {i: piece for b in plan.buckets
                       for i, piece in zip(b.members, auto.bucket(route, b, grads))}
            else:
                out = eng.build_buckets(plan.buckets, grads)
    built[key] = (grads, out, auto, route, names)
    return out, auto, route, names


def stock_compress(sc, tensor):
    """hvd_quant._stock's hook for TensorFlow tensors: eager ones take the generic path; a symbolic one's
    exchange goes into the graph (its placeholder returned): inside Horovod's ``allreduce_grads`` the
    whole list's at its first ``compress`` (:func:`_fused`), elsewhere the tensor's alone."""
    from .. import _stock
    if tf.executing_eagerly() and hasattr(tensor, "numpy"):
        return sc.compress_on(_backend.FRONTEND, tensor)
    if os.environ.get("HOROVOD_ELASTIC") == "1":
        raise ValueError(
            "hvd_quant: a codec as compression= of Horovod's TensorFlow tape or optimizer inside a "
            "tf.function does not support elastic Horovod (HOROVOD_ELASTIC=1): use "
            "hvd_quant.tensorflow.DistributedGradientTape / DistributedOptimizer, which do "
            "(docs/TENSORFLOW.md, \"Elastic\")")
    adapter = _backend.FRONTEND
    info = adapter.describe(tensor)
    hctx = horovod_context(tensor)
    ps = hctx.process_set if hasattr(hctx.process_set, "process_set_id") else hvd.global_process_set
    if not sc.compressible(info):
        return _stock.uncompressed(adapter, tensor, info)
    result = plain = None
    if hctx.grads is not None:
        out, auto, route, names = _fused(sc, ps, hctx)
        result = out.get(hctx.index)
        if result is not None and auto is not None:
            plain = auto.plain(route, tensor, hctx, f"hvdq.stock.{names[hctx.index]}")
    if result is None:          # not planned with the list: exchanged alone
        eng = _engine(sc, ps)
        key = eng.unique_key(hctx.name or hctx.variable or tensor.name)
        ok = eng.handshake(f"{eng.exchange.prefix}.hs.{key}", sc.record(key, info.shape), f"tensor {key!r}")
        flat = tf.reshape(tf.cast(tensor, tf.float32), [-1])
        result = eng.build(key, flat, header=_stock.header(key, info.shape), deps=[ok])
    return adapter.placeholder(tensor), _stock._Ctx(functools.partial(_decompress, result, info, ps.size(), plain))
