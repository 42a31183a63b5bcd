"""What a receiver tells those who watch it take versions, and what it asks them.

A relay forwards each chunk as its receiver takes it, and acks upstream only once its own
workers hold the version: it registers a :class:`ReceiverObserver` with its
:class:`~zmqsync.receiver.WeightReceiver` rather than extending the receiver's class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from zmqsync.protocol import Chunk, WeightsSchema
from zmqsync.protocol.stream import Broken

__all__ = ["Observers", "PendingAck", "ReceiverObserver"]


@dataclass(frozen=True, slots=True)
class PendingAck:
    """An ack about to go upstream. ``applied``: the version is held (``version`` and
    ``epoch`` None: the one held now); else refused, for ``reason``."""

    applied: bool
    reason: str = ""
    version: int | None = None
    epoch: int | None = None


class ReceiverObserver(Protocol):
    """The contract of a receiver's observer (see
    :meth:`~zmqsync.receiver.WeightReceiver.add_observer`).

    Every call comes on the thread that handles the receiver's messages, with the
    receiver's transport held: an observer must not call back into the receiver's
    message handling (``poll``, ``receive``, ``connect``), and should return quickly.
    Subclass it to inherit the defaults below (each does nothing), or implement all.

    A version the receiver takes is seen as ``version_starting``, ``version_started``,
    ``chunk_arrived`` once per chunk, then either ``version_completed`` or
    ``version_broken``. A version not taken (a duplicate, a delta the receiver cannot
    apply, one that does not fit the model) is seen at most as ``version_starting``.
    """

    def version_starting(self, chunk: Chunk) -> None:
        """The first chunk of a version came, before the receiver prepares for it (its
        staging buffer still holds what it held)."""

    def version_started(self, chunk: Chunk) -> None:
        """The receiver takes the version ``chunk`` starts. Raising drops the version:
        the receiver lets it go whole and asks for it again with its next heartbeat."""

    def chunk_arrived(self, chunk: Chunk) -> None:
        """A chunk of the version being taken, before the receiver applies it (the
        first one too). ``chunk.payload`` is valid during the call only."""

    def version_completed(self, chunk: Chunk, schema: WeightsSchema) -> None:
        """The version ``chunk`` ends (its last chunk) is the receiver's now; ``schema``
        is its layout."""

    def version_broken(self, broken: Broken) -> None:
        """The version being taken will not complete (its stream broke, or the receiver
        followed another upstream)."""

    def review_ack(self, ack: PendingAck) -> PendingAck | None:
        """The ack to send for ``ack``: itself, another (an ack of a version held may say
        it was refused below), or None to hold it back (the observer sends it later
        with :meth:`~zmqsync.receiver.WeightReceiver.send_ack`)."""
        return ack

    def below(self) -> dict[str, Any]:
        """Workers the receiver speaks for, as its heartbeats name them: none."""
        return {}

    def wants_resend(self) -> bool:
        """Whether the upstream should send the version held again, whole: the
        receiver's heartbeats then say it does not hold it whole, and it takes it."""
        return False


class Observers(ReceiverObserver):
    """Every registered observer as one: the calls go to each in turn."""

    def __init__(self) -> None:
        self._all: list[ReceiverObserver] = []

    def add(self, observer: ReceiverObserver) -> None:
        self._all.append(observer)

    def version_starting(self, chunk: Chunk) -> None:
        for observer in self._all:
            observer.version_starting(chunk)

    def version_started(self, chunk: Chunk) -> None:
        for observer in self._all:
            observer.version_started(chunk)

    def chunk_arrived(self, chunk: Chunk) -> None:
        for observer in self._all:
            observer.chunk_arrived(chunk)

    def version_completed(self, chunk: Chunk, schema: WeightsSchema) -> None:
        for observer in self._all:
            observer.version_completed(chunk, schema)

    def version_broken(self, broken: Broken) -> None:
        for observer in self._all:
            observer.version_broken(broken)

    def review_ack(self, ack: PendingAck) -> PendingAck | None:
        reviewed: PendingAck | None = ack
        for observer in self._all:
            if reviewed is None:
                break
            reviewed = observer.review_ack(reviewed)
        return reviewed

    def below(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for observer in self._all:
            out.update(observer.below())
        return out

    def wants_resend(self) -> bool:
        return any(observer.wants_resend() for observer in self._all)
