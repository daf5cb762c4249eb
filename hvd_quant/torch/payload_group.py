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

    Horovod 0.28.1 orders an allgather after what the host had queued on the default stream when its
    background thread allocated the output, and a dependent collective waits for its next cycle; a
    collective here is ordered after the bucket's encode alone, and the stream, not the host, waits
    for it (docs/EXCHANGE.md, "The reductions"). Their collectives match by order: ``first`` carries
    each bucket's first collective (started in plan order), ``second`` SRA's allgathers of the
    reduced chunks (in the order of the alltoalls, :meth:`~hvd_quant.exchange.Exchange.advance`).
    A route's first step in a world goes through Horovod instead: a kernel's first (lazy) load may
    wait for a collective spinning on the device, and ranks would wait for each other for ever.
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
        """The payload channel of one optimizer (``label``: its collective prefix) on ``device``, made
        now, NCCL communicators included; None where :data:`PAYLOAD_GROUP` has no backend for the
        device type or rank 0's ``HVD_QUANT_PAYLOAD_GROUP`` is ``0``. A blocking collective: call it
        where every rank comes to the same point with nothing of its step left waiting on this rank,
        never in a gradient hook. At world size 1 the store lives in this process. ``handshake``:
        called first, where no handshake has compared the ranks yet. A store that cannot be made or
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
    """A torch.distributed collective in flight (of a payload group, or ``ddp.collectives``'): its
    result ``out``, after ``post(out)`` where given. On CUDA the current stream waits for it, the
    host does not."""
    __slots__ = ("work", "out", "post")

    def __init__(self, work, out, post=None):
        self.work, self.out, self.post = work, out, post

    def wait(self):
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.post is not None:
            self.out, self.post = self.post(self.out), None
        return self.out
