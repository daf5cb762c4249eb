#!/usr/bin/env python3
"""Where a training step's time goes: torch.profiler over a few steps of one exchange method.

One process per rank, as ``hvd_quant.bench train`` runs them (synthetic batch kept on the device,
SGD). On one GPU the exchange is forced at world size 1 by ``HOROVOD_ELASTIC=1``::

    HOROVOD_ELASTIC=1 python scripts/profile_step.py --method sra --model vgg16
    horovodrun -np 2 -H localhost:2 python scripts/profile_step.py --method allgather --model resnet50

It prints the mean step time of ``--steps`` timed steps, then writes the profiler's tables of
``--profile-steps`` more (by self CPU time and by self device time) to
``<out-dir>/prof-<model>-<method>.txt`` on rank 0. Methods: ``fp32`` (Horovod's optimizer, no
compression), ``sra`` / ``allgather`` / ``auto`` (``hvd_quant.torch.DistributedOptimizer``, QSGD
4-bit), ``stock-sra`` / ``stock-allgather`` (Horovod's optimizer with
``StockCompression(QSGD(bits=4), reduction=...)``). Models: torchvision's.
"""
import argparse
import os
import time


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", required=True,
                   choices=("fp32", "sra", "allgather", "auto", "stock-sra", "stock-allgather"))
    p.add_argument("--model", default="vgg16")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--out-dir", default=".")
    args = p.parse_args()

    import torch
    import torch.nn.functional as F
    import torchvision.models as tvm
    from torch.profiler import ProfilerActivity, profile
    import horovod.torch as hvd
    import hvd_quant
    import hvd_quant.torch

    hvd.init()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(hvd.local_rank())
    device = torch.device("cuda" if cuda else "cpu")
    model = getattr(tvm, args.model)(num_classes=1000).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    named = model.named_parameters()
    if args.method == "fp32":
        opt = hvd.DistributedOptimizer(opt, named_parameters=named)
    elif args.method.startswith("stock-"):
        comp = hvd_quant.StockCompression(hvd_quant.QSGD(bits=4), reduction=args.method[6:])
        opt = hvd.DistributedOptimizer(opt, named_parameters=named, compression=comp)
    else:
        opt = hvd_quant.torch.DistributedOptimizer(opt, named_parameters=named,
                                                   compression=hvd_quant.QSGD(bits=4), reduction=args.method)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    data = torch.randn(args.batch_size, 3, 224, 224, device=device)
    target = torch.randint(0, 1000, (args.batch_size,), device=device)

    def step():
        opt.zero_grad()
        F.cross_entropy(model(data), target).backward()
        opt.step()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        step()
    sync()
    t = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    dt = (time.perf_counter() - t) / args.steps
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(args.profile_steps):
            step()
        sync()
    if hvd.rank() == 0:
        line = (f"{args.model} {args.method}: {dt * 1e3:.1f} ms/step, "
                f"{args.batch_size * hvd.size() / dt:.0f} img/s over {hvd.size()} rank(s)")
        print(line, flush=True)
        ka = prof.key_averages()
        path = os.path.join(args.out_dir, f"prof-{args.model}-{args.method}.txt")
        with open(path, "w") as f:
            f.write(line + f"\nprofiled steps: {args.profile_steps}\n")
            f.write(ka.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))
            if cuda:
                f.write(ka.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70))
        print(f"tables: {path}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
