"""TensorFlow frontend (TensorFlow 2.15 with Keras 2, Horovod 0.28.1). See docs/TENSORFLOW.md.

- :func:`DistributedGradientTape`, :func:`DistributedOptimizer` (and
  ``hvd_quant.tensorflow.keras.DistributedOptimizer``): Horovod's wrappers with hvd_quant's
  compressed exchange, ``reduction``, ``bucket_bytes``, ``min_compress_numel``, ``warmup_steps`` and
  checkpointable error feedback.
- :class:`GradientReducer`: the persistent, ``tf.train.Checkpoint``-trackable reduction they use.
- :data:`OPS` / :func:`collectives`: the core's ArrayOps and eager Collectives tables for TensorFlow.

Importing this module imports TensorFlow and ``horovod.tensorflow``. Codecs passed to stock Horovod
(``hvd.DistributedGradientTape(tape, compression=hvd_quant.QSGD(bits=4))``) reach this frontend
through ``hvd_quant._stock`` without this import.
"""
from ._backend import OPS, collectives
from .reducer import GradientReducer, resolve_codec
from .wrappers import (DistributedGradientTape, DistributedOptimizer, bytes_sent_per_step,
                       install_reducer, reducer_of)

__all__ = ["DistributedGradientTape", "DistributedOptimizer", "GradientReducer", "OPS",
           "bytes_sent_per_step", "collectives", "install_reducer", "reducer_of", "resolve_codec"]
