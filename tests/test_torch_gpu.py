"""The CPU-tested guarantees on GPUs (NCCL): the same workers with tensors on CUDA.

tests/workers/torch_exchange.py, torch_optim.py and torch_mismatch.py run with
``HVDQ_TEST_DEVICE=cuda`` (one GPU per rank), 2 ranks. The exchange worker compares the GPU result
bit for bit with the pipeline replayed on the CPU, so it also holds the CUDA kernels equal to the CPU
ones inside the exchange. Needs 2 GPUs and Horovod built with NCCL (scripts/build_horovod_gpu.sh).
"""
import pytest

from launch import run_horovod
from test_exchange_multiproc import assert_all_ranks_passed

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.multiproc, pytest.mark.torch,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 CUDA GPUs")]

ENV = {"HVDQ_TEST_DEVICE": "cuda"}


@pytest.mark.parametrize("worker,args", [
    ("torch_exchange.py", ()),
    ("torch_optim.py", ("grads", "options", "bytes", "resume", "train", "payload-group")),
    ("torch_mismatch.py", ()),
], ids=["exchange", "optimizer", "mismatch"])
def test_workers_on_cuda(worker, args):
    result = run_horovod(worker, np=2, controller="gloo", args=args, env=ENV, timeout=900)
    assert_all_ranks_passed(result, 2)
