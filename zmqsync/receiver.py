"""WeightReceiver: a worker's end. Receives versions, validates, applies, acks.

A receiver holds ``(epoch, version)``: versions of its sender's epoch only go up;
duplicates and stale versions are ignored and counted; a new epoch (a restarted sender)
is followed, and frames of an epoch it has left are dropped. A version is applied whole
or not at all, under :attr:`WeightReceiver.lock`, so a forward pass that holds the lock
never sees half of one.

Connecting follows ZeroMQ's Clone pattern: say hello, subscribe, prove the subscription
is live with a probe (no ``sleep()``), then ask for a snapshot of the latest version.
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
from collections import deque
from collections.abc import Callable
from typing import Any, Final

from zmqsync.errors import FrameError, SchemaMismatchError, SyncTimeout, ZMQSyncError
from zmqsync.protocol import (
    AUTO_WORKER,
    Ack,
    ErrorMessage,
    Goodbye,
    Hello,
    Message,
    Probe,
    ProbeRequest,
    SnapshotRequest,
    UpToDate,
    Weights,
    Welcome,
    decode,
    encode,
)
from zmqsync.tensors import ApplyPlan, ModelTensors, as_weights_object, materialize
from zmqsync.transport.base import SpokeTransport

__all__ = ["WeightReceiver"]

log = logging.getLogger("zmqsync.receiver")

#: connect() repeats an unanswered hello, probe or snapshot request after FIRST_RETRY
#: seconds, doubling up to RETRY_INTERVAL (a new subscription takes a few ms to be live).
FIRST_RETRY: Final = 0.005
RETRY_INTERVAL: Final = 0.2
#: Epochs a receiver remembers having left, to drop their late frames.
RETIRED_EPOCHS: Final = 16
#: A worker keeps the receive buffers of the version it applied last until the next
#: version has arrived (frames up to HOLD_MAX_FRAME bytes each, HOLD_MAX_BYTES in all).
#: Freed at once, a version's buffers coalesce at the top of ZeroMQ's I/O thread's
#: malloc arena, glibc hands the pages back to the kernel, and the next version faults
#: them in again: 1,600-2,600 page faults, 2.5-6 ms of CPU per 16 MB version (measured;
#: the benchmark's hand-written baseline keeps its last frames until the next arrive
#: and did not pay them). Larger frames are mmap'd afresh every time whatever we do
#: (glibc's mmap threshold tops out at 32 MiB), so holding them would only cost memory.
HOLD_MAX_FRAME: Final = 32 << 20
HOLD_MAX_BYTES: Final = 256 << 20


class WeightReceiver:
    """Receives versions of one model and applies them to ``model`` in place.

    Args:
        spoke: the transport's worker end; the receiver owns and closes it.
        model_id: the model this worker holds.
        model: what received weights are applied to (``nn.Module``, ``TensorDict`` or
            ``dict`` of tensors); ``None`` keeps the latest weights in :attr:`weights`.
        strategy: must match the sender's.
        worker_idx: this worker's id, unique in the fleet; ``None`` asks the sender to
            assign one when connecting (a fleet scaled by replicas has no ids to hand out).
        timeout: default seconds for :meth:`connect`.
    """

    def __init__(
        self,
        spoke: SpokeTransport,
        *,
        model_id: str = "policy",
        model: Any = None,
        strategy: str = "tensordict",
        worker_idx: int | None = 0,
        timeout: float = 10.0,
    ) -> None:
        self._spoke = spoke
        self.model_id = model_id
        self.model = model
        self.strategy = strategy
        self.worker_idx = worker_idx
        self.timeout = timeout
        self.version = 0
        self.epoch = 0
        self.weights: Any = None
        self._model_tensors = ModelTensors(strategy)
        self._plan: ApplyPlan | None = None
        #: Held while a version is copied into the model. Hold it during a forward pass
        #: to never see half of one.
        self.lock = threading.RLock()
        self.stats = {
            "received_bytes": 0,
            "applied": 0,
            "duplicates": 0,
            "stale": 0,
            "rejected_frames": 0,
            "last_apply_s": 0.0,
        }
        self.rejections: deque[str] = deque(maxlen=8)
        #: The last version refused for not fitting the model, and why, until one fits:
        #: what connect() raises. ``_stale_mismatch``: the one refused before it began.
        self._mismatch: tuple[int, SchemaMismatchError] | None = None
        self._stale_mismatch: tuple[int, SchemaMismatchError] | None = None
        #: A rejected ack from before the Welcome: sent once the session exists.
        self._unsent_refusal: dict[str, Any] | None = None
        #: Called as ``fn(epoch, version)`` after each version is applied, still under
        #: :attr:`lock` (so the model holds exactly that version while it runs).
        self.on_applied: list[Callable[[int, int], None]] = []
        self._sender_epoch = 0
        self._heartbeat = 1.0
        self._last_heartbeat = 0.0
        self._welcomed = False
        self._probe_nonce = ""
        self._probe_ok = False
        #: One attempt to connect (its repeated Hellos), and the secret of its Welcome.
        self._attempt = ""
        self._session = ""
        #: Whether the sender picks this worker's id (and may pick another one later).
        self._auto_id = worker_idx is None
        self._retired: deque[int] = deque(maxlen=RETIRED_EPOCHS)
        self._pid = os.getpid()
        self._host = socket.gethostname()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._closed = False
        #: The last applied version's receive buffers (see HOLD_MAX_BYTES).
        self._held: list[Any] = []
        self._caught_up = False
        self._refused = ""
        # The spoke's sockets are used by one thread at a time: connect(), receive() or
        # the background thread.
        self._io_lock = threading.RLock()

    @property
    def transport(self) -> SpokeTransport:
        return self._spoke

    # --- connecting ------------------------------------------------------------------

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
        self._last_heartbeat = time.monotonic()

    def _wait(self, deadline: float, done: Any, ask: Any, message: str) -> None:
        next_ask = 0.0
        interval = FIRST_RETRY
        while True:
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

    def _send(self, message: Message) -> None:
        self._spoke.send_frames(encode(message))

    def _send_hello(self) -> None:
        worker = AUTO_WORKER if self.worker_idx is None else self.worker_idx
        self._send(
            Hello(
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
                ProbeRequest(
                    self.model_id, self.worker_idx, self._probe_nonce, session=self._session
                )
            )

    def _send_snapshot_request(self) -> None:
        if self.worker_idx is None or not self._session:
            # Heartbeats follow the Welcome; one that never came is asked for again.
            if self._welcomed:
                self._send_hello()
            return
        self._send(
            SnapshotRequest(self.model_id, self.version, self.epoch, self.worker_idx, self._session)
        )

    # --- receiving -------------------------------------------------------------------

    def receive(self, timeout: float | None = None) -> Any:
        """Wait up to ``timeout`` seconds for a new version; apply it and return it.

        Returns the weights applied (a ``dict`` for ``state_dict``, a ``TensorDict`` for
        ``tensordict``; the model's own tensors when there is a model), or ``None`` if no
        new version came in time. ``timeout=None`` waits up to the receiver's timeout.
        """
        if self._thread is not None:
            raise RuntimeError("a background receiver is running: it receives for you")
        return self._receive(self.timeout if timeout is None else timeout)

    def _receive(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        before = (self.epoch, self.version)
        while True:
            remaining = deadline - time.monotonic()
            self._process(max(0.0, min(remaining, self._heartbeat)))
            if (self.epoch, self.version) != before:
                return self.current_weights()
            if remaining <= 0:
                return None

    def poll(self) -> bool:
        """Handle whatever has arrived without waiting; True if a new version was applied."""
        before = (self.epoch, self.version)
        self._process(0.0)
        return (self.epoch, self.version) != before

    def current_weights(self) -> Any:
        """The weights held now: the model's, or the last received."""
        if self.model is not None:
            return self.model
        return self.weights

    def _process(self, timeout: float) -> None:
        """Wait up to ``timeout`` for messages, then handle all that queued up.

        Of several queued versions only the newest is applied: a worker that fell behind
        skips straight to the latest.
        """
        with self._io_lock:
            self._process_locked(timeout)

    def _process_locked(self, timeout: float) -> None:
        now = time.monotonic()
        if self._welcomed and now - self._last_heartbeat >= self._heartbeat:
            self._last_heartbeat = now
            self._send_snapshot_request()
        frames = self._spoke.recv_frames(timeout)
        newest: Weights | None = None
        while frames is not None:
            message = self._decode(frames)
            if isinstance(message, Weights):
                self.stats["received_bytes"] += sum(len(b) for b in message.buffers)
                if newest is None or self._newer(message, newest):
                    if newest is not None:
                        self.stats["stale"] += 1
                    newest = message
                else:
                    self.stats["stale"] += 1
            elif message is not None:
                self._on_control(message)
            # Anything more (a newer version, say)? Asking first spares a read.
            frames = self._spoke.recv_frames(0) if self._spoke.has_input() else None
        if newest is not None:
            ack = self._on_weights(newest)
            if self._spoke.lent(newest.buffers):
                # Let go of the frames before acking: a transport that lends its memory
                # (shared blocks) may reuse it by the time the sender sees the ack.
                frames = message = newest = None
                self._held = []
            else:
                # The previous version's buffers go now that this one's were allocated.
                self._held = _to_hold(newest.buffers)
            if ack is not None:
                self._ack(**ack)

    def _newer(self, a: Weights, b: Weights) -> bool:
        return a.epoch != b.epoch or a.version > b.version

    def _decode(self, frames: list[Any]) -> Message | None:
        try:
            message = decode(frames)
        except FrameError as exc:
            self._rejected(f"malformed message: {exc}")
            return None
        if message.model_id != self.model_id:
            self._rejected(
                f"message for model {message.model_id!r}; this worker holds {self.model_id!r}"
            )
            return None
        return message

    def _rejected(self, reason: str) -> None:
        self.stats["rejected_frames"] += 1
        self.rejections.append(reason)
        log.warning("worker %s rejected a message: %s", self.worker_idx, reason)

    def _on_control(self, message: Message) -> None:
        if isinstance(message, Welcome):
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
            self._spoke.follow(
                {"data_endpoint": message.data_endpoint, "ack_endpoint": message.ack_endpoint}
            )
            self._heartbeat = message.heartbeat_seconds
            self._sender_epoch = message.epoch
            self._welcomed = True
        elif isinstance(message, Probe):
            if message.worker == self.worker_idx and message.nonce == self._probe_nonce:
                self._probe_ok = True
        elif isinstance(message, UpToDate):
            if message.epoch != self._sender_epoch and self._welcomed:
                # A restarted sender: say hello again (its data address may be new).
                self._sender_epoch = message.epoch
                self._new_attempt()
                self._send_hello()
            # Nothing is coming (or the sender keeps no snapshot): caught up. If the latest
            # is already on its way, wait for it instead.
            if not message.in_flight:
                self._caught_up = True
        elif isinstance(message, ErrorMessage):
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

    def _on_weights(self, message: Weights) -> dict[str, Any] | None:
        """Apply ``message`` if it is new; returns the ack to send (once the caller has
        let go of the message), or None."""
        if message.epoch != self.epoch:
            if message.epoch in self._retired:
                self.stats["stale"] += 1  # frames of a sender life we already left
                return None
        elif message.version <= self.version:
            self.stats["duplicates"] += 1
            self._caught_up = True
            return {"applied": True}  # we hold it (or newer): that settles a waiting send
        start = time.monotonic()
        with self.lock:
            try:
                if self.model is not None:
                    target = self._model_tensors.get(self.model)
                    if self._plan is None or not self._plan.fits(message.schema, target):
                        self._plan = ApplyPlan(message.schema, target, self.strategy)
                    self._plan.apply(message)
                else:
                    self.weights = as_weights_object(materialize(message), self.strategy)
            except SchemaMismatchError as exc:
                self._rejected(f"version {message.version}: {exc}")
                self._mismatch = (message.version, exc)
                return {
                    "applied": False,
                    "reason": str(exc),
                    "version": message.version,
                    "epoch": message.epoch,
                }
            self._mismatch = None
            if message.epoch != self.epoch:
                if self.epoch:
                    self._retired.append(self.epoch)
                self.epoch = message.epoch
                self._sender_epoch = message.epoch
            self.version = message.version
            for listener in self.on_applied:
                listener(self.epoch, self.version)
        self.stats["applied"] += 1
        self.stats["last_apply_s"] = time.monotonic() - start
        self._caught_up = True
        return {"applied": True}

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
            Ack(
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
            )
        )

    # --- background thread -----------------------------------------------------------

    def start(self) -> None:
        """Receive in a background thread; new versions are applied under :attr:`lock`."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, name=f"zmqsync-receiver-{self.worker_idx}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._process(0.05)
            except Exception:
                if self._closed:
                    return
                log.exception("background receiver of worker %s", self.worker_idx)
                time.sleep(0.05)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the background thread (waits at most ``timeout`` seconds)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join(timeout)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop receiving and close the transport. Idempotent; never waits on a peer."""
        if self._closed:
            return
        self.stop()
        self._closed = True
        self._held = []
        self._say_goodbye()
        self._spoke.close()

    def _say_goodbye(self) -> None:
        """Tell the sender this worker is leaving, so that it stops waiting for it.

        Best effort and never blocking: a sender that misses it waits out its timeout
        (a fleet of known size) or stops counting this worker once its heartbeats stop
        (a fleet that is whoever connected)."""
        if not self._welcomed or self.worker_idx is None or not self._session:
            return
        # Not while the background thread (if it did not stop in time) uses the spoke.
        if not self._io_lock.acquire(blocking=False):
            return
        try:
            self._send(
                Goodbye(self.model_id, self.version, self.epoch, self.worker_idx, self._session)
            )
        except Exception:  # a closed or broken transport: the sender finds out anyway
            log.debug("could not say goodbye to the sender", exc_info=True)
        finally:
            self._io_lock.release()


def _to_hold(buffers: tuple[Any, ...]) -> list[Any]:
    """The buffers worth keeping until the next version arrives (see HOLD_MAX_BYTES)."""
    held, total = [], 0
    for b in buffers:
        n = len(b)
        if n <= HOLD_MAX_FRAME and total + n <= HOLD_MAX_BYTES:
            held.append(b)
            total += n
    return held
