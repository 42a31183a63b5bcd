"""Transport over Ray: the hub calls a method on each worker actor; replies come back as
the calls' results.

A Ray actor cannot be written to like a socket, and cannot easily call its driver back, so
the hub drives every exchange:

- ``send_frames`` calls ``actor.zmqsync_deliver(channel, peer_index, frames)`` on each
  targeted actor. A large message is put into Ray's object store **once**
  (``ray.put`` of a list of ``uint8`` numpy arrays) and every actor on the node reads it
  through zero-copy, read-only views; the receiver then copies it once into its model.
- Actors on the driver's host do better: asked once (a probe) whether they can open the
  driver's shared-memory blocks through ``/proc/<pid>/fd``, those that can get large
  frames as places in the hub's reused ``memfd`` blocks (the same pool as the pipe
  transport's), map them read-only once, and copy from them into their model; no
  object in Ray's store, and the sender's snapshot is the block it sends. They release
  a block in a reply once they let go of its frames; the hub rewrites a block only when
  every actor it went to has released it or died.
- What the actor's side sends (acks, hellos, heartbeats) waits in its spoke's outbox and
  is the **result** of the next call. When nothing else is under way, the hub *polls*
  each actor (a call with no frames) every ``poll_interval`` seconds at most, sooner
  right after an actor had something to say.
- Calls complete through Ray's futures, so nothing here blocks on an actor: a killed
  actor (``ray.kill``) fails its calls with ``ActorDiedError`` and is counted as lost;
  one that hangs just never answers, and the sync layer's timeout names it.

The actor's class provides the method by inheriting :class:`WeightSyncActorMixin` (or by
defining a method that calls :func:`deliver`)::

    @ray.remote
    class Collector(WeightSyncActorMixin):
        def __init__(self, scheme):
            self.policy = make_policy()
            scheme.init_on_worker("policy", model=self.policy)   # registers a RaySpoke

The actor side (:class:`RaySpoke`, :func:`deliver`) never imports Ray. Ray serializes
the calls; what zmqsync puts in them is bytes and numpy byte arrays, nothing executable of
its own.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import struct
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from zmqsync.errors import EndpointError, TransportClosed, TransportError
from zmqsync.protocol import Buffer, Kind, peek_kind, starts_version
from zmqsync.transport._shm import (
    SHM_AVAILABLE,
    Block,
    PeerBlocks,
    Ref,
    ShmPool,
    map_peer_block,
)
from zmqsync.transport.base import HubTransport, Incoming, PeerId, SpokeTransport

__all__ = [
    "DELIVER_METHOD",
    "RayHub",
    "RaySpoke",
    "WeightSyncActorMixin",
    "deliver",
    "peer_id",
]

log = logging.getLogger("zmqsync.transport.ray")

#: How long a call that overtook an earlier one (a threaded actor) waits for it (seconds);
#: past it the call goes on, and a version whose chunks came out of order is repaired.
ORDER_WAIT: Final = 2.0
#: The actor method a hub calls (what :class:`WeightSyncActorMixin` defines).
DELIVER_METHOD: Final = "zmqsync_deliver"
#: Messages at least this big go through the object store (put once, read zero-copy by
#: every actor on the node); smaller ones travel inline in the call, which is cheaper.
INLINE_BYTES: Final = 64 * 1024
#: Calls under way to one actor before new messages to it are dropped: an actor that does
#: not run its calls (busy in a long method, or hung) must not grow an unbounded queue of
#: model-sized messages. The sync layer repairs it once it answers again.
MAX_IN_FLIGHT: Final = 16
#: Chunk calls under way to one actor at once: enough to keep it busy while the next
#: is submitted. The rest wait in the hub, in order (a newer version's first chunk drops
#: the waiting chunks of older ones), at most MAX_WAITING of them.
CHUNK_CALLS: Final = 2
MAX_WAITING: Final = 64
#: Default longest gap between polls of an idle actor; it bounds how late a new worker
#: is noticed and how late its heartbeat arrives.
POLL_INTERVAL: Final = 0.25
#: Gap before the next poll of an actor whose last reply carried messages (it is in the
#: middle of something, such as joining).
FAST_POLL: Final = 0.005
#: Messages an actor's spoke keeps for the hub before dropping new ones.
MAX_OUTBOX: Final = 1024

# Shared memory with actors on the driver's host. The hub first sends an actor a probe
# (the driver's pid, the descriptor of a small block and the token written in it); an
# actor that can open ``/proc/<pid>/fd/<fd>`` and read the token answers yes, and from
# then on gets large frames as places in the hub's blocks (one ``_SHM_HEAD`` record,
# ``_SHM_ENTRY`` per frame, the ids of the blocks that still exist, then the small
# frames inline) instead of an object in Ray's store. It releases each block (a
# ``_RELEASE`` reply) once it let go of the frames in it.
_PROBE: Final = b"ZRSP"
_PROBE_BODY: Final = struct.Struct("<qq16s")  # pid, fd, token
_ANSWER: Final = b"ZRSA"
_SHARED: Final = b"ZRS1"
_SHM_HEAD: Final = struct.Struct("<4sqII")  # magic, pid, frames, live block ids
_SHM_ENTRY: Final = struct.Struct("<qqQQQ")  # block id (-1: inline), fd, block size, offset, length
_LIVE: Final = struct.Struct("<q")
_RELEASE: Final = b"ZRSR"
#: Blocks an actor keeps mapped; the hub's live list trims it sooner.
_MAX_MAPS: Final = 8


def peer_id(index: int) -> PeerId:
    """The hub's peer id of the actor at ``index``: ``b"ray:3"``."""
    return b"ray:%d" % index


def _owned(frames: Sequence[Buffer]) -> list[bytes]:
    return [f if isinstance(f, bytes) else bytes(f) for f in frames]


# --- the actor's side ------------------------------------------------------------------

_spokes: dict[str, RaySpoke] = {}
#: What a spoke that closed had not handed to its hub yet (its goodbye), by channel: the
#: hub's next call takes it, as it would have taken the outbox.
_last_words: dict[str, list[list[bytes]]] = {}
_spokes_lock = threading.Lock()


class RaySpoke(SpokeTransport):
    """A worker actor's end, registered in its process under ``channel`` (the model_id).

    The hub's calls reach it through :func:`deliver`: delivered messages queue for
    :meth:`recv_frames`; what :meth:`send_frames` is given is returned to the hub as the
    result of the call. :attr:`on_delivery`, if set, runs on every call between the two
    (the Ray scheme applies versions and acks there, so the ack rides on the same call).
    """

    lends_memory = True  # shared blocks, reused once released

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
        self._closed = False
        self._counters = {"dropped_sends": 0, "read_only_views": 0, "shared_frames": 0}
        self._maps = PeerBlocks(_MAX_MAPS)  # the driver's blocks, mapped read-only
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

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def endpoint(self) -> str:
        """A name for messages: the spoke has no address of its own."""
        return f"ray://{self.channel}"

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"the Ray spoke for {self.channel!r} is closed")

    def send_frames(self, frames: Sequence[Buffer]) -> None:
        self._check_open()
        with self._cond:
            if len(self._outbox) >= MAX_OUTBOX:
                self._counters["dropped_sends"] += 1  # the hub stopped calling; it will ask again
                return
            self._outbox.append(_owned(frames))
            self._cond.notify_all()

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

    def _reply(self, message: list[bytes]) -> None:
        with self._cond:
            self._outbox.append(message)
            self._cond.notify_all()

    def _probe(self, record: bytes) -> bool:
        """Whether this process can read the hub's shared blocks."""
        try:
            pid, fd, token = _PROBE_BODY.unpack(record[len(_PROBE) :])
            mapped = map_peer_block(pid, fd, len(token))
            return bytes(mapped[: len(token)]) == token
        except (OSError, ValueError, struct.error):
            return False

    def _resolve(self, frames: Sequence[Any]) -> list[Buffer]:
        """The frames of a shared-memory message: views of the hub's blocks (mapped
        read-only, once each) and the inline frames. Raises OSError/ValueError."""
        head = frames[0]
        _, pid, count, live = _SHM_HEAD.unpack_from(head)
        offset = _SHM_HEAD.size
        entries = [_SHM_ENTRY.unpack_from(head, offset + i * _SHM_ENTRY.size) for i in range(count)]
        offset += count * _SHM_ENTRY.size
        alive = {_LIVE.unpack_from(head, offset + i * _LIVE.size)[0] for i in range(live)}
        self._maps.keep_only(pid, alive)  # the others the hub dropped
        inline = iter(frames[1:])
        out: list[Any] = []  # buffers: bytes inline, numpy views of blocks
        views: dict[int, list[Any]] = {}
        for block_id, fd, size, start, length in entries:
            if block_id < 0:
                frame = next(inline)
                out.append(frame if isinstance(frame, bytes) else memoryview(frame))
                continue
            view = self._maps.view(pid, block_id, fd, size, start, length)
            views.setdefault(block_id, []).append(view)
            out.append(view)
        for block_id, held in views.items():
            self._release_when_gone(block_id, held)
        self._counters["shared_frames"] += sum(len(v) for v in views.values())
        return out

    def _release_when_gone(self, block_id: int, views: list[Any]) -> None:
        left = [len(views)]
        lock = threading.Lock()
        message = [_RELEASE + _LIVE.pack(block_id)]

        def one_gone() -> None:
            with lock:
                left[0] -= 1
                done = left[0] == 0
            if done and not self._closed:
                self._reply(message)

        for view in views:
            weakref.finalize(view, one_gone)

    def exchange(
        self, peer_index: int, frames: Sequence[Any] | None, seq: int | None = None
    ) -> list[list[bytes]]:
        """One call from the hub: queue ``frames`` (if any) and return the outbox.

        ``seq``: the call's number at the hub. A call that overtook an earlier one (a
        threaded actor) waits for it, at most :data:`ORDER_WAIT` seconds.
        """
        if self._closed:
            return []
        if seq is not None:
            with self._cond:
                if seq == 0 or peer_index != self.peer_index:
                    self._next_seq = None  # a new hub (or index): its numbers start anew
                if self._next_seq is not None and seq > self._next_seq:
                    self._cond.wait_for(
                        lambda: self._closed or self._next_seq is None or self._next_seq >= seq,
                        ORDER_WAIT,
                    )
        try:
            return self._exchange(peer_index, frames)
        finally:
            if seq is not None:
                with self._cond:
                    self._next_seq = max(seq + 1, self._next_seq or 0)
                    self._cond.notify_all()

    def _exchange(self, peer_index: int, frames: Sequence[Any] | None) -> list[list[bytes]]:
        self.peer_index = peer_index
        first = frames[0] if frames else None
        if isinstance(first, bytes) and first.startswith(_PROBE):
            self._reply([_ANSWER + (b"\x01" if self._probe(first) else b"\x00")])
            frames = None
        elif isinstance(first, bytes) and first.startswith(_SHARED):
            try:
                frames = self._resolve(frames)  # type: ignore[arg-type]
            except (OSError, ValueError, StopIteration, struct.error) as exc:
                # Lost: say so (the hub stops sharing; the sync layer repairs the version).
                log.warning("could not read the hub's shared memory: %s", exc)
                self._reply([_ANSWER + b"\x00"])
                frames = None
        if frames is not None:
            # Views, not copies: numpy arrays from the object store stay where they are
            # until the receiver copies them into its model.
            views: list[Buffer] = [f if isinstance(f, bytes) else memoryview(f) for f in frames]
            with self._cond:
                self._counters["read_only_views"] += sum(
                    isinstance(v, memoryview) and v.readonly for v in views
                )
                self._delivered += 1
                self._inbox.put(views)
            # The inbox holds the only reference now: once the receiver is done with the
            # frames, shared blocks are released in this very reply.
            views = frames = first = None  # type: ignore[assignment]
        hook = self.on_delivery
        if hook is not None:
            try:
                hook()
            except Exception:  # the reply must still go back
                log.exception("processing a delivery on %s", self.endpoint)
        with self._cond:
            out, self._outbox = self._outbox, []
        return out

    def counters(self) -> dict[str, int]:
        """``dropped_sends`` (the hub stopped calling), ``read_only_views`` (frames read
        in place from Ray's object store or the hub's shared memory, without a copy) and
        ``shared_frames`` (those of them in the hub's shared memory)."""
        return dict(self._counters)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._cond:
            words, self._outbox = self._outbox, []
        with _spokes_lock:
            if _spokes.get(self.channel) is self:
                del _spokes[self.channel]
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
        """Receive one message from the hub (or a poll) and return this actor's replies."""
        return deliver(channel, peer_index, frames, seq)


# --- the driver's side -----------------------------------------------------------------


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - CI installs ray
        raise ImportError("the Ray transport needs Ray: pip install 'zmqsync[ray]'") from exc
    return ray


@dataclass
class _Actor:
    index: int
    handle: Any = field(repr=False)
    method: Any = field(repr=False)
    next_seq: int = 0  # sequence number of the next call
    done_seq: int = 0  # next call whose result is handed on (results keep call order)
    finished: dict[int, Any] = field(default_factory=dict, repr=False)
    in_flight: int = 0
    #: Chunk calls under way, by sequence number, with the frames they were made from
    #: (kept until the call is done: a sender lets no more chunks go out meanwhile).
    chunk_calls: dict[int, Any] = field(default_factory=dict, repr=False)
    #: Chunks waiting for a call: (message, frames).
    waiting: deque[tuple[Any, Any]] = field(default_factory=deque, repr=False)
    next_poll: float = 0.0
    poll_gap: float = FAST_POLL
    dead: str | None = None
    shared: bool | None = None  # reads the hub's shared memory (None: not asked yet)
    probing: bool = False


class RayHub(HubTransport):
    """The driver's end: one Ray actor per worker.

    Args:
        actors: the worker actors' handles, a sequence (worker ``i`` is ``actors[i]``)
            or a mapping ``{worker_index: handle}``. Their class must have the method
            ``method`` (inherit :class:`WeightSyncActorMixin`).
        channel: the name both ends use (the scheme passes its model_id), so one actor
            can receive several models.
        method: the actor method to call.
        poll_interval: longest gap between polls of an idle actor (seconds).
        inline_bytes: messages smaller than this travel inside the call instead of
            through the object store.
        shared_memory: give actors on the driver's host large frames through
            shared-memory blocks (read in place, reused once released) instead of a new
            object in Ray's store per message. Each actor is asked first whether it can
            read them; actors elsewhere get the object store.

    Peer ids are ``b"ray:<index>"`` (:func:`peer_id`). Ray must be initialised
    (``ray.init()``) by the caller.
    """

    name = "ray"

    def __init__(
        self,
        actors: Sequence[Any] | Mapping[int, Any],
        *,
        channel: str = "policy",
        method: str = DELIVER_METHOD,
        poll_interval: float = POLL_INTERVAL,
        inline_bytes: int = INLINE_BYTES,
        shared_memory: bool = True,
    ) -> None:
        self._ray = _ray()
        if poll_interval <= 0:
            raise ValueError(f"poll_interval must be positive seconds; got {poll_interval}")
        self._channel = channel
        self._method = method
        self._poll_interval = poll_interval
        self._inline_bytes = inline_bytes
        self._actors: dict[PeerId, _Actor] = {}
        self._lock = threading.Lock()  # actor records: send_frames vs recv_frames
        self._events: queue.Queue[tuple[_Actor, int, Any] | None] = queue.Queue()
        self._ready: list[Incoming] = []
        self._closed = False
        self._counters = {
            "dropped_sends": 0,
            "peers_lost": 0,
            "remote_errors": 0,
            "polls": 0,
            "object_store_puts": 0,
            "shared_sends": 0,
            "bad_releases": 0,
        }
        self.last_error: str | None = None
        self._shm: ShmPool | None = None
        self._probe: Block | None = None
        self._probe_record = b""
        if shared_memory and SHM_AVAILABLE:
            self._shm = ShmPool()
            token = secrets.token_bytes(16)
            self._probe = Block(0, len(token))
            self._probe.array[:] = memoryview(token)
            self._probe_record = _PROBE + _PROBE_BODY.pack(os.getpid(), self._probe.fd, token)
        items = actors.items() if isinstance(actors, Mapping) else enumerate(actors)
        for index, handle in items:
            self.add_actor(handle, index=index)

    # --- actors ----------------------------------------------------------------------

    def add_actor(self, handle: Any, *, index: int | None = None) -> PeerId:
        """Serve one more actor (a late joiner); returns its peer id."""
        self._check_open()
        with self._lock:
            if index is None:
                index = 1 + max((a.index for a in self._actors.values()), default=-1)
            if isinstance(index, bool) or not isinstance(index, int) or index < 0:
                raise ValueError(f"worker indices must be non-negative ints; got {index!r}")
            peer = peer_id(index)
            if peer in self._actors:
                raise ValueError(f"worker index {index} already has an actor")
            try:
                method = getattr(handle, self._method)
            except AttributeError:
                raise TypeError(
                    f"actor {handle!r} has no method {self._method!r}: make its class inherit "
                    "zmqsync.transport.ray.WeightSyncActorMixin (or define that method to call "
                    "zmqsync.transport.ray.deliver)"
                ) from None
            self._actors[peer] = _Actor(index, handle, method)
        return peer

    @property
    def peers(self) -> list[PeerId]:
        """Every actor's peer id, dead or not."""
        return list(self._actors)

    def lost_peers(self) -> frozenset[PeerId]:
        """Actors whose calls failed with ``ActorDiedError``."""
        with self._lock:
            return frozenset(pid for pid, actor in self._actors.items() if actor.dead is not None)

    def reserved_workers(self) -> frozenset[int]:
        """Each actor's worker index."""
        with self._lock:
            return frozenset(actor.index for actor in self._actors.values())

    # --- HubTransport ----------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"ray://{self._channel}"

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"Ray hub {self.endpoint} is closed")

    def shared_buffer(self, nbytes: int) -> Any:
        """Shared memory to carve a sender's snapshot from (sent without another copy to
        actors that read the hub's blocks), or None."""
        self._check_open()
        if self._shm is None:
            return None
        lent = self._shm.lend(nbytes)
        return None if lent is None else lent[1]

    def _shared_payload(
        self, frames: Sequence[Buffer]
    ) -> tuple[list[bytes], list[Block], Any] | None:
        """The message as places in shared blocks, the blocks, and what keeps them lent;
        None when it has no frame large enough or every block is busy."""
        assert self._shm is not None
        shared, keep = self._shm.share(frames)
        refs = [f for f in shared if isinstance(f, Ref)]
        if not refs:
            return None
        entries = []
        inline: list[bytes] = []
        for f in shared:
            if isinstance(f, Ref):
                block = f.block
                entries.append(_SHM_ENTRY.pack(block.id, block.fd, block.size, f.offset, f.length))
            else:
                entries.append(_SHM_ENTRY.pack(-1, -1, 0, 0, 0))
                inline.append(f if isinstance(f, bytes) else bytes(f))
        live = self._shm.live_ids()
        head = (
            _SHM_HEAD.pack(_SHARED, os.getpid(), len(shared), len(live))
            + b"".join(entries)
            + b"".join(_LIVE.pack(i) for i in live)
        )
        blocks = list({f.block.id: f.block for f in refs}.values())
        return [head, *inline], blocks, keep

    def _hold(self, actor: _Actor, blocks: list[Block]) -> None:
        assert self._shm is not None
        for block in blocks:
            self._shm.hold(block, actor.index)

    def _let_go(self, actor: _Actor, payload: Any) -> None:
        """A shared-memory message for ``actor`` that will never be sent: release it."""
        if isinstance(payload, _SharedPayload) and self._shm is not None:
            for block in payload.blocks:
                self._shm.release(block.id, actor.index)

    def _payload(self, frames: Sequence[Buffer]) -> Any:
        if sum(len(f) for f in frames) < self._inline_bytes:
            return _owned(frames)
        import numpy as np

        # One copy, into the object store; each actor then maps it read-only.
        arrays = [f if isinstance(f, bytes) else np.frombuffer(f, dtype=np.uint8) for f in frames]
        try:
            ref = self._ray.put(arrays)
        except Exception as exc:
            raise TransportError(
                f"putting a message into Ray's object store failed: {exc}"
            ) from exc
        with self._lock:
            self._counters["object_store_puts"] += 1
        return ref

    def _call(self, actor: _Actor, payload: Any, *, frames: Any = None) -> None:
        """Start one call (caller holds the lock); its result arrives as an event.
        ``frames``: a chunk's, kept until its call is done."""
        seq = actor.next_seq
        if frames is not None:
            actor.chunk_calls[seq] = frames
        actor.next_seq += 1
        actor.in_flight += 1
        if isinstance(payload, _SharedPayload):
            payload = list(payload)  # Ray pickles what it is given: plain bytes only
        try:
            future = actor.method.remote(self._channel, actor.index, payload, seq).future()
        except Exception as exc:  # a failed submission is a failed call
            failed: Any = _Failed(exc)
            self._events.put((actor, seq, failed))
            return
        future.add_done_callback(lambda f, a=actor, s=seq: self._events.put((a, s, f)))

    def _submit_chunks(self, actor: _Actor) -> None:
        """Call ``actor`` with its waiting chunks, in order, CHUNK_CALLS at a time
        (caller holds the lock)."""
        while actor.waiting and len(actor.chunk_calls) < CHUNK_CALLS and actor.dead is None:
            message, frames = actor.waiting.popleft()
            self._call(actor, message, frames=frames)

    def send_frames(
        self, frames: Sequence[Buffer], *, to: Collection[PeerId] | None = None
    ) -> None:
        self._check_open()
        chunk = bool(frames) and peek_kind(frames[0]) is Kind.WEIGHTS
        first = chunk and starts_version(frames[0])
        with self._lock:
            targets = (
                list(self._actors.values()) if to is None else [self._actors.get(p) for p in to]
            )
            live = [
                a
                for a in targets
                if a is not None and a.dead is None and a.in_flight < MAX_IN_FLIGHT
            ]
            self._counters["dropped_sends"] += len(targets) - len(live)
            if not live:
                return
        shared = [a for a in live if a.shared] if self._shm is not None else []
        big = sum(len(f) for f in frames) >= self._inline_bytes
        shared_payload: _SharedPayload | None = None
        if shared and big:
            made = self._shared_payload(frames)
            if made is not None:
                shared_payload = _SharedPayload(made[0], made[1], made[2])
        others = [a for a in live if shared_payload is None or not a.shared]
        payload = self._payload(frames) if others else None
        with self._lock:
            for actor in live:
                message = payload if shared_payload is None or not actor.shared else shared_payload
                if message is shared_payload:
                    self._hold(actor, shared_payload.blocks)  # type: ignore[union-attr]
                    self._counters["shared_sends"] += 1
                if not chunk:
                    self._call(actor, message)
                    continue
                if first:
                    # A newer version starts: chunks of older ones still waiting go.
                    self._counters["dropped_sends"] += len(actor.waiting)
                    for old, _ in actor.waiting:
                        self._let_go(actor, old)
                    actor.waiting.clear()
                if len(actor.waiting) >= MAX_WAITING:
                    self._counters["dropped_sends"] += 1
                    self._let_go(actor, message)
                    continue
                actor.waiting.append((message, list(frames)))
                self._submit_chunks(actor)

    def _poll_due(self, now: float) -> float | None:
        """Poll every idle actor that is due; return when the next one will be."""
        soonest: float | None = None
        with self._lock:
            for actor in self._actors.values():
                if actor.dead is not None or actor.in_flight:
                    continue
                if actor.next_poll <= now:
                    self._counters["polls"] += 1
                    if actor.shared is None and self._shm is not None and not actor.probing:
                        actor.probing = True  # ask once whether it reads our blocks
                        self._call(actor, [self._probe_record])
                    else:
                        self._call(actor, None)
                elif soonest is None or actor.next_poll < soonest:
                    soonest = actor.next_poll
        return soonest

    def _complete(self, actor: _Actor, seq: int, future: Any) -> None:
        with self._lock:
            actor.finished[seq] = future
            while actor.done_seq in actor.finished:
                done = actor.finished.pop(actor.done_seq)
                if actor.chunk_calls.pop(actor.done_seq, None) is not None:
                    self._submit_chunks(actor)
                actor.done_seq += 1
                actor.in_flight -= 1
                replies = [
                    r for r in self._result(actor, done) if not self._transport_reply(actor, r)
                ]
                self._ready.extend(Incoming(frames, peer_id(actor.index)) for frames in replies)
                # An actor with something to say is busy with something (joining): ask
                # again soon. An idle one is asked less and less often.
                actor.poll_gap = (
                    FAST_POLL if replies else min(self._poll_interval, actor.poll_gap * 2)
                )
                actor.next_poll = time.monotonic() + actor.poll_gap

    def _transport_reply(self, actor: _Actor, frames: list[Buffer]) -> bool:
        """Handle a reply meant for this transport (a probe's answer, a release); True if
        it was one (caller holds the lock)."""
        if len(frames) != 1:
            return False
        record = bytes(frames[0][:4])
        if record == _ANSWER:
            actor.probing = False
            actor.shared = bytes(frames[0][4:5]) == b"\x01"
            return True
        if record == _RELEASE:
            try:
                (block_id,) = _LIVE.unpack(bytes(frames[0][4:]))
            except struct.error:
                block_id = -1
            if self._shm is None or not self._shm.release(block_id, actor.index):
                self._counters["bad_releases"] += 1
            return True
        return False

    def _result(self, actor: _Actor, future: Any) -> list[list[Buffer]]:
        exceptions = self._ray.exceptions
        try:
            result = future.result(timeout=0)
        except exceptions.ActorDiedError as exc:
            if actor.dead is None:
                actor.dead = str(exc).splitlines()[0] if str(exc) else "actor died"
                self._counters["peers_lost"] += 1
                if self._shm is not None:
                    self._shm.forget(actor.index)  # it reads no block any more
                actor.waiting.clear()
                log.warning("Ray actor of worker %d died: %s", actor.index, actor.dead)
            return []
        except Exception as exc:  # counted; the actor stays in the fleet
            self._counters["remote_errors"] += 1
            self.last_error = f"worker {actor.index}: {type(exc).__name__}: {exc}"[:2000]
            log.warning(
                "a call to the Ray actor of worker %d failed: %s", actor.index, self.last_error
            )
            return []
        if not isinstance(result, list) or not all(
            isinstance(m, list) and all(isinstance(b, bytes | bytearray | memoryview) for b in m)
            for m in result
        ):
            self._counters["remote_errors"] += 1
            self.last_error = (
                f"worker {actor.index}: {self._method} returned {type(result).__name__}, not a "
                "list of messages"
            )
            log.warning("%s", self.last_error)
            return []
        return result

    def recv_frames(self, timeout: float | None) -> Incoming | None:
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if self._ready:
                    return self._ready.pop(0)
            now = time.monotonic()
            next_poll = self._poll_due(now)
            remaining = None if deadline is None else max(0.0, deadline - now)
            wait = remaining
            if next_poll is not None:
                until_poll = max(0.0, next_poll - now)
                wait = until_poll if wait is None else min(wait, until_poll)
            woken = False
            event = self._take(wait)
            while event is not None:  # everything that has completed meanwhile, too
                if event is _WOKEN:
                    woken = True
                else:
                    self._complete(*event)  # type: ignore[misc]
                event = self._take(0)
            if self._closed:
                raise TransportClosed(f"Ray hub {self.endpoint} is closed")
            with self._lock:
                if self._ready:
                    # A reply beats a wake-up: whoever woke us gets the hub back at once
                    # either way.
                    return self._ready.pop(0)
            if woken or remaining == 0:
                return None

    def _take(self, timeout: float | None) -> object:
        try:
            if timeout is not None and timeout <= 0:
                item = self._events.get_nowait()
            else:
                item = self._events.get(timeout=timeout)
        except queue.Empty:
            return None
        return _WOKEN if item is None else item

    def wake(self) -> None:
        self._events.put(None)

    def counters(self) -> dict[str, int]:
        with self._lock:
            counts = dict(self._counters)
        if self._shm is not None:
            counts["shm_bytes"] = self._shm.nbytes()
        return counts

    def close(self) -> None:
        # Calls under way are left to finish or fail on their own: nothing waits on them.
        if self._closed:
            return
        self._closed = True
        self._events.put(None)
        if self._shm is not None:
            self._shm.close()
        if self._probe is not None:
            self._probe.close()


_WOKEN: Final = object()


class _SharedPayload(list):
    """A shared-memory message (what Ray sends: a list of bytes), with the blocks it
    names and what keeps them lent until it is sent."""

    def __init__(self, items: list[bytes], blocks: list[Block], keep: Any) -> None:
        super().__init__(items)
        self.blocks = blocks
        self.keep = keep


class _Failed:
    """A call that could not even be submitted, shaped like a failed future."""

    def __init__(self, exc: BaseException) -> None:
        self._exc = exc

    def result(self, timeout: float | None = None) -> Any:
        raise self._exc
