"""Worker: Horovod's usage patterns with hvd_quant's optimizers, on real Horovod processes.

argv picks the groups (default: all):

* ``resume``: rank 0 resumes from a checkpoint saved after 3 steps (model, optimizer state and
  hvd_quant's residuals and step counter), the other ranks start fresh; ``hvd.broadcast_parameters``
  and ``hvd.broadcast_optimizer_state`` (or ``hvd.elastic.TorchState.sync``), then 3 more steps.
  Horovod's ``broadcast_optimizer_state`` steps only the ranks with an empty state: no exchange may
  start there (it used to hang). Checked: parameters and optimizer state identical after the
  broadcast, rank 0's residuals untouched, then every step's gradient within the codec's bound of an
  uncompressed ``hvd.allreduce`` (1-bit + error feedback: direction, see ``grads_ok``), replicas
  bit-identical after every step, and every rank on the same step counter (with warm-up, the
  rank that resumed past warm-up and the fresh ones must agree on it, or they would not run the same
  collectives);
* ``sparse``: an ``nn.Embedding(sparse=True)`` of 2048 elements (2-D: planned into a compressed
  bucket, next to dense weights) with SGD, and with SparseAdam in a second optimizer sharing the
  codec: with ``sparse_as_dense=False`` its gradient stays sparse and equals Horovod's sparse
  allreduce exactly, rows no rank looked up stay zero; the dense weights of the same bucket are within
  the bound; ``sparse_as_dense=True`` densifies and compresses it (within the bound); stock path too;
* ``uneven``: rank 1 has fewer batches. The documented pattern: every step each rank tells whether it
  still has a batch (``hvd.allreduce(..., op=hvd.Max)``), a rank without one calls ``step()`` without
  backward and so contributes zero gradients; the loop ends on every rank together, then
  ``hvd.join()``. Gradients against the uncompressed reference (zeros from the exhausted rank),
  replicas identical;
* ``join``: Horovod's own uneven-data pattern. Each rank in turn has 2 batches where the others have
  4, and calls ``hvd.join()`` when it runs out (rank 0 joining used to crash Horovod). The first 2
  steps are compressed and checked as above. The steps after the join must give exactly an
  uncompressed ``hvd.allreduce`` under join (zeros from the joined rank). ``hvd.join()`` must return
  the same rank everywhere, and the ranks that stepped on must end identical. Both entry points and
  reductions, QSGD and 1-bit;
* ``patterns``: for the stock path and hvd_quant's optimizer with both reductions: gradient clipping
  between ``synchronize()`` and ``skip_synchronize()`` (no warning), parameters without a gradient in
  a step (which ones differs between ranks), ``requires_grad`` switched off and on mid-training,
  ``backward_passes_per_step``, ``groups=``, ``op=hvd.Sum``, ``gradient_predivide_factor``, and two
  optimizers on disjoint parameters sharing one codec object.

A hang dumps every thread's stack (faulthandler) and exits before the launcher's timeout.
"""
import faulthandler
import io
import math
import os
import sys
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import horovod.torch as hvd

import hvd_quant
import hvd_quant.torch as hqt

from torch_common import DEVICE, Checks, gather_max, init, params_identical, same_on_all_ranks

faulthandler.dump_traceback_later(float(os.environ.get("HVDQ_TEST_HANG_S", "400")), exit=True)
R, N = init()
check = Checks()

Q8 = "qsgd:bits=8,bucket_size=512,mode=deterministic"
Q4D = "qsgd:bits=4,bucket_size=512,mode=deterministic"
ONEBIT = "onebit:bucket_size=64"
ENTRIES = (("stock", "sra"), ("ours", "sra"), ("ours", "allgather"))


class Net(nn.Module):
    """a.weight 2048 and b.weight 4096 elements are compressed; c.weight (640) and biases are not."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 64)
        self.c = nn.Linear(64, 10)

    def forward(self, x, use=("a", "b", "c")):
        h = F.relu(self.a(x))
        if "b" in use:
            h = h + F.relu(self.b(h))
        return self.c(h)


class EmbNet(nn.Module):
    """emb.weight (256 x 8 = 2048, sparse gradient), b.weight (8 x 128 = 1024) and c.weight
    (10 x 128 = 1280) are all compressed: with the default bucket_bytes they share one bucket."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 8, sparse=True)
        self.b = nn.Linear(8, 128)
        self.c = nn.Linear(128, 10)

    def forward(self, idx):
        return self.c(F.relu(self.b(self.emb(idx).mean(1))))


def fresh(cls=Net, seed=1234):
    torch.manual_seed(seed)
    return cls().to(DEVICE)


def batch(step, salt, n=16, rank=None):
    g = torch.Generator().manual_seed(7919 * (R if rank is None else rank) + 104729 * step + salt)
    return torch.randn(n, 32, generator=g).to(DEVICE), torch.randint(0, 10, (n,), generator=g).to(DEVICE)


# Rows each rank looks up: its own 64 rows and 10 shared ones; rows 230.. are looked up by nobody.
def emb_batch(step, n=16):
    g = torch.Generator().manual_seed(31 * R + 1009 * step)
    own = torch.randint(R * 64, R * 64 + 64, (n, 3), generator=g)
    shared = torch.randint(200, 210, (n, 1), generator=g)
    return torch.cat([own, shared], 1).to(DEVICE), torch.randint(0, 10, (n,), generator=g).to(DEVICE)


def make_opt(entry, model, spec, base=None, reduction="sra", named=None, **kw):
    base = base or torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    named = list(model.named_parameters()) if named is None else named
    comp = hvd_quant.from_spec(spec) if isinstance(spec, str) else spec
    if entry == "ours":
        kw.setdefault("bucket_bytes", 16384)
        return hqt.DistributedOptimizer(base, named_parameters=named, compression=comp,
                                        reduction=reduction, **kw)
    if reduction != "sra":
        comp = hvd_quant.StockCompression(comp, reduction=reduction)
    return hvd.DistributedOptimizer(base, named_parameters=named, compression=comp, **kw)


def compressed(p, min_numel=1024):
    return p.dim() > 1 and p.numel() >= min_numel


_uid = [0]


def reference(grads, op=hvd.Average):
    """Uncompressed allreduce of every rank's local float32 gradients, and each rank's largest
    |gradient| over the compressed tensors (the bound's M_j)."""
    _uid[0] += 1
    ref = hvd.grouped_allreduce([g.clone() for g in grads], op=op, name=f"ref.{_uid[0]}")
    comp = [g.reshape(-1) for g, c in grads_compressed(grads) if c]
    m = gather_max(torch.cat(comp)) if comp else [0.0] * N
    return ref, m


def grads_compressed(grads):
    return [(g, compressed(g)) for g in grads]


def grads_ok(params, ref, m, spec, reduction="sra", op=hvd.Average, skip=()):
    """Every parameter's gradient against the reference (tests/workers/torch_optim.py derives the
    bound): QSGD within q * sum_j M_j / s (q = 1/2 per deterministic quantization, two for SRA;
    divided by N for Average); 1-bit + error feedback carries residuals from earlier steps, so its
    direction is checked (cosine > 0.3); uncompressed tensors up to fp32 summation order."""
    ok, worst = True, 0.0
    for p, r_ in zip(params, ref):
        if p in skip:
            continue
        got = (p.grad.to_dense() if p.grad.is_sparse else p.grad).float()
        if compressed(p) and spec not in ("none", None):
            if spec.startswith("qsgd"):
                bits = int(spec.split("bits=")[1].split(",")[0])
                b = (0.5 if "deterministic" in spec else 1.0) * (1 if reduction == "allgather" else 2)
                b = b * sum(m) / ((1 << (bits - 1)) - 1) / (N if op == hvd.Average else 1)
                tol = b + 2 * torch.finfo(torch.float32).eps * (r_.abs() + b) + 1e-6 * sum(m)
                err = (got - r_).abs()
                worst = max(worst, float((err / tol).max()))
                ok &= bool((err <= tol).all())
            else:
                cos = float(F.cosine_similarity(got.reshape(1, -1), r_.reshape(1, -1)))
                ok &= math.isfinite(cos) and cos > 0.3
                worst = max(worst, 1 - cos)
        else:
            tol = 4 * torch.finfo(torch.float32).eps * N * (float(r_.abs().max()) + 1e-3)
            ok &= float((got - r_).abs().max()) <= tol
    return ok, worst


def local_grads(loss, params):
    """This rank's gradients (float32; zeros where none flows or requires_grad is off), without
    firing the optimizer's hooks."""
    live = [p for p in params if p.requires_grad]
    gs = dict(zip(map(id, live), torch.autograd.grad(loss, live, retain_graph=True, allow_unused=True)))
    return [g.float() if g is not None else torch.zeros_like(p, dtype=torch.float32)
            for p, g in ((p, gs.get(id(p))) for p in params)]


def train_step(label, model, opt, spec, reduction="sra", op=hvd.Average, data=None, use=None,
               clip=None):
    """One checked step: reference, backward, synchronize, (clip), step under skip_synchronize."""
    params = list(model.parameters())
    if data is None:
        loss = None
        grads = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    else:
        x, y = data
        out = model(x) if use is None else model(x, use=use)
        loss = F.cross_entropy(out, y)
        grads = local_grads(loss, params)
    ref, m = reference(grads, op)
    if loss is not None:
        loss.backward()
    opt.synchronize()
    ok, worst = grads_ok([p for p in params], ref, m, spec, reduction, op,
                         skip={p for p in params if p.grad is None})
    check(ok and all(p.grad is not None for p in params if p.requires_grad or p.grad is not None),
          f"grad {label}", f"worst error/bound {worst:.3f}")
    if clip is not None:
        total = float(torch.nn.utils.clip_grad_norm_(params, clip))
        after = math.sqrt(sum(float(p.grad.float().pow(2).sum()) for p in params if p.grad is not None))
        check(after <= clip * (1 + 1e-5) and same_on_all_ranks(torch.tensor([total])),
              f"clipped {label}", f"norm {total:.4f} -> {after:.4f} (max {clip})")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opt.skip_synchronize():
            opt.step()
    check(not any("skip_synchronize" in str(w.message) for w in caught), f"no warning {label}")
    check(params_identical(model), f"identical params {label}")
    opt.zero_grad()


# -- resume -----------------------------------------------------------------------------------------
def optimizer_state_identical(opt):
    tensors = [v.detach().float().reshape(-1) for st in opt.state.values() for v in st.values()
               if torch.is_tensor(v)]
    return bool(tensors) and same_on_all_ranks(torch.cat(tensors))


def resume_cases():
    from horovod.torch.elastic import TorchState
    for label, spec, kw, via in (("qsgd4/sra", Q4D, {}, "broadcast"),
                                 ("onebit+ef/sra", ONEBIT, {}, "broadcast"),
                                 ("qsgd4/allgather/warmup=2", Q4D, {"reduction": "allgather",
                                                                    "warmup_steps": 2}, "broadcast"),
                                 ("onebit+ef/sra/TorchState", ONEBIT, {}, "TorchState")):
        t0 = time.perf_counter()
        # The first run: every rank trains 3 steps; rank 0 keeps a checkpoint.
        m = fresh()
        opt = make_opt("ours", m, spec, base=torch.optim.Adam(m.parameters(), lr=1e-3), **kw)
        for step in range(3):
            opt.zero_grad()
            F.cross_entropy(m(batch(step, 3)[0]), batch(step, 3)[1]).backward()
            opt.step()
        buf = io.BytesIO()
        torch.save({"model": m.state_dict(), "opt": opt.state_dict()}, buf)
        saved = opt.state_dict()["hvd_quant"]
        # The restart: fresh model (other initial values) and optimizer everywhere; rank 0 resumes.
        m = fresh(seed=4321 + R)
        opt = make_opt("ours", m, spec, base=torch.optim.Adam(m.parameters(), lr=1e-3), **kw)
        if R == 0:
            buf.seek(0)
            state = torch.load(buf)
            m.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
        if via == "broadcast":
            hvd.broadcast_parameters(m.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(opt, root_rank=0)
        else:
            TorchState(model=m, optimizer=opt, epoch=0).sync()
        check(params_identical(m) and optimizer_state_identical(opt), f"resume {label}: broadcast",
              f"{len(opt.state)} parameter states")
        if R == 0 and saved["residuals"]:
            mine = opt.state_dict()["hvd_quant"]["residuals"]
            check(all(torch.equal(mine[k], v) for k, v in saved["residuals"].items()),
                  f"resume {label}: rank 0 residuals kept", f"{sorted(saved['residuals'])}")
        for step in range(3, 6):
            train_step(f"resume {label} step {step}", m, opt, spec, kw.get("reduction", "sra"),
                       data=batch(step, 3))
        steps = hvd.allgather(torch.tensor([opt._step]), name=f"resume.steps.{label}").tolist()
        check(steps == [6] * N, f"resume {label}: step counters agree", f"{steps}")
        print(f"TIME resume {label} {time.perf_counter() - t0:.2f}s", flush=True)


# -- sparse -----------------------------------------------------------------------------------------
_sparse_uid = [0]


def sparse_reference(g):
    """Horovod's sparse allreduce of a local sparse gradient, written as Horovod's optimizer does."""
    _sparse_uid[0] += 1
    out = hvd.sparse_allreduce_async(g, name=f"sref.{_sparse_uid[0]}", op=hvd.Average)()
    return g.clone().zero_().add_(out).to_dense()


def sparse_step(label, m, opts, spec, reduction, sparse_as_dense, steps=2):
    params = list(m.parameters())
    untouched = slice(230, 256)
    for step in range(steps):
        idx, y = emb_batch(step)
        loss = F.cross_entropy(m(idx), y)
        gs = torch.autograd.grad(loss, params, retain_graph=True)
        exact = sparse_reference(gs[0]) if not sparse_as_dense else None
        ref, mx = reference([g.to_dense().float() if g.is_sparse else g.float() for g in gs])
        loss.backward()
        for o in opts:
            o.synchronize()
        g = m.emb.weight.grad
        if sparse_as_dense:
            ok, worst = grads_ok(params, ref, mx, spec, reduction)
            check(ok and g.is_sparse and not bool(g.to_dense()[untouched].any()),
                  f"sparse_as_dense {label} step {step}", f"worst error/bound {worst:.3f}")
        else:
            ok, worst = grads_ok(params, ref, mx, spec, reduction, skip={m.emb.weight})
            check(g.is_sparse and torch.equal(g.to_dense(), exact),
                  f"sparse grad exact {label} step {step}", f"nnz {g._nnz()}")
            check(not bool(g.to_dense()[untouched].any()) and bool(g.to_dense()[200:210].any()),
                  f"sparse untouched rows zero {label} step {step}")
            check(ok, f"dense grads of the bucket {label} step {step}", f"worst error/bound {worst:.3f}")
        for o in opts:
            with o.skip_synchronize():
                o.step()
        check(params_identical(m), f"identical params {label} step {step}")
        for o in opts:
            o.zero_grad()


def sparse_cases():
    for entry, reduction in ENTRIES:
        for sparse_as_dense in (False, True):
            m = fresh(EmbNet)
            kw = {"sparse_as_dense": sparse_as_dense}
            if entry == "ours":
                kw["bucket_bytes"] = 4 << 20          # one bucket: emb.weight with b and c weights
            opt = make_opt(entry, m, Q8, base=torch.optim.SGD(m.parameters(), lr=0.1),
                           reduction=reduction, **kw)
            if entry == "ours":
                check(len(opt._buckets) == 1 and len(opt._bucket_params[0]) == 3,
                      f"sparse {entry}/{reduction}: emb shares a bucket", f"{len(opt._buckets)} buckets")
            sparse_step(f"{entry}/{reduction}/SGD/sparse_as_dense={sparse_as_dense}", m, [opt], Q8,
                        reduction, sparse_as_dense)
    # SparseAdam for the embedding, Adam for the rest: two optimizers sharing one codec object.
    for entry, reduction in ENTRIES:
        m = fresh(EmbNet)
        q = hvd_quant.from_spec(Q8)
        dense = [(n, p) for n, p in m.named_parameters() if not n.startswith("emb")]
        o1 = make_opt(entry, m, q, base=torch.optim.SparseAdam([m.emb.weight], lr=1e-2),
                      reduction=reduction, named=[("emb.weight", m.emb.weight)])
        o2 = make_opt(entry, m, q, base=torch.optim.Adam([p for _, p in dense], lr=1e-2),
                      reduction=reduction, named=dense)
        sparse_step(f"{entry}/{reduction}/SparseAdam+Adam", m, [o1, o2], Q8, reduction, False)


# -- uneven data ------------------------------------------------------------------------------------
def any_rank(flag, name):
    """True when some rank passes True (the uneven-data pattern of docs/EXCHANGE.md)."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    return bool(hvd.allreduce(t, op=hvd.Max, name=name).item())


def uneven_cases():
    for entry, reduction in ENTRIES:
        for spec in (Q4D, ONEBIT):
            label = f"uneven {entry}/{reduction}/{spec}"
            m = fresh()
            opt = make_opt(entry, m, spec, reduction=reduction)
            data = iter([batch(i, 17) for i in range(4 if R == 1 else 6)])
            steps = 0
            while True:
                b = next(data, None)
                if not any_rank(b is not None, f"more.{label}"):
                    break
                train_step(f"{label} step {steps}{'' if b is not None else ' (no batch)'}", m, opt,
                           spec, reduction, data=b)
                steps += 1
            check(steps == 6, f"{label}: every rank ran the longest rank's steps", f"{steps}")
    last = hvd.join()
    check(0 <= last < N, "hvd.join() after the loop", f"last joined rank {last}")


# -- hvd.join() -------------------------------------------------------------------------------------
def join_step(label, model, opt, step):
    """A step while some rank is inside ``hvd.join()``: the exchange must fall back to Horovod's
    allreduce, which adds zeros for the joined ranks, so the gradient equals an uncompressed
    ``hvd.allreduce`` of the local gradients exactly (at most one summand of each sum differs from
    zero or all do: the order of additions cannot change the result)."""
    params = list(model.parameters())
    x, y = batch(step, 23)
    loss = F.cross_entropy(model(x), y)
    grads = local_grads(loss, params)
    ref = hvd.grouped_allreduce([g.clone() for g in grads], op=hvd.Average, name=f"jref.{label}.{step}")
    loss.backward()
    opt.synchronize()
    worst = max(float((p.grad - r).abs().max()) for p, r in zip(params, ref))
    check(worst == 0.0, f"{label} step {step}: Horovod's allreduce under join", f"max |diff| {worst}")
    with opt.skip_synchronize():
        opt.step()
    opt.zero_grad()


def join_cases():
    """Each rank in turn runs out of data first and calls ``hvd.join()`` while the others step on
    (Horovod's pattern for uneven data; rank 0 joining used to crash Horovod)."""
    for entry, reduction in ENTRIES:
        for spec in (Q4D, ONEBIT):
            for short in range(N):
                label = f"join {entry}/{reduction}/{spec} rank {short} joins first"
                m = fresh()
                opt = make_opt(entry, m, spec, reduction=reduction)
                steps = 2 if R == short else 4
                for step in range(2):       # everyone steps: compressed, within the bound
                    train_step(f"{label} step {step}", m, opt, spec, reduction, data=batch(step, 23))
                for step in range(2, steps):
                    join_step(label, m, opt, step)
                last = hvd.join()
                check(same_on_all_ranks(torch.tensor([last])) and last != short,
                      f"{label}: hvd.join() returns the last rank to join on every rank", f"{last}")
                flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
                rows = hvd.allgather(flat[None], name=f"jparams.{label}")
                stepped = [r for r in range(N) if r != short]
                check(all(torch.equal(rows[stepped[0]], rows[r]) for r in stepped),
                      f"{label}: the ranks that stepped on are identical")


# -- patterns ---------------------------------------------------------------------------------------
def pattern_cases():
    for entry, reduction in ENTRIES:
        tag = f"{entry}/{reduction}"
        # Gradient clipping between synchronize() and step().
        m = fresh()
        opt = make_opt(entry, m, Q4D, reduction=reduction)
        for step in range(2):
            train_step(f"{tag}/clip step {step}", m, opt, Q4D, reduction, data=batch(step, 5), clip=0.05)
        # Parameters without a gradient: rank 0 skips the b branch at step 1, every rank at step 2.
        m = fresh()
        opt = make_opt(entry, m, Q4D, reduction=reduction)
        for step in range(3):
            use = ("a", "c") if (step == 1 and R == 0) or step == 2 else ("a", "b", "c")
            train_step(f"{tag}/no-grad step {step}", m, opt, Q4D, reduction, data=batch(step, 6), use=use)
        # requires_grad switched off (on every rank) at step 1, on again at step 3.
        m = fresh()
        opt = make_opt(entry, m, Q4D, reduction=reduction)
        for step in range(4):
            m.a.weight.requires_grad_(step not in (1, 2))
            before = m.a.weight.detach().clone()
            train_step(f"{tag}/requires_grad step {step}", m, opt, Q4D, reduction, data=batch(step, 7))
            if step in (1, 2):
                # As with Horovod, the frozen weight gets an exchanged zero gradient, which plain SGD
                # with momentum still applies (the momentum buffer): it moves identically everywhere.
                check(same_on_all_ranks(m.a.weight), f"{tag}/requires_grad frozen step {step}",
                      f"moved by {float((m.a.weight - before).abs().max()):.3g}")
        m.a.weight.requires_grad_(True)
        # A parameter frozen when the optimizer is built is not planned (Horovod registers no hook for
        # it either): unfrozen later, its gradient is not reduced and the replicas drift apart.
        m = fresh()
        m.a.weight.requires_grad_(False)
        opt = make_opt(entry, m, Q4D, reduction=reduction)
        m.a.weight.requires_grad_(True)
        opt.zero_grad()
        F.cross_entropy(m(batch(0, 11)[0]), batch(0, 11)[1]).backward()
        opt.step()
        check(not same_on_all_ranks(m.a.weight) and same_on_all_ranks(m.b.weight),
              f"{tag}/frozen at construction: not reduced (documented limitation)")
        # backward_passes_per_step=2: two backward passes accumulate locally, one exchange.
        m = fresh()
        opt = make_opt(entry, m, Q4D, reduction=reduction, backward_passes_per_step=2)
        for step in range(2):
            params = list(m.parameters())
            grads = [torch.zeros_like(p) for p in params]
            losses = []
            for k in range(2):
                x, y = batch(2 * step + k, 8)
                loss = F.cross_entropy(m(x), y)
                grads = [a + g for a, g in zip(grads, local_grads(loss, params))]
                losses.append(loss)
            ref, mx = reference(grads)
            for loss in losses:
                loss.backward()
            opt.synchronize()
            ok, worst = grads_ok(params, ref, mx, Q4D, reduction)
            check(ok, f"{tag}/passes=2 step {step}", f"worst error/bound {worst:.3f}")
            with opt.skip_synchronize():
                opt.step()
            check(params_identical(m), f"{tag}/passes=2 identical step {step}")
            opt.zero_grad()
        # zero_grad() between the passes is refused, as Horovod refuses it: the first pass's gradient
        # would be lost while its pass was already counted.
        m = fresh()
        opt = make_opt(entry, m, Q4D, reduction=reduction, backward_passes_per_step=2)
        x, y = batch(0, 12)
        F.cross_entropy(m(x), y).backward()
        try:
            opt.zero_grad()
            refused = ""
        except AssertionError as e:
            refused = str(e)
        check("zero_grad() was called after loss.backward()" in refused,
              f"{tag}/passes=2 zero_grad between the passes refused")
        F.cross_entropy(m(x), y).backward()
        opt.step()
        check(params_identical(m), f"{tag}/passes=2 after the refused zero_grad")
        opt.zero_grad()
        # groups=, op=Sum, gradient_predivide_factor.
        for name, kw, op in (("groups=list", None, hvd.Average), ("groups=2", {"groups": 2}, hvd.Average),
                             ("op=Sum", {"op": hvd.Sum}, hvd.Sum),
                             ("predivide=4", {"gradient_predivide_factor": 4.0}, hvd.Average)):
            m = fresh()
            if kw is None:
                kw = {"groups": [[m.a.weight, m.b.weight], [m.c.weight, m.c.bias]]}
            opt = make_opt(entry, m, Q4D, reduction=reduction, **kw)
            for step in range(2):
                train_step(f"{tag}/{name} step {step}", m, opt, Q4D, reduction, op=op, data=batch(step, 9))
        # Two optimizers on disjoint parameters sharing one codec object.
        m = fresh()
        q = hvd_quant.from_spec(Q4D)
        first = [(n, p) for n, p in m.named_parameters() if n.startswith("a.")]
        rest = [(n, p) for n, p in m.named_parameters() if not n.startswith("a.")]
        o1 = make_opt(entry, m, q, base=torch.optim.SGD([p for _, p in first], lr=0.05), named=first,
                      reduction=reduction)
        o2 = make_opt(entry, m, q, base=torch.optim.Adam([p for _, p in rest], lr=1e-3), named=rest,
                      reduction=reduction)
        for step in range(2):
            params = list(m.parameters())
            x, y = batch(step, 10)
            loss = F.cross_entropy(m(x), y)
            ref, mx = reference(local_grads(loss, params))
            loss.backward()
            o1.synchronize()
            o2.synchronize()
            ok, worst = grads_ok(params, ref, mx, Q4D, reduction)
            check(ok, f"{tag}/two optimizers one codec step {step}", f"worst error/bound {worst:.3f}")
            for o in (o1, o2):
                with o.skip_synchronize():
                    o.step()
                o.zero_grad()
            check(params_identical(m), f"{tag}/two optimizers identical step {step}")


def main():
    groups = sys.argv[1:] or ["resume", "sparse", "uneven", "join", "patterns"]
    table = {"resume": resume_cases, "sparse": sparse_cases, "uneven": uneven_cases,
             "join": join_cases, "patterns": pattern_cases}
    for g in groups:
        check.run(g, table[g])
    faulthandler.cancel_dump_traceback_later()
    check.finish()


if __name__ == "__main__":
    main()
