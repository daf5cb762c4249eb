"""``hvd_quant.torch.OneBitAdam``: 1-bit Adam (Tang et al., 2021) as a Horovod data-parallel optimizer.

Plain 1-bit error feedback under Adam lets Adam's second moment see the quantizer's codes. 1-bit Adam
learns the variance uncompressed first, then freezes it and compresses the momentum instead:

1. Steps 1..``freeze_step`` (warm-up): each bucket of gradients (a missing gradient counts as zeros,
   as in Horovod) is flattened and averaged by Horovod's fp32 allreduce; then exact Adam (AdamW with
   ``decoupled_weight_decay``) on the average: the same operations as ``torch.optim.Adam(foreach=False)``.
2. From step ``freeze_step + 1`` on, the variance ``v`` stays as it was. Each rank updates the
   momentum with its own gradient, ``m = b1 * m + (1 - b1) * g_local``, then the momenta of each
   bucket are averaged through :class:`hvd_quant.exchange.Exchange` with ``reduction="sra"`` and a
   1-bit codec (:class:`hvd_quant.OneBit`), error feedback on both sides: the worker's residual of
   encoding its momentum, the server's of requantizing the reduced chunk it owns
   (:class:`hvd_quant.exchange.Memory`). Every rank decodes the same bytes, so ``m`` and the
   parameters stay bit-identical across ranks.
3. ``p -= lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^T)) + eps)`` with ``T = freeze_step``: Adam's
   bias correction, the variance's frozen with it. ``bias_correction=False`` gives DeepSpeed's
   ``OnebitAdam`` update ``p -= lr * m / (sqrt(v) + eps)`` in both phases (DeepSpeed accepts a
   ``bias_correction`` flag but its update never applies it).

Followed from DeepSpeed's ``OnebitAdam``: the warm-up length, the frozen variance, the local momentum
update before the compressed allreduce, the worker and server error feedback, the update above, and
weight decay as a decoupled term (its ``update += weight_decay * p`` is ``decoupled_weight_decay=True``
here, written as torch's AdamW ``p *= 1 - lr * weight_decay``; the default is torch.optim.Adam's L2
term added to the gradient). Differences: buckets of up to ``bucket_bytes`` travel as one exchange
(DeepSpeed: one per tensor), with OneBit's two-mean scales per ``bucket_size`` elements (DeepSpeed: one
``||x|| / sqrt(n)`` per chunk); the residuals are saved and restored with the optimizer (DeepSpeed
resets them on load), so a resume continues bit-exactly; no initialisation step and no
``exp_avg_mask``.

``state_dict()`` holds per parameter ``step``, ``exp_avg`` (momentum) and ``exp_avg_sq`` (variance,
frozen after the warm-up), as torch.optim.Adam; under ``"hvd_quant_onebit_adam"`` this rank's worker
residuals by parameter name and server residuals by ``(bucket header, rank, world size)``. The state
exists from construction, so ``hvd.broadcast_optimizer_state`` broadcasts it without a step.
"""
import numbers

import torch

import horovod.torch as hvd

# The internals this module builds on, all here so that they can be re-pointed in one place.
from ..codecs import OneBit, resolve_codec          # the 1-bit codec; compression= to a codec
from ..exchange import AVERAGE, Exchange, Memory, Traffic, handshake   # the reductions, residuals, bytes per step
from ..plan import (BUCKET_BYTES, Tensor, configure, make_plan,  # static bucket fusion
                    restore_residuals, save_residuals)          # residuals <-> checkpoint form
from ._backend import OPS, collectives               # torch's ArrayOps and Collectives tables

__all__ = ["OneBitAdam"]

_STATE_KEY = "hvd_quant_onebit_adam"
_HANDSHAKE = "hvdq.onebit_adam.handshake"
_instances = {}         # OneBitAdam objects made in this process per process set: names collectives


def _check_whole(value, name, low):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be a whole number >= {low}; got {value!r}")
    return int(value)


class OneBitAdam(torch.optim.Optimizer):
    """1-bit Adam over Horovod (module docstring: the algorithm, what it follows of DeepSpeed).

    Arguments:
        params, lr, betas, eps, weight_decay: as ``torch.optim.Adam`` (parameter groups too).
        freeze_step: required; the number of warm-up steps of exact Adam on fp32-averaged gradients,
            after which the variance is frozen and the momentum travels in 1 bit. DeepSpeed advises
            15-25% of the run; a run that ends before it never compresses.
        bucket_bytes: the parameters (those requiring a gradient at construction, in a fixed order
            on every rank) are fused into buckets of at most this many float32 bytes
            (``hvd_quant.plan.make_plan``); each bucket is one allreduce or exchange. 0: one bucket.
        decoupled_weight_decay: AdamW's decay ``p *= 1 - lr * weight_decay`` instead of L2.
        bias_correction: Adam's (default); False: DeepSpeed's uncorrected update.
        named_parameters: ``model.named_parameters()``: names for checkpoints and headers
            (default, and for groups added later: positions in the parameter groups).
        compression: a :class:`hvd_quant.OneBit` codec with error feedback, or its spec string.
            Default ``OneBit(bucket_size=1024)``: about 1.06 bits per element (1/30 of fp32).
        process_set: the Horovod process set the ranks average over (this rank must be in it).

    Memory: Adam's two state tensors per parameter, and from the freeze on two more parameter-sized
    buffers (the frozen denominator, kept instead of recomputed every step, and one flat momentum
    buffer per bucket), besides the error-feedback residuals.

    Raises ``ValueError`` at construction for bad arguments, and in ``step()`` for sparse gradients
    and for parameters added or removed once the variance is frozen (before, the buckets are planned
    again). Example::

        opt = hvd_quant.torch.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=2000,
                                         named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        for x, y in batches:
            opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *,
                 freeze_step, bucket_bytes=BUCKET_BYTES, decoupled_weight_decay=False,
                 bias_correction=True, named_parameters=None, compression=None,
                 process_set=hvd.global_process_set):
        for value, what in ((lr, "lr"), (eps, "eps"), (weight_decay, "weight_decay")):
            if not value >= 0.0:
                raise ValueError(f"{what} must be >= 0; got {value!r}")
        if not (len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"betas must be two numbers in [0, 1); got {betas!r}")
        for flag, name in ((decoupled_weight_decay, "decoupled_weight_decay"),
                           (bias_correction, "bias_correction")):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be True or False; got {flag!r}")
        self.freeze_step = _check_whole(freeze_step, "freeze_step", 1)
        codec = OneBit(bucket_size=1024) if compression is None else resolve_codec(compression)
        if not isinstance(codec, OneBit) or not codec.error_feedback:
            raise ValueError(f"OneBitAdam exchanges the momentum with a 1-bit codec with error feedback "
                             f"(hvd_quant.OneBit()); got {codec.spec()}")
        if not process_set.included():
            raise ValueError("OneBitAdam: this rank is not in process_set")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      decoupled_weight_decay=decoupled_weight_decay,
                                      bias_correction=bias_correction))
        self.codec, self.process_set = codec, process_set
        ps_id = process_set.process_set_id
        n = _instances[ps_id] = _instances.get(ps_id, -1) + 1
        self._prefix = f"hvdq.1bitadam{n}" + (f".ps{ps_id}" if ps_id else "")
        self._names = {} if named_parameters is None else {id(p): k for k, p in named_parameters}
        unnamed = [f"{i}.{j}" for i, g in enumerate(self.param_groups) for j, p in enumerate(g["params"])
                   if named_parameters is not None and id(p) not in self._names]
        if unnamed:
            raise ValueError(f"named_parameters does not name the parameters {', '.join(unnamed)} "
                             "(group.index)")
        self._config = configure(codec, reduction="sra", bucket_bytes=bucket_bytes, min_compress_numel=0,
                                 compress_1d=True, warmup_steps=None, error_feedback=True, op=AVERAGE,
                                 predivide=None, extra=(("optimizer", "OneBitAdam"),
                                                        ("freeze_step", self.freeze_step)))
        self._memory = Memory(OPS)
        self._flat_momenta = {}     # bucket name -> the buffer its momenta travel from
        self._denominators = {}     # parameter -> (what it was made from, Adam's frozen denominator)
        self._exchange = None       # made at the first compressed step
        self._coll = None           # the process set's Collectives the ranks last agreed on
        self.last_traffic = Traffic()
        self._plan()

    # -- plan ---------------------------------------------------------------------------------------
    def _layout(self):
        return tuple((id(p), p.requires_grad) for g in self.param_groups for p in g["params"])

    def _plan(self):
        """Buckets of the parameters requiring a gradient, the same on every rank; state for new ones."""
        params, names = [], []
        for i, g in enumerate(self.param_groups):
            for j, p in enumerate(g["params"]):
                if not p.requires_grad:
                    continue
                if p.dtype != torch.float32:
                    raise ValueError(f"OneBitAdam keeps float32 parameters; parameter {i}.{j} is {p.dtype}")
                params.append(p)
                names.append(self._names.get(id(p), f"onebit.noname.{i}.{j}"))   # added groups: positions
        if len(set(names)) != len(names):
            raise ValueError("parameter names in named_parameters must be unique")
        plan = make_plan(self._config, [Tensor(k, tuple(p.shape), True) for k, p in zip(names, params)],
                         prefix=self._prefix)
        self.buckets = plan.buckets     # plan.Bucket records: name, header, members, offsets
        self._record = plan.record
        self._bucket_params = [[params[i] for i in b.members] for b in plan.buckets]
        for p in params:
            if not self.state[p]:
                self.state[p].update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        self._params = params
        self._laid_out = self._layout()
        self._coll = None               # agree on the new plan at the next step

    def _connect(self):
        """The process set's Collectives; on a new one (first step, another world, a new plan) every
        rank checks that every rank planned the same buckets with the same configuration."""
        coll = collectives(self.process_set)
        if coll is not self._coll:
            if coll.size > 1:
                handshake(coll, OPS, self._record, "hvd_quant.torch.OneBitAdam", name=_HANDSHAKE)
            self._coll = coll
            if self._exchange is not None:
                self._exchange.coll = coll
        return coll

    # -- step ---------------------------------------------------------------------------------------
    def _grad(self, p):
        g = p.grad
        if g is None:
            return torch.zeros_like(p)
        if g.is_sparse:
            raise ValueError("OneBitAdam does not support sparse gradients (nn.Embedding(sparse=True) "
                             "and the like): its exchange and update are dense")
        return g

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t = max((int(self.state[p]["step"]) for p in self._params), default=0) + 1
        if self._layout() != self._laid_out:
            if t > self.freeze_step:
                raise ValueError("OneBitAdam: the parameter groups changed after the variance was frozen "
                                 f"(step {t - 1} >= freeze_step {self.freeze_step}); the buckets, their "
                                 "residuals and the frozen variance belong to the parameters planned "
                                 "then. Add or remove parameters before the freeze only.")
            self._plan()
        grads = [self._grad(p) for p in self._params]
        # each parameter's group, looked up every step: load_state_dict replaces the group dicts
        self._group = {p: g for g in self.param_groups for p in g["params"]}
        coll = self._connect()
        traffic = Traffic()
        if t <= self.freeze_step:
            grads = self._average(coll, grads, traffic)
        else:
            self._exchange_momentum(coll, grads, t, traffic)
        for p, g in zip(self._params, grads):
            self._update(p, g, t)
        self.last_traffic = traffic
        return loss

    def _average(self, coll, grads, traffic):
        """Warm-up: every bucket's gradients averaged by Horovod's fp32 allreduce (views of the result)."""
        if coll.size == 1:
            return grads
        index = {p: i for i, p in enumerate(self._params)}
        flats, handles = [], []     # the flat buffers stay referenced until their allreduce is done
        for b, ps in zip(self.buckets, self._bucket_params):
            flat = OPS.flatten([grads[index[p]] for p in ps])
            handles.append(coll.allreduce_async(flat, f"{b.name}.fp32", AVERAGE))
            flats.append(flat)
            traffic.add_allreduce(4 * b.numel, b.numel, coll.size)
        out = list(grads)
        for b, ps, h in zip(self.buckets, self._bucket_params, handles):
            flat = coll.synchronize(h)
            for k, p in enumerate(ps):
                out[index[p]] = flat[b.offsets[k]:b.offsets[k + 1]].view_as(p)
        return out

    def _momentum(self, p, g, out):
        """After the freeze: this rank's momentum from its own gradient (L2 decay in the gradient),
        written into ``out``."""
        group = self._group[p]
        if group["weight_decay"] and not group["decoupled_weight_decay"]:
            g = g.add(p, alpha=group["weight_decay"])
        torch.lerp(self.state[p]["exp_avg"], g, 1 - group["betas"][0], out=out)

    def _exchange_momentum(self, coll, grads, t, traffic):
        """Each rank's momentum, written straight into one kept buffer per bucket, averaged in 1 bit
        (SRA, worker and server error feedback) into every parameter's ``exp_avg``."""
        if coll.size == 1:
            for p, g in zip(self._params, grads):
                self._momentum(p, g, self.state[p]["exp_avg"])
            return
        if self._exchange is None:
            self._exchange = Exchange(self.codec, coll, OPS, reduction="sra", memory=self._memory,
                                      prefix=self._prefix, reuse_result=True)
        ex = self._exchange
        ex.traffic.reset()
        pending = []
        for b, ps in zip(self.buckets, self._bucket_params):
            flat = self._flat_momenta.get(b.name)
            if flat is None:
                flat = self._flat_momenta[b.name] = torch.empty(b.numel, device=ps[0].device)
            for i, p, a, z in zip(b.members, ps, b.offsets, b.offsets[1:]):
                self._momentum(p, grads[i], flat[a:z].view_as(p))
            pending.append(ex.start(b.name, flat, step=t, header=b.header))
        for b, ps, out in zip(self.buckets, self._bucket_params, ex.finish_all(pending)):
            for p, a, z in zip(ps, b.offsets, b.offsets[1:]):     # the average into the momentum
                torch.mul(out[a:z].view_as(p), 1.0 / coll.size, out=self.state[p]["exp_avg"])
        traffic.add(ex.traffic)

    def _update(self, p, g, t):
        """Adam's update, as torch.optim.Adam(foreach=False) writes it. Up to the freeze ``g`` is the
        averaged gradient; after it the momentum was exchanged already and the variance stays."""
        group, state = self._group[p], self.state[p]
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        state["step"] = t
        if wd and group["decoupled_weight_decay"]:
            p.mul_(1 - lr * wd)
        if t <= self.freeze_step:
            if wd and not group["decoupled_weight_decay"]:
                g = g.add(p, alpha=wd)
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
        if group.get("bias_correction", True):     # (absent from torch.optim.Adam's groups)
            bc1, bc2 = 1 - b1 ** t, 1 - b2 ** min(t, self.freeze_step)
        else:
            bc1 = bc2 = 1.0
        p.addcdiv_(m, self._denominator(p, v, bc2, eps, frozen=t > self.freeze_step), value=-lr / bc1)

    def _denominator(self, p, v, bc2, eps, frozen):
        """``sqrt(v / bc2) + eps``. Once the variance is frozen it is kept (one more parameter-sized
        buffer) until ``v``, ``bc2`` or ``eps`` change: three of the step's passes over memory fewer.
        ``v._version`` counts in-place writes (a broadcast into the state, for one)."""
        if not frozen:
            return (v.sqrt() / bc2 ** 0.5).add_(eps)
        key = (v.data_ptr(), v._version, bc2, eps)
        kept = self._denominators.get(p)
        if kept is None or kept[0] != key:
            kept = self._denominators[p] = (key, (v.sqrt() / bc2 ** 0.5).add_(eps))
        return kept[1]

    # -- traffic and state ----------------------------------------------------------------------------
    def bytes_per_step(self):
        """This rank's bytes sent in the last step beside an fp32 ring allreduce's (a ``Traffic``)."""
        return self.last_traffic

    @property
    def frozen(self):
        """True once the variance is frozen (the next step exchanges the momentum in 1 bit)."""
        return max((int(self.state[p]["step"]) for p in self._params), default=0) >= self.freeze_step

    def state_dict(self):
        state = super().state_dict()
        worker, server = save_residuals(self._memory, self.buckets, lambda t: t.detach().clone())
        state[_STATE_KEY] = {"freeze_step": self.freeze_step, "codec": self.codec.spec(),
                             "worker_residuals": worker, "server_residuals": server}
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        ours = state_dict.pop(_STATE_KEY, None)
        super().load_state_dict(state_dict)
        self._memory.clear()
        self._denominators.clear()
        if ours is not None:
            device = self._params[0].device if self._params else torch.device("cpu")
            restore_residuals(self._memory, self.buckets, dict(ours["worker_residuals"]),
                              dict(ours["server_residuals"]),
                              lambda ts: torch.cat([t.detach().reshape(-1).to(device, torch.float32)
                                                    for t in ts]))
