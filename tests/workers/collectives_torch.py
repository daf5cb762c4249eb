"""Horovod + PyTorch collectives on real processes: allreduce, uint8 allgather and alltoall.

Each rank builds inputs from its rank alone and checks the outputs against values computed in closed
form, so a wrong reduction, a wrong byte order or a mixed-up rank fails the run.
"""
import torch
import horovod.torch as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()

# allreduce: sum and average of rank-dependent fp32 values.
x = torch.arange(1000, dtype=torch.float32) * (rank + 1)
total = sum(r + 1 for r in range(size))
torch.testing.assert_close(hvd.allreduce(x, op=hvd.Sum, name="sum"), torch.arange(1000.0) * total, rtol=0, atol=0)
torch.testing.assert_close(hvd.allreduce(x, op=hvd.Average, name="avg"), torch.arange(1000.0) * total / size,
                           rtol=1e-6, atol=0)

# allgather of uint8 payloads of different lengths (rank r sends r+3 bytes of value 10*r+i).
mine = torch.tensor([(10 * rank + i) % 256 for i in range(rank + 3)], dtype=torch.uint8)
gathered = hvd.allgather(mine, name="gather_u8")
expected = torch.tensor([(10 * r + i) % 256 for r in range(size) for i in range(r + 3)], dtype=torch.uint8)
assert gathered.dtype == torch.uint8 and torch.equal(gathered, expected), (gathered, expected)

# alltoall of uint8 with uneven splits: rank r sends (d+1) bytes of value 16*r+d to rank d.
splits = torch.tensor([d + 1 for d in range(size)], dtype=torch.int32)
send = torch.cat([torch.full((d + 1,), 16 * rank + d, dtype=torch.uint8) for d in range(size)])
recv, recv_splits = hvd.alltoall(send, splits=splits, name="alltoall_u8")
expected = torch.cat([torch.full((rank + 1,), 16 * r + rank, dtype=torch.uint8) for r in range(size)])
assert torch.equal(recv, expected), (recv, expected)
assert recv_splits.tolist() == [rank + 1] * size, recv_splits

hvd.shutdown()
print(f"rank {rank}/{size}: torch collectives OK", flush=True)
