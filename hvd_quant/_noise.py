"""The keys of stochastic rounding: an integer mix of (seed, rank, name hash) xor k, and fresh seeds.
Every encode kernel first finishes its key with one more mix, then hashes it with each element's index
into one uniform per element (``numba_kernels._scalar``).
"""
import os
import random

from numba_kernels._scalar import mix64_py
from numba_kernels.wire import MASK64

_SEED_SALT = 0x6A09E667F3BCC908


def noise_base(seed, rank, name_hash):
    """The part of :func:`noise_key` that stays fixed for one name on one rank (computed once)."""
    h = mix64_py((seed ^ _SEED_SALT) & MASK64)
    h = mix64_py(h ^ (rank & MASK64))
    return mix64_py(h ^ name_hash)


def noise_key(seed, k, rank, name_hash):
    """The 64-bit key of stochastic rounding that encodes take (they finish it with one more mix); ``k``
    counts draws for the same name (a direct ``Codec.encode``'s call count, the exchange's training
    step: docs/CODECS.md, "Noise and seeds")."""
    return noise_base(seed, rank, name_hash) ^ (k & MASK64)


_FRESH = random.Random(os.urandom(32))
os.register_at_fork(after_in_child=lambda: _FRESH.seed(os.urandom(32)))


def fresh_seed():
    """64 fresh random bits (the base of unseeded stochastic rounding): a generator seeded from OS
    entropy at import and again in every forked child, so processes never share a stream."""
    return _FRESH.getrandbits(64)
