"""The CPU-tested guarantees on GPUs (NCCL): the same workers with tensors on CUDA.

tests/workers/torch_exchange.py, torch_optim.py and torch_mismatch.py run with
``HVDQ_TEST_DEVICE=cuda`` (one GPU per rank), 2 ranks. The exchange worker compares the GPU result
bit for bit with the pipeline replayed on the CPU, so it also holds the CUDA kernels equal to the CPU
ones inside the exchange. ResNet-50 trains a few steps through ``python -m hvd_quant.bench train``.
Needs 2 GPUs and Horovod built with NCCL (scripts/build_horovod_gpu.sh).
"""
import csv
import os
import subprocess
import sys

import pytest

from launch import ROOT, run_horovod
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


def test_resnet50_trains_on_the_payload_groups(tmp_path):
    """ResNet-50 (torchvision, batch 64) for 16 steps on 2 GPUs over NVLink, through both entry points
    with SRA and ``auto`` (and 1-bit SRA, with its residuals), as ``python -m hvd_quant.bench train``
    runs it: every job ends and its replicas are identical. With the payload groups carrying a
    route's first step, SRA's jobs hung there (CUDA's lazy loading; ``hvd_quant.torch._backend.
    PayloadGroup``), which the tiny models of the workers above never showed."""
    pytest.importorskip("torchvision")
    out = tmp_path / "bench"
    methods = ["hvdq-qsgd4-sra", "hvdq-qsgd4-auto", "stock-qsgd4-sra", "hvdq-onebit-sra"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-m", "hvd_quant.bench", "train", "--np", "2", "--networks", "nvlink",
                    "--models", "resnet50", "--methods", ",".join(methods), "--num-warmup-batches", "12",
                    "--num-batches-per-iter", "2", "--num-iters", "2", "--timeout", "150", "--no-plot",
                    "--out", str(out)], env=env, check=False, timeout=900)
    with open(out / "train.csv", newline="") as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    for m in methods:
        assert rows[m]["status"] == "ok" and rows[m]["replicas"] == "identical", (m, rows[m])
