"""The one training driver of the PyTorch examples: MNIST, CIFAR-10, SST-5, a byte-level language model
and ImageNet-size throughput.

Run it under Horovod (see docs/EXAMPLES.md for every task)::

    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch/train.py \\
        --task mnist --model resnet18 --compression qsgd:bits=4,bucket_size=512,mode=stochastic

or, with ``--frontend ddp``, under torchrun with torch DDP and no Horovod (``--compression none``:
DDP's own allreduce; ``powersgd:rank=4``: DDP's PowerSGD hook; a codec: ``hvd_quant.torch.ddp_comm_hook``)::

    torchrun --nproc_per_node 2 examples/pytorch/train.py --frontend ddp \\
        --task mnist --model resnet18 --compression qsgd:bits=4,bucket_size=512,mode=stochastic

What it does, per model named by ``--model`` (a comma-separated list runs one after another in the
same job, which is how the tests and benchmarks batch several models into one launch):

1. builds the model from :mod:`examples.pytorch.models` and the optimizer (Adam or SGD, learning rate
   times the world size unless ``--no-scale-lr``);
2. wraps it: ``--compression none`` with ``--frontend auto`` uses stock ``hvd.DistributedOptimizer``
   (the fp32 ring-allreduce baseline); any other codec uses
   ``hvd_quant.torch.DistributedOptimizer(compression=codec, reduction=..., ...)``; ``--frontend ddp``
   wraps the model in DDP instead (:func:`wrap_ddp`);
3. broadcasts parameters and optimizer state from rank 0 (DDP: its own broadcast of the parameters);
4. prints the world size, controller, codec spec, reduction, data source and the bytes one rank sends
   per step beside fp32 (:mod:`examples.common.traffic`);
5. trains on this rank's shard, printing ``StepN: X data/sec`` every ``--log-every`` steps and
   ``Epoch E in T sec, test time S sec, test accuracy:A`` after each epoch's test pass, and a
   ``Throughput:`` line at the end; every metric also goes to ``--metrics-out``.

``--task lm`` trains :class:`examples.pytorch.models.ByteLM` on the Python standard library's source
(:func:`examples.common.data.load_stdlib_lm`); its test pass reports the validation loss in nats per
byte, its perplexity and bits per byte, and the next-byte accuracy as ``test accuracy``.

``--task imagenet`` trains on one synthetic batch kept on the device (like Horovod's
``pytorch_synthetic_benchmark.py``) for ``--max-steps`` steps (default 200) and has no test pass.
"""
import math
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch
import torch.nn as nn

from examples.common import cli, data as D, traffic
from examples.common.runlog import RunLog, format_throughput
from examples.pytorch.models import ModelContext, build_model, describe_registry, torchvision_available

TASK_DATA = {"mnist": "image", "cifar10": "image", "sst5": "text", "lm": "lm", "imagenet": "synthetic"}


def build_parser():
    p = cli.build_parser("PyTorch")
    g = p.add_argument_group("PyTorch")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: this rank's GPU (local rank) when CUDA is available, else CPU")
    g.add_argument("--model-source", choices=("auto", "builtin", "torchvision"), default="auto",
                   help="ImageNet models: torchvision's definitions when importable (auto) or ours")
    g.add_argument("--width-mult", type=float, default=1.0,
                   help="scale channels / hidden sizes of the built-in models (tests use < 1)")
    g.add_argument("--embed-dim", type=int, default=None, help="SST-5 / lm Transformer width (default: the task's)")
    g.add_argument("--heads", type=int, default=None, help="SST-5 / lm Transformer attention heads")
    g.add_argument("--layers", type=int, default=None, help="SST-5 / lm Transformer layers")
    g.add_argument("--num-classes", type=int, default=1000, help="ImageNet benchmark classes")
    g.add_argument("--onebit-adam", action="store_true",
                   help="train with hvd_quant.torch.OneBitAdam (Adam, lr, --weight-decay; --compression: "
                        "its 1-bit codec, e.g. onebit:bucket_size=1024) instead of --optimizer and a "
                        "DistributedOptimizer")
    g.add_argument("--freeze-step", type=int, default=None,
                   help="OneBitAdam's warm-up of exact Adam, in steps (default: a quarter of the run's "
                        "steps; it must end before the run does)")
    g.add_argument("--threads", type=int, default=0,
                   help="CPU threads per rank for torch and Numba (0: this host's cores / ranks on it, "
                        "unless OMP_NUM_THREADS / NUMBA_NUM_THREADS say otherwise)")
    return p


# ----------------------------------------------------------------------------- setup

def load_data(args, rank):
    if args.task == "mnist":
        ds = D.load_mnist(args.data_dir, image_size=args.image_size, seed=args.seed)
    elif args.task == "cifar10":
        ds = D.load_cifar10(args.data_dir, seed=args.seed, image_size=args.image_size)
    elif args.task == "sst5":
        ds = D.load_sst5(args.data_dir, max_len=args.max_len, vocab_size=args.vocab_size, seed=args.seed)
    elif args.task == "lm":
        if args.data_dir:
            raise SystemExit("--task lm reads the Python standard library's source; it takes no --data-dir")
        ds = D.load_stdlib_lm(context=args.max_len)
    else:
        return None
    return ds.subset(args.train_size, args.test_size)


def model_context(args, ds):
    if args.task == "lm":
        return ModelContext(num_classes=256, vocab_size=256, max_len=args.max_len, embed_dim=args.embed_dim,
                            heads=args.heads, layers=args.layers, dropout=0.0)
    if args.task == "sst5":
        return ModelContext(num_classes=5, vocab_size=ds.meta["vocab_size"], max_len=args.max_len,
                            embed_dim=args.embed_dim, heads=args.heads, layers=args.layers,
                            width_mult=args.width_mult)
    if args.task == "imagenet":
        return ModelContext(num_classes=args.num_classes, in_channels=3, image_size=args.image_size,
                            width_mult=args.width_mult)
    return ModelContext(num_classes=ds.num_classes, in_channels=ds.x_train.shape[1],
                        image_size=args.image_size, small_input=True, width_mult=args.width_mult)


def make_optimizer(args, model, lr):
    if args.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum,
                           weight_decay=args.weight_decay)


def freeze_step(args, total_steps):
    """OneBitAdam's ``freeze_step``: ``--freeze-step``, else a quarter of the run (DeepSpeed advises
    15-25% of a run; these runs are short, so the upper end: an eighth left the language model 3.1%
    above Adam's loss, docs/data/accuracy_lm_onebit_adam_freeze.json). One that the run never
    passes is an error."""
    step = args.freeze_step if args.freeze_step is not None else max(1, total_steps // 4)
    if not 1 <= step < total_steps:
        raise SystemExit(f"--freeze-step {step}: the run has {total_steps} steps; 1-bit Adam compresses "
                         "only after its warm-up, so it must end inside the run")
    return step


def make_onebit_adam(args, model, lr, codec, total_steps):
    """``(OneBitAdam, description, kind)``: 1-bit Adam is the optimizer and the exchange at once."""
    import hvd_quant.torch as hq
    kwargs = {} if args.bucket_bytes is None else {"bucket_bytes": args.bucket_bytes}
    step = freeze_step(args, total_steps)
    opt = hq.OneBitAdam(model.parameters(), lr=lr, weight_decay=args.weight_decay, freeze_step=step,
                        compression=codec, named_parameters=model.named_parameters(), **kwargs)
    return opt, f"hvd_quant.torch.OneBitAdam (freeze_step {step} of {total_steps} steps)", "onebit-adam"


def make_codec(spec):
    try:
        import hvd_quant
        from_spec = hvd_quant.from_spec
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"--compression {spec!r} needs hvd_quant.from_spec, which is not importable: {e}")
    return from_spec(spec)


def wrap_optimizer(args, hvd, opt, model, codec):
    """``(distributed optimizer, description, frontend kind)``."""
    frontend = args.frontend
    if frontend == "auto":
        frontend = "horovod" if codec is None else "hvd_quant"
    if frontend == "horovod":
        compression = hvd.Compression.none if codec is None else codec
        dist = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                        compression=compression,
                                        backward_passes_per_step=args.backward_passes_per_step,
                                        op=hvd.Average)
        what = ("stock hvd.DistributedOptimizer (fp32 ring allreduce)" if codec is None else
                "stock hvd.DistributedOptimizer with the codec as compression=")
        return dist, what, "horovod"
    import hvd_quant.torch as hq
    kwargs = {}
    if args.bucket_bytes is not None:
        kwargs["bucket_bytes"] = args.bucket_bytes
    dist = hq.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=codec if codec is not None else make_codec("none"),
                                   backward_passes_per_step=args.backward_passes_per_step,
                                   op=hvd.Average, reduction=args.reduction,
                                   min_compress_numel=args.min_compress_numel,
                                   warmup_steps=args.warmup_steps, **kwargs)
    return dist, "hvd_quant.torch.DistributedOptimizer", "hvd_quant"


def powersgd_rank(spec):
    """R of ``powersgd:rank=R`` (``--frontend ddp``), else None."""
    name, _, params = spec.lower().partition(":")
    if name != "powersgd":
        return None
    key, _, value = params.partition("=")
    if key != "rank" or not value.isdigit() or int(value) < 1:
        raise SystemExit(f"--compression {spec!r}: expected powersgd:rank=R with R >= 1")
    return int(value)


def wrap_ddp(args, model, device, codec):
    """``--frontend ddp``: ``(DDP model, hook state or None, description)``: DDP's fp32 allreduce for
    ``none``, DDP's PowerSGD hook for ``powersgd:rank=R`` (error feedback and warm start, its defaults;
    fp32 allreduce for the first max(2, --warmup-steps) steps; on Gloo in one DDP bucket), else
    ``hvd_quant.torch.ddp_comm_hook``."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank = powersgd_rank(args.compression)
    kwargs = {}
    if rank is not None and dist.get_backend() == "gloo":
        # PowerSGD starts a bucket's second allreduce when its first completes, a moment that differs
        # between ranks: with several buckets, Gloo would see the ranks' collectives in different
        # orders (and abort). One bucket keeps one order.
        kwargs["bucket_cap_mb"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20 + 1
    ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None, **kwargs)
    if codec is not None:
        import hvd_quant.torch as hq
        kwargs = {} if args.bucket_bytes is None else {"bucket_bytes": args.bucket_bytes}
        state, hook = hq.ddp_comm_hook(codec, reduction=args.reduction, warmup_steps=args.warmup_steps,
                                       min_compress_numel=args.min_compress_numel, **kwargs)
        what = f"DDP with hvd_quant.torch.ddp_comm_hook (reduction {args.reduction})"
    elif rank is not None:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                       start_powerSGD_iter=max(2, args.warmup_steps))
        hook, what = powersgd.powerSGD_hook, f"DDP with the PowerSGD hook (rank {rank})"
    else:
        return ddp, None, "DDP (fp32 allreduce)"
    ddp.register_comm_hook(state, hook)
    return ddp, state, what


def estimate_traffic(args, model, codec, kind, world_size, local_size=None):
    """Bytes per step from :mod:`examples.common.traffic`, laid out as the frontend fuses them."""
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    rank = powersgd_rank(args.compression) if kind == "ddp" else None
    if rank:
        return traffic.powersgd_bytes_per_step(shapes, world_size, rank)
    if codec is None or codec.spec().split(":", 1)[0] in ("none", "nocompression"):
        return traffic.bytes_per_step(shapes, world_size)  # plain fp32 allreduce
    wire = codec.wire_nbytes
    from hvd_quant.plan import BUCKET_BYTES
    if kind == "horovod":  # the stock path fuses an optimizer's gradients into StockCompression's buckets
        bucket = BUCKET_BYTES
    else:
        bucket = args.bucket_bytes if args.bucket_bytes is not None else BUCKET_BYTES
    if kind == "onebit-adam":   # after the freeze: every momentum in 1 bit through SRA, 1-D ones too
        return traffic.bytes_per_step([(math.prod(s), 1) for s in shapes], world_size, wire, "sra", 0,
                                      bucket_bytes=bucket)
    return traffic.bytes_per_step(shapes, world_size, wire, args.reduction, args.min_compress_numel,
                                  bucket_bytes=bucket, local_size=local_size)


def measured_traffic(dist, kind, codec, steps, hook_state=None):
    """Bytes per step hvd_quant counted: the last step for its own optimizer and DDP hook; for a stock
    Horovod optimizer with a codec, hvd_quant counts since the start, so divide by the steps. None for
    stock Horovod and DDP without a codec, and before the first step. A failure to read the count is
    an error, not a missing line."""
    if (codec is None and kind != "hvd_quant") or not steps:
        return None
    import hvd_quant.torch as hq
    if kind == "ddp":
        t = hook_state.bytes_per_step()
        return {"sent": t.sent_bytes, "fp32": t.fp32_bytes, "ratio": t.ratio}
    m = dict(hq.bytes_sent_per_step(dist))
    if kind == "horovod":
        m["sent"] /= steps
        m["fp32"] /= steps
    return m


def step_metrics(dist):
    """hvd_quant's record of the optimizer's last step (``hvd_quant.torch.step_metrics``), on rank 0's
    logged steps, for hvd_quant's own optimizer (the stock path counts bytes since the last call,
    which the end-of-run summary reads)."""
    import hvd_quant.torch as hq
    return hq.step_metrics(dist)


def tensorboard_writers(logdir):
    """``--tensorboard DIR``: a ``SummaryWriter`` per model, under ``DIR/<model>`` (rank 0 only)."""
    if not logdir:
        return None
    from torch.utils.tensorboard import SummaryWriter
    return lambda name: SummaryWriter(os.path.join(logdir, name))


def lr_at(args, base_lr, epoch, step, total_steps):
    if args.lr_schedule == "step":
        return base_lr * (0.1 ** sum(epoch >= args.epochs * f for f in (0.5, 0.75)))
    if args.lr_schedule == "cosine" and total_steps:
        return 0.5 * base_lr * (1 + math.cos(math.pi * min(step, total_steps) / total_steps))
    return base_lr


# ----------------------------------------------------------------------------- train / test

class Batches:
    """Turns NumPy shards into device tensors (images: optional crop/flip; text: trimmed padding)."""

    def __init__(self, args, ds, device):
        self.args, self.ds, self.device = args, ds, device
        self.text = args.task == "sst5"
        self.lm = args.task == "lm"
        self.augment = args.task == "cifar10" and not args.no_augment
        self.rng = np.random.default_rng([args.seed, 7])

    def get(self, x, y, idx, lengths=None, train=True):
        xb = x[idx]
        if self.text:
            xb = xb[:, :max(1, int(lengths[idx].max()))]
        elif self.augment and train:
            xb = D.random_crop_flip(xb, self.rng)
        xt = torch.from_numpy(np.ascontiguousarray(xb))
        xt = xt.long() if self.text or self.lm else xt
        yt = torch.from_numpy(y[idx].reshape(-1))    # a language model's targets: every position
        return xt.to(self.device, non_blocking=True), yt.to(self.device, non_blocking=True)


def evaluate(hvd, model, ds, batches, args, rank, size, tag):
    model.eval()
    idx = D.eval_indices(len(ds.y_test), rank, size)
    correct = total = 0
    loss_sum = 0.0
    lengths = ds.meta.get("lengths_test")
    with torch.no_grad():
        for sl in D.batch_slices(len(idx), max(args.batch_size, 256)):
            xb, yb = batches.get(ds.x_test, ds.y_test, idx[sl], lengths, train=False)
            out = model(xb)
            loss_sum += float(nn.functional.cross_entropy(out, yb, reduction="sum"))
            correct += int((out.argmax(1) == yb).sum())
            total += len(yb)
    sums = hvd.allreduce(torch.tensor([correct, total, loss_sum], dtype=torch.float64), op=hvd.Sum,
                         name=f"eval.{tag}")
    model.train()
    c, t, l = sums.tolist()
    return (c / t if t else None), (l / t if t else None), int(t)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_model(name, args, hvd, ds, log, device):
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(args.seed)
    log.start_model(name)
    model, note = build_model(name, model_context(args, ds), args.model_source)
    model = model.to(device)
    lr = args.lr * (1 if args.no_scale_lr else size)
    codec = None if (args.compression.lower() in ("none", "fp32") and args.frontend != "hvd_quant"
                     or args.frontend == "ddp" and powersgd_rank(args.compression)) \
        else make_codec(args.compression)
    if args.task == "imagenet":
        if not args.max_steps:
            raise SystemExit("--task imagenet needs --max-steps > 0")
        epochs, per_epoch = 1, args.max_steps
    else:
        epochs = args.epochs
        per_epoch = D.steps_per_epoch(len(ds.y_train), size, args.batch_size)
    total_steps = min(epochs * per_epoch, args.max_steps) if args.max_steps else epochs * per_epoch
    net, hook_state = model, None       # net: the module itself, for the test pass
    if args.frontend == "ddp":
        if args.onebit_adam:
            raise SystemExit("--onebit-adam runs on Horovod, not with --frontend ddp")
        model, hook_state, what = wrap_ddp(args, net, device, codec)
        dist = opt = make_optimizer(args, net, lr)
        kind = "ddp"
    elif args.onebit_adam:
        dist, what, kind = make_onebit_adam(args, model, lr, codec, total_steps)
        opt = dist
    else:
        opt = make_optimizer(args, model, lr)
        dist, what, kind = wrap_optimizer(args, hvd, opt, model, codec)
    if kind != "ddp":
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        # Horovod's broadcast_optimizer_state gives a fresh optimizer its state by one step on zero
        # gradients, which starts Adam's step count at 1 and so changes its bias correction for the
        # whole run (OneBitAdam, whose state exists from construction, and DDP take no such step). A
        # fresh optimizer is the same on every rank: only a state there is (OneBitAdam's) is broadcast.
        if dist.state_dict()["state"]:
            hvd.broadcast_optimizer_state(dist, root_rank=0)

    nparams = sum(p.numel() for p in model.parameters())
    est = estimate_traffic(args, net, codec, kind, size, hvd.local_size())
    psgd = powersgd_rank(args.compression) if kind == "ddp" else None
    spec = codec.spec() if codec is not None else f"powersgd:rank={psgd}" if psgd else "none"
    log.emit(f"model: {note}; {nparams / 1e6:.3f}M parameters in "
             f"{sum(1 for _ in model.parameters())} tensors")
    optimizer = "onebit-adam" if args.onebit_adam else args.optimizer
    log.emit(f"optimizer: {optimizer} lr {lr:g} ({args.lr:g} x {1 if args.no_scale_lr else size}), "
             f"batch {args.batch_size} per rank; exchange: {what}")
    log.emit(f"compression: {spec}; reduction: {args.reduction if codec is not None else est.reduction}")
    log.emit(f"bytes sent per step per rank: {est.describe()}")
    log.record("config", task=args.task, model_name=name, model_note=note, parameters=nparams,
               world_size=size, compression=spec, reduction=args.reduction, frontend=what,
               batch_size=args.batch_size, lr=lr, optimizer=optimizer,
               data=ds.source if ds is not None else "synthetic", **cli.spec_labels(spec), **est.as_dict())

    criterion = nn.CrossEntropyLoss()
    batches = Batches(args, ds, device) if ds is not None else None
    if args.task == "imagenet":
        g = torch.Generator().manual_seed(args.seed + rank)
        synth_x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=g).to(device)
        synth_y = torch.randint(0, args.num_classes, (args.batch_size,), generator=g).to(device)

    step, samples, train_time = 0, 0, 0.0
    bench_t0 = bench_s0 = None
    loss_acc, loss_n = torch.zeros((), device=device), 0
    model.train()
    for epoch in range(epochs):
        if args.max_steps and step >= args.max_steps:
            break
        if ds is not None:
            idx = D.shard_indices(len(ds.y_train), rank, size, epoch, args.seed)
            slices = D.batch_slices(len(idx), args.batch_size)
        else:
            slices = [None] * per_epoch
        epoch_train = 0.0
        with log.bar(len(slices), f"{name} epoch {epoch}"):
            for sl in slices:
                if args.max_steps and step >= args.max_steps:
                    break
                cur_lr = lr_at(args, lr, epoch, step, total_steps)
                for group in dist.param_groups:
                    group["lr"] = cur_lr
                t0 = time.perf_counter()
                if ds is None:
                    xb, yb = synth_x, synth_y
                else:
                    xb, yb = batches.get(ds.x_train, ds.y_train, idx[sl], ds.meta.get("lengths_train"))
                dist.zero_grad()
                loss = criterion(model(xb), yb)
                loss.backward()
                dist.step()
                step += 1
                samples += len(xb) * size
                loss_acc += loss.detach()
                loss_n += 1
                at_log = step % args.log_every == 0 or step == total_steps
                if at_log:
                    _sync(device)
                dt = time.perf_counter() - t0
                train_time += dt
                epoch_train += dt
                if step == args.bench_warmup:
                    bench_t0, bench_s0 = train_time, samples
                mean_loss = None
                if at_log:
                    mean_loss = float(loss_acc) / max(loss_n, 1)
                    loss_acc.zero_()
                    loss_n = 0
                log.step(step, epoch, samples, train_time, loss=mean_loss, lr=cur_lr,
                         step_time=dt, record=at_log,
                         exchange=step_metrics(dist) if at_log and kind == "hvd_quant" else None)
        if ds is not None and not args.no_eval:
            t0 = time.perf_counter()
            acc, test_loss, test_count = evaluate(hvd, net, ds, batches, args, rank, size, f"{name}.{epoch}")
            test_time = time.perf_counter() - t0
            log.epoch(epoch, epoch_train + test_time, test_time, acc, test_loss=test_loss, steps=step,
                      test_count=test_count)
            if args.task == "lm":
                log.emit(f"Validation loss {test_loss:.4f} nats/byte (perplexity {math.exp(test_loss):.3f}, "
                         f"{test_loss / math.log(2):.3f} bits/byte) after {step} steps")

    _sync(device)
    if bench_t0 is not None and step > args.bench_warmup:
        rate, counted, warm = (samples - bench_s0) / (train_time - bench_t0), step - args.bench_warmup, args.bench_warmup
    else:
        rate, counted, warm = (samples / train_time if train_time else 0.0), step, 0
    log.emit(format_throughput(rate, size, counted, warm))
    measured = measured_traffic(dist, kind, codec, step, hook_state)
    if measured is not None:
        which = "in the last step" if kind != "horovod" else f"per step over {step} steps"
        log.emit(f"bytes sent {which}, measured by hvd_quant: {traffic.fmt_bytes(measured['sent'])} "
                 f"vs {traffic.fmt_bytes(measured['fp32'])} fp32 ({measured['ratio']:.2f}x less)"
                 f"{traffic.fmt_gbps(measured.get('gbps'))}")
    log.record("summary", steps=step, samples=samples, train_time=train_time, bench_data_per_sec=rate,
               data_per_sec=samples / train_time if train_time else 0.0,
               measured_bytes_sent=None if measured is None else measured["sent"],
               measured_bytes_fp32=None if measured is None else measured["fp32"],
               measured_gbps=None if measured is None else measured.get("gbps"), **est.as_dict())
    del dist, opt, model, net, hook_state


class TorchDistributed:
    """``--frontend ddp`` (under torchrun): the ranks and the sum the driver asks of
    ``horovod.torch`` otherwise, over a ``torch.distributed`` process group."""
    Sum = "sum"

    def __init__(self, backend):
        import torch.distributed as dist
        dist.init_process_group(backend)    # the job ends through hvd_quant.torch.ddp.shutdown (below)
        self.dist, self.backend = dist, backend

    def rank(self):
        return self.dist.get_rank()

    def size(self):
        return self.dist.get_world_size()

    def local_rank(self):
        return int(os.environ.get("LOCAL_RANK", "0"))

    def local_size(self):
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

    def allreduce(self, t, op, name=None):
        """The sum over ranks of host tensor ``t`` (``op`` is :attr:`Sum`)."""
        assert op == self.Sum, op
        out = t.cuda() if self.backend == "nccl" else t.clone()
        self.dist.all_reduce(out)
        return out.cpu()


def share_cores(requested, ranks_here):
    """Give each rank its share of this host's cores (torch and Numba), so ranks do not oversubscribe
    the CPU: Numba's parallel kernels spin, and two ranks each running one thread per core on the same
    cores run several times slower. Environment variables the user set win over the default."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    share = requested or max(1, cores // max(1, ranks_here))
    if requested or "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(share)
    numba_threads = None
    try:
        import numba
        if requested or "NUMBA_NUM_THREADS" not in os.environ:
            numba.set_num_threads(min(share, numba.config.NUMBA_NUM_THREADS))
        numba_threads = numba.get_num_threads()
    except Exception:  # numba missing or its threading layer unavailable
        pass
    return f"torch {torch.get_num_threads()}, numba {numba_threads if numba_threads is not None else 'n/a'}"


def main(argv=None):
    args = cli.finalize(build_parser().parse_args(argv))
    if args.list_models:
        print(describe_registry())
        return 0
    if args.frontend == "ddp":
        hvd = TorchDistributed("nccl" if args.device != "cpu" and torch.cuda.is_available() else "gloo")
    else:
        import horovod.torch as hvd
        # two_level's node and cross-node process sets are made at the first step
        hvd.init(process_sets="dynamic" if args.reduction == "two_level" else None)
    rank, size = hvd.rank(), hvd.size()
    threads = share_cores(args.threads, hvd.local_size())
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(hvd.local_rank())
        device = torch.device("cuda", hvd.local_rank())
    else:
        device = torch.device("cpu")
    log = RunLog(rank, size, args.log_every, args.metrics_out, progress=not args.no_progress,
                 tensorboard=tensorboard_writers(args.tensorboard))
    if args.frontend == "ddp":
        controller = f"torch.distributed {hvd.backend}"
    else:
        controller = "mpi" if hvd.mpi_enabled() else "gloo" if hvd.gloo_enabled() else "unknown"
    ds = load_data(args, rank)
    data_line = ds.source if ds is not None else (
        f"synthetic ImageNet-size batch ({args.batch_size}x3x{args.image_size}x{args.image_size}, "
        f"{args.num_classes} classes), generated on the device; no test pass")
    tv = "torchvision importable" if torchvision_available() else "torchvision not importable: built-in models"
    log.emit(f"hvd_quant PyTorch example: task {args.task}, models {','.join(args.models)}")
    log.emit(f"world size: {size} (controller: {controller}); device: {device}; torch {torch.__version__}; "
             f"CPU threads per rank: {threads}; {tv}")
    log.emit(f"compression: {args.compression}; reduction: {args.reduction}; frontend: {args.frontend}")
    log.emit(f"data: {data_line}")
    log.record("config", task=args.task, world_size=size, controller=controller, device=str(device),
               compression=args.compression, reduction=args.reduction, data=data_line,
               argv=sys.argv[1:] if argv is None else list(argv))
    try:
        for name in args.models:
            run_model(name, args, hvd, ds, log, device)
    finally:
        log.close()
    return 0


if __name__ == "__main__":
    code = main()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # barrier, group destroyed, then leave without torch.distributed's exit-time teardown,
        # which has aborted ranks after complete runs
        from hvd_quant.torch.ddp import shutdown
        shutdown(exit_code=code)
    sys.exit(code)
