"""``hvd_quant.tensorflow.keras.DistributedOptimizer``: Horovod's Keras optimizer wrapper with a
compressed gradient exchange, for ``model.fit`` with Keras 2 (a Keras 3 optimizer is refused:
docs/TENSORFLOW.md). Horovod's Keras ``callbacks`` work unchanged and are re-exported here.
"""
from horovod.tensorflow.keras import callbacks  # noqa: F401

from ..wrappers import KerasDistributedOptimizer as DistributedOptimizer
from ..wrappers import bytes_sent_per_step, reducer_of, step_metrics

__all__ = ["DistributedOptimizer", "bytes_sent_per_step", "reducer_of", "step_metrics", "callbacks"]
