"""The copies a sender streams from: the version's stream in memory it owns, in a ring
of chunk buffers, or in shared memory its workers read (share_params); the snapshot of
the latest version; and, with ``delta``, which blocks each version changed."""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Final, Protocol

import numpy as np
import torch

from zmqsync.chunking.delta import DELTA_BLOCK, DeltaTracker
from zmqsync.chunking.layout import StreamLayout
from zmqsync.protocol import Buffer
from zmqsync.sender.stats import SendStats
from zmqsync.sender.transfers import Copy, Forwarded, Ring, Stamp, Transfer, stream_checksums
from zmqsync.tensors.dtensor import LocalPart
from zmqsync.tensors.extract import KeyPath, extract
from zmqsync.tensors.flatten import DEFAULT_PACK_THRESHOLD, Flat, Flattener
from zmqsync.tensors.model_tensors import ModelTensors
from zmqsync.tensors.shared_params import SharedParams, why_not_shared
from zmqsync.transport.base import PeerId
from zmqsync.transport.cuda import handles

__all__ = ["Outlet", "VersionStore"]

#: The chunks of a version sent to workers that all keep each version mapped (the
#: shared read-only mode) are up to this large. They copy nothing out, so many small
#: chunks overlap nothing with the learner's write, and each chunk costs each worker a
#: message and its handling (about 0.15 ms of Python per chunk on a 2-core machine: 8
#: workers took 27.5 ms of CPU per 128 MB version in 8 MiB chunks, 9.5 ms in one).
KEPT_CHUNK_BYTES: Final = 256 * 1024 * 1024

log = logging.getLogger("zmqsync.sender")

#: share_params through a hub that lends no memory (tcp): model-sized buffers of earlier
#: versions a transport may still hold (a stopped worker's queue) before the tensors stop
#: moving on and sends copy again, until the transport lets go of them.
PINNED_MAX: Final = 1


class Outlet(Protocol):
    """What the store needs of each hub a sender streams through (its pump's runner)."""

    def holding(self) -> AbstractContextManager[None]:
        """Hold the hub: no pump writes a chunk to it meanwhile."""

    def lending(self) -> bool:
        """Whether the hub lends memory its peers read in place, now."""

    def lend(self, nbytes: int) -> Any:
        """``nbytes`` of memory the hub lends (None: none to lend)."""

    def all_keep_versions(self) -> bool:
        """Whether the hub lends memory and every peer keeps each version mapped."""

    def takes_device(self, device: Any) -> bool:
        """Whether every peer of the hub reads versions lent on GPU ``device``."""

    def lend_device(self, nbytes: int, device: Any) -> Any:
        """``nbytes`` of memory on GPU ``device`` the hub lends (None: none)."""

    def streams(self, copy: Copy | Forwarded) -> bool:
        """Whether a transfer streams ``copy`` to the hub now."""


class VersionStore:
    """The copies one sender streams its versions from, and the snapshot it serves.

    It owns the stream's layout, the ring of chunk buffers, the snapshot (guarded by its
    own lock: a pump reads it to serve a late joiner while a send replaces it), the
    model's tensors in shared memory (``share_params``) and the delta tracker
    (``delta``). ``outlets`` are the hubs it streams through, in order.

    Args:
        stamp: what every chunk carries (model, epoch, checksums); see :meth:`new_life`.
        strategy, pack_threshold, wire_dtype: how weights are flattened.
        chunk_bytes: the most bytes one chunk carries.
        retain_snapshot: keep the latest version whole once sent.
        share_params: send the model's own tensors from shared memory a hub lends.
        part: a sharded learner's rank: it streams its own part of each version only.
        delta: versions are digested and sent as deltas (never from device memory).
        stats: where moves of the model's tensors are counted (``params_moved``).
    """

    def __init__(
        self,
        outlets: Sequence[Outlet],
        stamp: Stamp,
        *,
        strategy: str,
        chunk_bytes: int,
        stats: SendStats,
        retain_snapshot: bool = True,
        share_params: bool = False,
        wire_dtype: torch.dtype | None = None,
        pack_threshold: int = DEFAULT_PACK_THRESHOLD,
        part: LocalPart | None = None,
        delta: bool = False,
    ) -> None:
        self.stamp = stamp
        self.delta = delta
        self.strategy = strategy
        self.chunk_bytes = chunk_bytes
        self.retain_snapshot = retain_snapshot
        self.share_params = share_params
        self.wire_dtype = wire_dtype
        self._outlets = outlets
        self._stats = stats
        self._flattener = Flattener(strategy, pack_threshold=pack_threshold, wire_dtype=wire_dtype)
        self._part = part
        if part is not None:
            self._flattener.part = (part.part, part.parts)
        self._model_tensors = ModelTensors(strategy)
        #: The layout of the latest stream, reused while the weights fit it.
        self.layout: StreamLayout | None = None
        #: The chunk buffers sends without a snapshot stream through.
        self.ring = Ring(chunk_bytes)
        self._snapshot: Copy | None = None
        self._snapshot_lock = threading.Lock()
        self._tracker: DeltaTracker | None = None
        #: The model's tensors in a hub's shared memory (share_params), and why not.
        self._shared: SharedParams | None = None
        self.share_problem: str | None = None
        #: Whether ``_shared`` is memory of the sender's own (no hub lends any), and the
        #: earlier such buffers, while a transport may still hold them.
        self._shared_private = False
        self._pinned: list[weakref.ref[np.ndarray]] = []

    @property
    def snapshot(self) -> Copy | None:
        """The copy late joiners and repairs are served from (None: none is kept)."""
        return self._snapshot

    def serve(self, copy: Copy | None) -> Copy | None:
        """Serve ``copy`` to late joiners and repairs from now on (None: nothing);
        returns the copy served until now."""
        with self._snapshot_lock:
            old, self._snapshot = self._snapshot, copy
        return old

    def new_life(self, epoch: int) -> None:
        """Copies carry ``epoch`` from now on; the snapshot of the life before is served
        to nobody."""
        self.stamp = Stamp(self.stamp.model_id, epoch, self.stamp.checksums)
        self.serve(None)

    def latest(self, version: int, pending: Copy | None, held: bool = False) -> Copy | None:
        """What serves ``version`` (the latest) to a worker that lacks it: the snapshot
        or ``pending`` (the copy a send streams), if still readable; None if neither.
        ``held``: serve the snapshot whatever its version (a relay serves the latest it
        holds whole while it forwards the next)."""
        with self._snapshot_lock:
            snapshot = self._snapshot
            if (
                snapshot is not None
                and snapshot.readable  # not version 0 read from weights changed since
                and (held or snapshot.version == version)
            ):
                return snapshot
            if pending is not None and pending.version == version and pending.readable:
                return pending
        return None

    def whole(
        self,
        version: int,
        layout: StreamLayout,
        data: np.ndarray,
        metadata: Any = None,
    ) -> Copy:
        """A copy of a stream held whole elsewhere (``data``, laid out as ``layout``):
        nothing is written into it."""
        return Copy(self.stamp, version, layout, data, None, metadata=metadata)

    # --- making copies -----------------------------------------------------------------

    def copy_of(self, weights: Any, version: int, *, model: Any, whole: bool = True) -> Copy:
        """``weights`` (``None``: ``model``'s), to be copied chunk by chunk as it is
        sent: into memory the sender owns (``whole``), or through the ring."""
        source = model if weights is None else weights
        tensors = (
            self._model_tensors.get(source)
            if source is not None
            else extract(None, self.strategy)  # raises: says what to pass
        )
        if self._part is not None:
            tensors = self._part.local(tensors)  # this rank's boxes only
            self._flattener.boxes = self._part.boxes
        if not whole and self.share_params and version > 0:
            # (Version 0 is served through the ring: publishing moves no tensor.)
            if source is model:
                live = self._live_copy(tensors, version, model)
                if live is not None:
                    return live
            else:
                self.share_problem = "send() was given weights that are not the model's"
        # Tensors on a GPU stay there: each chunk is copied to the host as it is written.
        flat = self._flattener.flatten(tensors, stage=False, pack=False)
        shared = self._lender()
        chunk_bytes = self._chunk_bytes(shared if whole else None)
        device = self._device_to_lend(flat, shared) if whole else None
        if device is not None:
            # Workers copy each version device to device (no host, no overlap to gain).
            chunk_bytes = max(chunk_bytes, KEPT_CHUNK_BYTES)
        if self.layout is None or not self.layout.fits(flat, chunk_bytes):
            self.layout = StreamLayout(flat, chunk_bytes)
        if not whole:
            self._drop_snapshot()  # none is kept: let the last one go
            if shared is not None and len(self._outlets) == 1:
                # Chunks written into blocks the hub lends, which workers copy out
                # while the next is written; the hub's pool bounds them.
                ring = Ring(self.chunk_bytes, alloc=shared.lend)
            else:
                ring = self.ring
            return Copy(self.stamp, version, self.layout, None, flat, ring=ring)
        if shared is not None and device is not None:
            # Every worker's model is on the learner's GPU: the version is written once
            # into device memory the hub lends through CUDA IPC, and nothing crosses to
            # the host (while no device block is free, into shared memory as usual).
            lender = shared

            def on_device(nbytes: int) -> Any:
                lent = lender.lend_device(nbytes, device)
                return lender.lend(nbytes) if lent is None else lent

            with shared.holding():
                return self._own(version, flat, self.layout, alloc=on_device)
        if shared is not None:
            # A hub whose workers read shared memory in place: the stream, written once
            # into memory it lent, IS the transfer (workers copy chunk i out while the
            # next one is written).
            with shared.holding():
                owned = self._own(version, flat, self.layout, alloc=shared.lend)
            # Workers that map each version copy nothing while it is written: the
            # learner's write may take every core.
            owned.pooled = self._all_keep(shared)
            owned.tensors = tensors  # workers that lent their tensors are written from them
            return owned
        return self._own(version, flat, self.layout)

    def rendezvous(self, weights: Any, model: Any) -> Copy:
        """Version 0 without a snapshot (``publish()`` with ``retain_snapshot=False``):
        read from ``weights`` (``None``: ``model``'s) chunk by chunk through the ring
        whenever a worker is served, as a send reads them, and checked against each
        chunk's checksum taken now (one read of the weights, nothing model-sized kept).
        Weights changed in place since can no longer be sent as version 0: see
        :class:`Copy`'s ``expected``."""
        copy = self.copy_of(weights, 0, model=model, whole=False)
        if copy.ring is self.ring:
            # A ring of its own, let go of with the copy at the first send: the sends'
            # ring is sized then (over ipc, say, the hub's blocks serve as theirs).
            copy.ring = Ring(self.chunk_bytes)
        sources = copy.sources
        assert sources is not None
        copy.expected = stream_checksums(copy.layout, sources)
        return copy

    def still_read(self, copy: Copy) -> bool:
        """Whether a transfer still streams ``copy`` or a transport holds its memory: its
        buffer may be written again only once neither does."""
        if any(outlet.streams(copy) for outlet in self._outlets):
            return True
        return not copy.lease.released  # after: a transfer that ended lent its last chunk

    def _drop_snapshot(self) -> Copy | None:
        """Keep no snapshot any more; return the one kept. One read from the weights
        (the published version 0 without a snapshot) is ended, holding every hub: no
        pump is writing a chunk from it meanwhile."""
        old = self.serve(None)
        if old is not None and old.data is None:
            with contextlib.ExitStack() as held:
                for outlet in self._outlets:
                    held.enter_context(outlet.holding())
                old.end()
            return None
        return old

    def _own(
        self,
        version: int,
        flat: Flat,
        layout: StreamLayout,
        alloc: Callable[[int], Any] | None = None,
    ) -> Copy:
        """Memory the sender owns for ``flat``'s stream (``alloc``: memory a hub lends)."""
        old = self._drop_snapshot()  # at most one kept copy at a time
        # The previous stream's memory is reused once no transport reads it any more
        # (fresh memory costs a page fault per page); else it is left to whoever still
        # holds it, and freed when they let go.
        data = None
        previous = old.version if old is not None and old.layout is layout else None
        if alloc is not None:
            data = alloc(layout.total)
        elif (
            old is not None
            and old.data is not None
            and not old.lent_by_hub
            and len(old.data) == layout.total
            and old.lease.released
        ):
            data = old.data
        old = None
        lent = data is not None and alloc is not None
        holds = None
        if data is None:
            data = np.empty(layout.total, dtype=np.uint8)
        elif alloc is None:
            holds = previous  # the previous snapshot's memory: its bytes, whole
        owned = Copy(self.stamp, version, layout, data, flat, lent_by_hub=lent)
        owned.holds = holds
        if self.retain_snapshot or version == 0:
            self.serve(owned)
        return owned

    # --- share_params ------------------------------------------------------------------

    def _live_copy(self, tensors: dict[KeyPath, Any], version: int, model: Any) -> Copy | None:
        """The version as the model's own tensors in shared memory (``share_params``),
        moved there first if need be; None if they cannot live there."""
        shared = self._shared
        if (
            shared is None
            or not shared.holds(tensors)
            or (self._shared_private and self._lender() is not None)  # a hub lends now
        ):
            shared = self.share(model, tensors)
            if shared is None:
                return None
        self._drop_snapshot()  # the published version 0, if still kept
        return Copy(
            self.stamp, version, shared.layout, shared.data, None, lent_by_hub=True, live=True
        )

    @property
    def shares_own_memory(self) -> bool:
        """Whether the model's tensors live in memory of the sender's own (share_params
        through a hub that lends none): what a transport holds of it is what matters
        when a send returns, not what workers read."""
        return self._shared is not None and self._shared_private

    def share(self, model: Any, tensors: dict[KeyPath, Any] | None = None) -> SharedParams | None:
        """Move ``model``'s tensors (``tensors``: as extracted) into a block the hub lends,
        or into memory of the sender's own if the hub lends none (out of the one they
        are in, if any); None, and the reason kept in ``share_problem``, if they cannot
        move."""
        if tensors is None:
            tensors = self._model_tensors.get(model)
        outlet = self._lender()
        owners = self._model_tensors.owners(model)
        old, self._shared = self._shared, None
        why = (
            "wire_dtype casts every version: the tensors are not the wire bytes"
            if self.wire_dtype is not None
            else "the sender streams through more than one hub"
            if len(self._outlets) != 1
            else why_not_shared(tensors, owners)
        )
        old_private = self._shared_private
        self._pinned = [r for r in self._pinned if r() is not None]
        if why is None:
            assert owners is not None
            flat = self._flattener.flatten(tensors, pack=False)
            if self.layout is None or not self.layout.fits(flat, self.chunk_bytes):
                self.layout = StreamLayout(flat, self.chunk_bytes)
            data = None
            if outlet is not None:
                with outlet.holding():
                    data = outlet.lend(self.layout.total)
                if data is None:
                    why = "the hub has no shared-memory block free"
            elif len(self._pinned) >= PINNED_MAX:
                why = "a transport still holds an earlier version's memory (a stopped worker?)"
            else:
                # No hub lends memory (tcp): the sender's own, sent without a copy; it
                # moves on if a transport still holds it when a send returns.
                data = np.empty(self.layout.total, dtype=np.uint8)
            if data is not None:
                self._shared = SharedParams(tensors, owners, flat, self.layout, data)
                self._shared_private = outlet is None
                self._stats.add("params_moved")
        if old is not None:
            if old_private:
                self._pinned.append(weakref.ref(old.data))  # alive while a transport holds it
            old.release(owners or [], private=self._shared is None)
        if why is not None and why != self.share_problem:
            log.warning("share_params: sends copy the model's tensors (%s)", why)
        self.share_problem = why
        return self._shared

    def _chunk_bytes(self, lender: Outlet | None) -> int:
        """The chunks of a version written into memory ``lender`` lends: up to
        :data:`KEPT_CHUNK_BYTES` when it is the only hub and every worker keeps each
        version mapped (the shared mode), else ``chunk_bytes``."""
        if not self._all_keep(lender):
            return self.chunk_bytes
        return max(self.chunk_bytes, KEPT_CHUNK_BYTES)

    def _all_keep(self, lender: Outlet | None) -> bool:
        """Whether ``lender`` is the only hub and every worker of it keeps each version
        mapped (the shared mode): they copy nothing out of the stream."""
        return (
            lender is not None
            and len(self._outlets) == 1
            and self._part is None
            and lender.all_keep_versions()
        )

    def _device_to_lend(self, flat: Flat, lender: Outlet | None) -> torch.device | None:
        """The GPU ``flat`` lies on, if its version may be written into device memory
        ``lender`` lends: the only hub, every worker on that GPU, the version sent
        whole and as it is (no cast, no checksum, no delta, not a sharded part)."""
        if (
            lender is None
            or not flat.on_device
            or len(self._outlets) != 1
            or self._part is not None
            or self.wire_dtype is not None
            or self.stamp.checksums
            or self.delta
        ):
            return None
        devices = {getattr(b, "device", None) for b in flat.buffers}
        if len(devices) != 1:
            return None
        device = next(iter(devices))
        if not handles.IPC.lendable(device) or not lender.takes_device(device):
            return None
        return device

    def _lender(self) -> Outlet | None:
        """The first hub that lends shared memory to send from, if any."""
        for outlet in self._outlets:
            if outlet.lending():
                return outlet
        return None

    # --- delta ---------------------------------------------------------------------------

    def record(self, copy: Copy) -> None:
        """Write a version whole and digest it (``delta``): which blocks it changed.

        The digests read the caller's tensors where they are plain CPU bytes; then only
        the chunks that changed are written into the previous snapshot's memory, when
        the copy took it over. Otherwise (casts, a GPU) the stream is written whole
        first and its bytes digested."""
        assert copy.data is not None
        tracker = self._tracker
        if tracker is None or tracker.layout is not copy.layout:
            # Blocks no larger than a chunk: a delta never moves more than a chunk for
            # a change of one byte.
            tracker = self._tracker = DeltaTracker(copy.layout, min(DELTA_BLOCK, self.chunk_bytes))
        layout, sources, latest = copy.layout, copy.sources, tracker.latest
        if sources is not None and layout.stretches(sources, 0, layout.total) is not None:

            def read(lo: int, hi: int) -> list[Buffer]:
                parts = layout.stretches(sources, lo, hi)
                assert parts is not None  # every source is plain bytes
                return parts

            tracker.record(copy.version, read)
            if copy.holds is not None and copy.holds == latest:
                copy.write_chunks(tracker.chunks_changed(copy.version))
            else:
                copy.write_through(copy.count - 1)
            return
        copy.write_through(copy.count - 1)
        data = memoryview(copy.data.data)
        tracker.record(copy.version, lambda lo, hi: (data[lo:hi],))

    def delta_transfers(
        self,
        copy: Copy,
        holdings: list[tuple[PeerId, int | None]],
        fan_out: bool,
        *,
        fans_out: bool,
        lending: bool,
    ) -> list[Transfer]:
        """How ``copy`` goes to one hub's targeted peers (``holdings``: each with the
        version it holds whole, if any) with ``delta``: deltas where they can be
        applied, the whole version to the rest (``fan_out``: also to peers that are not
        targeted, as a send to every worker does). ``fans_out``: the hub's one stream
        reaches every peer; ``lending``: its peers read the lent memory in place."""
        tracker = self._tracker
        assert tracker is not None
        known = [(peer, base) for peer, base in holdings if base is not None]
        if not known:
            return [Transfer(copy, None if fan_out else [p for p, _ in holdings])]
        if fans_out or lending:
            # One stream reaches every peer: one delta, against the oldest version held.
            groups = {min(base for _, base in known): [peer for peer, _ in known]}
        else:
            groups = {}
            for peer, base in known:
                groups.setdefault(base, []).append(peer)
        whole = [peer for peer, base in holdings if base is None]
        deltas = []
        for base, peers in sorted(groups.items()):
            spans = tracker.spans(base, self.chunk_bytes)
            if spans is None:
                whole += peers
            else:
                deltas.append((base, peers, spans))
        if fan_out and not whole and len(deltas) == 1 and fans_out:
            base, peers, spans = deltas[0]
            return [Transfer(copy, None, spans, base, len(peers))]
        # Addressed, so that no worker is sent two streams of one version at once.
        transfers = [
            Transfer(copy, peers, spans, base, len(peers)) for base, peers, spans in deltas
        ]
        if whole:
            transfers.append(Transfer(copy, whole))
        return transfers
