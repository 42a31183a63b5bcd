"""In-process transport over queues: for tests, docs and single-process setups.

``memory://NAME`` names a hub in this process; spokes connect to it by that name. Every
send copies its buffers (``bytes(...)``), so a receiver never aliases the sender's memory
and the sender may change its tensors as soon as ``send_frames`` returns.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Sequence
from typing import ClassVar

from zmqsync.errors import EndpointError
from zmqsync.protocol import Buffer
from zmqsync.transport.base import (
    HubTransport,
    Incoming,
    PeerId,
    Recipients,
    SpokeTransport,
    Stream,
)
from zmqsync.transport.ends import OpenEnd

__all__ = ["MemoryHub", "MemorySpoke"]

_WAKE = object()
_ids = itertools.count()


def _copy(frames: Sequence[Buffer]) -> list[Buffer]:
    return [bytes(f) for f in frames]


def _get(q: queue.Queue[object], timeout: float | None) -> object | None:
    try:
        if timeout is not None and timeout <= 0:
            return q.get_nowait()
        return q.get(timeout=timeout)
    except queue.Empty:
        return None


class MemoryHub(OpenEnd, HubTransport):
    """The hub end of an in-memory fleet."""

    name = "memory"
    _registry: ClassVar[dict[str, MemoryHub]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, endpoint: str | None = None) -> None:
        name = endpoint or f"memory://hub-{next(_ids)}"
        if not name.startswith("memory://"):
            raise EndpointError(f"a memory endpoint looks like 'memory://NAME'; got {name!r}")
        with self._registry_lock:
            if name in self._registry:
                raise EndpointError(f"{name} is already bound in this process; pick another name")
            self._registry[name] = self
        self._endpoint = name
        self._inbox: queue.Queue[object] = queue.Queue()
        self._spokes: dict[PeerId, MemorySpoke] = {}
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def lookup(cls, endpoint: str) -> MemoryHub | None:
        with cls._registry_lock:
            return cls._registry.get(endpoint)

    def _attach(self, spoke: MemorySpoke) -> None:
        with self._lock:
            self._spokes[spoke.peer_id] = spoke

    def _detach(self, spoke: MemorySpoke) -> None:
        with self._lock:
            self._spokes.pop(spoke.peer_id, None)

    def _deliver(self, frames: list[Buffer], peer: PeerId) -> None:
        if not self._closed:
            self._inbox.put(Incoming(frames, peer))

    def send_frames(
        self, frames: Sequence[Buffer], *, to: Recipients = None, stream: Stream | None = None
    ) -> None:
        self._check_open()
        with self._lock:
            spokes = (
                list(self._spokes.values())
                if to is None
                else [self._spokes[p] for p in to if p in self._spokes]
            )
        for spoke in spokes:
            spoke._inbox.put(_copy(frames))

    def recv_frames(self, timeout: float | None) -> Incoming | None:
        self._check_open()
        item = _get(self._inbox, timeout)
        return item if isinstance(item, Incoming) else None

    def wake(self) -> None:
        self._inbox.put(_WAKE)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._registry_lock:
            self._registry.pop(self._endpoint, None)
        self._inbox.put(_WAKE)


class MemorySpoke(OpenEnd, SpokeTransport):
    """A worker's end of an in-memory fleet."""

    name = "memory"

    def __init__(self, endpoint: str, *, identity: str = "", peer_id: PeerId | None = None) -> None:
        self._endpoint = endpoint
        self.peer_id = peer_id or f"memory-spoke-{identity}-{next(_ids)}".encode()
        self._inbox: queue.Queue[object] = queue.Queue()
        self._hub: MemoryHub | None = None
        self._closed = False
        self._connect()

    def _connect(self) -> MemoryHub | None:
        # Like ZeroMQ, a spoke may connect before its hub binds: it attaches when it can.
        if self._hub is None or self._hub.closed:
            hub = MemoryHub.lookup(self._endpoint)
            if hub is not None:
                hub._attach(self)
            self._hub = hub
        return self._hub

    def send_frames(self, frames: Sequence[Buffer], *, ack: bool = False) -> None:
        self._check_open()
        hub = self._connect()
        if hub is not None:
            hub._deliver(_copy(frames), self.peer_id)

    def recv_frames(self, timeout: float | None) -> list[Buffer] | None:
        self._check_open()
        self._connect()
        item = _get(self._inbox, timeout)
        return item if isinstance(item, list) else None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._hub is not None:
            self._hub._detach(self)
