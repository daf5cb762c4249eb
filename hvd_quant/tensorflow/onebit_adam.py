"""``hvd_quant.tensorflow.OneBitAdam``: 1-bit Adam (Tang et al., 2021) as a Keras 2 optimizer.

The algorithm of ``hvd_quant.torch.OneBitAdam`` (its module docstring) in Keras's Adam:

1. Steps 1..``freeze_step``: every gradient is averaged by Horovod's fp32 allreduce, then Keras's
   ``Adam.update_step`` runs on the average (the same operations as ``tf.keras.optimizers.Adam``).
2. Later steps: the variance stays; each rank forms its momentum from its own gradient,
   ``m += (g_local - m) * (1 - beta_1)``, and the momenta are averaged by a
   :class:`~hvd_quant.tensorflow.GradientReducer` (SRA, :class:`hvd_quant.OneBit`, worker and server
   error feedback, every variable compressed): the frontend's reduction, not another exchange.
   Every rank decodes the same bytes, so momentum and weights stay bit-identical across ranks.
3. ``w -= lr * sqrt(1 - beta_2^T) / (1 - beta_1^t) * m / (sqrt(v) + epsilon)`` with
   ``T = freeze_step``: Keras's bias correction, the variance's frozen with it.

``weight_decay`` is Keras's (decoupled: ``w -= lr * weight_decay * w`` before the update). The phase
is read from ``iterations`` inside the graph (a ``tf.cond``), so one trace of ``fit``'s train
function serves both phases, and ``hvd.broadcast_variables(opt.variables())`` carries it.
Checkpoints: ``iterations``, ``m`` and ``v`` are the optimizer's variables; the residuals are the
reducer's, tracked as the dependency ``hvd_quant`` (``tf.train.Checkpoint(optimizer=opt)`` saves them).
"""
import numbers

import horovod.tensorflow as hvd
import tensorflow as tf

from .. import plan as _plan
from ..codecs import OneBit
from ..exchange import Traffic
from ._backend import op_name, resolve_codec
from .reducer import GradientReducer

__all__ = ["OneBitAdam"]

_Adam = tf.keras.optimizers.Adam


class OneBitAdam(_Adam):
    """1-bit Adam over Horovod for Keras 2 (module docstring: the algorithm).

    Arguments are ``tf.keras.optimizers.Adam``'s (``learning_rate`` may be a schedule) and:
        freeze_step: required; the warm-up steps of exact Adam on fp32-averaged gradients, after which
            the variance is frozen and the momentum travels in 1 bit (DeepSpeed advises 15-25% of
            the run).
        bucket_bytes: momenta are fused into buckets of at most this many float32 bytes (0: one).
        compression: a :class:`hvd_quant.OneBit` codec with error feedback, or its spec string;
            default ``OneBit(bucket_size=1024)``.
        process_set: the Horovod process set averaged over.

    ``amsgrad`` and gradient clipping (``clipnorm``, ``clipvalue``, ``global_clipnorm``) raise: the
    frozen phase exchanges momenta, not gradients. ``tf.IndexedSlices`` gradients are made dense and a
    missing gradient counts as zeros, as in Horovod. The variables are fixed at the first
    ``apply_gradients``; another list raises ``ValueError``. Use it as any Keras optimizer, without a
    Horovod wrapper (it averages itself)::

        opt = hvd_quant.tensorflow.OneBitAdam(1e-3, freeze_step=2000)
        model.compile(optimizer=opt, loss=...); model.fit(..., callbacks=[
            hvd.keras.callbacks.BroadcastGlobalVariablesCallback(0)])
        # or: grads = tape.gradient(loss, variables); opt.apply_gradients(zip(grads, variables))
    """

    def __init__(self, learning_rate=1e-3, beta_1=0.9, beta_2=0.999, epsilon=1e-7, weight_decay=None,
                 *, freeze_step, bucket_bytes=_plan.BUCKET_BYTES, compression=None, process_set=None,
                 name="OneBitAdam", **kwargs):
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, numbers.Integral) or freeze_step < 1:
            raise ValueError(f"freeze_step must be a whole number >= 1; got {freeze_step!r}")
        for bad in ("amsgrad", "clipnorm", "clipvalue", "global_clipnorm"):
            if kwargs.get(bad):
                raise ValueError(f"OneBitAdam does not take {bad}: after the freeze it exchanges momenta, "
                                 "not gradients")
        codec = OneBit(bucket_size=1024) if compression is None else resolve_codec(compression)
        if not isinstance(codec, OneBit) or not codec.error_feedback:
            raise ValueError(f"OneBitAdam exchanges the momentum with a 1-bit codec with error feedback "
                             f"(hvd_quant.OneBit()); got {codec.spec()}")
        kwargs.setdefault("jit_compile", False)
        super().__init__(learning_rate, beta_1, beta_2, epsilon, weight_decay=weight_decay, name=name,
                         **kwargs)
        self.freeze_step = int(freeze_step)
        self.process_set = hvd.global_process_set if process_set is None else process_set
        reducer = GradientReducer(codec, op=hvd.Average, reduction="sra", bucket_bytes=bucket_bytes,
                                  min_compress_numel=0, compress_1d=True, error_feedback=True,
                                  process_set=self.process_set)
        self._track_trackable(reducer, name="hvd_quant", overwrite=True)
        self.codec, self.momentum_reducer = codec, reducer
        self._planned = None        # the variables of the first apply_gradients
        self._numel = 0

    def get_config(self):
        config = super().get_config()
        config.update(freeze_step=self.freeze_step, compression=self.codec.spec())
        return config

    def _check_variables(self, variables):
        keys = tuple(self._var_key(v) for v in variables)
        if self._planned is None:
            self._planned = keys
            self._numel = sum(int(v.shape.num_elements()) for v in variables)
        elif keys != self._planned:
            raise ValueError("OneBitAdam: apply_gradients got other variables than at its first call; its "
                             "buckets, residuals and frozen variance belong to those. Use one OneBitAdam "
                             "per variable list.")

    def _momentum(self, variable):
        return self._momentums[self._index_dict[self._var_key(variable)]]

    def apply_gradients(self, grads_and_vars, name=None, skip_gradients_aggregation=False, **kwargs):
        """Average (fp32 gradients, or 1-bit momenta after the freeze), then Keras's update."""
        grads_and_vars = list(grads_and_vars)
        if not grads_and_vars:
            return self.iterations
        grads, variables = zip(*grads_and_vars)
        with tf.init_scope():
            self.build(variables)
        self._check_variables(variables)
        grads = [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g) for g, v in zip(grads, variables)]

        def average():
            return [hvd.allreduce(g, op=hvd.Average, name=op_name(f"hvdq.1bitadam.fp32.{v.name}"),
                                  ignore_name_scope=True, process_set=self.process_set)
                    for g, v in zip(grads, variables)]

        def exchange():
            m = self._momentum
            local = [m(v) + (g - m(v)) * (1 - self.beta_1) for g, v in zip(grads, variables)]
            return self.momentum_reducer(local, list(variables))

        if self.process_set.size() > 1:
            grads = tf.cond(self.iterations < self.freeze_step, average, exchange)
        else:
            grads = tf.cond(self.iterations < self.freeze_step, lambda: grads, exchange)
        return super().apply_gradients(zip(grads, variables), name=name, skip_gradients_aggregation=True)

    def update_step(self, gradient, variable):
        """Adam's step on the average up to the freeze; after it ``gradient`` is the averaged momentum."""
        def warm():
            super(OneBitAdam, self).update_step(gradient, variable)
            return tf.constant(True)

        def frozen():
            dtype = variable.dtype
            lr = tf.cast(self.learning_rate, dtype)
            step = tf.cast(self.iterations + 1, dtype)
            beta_1_power = tf.pow(tf.cast(self.beta_1, dtype), step)
            beta_2_power = tf.pow(tf.cast(self.beta_2, dtype), tf.cast(self.freeze_step, dtype))
            alpha = lr * tf.sqrt(1 - beta_2_power) / (1 - beta_1_power)
            m = self._momentum(variable)
            v = self._velocities[self._index_dict[self._var_key(variable)]]
            m.assign(gradient)
            variable.assign_sub((m * alpha) / (tf.sqrt(v) + self.epsilon))
            return tf.constant(True)

        tf.cond(self.iterations < self.freeze_step, warm, frozen)

    @property
    def frozen(self):
        """True once the variance is frozen (the next step exchanges the momentum in 1 bit)."""
        return int(self.iterations.numpy()) >= self.freeze_step

    def bytes_per_step(self):
        """This rank's bytes sent in the last step beside an fp32 ring allreduce's (a ``Traffic``):
        the fp32 allreduce's up to the freeze, the 1-bit exchange's after it."""
        if int(self.iterations.numpy()) > self.freeze_step:
            return self.momentum_reducer.bytes_per_step()
        t = Traffic()
        t.add_allreduce(4 * self._numel, self._numel, self.process_set.size())
        return t
