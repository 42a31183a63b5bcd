"""A version's chunks into the model, whole or not at all.

Two ways (``apply_mode``): *staged* gathers the chunks in a buffer of the version's size
and copies it into the model at the end (the lock is held for that copy only); *in
place* writes each chunk into the model as it comes, holding the lock from the first
chunk to the last (no model-sized buffer). If an in-place stream breaks, the model is
*torn*: forward passes are refused until a whole version repairs it.

A *delta* carries only the stretches that changed since its base version; it is applied
only by a worker that holds a whole version of the same epoch and layout at or after the
base (without a model, or with a sink, in its staging buffer). Any other worker skips it
and asks for the whole version.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final

from zmqsync.chunking.staging import Staging
from zmqsync.errors import SchemaMismatchError
from zmqsync.protocol import Chunk, WeightsSchema
from zmqsync.protocol.stream import Apply, Broken, ChunkStream, Ignored, Start
from zmqsync.receiver.lock import WeightsLock
from zmqsync.tensors.apply import ApplyPlan, materialize
from zmqsync.tensors.extract import as_weights_object
from zmqsync.tensors.in_place import InPlace
from zmqsync.tensors.model_tensors import ModelTensors
from zmqsync.tensors.sink_feed import SinkFeed
from zmqsync.transport.base import Borrows, SpokeTransport
from zmqsync.vocabulary import Metadata

__all__ = ["APPLY_MODES", "STAGED_MAX_BYTES", "Applying"]

log = logging.getLogger("zmqsync.receiver")

#: ``apply_mode="auto"`` stages versions of a few chunks up to this size: a buffer this
#: large is cheap next to the model, and forward passes wait only for one copy. Larger
#: versions (and any that arrive through shared memory, at copying speed anyway) are
#: written in place: no model-sized buffer.
STAGED_MAX_BYTES: Final = 256 * 1024 * 1024
APPLY_MODES: Final = ("auto", "in_place", "staged")


class Applying:
    """The receiver's part that applies versions (a mixin of
    :class:`~zmqsync.receiver.WeightReceiver`, whose ``__init__`` sets this state)."""

    #: Without a model: whether the stream's bytes are kept in the staging buffer (a
    #: relay that keeps no copy of the latest version only passes them on).
    _stages = True

    model_id: str
    model: Any
    strategy: str
    apply_mode: str
    sink: Callable[[list[Any]], Any] | None
    worker_idx: int | None
    version: int
    epoch: int
    weights: Any
    metadata: Metadata | None
    wire_dtype: str | None
    lock: WeightsLock
    stats: dict[str, Any]
    on_applied: list[Callable[[int, int], None]]
    _spoke: SpokeTransport
    _stream: ChunkStream
    _staging: Staging
    _model_tensors: ModelTensors
    _plan: ApplyPlan | None
    _in_place: InPlace | None
    _sink_feed: SinkFeed | None
    _sink_refused: tuple[int, str] | None
    _writing: str
    _held_layout: bytes
    _staging_holds: tuple[int, int] | None
    _delta_spans: list[tuple[int, int]] | None
    _fills_staging: bool
    _materialize: bool
    _started_at: float
    _schema: WeightsSchema | None
    _incoming_metadata: Metadata | None
    _wire_of: tuple[WeightsSchema | None, str | None]
    _ack_due: dict[str, Any] | None
    _mismatch: tuple[int, SchemaMismatchError] | None
    _retired: deque[int]
    _sender_epoch: int
    _caught_up: bool
    _welcomed: bool
    #: The session's and the receiver's (see zmqsync.receiver.session and .core).
    _send_snapshot_request: Callable[..., None]
    _rejected: Callable[[str], None]

    @property
    def torn(self) -> bool:
        """Whether the model holds parts of two versions (an in-place stream broke)."""
        return self.lock.torn is not None

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
            if not self._stages:
                self._writing = "passing"  # the bytes are someone else's to keep
                self._fills_staging = False
                return
            self._writing = "staged"
            self._staging.start(chunk.total)
            return
        target = self._model_tensors.get(self.model)
        in_place = self.apply_mode == "in_place" or (
            self.apply_mode == "auto"
            and (
                chunk.count == 1
                or chunk.total > STAGED_MAX_BYTES
                or (isinstance(self._spoke, Borrows) and self._spoke.borrowed([chunk.payload]))
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
