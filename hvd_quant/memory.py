"""Error-feedback memory (docs/EXCHANGE.md, "Error feedback"): a rank's residuals, :attr:`Memory.WORKER`
by exchange name, :attr:`Memory.SERVER` (SRA's requantized chunk) by ``(exchange name, rank, size)``."""

__all__ = ["Memory"]


class Memory:
    """Residuals by namespace and key, on the frontend's :class:`hvd_quant.exchange.ArrayOps`."""

    WORKER = "worker"
    SERVER = "server"
    NAMESPACES = (WORKER, SERVER)

    def __init__(self, ops):
        self.ops = ops
        self._residuals = {ns: {} for ns in self.NAMESPACES}
        self._ready = {}        # (ns, key) -> (id, numel) of the residual last found right (size, device)

    def _ns(self, ns):
        try:
            return self._residuals[ns]
        except KeyError:
            raise ValueError(f"hvd_quant: unknown residual namespace {ns!r}; use Memory.WORKER or "
                             f"Memory.SERVER") from None

    def names(self, ns):
        return list(self._ns(ns))

    def items(self, ns):
        return list(self._ns(ns).items())

    def get(self, ns, key, default=None):
        return self._ns(ns).get(key, default)

    def _fetch(self, ns, key, numel, like):
        res = self._ns(ns).get(key)
        if res is None:
            return None
        if self._ready.get((ns, key)) == (id(res), numel):     # checked and moved: the steady state
            return res
        if self.ops.numel(res) != numel:
            raise ValueError(f"hvd_quant: the error-feedback residual for {key!r} ({ns}) has "
                             f"{self.ops.numel(res)} elements, the tensor {numel}: the model or the "
                             f"bucketing changed since it was saved")
        res = self.ops.to_like(res, like)
        self._residuals[ns][key] = res
        self._ready[(ns, key)] = (id(res), numel)
        return res

    def compensate(self, ns, key, flat):
        """Step 1: ``flat + residual`` (in place where the framework allows; use the return value)."""
        res = self._fetch(ns, key, self.ops.numel(flat), flat)
        return flat if res is None else self.ops.add_(flat, res)

    def current(self, ns, key, numel, like):
        """The residual itself (zeros if there is none yet), on ``like``'s device, for a kernel that
        adds it and then overwrites it in one pass; :meth:`set` it afterwards."""
        res = self._fetch(ns, key, numel, like)
        return self.ops.zeros(numel, like) if res is None else res

    def buffer(self, ns, key, numel, like):
        """A float32 buffer of ``numel`` elements to decode into for step 3 (the old residual, reused)."""
        res = self._fetch(ns, key, numel, like)
        return self.ops.empty(numel, like) if res is None else res

    def set(self, ns, key, residual):
        """Step 3: store ``compensated - decoded``."""
        d = self._ns(ns)
        if d.get(key) is not residual:
            self._ready.pop((ns, key), None)
        d[key] = residual

    def clear(self):
        self.load_state_dict({})

    def state_dict(self):
        """``{Memory.WORKER: {key: copy}, Memory.SERVER: {key: copy}}``; tensors, so ``torch.save``
        and ``copy.deepcopy`` keep them exactly."""
        return {ns: {k: self.ops.clone(v) for k, v in d.items()} for ns, d in self._residuals.items()}

    def load_state_dict(self, state):
        state = dict(state)
        self._ready.clear()
        self._residuals = {ns: {k: self.ops.clone(v) for k, v in dict(state.get(ns, {})).items()}
                           for ns in self.NAMESPACES}
