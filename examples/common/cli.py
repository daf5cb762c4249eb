"""Command-line flags shared by every example (PyTorch and TensorFlow), and task defaults.

``build_parser(framework)`` returns an ``argparse.ArgumentParser`` with the flags below;
``finalize(args)`` fills what the task decides (model, learning rate, batch size, ...) where the
user did not say. A framework adds its own flags to the parser before parsing.

Codec specs (``--compression``) are strings that ``hvd_quant.from_spec`` understands:
``none``, ``fp16``, ``qsgd:bits=4,bucket_size=512,mode=stochastic``, ``onebit:bucket_size=64``.
:func:`parse_spec` splits one without importing hvd_quant (for logs and metrics).
"""
import argparse

REDUCTIONS = ("sra", "allgather")

# What each task defaults to. Learning rates are per rank: the examples multiply by the world size
# (the runs we mirror used Adam(lr=0.01 * world_size)) unless --no-scale-lr.
TASK_DEFAULTS = {
    # MNIST with ResNet-18/50/101: Adam, lr 0.01 * world size, batch 128 (reference logs 001/002).
    "mnist": dict(model="resnet18", optimizer="adam", lr=0.01, momentum=0.9, weight_decay=0.0,
                  batch_size=128, epochs=4, lr_schedule="none", image_size=28, max_steps=0),
    # CIFAR-10 with the He et al. CIFAR ResNets: SGD momentum 0.9, lr 0.1, wd 1e-4, batch 128,
    # lr / 10 at 50% and 75% of the epochs (He et al. 2016, sec. 4.2 use 32k/48k of 64k iterations).
    "cifar10": dict(model="resnet20", optimizer="sgd", lr=0.1, momentum=0.9, weight_decay=1e-4,
                    batch_size=128, epochs=160, lr_schedule="step", image_size=32, max_steps=0),
    # SST-5 with a 6-layer Transformer (256 embedding, 4 heads, max length 256), Adam, batch 128.
    "sst5": dict(model="transformer", optimizer="adam", lr=0.01, momentum=0.9, weight_decay=0.0,
                 batch_size=128, epochs=4, lr_schedule="none", image_size=0, max_steps=0, max_len=256,
                 embed_dim=256, heads=4, layers=6),
    # Byte-level language model on the Python standard library's source: a 2-layer, 128-wide causal
    # Transformer over 128-byte windows, Adam with a cosine schedule, 300 steps of 16 windows per rank
    # (about a minute for 2 ranks on 2 CPU cores). Measured by validation loss (nats per byte).
    "lm": dict(model="byte_lm", optimizer="adam", lr=0.001, momentum=0.9, weight_decay=0.0,
               batch_size=16, epochs=1, lr_schedule="cosine", image_size=0, max_steps=300, max_len=128,
               embed_dim=128, heads=4, layers=2),
    # ImageNet-size throughput on synthetic data: 200 steps as in the quantized-NCCL runs.
    "imagenet": dict(model="resnet50", optimizer="sgd", lr=0.0125, momentum=0.9, weight_decay=5e-5,
                     batch_size=32, epochs=1, lr_schedule="none", image_size=224, max_steps=200),
}
TASKS = tuple(TASK_DEFAULTS)


def parse_spec(spec: str):
    """Split ``"qsgd:bits=4,bucket_size=512"`` into ``("qsgd", {"bits": 4, "bucket_size": 512})``.

    Values that look like ints or floats become numbers. This is for labelling logs and metrics; the
    codec itself is built by ``hvd_quant.from_spec``, which is the authority on what is valid.
    """
    spec = (spec or "none").strip()
    method, _, rest = spec.partition(":")
    params = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"bad codec spec {spec!r}: {item!r} is not key=value")
        params[key.strip()] = _number(value.strip())
    return method.strip().lower(), params


def _number(text):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def spec_labels(spec: str):
    """``{"method", "bits", "bucket_size", "mode"}`` for a spec; fp32 is 32 bits, fp16 16 bits."""
    method, params = parse_spec(spec)
    bits = params.get("bits", {"none": 32, "fp32": 32, "fp16": 16, "onebit": 1}.get(method))
    return {"method": method, "bits": bits, "bucket_size": params.get("bucket_size"),
            "mode": params.get("mode")}


def build_parser(framework: str, description: str = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=description or f"hvd_quant {framework} example (run under horovodrun)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("task and model")
    g.add_argument("--task", choices=TASKS, default="mnist",
                   help="mnist | cifar10 | sst5 | lm (byte-level language model on the Python standard "
                        "library's source) | imagenet (synthetic-data throughput)")
    g.add_argument("--model", default=None,
                   help="model name from the registry, or a comma-separated list run one after another "
                        "in the same job (default: the task's)")
    g.add_argument("--list-models", action="store_true", help="print the model registry and exit")

    g = p.add_argument_group("data")
    g.add_argument("--data-dir", default=None,
                   help="directory with the standard dataset files (see docs/EXAMPLES.md); without it "
                        "an offline default is used and the log says which")
    g.add_argument("--train-size", type=int, default=0, help="use only the first N training samples (0: all)")
    g.add_argument("--test-size", type=int, default=0, help="use only the first N test samples (0: all)")
    g.add_argument("--image-size", type=int, default=None, help="input height/width (default: the task's)")
    g.add_argument("--max-len", type=int, default=None,
                   help="SST-5: longest sentence in tokens; lm: context in bytes (default: the task's)")
    g.add_argument("--vocab-size", type=int, default=20000, help="SST-5: most frequent training words kept")
    g.add_argument("--no-augment", action="store_true", help="CIFAR-10: no random crop / flip")

    g = p.add_argument_group("compression and reduction")
    g.add_argument("--compression", default="none",
                   help="codec spec: none | fp16 | qsgd:bits=4,bucket_size=512,mode=stochastic | "
                        "onebit:bucket_size=64 | ...")
    ddp = framework == "PyTorch"
    g.add_argument("--reduction", choices=REDUCTIONS + (("two_level",) if ddp else ()), default="sra",
                   help="how compressed gradients are reduced: sra (scatter-reduce-allgather) or allgather"
                        + ("; two_level: fp32 inside each node, the codec between nodes (Horovod frontends)"
                           if ddp else ""))
    g.add_argument("--frontend", choices=("auto", "hvd_quant", "horovod") + (("ddp",) if ddp else ()),
                   default="auto",
                   help="auto: stock Horovod allreduce for 'none', hvd_quant's DistributedOptimizer "
                        "otherwise; hvd_quant: always hvd_quant; horovod: stock hvd.DistributedOptimizer "
                        "with the codec as its compression= argument"
                        + ("; ddp: torch DDP under torchrun, no Horovod ('none': DDP's allreduce, "
                           "powersgd:rank=R: DDP's PowerSGD hook, a codec: hvd_quant.torch.ddp_comm_hook)"
                           if ddp else ""))
    g.add_argument("--min-compress-numel", type=int, default=1024,
                   help="tensors with fewer elements (and all 1-D tensors) are sent in fp32")
    g.add_argument("--bucket-bytes", type=int, default=None,
                   help="fusion buffer size of hvd_quant's optimizer (default: the frontend's)")
    g.add_argument("--warmup-steps", type=int, default=0,
                   help="steps sent uncompressed before the codec takes over")
    g.add_argument("--backward-passes-per-step", type=int, default=1)

    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=int, default=None)
    g.add_argument("--max-steps", type=int, default=None,
                   help="stop after this many optimizer steps in all (0: no limit)")
    g.add_argument("--batch-size", type=int, default=None, help="per rank")
    g.add_argument("--optimizer", choices=("adam", "sgd"), default=None)
    g.add_argument("--lr", type=float, default=None, help="per-rank learning rate, times world size unless --no-scale-lr")
    g.add_argument("--no-scale-lr", action="store_true")
    g.add_argument("--momentum", type=float, default=None)
    g.add_argument("--weight-decay", type=float, default=None)
    g.add_argument("--lr-schedule", choices=("none", "step", "cosine"), default=None)
    g.add_argument("--seed", type=int, default=42)
    g.add_argument("--no-eval", action="store_true", help="skip the test pass at the end of each epoch")
    g.add_argument("--bench-warmup", type=int, default=10,
                   help="steps left out of the final throughput figure")

    g = p.add_argument_group("logging")
    g.add_argument("--log-every", type=int, default=200, help="print 'StepN: X data/sec' every N steps")
    g.add_argument("--metrics-out", default=None,
                   help="write every metric here, as JSON lines (.jsonl/.json) or CSV (.csv)")
    g.add_argument("--no-progress", action="store_true",
                   help="no progress (rank 0 only: a bar on a terminal, else a line every 30 s)")
    g.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="also write the metrics as TensorBoard scalars under DIR/<model> (rank 0)")
    return p


def finalize(args):
    """Fill the task's defaults into ``args`` where the user gave none; return ``args``."""
    defaults = TASK_DEFAULTS[args.task]
    if getattr(args, "max_len", None) is None:
        args.max_len = defaults.get("max_len", 256)
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.models = [m.strip() for m in str(args.model).split(",") if m.strip()]
    if args.max_steps is None:
        args.max_steps = 0
    if args.log_every <= 0:
        raise SystemExit("--log-every must be positive")
    args.compression = args.compression.strip() or "none"
    return args
