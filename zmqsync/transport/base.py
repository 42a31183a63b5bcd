"""The transport contract: move ordered lists of byte buffers between a hub and spokes.

A fleet has one **hub** (the sender's end) and many **spokes** (one per worker). A
transport knows nothing of versions, models or acks: it moves ``list[Buffer]`` messages,
whole and in order per peer, and says who sent what. What a message is for, it is told
by its sender (``stream=``, ``ack=``), never reads.

Contract, for every adapter (``zmqsync.testing.check_transport`` tests it):

- ``send_frames(frames)`` sends one message. It never blocks longer than the
  transport's own short send timeout; a message a peer cannot take right now (gone, or
  its queue full) is dropped for that peer, silently: the sync layer above notices the
  missing ack and repairs it.
- Hub ``send_frames(frames, to=None)`` fans out to every connected spoke (a hub that
  :class:`AdmitsPeers`: to every admitted one); ``to=[peer, ...]`` sends to exactly
  those peers, over the transport's reliable addressed path. ``stream=`` marks a
  version's chunks (see :class:`Stream`): a hub that queues may drop the queued chunks
  of older versions once a newer one starts.
- Spoke ``send_frames(frames, ack=True)`` says the message is an ack: it may travel on
  the hub's ack channel, where the hub receives it with ``peer=None``.
- ``recv_frames(timeout)`` returns the next message, or ``None`` when ``timeout``
  seconds pass first (``0`` polls, ``None`` waits until ``wake()`` or a message). A
  hub's messages come as :class:`Incoming` with the sender's ``peer`` id.
- Received buffers belong to the caller; they never alias the sending side's memory
  once the send has completed... except over ``inproc``, where they may, and where the
  hub lends memory (:class:`Lends`), whose read-only views it rewrites only once
  released: which is why receivers always copy before keeping anything.
- Whatever a stranger sends, a hub keeps nothing per peer for it: anyone who can
  connect may send a message, and the hub passes it up with its ``peer`` id. What a
  hub keeps per peer (whom a fan-out goes to, leases on lent memory), it keeps for the
  ends its caller gave it (a pipe, an actor, an in-process spoke), or for the peers the
  layer above admitted (:class:`AdmitsPeers`: the sender does with each Welcome) until
  told they left (:class:`ForgetsPeers`): never more than the sender keeps sessions.
  A hub is told who is admitted; it never reads a message to find out.
- A hub's ``wake()`` is the only method that may be called from another thread: it
  makes a blocked ``recv_frames`` return ``None`` promptly.
- ``close()`` is idempotent and never waits on a dead peer (linger 0). Any other call
  after it raises :class:`~zmqsync.errors.TransportClosed`.
- Backend errors are raised as :class:`~zmqsync.errors.TransportError`, chained.

Abilities some adapters have beyond that are the small classes below (:class:`Waitable`,
:class:`Lends`, :class:`TracksPeers`, ...): an adapter declares each one it has by
subclassing it, and callers test for them with ``isinstance``.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias

from zmqsync.closing import ClosesOnExit
from zmqsync.protocol import Buffer

__all__ = [
    "HUB_ABILITIES",
    "RELAY_CREDENTIAL",
    "SPOKE_ABILITIES",
    "Ability",
    "AdmitsPeers",
    "Announces",
    "Borrows",
    "Counted",
    "Follows",
    "ForgetsPeers",
    "HubTransport",
    "Incoming",
    "Lends",
    "Peekable",
    "PeerId",
    "Recipients",
    "SpokeTransport",
    "Stream",
    "TracksPeers",
    "Waitable",
    "ZeroCopy",
    "counters",
    "has_input",
    "lost_peers",
    "reserved_workers",
]

#: How a hub that authenticates its peers names one allowed to act as a relay (to claim
#: the workers below it): its credential starts so. The keys given that role are the
#: hub's configuration (``CurveServer.relay_clients``); the sender only reads the name.
RELAY_CREDENTIAL: Final = "relay:"

#: Opaque id of a spoke as its hub sees it (a ZeroMQ routing id, a pipe index, ...).
PeerId = bytes
#: Whom a hub sends a message to: exactly these peers, or every spoke (``None``).
Recipients: TypeAlias = Collection[PeerId] | None


class Stream(enum.Enum):
    """A message's place in the stream of versions, as its sender says.

    A newer version supersedes the older ones: once a message marked START is sent, a
    hub that queues messages for a slow peer may drop the queued messages of older
    versions (those marked START or MORE). Unmarked messages are never dropped for that.
    """

    #: The first chunk of a version.
    START = "start"
    #: A later chunk of the version last started.
    MORE = "more"


@dataclass(frozen=True, slots=True)
class Incoming:
    """A message a hub received, and the peer to address a reply to (if any).

    ``credential``: who the peer proved to be, as the hub's authentication names it
    (with CURVE: ``"relay:<key>"`` or ``"client:<key>"``, see :data:`RELAY_CREDENTIAL`);
    None where the hub authenticates nobody.
    """

    frames: list[Buffer] = field(repr=False)
    peer: PeerId | None = None
    credential: str | None = None


class _Closable(ClosesOnExit):
    @abc.abstractmethod
    def close(self) -> None:
        """Release every resource. Closing twice silently succeeds."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool: ...

    @property
    @abc.abstractmethod
    def endpoint(self) -> str:
        """Where the hub is: the address spokes connect to (a name where it has none)."""


class HubTransport(_Closable):
    """The sender's end: fans out to spokes, hears from each of them."""

    #: Short name shown in status ("zmq-pubsub", "memory", ...).
    name: str = "hub"
    #: Whether one ``send_frames(to=None)`` reaches every peer for the cost of one
    #: send (a PUB socket): a sender then sends one delta to all rather than one each.
    fans_out: bool = False

    @abc.abstractmethod
    def send_frames(
        self, frames: Sequence[Buffer], *, to: Recipients = None, stream: Stream | None = None
    ) -> None:
        """Send one message to every spoke (``to=None``) or exactly the given peers."""

    @abc.abstractmethod
    def recv_frames(self, timeout: float | None) -> Incoming | None:
        """The next message from any spoke, or ``None`` after ``timeout`` seconds."""

    @abc.abstractmethod
    def wake(self) -> None:
        """Thread-safe: make a blocked :meth:`recv_frames` return ``None`` now."""


class SpokeTransport(_Closable):
    """A worker's end: hears the hub's fan-out and addressed messages, talks back."""

    name: str = "spoke"

    @abc.abstractmethod
    def send_frames(self, frames: Sequence[Buffer], *, ack: bool = False) -> None:
        """Send one message to the hub (``ack``: it is an ack; see the module)."""

    @abc.abstractmethod
    def recv_frames(self, timeout: float | None) -> list[Buffer] | None:
        """The next message from the hub, or ``None`` after ``timeout`` seconds."""


# --- abilities -----------------------------------------------------------------------------
#
# An adapter declares each ability it has by subclassing it (trio's way), and callers test
# for it with ``isinstance``: a declaration, never a method's name, switches an ability on.
# Each ability's methods are abstract, so a class that declares one and lacks (or renamed)
# a method cannot be instantiated; ``zmqsync.testing.check_transport`` checks each declared
# ability's methods and behaviour besides.


# A common base names them all (HUB_ABILITIES, SPOKE_ABILITIES); its abstract methods are
# each ability's own.
class Ability(abc.ABC):  # noqa: B024
    """Base of the abilities: what a transport end may do beyond the contract."""

    __slots__ = ()


# --- abilities: hubs ----------------------------------------------------------------------


class Waitable(Ability):
    """A hub whose input can be waited for WITHOUT holding the hub (ZeroMQ's sockets).

    A hub's sockets are used by one thread at a time. With these, the thread that
    serves the hub between sends waits in ``poll()`` on :meth:`wait_handles` while
    holding nothing, so a sending thread takes the hub at once instead of waking that
    thread first. Readable means "look again" (ZeroMQ's descriptors are edge-like): the
    waiter then takes the hub and calls ``recv_frames(0)`` until it returns None, and
    whoever lets go of the hub checks :meth:`has_input` first and wakes the waiter if it
    says True. ``acks=False`` leaves out the ack channel (the sending thread reads acks
    itself). Both are called while holding the hub. Other hubs are served by a thread
    blocked in ``recv_frames``.
    """

    __slots__ = ()

    @abc.abstractmethod
    def wait_handles(self, *, acks: bool = True) -> list[int]:
        """The file descriptors to wait on."""

    @abc.abstractmethod
    def has_input(self, *, acks: bool = True) -> bool:
        """Whether a message is waiting."""


class Lends(Ability):
    """A hub that lends memory its peers read in place (shared-memory blocks).

    A sender then writes its snapshot into memory the hub lends and sends it as it is;
    the hub counts a lease per peer on it and reuses it only once every peer released it.
    """

    __slots__ = ()

    @abc.abstractmethod
    def lending(self) -> bool:
        """Whether this hub lends memory its peers on this host read in place (from the
        start, before any peer joined): the sender then carves its copies from
        :meth:`lend`; else it sends the model's own memory and keeps its snapshot apart."""

    @abc.abstractmethod
    def lend(self, nbytes: int) -> Any:
        """``nbytes`` of memory this hub's peers can read in place (a uint8 numpy array),
        or None. Frames that are read-only views of it are sent without a copy."""

    def unwritten(self, memory: Any) -> None:
        """``memory``, from :meth:`lend`, was never written and never will be: every
        peer took its version into tensors it lends (:meth:`ask_lent`). The hub then
        keeps no memory written for earlier versions that nobody reads. Nothing by
        default."""

    def copying(self) -> dict[PeerId, int]:
        """The peers this hub now sends copies to instead of leases (they still hold
        blocks they should have let go of: stopped, stuck), each with how many blocks
        it holds. None by default."""
        return {}

    def all_keep_versions(self) -> bool:
        """Whether every peer now keeps each version mapped until the next (workers
        in the shared read-only mode say so): none copies a chunk out while the next is
        written, so a version gains nothing from going in many small chunks. False by
        default."""
        return False

    def takes_device(self, device: Any) -> bool:
        """Whether every peer reads versions lent on GPU ``device`` in place (its model
        lives on that GPU of this host: CUDA IPC). False by default."""
        return False

    def lend_device(self, nbytes: int, device: Any) -> Any:
        """``nbytes`` of memory on GPU ``device`` (a uint8 tensor) that frames are later
        sent from as they are, or None (by default: no hub lends device memory but those
        that lend shared memory)."""
        return None

    # --- lent tensors: peers that lend the memory their tensors lie in -----------------

    def lent_peers(self, layout: bytes) -> list[PeerId]:
        """The live peers whose tensors lie in memory they lend, laid out as versions
        of ``layout`` (a layout digest): the sender may write such a version straight
        into them (:meth:`ask_lent`). None by default."""
        return []

    def ask_lent(self, peer: PeerId, version: int, epoch: int, layout: bytes) -> None:
        """Ask ``peer`` whether the sender may write ``version`` into its lent tensors now
        (its answer comes from :meth:`take_gos`)."""

    def take_gos(self) -> list[tuple[PeerId, int, int, bool]]:
        """The answers to :meth:`ask_lent` that came since the last call, as ``(peer,
        version, epoch, ok)``; each wakes a :meth:`recv_frames` waiting meanwhile."""
        return []

    def lent_memory(self, peer: PeerId, nbytes: int) -> Any:
        """The memory ``peer`` lends (a writable uint8 numpy array of exactly ``nbytes``),
        mapped once; None if it lends none, or what it said of it does not hold (counted
        in ``counters()["lent_refused"]``: it is then sent versions the usual way)."""
        return None

    def written(
        self,
        peer: PeerId,
        version: int,
        epoch: int,
        ok: bool,
        metadata: bytes,
        unusable: bool = False,
    ) -> None:
        """Tell ``peer`` that ``version`` lies in its lent tensors (``ok``), or that
        nothing of it was written there (``unusable``: because the memory it lends could
        not be used)."""


class ZeroCopy(Ability):
    """A hub that copies small buffers unless told otherwise (pyzmq's threshold)."""

    __slots__ = ()

    @abc.abstractmethod
    def zero_copy_from(self, nbytes: int) -> None:
        """Send buffers of at least ``nbytes`` from the caller's memory, without a copy.

        A sender says this once, with the size below which it packs tensors together:
        what it does not pack, it wants sent zero-copy.
        """


class Announces(Ability):
    """A hub whose spokes need more addresses than its endpoint (see :class:`Follows`)."""

    __slots__ = ()

    @abc.abstractmethod
    def announce(self) -> dict[str, Any]:
        """The extra addresses (the sender puts them in its Welcome): JSON-ready."""


class TracksPeers(Ability):
    """A hub whose peers are fixed, known ends (a pipe, an actor) bound to worker ids."""

    __slots__ = ()

    @abc.abstractmethod
    def lost_peers(self) -> frozenset[PeerId]:
        """Peers known to be gone for good (a broken pipe, a dead actor): a sender stops
        waiting for them instead of waiting out its timeout."""

    @abc.abstractmethod
    def reserved_workers(self) -> frozenset[int]:
        """Worker ids bound to this hub's peers (a pipe's or an actor's index): a sender
        serving several hubs gives them to nobody else, even before they first speak."""


class AdmitsPeers(Ability):
    """A hub that keeps something per peer (whom a fan-out reaches, leases on shared
    memory) only for the peers the layer above admitted: anyone can connect and send,
    and what such a stranger sends is passed up and leaves nothing behind."""

    __slots__ = ()

    @abc.abstractmethod
    def peer_joined(self, peer: PeerId) -> None:
        """``peer`` is a worker now (the sender welcomed it): fan-outs reach it, and it
        may be offered what the hub keeps per peer, until :meth:`ForgetsPeers.peer_left`.
        Saying so again changes nothing."""


class ForgetsPeers(Ability):
    """A hub that keeps something per peer (leases on shared memory) until told."""

    __slots__ = ()

    @abc.abstractmethod
    def peer_left(self, peer: PeerId) -> None:
        """``peer`` said goodbye: forget what is kept for it. It may come back (a
        hello) as a new peer."""


# --- abilities: spokes --------------------------------------------------------------------


class Peekable(Ability):
    """A spoke that can tell cheaply that no message waits."""

    __slots__ = ()

    @abc.abstractmethod
    def has_input(self) -> bool:
        """False only when surely no message waits: a receiver that got a version asks
        this before reading again for a newer one, and a cheap no spares a read."""


class Borrows(Ability):
    """A spoke whose received buffers may be memory its hub lends (see :class:`Lends`).

    The receiver then lets go of a version's frames before acking it, and applies such
    versions in place; other spokes' versions are freed after the ack, off the sender's
    critical path.
    """

    __slots__ = ()

    @abc.abstractmethod
    def borrowed(self, buffers: Sequence[Buffer]) -> bool:
        """Whether these received buffers may be memory the hub lends."""

    def keep_versions(self) -> None:
        """Tell the hub this worker keeps each version's frames until the next version
        is in (its weights are views of them), so that a hub that holds back a version
        from a worker still reading the last one does not wait for it."""

    def take_device(self, device: Any) -> None:
        """Tell the hub this worker's model lives on GPU ``device``: versions the hub
        lends on that GPU come as device tensors, copied device to device. Nothing by
        default (the hub lends it no device memory)."""

    def lends_tensors(self) -> bool:
        """Whether this spoke can tell its hub of memory its tensors lie in
        (:meth:`lend_tensors`). False by default."""
        return False

    def lend_tensors(self, where: Any, layout: bytes) -> None:
        """Tell the hub the worker's tensors lie in memory it lends (``where``: a
        :class:`~zmqsync.transport.shm.lent.Where`, or None: it lends none any more),
        laid out as versions of ``layout``."""

    def answer(self, version: int, epoch: int, ok: bool) -> None:
        """Answer the hub's ask to write ``version`` into the lent tensors: ``ok``, the
        worker holds its lock until the hub says it is written."""


class Follows(Ability):
    """A spoke that connects the addresses its hub announced (see :class:`Announces`)."""

    __slots__ = ()

    @abc.abstractmethod
    def follow(self, announced: dict[str, Any]) -> None:
        """Use the addresses a hub announced in its Welcome (connect the data path)."""


# --- abilities: both ----------------------------------------------------------------------


class Counted(Ability):
    """An end that counts what happens at the transport's level."""

    __slots__ = ()

    @abc.abstractmethod
    def counters(self) -> dict[str, int]:
        """Counts such as rejected connections, dropped messages, frames read in place."""


#: The abilities a hub may declare, and a spoke.
HUB_ABILITIES: Final[tuple[type[Ability], ...]] = (
    Waitable,
    Lends,
    ZeroCopy,
    Announces,
    TracksPeers,
    AdmitsPeers,
    ForgetsPeers,
    Counted,
)
SPOKE_ABILITIES: Final[tuple[type[Ability], ...]] = (Peekable, Borrows, Follows, Counted)


def has_input(spoke: SpokeTransport) -> bool:
    """Whether a message may be waiting at ``spoke`` (False only when surely none is)."""
    return not isinstance(spoke, Peekable) or spoke.has_input()


def counters(end: HubTransport | SpokeTransport) -> dict[str, int]:
    """``end``'s counters, or none."""
    return end.counters() if isinstance(end, Counted) else {}


def lost_peers(hub: HubTransport) -> frozenset[PeerId]:
    """``hub``'s peers known to be gone (none where it cannot tell)."""
    return hub.lost_peers() if isinstance(hub, TracksPeers) else frozenset()


def reserved_workers(hub: HubTransport) -> frozenset[int]:
    """The worker ids ``hub`` binds to its peers (none where workers pick their own)."""
    return hub.reserved_workers() if isinstance(hub, TracksPeers) else frozenset()
