"""Codecs as stock Horovod's ``compression=`` argument.

Horovod's optimizers call ``compress(grad) -> (t, ctx)``, **sum** ``t`` across ranks with allreduce
(applying ``op``, ``prescale_factor`` and ``postscale_factor``), then ``decompress(summed_t, ctx)``.
Summing quantized codes is wrong (DESIGN.md), so here:

1. ``compress`` starts hvd_quant's own exchange for the tensor (:class:`hvd_quant.exchange.Exchange`,
   asynchronous, named after the tensor) and hands Horovod a 1-element placeholder holding 1.0;
2. Horovod allreduces the placeholders: the result is exactly the factor Horovod would have applied to
   (sum of gradients) * N -- 1 for Average, N for Sum, times the pre/post-scale factors;
3. ``decompress`` finishes the exchange and returns ``decoded_sum * (placeholder / N)``, computed on
   the device (no host synchronisation), cast back to the gradient's dtype and shape.

Fusion. When ``compress`` is called by a Horovod optimizer (PyTorch: the frame of its
``_allreduce_grad_async`` / ``_grouped_allreduce_grad_async`` holds ``self`` and the parameter), the
optimizer's gradients are planned once with :func:`hvd_quant.plan.make_plan`, exactly as
``hvd_quant.torch.DistributedOptimizer`` plans them: buckets of at most ``bucket_bytes`` of float32 in
reverse parameter order. ``compress`` then only records the gradient; the bucket's exchange starts when
its last member arrives, and ``decompress`` returns views of the bucket's result scaled by the factor
of the optimizer's ``op`` (1/N for Average, 1 for Sum; one scaling launch per bucket; the placeholder
Horovod still allreduces is not read). The optimizer's ``_allreduce_grad_async`` (not the grouped
one) is taken over at its first gradient (:meth:`StockCompression._take_over`). From its second step
its gradients go straight into their buckets, and the float32 ones left uncompressed into plain groups
(one Horovod allreduce each), as in hvd_quant's optimizer; Horovod's ``synchronize`` gets each result
from a callable handle, as for Horovod's own sparse path: no Horovod op and no frame lookup per tensor.
On CUDA the compressed payloads then travel on a payload group of the plan's own (the torch
frontend's ``PayloadGroup``), once a route has run one such step. Without such an owner
(``hvd.allreduce(t, compression=...)``, TensorFlow) each tensor is its own exchange, as in 1-3 above.

Tensors with fewer than ``min_compress_numel`` elements, 1-D tensors (unless ``compress_1d``) and
non-floating tensors are returned as they are, with a passthrough context, and Horovod allreduces them.
``op=hvd.Adasum`` raises (Adasum needs dot products of full gradients, which codes do not give).

Names. ``compress`` is not told the tensor's name. It takes it from the calling frame: Horovod 0.28.1's
``_allreduce_grad_async`` (torch) and ``allreduce`` (TensorFlow, torch) hold a ``name`` local; in the
grouped path the parameter's own name is found through ``self._parameter_names``. When no name is found
it falls back to the call order within the step. The name and shape go into every payload header, so
a rank that receives another tensor's payload raises instead of mixing data; exchanges are matched
across ranks by name, so ranks may call hooks in different orders. The first exchange of each name
carries a configuration handshake (codec spec, reduction, size thresholds, shape).

Frameworks. ``compress`` dispatches on the tensor's type to its frontend (``hvd_quant.dispatch``;
:class:`hvd_quant.frontend.Frontend`), which provides ``stock_backend(process_set)`` ->
``(Collectives, ArrayOps)`` and ``stock_adapter()`` -> an object with ``describe(t)``,
``placeholder(t)``, ``split(flat, sizes)``, ``restore(flat, info)``, ``as_float(t)``, ``sendable(t)``
and ``cast_back(t, info)``. Optionally
``stock_compress(stock_compression, tensor)``: return ``(tensor, ctx)`` to take over ``compress`` or
None to let the generic path run; a ctx with a ``stock_decompress(summed)`` method then finishes in
``decompress``. TensorFlow's hook
(``hvd_quant/tensorflow/_graph.py``) builds symbolic tensors' exchanges into the graph with the public
methods here and hands eager ones to :meth:`StockCompression.compress_on`. The configuration is a
:class:`hvd_quant.plan.Config`, as in the frontends' optimizers.
"""
import functools
import sys
import threading
import weakref

from . import plan as _plan
from .dispatch import frontend_for
from .exchange import SUM as _SUM, Exchange, Traffic, handshake_record
from .memory import Memory

__all__ = ["StockCompression", "compress", "decompress", "stock_compression", "header", "uncompressed",
           "take_traffic", "PASSTHROUGH"]

def _backend_for(tensor):
    backend = frontend_for(tensor)
    if backend is None or not hasattr(backend, "stock_backend"):
        raise TypeError(f"hvd_quant: no frontend for tensors of type {type(tensor)!r} "
                        "(hvd_quant.dispatch.register_frontend adds one)")
    return backend


class _Passthrough:
    """ctx of a tensor Horovod allreduces itself."""
    __slots__ = ()


PASSTHROUGH = _Passthrough()


class _Cast:
    """ctx of a tensor sent uncompressed in float32 because Horovod cannot reduce its dtype."""
    __slots__ = ("adapter", "info")

    def __init__(self, adapter, info):
        self.adapter, self.info = adapter, info


def uncompressed(adapter, tensor, info):
    """``(tensor Horovod allreduces, ctx)`` for a tensor sent uncompressed: itself, or a float32 copy
    where Horovod cannot reduce its dtype (bfloat16), cast back in ``decompress``."""
    sendable = adapter.sendable(tensor)
    if sendable is tensor:
        return tensor, PASSTHROUGH
    return sendable, _Cast(adapter, info)


def header(name, shape):
    """The payload header of tensor ``name``: the shape goes into it (not into the collective's name,
    which must match across ranks for a mismatch to be reported instead of stalling)."""
    return f"{name}[{'x'.join(map(str, shape))}]"


class _Ctx:
    __slots__ = ("session", "pending", "info", "size")

    def __init__(self, session, pending, info, size):
        self.session, self.pending, self.info, self.size = session, pending, info, size


class _Session:
    """The exchanges (one per reduction in use, sharing one error-feedback memory) of one framework
    backend and process set. ``exchange`` is the configured reduction's; with ``"auto"``, SRA's for
    what is not planned (unfused tensors, TensorFlow's stock path)."""

    def __init__(self, backend, process_set, codec, reduction, error_feedback):
        coll, ops = backend.stock_backend(process_set)
        self.adapter = backend.stock_adapter()
        self.ops, self.codec, self.coll = ops, codec, coll
        self.memory = Memory(ops) if error_feedback else None
        self.exchanges = {}
        self.exchange = self.exchange_for("sra" if reduction == _plan.AUTO else reduction)

    def exchange_for(self, reduction):
        ex = self.exchanges.get(reduction)
        if ex is None:
            ex = self.exchanges[reduction] = Exchange(self.codec, self.coll, self.ops,
                                                      reduction=reduction, memory=self.memory)
        return ex

    def rebind(self, coll):
        self.coll = coll
        for ex in self.exchanges.values():
            ex.coll = coll


class _Caller:
    """What ``compress`` learns from the Horovod function that called it: the tensor's ``name``, the
    ``process_set``, the optimizer (``owner``) and the parameter (``param``) where there are ones."""
    __slots__ = ("name", "process_set", "owner", "param")

    def __init__(self, name=None, process_set=None, owner=None, param=None):
        self.name, self.process_set, self.owner, self.param = name, process_set, owner, param


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


def _refuse_adasum(backend, owner):
    """Adasum combines gradients pairwise with dot products, which quantized payloads do not give:
    Horovod's Adasum optimizer, or ``op=hvd.Adasum``, raises on every rank at the first gradient."""
    # Horovod copies its class's methods into a subclass of the user's optimizer; their names stay
    method = getattr(type(owner), "_allreduce_grad_async", None)
    if getattr(method, "__qualname__", "").startswith("_DistributedAdasumOptimizer."):
        raise ValueError("hvd_quant: op=hvd.Adasum is not supported with an hvd_quant codec as "
                         "compression=: Adasum combines gradients pairwise with dot products, which "
                         "quantized payloads do not provide. Use op=hvd.Average or op=hvd.Sum.")
    op = getattr(owner, "op", None)
    if op is not None and hasattr(backend, "core_op"):
        backend.core_op(op)


class _Slot:
    """ctx of a tensor fused into a bucket of a :class:`_Group`: member ``i`` of bucket ``k``,
    exchanged by ``route`` ("sra" or "allgather")."""
    __slots__ = ("group", "k", "i", "info", "route")

    def __init__(self, group, k, i, info, route):
        self.group, self.k, self.i, self.info, self.route = group, k, i, info, route


class _Group:
    """The buckets of one Horovod optimizer's gradients (:func:`hvd_quant.plan.make_plan`), made at its
    first ``compress``, and each bucket's state in the current step: the gradients recorded so far,
    the exchange once started, the scaled result once finished, and the members not yet returned."""

    def __init__(self, sc, session, owner, backend, process_set):
        self.backend, self.process_set = backend, process_set
        names = owner._parameter_names
        todo = getattr(owner, "_requires_update", None) or set()
        params = [p for g in owner.param_groups for p in g["params"]
                  if p in todo or (not todo and p.requires_grad)]
        tensors = [_plan.Tensor(names.get(p, f"hvdq.param.{i}"), tuple(p.shape), p.is_floating_point())
                   for i, p in enumerate(params)]
        self.plan = _plan.make_plan(sc.config, tensors, prefix="hvdq.stock")
        self.session = session
        self.where = {params[m]: (k, i) for k, b in enumerate(self.plan.buckets)
                      for i, m in enumerate(b.members)}
        self.index = {p: i for i, p in enumerate(params)}
        # Taken over (StockCompression._take_over), the float32 gradients left uncompressed are fused
        # as in hvd_quant's optimizer: plain groups in reverse order, one Horovod allreduce each.
        float32 = [session.adapter.describe(q) for q in params]
        plain = [i for i in self.plan.plain if float32[i].is_float and float32[i].itemsize == 4]
        numels = [info.numel for info in float32]
        fused = _plan.fuse(list(reversed(plain)), numels, sc.config.bucket_bytes)
        self.plain_names = [f"hvdq.stock.plain.{_plan.bucket_header([tensors[i].name for i in g])}"
                            for g in fused]
        self.plain_sizes = [[numels[i] for i in g] for g in fused]
        self.plain_where = {params[i]: (j, m) for j, g in enumerate(fused) for m, i in enumerate(g)}
        self.plain = fused
        self.taken_over = False     # StockCompression._take_over replaced its _allreduce_grad_async
        self.direct = False         # taken over: this step's gradients go straight into their buckets
        self.device = getattr(params[0], "device", None) if params else None
        self.channel = (None, None)  # (collectives, what carries the payloads) in this world
        self.next_channel = None     # made in this step, used from the next (_go_direct)
        # Horovod's factor on the sum (module doc): 1/N for Average; Sum: 1. Its pre/post-scale split.
        op = getattr(owner, "op", None)
        self.average = op is None or not hasattr(backend, "core_op") or backend.core_op(op) != _SUM
        f = getattr(owner, "gradient_predivide_factor", 1.0) if self.average else 1.0
        self.scale_split = (1.0 / f, f)
        self.routes = [_plan.ALLREDUCE] * len(self.plan.buckets)  # how each bucket last travelled
        one = getattr(backend, "host_one", None)
        ps = session.coll.process_set
        # named by the gradients alone: ranks configured differently must still meet, in the handshake
        self.presence = (_plan.Presence(f"hvdq.stock.present.{_plan.digest([t.name for t in tensors])}",
                                        one)
                         if one is not None and getattr(ps, "process_set_id", 0) == 0 else None)
        self.auto = _plan.AutoChoice() if sc.reduction == _plan.AUTO else None
        wait = getattr(backend, "wait_for", None)   # auto's wait for the device (backends that have one)
        self.wait_device = None if wait is None else functools.partial(wait, self.device)
        self.key = self.plan.key                   # names this plan in state_dict()["auto"]
        self.infos = {}                # parameter -> (dtype, layout, adapter.describe of its gradient)
        self.ones = {}                 # (dtype, device) -> one placeholder slot per parameter
        self.new_step()

    def new_step(self):
        """Start with no step in progress (at creation, or when the world's change cut one short)."""
        n = len(self.plan.buckets)
        self.grads = [[None] * len(b.members) for b in self.plan.buckets]
        self.arrived = [0] * n
        self.left = [0] * n            # members still to be returned by decompress
        self.pending = [None] * n      # (exchange, Pending) once started
        self.result = [None] * n
        self.seen = set()              # parameters whose gradient arrived in this step
        self.plain_grads = [[None] * len(g) for g in self.plain]
        self.plain_arrived = [0] * len(self.plain)
        self.plain_pending = [None] * len(self.plain)   # Horovod's handle once started
        self.plain_result = [None] * len(self.plain)
        self.plain_left = [0] * len(self.plain)
        self.complete = []             # complete buckets waiting for this step's presence count
        self.next_start = 0            # with a payload channel: the next bucket to start, plan order
        self.stepped_direct = False    # whether the step under way went straight into the buckets
        self.routes_run = set()        # routes that completed a direct step in this world (joining
                                       # ranks' processes ran none)
        self.like = None               # a gradient of this step (zeros for buckets none reached)
        if self.presence is not None:
            self.presence.reset()

    def describe(self, param, tensor):
        """``adapter.describe(tensor)`` of ``param``'s gradient, made once per dtype and layout."""
        known = self.infos.get(param)
        if known is None or known[0] is not tensor.dtype or known[1] is not tensor.layout:
            info = self.session.adapter.describe(tensor)
            known = self.infos[param] = (tensor.dtype, tensor.layout, info)
        return known[2]

    def placeholder(self, param, tensor):
        """``param``'s placeholder where Horovod still allreduces one (its grouped path; a taken-over
        optimizer's first step): a view of one buffer per dtype and device, refilled with ones at
        each step's first gradient, instead of a new tensor per gradient. Its value is not read: the
        bucket's factor comes from the optimizer's op (:meth:`factor`)."""
        key = (tensor.dtype, tensor.device)
        ones = self.ones.get(key)
        if ones is None:
            ones = self.ones[key] = self.session.adapter.placeholder(tensor, len(self.index))
        i = self.index[param]
        return ones[i:i + 1]

    def route(self):
        """How this step's buckets travel (the configured reduction, or auto's current one)."""
        return self.auto.current() if self.auto is not None else self.plan.config.reduction

    def absent(self):
        """True when a rank is inside ``hvd.join()`` this step (:class:`hvd_quant.plan.Presence`)."""
        return self.presence is not None and self.presence.absent(self.session.coll)

    def payload_channel(self, route):
        """What carries this step's payloads on ``route``: the payload group made for the current
        world (its collectives match by order: the buckets then start in plan order), or None
        (Horovod; always for the allreduce route, and until the route has completed a step whose
        gradients went straight into their buckets: why in the torch frontend's ``PayloadGroup``)."""
        if route == _plan.ALLREDUCE or route not in self.routes_run:
            return None
        return self.channel[1] if self.channel[0] is self.session.coll else None

    def factor(self):
        """What Horovod's op applies to the sum over the ranks (those in ``hvd.join()`` add zero)."""
        return 1.0 / self.session.coll.size if self.average else 1.0


def _key_str(key):
    return "/".join(map(str, key))


class StockCompression:
    """A codec wrapped for stock Horovod's ``compression=`` argument (module doc).

    ``hvd.DistributedOptimizer(opt, named_parameters=..., compression=hvd_quant.QSGD(bits=4))`` uses a
    default ``StockCompression`` of the codec; build one yourself to change the defaults::

        compression = hvd_quant.StockCompression(hvd_quant.QSGD(bits=4), reduction="allgather")

    ``error_feedback`` defaults to ``codec.wants_error_feedback``; residuals are kept per tensor name
    and exposed by :meth:`state_dict` / :meth:`load_state_dict`.
    """

    def __init__(self, codec, reduction="auto", min_compress_numel=1024, compress_1d=False,
                 error_feedback=None, bucket_bytes=_plan.BUCKET_BYTES):
        self.config = _plan.configure(codec, reduction=reduction, bucket_bytes=bucket_bytes,
                                      min_compress_numel=min_compress_numel, compress_1d=compress_1d,
                                      warmup_steps=None, error_feedback=error_feedback, op=None,
                                      predivide=None)
        c = self.config
        self.codec, self.reduction, self.error_feedback = c.codec, c.reduction, c.error_feedback
        self.min_compress_numel, self.compress_1d = c.min_compress_numel, c.compress_1d
        self.bucket_bytes = c.bucket_bytes
        self._sessions = {}
        self._groups = {}       # id(optimizer) -> its _Group (dropped with the optimizer)
        self._pending = {}      # exchange name -> (session, Pending) of unfused tensors in flight
        self._unadvanced = []   # (group or None, exchange, Pending) started and not yet advanced
        self._steps = {}        # exchange name -> how many exchanges of that name were started
        self._anon = 0          # fallback names: call order since nothing was pending
        self._restored = {}     # residuals loaded before their session existed
        self._restored_auto = {}    # reduction=auto states loaded before their optimizer's group
        self._graph_autos = {}      # plan key -> AutoChoice of a TensorFlow graph (_graph.GraphAuto)
        # .decided: (gradient, compress's answer) decided by a taken-over optimizer, per thread
        # (autograd runs hooks on one thread per device)
        self._thread = threading.local()

    # -- configuration ----------------------------------------------------------------------------
    def summary(self):
        return self.config.summary()

    def record(self, name, shape):
        """The handshake record of the first exchange of tensor ``name``."""
        return handshake_record(self.summary(), (name, tuple(shape)))

    def session(self, backend, process_set):
        """The session (``.exchange``, ``.memory``, ``.ops``, ``.adapter``) of ``backend`` and
        ``process_set``, created on first use and rebound when the process set's rank or size changed."""
        key = (backend, getattr(process_set, "process_set_id", 0))
        s = self._sessions.get(key)
        if s is None:
            s = self._sessions[key] = _Session(backend, process_set, self.codec, self.reduction,
                                               self.error_feedback)
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
        s.rebind(coll)
        # Another world: the ranks that joined start their exchanges afresh, so every rank does
        # (handshake with the first exchange of each name, step counts, auto's schedule).
        self._steps.clear()
        for _, group in self._groups.values():
            if group.session is s:
                group.new_step()            # the step before the change is not continued
                if group.auto is not None:
                    group.auto.reset()      # measure again
        return True

    def compressible(self, info):
        """Whether a tensor ``adapter.describe`` described is compressed (:class:`hvd_quant.plan.Config`)."""
        return self.config.compressible(info.shape, info.is_float)

    def step_metrics(self, optimizer):
        """:func:`hvd_quant.plan.step_metrics` of ``optimizer``'s last step on this path (bytes: since
        the last call, as :func:`take_traffic`; ``exchange_s`` is not measured here: None), or None
        before its first gradient."""
        entry = self._groups.get(id(optimizer))
        if entry is None or entry[0]() is not optimizer:
            return None
        group = entry[1]
        return _plan.step_metrics(group.plan, take_traffic(self), list(group.routes), self.codec.spec())

    def reduction_in_use(self, optimizer):
        """How ``optimizer``'s next step's buckets travel on this path (``"sra"``, ``"allgather"``,
        ``"allreduce"``), or None before its first gradient."""
        entry = self._groups.get(id(optimizer))
        return None if entry is None or entry[0]() is not optimizer else entry[1].route()

    # -- Horovod Compressor protocol --------------------------------------------------------------
    def compress(self, tensor):
        backend = _backend_for(tensor)
        hook = getattr(backend, "stock_compress", None)   # a frontend's own path (TensorFlow)
        if hook is not None:
            out = hook(self, tensor)
            if out is not None:
                return out
        return self.compress_on(backend, tensor)

    def compress_on(self, backend, tensor):
        """``compress`` through ``backend`` (a frontend, or another object with the stock path's
        interface) with its hook skipped."""
        decided = getattr(self._thread, "decided", None)
        if decided is not None and decided[0] is tensor:
            return decided[1]
        caller = _frame_context(tensor)
        if caller.param is not None:
            return self._compress_member(self._group(backend, caller), caller.param, tensor)
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
        record = self.record(name, info.shape) if name not in self._steps else None
        pending = self._start(session.exchange, name, session.ops.flatten([tensor]), record,
                              header(name, info.shape))
        self._pending[name] = (session, pending)
        return adapter.placeholder(tensor), _Ctx(session, pending, info, session.exchange.coll.size)

    def _compress_member(self, group, param, tensor):
        """``compress`` of the gradient of ``param``, one of ``group``'s optimizer's parameters."""
        out, ctx = self._member(group, param, tensor)
        return (group.placeholder(param, tensor) if out is None else out), ctx

    def _member(self, group, param, tensor, direct=False):
        """``(None, ctx)`` when the gradient of ``param`` (one of ``group``'s optimizer's parameters)
        was recorded into its bucket (``direct``: or its plain group; the ctx is then a callable
        giving the result), else ``(what Horovod allreduces, ctx)``."""
        self._arrived(group, param)
        session = group.session
        info = group.describe(param, tensor)
        where = group.where.get(param)
        if where is None or not self.compressible(info):
            spot = group.plain_where.get(param) if direct else None
            if spot is None:
                return self._uncompressed(session, tensor, info)
            return None, self._record_plain(group, spot, tensor, info)
        route = group.route()
        if not direct and (route == _plan.ALLREDUCE or group.absent()):
            group.routes[where[0]] = _plan.ALLREDUCE
            return self._uncompressed(session, tensor, info)
        slot = self._record(group, where, tensor, info, route)
        return None, (functools.partial(self._finish_slot, slot) if direct else slot)

    @staticmethod
    def _uncompressed(session, tensor, info):
        out = uncompressed(session.adapter, tensor, info)
        itemsize = info.itemsize if out[0] is tensor else session.adapter.describe(out[0]).itemsize
        session.exchange.traffic.add_allreduce(info.numel * itemsize, info.numel, session.coll.size)
        return out

    def _start(self, exchange, name, flat, record, head, group=None, channel=None):
        step = self._steps.get(name, 0)
        self._steps[name] = step + 1
        pending = exchange.start(name, flat, step=step, record=record, header=head, channel=channel)
        self._unadvanced.append((group, exchange, pending))
        return pending

    def _arrived(self, group, param):
        """Note a gradient of ``group``; one seen before in this step starts the next step, which
        ends the step before for ``reduction="auto"`` (and may take its decision, the same on every
        rank). A step's first gradient follows the world's changes (elastic), once per step."""
        repeat = param in group.seen
        if not repeat:
            group.seen.add(param)
            if len(group.seen) > 1:
                return
        else:
            group.seen = {param}
        if self._follow_world(group.session, group.backend, group.process_set):
            group.seen.add(param)       # (new_step emptied it) this gradient opens the new world's step
        elif (repeat and group.auto is not None and not group.absent()
              and group.auto.end_step(wait=group.wait_device)):
            coll = group.session.coll
            group.auto.decide(coll, group.session.ops, "hvdq.stock.auto")
            if coll.rank == 0:
                print(f"hvd_quant (compression=): {group.auto.summary()}", flush=True)
        self._step_begins(group)

    @staticmethod
    def _step_begins(group):
        """A step's first gradient: refill the placeholders, count the ranks that step (hvd.join()),
        note the routes the step before completed (a taken-over step: the path of the steps after
        it), take up a payload group made in it."""
        group.next_start = 0
        if group.stepped_direct:    # the step before ran the code of every later step
            group.routes_run.update(r for r, p in zip(group.routes, group.pending) if p is None)
        group.stepped_direct = group.direct
        if group.next_channel is not None:
            group.channel, group.next_channel = group.next_channel, None
        for ones in group.ones.values():
            ones.fill_(1)
        if group.presence is not None:
            coll = group.session.coll
            group.presence.end_step(coll)
            if coll.size > 1 and group.plan.buckets and group.route() != _plan.ALLREDUCE:
                group.presence.start(coll)

    def _group(self, backend, caller):
        """The :class:`_Group` of the Horovod optimizer that called (planned on its first gradient)."""
        owner = caller.owner
        entry = self._groups.get(id(owner))
        if entry is not None and entry[0]() is owner:
            return entry[1]
        _refuse_adasum(backend, owner)
        group = _Group(self, self.session(backend, caller.process_set), owner, backend,
                       caller.process_set)
        if group.auto is not None:
            self._restore_auto(group.key, group.auto)
        self._groups[id(owner)] = (weakref.ref(owner), group)
        weakref.finalize(owner, self._groups.pop, id(owner), None)
        if caller.param is not None and getattr(owner, "_groups", None) is None:
            self._take_over(owner, group)
        return group

    def _take_over(self, owner, group):
        """Give ``owner`` (a Horovod optimizer, one allreduce per parameter) an
        ``_allreduce_grad_async`` of hvd_quant's own. While ``group.direct``, a planned gradient goes
        straight into its bucket or plain group, and Horovod's ``synchronize`` gets the result from a
        callable handle (as for Horovod's own sparse path): no placeholder, no Horovod op per tensor,
        no frame lookup. ``direct`` turns on once every rank has handed out a bucket (the first
        ``_finish_slot``), and off at a step's first gradient in a new world (elastic), for one step:
        the ranks that joined start with Horovod's per-tensor path, so every rank does. A plan with
        no bucket (every gradient too small or 1-D; no ``_finish_slot``) turns direct at its second
        step's first gradient instead, and again after a new world's first step. Other gradients
        (sparse, outside the plan) take Horovod's own path."""
        horovod_async = owner._allreduce_grad_async
        always = not group.plan.buckets

        def allreduce_grad_async(p):
            if p not in group.index:
                return horovod_async(p)
            begins = not group.seen or p in group.seen      # this step's first gradient
            if begins and (group.direct or (always and group.seen)):
                group.direct = not self._world_changed(group)
            if group.direct and p.grad is None:
                p.grad = p.data.new(p.size()).zero_()   # as Horovod: a gradient of zeros
            grad = p.grad
            if grad is not None and not grad.is_sparse:
                if group.direct:
                    out, ctx = self._member(group, p, grad, direct=True)
                    if out is None:
                        return ctx, None
                else:
                    out, ctx = self._compress_member(group, p, grad)
                self._thread.decided = (grad, (out, ctx))   # what compress returns, no frame lookup
            try:
                return horovod_async(p)
            finally:
                self._thread.decided = None

        owner._allreduce_grad_async = allreduce_grad_async
        group.taken_over = True

    @staticmethod
    def _world_changed(group):
        return group.backend.stock_backend(group.process_set)[0] is not group.session.coll

    def _record_plain(self, group, spot, tensor, info):
        """Keep plain member ``spot`` = (group, index); start its allreduce once the group is complete.
        Returns the callable handle of its result."""
        j, i = spot
        grads = group.plain_grads[j]
        if grads[i] is not None:
            raise RuntimeError(f"hvd_quant: gradient of {group.plain_names[j]}[{i}] was handed over "
                               f"twice before its result (backward run twice without a step?)")
        grads[i] = tensor
        group.plain_arrived[j] += 1
        if group.plain_arrived[j] == len(grads):
            self._launch_plain(group, j)
        return functools.partial(self._finish_plain, group, j, i, info)

    @staticmethod
    def _launch_plain(group, j):
        """Plain group ``j``: one Horovod allreduce of its gradients, flattened (zeros for a member
        that never arrived), with the optimizer's op and Horovod's pre/post-scale split."""
        session, grads, sizes = group.session, group.plain_grads[j], group.plain_sizes[j]
        like = next(g for g in grads if g is not None)
        flat = session.ops.flatten([g if g is not None else session.ops.zeros(size, like)
                                    for g, size in zip(grads, sizes)])
        n = sum(sizes)
        session.exchange.traffic.add_allreduce(4 * n, n, session.coll.size)
        op = _plan.AVERAGE if group.average else _SUM
        pre, post = group.scale_split
        group.plain_pending[j] = session.coll.allreduce_async(flat, group.plain_names[j], op, pre, post)
        group.plain_left[j] = sum(g is not None for g in grads)
        group.plain_grads[j] = [None] * len(grads)
        group.plain_arrived[j] = 0

    def _finish_plain(self, group, j, i, info):
        pieces = group.plain_result[j]
        if pieces is None:
            if group.complete:      # start the buckets before any wait of the step
                self._launch_complete(group, group.route(), wait=True)
            # and finish them: on a payload group that queues their second phases and decodes on
            # the device without waiting, and the wait below lasts until backward's end
            self._advance_all(group)
            for k, pending in enumerate(group.pending):
                if pending is not None and group.left[k]:      # (left: members to hand out)
                    self._bucket_result(group, k)
            if group.plain_pending[j] is None:      # a member never reached this rank's hook
                self._launch_plain(group, j)
            flat = group.session.coll.synchronize(group.plain_pending[j])
            pieces = group.plain_result[j] = group.session.adapter.split(flat, group.plain_sizes[j])
            group.plain_pending[j] = None
        group.plain_left[j] -= 1
        if group.plain_left[j] == 0:
            group.plain_result[j] = None
        return group.session.adapter.restore(pieces[i], info)

    def _record(self, group, where, tensor, info, route):
        """Keep member ``where`` = (bucket, index) of ``group``; start the bucket once it is complete."""
        k, i = where
        grads = group.grads[k]
        b = group.plan.buckets[k]
        if grads[i] is not None:
            raise RuntimeError(f"hvd_quant: gradient {b.names[i]!r} was compressed twice before "
                               f"its decompress (backward run twice without a step?)")
        grads[i] = tensor
        group.like = tensor
        group.arrived[k] += 1
        if group.arrived[k] == len(grads):
            group.complete.append(k)
        if group.complete:
            self._launch_complete(group, route, wait=False)
        return _Slot(group, k, i, info, route)

    def _launch_complete(self, group, route, wait):
        """Launch the complete buckets once this step's presence count is known (``wait``: block)."""
        if group.presence is not None and not group.presence.known(group.session.coll, wait):
            return
        complete, group.complete = group.complete, []
        channel = group.payload_channel(route)
        if channel is not None:
            complete, group.complete, group.next_start = _plan.in_plan_order(complete, group.next_start)
        for k in complete:
            self._launch(group, k, route, channel)

    def _launch(self, group, k, route, channel=None):
        """Start bucket ``k``'s exchange; members that never arrived contribute zeros (as Horovod
        allreduces zeros for a parameter without a gradient). While a rank is inside ``hvd.join()``
        the bucket goes through Horovod's allreduce (a Sum, scaled in ``decompress``)."""
        session, b, grads = group.session, group.plan.buckets[k], group.grads[k]
        parts = [g if g is not None else session.ops.zeros(b.numels[i], group.like)
                 for i, g in enumerate(grads)]
        flat = session.ops.flatten(parts)
        if group.absent():
            route = _plan.ALLREDUCE
        group.routes[k] = route
        if route == _plan.ALLREDUCE:
            session.exchange.traffic.add_allreduce(4 * b.numel, b.numel, session.coll.size)
            group.pending[k] = None, session.coll.allreduce_async(flat, f"{b.name}.sum", _SUM)
        else:
            record = group.plan.record if b.name not in self._steps else None
            ex = session.exchange_for(route)
            group.pending[k] = ex, self._start(ex, b.name, flat, record, b.header, group, channel)
            ex.advance_ready([q for _, e, q in self._unadvanced if e is ex])  # done alltoalls: phase two
        group.left[k] = sum(g is not None for g in grads)     # the members decompress will return
        group.grads[k] = [None] * len(grads)
        group.arrived[k] = 0

    def _advance_all(self, group=None):
        """Move every exchange of ``group`` (None: the unfused tensors) still in its first phase to its
        second before waiting on any (the overlap rule), once per step, not once per tensor. Another
        optimizer's exchanges are left to its own ``synchronize()``: advancing one blocks on its
        alltoall, which a rank may start only there (its presence count was not known in backward),
        after this optimizer's: two ranks would wait for each other."""
        mine = [e for e in self._unadvanced if e[0] is group]
        if mine:
            self._unadvanced = [e for e in self._unadvanced if e[0] is not group]
            for _, exchange, pending in mine:
                exchange.advance(pending)

    def decompress(self, tensor, ctx):
        if isinstance(ctx, _Slot):
            return self._finish_slot(ctx)
        if isinstance(ctx, _Cast):
            return ctx.adapter.cast_back(tensor, ctx.info)
        if not isinstance(ctx, _Ctx):
            finish = getattr(ctx, "stock_decompress", None)   # made by a backend's stock_compress
            return tensor if finish is None else finish(tensor)
        self._advance_all()
        session, pending = ctx.session, ctx.pending
        self._pending.pop(pending.name, None)
        flat = session.exchange.finish(pending)
        flat = session.ops.scale_(flat, ctx.session.adapter.as_float(tensor) / ctx.size)
        return session.adapter.restore(flat, ctx.info)

    def _finish_slot(self, slot):
        group, k = slot.group, slot.k
        if group.taken_over and not group.direct:
            self._go_direct(group, slot.route)
        session = group.session
        pieces = group.result[k]
        if pieces is None:
            if group.pending[k] is None:
                self._launch_complete(group, slot.route, wait=True)
            if group.pending[k] is None:        # a member never reached compress on this rank
                channel = group.payload_channel(slot.route)
                for j in range(group.next_start if channel is not None else k, k + 1):   # plan order
                    if group.pending[j] is None:
                        self._launch(group, j, slot.route, channel)
                group.next_start = max(group.next_start, k + 1)
                group.complete = [j for j in group.complete if group.pending[j] is None]
            self._advance_all(group)
            pieces = self._bucket_result(group, k)
        group.left[k] -= 1
        if group.left[k] == 0:
            group.result[k] = None
        return session.adapter.restore(pieces[slot.i], slot.info)

    @staticmethod
    def _bucket_result(group, k):
        """Bucket ``k``'s result, once its exchange or allreduce is started: finished, scaled by
        Horovod's factor and split into its members' pieces (one split, not a slice per member),
        kept until they are handed out."""
        ex, pending = group.pending[k]
        flat = ex.finish(pending) if ex is not None else group.session.coll.synchronize(pending)
        factor = group.factor()
        flat = flat if factor == 1.0 else group.session.ops.scale_(flat, factor)
        pieces = group.result[k] = group.session.adapter.split(flat, group.plan.buckets[k].numels)
        group.pending[k] = None
        return pieces

    def _go_direct(self, group, route):
        """A taken-over optimizer's first bucket result in this world: every hook of the step has run
        on this rank and nothing of the step has been waited for, so every rank comes to this point.
        Launch the complete buckets (other ranks may wait for them), make the payload group (a
        collective; used from the next step, so that a bucket of this step does not go one way on
        one rank and the other way on another), and from the next step on hand the gradients
        straight to their buckets."""
        self._launch_complete(group, route, wait=True)
        make = getattr(group.backend, "payload_group", None)
        coll = group.session.coll
        if make is not None and group.device is not None and not group.absent():
            label = f"hvdq.stock.{group.key}"
            group.next_channel = (coll, make(coll.process_set, group.device, label, group.plan.record,
                                             "hvd.DistributedOptimizer(compression=...)"))
        group.direct = True

    # -- state ------------------------------------------------------------------------------------
    @property
    def traffic(self):
        """Bytes sent since the last :meth:`reset_traffic`, summed over sessions."""
        total = Traffic()
        for s in self._sessions.values():
            for ex in s.exchanges.values():
                total.add(ex.traffic)
        return total

    def reset_traffic(self):
        for s in self._sessions.values():
            for ex in s.exchanges.values():
                ex.traffic.reset()

    def state_dict(self):
        """``{"residuals": {session key: {name: tensor}}, "server_residuals": {session key:
        {(name, rank, size): tensor}}, "steps": {name: count}, "auto": {plan key: state}}`` (worker
        and server residuals as in :class:`hvd_quant.memory.Memory`, keyed by exchange name: the
        bucket's or, unfused, the tensor's; ``reduction="auto"``'s schedule per optimizer plan)."""
        states = dict(self._restored)
        states.update({_key_str(k): s.memory.state_dict()
                       for k, s in self._sessions.items() if s.memory is not None})
        auto = dict(self._restored_auto)
        auto.update({g.key: g.auto.state_dict() for _, g in self._groups.values() if g.auto is not None})
        auto.update({k: a.state_dict() for k, a in self._graph_autos.items()})
        return {"residuals": {k: dict(v.get(Memory.WORKER, {})) for k, v in states.items()},
                "server_residuals": {k: dict(v.get(Memory.SERVER, {})) for k, v in states.items()},
                "steps": dict(self._steps), "auto": auto}

    def adopt_auto(self, key, choice):
        """Keep ``choice``, the :class:`hvd_quant.plan.AutoChoice` of plan ``key`` made by a
        framework's graph path, in :meth:`state_dict`, restored from a loaded state if one waits."""
        self._restore_auto(key, choice)
        self._graph_autos[key] = choice

    def _restore_auto(self, key, choice):
        saved = self._restored_auto.pop(key, None)
        if saved is not None:
            choice.load_state_dict(saved)

    def load_state_dict(self, state):
        self._steps = dict(state.get("steps", {}))
        self._restored_auto = dict(state.get("auto", {}))
        for k, a in self._graph_autos.items():
            self._restore_auto(k, a)
        for _, g in self._groups.values():
            if g.auto is not None:
                self._restore_auto(g.key, g.auto)
        server = state.get("server_residuals", {})
        self._restored = {k: {Memory.WORKER: v, Memory.SERVER: server.get(k, {})}
                          for k, v in state.get("residuals", {}).items()}
        for k, s in self._sessions.items():
            if s.memory is not None:
                s.memory.load_state_dict(self._restored.pop(_key_str(k), {}))


# The default StockCompression of each codec object (what codec.compress / decompress use).
_DEFAULTS = {}


def stock_compression(codec):
    """The StockCompression that ``codec.compress`` / ``codec.decompress`` use (created on first use)."""
    sc = _DEFAULTS.get(id(codec))
    if sc is None or sc.codec is not codec:
        sc = _DEFAULTS[id(codec)] = StockCompression(codec)
        try:
            weakref.finalize(codec, _DEFAULTS.pop, id(codec), None)
        except TypeError:       # not weak-referenceable: keep it for the process's lifetime
            pass
    return sc


def take_traffic(compression):
    """:class:`~hvd_quant.exchange.Traffic` of ``compression`` (a StockCompression, or a codec used as
    one) since the last call."""
    sc = compression if isinstance(compression, StockCompression) else stock_compression(compression)
    t = sc.traffic
    sc.reset_traffic()
    return t


def compress(codec, tensor):
    return stock_compression(codec).compress(tensor)


def decompress(codec, tensor, ctx):
    return stock_compression(codec).decompress(tensor, ctx)
