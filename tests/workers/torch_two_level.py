"""Worker: ``reduction="two_level"`` on emulated nodes (2 hosts x 2 ranks; tests/test_two_level.py).

Reuses tests/workers/torch_optim.py's step checks: every step, both entry points' gradients against
an uncompressed ``hvd.allreduce`` within the codec's bound (two nodes: each node's fp32 sum is
quantized once, as allgather's per-rank payloads are; the bound in torch_optim's docstring with the
allgather factor), the same parameter bytes on every rank after ``step()``, and a save / restore
that continues bit-identically with error feedback. Groups (argv): ``topology``, ``grads``,
``resume``, ``join``, ``bytes``, ``auto``; and ``one-node`` (a plain 2-rank job).
"""
import sys

import torch
import torch.nn.functional as F

import horovod.torch as hvd

import torch_optim as T
from torch_optim import N, ONEBIT, Q4D, Q4S, R, check

import hvd_quant.torch as hqt


def topology_cases():
    L = hvd.local_size()
    check(L == 2 and hvd.cross_size() == N // 2 and R == hvd.cross_rank() * L + hvd.local_rank(),
          "two hosts", f"rank {R}: local {hvd.local_rank()}/{L}, cross {hvd.cross_rank()}/{hvd.cross_size()}")


def grad_cases():
    for entry in ("ours", "stock"):
        for spec in (Q4D, Q4S):
            m = T.fresh()
            T.step_checks(f"{entry}/two_level/{spec}", m, T.make_opt(entry, m, spec, reduction="two_level"),
                          spec, "two_level")
    # error feedback: the direction (torch_optim.step_checks' rule for residuals)
    m = T.fresh()
    T.step_checks("ours/two_level/onebit", m, T.make_opt("ours", m, ONEBIT, reduction="two_level"),
                  ONEBIT, "two_level")


def resume_cases():
    T.resume_cases(((ONEBIT, None, "two_level"), (Q4S, True, "two_level")), more=False)


def join_cases():
    """Rank N-1 runs one step fewer and joins: the others' last step goes through Horovod's
    allreduce (a joined rank contributes zeros), as with the flat reductions."""
    m = T.fresh()
    opt = T.make_opt("ours", m, Q4D, reduction="two_level")
    steps = 3 if R == N - 1 else 4
    for step in range(steps):
        x, y = T.batch(step, 9)
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()
    hvd.join()
    # the ranks that stepped hold the same bytes; rank N-1 stopped a step earlier
    flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    g = hvd.allgather(flat[None], name="join.params")
    check(all(torch.equal(g[0], g[r]) for r in range(N - 1)) and not torch.equal(g[0], g[N - 1]),
          "join: the stepping ranks' replicas identical")
    if R < N - 1:
        check(opt.step_metrics()["reduction"] == "allreduce", "join: the last step through Horovod's allreduce")


def bytes_cases():
    """The node level sends fp32 inside the node; across nodes each rank sends one payload of its
    shard (allgather between 2 nodes): about 1/L of flat SRA's cross-node bytes."""
    m = T.fresh()
    opt = T.make_opt("ours", m, Q4D, reduction="two_level")
    x, y = T.batch(0, 5)
    F.cross_entropy(m(x), y).backward()
    opt.step()
    got = hqt.bytes_sent_per_step(opt)
    sm = hqt.step_metrics(opt)
    check(sm["reduction"] == "two_level" and got["fp32"] > 0 and got["sent"] > 0, "bytes two_level",
          f"{sm['reduction']}, sent {got['sent']:.0f}, fp32 {got['fp32']:.0f}")


def auto_cases():
    """``reduction="auto"`` on two nodes weighs two_level too: its schedule runs every way (two_level
    among them) on the same steps on every rank, the choice is one of them, replicas stay identical."""
    for entry in ("ours", "stock"):
        m = T.fresh()
        opt = T.make_opt(entry, m, Q4D, reduction="auto")
        ways = []
        for step in range(4 + 4 * 5 + 2):          # warm-up of 4 ways, 5 trials each, then the choice
            x, y = T.batch(step, 9)
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
            ways.append(hqt.step_metrics(opt)["reduction"])
        check(ways[:4] == ["two_level", "sra", "allgather", "allreduce"]
              and set(ways[4:-2]) == {"two_level", "sra", "allgather", "allreduce"}
              and ways[-1] == ways[-2] and ways[-1] in ways[:4], f"auto {entry}: two_level weighed",
              f"ways per step {ways}")
        flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
        g = hvd.allgather(flat[None], name=f"auto.{entry}.params")
        check(all(torch.equal(g[0], g[r]) for r in range(N)), f"auto {entry}: replicas identical")


def one_node_cases():
    """One node (a plain 2-rank job): the node's fp32 sum is the result, as Horovod's allreduce."""
    m = T.fresh()
    T.step_checks("ours/two_level/one-node", m, T.make_opt("ours", m, Q4D, reduction="two_level"), Q4D,
                  "two_level", warmup=3)


def main():
    groups = sys.argv[1:] or ["topology", "grads", "resume", "join", "bytes"]
    table = {"topology": topology_cases, "grads": grad_cases, "resume": resume_cases, "join": join_cases,
             "bytes": bytes_cases, "auto": auto_cases, "one-node": one_node_cases}
    for g in groups:
        check.run(g, table[g])
    check.finish()


if __name__ == "__main__":
    main()
