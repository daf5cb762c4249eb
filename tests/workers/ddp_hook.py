"""Worker: ``hvd_quant.torch.ddp_comm_hook`` on real torch.distributed processes under torchrun: Gloo
on the CPU, or NCCL with one GPU per rank where ``HVDQ_TEST_DEVICE=cuda``. argv: the groups of
checks to run.

Each step runs the same batches through two DDP models with the same parameters: ours (the hook) and
DDP's own allreduce (the reference), and checks:

* ``grads``: warm-up steps give DDP's bytes exactly (the hook then reduces as DDP does); later steps
  are within the codec's bound of DDP's result. With M_j the largest |local gradient| of rank j over
  the compressed tensors, s = 2^(bits-1)-1 and unit_j = M_j / s: deterministic QSGD errs at most
  unit_j/2 per rank and quantization, stochastic at most unit_j; allgather quantizes once, SRA twice
  (the reduced chunk, whose max is at most sum_j M_j); the average divides by N. Uncompressed
  tensors differ from DDP's only in rounding: DDP multiplies each rank's gradient by 1/N before the
  sum, the hook scales the sum, and Gloo's ring sums a flat buffer of another layout in another
  order: an fp32 rounding per addend and step (N * eps * sum_j |g_j| / N). After each
  step every parameter has the same bytes on every rank. Run for SRA and allgather, deterministic
  and seeded stochastic QSGD.
* ``resume``: 3 steps, a checkpoint (model, optimizer, hook state with error-feedback residuals), a
  fresh model, DDP and hook loaded from it and 3 more steps give the bytes of 6 uninterrupted steps;
  resumed without the hook state, they do not (the residuals matter).
* ``nosync``: gradients accumulated under ``model.no_sync()`` then reduced once, within the bound
  of the summed local gradients.
* ``unused``: ``find_unused_parameters=True`` with a parameter outside the forward pass.
* ``auto``: ``reduction="auto"`` decides after its 18 steps, the same on every rank (the test counts
  rank 0's one printed line); a step it times on DDP's allreduce ends with its allreduces done.
* ``bad``: an unknown codec spec and a bad reduction raise ValueError naming them.
"""
import copy
import io
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checks as _checks  # noqa: E402

from hvd_quant.torch import ddp_comm_hook  # noqa: E402

torch.set_num_threads(1)
DEVICE = torch.device(os.environ.get("HVDQ_TEST_DEVICE", "cpu"))
if DEVICE.type == "cuda":
    DEVICE = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(DEVICE)
dist.init_process_group("nccl" if DEVICE.type == "cuda" else "gloo")
R, N = dist.get_rank(), dist.get_world_size()

Q4D = "qsgd:bits=4,bucket_size=512,mode=deterministic"
Q4S = "qsgd:bits=4,bucket_size=512,mode=stochastic,seed=11"
CAP_MB = 0.01           # DDP buckets of ~2600 floats: several per model, rebuilt after the first step


WORLD = _checks.TorchWorld()
check = _checks.Checks(WORLD)


class Net(nn.Module):
    """a.weight 2048 and b.weight 4096 elements are compressed; c.weight (640) and biases are not;
    ``u`` is never used."""

    def __init__(self, unused=False):
        super().__init__()
        torch.manual_seed(1)
        self.a, self.b, self.c = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 10)
        self.u = nn.Linear(64, 64) if unused else None

    def forward(self, x):
        return self.c(F.relu(self.b(F.relu(self.a(x)))))


def batch(step, salt=0):
    g = torch.Generator().manual_seed(7919 * R + 104729 * step + salt)
    return torch.randn(16, 32, generator=g).to(DEVICE), torch.randint(0, 10, (16,), generator=g).to(DEVICE)


def loss_of(model, step, salt=0):
    x, y = batch(step, salt)
    return F.cross_entropy(model(x), y)


def ddp(net, **kw):
    return DDP(net.to(DEVICE), bucket_cap_mb=CAP_MB, device_ids=[DEVICE] if DEVICE.type == "cuda" else None,
               **kw)


def ours(spec, unused=False, **kw):
    model = ddp(Net(unused), find_unused_parameters=unused)
    state, hook = ddp_comm_hook(spec, bucket_bytes=16384, **kw)
    model.register_comm_hook(state, hook)
    return model, state


def same_on_all_ranks(t):
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    out = [torch.empty_like(raw) for _ in range(N)]
    dist.all_gather(out, raw)
    return all(torch.equal(out[0], o) for o in out[1:])


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def compressed(p):
    return p.dim() > 1 and p.numel() >= 1024


def gather(x):
    out = [torch.zeros_like(x) for _ in range(N)]
    dist.all_gather(out, x)
    return out


def within_bound(params, refs, local, spec, reduction):
    """(ok, worst error / bound) of the gradients of ``params`` against those of ``refs`` (module
    doc); ``local``: this rank's own gradients of ``refs``."""
    mine = torch.tensor([max(float(g.abs().max()) for p, g in zip(refs, local) if compressed(p))],
                        dtype=torch.float64, device=DEVICE)
    m = float(sum(gather(mine)))
    s = (1 << (int(spec.split("bits=")[1].split(",")[0]) - 1)) - 1
    bound = (0.5 if "deterministic" in spec else 1.0) * (1 if reduction == "allgather" else 2) * m / s / N
    eps = torch.finfo(torch.float32).eps
    ok, worst = True, 0.0
    for p, r, g in zip(params, refs, local):
        if r.grad is None:
            continue
        err = (p.grad - r.grad).abs()
        if compressed(p):
            tol = bound + 2 * eps * (r.grad.abs() + bound) + 1e-6 * m
        else:
            tol = eps * sum(gather(g.abs())) + 1e-30
        worst = max(worst, float((err / tol).max()))
        ok &= bool((err <= tol).all())
    return ok, worst


def sgd(model):
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-0.05)


def grads_case(spec, reduction, steps=5, warmup=1):
    name = f"{reduction}:{spec.split(',')[0]}:{'det' if 'deterministic' in spec else 'sto'}"
    model, state = ours(spec, reduction=reduction, warmup_steps=warmup)
    ref = ddp(Net())
    for step in range(steps):
        with torch.no_grad():
            for p, r in zip(model.parameters(), ref.parameters()):
                r.copy_(p)
        local = torch.autograd.grad(loss_of(ref.module, step), list(ref.module.parameters()))
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
            loss_of(m, step).backward()
        if step < warmup:
            check(all(torch.equal(p.grad, r.grad) for p, r in zip(model.parameters(), ref.parameters())),
                  f"{name} warm-up step {step} equals DDP's allreduce")
        else:
            ok, worst = within_bound(list(model.parameters()), list(ref.parameters()), local, spec, reduction)
            check(ok, f"{name} step {step} within the codec's bound of DDP's allreduce", f"worst {worst:.3f}")
        sgd(model)
        check(same_on_all_ranks(flat_params(model)), f"{name} step {step} replicas identical")
    m = state.step_metrics()
    check(state.step == steps and m["ratio"] > 2 and m["buckets"], f"{name} metrics",
          f"step {state.step} ratio {m['ratio']:.2f} buckets {len(m['buckets'])}")


def test_grads():
    grads_case(Q4D, "sra")
    grads_case(Q4D, "allgather")
    grads_case(Q4S, "sra", warmup=0)


def run_steps(model, opt, first, last):
    for step in range(first, last):
        opt.zero_grad(set_to_none=True)
        loss_of(model, step).backward()
        opt.step()


def test_resume():
    kw = dict(reduction="sra", error_feedback=True)

    def fresh():
        model, state = ours(Q4S, **kw)
        return model, state, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    model, state, opt = fresh()
    run_steps(model, opt, 0, 6)
    whole = flat_params(model)

    model, state, opt = fresh()
    run_steps(model, opt, 0, 3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}, buf)
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=False, map_location=DEVICE)
    res = saved["hook"]["residuals"]
    check(len(res) == 2 and all(float(t.abs().max()) > 0 for t in res.values())
          and saved["hook"]["server_residuals"], "resume: the checkpoint holds nonzero residuals",
          f"{sorted(res)} server {len(saved['hook']['server_residuals'])}")
    for with_hook in (True, False):
        model, state, opt = fresh()
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        if with_hook:
            state.load_state_dict(saved["hook"])
        run_steps(model, opt, 3, 6)
        same = torch.equal(flat_params(model), whole)
        check(same == with_hook, f"resume {'with' if with_hook else 'without'} the hook state: "
              f"{'the same' if with_hook else 'not the same'} model as 6 uninterrupted steps")
        check(same_on_all_ranks(flat_params(model)), "resume: replicas identical")


def test_nosync():
    for spec, reduction in ((Q4D, "sra"), (Q4D, "allgather")):
        model, state = ours(spec, reduction=reduction)
        ref = ddp(Net())
        for step in range(3):
            with torch.no_grad():
                for p, r in zip(model.parameters(), ref.parameters()):
                    r.copy_(p)
            params = list(ref.module.parameters())
            local = torch.autograd.grad(loss_of(ref.module, step) + loss_of(ref.module, step, salt=1), params)
            for m in (model, ref):
                m.zero_grad(set_to_none=True)
                with m.no_sync():
                    loss_of(m, step).backward()
                loss_of(m, step, salt=1).backward()
            ok, worst = within_bound(list(model.parameters()), list(ref.parameters()), local, spec, reduction)
            check(ok, f"no_sync {reduction} step {step}: accumulated gradients within the bound",
                  f"worst {worst:.3f}")
            sgd(model)
            check(same_on_all_ranks(flat_params(model)), f"no_sync {reduction} step {step} replicas identical")
        check(state.step == 3, "no_sync passes are not steps", f"step {state.step}")


def test_unused():
    model, state = ours(Q4D, unused=True, reduction="sra")
    ref = ddp(Net(unused=True), find_unused_parameters=True)
    for step in range(3):
        with torch.no_grad():
            for p, r in zip(model.parameters(), ref.parameters()):
                r.copy_(p)
        params = [p for n, p in ref.module.named_parameters() if not n.startswith("u.")]
        local = torch.autograd.grad(loss_of(ref.module, step), params)
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
            loss_of(m, step).backward()
        used = [(p, r) for (n, p), r in zip(model.named_parameters(), ref.parameters()) if not n.startswith("u.")]
        ok, worst = within_bound([p for p, _ in used], [r for _, r in used], local, Q4D, "sra")
        check(ok, f"unused parameter, step {step}: used gradients within the bound", f"worst {worst:.3f}")
        u = model.module.u.weight.grad
        check(u is None or not u.any(), f"unused parameter, step {step}: no gradient for it")
        sgd(model)
        check(same_on_all_ranks(flat_params(model)), f"unused parameter, step {step}: replicas identical")


def test_auto():
    model, state = ours(Q4D, reduction="auto")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    run_steps(model, opt, 0, 1)
    # a step timed on DDP's allreduce ends with its allreduces done (else their wait falls into the
    # next candidate's time, and allreduce measures nearly free on any link)
    launched, allreduce, late = [], state._allreduce, []
    state._allreduce = lambda buf: launched.append(allreduce(buf)) or launched[-1]
    auto, clock = state._sched.auto, state._sched.auto.clock

    def read_clock():
        late.extend(f for f in launched if not f.done())
        launched.clear()
        return clock()
    auto.clock = read_clock
    run_steps(model, opt, 1, 20)
    check(not late, "auto: a step timed on allreduce holds its allreduces", f"{len(late)} not done")
    choice = WORLD.allgather_object(state.reduction_in_use())
    check(len(set(choice)) == 1 and state._sched.auto.choice is not None, "auto: one choice on every rank",
          str(choice))
    check(same_on_all_ranks(flat_params(model)), "auto: replicas identical")


def test_bad():
    for args, what in ((("qsgdx:bits=4",), {}), (("qsgd:bits=4",), {"reduction": "ring"})):
        try:
            ddp_comm_hook(*args, **what)
            check(False, f"bad arguments {args} {what} refused")
        except ValueError as e:
            named = "qsgdx" in str(e) or "ring" in str(e)
            check(named, f"bad arguments {args} {what} refused, naming them", str(e))


GROUPS = {"grads": test_grads, "resume": test_resume, "nosync": test_nosync, "unused": test_unused,
          "auto": test_auto, "bad": test_bad}

for group in sys.argv[1:]:
    check.run(group, GROUPS[group])
check.finish()
