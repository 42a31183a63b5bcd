"""The transport contract: move ordered lists of byte buffers between a hub and spokes.

A fleet has one **hub** (the sender's end) and many **spokes** (one per worker). A
transport knows nothing of versions, models or acks: it moves ``list[Buffer]`` messages,
whole and in order per peer, and says who sent what.

Contract, for every adapter (``zmqsync.testing.check_transport`` tests it):

- ``send_frames(frames)`` sends one message. It never blocks longer than the
  transport's own short send timeout; a message a peer cannot take right now (gone, or
  its queue full) is dropped for that peer, silently: the sync layer above notices the
  missing ack and repairs it.
- Hub ``send_frames(frames, to=None)`` fans out to every connected spoke;
  ``to=[peer, ...]`` sends to exactly those peers, over the transport's reliable
  addressed path.
- ``recv_frames(timeout)`` returns the next message, or ``None`` when ``timeout``
  seconds pass first (``0`` polls, ``None`` waits until ``wake()`` or a message). A
  hub's messages come as :class:`Incoming` with the sender's ``peer`` id.
- Received buffers belong to the caller; they never alias the sending side's memory
  once the send has completed... except over ``inproc``, where they may, which is why
  receivers always copy before keeping anything.
- ``wake()`` is the only method that may be called from another thread: it makes a
  blocked ``recv_frames`` return ``None`` promptly.
- ``close()`` is idempotent and never waits on a dead peer (linger 0). Any other call
  after it raises :class:`~zmqsync.errors.TransportClosed`.
- Backend errors are raised as :class:`~zmqsync.errors.TransportError`, chained.
"""

from __future__ import annotations

import abc
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from zmqsync.protocol import Buffer

__all__ = ["HubTransport", "Incoming", "PeerId", "SpokeTransport"]

#: Opaque id of a spoke as its hub sees it (a ZeroMQ routing id, a pipe index, ...).
PeerId = bytes


@dataclass(frozen=True, slots=True)
class Incoming:
    """A message a hub received, and the peer to address a reply to (if any)."""

    frames: list[Buffer] = field(repr=False)
    peer: PeerId | None = None


class _Closable(abc.ABC):
    @abc.abstractmethod
    def close(self) -> None:
        """Release every resource. Closing twice silently succeeds."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool: ...

    def __enter__(self) -> _Closable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HubTransport(_Closable):
    """The sender's end: fans out to spokes, hears from each of them."""

    #: Short name shown in status ("zmq-pubsub", "memory", ...).
    name: str = "hub"
    #: Whether one ``send_frames(to=None)`` reaches every peer for the cost of one
    #: send (a PUB socket): a sender then sends one delta to all rather than one each.
    fans_out: bool = False

    @property
    @abc.abstractmethod
    def endpoint(self) -> str:
        """The address spokes connect to."""

    @abc.abstractmethod
    def send_frames(
        self, frames: Sequence[Buffer], *, to: Collection[PeerId] | None = None
    ) -> None:
        """Send one message to every spoke (``to=None``) or exactly the given peers."""

    @abc.abstractmethod
    def recv_frames(self, timeout: float | None) -> Incoming | None:
        """The next message from any spoke, or ``None`` after ``timeout`` seconds."""

    @abc.abstractmethod
    def wake(self) -> None:
        """Thread-safe: make a blocked :meth:`recv_frames` return ``None`` now."""

    def wait_handles(self, *, acks: bool = True) -> list[int] | None:
        """File descriptors to wait on WITHOUT holding the hub, or None.

        A hub's sockets are used by one thread at a time. With these, the thread that
        serves the hub between sends waits in ``poll()`` on them while holding nothing,
        so a sending thread takes the hub at once instead of waking that thread first.
        Readable means "look again" (ZeroMQ's descriptors are edge-like): the waiter
        then takes the hub and calls ``recv_frames(0)`` until it returns None, and
        whoever lets go of the hub checks :meth:`has_input` first and wakes the waiter
        if it says True. ``acks=False`` leaves out the ack channel (the sending thread
        reads acks itself). Call while holding the hub; hubs without such descriptors
        return None and are served by a thread blocked in ``recv_frames``.
        """
        return None

    def has_input(self, *, acks: bool = True) -> bool:
        """Whether a message is waiting (call while holding the hub; see
        :meth:`wait_handles`). ``acks=False``: leave out the ack channel."""
        return True

    def zero_copy_from(self, nbytes: int) -> None:
        """Send buffers of at least ``nbytes`` from the caller's memory, without a copy.

        A sender says this once, with the size below which it packs tensors together:
        what it does not pack, it wants sent zero-copy. Adapters that always copy (or
        never do) ignore it.
        """

    def shared_buffer(self, nbytes: int) -> Any:
        """``nbytes`` of memory this hub's peers can read in place (a uint8 numpy array),
        or None. Frames that are read-only views of it are sent without a copy.

        Hubs without shared memory do not override this; a sender then keeps its
        snapshot in memory of its own.
        """
        return None

    def shares_memory(self) -> bool:
        """Whether :meth:`shared_buffer` lends memory that peers read in place, now.

        A sender then writes its snapshot there and sends it as it is; otherwise it
        sends the model's own memory and keeps its snapshot apart.
        """
        return type(self).shared_buffer is not HubTransport.shared_buffer

    def announce(self) -> dict[str, Any]:
        """Extra addresses a spoke needs (the sender puts them in its Welcome)."""
        return {}

    def peer_left(self, peer: PeerId) -> None:
        """``peer`` said goodbye: forget what is kept for it (shared-memory holds). It
        may come back (a hello) as a new peer. Adapters that keep nothing per peer
        ignore it."""

    def lost_peers(self) -> frozenset[PeerId]:
        """Peers this hub knows are gone for good (a broken pipe, a dead actor).

        A sender stops waiting for a worker that is lost, instead of waiting out its
        timeout. Transports that cannot tell (ZeroMQ reconnects) report none.
        """
        return frozenset()

    def reserved_workers(self) -> frozenset[int]:
        """Worker ids bound to this hub's peers (a pipe's or an actor's index).

        A sender serving several hubs gives these ids to nobody else, even before
        their workers first speak. Hubs whose workers pick their own ids reserve none.
        """
        return frozenset()

    def counters(self) -> dict[str, int]:
        """Transport-level counts (rejected connections, dropped messages)."""
        return {}


class SpokeTransport(_Closable):
    """A worker's end: hears the hub's fan-out and addressed messages, talks back."""

    name: str = "spoke"
    #: True when received frames may be memory the hub lends (shared blocks it reuses
    #: once released): the receiver then lets go of a version's frames before acking it.
    #: Otherwise it acks first: freeing a large message (unmapping its pages) is then off
    #: the sender's critical path.
    lends_memory: bool = False

    @abc.abstractmethod
    def send_frames(self, frames: Sequence[Buffer]) -> None:
        """Send one message to the hub."""

    def lent(self, buffers: Sequence[Buffer]) -> bool:
        """Whether these received buffers may be memory the hub lends (see
        :attr:`lends_memory`): the receiver then lets go of them before it acks."""
        return self.lends_memory

    def has_input(self) -> bool:
        """Whether a message may be waiting: False only when surely none is.

        A receiver that got a version asks this before reading again for a newer one
        (only the newest is applied); a cheap no spares a read. Adapters that cannot
        tell cheaply keep this default.
        """
        return True

    @abc.abstractmethod
    def recv_frames(self, timeout: float | None) -> list[Buffer] | None:
        """The next message from the hub, or ``None`` after ``timeout`` seconds."""

    def follow(self, announced: dict[str, Any]) -> None:
        """Use the addresses a hub announced in its Welcome (connect the data path)."""

    def counters(self) -> dict[str, int]:
        """Transport-level counts on the worker's side (frames read in place, ...)."""
        return {}
