"""WeightReceiver: a worker's end. Receives versions, validates, applies, acks.

A receiver holds ``(epoch, version)``: versions of its sender's epoch only go up;
duplicates and stale versions are ignored and counted; a new epoch (a restarted sender)
is followed, and frames of an epoch it has left are dropped.

A version arrives as a stream of chunks and is applied whole or not at all, under
:attr:`WeightReceiver.lock`, so a forward pass that holds the lock never sees half of
one. Two ways (``apply_mode``): *staged* gathers the chunks in a buffer of the version's
size and copies it into the model at the end (the lock is held for that copy only);
*in place* writes each chunk into the model as it comes, holding the lock from the first
chunk to the last (no model-sized buffer). If an in-place stream breaks, the model is
*torn*: the lock refuses forward passes (:class:`~zmqsync.errors.TornWeights` after a
wait) until a whole version, the sender's snapshot or the next one, repairs it.

A *delta* (the sender's ``delta=True``) carries only the stretches that changed since
its base version; it is applied (the same two ways, staged ones stretch by stretch) only
by a worker that holds a whole version of the same epoch and layout at or after the base
(without a model, or with a sink, in its staging buffer). Any other worker skips it and
asks for the whole version.

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
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch

from zmqsync.chunking import InPlace, SinkFeed, Staging
from zmqsync.errors import (
    FrameError,
    SchemaMismatchError,
    SyncTimeout,
    TornWeights,
    WeightsRejected,
    ZMQSyncError,
)
from zmqsync.protocol import (
    AUTO_WORKER,
    Ack,
    Chunk,
    ErrorMessage,
    Goodbye,
    Hello,
    Message,
    Probe,
    ProbeRequest,
    SnapshotRequest,
    UpToDate,
    WeightsSchema,
    Welcome,
    decode,
    encode,
)
from zmqsync.protocol.stream import DEFAULT_GAP, Apply, Broken, ChunkStream, Ignored, Start
from zmqsync.tensors import ApplyPlan, ModelTensors, as_weights_object, materialize
from zmqsync.transport.base import SpokeTransport
from zmqsync.vocabulary import Strategy

__all__ = ["WeightReceiver"]

log = logging.getLogger("zmqsync.receiver")

#: connect() repeats an unanswered hello, probe or snapshot request after FIRST_RETRY
#: seconds, doubling up to RETRY_INTERVAL (a new subscription takes a few ms to be live).
FIRST_RETRY: Final = 0.005
RETRY_INTERVAL: Final = 0.2
#: A worker with a failover list moves on when its upstream, which answers every
#: heartbeat, was silent this many heartbeats (and at least FAILOVER_MIN_SECONDS).
FAILOVER_HEARTBEATS: Final = 4
FAILOVER_MIN_SECONDS: Final = 2.0
#: Epochs a receiver remembers having left, to drop their late frames.
RETIRED_EPOCHS: Final = 16
#: ``apply_mode="auto"`` stages versions of a few chunks up to this size: a buffer this
#: large is cheap next to the model, and forward passes wait only for one copy. Larger
#: versions (and any that arrive through shared memory, at copying speed anyway) are
#: written in place: no model-sized buffer.
STAGED_MAX_BYTES: Final = 256 * 1024 * 1024
APPLY_MODES: Final = ("auto", "in_place", "staged")


class WeightsLock:
    """The lock a forward pass holds to see one whole version: ``with receiver.lock:``.

    Re-entrant, like ``threading.RLock``. While an in-place version is being written
    (from its first chunk to its last, whichever threads deliver them), acquiring it
    waits. While the model is torn (an in-place version's stream broke), acquiring it
    waits for the repair up to ``timeout`` seconds (the ``timeout`` argument, or the
    receiver's) and then raises :class:`~zmqsync.errors.TornWeights`: a forward pass
    never runs on torn weights.
    """

    def __init__(self, timeout: float) -> None:
        #: What the receiver itself writes under (it may write a torn model).
        self.raw = threading.RLock()
        self._repaired = threading.Condition(self.raw)
        #: ``(version, reason)`` while the model is torn, else None.
        self.torn: tuple[int, str] | None = None
        #: True while an in-place version is being written.
        self.writing = False
        self.timeout = timeout

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        again = self._is_owned()  # re-entrant: this thread already holds it
        if not self.raw.acquire(blocking, timeout):
            return False
        if again or (self.torn is None and not self.writing):
            return True
        start = time.monotonic()
        while self.writing and self.torn is None:
            # An in-place version is going in: it ends whole or torn (a gap between
            # chunks longer than the receiver's chunk_timeout breaks it).
            remaining = None if timeout < 0 else timeout - (time.monotonic() - start)
            if not blocking or (remaining is not None and remaining <= 0):
                self.raw.release()
                return False
            self._repaired.wait(remaining)
        if self.torn is None:
            return True
        deadline = time.monotonic() + (self.timeout if timeout < 0 else timeout)
        while self.torn is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not blocking:
                version, reason = self.torn
                self.raw.release()
                raise TornWeights(
                    f"the model is torn: version {version}'s stream broke while it was "
                    f"written in place ({reason}), and no repair came within "
                    f"{max(0.0, deadline - time.monotonic() + remaining):.3g}s",
                    version=version,
                    reason=reason,
                )
            self._repaired.wait(remaining)
        return True

    def release(self) -> None:
        self.raw.release()

    def _is_owned(self) -> bool:
        """Whether this thread holds it (``threading.RLock``'s own test)."""
        return bool(self.raw._is_owned())  # type: ignore[attr-defined]

    def __enter__(self) -> WeightsLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def begin_write(self) -> None:
        """An in-place version starts: forward passes wait from now (once those under
        way are done) until :meth:`end_write`, from whichever thread."""
        with self.raw:
            self.writing = True

    def end_write(self) -> None:
        """The in-place version is in, whole or torn (call holding :attr:`raw`)."""
        self.writing = False
        self._repaired.notify_all()

    def tear(self, version: int, reason: str) -> None:
        """Mark the model torn (call holding :attr:`raw`)."""
        self.torn = (version, reason)

    def mend(self) -> None:
        """A whole version is in the model again (call holding :attr:`raw`)."""
        if self.torn is not None:
            self.torn = None
            self._repaired.notify_all()


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
        timeout: default seconds for :meth:`connect`, and for a forward pass waiting on
            a torn model (:class:`WeightsLock`).
        apply_mode: ``"staged"``, ``"in_place"`` or ``"auto"``: staged for versions of
            several chunks up to :data:`STAGED_MAX_BYTES` that do not come through
            shared memory, in place otherwise (see the module).
        chunk_timeout: seconds between two chunks of a version before its stream counts
            as broken.
        failover: makers of spokes to other upstreams (relays, or the learner itself;
            the first upstream's again at the end, to come round to it), tried in
            turn when the upstream goes silent (nothing heard for
            :data:`FAILOVER_HEARTBEATS` heartbeats, at least :data:`FAILOVER_MIN_SECONDS`):
            the worker says hello there, keeping the version it holds, and is caught up.
        sink: instead of a model, a callable (an inference engine's ``load_weights``)
            called with each chunk's complete tensors as a list of ``(name, tensor)``
            (names dotted, as the learner's strategy spells them; each tensor in its own
            dtype, a view valid during the call: copy what you keep). The version is
            acked once the last call returned; a call that raises refuses the version,
            with the exception's text in the ack.
    """

    def __init__(
        self,
        spoke: SpokeTransport,
        *,
        model_id: str = "policy",
        model: Any = None,
        strategy: Strategy = "tensordict",
        worker_idx: int | None = 0,
        timeout: float = 10.0,
        apply_mode: str = "auto",
        chunk_timeout: float = DEFAULT_GAP,
        sink: Callable[[list[tuple[str, torch.Tensor]]], Any] | None = None,
        failover: Sequence[Callable[[], SpokeTransport]] = (),
    ) -> None:
        if apply_mode not in APPLY_MODES:
            raise ValueError(f"apply_mode must be one of {APPLY_MODES}; got {apply_mode!r}")
        if sink is not None and (model is not None or not callable(sink)):
            raise ValueError("sink= is a callable that takes the place of a model: not both")
        self.sink = sink
        self._sink_feed: SinkFeed | None = None
        #: The version the sink last refused during connect(), and why.
        self._sink_refused: tuple[int, str] | None = None
        self._spoke = spoke
        self._failover = list(failover)
        self._failovers = 0
        #: When the upstream was last heard from (any message).
        self._last_heard = time.monotonic()
        self.apply_mode = apply_mode
        self.model_id = model_id
        self.model = model
        self.strategy = strategy
        self.worker_idx = worker_idx
        self.timeout = timeout
        self.version = 0
        self.epoch = 0
        self.weights: Any = None
        #: What the learner attached to the version held now (``send(metadata=)``).
        self.metadata: dict[str, Any] | None = None
        self._incoming_metadata: dict[str, Any] | None = None
        #: The dtype the version held now travelled as (``wire_dtype``), or None.
        self.wire_dtype: str | None = None
        self._wire_of: tuple[WeightsSchema | None, str | None] = (None, None)
        self._model_tensors = ModelTensors(strategy)
        self._plan: ApplyPlan | None = None
        self._in_place: InPlace | None = None
        self._staging = Staging()
        self._stream = ChunkStream(chunk_timeout)
        #: How the version in progress is applied: "in_place", "staged", "sink", or "".
        self._writing = ""
        #: The layout digest of the version held now (a delta must be of the same).
        self._held_layout = b""
        #: (epoch, version) whose whole stream the staging buffer holds, if any: what a
        #: delta is patched onto without a model (and for a sink).
        self._staging_holds: tuple[int, int] | None = None
        #: The version in progress is a delta: the stretches it carried so far.
        self._delta_spans: list[tuple[int, int]] | None = None
        #: Whether staging holds the whole version in progress once its stream is in.
        self._fills_staging = False
        #: Without a model: make :attr:`weights` of each version (a relay needs only its
        #: staging buffer).
        self._materialize = True
        self._started_at = 0.0
        self._schema: WeightsSchema | None = None
        #: The ack to send once the last chunk's frames are let go of.
        self._ack_due: dict[str, Any] | None = None
        #: Held while a version is copied into the model. Hold it during a forward pass
        #: to never see half of one.
        self.lock = WeightsLock(timeout)
        self.stats = {
            "received_bytes": 0,
            "applied": 0,
            "duplicates": 0,
            "stale": 0,
            "rejected_frames": 0,
            "last_apply_s": 0.0,
            "chunks": 0,
            "broken_streams": 0,
            "torn": 0,
            "deltas": 0,
            "deltas_skipped": 0,
            "failovers": 0,
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

    def _send_snapshot_request(self, whole: bool = False) -> None:
        if self.worker_idx is None or not self._session:
            # Heartbeats follow the Welcome; one that never came is asked for again.
            if self._welcomed:
                self._send_hello()
            return
        self._send(
            SnapshotRequest(
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
        """The weights held now: the model's, or the last received; with a sink, the
        version it was given last."""
        if self.model is not None:
            return self.model
        if self.sink is not None:
            return self.version
        return self.weights

    def _process(self, timeout: float) -> None:
        """Wait up to ``timeout`` for messages, then handle all that queued up.

        Of several queued versions only the newest is applied: a worker that fell behind
        skips straight to the latest.
        """
        with self._io_lock:
            self._process_locked(timeout)

    @property
    def torn(self) -> bool:
        """Whether the model holds parts of two versions (an in-place stream broke)."""
        return self.lock.torn is not None

    def _process_locked(self, timeout: float) -> None:
        now = time.monotonic()
        if (
            self._failover
            and self._welcomed
            and now - self._last_heard
            > max(FAILOVER_HEARTBEATS * self._heartbeat, FAILOVER_MIN_SECONDS)
        ):
            self._fail_over()
        if self._welcomed and now - self._last_heartbeat >= self._heartbeat:
            self._last_heartbeat = now
            self._send_snapshot_request()
        frames = self._spoke.recv_frames(timeout)
        while True:
            if frames is not None:
                self._last_heard = time.monotonic()
                message = self._decode(frames)
                if isinstance(message, Chunk):
                    self._on_chunk(message)
                elif message is not None:
                    self._on_control(message)
                # Let go of the frames before acking: a transport that lends its memory
                # (shared blocks) may reuse it by the time the sender sees the ack.
                frames = message = None
                if self._ack_due is not None:
                    ack, self._ack_due = self._ack_due, None
                    self._ack(**ack)
            if self._stream.active:
                # The middle of a version: wait for its next chunk (an in-place write
                # holds the model's lock until the last one).
                broken = self._stream.expire(time.monotonic())
                if broken is not None:
                    self._on_broken(broken)
                    continue
                now = time.monotonic()
                if self._welcomed and now - self._last_heartbeat >= self._heartbeat:
                    self._last_heartbeat = now  # still alive, still behind
                    self._send_snapshot_request()
                if timeout <= 0:
                    # A poll (a Ray actor's call delivers one chunk): the next chunk
                    # comes with a later call, and the stream's gap is checked then.
                    frames = self._spoke.recv_frames(0) if self._spoke.has_input() else None
                    if frames is None:
                        return
                    continue
                frames = self._spoke.recv_frames(min(self._heartbeat, self._stream.gap))
                continue
            if frames is None and self._spoke.has_input():
                frames = self._spoke.recv_frames(0)  # anything more? asking first spares a read
            if frames is None:
                return

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

    def _on_chunk(self, chunk: Chunk) -> None:
        self.stats["received_bytes"] += len(chunk.payload)
        self.stats["chunks"] += 1
        wanted = self._wanted(chunk) if chunk.first else True
        for event in self._stream.feed(chunk, time.monotonic(), wanted):
            if isinstance(event, Start):
                self._on_start(event)
            elif isinstance(event, Apply):
                self._on_piece(event.chunk)
            elif isinstance(event, Broken):
                self._on_broken(event)
            elif isinstance(event, Ignored) and event.reason != "not wanted":
                self.stats["stale"] += 1

    def _wanted(self, chunk: Chunk) -> bool:
        """Whether to receive the version ``chunk`` starts (counts what it is not)."""
        if chunk.epoch != self.epoch:
            if chunk.epoch in self._retired:
                self.stats["stale"] += 1  # frames of a sender life we already left
                return False
            return True
        if self.torn and chunk.version >= self.version:
            return True  # a repair: the model no longer holds self.version
        if chunk.version <= self.version:
            self.stats["duplicates"] += 1
            self._caught_up = True
            self._ack_due = {"applied": True}  # we hold it (or newer): settles a waiting send
            return False
        return True

    def _patchable(self, chunk: Chunk) -> str:
        """Why this worker cannot apply the delta ``chunk`` starts ("" if it can)."""
        assert chunk.base is not None
        if self.torn:
            return "the model is torn"
        if chunk.epoch != self.epoch or not chunk.base <= self.version < chunk.version:
            return f"it is against version {chunk.base}; this worker holds {self.version}"
        if chunk.layout != self._held_layout:
            return "its layout is not the one of the version held"
        if (self.sink is not None or self.model is None) and self._staging_holds != (
            self.epoch,
            self.version,
        ):
            return "the staging buffer does not hold the version held"
        return ""

    def _on_start(self, event: Start) -> None:
        chunk, schema = event.chunk, event.schema
        self._delta_spans = None
        if chunk.base is not None:
            why = self._patchable(chunk)
            if why:
                # Never a wrong version: ask for the whole one instead.
                self._stream.abandon("cannot apply the delta")
                self.stats["deltas_skipped"] += 1
                log.info(
                    "worker %s: delta of version %s skipped: %s",
                    self.worker_idx,
                    chunk.version,
                    why,
                )
                if self._welcomed:
                    self._send_snapshot_request(whole=True)
                return
            self._delta_spans = []
        patches_staging = self._staging_holds == (self.epoch, self.version)
        self._staging_holds = None  # what staging holds is written over from here
        self._started_at = time.monotonic()
        self._schema = schema
        self._incoming_metadata = chunk.metadata
        if self._wire_of[0] is not schema:  # once per layout, not per version
            self._wire_of = (schema, next((e.wire for e in schema.entries if e.wire), None))
        #: Whether staging will hold the whole version once this stream is in.
        self._fills_staging = chunk.base is None or patches_staging
        if self.sink is not None:
            self._writing = "sink"
            self._staging.start(chunk.total)
            feed = self._sink_feed
            if feed is None or feed.schema is not schema:
                self._sink_feed = feed = SinkFeed(schema)
            feed.start()
            return
        if self.model is None:
            self._writing = "staged"
            self._staging.start(chunk.total)
            return
        target = self._model_tensors.get(self.model)
        in_place = self.apply_mode == "in_place" or (
            self.apply_mode == "auto"
            and (
                chunk.count == 1
                or chunk.total > STAGED_MAX_BYTES
                or self._spoke.lent([chunk.payload])
            )
        )
        try:
            if in_place or chunk.base is not None:
                # A delta, even staged, is applied stretch by stretch into the tensors.
                if self._in_place is None or not self._in_place.fits(schema, target):
                    self._in_place = InPlace(schema, target, self.strategy)
            elif self._plan is None or not self._plan.fits(schema, target):
                self._plan = ApplyPlan(schema, target, self.strategy)
        except SchemaMismatchError as exc:
            self._stream.abandon("refused")
            self._refuse(chunk, exc)
            return
        if in_place:
            self.lock.begin_write()  # until the last chunk is in (or the stream breaks)
            self._writing = "in_place"
        else:
            self._writing = "staged"
            self._staging.start(chunk.total)

    def _refuse(self, chunk: Chunk, exc: SchemaMismatchError) -> None:
        self._rejected(f"version {chunk.version}: {exc}")
        self._mismatch = (chunk.version, exc)
        self._ack_due = {
            "applied": False,
            "reason": str(exc),
            "version": chunk.version,
            "epoch": chunk.epoch,
        }

    def _on_piece(self, chunk: Chunk) -> None:
        if self._delta_spans is not None and chunk.payload:
            self._delta_spans.append((chunk.offset, len(chunk.payload)))
        if self._writing == "in_place":
            assert self._in_place is not None
            self._in_place.apply(chunk.offset, chunk.payload)
        elif self._writing == "staged":
            self._staging.write(chunk.offset, chunk.payload)
        elif self._writing == "sink":
            self._staging.write(chunk.offset, chunk.payload)
            assert self._sink_feed is not None and self.sink is not None
            tensors = self._sink_feed.ready(
                self._staging, chunk.offset + len(chunk.payload), self._delta_spans
            )
            if tensors:
                try:
                    self.sink(tensors)
                except Exception as exc:  # the engine refused: the version is not applied
                    self._writing = ""
                    self._stream.abandon("refused")
                    reason = f"sink raised {type(exc).__name__}: {exc}"
                    self._rejected(f"version {chunk.version}: {reason}")
                    self._sink_refused = (chunk.version, reason)
                    self._ack_due = {
                        "applied": False,
                        "reason": reason,
                        "version": chunk.version,
                        "epoch": chunk.epoch,
                    }
                    return
                finally:
                    del tensors
        if chunk.last and self._writing:
            self._complete(chunk)

    def _complete(self, chunk: Chunk) -> None:
        """The last chunk is in: make the version the model's, and ack it."""
        writing, self._writing = self._writing, ""
        with self.lock.raw:
            if writing == "in_place":
                assert self._in_place is not None
                self._in_place.finish()
                self.lock.end_write()
            elif writing == "sink":
                pass  # every tensor went to the sink as its chunk came
            elif self.model is not None and self._delta_spans is not None:
                assert self._in_place is not None
                staged = self._staging.array
                for offset, length in self._delta_spans:
                    self._in_place.apply(offset, staged[offset : offset + length].data)
                self._in_place.finish()
            elif self.model is not None:
                assert self._plan is not None
                schema = self._plan.schema
                self._plan.apply(
                    self._staging.weights(self.model_id, chunk.version, chunk.epoch, schema)
                )
            elif self._materialize:
                assert self._schema is not None
                weights = self._staging.weights(
                    self.model_id, chunk.version, chunk.epoch, self._schema
                )
                self.weights = as_weights_object(materialize(weights), self.strategy)
            self._mismatch = None
            if chunk.epoch != self.epoch:
                if self.epoch:
                    self._retired.append(self.epoch)
                self.epoch = chunk.epoch
                self._sender_epoch = chunk.epoch
            self.version = chunk.version
            self._held_layout = chunk.layout
            if writing != "in_place" and self._fills_staging:
                self._staging_holds = (self.epoch, self.version)
            self.metadata = self._incoming_metadata
            self.wire_dtype = self._wire_of[1]
            self.lock.mend()
            for listener in self.on_applied:
                listener(self.epoch, self.version)
        self.stats["applied"] += 1
        if self._delta_spans is not None:
            self.stats["deltas"] += 1
        self.stats["last_apply_s"] = time.monotonic() - self._started_at
        self._caught_up = True
        self._ack_due = {"applied": True}

    def _on_broken(self, broken: Broken) -> None:
        """The version in progress will not complete."""
        writing, self._writing = self._writing, ""
        self.stats["broken_streams"] += 1
        log.info(
            "worker %s: version %s broke off: %s", self.worker_idx, broken.version, broken.reason
        )
        if writing == "in_place":
            with self.lock.raw:
                self.lock.tear(broken.version, broken.reason)
                self.lock.end_write()  # forward passes now refuse: the model is torn
            self.stats["torn"] += 1
        if self._welcomed:
            self._send_snapshot_request()  # the sender's latest repairs it

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
        if self._writing == "in_place":  # half a version is in the model: torn for good
            self._writing = ""
            with self.lock.raw:
                self.lock.tear(self.version + 1, "the receiver closed mid-version")
                self.lock.end_write()
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
