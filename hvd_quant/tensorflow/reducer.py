"""``GradientReducer``: the compressed gradient reduction behind every TensorFlow entry point.

Horovod's TensorFlow wrappers (``DistributedGradientTape``, ``DistributedOptimizer`` and the Keras
``DistributedOptimizer``) all reduce gradients through one function, ``_allreduce_grads(grads, vars)``.
hvd_quant's wrappers are Horovod's own, with that function replaced by a :class:`GradientReducer`:

1. **Plan** (when tracing, :func:`hvd_quant.plan.make_plan`): compressible gradients are fused, in
   reverse variable order, into buckets of at most ``bucket_bytes`` of float32, or as ``groups``
   says; the others (1-D, small, ``tf.IndexedSlices`` unless ``sparse_as_dense``) go through
   ``hvd.allreduce``, which Horovod fuses.
2. **Handshake** (first execution): one allgather of the configuration and the plan; ranks that
   differ raise :class:`~hvd_quant.exchange.ConfigMismatchError` on every rank before any gradient
   collective is submitted.
3. **Exchange**: each bucket's exchange (``reduction="sra"`` or ``"allgather"``) is built into the
   graph (``hvd_quant/tensorflow/_graph.py``) and returns the float32 sum over ranks;
   ``op=hvd.Average`` divides it by N; it is split back into the gradients, reshaped and cast.
   TensorFlow runs buckets as their gradients become ready, overlapping with the rest of backward.
4. **Warm-up**: while ``step < warmup_steps`` (a variable saved with the state) every gradient goes
   through full-precision ``hvd.allreduce`` instead (a ``tf.cond``, so one trace serves both phases).

Error-feedback residuals live in the core's :class:`~hvd_quant.memory.Memory`. The reducer is a
TensorFlow ``Trackable``: ``tf.train.Checkpoint(..., hvd_quant=reducer)`` saves, per rank, the step
and the residuals keyed by **variable name** (SRA's "server" residuals by ``(bucket header, rank,
size)``) as one serialized string, and restores them bit-exactly, before or after the first step.
The Keras and legacy optimizers track their reducer as the dependency ``hvd_quant``.
"""
import io
import json
import os
import threading

import numpy as np
import tensorflow as tf

from .. import plan as _plan
from ..exchange import AVERAGE, HANDSHAKE_NAME, Exchange, Traffic
from ..memory import Memory
from ..scheduler import step_metrics
from . import _backend
from ._backend import OPS, op_name
from ._graph import (GraphExchange, build_buckets, describe_gradient, graph_collectives,
                     gradient_names)


__all__ = ["GradientReducer"]

_PREFIX = "hvdq.tf"
_Trackable = tf.__internal__.tracking.Trackable


class _Trace:
    """The plan of one traced signature and what the graph needs beside it."""
    __slots__ = ("plan", "key", "names", "plain_nbytes", "plain_numel")


def _host_copy(a):
    """A residual as a new float32 NumPy array."""
    return np.array(a, np.float32)


def _join(arrays):
    return np.concatenate([np.asarray(a, np.float32).reshape(-1) for a in arrays])


class GradientReducer(_Trackable):
    """Reduce a list of gradients across ranks with a compressed exchange (module doc).

    Arguments are Horovod's (``op``, ``gradient_predivide_factor``, ``groups``, ``sparse_as_dense``,
    ``process_set``, ``device_dense``, ``device_sparse``) plus ``compression`` (a codec, a spec
    string or ``hvd.Compression.none/fp16``), ``reduction`` (``"sra"`` | ``"allgather"`` | ``"two_level"``),
    ``bucket_bytes`` (default 25 MiB), ``min_compress_numel`` (default 1024), ``compress_1d``,
    ``warmup_steps`` and ``error_feedback`` (default: what the codec wants). ``device_exchange=True``
    raises (:data:`~hvd_quant.tensorflow._backend.GPU_REFUSED`): GPU gradients take the host steps.

    Call it as Horovod calls its own: ``reducer(grads, vars)`` -> reduced grads (``None`` stays
    ``None``), eagerly (it wraps itself in a ``tf.function``) or inside a graph.
    """

    def __init__(self, compression=None, op=None, reduction="sra", bucket_bytes=_plan.BUCKET_BYTES,
                 min_compress_numel=1024, warmup_steps=0, error_feedback=None, compress_1d=False,
                 gradient_predivide_factor=1.0, groups=None, sparse_as_dense=False,
                 process_set=None, device_dense="", device_sparse="", device_exchange=False):
        import horovod.tensorflow as hvd
        op = _backend.core_op(op)
        _plan.check_reduction(reduction, auto=False)   # "auto" is measured by the PyTorch paths only
        _plan.check_groups(groups, "tf.Variable")
        self.config = _plan.configure(
            _backend.resolve_codec(compression), reduction=reduction, bucket_bytes=bucket_bytes,
            min_compress_numel=min_compress_numel, compress_1d=compress_1d, warmup_steps=warmup_steps,
            error_feedback=error_feedback, op=op, predivide=gradient_predivide_factor)
        self.op, self.codec, self.reduction = op, self.config.codec, reduction
        self.warmup_steps, self.error_feedback = self.config.warmup_steps, self.config.error_feedback
        self.groups = groups
        self.sparse_as_dense = bool(sparse_as_dense)
        self.process_set = hvd.global_process_set if process_set is None else process_set
        self.device_dense, self.device_sparse = device_dense, device_sparse
        self._prefix = _PREFIX
        self.memory = Memory(OPS) if self.error_feedback else None
        if device_exchange:
            raise ValueError(f"hvd_quant: {_backend.GPU_REFUSED}")
        with tf.init_scope():
            self._step = tf.Variable(0, dtype=tf.int64, trainable=False, name="hvd_quant_step")
        self._traces = {}
        self._engine = None
        self._lock = threading.RLock()
        self._restored = {}            # var name -> residual, until its bucket is planned
        self._restored_server = {}
        self._restored_steps = {}      # exchange name -> executions (stochastic rounding's counter)
        self.last_traffic = Traffic()
        self._last = (None, ())        # (plan, routes) of the last reduction (step_metrics)
        self._eager_fn = tf.function(self._reduce, autograph=False)

    # -- configuration --------------------------------------------------------------------------------
    @property
    def step(self):
        """Reductions run so far (a tf.Variable; saved and restored with the state)."""
        return self._step

    def summary(self):
        return self.config.summary()

    def _connect(self):
        ps = self.process_set
        coll = graph_collectives(ps)
        if self._engine is None or self._engine.exchange.coll is not coll:
            exchange = Exchange(self.codec, coll, OPS, reduction=self.reduction, memory=self.memory,
                                prefix=self._prefix)
            steps = self._engine.steps if self._engine is not None else self._restored_steps
            self._engine = GraphExchange(exchange, ps)
            self._engine.steps.update(steps)
        return self._engine

    # -- plan -----------------------------------------------------------------------------------------
    def _trace_for(self, grads, variables, names):
        sig = tuple((n, None if g is None else (type(g).__name__, g.dtype.name, str(g.shape)))
                    for n, g in zip(names, grads))
        trace = self._traces.get(sig)
        if trace is not None:
            return trace
        groups = self.groups
        if isinstance(groups, (list, tuple)):
            index = {v.ref(): i for i, v in enumerate(variables or ())}
            groups = [[index[v.ref()] for v in grp if v.ref() in index] for grp in groups] \
                if variables is not None else None
        plan = _plan.make_plan(self.config, [describe_gradient(n, g) for n, g in zip(names, grads)], groups,
                               prefix=self._prefix)
        trace = _Trace()
        trace.plan, trace.names = plan, names
        dense = [(grads[i], int(np.prod(grads[i].shape.as_list(), dtype=np.int64))) for i in plan.plain
                 if isinstance(grads[i], tf.Tensor) and grads[i].shape.is_fully_defined()]
        trace.plain_numel = sum(n for _, n in dense)
        trace.plain_nbytes = sum(n * _backend.sendable_dtype(g.dtype).size for g, n in dense)
        # One handshake per plan, named after every variable it reduces: ranks configured differently
        # meet in it and raise (ranks with differently named variables would not meet in Horovod anyway).
        trace.key = f"{HANDSHAKE_NAME}.tf.{_plan.digest(names)}"
        self._traces[sig] = trace
        self._apply_restored([trace])
        return trace

    # -- reduction ------------------------------------------------------------------------------------
    def __call__(self, grads, vars=None, use_generic_names=False):  # noqa: A002 - Horovod's signature
        grads = list(grads)
        variables = list(vars) if vars is not None else None
        # The names are a Python argument, hence part of the trace key: tf.function would otherwise
        # reuse a trace (and its names, hence its collectives' names) for other variables of the
        # same shapes.
        names = gradient_names(grads, variables)
        if tf.executing_eagerly():
            return self._eager_fn(grads, variables, names)
        return self._reduce(grads, variables, names)

    def _allreduce(self, g, name):
        import horovod.tensorflow as hvd
        pre, post = self.config.allreduce_factors()
        hop = _backend.hvd_op(self.op)
        nm = op_name(f"{self._prefix}.p.{name}")
        if isinstance(g, tf.Tensor) and _backend.sendable_dtype(g.dtype) != g.dtype:
            out = hvd.allreduce(tf.cast(g, tf.float32), op=hop, prescale_factor=pre,
                                postscale_factor=post, name=nm, ignore_name_scope=True,
                                process_set=self.process_set, device_dense=self.device_dense)
            return tf.cast(out, g.dtype)
        return hvd.allreduce(g, op=hop, prescale_factor=pre, postscale_factor=post, name=nm,
                             ignore_name_scope=True, process_set=self.process_set,
                             device_dense=self.device_dense, device_sparse=self.device_sparse)

    def _compressed(self, engine, plan, grads):
        # op=Average: 1/N of the size when the graph runs (elastic Horovod changes it under a trace),
        # rounded to float32 as a Python constant 1/N would be
        scale = None
        if self.op == AVERAGE:
            n = tf.cast(engine.world_size(), tf.float64)
            scale = tf.cast(tf.constant(1.0, tf.float64) / n, tf.float32)
        out = build_buckets(plan.buckets, grads, lambda b, flat: engine.build(
            b.name, flat, header=b.header), scale)
        return [out[i] if grads[i].dtype == tf.float32 else tf.cast(out[i], grads[i].dtype)
                for i in plan.compressed]

    def _reduce(self, grads, variables, names=None):
        grads = list(grads)
        if names is None:
            names = gradient_names(grads, variables)
        if self.sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        ps = self.process_set
        if not ps.included() or (ps.size() <= 1 and os.environ.get("HOROVOD_ELASTIC") != "1"):
            return grads        # elastic: the world may grow under this trace, as in Horovod
        with self._lock:
            engine = self._connect()
            trace = self._trace_for(grads, variables, list(names))
        plan = trace.plan
        ok = engine.handshake(trace.key, plan.record, "hvd_quant.tensorflow gradient reduction",
                              name=trace.key)
        out = list(grads)
        with tf.control_dependencies([ok]):
            for i in plan.plain:
                out[i] = self._allreduce(grads[i], trace.names[i])
            comp_numel = plan.compressed_numel
            comp_bytes = sum(n * _backend.sendable_dtype(grads[i].dtype).size
                             for b in plan.buckets for i, n in zip(b.members, b.numels))
            if plan.compressed and self.warmup_steps > 0:
                warm = self._step < self.warmup_steps
                reduced = tf.cond(
                    warm, lambda: [self._allreduce(grads[i], trace.names[i]) for i in plan.compressed],
                    lambda: self._compressed(engine, plan, grads))
                extra_bytes = tf.where(warm, np.int64(comp_bytes), np.int64(0))
                extra_numel = tf.where(warm, np.int64(comp_numel), np.int64(0))
            else:
                reduced = self._compressed(engine, plan, grads) if plan.compressed else []
                extra_bytes = extra_numel = tf.constant(0, tf.int64)
            for i, r in zip(plan.compressed, reduced):
                out[i] = r
            tail = [t for t in out if isinstance(t, tf.Tensor)]
            with tf.control_dependencies(tail):
                self._step.assign_add(1)
                self._account_op(engine, trace, extra_bytes, extra_numel)
        return out

    def _account_op(self, engine, trace, extra_bytes, extra_numel):
        def account(nbytes, numel):
            seconds = engine.take_seconds()
            with engine.lock:
                size = engine.exchange.coll.size
                t = engine.exchange.traffic
                t.add_allreduce(trace.plain_nbytes + int(nbytes), trace.plain_numel + int(numel), size)
                t.seconds = seconds
                self.last_traffic = t.copy()
                t.reset()
            warm = int(nbytes) > 0 or int(numel) > 0     # warm-up: the buckets went uncompressed
            route = _plan.ALLREDUCE if warm else self.reduction
            self._last = (trace.plan, [route] * len(trace.plan.buckets))
            return np.int64(0)
        with tf.device("/cpu:0"):
            return tf.numpy_function(account, [extra_bytes, extra_numel], tf.int64, stateful=True,
                                     name="hvdq_account")

    def bytes_per_step(self):
        """:class:`hvd_quant.exchange.Traffic` of the last reduction: bytes this rank sent and what an
        fp32 ring allreduce of the same gradients would have sent (``.sent_bytes``, ``.fp32_bytes``,
        ``.ratio``)."""
        return self.last_traffic

    def step_metrics(self):
        """What the last reduction did (:func:`hvd_quant.scheduler.step_metrics`; ``exchange_s``: host time
        from the first compressed exchange's start to its last finish, None without one)."""
        plan, routes = self._last
        if plan is None:
            return None
        return step_metrics(plan, self.last_traffic, routes, self.codec.spec())

    # -- state ----------------------------------------------------------------------------------------
    def state_dict(self):
        """``{"step", "codec", "reduction", "residuals": {var name: array}, "server_residuals":
        {(bucket header, rank, size): array}, "exchange_steps": {bucket: count}}`` (NumPy copies;
        this rank's). The exchange counters key the stochastic rounding, so a restored run draws the
        same noise."""
        residuals, server = {}, {}
        with self._lock:
            for trace in self._traces.values():
                if self.memory is not None:
                    worker, own = _plan.save_residuals(self.memory, trace.plan.buckets, _host_copy)
                    residuals.update(worker)
                    server.update(own)
            residuals.update({k: v for k, v in self._restored.items() if k not in residuals})
            for k, v in self._restored_server.items():
                server.setdefault(k, v)
            steps = {self._rel(k): v for k, v in
                     (self._engine.steps if self._engine is not None else self._restored_steps).items()}
        return {"step": int(self._step.numpy()), "codec": self.codec.spec(),
                "reduction": self.reduction, "residuals": residuals, "server_residuals": server,
                "exchange_steps": steps}

    def load_state_dict(self, state):
        """Restore what :meth:`state_dict` returned (server residuals keyed otherwise than by
        ``(bucket header, rank, size)`` are ignored)."""
        with self._lock:
            self._step.assign(int(state.get("step", 0)))
            steps = {self._abs(k): int(v) for k, v in state.get("exchange_steps", {}).items()}
            if self._engine is not None:
                self._engine.steps.clear()
                self._engine.steps.update(steps)
            else:
                self._restored_steps = steps
            if self.memory is None:
                return
            self.memory.clear()
            self._restored = {k: np.array(v, np.float32) for k, v in state.get("residuals", {}).items()}
            self._restored_server = {tuple(k): np.array(v, np.float32).reshape(-1)
                                     for k, v in state.get("server_residuals", {}).items()
                                     if isinstance(k, tuple) and len(k) == 3}
            self._apply_restored(self._traces.values())

    # Exchange names start with this instance's prefix (``hvdq.tf``); the state stores the exchange
    # counters without it, so a checkpoint restores into another instance (another process, another order).
    def _rel(self, key):
        p = self._prefix + "."
        return key[len(p):] if key.startswith(p) else key

    def _abs(self, key):
        return f"{self._prefix}.{key}"

    def _apply_restored(self, traces):
        if self.memory is None or not (self._restored or self._restored_server):
            return
        for trace in traces:
            # residuals are kept on the host until the exchange fetches them
            _plan.restore_residuals(self.memory, trace.plan.buckets, self._restored, self._restored_server,
                                    _join)

    def reset_residuals(self):
        """Forget every error-feedback residual (e.g. after restoring another rank's checkpoint)."""
        with self._lock:
            if self.memory is not None:
                self.memory.clear()
            self._restored, self._restored_server = {}, {}

    # The whole state as one string tensor: the set of residual names is only known once the model
    # has been traced, and TensorFlow restores by keys known at restore time.
    def serialize(self):
        """The state as bytes (NumPy ``.npz``; no pickle)."""
        st = self.state_dict()
        arrays, rnames, snames = {}, [], []
        for k, (name, v) in enumerate(sorted(st["residuals"].items())):
            arrays[f"r{k}"] = v
            rnames.append(name)
        for k, (key, v) in enumerate(sorted(st["server_residuals"].items())):
            arrays[f"s{k}"] = v
            snames.append(list(key))
        meta = {"format": 2, "step": st["step"], "codec": st["codec"], "reduction": st["reduction"],
                "residuals": rnames, "server_residuals": snames, "exchange_steps": st["exchange_steps"]}
        buf = io.BytesIO()
        np.savez(buf, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
        return buf.getvalue()

    def deserialize(self, data):
        with np.load(io.BytesIO(bytes(data)), allow_pickle=False) as z:
            meta = json.loads(z["meta"].tobytes().decode())
            state = {"step": meta["step"], "exchange_steps": meta.get("exchange_steps", {}),
                     "residuals": {n: z[f"r{k}"] for k, n in enumerate(meta["residuals"])},
                     "server_residuals": {tuple(n): z[f"s{k}"] for k, n in enumerate(meta["server_residuals"])
                                          if meta.get("format") == 2}}
        self.load_state_dict(state)

    def _serialize_to_tensors(self):
        if tf.executing_eagerly():
            return {"state": tf.constant(self.serialize())}
        with tf.device("/cpu:0"):
            t = tf.numpy_function(lambda: np.array(self.serialize(), dtype=object), [], tf.string,
                                  stateful=True)
        t.set_shape([])
        return {"state": t}

    def _restore_from_tensors(self, restored_tensors):
        t = restored_tensors["state"]
        if tf.executing_eagerly():
            self.deserialize(t.numpy())
            return None
        with tf.device("/cpu:0"):
            return tf.numpy_function(lambda b: (self.deserialize(b), np.int64(0))[1], [t], tf.int64,
                                     stateful=True)
