"""A version as a byte stream cut into chunks: laying it out, writing chunks, applying them.

Part of the tensors layer (it imports torch and numpy; nothing above it does I/O here).

- :class:`StreamLayout` (sender): where each of a :class:`~zmqsync.tensors.Flat`'s
  buffers lies in the version's byte stream (one after the other, each on a 64-byte
  boundary), the stream's schema (every tensor in buffer 0, at its stream offset), and
  which bytes of which buffer each chunk carries. :meth:`StreamLayout.write` fills one
  chunk; it is worked out once per layout and reused every version.
- :class:`InPlace` (receiver): copies each chunk's bytes straight into a model's tensors.
  The tensors hold a mix of two versions until the last chunk: the receiver holds its
  lock throughout, and marks the worker torn if the stream breaks.
- :class:`Staging` (receiver): a buffer of the version's size that chunks land in; once
  the last came, the whole version is applied in one go (:class:`~zmqsync.tensors
  .ApplyPlan`), so the model is locked only for that copy.
- :class:`DeltaTracker` (sender, ``delta=True``): a digest of every block of the stream
  and the version that last changed it, from which a delta's stretches are cut.

A chunk with many tensors (a few thousand small ones) costs no Python step per tensor:
its destinations and the views that feed them are made once, and one ``map`` of
``np.copyto`` over them runs in C.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import torch
import xxhash

from zmqsync.protocol import (
    Buffer,
    Chunk,
    TensorEntry,
    Weights,
    WeightsSchema,
    encode,
    encode_schema,
)
from zmqsync.protocol.codec import layout_digest
from zmqsync.tensors import (
    CastPlan,
    Flat,
    Flattener,
    KeyPath,
    check_fits,
    extract,
    overlapping,
    read_view,
    serial_pieces,
    torch_dtype,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DELTA_BLOCK",
    "MIN_CHUNK_BYTES",
    "DeltaTracker",
    "DeviceReader",
    "InPlace",
    "SinkFeed",
    "Staging",
    "StreamLayout",
    "version_messages",
]

#: Default chunk size. Large enough that a chunk's fixed costs (a message, a lease, a
#: Python step on each side) vanish next to its copy; small enough that a same-host
#: worker copies chunk i while the learner writes chunk i+1, and that a worker's
#: receive memory (a chunk or two) stays small. (benchmarks/README.md: how it was chosen.)
DEFAULT_CHUNK_BYTES: Final = 8 * 1024 * 1024
#: Smallest chunk_bytes a scheme accepts: below it, per-message costs dominate.
MIN_CHUNK_BYTES: Final = 64 * 1024
#: Each buffer of a Flat starts on this boundary in the stream (a cache line), so a
#: receiver can view any tensor at its natural alignment.
STREAM_ALIGN: Final = 64
#: The stretch of a stream one digest covers (``delta=True``): a delta moves whole
#: blocks, so a change of one byte sends one block.
DELTA_BLOCK: Final = 1024 * 1024
#: A delta larger than this share of the whole version goes whole (any worker can apply
#: a whole version; few gain from a delta that large).
DELTA_MAX_SHARE: Final = 0.5
#: A chunk with more pieces than this is applied through cached views and one ``map``
#: (fewer are cheaper to slice on the spot).
_MANY: Final = 16


def _aligned(n: int) -> int:
    return -(-n // STREAM_ALIGN) * STREAM_ALIGN


@dataclass(frozen=True, slots=True)
class _Piece:
    buffer: int  # which of the Flat's buffers
    start: int  # first byte of that buffer
    stop: int
    at: int  # where it goes in the chunk


class StreamLayout:
    """One layout of a Flat as a stream of ``chunk_bytes`` chunks (see the module)."""

    def __init__(self, flat: Flat, chunk_bytes: int) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive; got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.source_schema = flat.schema
        self.sizes = flat.sizes
        bases, pos = [], 0
        for n in self.sizes:
            bases.append(pos)
            pos = _aligned(pos + n)
        entries = tuple(
            TensorEntry(e.key, e.dtype, e.shape, 0, bases[e.buffer] + e.offset, e.nbytes, e.wire)
            for e in flat.schema.entries
        )
        self.total = max((e.offset + e.nbytes for e in entries if e.nbytes), default=0)
        self.bases = bases
        self.schema = WeightsSchema(flat.schema.strategy, entries)
        self.schema_bytes = encode_schema(self.schema)
        self.layout = layout_digest(self.schema_bytes)
        self.count = max(1, -(-self.total // chunk_bytes))
        self._pieces: list[list[_Piece]] = [[] for _ in range(self.count)]
        for index, (base, n) in enumerate(zip(bases, self.sizes, strict=True)):
            n = min(n, self.total - base)  # nothing past the stream's last tensor byte
            pos = 0
            while pos < n:
                i = (base + pos) // chunk_bytes
                at = base + pos - i * chunk_bytes
                take = min(n - pos, chunk_bytes - at)
                self._pieces[i].append(_Piece(index, pos, pos + take, at))
                pos += take

    @classmethod
    def received(cls, schema: WeightsSchema, chunk_bytes: int) -> StreamLayout:
        """The layout of a stream received whole (a relay's copy): its chunks can be cut
        and sent again, not written from tensors."""
        self = cls.__new__(cls)
        self.chunk_bytes = chunk_bytes
        self.source_schema = schema
        self.sizes = []
        self.bases = []
        self.total = max((e.offset + e.nbytes for e in schema.entries if e.nbytes), default=0)
        self.schema = schema
        self.schema_bytes = encode_schema(schema)
        self.layout = layout_digest(self.schema_bytes)
        self.count = max(1, -(-self.total // chunk_bytes))
        self._pieces = [[] for _ in range(self.count)]
        return self

    def fits(self, flat: Flat, chunk_bytes: int) -> bool:
        """Whether this layout serves ``flat`` too (the same schema and sizes)."""
        return (
            flat.schema is self.source_schema
            and chunk_bytes == self.chunk_bytes
            and flat.sizes == self.sizes
        )

    def stretches(self, sources: Sources, lo: int, hi: int) -> list[Buffer] | None:
        """The sources' bytes that stream bytes ``[lo, hi)`` hold, in order, without the
        alignment gaps (zeros), or None if some must be cast or copied off a device
        first: what a delta's digests read without writing the stream."""
        if isinstance(sources, DeviceReader):
            return None
        out: list[Buffer] = []
        bases, sizes = self.bases, self.sizes
        for b in range(max(0, bisect.bisect_right(bases, lo) - 1), len(bases)):
            start = bases[b]
            if start >= hi:
                break
            end = start + sizes[b]
            if end <= lo:
                continue
            source = sources[b]
            if not isinstance(source, np.ndarray):
                return None
            out.append(source[max(lo, start) - start : min(hi, end) - start].data)
        return out

    def span(self, index: int) -> tuple[int, int]:
        """Chunk ``index``'s ``(offset, length)`` in the stream."""
        offset = index * self.chunk_bytes
        return offset, min(self.chunk_bytes, self.total - offset)

    def sources(self, flat: Flat) -> Sources:
        """What :meth:`write` reads: a Flat's buffers as numpy byte arrays, or a
        :class:`DeviceReader` of them if they are on an accelerator."""
        if flat.on_device:
            return DeviceReader(self, flat.buffers, flat.casts)
        return [
            _Cast(b, flat.casts[i]) if i in flat.casts else np.frombuffer(b, dtype=np.uint8)
            for i, b in enumerate(flat.buffers)
        ]

    def pieces(self, index: int) -> list[_Piece]:
        return self._pieces[index]

    def write(self, index: int, sources: Sources, out: np.ndarray) -> None:
        """Fill ``out`` (at least the chunk's length) with chunk ``index``'s bytes.

        Alignment gaps between buffers are zeroed: a reused buffer never sends stale bytes.
        """
        _, length = self.span(index)
        if isinstance(sources, DeviceReader):
            sources.write(index, out[:length])
            return
        pos = 0
        for p in self._pieces[index]:
            if p.at > pos:
                out[pos : p.at] = 0
            source = sources[p.buffer]
            if isinstance(source, _Cast):
                source.write(p.start, p.stop, out[p.at : p.at + p.stop - p.start])
            else:
                np.copyto(out[p.at : p.at + p.stop - p.start], source[p.start : p.stop])
            pos = p.at + p.stop - p.start
        if length > pos:
            out[pos:length] = 0


class _Cast:
    """A buffer cast for the wire as it is read (``wire_dtype``): the tensor's elements."""

    def __init__(self, tensor: torch.Tensor, wire: torch.dtype) -> None:
        self.tensor = tensor  # flat, the tensor's own dtype
        self.wire = wire

    def write(self, start: int, stop: int, out: Any) -> None:
        """Wire bytes ``[start, stop)`` of the buffer, cast, into ``out``."""
        size = self.wire.itemsize
        if start % size or stop % size:
            raise ValueError(f"chunk_bytes must be a multiple of {size} to cast to {self.wire}")
        target = out if isinstance(out, torch.Tensor) else torch.from_numpy(out)
        source = self.tensor[start // size : stop // size]
        with torch.no_grad():
            if source.device.type != "cpu":  # on the device, then one copy to the host
                target.view(self.wire).copy_(source, non_blocking=target.is_pinned())
                return
            dests: list[torch.Tensor] = []
            sources: list[torch.Tensor] = []
            serial_pieces(target.view(self.wire), source, dests, sources)
            torch._foreach_copy_(dests, sources)


class DeviceReader:
    """Reads a stream's chunks out of tensors on an accelerator, through two chunk-sized
    host buffers: chunk i+1 is copied device-to-host while chunk i is sent.

    On CUDA the buffers are pinned and the copies run on a stream of their own (which
    first waits for the work already queued, such as an optimizer step); elsewhere they
    are plain copies. Either way the learner's extra memory is two chunks, whatever the
    model's size. Any tensor works (CPU ones too), so the mapping is the same everywhere.
    """

    def __init__(
        self,
        layout: StreamLayout,
        buffers: list[torch.Tensor],
        casts: Mapping[int, torch.dtype] | None = None,
    ) -> None:
        self.layout = layout
        self._buffers: list[torch.Tensor | _Cast] = [
            _Cast(b, casts[i]) if casts and i in casts else b for i, b in enumerate(buffers)
        ]
        devices = {b.device for b in buffers if b.device.type == "cuda"}  # cast ones too
        self._device = next(iter(devices)) if len(devices) == 1 else None
        self._stream: Any = None
        if self._device is not None and torch.cuda.is_available():
            self._stream = torch.cuda.Stream(self._device)
            self._stream.wait_stream(torch.cuda.current_stream(self._device))
        elif devices:  # several GPUs: each copy waits for its own device
            for device in devices:
                torch.cuda.current_stream(device).synchronize()
        self._slots: list[torch.Tensor] = []
        self._arrays: list[np.ndarray] = []
        #: Per slot: the chunk it holds, and the event its copy ends with (None: done).
        self._held: list[tuple[int, Any]] = []

    def _slot_for(self, index: int) -> int:
        """The slot chunk ``index`` goes in, made on first use."""
        if not self._slots:
            pin = self._stream is not None
            n = min(self.layout.chunk_bytes, self.layout.total)
            for _ in range(2 if self.layout.count > 1 else 1):
                slot = torch.empty(n, dtype=torch.uint8, pin_memory=pin)
                self._slots.append(slot)
                self._arrays.append(slot.numpy())
                self._held.append((-1, None))
        return index % len(self._slots)

    def _issue(self, index: int) -> None:
        """Start copying chunk ``index`` into its slot."""
        s = self._slot_for(index)
        self._wait(s)
        slot = self._slots[s]
        with torch.no_grad():
            if self._stream is None:
                self._copy(index, slot)
                self._held[s] = (index, None)
                return
            with torch.cuda.stream(self._stream):
                self._copy(index, slot)
                event = torch.cuda.Event()
                event.record(self._stream)
        self._held[s] = (index, event)

    def _copy(self, index: int, slot: torch.Tensor) -> None:
        for p in self.layout.pieces(index):
            source = self._buffers[p.buffer]
            out = slot[p.at : p.at + p.stop - p.start]
            if isinstance(source, _Cast):
                source.write(p.start, p.stop, out)
            else:
                out.copy_(source[p.start : p.stop], non_blocking=slot.is_pinned())

    def _wait(self, s: int) -> None:
        index, event = self._held[s]
        if event is not None:
            event.synchronize()
            self._held[s] = (index, None)

    @property
    def nbytes(self) -> int:
        """The host memory it holds (its slots)."""
        return sum(int(s.numel()) for s in self._slots)

    def close(self) -> None:
        """Wait for the copies still running (before the tensors or slots may go)."""
        for s in range(len(self._held)):
            self._wait(s)
            self._held[s] = (-1, None)

    def write(self, index: int, out: np.ndarray) -> None:
        """Fill ``out`` (the chunk's length) with chunk ``index``, and start the next."""
        s = self._slot_for(index)
        if self._held[s][0] != index:
            self._issue(index)
        if index + 1 < self.layout.count and self._held[self._slot_for(index + 1)][0] != index + 1:
            self._issue(index + 1)  # on the device's copy engine while this one is sent
        self._wait(s)
        source = self._arrays[s]
        pos = 0
        for p in self.layout.pieces(index):
            if p.at > pos:
                out[pos : p.at] = 0
            end = p.at + p.stop - p.start
            np.copyto(out[p.at : end], source[p.at : end])
            pos = end
        if len(out) > pos:
            out[pos:] = 0
        self._held[s] = (-1, None)


#: What :meth:`StreamLayout.write` reads.
Sources = list[np.ndarray | _Cast] | DeviceReader


@dataclass(slots=True)
class _Span:
    """What one chunk (by its offset and length) writes into the target's tensors."""

    dests: list[np.ndarray]  # CPU destinations, byte arrays
    starts: list[int]  # where each one's bytes start in the chunk
    #: For many pieces: views of ``scratch`` matching ``dests``, made once.
    views: list[np.ndarray] | None = None
    #: Pieces of tensors that cannot be written through numpy (on an accelerator, or
    #: not contiguous): (entry index, start in the tensor's bytes, start in the chunk, n).
    others: list[tuple[int, int, int, int]] | None = None


class InPlace:
    """Applies a stream's chunks straight into a target's tensors (see the module).

    Building it checks that the schema fits the target (nothing is written otherwise).
    """

    def __init__(
        self, schema: WeightsSchema, target: Mapping[KeyPath, torch.Tensor], strategy: str
    ) -> None:
        check_fits(schema, target, strategy)
        self.schema = schema
        self.target = target
        self._entries = sorted(
            (e for e in schema.entries if e.nbytes and not e.wire), key=lambda e: e.offset
        )
        cast = [e for e in schema.entries if e.wire]
        #: Tensors that travel cast (``wire_dtype``): copied element-wise, cast back.
        self._cast = CastPlan(cast, target) if cast else None
        self._starts = [e.offset for e in self._entries]
        self._arrays: list[np.ndarray | None] = []
        #: Tensors numpy cannot write: (the tensor, its contiguous CPU byte buffer or its
        #: own byte view on an accelerator).
        self._special: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, e in enumerate(self._entries):
            dest = target[e.key]
            if dest.device.type == "cpu" and dest.is_contiguous():
                self._arrays.append(dest.detach().reshape(-1).view(torch.uint8).numpy())
                continue
            self._arrays.append(None)
            if dest.is_contiguous():
                self._special[i] = (dest, dest.detach().reshape(-1).view(torch.uint8))
            else:
                self._special[i] = (dest, torch.empty(e.nbytes, dtype=torch.uint8))
        self._spans: dict[tuple[int, int], _Span] = {}
        self._scratch: np.ndarray | None = None
        self._devices = sorted(
            {t.device for t, _ in self._special.values()} - {torch.device("cpu")}, key=str
        )

    def fits(self, schema: WeightsSchema, target: Mapping[KeyPath, torch.Tensor]) -> bool:
        return schema is self.schema and target is self.target

    def _span(self, offset: int, length: int) -> _Span:
        span = self._spans.get((offset, length))
        if span is not None:
            return span
        span = _Span([], [])
        for i, e, lo, hi in overlapping(self._entries, self._starts, offset, length):
            array = self._arrays[i]
            if array is None:
                if span.others is None:
                    span.others = []
                span.others.append((i, lo - e.offset, lo - offset, hi - lo))
            else:
                span.dests.append(array[lo - e.offset : hi - e.offset])
                span.starts.append(lo - offset)
        if len(span.dests) > _MANY:
            if self._scratch is None or len(self._scratch) < length:
                self._scratch = np.empty(length, dtype=np.uint8)
                for s in self._spans.values():  # views of the old scratch are stale
                    if s.views is not None:
                        s.views = self._views(s)
            span.views = self._views(span)
        if len(self._spans) < 1 << 16:  # one per chunk of the stream; bounded regardless
            self._spans[(offset, length)] = span
        return span

    def _views(self, span: _Span) -> list[np.ndarray]:
        assert self._scratch is not None
        return [
            self._scratch[s : s + d.nbytes] for s, d in zip(span.starts, span.dests, strict=True)
        ]

    def apply(self, offset: int, payload: Buffer) -> None:
        """Write the chunk that starts at stream byte ``offset`` into the tensors."""
        source = np.frombuffer(payload, dtype=np.uint8)
        span = self._span(offset, len(source))
        if span.views is not None:
            assert self._scratch is not None
            np.copyto(self._scratch[: len(source)], source)
            collections.deque(map(np.copyto, span.dests, span.views), maxlen=0)
        else:
            for dest, start in zip(span.dests, span.starts, strict=True):
                np.copyto(dest, source[start : start + dest.nbytes])
        if self._cast is not None:
            chunk = read_view(source)
            if chunk is not None:
                with torch.no_grad():
                    self._cast.apply(chunk, offset, copy=True)
        if span.others:
            with torch.no_grad():
                chunk = read_view(source)
                assert chunk is not None  # a chunk with pieces has bytes
                for i, at, start, n in span.others:
                    _, buf = self._special[i]
                    buf[at : at + n].copy_(chunk[start : start + n], non_blocking=True)

    def finish(self) -> None:
        """After the last chunk: put non-contiguous tensors in place, and wait for
        copies to accelerators (an acked version is in the tensors)."""
        with torch.no_grad():
            for dest, buf in self._special.values():
                if not dest.is_contiguous():
                    dest.copy_(buf.view(dest.dtype).reshape(dest.shape))
            if self._cast is not None:
                self._cast.finish()
        for device in self._devices:
            if device.type == "cuda":
                torch.cuda.synchronize(device)


class Staging:
    """A version's byte stream gathered in one buffer, kept and reused between versions."""

    def __init__(self) -> None:
        self._buffer: np.ndarray | None = None
        self.total = 0

    def start(self, total: int) -> None:
        """Get ready for a stream of ``total`` bytes (reusing the buffer if it fits)."""
        if self._buffer is None or len(self._buffer) != total:
            self._buffer = None  # let the old one go first: at most one is held
            self._buffer = np.empty(total, dtype=np.uint8)
        self.total = total

    def write(self, offset: int, payload: Buffer) -> None:
        assert self._buffer is not None
        source = np.frombuffer(payload, dtype=np.uint8)
        np.copyto(self._buffer[offset : offset + len(source)], source)

    def weights(self, model_id: str, version: int, epoch: int, schema: WeightsSchema) -> Weights:
        """The gathered version (its one buffer is this staging's memory)."""
        assert self._buffer is not None
        return Weights(model_id, version, epoch, schema, (self._buffer.data,))

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else len(self._buffer)

    @property
    def array(self) -> np.ndarray:
        assert self._buffer is not None
        return self._buffer

    def release(self) -> None:
        self._buffer = None

    def detach(self) -> None:
        """Go on in a copy of the buffer: the one held so far is someone else's now (a
        relay's snapshot that a repair may still be reading)."""
        if self._buffer is not None:
            self._buffer = self._buffer.copy()


class SinkFeed:
    """For a receiver with a sink: which of a version's tensors the stream's first bytes
    complete, each as ``(dotted name, tensor)`` viewing the staging buffer (cast back to
    its own dtype if it travelled cast)."""

    def __init__(self, schema: WeightsSchema) -> None:
        self.schema = schema
        self._order = sorted(schema.entries, key=lambda e: (e.offset + e.nbytes, e.offset))
        self._ends = [e.offset + e.nbytes for e in self._order]
        self._names = [".".join(e.key) for e in self._order]
        self._next = 0

    def start(self) -> None:
        self._next = 0

    def ready(
        self, staging: Staging, received: int, delta: list[tuple[int, int]] | None = None
    ) -> list[tuple[str, torch.Tensor]]:
        """The tensors that the stream's first ``received`` bytes complete, not yet given.

        ``delta``: the version is a delta patched onto the staging buffer, which carried
        these ``(offset, length)`` stretches so far: only the tensors they touch are given.
        """
        stop = bisect.bisect_right(self._ends, received)
        data = staging.array
        out = []
        starts = [o for o, _ in delta] if delta is not None else []
        for i in range(self._next, stop):
            e = self._order[i]
            if delta is not None:
                # The last stretch starting before the tensor's end touches it, or none.
                j = bisect.bisect_left(starts, e.offset + e.nbytes) - 1
                if j < 0 or sum(delta[j]) <= e.offset or not e.nbytes:
                    continue
            raw = torch.from_numpy(data[e.offset : e.offset + e.nbytes])
            t = raw.view(torch_dtype(e.wire or e.dtype))
            if e.wire:
                t = t.to(torch_dtype(e.dtype))
            out.append((self._names[i], t.view(e.shape)))
        self._next = max(self._next, stop)
        return out


class DeltaTracker:
    """Which blocks of a layout's stream changed in which version (``delta=True``).

    :meth:`record` takes each version's stream, whole, in the order versions are made:
    a block whose digest (XXH3-128 of its bytes) differs from the one recorded before is
    marked as changed in that version. :meth:`spans` then says which stretches a worker
    that holds version ``base`` lacks: every block changed after ``base``. Digests, not
    a copy of the previous version, so that it costs no memory the size of the model: a
    128-bit hash of the block's bytes (its chance of missing a change is 2^-128).
    """

    def __init__(self, layout: StreamLayout, block: int = DELTA_BLOCK) -> None:
        self.layout = layout
        self.block = block
        n = max(1, -(-layout.total // block))
        self._digests: list[bytes] = [b""] * n
        self._changed = np.zeros(n, dtype=np.int64)
        #: The first version recorded: a delta against an older one is not known.
        self.since: int | None = None
        self.latest = -1

    def record(self, version: int, read: Callable[[int, int], Iterable[Buffer]]) -> int:
        """Take ``version``'s whole stream, whose bytes ``[lo, hi)`` are ``read(lo, hi)``
        (in parts); returns how many blocks it changed."""
        if version < self.latest:
            raise ValueError(f"version {version} recorded after {self.latest}")
        again = version == self.latest  # its weights changed under the same number
        block, digests, changed = self.block, self._digests, 0
        total = self.layout.total
        for k in range(len(digests)):
            hasher = xxhash.xxh3_128()
            for part in read(k * block, min((k + 1) * block, total)):
                hasher.update(part)
            d = hasher.digest()
            if d != digests[k]:
                digests[k] = d
                self._changed[k] = version
                changed += 1
        if self.since is None or again:
            # Workers may hold either weights of a version recorded twice: no delta
            # against it is known.
            self.since = version + 1 if again else version
        self.latest = version
        return changed

    def chunks_changed(self, version: int) -> list[int]:
        """The chunks of the layout that hold a block ``version`` changed."""
        per = self.layout.chunk_bytes
        out: set[int] = set()
        for k in np.flatnonzero(self._changed == version).tolist():
            lo, hi = k * self.block, min((k + 1) * self.block, self.layout.total)
            out.update(range(lo // per, max(lo, hi - 1) // per + 1))
        return sorted(out)

    def spans(self, base: int, max_bytes: int) -> list[tuple[int, int]] | None:
        """``(offset, length)`` stretches, each at most ``max_bytes``, holding every block
        changed after ``base`` (at least one stretch, maybe empty); None if a delta
        against ``base`` is unknown or not worth it (see :data:`DELTA_MAX_SHARE`)."""
        if self.since is None or not self.since <= base <= self.latest:
            return None
        total, block = self.layout.total, self.block
        changed = np.flatnonzero(self._changed > base)
        if len(changed) * block > DELTA_MAX_SHARE * max(total, 1):
            return None
        spans: list[tuple[int, int]] = []
        if len(changed):
            # Runs of consecutive blocks, each cut into stretches of at most max_bytes.
            breaks = np.flatnonzero(np.diff(changed) != 1) + 1
            for run in np.split(changed, breaks):
                start = int(run[0]) * block
                stop = min((int(run[-1]) + 1) * block, total)
                for at in range(start, stop, max_bytes):
                    spans.append((at, min(max_bytes, stop - at)))
        return spans or [(0, 0)]  # nothing changed: one empty chunk carries the version


def version_messages(
    weights: Any,
    *,
    model_id: str = "policy",
    version: int = 1,
    epoch: int = 1,
    strategy: str = "state_dict",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> list[list[Buffer]]:
    """One version of ``weights`` (a module, TensorDict or dict of tensors) as the chunk
    messages a sender sends, each ready for a transport's ``send_frames`` (tests, tools)."""
    flat = Flattener(strategy).flatten(extract(weights, strategy))
    layout = StreamLayout(flat, chunk_bytes)
    data = np.empty(layout.total, dtype=np.uint8)
    sources = layout.sources(flat)
    messages = []
    for i in range(layout.count):
        offset, length = layout.span(i)
        layout.write(i, sources, data[offset : offset + length])
        chunk = Chunk(
            model_id,
            version,
            epoch,
            i,
            layout.count,
            offset,
            layout.total,
            layout.layout,
            data[offset : offset + length].tobytes(),
        )
        messages.append(encode(chunk, schema_bytes=layout.schema_bytes if i == 0 else None))
    return messages
