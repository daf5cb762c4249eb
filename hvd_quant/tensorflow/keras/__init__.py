"""``DistributedOptimizer``: Horovod's Keras wrapper with a compressed gradient exchange, for ``model.fit``
with Keras 2 (docs/TENSORFLOW.md); Horovod's Keras ``callbacks``, re-exported unchanged.
"""
from horovod.tensorflow.keras import callbacks  # noqa: F401

from ..wrappers import KerasDistributedOptimizer as DistributedOptimizer
from ..wrappers import bytes_sent_per_step, reducer_of, step_metrics

__all__ = ["DistributedOptimizer", "bytes_sent_per_step", "reducer_of", "step_metrics", "callbacks"]
