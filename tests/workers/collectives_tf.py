"""Horovod + TensorFlow collectives on real processes: allreduce, uint8 allgather and alltoall.

Each rank builds inputs from its rank alone and checks the outputs against values computed in closed
form.
"""
import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
total = sum(r + 1 for r in range(size))

x = tf.range(1000, dtype=tf.float32) * float(rank + 1)
np.testing.assert_array_equal(hvd.allreduce(x, op=hvd.Sum, name="sum").numpy(), np.arange(1000.0) * total)
np.testing.assert_allclose(hvd.allreduce(x, op=hvd.Average, name="avg").numpy(),
                           np.arange(1000.0) * total / size, rtol=1e-6)

mine = tf.constant([(10 * rank + i) % 256 for i in range(rank + 3)], dtype=tf.uint8)
gathered = hvd.allgather(mine, name="gather_u8")
expected = np.array([(10 * r + i) % 256 for r in range(size) for i in range(r + 3)], dtype=np.uint8)
assert gathered.dtype == tf.uint8
np.testing.assert_array_equal(gathered.numpy(), expected)

splits = tf.constant([d + 1 for d in range(size)], dtype=tf.int32)
send = tf.concat([tf.fill([d + 1], tf.constant(16 * rank + d, tf.uint8)) for d in range(size)], axis=0)
recv, recv_splits = hvd.alltoall(send, splits=splits, name="alltoall_u8")
expected = np.concatenate([np.full(rank + 1, 16 * r + rank, dtype=np.uint8) for r in range(size)])
np.testing.assert_array_equal(recv.numpy(), expected)
np.testing.assert_array_equal(recv_splits.numpy(), [rank + 1] * size)

hvd.shutdown()
print(f"rank {rank}/{size}: tensorflow collectives OK", flush=True)
