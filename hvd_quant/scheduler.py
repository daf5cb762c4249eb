"""The step of a compressed gradient reduction, written once for the PyTorch paths (no framework here):
:class:`StepScheduler`, :class:`AutoChoice`, :class:`Presence` (docs/ARCHITECTURE.md, "The step")."""
import math
import statistics
import struct
import time

from .exchange import SUM, TWO_LEVEL, Exchange
from .plan import ALLREDUCE, AUTO, restore_residuals, save_residuals

__all__ = ["StepScheduler", "StepOwner", "AutoChoice", "Presence", "in_plan_order", "step_metrics"]


def in_plan_order(complete, next_start):
    """Of the ``complete`` bucket indices, the run from ``next_start`` starts now, the rest wait (a payload
    channel matches collectives by order): ``(start, waiting, next_start)``."""
    waiting, start = sorted(complete), []
    while waiting and waiting[0] == next_start:
        start.append(waiting.pop(0))
        next_start += 1
    return start, waiting, next_start


class StepScheduler:
    """One plan's buckets and plain groups through each step (docs/ARCHITECTURE.md, "The step")."""

    def __init__(self, plan, plain, *, ops, exchange_for, traffic, numbering, split, average=True,
                 plain_op=(SUM, 1.0, 1.0), name="hvdq", label="hvd_quant", presence=None,
                 wait_device=None):
        self.plan, self.buckets = plan, plan.buckets
        self.nb = len(plan.buckets)
        self.groups = [(b.name, b.numels) for b in plan.buckets] + [(n, tuple(s)) for n, s in plain]
        self.ops, self.exchange_for, self.traffic = ops, exchange_for, traffic
        self.numbering, self.split = numbering, split
        self.average, self.plain_op = average, plain_op
        self.name, self.label = name, label
        self.presence, self.wait_device = presence, wait_device
        self.reduction = plan.config.reduction
        self.auto = AutoChoice() if self.reduction == AUTO else None
        self.coll = None
        self.channel = (None, None)     # (collectives, payload carrier) of the current world
        self.next_channel = None        # made during a step, taken up at the next one's start
        self.routes_run = set()         # routes that completed a step in this world
        self.routes = [ALLREDUCE] * self.nb     # how each bucket travelled this step
        self.clear_step()

    def clear_step(self):
        """No step in progress (at creation, in a new world, after a restored state)."""
        n = len(self.groups)
        self.grads = [[None] * len(numels) for _, numels in self.groups]
        self.arrived = [0] * n
        self.complete = []              # complete buckets waiting for the presence count
        self.next_start = 0             # with a payload channel: the next bucket to start
        self.pending = [None] * n       # (exchange or None for an allreduce, Pending or handle)
        self.unadvanced = []            # started exchanges not yet advanced
        self.pieces = [None] * n        # a finished group's pieces until handed out
        self.left = [0] * n             # members still to be handed out
        self.ran = set()                # routes of the buckets finished this step
        self.like = None                # a gradient of this step (zeros for members not reached)
        if self.presence is not None:
            self.presence.reset()

    # -- world and route ------------------------------------------------------------------------
    def bind(self, coll):
        """Run on ``coll``; True when it is another world (the step is dropped, ``auto`` measures again)."""
        if coll is self.coll:
            return False
        self.coll = coll
        self.routes_run.clear()         # a joining rank's process ran none
        if self.auto is not None:
            self.auto.reset(AutoChoice.candidates_for(coll))
        self.clear_step()
        return True

    def route(self):
        """How this step's buckets travel: ``"sra"``, ``"allgather"``, ``"two_level"`` or ``"allreduce"``."""
        return self.auto.current() if self.auto is not None else self.reduction

    def absent(self):
        """True when a rank is inside ``hvd.join()`` this step (:class:`Presence`)."""
        return self.presence is not None and self.presence.absent(self.coll)

    def channel_for(self, route):
        """The payload channel of this world from ``route``'s second step on, else None (Horovod's)."""
        if route == ALLREDUCE or route not in self.routes_run:
            return None
        coll, carrier = self.channel
        return carrier if coll is self.coll else None

    # -- the step -------------------------------------------------------------------------------
    def begin_step(self, compress=True):
        """At a step's first gradient; ``compress``: the driver allows a compressed exchange (after
        warm-up). Returns whether the buckets take one."""
        self.next_start = 0
        self.routes = [ALLREDUCE] * self.nb
        if self.next_channel is not None:
            self.channel, self.next_channel = self.next_channel, None
        compressing = bool(compress and self.buckets) and self.route() != ALLREDUCE
        if self.presence is not None:
            self.presence.end_step(self.coll)
            if compressing and self.coll.size > 1:
                self.presence.start(self.coll)
        return compressing

    def end_step(self, timed=True, completed=True):
        """``completed``: the finished routes count as run; ``timed``: the step counts for ``auto``."""
        joined = self.absent()
        if completed:
            self.routes_run.update(self.ran)
        self.ran = set()
        if self.presence is not None:
            self.presence.end_step(self.coll)
        if (self.auto is not None and timed and not joined
                and self.auto.end_step(wait=self.wait_device)):
            self.auto.decide(self.coll, self.ops, f"{self.name}.auto")
            if self.coll.rank == 0:
                print(f"{self.label}: {self.auto.summary()}", flush=True)

    def arrive(self, k, i, grad):
        """Member ``i`` of group ``k`` arrived; a complete group starts (buckets: :meth:`start_complete`)."""
        grads = self.grads[k]
        if grads[i] is not None:
            name = self.buckets[k].names[i] if k < self.nb else f"{self.groups[k][0]}[{i}]"
            raise RuntimeError(f"hvd_quant: gradient {name!r} arrived twice before its result "
                               f"(backward run twice without a step?)")
        grads[i] = grad
        self.like = grad
        self.arrived[k] += 1
        if k >= self.nb:
            if self.arrived[k] == len(grads):
                self._start(k)
            return
        if self.arrived[k] == len(grads):
            self.complete.append(k)
        if self.complete:
            self.start_complete(wait=False)

    def start_complete(self, wait):
        """Start the complete buckets once this step's presence count is known (``wait``: block)."""
        if self.presence is not None and not self.presence.known(self.coll, wait):
            return
        complete, self.complete = self.complete, []
        route = self.route()
        channel = self.channel_for(route)
        if channel is not None:
            complete, self.complete, self.next_start = in_plan_order(complete, self.next_start)
        for k in complete:
            self._start(k, route, channel)

    def _start(self, k, route=ALLREDUCE, channel=None):
        """Start group ``k``, zeros for members that never arrived (as Horovod); a bucket takes a Sum
        allreduce while a rank is inside ``hvd.join()``."""
        grads, (name, numels) = self.grads[k], self.groups[k]
        like = next((g for g in grads if g is not None), self.like)
        flat = self.ops.flatten([g if g is not None else self.ops.zeros(n, like) for g, n in zip(grads, numels)])
        if k < self.nb:
            route = ALLREDUCE if self.absent() else route
            self.routes[k] = route
            op, pre, post, name = SUM, 1.0, 1.0, f"{name}.sum"
        else:
            op, pre, post = self.plain_op
        if route == ALLREDUCE:
            numel = sum(numels)
            self.traffic.add_allreduce(4 * numel, numel, self.coll.size)
            self.pending[k] = None, self.coll.allreduce_async(flat, name, op, pre, post)
        else:
            ex, b = self.exchange_for(route), self.buckets[k]
            step, record = self.numbering(b)
            self.pending[k] = ex, ex.start(b.name, flat, step=step, record=record, header=b.header,
                                           channel=channel)
            self.unadvanced.append(k)
            ex.advance_ready([self.pending[j][1] for j in self.unadvanced
                              if self.pending[j][0] is ex])     # done alltoalls: phase two
        self.left[k] = sum(g is not None for g in grads)
        self.grads[k] = [None] * len(grads)
        self.arrived[k] = 0

    def _start_through(self, k):
        """Start bucket ``k`` (and, on a payload channel, the buckets before it: plan order) though
        some member never arrived on this rank."""
        route = self.route()
        channel = self.channel_for(route)
        for j in range(self.next_start if channel is not None else k, k + 1):
            if self.pending[j] is None:
                self._start(j, route, channel)
        self.next_start = max(self.next_start, k + 1)
        self.complete = [j for j in self.complete if self.pending[j] is None]

    def _advance_all(self):
        ks, self.unadvanced = self.unadvanced, []
        for k in ks:
            ex, pending = self.pending[k]
            ex.advance(pending)

    def _finish(self, k):
        ex, pending = self.pending[k]
        flat = ex.finish(pending) if ex is not None else self.coll.synchronize(pending)
        self.pending[k] = None
        if k < self.nb:
            self.ran.add(self.routes[k])
            if self.average and self.coll.size != 1:
                flat = self.ops.scale_(flat, 1.0 / self.coll.size)
        return self.split(flat, self.groups[k][1])

    def result(self, k):
        """Group ``k``'s members' pieces, kept until :meth:`take` took each; a plain group first finishes
        the started buckets."""
        if self.pieces[k] is None:
            if k >= self.nb:
                if self.complete:
                    self.start_complete(wait=True)
                self._advance_all()
                for b in range(self.nb):
                    if self.pending[b] is not None and self.left[b]:
                        self.pieces[b] = self._finish(b)
                if self.pending[k] is None:         # a member never arrived on this rank
                    self._start(k)
            else:
                if self.pending[k] is None:
                    self.start_complete(wait=True)
                if self.pending[k] is None:
                    self._start_through(k)
                self._advance_all()
            self.pieces[k] = self._finish(k)
        return self.pieces[k]

    def take(self, k, n=1):
        """``n`` members of group ``k`` have their pieces; the pieces go once every one has."""
        self.left[k] -= n
        if self.left[k] <= 0:
            self.pieces[k] = None

    def finish_started(self):
        """``[(k, pieces)]`` of every group started this step, every exchange advanced before any finishes."""
        self.start_complete(wait=True)
        started = [k for k, p in enumerate(self.pending) if p is not None]
        self._advance_all()
        return [(k, self._finish(k)) for k in started]


class StepOwner:
    """What the owners of a :class:`StepScheduler` share (the optimizer, the DDP hook's state). They hold
    ``config``, ``_sched``, ``_coll``, ``_memory``, ``_prefix``, ``_exchanges``, ``_traffic``, ``last_traffic``."""

    def _exchange_for(self, route):
        ex = self._exchanges.get(route)
        if ex is None:
            # reuse_result: the results are handed out before the route's next step rewrites them
            ex = self._exchanges[route] = Exchange(
                self.config.codec, self._coll, self._sched.ops, reduction=route, memory=self._memory,
                prefix=self._prefix, reuse_result=True)
            ex.traffic = self._traffic
        return ex

    def _keep_traffic(self, t0):
        """The step ends: its traffic (exchanged from ``t0``, ``time.perf_counter()``) is ``last_traffic``."""
        if t0 is not None:
            self._traffic.seconds = time.perf_counter() - t0
        self.last_traffic = self._traffic.copy()
        self._traffic.reset()

    def _plan_state(self, step):
        """What a checkpoint keeps of the run: ``step``, codec, reduction, residuals, ``auto``'s state."""
        s, mem = self._sched, self._memory
        residuals, server = ({}, {}) if s is None or mem is None else save_residuals(mem, s.buckets, mem.ops.clone)
        return {"step": step, "codec": self.config.codec.spec(), "reduction": self.config.reduction,
                "residuals": residuals, "server_residuals": server,
                "auto": None if s is None or s.auto is None else s.auto.state_dict()}

    def _load_plan_state(self, state, like):
        """Restore :meth:`_plan_state`'s ``auto`` and residuals (onto ``like``'s device); the step is the caller's."""
        s, mem = self._sched, self._memory
        if s.auto is not None and state.get("auto") is not None:
            s.auto.load_state_dict(state["auto"])
        if mem is not None:
            mem.clear()
            restore_residuals(mem, s.buckets, dict(state.get("residuals", {})),
                              {k: v for k, v in state.get("server_residuals", {}).items() if isinstance(k, tuple)},
                              lambda ts: mem.ops.to_like(mem.ops.flatten(ts), like))

    def bytes_per_step(self):
        """The last step's :class:`hvd_quant.exchange.Traffic` (``.sent_bytes``, ``.fp32_bytes``, ``.ratio``)."""
        return self.last_traffic

    def step_metrics(self):
        """:func:`step_metrics` of the last step; None before planning."""
        s = self._sched
        return None if s is None else step_metrics(s.plan, self.last_traffic, s.routes, self.config.codec.spec())

    def reduction_in_use(self):
        """How the next step's compressed buckets travel (:meth:`StepScheduler.route`)."""
        return self.config.reduction if self._sched is None else self._sched.route()


class AutoChoice:
    """``reduction="auto"``: which way a plan's compressed buckets travel, from measured step times
    (docs/EXCHANGE.md, "The reductions"): each candidate once untimed, in reverse order, then ``trials``
    times interleaved; a compressed way must be ``margin`` faster than allreduce; ties go to the earlier."""
    CANDIDATES = (ALLREDUCE, "allgather", "sra")

    def __init__(self, trials=5, clock=time.perf_counter, margin=0.1, candidates=CANDIDATES):
        self.trials, self.clock, self.margin = int(trials), clock, float(margin)
        self.reset(candidates)

    @classmethod
    def candidates_for(cls, coll):
        """:data:`CANDIDATES`, and ``"two_level"`` where ``coll.levels(probe=True)`` offers two levels."""
        levels = getattr(coll, "levels", None)
        if levels is not None and all(level is not None for level in levels(probe=True)):
            return cls.CANDIDATES + (TWO_LEVEL,)
        return cls.CANDIDATES

    def reset(self, candidates=None):
        if candidates is not None:
            self.candidates = tuple(candidates)
        cands = self.candidates
        self.schedule = list(cands[::-1]) + [c for _ in range(self.trials) for c in cands]
        self.step = 0
        self.times = {c: [] for c in cands}
        self.choice = None
        self.medians = None
        self._last = None

    def current(self):
        """The reduction of the step in progress: a candidate of the schedule, then the choice."""
        if self.choice is not None:
            return self.choice
        return self.schedule[min(self.step, len(self.schedule) - 1)]

    def end_step(self, wait=None):
        """Record the end of a step; True when :meth:`decide` is due. ``wait``: waits for the device's
        queued work first, else the host, running ahead, charges a step's work to the next candidate."""
        if self.choice is not None:
            return False
        if wait is not None:
            wait()
        now = self.clock()
        if self._last is not None and self.step >= len(self.candidates):
            self.times[self.schedule[self.step]].append(now - self._last)
        self._last = now
        self.step += 1
        return self.step >= len(self.schedule)

    def decide(self, coll, ops, name):
        """Allgather every rank's :meth:`record` and take the same choice on every rank."""
        record = self.record()
        if coll.size > 1:
            record = ops.to_bytes(coll.synchronize(coll.allgather_async(ops.from_bytes(record), name)))
        return self.choose(record)

    def record(self):
        """This rank's median step time per candidate (float64 seconds), as bytes to allgather."""
        return struct.pack(f"<{len(self.candidates)}d", *[statistics.median(self.times[c]) for c in self.candidates])

    def choose(self, gathered):
        """Take the choice from every rank's medians, concatenated (the same on every rank)."""
        n = len(self.candidates)
        rows = [struct.unpack_from(f"<{n}d", gathered, r * 8 * n) for r in range(len(gathered) // (8 * n))]
        self.medians = [sum(r[i] for r in rows) / len(rows) for i in range(n)]
        best = min(range(n), key=lambda i: (self.medians[i], i))
        plain = self.candidates.index(ALLREDUCE)
        if self.medians[best] > (1.0 - self.margin) * self.medians[plain]:
            best = plain
        self.choice = self.candidates[best]
        return self.choice

    def state_dict(self):
        """Where the schedule stands (a resumed run takes the same ways on the same steps)."""
        return {"step": self.step, "candidates": list(self.candidates),
                "times": {c: list(t) for c, t in self.times.items()},
                "choice": self.choice, "medians": None if self.medians is None else list(self.medians)}

    def load_state_dict(self, state):
        saved = state.get("candidates")
        if saved is not None and not set(saved) <= set(self.CANDIDATES + (TWO_LEVEL,)):
            raise ValueError(f"hvd_quant: saved reduction=auto candidates {saved!r} are not ways of "
                             f"{self.CANDIDATES + (TWO_LEVEL,)}")
        self.reset(saved)
        self.step = int(state.get("step", 0))
        for c, t in dict(state.get("times", {})).items():
            if c in self.times:
                self.times[c] = [float(x) for x in t]
        self.choice = state.get("choice")
        if self.choice is not None and self.choice not in self.candidates:
            raise ValueError(f"hvd_quant: saved reduction=auto choice {self.choice!r} is not one of "
                             f"{self.candidates} (this run's ways)")
        medians = state.get("medians")
        self.medians = None if medians is None else [float(x) for x in medians]

    def summary(self):
        """One line for the log: the choice and the mean median step time of each candidate."""
        times = ", ".join(f"{c} {m * 1e3:.2f} ms" for c, m in zip(self.candidates, self.medians or ()))
        return f"reduction=auto chose {self.choice!r} (median step time, mean over ranks: {times})"


class Presence:
    """Which ranks step this time, for ``hvd.join()`` (docs/EXCHANGE.md, "Horovod's usage patterns"):
    each stepping rank adds ``one()`` to a Sum allreduce; no exchange starts before the count is known."""

    def __init__(self, name, one):
        self.name, self.one = name, one
        self.reset()

    def reset(self):
        """No count in flight or known (a new world: the old one's allreduce is not waited for)."""
        self.handle = None
        self.count = None

    def start(self, coll):
        self.handle = coll.allreduce_async(self.one(), self.name, SUM)

    def known(self, coll, wait):
        """True once this step's count is known (``wait``: block for it); False while in flight."""
        if self.handle is None:
            return True
        if not wait and coll.poll is not None and not coll.poll(self.handle):
            return False
        self.count = int(coll.synchronize(self.handle))
        self.handle = None
        return True

    def absent(self, coll):
        """True when a rank did not step this time (it is inside ``hvd.join()``)."""
        return self.count is not None and self.count < coll.size

    def end_step(self, coll):
        self.known(coll, wait=True)
        self.count = None


def step_metrics(plan, traffic, routes, precision):
    """What a frontend's last step did, as plain Python values for logs (docs/EXCHANGE.md, "Traffic")."""
    buckets = [{"name": b.header, "numel": b.numel, "reduction": r,
                "precision": "fp32" if r == ALLREDUCE else precision}
               for b, r in zip(plan.buckets, routes)]
    plain = [plan.tensors[i].shape for i in plan.plain]
    return {"sent": traffic.sent_bytes, "fp32": traffic.fp32_bytes, "ratio": traffic.ratio,
            "exchange_s": traffic.seconds, "reduction": routes[0] if routes else ALLREDUCE,
            "buckets": buckets,
            "uncompressed": {"tensors": len(plain),
                             "numel": sum(math.prod(s) for s in plain if s is not None)}}
