"""The foundation: Horovod built with both frameworks and both controllers, exercised for real."""
import subprocess

import pytest

from launch import CONTROLLERS, run_horovod, _tool

pytestmark = pytest.mark.multiproc


def test_packages_import():
    import hvd_quant
    import numba_kernels
    assert hvd_quant.__version__


def test_check_build_lists_frameworks_and_controllers():
    out = subprocess.run([_tool("horovodrun"), "--check-build"], capture_output=True, text=True,
                         check=True).stdout
    for line in ("[X] TensorFlow", "[X] PyTorch", "[X] MPI", "[X] Gloo"):
        assert line in out, out


@pytest.mark.parametrize("controller", CONTROLLERS)
@pytest.mark.parametrize("framework", [pytest.param("torch", marks=pytest.mark.torch),
                                       pytest.param("tf", marks=pytest.mark.tensorflow)])
# 3 ranks: an odd size, as the build check (2 ranks: nearly every other job of the suite)
@pytest.mark.parametrize("np_", [3], ids=lambda n: f"np{n}")
def test_collectives(framework, controller, np_):
    result = run_horovod(f"collectives_{framework}.py", np=np_, controller=controller, timeout=300)
    for r in range(np_):
        assert f"rank {r}/{np_}:" in result.stdout, result.stdout
