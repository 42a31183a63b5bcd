"""WeightReceiver: a worker's end. Receives versions, validates, applies, acks.

A receiver holds ``(epoch, version)``: versions of its sender's epoch only go up;
duplicates and stale versions are ignored and counted; a new epoch (a restarted sender)
is followed, and frames of an epoch it has left are dropped. How it joins and speaks to
its sender is :mod:`~zmqsync.receiver.session`'s; how a version reaches the model is
:mod:`~zmqsync.receiver.applying`'s.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch

from zmqsync.chunking.staging import Staging
from zmqsync.errors import FrameError, SchemaMismatchError
from zmqsync.protocol import Chunk, Message, WeightsSchema, decode
from zmqsync.protocol.stream import DEFAULT_GAP, ChunkStream
from zmqsync.receiver.applying import APPLY_MODES, Applying
from zmqsync.receiver.lock import WeightsLock
from zmqsync.receiver.session import UpstreamSession
from zmqsync.tensors.apply import ApplyPlan
from zmqsync.tensors.in_place import InPlace
from zmqsync.tensors.model_tensors import ModelTensors
from zmqsync.tensors.sink_feed import SinkFeed
from zmqsync.transport.base import SpokeTransport, has_input
from zmqsync.vocabulary import Metadata, Strategy

__all__ = ["WeightReceiver"]

log = logging.getLogger("zmqsync.receiver")

#: Epochs a receiver remembers having left, to drop their late frames.
RETIRED_EPOCHS: Final = 16


class WeightReceiver(Applying, UpstreamSession):
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
        self.metadata: Metadata | None = None
        self._incoming_metadata: Metadata | None = None
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

    def _process_locked(self, timeout: float) -> None:
        now = time.monotonic()
        if self._upstream_silent(now):
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
                    frames = self._spoke.recv_frames(0) if has_input(self._spoke) else None
                    if frames is None:
                        return
                    continue
                frames = self._spoke.recv_frames(min(self._heartbeat, self._stream.gap))
                continue
            if frames is None and has_input(self._spoke):
                frames = self._spoke.recv_frames(0)  # anything more? asking first spares a read
            if frames is None:
                return

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
