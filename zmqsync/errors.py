"""Every exception zmqsync raises, in one tree.

::

    ZMQSyncError
    ├── FrameError (ValueError)          a peer sent bytes that are not a valid message
    ├── SchemaMismatchError (ValueError) weights that do not fit a model (key, dtype, shape)
    ├── EndpointError (ValueError)       an endpoint string we cannot use
    ├── CheckpointError (ValueError)     a checkpoint file missing, unreadable, not tensors
    ├── FactoryError (ValueError)        a module:factory that does not build a model
    ├── SyncTimeout (TimeoutError)       targeted workers did not ack in time
    ├── TornWeights (TimeoutError)       a forward pass waited on weights left half-written
    ├── WeightsRejected                  workers received a version and refused it
    └── TransportError                   the backend (ZeroMQ, a pipe, Ray) failed
        └── TransportClosed              you closed it, then used it

API misuse that torchrl's seeds specify as ``RuntimeError`` (``get_sender()`` before
``init_on_sender()``, a second ``send_async()`` while one is pending) stays a plain
``RuntimeError``, so code written against torchrl keeps catching what it caught.

Errors carry fields, not just text: ``SyncTimeout.missing_workers``,
``WeightsRejected.rejections``, ``SchemaMismatchError.key``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = [
    "CheckpointError",
    "EndpointError",
    "FactoryError",
    "FrameError",
    "SchemaMismatchError",
    "SyncTimeout",
    "TornWeights",
    "TransportClosed",
    "TransportError",
    "WeightsRejected",
    "ZMQSyncError",
]


class ZMQSyncError(Exception):
    """Base of every error zmqsync raises on purpose."""


class FrameError(ZMQSyncError, ValueError):
    """A list of buffers from a peer is not a valid zmqsync message.

    Raised by the decoder for anything malformed: wrong magic, unknown kind, a limit
    exceeded, a schema that does not match the buffers. Receivers catch it, count it,
    and keep running.
    """


class SchemaMismatchError(ZMQSyncError, ValueError):
    """Weights do not fit the model they should be applied to.

    ``key`` names the first offending tensor (``None`` when the problem is global, such
    as a strategy mismatch). Nothing was copied when this is raised.
    """

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class EndpointError(ZMQSyncError, ValueError):
    """An endpoint string that zmqsync cannot bind or connect."""


class CheckpointError(ZMQSyncError, ValueError):
    """A checkpoint file that is missing, unreadable, or holds something other than tensors."""


class FactoryError(ZMQSyncError, ValueError):
    """A ``module:factory`` spec that does not import, or does not build a model."""


class SyncTimeout(ZMQSyncError, TimeoutError):
    """Targeted workers did not acknowledge a version before the timeout.

    ``missing_workers`` lists their ids (sorted); ``version`` is the version that was
    being sent. For a rank of a sharded learner, ``missing_ranks`` lists the ranks
    whose parts of that version those workers still wait for (sorted; empty when they
    said none, or the learner has one rank). The sender stays usable after this error.
    """

    def __init__(
        self,
        message: str,
        *,
        missing_workers: Iterable[int] = (),
        version: int | None = None,
        transports: Mapping[int, str] | None = None,
        missing_ranks: Iterable[int] = (),
    ) -> None:
        super().__init__(message)
        self.missing_workers = sorted(missing_workers)
        self.version = version
        self.transports = dict(transports or {})
        self.missing_ranks = sorted(missing_ranks)


class TornWeights(ZMQSyncError, TimeoutError):
    """A version's stream broke while it was written into the model in place, and no
    repair came within the wait: the model holds parts of two versions, so no forward
    pass may run on it. ``version`` is the one that was being written."""

    def __init__(self, message: str, *, version: int = 0, reason: str = "") -> None:
        super().__init__(message)
        self.version = version
        self.reason = reason


class WeightsRejected(ZMQSyncError):
    """Workers received a version and refused to apply it.

    ``rejections`` maps each refusing worker id to the reason it gave.
    """

    def __init__(self, message: str, *, rejections: Mapping[int, str], version: int) -> None:
        super().__init__(message)
        self.rejections = dict(rejections)
        self.version = version


class TransportError(ZMQSyncError):
    """The transport backend failed; the original error is chained as ``__cause__``."""


class TransportClosed(TransportError):
    """The transport was closed by its owner and then used."""
