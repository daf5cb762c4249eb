"""The Numba half of the TensorFlow frontend's opt-in device exchange (hvd_quant/tensorflow/_device.py):
the core's ArrayOps over Numba device arrays and the codec adapter for them, against the host path,
with N ranks simulated in one process (tests/workers/tf_device_child.py says what is checked).

No TensorFlow is involved: the TensorFlow half (DLPack views of GPU tensors, tf.py_function steps on
the GPU) cannot run anywhere we have (no GPU with TensorFlow); docs/TENSORFLOW.md says so."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

import children

ROOT = Path(__file__).resolve().parents[1]
CHILD = ROOT / "tests" / "workers" / "tf_device_child.py"


def _run(env_extra, args, timeout):
    env = dict(os.environ, **env_extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return _checked(subprocess.run([sys.executable, str(CHILD), *args], capture_output=True, text=True,
                                   timeout=timeout, env=env, cwd=str(ROOT)))


def _checked(p):
    assert p.returncode == 0 and "DEVICE-RESULT" in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]
    assert "DEVICE FAIL" not in p.stdout, p.stdout[-4000:]
    return p.stdout


@pytest.fixture
def simulator_output():
    """The child in the CUDA simulator (started in the background at collection, tests/children.py):
    small sizes, 4-bit QSGD and 1-bit + EF."""
    return children.result("test_tf_device", "simulator_output")


def test_device_exchange_in_cuda_simulator(simulator_output):
    assert _checked(simulator_output).count("DEVICE ok") == 5


@pytest.mark.gpu
def test_device_exchange_on_gpu():
    numba_cuda = pytest.importorskip("numba.cuda")
    if not numba_cuda.is_available():
        pytest.skip("no CUDA device")
    out = _run({}, ["--sizes", "1,1000,100003,4000000", "--ranks", "2,3"], timeout=900)
    assert out.count("DEVICE ok") == 1 + 2 * 4 * 4 * 2
