"""Quality per byte: relative error and bias of QSGD, SortQuant and KMeans on real gradients (issue 15).

For each example task (the ResNet-18 of ``--task mnist`` on the 5,000-image MNIST sample offline, and
the SST-5 Transformer of ``--task sst5``: generated keyword-sentiment sentences offline), the model trains ``--steps`` steps with Adam (batch
128, the examples' settings), then the gradient of the next batch, all parameters flattened into one
float32 vector g, goes through each codec ``--draws`` times (seeds 0, 1, ...). ``--task resnet50``
(needs a GPU): torchvision's ResNet-50 on synthetic ImageNet batches (64 images of 224 x 224, 1000
classes, SGD with momentum, lr 0.1), its gradient kept on the GPU and the codecs' CUDA kernels run.
Printed per codec:

* ``bits/elem``: the payload's size (header, codes, scales) * 8 / numel;
* ``rel. error``: the mean over the draws of ||Q(g) - g|| / ||g||;
* ``bias``: ||mean of the draws - g|| / ||g|| (a deterministic codec's is its error; an unbiased
  codec's falls as 1/sqrt(draws));
* ``enc+dec ms``: one encode and decode_into of g (CPU: Numba, ``NUMBA_NUM_THREADS``; GPU: the
  CUDA kernels, synchronised), the best of three, beside a copy of g.

    python scripts/quality_table.py                       # both tasks, 20 steps, 16 draws
    python scripts/quality_table.py --tasks mnist --steps 5 --draws 4

The codec list (``--codecs``, semicolon-separated specs) defaults to QSGD and SortQuant at about 2, 4,
6 and 8 bits per element (the source's settings: 4 = 2+2, 6 = 3+3, 8 = 2+6), each with bucket 512,
and KMeans at 2, 4, 6 and 8 bits with 20 iterations, one codebook for g (the source's setting) and
one per bucket of 4096 (2, 4 bits), 16384 (6) or 65536 (8) values (codebooks of 1/8 bit per element
or less).
"""
import argparse
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import hvd_quant  # noqa: E402
from examples.common import data as D  # noqa: E402
from examples.pytorch.models import ModelContext, build_model  # noqa: E402

CODECS = ("qsgd:bits=2,bucket_size=512;sortquant:bits=2,split_bits=1,bucket_size=512;"
          "qsgd:bits=4,bucket_size=512;sortquant:bits=4,split_bits=2,bucket_size=512;"
          "sortquant:bits=4,split_bits=1,bucket_size=512;"
          "qsgd:bits=4,bucket_size=512,mode=deterministic;"
          "sortquant:bits=4,split_bits=2,bucket_size=512,mode=deterministic;"
          "qsgd:bits=6,bucket_size=512;sortquant:bits=6,split_bits=3,bucket_size=512;"
          "qsgd:bits=8,bucket_size=512;sortquant:bits=8,split_bits=2,bucket_size=512;"
          "kmeans:bits=2,iters=20;kmeans:bits=4,iters=20;kmeans:bits=6,iters=20;kmeans:bits=8,iters=20;"
          "kmeans:bits=2,iters=20,bucket_size=4096;kmeans:bits=4,iters=20,bucket_size=4096;"
          "kmeans:bits=6,iters=20,bucket_size=16384;kmeans:bits=8,iters=20,bucket_size=65536")


def task_gradient(task, steps, seed):
    """(description, flat float32 gradient) after ``steps`` steps of the task's model."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    if task == "resnet50":
        import torchvision
        if not torch.cuda.is_available():
            raise SystemExit("--tasks resnet50 needs a GPU")
        model = torchvision.models.resnet50(num_classes=1000).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        batches = [(torch.randn(64, 3, 224, 224, device="cuda"), torch.randint(0, 1000, (64,), device="cuda"))
                   for _ in range(4)]
        what = "resnet50 (synthetic ImageNet batches of 64, torchvision ResNet-50"
    elif task in ("mnist", "sst5"):
        if task == "mnist":
            ds = D.load_mnist(image_size=28, seed=seed)
            ctx = ModelContext(num_classes=ds.num_classes, in_channels=ds.x_train.shape[1], image_size=28,
                               small_input=True)
            name = "resnet18"
        else:
            ds = D.load_sst5(max_len=256, seed=seed)
            ctx = ModelContext(num_classes=5, vocab_size=ds.meta["vocab_size"], max_len=256)
            name = "transformer"
        model, _ = build_model(name, ctx, "builtin")
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        batches = []
        for _ in range(steps + 1):
            idx = rng.choice(len(ds.y_train), 128, replace=False)
            batches.append((torch.from_numpy(ds.x_train[idx]), torch.from_numpy(ds.y_train[idx])))
        what = f"{task} ({ds.kind}, {name}"
    else:
        raise SystemExit(f"unknown task {task!r} (mnist, sst5, resnet50)")
    loss_fn = nn.CrossEntropyLoss()
    grads = None
    for step in range(steps + 1):
        x, y = batches[step % len(batches)]
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        if step == steps:
            grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
        else:
            opt.step()
        print(f"  {task}: step {step}/{steps} loss {float(loss.detach()):.3f}", flush=True)
    g = grads.detach().float().contiguous()
    n = g.numel()
    if not g.is_cuda:
        g = g.numpy().copy()
    return f"{what}, {n:,} parameters, after {steps} steps)", g


def best_of(f, n=3, cuda=False):
    best = float("inf")
    for _ in range(n):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        f()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def rows(g, specs, draws):
    """(spec, bits/elem, rel. error, bias, enc+dec ms) per codec, on g (NumPy, or a CUDA tensor)."""
    cuda = not isinstance(g, np.ndarray)
    t = g if cuda else torch.from_numpy(g)
    g64 = t.double()
    norm = float(torch.linalg.vector_norm(g64))
    out = torch.empty_like(t) if cuda else np.empty_like(g)
    copy_ms = best_of(lambda: out.copy_(t) if cuda else np.copyto(out, g), cuda=cuda)
    yield ("copy", 32.0, 0.0, 0.0, copy_ms)
    for spec in specs:
        base = hvd_quant.from_spec(spec)
        cfg = {k: v for k, v in base._config().items() if k != "seed"}
        stochastic = base.stochastic
        errs, acc = [], torch.zeros_like(g64)
        for k in range(draws if stochastic else 1):
            c = type(base)(**cfg, seed=k) if stochastic else base
            y = c.decode(c.encode(g, name="g"))
            y = (y if cuda else torch.from_numpy(y)).double()
            errs.append(float(torch.linalg.vector_norm(y - g64)) / norm)
            acc += y
        bias = float(torch.linalg.vector_norm(acc / len(errs) - g64)) / norm
        nbytes = base.wire_nbytes(t.numel())
        ms = best_of(lambda: base.decode_into(base.encode(g, name="g"), out), cuda=cuda)
        yield (spec, nbytes * 8 / t.numel(), float(np.mean(errs)), bias, ms)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="mnist,sst5")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--draws", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--codecs", default=CODECS)
    args = ap.parse_args(argv)
    specs = [s.strip() for s in args.codecs.split(";") if s.strip()]
    for task in args.tasks.split(","):
        what, g = task_gradient(task.strip(), args.steps, args.seed)
        print(f"\n### {what}; {args.draws} draws of the stochastic codecs\n")
        print("| codec | bits/elem | rel. error | bias | enc+dec ms |")
        print("|---|---:|---:|---:|---:|")
        for spec, bits, err, bias, ms in rows(g, specs, args.draws):
            print(f"| {spec} | {bits:.3f} | {err:.4f} | {bias:.4f} | {ms:.2f} |", flush=True)


if __name__ == "__main__":
    main()
