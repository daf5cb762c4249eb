"""``reduction="two_level"`` of :class:`hvd_quant.exchange.Exchange`: the node's fp32 sum, the codec
across nodes on this rank's shard of it, the shards gathered inside the node (docs/EXCHANGE.md, "Two
levels"). :class:`TwoLevel` is registered in ``exchange.LEVELLED`` on import; the levels are the
nodes' Horovod process sets (:func:`node_levels`, a method of every ``Frontend``).
"""
import importlib
import os
import struct

from .exchange import LEVELLED, SUM, TWO_LEVEL, Exchange, Pending, Traffic, chunk_bounds

__all__ = ["TwoLevel", "node_levels", "node_ranks"]


class TwoLevel:
    """``reduction="two_level"`` of an :class:`Exchange` (module doc). The levels come from
    ``Collectives.levels()`` of the exchange's ``coll``, taken again when that changes (elastic).
    Across two nodes the shards go by allgather (SRA's bytes, one quantization and one round instead
    of two), across more by SRA. Error feedback: a bucket's worker residual stays bucket-sized in the
    exchange's memory, this rank's shard of it written, the rest zero (:class:`_ShardMemory`), so
    checkpoints keep per-tensor residuals; the server residual is keyed by the cross-node rank and size.
    """

    class Pending(Pending):
        """A bucket's two-level exchange: ``result`` the shard until it is done, then the sum;
        ``cross``: its shard's exchange across nodes."""
        __slots__ = ("header", "cross")

    def __init__(self, ex):
        self.ex = ex
        self.coll = self.local = self.cross = None
        self.traffic = {}          # name -> the Traffic of the node level, per step

    def levels(self):
        ex = self.ex
        if self.coll is not ex.coll:
            if ex.coll.levels is None:
                raise ValueError("hvd_quant: reduction='two_level' needs the nodes' process sets, "
                                 "which this frontend or process set does not provide")
            self.local, cross = ex.coll.levels()
            if ex.coll.rank == 0 and (self.local is None or cross is None):
                nodes, per = (1, ex.coll.size) if cross is None else (ex.coll.size, 1)
                print(f"hvd_quant: reduction='two_level' on {nodes} node(s) of {per} rank(s): "
                      + ("an fp32 allreduce, nothing compressed" if cross is None
                         else "the codec's exchange across nodes only"), flush=True)
            self.cross = None if cross is None else Exchange(
                ex.codec, cross, ex.ops, reduction="allgather" if cross.size == 2 else "sra",
                memory=None if ex.memory is None else _ShardMemory(ex.memory, ex.ops),
                prefix=ex.prefix, timing=ex._mark is not None)
            self.coll = ex.coll
            self.traffic = {}
        if self.cross is not None:
            self.cross.traffic = self.ex.traffic
        return self.local, self.cross

    def start(self, name, flat, step, record, header):
        local, _ = self.levels()
        p = self.Pending(name, None, step, flat, self.ex)
        p.record, p.header, p.cross = record, header, None
        if local is not None:
            p.handle = local.allreduce_async(flat, f"{self.ex.prefix}.node.{name}", SUM)
        else:
            p.result = flat
        return p

    def advance_ready(self, pendings):
        local, cross = self.local, self.cross
        for p in pendings:
            if p is not None and p.stage == "first" and (
                    local is None or (local.poll is not None and local.poll(p.handle))):
                self.advance(p)
        if cross is not None:
            cross.advance_ready([p.cross for p in pendings if p is not None and p.cross is not None])

    def advance(self, p):
        """Wait for the node's sum and start this rank's shard's exchange across nodes."""
        if p.stage != "first":
            return
        ex, local, cross = self.ex, self.local, self.cross
        numel = ex.ops.numel(p.like)
        whole = local is None or cross is None          # one level: no part to keep
        a, b = (0, numel) if whole else chunk_bounds(numel, local.size, ex.align)[local.rank]
        shard = p.result if local is None else ex.ops.slice(local.synchronize(p.handle), a, b)
        t = self.traffic.get(p.name)
        if t is None:
            t = self.traffic[p.name] = _node_traffic(numel, b - a, local, cross, ex.coll.size)
            if cross is not None and cross.memory is not None:
                cross.memory.bounds[p.name] = (a, b, numel)
        ex.traffic.add(t)
        if cross is not None:
            p.cross = cross.start(p.name, shard, step=p.step, record=p.record, header=p.header)
        p.result, p.handle, p.stage = shard, None, "second"

    def finish(self, p):
        """Finish the shard's exchange, then gather the node's shards: the float32 sum over ranks."""
        self.advance(p)
        ex, local, cross = self.ex, self.local, self.cross
        shard = p.result if cross is None else cross.finish(p.cross)
        out = shard
        if local is not None and cross is not None:
            numel = ex.ops.numel(p.like)
            a, b = chunk_bounds(numel, local.size, ex.align)[local.rank]
            out = ex.ops.zeros(numel, p.like)
            ex.ops.add_(ex.ops.slice(out, a, b), shard)
            out = local.synchronize(local.allreduce_async(out, f"{ex.prefix}.gather.{p.name}", SUM))
        p.result, p.stage, p.like, p.cross = out, "done", None, None
        return out


def _node_traffic(numel, shard, local, cross, size):
    """What the node level adds to a step's Traffic beside the cross-node exchange's own count: its
    two fp32 ring allreduces, and the rest of the flat ring allreduce's bytes."""
    t = Traffic()
    n_local = 1 if local is None else local.size
    n_cross = 1 if cross is None else cross.coll.size
    t.sent_bytes = (2 if cross is not None else 1) * 2.0 * (n_local - 1) / n_local * 4 * numel
    t.fp32_bytes = 2.0 * (size - 1) / size * 4 * numel - 2.0 * (n_cross - 1) / n_cross * 4 * shard
    t.numel = numel - (shard if cross is not None else 0)
    return t


class _ShardMemory:
    """The memory the cross-node exchange of :class:`TwoLevel` sees: server residuals as they are;
    the worker residual of ``name`` is this rank's shard of the bucket-sized residual kept in
    ``memory`` (zeros outside it), written in place."""
    WORKER, SERVER = "worker", "server"

    def __init__(self, memory, ops):
        self.memory, self.ops = memory, ops
        self.bounds = {}            # name -> (start, stop, bucket numel): this rank's shard

    def shard(self, key, like):
        a, b, n = self.bounds[key]
        full = self.memory.current(self.WORKER, key, n, like)
        self.memory.set(self.WORKER, key, full)
        return self.ops.slice(full, a, b)

    def compensate(self, ns, key, flat):
        if ns == self.SERVER:
            return self.memory.compensate(ns, key, flat)
        return self.ops.add_(flat, self.shard(key, flat))

    def buffer(self, ns, key, numel, like):
        return self.memory.buffer(ns, key, numel, like) if ns == self.SERVER else self.shard(key, like)

    def current(self, ns, key, numel, like):
        return self.memory.current(ns, key, numel, like)

    def set(self, ns, key, residual):
        if ns == self.SERVER:
            self.memory.set(ns, key, residual)


LEVELLED[TWO_LEVEL] = TwoLevel


def node_levels(frontend, process_set, probe=False):
    """``Collectives.levels`` of the global set (``Frontend.node_levels``): ``(local, cross)``, the
    Collectives of this rank's node and of the ranks with its local rank, one per node; the global
    set's where a level spans every rank, None where it has one. The process sets are those
    registered at ``hvd.init(process_sets=...)``, else added here (every rank at once, in the same
    order) where Horovod allows it (``hvd.init(process_sets="dynamic")``). ``probe``
    (``reduction="auto"``): ``(None, None)`` unless the nodes are alike with several ranks each and
    their process sets can be had, decided alike on every rank and with no collective where
    Horovod's own layout already rules two levels out."""
    hvd = frontend.hvd()
    coll = frontend.collectives(process_set)
    if process_set.process_set_id != 0:
        raise ValueError("hvd_quant: reduction='two_level' runs on Horovod's global process set only")
    if probe:
        basics = importlib.import_module(f"{frontend.horovod}.mpi_ops")._basics
        if not (basics.is_homogeneous() and 1 < hvd.local_size() < hvd.size()):
            return None, None
        try:
            return node_levels(frontend, process_set)
        except ValueError:
            return None, None
    key = (coll.size, coll.rank)
    known = vars(frontend).get("_levels")          # ((size, rank), levels) of the last world
    if known is not None and known[0] == key:
        return known[1]
    me = struct.pack("<3i", hvd.cross_rank(), hvd.local_rank(), hvd.local_size())
    ops = frontend.ops
    data = ops.to_bytes(coll.synchronize(coll.allgather_async(ops.from_bytes(me), "hvdq.nodes")))
    nodes = node_ranks([struct.unpack_from("<3i", data, 12 * r) for r in range(coll.size)])
    made = {}
    for ranks in nodes + [list(c) for c in zip(*nodes)]:     # the same order on every rank
        if 1 < len(ranks) < coll.size:
            made[tuple(ranks)] = _process_set(frontend, ranks)
    node = next(n for n in nodes if coll.rank in n)

    def level(ranks):
        if len(ranks) in (1, coll.size):
            return None if len(ranks) == 1 else coll
        return frontend.collectives(made[tuple(ranks)])
    levels = (level(node), level([n[node.index(coll.rank)] for n in nodes]))
    frontend._levels = (key, levels)
    return levels


def _process_set(frontend, ranks):
    hvd = frontend.hvd()
    basics = importlib.import_module(f"{frontend.horovod}.mpi_ops")._basics
    for ps_id, members in basics._get_process_set_ids_and_ranks().items():
        if list(members) == list(ranks):
            ps = hvd.ProcessSet(ranks)
            ps.process_set_id = ps_id
            return ps
    if os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS") != "1":
        raise ValueError(
            f"hvd_quant: reduction='two_level' needs a Horovod process set of ranks {ranks}: call "
            f"hvd.init(process_sets='dynamic') (hvd_quant adds the nodes' sets), or register every "
            f"node's ranks and every local rank's ranks across nodes at hvd.init(process_sets=[...])")
    return hvd.add_process_set(ranks)


def node_ranks(rows):
    """The global ranks of each node, in local-rank order, from every rank's ``(cross rank, local
    rank, local size)`` (index: global rank). Raises ValueError where nodes hold different numbers
    of ranks (reduction="two_level" pairs local rank l of every node)."""
    sizes = {r[2] for r in rows}
    nodes = {}
    for g, (cross, local, _) in enumerate(rows):
        nodes.setdefault(cross, {})[local] = g
    if len(sizes) != 1 or any(sorted(n) != list(range(len(n))) or len(n) != rows[0][2] for n in nodes.values()):
        per = {c: len(n) for c, n in sorted(nodes.items())}
        raise ValueError(f"hvd_quant: reduction='two_level' needs the same number of ranks on every "
                         f"node; ranks per node (by cross rank): {per}")
    return [[n[i] for i in range(len(n))] for _, n in sorted(nodes.items())]
