#!/usr/bin/env python3
"""Host cost of the exchange around one training step, on CPU, at world size 1 with the exchange
forced: ResNet-50's 161 parameter shapes with every width divided by ``--shrink`` (kernels cheap, the
per-tensor and per-bucket host work left), a loss linear in the parameters, all methods in one process.

    HOROVOD_ELASTIC=1 python scripts/step_host_cost.py --methods fp32,stock-sra,sra [--cprofile M]

Prints ms per step for each method (median of ``--steps``; the methods take turns in ``--rounds``, so
that the machine's drift hits each alike), the ratio to Horovod fp32, the medians of the step's two
halves (``backward()`` with the hooks, ``step()`` with ``synchronize()`` and the hand-out of the
results), and with ``--cprofile M`` the top of method M's cProfile table.
"""
import argparse
import cProfile
import pstats
import statistics
import time

import torch


def resnet50_shapes(shrink):
    """The parameter shapes of torchvision's ResNet-50 (161 tensors), channel widths // shrink."""
    w = lambda c: max(1, c // shrink)
    shapes = [(w(64), 3, 7, 7), (w(64),), (w(64),)]
    inp = w(64)
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            mid, out = w(width), w(width * 4)
            shapes += [(mid, inp, 1, 1), (mid,), (mid,), (mid, mid, 3, 3), (mid,), (mid,),
                       (out, mid, 1, 1), (out,), (out,)]
            if b == 0:
                shapes += [(out, inp, 1, 1), (out,), (out,)]
            inp = out
    return shapes + [(1000, inp), (1000,)]


def make_optimizer(method, params, named):
    import horovod.torch as hvd
    import hvd_quant
    import hvd_quant.torch
    opt = torch.optim.SGD(params, lr=0.0)
    if method == "fp32":
        return hvd.DistributedOptimizer(opt, named_parameters=named)
    if method.startswith("stock-"):
        comp = hvd_quant.StockCompression(hvd_quant.QSGD(bits=4), reduction=method[6:])
        return hvd.DistributedOptimizer(opt, named_parameters=named, compression=comp)
    return hvd_quant.torch.DistributedOptimizer(opt, named_parameters=named,
                                                compression=hvd_quant.QSGD(bits=4), reduction=method)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="fp32,stock-sra,stock-allgather,sra,allgather")
    p.add_argument("--shrink", type=int, default=8)
    p.add_argument("--steps", type=int, default=120, help="timed steps per method")
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--cprofile", default=None, help="print the cProfile table of this method")
    args = p.parse_args()
    import horovod.torch as hvd
    hvd.init()
    torch.set_num_threads(1)
    shapes = resnet50_shapes(args.shrink)
    gen = torch.Generator().manual_seed(0)
    coef = [torch.randn(s, generator=gen) for s in shapes]
    print(f"{len(shapes)} tensors, {sum(c.numel() for c in coef)} floats", flush=True)
    steps = {}
    for method in args.methods.split(","):
        params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        opt = make_optimizer(method, params, [(f"p{i}", q) for i, q in enumerate(params)])

        def step(opt=opt, params=params, halves=None):
            opt.zero_grad()
            loss = sum((q * c).sum() for q, c in zip(params, coef))
            t0 = time.perf_counter()
            loss.backward()
            t1 = time.perf_counter()
            opt.step()
            if halves is not None:
                halves.append(((t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3))
        for _ in range(args.warmup):
            step()
        steps[method] = step
    times = {m: [] for m in steps}
    halves = {m: [] for m in steps}
    for _ in range(args.rounds):            # the methods in turn, so that drift hits each alike
        for method, step in steps.items():
            for _ in range(args.steps // args.rounds):
                t = time.perf_counter()
                step(halves=halves[method])
                times[method].append((time.perf_counter() - t) * 1e3)
    results = {m: statistics.median(v) for m, v in times.items()}
    if args.cprofile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(20):
            steps[args.cprofile]()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
        pstats.Stats(pr).sort_stats("cumtime").print_stats("hvd_quant", 30)
    base = results.get("fp32")
    for method, ms in results.items():
        ratio = f"  {base / ms:.2f}x fp32's speed" if base else ""
        bwd, stp = (statistics.median(h) for h in zip(*halves[method]))
        print(f"{method:18s} {ms:8.2f} ms/step{ratio}  (backward {bwd:.2f}, step() {stp:.2f})",
              flush=True)


if __name__ == "__main__":
    main()
