"""NCCL allreduce on real GPUs, one process per GPU, checked against the closed-form sum."""
import torch
import horovod.torch as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
torch.cuda.set_device(hvd.local_rank())
n = 1 << 20
x = torch.arange(n, dtype=torch.float32, device="cuda") + 1000.0 * rank
out = hvd.allreduce(x, op=hvd.Sum, name="nccl_sum")
expected = torch.arange(n, dtype=torch.float64, device="cuda") * size + 1000.0 * sum(range(size))
err = (out.double() - expected).abs().max().item()
assert err == 0.0, err
print(f"rank {rank}/{size} on {torch.cuda.get_device_name()}: NCCL allreduce of {n} fp32 exact "
      f"(out[0]={out[0].item():.1f}, out[-1]={out[-1].item():.1f}, expected {expected[0].item():.1f}, "
      f"{expected[-1].item():.1f})", flush=True)
hvd.shutdown()
