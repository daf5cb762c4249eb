#!/usr/bin/env python3
"""Registers and spills of the warp kernels at their register caps, as ptxas reports them for sm_90.

Needs the CUDA toolkit (NVVM and ``ptxas`` on PATH), not a GPU: each kernel is compiled to PTX by Numba
for compute capability 9.0 and assembled with ``ptxas -v -maxrregcount=<its cap>``. A spill in a
memory-bound kernel costs time (the plain decode's 44 bytes, from a ``range`` loop over payloads that
runs once there, made the 4-bit decode of 100M floats 0.134 -> 0.155 ms on an H200; docs/BENCHMARKS.md)::

    python3 scripts/kernel_spills.py [--bucket-size 512] [--only decode]
"""
import argparse
import shutil
import subprocess
import sys
import tempfile

import numba.cuda.dispatcher as _dispatcher
from numba import cuda
from numba.core import types as nbt


class _SM90:
    compute_capability = (9, 0)


# device functions are compiled for the current device's compute capability: name one without a GPU
# (numba_kernels.cuda, which loads the driver, is not imported)
_dispatcher.get_current_device = _SM90

from numba_kernels import _cuda_warp as W  # noqa: E402
from numba_kernels._cuda_block import MULTI_CHUNKS, MULTI_SUM  # noqa: E402
from numba_kernels._cuda_device import (DEC_MEAN_ABS, DEC_QSGD, MAX, PACK_DET, PACK_ONEBIT,  # noqa: E402
                                        PACK_STOCH, SIG_WARP_DECODE, SIG_WARP_ENCODE)


def ptxas(kernel, sig, regs):
    """ptxas's summary line for ``kernel`` at ``regs`` registers: registers used, stack, spills."""
    ptx, _ = cuda.compile_ptx(kernel.py_func, nbt.void(*sig), cc=(9, 0))
    with tempfile.TemporaryDirectory() as d:
        with open(f"{d}/k.ptx", "w") as f:
            f.write(ptx)
        r = subprocess.run(["ptxas", "-arch=sm_90", "-v", f"-maxrregcount={regs}", f"{d}/k.ptx", "-o",
                            f"{d}/k.cubin"], capture_output=True, text=True)
    lines = r.stderr.splitlines()
    used = next((ln.split(":", 1)[1].split(",")[0].strip() for ln in lines if "Used" in ln), "?")
    spill = next((ln.strip() for ln in lines if "spill" in ln), r.stderr.strip()[-200:])
    return f"{used}; {spill}"


def cases(bs):
    dec = W.dec_steps(bs)
    for bits, kind in ((4, DEC_QSGD), (8, DEC_QSGD), (2, DEC_QSGD), (1, DEC_MEAN_ABS)):
        for mode, name in ((None, "decode"), (MULTI_SUM, "decode_sum"), (MULTI_CHUNKS, "decode_chunks")):
            spec = (bits, kind, dec) + (() if mode is None else (mode,))
            yield name, spec, W.make_decode, SIG_WARP_DECODE
    regk = W.regk(bs)
    for bits, pack in ((4, PACK_STOCH), (8, PACK_STOCH), (4, PACK_DET), (1, PACK_ONEBIT)):
        paired = pack == PACK_STOCH and regk >= 2 and bs % 64 == 0
        for resid in (False, True):
            for src, name in ((False, "encode"), (True, "reduce_requantize")):
                spec = (bits, MAX, pack, regk, paired, resid) + ((True,) if src else ())
                yield name, spec, W.make_encode, SIG_WARP_ENCODE


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bucket-size", type=int, default=512)
    p.add_argument("--only", default=None, help="kernels whose name contains this")
    args = p.parse_args()
    if shutil.which("ptxas") is None:
        sys.exit("kernel_spills: ptxas is not on PATH (it comes with the CUDA toolkit)")
    for name, spec, make, sig in cases(args.bucket_size):
        if args.only is None or args.only in name:
            kernel = make(spec)
            regs = kernel.targetoptions["max_registers"]        # the kernel's own cap (_cuda_warp._limit)
            print(f"{name:<18} {str(spec):<28} cap {regs}: {ptxas(kernel, sig, regs)}", flush=True)


if __name__ == "__main__":
    main()
