"""What the adapters here share: an end's open or closed state, and the peers of a hub
whose peers are fixed ends bound to worker indices (a pipe's, an actor's)."""

from __future__ import annotations

import abc
import threading
from collections.abc import Mapping
from typing import Protocol

from zmqsync.errors import TransportClosed
from zmqsync.transport.base import PeerId, TracksPeers

__all__ = ["BoundEnd", "FixedPeers", "OpenEnd", "worker_index"]


class OpenEnd:
    """``endpoint``, ``closed`` and the check that an end is still open: a mixin, listed
    before :class:`~zmqsync.transport.base.HubTransport` or ``SpokeTransport``."""

    _endpoint: str
    _closed: bool

    @property
    def endpoint(self) -> str:
        return self._endpoint

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"{type(self).__name__} at {self.endpoint} is closed")


class BoundEnd(Protocol):
    """A hub's record of a peer bound to a worker index."""

    @property
    def index(self) -> int: ...

    @property
    def lost(self) -> str | None:
        """Why the peer is gone for good (a broken pipe, a dead actor), or None."""
        ...


class FixedPeers(TracksPeers):
    """:class:`~zmqsync.transport.base.TracksPeers` for a hub whose peers are fixed ends
    bound to worker indices: a mixin over its table of them, guarded by its ``_lock``
    (a hub that subclasses it declares that ability)."""

    _lock: threading.Lock

    @abc.abstractmethod
    def _bound(self) -> Mapping[PeerId, BoundEnd]:
        """Each peer's record, by peer id (the caller holds ``_lock``)."""

    def lost_peers(self) -> frozenset[PeerId]:
        """Peers known to be gone for good: their worker exited, or was killed."""
        with self._lock:
            return frozenset(pid for pid, end in self._bound().items() if end.lost is not None)

    def reserved_workers(self) -> frozenset[int]:
        """Each peer's worker index: it belongs to whoever holds that peer's end."""
        with self._lock:
            return frozenset(end.index for end in self._bound().values())


def worker_index(index: object) -> int:
    """``index`` if it is a worker index (a non-negative int); else ValueError."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"worker indices must be non-negative ints; got {index!r}")
    return index
