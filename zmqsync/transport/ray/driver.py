"""The driver's side of the Ray transport: :class:`RayHub` calls each worker actor.

Ray serializes the calls; what zmqsync puts in them is bytes and numpy byte arrays,
nothing executable of its own.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from zmqsync.errors import TransportError
from zmqsync.protocol import Buffer
from zmqsync.transport.base import (
    Counted,
    HubTransport,
    Incoming,
    Lends,
    PeerId,
    Recipients,
    Stream,
)
from zmqsync.transport.cuda import handles
from zmqsync.transport.ends import FixedPeers, OpenEnd, worker_index
from zmqsync.transport.ray.actor import DELIVER_METHOD, MAX_BATCH, SEQ_SPAN, batch, owned
from zmqsync.transport.ray.lending import ActorLending, LentPayload
from zmqsync.transport.shm.blocks import SHM_AVAILABLE
from zmqsync.transport.shm.lent import LentPeers, TakesLentTensors
from zmqsync.transport.shm.records import (
    Go,
    LentAt,
    RecordError,
    decode,
    is_lent_record,
    is_record,
)

__all__ = ["POLL_INTERVAL", "RayHub", "peer_id"]

log = logging.getLogger("zmqsync.transport.ray")

#: Messages at least this big go through the object store (put once, read zero-copy by
#: every actor on the node); smaller ones travel inline in the call, which is cheaper.
INLINE_BYTES: Final = 64 * 1024
#: Calls under way to one actor before new messages to it are dropped: an actor that does
#: not run its calls (busy in a long method, or hung) must not grow an unbounded queue of
#: model-sized messages. The sync layer repairs it once it answers again.
MAX_IN_FLIGHT: Final = 16
#: Chunk calls under way to one actor at once: enough to keep it busy while the next
#: is submitted. The rest wait in the hub, in order (a newer version's first chunk drops
#: the waiting chunks of older ones), at most MAX_WAITING of them; those that travel in
#: the call (leases, small chunks) go together in the next call (see ``actor.batch``).
CHUNK_CALLS: Final = 2
MAX_WAITING: Final = 64
#: Why every actor is lost once this process has left Ray.
RAY_GONE: Final = "Ray is not running in this process any more (ray.shutdown() ran)"
#: Default longest gap between polls of an idle actor; it bounds how late a new worker
#: is noticed and how late its heartbeat arrives.
POLL_INTERVAL: Final = 0.25
#: Gap before the next poll of an actor whose last reply carried messages (it is in the
#: middle of something, such as joining).
FAST_POLL: Final = 0.005


def peer_id(index: int) -> PeerId:
    """The hub's peer id of the actor at ``index``: ``b"ray:3"``."""
    return b"ray:%d" % index


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
    #: This record's numbering of its calls: a call carries ``epoch * SEQ_SPAN + seq``
    #: (the actor's spoke tells a new hub by it, whichever of its calls runs first).
    epoch: int = field(default_factory=lambda: 1 + secrets.randbelow(SEQ_SPAN - 1))
    done_seq: int = 0  # next call whose result is handed on (results keep call order)
    finished: dict[int, Any] = field(default_factory=dict, repr=False)
    in_flight: int = 0
    #: Chunk calls under way, by sequence number.
    chunk_calls: set[int] = field(default_factory=set, repr=False)
    #: Chunks waiting for a call: (message, frames). The frames are kept until the call
    #: is made (a sender lets no more chunks go out meanwhile: its window is paced by
    #: the actor's calls); a call's message needs them no more (bytes, a lease on the
    #: hub's blocks, or an object in Ray's store).
    waiting: deque[tuple[Any, Any]] = field(default_factory=deque, repr=False)
    next_poll: float = 0.0
    poll_gap: float = FAST_POLL
    lost: str | None = None  # why it is gone for good (it died)
    shared: bool | None = None  # reads the hub's lent blocks (None: not offered yet)
    answer_due: bool = False  # it was offered the hub's blocks and has not answered
    #: Calls under way that carry a lease on the hub's blocks, by sequence number.
    lent_seqs: set[int] = field(default_factory=set, repr=False)
    #: The version in progress goes to it through the object store (see _via_store).
    via_store: bool = False


class RayHub(OpenEnd, FixedPeers, HubTransport, TakesLentTensors, Lends, Counted):
    """The driver's end: one Ray actor per worker.

    A Ray actor cannot be written to like a socket, and cannot easily call its driver
    back, so the hub drives every exchange:

    - ``send_frames`` calls ``actor.zmqsync_deliver(channel, peer_index, frames, seq)`` on
      each targeted actor. A large message is put into Ray's object store **once** and
      every actor on the node reads it through zero-copy, read-only views.
    - Actors on the driver's host do better: offered the hub's shared memory once, those
      that can open it get large frames as leases on the hub's reused blocks
      (:mod:`zmqsync.transport.shm`); no object in Ray's store, and the sender's snapshot
      is the block it sends. They release a block in a reply once they let go of its
      frames.
    - What the actor's side sends (acks, hellos, heartbeats) is the **result** of the next
      call. When nothing else is under way, the hub *polls* each actor (a call with no
      frames) every ``poll_interval`` seconds at most, sooner right after an actor had
      something to say.
    - Calls complete through Ray's futures, so nothing here blocks on an actor: a killed
      actor fails its calls with ``ActorDiedError`` and is counted as lost; one that hangs
      just never answers, and the sync layer's timeout names it.

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
            object in Ray's store per message. Each actor is offered them first, and
            those that cannot open them (elsewhere) get the object store.
        device_memory: a learner on a GPU writes each version into device memory lent to
            the actors whose model lives on that GPU (the same host), which copy it
            device to device (:mod:`zmqsync.transport.cuda`); needs ``shared_memory``
            (it proves an actor is on this host).

    Peer ids are ``b"ray:<index>"`` (:func:`peer_id`). Ray must be initialised
    (``ray.init()``) by the caller. Besides the contract it has the
    abilities it subclasses: ``Lends``, ``Counted``, and ``TracksPeers`` (as
    :class:`~zmqsync.transport.ends.FixedPeers`).
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
        device_memory: bool = True,
    ) -> None:
        self._ray = _ray()
        if poll_interval <= 0:
            raise ValueError(f"poll_interval must be positive seconds; got {poll_interval}")
        self._channel = channel
        self._endpoint = f"ray://{channel}"
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
            "behind_sends": 0,
            "bad_releases": 0,
            "batched_messages": 0,
            "device_sends": 0,
        }
        self._lending = (
            ActorLending(device_memory=device_memory) if shared_memory and SHM_AVAILABLE else None
        )
        #: The memory actors on this host lend (their tensors), which the sender writes
        #: versions into; believed only from an actor that reads the hub's blocks.
        self._lent = LentPeers(lambda p: f"actor {p.decode(errors='replace')}")
        #: An actor answered an ask since recv_frames last returned.
        self._answered = False
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
            index = worker_index(index)
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

    def _bound(self) -> Mapping[PeerId, _Actor]:
        # An actor is lost once its calls fail with ActorDiedError.
        return self._actors

    # --- HubTransport ----------------------------------------------------------------

    def lending(self) -> bool:
        return self._lending is not None

    def all_keep_versions(self) -> bool:
        lending = self._lending
        if lending is None:
            return False
        with self._lock:
            live = [a.index for a in self._actors.values() if a.lost is None]
        return bool(live) and all(index in lending.keeping for index in live)

    def lent_peers(self, layout: bytes) -> list[PeerId]:
        peers = self._lent.peers(layout)
        with self._lock:
            return [p for p in peers if (a := self._actors.get(p)) and a.lost is None and a.shared]

    def _lent_record(self, peer: PeerId, record: bytes, *, unmaps: bool = False) -> None:
        """A call of its own carrying one record of the lent tensors' handshake."""
        with self._lock:
            actor = self._actors.get(peer)
            if actor is None or actor.lost is not None or actor.in_flight >= MAX_IN_FLIGHT:
                self._counters["dropped_sends"] += 1
                return
            self._call(actor, [record])

    def lend(self, nbytes: int) -> Any:
        """Shared memory to carve a sender's snapshot from (sent without another copy to
        actors that read the hub's blocks), or None."""
        self._check_open()
        return None if self._lending is None else self._lending.lend(nbytes)

    def unwritten(self, memory: Any) -> None:
        if self._lending is not None:
            self._lending.unwritten(memory)

    def takes_device(self, device: Any) -> bool:
        """Whether every actor reads this host's blocks and said its model lives on GPU
        ``device``, and none keeps its versions mapped (those read host blocks)."""
        lending = self._lending
        if lending is None or lending.devices is None or not handles.IPC.lendable(device):
            return False
        with self._lock:
            live = [a for a in self._actors.values() if a.lost is None]
            return bool(live) and all(
                a.shared and a.index not in lending.keeping and lending.takes(a.index, device)
                for a in live
            )

    def lend_device(self, nbytes: int, device: Any) -> Any:
        """``nbytes`` of memory on ``device`` that frames are later sent from as they
        are, leased to the actors on that GPU through CUDA IPC; None when some actor is
        not on it (:meth:`takes_device`) or no device block is free."""
        self._check_open()
        if self._lending is None or not self.takes_device(device):
            return None
        return self._lending.lend_device(nbytes, device)

    def _on_device(
        self, frames: Sequence[Any], live: list[_Actor], lend_to: set[int]
    ) -> tuple[LentPayload | None, set[int], Sequence[Any]]:
        """For frames that lie on a GPU: the lease of their device blocks, the actors it
        goes to (those of ``lend_to`` on that GPU), and the frames as host bytes where
        some actor is not one of them (else as they are)."""
        lending = self._lending
        if lending is None or not any(handles.IPC.is_device(f) for f in frames):
            return None, set(), frames
        lent = lending.payload(frames) if lending.devices is not None else None
        device = None if lent is None else lent.device
        takers = {i for i in lend_to if device is not None and lending.device_of.get(i) == device}
        if len(takers) < len(live):
            frames = [_host(f) if handles.IPC.is_device(f) else f for f in frames]
        return (lent if takers else None), takers, frames

    def _payload(self, frames: Sequence[Buffer]) -> Any:
        if sum(len(f) for f in frames) < self._inline_bytes:
            return owned(frames)
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

    def _call(
        self, actor: _Actor, payload: Any, *, chunk: bool = False, lent: bool = False
    ) -> None:
        """Start one call (caller holds the lock); its result arrives as an event.
        ``chunk``: it carries chunks; ``lent``: a lease on the hub's blocks."""
        if not self._ray_running():
            return
        seq = actor.next_seq
        if chunk:
            actor.chunk_calls.add(seq)
        actor.next_seq += 1
        actor.in_flight += 1
        if lent or isinstance(payload, LentPayload):
            actor.lent_seqs.add(seq)
            payload = list(payload)  # Ray pickles what it is given: plain bytes only
        try:
            tagged = actor.epoch * SEQ_SPAN + seq
            future = actor.method.remote(self._channel, actor.index, payload, tagged).future()
        except Exception as exc:  # a failed submission is a failed call
            failed: Any = _Failed(exc)
            self._events.put((actor, seq, failed))
            return
        future.add_done_callback(lambda f, a=actor, s=seq: self._events.put((a, s, f)))

    def _submit_chunks(self, actor: _Actor) -> None:
        """Call ``actor`` with its waiting chunks, in order, CHUNK_CALLS at a time
        (caller holds the lock)."""
        while actor.waiting and len(actor.chunk_calls) < CHUNK_CALLS and actor.lost is None:
            message, _ = actor.waiting.popleft()
            if not isinstance(message, list) or not actor.waiting:
                self._call(actor, message, chunk=True)  # an object in Ray's store, or one
                continue
            # Messages that travel in the call go together: one call, not one each.
            messages = [message]
            while actor.waiting and len(messages) < MAX_BATCH:
                if not isinstance(actor.waiting[0][0], list):
                    break
                messages.append(actor.waiting.popleft()[0])
            if len(messages) == 1:
                self._call(actor, message, chunk=True)
                continue
            lent = any(isinstance(m, LentPayload) for m in messages)
            self._counters["batched_messages"] += len(messages)
            self._call(actor, batch(messages), chunk=True, lent=lent)

    def send_frames(
        self, frames: Sequence[Buffer], *, to: Recipients = None, stream: Stream | None = None
    ) -> None:
        self._check_open()
        chunk = stream is not None
        first = stream is Stream.START
        with self._lock:
            self._ray_running()
            targets = (
                list(self._actors.values()) if to is None else [self._actors.get(p) for p in to]
            )
            live = [
                a
                for a in targets
                if a is not None and a.lost is None and a.in_flight < MAX_IN_FLIGHT
            ]
            self._counters["dropped_sends"] += len(targets) - len(live)
            if not live:
                return
        lending = self._lending
        with self._lock:
            lend_to = {a.index for a in live if a.shared and not self._via_store(a, chunk, first)}
        big = sum(len(f) for f in frames) >= self._inline_bytes
        given = list(frames)  # what the sender watches: kept until each call is made
        on_device, takers, frames = self._on_device(frames, live, lend_to)
        lend_to -= takers
        lent = lending.payload(frames) if lending is not None and lend_to and big else None
        others = [
            a for a in live if a.index not in takers and (lent is None or a.index not in lend_to)
        ]
        payload = self._payload(frames) if others else None
        with self._lock:
            for actor in live:
                message = payload if lent is None or actor.index not in lend_to else lent
                if big and actor.shared and actor.index not in lend_to | takers:
                    self._counters["behind_sends"] += 1  # behind: the object store for it
                if lending is not None and on_device is not None and actor.index in takers:
                    message = on_device
                    for grant in lending.grants(actor.index, on_device):
                        self._call(actor, grant)  # called first: it comes first
                    lending.lease(actor.index, on_device)
                    self._counters["device_sends"] += 1
                elif lending is not None and lent is not None and message is lent:
                    lending.lease(actor.index, lent)
                    self._counters["shared_sends"] += 1
                if not chunk:
                    self._call(actor, message)
                    continue
                if first:
                    # A newer version starts: chunks of older ones still waiting go.
                    self._counters["dropped_sends"] += len(actor.waiting)
                    for old, _ in actor.waiting:
                        self._release(actor, old)
                    actor.waiting.clear()
                if len(actor.waiting) >= MAX_WAITING:
                    self._counters["dropped_sends"] += 1
                    self._release(actor, message)
                    continue
                actor.waiting.append((message, given))
                self._submit_chunks(actor)

    def _via_store(self, actor: _Actor, chunk: bool, first: bool) -> bool:
        """Whether a large message for ``actor``, which reads the hub's blocks, goes
        through the object store instead (caller holds the lock): the actor keeps each
        version mapped until the next (the shared mode) and a lent call is still on its
        way to it (stopped, or busy in a long method). Leasing it one more block per
        version would let one stuck actor pin them all; it gets copies until it catches
        up. A version's chunks all go the way its first went."""
        if chunk and not first:
            return actor.via_store
        lending = self._lending
        behind = lending is not None and actor.index in lending.keeping and bool(actor.lent_seqs)
        if chunk:
            actor.via_store = behind
        return behind

    def _poll_due(self, now: float) -> float | None:
        """Poll every idle actor that is due; return when the next one will be."""
        soonest: float | None = None
        with self._lock:
            # Checked here too: a call under way when Ray went never completes, so the
            # actor it went to is never polled (nor called) again.
            self._ray_running()
            for actor in self._actors.values():
                if actor.lost is not None or actor.in_flight:
                    continue
                if actor.next_poll <= now:
                    self._counters["polls"] += 1
                    if actor.shared is None and self._lending is not None and not actor.answer_due:
                        actor.answer_due = True  # offered once: it joins if it reads our blocks
                        self._call(actor, self._lending.offer())
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
                actor.lent_seqs.discard(actor.done_seq)
                if actor.done_seq in actor.chunk_calls:
                    actor.chunk_calls.discard(actor.done_seq)
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
        """Handle a reply meant for this transport (the answer to an offer, a release);
        True if it was one (caller holds the lock)."""
        if len(frames) != 1 or not is_record(frames):
            return False
        if is_lent_record(frames):
            self._on_lent(actor, frames[0])
            return True
        try:
            if self._lending is None:
                raise RecordError("this hub lends no memory")
            joined = self._lending.on_reply(actor.index, frames[0])
        except RecordError:
            self._counters["bad_releases"] += 1
            return True
        if joined is not None:
            actor.answer_due = False
            actor.shared = joined
            if not joined:
                log.info(
                    "the Ray actor of worker %d cannot read this host's shared memory (it "
                    "runs elsewhere): it gets versions through Ray's object store",
                    actor.index,
                )
        return True

    def _on_lent(self, actor: _Actor, frame: Buffer) -> None:
        """Where an actor's tensors lie, or its answer to an ask (caller holds the
        lock). Only an actor that reads the hub's blocks proved it is on this host:
        from any other, it is a bad record."""
        try:
            record = decode(frame)
        except RecordError:
            record = None
        if isinstance(record, LentAt) and actor.shared:
            self._lent.said(peer_id(actor.index), record)
        elif isinstance(record, Go) and actor.shared:
            self._lent.answered(peer_id(actor.index), record)
            self._answered = True
        else:
            self._counters["bad_releases"] += 1

    def _release(self, actor: _Actor, payload: Any) -> None:
        """A message for ``actor`` that will never be sent: release its lease."""
        if self._lending is not None:
            self._lending.release(actor.index, payload)

    def _lose(self, actor: _Actor, why: str) -> None:
        """``actor`` is gone for good: no more calls, no block lent to it."""
        if actor.lost is not None:
            return
        actor.lost = why
        self._counters["peers_lost"] += 1
        if self._lending is not None:
            self._lending.forget(actor.index)  # it reads no block any more
        self._lent.forget(peer_id(actor.index))
        actor.waiting.clear()
        actor.lent_seqs.clear()
        log.warning("Ray actor of worker %d is lost: %s", actor.index, why)

    def _ray_running(self) -> bool:
        """Whether this process is still connected to Ray (caller holds the lock). Once
        ``ray.shutdown()`` has run, a call or a put would start a new local cluster (Ray
        connects on first use) from the hub's thread, with none of the hub's actors in
        it; instead every actor is lost, so nothing more is called or put, and the
        sender's timeouts say so."""
        if self._ray.is_initialized():
            return True
        for actor in self._actors.values():
            self._lose(actor, RAY_GONE)
        return False

    def _result(self, actor: _Actor, future: Any) -> list[list[Buffer]]:
        exceptions = self._ray.exceptions
        try:
            result = future.result(timeout=0)
        except exceptions.ActorDiedError as exc:
            self._lose(actor, str(exc).splitlines()[0] if str(exc) else "actor died")
            return []
        except Exception as exc:  # counted; the actor stays in the fleet
            self._counters["remote_errors"] += 1
            error = f"worker {actor.index}: {type(exc).__name__}: {exc}"[:2000]
            log.warning("a call to the Ray actor of worker %d failed: %s", actor.index, error)
            return []
        if not isinstance(result, list) or not all(
            isinstance(m, list) and all(isinstance(b, bytes | bytearray | memoryview) for b in m)
            for m in result
        ):
            self._counters["remote_errors"] += 1
            log.warning(
                "worker %d: %s returned %s, not a list of messages",
                actor.index,
                self._method,
                type(result).__name__,
            )
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
            self._check_open()
            with self._lock:
                if self._ready:
                    # A reply beats a wake-up: whoever woke us gets the hub back at once
                    # either way.
                    return self._ready.pop(0)
                answered, self._answered = self._answered, False
            if woken or answered or remaining == 0:  # an answer: the sender takes it at once
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
        if self._lending is not None:
            counts["shm_bytes"] = self._lending.pool.nbytes()
            devices = self._lending.devices
            if devices is not None and (devices.nbytes() or devices.refused):
                counts["device_bytes"] = devices.nbytes()
                counts["device_refused"] = devices.refused
            counts["bad_releases"] += self._lending.bad_releases
            with self._lock:
                shared = [a.shared for a in self._actors.values() if a.lost is None]
            # Actors that read the hub's blocks (on this host), and those that cannot.
            counts["actors_sharing"] = sum(s is True for s in shared)
            counts["actors_not_sharing"] = sum(s is False for s in shared)
        counts.update(self._lent.counts())
        return counts

    def close(self) -> None:
        # Calls under way are left to finish or fail on their own: nothing waits on them.
        if self._closed:
            return
        self._closed = True
        self._events.put(None)
        if self._lending is not None:
            self._lending.close()


_WOKEN: Final = object()


def _host(frame: Any) -> Any:
    """A frame on a GPU as host bytes (a numpy array)."""
    return frame.detach().cpu().numpy()


class _Failed:
    """A call that could not even be submitted, shaped like a failed future."""

    def __init__(self, exc: BaseException) -> None:
        self._exc = exc

    def result(self, timeout: float | None = None) -> Any:
        raise self._exc
