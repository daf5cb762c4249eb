"""``hvd_quant.tensorflow.keras.DistributedOptimizer``: Horovod's Keras optimizer wrapper with a
compressed gradient exchange, for ``model.fit`` with Keras 2: ``tf.keras`` of TensorFlow 2.15, or
``tf_keras`` with ``TF_USE_LEGACY_KERAS=1`` (a Keras 3 optimizer is refused).

Horovod's Keras callbacks work unchanged (``hvd.callbacks.BroadcastGlobalVariablesCallback(0)``,
``MetricAverageCallback()``, ...); they are re-exported here as ``callbacks`` for convenience.
"""
from horovod.tensorflow.keras import callbacks  # noqa: F401

from ..wrappers import KerasDistributedOptimizer as DistributedOptimizer
from ..wrappers import bytes_sent_per_step, reducer_of, step_metrics

__all__ = ["DistributedOptimizer", "bytes_sent_per_step", "reducer_of", "step_metrics", "callbacks"]
