"""Error-feedback memory: the quantization residual of each tensor, kept by name.

Error feedback (Seide et al. 2014; Karimireddy et al. 2019, EF-SignSGD) adds back what the last
quantization lost before quantizing again, so the error does not accumulate over steps:

    1. compensated = gradient + residual[name]
    2. payload     = encode(compensated)
    3. residual[name] = compensated - decode(payload)      # from this rank's own payload

The exchange (``hvd_quant/exchange.py``) calls :meth:`Memory.compensate`, :meth:`Memory.buffer` and
:meth:`Memory.set`. Residuals are framework tensors on the gradient's device; :meth:`state_dict`
returns copies (saved with the optimizer, ``hvd.elastic.TorchState`` included) and
:meth:`load_state_dict` restores them bit-exactly, moved to the gradient's device on first use.
Always on for ``OneBit(error_feedback=True)``; optional for QSGD.
"""

__all__ = ["Memory"]


class Memory:
    """Residuals keyed by tensor (or bucket) name. ``ops`` is the frontend's
    :class:`hvd_quant.exchange.ArrayOps` table."""

    def __init__(self, ops):
        self.ops = ops
        self._residuals = {}

    def __contains__(self, name):
        return name in self._residuals

    def __len__(self):
        return len(self._residuals)

    def names(self):
        return list(self._residuals)

    def get(self, name, default=None):
        return self._residuals.get(name, default)

    def _fetch(self, name, numel, like):
        res = self._residuals.get(name)
        if res is None:
            return None
        if self.ops.numel(res) != numel:
            raise ValueError(f"hvd_quant: the error-feedback residual for {name!r} has "
                             f"{self.ops.numel(res)} elements, the tensor {numel}: the model or the "
                             f"bucketing changed since it was saved")
        res = self.ops.to_like(res, like)
        self._residuals[name] = res
        return res

    def compensate(self, name, flat):
        """Step 1: ``flat + residual`` (in place where the framework allows; use the return value)."""
        res = self._fetch(name, self.ops.numel(flat), flat)
        return flat if res is None else self.ops.add_(flat, res)

    def buffer(self, name, numel, like):
        """A float32 buffer of ``numel`` elements to decode into for step 3 (the old residual, reused)."""
        res = self._fetch(name, numel, like)
        return self.ops.empty(numel, like) if res is None else res

    def set(self, name, residual):
        """Step 3: store ``compensated - decoded``."""
        self._residuals[name] = residual

    def clear(self):
        self._residuals.clear()

    def state_dict(self):
        """``{name: residual copy}``; tensors, so ``torch.save`` and ``copy.deepcopy`` keep them exactly."""
        return {k: self.ops.clone(v) for k, v in self._residuals.items()}

    def load_state_dict(self, state):
        self._residuals = {k: self.ops.clone(v) for k, v in dict(state).items()}
