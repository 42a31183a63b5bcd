"""The actor's side of the Ray transport: what a worker actor's process runs.

The hub's calls reach this process's :class:`RaySpoke` through :func:`deliver` (the
method :class:`WeightSyncActorMixin` gives an actor class); what the spoke sends waits
in its outbox and is the call's result. Nothing here imports Ray.
"""

from __future__ import annotations

import logging
import queue
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np
import torch

from zmqsync.errors import EndpointError
from zmqsync.protocol import Buffer
from zmqsync.transport.base import Borrows, Counted, SpokeTransport
from zmqsync.transport.cuda import handles
from zmqsync.transport.cuda.handles import DEVICE_IDS
from zmqsync.transport.ends import OpenEnd
from zmqsync.transport.shm.borrowing import PeerBlocks, borrow, read_token, release_when_gone
from zmqsync.transport.shm.lent import lent_at
from zmqsync.transport.shm.records import (
    DeviceGrant,
    Go,
    Join,
    Keeps,
    Lease,
    Leave,
    Offer,
    RecordError,
    Release,
    TakesDevice,
    decode,
    encode,
    is_lent_record,
    is_record,
    written_in,
)

__all__ = [
    "DELIVER_METHOD",
    "MAX_BATCH",
    "SEQ_SPAN",
    "RaySpoke",
    "WeightSyncActorMixin",
    "batch",
    "deliver",
    "owned",
]

log = logging.getLogger("zmqsync.transport.ray")

#: How long the messages of calls that overtook an earlier one (a threaded actor) wait
#: for it (seconds); past it they are queued as they are, and a version whose chunks came
#: out of order is repaired. They wait in the spoke, not in the call: a call returns at
#: once, so calls that overtook another never hold the actor's threads.
ORDER_WAIT: Final = 30.0
#: Calls that overtook an earlier one whose messages the spoke keeps; more than that and
#: the gap is given up (the hub has at most this many calls to one actor under way).
MAX_EARLY: Final = 16
#: A hub numbers its calls to an actor within a numbering of its own (a random epoch,
#: new with each hub and each actor it serves): a call's ``seq`` is ``epoch * SEQ_SPAN``
#: plus its place in it. A spoke tells a new numbering (a restarted learner) from the
#: epoch, not from a call numbered 0, which a threaded actor may run after call 1. A
#: ``seq`` under ``SEQ_SPAN`` is an untagged numbering, new whenever a call is numbered 0.
SEQ_SPAN: Final = 1 << 32
#: Numberings a spoke gave up for a newer one and remembers: a late call from one of
#: them (an older hub's, overtaken by the new hub's) is dropped, not taken for yet
#: another new hub.
MAX_RETIRED: Final = 8
#: The actor method a hub calls (what :class:`WeightSyncActorMixin` defines).
DELIVER_METHOD: Final = "zmqsync_deliver"
#: Messages an actor's spoke keeps for the hub before dropping new ones.
MAX_OUTBOX: Final = 1024
#: Messages one call carries at most: the chunks waiting for an actor go together (a
#: Ray call costs about a millisecond whatever it carries; a lease or a small chunk is
#: a few bytes), see :func:`batch`.
MAX_BATCH: Final = 64
#: The first frame of a call that carries several messages: this magic, their count,
#: and each one's count of frames (the frames follow, message after message).
_BATCH: Final = b"ZRb1"
_COUNT: Final = struct.Struct("<I")


def batch(messages: Sequence[Sequence[bytes]]) -> list[bytes]:
    """One call's frames carrying ``messages`` (at most :data:`MAX_BATCH`), in order."""
    if not 0 < len(messages) <= MAX_BATCH:
        raise ValueError(f"a batch carries 1 to {MAX_BATCH} messages; got {len(messages)}")
    head = _BATCH + _COUNT.pack(len(messages)) + b"".join(_COUNT.pack(len(m)) for m in messages)
    return [head, *(frame for message in messages for frame in message)]


def _unbatch(frames: Sequence[Any]) -> list[Sequence[Any]] | None:
    """The messages a batch's ``frames`` carry; None when it is malformed."""
    head = frames[0]
    if len(head) < len(_BATCH) + _COUNT.size:
        return None
    (count,) = _COUNT.unpack_from(head, len(_BATCH))
    if not 0 < count <= MAX_BATCH or len(head) != len(_BATCH) + _COUNT.size * (count + 1):
        return None
    sizes = [n for (n,) in _COUNT.iter_unpack(head[len(_BATCH) + _COUNT.size :])]
    if any(n < 1 for n in sizes) or sum(sizes) != len(frames) - 1:
        return None
    out, pos = [], 1
    for n in sizes:
        out.append(frames[pos : pos + n])
        pos += n
    return out


def _is_batch(frames: Sequence[Any] | None) -> bool:
    return bool(frames) and isinstance(frames[0], bytes) and frames[0][: len(_BATCH)] == _BATCH  # type: ignore[index]


def owned(frames: Sequence[Buffer]) -> list[bytes]:
    """``frames`` as bytes (what Ray pickles, and what stays valid)."""
    return [f if isinstance(f, bytes) else bytes(f) for f in frames]


def _read_only(frame: Buffer) -> bool:
    """Whether ``frame`` is read in place, read-only (not a copy of the bytes)."""
    if isinstance(frame, np.ndarray):
        return not frame.flags.writeable
    return isinstance(frame, memoryview) and frame.readonly


_spokes: dict[str, RaySpoke] = {}
#: What a spoke that closed had not handed to its hub yet (its goodbye), by channel: the
#: hub's next call takes it, as it would have taken the outbox.
_last_words: dict[str, list[list[bytes]]] = {}
#: By channel with no spoke open, the last call of the hub's numbering that reached
#: this process (epoch, number): dropped (no spoke yet), or the last a spoke that closed
#: had queued. A spoke opened later goes on from there; with nothing here, a numbering
#: starts at 0. Bounded: the hub names the channels.
_heard: dict[str, tuple[int, int]] = {}
#: Channels :data:`_heard` remembers at most (the oldest is forgotten first).
MAX_HEARD: Final = 64
_spokes_lock = threading.Lock()


def _hear(channel: str, epoch: int, number: int) -> None:
    """Remember call ``number`` of numbering ``epoch`` on ``channel`` (holding the
    spokes' lock)."""
    last = _heard.pop(channel, None)
    if last is not None and last[0] == epoch:
        number = max(number, last[1])
    _heard[channel] = (epoch, number)
    while len(_heard) > MAX_HEARD:
        del _heard[next(iter(_heard))]


class RaySpoke(OpenEnd, SpokeTransport, Borrows, Counted):
    """A worker actor's end, registered in its process under ``channel`` (the model_id).

    The hub's calls reach it through :func:`deliver`: delivered messages queue for
    :meth:`recv_frames`; what :meth:`send_frames` is given is returned to the hub as the
    result of the call. :attr:`on_delivery`, if set, runs on every call between the two
    (the Ray scheme applies versions and acks there, so the ack rides on the same call).
    Besides the contract it has the abilities it subclasses.
    """

    name = "ray"

    def __init__(self, channel: str = "policy") -> None:
        self.channel = channel
        self._inbox: queue.Queue[list[Buffer] | None] = queue.Queue()
        self._outbox: list[list[bytes]] = []
        self._cond = threading.Condition()
        self._delivered = 0  # messages the hub delivered
        self._taken = 0  # ... and recv_frames took
        self._reader_idle = False  # a reader waits in recv_frames on an empty inbox
        self._next_seq: int | None = None  # the hub's next call, by its number
        self._epoch: int | None = None  # the numbering of the hub's calls (see SEQ_SPAN)
        self._retired: deque[int] = deque(maxlen=MAX_RETIRED)
        #: Messages of calls that overtook an earlier one: seq -> (arrived, messages).
        self._early: dict[int, tuple[float, list[list[Buffer]]]] = {}
        self._closed = False
        self._counters = {
            "dropped_sends": 0,
            "order_gaps": 0,
            "read_only_views": 0,
            "shared_frames": 0,
            "malformed_batches": 0,
            "stale_calls": 0,
            "unread_device": 0,
        }
        self._maps = PeerBlocks()  # the driver's blocks, mapped read-only
        self._keeps = False  # keeps each version mapped until the next (says so on joins)
        self._joined = False  # answered the hub's offer: it reads the hub's blocks
        #: The GPU this actor told the hub its model lives on (device blocks come as
        #: tensors on it, each released only once the device is synchronized).
        self._device: torch.device | None = None
        #: This actor's index at its hub (``None`` until the hub's first call).
        self.peer_index: int | None = None
        #: Called on each of the hub's calls, after its frames are queued and before the
        #: reply is taken: a place to process them at once.
        self.on_delivery: Callable[[], None] | None = None
        with _spokes_lock:
            other = _spokes.get(channel)
            if other is not None and not other.closed:
                raise EndpointError(
                    f"this process already has an open Ray spoke for {channel!r}: close it "
                    "(scheme.shutdown()) before creating another"
                )
            _spokes[channel] = self
            #: Where the hub's numbering stood before this spoke opened (see _heard).
            self._heard = _heard.pop(channel, None)

    @property
    def endpoint(self) -> str:
        """A name for messages: the spoke has no address of its own."""
        return f"ray://{self.channel}"

    def send_frames(self, frames: Sequence[Buffer], *, ack: bool = False) -> None:
        self._check_open()
        with self._cond:
            if len(self._outbox) >= MAX_OUTBOX:
                self._counters["dropped_sends"] += 1  # the hub stopped calling; it will ask again
                return
            self._outbox.append(owned(frames))
            self._cond.notify_all()

    def borrowed(self, buffers: Sequence[Buffer]) -> bool:
        # Its hub lends blocks whenever this actor can read them: each version is let
        # go of before its ack.
        return True

    def keep_versions(self) -> None:
        """Tell the hub (in a reply, now if joined and on every join) that this actor
        keeps each version mapped until the next (``apply_mode="shared"``): while a lent
        call is still on its way to it, the hub sends it versions through the object
        store, so that a stopped actor pins few of its blocks."""
        if not self._keeps and not self._closed:
            self._keeps = True
            if self._joined:
                self._reply([encode(Keeps())])

    def take_device(self, device: Any) -> None:
        """Tell the hub (in a reply, now if joined and on every join) that this actor's
        model lives on GPU ``device``: versions the hub lends on it come as device
        tensors, copied device to device."""
        lent = handles.lent_device(device)
        if lent is None or self._device == lent or self._closed:
            return
        self._device = lent
        if self._joined:
            self._reply([encode(TakesDevice(handles.gpu_name(lent)))])

    def recv_frames(self, timeout: float | None) -> list[Buffer] | None:
        self._check_open()
        blocking = timeout is None or timeout > 0
        if blocking:
            with self._cond:
                # Everything delivered was taken and handled: tell wait_reply().
                self._reader_idle = self._inbox.empty()
                self._cond.notify_all()
        try:
            item = self._inbox.get(timeout=timeout) if blocking else self._inbox.get_nowait()
        except queue.Empty:
            item = None
        with self._cond:
            self._reader_idle = False
            if item is not None:
                self._taken += 1
        return item

    def wait_reply(self, timeout: float) -> bool:
        """Wait until the messages delivered so far have been answered, or handled by a
        reader (in another thread) that then went back to waiting, or ``timeout``
        seconds passed. True if there is something to send back."""
        with self._cond:
            self._cond.wait_for(
                lambda: (
                    bool(self._outbox)
                    or self._closed
                    or (self._reader_idle and self._taken >= self._delivered)
                ),
                timeout,
            )
            return bool(self._outbox)

    def lends_tensors(self) -> bool:
        # Only an actor that reads the hub's blocks proved it is on the learner's host:
        # the hub believes what it lends from no other.
        return not self._closed and self._joined

    def lend_tensors(self, where: Any, layout: bytes) -> None:
        self._reply([encode(lent_at(where, layout))])

    def answer(self, version: int, epoch: int, ok: bool) -> None:
        self._reply([encode(Go(version, epoch, ok))])

    def _reply(self, message: list[bytes]) -> None:
        with self._cond:
            self._outbox.append(message)
            self._cond.notify_all()

    def _on_record(self, frame: bytes, inline: Sequence[Any]) -> list[Buffer] | None:
        """Handle a shared-memory record from the hub: answer an offer, or return the
        frames a lease names (views of the hub's blocks, mapped read-only once each)."""
        try:
            record = decode(frame)
            if isinstance(record, Offer):
                answer = self._answer(record)
                self._joined = isinstance(answer, Join)
                self._reply([encode(answer)])
                if self._joined and self._keeps:
                    self._reply([encode(Keeps())])
                if self._joined and self._device is not None:
                    self._reply([encode(TakesDevice(handles.gpu_name(self._device)))])
                return None
            if isinstance(record, DeviceGrant):
                self._open_device_block(record)
                return None
            if not isinstance(record, Lease):
                raise RecordError(f"a {type(record).__name__} record from the hub")
            unread = {e.block for e in record.entries if e.block >= 0}
            if any(b >= DEVICE_IDS and b not in self._maps for b in unread):
                # In a device block it could not open: this message is lost (repaired),
                # and each lease it counted ends.
                self._counters["unread_device"] += 1
                self._reply([encode(Release(tuple(sorted(unread))))])
                return None
            # Views, not copies: bytes inline, numpy arrays of blocks (device blocks:
            # tensors on this actor's GPU).
            frames, views = borrow(
                record,
                (f if isinstance(f, bytes) else memoryview(f) for f in inline),
                self._maps,
            )
        except (OSError, ValueError) as exc:
            # Say so (the hub stops lending to us; the sync layer repairs a lost version).
            log.warning("could not read the hub's shared memory: %s", exc)
            self._reply([encode(Leave())])
            return None
        release_when_gone(views, self._release)
        self._counters["shared_frames"] += sum(len(v) for v in views.values())
        return frames

    def _open_device_block(self, grant: DeviceGrant) -> None:
        if self._device is None:
            return  # it took none, or refused one already: the hub is told so
        opened = handles.open_block(grant.block, grant.handle)
        if opened is None:
            # The hub is told this actor takes none: its versions then come through the
            # host, and what it missed is repaired.
            self._device = None
            self._reply([encode(TakesDevice(handles.gpu_name(None)))])
            return
        self._maps.add(grant.block, opened, owner=grant.pid)

    @staticmethod
    def _answer(offer: Offer) -> Join | Leave:
        """Join if this process can read the hub's blocks (the same host), else leave."""
        try:
            return Join(read_token(offer))
        except (OSError, ValueError) as exc:
            log.info(
                "this actor cannot read the sender's shared memory (%s: another host?): "
                "versions come through Ray's object store, copied",
                exc,
            )
            return Leave()

    def _release(self, block_id: int) -> None:
        if self._closed:
            return
        device = self._device
        if block_id >= DEVICE_IDS and device is not None:
            # The copies out of it may still be queued on the device: they end first.
            handles.IPC.synchronize(device)
        self._reply([encode(Release((block_id,)))])

    def exchange(
        self, peer_index: int, frames: Sequence[Any] | None, seq: int | None = None
    ) -> list[list[bytes]]:
        """One call from the hub: queue ``frames`` (if any) and return the outbox.

        ``seq``: the call's number at the hub. The messages of a call that overtook an
        earlier one (a threaded actor runs calls at once, and Ray may hand them over in
        any order) wait in the spoke until the earlier ones came, at most
        :data:`ORDER_WAIT` seconds and :data:`MAX_EARLY` calls; the call itself returns.
        """
        if self._closed:
            return []
        epoch, number = (0, 0) if seq is None else divmod(seq, SEQ_SPAN)
        if epoch:
            with self._cond:
                stale = epoch in self._retired
                if stale:
                    self._counters["stale_calls"] += 1
            if stale:  # an older hub's, late: its replies are not for it either
                return []
        messages = self._messages(frames)
        with self._cond:
            if seq is not None and self._new_numbering(peer_index, epoch, number):
                # A new hub (or index): its numbers start anew, and what waited for an
                # older hub's calls goes.
                if self._epoch:
                    self._retired.append(self._epoch)
                self._next_seq = self._first(epoch)
                self._epoch = epoch
                self._early.clear()
            self.peer_index = peer_index
            if seq is None:
                self._queue(messages)
            else:
                self._in_order(number, messages)
            # The inbox holds the only references now (see _views).
            messages, frames = [], None
        hook = self.on_delivery
        if hook is not None:
            try:
                hook()
            except Exception:  # the reply must still go back
                log.exception("processing a delivery on %s", self.endpoint)
        with self._cond:
            out, self._outbox = self._outbox, []
        return out

    def _first(self, epoch: int) -> int | None:
        """The number of the first call of numbering ``epoch`` this spoke takes: 0, or
        the one after the last this process heard of before the spoke opened (a
        threaded actor may run call 1 before call 0: call 1 then waits for call 0).
        None for an untagged numbering: it starts at whichever call comes first."""
        if not epoch:
            return None
        if self._heard is not None and self._heard[0] == epoch:
            return self._heard[1] + 1
        return 0

    def _new_numbering(self, peer_index: int, epoch: int, number: int) -> bool:
        """Whether a call starts a new numbering of the hub's calls (caller holds the
        lock): another epoch or index, or an untagged call numbered 0."""
        return epoch != self._epoch or peer_index != self.peer_index or (not epoch and number == 0)

    def _messages(self, frames: Sequence[Any] | None) -> list[list[Buffer]]:
        """The inbox's messages from one call's ``frames`` (several, for a batch)."""
        if not _is_batch(frames):
            one = self._views(frames)
            return [] if one is None else [one]
        assert frames is not None
        messages = _unbatch(frames)
        if messages is None:
            self._counters["malformed_batches"] += 1
            log.warning("a malformed batch of messages from the hub, dropped")
            return []
        return [v for m in messages if (v := self._views(m)) is not None]

    def _views(self, frames: Sequence[Any] | None) -> list[Buffer] | None:
        """What the inbox gets from one call's ``frames``: views, not copies (numpy
        arrays from the object store stay where they are until the receiver copies them
        into its model; lent blocks are released in the reply after the receiver lets
        go of them). None: nothing for the receiver (a poll, or a record answered here)."""
        first = frames[0] if frames else None
        if isinstance(first, bytes) and is_lent_record([first]):
            if written_in(first):
                # A version in the lent tensors: the driver's blocks mapped for those
                # before are forgotten (mapped again through /proc if named again), so
                # that one it retires frees its memory.
                self._maps.forget_host()
            return [first]  # the hub's Ask or Written: the receiver's to act on
        if isinstance(first, bytes) and is_record([first]):
            # The hub's blocks stay numpy arrays over this process's read-only mapping
            # (as a ZeroMQ spoke's do): what apply_mode="shared" maps as the weights.
            return self._on_record(first, frames[1:])  # type: ignore[index]
        if frames is None:
            return None
        # The object store's pages are Ray's, not a read-only mapping of the learner's:
        # memoryviews, which the shared mode copies from and never maps.
        return [f if isinstance(f, bytes) else memoryview(f) for f in frames]

    def _in_order(self, seq: int, views: list[list[Buffer]]) -> None:
        """Queue call ``seq``'s messages in the hub's order (caller holds the lock)."""
        expected = self._next_seq
        if expected is not None and seq > expected:
            self._early[seq] = (time.monotonic(), views)
        else:  # the next call, the first, or a late one whose gap was given up
            self._queue(views)
            self._next_seq = max(seq + 1, expected or 0)
        while self._early:
            if self._next_seq not in self._early:
                oldest = min(self._early)
                waited = time.monotonic() - self._early[oldest][0]
                if len(self._early) <= MAX_EARLY and waited < ORDER_WAIT:
                    return
                self._counters["order_gaps"] += 1  # given up: a later repair mends it
                self._next_seq = oldest
            _, waiting = self._early.pop(self._next_seq)
            self._queue(waiting)
            self._next_seq += 1

    def _queue(self, messages: list[list[Buffer]]) -> None:
        for views in messages:
            self._counters["read_only_views"] += sum(_read_only(v) for v in views)
            self._delivered += 1
            self._inbox.put(views)

    def counters(self) -> dict[str, int]:
        """``dropped_sends`` (the hub stopped calling), ``order_gaps`` (calls whose
        messages were queued out of the hub's order, an earlier one not having come in
        time), ``read_only_views`` (frames read in place from Ray's object store or the
        hub's shared memory, without a copy), ``shared_frames`` (those of them in the
        hub's shared memory), ``malformed_batches`` (calls whose batch of messages
        could not be read, dropped), ``stale_calls`` (late calls of a hub a newer one
        replaced, dropped) and ``unread_device`` (messages that lay in a device block
        this actor could not open, dropped: their version is repaired)."""
        return dict(self._counters)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._cond:
            words, self._outbox = self._outbox, []
            self._early.clear()
            heard = (self._epoch, self._next_seq - 1) if self._epoch and self._next_seq else None
        with _spokes_lock:
            if _spokes.get(self.channel) is self:
                del _spokes[self.channel]
                if heard is not None:  # a spoke opened next goes on from there
                    _hear(self.channel, *heard)
            if words:
                _last_words.setdefault(self.channel, []).extend(words)
                del _last_words[self.channel][:-MAX_OUTBOX]
        self._inbox.put(None)  # ends a blocked recv_frames
        with self._cond:
            self._cond.notify_all()


def deliver(
    channel: str, peer_index: int, frames: Sequence[Any] | None, seq: int | None = None
) -> list[list[bytes]]:
    """Hand one hub call to this process's spoke for ``channel``; return its replies.

    ``seq`` numbers the hub's calls to this actor: a threaded actor may run two at once,
    and the spoke queues their messages in the hub's order (the chunks of a version
    must follow on).

    Call it from the actor method a :class:`RayHub` invokes (see
    :class:`WeightSyncActorMixin`). With no spoke registered (the actor has not called
    ``init_on_worker`` yet) the frames are dropped and nothing is returned; the hub asks
    again later. What a spoke that closed still had to say goes out on the next call.
    """
    with _spokes_lock:
        spoke = _spokes.get(channel)
        words = _last_words.pop(channel, [])  # a closed spoke's goodbye comes first
        if spoke is None and seq is not None and seq >= SEQ_SPAN:
            _hear(channel, *divmod(seq, SEQ_SPAN))  # dropped: a spoke opened later knows
    if spoke is None:
        return words
    return words + spoke.exchange(peer_index, frames, seq)


class WeightSyncActorMixin:
    """Gives a Ray actor class the method its :class:`RayHub` calls.

    Example::

        @ray.remote
        class Collector(WeightSyncActorMixin):
            ...

    Calls are ordinary actor calls: a plain actor runs them between its other methods
    (a long method delays its updates; the sender's timeout covers that). A threaded
    actor (``max_concurrency > 1``) runs them alongside.
    """

    def zmqsync_deliver(
        self, channel: str, peer_index: int, frames: list[Any] | None, seq: int | None = None
    ) -> list[list[bytes]]:
        """Receive messages from the hub (one, a batch, or none: a poll) and return this
        actor's replies."""
        return deliver(channel, peer_index, frames, seq)
