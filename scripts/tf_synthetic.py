#!/usr/bin/env python3
"""Images/sec of a Keras application model trained on synthetic data with Horovod's stock
``hvd.DistributedGradientTape`` inside a ``tf.function``, as Horovod's own TensorFlow 2 synthetic
benchmark does it, with only ``compression=`` changed (or hvd_quant's own tape with ``--tape hvdq``).

    horovodrun -np 2 -H localhost:2 --gloo python scripts/tf_synthetic.py \\
        --model MobileNetV2 --image 64 --batch-size 16 --compression qsgd:bits=4

``--compression``: ``none`` (Horovod fp32), ``fp16`` (Horovod's fp16), or an hvd_quant spec string
(``qsgd:bits=4``, ``onebit``); ``--reduction`` sets the stock path's reduction
(:class:`hvd_quant.StockCompression`). Rank 0 prints one line per timed iteration and the mean with
its 95% interval (1.96 standard deviations), as Horovod's script does, and a last line
``RESULT <json>``.
"""
import argparse
import json
import os
import sys
import timeit

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd


def compression_of(spec, reduction):
    if spec == "none":
        return hvd.Compression.none
    if spec == "fp16":
        return hvd.Compression.fp16
    import hvd_quant
    return hvd_quant.StockCompression(hvd_quant.from_spec(spec), reduction=reduction)


def training_step(model_name, image, batch_size):
    """A Keras application model, SGD and one synthetic batch; returns ``make(make_tape)``: a
    ``tf.function`` ``step(first_batch=False)`` whose tape is ``make_tape(tf.GradientTape)``
    (the first batch also broadcasts the variables from rank 0)."""
    tf.random.set_seed(1)
    model = getattr(tf.keras.applications, model_name)(weights=None, input_shape=(image, image, 3))
    opt = tf.optimizers.SGD(0.01)
    data = tf.random.uniform([batch_size, image, image, 3])
    target = tf.random.uniform([batch_size, 1], minval=0, maxval=999, dtype=tf.int64)

    def make(make_tape):
        @tf.function
        def step(first_batch=False):
            with tf.GradientTape() as tape:
                loss = tf.losses.sparse_categorical_crossentropy(target, model(data, training=True))
            tape = make_tape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            if first_batch:
                hvd.broadcast_variables(model.variables, root_rank=0)
                hvd.broadcast_variables(opt.variables(), root_rank=0)
        return step
    return make


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="MobileNetV2", help="a tf.keras.applications model")
    p.add_argument("--image", type=int, default=64, help="image side in pixels")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--compression", default="none")
    p.add_argument("--reduction", default="auto", help="stock path: auto | sra | allgather")
    p.add_argument("--tape", choices=("stock", "hvdq"), default="stock",
                   help="stock: hvd.DistributedGradientTape(compression=...); hvdq: "
                        "hvd_quant.tensorflow.DistributedGradientTape")
    p.add_argument("--num-warmup-batches", type=int, default=10)
    p.add_argument("--num-batches-per-iter", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=10)
    args = p.parse_args()

    hvd.init()
    if args.tape == "hvdq":
        import hvd_quant.tensorflow as hq
        comp = "none" if args.compression == "none" else args.compression
        make_tape = lambda tape: hq.DistributedGradientTape(tape, compression=comp,
                                                            reduction=args.reduction)
    else:
        compression = compression_of(args.compression, args.reduction)
        make_tape = lambda tape: hvd.DistributedGradientTape(tape, compression=compression)
    step = training_step(args.model, args.image, args.batch_size)(make_tape)

    def log(s):
        if hvd.rank() == 0:
            print(s, flush=True)

    log(f"Model: {args.model} {args.image}px, batch {args.batch_size}, {hvd.size()} ranks, "
        f"compression {args.compression} ({args.tape} tape, reduction {args.reduction})")
    with tf.device("CPU"):
        step(first_batch=True)
        timeit.timeit(lambda: step(first_batch=False), number=args.num_warmup_batches)
        rates = []
        for i in range(args.num_iters):
            t = timeit.timeit(lambda: step(first_batch=False), number=args.num_batches_per_iter)
            rates.append(args.batch_size * args.num_batches_per_iter / t)
            log(f"Iter #{i}: {rates[-1]:.1f} img/sec per CPU")
    mean, conf = float(np.mean(rates)), float(1.96 * np.std(rates))
    log(f"Total img/sec on {hvd.size()} CPU(s): {hvd.size() * mean:.1f} +-{hvd.size() * conf:.1f}")
    log("RESULT " + json.dumps({"compression": args.compression, "tape": args.tape,
                                "reduction": args.reduction, "model": args.model,
                                "ranks": hvd.size(), "img_s": hvd.size() * mean,
                                "conf": hvd.size() * conf}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
