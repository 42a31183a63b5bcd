"""A worker's conversation with its sender: joining, heartbeats, acks, failover, goodbye.

Joining follows ZeroMQ's Clone pattern: say hello, subscribe, prove the subscription is
live with a probe (no ``sleep()``), then ask for a snapshot of the latest version.
Heartbeats (a snapshot request with the version held) keep a worker caught up after
anything it missed: a dropped message, a cut link, a restarted sender.
"""

from __future__ import annotations

import abc
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any, Final

from zmqsync import protocol
from zmqsync.errors import SchemaMismatchError, SyncTimeout, WeightsRejected, ZMQSyncError
from zmqsync.protocol.stream import Broken, ChunkStream
from zmqsync.transport.base import Follows, SpokeTransport

__all__ = ["FAILOVER_HEARTBEATS", "FAILOVER_MIN_SECONDS", "UpstreamSession"]

log = logging.getLogger("zmqsync.receiver")

#: connect() repeats an unanswered hello, probe or snapshot request after FIRST_RETRY
#: seconds, doubling up to RETRY_INTERVAL (a new subscription takes a few ms to be live).
FIRST_RETRY: Final = 0.005
RETRY_INTERVAL: Final = 0.2
#: A worker with a failover list moves on when its upstream, which answers every
#: heartbeat, was silent this many heartbeats (and at least FAILOVER_MIN_SECONDS).
FAILOVER_HEARTBEATS: Final = 4
FAILOVER_MIN_SECONDS: Final = 2.0
#: Longest close() waits for another thread to let go of the spoke before saying
#: goodbye (a connect() under way notices the close within RETRY_INTERVAL).
GOODBYE_WAIT: Final = 1.0


class UpstreamSession:
    """The receiver's part that speaks to the sender (a mixin of
    :class:`~zmqsync.receiver.WeightReceiver`, whose ``__init__`` sets this state)."""

    model_id: str
    strategy: str
    worker_idx: int | None
    timeout: float
    version: int
    epoch: int
    stats: dict[str, Any]
    _spoke: SpokeTransport
    _stream: ChunkStream
    _io_lock: threading.RLock
    _closed: bool
    _failover: list[Callable[[], SpokeTransport]]
    _failovers: int
    _last_heard: float
    _last_heartbeat: float
    _heartbeat: float
    _welcomed: bool
    _attempt: str
    _session: str
    _auto_id: bool
    _probe_nonce: str
    _probe_ok: bool
    _caught_up: bool
    _refused: str
    _mismatch: tuple[int, SchemaMismatchError] | None
    _stale_mismatch: tuple[int, SchemaMismatchError] | None
    _sink_refused: tuple[int, str] | None
    _unsent_refusal: dict[str, Any] | None
    _sender_epoch: int
    _pid: int
    _host: str
    #: The receiver's and the applier's (see zmqsync.receiver.core and .applying).
    _process: Callable[[float], None]
    _rejected: Callable[[str], None]
    _on_broken: Callable[[Broken], None]

    @property
    @abc.abstractmethod
    def torn(self) -> bool:
        """Whether the model holds parts of two versions (the applier says)."""

    def connect(self, timeout: float | None = None) -> None:
        """Join the fleet and return with the latest version applied.

        Raises :class:`SyncTimeout` if no sender answers within ``timeout`` seconds, and
        :class:`SchemaMismatchError` if the sender's latest version does not fit the
        model (the model keeps its weights; the sender is told, and counts the refusal).
        """
        timeout = self.timeout if timeout is None else timeout
        with self._io_lock:
            self._connect(timeout)

    def _connect(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        endpoint = getattr(self._spoke, "endpoint", "")
        self._new_attempt()
        self._welcomed = False  # welcomed anew: a new session for this attempt
        # A refusal from before this call stands unless a version that fits comes: a
        # sender that knows of it answers "up to date" instead of resending that version.
        self._stale_mismatch = self._mismatch
        self._sink_refused = None
        self._wait(
            deadline,
            lambda: self._welcomed,
            self._send_hello,
            f"no sender answered at {endpoint} within {timeout:g}s: is the learner running "
            "and the endpoint right?",
        )
        self._probe_nonce = secrets.token_hex(8)
        self._probe_ok = False
        self._wait(
            deadline,
            lambda: self._probe_ok,
            self._send_probe,
            f"the sender at {endpoint} answered but its fan-out never reached this worker "
            f"within {timeout:g}s (blocked data port?)",
        )
        self._caught_up = False
        self._wait(
            deadline,
            lambda: self._caught_up,
            self._send_snapshot_request,
            f"the sender at {endpoint} did not send its latest version within {timeout:g}s",
        )
        if self._mismatch is not None:
            raise self._mismatch_error()
        if self._sink_refused is not None:
            version, reason = self._sink_refused
            raise WeightsRejected(
                f"this worker's sink refused version {version} of {endpoint or 'the sender'}: "
                f"{reason}",
                rejections={-1 if self.worker_idx is None else self.worker_idx: reason},
                version=version,
            )
        self._last_heartbeat = time.monotonic()

    def _wait(self, deadline: float, done: Any, ask: Any, message: str) -> None:
        next_ask = 0.0
        interval = FIRST_RETRY
        while True:
            if self._closed:  # by another thread: it says goodbye once this returns
                raise ZMQSyncError("the receiver was closed while it connected")
            # Before done(): the sender answers "up to date" to a worker that refused its
            # latest version, and a worker caught up that way does not hold it.
            if (
                self._mismatch is not None
                and self._mismatch is not self._stale_mismatch
                and (self._session or time.monotonic() >= deadline)
            ):
                # Once welcomed: its rejected ack, sent then, tells the sender why.
                raise self._mismatch_error()
            if done():
                return
            if self._refused:
                refused, self._refused = self._refused, ""
                raise ZMQSyncError(f"the sender refused worker {self.worker_idx}: {refused}")
            now = time.monotonic()
            if now >= deadline:
                raise SyncTimeout(message)
            if now >= next_ask:
                ask()
                next_ask = now + interval
                interval = min(RETRY_INTERVAL, interval * 2)
            self._process(min(RETRY_INTERVAL, deadline - now, max(0.0, next_ask - now)))

    def _new_attempt(self) -> None:
        """Start connecting afresh: a new attempt id, no session until welcomed."""
        self._attempt = secrets.token_hex(8)
        self._session = ""

    def _mismatch_error(self) -> SchemaMismatchError:
        """What connect() raises for :attr:`_mismatch`: the tensors layer's reason (the
        offending key), with the version and where it came from."""
        assert self._mismatch is not None
        version, exc = self._mismatch
        endpoint = getattr(self._spoke, "endpoint", "")
        weights = f"the weights at {endpoint}" if endpoint else "the sender's weights"
        error = SchemaMismatchError(
            f"{weights} (version {version}) do not fit this worker's model: {exc}; "
            "build the model the learner's weights come from",
            key=exc.key,
        )
        error.__cause__ = exc
        return error

    def _send(self, message: protocol.Message, *, ack: bool = False) -> None:
        self._spoke.send_frames(protocol.encode(message), ack=ack)

    def _send_hello(self) -> None:
        worker = protocol.AUTO_WORKER if self.worker_idx is None else self.worker_idx
        self._send(
            protocol.Hello(
                self.model_id,
                self.version,
                self.epoch,
                worker,
                self._pid,
                self._host,
                self._attempt,
            )
        )

    def _send_probe(self) -> None:
        if self.worker_idx is not None and self._session:  # probes follow the Welcome
            self._send(
                protocol.ProbeRequest(
                    self.model_id, self.worker_idx, self._probe_nonce, session=self._session
                )
            )

    def _send_snapshot_request(self, whole: bool = False) -> None:
        if self.worker_idx is None or not self._session:
            # Heartbeats follow the Welcome; one that never came is asked for again.
            if self._welcomed:
                self._send_hello()
            return
        self._send(
            protocol.SnapshotRequest(
                self.model_id,
                self.version,
                self.epoch,
                self.worker_idx,
                self._session,
                torn=self.torn,
                whole=whole,
                below=self._below(),
            )
        )

    def _below(self) -> dict[str, Any]:
        """Workers this one speaks for (a relay's), for its heartbeats: none."""
        return {}

    def _upstream_silent(self, now: float) -> bool:
        """Whether to follow the next upstream in the failover list: this one, which
        answers every heartbeat, has been silent too long."""
        silent = now - self._last_heard
        limit = max(FAILOVER_HEARTBEATS * self._heartbeat, FAILOVER_MIN_SECONDS)
        return bool(self._failover) and self._welcomed and silent > limit

    def _fail_over(self) -> None:
        """The upstream went silent: say hello to the next one in the failover list,
        keeping the version held (a version half in the model is torn, and repaired)."""
        now = time.monotonic()
        self._last_heard = now  # the next one gets its own grace period
        make = self._failover[self._failovers % len(self._failover)]
        self._failovers += 1
        try:
            spoke = make()
        except Exception as exc:  # a bad address: try the next one later
            log.warning("worker %s: failover failed: %s", self.worker_idx, exc)
            return
        broken = self._stream.abandon("the upstream went silent")
        self._welcomed = False
        if broken is not None:
            self._on_broken(broken)
        old, self._spoke = self._spoke, spoke
        old.close()
        self.stats["failovers"] += 1
        log.warning(
            "worker %s: its upstream went silent; now following %s",
            self.worker_idx,
            getattr(spoke, "endpoint", "the next upstream"),
        )
        self._new_attempt()
        self._send_hello()

    def _on_control(self, message: protocol.Message) -> None:
        if isinstance(message, protocol.Welcome):
            if message.attempt != self._attempt:
                self.stats["stale"] += 1  # the answer to an earlier attempt
                return
            if self.worker_idx is None:
                self.worker_idx = message.worker  # assigned by the sender
            self._session = message.session
            if self._unsent_refusal is not None:
                refusal, self._unsent_refusal = self._unsent_refusal, None
                self._ack(applied=False, **refusal)
            elif self.epoch == message.epoch:
                # What it holds of this sender, acked anew: an ack sent while it had no
                # session (a restarted sender's version, applied before its Welcome) was
                # never counted, and a send may be waiting for it.
                self._ack(applied=True)
            if message.strategy != self.strategy:
                self._rejected(
                    f"sender uses strategy {message.strategy!r}, this worker {self.strategy!r}"
                )
            if isinstance(self._spoke, Follows):
                self._spoke.follow(
                    {"data_endpoint": message.data_endpoint, "ack_endpoint": message.ack_endpoint}
                )
            self._heartbeat = message.heartbeat_seconds
            self._sender_epoch = message.epoch
            self._welcomed = True
        elif isinstance(message, protocol.Probe):
            if message.worker == self.worker_idx and message.nonce == self._probe_nonce:
                self._probe_ok = True
        elif isinstance(message, protocol.UpToDate):
            if message.epoch != self._sender_epoch and self._welcomed:
                # A restarted sender: say hello again (its data address may be new).
                self._sender_epoch = message.epoch
                self._new_attempt()
                self._send_hello()
            # Nothing is coming (or the sender keeps no snapshot): caught up. If the latest
            # is already on its way, wait for it instead.
            if not message.in_flight:
                self._caught_up = True
        elif isinstance(message, protocol.ErrorMessage):
            self._rejected(f"sender said {message.code}: {message.message}")
            if message.code == "unknown-session" and self._welcomed:
                # Expired while this worker was stopped, or taken over: join again.
                self._new_attempt()
                self._send_hello()
            elif message.code == "duplicate-worker":
                if self._auto_id and self._welcomed:
                    # Its id went to another worker while this one was away: ask anew.
                    self.worker_idx = None
                    self._new_attempt()
                    self._send_hello()
                else:
                    self._refused = message.message
        else:
            self._rejected(f"unexpected {type(message).__name__} at a worker")

    def _ack(
        self,
        *,
        applied: bool,
        reason: str = "",
        version: int | None = None,
        epoch: int | None = None,
    ) -> None:
        if self.worker_idx is None or not self._session:
            # Not welcomed (yet, or again): no ack counts now. A refusal is told once it is.
            if not applied:
                self._unsent_refusal = {"reason": reason, "version": version, "epoch": epoch}
            return
        self._send(
            protocol.Ack(
                self.model_id,
                self.version if version is None else version,
                self.epoch if epoch is None else epoch,
                worker=self.worker_idx,
                applied=applied,
                reason=reason[:1000],
                received_bytes=int(self.stats["received_bytes"]),
                apply_seconds=self.stats["last_apply_s"],
                rejected_frames=int(self.stats["rejected_frames"]),
                pid=self._pid,
                host=self._host,
                session=self._session,
            ),
            ack=True,
        )

    def _say_goodbye(self) -> None:
        """Tell the sender this worker is leaving, so that it stops waiting for it.

        Best effort and never blocking: a sender that misses it waits out its timeout
        (a fleet of known size) or stops counting this worker once its heartbeats stop
        (a fleet that is whoever connected)."""
        if not self._welcomed or self.worker_idx is None or not self._session:
            return
        # Not while another thread uses the spoke: a connect() under way (it stops, seeing
        # the receiver closed), or a background thread that did not stop in time.
        if not self._io_lock.acquire(timeout=GOODBYE_WAIT):
            log.debug("the spoke stayed busy: no goodbye to the sender")
            return
        try:
            self._send(
                protocol.Goodbye(
                    self.model_id, self.version, self.epoch, self.worker_idx, self._session
                )
            )
        except Exception:  # a closed or broken transport: the sender finds out anyway
            log.debug("could not say goodbye to the sender", exc_info=True)
        finally:
            self._io_lock.release()
