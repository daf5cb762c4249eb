"""One training-speed job of ``python -m hvd_quant.bench train`` (the driver starts it; see train.py).

    # Horovod-based methods (hvd-*, stock-*, hvdq-*)
    horovodrun -np 2 -H localhost:2 --gloo python -m hvd_quant.bench._train_worker \\
        --method hvdq-qsgd4-sra --model cpu_resnet --device cpu
    # DDP methods
    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        -m hvd_quant.bench._train_worker --method ddp-fp16 --model cpu_resnet --device cpu
    # the single-process baseline, and world size 1 with the exchange forced (HOROVOD_ELASTIC=1)
    python -m hvd_quant.bench._train_worker --method single --model mlp --device cpu
    HOROVOD_ELASTIC=1 python -m hvd_quant.bench._train_worker --method hvdq-qsgd4-sra --model mlp

Timing as Horovod's ``examples/pytorch/pytorch_synthetic_benchmark.py``: one synthetic batch kept on the
device, SGD (lr 0.01), ``--num-warmup-batches`` untimed steps, then ``--num-iters`` timed iterations
of ``--num-batches-per-iter`` steps each (zero_grad, forward, cross-entropy, backward, step); on CUDA
the device is synchronised at the end of each timed iteration. Rank 0 prints ``Iter #i: x img/sec per
GPU`` (or CPU) for each iteration, the mean +- 1.96 * std per rank and the total (mean * size), then
one machine-readable line ``HVDQ_TRAIN_RESULT {json}`` that the driver parses.

After the timed steps every rank hashes its parameters (SHA-256 of their bytes, in order) and the ranks
compare the digests: ``replicas`` is ``identical`` when every rank holds bit-for-bit the same model,
``DIFFER`` otherwise (a data-parallel run must never drift), ``one`` for a single process.
"""
import argparse
import hashlib
import json
import os
import re
import sys
import time

RESULT_PREFIX = "HVDQ_TRAIN_RESULT "

CODECS = {"qsgd8": ("QSGD", {"bits": 8}), "qsgd4": ("QSGD", {"bits": 4}),
          "qsgd2": ("QSGD", {"bits": 2}), "onebit": ("OneBit", {})}
GPU_MODELS = ("resnet50", "vgg16", "vit_b_16")
CPU_MODELS = ("cpu_resnet", "mlp", "mlp_wide")
_REDUCTION = re.compile(r"^[a-z][a-z0-9_]*$")


def parse_method(method):
    """``{"method", "launcher", "kind", ...}`` for a method id, or ValueError.

    launcher: ``single`` (one plain process), ``ddp`` (torch.distributed.run), ``horovod``.
    """
    m = method
    if m == "single":
        return dict(method=m, launcher="single", kind="single")
    if m in ("ddp-fp32", "ddp-fp16"):
        return dict(method=m, launcher="ddp", kind=m[4:])
    g = re.fullmatch(r"ddp-powersgd(\d+)", m)
    if g and int(g.group(1)) > 0:
        return dict(method=m, launcher="ddp", kind="powersgd", rank=int(g.group(1)))
    if m in ("hvd-fp32", "hvd-fp16"):
        return dict(method=m, launcher="horovod", kind=m[4:])
    if m == "hvd-fp32-hier":        # HOROVOD_HIERARCHICAL_ALLREDUCE=1 (Horovod applies it where it has one)
        return dict(method=m, launcher="horovod", kind="fp32", hierarchical=True)
    if m.startswith("ddpq-"):
        codec, _, reduction = m[5:].partition("-")
        if codec in CODECS and _REDUCTION.match(reduction):
            # DDP with hvd_quant.torch.ddp_comm_hook(<codec>, reduction=<reduction>)
            return dict(method=m, launcher="ddp", kind="hook", codec=codec, reduction=reduction)
    if m == "onebit-adam":
        return dict(method=m, launcher="horovod", kind="onebit_adam")
    if m.startswith("stock-"):
        codec, _, reduction = m[6:].partition("-")
        if codec in CODECS and (not reduction or _REDUCTION.match(reduction)):
            # stock-<codec>: the bare codec (its defaults); stock-<codec>-<reduction>: a StockCompression
            return dict(method=m, launcher="horovod", kind="stock", codec=codec, reduction=reduction or None)
    if m.startswith("hvdq-"):
        codec, _, reduction = m[5:].partition("-")
        if codec in CODECS and _REDUCTION.match(reduction):
            # the reduction is passed through as written: hvd_quant decides what it accepts
            return dict(method=m, launcher="horovod", kind="hvdq", codec=codec, reduction=reduction)
    raise ValueError(f"unknown method {method!r}: expected single, ddp-fp32, ddp-fp16, ddp-powersgd<R>, "
                     f"ddpq-<codec>-<reduction>, hvd-fp32, hvd-fp16, onebit-adam, stock-<codec>[-<reduction>] "
                     f"or hvdq-<codec>-<reduction> with codec in "
                     f"{', '.join(CODECS)}")


def _link_counters():
    """(tx, rx) bytes of the network interface Gloo uses (``HOROVOD_GLOO_IFACE``, e.g. a slownet node's
    link, read from inside its namespace), or None without one."""
    iface = os.environ.get("HOROVOD_GLOO_IFACE")
    try:
        return tuple(int(open(f"/sys/class/net/{iface}/statistics/{k}_bytes").read()) for k in ("tx", "rx"))
    except (OSError, TypeError, ValueError):
        return None


def make_codec(name):
    import hvd_quant
    cls, kw = CODECS[name]
    return getattr(hvd_quant, cls)(**kw)


# ---- models ------------------------------------------------------------------------------------------

def _cpu_models():
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU(inplace=True)
            self.down = None
            if stride != 1 or cin != cout:
                self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            y = self.relu(self.bn1(self.conv1(x)))
            y = self.bn2(self.conv2(y))
            return self.relu(y + (x if self.down is None else self.down(x)))

    class CpuResNet(nn.Module):
        """A ResNet-18-like net for small inputs: 3x3 stem, one basic block per stage at widths
        48/96/192/384, global pooling, one linear layer (38 parameter tensors, 2.76M parameters at 10
        classes)."""

        def __init__(self, num_classes, widths=(48, 96, 192, 384)):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False),
                                      nn.BatchNorm2d(widths[0]), nn.ReLU(inplace=True))
            layers, cin = [], widths[0]
            for i, w in enumerate(widths):
                layers.append(Block(cin, w, 1 if i == 0 else 2))
                cin = w
            self.layers = nn.Sequential(*layers)
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(cin, num_classes)

        def forward(self, x):
            return self.fc(self.pool(self.layers(self.stem(x))).flatten(1))

    class MLP(nn.Module):
        """A tiny MLP on flattened images (for tests): in -> 256 -> 256 -> classes."""

        def __init__(self, in_features, num_classes, hidden=256):
            super().__init__()
            self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(),
                                     nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

        def forward(self, x):
            return self.net(x)

    return CpuResNet, MLP


def build_model(name, num_classes, image_size):
    """``(model, source)``: the module and where its definition came from."""
    if name == "cpu_resnet":
        return _cpu_models()[0](num_classes), "hvd_quant.bench._train_worker"
    if name in ("mlp", "mlp_wide"):     # mlp_wide: hidden 2048, 10.5M parameters at 32 px
        hidden = 2048 if name == "mlp_wide" else 256
        return (_cpu_models()[1](3 * image_size * image_size, num_classes, hidden),
                "hvd_quant.bench._train_worker")
    if name in GPU_MODELS:
        try:
            import torchvision.models as tvm
        except Exception as e:  # ImportError, or a torchvision built for another torch
            try:    # the repository's own definitions of the same architectures (examples/pytorch)
                from examples.pytorch.models import ModelContext, build_model as build_builtin
            except Exception:
                raise SystemExit(f"model {name!r} needs torchvision, which is not importable ({e})")
            model, _ = build_builtin(name, ModelContext(num_classes=num_classes, image_size=image_size),
                                     source="builtin")
            return model, "examples.pytorch.models (torchvision not importable)"
        return getattr(tvm, name)(num_classes=num_classes), "torchvision"
    raise SystemExit(f"unknown model {name!r}; known: {', '.join(GPU_MODELS + CPU_MODELS)}")


# ---- the job -----------------------------------------------------------------------------------------

def build_parser():
    p = argparse.ArgumentParser(prog="python -m hvd_quant.bench._train_worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--batch-size", type=int, default=64, help="images per rank per step")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                   help="what every method wraps (onebit-adam is Adam itself)")
    p.add_argument("--num-warmup-batches", type=int, default=10)
    p.add_argument("--num-batches-per-iter", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=10)
    p.add_argument("--powersgd-start-iter", type=int, default=2,
                   help="ddp-powersgd<R>: steps of plain allreduce before PowerSGD (>= 2)")
    p.add_argument("--threads", type=int, default=0, help="CPU: torch threads per rank (0: leave)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--trace", metavar="PREFIX", default=None,
                   help="after the timed steps, profile --trace-steps more: every rank writes "
                        "PREFIX.rank<r>.json.gz (torch.profiler, Chrome trace format), Horovod jobs' "
                        "rank 0 also PREFIX.horovod.json (Horovod timeline), and rank 0 logs the top ops")
    p.add_argument("--trace-steps", type=int, default=3)
    return p


def trace_steps(step, sync, n, prefix, rank, hvd, cuda, log):
    """Profile ``n`` training steps (untimed, after the timed ones): one Chrome trace per rank, the
    Horovod timeline of the same steps on rank 0 of a Horovod job started with HOROVOD_TIMELINE set,
    the ops' table in the log."""
    import gzip
    import shutil
    from torch.profiler import ProfilerActivity, profile, record_function
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    timeline = hvd is not None and bool(os.environ.get("HOROVOD_TIMELINE"))
    if timeline:
        hvd.start_timeline(f"{prefix}.horovod.json")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for i in range(n):
            with record_function(f"train_step#{i}"):
                step()
                sync()
    if timeline:
        hvd.stop_timeline()
    raw = f"{prefix}.rank{rank}.json"
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as f, gzip.open(raw + ".gz", "wb") as g:
        shutil.copyfileobj(f, g)
    os.remove(raw)
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    log(f"Trace of {n} steps: {raw}.gz\n" + prof.key_averages().table(sort_by=key, row_limit=25))


def parameters_digest(model):
    """SHA-256 (hex, first 16 digits) of every parameter's bytes, in the model's order."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().view(-1).numpy().tobytes())
    return h.hexdigest()[:16]


def replicas_state(model, launcher, size, hvd):
    """``identical`` / ``DIFFER`` across the ranks' parameters, or ``one`` for one process."""
    if launcher == "single" or size == 1:
        return "one"
    mine = parameters_digest(model)
    if launcher == "horovod":
        digests = hvd.allgather_object(mine)
    else:
        import torch.distributed as dist
        digests = [None] * size
        dist.all_gather_object(digests, mine)
    return "identical" if len(set(digests)) == 1 else "DIFFER"


def main(argv=None):
    args = build_parser().parse_args(argv)
    spec = parse_method(args.method)
    import numpy as np
    import torch
    import torch.nn.functional as F

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but CUDA is not available")
    launcher = spec["launcher"]
    hvd = None
    rank, size, local_rank = 0, 1, 0
    if launcher == "horovod":
        if spec.get("hierarchical"):
            os.environ["HOROVOD_HIERARCHICAL_ALLREDUCE"] = "1"
        import horovod.torch as hvd
        # two_level, and auto on several nodes (it weighs two_level): hvd_quant adds the nodes' process sets
        nodes = int(os.environ.get("HOROVOD_CROSS_SIZE", "1")) > 1
        levels = spec.get("reduction") == "two_level" or (spec.get("reduction") == "auto" and nodes)
        hvd.init(process_sets="dynamic" if levels else None)
        rank, size, local_rank = hvd.rank(), hvd.size(), hvd.local_rank()
    elif launcher == "ddp":
        import torch.distributed as dist
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend="nccl" if cuda else "gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(local_rank)
        torch.backends.cudnn.benchmark = True
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    devname = "GPU" if cuda else "CPU"

    def log(msg):
        if rank == 0:
            print(msg, flush=True)

    torch.manual_seed(args.seed)
    model, source = build_model(args.model, args.num_classes, args.image_size)
    model.to(device)
    nparams = sum(p.numel() for p in model.parameters())
    ntensors = sum(1 for _ in model.parameters())
    optimizer = (torch.optim.Adam if args.optimizer == "adam" else torch.optim.SGD)(model.parameters(), lr=args.lr)
    traffic_of = None
    warm_traffic = None
    if launcher == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        kwargs = {}
        if spec["kind"] == "powersgd" and not cuda:
            # PowerSGD starts a bucket's second allreduce when its first completes, a moment that
            # differs between ranks: with several buckets Gloo would see the ranks' collectives in
            # different orders (and abort). One bucket keeps one order.
            kwargs["bucket_cap_mb"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20 + 1
        model = DDP(model, device_ids=[local_rank] if cuda else None, **kwargs)
        if spec["kind"] == "fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            model.register_comm_hook(state=None, hook=default_hooks.fp16_compress_hook)
        elif spec["kind"] == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
            state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=spec["rank"],
                                           start_powerSGD_iter=args.powersgd_start_iter)
            model.register_comm_hook(state, powerSGD.powerSGD_hook)
        elif spec["kind"] == "hook":
            import hvd_quant.torch
            state, hook = hvd_quant.torch.ddp_comm_hook(make_codec(spec["codec"]), reduction=spec["reduction"])
            model.register_comm_hook(state, hook)
            traffic_of = state
    elif launcher == "horovod":
        kind = spec["kind"]
        if kind in ("fp32", "fp16"):
            comp = hvd.Compression.fp16 if kind == "fp16" else hvd.Compression.none
            optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                                 compression=comp)
        elif kind == "onebit_adam":
            # the variance freezes halfway through the warm-up: the timed steps send the momentum in 1 bit
            import hvd_quant.torch
            optimizer = hvd_quant.torch.OneBitAdam(model.parameters(), lr=args.lr,
                                                   freeze_step=max(1, args.num_warmup_batches // 2),
                                                   named_parameters=model.named_parameters())
            traffic_of = warm_traffic = optimizer
        elif kind == "stock":
            import hvd_quant
            comp = make_codec(spec["codec"])
            if spec["reduction"]:
                comp = hvd_quant.StockCompression(comp, reduction=spec["reduction"])
            optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                                 compression=comp)
            traffic_of = optimizer
        else:
            import hvd_quant.torch
            optimizer = hvd_quant.torch.DistributedOptimizer(
                optimizer, named_parameters=model.named_parameters(), compression=make_codec(spec["codec"]),
                reduction=spec["reduction"])
            traffic_of = optimizer
        # SGD without momentum has no state to broadcast; the parameters are what must agree
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    target = torch.randint(0, args.num_classes, (args.batch_size,), device=device)

    def step():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    forced = launcher == "horovod" and size == 1 and os.environ.get("HOROVOD_ELASTIC") == "1"
    log(f"Model: {args.model} ({source}; {nparams} parameters in {ntensors} tensors)")
    log(f"Method: {args.method} ({launcher}{', exchange forced at size 1' if forced else ''}); "
        f"batch size {args.batch_size}, {args.image_size} px, {size} {devname}(s)")
    log("Running warmup...")
    t0 = time.perf_counter()
    for i in range(args.num_warmup_batches):
        step()
        if i == 0 and warm_traffic is not None:     # a step before the freeze: fp32
            from hvd_quant.torch import bytes_sent_per_step
            warm_traffic = bytes_sent_per_step(warm_traffic)
            log(f"hvd_quant bytes_per_step before the freeze: sent {warm_traffic['sent'] / 1e6:.3f} MB "
                f"per rank, fp32 ring allreduce {warm_traffic['fp32'] / 1e6:.3f} MB")
    sync()
    warmup_s = time.perf_counter() - t0
    traffic = None
    if traffic_of is not None:
        from hvd_quant.torch import bytes_sent_per_step
        bytes_sent_per_step(traffic_of)     # stock optimizers: counts start here
    log("Running benchmark...")
    link = _link_counters()
    img_secs = []
    for i in range(args.num_iters):
        t0 = time.perf_counter()
        for _ in range(args.num_batches_per_iter):
            step()
        sync()
        dt = time.perf_counter() - t0
        img_sec = args.batch_size * args.num_batches_per_iter / dt
        log(f"Iter #{i}: {img_sec:.1f} img/sec per {devname}")
        img_secs.append(img_sec)
    link_bytes = None
    if link is not None:        # bytes this rank's node sent over its link per timed step (slownet)
        steps = args.num_iters * args.num_batches_per_iter
        link_bytes = [(b - a) / steps for a, b in zip(link, _link_counters())]
        log(f"Link bytes per step ({os.environ['HOROVOD_GLOO_IFACE']}): sent {link_bytes[0]:.0f}, "
            f"received {link_bytes[1]:.0f}")
    if traffic_of is not None:      # hvd_quant counts every run with a codec: a failure is an error
        traffic = bytes_sent_per_step(traffic_of)
        if spec["kind"] == "stock":     # since the reset after warm-up: all timed steps
            steps = args.num_iters * args.num_batches_per_iter
            traffic = {"sent": traffic["sent"] / steps, "fp32": traffic["fp32"] / steps,
                       "ratio": traffic["ratio"]}
        if traffic["sent"] or traffic["fp32"]:
            log(f"hvd_quant bytes_per_step: sent {traffic['sent'] / 1e6:.3f} MB per rank, fp32 ring "
                f"allreduce {traffic['fp32'] / 1e6:.3f} MB, ratio {traffic['ratio']:.2f}x fewer")
        else:
            log("hvd_quant bytes_per_step: nothing sent (one rank)")
    if args.trace:
        trace_steps(step, sync, args.trace_steps, args.trace, rank, hvd, cuda, log)
    mean = float(np.mean(img_secs))
    conf = float(1.96 * np.std(img_secs))
    replicas = replicas_state(model, launcher, size, hvd)
    log(f"Replicas: {replicas}")
    log(f"Img/sec per {devname}: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {size} {devname}(s): {size * mean:.1f} +-{size * conf:.1f}")
    if rank == 0:
        ratio = None
        if traffic is not None and traffic["ratio"] != float("inf"):
            ratio = traffic["ratio"]
        result = dict(method=args.method, model=args.model, model_source=source, device=args.device,
                      size=size, forced=forced, batch_size=args.batch_size, image_size=args.image_size,
                      params=nparams, tensors=ntensors, img_per_sec=mean, conf=conf,
                      total_img_per_sec=size * mean, total_conf=size * conf, iters=img_secs,
                      warmup_s=warmup_s, bytes_sent=None if traffic is None else traffic["sent"],
                      bytes_fp32=None if traffic is None else traffic["fp32"], bytes_ratio=ratio,
                      bytes_sent_before_freeze=None if warm_traffic is None else warm_traffic["sent"],
                      optimizer="adam" if spec["kind"] == "onebit_adam" else args.optimizer,
                      replicas=replicas, link_bytes_per_step=link_bytes)
        print(RESULT_PREFIX + json.dumps(result), flush=True)
    if launcher == "horovod":
        hvd.shutdown()
    elif launcher == "ddp":
        from hvd_quant.torch.ddp import shutdown
        shutdown(exit_code=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
