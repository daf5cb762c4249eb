"""``GradientReducer``: the compressed gradient reduction behind every TensorFlow entry point (Horovod's
wrappers with their ``_allreduce_grads(grads, vars)`` replaced by one). Per traced signature it plans
(:func:`hvd_quant.plan.make_plan`: buckets, and ``hvd.allreduce`` for the rest), runs the configuration
handshake at the first execution, and builds each bucket's exchange into the graph (``_graph.py``);
while ``step < warmup_steps`` (a ``tf.cond``) every gradient takes ``hvd.allreduce`` instead. A
``Trackable``: its state is saved per rank as one string (docs/TENSORFLOW.md, "Checkpoints").
"""
import functools
import io
import json
import os
import threading
import types

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from .. import plan as _plan
from ..exchange import AVERAGE, Exchange, Memory, Traffic
from ..scheduler import step_metrics
from . import _backend
from ._backend import OPS
from ._graph import GraphExchange, allreduce, gradient_names, graph_collectives, numpy_step, plan_gradients


__all__ = ["GradientReducer"]

_PREFIX = "hvdq.tf"
_Trackable = tf.__internal__.tracking.Trackable


class GradientReducer(_Trackable):
    """Reduce a list of gradients across ranks with a compressed exchange (module doc).

    Arguments: Horovod's, and hvd_quant's (docs/TENSORFLOW.md, the table); ``device_exchange=True``
    raises (docs/TENSORFLOW.md, "GPU"). Called as Horovod calls its own, ``reducer(grads, vars)`` ->
    reduced grads (``None`` stays ``None``), eagerly (it wraps itself in a ``tf.function``) or in a graph.
    """

    def __init__(self, compression=None, op=None, reduction="sra", bucket_bytes=_plan.BUCKET_BYTES,
                 min_compress_numel=1024, warmup_steps=0, error_feedback=None, compress_1d=False,
                 gradient_predivide_factor=1.0, groups=None, sparse_as_dense=False,
                 process_set=None, device_dense="", device_sparse="", device_exchange=False):
        if device_exchange:
            raise ValueError(f"hvd_quant: {_backend.GPU_REFUSED}")
        op = _backend.core_op(op)
        _plan.check_reduction(reduction, auto=False)   # "auto" is measured by the PyTorch paths only
        _plan.check_groups(groups, "tf.Variable")
        self.config = _plan.configure(
            _backend.resolve_codec(compression), reduction=reduction, bucket_bytes=bucket_bytes,
            min_compress_numel=min_compress_numel, compress_1d=compress_1d, warmup_steps=warmup_steps,
            error_feedback=error_feedback, op=op, predivide=gradient_predivide_factor)
        self.op, self.codec, self.reduction = op, self.config.codec, reduction
        self.warmup_steps, self.error_feedback = self.config.warmup_steps, self.config.error_feedback
        self.groups, self.sparse_as_dense = groups, bool(sparse_as_dense)
        self.process_set = hvd.global_process_set if process_set is None else process_set
        self.device_dense, self.device_sparse = device_dense, device_sparse
        self.memory = Memory(OPS) if self.error_feedback else None
        with tf.init_scope():
            # reductions run so far (warm-up), saved and restored with the state
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="hvd_quant_step")
        self._traces = {}
        self._engine = None
        self._lock = threading.RLock()
        self._restored = {}            # var name -> residual, until its bucket is planned
        self._restored_server = {}
        self._steps = {}               # exchange name -> executions (its engine's counters)
        self.last_traffic = Traffic()
        self._last = (None, ())        # (plan, routes) of the last reduction (step_metrics)
        self._eager_fn = tf.function(self._reduce, autograph=False)

    # -- configuration --------------------------------------------------------------------------------
    def _connect(self):
        coll = graph_collectives(self.process_set)
        if self._engine is None or self._engine.exchange.coll is not coll:
            exchange = Exchange(self.codec, coll, OPS, reduction=self.reduction, memory=self.memory, prefix=_PREFIX)
            self._engine = GraphExchange(exchange, self.process_set, self._steps)
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
        plan, key = plan_gradients(self.config, grads, names, _PREFIX, groups)
        dense = [(i, int(np.prod(grads[i].shape.as_list(), dtype=np.int64))) for i in plan.plain
                 if isinstance(grads[i], tf.Tensor) and grads[i].shape.is_fully_defined()]
        comp = [(i, n) for b in plan.buckets for i, n in zip(b.members, b.numels)]

        def traffic(pairs):             # (bytes, elements) of an fp32 allreduce of these gradients
            return (sum(n * _backend.sendable_dtype(grads[i].dtype).size for i, n in pairs),
                    sum(n for _, n in pairs))
        trace = self._traces[sig] = types.SimpleNamespace(plan=plan, names=names, key=key, plain=traffic(dense),
                                                          warm=traffic(dense + comp))
        self._apply_restored([trace])
        return trace

    # -- reduction ------------------------------------------------------------------------------------
    def __call__(self, grads, vars=None, use_generic_names=False):  # noqa: A002 - Horovod's signature
        grads = list(grads)
        variables = list(vars) if vars is not None else None
        # The names are a Python argument, hence part of the trace key: tf.function would otherwise
        # reuse a trace (and its collectives' names) for other variables of the same shapes.
        names = gradient_names(grads, variables)
        if tf.executing_eagerly():
            return self._eager_fn(grads, variables, names)
        return self._reduce(grads, variables, names)

    def _allreduce(self, g, name):
        pre, post = self.config.allreduce_factors()
        return allreduce(g, f"{_PREFIX}.p.{name}", op=_backend.hvd_op(self.op), prescale_factor=pre,
                         postscale_factor=post, process_set=self.process_set, device_dense=self.device_dense,
                         device_sparse=self.device_sparse)

    def _compressed(self, engine, plan, grads):
        # op=Average: 1/N of the size when the graph runs (elastic Horovod changes it under a trace),
        # rounded to float32 as a Python constant 1/N would be
        scale = None
        if self.op == AVERAGE:
            n = tf.cast(hvd.size_op(process_set_id=self.process_set.process_set_id), tf.float64)
            scale = tf.cast(tf.constant(1.0, tf.float64) / n, tf.float32)
        out = engine.build_buckets(plan.buckets, grads, scale)
        return [out[i] if grads[i].dtype == tf.float32 else tf.cast(out[i], grads[i].dtype)
                for i in plan.compressed]

    def _reduce(self, grads, variables, names):
        grads = list(grads)
        if self.sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        ps = self.process_set
        if not ps.included() or (ps.size() <= 1 and os.environ.get("HOROVOD_ELASTIC") != "1"):
            return grads        # elastic: the world may grow under this trace, as in Horovod
        with self._lock:
            engine = self._connect()
            trace = self._trace_for(grads, variables, list(names))
        plan = trace.plan
        ok = engine.handshake(trace.key, plan.record, "hvd_quant.tensorflow gradient reduction")
        out = list(grads)
        with tf.control_dependencies([ok]):
            for i in plan.plain:
                out[i] = self._allreduce(grads[i], trace.names[i])
            if plan.compressed and self.warmup_steps > 0:
                warm = self.step < self.warmup_steps
                reduced = tf.cond(
                    warm, lambda: [self._allreduce(grads[i], trace.names[i]) for i in plan.compressed],
                    lambda: self._compressed(engine, plan, grads))
            else:
                warm = tf.constant(False)
                reduced = self._compressed(engine, plan, grads) if plan.compressed else []
            for i, r in zip(plan.compressed, reduced):
                out[i] = r
            with tf.control_dependencies([t for t in out if isinstance(t, tf.Tensor)]):
                self.step.assign_add(1)
                numpy_step(functools.partial(self._account, engine, trace), [warm], tf.int64, [],
                           "hvdq_account")
        return out

    def _account(self, engine, trace, warm):
        """The step's traffic (fp32 allreduces: the plain gradients, and in warm-up every one)."""
        with engine.lock:
            t = engine.exchange.traffic
            t.add_allreduce(*(trace.warm if warm else trace.plain), engine.exchange.coll.size)
            t.seconds = engine.take_seconds()
            self.last_traffic = t.copy()
            t.reset()
        self._last = (trace.plan, [_plan.ALLREDUCE if warm else self.reduction] * len(trace.plan.buckets))
        return np.int64(0)

    def bytes_per_step(self):
        """:class:`hvd_quant.exchange.Traffic` of the last reduction."""
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
        {(bucket header, rank, size): array}, "exchange_steps": {bucket: count}}``: this rank's, copied."""
        with self._lock:
            residuals, server = dict(self._restored), dict(self._restored_server)
            for trace in self._traces.values() if self.memory is not None else ():
                worker, own = _plan.save_residuals(self.memory, trace.plan.buckets, lambda a: np.array(a, np.float32))
                residuals.update(worker)
                server.update(own)
            # the counters without the prefix: a checkpoint restores into another instance
            steps = {k.removeprefix(_PREFIX + "."): v for k, v in self._steps.items()}
        return {"step": int(self.step.numpy()), "codec": self.codec.spec(),
                "reduction": self.reduction, "residuals": residuals, "server_residuals": server,
                "exchange_steps": steps}

    def load_state_dict(self, state):
        """Restore what :meth:`state_dict` returned."""
        with self._lock:
            self.step.assign(int(state.get("step", 0)))
            self._steps.clear()
            self._steps.update({f"{_PREFIX}.{k}": int(v) for k, v in state.get("exchange_steps", {}).items()})
            if self.memory is None:
                return
            self.memory.clear()
            self._restored = {k: np.array(v, np.float32) for k, v in state.get("residuals", {}).items()}
            self._restored_server = {tuple(k): np.array(v, np.float32).reshape(-1)
                                     for k, v in state.get("server_residuals", {}).items()
                                     if isinstance(k, tuple) and len(k) == 3}
            self._apply_restored(self._traces.values())

    def _apply_restored(self, traces):
        if self.memory is None or not (self._restored or self._restored_server):
            return
        for trace in traces:        # kept on the host until the exchange fetches them
            _plan.restore_residuals(self.memory, trace.plan.buckets, self._restored, self._restored_server,
                                    OPS.flatten)

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
        worker, server = sorted(st["residuals"].items()), sorted(st["server_residuals"].items())
        arrays = {f"r{k}": v for k, (_, v) in enumerate(worker)} | {f"s{k}": v for k, (_, v) in enumerate(server)}
        meta = {"format": 2, "step": st["step"], "codec": st["codec"], "reduction": st["reduction"],
                "residuals": [n for n, _ in worker], "server_residuals": [list(k) for k, _ in server],
                "exchange_steps": st["exchange_steps"]}
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
        return {"state": numpy_step(lambda: np.array(self.serialize(), dtype=object), [], tf.string, [],
                                    "hvdq_serialize")}

    def _restore_from_tensors(self, restored_tensors):
        t = restored_tensors["state"]
        if tf.executing_eagerly():
            self.deserialize(t.numpy())
            return None
        return numpy_step(lambda b: (self.deserialize(b), np.int64(0))[1], [t], tf.int64, [],
                          "hvdq_deserialize")
