"""A read-only install: importing the kernels and running them writes nothing into the package.

The package is copied to a fresh directory and used from there by a child process, with Numba's
cache pointed elsewhere (``NUMBA_CACHE_DIR``, as a read-only site-packages or container image would
need); every file under the copy must be exactly as it was (names, sizes, modification times).
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import numpy as np
import hvd_quant
x = np.random.default_rng(0).standard_normal(5000).astype(np.float32)
# one codec with kernels is enough: every codec's kernels come from one factory (_cpu_base._Kernel)
for spec in ("qsgd:bits=4,bucket_size=512,seed=1", "fp16"):
    c = hvd_quant.from_spec(spec)
    y = c.decode(c.encode(x, name="w"), name="w")
    assert y.shape == x.shape
print("ok", hvd_quant.__file__)
"""


def _snapshot(root):
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


def test_import_and_kernels_write_nothing_into_the_package(tmp_path):
    site = tmp_path / "site"
    for pkg in ("hvd_quant", "numba_kernels"):
        shutil.copytree(ROOT / pkg, site / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    before = _snapshot(site)
    env = dict(os.environ, PYTHONPATH=str(site), NUMBA_CACHE_DIR=str(tmp_path / "numba-cache"),
               PYTHONDONTWRITEBYTECODE="1")
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert str(site) in out.stdout                  # the copy was imported, not the checkout
    assert _snapshot(site) == before
    assert any((tmp_path / "numba-cache").rglob("*"))   # Numba cached where it was told to
