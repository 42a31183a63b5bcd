"""What a sender streams a version from: a copy it owns (or a ring of chunk buffers),
a relay's forwarded chunks, one stream to one hub (a transfer), and the lease that says
when no transport reads that memory any more."""

from __future__ import annotations

import logging
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

import numpy as np
import torch

from zmqsync.chunking.layout import Sources, StreamLayout
from zmqsync.fleet import Send
from zmqsync.protocol import Buffer, Chunk, checksum, encode
from zmqsync.tensors.device_reader import DeviceReader
from zmqsync.tensors.extract import KeyPath
from zmqsync.tensors.flatten import Flat
from zmqsync.transport.base import PeerId
from zmqsync.vocabulary import Metadata

__all__ = [
    "Copy",
    "Forwarded",
    "Forwarding",
    "Lent",
    "Pending",
    "Ring",
    "Stamp",
    "Transfer",
    "ViewLease",
    "stream_checksums",
]

log = logging.getLogger("zmqsync.sender")

#: Chunk buffers a sender without a snapshot keeps at most: the window's, and those
#: stopped peers pin until their transport queues are full (at the default 8 MiB
#: chunks, 256 MiB at worst, whatever the model's size).
RING_SLOTS: Final = 32


def stream_checksums(layout: StreamLayout, sources: Sources) -> list[int]:
    """Each chunk's :func:`checksum`, as the stream written from ``sources`` would carry
    it: read in place where the sources are plain bytes, else through one chunk-sized
    buffer (casts, tensors on an accelerator), so nothing model-sized is made."""
    plain = isinstance(sources, list) and all(isinstance(s, np.ndarray) for s in sources)
    scratch: np.ndarray | None = None
    out = []
    for index in range(layout.count):
        _, length = layout.span(index)
        if not plain:
            if scratch is None:
                scratch = np.empty(min(layout.chunk_bytes, layout.total), dtype=np.uint8)
            layout.write(index, sources, scratch)
            out.append(checksum(scratch[:length].data))
            continue
        assert isinstance(sources, list)
        crc, pos = 0, 0
        for p in layout.pieces(index):
            if p.at > pos:  # an alignment gap: zeros in the stream
                crc = zlib.crc32(bytes(p.at - pos), crc)
            source = sources[p.buffer]
            assert isinstance(source, np.ndarray)
            crc = zlib.crc32(source[p.start : p.stop].data, crc)
            pos = p.at + p.stop - p.start
        if length > pos:
            crc = zlib.crc32(bytes(length - pos), crc)
        out.append(crc + 1)  # as checksum() counts
    return out


class Lent(NamedTuple):
    """Frames to send, and weak references to the views of the sender's memory among
    them: while one is alive, a transport still holds that memory."""

    frames: list[Any]
    views: list[weakref.ref[Any]]


class ViewLease:
    """Tracks the views of sender-owned memory that were handed to transports.

    A transport that sends without copying keeps the view object until it let go of
    the bytes (pyzmq does, until ZeroMQ's I/O thread is done with the message), so a
    weak reference to each view says when nobody reads the memory any more.
    """

    __slots__ = ("_refs",)

    def __init__(self) -> None:
        self._refs: list[weakref.ref[Any]] = []

    def lend(self, frames: Sequence[Buffer]) -> Lent:
        """``frames`` with every buffer after the header and body as a fresh view, and
        weak references to those views."""
        out: list[Any] = list(frames)
        refs = []
        for i in range(2, len(out)):
            frame = out[i]
            # A device block's bytes stay a tensor (the hub leases them as they are).
            view = frame[:] if isinstance(frame, torch.Tensor) else np.frombuffer(frame, np.uint8)
            ref = weakref.ref(view)
            refs.append(ref)
            out[i] = view
        self._refs.extend(refs)
        if len(self._refs) > 256:
            self._refs = [r for r in self._refs if r() is not None]
        return Lent(out, refs)

    @property
    def released(self) -> bool:
        self._refs = [r for r in self._refs if r() is not None]
        return not self._refs


class Ring:
    """Chunk-sized buffers a sender without a snapshot streams through, reused once no
    transport holds them: its whole extra memory, whatever the model's size.

    With ``alloc`` (a hub that lends shared memory), each chunk is written into a block
    the hub lends, and the hub's pool is the ring (it lends a block again once every
    worker released it); while every block is held, buffers of its own.
    """

    def __init__(self, chunk_bytes: int, alloc: Callable[[int], Any] | None = None) -> None:
        self.chunk_bytes = chunk_bytes
        self._alloc = alloc
        self._slots: list[tuple[np.ndarray, list[weakref.ref[np.ndarray]]]] = []

    def take(self, nbytes: int) -> np.ndarray | None:
        """A buffer of ``nbytes`` nobody holds, or None while every one is held."""
        if self._alloc is not None:
            lent = self._alloc(nbytes)
            if lent is not None:
                return lent
            # Every block the hub may lend is held (a stopped worker): through the
            # hub's socket, from buffers of our own, until blocks come free.
        for i, (slot, refs) in enumerate(self._slots):
            if all(r() is None for r in refs):
                if slot.nbytes < nbytes:  # made for a smaller model's stream
                    slot = np.empty(nbytes, dtype=np.uint8)
                self._slots[i] = (slot, [])
                return slot[:nbytes]
        if len(self._slots) >= RING_SLOTS:
            return None
        # The size asked for: a stream shorter than one chunk (a small model) needs no
        # chunk-sized buffer. A version's first chunks are its largest.
        slot = np.empty(nbytes, dtype=np.uint8)
        self._slots.append((slot, []))
        return slot[:nbytes]

    def hold(self, buffer: np.ndarray, refs: list[weakref.ref[np.ndarray]]) -> None:
        """``refs`` view ``buffer`` (a slot): it is not taken again until they are gone."""
        for slot, held in self._slots:
            if buffer.base is slot or buffer is slot:
                held.extend(refs)
                return

    @property
    def nbytes(self) -> int:
        return sum(slot.nbytes for slot, _ in self._slots)


@dataclass(frozen=True, slots=True)
class Stamp:
    """What every chunk of a copy carries besides its bytes and version: the model, the
    sender's life (epoch), and whether each chunk carries a CRC-32 of its bytes."""

    model_id: str
    epoch: int
    checksums: bool


class Copy:
    """One version's byte stream, as every transport sends it.

    Either whole (``data``: memory the sender owns, written chunk by chunk as it is
    first sent, kept as the snapshot), or through a :class:`Ring` (each chunk written
    into a ring buffer as it is sent; nothing model-sized). Both read ``sources`` (the
    flattened weights), let go of once the copy is whole or its send is over.

    Or ``live``: ``data`` is the model's own parameters, which live in shared memory
    (``share_params``): nothing is written, and nothing is sent once the send is over.

    A ring copy with ``expected`` (version 0 published without a snapshot) checks each
    chunk it writes against the checksum it had when published: the weights are read
    when a worker is served, and a chunk that changed since ends the copy, unsent
    (``changed``), so a worker gets the published version whole or not at all.
    """

    def __init__(
        self,
        stamp: Stamp,
        version: int,
        layout: StreamLayout,
        data: np.ndarray | None,
        flat: Flat | None,
        lent_by_hub: bool = False,
        ring: Ring | None = None,
        live: bool = False,
        metadata: Metadata | None = None,
    ) -> None:
        self.version = version
        #: Whether its chunks are written by torch's thread pool (nobody copies them as
        #: they are written: see StreamLayout.write).
        self.pooled = False
        #: What the learner attached to the version (its first chunk carries it).
        self.metadata = metadata
        self.layout = layout
        self.data = data
        self.ring = ring
        self.lent_by_hub = lent_by_hub
        self.live = live
        #: The peers its chunks went to (None: a hub's every peer).
        self.reached: set[PeerId] | None = set()
        #: The version whose whole stream ``data`` held when this copy took it over
        #: (the previous snapshot's memory, reused), or None.
        self.holds: int | None = None
        self.lease = ViewLease()
        #: Each chunk's checksum when published, checked as it is written (see above).
        self.expected: list[int] | None = None
        #: Whether a chunk differed from ``expected``: the weights changed in place.
        self.changed = False
        self._model_id = stamp.model_id
        self._epoch = stamp.epoch
        self._checksums = stamp.checksums
        self._flat: Flat | None = flat
        #: The tensors the stream is made of, by key, while they are read (a version
        #: written straight into workers' lent tensors is copied from them).
        self.tensors: Mapping[KeyPath, Any] | None = None
        self._sources = layout.sources(flat) if flat is not None else None
        self._written = 0 if flat is not None else layout.count
        self._ended = False
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return self.layout.count

    @property
    def nbytes(self) -> int:
        return self.layout.total

    @property
    def readable(self) -> bool:
        """Whether every chunk can still be sent (a ring or live copy reads the caller's
        tensors, only while its send lasts)."""
        return not self._ended and (self.data is not None or self._sources is not None)

    def write_through(self, index: int) -> None:
        """Make sure chunks ``0..index`` are written (whole copies only)."""
        if self._written > index or self.data is None:
            return
        with self._lock:
            while self._written <= index:
                assert self._sources is not None
                offset, length = self.layout.span(self._written)
                out = self.data[offset : offset + length]
                self.layout.write(self._written, self._sources, out, self.pooled)
                self._written += 1
            if self._written == self.layout.count:
                self._let_go()  # the caller's memory is read no more

    def write_chunks(self, indices: Iterable[int]) -> None:
        """Write only chunks ``indices``: ``data`` holds the others already (``holds``
        a version that differs from this one in those chunks alone)."""
        assert self.data is not None and self._sources is not None
        with self._lock:
            for index in indices:
                offset, length = self.layout.span(index)
                out = self.data[offset : offset + length]
                self.layout.write(index, self._sources, out, self.pooled)
            self._written = self.layout.count
            self._let_go()

    @property
    def sources(self) -> Sources | None:
        """What the chunks are written from, while they are still read."""
        return self._sources

    def end(self) -> None:
        """The send is over: a ring or live copy reads the caller's tensors no more."""
        if self.data is None or self.live:
            self._let_go()
            self._ended = True

    def _let_go(self) -> None:
        if isinstance(self._sources, DeviceReader):
            self._sources.close()  # no copy out of the caller's tensors is still running
        self._sources = self._flat = self.tensors = None

    @property
    def written(self) -> int:
        """How many of its chunks are written (whole copies)."""
        return self._written

    def forgo(self) -> None:
        """Nothing of this whole copy was written, and nothing will be (every worker
        took the version another way): it reads the caller's tensors no more, and can
        serve nobody."""
        with self._lock:
            self._let_go()
            self._ended = True

    def reach(self, to: Sequence[PeerId] | None) -> None:
        """Its chunks went to ``to`` (None: every peer)."""
        if to is None:
            self.reached = None
        elif self.reached is not None:
            self.reached.update(to)

    def delta_frames(
        self,
        index: int,
        spans: list[tuple[int, int]],
        base: int,
        targets: tuple[int, ...] | None = None,
    ) -> Lent:
        """Chunk ``index`` of the delta against ``base`` that carries ``spans`` (a whole
        copy, written: the sender records a version's digests once it is)."""
        assert self.data is not None and self._written == self.layout.count
        offset, length = spans[index]
        payload = self.data[offset : offset + length].data.toreadonly()
        chunk = Chunk(
            self._model_id,
            self.version,
            self._epoch,
            index,
            len(spans),
            offset,
            self.layout.total,
            self.layout.layout,
            payload,
            checksum=checksum(payload) if self._checksums else 0,
            metadata=self.metadata if index == 0 else None,
            base=base,
            targets=targets if index == 0 else None,
        )
        frames = encode(chunk, schema_bytes=self.layout.schema_bytes if index == 0 else None)
        return self.lease.lend(frames)

    def frames(self, index: int, targets: tuple[int, ...] | None = None) -> Lent | None:
        """Chunk ``index`` as frames to send, lent afresh (and written first if need
        be); None while the ring has no free buffer. ``targets``: the workers behind a
        relay the version is for (the first chunk says so)."""
        layout = self.layout
        offset, length = layout.span(index)
        if self.data is not None:
            self.write_through(index)
            buffer = self.data[offset : offset + length]
        else:
            assert self.ring is not None and self._sources is not None
            taken = self.ring.take(length)
            if taken is None:
                return None
            layout.write(index, self._sources, taken)
            buffer = taken
        payload = buffer if isinstance(buffer, torch.Tensor) else buffer.data.toreadonly()
        crc = checksum(payload) if self._checksums or self.expected is not None else 0
        if self.expected is not None and crc != self.expected[index]:
            # Changed since it was published, and no copy of it is kept: this version
            # can no longer be sent whole (the ring buffer, never lent, is free again).
            if not self.changed:
                log.warning(
                    "the weights published as version 0 changed in place before the first "
                    "send (no copy is kept: retain_snapshot=False); workers that connect "
                    "now get the first send's version. Call publish() after changing them."
                )
            self.changed = True
            self.end()
            return None
        chunk = Chunk(
            self._model_id,
            self.version,
            self._epoch,
            index,
            layout.count,
            offset,
            layout.total,
            layout.layout,
            payload,
            checksum=crc if self._checksums else 0,
            metadata=self.metadata if index == 0 else None,
            targets=targets if index == 0 else None,
        )
        frames = encode(chunk, schema_bytes=layout.schema_bytes if index == 0 else None)
        lent = self.lease.lend(frames)
        if self.data is None:
            assert self.ring is not None
            self.ring.hold(buffer, lent.views)
        return lent


class Forwarded:
    """A version as a relay receives it from upstream: each chunk's frames, sent on as
    they come (:meth:`frames` is None until chunk ``index`` arrived) and let go of once
    sent. Nothing of it is kept: the relay's snapshot serves repairs and late joiners.
    """

    data = None
    live = False

    def __init__(self, chunk: Chunk) -> None:
        self.version = chunk.version
        self.count = chunk.count
        self.nbytes = chunk.total
        self.metadata = chunk.metadata
        self.reached: set[PeerId] | None = set()
        self.lease = ViewLease()
        self._frames: dict[int, list[Any]] = {}
        self._ended = False

    @property
    def readable(self) -> bool:
        return not self._ended

    def add(self, index: int, frames: list[Any]) -> None:
        if not self._ended:
            self._frames[index] = frames

    def end(self) -> None:
        """The upstream stream broke (or the relay closes): nothing more will come."""
        self._ended = True
        self._frames.clear()

    def reach(self, to: Sequence[PeerId] | None) -> None:
        if to is None:
            self.reached = None
        elif self.reached is not None:
            self.reached.update(to)

    def frames(self, index: int) -> Lent | None:
        frames = self._frames.pop(index, None)
        return None if frames is None else self.lease.lend(frames)


@dataclass(eq=False)
class Transfer:
    """One version streaming to one hub: fanned out (``to=None``) or to given peers;
    whole, or (``spans``) as a delta against version ``base``."""

    copy: Copy | Forwarded
    to: list[PeerId] | None
    spans: list[tuple[int, int]] | None = None
    base: int = 0
    #: How many targeted workers a delta goes to (counted in status).
    workers: int = 0
    #: The workers behind the relay it goes to that the version is for, if some.
    targets: tuple[int, ...] | None = None
    #: The next chunk to send.
    next: int = field(default=0, init=False)
    started: float = field(default_factory=time.monotonic, init=False)

    def covers(self, copy: Copy | Forwarded, peer: PeerId) -> bool:
        """Whether it brings ``peer`` the whole ``copy`` (a delta may not do)."""
        return self.copy is copy and self.spans is None and (self.to is None or peer in self.to)

    @property
    def count(self) -> int:
        return self.copy.count if self.spans is None else len(self.spans)

    @property
    def nbytes(self) -> int:
        """Bytes it sends each of its peers."""
        return self.copy.nbytes if self.spans is None else sum(n for _, n in self.spans)

    def frames(self) -> Lent | None:
        if self.spans is None:
            if isinstance(self.copy, Forwarded):
                return self.copy.frames(self.next)
            return self.copy.frames(self.next, self.targets)
        assert isinstance(self.copy, Copy)
        return self.copy.delta_frames(self.next, self.spans, self.base, self.targets)

    @property
    def sent(self) -> bool:
        return self.next >= self.count


@dataclass
class Pending:
    """A send of the sender's own, and the copy it streams."""

    send: Send
    copy: Copy = field(repr=False)
    #: The workers the version was written into (their lent tensors), not streamed to.
    lent: set[PeerId] = field(default_factory=set)


@dataclass
class Forwarding:
    """A relay's version on its way to its workers, and the send that waits for them."""

    send: Send
    copy: Forwarded = field(repr=False)
    #: While the forward is being begun on the hubs (the fleet already counts the
    #: version, a hub's runner not yet): per runner index, the peers it will stream to
    #: (None: every one). Emptied once every runner has begun it.
    starting: dict[int, frozenset[PeerId] | None] = field(default_factory=dict)
