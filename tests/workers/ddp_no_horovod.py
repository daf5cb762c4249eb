"""Worker: ``hvd_quant.torch.ddp_comm_hook`` in a process where Horovod cannot be imported (a
``sys.meta_path`` finder refuses it), on a one-process Gloo group: the hook returns each bucket as it
is, so the gradients equal the local ones exactly; the Horovod frontends raise an ImportError naming
Horovod; ``fsdp_reduce_scatter`` imports too. Prints ``OK`` at the end."""
import importlib.abc
import sys


class _NoHorovod(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "horovod":
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None


sys.meta_path.insert(0, _NoHorovod())

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

import hvd_quant.torch  # noqa: E402
from hvd_quant.torch import ddp_comm_hook, fsdp_reduce_scatter  # noqa: E402

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
model = torch.nn.parallel.DistributedDataParallel(net)
state, hook = ddp_comm_hook("qsgd:bits=4,bucket_size=512", reduction="sra")
model.register_comm_hook(state, hook)
for step in range(2):
    x = torch.randn(16, 32)
    local = torch.autograd.grad(net(x).square().mean(), list(net.parameters()))
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), local)), step
assert state.step == 2, state.step
assert fsdp_reduce_scatter(net, "qsgd:bits=4").steps == {}     # no FSDP module here: nothing set
for name in ("DistributedOptimizer", "OneBitAdam"):
    try:
        getattr(hvd_quant.torch, name)
    except ImportError as e:
        assert "Horovod" in str(e) and "ddp_comm_hook" in str(e), str(e)
    else:
        raise AssertionError(f"hvd_quant.torch.{name} imported without Horovod")
assert not any(m.partition(".")[0] == "horovod" for m in sys.modules), "horovod was imported"
dist.destroy_process_group()
print("OK", flush=True)
