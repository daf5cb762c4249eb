"""``hvd_quant.torch.DistributedOptimizer``: ``horovod.torch.DistributedOptimizer``'s arguments and rules,
its hooks handing gradients to a :class:`hvd_quant.scheduler.StepScheduler` (docs/EXCHANGE.md)."""
import os
import sys
import time
import warnings
from contextlib import contextmanager

import torch

import horovod.torch as hvd

from .. import plan as _plan
from ..exchange import HANDSHAKE_NAME, Memory, Traffic, handshake
from ..scheduler import Presence, StepOwner, StepScheduler
from . import _backend


__all__ = ["DistributedOptimizer"]

_STATE_KEY = "hvd_quant"
# optimizers made in this process per process set id: names their collectives alike on every rank
# whatever other sets each is in (every member makes the set's optimizers in the same order)
_instances = {}


class _DistributedOptimizer(torch.optim.Optimizer, StepOwner):
    def __init__(self, params, named_parameters, config, backward_passes_per_step, groups,
                 sparse_as_dense, process_set):
        super(self.__class__, self).__init__(params)

        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            named_parameters = [(f'allreduce.noname.{i}.{j}', v)
                                for i, param_group in enumerate(self.param_groups)
                                for j, v in enumerate(param_group['params'])]
        if any(not isinstance(p, tuple) for p in named_parameters):
            raise ValueError('named_parameters should be a sequence of tuples (name, parameter), '
                             'usually produced by model.named_parameters().')
        names = [k for k, _ in named_parameters]
        dups = sorted({k for k in names if names.count(k) > 1})
        if dups:
            raise ValueError('Parameter names in named_parameters must be unique. '
                             'Found duplicates: %s' % ', '.join(dups))
        all_ids = {id(v) for g in self.param_groups for v in g['params']}
        unnamed = all_ids - {id(v) for _, v in named_parameters}
        if unnamed:
            raise ValueError('named_parameters was specified, but one or more model parameters were '
                             'not named. Python object ids: %s' % ', '.join(map(str, unnamed)))

        self._parameter_names = {v: k for k, v in sorted(named_parameters, key=lambda kv: kv[0])}
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {v: backward_passes_per_step for _, v in named_parameters}
        self.config, self.op = config, config.op
        self.gradient_predivide_factor = config.predivide     # Horovod's attribute
        self.codec, self.reduction, self.error_feedback = config.codec, config.reduction, config.error_feedback
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set

        ps_id = process_set.process_set_id
        n = _instances[ps_id] = _instances.get(ps_id, -1) + 1
        self._prefix = f"hvdq{n}" if ps_id == 0 else f"hvdq{n}.ps{ps_id}"
        self._memory = Memory(_backend.OPS) if config.error_feedback else None
        self._coll = None             # the process set's Collectives, once connected
        self._exchanges = {}          # reduction -> Exchange (two with reduction="auto")
        self._handles = {}           # param -> its own allreduce's handle (a callable for sparse)
        self._launched = set()       # params whose gradient was handed to an exchange or allreduce
        self._grad_accs = []
        self._requires_update = set()
        self._synchronized = False
        self._should_synchronize = True
        self._step = 0               # completed synchronizations: warm-up and the noise key
        self._step_agreed = False    # ranks take the largest counter at their first exchange
        self._traffic = Traffic()    # this step so far
        self.last_traffic = Traffic()  # the last completed step
        self._t_first = None          # when this step's first gradient was handed in
        self._compress_now = False    # this step's buckets take a compressed exchange
        self._make_plan(groups)

        elastic = os.environ.get('HOROVOD_ELASTIC') == '1'
        self._active = self.process_set.included() and (hvd.size() > 1 or elastic)
        if self._active:
            if not elastic:
                # Elastic: no collective outside hvd.elastic.run (a worker that joins builds its
                # optimizer while the others sync state); _ready connects at the first gradient.
                self._connect()
            self._register_hooks()

    # -- plan ---------------------------------------------------------------------------------------
    def _make_plan(self, groups):
        params = [p for g in self.param_groups for p in g['params'] if p.requires_grad]
        index = {id(p): i for i, p in enumerate(params)}
        if isinstance(groups, (list, tuple)):
            groups = [[index[id(p)] for p in grp if id(p) in index] for grp in groups]
        tensors = [_plan.Tensor(self._parameter_names[p], tuple(p.shape), p.is_floating_point())
                   for p in params]
        plan = self._grad_plan = _plan.make_plan(self.config, tensors, groups, prefix=self._prefix)
        self._buckets = plan.buckets
        self._bucket_params = [[params[i] for i in b.members] for b in self._buckets]
        # uncompressed float32 gradients: one allreduce per plain group, whose views become their .grad
        plain = _plan.plain_groups(plan, [p.dtype == torch.float32 for p in params],
                                   self.config.bucket_bytes)
        self._group_params = self._bucket_params + [[params[i] for i in g] for g in plain]
        self._group_shapes = [[tuple(p.shape) for p in ps] for ps in self._group_params]
        self._spots = {p: (k, m) for k, ps in enumerate(self._group_params) for m, p in enumerate(ps)}
        pre, post = self.config.allreduce_factors()
        presence = (Presence(f"{self._prefix}.present", _backend.host_one)
                    if self.process_set.process_set_id == 0 else None)   # hvd.join() is global
        self._sched = StepScheduler(
            plan, [(f"{self._prefix}.plain.{j}", [params[i].numel() for i in g])
                   for j, g in enumerate(plain)],
            ops=_backend.OPS, exchange_for=self._exchange_for, traffic=self._traffic,
            numbering=lambda b: (self._step, None), split=_backend.FRONTEND.split,
            average=self.op == _plan.AVERAGE, plain_op=(self.op, pre, post), name=self._prefix,
            label="hvd_quant", presence=presence,
            wait_device=lambda: _backend.wait_for(self._bucket_params[0][0].device if self._buckets else None))

    def _connect(self):
        """(Re)bind to the process set's current rank and size and check every rank agrees."""
        coll = _backend.collectives(self.process_set)
        if self._coll is coll:
            return
        if coll.size > 1:
            handshake(coll, _backend.OPS, self._grad_plan.record,
                      "hvd_quant.torch.DistributedOptimizer", name=HANDSHAKE_NAME)
        self._coll = coll
        self._step_agreed = False
        for ex in self._exchanges.values():
            ex.coll = coll
        self._sched.bind(coll)          # another world: routes and auto start over
        # CUDA payloads travel on process groups of this optimizer's own (from a route's second step)
        self._sched.channel = (coll, _backend.PayloadGroup.open(
            self.process_set, self._bucket_params[0][0].device, self._prefix) if self._buckets else None)

    # -- hooks --------------------------------------------------------------------------------------
    def _register_hooks(self):
        for param_group in self.param_groups:
            for p in param_group['params']:
                if p.requires_grad:
                    self._requires_update.add(p)
                    grad_acc = p.expand_as(p).grad_fn.next_functions[0][0]
                    grad_acc.register_hook(self._make_hook(p))
                    self._grad_accs.append(grad_acc)

    def _make_hook(self, p):
        def hook(*ignore):
            if p in self._launched and self._allreduce_delay[p] <= 0:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times before call "
                    "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
            assert not p.grad.requires_grad
            assert self._allreduce_delay[p] > 0
            self._allreduce_delay[p] -= 1
            if self._allreduce_delay[p] == 0:
                self._ready(p)
        return hook

    def _agree_step(self, device):
        """Once per binding: every rank takes the largest step counter (``broadcast_optimizer_state``
        does not carry it); where they differed, ``auto`` measures again."""
        self._step_agreed = True
        if self._coll.size > 1:
            t = torch.tensor([self._step, -self._step], dtype=torch.int64, device=device)
            top, neg_low = hvd.allreduce(t, op=hvd.Max, name=f"{self._prefix}.step",
                                         process_set=self.process_set).tolist()
            self._step = int(top)
            if top != -neg_low and self._sched.auto is not None:
                self._sched.auto.reset()

    def _ready(self, p):
        if p in self._launched:
            return
        if not self._launched:
            self._t_first = time.perf_counter()
            self._connect()             # the first gradient of a step: the world may have changed
            if not self._step_agreed:
                self._agree_step(p.device)
            self._compress_now = self._sched.begin_step(compress=self._step >= self.config.warmup_steps)
        self._launched.add(p)
        if p.grad is None:
            p.grad = p.data.new(p.size()).zero_()
        spot = self._spots.get(p)
        if spot is None or not (self._compress_now or spot[0] >= len(self._buckets)):
            self._launch_plain(p)       # not float32, or its bucket goes by allreduce this step
            return
        if p.grad.is_sparse and not self.sparse_as_dense:
            # Horovod's sparse allreduce, uncompressed; the group keeps the layout every rank
            # planned, with zeros in this slot, and its result there is ignored (_hand_out).
            self._launch_plain(p)
            grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        else:
            grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
        self._sched.arrive(*spot, grad)

    def _hand_out(self, params, shapes, pieces):
        """Each of ``params`` gets its piece of a group's result: float32 ``p.grad`` a view, other dtypes
        a copy, sparse ones (``_handles``) left to Horovod; ``shapes``: the planned tuples."""
        handles = self._handles
        for p, shape, piece in zip(params, shapes, pieces):
            if handles and p in handles:
                continue
            grad = p.grad
            if grad.is_sparse:
                grad.zero_().add_(piece.view(shape).to(grad.dtype).to_sparse())
            elif grad.dtype == piece.dtype:
                p.grad = piece if piece.shape == shape else piece.view(shape)
            else:
                grad.copy_(piece.view(shape))

    def _launch_plain(self, p):
        name = self._parameter_names.get(p)
        tensor = p.grad
        if tensor.is_sparse and not self.sparse_as_dense:
            self._handles[p] = hvd.sparse_allreduce_async(tensor, name=name, op=_backend.hvd_op(self.op),
                                                          process_set=self.process_set)
            return
        if tensor.is_sparse:
            tensor = tensor.to_dense()
        tensor = _backend.FRONTEND.sendable(tensor)     # bfloat16 as float32: Horovod cannot reduce it
        pre, post = self.config.allreduce_factors()
        self._traffic.add_allreduce(tensor.numel() * tensor.element_size(), tensor.numel(),
                                    self._coll.size)
        self._handles[p] = self._coll.allreduce_async(tensor, name, self.op, pre, post)

    # -- synchronize / step ---------------------------------------------------------------------------
    def synchronize(self):
        if not self._active:
            self._synchronized = True
            return
        if not self._launched:
            self._connect()
        for p in sorted(self._requires_update - self._launched, key=self._parameter_names.get):
            self._ready(p)
        sched = self._sched
        for k, pieces in sched.finish_started():
            self._hand_out(self._group_params[k], self._group_shapes[k], pieces)
        for p, h in self._handles.items():
            out = h() if callable(h) else hvd.synchronize(h)        # callable: a sparse allreduce
            if p.grad.is_sparse:
                p.grad.zero_().add_(out if out.is_sparse else out.to_sparse())
            elif out is not p.grad:
                p.grad.copy_(out)
        self._handles.clear()
        self._launched.clear()
        self.set_backward_passes_per_step(self.backward_passes_per_step)
        sched.end_step(timed=self._step >= self.config.warmup_steps)
        self._step += 1
        self._keep_traffic(self._t_first)
        self._t_first = None
        self._connect()
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self):
        """Use after an explicit ``synchronize()`` so ``step()`` does not synchronize again."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if _initialising_state():
            # on the ranks with empty state only: step the wrapped optimizer, as Horovod does
            return super(self.__class__, self).step(closure)
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context "
                              "after optimizer.synchronize(). This can cause training slowdown. You "
                              "may want to consider using optimizer.skip_synchronize() context if you "
                              "use optimizer.synchronize() in your code.")
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, *args, **kwargs):
        # Horovod's test: a gradient handed on, or a backward pass counted towards one, would be lost
        passes = self.backward_passes_per_step
        if self._launched or any(d < passes for d in self._allreduce_delay.values()):
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as "
                                 "it can cause a race condition.")
        return super(self.__class__, self).zero_grad(*args, **kwargs)

    def set_backward_passes_per_step(self, passes):
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    # -- state ----------------------------------------------------------------------------------------
    def state_dict(self, *args, **kwargs):
        state = super(self.__class__, self).state_dict(*args, **kwargs)
        state[_STATE_KEY] = self._plan_state(self._step)
        return state

    def load_state_dict(self, state_dict, *args, **kwargs):
        state_dict = dict(state_dict)
        ours = state_dict.pop(_STATE_KEY, None)
        self._handles = {}
        self._launched = set()
        self._sched.clear_step()
        self._synchronized = False
        self._should_synchronize = True
        self.set_backward_passes_per_step(self.backward_passes_per_step)
        super(self.__class__, self).load_state_dict(state_dict, *args, **kwargs)
        if ours is None:
            return
        self._step = int(ours.get("step", 0))
        self._load_plan_state(ours, self._bucket_params[0][0] if self._buckets else None)
        if self._coll is not None and self._memory is not None:
            self._connect()


def _initialising_state():
    """True when ``step()`` was called by Horovod's ``broadcast_optimizer_state`` (directly or through
    ``hvd.elastic.TorchState.sync``), which steps only the ranks that have no optimizer state yet."""
    f = sys._getframe(2)                # step()'s caller
    while f is not None and f.f_globals.get("__name__", "").startswith("torch."):
        f = f.f_back                    # torch's step hooks and profiling wrappers
    return (f is not None and f.f_code.co_name == "broadcast_optimizer_state"
            and f.f_globals.get("__name__", "").startswith("horovod."))


def DistributedOptimizer(optimizer, named_parameters=None, compression=None,
                         backward_passes_per_step=1, op=hvd.Average,
                         gradient_predivide_factor=1.0, num_groups=0, groups=None,
                         sparse_as_dense=False, process_set=hvd.global_process_set,
                         reduction="auto", bucket_bytes=_plan.BUCKET_BYTES, min_compress_numel=1024,
                         warmup_steps=0, error_feedback=None, compress_1d=False):
    """Wrap ``optimizer`` so that gradients are averaged across ranks with a compressed exchange.

    Horovod's arguments (named_parameters, compression, backward_passes_per_step, op,
    gradient_predivide_factor, num_groups/groups, sparse_as_dense, process_set) mean what they mean
    in ``horovod.torch.DistributedOptimizer``; ``op=hvd.Adasum`` is refused. Besides:

    Arguments:
        compression: an hvd_quant codec (``hvd_quant.QSGD(bits=4)``, ...), a spec string
            (``"qsgd:bits=4,bucket_size=512"``) or ``hvd.Compression.none/fp16``. Default: none.
        reduction: ``"auto"`` (default: whichever of Horovod's fp32 allreduce and the ways below gave
            the fastest steps at the start, the same on every rank), ``"sra"`` (scatter-reduce-allgather:
            traffic flat in the number of ranks), ``"allgather"`` (one quantization) or ``"two_level"``
            (fp32 inside each node, the codec between nodes; needs ``hvd.init(process_sets="dynamic")``
            or the nodes' sets); docs/EXCHANGE.md, "The reductions".
        bucket_bytes: compressed gradients are fused into buckets of at most this many float32
            bytes, in reverse parameter order; 0: one bucket. Default 25 MiB.
        min_compress_numel: smaller gradients go uncompressed through Horovod's allreduce (float32
            ones fused into groups of ``bucket_bytes``), as do 1-D ones unless ``compress_1d``.
        warmup_steps: full-precision allreduce for this many first steps. Default 0.
        error_feedback: keep each rank's quantization residual and add it to the next gradient.
            Default: what the codec wants (``OneBit``: yes; ``QSGD``: no).

    Ranks configured differently raise ``ConfigMismatchError`` at construction. Example::

        opt = hvd_quant.torch.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
            compression=hvd_quant.QSGD(bits=4))
    """
    if num_groups != 0:
        warnings.warn('Parameter `num_groups` has been replaced by `groups` and will be removed.',
                      DeprecationWarning)
        if groups is None:
            groups = num_groups
    _plan.check_groups(groups, "torch.Tensor")
    _plan.check_backward_passes(backward_passes_per_step)
    config = _plan.configure(
        _backend.resolve_codec(compression), reduction=reduction, bucket_bytes=bucket_bytes,
        min_compress_numel=min_compress_numel, compress_1d=compress_1d, warmup_steps=warmup_steps,
        error_feedback=error_feedback, op=_backend.core_op(op), predivide=gradient_predivide_factor,
        extra=(("backward_passes", backward_passes_per_step),))
    cls = type(optimizer.__class__.__name__, (optimizer.__class__, StepOwner),
               dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, config, backward_passes_per_step, groups,
               sparse_as_dense, process_set)
