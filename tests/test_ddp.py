"""``hvd_quant.torch.ddp_comm_hook`` on real torch.distributed processes started by torchrun (Gloo
on the CPU; NCCL with ``HVDQ_TEST_DEVICE=cuda``, one GPU per rank, where 2 GPUs are there):
tests/workers/ddp_hook.py (its docstring lists the checks and derives the bounds),
tests/workers/fsdp_reduce_scatter.py (``fsdp_reduce_scatter`` on FSDP2, Gloo),
tests/workers/ddp_no_horovod.py (the hook in a process that cannot import Horovod), docs/EXCHANGE.md's
torchrun snippets and examples/pytorch/train.py --frontend ddp."""
import re
import sys
from pathlib import Path

import pytest
import torch

from launch import ROOT, run_command
from test_exchange_multiproc import assert_all_ranks_passed

pytestmark = [pytest.mark.multiproc, pytest.mark.torch]


def run_torchrun(script, np_, args=(), timeout=600, env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(np_),
           f"tests/workers/{script}", *args]
    return run_command(cmd, env=env, timeout=timeout)


ALL = ["grads", "resume", "nosync", "unused", "auto", "bad"]
TWO_GPUS = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


@pytest.mark.parametrize("np_,groups,env", [
    pytest.param(2, ALL, None, id="np2"),
    pytest.param(3, ["grads", "resume", "nosync"], None, id="np3"),
    pytest.param(2, ALL, {"HVDQ_TEST_DEVICE": "cuda"}, id="np2-nccl", marks=TWO_GPUS),
])
def test_ddp_hook(np_, groups, env):
    result = run_torchrun("ddp_hook.py", np_, groups, timeout=900, env=env)
    assert_all_ranks_passed(result, np_)
    if "auto" in groups:        # decided once, printed once by rank 0
        assert len(re.findall(r"hvd_quant.ddp_comm_hook: reduction=auto chose", result.stdout)) == 1, \
            result.stdout[-3000:]


@pytest.mark.parametrize("np_", [2, 3], ids=["np2", "np3"])
def test_fsdp_reduce_scatter(np_):
    result = run_torchrun("fsdp_reduce_scatter.py", np_, ["grads", "train", "resume", "bad"], timeout=900)
    assert_all_ranks_passed(result, np_)


@pytest.mark.parametrize("index", [0, 1], ids=["ddp", "fsdp"])
def test_doc_snippet_runs(index, tmp_path):
    """docs/EXCHANGE.md's ```python torchrun blocks are whole programs: each runs as written on 2 ranks."""
    blocks = re.findall(r"```python torchrun\n(.*?)```", (Path(ROOT) / "docs" / "EXCHANGE.md").read_text(), re.S)
    assert len(blocks) == 2
    script = tmp_path / "snippet.py"
    script.write_text(blocks[index])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    result = run_command(cmd, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    if index == 0:
        ratios = re.findall(r"rank \d: (\d+\.\d) times fewer bytes", result.stdout)
        assert len(ratios) == 2 and all(float(r) > 2 for r in ratios), result.stdout[-3000:]
    else:
        assert len(re.findall(r"rank \d: reduce-scatters \{'2': 10, '0': 10\}", result.stdout)) == 2, \
            result.stdout[-3000:]


@pytest.mark.parametrize("compression,exchange", [
    ("none", "exchange: DDP (fp32 allreduce)"),
    ("qsgd:bits=4,bucket_size=512", "exchange: DDP with hvd_quant.torch.ddp_comm_hook (reduction sra)"),
    ("powersgd:rank=4", "exchange: DDP with the PowerSGD hook (rank 4)"),
], ids=["fp32", "qsgd4", "powersgd4"])
def test_example_driver_on_ddp(compression, exchange, tmp_path):
    """examples/pytorch/train.py --frontend ddp under torchrun (examples/accuracy.py's DDP precisions):
    a few steps of the byte-level language model and its validation pass."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "examples/pytorch/train.py", "--frontend", "ddp", "--task", "lm", "--layers", "1", "--embed-dim", "32",
           "--heads", "2", "--max-steps", "4", "--epochs", "1", "--log-every", "2", "--threads", "1",
           "--no-progress", "--compression", compression, "--metrics-out", str(tmp_path / "m.jsonl")]
    out = run_command(cmd, timeout=600).stdout
    assert exchange in out and "torch.distributed gloo" in out and "Validation loss" in out, out[-3000:]
    assert ("measured by hvd_quant" in out) == compression.startswith("qsgd"), out[-3000:]


def test_ddp_hook_without_horovod():
    result = run_command([sys.executable, "tests/workers/ddp_no_horovod.py"], timeout=300)
    assert result.stdout.strip().splitlines()[-1] == "OK", result.stdout[-3000:] + result.stderr[-3000:]
