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

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final, Literal, Protocol

import numpy as np
import torch

from zmqsync.chunking.staging import Staging
from zmqsync.errors import SchemaMismatchError
from zmqsync.protocol import Buffer, Chunk, WeightsSchema
from zmqsync.protocol.stream import Apply, Broken, ChunkStream, Ignored, Start
from zmqsync.receiver.lent import LentVersions, stream_bytes
from zmqsync.receiver.lock import WeightsLock
from zmqsync.receiver.observer import PendingAck, ReceiverObserver
from zmqsync.receiver.rejections import Rejections
from zmqsync.receiver.shared import SHARED_MODE, SharedVersion
from zmqsync.tensors.apply import ApplyPlan, materialize
from zmqsync.tensors.extract import as_weights_object
from zmqsync.tensors.fit import check_fits
from zmqsync.tensors.in_place import InPlace
from zmqsync.tensors.model_tensors import ModelTensors
from zmqsync.tensors.sink_feed import SinkFeed
from zmqsync.tensors.views import byte_view
from zmqsync.transport.base import Borrows, SpokeTransport
from zmqsync.transport.cuda import handles
from zmqsync.transport.shm.lent import LENT_MIN_BYTES
from zmqsync.vocabulary import Metadata

__all__ = ["APPLY_MODES", "KEEPS", "STAGED_MAX_BYTES", "Applier", "ApplyHost", "Keep"]

log = logging.getLogger("zmqsync.receiver")

#: ``apply_mode="auto"`` stages versions of a few chunks up to this size: a buffer this
#: large is cheap next to the model, and forward passes wait only for one copy. Larger
#: versions (and any that arrive through shared memory, at copying speed anyway) are
#: written in place: no model-sized buffer.
STAGED_MAX_BYTES: Final = 256 * 1024 * 1024
APPLY_MODES: Final = ("auto", "in_place", "staged", SHARED_MODE)

#: Without a model or sink, what a receiver keeps of each version: its weights (as
#: tensors), only its stream's bytes (the staging buffer), or nothing (its chunks only
#: pass by its observers).
Keep = Literal["weights", "bytes", "nothing"]
KEEPS: Final = ("weights", "bytes", "nothing")


class ApplyHost(Protocol):
    """What the apply machinery needs from the receiver that holds it."""

    @property
    def worker_idx(self) -> int | None:
        """The worker's id, for the log."""

    @property
    def transport(self) -> SpokeTransport:
        """The spoke chunks come through (it may lend their memory)."""

    def request_latest(self, *, whole: bool = False) -> None:
        """Ask the upstream for its latest version now, if joined (``whole``: not as a
        delta)."""


class Applier:
    """A version's chunks into the model (or its staging buffer, or a sink): the held
    version, the stream in progress, and what each mode keeps between versions.

    It owns the version held (:attr:`version`, :attr:`epoch`, :attr:`weights`,
    :attr:`metadata`, :attr:`wire_dtype`), the :attr:`lock` a forward pass holds, and
    why a version was last refused (:attr:`mismatch`, :attr:`sink_refused`). It adds
    to ``stats``, the receiver's counters. One thread feeds it at a time (the one that
    holds the receiver's transport); :attr:`lock` guards what forward passes read.
    """

    def __init__(
        self,
        host: ApplyHost,
        *,
        model_id: str,
        model: Any,
        strategy: str,
        apply_mode: str,
        sink: Callable[[list[Any]], Any] | None,
        keep: Keep,
        chunk_timeout: float,
        timeout: float,
        stats: dict[str, Any],
        rejections: Rejections,
        observer: ReceiverObserver,
        retired_epochs: int,
        lend_tensors: bool | None = None,
    ) -> None:
        self._host = host
        self._rejections = rejections
        self._observer = observer
        self.stats = stats
        self.model_id = model_id
        self.model = model
        self.strategy = strategy
        self.apply_mode = apply_mode
        self.sink = sink
        #: Without a model: whether the stream's bytes are kept in the staging buffer (a
        #: receiver that keeps nothing only passes them by).
        self._stages = keep != "nothing"
        #: Without a model: make :attr:`weights` of each version.
        self._materialize = keep == "weights"
        self.version = 0
        self.epoch = 0
        self.weights: Any = None
        #: What the learner attached to the version held now (``send(metadata=)``).
        self.metadata: Metadata | None = None
        #: The dtype the version held now travelled as (``wire_dtype``), or None.
        self.wire_dtype: str | None = None
        #: Held while a version is copied into the model. Hold it during a forward pass
        #: to never see half of one.
        self.lock = WeightsLock(timeout)
        #: Called as ``fn(epoch, version)`` after each version is applied, still under
        #: :attr:`lock` (so the model holds exactly that version while it runs).
        self.on_applied: list[Callable[[int, int], None]] = []
        #: The buffer a version is gathered in (without a model: the one held whole).
        self.staging = Staging()
        #: The last version refused for not fitting the model, and why, until one fits.
        self.mismatch: tuple[int, SchemaMismatchError] | None = None
        #: The version a sink last refused, and why.
        self.sink_refused: tuple[int, str] | None = None
        self._stream = ChunkStream(chunk_timeout)
        self._incoming_metadata: Metadata | None = None
        self._wire_of: tuple[WeightsSchema | None, str | None] = (None, None)
        self._model_tensors = ModelTensors(strategy)
        self._plan: ApplyPlan | None = None
        self._in_place: InPlace | None = None
        self._sink_feed: SinkFeed | None = None
        #: How the version in progress is applied: "in_place", "staged", "sink",
        #: "passing", or "" (none).
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
        self._started_at = 0.0
        self._schema: WeightsSchema | None = None
        #: The ack the chunk being fed calls for, if any.
        self._ack_due: PendingAck | None = None
        #: Epochs it left, to drop their late frames.
        self._retired: deque[int] = deque(maxlen=retired_epochs)
        #: ``apply_mode="shared"``: the model's tensors become read-only views of each
        #: version's shared memory (see :mod:`~zmqsync.receiver.shared`).
        self._shared = (
            SharedVersion(self._borrowed, stats)
            if apply_mode == SHARED_MODE and model is not None and sink is None
            else None
        )
        #: The model's tensors in memory lent to the hub, which writes each version
        #: straight into them (see :mod:`~zmqsync.receiver.lent`); None: not lent.
        self._lent = (
            LentVersions(stats)
            if lend_tensors is not False
            and model is not None
            and sink is None
            and self._shared is None
            else None
        )
        #: Lend the tensors whatever the version's size (``lend_tensors=True``); by
        #: default only from LENT_MIN_BYTES up, where the learner writes lent memory.
        self._lend_small = lend_tensors is True
        #: The last schema sized for lending, and whether it is large enough (walking
        #: thousands of entries at every version would cost as much as their copy).
        self._lend_sized: tuple[WeightsSchema, bool] | None = None

    def device_to_take(self) -> torch.device | None:
        """The GPU the model lives on, when versions lent on it can be applied from it
        as they are (in place, device to device): every tensor on that one GPU, no sink,
        not the shared mode."""
        if (
            self.model is None
            or self.sink is not None
            or self._shared is not None
            or self.apply_mode not in ("auto", "in_place")
        ):
            return None
        devices = {t.device for t in self._model_tensors.get(self.model).values()}
        device = next(iter(devices)) if len(devices) == 1 else None
        return device if handles.IPC.lendable(device) else None

    @property
    def torn(self) -> bool:
        """Whether the model holds parts of two versions (an in-place stream broke)."""
        return self.lock.torn is not None

    def needs_whole(self) -> bool:
        """Whether it takes the next whole version, even one it holds: the model is torn,
        or an observer wants the version held again."""
        return self.lock.torn is not None or self._observer.wants_resend()

    @property
    def active(self) -> bool:
        """Whether a version is in progress (its next chunk, or the hub's word that it
        is written into the lent tensors, is awaited)."""
        return self._stream.active or (self._lent is not None and self._lent.pending is not None)

    @property
    def gap(self) -> float:
        """The longest wait between two chunks of a version before it counts as broken."""
        return self._stream.gap

    def feed(self, chunk: Chunk) -> PendingAck | None:
        """Take ``chunk``; return the ack it calls for, to send once its frames are let
        go of (a transport that lends its memory may reuse it once the ack is out)."""
        self._ack_due = None
        self.stats["received_bytes"] += len(chunk.payload)
        self.stats["chunks"] += 1
        if chunk.first and chunk.schema is not None and chunk.schema.parts != 1:
            # A part of a sharded learner's version, not gathered with the others (the
            # receiver gathers them): never applied on its own.
            self.stats["stale"] += 1
            wanted = False
        else:
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
        # The gap to the next chunk counts from now, not from when this one was read:
        # the time taken to apply it is the receiver's own, not the stream's.
        self._stream.ready(time.monotonic())
        return self._ack_due

    def expire(self, now: float) -> bool:
        """Break the version in progress if its next chunk is overdue; True if it did."""
        lent = self._lent
        if lent is not None and lent.pending is not None and now > lent.pending[2]:
            version = lent.pending[0]
            self._take_back(version, "the sender went quiet while writing it into the tensors")
            return True
        broken = self._stream.expire(now)
        if broken is None:
            return False
        self._on_broken(broken)
        return True

    def abandon(self, reason: str) -> None:
        """Give up the version in progress, if any (the receiver follows another
        upstream): as a broken stream."""
        broken = self._stream.abandon(reason)
        if broken is not None:
            self._on_broken(broken)

    def close(self) -> None:
        """The receiver closes: half a version in the model leaves it torn for good."""
        if self._shared is not None:
            self._shared.abandon()
        if self._lent is not None:
            if self._lent.pending is not None:
                self._take_back(self._lent.pending[0], "the receiver closed mid-version", False)
            else:
                with self.lock.raw:
                    self._lent.take_back(count=False)
        if self._writing in ("in_place", "parts"):
            self._writing = ""
            with self.lock.raw:
                self.lock.tear(self.version + 1, "the receiver closed mid-version")
                self.lock.end_write()

    # --- lent tensors: the hub writes each version straight into the model ----------

    def _lend(self, layout: bytes) -> None:
        """A version of ``layout`` came whole into the model, not through its lent
        tensors (under the lock): lend them to the hub, if the transport can say so and
        they can lie in the stream. Said again after each such version, though lent
        already: a hub that forgot this worker (it joined again) learns it anew."""
        assert self._lent is not None and self._schema is not None
        spoke = self._host.transport
        if not isinstance(spoke, Borrows) or not spoke.lends_tensors():
            return
        if not self._lend_small and not self._large_enough(self._schema):
            return  # the learner streams versions this small: nothing to lend for
        if self._lent.said_lately(layout, time.monotonic()):
            return  # said within the second, and nothing was refused since
        lent = self._lent.lend(
            self._schema, layout, self.model, self._model_tensors.get(self.model)
        )
        if lent is not None:
            where, moved = lent
            if moved:
                self._in_place = self._plan = None  # their views are of the old memory
            spoke.lend_tensors(where, layout)

    def _large_enough(self, schema: WeightsSchema) -> bool:
        """Whether versions of ``schema`` are large enough for the learner to write
        into lent memory (LENT_MIN_BYTES and more).

        The whole version's bytes decide, not those of its large tensors alone (which
        decide the learner's side): a model of thousands of small tensors is streamed
        even to a lending worker, but its tensors, lent, lie back to back as the stream
        lays them, and each chunk is applied in one copy, not one per tensor (2,000 x
        4 KB to one worker: 5.8 ms lent against 9.1 private, in one run)."""
        sized = self._lend_sized
        if sized is None or sized[0] is not schema:
            sized = self._lend_sized = (schema, stream_bytes(schema) >= LENT_MIN_BYTES)
        return sized[1]

    def lent_ask(self, version: int, epoch: int, layout: bytes) -> None:
        """The hub asks to write ``version`` into the lent tensors: hold the lock and say
        go, or say no (a version in progress, not newer, the tensors moved). Asked again
        for the version it said go for, it holds on: the hub is still writing."""
        spoke = self._host.transport
        if not isinstance(spoke, Borrows):
            return
        lent = self._lent
        if lent is not None and lent.still_writing(version, epoch, time.monotonic() + self.gap):
            return  # asked again: the hub is alive, writing the version it said go for
        newer = epoch != self.epoch or version > self.version or self.needs_whole()
        ok = (
            lent is not None
            and not self._writing
            and not self._stream.active
            and newer
            and epoch not in self._retired
            and lent.may_write(layout)
        )
        if ok:
            assert lent is not None
            self.lock.begin_write()  # forward passes under way finish; new ones wait
            self._writing = "lent"
            self._started_at = time.monotonic()
            lent.pending = (version, epoch, self._started_at + self.gap)
        elif lent is not None and lent.tensors is not None and not lent.tensors.intact():
            with self.lock.raw:
                lent.take_back()  # moved under it: lent again after the next version
            spoke.lend_tensors(None, b"")
        spoke.answer(version, epoch, ok)

    def lent_written(
        self, version: int, epoch: int, ok: bool, metadata: Any, unusable: bool = False
    ) -> PendingAck | None:
        """The hub says ``version`` is in the lent tensors (``ok``) or that it wrote
        nothing of it (the version then comes as a stream; ``unusable``: it could not
        use the memory lent). Returns its ack."""
        lent = self._lent
        if lent is None or lent.pending is None or lent.pending[:2] != (version, epoch):
            self.stats["stale"] += 1  # an answer to an ask given up on: nothing to do
            return None
        if not ok:
            if unusable:
                lent.unusable()
            lent.pending = None
            self._writing = ""
            with self.lock.raw:
                self.lock.end_write()
            return None
        assert self._schema is not None
        total = stream_bytes(self._schema)
        chunk = Chunk(
            self.model_id,
            version,
            epoch,
            0,
            1,
            0,
            total,
            lent.layout,
            b"",
            schema=self._schema,
            metadata=metadata,
        )
        self._incoming_metadata = metadata
        self._wire_of = (self._schema, None)
        self._delta_spans = None
        self._fills_staging = False
        self._staging_holds = None
        self._complete(chunk)
        return self._ack_due

    def _take_back(self, version: int, reason: str, repair: bool = True) -> None:
        """The hub may still write into the lent tensors: move them away (one copy);
        the model is torn (the hub may have written part of ``version``) until a
        whole version repairs it (asked for now, unless not ``repair``: closing)."""
        assert self._lent is not None
        self._writing = ""
        with self.lock.raw:
            self._lent.take_back()
            self._in_place = self._plan = None
            self.lock.tear(version, reason)
            self.lock.end_write()
        self.stats["torn"] += 1
        spoke = self._host.transport
        if isinstance(spoke, Borrows):
            spoke.lend_tensors(None, b"")
        if repair:
            self._host.request_latest()

    # --- a sharded learner's versions, written in place as their parts come --------

    def place_parts(self, schema: WeightsSchema, total: int) -> list[np.ndarray] | None:
        """Where the parts of a sharded learner's version (laid out whole as ``schema``,
        ``total`` bytes) are written as they come: the model's own tensors (their bytes,
        shaped as each tensor with its elements' bytes last), the model then being
        written in place until :meth:`parts_placed` or :meth:`parts_torn`; or None, to
        have them gathered in a buffer and fed whole. In place when the mode says so
        (``"in_place"``, or ``"auto"`` above :data:`STAGED_MAX_BYTES`) and every tensor
        can take its bytes where it stands: on the CPU, contiguous, not cast."""
        if self.model is None or self.sink is not None or self._writing or self._shared is not None:
            return None
        mode = self.apply_mode
        if not (mode == "in_place" or (mode == "auto" and total > STAGED_MAX_BYTES)):
            return None
        if any(e.wire for e in schema.entries):
            return None
        target = self._model_tensors.get(self.model)
        try:
            check_fits(schema, target, self.strategy)
        except SchemaMismatchError:
            return None  # refused once it comes whole, saying why
        views = []
        for e in schema.entries:
            t = target[e.key]
            if t.device.type != "cpu" or not t.is_contiguous():
                return None
            views.append(byte_view(t.detach()).numpy().reshape(*e.shape, t.element_size()))
        self._started_at = time.monotonic()
        self.lock.begin_write()  # until every part is in (or one breaks off)
        self._writing = "parts"
        return views

    def parts_placed(self, chunk: Chunk) -> PendingAck:
        """Every part of the version ``chunk`` names (its whole schema, no bytes) was
        written in place: it is the model's now. Returns its ack."""
        assert self._writing == "parts" and chunk.schema is not None
        self._schema = chunk.schema
        self._incoming_metadata = chunk.metadata
        self._wire_of = (chunk.schema, None)
        self._delta_spans = None
        self._fills_staging = False
        self._staging_holds = None
        self._complete(chunk)
        return PendingAck(applied=True)

    def parts_torn(self, version: int, reason: str) -> None:
        """The version written in place broke off: the model is torn until a whole
        version repairs it."""
        if self._writing != "parts":
            return
        self._writing = ""
        self.stats["broken_streams"] += 1
        with self.lock.raw:
            self.lock.tear(version, reason)
            self.lock.end_write()  # forward passes now refuse: the model is torn
        self.stats["torn"] += 1

    def _wanted(self, chunk: Chunk) -> bool:
        """Whether to receive the version ``chunk`` starts (counts what it is not)."""
        if chunk.epoch != self.epoch:
            if chunk.epoch in self._retired:
                self.stats["stale"] += 1  # frames of a sender life we already left
                return False
            return True
        if chunk.version >= self.version and self.needs_whole():
            return True  # a repair: the model no longer holds self.version
        if chunk.version <= self.version:
            self.stats["duplicates"] += 1
            self._ack_due = PendingAck(applied=True)  # we hold it (or newer): settles a send
            return False
        return True

    def _patchable(self, chunk: Chunk) -> str:
        """Why this worker cannot apply the delta ``chunk`` starts ("" if it can)."""
        assert chunk.base is not None
        # A receiver that keeps nothing patches nothing: the delta passes by its
        # observers, to those below that hold its base.
        if self._shared is not None:
            return "its weights are shared: each version is mapped whole"
        if self._stages and self.needs_whole():
            return "the model is torn"
        if chunk.epoch != self.epoch or not chunk.base <= self.version < chunk.version:
            return f"it is against version {chunk.base}; this worker holds {self.version}"
        if chunk.layout != self._held_layout:
            return "its layout is not the one of the version held"
        if (
            self._stages
            and (self.sink is not None or self.model is None)
            and self._staging_holds != (self.epoch, self.version)
        ):
            return "the staging buffer does not hold the version held"
        return ""

    def _on_start(self, event: Start) -> None:
        self._observer.version_starting(event.chunk)
        self._prepare(event)
        if self._writing:  # taken: not a delta it cannot apply, not refused
            try:
                self._observer.version_started(event.chunk)
            except BaseException:
                self._drop("an observer refused it")
                raise

    def _drop(self, reason: str) -> None:
        """Let the version just started go (nothing of it was written yet): without its
        first chunk, it is asked for again."""
        writing, self._writing = self._writing, ""
        if writing == "in_place":
            with self.lock.raw:
                self.lock.end_write()
        self._stream.abandon(reason)

    def _prepare(self, event: Start) -> None:
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
                    self._host.worker_idx,
                    chunk.version,
                    why,
                )
                self._host.request_latest(whole=True)
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
            self.staging.start(chunk.total)
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
            self.staging.start(chunk.total)
            return
        target = self._model_tensors.get(self.model)
        if self._shared is not None:
            try:
                self._shared.check(schema, target, self.strategy)
            except SchemaMismatchError as exc:
                self._stream.abandon("refused")
                self._refuse(chunk, exc)
                return
            self._writing = "shared"
            self._fills_staging = False  # the block (or a private copy) holds it
            spoke = self._host.transport
            if isinstance(spoke, Borrows):
                spoke.keep_versions()
            self._shared.start(chunk.total)
            return
        in_place = self.apply_mode == "in_place" or (
            self.apply_mode == "auto"
            and (
                chunk.count == 1 or chunk.total > STAGED_MAX_BYTES or self._borrowed(chunk.payload)
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
            self.staging.start(chunk.total)

    def _borrowed(self, payload: Buffer) -> bool:
        """Whether ``payload`` is memory the transport lends (shared memory)."""
        spoke = self._host.transport
        return isinstance(spoke, Borrows) and spoke.borrowed([payload])

    def _refuse(self, chunk: Chunk, exc: SchemaMismatchError) -> None:
        self._rejections.add(self._host.worker_idx, f"version {chunk.version}: {exc}")
        self.mismatch = (chunk.version, exc)
        self._ack_due = PendingAck(False, str(exc), chunk.version, chunk.epoch)

    def _on_piece(self, chunk: Chunk) -> None:
        if self._writing:
            self._observer.chunk_arrived(chunk)  # before it is written: cut-through
        if self._writing not in ("in_place", "") and isinstance(chunk.payload, torch.Tensor):
            # A device block's bytes, for a version not applied in place: on the host.
            chunk = dataclasses.replace(chunk, payload=chunk.payload.cpu().numpy())
        if self._delta_spans is not None and len(chunk.payload):
            self._delta_spans.append((chunk.offset, len(chunk.payload)))
        if self._writing == "in_place":
            assert self._in_place is not None
            if isinstance(chunk.payload, torch.Tensor):
                self.stats["device_chunks"] += 1  # lent on the device: device to device
            self._in_place.apply(chunk.offset, chunk.payload)
        elif self._writing == "staged":
            self.staging.write(chunk.offset, chunk.payload)
        elif self._writing == "shared":
            assert self._shared is not None
            self._shared.piece(chunk.offset, chunk.payload)
        elif self._writing == "sink":
            self.staging.write(chunk.offset, chunk.payload)
            assert self._sink_feed is not None and self.sink is not None
            tensors = self._sink_feed.ready(
                self.staging, chunk.offset + len(chunk.payload), self._delta_spans
            )
            if tensors:
                try:
                    self.sink(tensors)
                except Exception as exc:  # the engine refused: the version is not applied
                    self._writing = ""
                    self._stream.abandon("refused")
                    reason = f"sink raised {type(exc).__name__}: {exc}"
                    self._rejections.add(
                        self._host.worker_idx, f"version {chunk.version}: {reason}"
                    )
                    self.sink_refused = (chunk.version, reason)
                    self._ack_due = PendingAck(False, reason, chunk.version, chunk.epoch)
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
            elif writing == "parts":
                self.lock.end_write()  # every box went to its tensor as it came
            elif writing == "lent":
                assert self._lent is not None
                self._lent.written()
                self.lock.end_write()  # the hub wrote every tensor in place
            elif writing == "sink":
                pass  # every tensor went to the sink as its chunk came
            elif writing == "shared":
                assert self._shared is not None and self._schema is not None
                target = self._model_tensors.get(self.model)
                self._shared.install(self._schema, self.model, target)
                self._model_tensors.storage_moved()  # re-pointed just now, by us
            elif self.model is not None and self._delta_spans is not None:
                assert self._in_place is not None
                staged = self.staging.array
                for offset, length in self._delta_spans:
                    self._in_place.apply(offset, staged[offset : offset + length].data)
                self._in_place.finish()
            elif self.model is not None:
                assert self._plan is not None
                schema = self._plan.schema
                self._plan.apply(
                    self.staging.weights(self.model_id, chunk.version, chunk.epoch, schema)
                )
            elif self._materialize:
                assert self._schema is not None
                weights = self.staging.weights(
                    self.model_id, chunk.version, chunk.epoch, self._schema
                )
                self.weights = as_weights_object(materialize(weights), self.strategy)
            self.mismatch = None
            if chunk.epoch != self.epoch:
                if self.epoch:
                    self._retired.append(self.epoch)
                self.epoch = chunk.epoch
            self.version = chunk.version
            self._held_layout = chunk.layout
            if writing != "in_place" and self._fills_staging:
                self._staging_holds = (self.epoch, self.version)
            elif writing in ("in_place", "parts", "lent", "shared"):
                # The model took this version without the staging buffer, which holds no
                # version now (a later delta patches the model): a whole model's worth
                # of memory kept for nothing while versions keep coming that way (leased
                # blocks again, after versions a hub sent through its socket, copied).
                self.staging.release()
                if self._plan is not None:
                    self._plan.forget_source()
            self.metadata = self._incoming_metadata
            self.wire_dtype = self._wire_of[1]
            self.lock.mend()
            if self._lent is not None and writing != "lent":
                self._lend(chunk.layout)
            for listener in self.on_applied:
                listener(self.epoch, self.version)
        self.stats["applied"] += 1
        if self._delta_spans is not None:
            self.stats["deltas"] += 1
        self.stats["last_apply_s"] = time.monotonic() - self._started_at
        self._ack_due = PendingAck(applied=True)
        assert self._schema is not None
        self._observer.version_completed(chunk, self._schema)

    def _on_broken(self, broken: Broken) -> None:
        """The version in progress will not complete."""
        writing, self._writing = self._writing, ""
        if writing == "shared" and self._shared is not None:
            self._shared.abandon()  # the version held stays mapped
        self.stats["broken_streams"] += 1
        log.info(
            "worker %s: version %s broke off: %s",
            self._host.worker_idx,
            broken.version,
            broken.reason,
        )
        if writing == "in_place":
            with self.lock.raw:
                self.lock.tear(broken.version, broken.reason)
                self.lock.end_write()  # forward passes now refuse: the model is torn
            self.stats["torn"] += 1
        self._host.request_latest()  # the sender's latest repairs it
        self._observer.version_broken(broken)
