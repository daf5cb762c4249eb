"""Worker: both PyTorch entry points, step by step, against an uncompressed hvd.allreduce.

Entry points: ``hvd_quant.torch.DistributedOptimizer`` ("ours") and stock
``hvd.DistributedOptimizer(compression=<codec or StockCompression>)`` ("stock").

Each step computes every rank's local gradients with ``torch.autograd.grad`` (which does not fire the
optimizer's hooks), allreduces them uncompressed as the reference, then runs the real backward and
``synchronize()`` and checks:

* compressed gradients within the codec's bound of the reference. With M_j the largest |gradient| of
  rank j over all compressed tensors (an upper bound of every bucket's max), s = 2^(bits-1)-1 and
  unit_j = M_j / s: deterministic QSGD errs at most unit_j/2 per rank per quantization, stochastic at
  most unit_j; allgather quantizes once, SRA twice (the second time the reduced chunk, whose max is at
  most sum_j M_j). Average divides the bound by N. fp16/bf16 gradients add one rounding of the result;
* uncompressed tensors (1-D, < min_compress_numel) equal to the reference up to fp32 summation order;
* after ``step()``, every parameter has the same bytes on every rank.

Then: op Sum, gradient_predivide_factor, groups (Horovod's grouped path for stock), hook order that
differs between ranks, backward_passes_per_step, warmup, NaN, process sets (one, and several at once:
``process-sets``), bytes per step, Adasum refusal, state_dict / TorchState resume (bit-exact, residuals
included), and training to a loss close to fp32's (argv ``train``).
"""
import copy
import io
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import horovod.torch as hvd

import hvd_quant
import hvd_quant.torch as hqt

from torch_common import (DEVICE, Checks, gather_max, init, params_identical, payload_group,
                          same_on_all_ranks)

# A process set of ranks 0 and 1 (with 2 ranks it would duplicate the global set, which Horovod
# refuses; then the global set stands in), and more sets for several at once (process_set_cases):
# 2 ranks {0} and {1}; 3 ranks {0,1} and {1,2}, overlapping in rank 1; 4 ranks {0,1} and {2,3},
# disjoint, and {1,2,3}, overlapping both.
_WORLD = int(os.environ.get("HOROVOD_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or 0)
PS01 = hvd.ProcessSet([0, 1]) if _WORLD > 2 else None
# (not on emulated nodes, tests/workers/torch_two_level.py: Horovod's Gloo init times out there on
# a set of ranks 1, 2 and 3, which spans both hosts)
MORE_SETS = [hvd.ProcessSet(r) for r in {2: [[0], [1]], 3: [[1, 2]], 4: [[2, 3], [1, 2, 3]]}.get(_WORLD, [])
             if os.environ.get("HVDQ_TEST_NODES") is None]
R, N = init(process_sets=([PS01] if PS01 is not None else []) + MORE_SETS)
PS01 = PS01 or hvd.global_process_set
check = Checks()
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

Q8 = "qsgd:bits=8,bucket_size=512,mode=deterministic"
Q4D = "qsgd:bits=4,bucket_size=512,mode=deterministic"
Q4S = "qsgd:bits=4,bucket_size=512,mode=stochastic,seed=11"
Q2S = "qsgd:bits=2,bucket_size=128,mode=stochastic,seed=5"
ONEBIT = "onebit:bucket_size=64"
SQ4 = "sortquant:bits=4,split_bits=2,bucket_size=128,mode=stochastic,seed=3"
KM3 = "kmeans:bits=3,iters=5,seed=3"
_case = [0]


class Net(nn.Module):
    """a.weight 2048 and b.weight 4096 elements are compressed; c.weight (640) and biases are not."""

    def __init__(self, d_in=32, h=64, out=10):
        super().__init__()
        self.a = nn.Linear(d_in, h)
        self.b = nn.Linear(h, h)
        self.c = nn.Linear(h, out)

    def forward(self, x):
        return self.c(F.relu(self.b(F.relu(self.a(x)))))


class TwoBranch(nn.Module):
    """Two independent losses: backward of one fires only its own parameters' hooks."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(32, 64)
        self.c = nn.Linear(32, 64)

    def losses(self, x):
        return [m(x).tanh().pow(2).mean() for m in (self.a, self.b, self.c)]


def batch(step, salt, n=16, d_in=32, rank=None):
    g = torch.Generator().manual_seed(7919 * (R if rank is None else rank) + 104729 * step + salt)
    return torch.randn(n, d_in, generator=g).to(DEVICE), torch.randint(0, 10, (n,), generator=g).to(DEVICE)


def codec(spec):
    return hvd_quant.from_spec(spec)


def make_opt(entry, model, spec, base=None, reduction="sra", **kw):
    base = base or torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    named = list(model.named_parameters())
    if entry == "ours":
        return hqt.DistributedOptimizer(base, named_parameters=named, compression=codec(spec),
                                        reduction=reduction, bucket_bytes=16384, **kw)
    ef = kw.pop("error_feedback", None)
    stock_kw = {k: kw.pop(k) for k in ("min_compress_numel",) if k in kw}
    comp = codec(spec)
    if reduction != "sra" or ef is not None or stock_kw:
        comp = hvd_quant.StockCompression(comp, reduction=reduction, error_feedback=ef, **stock_kw)
    return hvd.DistributedOptimizer(base, named_parameters=named, compression=comp, **kw)


def q_factor(spec, reduction):
    """Bound multiplier on sum_j unit_j (module doc)."""
    per = 0.5 if "deterministic" in spec else 1.0
    # two_level across 2 nodes: each node's fp32 sum is quantized once (its max at most sum_j M_j)
    return per * (1 if reduction in ("allgather", "two_level") else 2)


def is_compressed(p, min_numel=1024):
    return p.dim() > 1 and p.numel() >= min_numel


def grads_within_bound(params, ref, m, spec, reduction, op, size, compressed=True, min_cos=None):
    """``(ok, worst error / bound)`` of the exchanged ``p.grad`` against ``ref`` (module doc); ``m``:
    every member's largest |gradient|, ``size`` the members; ``compressed=False``: warm-up steps."""
    ok, worst = True, 0.0
    dtype = params[0].dtype
    for p, r_ in zip(params, ref):
        got = p.grad.float()
        if is_compressed(p) and compressed:
            if spec.startswith("qsgd") and min_cos is None:
                bits = int(spec.split("bits=")[1].split(",")[0])
                s = (1 << (bits - 1)) - 1
                b = q_factor(spec, reduction) * sum(m) / s
                if op == hvd.Average:
                    b /= size
                tol = b + 2 * torch.finfo(dtype).eps * (r_.abs() + b) + 1e-6 * sum(m)
                err = (got - r_).abs()
                worst = max(worst, float((err / tol).max()))
                ok &= bool((err <= tol).all())
            else:
                cos = float(F.cosine_similarity(got.reshape(1, -1), r_.reshape(1, -1)))
                ok &= math.isfinite(cos) and cos > (0.3 if min_cos is None else min_cos)
                worst = max(worst, 1 - cos)
        else:
            tol = 4 * torch.finfo(dtype).eps * size * (r_.abs().max() + 1e-3)
            e = float((got - r_).abs().max())
            ok &= e <= tol
    return ok, worst


def reference(label, params, local, op=hvd.Average, process_set=None):
    """The uncompressed allreduce of the local gradients ``local`` over ``process_set`` (None: every
    rank), and every member's largest |gradient| over the compressed tensors (the M_j of the bound)."""
    kw = {} if process_set is None else {"process_set": process_set}
    ref = [hvd.allreduce(g.clone(), op=op, name=f"ref.{label}.{i}", **kw) for i, g in enumerate(local)]
    comp = torch.cat([g.reshape(-1) for p, g in zip(params, local) if is_compressed(p)])
    m = gather_max(comp) if process_set is None else \
        hvd.allgather(torch.tensor([float(comp.abs().max())], dtype=torch.float64),
                      process_set=process_set, name=f"refmax.{label}").tolist()
    return ref, m


def step_checks(label, model, opt, spec, reduction="sra", op=hvd.Average, steps=3, passes=1,
                order=None, nan=False, warmup=0, process_set=None, salt=0, min_cos=None):
    """Run ``steps`` steps checking gradients against the uncompressed reference (module doc).

    With error feedback the exchanged gradient is Q(g + residual): its distance to the step's true
    gradient includes the previous residual, which the per-step bound does not cover. Those cases
    (``min_cos``; 1-bit always) check the direction instead: cosine similarity to the reference."""
    t0 = time.perf_counter()
    params = list(model.parameters())
    dtype = params[0].dtype
    members = process_set is None or process_set.included()
    size = N if process_set is None else len(process_set.ranks)
    for step in range(steps):
        local = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in params]
        losses = []
        for k in range(passes):
            x, y = batch(step * passes + k, salt)
            if isinstance(model, TwoBranch):
                ls = model.losses(x.to(dtype))
                loss = sum(ls)
            else:
                out = model(x.to(dtype)).float()
                loss = F.cross_entropy(out, y)
                if nan and R == 0 and k == 0:
                    loss = loss + model.b.weight[3, 5] * float("nan")
            grads = torch.autograd.grad(loss, params, retain_graph=True)
            local = [a + g.float() for a, g in zip(local, grads)]
            losses.append(ls if isinstance(model, TwoBranch) else [loss])
        ref = None
        if members:
            ref, m = reference(f"{label}.{step}", params, local, op, process_set)
        for ls in losses:
            order_ = order(step) if order else range(len(ls))
            for i in order_:
                ls[i].backward(retain_graph=True)
        opt.synchronize()
        if members:
            ok, worst = (True, 0.0) if nan else grads_within_bound(
                params, ref, m, spec, reduction, op, size, compressed=step >= warmup, min_cos=min_cos)
            if nan:
                w = model.b.weight.grad.float()
                k = next(i for i, p in enumerate(params) if p is model.b.weight)
                ok = bool(torch.isnan(w[3, 5])) and bool(torch.isnan(ref[k][3, 5]))
            check(ok, f"grad {label} step {step}", f"worst error/bound {worst:.3f}")
            if nan:
                check(same_on_all_ranks(model.b.weight.grad), f"nan identical {label}")
        with opt.skip_synchronize():
            opt.step()
        if process_set is None:
            check(params_identical(model), f"identical params {label} step {step}")
        else:
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            g = hvd.allgather(flat[None], name=f"idps.{label}.{step}")
            same = torch.equal(g[0], g[1])
            check(same or not members, f"identical params {label} step {step} (process set)")
        opt.zero_grad()
    print(f"TIME {label} {time.perf_counter() - t0:.2f}s", flush=True)


def fresh(model_cls=Net, dtype=torch.float32):
    torch.manual_seed(1234)
    return model_cls().to(device=DEVICE, dtype=dtype)


def grad_cases():
    for entry in ("ours", "stock"):
        for reduction in ("sra", "allgather"):
            for op, opname in ((hvd.Average, "avg"), (hvd.Sum, "sum")):
                for spec in (Q8, Q4S):
                    label = f"{entry}/{reduction}/{opname}/{spec}"
                    m = fresh()
                    step_checks(label, m, make_opt(entry, m, spec, reduction=reduction, op=op), spec,
                                reduction, op=op)
            spec = ONEBIT
            m = fresh()
            step_checks(f"{entry}/{reduction}/onebit+ef", m, make_opt(entry, m, spec, reduction=reduction),
                        spec, reduction)
        for dtype in (torch.float16, torch.bfloat16):
            m = fresh(dtype=dtype)
            step_checks(f"{entry}/sra/{dtype}", m, make_opt(entry, m, Q4D), Q4D)
        for spec in ("fp16", "none", Q2S, SQ4, KM3):
            for reduction in ("sra", "allgather") if spec in (SQ4, KM3) else ("sra",):
                m = fresh()
                step_checks(f"{entry}/{reduction}/{spec}", m, make_opt(entry, m, spec, reduction=reduction),
                            spec, reduction)


def option_cases():
    for entry in ("ours", "stock"):
        # Hook order that differs between ranks: rank parity decides which branch runs backward first.
        for reduction in ("sra", "allgather"):
            m = fresh(TwoBranch)
            order = (lambda step: [0, 1, 2]) if R % 2 == 0 else (lambda step: [2, 0, 1])
            step_checks(f"{entry}/{reduction}/hook-order", m, make_opt(entry, m, Q4D, reduction=reduction),
                        Q4D, reduction, order=order)
        m = fresh()
        step_checks(f"{entry}/groups=2", m, make_opt(entry, m, Q4D, groups=2), Q4D)
        m = fresh()
        step_checks(f"{entry}/predivide=2", m, make_opt(entry, m, Q4D, gradient_predivide_factor=2.0),
                    Q4D)
        m = fresh()
        step_checks(f"{entry}/passes=2", m, make_opt(entry, m, Q4D, backward_passes_per_step=2), Q4D,
                    passes=2)
        m = fresh()
        step_checks(f"{entry}/nan", m, make_opt(entry, m, Q4D), Q4D, steps=1, nan=True)
        m = fresh()
        step_checks(f"{entry}/process-set", m, make_opt(entry, m, Q4D, process_set=PS01), Q4D,
                    process_set=PS01)
    m = fresh()
    groups = [[m.a.weight, m.b.weight]]
    step_checks("ours/groups=list", m, make_opt("ours", m, Q4D, groups=groups), Q4D)
    m = fresh()
    step_checks("ours/warmup=2", m, make_opt("ours", m, Q4D, warmup_steps=2), Q4D, steps=4, warmup=2)
    m = fresh()
    # 4-bit stochastic rounding adds per element a variance up to unit^2/4, unit = bucket max / 7; on
    # gradients whose bucket max is ~3 standard deviations that is ~0.05 of the gradient's variance
    # per quantization (two for SRA, plus the carried residual): a cosine to the true mean of about
    # 0.85-0.95 is expected; 0.7 is the floor that still rules out a wrong sign, scale or tensor.
    step_checks("ours/qsgd4+ef", m, make_opt("ours", m, Q4S, error_feedback=True), Q4S, steps=3,
                min_cos=0.7)
    # hvd.broadcast_optimizer_state (and so TorchState.sync) works on hvd_quant's optimizer.
    m = fresh()
    opt = make_opt("ours", m, Q4D, base=torch.optim.Adam(m.parameters(), lr=1e-3))
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    step_checks("ours/after-broadcast_optimizer_state", m, opt, Q4D, steps=1)
    # Stock hvd.allreduce(tensor, compression=codec), outside any optimizer, both ops.
    for op, opname in ((hvd.Average, "avg"), (hvd.Sum, "sum")):
        x = batch(0, 55, n=64)[0]
        ref = hvd.allreduce(x, op=op, name=f"direct.ref.{opname}")
        got = hvd.allreduce(x, op=op, name=f"direct.{opname}", compression=codec(Q8))
        m_ = gather_max(x)
        b = q_factor(Q8, "sra") * sum(m_) / 127 / (N if op == hvd.Average else 1)
        check(bool(((got - ref).abs() <= b * (1 + 1e-5)).all()) and same_on_all_ranks(got),
              f"stock hvd.allreduce(compression=codec) {opname}",
              f"max error {float((got - ref).abs().max()):.3g} <= {b:.3g}")
    # Adasum is refused with a clear message.
    try:
        hqt.DistributedOptimizer(torch.optim.SGD(fresh().parameters(), lr=0.1), compression=codec(Q4D),
                                 op=hvd.Adasum)
        msg = ""
    except ValueError as e:
        msg = str(e)
    check("Adasum" in msg and "not supported" in msg, "adasum refused", msg[:200])
    # ... and through the stock path, at the first gradient on every rank (Horovod's Adasum optimizer
    # would otherwise sum the placeholders and silently average the compressed tensors).
    m = fresh()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), compression=codec(Q4D),
                                   named_parameters=m.named_parameters(), op=hvd.Adasum)
    try:
        x, y = batch(0, 66)
        F.cross_entropy(m(x), y).backward()
        msg = ""
    except ValueError as e:
        msg = str(e)
    check("Adasum" in msg and "not supported" in msg, "stock adasum refused", msg[:200])
    # SRA's second phase starts during backward for a bucket whose alltoall is done: b.weight's
    # bucket starts first; a.weight's gradient is held back (on every rank) until b's alltoall has
    # completed, so when a's own bucket starts, b's is advanced then, before synchronize(). (b.weight
    # is held back 0.2 s: a bucket starts once the step's presence count, hvd.join(), issued at c's
    # gradient, is known, and no other gradient would look for it before a.weight's.) The second
    # step's, so that with a payload group (HVDQ_TEST_PAYLOAD_GROUP) the group carries it.
    m = fresh()
    opt = hqt.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05),
                                   named_parameters=m.named_parameters(), compression=codec(Q4D),
                                   reduction="sra", bucket_bytes=16384)
    kb = next(k for k, ps in enumerate(opt._bucket_params) if ps == [m.b.weight])

    def b_alltoall_done(g, deadline_s=60.0):
        end = time.monotonic() + deadline_s      # b never started: the check below fails
        while time.monotonic() < end:
            p = opt._sched.pending[kb]
            p = None if p is None else p[1]
            if p is not None and p.handle is not None and opt._coll.poll(p.handle):
                return
            time.sleep(0.005)

    x, y = batch(0, 68)
    F.cross_entropy(m(x), y).backward()
    opt.step()
    opt.zero_grad()
    m.b.weight.register_hook(lambda g: time.sleep(0.2))
    m.a.weight.register_hook(b_alltoall_done)
    F.cross_entropy(m(x), y).backward()
    stage, channel = opt._sched.pending[kb][1].stage, opt._sched.pending[kb][1].channel
    opt.step()
    from hvd_quant.torch._backend import PAYLOAD_GROUP
    check(stage == "second" and (channel is not None) == (DEVICE.type in PAYLOAD_GROUP),
          "ours/sra: second phase started during backward", f"stage {stage}, channel {channel}")
    # The stock path fuses: one optimizer's compressed gradients travel as one bucket per step.
    m = fresh()
    comp = hvd_quant.StockCompression(codec(Q4D), reduction="sra")
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), compression=comp,
                                   named_parameters=m.named_parameters())
    run_steps(m, opt, range(3), 67, [])
    steps = comp.state_dict()["steps"]
    check(len(steps) == 1 and list(steps.values()) == [3], "stock path fuses into one bucket",
          f"exchanges started per name: {steps}")
    # Both entry points fuse the uncompressed float32 gradients too (c.weight and the three biases:
    # 778 floats, one plain group): one allreduce per step, none per tensor. The stock path does so
    # from its second step (its first is Horovod's, one allreduce per tensor, placeholders for the
    # compressed ones), and no longer allreduces a placeholder. The results are checked against the
    # reference by every step_checks case.
    # A stock plan with no bucket (nothing large enough to compress) fuses its gradients the same way
    # from its second step, with no bucket's hand-out to turn that on, and counts no presence.
    import horovod.torch.optimizer as hvd_optimizer
    for entry, first in (("ours", 0), ("stock", 1), ("stock-no-bucket", 1)):
        m = fresh()
        opt = (make_opt("stock", m, Q4D, min_compress_numel=10 ** 9) if entry == "stock-no-bucket"
               else make_opt(entry, m, Q4D))
        names, real = [], hvd.allreduce_async_

        def counting(tensor, *args, **kw):
            names.append(kw.get("name"))
            return real(tensor, *args, **kw)
        hvd.allreduce_async_ = hvd_optimizer.allreduce_async_ = counting
        try:
            run_steps(m, opt, range(first), 69, [])
            per_tensor_first = [n for n in names if n in dict(m.named_parameters())]
            del names[:]
            run_steps(m, opt, range(first, first + 2), 69, [])
        finally:
            hvd.allreduce_async_ = hvd_optimizer.allreduce_async_ = real
        plain = [n for n in names if ".plain." in str(n)]
        per_tensor = [n for n in names if n in dict(m.named_parameters())]
        # hvd.join()'s presence count: only in steps that exchange compressed buckets
        present = [n for n in names if ".present" in str(n)]
        check(len(plain) == 2 and len(set(plain)) == 1 and not per_tensor
              and not (entry == "stock-no-bucket" and present),
              f"{entry}: uncompressed gradients fused, one allreduce per step",
              f"allreduce names: {names}")
        check(len(per_tensor_first) == first * len(list(m.parameters())),
              f"{entry}: first step's allreduces per tensor", f"{per_tensor_first}")
        check(params_identical(m), f"{entry}: replicas identical after fused plain groups")


def bytes_cases():
    """Bytes per step measured by the optimizer, against examples/common/traffic.py's formula."""
    from examples.common.traffic import bytes_per_step
    for spec, at_least in ((Q4D, 3.0), (Q8, 2.0), (ONEBIT, 4.0)):
        for entry in ("ours", "stock"):
            m = fresh()
            opt = make_opt(entry, m, spec)
            x, y = batch(0, 5)
            F.cross_entropy(m(x), y).backward()
            opt.step()
            got = hqt.bytes_sent_per_step(opt)
            c = codec(spec)
            shapes = [tuple(p.shape) for p in m.parameters()]
            # stock: its default buckets of 4 MiB; ours: bucket_bytes=16384 (make_opt)
            formula = bytes_per_step(shapes, N, c.wire_nbytes, reduction="sra",
                                     bucket_bytes=4 << 20 if entry == "stock" else 16384)
            # Chunks fall on bucket boundaries, so on small tensors ranks send unequal shares; the
            # formula assumes equal shares: compare the mean over ranks.
            mean = float(hvd.allreduce(torch.tensor([got["sent"]], dtype=torch.float64),
                                       name=f"bytes.{entry}.{spec}"))
            check(got["ratio"] >= at_least and abs(mean - formula.sent) <= 0.10 * formula.sent
                  and abs(got["fp32"] - formula.fp32) < 1e-6 * formula.fp32,
                  f"bytes {entry}/{spec}", f"sent {got['sent']:.0f} (mean over ranks {mean:.0f}) vs "
                  f"formula {formula.sent:.0f}, {got['ratio']:.2f}x fewer than fp32 (>= {at_least})")
            opt.zero_grad()
            step_metrics_ok(entry, m, opt, c, got)
    # warm-up: the buckets went through Horovod's allreduce uncompressed, and say so
    m = fresh()
    opt = make_opt("ours", m, Q4D, warmup_steps=1)
    x, y = batch(1, 5)
    F.cross_entropy(m(x), y).backward()
    opt.step()
    sm = hqt.step_metrics(opt)
    check(sm["reduction"] == "allreduce" and sm["ratio"] == 1.0
          and all(b["reduction"] == "allreduce" and b["precision"] == "fp32" for b in sm["buckets"]),
          "step_metrics in warm-up", f"{sm['reduction']}, {[b['precision'] for b in sm['buckets']]}")


def step_metrics_ok(entry, m, opt, c, got):
    """hvd_quant.torch.step_metrics after one step: the bytes of bytes_sent_per_step, each bucket
    with its reduction and the codec's spec, the uncompressed tensors, the exchange's time."""
    if entry == "stock":      # bytes since the last call: take one more step (auto's second: allgather)
        x, y = batch(1, 5)
        F.cross_entropy(m(x), y).backward()
        opt.step()
        opt.zero_grad()
    sm = hqt.step_metrics(opt)
    params = list(m.parameters())
    comp = [p for p in params if is_compressed(p)]
    buckets = sm["buckets"]
    route = "sra" if entry == "ours" else "allgather"
    check(sm["reduction"] == route and buckets
          and all(b["reduction"] == route and b["precision"] == c.spec() for b in buckets)
          and sum(b["numel"] for b in buckets) == sum(p.numel() for p in comp)
          and sm["uncompressed"] == {"tensors": len(params) - len(comp),
                                     "numel": sum(p.numel() for p in params if not is_compressed(p))}
          and (sm["sent"] == got["sent"] if entry == "ours" else sm["sent"] > 0)
          and sm["fp32"] == got["fp32"]
          and (sm["exchange_s"] is None if entry == "stock" else 0 < sm["exchange_s"] < 60),
          f"step_metrics {entry}/{c.spec()}",
          f"{sm['reduction']}, {len(buckets)} buckets, exchange {sm['exchange_s']} s, "
          f"uncompressed {sm['uncompressed']}")


def run_steps(model, opt, steps, salt, trace):
    for step in steps:
        x, y = batch(step, salt)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        trace.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))


def resume_cases(cases=((ONEBIT, None, "sra"), (Q4S, True, "sra"), (Q4S, True, "allgather")), more=True):
    """Save mid-run, continue, restore, continue again: the two continuations are bit-identical.
    ``more``: also hvd.elastic.TorchState and the stock path."""
    for spec, ef, reduction in cases:
        label = f"{spec}/{reduction}/ef={ef}"
        m = fresh()
        opt = make_opt("ours", m, spec, base=torch.optim.Adam(m.parameters(), lr=1e-3),
                       reduction=reduction, error_feedback=ef)
        run_steps(m, opt, range(3), 21, [])
        buf = io.BytesIO()
        torch.save({"model": m.state_dict(), "opt": opt.state_dict()}, buf)
        saved = opt.state_dict()["hvd_quant"]
        check(len(saved["residuals"]) == 2 and all(float(v.abs().sum()) > 0
                                                  for v in saved["residuals"].values()),
              f"residuals saved {label}", f"{sorted(saved['residuals'])}")
        first = []
        run_steps(m, opt, range(3, 6), 21, first)
        buf.seek(0)
        state = torch.load(buf)
        m.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        second = []
        run_steps(m, opt, range(3, 6), 21, second)
        check(all(torch.equal(a, b) for a, b in zip(first, second)), f"resume bit-exact {label}")
        # Without the residuals the continuation differs: they really are part of the state.
        st = copy.deepcopy(state["opt"])
        st["hvd_quant"]["residuals"] = {}
        st["hvd_quant"]["server_residuals"] = {}
        m.load_state_dict(state["model"])
        opt.load_state_dict(st)
        third = []
        run_steps(m, opt, range(3, 6), 21, third)
        check(not all(torch.equal(a, b) for a, b in zip(first, third)), f"residuals matter {label}")
    if not more:
        return
    # hvd.elastic.TorchState saves and restores the optimizer's state dict, residuals included.
    from horovod.torch.elastic import TorchState
    m = fresh()
    opt = make_opt("ours", m, ONEBIT, base=torch.optim.Adam(m.parameters(), lr=1e-3))
    run_steps(m, opt, range(2), 33, [])
    state = TorchState(model=m, optimizer=opt, batch=0)
    state.save()
    first, second = [], []
    run_steps(m, opt, range(2, 5), 33, first)
    state.restore()
    run_steps(m, opt, range(2, 5), 33, second)
    check(all(torch.equal(a, b) for a, b in zip(first, second)), "TorchState resume bit-exact")
    # Stock path: StockCompression's residuals round-trip too.
    m = fresh()
    # (an explicit reduction: under "auto" the schedule's fp32-allreduce steps are Horovod's own,
    # whose MPI sums may take another order when its fusion differs between two runs)
    comp = hvd_quant.StockCompression(codec(ONEBIT), reduction="sra")
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05), compression=comp,
                                   named_parameters=m.named_parameters())
    run_steps(m, opt, range(2), 44, [])
    snap = (copy.deepcopy(m.state_dict()), copy.deepcopy(opt.state_dict()), copy.deepcopy(comp.state_dict()))
    first, second = [], []
    run_steps(m, opt, range(2, 4), 44, first)
    m.load_state_dict(snap[0])
    opt.load_state_dict(snap[1])
    comp.load_state_dict(snap[2])
    run_steps(m, opt, range(2, 4), 44, second)
    check(all(torch.equal(a, b) for a, b in zip(first, second)), "stock resume bit-exact")


def train_cases():
    """A teacher-labelled classification task, 300 steps; compressed runs end close to fp32.

    Tolerance: the final loss (mean over the last 30 steps) may exceed fp32's by 10% + 0.02 for
    8-bit and 4-bit QSGD and by 25% + 0.05 for 1-bit with error feedback. Stochastic QSGD is unbiased
    with a variance of at most unit^2/4 per element (unit = bucket max / 7 at 4 bits): with momentum
    SGD at this learning rate that noise is far below the minibatch noise, so the loss curves should
    nearly coincide; 1-bit + error feedback converges at the same rate asymptotically (Karimireddy et
    al. 2019) but lags early, hence the wider tolerance over only 300 steps.
    """
    torch.manual_seed(99)
    teacher = Net(32, 64, 10).to(DEVICE)
    steps = 300

    def run(spec, ef=None):
        torch.manual_seed(5)
        m = Net(32, 128, 10).to(DEVICE)
        base = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        if spec is None:
            opt = hvd.DistributedOptimizer(base, named_parameters=m.named_parameters())
        else:
            opt = hqt.DistributedOptimizer(base, named_parameters=m.named_parameters(),
                                           compression=codec(spec), error_feedback=ef)
        hist = []
        for step in range(steps):
            x, _ = batch(step, 77, n=32)
            with torch.no_grad():
                y = teacher(x).argmax(1)
            opt.zero_grad()
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            hist.append(float(loss))
        ends = hvd.allreduce(torch.tensor([hist[0], sum(hist[-30:]) / 30]), name=f"trainloss.{spec}")
        return float(ends[1]), float(ends[0]), params_identical(m)

    base_loss, first, _ = run(None)
    check(base_loss < 0.6 * first, "train fp32 learns", f"{first:.3f} -> {base_loss:.3f}")
    for spec, ef, rel, ab in ((Q8.replace("deterministic", "stochastic"), None, 0.10, 0.02),
                              (Q4S, None, 0.10, 0.02), (ONEBIT, None, 0.25, 0.05)):
        loss, _, same = run(spec, ef)
        check(loss <= base_loss * (1 + rel) + ab and same, f"train {spec}",
              f"final loss {loss:.4f} vs fp32 {base_loss:.4f} (tolerance {rel:.0%} + {ab})")
        print(f"TRAIN {spec} {loss:.4f} fp32 {base_loss:.4f}", flush=True)


def auto_cases():
    """``reduction="auto"`` (the default of both paths): the schedule's steps are correct, the choice
    is the same on every rank although each rank times its own steps (rank 1 is made slower during
    the compressed candidates), and the replicas stay bit-identical afterwards."""
    for entry in ("ours", "stock"):
        m = fresh()
        base = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        if entry == "ours":
            opt = hqt.DistributedOptimizer(base, named_parameters=m.named_parameters(),
                                           compression=codec(Q4D), bucket_bytes=16384)
            route = opt.reduction_in_use
        else:
            comp = hvd_quant.StockCompression(codec(Q4D))
            opt = hvd.DistributedOptimizer(base, named_parameters=m.named_parameters(), compression=comp)
            route = lambda: comp.reduction_in_use(opt)      # noqa: E731
        seen = []
        for step in range(3 + 3 * 5 + 2):
            used = route()
            seen.append(used)
            if R == 1 and used in ("sra", "allgather"):
                time.sleep(0.01)
            step_checks(f"{entry}/auto/step{step}", m, opt, Q4D, "sra", steps=1, salt=step)
        choice = route()
        codes = hvd.allgather(torch.tensor([["allreduce", "allgather", "sra"].index(choice)]),
                              name=f"auto.choice.{entry}")
        check(len(set(codes.tolist())) == 1, f"{entry}/auto same choice on every rank",
              f"choices {codes.tolist()}, schedule {seen[:18]}")
        # (the stock path knows its optimizer from the first gradient on: None before)
        check(set(seen[1:18]) == {"allreduce", "allgather", "sra"} and seen[-1] == choice,
              f"{entry}/auto schedule", f"{seen}")


def process_set_cases():
    """Several process sets at once: a model and optimizer for every set this rank is in (the global
    set too), every backward pass before any ``synchronize()`` (all the sets' exchanges in flight
    together), synchronized in an order that differs between ranks, then checked. Each set's
    gradients are within the bound of its own uncompressed allreduce and its members' parameters stay
    identical. (The checks' own blocking collectives come after every ``synchronize()``: SRA's second
    phase is submitted by the host, so a rank blocked in a collective of its own holds it back;
    docs/EXCHANGE.md, limitations.)"""
    sets = [hvd.global_process_set] + ([PS01] if PS01 is not hvd.global_process_set else []) + MORE_SETS
    mine = [(k, ps) for k, ps in enumerate(sets) if ps.included()]
    # hvd_quant.torch.DistributedOptimizer only: the stock path starts a global-set bucket once the
    # step's presence count (hvd.join()) has arrived, possibly only in synchronize(), which another
    # set's wait can hold back (docs/EXCHANGE.md, limitations)
    for entry in ("ours",):
        for reduction in ("sra", "allgather"):
            label = f"{entry}/{reduction}/process-sets"
            models = {k: fresh() for k, _ in mine}
            opts = {k: make_opt(entry, models[k], Q4D, reduction=reduction, process_set=ps)
                    for k, ps in mine}
            for step in range(3):
                refs, maxes, losses = {}, {}, {}
                for k, ps in mine:
                    params = list(models[k].parameters())
                    x, y = batch(step, salt=k)
                    losses[k] = F.cross_entropy(models[k](x), y)
                    local = torch.autograd.grad(losses[k], params, retain_graph=True)
                    refs[k], maxes[k] = reference(f"{label}.{k}.{step}", params, local, process_set=ps)
                for k, _ in mine:
                    losses[k].backward()
                for k, _ in (mine if R % 2 == 0 else mine[::-1]):
                    opts[k].synchronize()
                for k, ps in mine:
                    ok, worst = grads_within_bound(list(models[k].parameters()), refs[k], maxes[k], Q4D,
                                                   reduction, hvd.Average, ps.size())
                    name = "global" if ps is hvd.global_process_set else ps.ranks
                    check(ok, f"grad {label} set {name} step {step}", f"worst error/bound {worst:.3f}")
                    with opts[k].skip_synchronize():
                        opts[k].step()
                    opts[k].zero_grad()
                    flat = torch.cat([p.detach().reshape(-1) for p in models[k].parameters()])
                    rows = hvd.allgather(flat[None], name=f"idps.{label}.{k}.{step}", process_set=ps)
                    check(all(torch.equal(rows[0], row) for row in rows),
                          f"identical params {label} set {name} step {step}")


def payload_group_cases():
    """Process groups of the optimizer's own for the payloads (``torch._backend.PayloadGroup``: NCCL
    on CUDA by default; forced onto the CPU here with Gloo), both reductions: with buckets that
    complete in an order differing between ranks, every compressed gradient equals, bit for bit, that
    of the same steps through Horovod's collectives (deterministic codecs: the payloads do not depend
    on the optimizer's name). A route's first step goes through Horovod's collectives, the group
    carries the next ones (the stock path counts from its second step, the first whose gradients
    go straight into their buckets).
    ``HVD_QUANT_PAYLOAD_GROUP=0`` on rank 0 turns the group off on every rank; on another rank alone
    it changes nothing (rank 0 decides)."""
    from hvd_quant.torch._backend import PayloadGroup
    calls = [0]
    plain = PayloadGroup.allgather, PayloadGroup.alltoall

    def counting(f):
        def call(self, *args):
            calls[0] += 1
            return f(self, *args)
        return call

    PayloadGroup.allgather, PayloadGroup.alltoall = map(counting, plain)
    # buckets [c, b] and [a] (reverse order, 16 KiB): even ranks complete [a] first, odd ranks [c, b]
    order = (lambda step: [0, 1, 2]) if R % 2 == 0 else (lambda step: [1, 2, 0])

    def run(entry, spec, reduction, group):
        """Three steps; the gradients of each and the buckets' member counts."""
        with payload_group(group):
            m = fresh(TwoBranch)
            if entry == "ours":
                opt = make_opt(entry, m, spec, reduction=reduction)
            else:
                comp = hvd_quant.StockCompression(codec(spec), reduction=reduction, bucket_bytes=16384)
                opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                                               named_parameters=list(m.named_parameters()), compression=comp)
            grads = []
            for step in range(3):
                x, _ = batch(step, salt=17)
                losses = m.losses(x)
                for i in order(step):
                    losses[i].backward()
                opt.synchronize()
                grads.append([p.grad.detach().clone() for p in m.parameters()])
                with opt.skip_synchronize():
                    opt.step()
                opt.zero_grad()
            buckets = (opt._buckets if entry == "ours"
                       else [g for _, g in comp._groups.values()][0].plan.buckets)
            return grads, [len(b.members) for b in buckets]

    def same(ga, gb):
        # the compressed (2-D) gradients; the biases go through Horovod's fp32 allreduce in both
        # runs, whose sum order at 3+ ranks follows Horovod's fusion, hence timing
        return all(torch.equal(a, b) for sa, sb in zip(ga, gb) for a, b in zip(sa, sb) if a.dim() > 1)

    try:
        horovods = {}
        for entry, spec, reduction in (("ours", Q4D, "allgather"), ("ours", ONEBIT, "allgather"),
                                       ("stock", Q4D, "allgather"), ("ours", Q4D, "sra"),
                                       ("ours", ONEBIT, "sra"), ("stock", Q4D, "sra")):
            got = {}
            per_bucket = 1 if reduction == "allgather" else 2       # SRA: the alltoall, the allgather
            for group in (False, True):
                calls[0] = 0
                got[group], sizes = run(entry, spec, reduction, group)
                # two buckets in steps 2 and 3; the stock path's in step 3 only
                expected = (2 if entry == "ours" else 1) * 2 * per_bucket if group else 0
                check(calls[0] == expected and sizes == [2, 1],
                      f"payload-group {entry} {spec} {reduction} group={group} collectives",
                      f"{calls[0]} through the group")
            horovods[entry, spec, reduction] = got[False]
            check(same(got[False], got[True]),
                  f"payload-group {entry} {spec} {reduction} equals Horovod's collectives, bit for bit")
        for off in {0, hvd.size() - 1}:
            calls[0] = 0
            if R == off:
                os.environ["HVD_QUANT_PAYLOAD_GROUP"] = "0"
            try:
                grads, _ = run("ours", Q4D, "allgather", True)
            finally:
                os.environ.pop("HVD_QUANT_PAYLOAD_GROUP", None)
            check(calls[0] == (0 if off == 0 else 4) and same(grads, horovods["ours", Q4D, "allgather"]),
                  f"payload-group HVD_QUANT_PAYLOAD_GROUP=0 on rank {off}", f"{calls[0]} through the group")
    finally:
        PayloadGroup.allgather, PayloadGroup.alltoall = plain


def main():
    groups = sys.argv[1:] or ["grads", "options", "bytes", "resume", "train", "auto", "process-sets",
                              "payload-group"]
    table = {"grads": grad_cases, "options": option_cases, "bytes": bytes_cases,
             "resume": resume_cases, "train": train_cases, "auto": auto_cases,
             "process-sets": process_set_cases, "payload-group": payload_group_cases}
    for g in groups:
        check.run(g, table[g])
    check.finish()


if __name__ == "__main__":
    main()
