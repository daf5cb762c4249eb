"""The payload groups of the PyTorch frontend: process groups of hvd_quant's own that carry an
optimizer's compressed payloads (:class:`PayloadGroup`)."""
import collections
import datetime
import os
import socket

import torch
import torch.distributed as dist

__all__ = ["PayloadGroup", "GroupWork", "PAYLOAD_GROUP", "STORE_TIMEOUT_S"]

# Device type -> torch.distributed backend of an optimizer's payload group (PayloadGroup.open); a
# device type not listed gathers through Horovod.
PAYLOAD_GROUP = {"cuda": "nccl"}
STORE_TIMEOUT_S = 120


class PayloadGroup:
    """hvd_quant's own torch.distributed process groups among a Horovod process set's ranks, for one
    optimizer's compressed payloads (:meth:`open`): the channel an
    :class:`~hvd_quant.exchange.Exchange` takes instead of Horovod's alltoall and allgather.

    Why: Horovod 0.28.1 allocates an allgather's output on its background thread and orders its GPU
    stream after an event recorded there on the device's default stream, the one training runs on
    (``TorchOpContext::AllocateOutput``); as the host runs ahead of the GPU, each allgather starts when
    backward reaches what the host had queued by then, not when its bucket is encoded. And a Horovod
    collective that depends on another waits for Horovod's next cycle, which SRA's second phase does
    at every bucket (docs/RESULTS.md, "Two GPUs, fourth session"). A collective of these groups, on an
    output allocated here on the caller's stream, is ordered after the bucket's encode and nothing
    else, and the stream, not the host, waits for its result. Made collectively (a TCP store on the
    set's rank 0, whose address, :func:`_store_host`, travels by Horovod broadcast). Two groups,
    because their collectives match by order: ``first`` carries each bucket's first collective (SRA's
    alltoall, the allgather reduction's allgather), which the caller starts in plan order on every
    rank; ``second`` carries SRA's allgathers of the reduced chunks, which the exchange starts in the
    order of the alltoalls (:meth:`~hvd_quant.exchange.Exchange.advance`), whenever each rank gets to
    them.

    A route's first step in a world goes through Horovod's collectives, not the groups (the
    optimizers' payload channel): with CUDA's lazy module loading (the default) a kernel's first
    launch may wait for every kernel running on the device, while a collective of these groups,
    started as soon as its bucket is encoded, spins until the peers start theirs; the two groups and
    Horovod's communicator start their collectives in orders that differ between ranks, so two ranks
    each loading a kernel, each with a collective spinning for the other, would wait forever
    (docs/RESULTS.md, "ResNet-50 with SRA hung on the payload groups"). Horovod's collectives start
    only when every rank has asked, in one order; after a route's first step its kernels are loaded.
    """

    def __init__(self, store, process_set, backend, device):
        self.store = store                  # rank 0 serves it for the group's lifetime
        self.size, self.rank = process_set.size(), process_set.rank()
        self.waiting = collections.deque()  # SRA exchanges in their first phase, in start order

        def group(prefix):
            sub = dist.PrefixStore(prefix, store)
            if backend == "nccl":
                # Horovod's NCCL streams have the device's greatest priority (cuda_operations.cc); at
                # the default priority a payload's kernels would queue behind backward's blocks
                return dist.ProcessGroupNCCL(sub, self.rank, self.size,
                                             dist.ProcessGroupNCCL.Options(is_high_priority_stream=True))
            return dist.ProcessGroupGloo(sub, self.rank, self.size)

        self.first, self.second = group("first"), group("second")
        # The first collective creates NCCL's communicator: a host call that blocks until every rank
        # joins. Here every rank is at the same point; in a gradient hook a rank would block there
        # while another waits in synchronize() for something this rank submits later.
        one = torch.zeros(1, device=device)
        for pg in (self.first, self.second):
            pg._allgather_base(one.new_empty(self.size), one).wait()
        if one.is_cuda:
            torch.cuda.current_stream(device).synchronize()

    @classmethod
    def open(cls, process_set, device, label, handshake=None):
        """The channel of an :class:`~hvd_quant.exchange.Exchange` for one optimizer's payloads on
        ``device`` (``label``: the optimizer's collective prefix), made now, its NCCL communicators
        included; None where :data:`PAYLOAD_GROUP` has no backend for the device type, or on every
        rank where rank 0's ``HVD_QUANT_PAYLOAD_GROUP`` is ``0`` (rank 0 decides, so the ranks
        cannot disagree). A collective (Horovod broadcast, the store, the groups' first
        allgathers): call it where every rank comes to the same point with nothing of its step left
        waiting on this rank (the optimizer's connection, beside its handshake; the stock path's
        first result of a taken-over step, after launching its complete buckets); made inside a
        gradient hook, it could wait for a rank that waits for this rank's next Horovod op. At world
        size 1 the exchange runs only where forced (``HOROVOD_ELASTIC=1``, the benchmarks' way to
        time it), and there it runs on the group as it does at size N. ``handshake``: called first,
        where no handshake has compared the ranks yet, so that ranks configured differently raise
        instead of waiting for each other under different labels. A store that cannot be made or
        reached raises on every rank, naming both variables."""
        backend = PAYLOAD_GROUP.get(device.type)
        if backend is None:
            return None
        if handshake is not None:
            handshake()
        import horovod.torch as hvd
        timeout = datetime.timedelta(seconds=STORE_TIMEOUT_S)
        name, size = f"{label}.payload_group", process_set.size()
        root = min(process_set.ranks) if process_set.ranks else 0   # the set's rank 0, as a global rank
        way_out = ("set HVD_QUANT_STORE_ADDR on rank 0 to an address of its host that every rank "
                   "reaches, or HVD_QUANT_PAYLOAD_GROUP=0 to carry the payloads through Horovod")
        on = os.environ.get("HVD_QUANT_PAYLOAD_GROUP", "1").strip() != "0"
        if size == 1:       # nobody to reach: a store in this process
            return cls(dist.HashStore(), process_set, backend, device) if on else None
        if process_set.rank() == 0:
            store = where = None
            if on:
                host = _store_host()
                try:
                    store = dist.TCPStore(host, 0, size, is_master=True, wait_for_workers=False,
                                          timeout=timeout)
                    where = (host, store.port)
                except Exception as e:  # noqa: BLE001 -- torch raises several kinds; tell every rank
                    where = f"rank 0 could not serve its payload group's store at {host} ({e}); {way_out}"
            hvd.broadcast_object(where, root_rank=root, process_set=process_set, name=name)
        else:
            where = hvd.broadcast_object(None, root_rank=root, process_set=process_set, name=name)
            if isinstance(where, tuple):
                try:
                    store = dist.TCPStore(*where, size, is_master=False, timeout=timeout)
                except Exception as e:  # noqa: BLE001
                    raise RuntimeError(f"hvd_quant: this rank could not reach rank 0's payload group "
                                       f"store at {where[0]}:{where[1]} ({e}); {way_out}") from e
        if isinstance(where, str):
            raise RuntimeError(f"hvd_quant: {where}")
        return None if where is None else cls(store, process_set, backend, device)

    def allgather(self, t, each=None, total=None):
        """The concatenation of every rank's ``t`` in rank order, as a handle, on ``first``: the
        allgather reduction's payloads, of equal lengths. With ``each`` (bytes), on ``second``: SRA's
        reduced chunks, whose lengths differ (every chunk but the last nonempty one is ``each``
        long): each rank sends its chunk padded to ``each`` and the result is the first ``total``
        bytes, the chunks back to back (the padding falls after the last nonempty chunk)."""
        if each is None:
            out = t.new_empty(t.numel() * self.size)
            return GroupWork(self.first._allgather_base(out, t), out)
        if t.numel() != each:
            # the padding's bytes are never read (a copy, not a kernel: nothing loads while a
            # collective of these groups may spin, see the class doc)
            padded = t.new_empty(each)
            padded[:t.numel()].copy_(t)
            t = padded
        out = t.new_empty(each * self.size)
        return GroupWork(self.second._allgather_base(out, t), out[:total])

    def alltoall(self, t, splits):
        """Rank r receives piece r of every rank's ``t`` (``splits``: the pieces' lengths, the one
        for each rank equal on every rank), concatenated in rank order, as a handle; on ``first``."""
        mine = splits[self.rank]
        out = t.new_empty(mine * self.size)
        return GroupWork(self.first.alltoall_base(out, t, [mine] * self.size, list(splits)), out)


def _store_host():
    """An address of this host that the set's other ranks reach: ``HVD_QUANT_STORE_ADDR`` where set;
    else, under a Gloo launch, this host's address on the route to Horovod's rendezvous server (which
    every rank reaches); else the address of the host name."""
    addr = os.environ.get("HVD_QUANT_STORE_ADDR")
    if addr:
        return addr
    peer = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
    if peer:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))        # no packet is sent: this only picks the route
            return s.getsockname()[0]
    return socket.gethostbyname(socket.gethostname())


class GroupWork:
    """A collective of a payload group in flight (the Collectives handle its ``synchronize`` and
    ``poll`` take)."""
    __slots__ = ("work", "out")

    def __init__(self, work, out):
        self.work, self.out = work, out

    def wait(self):
        """The result; on CUDA the current stream waits for the collective, the host does not."""
        self.work.wait()
        return self.out
