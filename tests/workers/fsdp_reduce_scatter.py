"""Worker: ``hvd_quant.torch.fsdp_reduce_scatter`` on real torch.distributed processes under torchrun
(Gloo on the CPU). argv: the groups of checks to run.

Two FSDP2 models (``fully_shard`` on each layer and the root) with the same parameters run the same
batches each step: ours (the compressed reduce-scatter) and FSDP's own reduce-scatter (the
reference). Checks:

* ``grads``: warm-up steps give FSDP's bytes exactly (torch's own reduce-scatter, the same op);
  later steps give each rank's gradient shard within the codec's bound of FSDP's. With M_j the
  largest |local gradient| of rank j, s = 2^(bits-1)-1 and unit_j = M_j / s, rank j's payload errs at
  most unit_j/2 per element (deterministic QSGD) or unit_j (stochastic); each shard is quantized once
  per rank (no requantization), so the mean errs at most sum_j c * unit_j / N, plus fp32 rounding
  of the sum and the scaling (2 eps relative) and the reference's own (1e-6 M). After each step
  the full parameters are bit-identical on every rank. Run for deterministic and seeded stochastic
  QSGD.
* ``train``: 10 SGD steps on each rank's fixed batch lower the mean loss over the ranks (the
  objective whose gradient the reduce-scatter averages) at least half as far as FSDP's own do.
* ``resume``: 3 steps, a checkpoint (the local shards and the state with its error-feedback
  residuals), a fresh model loaded from it and 3 more steps give the bytes of 6 uninterrupted steps;
  resumed without the state, they do not.
* ``bad``: a reduce op other than AVG or SUM raises ValueError naming it; ranks that configure a
  module differently raise ConfigMismatchError on every rank.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checks as _checks  # noqa: E402

from hvd_quant import ConfigMismatchError  # noqa: E402
from hvd_quant.torch import fsdp_reduce_scatter  # noqa: E402

torch.set_num_threads(1)
dist.init_process_group("gloo")
R, N = dist.get_rank(), dist.get_world_size()

Q4D = "qsgd:bits=4,bucket_size=512,mode=deterministic"
Q4S = "qsgd:bits=4,bucket_size=512,mode=stochastic,seed=11"


WORLD = _checks.TorchWorld()
check = _checks.Checks(WORLD)


class Net(nn.Module):
    """Three layers of 2112, 4160 and 650 parameters; c's 10 rows do not split evenly in 3."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.a, self.b, self.c = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 10)

    def forward(self, x):
        return self.c(F.relu(self.b(F.relu(self.a(x)))))


def sharded():
    net = Net()
    for layer in (net.a, net.b, net.c):
        fully_shard(layer)
    fully_shard(net)
    return net


def ours(spec, **kw):
    net = sharded()
    return net, fsdp_reduce_scatter(net, spec, **kw)


def loss_of(model, step):
    g = torch.Generator().manual_seed(7919 * R + 104729 * step)
    x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
    return F.cross_entropy(model(x), y)


def shards(model):
    return [p.to_local() for p in model.parameters()]


def gather(x):
    out = [torch.zeros_like(x) for _ in range(N)]
    dist.all_gather(out, x)
    return out


def same_on_all_ranks(model):
    full = torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])
    return all(torch.equal(full, o) for o in gather(full))


def sgd(model, lr=0.05):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-lr)


def bound_of(model, step, spec):
    """The codec's bound on the error of the mean gradient (module doc), from every rank's M_j."""
    plain = Net()
    with torch.no_grad():
        for q, p in zip(plain.parameters(), model.parameters()):
            q.copy_(p.full_tensor())
    local = torch.autograd.grad(loss_of(plain, step), list(plain.parameters()))
    m = float(sum(gather(torch.tensor([max(float(g.abs().max()) for g in local)], dtype=torch.float64))))
    s = (1 << (int(spec.split("bits=")[1].split(",")[0]) - 1)) - 1
    return (0.5 if "deterministic" in spec else 1.0) * m / s / N, m


def grads_case(spec, steps=4, warmup=1):
    name = f"{spec.split(',')[0]}:{'det' if 'deterministic' in spec else 'sto'}"
    model, state = ours(spec, warmup_steps=warmup)
    ref = sharded()
    eps = torch.finfo(torch.float32).eps
    for step in range(steps):
        with torch.no_grad():
            for r, p in zip(shards(ref), shards(model)):
                r.copy_(p)
        bound, m = bound_of(model, step, spec)
        for net in (model, ref):
            net.zero_grad(set_to_none=True)
            loss_of(net, step).backward()
        pairs = [(p.grad.to_local(), r.grad.to_local()) for p, r in zip(model.parameters(), ref.parameters())]
        if step < warmup:
            check(all(torch.equal(g, h) for g, h in pairs), f"{name} warm-up step {step} equals FSDP's reduce-scatter")
        else:
            worst = max(float(((g - h).abs() / (bound + 2 * eps * (h.abs() + bound) + 1e-6 * m)).max())
                        for g, h in pairs if g.numel())
            check(worst <= 1.0, f"{name} step {step} within the codec's bound of FSDP's reduce-scatter",
                  f"worst {worst:.3f} of the bound")
        sgd(model)
        check(same_on_all_ranks(model), f"{name} step {step}: full parameters identical on every rank")
    check(state.steps == {"a": steps, "b": steps, "c": steps}, f"{name}: one reduce-scatter per module and step",
          str(state.steps))


def test_grads():
    grads_case(Q4D)
    grads_case(Q4S, warmup=0)


def test_train():
    model, _ = ours(Q4S)
    ref = sharded()
    losses = {"ours": [], "ref": []}
    for step in range(10):
        for key, net in (("ours", model), ("ref", ref)):
            net.zero_grad(set_to_none=True)
            loss = loss_of(net, 0)          # each rank's batch every step: the mean is the objective
            loss.backward()
            sgd(net, lr=0.2)
            losses[key].append(float(sum(gather(loss.detach().reshape(1)))) / N)
    ours_l, ref_l = losses["ours"], losses["ref"]
    check(ours_l[-1] < ours_l[0] - 0.5 * (ref_l[0] - ref_l[-1]), "train: the mean loss over the ranks falls, "
          "at least half as far as with FSDP's reduce-scatter",
          f"{ours_l[0]:.4f} -> {ours_l[-1]:.4f} (reference {ref_l[0]:.4f} -> {ref_l[-1]:.4f})")
    check(same_on_all_ranks(model), "train: full parameters identical on every rank")


def test_resume():
    def fresh():
        return ours(Q4S, error_feedback=True)

    def run(model, first, last):
        for step in range(first, last):
            model.zero_grad(set_to_none=True)
            loss_of(model, step).backward()
            sgd(model)

    model, state = fresh()
    run(model, 0, 6)
    whole = [t.clone() for t in shards(model)]

    model, state = fresh()
    run(model, 0, 3)
    saved = {"shards": [t.clone() for t in shards(model)], "state": state.state_dict()}
    res = saved["state"]["residuals"]
    check(sorted(res) == ["a", "b", "c"] and all(float(t.abs().max()) > 0 for t in res.values()),
          "resume: the checkpoint holds nonzero residuals", str(sorted(res)))
    for with_state in (True, False):
        model, state = fresh()
        with torch.no_grad():
            for t, s in zip(shards(model), saved["shards"]):
                t.copy_(s)
        if with_state:
            state.load_state_dict(saved["state"])
        run(model, 3, 6)
        same = all(torch.equal(a, b) for a, b in zip(shards(model), whole))
        check(same == with_state, f"resume {'with' if with_state else 'without'} the state: "
              f"{'the same' if with_state else 'not the same'} model as 6 uninterrupted steps")


def test_bad():
    _, state = ours(Q4D)
    comm = state.comm("x")
    out, inp = torch.zeros(1024), torch.ones(1024 * N)
    check.raises("ReduceOp.MAX", lambda: comm(out, inp, dist.group.WORLD, dist.ReduceOp.MAX), ValueError, "MAX")
    try:
        state.comm(f"x{R}")(out, inp, dist.group.WORLD, dist.ReduceOp.AVG)
        check(False, "ranks configured differently raise ConfigMismatchError", "no error")
    except ConfigMismatchError as e:
        check("rank 0" in str(e), "ranks configured differently raise ConfigMismatchError", str(e)[:160])


GROUPS = {"grads": test_grads, "train": test_train, "resume": test_resume, "bad": test_bad}

for group in sys.argv[1:]:
    check.run(group, GROUPS[group])
check.finish()
