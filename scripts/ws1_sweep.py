#!/usr/bin/env python3
"""One configuration of a world-size-1 forced-exchange step (``HOROVOD_ELASTIC=1``, plain python),
timed with where the host time goes: the step, the forward and backward calls, ``opt.step()``, and
for ``hvd_quant.torch`` the optimizer's ``_ready`` / ``_start_complete`` / ``_launch_plain``.

    HOROVOD_ELASTIC=1 python scripts/ws1_sweep.py --method sra --model resnet50 --bucket-mb 4

Methods: ``fp32`` (Horovod's optimizer), ``sra`` / ``allgather`` (``hvd_quant.torch``, QSGD 4-bit),
``stock-sra`` / ``stock-allgather``. Prints one ``WS1 {json}`` line (times in ms per step);
``--cprofile F`` / ``--trace F`` write a cProfile table / a chrome trace of a few more steps.
``WS1_NO_ADVANCE_READY=1`` keeps SRA's second phase out of backward (an experiment).
``scripts/ws1_sweep.sh`` runs a list of configurations.
"""
import argparse
import json
import os
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--method", required=True)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--bucket-mb", type=float, default=4)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--cprofile", default=None, help="write cProfile stats of 20 more steps here")
    p.add_argument("--trace", default=None, help="write a chrome trace of 5 more steps here")
    args = p.parse_args()

    import torch
    import torch.nn.functional as F
    import torchvision.models as tvm
    import horovod.torch as hvd
    import hvd_quant
    import hvd_quant.torch

    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    device = torch.device("cuda")
    model = getattr(tvm, args.model)(num_classes=1000).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    named = model.named_parameters()
    bb = int(args.bucket_mb * (1 << 20))
    if args.method == "fp32":
        opt = hvd.DistributedOptimizer(opt, named_parameters=named)
    elif args.method.startswith("stock-"):
        comp = hvd_quant.StockCompression(hvd_quant.QSGD(bits=4), reduction=args.method[6:], bucket_bytes=bb)
        opt = hvd.DistributedOptimizer(opt, named_parameters=named, compression=comp)
    else:
        opt = hvd_quant.torch.DistributedOptimizer(opt, named_parameters=named, bucket_bytes=bb,
                                                   compression=hvd_quant.QSGD(bits=4), reduction=args.method)
    data = torch.randn(args.batch_size, 3, 224, 224, device=device)
    target = torch.randint(0, 1000, (args.batch_size,), device=device)
    in_step = [0.0]
    parts = {"forward": 0.0, "backward": 0.0}
    if args.method in ("sra", "allgather"):
        for attr in ("_ready", "_start_complete", "_launch_plain"):
            parts[attr] = 0.0

            def timed(*a, _f=getattr(opt, attr), _k=attr, **kw):
                t = time.perf_counter()
                try:
                    return _f(*a, **kw)
                finally:
                    parts[_k] += time.perf_counter() - t
            setattr(opt, attr, timed)
    if os.environ.get("WS1_NO_ADVANCE_READY"):
        from hvd_quant.exchange import Exchange
        Exchange.advance_ready = lambda self, pendings: None

    def step():
        opt.zero_grad()
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(data), target)
        t1 = time.perf_counter()
        loss.backward()
        t = time.perf_counter()
        parts["forward"] += t1 - t0
        parts["backward"] += t - t1
        opt.step()
        in_step[0] += time.perf_counter() - t

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    in_step[0] = 0.0
    for k in parts:
        parts[k] = 0.0
    times = []
    for _ in range(args.steps // 10):
        t = time.perf_counter()
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / 10)
    times.sort()
    res = {"model": args.model, "method": args.method, "bucket_mb": args.bucket_mb,
           "cycle": os.environ.get("HOROVOD_CYCLE_TIME", ""),
           "async": os.environ.get("HOROVOD_ENABLE_ASYNC_COMPLETION", ""),
           "ms_median": 1e3 * times[len(times) // 2], "ms_min": 1e3 * times[0],
           "in_step_ms": 1e3 * in_step[0] / (10 * len(times)),
           "noadv": os.environ.get("WS1_NO_ADVANCE_READY", "")}
    res.update({f"{k}_ms": round(1e3 * v / (10 * len(times)), 3) for k, v in parts.items()})
    print("WS1 " + json.dumps(res), flush=True)
    if args.cprofile:
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        prof.disable()
        with open(args.cprofile, "w") as f:
            st = pstats.Stats(prof, stream=f)
            st.sort_stats("tottime").print_stats(45)
            st.sort_stats("cumulative").print_stats(45)
    if args.trace:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        prof.export_chrome_trace(args.trace)
    hvd.shutdown()


if __name__ == "__main__":
    main()
