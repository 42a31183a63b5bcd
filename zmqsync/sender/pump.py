"""One hub and the pump thread that serves it: who holds the hub (the baton), the
window of chunks each transfer may have in the transport at once, and how long a
stopped peer may hold a chunk (the stall clock).

A chunk held past the clock's limit is a stopped peer's, unless a worker it went to
says it still reads it: a worker whose chunks come slowly says so as they come
(:class:`~zmqsync.protocol.Reading`), and the window waits while one that has not read
this chunk keeps saying it reads (up to :data:`STALL_MAX`). A slow link's worker keeps
its stream whole; a stopped worker goes quiet and is given up on at the limit."""

from __future__ import annotations

import contextlib
import logging
import select
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any, Final, NamedTuple, Protocol

import numpy as np

from zmqsync.sender.stats import SendStats
from zmqsync.sender.transfers import Copy, Forwarded, Transfer
from zmqsync.transport.base import HubTransport, Incoming, Lends, PeerId, Stream, Waitable
from zmqsync.transport.wakeup import Wakeup

__all__ = [
    "MAX_REPAIRS",
    "PUMP_TICK",
    "READING_CHECK",
    "STALL_MEMORY",
    "WINDOW",
    "WINDOW_WAIT",
    "HubRunner",
    "InFlight",
    "PumpHost",
    "StallClock",
    "sum_counters",
]

log = logging.getLogger("zmqsync.sender")

#: How long the pump waits for a message before looking at its timers.
PUMP_TICK: Final = 0.05
#: Chunks of one transfer that transports may hold at once (queued, or on the wire).
#: Below every transport's queue limit for one peer (ZeroMQ's DATA_HWM), so none is
#: dropped for a peer that keeps up; enough that a chunk is always ready to go out.
WINDOW: Final = 4
#: Transfers of the latest version to single workers (repairs, late joiners) at once;
#: a worker asking beyond it asks again at its next heartbeat.
MAX_REPAIRS: Final = 8
#: A peer that was sent a relay's version this lately (seconds), or within the time the
#: stream took, may still be reading it: what it asks for meanwhile is not sent again.
#: Its heartbeats go on while the last chunks wait in the transport and while it applies
#: them, and on a busy host one sent then arrives a good while after the stream ended
#: (0.25 s was too short: a relay without a snapshot fetched a version again for such a
#: heartbeat). The sender's default ``repair_after`` (1 s) waits as long after a send.
READING_GRACE: Final = 1.0
#: How long a transfer blocked on its window waits for transports before looking again
#: (a ZeroMQ hub waits whole milliseconds: one).
WINDOW_WAIT: Final = 0.0005
#: A chunk held this long (seconds), and far longer than chunks usually take, counts as
#: held by a stopped peer: the window goes on without it. The peer's transport queue then
#: fills, its later chunks are dropped and its stream breaks; it is repaired once back.
STALL_MIN: Final = 0.25
STALL_MAX: Final = 10.0
#: How many times the usual release time a chunk may take before it counts as stalled.
STALL_FACTOR: Final = 8.0
#: For this long after a stall, a stopped peer is known to be about: chunks it pins are
#: waited for only a little (its transport queue fills within a few windows, and each
#: would otherwise cost the whole fleet a full stall limit).
STALL_MEMORY: Final = 5.0
STALL_KNOWN: Final = 0.02
#: How often (seconds) a window held past the limit asks its sender again whether a
#: worker the chunk went to still reads it.
READING_CHECK: Final = 0.05


def sum_counters(counters: Iterable[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for c in counters:
        for k, v in c.items():
            total[k] = total.get(k, 0) + v
    return total


class StallClock:
    """How long chunks usually take to be let go of, and when one last stalled: how
    long a chunk may be held before its holder counts as stopped. The pumps of one
    sender share one, so that what one hub learns of a stopped peer holds for all."""

    __slots__ = ("last_stall", "release_time")

    def __init__(self) -> None:
        #: How long chunks usually take to be let go of (seconds, a moving average).
        self.release_time = 0.01
        #: When a chunk last stalled (time.monotonic()).
        self.last_stall = -STALL_MEMORY

    def released_after(self, seconds: float) -> None:
        """A chunk was let go of ``seconds`` after it was sent (an upper bound)."""
        self.release_time += 0.2 * (seconds - self.release_time)

    def limit(self, now: float) -> float:
        """How long a chunk may be held, at ``now``, before its holder counts as stopped."""
        limit = min(STALL_MAX, max(STALL_MIN, STALL_FACTOR * self.release_time))
        if now - self.last_stall < STALL_MEMORY:
            return min(limit, max(STALL_KNOWN, 2 * self.release_time))
        return limit

    def stalled(self, now: float) -> None:
        """A chunk was held past the limit at ``now``: a stopped peer is about."""
        self.last_stall = now


class PumpHost(Protocol):
    """What a pump needs from the sender it serves, called on the pump's thread holding
    the runner's baton (but :meth:`forwarded_version`, from any thread)."""

    def housekeeping(self, runner: HubRunner) -> None:
        """Between messages: timers, and what is to be done on this runner's hub."""

    def handle(self, incoming: Incoming, runner: HubRunner) -> None:
        """One message that came through this runner's hub. Never raises."""

    def pump_failed(self, exc: BaseException) -> None:
        """The pump stopped on ``exc`` (its thread ends)."""

    def forwarded_version(self) -> int | None:
        """The version of a stream the host forwards (a relay), if any."""

    def forward_starting(self, runner: HubRunner, peer: PeerId) -> bool:
        """Whether the host is beginning to forward a version to ``peer`` through
        ``runner``'s hub, which has no transfer of it yet (from any thread)."""

    def reading(self, runner: HubRunner, chunk: InFlight, now: float) -> bool:
        """Whether a worker that ``chunk`` went to through ``runner``'s hub, and that has
        not read it yet, says it still reads (slowly), at ``now`` (from any thread)."""

    def read_stalled(self, runner: HubRunner, chunk: InFlight, quiet: bool) -> None:
        """The window waited for ``chunk`` on workers' word that they read it, and gave
        up: at :data:`STALL_MAX` (their word is not to be taken again), or (``quiet``)
        once they went quiet, which a worker whose link slowed down may do once."""


class InFlight(NamedTuple):
    """A chunk handed to the hub: when, the views of its memory the hub may hold, the
    version it is of (-1: a delta's), whom it is for (None: every peer of the hub), and
    which chunk it is (the version it brings, its index), as workers' notes name it."""

    sent_at: float
    views: list[weakref.ref[np.ndarray]]
    version: int = -1
    to: list[PeerId] | None = None
    read: tuple[int, int] = (0, 0)

    def held(self) -> bool:
        """Whether the hub still holds some of the chunk (queued, or on the wire)."""
        return any(r() is not None for r in self.views)


class HubRunner:
    """One hub, its baton and the pump thread that serves it.

    The hub's sockets are used by one thread at a time, the baton's holder. Between
    sends the pump serves the hub (hellos, snapshot requests, status, stray acks).

    Where the hub has descriptors to wait on (ZeroMQ's), the pump waits on them holding
    nothing, and takes the baton only to read what came: a sending thread takes the
    baton at once, with no thread to wake first (a wake-up and a hand-off cost more
    than a 1 MB send's own work on a busy 2-core machine). With one hub, the sending
    thread reads its acks itself, so the pump does not even wake for them; it picks up
    stray ones on its tick. Whoever lets go of the baton checks for input first and
    wakes the pump if any is waiting (the descriptors say "look again", not "a message
    is here", and the holder's own reads may have consumed that signal).

    Other hubs (pipes, Ray, memory) are served by a pump blocked in ``recv_frames``
    with the baton held; a sending thread then wakes it (``hub.wake()``) and it lets go.
    """

    def __init__(
        self,
        host: PumpHost,
        hub: HubTransport,
        index: int,
        *,
        stats: SendStats,
        clock: StallClock | None = None,
        name: str = "",
    ) -> None:
        self._host = host
        self.hub = hub
        self.index = index
        #: Where chunks sent and stalls are counted.
        self._stats = stats
        self.clock = StallClock() if clock is None else clock
        #: The hub's abilities this runner uses, if it has them.
        self._waitable = hub if isinstance(hub, Waitable) else None
        self._lends = hub if isinstance(hub, Lends) else None
        self._baton = threading.Lock()
        self._owner: int | None = None
        self._wanted = 0
        self._free = threading.Condition()
        self._stopping = False
        self._waiting = False  # the pump waits on the hub's descriptors, not in recv_frames
        self._acks = True  # whether the pump wakes for acks (not when send() reads them)
        self._pokes: Wakeup | None = None  # wakes a waiting pump (see _run_waiting)
        #: Effects of the fleet core meant for this hub, decided on another hub's thread.
        self.later: deque[Any] = deque()
        #: Peers that asked for status while a send waited for acks, and when this hub
        #: last sent a report (the sender answers them; see its STATUS_INTERVAL).
        self.status_askers: deque[PeerId] = deque()
        self.status_at = float("-inf")
        #: Versions streaming to this hub (the baton holder advances them), oldest first,
        #: and their chunks that the hub may still hold: (sent at, weak refs to views).
        self.transfers: deque[Transfer] = deque()
        #: The last transfers sent whole, as (version, to, started, finished): a repair
        #: of what one just sent waits (no copy is kept alive by it).
        self.done: deque[tuple[int, list[PeerId] | None, float, float]] = deque(maxlen=MAX_REPAIRS)
        self.inflight: deque[InFlight] = deque()
        self._window_full = False  # whether the last advance() stopped at a full window
        #: The chunk a window waits for past the stall limit (a slow reader's), and the
        #: last answer to whether its workers still read it: (asked at, the answer).
        self._waited: InFlight | None = None
        self._reading = (float("-inf"), False)
        #: When the window last waited past the limit on a reader's word.
        self._read_wait = float("-inf")
        self._thread = threading.Thread(
            target=self._run, name=f"zmqsync-sender-{name}-{hub.name}", daemon=True
        )

    def start(self, *, wake_for_acks: bool = True) -> None:
        """Start the pump; ``wake_for_acks``: False when the sending thread reads the acks
        itself (one hub), so that the pump does not wake for them."""
        self._acks = wake_for_acks
        if self._waitable is not None:
            self._pokes = Wakeup()
            self._waiting = True
        self._thread.start()

    def begin(self, transfer: Transfer) -> None:
        """Stream ``transfer``'s version to this hub, superseding older versions' streams
        (their workers are repaired by this one), and send what the window allows."""
        with self.holding():
            version = transfer.copy.version
            self.transfers = deque(t for t in self.transfers if t.copy.version >= version)
            self.transfers.append(transfer)
            streaming = self.advance()
        if streaming and self._waiting:
            self._poke()  # the pump streams the rest if this thread does not

    def send_more(self) -> None:
        """Send what the window allows now (taking the baton); the pump streams the rest."""
        with self.holding():
            streaming = self.advance()
        if streaming and self._waiting:
            self._poke()

    def streams(self, copy: Copy | Forwarded) -> bool:
        """Whether a transfer streams ``copy`` to this hub (taking the baton)."""
        with self.holding():
            return any(t.copy is copy for t in self.transfers)

    def drop_unreadable(self) -> None:
        """Stop the transfers whose copy can no longer be read (taking the baton)."""
        with self.holding():
            self.transfers = deque(t for t in self.transfers if t.copy.readable)

    def lending(self) -> bool:
        """Whether the hub lends memory its peers read in place, now."""
        return self._lends is not None and self._lends.lending()

    def all_keep_versions(self) -> bool:
        """Whether the hub lends memory and every peer keeps each version mapped."""
        return self._lends is not None and self._lends.all_keep_versions()

    def lend(self, nbytes: int) -> Any:
        """Memory the hub lends (None: it has none to lend)."""
        return None if self._lends is None else self._lends.lend(nbytes)

    def takes_device(self, device: Any) -> bool:
        """Whether every peer of the hub reads versions lent on GPU ``device``."""
        return self._lends is not None and self._lends.takes_device(device)

    def lend_device(self, nbytes: int, device: Any) -> Any:
        """Memory on GPU ``device`` the hub lends (None: none)."""
        return None if self._lends is None else self._lends.lend_device(nbytes, device)

    def repair(self, copy: Copy, peer: PeerId) -> bool:
        """Stream ``copy`` to ``peer`` alone (holding the baton); False if the hub already
        streams it to that peer or streams too many repairs."""
        repairs = [t for t in self.transfers if t.to is not None and len(t.to) == 1]
        now = time.monotonic()
        if (
            len(repairs) >= MAX_REPAIRS
            or any(t.covers(copy, peer) for t in self.transfers)
            or self._queued(copy.version, peer, now)
            or any(
                version == copy.version
                and (to is None or peer in to)
                and now - finished < finished - started
                for version, to, started, finished in self.done
            )
        ):
            # Too many, or this version is on its way to the peer (still streaming; its
            # last chunks still queued in the transport; or sent so lately that the peer
            # may still be reading it: a worker asks while a long version reaches it):
            # it asks again if it must.
            return False
        self.transfers.append(Transfer(copy, [peer]))
        return True

    def _queued(self, version: int, peer: PeerId, now: float) -> bool:
        """Whether the hub still holds chunks of ``version`` for ``peer`` that the window
        waits for. The pump counts a transfer done once the hub has its last chunk, and
        on a link slower than the window the hub holds the last few for seconds (a whole
        4-chunk version at once, before any release time is learned): a worker that asks
        meanwhile is not sent it all again. A chunk given up on, or held past STALL_MAX,
        is pinned by a stopped peer, and says nothing of whether the version reaches this
        one (a late joiner is not kept waiting on it)."""
        return any(
            c.version == version
            and (c.to is None or peer in c.to)
            and now - c.sent_at <= STALL_MAX
            and c.held()
            for c in self.inflight
        )

    def forwarding_to(self, peer: PeerId) -> bool:
        """Whether a relay's version is on its way to ``peer`` (holding the baton): about
        to stream, still streaming, or sent so lately that the peer may still be reading
        it."""
        if self._host.forward_starting(self, peer):
            return True
        if any(
            isinstance(t.copy, Forwarded) and t.copy.readable and (t.to is None or peer in t.to)
            for t in self.transfers
        ):
            return True
        forwarded = self._host.forwarded_version()
        if forwarded is None:
            return False
        now = time.monotonic()
        return any(
            version == forwarded
            and (to is None or peer in to)
            and now - finished < max(finished - started, READING_GRACE)
            for version, to, started, finished in self.done
        )

    def _still_read(self, chunk: InFlight, now: float) -> bool:
        """The host's :meth:`PumpHost.reading` for ``chunk``, asked at most every
        :data:`READING_CHECK` seconds while the window waits for the same chunk."""
        asked_at, answer = self._reading
        if chunk is not self._waited or now - asked_at > READING_CHECK:
            answer = self._host.reading(self, chunk, now)
            self._waited, self._reading = chunk, (now, answer)
        return answer

    def advance(self) -> bool:
        """Send the chunks the window allows (holding the baton); True while some
        transfer has chunks left to send."""
        clock, totals = self.clock, self._stats.totals
        inflight = self.inflight
        now = time.monotonic()
        while self.transfers:
            while inflight and not inflight[0].held():
                released = inflight.popleft()
                took = now - released.sent_at
                if self._window_full and (
                    took <= clock.limit(now) or released.sent_at > self._read_wait
                ):
                    # Watched closely (the window was full): how long chunks take to go.
                    # Not what a slow reader's chunks took past the limit while the window
                    # waited for it: the limit stays one that finds a stopped peer soon.
                    clock.released_after(took)
            self._window_full = False
            if len(inflight) >= WINDOW:
                oldest = inflight[0]
                held_for = now - oldest.sent_at
                if held_for <= clock.limit(now):
                    self._window_full = True
                    return True
                if held_for <= STALL_MAX and self._still_read(oldest, now):
                    self._window_full = True
                    self._read_wait = now
                    return True
                inflight.popleft()  # held by a stopped peer: go on without it
                totals["stalls"] += 1
                clock.stalled(now)
                if self._read_wait >= oldest.sent_at:  # waited for on a worker's word
                    self._host.read_stalled(self, oldest, held_for <= STALL_MAX)
                continue
            transfer = self.transfers[0]
            if not transfer.copy.readable:
                self.transfers.popleft()  # a ring copy whose send is over
                continue
            lent = transfer.frames()
            if lent is None:
                self._window_full = True  # every ring buffer is held: wait as for the window
                return True
            frames, refs = lent
            if transfer.next == 0:
                transfer.copy.reach(transfer.to)
            stream = Stream.START if transfer.next == 0 else Stream.MORE
            self.hub.send_frames(frames, to=transfer.to, stream=stream)
            del frames  # what the hub keeps of them is what the window watches
            now = time.monotonic()
            # What a repair may wait for: a whole version (a delta brings it to some only).
            whole = transfer.copy.version if transfer.spans is None else -1
            read = (transfer.copy.version, transfer.next)
            inflight.append(InFlight(now, refs, whole, transfer.to, read))
            transfer.next += 1
            totals["chunks_sent"] += 1
            if transfer.sent:
                self.transfers.popleft()
                if transfer.spans is None:  # a delta brings the version to some only
                    self.done.append((transfer.copy.version, transfer.to, transfer.started, now))
        return False

    def _poke(self) -> None:
        """Make the pump look at the hub now (thread-safe, never blocks)."""
        assert self._pokes is not None
        self._pokes.wake()

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        if self._owner == threading.get_ident():
            yield  # re-entrant: send() holds it from the first frame to the last ack
            return
        with self._free:
            self._wanted += 1
        if not self._waiting:
            self.hub.wake()  # the pump holds the baton while it waits: make it let go
        self._baton.acquire()
        self._owner = threading.get_ident()
        try:
            yield
        finally:
            look = self._waiting and self._has_input()
            self._owner = None
            self._baton.release()
            with self._free:
                self._wanted -= 1
                if not self._wanted:
                    self._free.notify_all()
            if look:
                self._poke()

    def _has_input(self) -> bool:
        assert self._waitable is not None
        try:
            return self._waitable.has_input(acks=self._acks)
        except Exception:  # a closing hub: let the pump find out
            return True

    def _run(self) -> None:
        try:
            if self._waiting:
                self._run_waiting()
                return
            while not self._stopping:
                with self._free:
                    while self._wanted and not self._stopping:
                        self._free.wait(PUMP_TICK)
                with self._baton:
                    if self._stopping:
                        break
                    self._host.housekeeping(self)
                    streaming = self.advance()
                    incoming = self.hub.recv_frames(WINDOW_WAIT if streaming else PUMP_TICK)
                    while incoming is not None:
                        self._host.handle(incoming, self)
                        if self._wanted:
                            break
                        incoming = self.hub.recv_frames(0)
        except BaseException as exc:
            if not self._stopping:
                self._host.pump_failed(exc)

    def _run_waiting(self) -> None:
        """The pump of a hub with descriptors: wait holding nothing, then read it all."""
        waitable, pokes = self._waitable, self._pokes
        assert waitable is not None and pokes is not None
        poller = select.poll()
        poller.register(pokes.fileno(), select.POLLIN)
        watched: list[int] = []
        look = True  # read first: something may have come before the pump started
        while not self._stopping:
            with self._free:
                while self._wanted and not self._stopping:
                    self._free.wait(PUMP_TICK)
            if not look:
                # A tick reads everything, acks included; a stream goes on within a ms.
                poller.poll(1 if self.transfers else PUMP_TICK * 1000)
                pokes.drain()
            with self._baton:
                if self._stopping:
                    break
                self._host.housekeeping(self)
                self.advance()
                look = False
                incoming = self.hub.recv_frames(0)
                while incoming is not None:
                    self._host.handle(incoming, self)
                    if self._wanted:
                        look = True  # let the sender have it; read the rest after
                        break
                    incoming = self.hub.recv_frames(0)
                handles = waitable.wait_handles(acks=self._acks)
            if handles != watched:
                for fd in watched:
                    with contextlib.suppress(KeyError):
                        poller.unregister(fd)
                watched = handles
                for fd in watched:
                    poller.register(fd, select.POLLIN)

    def stop(self) -> None:
        self._stopping = True
        with self._free:
            self._free.notify_all()
        if self._waiting:
            self._poke()
        else:
            self.hub.wake()
        self._thread.join(timeout=5)
        if self._pokes is not None:
            self._pokes.close()
