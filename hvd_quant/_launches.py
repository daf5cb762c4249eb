"""What direct codec calls keep between calls, per thread: the call counts of seeded encodes
and the prepared kernel launches (each writes its parameter buffer and scratch on every call, so a
thread never shares one).
"""
import threading
import weakref

from ._arrays import status_for


class _ThreadState(threading.local):
    """What direct :meth:`Codec.encode` / :meth:`Codec.decode_into` calls keep between calls, one per
    thread, so that the codec stays an immutable value and threads never share it:

    * ``calls``: id(codec) -> (weak reference to the codec, {name hash: seeded encodes so far}): the
      ``k`` of :func:`noise_key` counts one codec object's encodes of a name on this thread;
    * ``launches``: prepared kernel launches; each writes its parameter buffer (and, on a device,
      its scratch) on every call, so each thread prepares its own."""

    def __init__(self):
        self.calls = {}
        self.launches = {}


_THREAD = _ThreadState()


def _direct_count(codec, nh):
    """How many direct encodes ``codec`` (this object) made for name hash ``nh`` on this thread
    before this one."""
    table = _THREAD.calls
    entry = table.get(id(codec))
    if entry is None or entry[0]() is not codec:        # new, or another object under a reused id
        if len(table) >= 1024:
            for key in [key for key, (ref, _) in table.items() if ref() is None]:
                del table[key]
        entry = table[id(codec)] = (weakref.ref(codec), {})
    calls = entry[1]
    k = calls.get(nh, 0)
    calls[nh] = k + 1
    return k


def _thread_launch(key, make, *args):
    """``make(*args)``, built once per ``key`` on this thread (:class:`_ThreadState`); the table is
    emptied when it holds 4096."""
    table = _THREAD.launches
    p = table.get(key, table)           # (the table itself: not built yet; None is a result)
    if p is table:
        if len(table) >= 4096:
            table.clear()
        p = table[key] = make(*args)
    return p


def _prepared_launch(codec, arrays, numel, accumulate):
    """This thread's prepared op of ``codec`` for ``numel`` elements on ``arrays``' device or the
    CPU (``Codec._bound_kernel``: the encode when ``accumulate`` is None); None where the generic
    path serves."""
    if not numel:
        return None
    return _thread_launch(("bound", codec, arrays, numel, accumulate), codec._bound_kernel, arrays, numel,
                          accumulate)


def _direct_encoder(codec, arrays, shape, dtype_name, name):
    """A direct ``encode``'s (name hash, payload bytes, header words, prepared launch
    ``f(x, payload, words, key, stream, residual)`` taking the adapter's device handles or NumPy
    arrays), or None (generic path); this thread's."""
    def make():
        nh, words, lay = codec.header_plan(shape, dtype_name, name)
        launch = _prepared_launch(codec, arrays, lay.numel, None)
        return None if launch is None else (nh, lay.total, words, launch)
    return _thread_launch(("encode", codec, arrays, shape, dtype_name, name), make)


def _device_decoder(codec, arrays, payload, numel, accumulate, name, expect):
    """A direct device ``decode_into``'s (payload bytes, bound launch ``f(payload, out)`` or None for
    the generic path), this thread's, per device (the launch reports to that device's status word of
    ``codec``)."""
    def make():
        exp = codec.expectation(numel, name) if expect is None else expect
        bound = None
        if numel and _prepared_launch(codec, arrays, numel, accumulate) is not None:
            bound = codec.bind_decode(arrays, numel, accumulate, exp, None,
                                      status=status_for(codec, arrays, payload))
        return codec.wire_nbytes(numel), bound
    key = ("decode", codec, arrays, arrays.device_key(payload), numel, accumulate, name, expect)
    return _thread_launch(key, make)


def _thread_op(codec, kind, device, numel, accumulate=None):
    """This thread's prepared op ``kind`` of ``codec`` for ``numel`` elements on a CUDA device or the
    CPU (``Codec._op``)."""
    return _thread_launch((kind, codec, device, numel, accumulate), codec._op, kind, device, numel, accumulate)
