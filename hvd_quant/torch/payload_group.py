"""The payload groups' names where tests and tools import them from; they live in ``_backend``."""
from ._backend import GroupWork, PAYLOAD_GROUP, PayloadGroup, STORE_TIMEOUT_S  # noqa: F401
