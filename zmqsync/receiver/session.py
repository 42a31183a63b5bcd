"""A worker's conversation with its sender: joining, heartbeats, acks, failover, goodbye.

Joining follows ZeroMQ's Clone pattern: say hello, subscribe, prove the subscription is
live with a probe (no ``sleep()``), then ask for a snapshot of the latest version.
Heartbeats (a snapshot request with the version held) keep a worker caught up after
anything it missed: a dropped message, a cut link, a restarted sender.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol

from zmqsync import protocol
from zmqsync.receiver.observer import PendingAck, ReceiverObserver
from zmqsync.receiver.pace import ReadPace
from zmqsync.receiver.rejections import Rejections
from zmqsync.transport.base import Follows, SpokeTransport

__all__ = [
    "FAILOVER_HEARTBEATS",
    "FAILOVER_MIN_SECONDS",
    "SessionHost",
    "SpokeLock",
    "UpstreamSession",
]

log = logging.getLogger("zmqsync.receiver")

#: A worker with a failover list moves on when its upstream, which answers every
#: heartbeat, was silent this many heartbeats (and at least FAILOVER_MIN_SECONDS).
FAILOVER_HEARTBEATS: Final = 4
FAILOVER_MIN_SECONDS: Final = 2.0
#: Longest close() waits for another thread to let go of the spoke before saying
#: goodbye (a connect() under way notices the close between two of its retries).
GOODBYE_WAIT: Final = 1.0
#: Longest a thread that loops over the spoke waits, between two turns, for the other
#: threads that asked for it to have had theirs.
GIVE_WAY_WAIT: Final = 1.0


class SpokeLock:
    """The reentrant lock that lets one thread use the spoke at a time, and that a
    looping thread hands over.

    A plain lock is not fair: a background thread that releases it and takes it again
    at once can keep a thread that asked for it (an ack, a goodbye, a request for the
    latest) waiting for seconds. So a thread that let go of it, before taking it
    again, lets every thread that asked meanwhile have its turn (:meth:`give_way`).
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._asking = 0
        self._turns = threading.Condition(threading.Lock())
        self._owner: int | None = None
        self._depth = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        with self._turns:
            self._asking += 1
        try:
            got = self._lock.acquire(blocking, timeout)
        finally:
            with self._turns:
                self._asking -= 1
                if not self._asking:
                    self._turns.notify_all()
        if got:
            self._owner = threading.get_ident()
            self._depth += 1
        return got

    def release(self) -> None:
        self._depth -= 1
        if not self._depth:
            self._owner = None
        self._lock.release()

    def __enter__(self) -> SpokeLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def give_way(self, timeout: float = GIVE_WAY_WAIT) -> None:
        """Wait, at most ``timeout`` seconds, until no other thread asks for the lock;
        at once if none does, or if this thread holds it."""
        if self._owner == threading.get_ident():
            return
        with self._turns:
            self._turns.wait_for(lambda: not self._asking, timeout)


class SessionHost(Protocol):
    """What the session needs from the receiver that holds it: what it holds, for its
    Hellos, heartbeats, acks and goodbye."""

    @property
    def version(self) -> int:
        """The version held."""

    @property
    def epoch(self) -> int:
        """The sender's life the version held is of."""

    @property
    def torn(self) -> bool:
        """Whether the version held is not whole (heartbeats say so, and the sender
        then sends it whole)."""


class UpstreamSession:
    """The receiver's conversation with its upstream: the transport (and the lock that
    lets one thread use it at a time), the failover list, the session from the last
    Welcome, heartbeats, and the acks and refusals it sends.

    It owns :attr:`spoke` (replaced on failover), :attr:`io_lock`, :attr:`worker_idx`
    (the sender may assign it) and the epoch of the sender's life it follows
    (:attr:`sender_epoch`). It adds to ``stats``, the receiver's counters, and reads the
    apply figures its acks carry there.
    """

    def __init__(
        self,
        host: SessionHost,
        spoke: SpokeTransport,
        *,
        model_id: str,
        strategy: str,
        worker_idx: int | None,
        failover: Sequence[Callable[[], SpokeTransport]],
        stats: dict[str, Any],
        rejections: Rejections,
        observer: ReceiverObserver,
    ) -> None:
        self._host = host
        self._rejections = rejections
        self._observer = observer
        self.stats = stats
        self.model_id = model_id
        self.strategy = strategy
        self.spoke = spoke
        #: The spoke's sockets are used by one thread at a time: connect(), the
        #: receiver's receive() or its background thread.
        self.io_lock = SpokeLock()
        self.worker_idx = worker_idx
        #: Whether the sender picks this worker's id (and may pick another one later).
        self._auto_id = worker_idx is None
        self._failover = list(failover)
        self._failovers = 0
        #: When the upstream was last heard from (any message).
        self._last_heard = time.monotonic()
        #: The sender's heartbeat (seconds), from its Welcome.
        self.heartbeat = 1.0
        self._last_heartbeat = 0.0
        #: Whether a Welcome answered the attempt under way.
        self.welcomed = False
        #: Whether the latest version is held (or nothing is coming): connect() waits
        #: for it.
        self.caught_up = False
        #: The epoch of the sender's life it follows (a new one means a restart).
        self.sender_epoch = 0
        self._probe_nonce = ""
        #: Whether the last probe came back (see :meth:`start_probe`).
        self.probe_ok = False
        #: For a rank of a sharded learner: the version whose parts are being gathered
        #: and the parts of it still missing, which each heartbeat tells (see
        #: :class:`~zmqsync.receiver.ranks.RankSessions`).
        self.waiting: tuple[int, tuple[int, ...]] = (0, ())
        #: One attempt to connect (its repeated Hellos), and the secret of its Welcome.
        self._attempt = ""
        self._session = ""
        #: Why the sender refused this worker, until connect() raises it.
        self._refused = ""
        #: A rejected ack from before the Welcome: sent once the session exists.
        self._unsent_refusal: PendingAck | None = None
        self._pid = os.getpid()
        self._host_name = socket.gethostname()
        #: A sharded learner's ranks' endpoints, as its last Welcome named them.
        self.ranks: tuple[str, ...] = ()
        #: The slices this worker holds (a tensor-parallel worker), which its Hello says.
        self.slices: tuple[protocol.Slice, ...] = ()
        #: How fast chunks come from this upstream, and when it was last told.
        self.pace = ReadPace()

    @property
    def attempt(self) -> str:
        """The id of the connect attempt under way (its Hellos carry it)."""
        return self._attempt

    @property
    def session(self) -> str:
        """The secret of the session its last Welcome opened ("" before one)."""
        return self._session

    @property
    def pid(self) -> int:
        """This worker's process id, as its Hellos and acks give it."""
        return self._pid

    @property
    def host_name(self) -> str:
        """This worker's host name, as its Hellos and acks give it."""
        return self._host_name

    def take_refusal(self) -> str:
        """Why the sender refused this worker since last asked ("" if it did not)."""
        refused, self._refused = self._refused, ""
        return refused

    def joined(self, now: float) -> None:
        """connect() is done at ``now``: the next heartbeat is due a heartbeat later."""
        self._last_heartbeat = now

    def heard(self, now: float) -> None:
        """A message came from the upstream at ``now``."""
        self._last_heard = now

    def beat(self, now: float) -> None:
        """Send a heartbeat if one is due (welcomed, a heartbeat since the last)."""
        if self.welcomed and now - self._last_heartbeat >= self.heartbeat:
            self._last_heartbeat = now
            self.request_snapshot()

    def read(self, chunk: protocol.Chunk, now: float) -> None:
        """A chunk from this upstream was read at ``now``: if chunks come slowly, say
        so (the sender then waits for this worker as for a slow link's, not a stopped
        one's). The last chunk of a version says nothing: its ack follows."""
        gap = self.pace.chunk(chunk.first, chunk.last, now)
        if gap is None or not self._session or self.worker_idx is None:
            return
        self._send(
            protocol.Reading(
                self.model_id,
                chunk.version,
                chunk.epoch,
                self.worker_idx,
                self._session,
                chunk.index,
                gap,
            )
        )

    def ask_again(self, *, whole: bool = False) -> None:
        """Ask for the latest version now, if welcomed (a heartbeat out of turn)."""
        if self.welcomed:
            self.request_snapshot(whole=whole)

    def new_attempt(self) -> None:
        """Start connecting afresh: a new attempt id, no session until welcomed."""
        self._attempt = secrets.token_hex(8)
        self._session = ""

    def _send(self, message: protocol.Message, *, ack: bool = False) -> None:
        self.spoke.send_frames(protocol.encode(message), ack=ack)

    def send_hello(self) -> None:
        """Introduce this worker, with the version it holds and the attempt under way."""
        worker = protocol.AUTO_WORKER if self.worker_idx is None else self.worker_idx
        self._send(
            protocol.Hello(
                self.model_id,
                self._host.version,
                self._host.epoch,
                worker,
                self._pid,
                self._host_name,
                self._attempt,
                self.slices,
            )
        )

    def start_probe(self) -> None:
        """A new probe: proves the fan-out reaches this worker once it comes back."""
        self._probe_nonce = secrets.token_hex(8)
        self.probe_ok = False

    def send_probe(self) -> None:
        """Ask for the probe to come down the data path (once welcomed)."""
        if self.worker_idx is not None and self._session:  # probes follow the Welcome
            self._send(
                protocol.ProbeRequest(
                    self.model_id, self.worker_idx, self._probe_nonce, session=self._session
                )
            )

    def request_snapshot(self, whole: bool = False) -> None:
        """Send a heartbeat: a request for the latest version, saying which one is held
        (``whole``: not as a delta) and the workers the observers speak for."""
        if self.worker_idx is None or not self._session:
            # Heartbeats follow the Welcome; one that never came is asked for again.
            if self.welcomed:
                self.send_hello()
            return
        self._send(
            protocol.SnapshotRequest(
                self.model_id,
                self._host.version,
                self._host.epoch,
                self.worker_idx,
                self._session,
                torn=self._host.torn,
                whole=whole,
                below=self._observer.below(),
                gathering=self.waiting[0],
                waiting=self.waiting[1],
            )
        )

    def upstream_silent(self, now: float) -> bool:
        """Whether to follow the next upstream in the failover list: this one, which
        answers every heartbeat, has been silent too long."""
        silent = now - self._last_heard
        limit = max(FAILOVER_HEARTBEATS * self.heartbeat, FAILOVER_MIN_SECONDS)
        return bool(self._failover) and self.welcomed and silent > limit

    def fail_over(self) -> bool:
        """The upstream went silent: say hello to the next one in the failover list,
        keeping the version held; False if its spoke could not be made (the next one is
        tried later). The version in progress, if any, is the holder's to give up."""
        now = time.monotonic()
        self._last_heard = now  # the next one gets its own grace period
        make = self._failover[self._failovers % len(self._failover)]
        self._failovers += 1
        try:
            spoke = make()
        except Exception as exc:  # a bad address: try the next one later
            log.warning("worker %s: failover failed: %s", self.worker_idx, exc)
            return False
        self.welcomed = False
        old, self.spoke = self.spoke, spoke
        old.close()
        self.stats["failovers"] += 1
        log.warning(
            "worker %s: its upstream went silent; now following %s",
            self.worker_idx,
            getattr(spoke, "endpoint", "the next upstream"),
        )
        self.new_attempt()
        self.send_hello()
        return True

    def on_control(self, message: protocol.Message) -> None:
        """Handle a control message from the upstream (anything but a chunk)."""
        if isinstance(message, protocol.Welcome):
            if message.attempt != self._attempt:
                self.stats["stale"] += 1  # the answer to an earlier attempt
                return
            if self.worker_idx is None:
                self.worker_idx = message.worker  # assigned by the sender
            self._session = message.session
            if self._unsent_refusal is not None:
                refusal, self._unsent_refusal = self._unsent_refusal, None
                self.ack(refusal)
            elif self._host.epoch == message.epoch:
                # What it holds of this sender, acked anew: an ack sent while it had no
                # session (a restarted sender's version, applied before its Welcome) was
                # never counted, and a send may be waiting for it.
                self.ack(PendingAck(applied=True))
            if message.strategy != self.strategy:
                self._rejected(
                    f"sender uses strategy {message.strategy!r}, this worker {self.strategy!r}"
                )
            if isinstance(self.spoke, Follows):
                self.spoke.follow(
                    {"data_endpoint": message.data_endpoint, "ack_endpoint": message.ack_endpoint}
                )
            self.heartbeat = message.heartbeat_seconds
            self.sender_epoch = message.epoch
            self.ranks = message.ranks
            self.welcomed = True
        elif isinstance(message, protocol.Probe):
            if message.worker == self.worker_idx and message.nonce == self._probe_nonce:
                self.probe_ok = True
        elif isinstance(message, protocol.UpToDate):
            if message.epoch != self.sender_epoch and self.welcomed:
                # A restarted sender: say hello again (its data address may be new).
                self.sender_epoch = message.epoch
                self.new_attempt()
                self.send_hello()
            # Nothing is coming (or the sender keeps no snapshot): caught up. If the latest
            # is already on its way, wait for it instead.
            if not message.in_flight:
                self.caught_up = True
        elif isinstance(message, protocol.ErrorMessage):
            self._rejected(f"sender said {message.code}: {message.message}")
            if message.code == "unknown-session" and self.welcomed:
                # Expired while this worker was stopped, or taken over: join again.
                self.new_attempt()
                self.send_hello()
            elif message.code == "duplicate-worker":
                if self._auto_id and self.welcomed:
                    # Its id went to another worker while this one was away: ask anew.
                    self.worker_idx = None
                    self.new_attempt()
                    self.send_hello()
                else:
                    self._refused = message.message
        else:
            self._rejected(f"unexpected {type(message).__name__} at a worker")

    def _rejected(self, reason: str) -> None:
        self._rejections.add(self.worker_idx, reason)

    def ack(self, pending: PendingAck) -> None:
        """Send ``pending`` as the observers review it (they may hold it back)."""
        reviewed = self._observer.review_ack(pending)
        if reviewed is None:
            return
        if self.worker_idx is None or not self._session:
            # Not welcomed (yet, or again): no ack counts now. A refusal is told once it is.
            if not reviewed.applied:
                self._unsent_refusal = reviewed
            return
        self._send(
            protocol.Ack(
                self.model_id,
                self._host.version if reviewed.version is None else reviewed.version,
                self._host.epoch if reviewed.epoch is None else reviewed.epoch,
                worker=self.worker_idx,
                applied=reviewed.applied,
                reason=reviewed.reason[:1000],
                received_bytes=int(self.stats["received_bytes"]),
                apply_seconds=self.stats["last_apply_s"],
                rejected_frames=int(self.stats["rejected_frames"]),
                pid=self._pid,
                host=self._host_name,
                session=self._session,
            ),
            ack=True,
        )

    def say_goodbye(self) -> None:
        """Tell the sender this worker is leaving, so that it stops waiting for it.

        Best effort and never blocking: a sender that misses it waits out its timeout
        (a fleet of known size) or stops counting this worker once its heartbeats stop
        (a fleet that is whoever connected)."""
        if not self.welcomed or self.worker_idx is None or not self._session:
            return
        # Not while another thread uses the spoke: a connect() under way (it stops, seeing
        # the receiver closed), or a background thread that did not stop in time.
        if not self.io_lock.acquire(timeout=GOODBYE_WAIT):
            log.debug("the spoke stayed busy: no goodbye to the sender")
            return
        try:
            self._send(
                protocol.Goodbye(
                    self.model_id,
                    self._host.version,
                    self._host.epoch,
                    self.worker_idx,
                    self._session,
                )
            )
        except Exception:  # a closed or broken transport: the sender finds out anyway
            log.debug("could not say goodbye to the sender", exc_info=True)
        finally:
            self.io_lock.release()
