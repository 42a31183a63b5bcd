"""Where a version's bytes lie in its stream, and which of them each chunk carries.

A sender's flattened buffers (:class:`~zmqsync.tensors.flatten.Flat`) follow one another
in the stream, each on a 64-byte boundary; the stream's schema puts every tensor at its
stream offset. :class:`StreamLayout` works this out once per layout and fills chunks.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final, Protocol, TypeAlias, runtime_checkable

import numpy as np
import torch

from zmqsync.chunking.copier import copier
from zmqsync.protocol import Buffer, TensorEntry, WeightsSchema, encode_schema
from zmqsync.protocol.codec import layout_digest
from zmqsync.tensors.streaming import fan_out
from zmqsync.tensors.views import word_spans, word_view, word_width

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MAX_REMEMBERED_CHUNKS",
    "MIN_CHUNK_BYTES",
    "POOLED_PIECE_BYTES",
    "STREAM_ALIGN",
    "BufferReader",
    "ChunkReader",
    "Flattened",
    "Piece",
    "Sources",
    "StreamLayout",
    "overlapping",
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
#: Pieces at least this large are copied on as many threads as torch may use when a
#: chunk is written ``pooled``: where nobody copies alongside the writer (workers that
#: map each version instead of copying it), the threads take every core. Where workers
#: copy each chunk as the next is written, the threads wait for cores the workers hold,
#: and one numpy copy on the writing thread is faster (benchmarks/README.md, "Why the
#: one-host targets are missed"). Below it, the cost per piece outweighs the threads.
POOLED_PIECE_BYTES: Final = 256 * 1024
#: What a receiver remembers per stretch of a stream (views made once) is kept for at most
#: this many stretches: one per chunk of any stream, and bounded whatever comes.
MAX_REMEMBERED_CHUNKS: Final = 1 << 16


def _aligned(n: int) -> int:
    return -(-n // STREAM_ALIGN) * STREAM_ALIGN


@dataclass(frozen=True, slots=True)
class Piece:
    """A stretch of one buffer that one chunk carries."""

    buffer: int  # which of the Flat's buffers
    start: int  # first byte of that buffer
    stop: int
    at: int  # where it goes in the chunk


class BufferReader(Protocol):
    """A buffer whose stream bytes are made as they are read (cast for the wire)."""

    def write(self, start: int, stop: int, out: np.ndarray) -> None:
        """Its stream bytes ``[start, stop)`` into ``out``."""


@runtime_checkable
class InPlaceReader(BufferReader, Protocol):
    """A buffer whose bytes lie in memory as they are, in parts (small tensors)."""

    def bytes_in(self, start: int, stop: int) -> list[Buffer]:
        """Its bytes ``[start, stop)``, part by part, without a copy."""


class ChunkReader(Protocol):
    """Buffers read a whole chunk at a time (copied off an accelerator)."""

    def write(self, index: int, out: np.ndarray) -> None:
        """Chunk ``index``'s bytes into ``out`` (the chunk's length)."""


#: What :meth:`StreamLayout.write` reads: each buffer as bytes or a reader of them, or one
#: reader of whole chunks.
Sources: TypeAlias = list[np.ndarray | BufferReader] | ChunkReader


class Flattened(Protocol):
    """What a layout is worked out from: a :class:`~zmqsync.tensors.flatten.Flat`."""

    @property
    def schema(self) -> WeightsSchema: ...

    @property
    def sizes(self) -> list[int]: ...

    def sources(self, layout: StreamLayout) -> Sources: ...


class StreamLayout:
    """One layout of a Flat as a stream of ``chunk_bytes`` chunks (see the module).

    ``schema`` is the stream's: every tensor in buffer 0, at its offset in the stream.
    """

    def __init__(self, flat: Flattened, chunk_bytes: int) -> None:
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
            TensorEntry(
                e.key, e.dtype, e.shape, 0, bases[e.buffer] + e.offset, e.nbytes, e.wire, e.box
            )
            for e in flat.schema.entries
        )
        self.total = max((e.offset + e.nbytes for e in entries if e.nbytes), default=0)
        self.bases = bases
        source = flat.schema
        self.schema = WeightsSchema(source.strategy, entries, source.part, source.parts)
        self.schema_bytes = encode_schema(self.schema)
        self.layout = layout_digest(self.schema_bytes)
        self.count = max(1, -(-self.total // chunk_bytes))
        self._pieces: list[list[Piece]] = [[] for _ in range(self.count)]
        for index, (base, n) in enumerate(zip(bases, self.sizes, strict=True)):
            n = min(n, self.total - base)  # nothing past the stream's last tensor byte
            pos = 0
            while pos < n:
                i = (base + pos) // chunk_bytes
                at = base + pos - i * chunk_bytes
                take = min(n - pos, chunk_bytes - at)
                self._pieces[i].append(Piece(index, pos, pos + take, at))
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

    def fits(self, flat: Flattened, chunk_bytes: int) -> bool:
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
        if not isinstance(sources, list):
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
            if isinstance(source, np.ndarray):
                out.append(source[max(lo, start) - start : min(hi, end) - start].data)
            elif isinstance(source, InPlaceReader):
                out.extend(source.bytes_in(max(lo, start) - start, min(hi, end) - start))
            else:
                return None
        return out

    def span(self, index: int) -> tuple[int, int]:
        """Chunk ``index``'s ``(offset, length)`` in the stream."""
        offset = index * self.chunk_bytes
        return offset, min(self.chunk_bytes, self.total - offset)

    def sources(self, flat: Flattened) -> Sources:
        """What :meth:`write` reads: a Flat's buffers as numpy byte arrays, or a reader
        that copies them off the accelerator they are on (:meth:`Flattened.sources`)."""
        return flat.sources(self)

    def pieces(self, index: int) -> list[Piece]:
        return self._pieces[index]

    def write(self, index: int, sources: Sources, out: np.ndarray, pooled: bool = False) -> None:
        """Fill ``out`` (at least the chunk's length) with chunk ``index``'s bytes.

        Alignment gaps between buffers are zeroed: a reused buffer never sends stale bytes.
        ``pooled``: large pieces are copied in one call on as many threads as torch
        may use, with streaming stores where they can be
        (:func:`zmqsync.tensors.streaming.fan_out`: for a writer that nobody copies
        alongside, see :data:`POOLED_PIECE_BYTES`), else each by one numpy copy on this
        thread.
        """
        _, length = self.span(index)
        if isinstance(out, torch.Tensor):  # device memory a hub lends: device to device
            assert not isinstance(sources, list) and hasattr(sources, "write_device")
            sources.write_device(index, out[:length])
            return
        if not isinstance(sources, list):
            sources.write(index, out[:length])
            return
        pos = 0
        dests: list[torch.Tensor] = []
        froms: list[torch.Tensor] = []
        copy = copier().copy_function()  # large pieces over the copy threads, if any
        for p in self._pieces[index]:
            if p.at > pos:
                out[pos : p.at] = 0
            source = sources[p.buffer]
            into = out[p.at : p.at + p.stop - p.start]
            if not isinstance(source, np.ndarray):
                source.write(p.start, p.stop, into)
            elif pooled and p.stop - p.start >= POOLED_PIECE_BYTES and source.flags.writeable:
                dest, part = torch.from_numpy(into), torch.from_numpy(source[p.start : p.stop])
                width = word_width(*word_spans(dest), *word_spans(part))
                dests.append(word_view(dest, width))
                froms.append(word_view(part, width))
            else:
                copy(into, source[p.start : p.stop])
            pos = p.at + p.stop - p.start
        if length > pos:
            out[pos:length] = 0
        if dests:
            fan_out([[d] for d in dests], froms)


def overlapping(
    entries: list[TensorEntry], starts: list[int], offset: int, length: int
) -> Iterator[tuple[int, TensorEntry, int, int]]:
    """The entries (sorted by offset; ``starts`` their offsets) that stream bytes
    ``[offset, offset + length)`` hold part of: ``(index, entry, lo, hi)``, the bytes
    ``[lo, hi)`` of the stream they share."""
    end = offset + length
    i = max(0, bisect.bisect_right(starts, offset) - 1)
    while i < len(entries) and entries[i].offset < end:
        e = entries[i]
        lo, hi = max(e.offset, offset), min(e.offset + e.nbytes, end)
        if lo < hi:
            yield i, e, lo, hi
        i += 1
