"""The copies a sender streams from: the version's stream in memory it owns, in a ring
of chunk buffers, or in shared memory its workers read (share_params); the snapshot of
the latest version; and, with ``delta``, which blocks each version changed."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from zmqsync.chunking.delta import DELTA_BLOCK, DeltaTracker
from zmqsync.chunking.layout import StreamLayout
from zmqsync.protocol import (
    Buffer,
)
from zmqsync.sender.pump import HubRunner
from zmqsync.sender.state import SenderState
from zmqsync.sender.transfers import Copy, Ring, Transfer, stream_checksums
from zmqsync.tensors.extract import KeyPath, extract
from zmqsync.tensors.flatten import Flat
from zmqsync.tensors.shared_params import SharedParams, why_not_shared
from zmqsync.transport.base import (
    PeerId,
)

__all__ = ["Copying"]

log = logging.getLogger("zmqsync.sender")


class Copying(SenderState):
    """How a sender makes the copy of each version (a part of WeightSender)."""

    def _record(self, copy: Copy) -> None:
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

    def _delta_transfers(
        self,
        copy: Copy,
        runner: HubRunner,
        holdings: list[tuple[PeerId, int | None]],
        fan_out: bool,
    ) -> list[Transfer]:
        """How ``copy`` goes to one hub's targeted peers (``holdings``: each with the
        version it holds whole, if any) with ``delta``: deltas where they can be
        applied, the whole version to the rest (``fan_out``: also to peers that are not
        targeted, as a send to every worker does)."""
        tracker = self._tracker
        assert tracker is not None
        known = [(peer, base) for peer, base in holdings if base is not None]
        if not known:
            return [Transfer(copy, None if fan_out else [p for p, _ in holdings])]
        if runner.hub.fans_out or runner.lending():
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
        if fan_out and not whole and len(deltas) == 1 and runner.hub.fans_out:
            base, peers, spans = deltas[0]
            return [Transfer(copy, None, spans, base, len(peers))]
        # Addressed, so that no worker is sent two streams of one version at once.
        transfers = [
            Transfer(copy, peers, spans, base, len(peers)) for base, peers, spans in deltas
        ]
        if whole:
            transfers.append(Transfer(copy, whole))
        return transfers

    def _copy_of(self, weights: Any, version: int, *, whole: bool = True) -> Copy:
        """``weights`` (``None``: the model's), to be copied chunk by chunk as it is
        sent: into memory the sender owns (``whole``), or through the ring."""
        source = self.model if weights is None else weights
        tensors = (
            self._model_tensors.get(source)
            if source is not None
            else extract(None, self.strategy)  # raises: says what to pass
        )
        if not whole and self.share_params and version > 0:
            # (Version 0 is served through the ring: publishing moves no tensor.)
            if source is self.model:
                live = self._live_copy(tensors, version)
                if live is not None:
                    return live
            else:
                self._share_problem = "send() was given weights that are not the model's"
        # Tensors on a GPU stay there: each chunk is copied to the host as it is written.
        flat = self._flattener.flatten(tensors, stage=False)
        if self._layout is None or not self._layout.fits(flat, self.chunk_bytes):
            self._layout = StreamLayout(flat, self.chunk_bytes)
        shared = self._shared_runner()
        if not whole:
            self._drop_snapshot()  # none is kept: let the last one go
            if shared is not None and len(self._runners) == 1:
                # Chunks written into blocks the hub lends, which workers copy out
                # while the next is written; the hub's pool bounds them.
                ring = Ring(self.chunk_bytes, alloc=shared.lend)
            else:
                ring = self._ring
            return Copy(self, version, self._layout, None, flat, ring=ring)
        if shared is not None:
            # A hub whose workers read shared memory in place: the stream, written once
            # into memory it lent, IS the transfer (workers copy chunk i out while the
            # next one is written).
            with shared.holding():
                return self._own(version, flat, self._layout, alloc=shared.lend)
        return self._own(version, flat, self._layout)

    def _rendezvous(self, weights: Any) -> Copy:
        """Version 0 without a snapshot (``publish()`` with ``retain_snapshot=False``):
        read from ``weights`` (``None``: the model's) chunk by chunk through the ring
        whenever a worker is served, as a send reads them, and checked against each
        chunk's checksum taken now (one read of the weights, nothing model-sized kept).
        Weights changed in place since can no longer be sent as version 0: see
        :class:`Copy`'s ``expected``."""
        copy = self._copy_of(weights, 0, whole=False)
        if copy.ring is self._ring:
            # A ring of its own, let go of with the copy at the first send: the sends'
            # ring is sized then (over ipc, say, the hub's blocks serve as theirs).
            copy.ring = Ring(self.chunk_bytes)
        sources = copy.sources
        assert sources is not None
        copy.expected = stream_checksums(copy.layout, sources)
        return copy

    def _drop_snapshot(self) -> Copy | None:
        """Keep no snapshot any more; return the one kept. One read from the weights
        (the published version 0 without a snapshot) is ended, holding every hub's
        baton: no pump is writing a chunk from it meanwhile."""
        with self._snapshot_lock:
            old, self._snapshot = self._snapshot, None
        if old is not None and old.data is None:
            with contextlib.ExitStack() as batons:
                for runner in self._runners:
                    batons.enter_context(runner.holding())
                old.end()
            return None
        return old

    def _live_copy(self, tensors: dict[KeyPath, Any], version: int) -> Copy | None:
        """The version as the model's own tensors in shared memory (``share_params``),
        moved there first if need be; None if they cannot live there."""
        shared = self._shared
        if shared is None or not shared.holds(tensors):
            shared = self._share(tensors)
            if shared is None:
                return None
        self._drop_snapshot()  # the published version 0, if still kept
        return Copy(self, version, shared.layout, shared.data, None, lent_by_hub=True, live=True)

    def _share(self, tensors: dict[KeyPath, Any]) -> SharedParams | None:
        """Move the model's tensors into a block the hub lends (out of the one they are
        in, if any); None, and the reason kept for ``status()``, if they cannot move."""
        runner = self._shared_runner()
        owners = self._model_tensors.owners(self.model)
        old, self._shared = self._shared, None
        why = (
            "wire_dtype casts every version: the tensors are not the wire bytes"
            if self.wire_dtype is not None
            else "no single hub lends shared memory (workers on another host?)"
            if runner is None or len(self._runners) != 1
            else why_not_shared(tensors, owners)
        )
        if why is None:
            assert runner is not None and owners is not None
            flat = self._flattener.flatten(tensors)
            if self._layout is None or not self._layout.fits(flat, self.chunk_bytes):
                self._layout = StreamLayout(flat, self.chunk_bytes)
            with runner.holding():
                data = runner.lend(self._layout.total)
            if data is None:
                why = "the hub has no shared-memory block free"
            else:
                self._shared = SharedParams(tensors, owners, flat, self._layout, data)
                self._totals["params_moved"] += 1
        if old is not None:
            old.release(owners or [], private=self._shared is None)
        if why is not None and why != self._share_problem:
            log.warning("share_params: sends copy the model's tensors (%s)", why)
        self._share_problem = why
        return self._shared

    def _shared_runner(self) -> HubRunner | None:
        """The first hub that lends shared memory to send from, if any."""
        for runner in self._runners:
            if runner.lending():
                return runner
        return None

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
        owned = Copy(self, version, layout, data, flat, lent_by_hub=lent)
        owned.holds = holds
        if self.retain_snapshot or version == 0:
            with self._snapshot_lock:
                self._snapshot = owned
        return owned

    def _still_read(self, copy: Copy) -> bool:
        """Whether a transfer still streams ``copy`` or a transport holds its memory: its
        buffer may be written again only once neither does."""
        for runner in self._runners:
            with runner.holding():
                if any(t.copy is copy for t in runner.transfers):
                    return True
        return not copy.lease.released  # after: a transfer that ended lent its last chunk

    def _latest(self) -> Copy | None:
        """The latest version's stream, or None if the sender keeps none."""
        version = self.fleet.version
        with self._snapshot_lock:
            snapshot = self._snapshot
            if (
                snapshot is not None
                and snapshot.readable  # not version 0 read from weights changed since
                and (snapshot.version == version or self._forwarding)
            ):
                return snapshot  # a relay serves the latest it holds whole
            pending = self._pending
            if pending is not None and pending.copy.version == version and pending.copy.readable:
                return pending.copy
        return None
