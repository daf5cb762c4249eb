"""Codecs as stock Horovod's ``compression=`` argument: an adapter over the bucket scheduler that reads
Horovod's context from the calling frame, hands Horovod placeholders, finds step boundaries (a gradient
seen again) and gives the state an owner (:func:`state_of`); ``hvd_quant.dispatch.STOCK_HOOKS``
(TensorFlow's graphs) may take over. docs/EXCHANGE.md, "Stock Horovod" and "The placeholder trick"."""
import collections
import functools
import sys
import threading
import weakref

from . import _codec
from . import plan as _plan
from .codecs import resolve_codec
from .dispatch import frontend_for, stock_hook_for
from .exchange import AVERAGE, SUM, Exchange, Memory, Traffic, handshake_record
from .scheduler import Presence, StepScheduler, step_metrics

__all__ = ["StockCompression", "state_of", "header", "uncompressed", "take_traffic"]


def _backend_for(tensor):
    backend = frontend_for(tensor)
    if backend is None or not hasattr(backend, "stock_backend"):
        raise TypeError(f"hvd_quant: no frontend for tensors of type {type(tensor)!r} "
                        "(hvd_quant.dispatch.register_frontend adds one)")
    _USED[backend] = True
    return backend


_USED = {}              # the frontends the stock path has served, in order


# A ctx Horovod hands back to ``decompress``: ``stock_decompress(summed)`` finishes the tensor.
_Ctx = collections.namedtuple("_Ctx", "stock_decompress")


def uncompressed(adapter, tensor, info):
    """``(tensor Horovod allreduces, ctx)`` of a tensor sent uncompressed (bfloat16: as float32)."""
    sendable = adapter.sendable(tensor)
    if sendable is tensor:
        return tensor, None         # decompress gives back what Horovod reduced
    return sendable, _Ctx(lambda summed: adapter.cast_back(summed, info))


def header(name, shape):
    """The payload header of tensor ``name``: the shape goes into it (not into the collective's name,
    which must match across ranks for a mismatch to be reported instead of stalling)."""
    return f"{name}[{'x'.join(map(str, shape))}]"


class _Session:
    """The exchanges of one backend and process set, one per reduction sharing one memory; ``exchange``
    serves what is not planned (SRA under ``"auto"``)."""

    def __init__(self, backend, process_set, config):
        self.coll, self.ops = backend.stock_backend(process_set)
        self.adapter, self.codec = backend.stock_adapter(), config.codec
        self.memory = Memory(self.ops) if config.error_feedback else None
        self.exchanges = {}
        self.exchange = self.exchange_for("sra" if config.reduction == _plan.AUTO else config.reduction)

    def exchange_for(self, reduction):
        ex = self.exchanges.get(reduction)
        if ex is None:
            ex = self.exchanges[reduction] = Exchange(self.codec, self.coll, self.ops,
                                                      reduction=reduction, memory=self.memory)
        return ex


# What ``compress`` learns from the Horovod function that called it: the tensor's ``name``, the
# ``process_set``, the optimizer (``owner``) and the parameter (``param``) where there are ones.
_Caller = collections.namedtuple("_Caller", "name process_set owner param", defaults=(None,) * 4)


def _frame_context(tensor):
    """The :class:`_Caller` of ``compress``, read from the Horovod frame that called it."""
    f = sys._getframe(1)
    while f is not None and f.f_globals.get("__name__", "").startswith("hvd_quant"):
        f = f.f_back
    for _ in range(4):
        if f is None:
            break
        loc = f.f_locals
        name = loc.get("name")
        if isinstance(name, str):
            owner = loc.get("self")
            ps = loc.get("process_set")
            if not hasattr(ps, "process_set_id"):
                ps = getattr(owner, "process_set", None)
                ps = ps if hasattr(ps, "process_set_id") else None
            names = getattr(owner, "_parameter_names", None)
            if not isinstance(names, dict):
                return _Caller(name, ps)
            group = loc.get("ps")
            if isinstance(group, (tuple, list)):
                # Horovod's grouped allreduce: one name for the group; find this tensor's parameter.
                for i, p in enumerate(group):
                    if getattr(p, "grad", None) is tensor:
                        return _Caller(names.get(p, f"{name}.{i}"), ps, owner, p)
                return _Caller(None, ps, owner)
            p = loc.get("p")
            return _Caller(name, ps, owner, p if p in names else None)
        f = f.f_back
    return _Caller()


class _Group:
    """One Horovod optimizer's gradients: its plan, where each parameter goes, its placeholders and
    the :class:`~hvd_quant.scheduler.StepScheduler` of its steps."""

    def __init__(self, sc, session, owner, backend, process_set):
        self.session, self.backend, self.process_set = session, backend, process_set
        names = owner._parameter_names
        todo = getattr(owner, "_requires_update", None) or set()
        params = [p for g in owner.param_groups for p in g["params"]
                  if p in todo or (not todo and p.requires_grad)]
        tensors = [_plan.Tensor(names.get(p, f"hvdq.param.{i}"), tuple(p.shape), p.is_floating_point())
                   for i, p in enumerate(params)]
        plan = self.plan = _plan.make_plan(sc.config, tensors, prefix="hvdq.stock")
        self.where = {params[m]: (k, i) for k, b in enumerate(plan.buckets) for i, m in enumerate(b.members)}
        self.index = {p: i for i, p in enumerate(params)}
        # taken over, the float32 gradients left uncompressed go into plain groups
        infos = [session.adapter.describe(q) for q in params]
        fused = _plan.plain_groups(plan, [x.is_float and x.itemsize == 4 for x in infos], sc.config.bucket_bytes)
        nb = len(plan.buckets)         # (plain group j is the scheduler's group nb + j)
        self.plain_where = {params[i]: (nb + j, m) for j, g in enumerate(fused) for m, i in enumerate(g)}
        self.device = getattr(params[0], "device", None) if params else None
        # Horovod's factor on the sum: 1/N for Average, 1 for Sum; its pre/post-scale split.
        op = getattr(owner, "op", None)
        average = op is None or not hasattr(backend, "core_op") or backend.core_op(op) != SUM
        f = getattr(owner, "gradient_predivide_factor", 1.0) if average else 1.0
        one = getattr(backend, "host_one", None)
        ps = session.coll.process_set
        # named by the gradients alone: ranks configured differently must still meet, in the handshake
        presence = (Presence(f"hvdq.stock.present.{_plan.digest([t.name for t in tensors])}", one)
                    if one is not None and getattr(ps, "process_set_id", 0) == 0 else None)
        wait = getattr(backend, "wait_for", None)   # auto's wait for the device (backends that have one)
        self.sched = StepScheduler(
            plan, [(f"hvdq.stock.plain.{_plan.bucket_header([tensors[i].name for i in g])}",
                    [infos[i].numel for i in g]) for g in fused],
            ops=session.ops, exchange_for=session.exchange_for, traffic=session.exchange.traffic,
            numbering=lambda b: sc.number(b.name, plan.record), split=session.adapter.split,
            average=average, plain_op=(AVERAGE if average else SUM, 1.0 / f, f), name="hvdq.stock",
            label="hvd_quant (compression=)", presence=presence,
            wait_device=None if wait is None else functools.partial(wait, self.device))
        self.sched.bind(session.coll)
        self.taken_over = False     # StockCompression._take_over replaced its _allreduce_grad_async
        self.direct = False         # taken over: this step's gradients go straight into their buckets
        self.stepped_direct = False  # the step under way went straight into its buckets
        self.seen = set()           # parameters whose gradient arrived in this step
        self.infos = {}             # parameter -> (dtype, layout, adapter.describe of its gradient)
        self.ones = {}              # (dtype, device) -> one placeholder slot per parameter

    def describe(self, param, tensor):
        """``adapter.describe(tensor)`` of ``param``'s gradient, made once per dtype and layout."""
        known = self.infos.get(param)
        if known is None or known[0] is not tensor.dtype or known[1] is not tensor.layout:
            known = self.infos[param] = (tensor.dtype, tensor.layout, self.session.adapter.describe(tensor))
        return known[2]

    def placeholder(self, param, tensor):
        """``param``'s placeholder (not read: the scheduler scales by the optimizer's op), a view of one
        buffer of ones per dtype and device, refilled at each step's start."""
        key = (tensor.dtype, tensor.device)
        ones = self.ones.get(key)
        if ones is None:
            ones = self.ones[key] = self.session.adapter.placeholder(tensor, len(self.index))
        i = self.index[param]
        return ones[i:i + 1]


def _key_str(key):
    return "/".join(map(str, key))


# What compress returns for a gradient a taken-over optimizer already handed over: (gradient, answer),
# per thread (autograd runs hooks on one thread per device); set only around Horovod's own call.
_DECIDED = threading.local()


def _compress(codec, tensor):
    """Horovod's ``compress`` of ``codec`` (a codec or a :class:`StockCompression`)."""
    decided = getattr(_DECIDED, "value", None)
    if decided is not None and decided[0] is tensor:
        return decided[1]
    caller, backend = _frame_context(tensor), _backend_for(tensor)
    sc = _owned_state(codec, caller, backend)
    hook = stock_hook_for(tensor)       # a framework's own path (TensorFlow: graphs)
    out = None if hook is None else hook(sc, tensor)
    return sc.compress_on(backend, tensor, caller) if out is None else out


_codec.STOCK_COMPRESS = _compress       # a codec's compress (hvd_quant._codec)


class StockCompression:
    """A codec for stock Horovod's ``compression=`` with other defaults (a Horovod optimizer given a
    codec keeps one of its own): ``StockCompression(hvd_quant.QSGD(bits=4), reduction="allgather")``.
    ``error_feedback`` defaults to ``codec.wants_error_feedback``; residuals: :meth:`state_dict`."""

    def __init__(self, codec, reduction="auto", min_compress_numel=1024, compress_1d=False,
                 error_feedback=None, bucket_bytes=_plan.BUCKET_BYTES):
        self.config = _plan.configure(resolve_codec(codec), reduction=reduction, bucket_bytes=bucket_bytes,
                                      min_compress_numel=min_compress_numel, compress_1d=compress_1d,
                                      warmup_steps=None, error_feedback=error_feedback, op=None,
                                      predivide=None)
        for arg in ("codec", "reduction", "error_feedback", "min_compress_numel", "compress_1d", "bucket_bytes"):
            setattr(self, arg, getattr(self.config, arg))       # the arguments, read back as attributes
        self._sessions = {}
        self._groups = {}       # id(optimizer) -> its _Group (dropped with the optimizer)
        self._pending = {}      # exchange name -> (session, Pending) of unfused tensors in flight
        self._unadvanced = []   # (exchange, Pending) of unfused tensors started, not yet advanced
        self._steps = {}        # exchange name -> how many exchanges of that name were started
        self._anon = 0          # fallback names: call order since nothing was pending
        self._restored = {}     # residuals loaded before their session existed
        self._restored_auto = {}    # reduction=auto states loaded before their optimizer's group
        self._graph_autos = {}      # plan key -> AutoChoice of a TensorFlow graph (_graph.GraphAuto)

    # -- configuration ----------------------------------------------------------------------------
    def record(self, name, shape):
        """The handshake record of the first exchange of tensor ``name``."""
        return handshake_record(self.config.summary(), (name, tuple(shape)))

    def number(self, name, record):
        """``(noise step, record)`` of the next exchange named ``name``; ``record`` None after the first."""
        step = self._steps.get(name)
        self._steps[name] = (step or 0) + 1
        return (0, record) if step is None else (step, None)

    def session(self, backend, process_set):
        """The :class:`_Session` of ``backend`` and ``process_set`` (made once, following its world)."""
        key = (backend, getattr(process_set, "process_set_id", 0))
        s = self._sessions.get(key)
        if s is None:
            s = self._sessions[key] = _Session(backend, process_set, self.config)
            saved = self._restored.pop(_key_str(key), None)
            if saved is not None and s.memory is not None:
                s.memory.load_state_dict(saved)
        else:
            self._follow_world(s, backend, process_set)
        return s

    def _follow_world(self, s, backend, process_set):
        """Rebind session ``s`` when the process set's rank or size changed (elastic); True then."""
        coll = backend.stock_backend(process_set)[0]
        if coll is s.coll:
            return False
        s.coll = coll
        for ex in s.exchanges.values():
            ex.coll = coll
        # another world: the ranks that joined start afresh (handshakes, step counts, auto), so all do
        self._steps.clear()
        for _, group in self._groups.values():
            if group.session is s:
                group.sched.bind(coll)      # the step before the change is not continued
        return True

    def compressible(self, info):
        """Whether a tensor (``info``: ``adapter.describe``'s) is compressed."""
        return self.config.compressible(info.shape, info.is_float)

    def _group_of(self, optimizer):
        entry = self._groups.get(id(optimizer))
        return None if entry is None or entry[0]() is not optimizer else entry[1]

    def step_metrics(self, optimizer):
        """:func:`hvd_quant.scheduler.step_metrics` of ``optimizer``'s last step, or None before it."""
        group = self._group_of(optimizer)
        return None if group is None else step_metrics(group.plan, take_traffic(self), list(group.sched.routes),
                                                       self.codec.spec())

    def reduction_in_use(self, optimizer):
        """How ``optimizer``'s next step's buckets travel (``"sra"``, ...), or None before its first gradient."""
        group = self._group_of(optimizer)
        return None if group is None else group.sched.route()

    # -- Horovod's Compressor protocol ------------------------------------------------------------
    compress = _compress
    decompress = _codec.Codec.decompress

    def compress_on(self, backend, tensor, caller=None):
        """``compress`` through ``backend`` (a frontend) with its hook skipped."""
        if caller is None:
            caller = _frame_context(tensor)
        if caller.param is not None:
            return self._member(self._group(backend, caller), caller.param, tensor)
        session = self.session(backend, caller.process_set)
        adapter = session.adapter
        info = adapter.describe(tensor)
        if not self.compressible(info):
            return self._uncompressed(session, tensor, info)
        name = caller.name
        if name is None:
            if not self._pending:
                self._anon = 0
            name = f"hvdq.anon.{self._anon}"
            self._anon += 1
        if name in self._pending:
            raise RuntimeError(f"hvd_quant: tensor {name!r} was compressed twice before its "
                               f"decompress; names must be unique among tensors in flight")
        step, record = self.number(name, self.record(name, info.shape))
        ex = session.exchange
        pending = ex.start(name, session.ops.flatten([tensor]), step=step, record=record,
                           header=header(name, info.shape))
        self._unadvanced.append((ex, pending))
        self._pending[name] = (session, pending)
        return adapter.placeholder(tensor), _Ctx(functools.partial(self._finish_alone, session, pending, info,
                                                                  ex.coll.size))

    def _member(self, group, param, tensor, direct=False):
        """``compress`` of ``param``'s gradient: ``(what Horovod allreduces, ctx)``, or ``direct``:
        ``(None, a callable giving the result)``."""
        self._arrived(group, param)
        session, sched = group.session, group.sched
        info = group.describe(param, tensor)
        where = group.where.get(param)
        if where is None or not self.compressible(info):
            where = group.plain_where.get(param) if direct else None    # (a plain group's, only direct)
        elif not direct and (sched.route() == _plan.ALLREDUCE or sched.absent()):
            where = None        # (the bucket's route: allreduce)
        if where is None:
            return self._uncompressed(session, tensor, info)
        sched.arrive(*where, tensor)
        finish = functools.partial(_finish, group, *where, info)
        return (None, finish) if direct else (group.placeholder(param, tensor), _Ctx(finish))

    @staticmethod
    def _uncompressed(session, tensor, info):
        out = uncompressed(session.adapter, tensor, info)
        itemsize = info.itemsize if out[0] is tensor else 4     # (else sent as a float32 copy)
        session.exchange.traffic.add_allreduce(info.numel * itemsize, info.numel, session.coll.size)
        return out

    def _arrived(self, group, param):
        """Note a gradient of ``group``; one seen before in this step ends it and begins the next."""
        repeat = param in group.seen
        if not repeat:
            group.seen.add(param)
            if len(group.seen) > 1:
                return
        group.seen = {param}
        sched = group.sched
        if not self._follow_world(group.session, group.backend, group.process_set):
            # a taken-over step ran the code of every later step: its routes count as run
            sched.end_step(timed=repeat, completed=group.stepped_direct)
        group.stepped_direct = group.direct
        for ones in group.ones.values():
            ones.fill_(1)
        sched.begin_step()

    def _group(self, backend, caller):
        """The :class:`_Group` of the Horovod optimizer that called (planned on its first gradient)."""
        owner = caller.owner
        group = self._group_of(owner)
        if group is not None:
            return group
        # Horovod's Adasum optimizer raises at the first gradient (op=hvd.Adasum: _Group's core_op);
        # Horovod copies its class's methods into a subclass of the user's optimizer, names and all
        method = getattr(type(owner), "_allreduce_grad_async", None)
        if getattr(method, "__qualname__", "").startswith("_DistributedAdasumOptimizer."):
            raise ValueError("hvd_quant: op=hvd.Adasum is not supported with an hvd_quant codec as "
                             "compression=: Adasum combines gradients pairwise with dot products, which "
                             "quantized payloads do not provide. Use op=hvd.Average or op=hvd.Sum.")
        group = _Group(self, self.session(backend, caller.process_set), owner, backend, caller.process_set)
        if group.sched.auto is not None:
            self._restore_auto(group.plan.key, group.sched.auto)
        self._groups[id(owner)] = (weakref.ref(owner), group)
        weakref.finalize(owner, self._groups.pop, id(owner), None)
        if caller.param is not None and getattr(owner, "_groups", None) is None:
            self._take_over(owner, group)
        return group

    def _take_over(self, owner, group):
        """Give ``owner`` an ``_allreduce_grad_async`` of hvd_quant's own: while ``group.direct``
        (:func:`_go_direct`; off for one step in a new world) a planned dense gradient goes straight into
        its bucket or plain group, its result a callable handle (docs/EXCHANGE.md, "Stock Horovod")."""
        horovod_async = owner._allreduce_grad_async
        always = not group.plan.buckets

        def allreduce_grad_async(p):
            if p not in group.index:
                return horovod_async(p)
            begins = not group.seen or p in group.seen      # this step's first gradient
            if begins and (group.direct or (always and group.seen)):
                group.direct = group.backend.stock_backend(group.process_set)[0] is group.session.coll
            if group.direct and p.grad is None:
                p.grad = p.data.new(p.size()).zero_()   # as Horovod: a gradient of zeros
            grad = p.grad
            if grad is not None and not grad.is_sparse:
                out, ctx = self._member(group, p, grad, direct=group.direct)
                if out is None:
                    return ctx, None
                _DECIDED.value = (grad, (out, ctx))     # what compress returns, no frame lookup
            try:
                return horovod_async(p)
            finally:
                _DECIDED.value = None

        owner._allreduce_grad_async = allreduce_grad_async
        group.taken_over = True

    def _finish_alone(self, session, pending, info, size, summed):
        """``decompress`` of a tensor exchanged alone (every such exchange started advanced first)."""
        started, self._unadvanced = self._unadvanced, []
        for exchange, started_one in started:
            exchange.advance(started_one)
        self._pending.pop(pending.name, None)
        flat = session.exchange.finish(pending)
        flat = session.ops.scale_(flat, session.adapter.as_float(summed) / size)
        return session.adapter.restore(flat, info)

    # -- state ------------------------------------------------------------------------------------
    def _traffics(self):
        return [ex.traffic for s in self._sessions.values() for ex in s.exchanges.values()]

    @property
    def traffic(self):
        """Bytes sent since the last :func:`take_traffic`, summed over sessions."""
        total = Traffic()
        for t in self._traffics():
            total.add(t)
        return total

    def state_dict(self):
        """``{"residuals": {session key: {name: tensor}}, "server_residuals": {session key:
        {(name, rank, size): tensor}}, "steps": {name: count}, "auto": {plan key: state}}``
        (residuals as in :class:`hvd_quant.exchange.Memory`, by exchange name)."""
        states = {**self._restored, **{_key_str(k): s.memory.state_dict()
                                       for k, s in self._sessions.items() if s.memory is not None}}
        auto = {**self._restored_auto, **{k: a.state_dict() for k, a in self._autos()}}
        return {"residuals": {k: dict(v.get(Memory.WORKER, {})) for k, v in states.items()},
                "server_residuals": {k: dict(v.get(Memory.SERVER, {})) for k, v in states.items()},
                "steps": dict(self._steps), "auto": auto}

    def adopt_auto(self, key, choice):
        """Keep a graph path's :class:`hvd_quant.scheduler.AutoChoice` of plan ``key`` in the state."""
        self._restore_auto(key, choice)
        self._graph_autos[key] = choice

    def _autos(self):
        """(plan key, AutoChoice) of each ``reduction="auto"`` schedule of this state."""
        groups = [(g.plan.key, g.sched.auto) for _, g in self._groups.values() if g.sched.auto is not None]
        return groups + list(self._graph_autos.items())

    def _restore_auto(self, key, choice):
        saved = self._restored_auto.pop(key, None)
        if saved is not None:
            choice.load_state_dict(saved)

    def load_state_dict(self, state):
        self._steps = dict(state.get("steps", {}))
        self._restored_auto = dict(state.get("auto", {}))
        for k, a in self._autos():
            self._restore_auto(k, a)
        server = state.get("server_residuals", {})
        self._restored = {k: {Memory.WORKER: v, Memory.SERVER: server.get(k, {})}
                          for k, v in state.get("residuals", {}).items()}
        for k, s in self._sessions.items():
            if s.memory is not None:
                s.memory.load_state_dict(self._restored.pop(_key_str(k), {}))


def _go_direct(group):
    """At a taken-over optimizer's first bucket result in this world (every rank reaches it, nothing
    waited for): start the complete buckets, make the payload channel (a collective, used from the next
    step: no bucket of this step goes two ways), and hand later steps' gradients straight to buckets."""
    sched = group.sched
    sched.start_complete(wait=True)
    make = getattr(group.backend, "payload_group", None)
    coll = group.session.coll
    if make is not None and group.device is not None and not sched.absent():
        sched.next_channel = (coll, make(coll.process_set, group.device, f"hvdq.stock.{group.plan.key}",
                                         group.plan.record, "hvd.DistributedOptimizer(compression=...)"))
    group.direct = True


def _finish(group, k, i, info, summed=None):
    """Member ``i``'s piece of the scheduler's group ``k``, in its dtype and shape (``summed`` not read)."""
    sched = group.sched
    if k < sched.nb and group.taken_over and not group.direct:
        _go_direct(group)
    pieces = sched.result(k)
    sched.take(k)
    return group.session.adapter.restore(pieces[i], info)


# -- who owns a codec's stock state -----------------------------------------------------------------
_STATE_ATTR = "_hvd_quant_stock"


def _owned_state(codec, caller, backend):
    """``codec``'s :class:`StockCompression`: itself, the calling optimizer's, else the process set's."""
    if isinstance(codec, StockCompression):
        return codec
    if caller.owner is not None:
        sc = vars(caller.owner).get(_STATE_ATTR)
        if sc is None or sc.codec is not codec:
            sc = StockCompression(codec)
            setattr(caller.owner, _STATE_ATTR, sc)
        return sc
    ps = caller.process_set
    if ps is None:
        ps = backend.stock_backend(None)[0].process_set
    states = vars(ps).setdefault(_STATE_ATTR, {})
    if codec not in states:
        states[codec] = StockCompression(codec)
    return states[codec]


def state_of(obj):
    """The :class:`StockCompression` behind ``obj``: itself, or the one a Horovod optimizer holds
    (its ``compression=`` a codec, after its first gradient; or a StockCompression); else None."""
    if isinstance(obj, StockCompression):
        return obj
    sc = getattr(obj, "__dict__", {}).get(_STATE_ATTR)
    if sc is None and isinstance(getattr(obj, "_compression", None), StockCompression):
        sc = obj._compression
    return sc


def take_traffic(obj):
    """:class:`~hvd_quant.exchange.Traffic` since the last call of ``obj``'s stock state (:func:`state_of`;
    of a codec, its states on each framework's global process set)."""
    states = [state_of(obj)]
    if states[0] is None:
        codec = getattr(obj, "_compression", obj)
        states = []
        for backend in list(_USED) if hasattr(codec, "spec") else ():
            ps = backend.stock_backend(None)[0].process_set
            sc = getattr(ps, "__dict__", {}).get(_STATE_ATTR, {}).get(codec)
            if sc is not None and all(sc is not s for s in states):
                states.append(sc)
    total = Traffic()
    for t in (t for s in states for t in s._traffics()):
        total.add(t)
        t.reset()
    return total
