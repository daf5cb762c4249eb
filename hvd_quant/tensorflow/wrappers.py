"""``hvd_quant.tensorflow.DistributedGradientTape`` / ``DistributedOptimizer`` and the Keras one:
each is Horovod's own wrapper (same arguments and behaviour) with its gradient reduction replaced by a
:class:`~hvd_quant.tensorflow.reducer.GradientReducer`, installed on the returned object only.
"""
import sys
import threading

import horovod.tensorflow as hvd
import tensorflow as tf
from horovod.tensorflow.compression import Compression as _HvdCompression

from .. import plan as _plan
from ..frontend import bytes_sent_per_step
from . import _backend
from .reducer import GradientReducer

__all__ = ["DistributedGradientTape", "DistributedOptimizer", "KerasDistributedOptimizer",
           "bytes_sent_per_step", "install_reducer", "reducer_of", "step_metrics"]

_TAPE_REDUCERS = {}
_TAPE_LOCK = threading.Lock()


def install_reducer(obj, reducer):
    """Make Horovod's wrapper ``obj`` (tape or optimizer) reduce gradients with ``reducer``, and
    track ``reducer`` under the checkpoint dependency name ``hvd_quant`` where ``obj`` is trackable."""
    object.__setattr__(obj, "_allreduce_grads", reducer)
    helper = getattr(obj, "_agg_helper", None)
    for attr in ("_allreduce_grads", "allreduce_grads"):     # backward_passes_per_step > 1
        if hasattr(helper, attr):
            setattr(helper, attr, reducer)
    track = getattr(obj, "_track_trackable", None)
    if track is not None:
        track(reducer, name="hvd_quant", overwrite=True)
    object.__setattr__(obj, "hvd_quant_reducer", reducer)
    return obj


def reducer_of(obj):
    """The :class:`GradientReducer` of an hvd_quant tape or optimizer (or ``obj`` if it is one)."""
    r = obj if isinstance(obj, GradientReducer) else getattr(obj, "hvd_quant_reducer", None)
    if r is None:
        raise TypeError(f"{type(obj).__name__} was not made by hvd_quant.tensorflow")
    return r


# GradientReducer's arguments, which every wrapper takes under the same names.
_REDUCER_ARGS = ("compression", "op", "reduction", "bucket_bytes", "min_compress_numel", "warmup_steps",
                 "error_feedback", "compress_1d", "gradient_predivide_factor", "groups",
                 "sparse_as_dense", "process_set", "device_dense", "device_sparse")


def _reducer_args(args, backward_passes_per_step=1):
    """The GradientReducer arguments among a wrapper's ``locals()``, checked (``num_groups`` as ``groups``)."""
    if args["device_exchange"]:
        raise ValueError(f"hvd_quant: {_backend.GPU_REFUSED}")
    _plan.check_backward_passes(backward_passes_per_step)
    kw = {k: args[k] for k in _REDUCER_ARGS}
    kw["op"] = _backend.core_op(kw["op"])
    if args["num_groups"] != 0 and kw["groups"] is None:
        kw["groups"] = args["num_groups"]
    return kw


def _tape_key(kw):
    key = dict(kw, process_set=kw["process_set"].process_set_id)
    try:        # codecs are immutable values: an equal codec made afresh each step finds the same reducer
        hash(kw["compression"])
    except TypeError:
        key["compression"] = id(kw["compression"])
    if isinstance(kw["groups"], (list, tuple)):
        key["groups"] = tuple(tuple(v.ref() for v in g) for g in kw["groups"])
    return tuple(key[k] for k in _REDUCER_ARGS)


def _tf_variable(v):
    """A Keras 3 variable (no ``.ref()``, which Horovod's tape needs) as its ``tf.Variable``; else ``v``."""
    if not hasattr(v, "ref") and isinstance(getattr(v, "value", None), tf.Variable):
        return v.value
    return v


def _keras3_sources(tape):
    """Let Horovod's ``tape`` take Keras 3 variables in ``gradient`` and ``register_local_source``."""
    gradient, register = tape.gradient, tape.register_local_source

    def keras3_gradient(target, sources, *args, **kwargs):
        if isinstance(sources, (list, tuple)):          # Horovod's tape zips sources with gradients
            sources = [_tf_variable(v) for v in sources]
        return gradient(target, sources, *args, **kwargs)

    object.__setattr__(tape, "gradient", keras3_gradient)
    object.__setattr__(tape, "register_local_source", lambda source: register(_tf_variable(source)))
    return tape


def DistributedGradientTape(gradtape, device_dense='', device_sparse='', compression=None,
                            sparse_as_dense=False, op=hvd.Average, gradient_predivide_factor=1.0,
                            num_groups=0, groups=None, process_set=hvd.global_process_set,
                            scale_local_gradients=True, reduction="sra", bucket_bytes=_plan.BUCKET_BYTES,
                            min_compress_numel=1024, warmup_steps=0, error_feedback=None,
                            compress_1d=False, device_exchange=False, reducer=None):
    """``horovod.tensorflow.DistributedGradientTape`` with a compressed gradient exchange: Horovod's
    arguments (the sources may be Keras 3 variables) and :class:`GradientReducer`'s. ``reducer``: one
    to use; by default tapes made with equal arguments share one (docs/TENSORFLOW.md).
    """
    if isinstance(groups, (list, tuple)):
        groups = [[_tf_variable(v) for v in g] for g in groups]
    kw = _reducer_args(locals())
    tape = hvd.DistributedGradientTape(
        gradtape, device_dense=device_dense, device_sparse=device_sparse,
        compression=_HvdCompression.none, sparse_as_dense=sparse_as_dense, op=_backend.hvd_op(kw["op"]),
        gradient_predivide_factor=gradient_predivide_factor, groups=kw["groups"], process_set=process_set,
        scale_local_gradients=scale_local_gradients)
    if reducer is None:
        key = _tape_key(kw)
        with _TAPE_LOCK:        # the entry keeps compression alive, so an id in a key is never reused
            if key not in _TAPE_REDUCERS:
                _TAPE_REDUCERS[key] = (compression, GradientReducer(**kw))
            reducer = _TAPE_REDUCERS[key][1]
    return _keras3_sources(install_reducer(tape, reducer))


# Horovod's optimizer arguments that the wrappers pass through unchanged.
_HOROVOD_OPTIMIZER_ARGS = ("name", "device_dense", "device_sparse", "sparse_as_dense",
                           "backward_passes_per_step", "gradient_predivide_factor",
                           "average_aggregated_gradients", "process_set", "scale_local_gradients")


def _keras_major(optimizer):
    """The major version of the ``keras`` package of ``optimizer``'s class; 0 for any other package."""
    top = type(optimizer).__module__.partition(".")[0]
    return int(str(getattr(sys.modules[top], "__version__", "0")).split(".")[0]) if top == "keras" else 0


def _wrap_optimizer(factory, args, **extra):
    """Horovod's optimizer wrapper ``factory`` with no compression of its own, and our reducer."""
    if _keras_major(args["optimizer"]) >= 3:
        raise TypeError(
            f"{type(args['optimizer']).__name__} is a Keras 3 optimizer, whose gradients Horovod 0.28.1 leaves "
            "unreduced: install tf_keras and set TF_USE_LEGACY_KERAS=1 before importing TensorFlow, or use "
            "hvd_quant.tensorflow.DistributedGradientTape (docs/TENSORFLOW.md, \"TensorFlow 2.19 and Keras 3\")")
    kw = _reducer_args(args, args["backward_passes_per_step"])
    opt = factory(args["optimizer"], compression=_HvdCompression.none, groups=kw["groups"],
                  op=_backend.hvd_op(kw["op"]), **{k: args[k] for k in _HOROVOD_OPTIMIZER_ARGS}, **extra)
    return install_reducer(opt, GradientReducer(**kw))


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense='', device_sparse='',
                         compression=None, sparse_as_dense=False, backward_passes_per_step=1,
                         op=hvd.Average, gradient_predivide_factor=1.0,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=hvd.global_process_set, scale_local_gradients=True,
                         reduction="sra", bucket_bytes=_plan.BUCKET_BYTES, min_compress_numel=1024,
                         warmup_steps=0, error_feedback=None, compress_1d=False,
                         device_exchange=False):
    """``horovod.tensorflow.DistributedOptimizer`` with a compressed gradient exchange (a Keras optimizer
    goes to the Keras wrapper); the reducer, ``opt.hvd_quant_reducer``, is checkpointed as ``hvd_quant``."""
    return _wrap_optimizer(hvd.DistributedOptimizer, locals(), use_locking=use_locking)


def KerasDistributedOptimizer(optimizer, name=None, device_dense='', device_sparse='',
                              compression=None, sparse_as_dense=False, gradient_predivide_factor=1.0,
                              op=hvd.Average, backward_passes_per_step=1,
                              average_aggregated_gradients=False, num_groups=0, groups=None,
                              process_set=hvd.global_process_set, scale_local_gradients=True,
                              reduction="sra", bucket_bytes=_plan.BUCKET_BYTES, min_compress_numel=1024,
                              warmup_steps=0, error_feedback=None, compress_1d=False,
                              device_exchange=False):
    """``horovod.tensorflow.keras.DistributedOptimizer`` with a compressed gradient exchange
    (exported as ``hvd_quant.tensorflow.keras.DistributedOptimizer``); use it with ``model.fit``."""
    import horovod.tensorflow.keras as hvdk
    return _wrap_optimizer(hvdk.DistributedOptimizer, locals())


def step_metrics(obj):
    """:func:`hvd_quant.scheduler.step_metrics` of an hvd_quant tape, optimizer or reducer's last step."""
    return reducer_of(obj).step_metrics()
