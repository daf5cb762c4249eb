"""The step of a compressed gradient reduction, written once (no framework here).

A :class:`StepScheduler` runs the buckets and plain groups of one :class:`hvd_quant.plan.Plan` through
each step; ``hvd_quant.torch.DistributedOptimizer`` and the stock ``compression=`` path drive it:

1. :meth:`~StepScheduler.bind` follows the process set's world (elastic): another world drops the
   step under way, forgets which routes ran and measures ``reduction="auto"`` again.
2. :meth:`~StepScheduler.begin_step`, at a step's first gradient: the step's route (``reduction``,
   or :class:`AutoChoice`'s current candidate) and, when the buckets take a compressed exchange, the
   presence count of ``hvd.join()`` (:class:`Presence`) started.
3. :meth:`~StepScheduler.arrive` / :meth:`~StepScheduler.arrive_plain`: a gradient is kept in its
   bucket or plain group; the last one to arrive starts the bucket's exchange
   (:class:`hvd_quant.exchange.Exchange`) or the group's allreduce. Buckets start once the presence
   count is known (a joined rank takes part in allreduces only: the buckets then go through one Sum
   allreduce each) and, where their payloads travel on a payload channel (collectives matched by
   order), in plan order.
4. :meth:`~StepScheduler.result` (one bucket), :meth:`~StepScheduler.finish_started` (every started
   bucket) and :meth:`~StepScheduler.plain_result`: start what is still missing (zeros for gradients
   that never arrived), advance every started exchange before waiting on any (the overlap rule),
   finish, scale (1/N for Average) and split the flat result into its members' pieces.
5. :meth:`~StepScheduler.end_step`: note the routes that completed a step in this world (a payload
   channel carries a route from its second step on) and time the step for ``reduction="auto"``,
   whose choice is allgathered, the same on every rank, and printed once by rank 0.

Also here: :class:`AutoChoice`, :class:`Presence`, :func:`in_plan_order` and :func:`step_metrics`.
"""
import math
import statistics
import struct
import time

from .exchange import SUM, TWO_LEVEL
from .plan import ALLREDUCE, AUTO

__all__ = ["StepScheduler", "AutoChoice", "Presence", "in_plan_order", "step_metrics"]


def in_plan_order(complete, next_start):
    """Buckets that start in plan order (a payload channel matches collectives by order): of the
    ``complete`` bucket indices, the run starting at ``next_start`` starts now and the rest wait.
    Returns ``(start, waiting, next_start)``."""
    waiting, start = sorted(complete), []
    while waiting and waiting[0] == next_start:
        start.append(waiting.pop(0))
        next_start += 1
    return start, waiting, next_start


class StepScheduler:
    """One plan's buckets and plain groups through each step (module doc).

    ``plan``: the static :class:`hvd_quant.plan.Plan`; ``plain``: ``(collective name, member numels)``
    of each plain group (float32 gradients sent uncompressed, one allreduce of the group flattened);
    ``ops``: the framework's :class:`~hvd_quant.exchange.ArrayOps`; ``exchange_for(route)``: the
    :class:`~hvd_quant.exchange.Exchange` of a route; ``traffic``: the
    :class:`~hvd_quant.exchange.Traffic` the allreduces are counted in; ``numbering(bucket)``:
    ``(step, record)`` of the bucket's next exchange (its noise step, and the handshake record its
    first exchange carries, or None); ``split(flat, numels)``: a flat result as its members' pieces;
    ``average``: results are scaled by 1/N (Sum: 1); ``plain_op``: ``(op, prescale, postscale)`` of
    the plain groups' allreduces; ``name``: prefix of the scheduler's own collectives; ``label``: how
    ``reduction="auto"``'s decision is printed; ``presence``: a :class:`Presence` (None: no
    ``hvd.join()`` to follow); ``wait_device``: waits for the device's queued work (auto's timing).
    """

    def __init__(self, plan, plain, *, ops, exchange_for, traffic, numbering, split, average=True,
                 plain_op=(SUM, 1.0, 1.0), name="hvdq", label="hvd_quant", presence=None,
                 wait_device=None):
        self.plan, self.buckets = plan, plan.buckets
        self.plain_names = [n for n, _ in plain]
        self.plain_sizes = [list(s) for _, s in plain]
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
        self.routes = [ALLREDUCE] * len(self.buckets)   # how each bucket travelled this step
        self.clear_step()

    def clear_step(self):
        """No step in progress (at creation, in a new world, after a restored state)."""
        n, m = len(self.buckets), len(self.plain_sizes)
        self.grads = [[None] * len(b.members) for b in self.buckets]
        self.arrived = [0] * n
        self.complete = []              # complete buckets waiting for the presence count
        self.next_start = 0             # with a payload channel: the next bucket to start
        self.pending = [None] * n       # (exchange or None for an allreduce, Pending or handle)
        self.unadvanced = []            # started exchanges not yet advanced
        self.pieces = [None] * n        # a finished bucket's pieces until handed out
        self.left = [0] * n             # members still to be handed out
        self.ran = set()                # routes of the buckets finished this step
        self.plain_grads = [[None] * len(s) for s in self.plain_sizes]
        self.plain_arrived = [0] * m
        self.plain_pending = [None] * m
        self.plain_pieces = [None] * m
        self.plain_left = [0] * m
        self.like = None                # a gradient of this step (zeros for members not reached)
        if self.presence is not None:
            self.presence.reset()

    # -- world and route ------------------------------------------------------------------------
    def bind(self, coll):
        """Step 1: run on ``coll``, the process set's Collectives; True when it is another world."""
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
        """What carries this step's payloads on ``route``: the payload channel of this world from the
        route's second step on, else None (Horovod's collectives; always for ``"allreduce"``)."""
        if route == ALLREDUCE or route not in self.routes_run:
            return None
        coll, carrier = self.channel
        return carrier if coll is self.coll else None

    # -- the step -------------------------------------------------------------------------------
    def begin_step(self, compress=True):
        """Step 2, and the payload channel made in the step before taken up. ``compress``: the driver
        allows a compressed exchange (after warm-up). Returns whether the buckets take one."""
        self.next_start = 0
        self.routes = [ALLREDUCE] * len(self.buckets)
        if self.next_channel is not None:
            self.channel, self.next_channel = self.next_channel, None
        compressing = bool(compress and self.buckets) and self.route() != ALLREDUCE
        if self.presence is not None:
            self.presence.end_step(self.coll)
            if compressing and self.coll.size > 1:
                self.presence.start(self.coll)
        return compressing

    def end_step(self, timed=True, completed=True):
        """Step 5. ``completed``: the finished routes count as run; ``timed``: the step counts for
        ``reduction="auto"`` (not in warm-up; never while a rank is inside ``hvd.join()``)."""
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
        """Step 3: member ``i`` of bucket ``k`` arrived; start the complete buckets that may start."""
        grads = self.grads[k]
        _keep(grads, i, grad, self.buckets[k].names[i])
        self.like = grad
        self.arrived[k] += 1
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

    def _start(self, k, route, channel):
        """Start bucket ``k`` (zeros for members that never arrived, as Horovod allreduces zeros for
        a parameter without a gradient; one Sum allreduce while a rank is inside ``hvd.join()``)."""
        b, grads = self.buckets[k], self.grads[k]
        flat = self._flat(grads, b.numels, self.like)
        if self.absent():
            route = ALLREDUCE
        self.routes[k] = route
        if route == ALLREDUCE:
            self.traffic.add_allreduce(4 * b.numel, b.numel, self.coll.size)
            self.pending[k] = None, self.coll.allreduce_async(flat, f"{b.name}.sum", SUM)
        else:
            ex = self.exchange_for(route)
            step, record = self.numbering(b)
            self.pending[k] = ex, ex.start(b.name, flat, step=step, record=record, header=b.header,
                                           channel=channel)
            self.unadvanced.append(k)
            ex.advance_ready([self.pending[j][1] for j in self.unadvanced
                              if self.pending[j][0] is ex])     # done alltoalls: phase two
        self.left[k] = sum(g is not None for g in grads)
        self.grads[k] = [None] * len(grads)
        self.arrived[k] = 0

    def _flat(self, grads, numels, like):
        """One flat float32 buffer of ``grads`` (zeros for those that never arrived)."""
        zeros = self.ops.zeros
        return self.ops.flatten([g if g is not None else zeros(n, like) for g, n in zip(grads, numels)])

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
        self.ran.add(self.routes[k])
        factor = 1.0 / self.coll.size if self.average else 1.0
        if factor != 1.0:
            flat = self.ops.scale_(flat, factor)
        return self.split(flat, self.buckets[k].numels)

    def result(self, k):
        """Step 4 for bucket ``k``: its members' pieces, kept until :meth:`take` took each."""
        pieces = self.pieces[k]
        if pieces is None:
            if self.pending[k] is None:
                self.start_complete(wait=True)
            if self.pending[k] is None:
                self._start_through(k)
            self._advance_all()
            pieces = self.pieces[k] = self._finish(k)
        return pieces

    def take(self, k, n=1):
        """``n`` members of bucket ``k`` have their pieces; the pieces go once every one has."""
        self.left[k] -= n
        if self.left[k] <= 0:
            self.pieces[k] = None

    def finish_started(self):
        """Step 4 for every bucket: ``[(k, pieces)]`` of each started this step."""
        self.start_complete(wait=True)
        started = [k for k, p in enumerate(self.pending) if p is not None]
        self._advance_all()
        return [(k, self._finish(k)) for k in started]

    # -- plain groups ---------------------------------------------------------------------------
    def arrive_plain(self, j, i, grad):
        """Step 3 for plain group ``j``: the last member to arrive starts its allreduce."""
        grads = self.plain_grads[j]
        _keep(grads, i, grad, f"{self.plain_names[j]}[{i}]")
        self.plain_arrived[j] += 1
        if self.plain_arrived[j] == len(grads):
            self._start_plain(j)

    def _start_plain(self, j):
        grads, sizes = self.plain_grads[j], self.plain_sizes[j]
        flat = self._flat(grads, sizes, next(g for g in grads if g is not None))
        n = sum(sizes)
        self.traffic.add_allreduce(4 * n, n, self.coll.size)
        op, pre, post = self.plain_op
        self.plain_pending[j] = self.coll.allreduce_async(flat, self.plain_names[j], op, pre, post)
        self.plain_left[j] = sum(g is not None for g in grads)
        self.plain_grads[j] = [None] * len(grads)
        self.plain_arrived[j] = 0

    def plain_result(self, j):
        """Step 4 for plain group ``j``. The complete buckets start and the started ones finish
        first (a payload channel then queues their second phases without waiting)."""
        pieces = self.plain_pieces[j]
        if pieces is None:
            if self.complete:
                self.start_complete(wait=True)
            self._advance_all()
            for k, pending in enumerate(self.pending):
                if pending is not None and self.left[k]:
                    self.pieces[k] = self._finish(k)
            if self.plain_pending[j] is None:       # a member never arrived on this rank
                self._start_plain(j)
            flat = self.coll.synchronize(self.plain_pending[j])
            pieces = self.plain_pieces[j] = self.split(flat, self.plain_sizes[j])
            self.plain_pending[j] = None
        return pieces

    def take_plain(self, j, n=1):
        """As :meth:`take`, for plain group ``j``."""
        self.plain_left[j] -= n
        if self.plain_left[j] <= 0:
            self.plain_pieces[j] = None

    def plain_started(self):
        """Indices of the plain groups whose allreduce is in flight."""
        return [j for j, h in enumerate(self.plain_pending) if h is not None]


def _keep(grads, i, grad, name):
    if grads[i] is not None:
        raise RuntimeError(f"hvd_quant: gradient {name!r} arrived twice before its result "
                           f"(backward run twice without a step?)")
    grads[i] = grad


class AutoChoice:
    """``reduction="auto"``: which way a plan's compressed buckets travel, from measured step times.

    The first steps follow a fixed schedule, the same on every rank: each candidate once to warm up
    (plans, kernel compilation; not timed), then each candidate ``trials`` times, interleaved. A step's
    time is the time from the end of the previous step to the end of this one (:meth:`end_step`, which
    on CUDA first waits for the device), so it includes everything the reduction costs the step,
    overlap included. Then every rank allgathers its median per candidate (:meth:`decide`, blocking,
    once), and all take the candidate with the lowest mean over ranks, but a compressed way only where
    it measured at least ``margin`` (10%) faster than Horovod's allreduce: step times on a busy host
    vary by several percent (docs/EXCHANGE.md), so medians of five can put a way that is slower in the
    steady state a few percent ahead. Ties go to the earlier candidate, Horovod's allreduce first. The
    choice holds for every bucket of the plan until :meth:`reset` (the world size changed).
    ``candidates``: :data:`CANDIDATES`, and ``"two_level"`` last where the ranks sit on several nodes
    of several ranks each (:meth:`candidates_for`); the warm-up runs them in reverse order.
    """
    CANDIDATES = (ALLREDUCE, "allgather", "sra")

    def __init__(self, trials=5, clock=time.perf_counter, margin=0.1, candidates=CANDIDATES):
        self.trials, self.clock, self.margin = int(trials), clock, float(margin)
        self.reset(candidates)

    @classmethod
    def candidates_for(cls, coll):
        """:data:`CANDIDATES`, with ``"two_level"`` where ``coll`` offers two levels of several ranks
        each (``Collectives.levels(probe=True)``: the same answer on every rank)."""
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
        """Record the end of a step. True when the schedule is over and :meth:`decide` is due.

        ``wait``, called first while steps are timed, waits for the device's queued work (CUDA):
        without it a way whose collectives leave the host free (a payload channel) is timed by its
        launches, and the host running steps ahead of the GPU charges its work to the next
        candidate."""
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
        """Allgather every rank's medians (seconds, float64) and take the same choice on every rank."""
        record = self.record()
        if coll.size > 1:
            record = ops.to_bytes(coll.synchronize(coll.allgather_async(ops.from_bytes(record), name)))
        return self.choose(record)

    def record(self):
        """This rank's median step time per candidate (float64 seconds), as bytes to allgather."""
        return struct.pack(f"<{len(self.candidates)}d",
                           *[statistics.median(self.times[c]) for c in self.candidates])

    def choose(self, gathered):
        """Take the choice from every rank's :meth:`record`, concatenated (the same on every rank)."""
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
    """Which ranks step this time, for Horovod's ``hvd.join()``.

    A rank inside ``hvd.join()`` takes part in allreduces only (it contributes zeros); an alltoall or
    allgather started while a rank has joined fails in Horovod 0.28.1, or crashes it. So in every step
    that would exchange compressed buckets, each stepping rank adds 1 to a one-element Sum allreduce
    (:meth:`start`, at its first gradient) and no compressed exchange starts before its result is
    known (:meth:`known`). When it is less than the world size, some rank has joined, and this
    step's buckets go through Horovod's allreduce instead (``absent``), as Horovod's own optimizer
    does under ``hvd.join()``. ``one`` makes the host tensor holding 1 (a host tensor, so reading the
    count never waits on a device stream).
    """

    def __init__(self, name, one):
        self.name, self.one = name, one
        self.reset()

    def reset(self):
        """No count in flight or known (a new world: the old one's allreduce is not waited for)."""
        self.handle = None
        self.count = None

    def start(self, coll):
        self.handle = coll.allreduce_async(self.one(), self.name, SUM)
        self.count = None

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
    """What a frontend's last step did, as plain Python values (``step_metrics()`` of the frontends,
    for logs and TensorBoard): ``sent`` bytes this rank sent and ``fp32`` what an fp32 ring allreduce
    of the same gradients would have sent, their ``ratio``, ``exchange_s`` (seconds from the first
    gradient handed to the exchange to the last result; None where not measured), ``reduction`` (how
    the compressed buckets travelled), ``buckets`` (per bucket: ``name``, ``numel``, ``reduction``,
    ``precision``: the codec's spec, or ``"fp32"`` when it went through Horovod's allreduce) and
    ``uncompressed`` (the tensors Horovod allreduced as they are: ``tensors``, ``numel``)."""
    buckets = [{"name": b.header, "numel": b.numel, "reduction": r,
                "precision": "fp32" if r == ALLREDUCE else precision}
               for b, r in zip(plan.buckets, routes)]
    plain = [plan.tensors[i].shape for i in plan.plain]
    return {"sent": traffic.sent_bytes, "fp32": traffic.fp32_bytes, "ratio": traffic.ratio,
            "exchange_s": traffic.seconds, "reduction": routes[0] if routes else ALLREDUCE,
            "buckets": buckets,
            "uncompressed": {"tensors": len(plain),
                             "numel": sum(math.prod(s) for s in plain if s is not None)}}
