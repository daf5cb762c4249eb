"""``hvd_quant.torch.fsdp_reduce_scatter``: the codecs for FSDP2 (``torch.distributed.fsdp.fully_shard``).

In backward FSDP2 copies the gradients of each sharded module into one flat buffer of N equal rank
chunks (chunk r: the shard rank r keeps) and hands it to the module's reduce-scatter comm, which
leaves the mean (``ReduceOp.AVG``) or sum of chunk r on rank r. ``FSDPModule.
set_custom_reduce_scatter(comm)`` replaces that comm; this one runs the first phase of the exchange's
SRA alone (``Exchange.start``, then the sum of this rank's chunk), with ``torch.distributed`` collectives:

1. chunks whose length is not a whole number of the codec's buckets are copied into a buffer with
   each chunk padded by zeros to one, so that the exchange's chunk bounds are FSDP's;
2. with error feedback, this rank's residual of the module (``Memory.WORKER``, keyed by the module's
   name) is added, and the new one kept;
3. chunk j is encoded and the alltoall sends it to rank j;
4. rank r decodes the N payloads of its chunk and sums them in rank order, in float32, then writes
   the sum, or the sum / N, into FSDP's output (cast to its dtype).

Each rank sends (N-1)/N * payload(n), half of a compressed allreduce: the reduced shard is not
requantized, since no other rank needs it. Warm-up calls and codecs the collectives can sum
themselves (``none``) take torch's own ``reduce_scatter_tensor``.
"""
import torch
import torch.distributed as dist

from .. import plan as _plan
from ..codecs import resolve_codec
from ..exchange import _FIRST_PHASE, AVERAGE, Exchange, Memory, handshake_record, is_passthrough_codec
from ._backend import OPS
from .ddp import collectives

__all__ = ["fsdp_reduce_scatter", "FSDPCommState"]

_PREFIX = "hvdq.fsdp"


class _ReduceScatter:
    """What ``FSDPModule.set_custom_reduce_scatter`` takes (torch's ``ReduceScatter`` interface), for
    the module named ``name``: ``allocate`` and the reduce-scatter call."""

    def __init__(self, state, name):
        self.state, self.name = state, name

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.state.reduce_scatter(self.name, output_tensor, input_tensor, group, op)
        return None


class FSDPCommState:
    """The compressed reduce-scatter's state (module doc), made by :func:`fsdp_reduce_scatter`: the
    exchange, the error-feedback residuals and each module's count of reduce-scatters.

    ``state_dict()`` holds ``codec`` (its spec), ``steps`` (reduce-scatters done, by module name: the
    warm-up and the noise key) and ``residuals`` (this rank's, by module name); every rank saves its
    own, and ``load_state_dict()`` restores it.
    """

    def __init__(self, config):
        self.config, self.codec = config, config.codec
        self.memory = Memory(OPS) if config.error_feedback else None
        self.steps = {}             # module name -> reduce-scatters done
        self._exchanges = {}        # process group -> Exchange

    def comm(self, name):
        """The reduce-scatter comm of the module named ``name`` (names key residuals and headers)."""
        return _ReduceScatter(self, name)

    def _exchange(self, group):
        ex = self._exchanges.get(group)
        if ex is None:
            ex = self._exchanges[group] = Exchange(self.codec, collectives(group), OPS, reduction="sra",
                                                   memory=self.memory, prefix=_PREFIX)
        return ex

    def reduce_scatter(self, name, output, input, group, op):
        """Reduce-scatter ``input`` (N chunks of ``output.numel()``) into ``output`` (module doc)."""
        step = self.steps.get(name, 0)
        self.steps[name] = step + 1
        if op not in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
            raise ValueError(f"hvd_quant: fsdp_reduce_scatter takes ReduceOp.AVG or SUM, FSDP asked for {op}: "
                             f"leave the gradient divide factor at its default")
        if step < self.config.warmup_steps or is_passthrough_codec(self.codec):
            dist.reduce_scatter_tensor(output, input, op=op, group=group)
            return
        ex = self._exchange(group)
        size, each = ex.coll.size, output.numel()
        padded = -(-each // ex.align) * ex.align
        if padded == each and input.dtype == torch.float32:
            flat = input.reshape(-1)
        else:
            flat = torch.zeros(size, padded, dtype=torch.float32, device=input.device)
            flat[:, :each].copy_(input.reshape(size, each))
            flat = flat.reshape(-1)
        exchange_name = f"{_PREFIX}.{name}"
        record = None
        if step == self.config.warmup_steps:     # the first compressed call: check every rank's setup
            record = handshake_record(f"fsdp_reduce_scatter {name} {self.codec.spec()} N={size} "
                                      f"numel={flat.numel()} ef={self.memory is not None}")
        p = ex.start(exchange_name, flat, step=step, record=record)
        # SRA's first phase alone: this rank's chunk summed over ranks, never requantized nor gathered
        _FIRST_PHASE.pop(id(p), None)
        data, own = ex._scattered(p), p.setup.own
        out = OPS.empty(own.b - own.a, flat)
        if own.b > own.a:
            ex._sum_own(p, data, out)
        out = out[:each]
        if op == dist.ReduceOp.AVG:
            out.mul_(1.0 / size)
        output.copy_(out.reshape(output.shape))

    def state_dict(self):
        residuals = {}
        if self.memory is not None:
            residuals = {k[len(_PREFIX) + 1:]: v.detach().clone() for k, v in self.memory.items(Memory.WORKER)}
        return {"codec": self.codec.spec(), "steps": dict(self.steps), "residuals": residuals}

    def load_state_dict(self, state):
        """Restore :meth:`state_dict`'s output; residuals move to the gradients' device at their next use."""
        if state.get("codec", self.codec.spec()) != self.codec.spec():
            raise ValueError(f"hvd_quant: the saved FSDP state is of codec {state['codec']!r}, this one's "
                             f"{self.codec.spec()!r}")
        self.steps = {k: int(v) for k, v in state.get("steps", {}).items()}
        if self.memory is not None:
            self.memory.clear()
            for k, v in state.get("residuals", {}).items():
                self.memory.set(Memory.WORKER, f"{_PREFIX}.{k}", v.detach().clone())


def fsdp_reduce_scatter(model, codec, error_feedback=None, warmup_steps=0):
    """Compress the gradient reduce-scatter of every FSDP2 module in ``model`` (``fully_shard``
    applied to it and its submodules): each gets ``state.comm(name)`` through
    ``set_custom_reduce_scatter``, ``name`` its qualified name in ``model``. Returns the
    :class:`FSDPCommState` (module doc). No Horovod needed.

    Arguments:
        codec: an hvd_quant codec or its spec string (``"qsgd:bits=4,bucket_size=512"``).
        error_feedback: keep each rank's quantization residual per module (default: what the codec
            wants).
        warmup_steps: torch's own reduce-scatter for this many first backward passes.

    The shards are averaged with the codec's error: biased as the codec is (``docs/CODECS.md``). Every
    rank must pass the same arguments (else every rank raises ``ConfigMismatchError`` at the first
    compressed step). FSDP's mixed precision may set ``reduce_dtype``; a custom gradient divide
    factor is refused (``ValueError``).

    Example (``torchrun --nproc_per_node 2 train.py``)::

        dist.init_process_group("gloo")
        for layer in net.layers:
            fully_shard(layer)
        fully_shard(net)
        state = hvd_quant.torch.fsdp_reduce_scatter(net, "qsgd:bits=4,bucket_size=512")
    """
    from torch.distributed.fsdp import FSDPModule

    config = _plan.configure(resolve_codec(codec), warmup_steps=warmup_steps, error_feedback=error_feedback,
                             op=AVERAGE)
    state = FSDPCommState(config)
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(state.comm(name))
    return state
