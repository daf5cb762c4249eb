"""``reduction="two_level"`` of ``hvd_quant.tensorflow`` as graph ops (``hvd_quant.exchange``'s module
doc): the node's fp32 sum (Horovod's allreduce over the node's process set), this rank's shard of it
through another ``GraphExchange`` on the cross-node set, the shards gathered by a Sum allreduce of
each in place."""
import horovod.tensorflow as hvd
import tensorflow as tf

from ..exchange import chunk_bounds
from . import _backend
from ._backend import op_name


class GraphTwoLevel:
    """The levels of one ``GraphExchange`` (``engine``), found when its first bucket is built:
    ``local``, the node's process set (None with one rank per node), and ``cross``, the
    ``GraphExchange`` across nodes that ``across(process_set, reduction)`` makes (None on one node)."""

    def __init__(self, engine, across):
        ex = self.exchange = engine.exchange
        if ex.memory is not None:
            raise ValueError("hvd_quant: reduction='two_level' with error feedback runs in "
                             "PyTorch only; TensorFlow takes it without")
        with tf.init_scope():       # eager collectives, also while tracing
            local, cross = _backend.FRONTEND.collectives(engine.process_set).levels()
        self.local = None if local is None else local.process_set
        self.cross = None if cross is None else across(cross.process_set,
                                                        "allgather" if cross.size == 2 else "sra")

    def build(self, key, flat, header, deps):
        """Graph ops of the float32 sum over ranks of ``flat``, as ``GraphExchange.build``."""
        ex, local, cross = self.exchange, self.local, self.cross
        numel, shard = int(flat.shape[0]), flat
        if local is not None:
            a, b = chunk_bounds(numel, local.size(), ex.align)[local.rank()]
            with tf.control_dependencies(list(deps)):
                total = hvd.allreduce(flat, op=hvd.Sum, name=op_name(f"{ex.prefix}.node.{key}"),
                                      ignore_name_scope=True, process_set=local)
            if cross is None:           # one node: its sum is the result
                return total
            shard, deps = total[a:b], ()
        if cross is not None:
            shard = cross.build(key, shard, header, deps)
        if local is not None:
            shard = hvd.allreduce(tf.pad(shard, [[a, numel - b]]), op=hvd.Sum, ignore_name_scope=True,
                                  name=op_name(f"{ex.prefix}.gather.{key}"), process_set=local)
        return shard
