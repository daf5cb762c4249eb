"""``hvd_quant.torch.ddp_comm_hook``: the codecs for ``torch.nn.parallel.DistributedDataParallel``.

DDP hands each bucket of gradients to a communication hook and waits for the futures it returned
once backward has ended. This hook runs DDP's gradients through the plan, scheduler and exchange of
``hvd_quant.torch.DistributedOptimizer``, on ``torch.distributed`` collectives (:func:`collectives`):

1. The first step holds its buckets until DDP's last one, then names each parameter by its place in
   that step's layout (``p0``, ``p1``, ...: the same in every run), plans them in DDP's order and
   checks that every rank made the same plan (one blocking allgather). The plan belongs to the
   parameters: DDP's rebuild of its buckets changes neither buckets nor residuals' keys.
2. Then each DDP bucket's gradients arrive at the scheduler as views of its buffer; a planned bucket
   starts its exchange once its last member has arrived, while backward goes on.
3. At DDP's last bucket every started exchange is advanced, then finished, and the averaged results
   are written into the step's DDP buffers, whose futures then complete.

Warm-up, and steps where ``auto`` runs or chose fp32 allreduce, reduce each bucket as DDP does, to
the bit (buffer * (1/N), then a Sum allreduce; waited for at the last bucket while ``auto`` times
its candidates); so do buckets that are not floating point.
"""
import gc
import os
import sys
import time

import torch
import torch.distributed as dist

from .. import plan as _plan
from ..codecs import resolve_codec
from ..exchange import AVERAGE, HANDSHAKE_NAME, Collectives, Memory, Traffic, handshake
from ..scheduler import StepOwner, StepScheduler
from ._backend import FRONTEND, OPS, GroupWork, wait_for

__all__ = ["ddp_comm_hook", "DDPCommState", "collectives", "shutdown"]

_PREFIX = "hvdq.ddp"
# torch 2.13 renamed all_gather_into_tensor (since deprecated) to all_gather_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Posted(GroupWork):
    """A collective whose result is ``post(out)``, computed at the first wait."""
    __slots__ = ("post",)

    def __init__(self, work, out, post):
        super().__init__(work, out)
        self.post = post

    def wait(self):
        out = super().wait()
        if self.post is not None:
            self.out, self.post = self.post(out), None
        return self.out


def collectives(process_group=None):
    """The exchange's :class:`~hvd_quant.exchange.Collectives` over a ``torch.distributed`` process
    group (default: the world). Its collectives match by order, so the caller issues them in one
    order on every rank; it has no ``poll`` (a second phase started while backward runs would start
    in an order that differs between ranks). ``allgather_async`` pads each payload to the longest
    (lengths from the caller, or gathered first: a blocking allgather); ``alltoall_async`` takes
    the received lengths to be this rank's split. On NCCL, host tensors travel on the current device.
    """
    pg = process_group if process_group is not None else dist.group.WORLD
    rank, size = dist.get_rank(pg), dist.get_world_size(pg)
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend(pg) == dist.Backend.NCCL else None)

    def on_device(t):
        return t if device is None or t.device == device else t.to(device)

    def allgather_async(t, name, sizes=None):
        t = on_device(t)
        if sizes is None:           # (a blocking allgather of the lengths: a sync point)
            sizes = torch.empty(size, dtype=torch.int64, device=t.device)
            _all_gather_single(sizes, torch.tensor([t.numel()], dtype=torch.int64, device=t.device),
                               group=pg)
            sizes = sizes.tolist()
        each = max(sizes)
        if t.numel() != each:
            padded = t.new_zeros(each)
            padded[:t.numel()].copy_(t)
            t = padded
        out = t.new_empty(each * size)
        work = _all_gather_single(out, t, group=pg, async_op=True)
        if all(s == each for s in sizes):
            return GroupWork(work, out)
        return _Posted(work, out, lambda o: torch.cat([o[r * each:r * each + s] for r, s in enumerate(sizes)]))

    def alltoall_async(t, splits, name):
        mine = int(splits[rank])
        out = t.new_empty(mine * size)
        work = dist.all_to_all_single(out, t, [mine] * size, [int(s) for s in splits], group=pg,
                                      async_op=True)
        return GroupWork(work, out)

    def allreduce_async(t, name, op=AVERAGE, prescale_factor=1.0, postscale_factor=1.0):
        if prescale_factor != 1.0:
            t.mul_(prescale_factor)
        work = dist.all_reduce(t, group=pg, async_op=True)
        factor = postscale_factor / size if op == AVERAGE else postscale_factor
        return GroupWork(work, t) if factor == 1.0 else _Posted(work, t, lambda o: o.mul_(factor))

    return Collectives(rank=rank, size=size, allgather_async=allgather_async,
                       alltoall_async=alltoall_async, allreduce_async=allreduce_async,
                       synchronize=lambda handle: handle.wait(), process_set=pg, poll=None)


def _done(value):
    fut = torch.futures.Future(devices=[value.device] if value.is_cuda else None)
    fut.set_result(value)
    return fut


class DDPCommState(StepOwner):
    """The hook's state (module doc): the plan, the scheduler, the error-feedback residuals, the step
    counter and ``reduction="auto"``'s measurements. Made by :func:`ddp_comm_hook`.

    ``state_dict()`` holds ``step``, ``codec`` (its spec), ``reduction``, this rank's worker
    residuals by parameter name (``residuals``), the SRA "server" residuals by ``(bucket, rank,
    world size)`` (``server_residuals``) and ``auto``'s state; every rank saves its own (residuals
    differ between ranks) and ``load_state_dict()`` restores it, before or after the first step.
    ``bytes_per_step()`` and ``step_metrics()`` describe the last step, as the optimizer's do.
    """
    _prefix = _PREFIX

    def __init__(self, config, process_group=None):
        self.config, self.codec = config, config.codec
        self.process_group = process_group
        self._memory = Memory(OPS) if config.error_feedback else None
        self.step = 0                   # completed steps: warm-up and the noise key
        self._traffic = Traffic()       # this step so far
        self.last_traffic = Traffic()
        self._coll = None
        self._plan = self._sched = None
        self._exchanges = {}            # route -> Exchange
        self._spots = {}                # id(parameter) -> (the scheduler's group, member)
        self._params = ()               # the planned parameters (their ids key _spots)
        self._layout = []               # the first step's DDP buckets' parameters, until planned
        self._held = []                 # this step's (future, buffer, parameters) for the scheduler
        self._allreduced = []           # this step's futures of DDP's own allreduce
        self._open = False              # a step is under way
        self._compress = False          # this step's buckets go through the scheduler
        self._t0 = None
        self._loaded = None             # a state_dict loaded before the plan was made

    # -- the hook ---------------------------------------------------------------------------------
    def reduce(self, bucket):
        """DDP's hook: the future of ``bucket``'s averaged buffer (module doc)."""
        buf = bucket.buffer()
        coll = self._collectives()
        if not self._open:
            self._begin_step()
        if coll.size == 1:
            fut = _done(buf)
        else:
            floating = buf.is_floating_point()
            if floating and self._plan is None:
                self._layout.append(bucket.parameters())
            if floating and self._compress:
                fut = torch.futures.Future(devices=[buf.device] if buf.is_cuda else None)
                self._held.append((fut, buf, bucket.parameters()))
                if self._sched is not None:
                    self._arrive(buf, self._held[-1][2])
            else:
                fut = self._allreduce(buf)
                self._allreduced.append(fut)
        if bucket.is_last():
            self._end_step()
        return fut

    def _collectives(self):
        if self._coll is None:
            self._coll = collectives(self.process_group)
        return self._coll

    def _allreduce(self, buf):
        """DDP's own reduction of a bucket, bit for bit: buffer * (1/N), then a Sum allreduce."""
        size = self._coll.size
        self._traffic.add_allreduce(buf.numel() * buf.element_size(), buf.numel(), size)
        buf.mul_(1.0 / size)
        work = dist.all_reduce(buf, group=self._coll.process_set, async_op=True)
        return work.get_future().then(lambda f: f.value()[0])

    def _begin_step(self):
        self._open = True
        self._t0 = time.perf_counter()
        warm = self.step < self.config.warmup_steps
        if self._sched is not None:
            self._compress = self._sched.begin_step(compress=not warm)
        else:
            self._compress = not warm

    def _arrive(self, buf, params):
        sched, off = self._sched, 0
        for p in params:
            n = p.numel()
            spot = self._spots.get(id(p))
            if spot is None:
                raise RuntimeError("hvd_quant: DDP handed ddp_comm_hook a parameter it did not hand over "
                                   "in the first step; make a new hook state for another model")
            sched.arrive(*spot, buf[off:off + n])
            off += n
        if off != buf.numel():
            raise RuntimeError(f"hvd_quant: a DDP bucket of {buf.numel()} elements holds parameters of "
                               f"{off}: its buffer is not their gradients back to back")

    def _end_step(self):
        if self._plan is None and self._layout:
            self._make_plan([p for ps in self._layout for p in ps])
            self._layout = []
            if self._held:
                self._compress = self._sched.begin_step()
                for _, buf, params in self._held:
                    if self._compress:
                        self._arrive(buf, params)
        if self._held:
            self._finish_held()
        allreduced, self._allreduced = self._allreduced, []
        if self._sched is not None:
            if self._sched.auto is not None and self._sched.auto.choice is None:
                for fut in allreduced:  # auto times this step: its allreduces end in it, as an
                    fut.wait()          # exchange does (else they fall into the next step's time)
            self._sched.end_step(timed=self.step >= self.config.warmup_steps)
        self.step += 1
        self._keep_traffic(self._t0)
        self._open = False

    def _finish_held(self):
        held, self._held = self._held, []
        if not self._compress:          # the plan has no compressed bucket: DDP's allreduce
            for fut, buf, _ in held:
                fut.set_result(self._allreduce(buf).wait())
            return
        out, nb = {}, len(self._plan.buckets)
        scale = 1.0 / self._coll.size   # the buckets' sums, averaged as they are written back
        for k, pieces in self._sched.finish_started():
            out.update((i, (piece, scale if k < nb else None)) for i, piece in zip(self._group_ids[k], pieces))
        for fut, buf, params in held:
            off = 0
            for p in params:
                n = p.numel()
                piece, factor = out[id(p)]
                if factor is None:
                    buf[off:off + n].copy_(piece)
                else:               # the same product as the scheduler's average, one pass fewer
                    torch.mul(piece, factor, out=buf[off:off + n])
                off += n
            fut.set_result(buf)

    # -- plan -------------------------------------------------------------------------------------
    def _make_plan(self, params):
        """Plan ``params`` (in the order DDP handed them over in the first step) and check that every
        rank made the same plan."""
        names = {id(p): f"p{i}" for i, p in enumerate(params)}
        ordered = params[::-1]          # make_plan fuses in reverse: here, in DDP's order
        tensors = [_plan.Tensor(names[id(p)], tuple(p.shape), p.is_floating_point()) for p in ordered]
        plan = _plan.make_plan(self.config, tensors, prefix=_PREFIX)
        groups = _plan.plain_groups(plan, [True] * len(ordered), self.config.bucket_bytes)
        handshake(self._coll, OPS, plan.record, "hvd_quant.torch.ddp_comm_hook", name=HANDSHAKE_NAME)
        self._params = tuple(params)
        self._group_ids = [[id(ordered[i]) for i in m] for m in [b.members for b in plan.buckets] + groups]
        self._spots = {pid: (k, i) for k, ids in enumerate(self._group_ids) for i, pid in enumerate(ids)}
        sched = StepScheduler(
            plan, [(f"{_PREFIX}.plain.{j}", [ordered[i].numel() for i in g]) for j, g in enumerate(groups)],
            ops=OPS, exchange_for=self._exchange_for, traffic=self._traffic,
            numbering=lambda b: (self.step, None), split=FRONTEND.split,
            average=False, plain_op=(AVERAGE, 1.0, 1.0), name=_PREFIX, label="hvd_quant.ddp_comm_hook",
            wait_device=lambda: wait_for(params[0].device))
        sched.bind(self._coll)
        self._plan, self._sched = plan, sched
        if self._loaded is not None:
            loaded, self._loaded = self._loaded, None
            self.load_state_dict(loaded)

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self):
        if self._plan is None and self._loaded is not None:
            return dict(self._loaded, step=self.step)
        return self._plan_state(self.step)

    def load_state_dict(self, state):
        """Restore :meth:`state_dict`'s output; before the first step it is kept until the plan is
        made. Residuals go to the devices of the parameters they belong to."""
        state = dict(state)
        if state.get("codec", self.codec.spec()) != self.codec.spec():
            raise ValueError(f"hvd_quant: the saved hook state is of codec {state['codec']!r}, this hook's "
                             f"{self.codec.spec()!r}")
        self.step = int(state.get("step", 0))
        if self._plan is None:
            self._loaded = state
            return
        self._load_plan_state(state, self._params[0])


def _hook(state, bucket):
    return state.reduce(bucket)


def ddp_comm_hook(codec, reduction="auto", error_feedback=None, warmup_steps=0, process_group=None, *,
                  bucket_bytes=_plan.BUCKET_BYTES, min_compress_numel=1024, compress_1d=False):
    """``(state, hook)`` for ``model.register_comm_hook(state, hook)`` on a DDP model: its gradients
    are averaged through hvd_quant's compressed exchange (module doc). No Horovod needed.

    Arguments:
        codec: an hvd_quant codec or its spec string (``"qsgd:bits=4,bucket_size=512"``).
        reduction: ``"auto"`` (default: fp32 allreduce, ``"allgather"`` or ``"sra"``, whichever gave
            the fastest steps in the first 18, the same on every rank, printed once by rank 0),
            ``"sra"`` or ``"allgather"``, as for ``hvd_quant.torch.DistributedOptimizer``.
        error_feedback: keep each rank's quantization residual (default: what the codec wants).
        warmup_steps: DDP's own fp32 allreduce for this many first steps.
        process_group: the ``torch.distributed`` group to average over (default: the world).
        bucket_bytes, min_compress_numel, compress_1d: the plan's fusion and size rules, as for the
            optimizer (gradients that are 1-D or smaller go uncompressed, fused into plain groups).

    Steps run under ``model.no_sync()`` accumulate locally and do not count. Every rank must pass
    the same arguments (else every rank raises ``ConfigMismatchError`` at the first step).

    Example (``torchrun --nproc_per_node 2 train.py``)::

        dist.init_process_group("gloo")
        model = DistributedDataParallel(net)
        state, hook = hvd_quant.torch.ddp_comm_hook("qsgd:bits=4,bucket_size=512")
        model.register_comm_hook(state, hook)
    """
    config = _plan.configure(resolve_codec(codec), reduction=reduction, bucket_bytes=bucket_bytes,
                             min_compress_numel=min_compress_numel, compress_1d=compress_1d,
                             warmup_steps=warmup_steps, error_feedback=error_feedback, op=AVERAGE)
    return DDPCommState(config, process_group), _hook


def shutdown(exit_code=None):
    """End a ``torch.distributed`` job that ran the hook (or FSDP's): the hooks' last collectives freed
    while the default process group lives (``gc.collect()``), a barrier, so that no rank tears its
    connections down while another still uses them, and the group destroyed. With ``exit_code``,
    stdout and stderr are flushed and the process leaves at once (``os._exit``): after a finished run,
    torch.distributed's exit-time teardown of its remaining objects has aborted ranks ("terminate
    called without an active exception"), turning a good run into a failed job."""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    if exit_code is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)
