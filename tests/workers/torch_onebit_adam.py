"""Worker: ``hvd_quant.torch.OneBitAdam`` on real Horovod processes (argv: the case groups to run).

Every rank draws its own batch from a generator seeded by (rank, step), so local gradients differ.

* ``adam``: during the warm-up the parameters follow ``torch.optim.Adam(foreach=False)`` (and AdamW;
  with ``bias_correction=False``, DeepSpeed's update as its code writes it) stepped on the gradients
  averaged by ``hvd.allreduce`` tensor by tensor. The optimizer averages
  fused buckets instead; at 2 ranks a+b is a+b in any order, so the two agree bit for bit; at 3 ranks
  the sum order may differ (relative gradient error <= 2 eps32 per element), and Adam's step
  ``lr * m_hat / (sqrt(v_hat) + eps)`` is scale-free, |m_hat / sqrt(v_hat)| <= (1-b1)/sqrt(1-b2) / (1-b1^t)
  * sqrt(1-b2^t) <= 3.2, so a relative perturbation d of the gradients moves a step by at most
  ~2 d * 3.2 * lr: over K steps tol = K * (lr * 8 * 2 * eps32 + 2 ulp(|p|)). DeepSpeed's update
  rounds differently (mul-add for lerp, decay in the update): the same tolerance.
* ``frozen``: after the freeze, per bucket and step, with c_r = m_r + e_r (rank r's local momentum
  plus its worker residual), e'_r its new residual, E / E' the server residuals of the chunks (in rank
  order they tile the bucket) and m' the exchanged momentum, error feedback gives exactly
      N m' = sum_r m_r + sum_r (e_r - e'_r) + (E - E')
  up to float32 rounding of the sums involved: |err| <= 4 N eps32 (sum_r(|m_r|+|e_r|+|e'_r|) + |E| + |E'|
  + N |m'|) per element. Hence, per element, the 1-bit bound |m' - mean_r m_r| <= (sum_r (|e_r| +
  |e'_r|) + |E| + |E'| + err) / N, where OneBit's two-mean code decodes an element to the mean of the
  same-signed elements of its codec bucket, so |e'_r| <= max |c_r| and |E'| <= max |s| (s the reduced
  sum) per bucket: the error is bounded by the scales of this and the last step. The momentum
  and the parameters have the same bytes on every rank; the variance stays as it was at the freeze;
  bytes per step against fp32's.
* ``resume``: state_dict after the freeze, torch.save, a new model and optimizer, load, then a new
  learning rate in both runs: the same parameters as the uninterrupted run, bit for bit; the same
  without the residuals differs.
* ``broadcast``: rank 0 loads a checkpoint, the others start fresh; ``hvd.broadcast_optimizer_state``
  gives every rank rank 0's state, and the next steps keep the ranks identical.
* ``errors``: bad arguments, sparse gradients, parameter groups changed after the freeze, ranks
  configured differently.
* ``train``: a small regression (a teacher MLP's targets), 400 steps, freeze at 80: Adam (Horovod's
  fp32 DistributedOptimizer) learns it (test loss below a tenth of the start), and 1-bit Adam ends
  within 10% of Adam's test loss; plain 1-bit EF under Adam is printed beside them.
"""
import io
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import horovod.torch as hvd

import hvd_quant
import hvd_quant.torch as hqt

from torch_common import Checks, init, params_identical, same_on_all_ranks

R, N = init()
check = Checks()
EPS32 = float(torch.finfo(torch.float32).eps)
KEY = "hvd_quant_onebit_adam"
CODEC = hvd_quant.OneBit(bucket_size=64)
_uid = [0]


def name(prefix):
    _uid[0] += 1
    return f"{prefix}.{_uid[0]}"


def model_for(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 48), nn.Tanh(), nn.Linear(48, 40), nn.Tanh(), nn.Linear(40, 4))


def local_grads(model, step, rank=R):
    """This rank's gradients at ``step`` (its own batch), left in ``p.grad``."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    for p in model.parameters():
        p.grad = None
    F.mse_loss(model(x), y).backward()


def onebit_adam(model, **kw):
    kw.setdefault("freeze_step", 3)
    kw.setdefault("bucket_bytes", 4096)     # several buckets, and chunks on every rank
    kw.setdefault("compression", CODEC)
    return hqt.OneBitAdam(model.parameters(), named_parameters=model.named_parameters(), **kw)


class DeepSpeedUpdate:
    """DeepSpeed OnebitAdam's warm-up update as its code writes it: no bias correction, weight decay
    added to the update."""

    def __init__(self, params, lr, weight_decay, betas=(0.9, 0.999), eps=1e-8):
        self.params, self.lr, self.wd, self.betas, self.eps = list(params), lr, weight_decay, betas, eps
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self):
        b1, b2 = self.betas
        for p, m, v in zip(self.params, self.m, self.v):
            m.mul_(b1).add_(p.grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            p.add_(m / (v.sqrt() + self.eps) + self.wd * p, alpha=-self.lr)


def adam_cases():
    steps, lr, wd = 6, 1e-2, 0.05
    variants = (("torch.optim.Adam", {}, lambda ps: torch.optim.Adam(ps, lr, weight_decay=wd, foreach=False)),
                ("torch.optim.AdamW", {"decoupled_weight_decay": True},
                 lambda ps: torch.optim.Adam(ps, lr, weight_decay=wd, foreach=False, decoupled_weight_decay=True)),
                ("DeepSpeed's update", {"decoupled_weight_decay": True, "bias_correction": False},
                 lambda ps: DeepSpeedUpdate(ps, lr, wd)))
    for what, kw, make_ref in variants:
        model, ref = model_for(), model_for()
        opt = onebit_adam(model, lr=lr, weight_decay=wd, freeze_step=10, **kw)
        ref_opt = make_ref(ref.parameters())
        # an lr schedule on both (torch's schedulers drive any torch.optim.Optimizer's groups)
        scheds = [] if what == "DeepSpeed's update" else [
            torch.optim.lr_scheduler.LambdaLR(o, lambda k: 0.7 ** k) for o in (opt, ref_opt)]
        # the same operations as the reference: exact at 2 ranks; DeepSpeed's are other roundings
        exact = N == 2 and what != "DeepSpeed's update"
        worst, tol = 0.0, 0.0
        for t in range(1, steps + 1):
            local_grads(model, t)
            local_grads(ref, t)
            for p in ref.parameters():
                p.grad = hvd.allreduce(p.grad, op=hvd.Average, name=name("ref"))
            opt.step()
            ref_opt.step()
            for s in scheds:
                s.step()
            for a, b in zip(model.parameters(), ref.parameters()):
                worst = max(worst, float((a - b).detach().abs().max()))
                tol = max(tol, t * (lr * 8 * 2 * EPS32 + 2 * EPS32 * float(b.detach().abs().max())))
        tol = 0.0 if exact else tol
        check(worst <= tol, f"adam warm-up equals {what} on the average"
              + (" (an lr schedule on both)" if scheds else ""), f"max |dp| {worst:.3g} tol {tol:.3g}")
        check(all(g["lr"] == lr * 0.7 ** steps for g in opt.param_groups) or not scheds,
              f"adam warm-up {what}: the scheduler set the lr", f"{opt.param_groups[0]['lr']}")
        check(params_identical(model), f"adam warm-up {what}: identical on every rank")
        check(opt.bytes_per_step().ratio == 1.0, "adam warm-up sends fp32", f"{opt.bytes_per_step()}")


def gathered(vec):
    """Every rank's copy of a 1-D float32 tensor of the same length, as float64 (N, n)."""
    return hvd.allgather(vec.detach().double()[None], name=name("vec"))


def bucket_vectors(opt, sd_key):
    """Per bucket: this rank's worker residual (flat, bucket order) and the server residuals of all
    ranks concatenated in rank order (zeros before the first exchange)."""
    ours = opt.state_dict()[KEY]
    out = []
    for b in opt.buckets:
        w = ours["worker_residuals"]
        worker = (torch.cat([w[n].reshape(-1) for n in b.names]) if all(n in w for n in b.names)
                  else torch.zeros(b.numel))
        mine = [v for (h, r, size), v in ours["server_residuals"].items() if h == b.header and size == N]
        server = mine[0] if mine else None
        parts = hvd.allgather_object(None if server is None else server.double(), name=name("srv"))
        server = (torch.cat([p for p in parts if p is not None]) if any(p is not None for p in parts)
                  else torch.zeros(b.numel, dtype=torch.float64))
        out.append((worker, server))
    return out


def flat_state(opt, b, key):
    by_name = dict(zip(b.names, (opt.state[p][key] for p in opt._bucket_params[b.index])))
    return torch.cat([by_name[n].reshape(-1) for n in b.names])


def frozen_cases():
    model, lr, wd, b1 = model_for(), 1e-2, 0.01, 0.9
    opt = onebit_adam(model, lr=lr, weight_decay=wd)
    for t in range(1, 4):
        local_grads(model, t)
        opt.step()
    check(opt.frozen, "frozen after freeze_step steps")
    v_frozen = [opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()]
    for t in range(4, 9):
        local_grads(model, t)
        before = bucket_vectors(opt, KEY)
        # this rank's local momentum, as the optimizer forms it (the same operations)
        local = {p: opt.state[p]["exp_avg"].lerp(p.grad.add(p, alpha=wd), 1 - b1) for p in model.parameters()}
        opt.step()
        after = bucket_vectors(opt, KEY)
        for b, (e0, E0), (e1, E1) in zip(opt.buckets, before, after):
            ps = opt._bucket_params[b.index]
            m_r = gathered(torch.cat([local[p].reshape(-1) for p in ps]))
            e_r, e1_r = gathered(e0), gathered(e1)
            m_new = torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in ps]).double()
            lhs = N * m_new
            rhs = m_r.sum(0) + (e_r - e1_r).sum(0) + (E0 - E1)
            scale = (m_r.abs() + e_r.abs() + e1_r.abs()).sum(0) + E0.abs() + E1.abs() + N * m_new.abs()
            err = (lhs - rhs).abs()
            check(bool((err <= 4 * N * EPS32 * scale).all()),
                  f"frozen step {t} bucket {b.index}: N m' = sum m_r + worker and server residual change",
                  f"max err {float(err.max()):.3g}, max tol {float((4 * N * EPS32 * scale).max()):.3g}")
            c_r, s = m_r + e_r, lhs + E1
            bound = ((e_r.abs() + e1_r.abs()).sum(0) + E0.abs() + E1.abs() + 4 * N * EPS32 * scale) / N
            dev = (m_new - m_r.mean(0)).abs()
            check(bool((e1_r.abs().amax(1) <= c_r.abs().amax(1)).all()) and E1.abs().max() <= s.abs().max()
                  and bool((dev <= bound).all()),
                  f"frozen step {t} bucket {b.index}: within the 1-bit bound of the average",
                  f"max |m' - mean m_r| {float(dev.max()):.3g}, max of it over its bound "
                  f"{float((dev / bound).max()):.3g}")
        check(same_on_all_ranks(torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in model.parameters()]))
              and params_identical(model), f"frozen step {t}: momentum and parameters identical on every rank")
    check(all(torch.equal(v, opt.state[p]["exp_avg_sq"]) for v, p in zip(v_frozen, model.parameters())),
          "the variance stays frozen")
    traffic = opt.bytes_per_step()
    check(traffic.fp32_bytes > 0 and traffic.sent_bytes < traffic.fp32_bytes / 8,
          "frozen bytes per step far below fp32's", f"ratio {traffic.ratio:.1f} ({traffic.sent_bytes} B)")


def run(model, opt, first, last):
    for t in range(first, last + 1):
        local_grads(model, t)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def checkpoint(model, opt):
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    return buf.getvalue()


def restored(blob, drop_residuals=False):
    ck = torch.load(io.BytesIO(blob), weights_only=False)
    model = model_for(seed=99)
    model.load_state_dict(ck["model"])
    opt = onebit_adam(model, lr=1e-2)
    if drop_residuals:
        ck["opt"][KEY]["worker_residuals"], ck["opt"][KEY]["server_residuals"] = {}, {}
    opt.load_state_dict(ck["opt"])
    return model, opt


def resume_cases():
    model = model_for()
    opt = onebit_adam(model, lr=1e-2)
    run(model, opt, 1, 5)
    blob = checkpoint(model, opt)
    ours = opt.state_dict()[KEY]
    check(len(ours["worker_residuals"]) == len(list(model.parameters())) and
          all(size == N for _, _, size in ours["server_residuals"]),
          "state_dict holds worker residuals per parameter and server residuals per (bucket, rank, size)",
          f"{len(ours['worker_residuals'])} worker, {len(ours['server_residuals'])} server")

    def decay(o):       # a learning-rate schedule's change after the checkpoint, in both runs
        for g in o.param_groups:
            g["lr"] = 4e-3
        return o

    straight = run(model, decay(opt), 6, 9)
    m2, o2 = restored(blob)
    again = run(m2, decay(o2), 6, 9)
    check(all(torch.equal(a, b) for a, b in zip(straight, again)),
          "resume after the freeze (and a new lr) equals the uninterrupted run, bit for bit")
    m3, o3 = restored(blob, drop_residuals=True)
    lost = run(m3, decay(o3), 6, 9)
    check(not all(torch.equal(a, b) for a, b in zip(straight, lost)), "resume without residuals differs")


def broadcast_cases():
    model = model_for()
    opt = onebit_adam(model, lr=1e-2)
    run(model, opt, 1, 5)
    blob = hvd.broadcast_object(checkpoint(model, opt) if R == 0 else None, root_rank=0, name=name("ck"))
    if R == 0:
        model, opt = restored(blob)
    else:
        model = model_for(seed=7)
        opt = onebit_adam(model, lr=1e-2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    steps = hvd.allgather_object([opt.state[p]["step"] for p in model.parameters()], name=name("st"))
    tensors = torch.cat([opt.state[p][k].reshape(-1) for p in model.parameters() for k in ("exp_avg", "exp_avg_sq")])
    check(all(s == [5] * len(s) for s in steps) and same_on_all_ranks(tensors) and opt.frozen,
          "broadcast_optimizer_state gives every rank rank 0's step, momentum and variance", f"{steps}")
    run(model, opt, 6, 8)
    check(params_identical(model), "after the broadcast the ranks stay identical")


raises = check.raises


def error_cases():
    model = model_for()
    for bad in (0, -1, 2.5, True, "3", None):
        raises(f"freeze_step={bad!r}", lambda: onebit_adam(model, freeze_step=bad), text="freeze_step")
    raises("a QSGD codec", lambda: onebit_adam(model, compression=hvd_quant.QSGD(bits=4)), text="1-bit")
    raises("OneBit without error feedback",
           lambda: onebit_adam(model, compression=hvd_quant.OneBit(error_feedback=False)), text="error feedback")
    raises("betas out of range", lambda: onebit_adam(model, betas=(0.9, 1.0)), text="betas")
    raises("lr=-1", lambda: onebit_adam(model, lr=-1.0), text="lr")
    raises("bucket_bytes=-1", lambda: onebit_adam(model, bucket_bytes=-1), text="bucket_bytes")
    raises("float64 parameters", lambda: onebit_adam(model_for().double()), text="float32")
    raises("an unnamed parameter", lambda: hqt.OneBitAdam(
        model.parameters(), freeze_step=3, named_parameters=list(model.named_parameters())[1:]), text="name")

    emb = nn.Embedding(10, 4, sparse=True)
    opt = hqt.OneBitAdam(emb.parameters(), freeze_step=3)
    emb(torch.tensor([1, 2])).sum().backward()
    raises("a sparse gradient", opt.step, text="sparse")

    extra = nn.Linear(3, 3)
    model = model_for()
    opt = onebit_adam(model, lr=1e-2)
    run(model, opt, 1, 1)
    opt.add_param_group({"params": extra.parameters()})      # before the freeze: planned again
    extra.weight.grad, extra.bias.grad = torch.ones(3, 3), torch.ones(3)
    run(model, opt, 2, 3)
    check(params_identical(model) and any(p is extra.weight for p in opt._params),
          "errors: a parameter group added before the freeze is planned")
    late = nn.Linear(2, 2)
    opt.add_param_group({"params": late.parameters()})
    local_grads(model, 4)
    raises("a parameter group added after the freeze", opt.step, text="after the variance was frozen")

    raises("ranks configured differently",
           lambda: run(model_for(), onebit_adam(model_for(), bucket_bytes=4096 + 4 * 64 * R), 1, 1),
           exc=hvd_quant.ConfigMismatchError, text="configured differently")


def train_cases():
    """A teacher MLP's targets, 4 shards; Adam (Horovod fp32), 1-bit Adam and 1-bit EF under Adam."""
    g = torch.Generator().manual_seed(5)
    teacher = nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 1))
    for p in teacher.parameters():      # unit-variance pre-activations and targets
        p.data = torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5 if p.dim() > 1 else 1.0)
    x = torch.randn(4096, 20, generator=g)
    with torch.no_grad():
        y = teacher(x)
    xs, ys = x[R::N], y[R::N]
    test_x, test_y = torch.randn(1024, 20, generator=g), None
    with torch.no_grad():
        test_y = teacher(test_x)

    def fit(kind, steps=400):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(20, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1))
        if kind == "adam":
            opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=3e-3),
                                           named_parameters=model.named_parameters())
        elif kind == "1bit-adam":
            opt = hqt.OneBitAdam(model.parameters(), lr=3e-3, freeze_step=80,
                                 named_parameters=model.named_parameters())
        else:
            opt = hqt.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=3e-3),
                                           named_parameters=model.named_parameters(),
                                           compression=hvd_quant.OneBit(bucket_size=1024), reduction="sra",
                                           min_compress_numel=0)
        with torch.no_grad():
            start = float(F.mse_loss(model(test_x), test_y))
        gen = torch.Generator().manual_seed(R)
        for _ in range(steps):
            idx = torch.randint(0, xs.shape[0], (64,), generator=gen)
            opt.zero_grad()
            F.mse_loss(model(xs[idx]), ys[idx]).backward()
            opt.step()
        with torch.no_grad():
            return float(F.mse_loss(model(test_x), test_y)), start, opt

    adam, start, _ = fit("adam")
    onebit, _, opt = fit("1bit-adam")
    ef, _, _ = fit("1bit-ef")
    print(f"TRAIN adam {adam:.5f} 1bit-adam {onebit:.5f} 1bit-ef-adam {ef:.5f} start {start:.5f} "
          f"bytes ratio {opt.bytes_per_step().ratio:.1f}", flush=True)
    check(adam < start / 10, "train: Adam learns the task", f"{start:.5f} -> {adam:.5f}")
    check(onebit <= 1.1 * adam, "train: 1-bit Adam within 10% of Adam's test loss",
          f"{onebit:.5f} vs {adam:.5f} (1-bit EF under Adam {ef:.5f})")


def main():
    groups = sys.argv[1:] or ["adam", "frozen", "resume", "broadcast", "errors", "train"]
    table = {"adam": adam_cases, "frozen": frozen_cases, "resume": resume_cases,
             "broadcast": broadcast_cases, "errors": error_cases, "train": train_cases}
    for g in groups:
        check.run(g, table[g])
    check.finish()


if __name__ == "__main__":
    main()
