"""A version made of parts (a sharded learner's ranks, each sending its own boxes of the
global tensors), gathered into one whole stream, without torch.

:func:`assemble` checks once per set of part layouts that the parts make whole tensors
(one dtype and global shape per tensor, boxes that tile it exactly) and lays the whole
version out as a plain stream; :class:`PartGather` follows one stream per part, writes
each chunk's box bytes at their strided places in that stream's buffer, and once every
part is in hands it on as one whole chunk, which a receiver applies as any version.

A part may come as a delta (a rank's ``delta=True``: the stretches of its own stream that
changed since a version the worker holds; a rank whose part did not change sends one
empty chunk). The gather takes it only where the whole version it last gave on is still
what the receiver holds, in its buffer or in the model's tensors: the stretches are kept
aside until every part is in, then patched over that version, so that the patched
version is given on whole or not at all.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

import numpy as np

from zmqsync.chunking.layout import STREAM_ALIGN
from zmqsync.chunking.staging import Staging
from zmqsync.errors import FrameError
from zmqsync.protocol import (
    DTYPE_ITEMSIZE,
    Buffer,
    Chunk,
    TensorEntry,
    WeightsSchema,
    encode_schema,
)
from zmqsync.protocol.codec import layout_digest
from zmqsync.protocol.stream import Apply, Broken, ChunkStream, Start

__all__ = [
    "Assembly",
    "GatherEvent",
    "Held",
    "Lost",
    "PartGather",
    "Place",
    "Placed",
    "Refused",
    "Skipped",
    "Torn",
    "Whole",
    "assemble",
]

#: Part layouts whose assembly a gather remembers (one per set of layouts seen lately).
_ASSEMBLIES: Final = 4


@dataclass(frozen=True, slots=True)
class _Copy:
    """One part entry's box, written into the whole stream."""

    source: int  # where its bytes start in the part's stream
    nbytes: int
    shape: tuple[int, ...]  # the box's
    offsets: tuple[int, ...]
    whole: tuple[int, ...]  # the global tensor's shape
    index: int  # the global tensor's, among the whole version's entries
    itemsize: int


@dataclass(frozen=True, slots=True)
class Assembly:
    """How ``parts`` (one schema per part, in part order) make one whole version:
    ``schema``, a plain layout of the whole tensors, and per part the boxes to copy
    (sorted by where they start in the part's stream)."""

    parts: tuple[WeightsSchema, ...]
    schema: WeightsSchema
    schema_bytes: bytes
    layout: bytes
    total: int
    copies: tuple[tuple[_Copy, ...], ...] = field(repr=False)
    starts: tuple[tuple[int, ...], ...] = field(repr=False)

    def views(self, out: np.ndarray) -> list[np.ndarray]:
        """Each global tensor's bytes in ``out``, the whole stream, shaped as the tensor
        with one more dimension for its elements' bytes: what :meth:`write` writes."""
        return [
            out[e.offset : e.offset + e.nbytes].reshape(*e.shape, DTYPE_ITEMSIZE[e.wire or e.dtype])
            for e in self.schema.entries
        ]

    def write(self, part: int, offset: int, payload: Buffer, tensors: Sequence[np.ndarray]) -> None:
        """Write bytes ``[offset, offset + len(payload))`` of part ``part``'s stream into
        ``tensors`` (the global tensors' bytes, as :meth:`views` shapes them): each box's
        bytes at their strided place (a box may begin or end in the middle of
        ``payload``, or span it)."""
        data = np.frombuffer(payload, dtype=np.uint8)
        end = offset + len(data)
        copies, starts = self.copies[part], self.starts[part]
        i = max(0, bisect.bisect_right(starts, offset) - 1)
        while i < len(copies) and copies[i].source < end:
            c = copies[i]
            i += 1
            lo, hi = max(c.source, offset), min(c.source + c.nbytes, end)
            if lo >= hi:
                continue
            box = tuple(slice(o, o + n) for o, n in zip(c.offsets, c.shape, strict=True))
            dest = tensors[c.index][box]
            _write_range(dest, data[lo - offset : hi - offset], lo - c.source, hi - c.source)


def _write_range(dest: np.ndarray, src: np.ndarray, lo: int, hi: int) -> None:
    """Elements ``[lo, hi)`` of ``dest`` in C order (a strided view) from ``src``: a
    partial row at each end, recursively, and the whole rows between in one copy."""
    if dest.ndim == 1:
        dest[lo:hi] = src
        return
    row = math.prod(dest.shape[1:])
    first, head = divmod(lo, row)
    last, tail = divmod(hi, row)
    if first == last:
        _write_range(dest[first], src, head, tail)
        return
    pos = 0
    if head:
        _write_range(dest[first], src[: row - head], head, row)
        pos, first = row - head, first + 1
    if last > first:
        n = (last - first) * row
        dest[first:last] = src[pos : pos + n].reshape(dest[first:last].shape)
        pos += n
    if tail:
        _write_range(dest[last], src[pos:], 0, tail)


def _aligned(n: int) -> int:
    return -(-n // STREAM_ALIGN) * STREAM_ALIGN


def assemble(parts: Sequence[WeightsSchema]) -> Assembly:
    """The assembly of ``parts`` (part ``i`` at index ``i``), or :class:`FrameError`
    saying why they do not make one whole version."""
    if not parts:
        raise FrameError("a version of no parts")
    strategy = parts[0].strategy
    tensors: dict[tuple[str, ...], tuple[str, str, tuple[int, ...]]] = {}
    boxes: dict[tuple[str, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for i, schema in enumerate(parts):
        if (schema.part, schema.parts) != (i, len(parts)) or schema.strategy != strategy:
            raise FrameError(
                f"part {schema.part} of {schema.parts} ({schema.strategy}) does not belong "
                f"at {i} of {len(parts)} ({strategy})"
            )
        for e in schema.entries:
            whole = e.box.shape if e.box is not None else e.shape
            offsets = e.box.offsets if e.box is not None else (0,) * len(e.shape)
            kind = (e.dtype, e.wire, whole)
            if tensors.setdefault(e.key, kind) != kind:
                raise FrameError(
                    f"tensor {e.dotted_key!r} is {kind} in part {i} but {tensors[e.key]} before"
                )
            boxes.setdefault(e.key, []).append((e.shape, offsets))
    for key, held in boxes.items():
        _check_tiling(".".join(key), tensors[key][2], held)
    entries: list[TensorEntry] = []
    where: dict[tuple[str, ...], int] = {}  # each tensor's index among the entries
    pos = 0
    for key, (dtype, wire, whole) in tensors.items():
        itemsize = DTYPE_ITEMSIZE[wire or dtype]
        nbytes = math.prod(whole) * itemsize
        pos = _aligned(pos)
        where[key] = len(entries)
        entries.append(TensorEntry(key, dtype, whole, 0, pos, nbytes, wire))
        pos += nbytes
    schema = WeightsSchema(strategy, tuple(entries))
    schema_bytes = encode_schema(schema)
    total = max((e.offset + e.nbytes for e in entries if e.nbytes), default=0)
    copies = tuple(
        sorted(
            (
                _Copy(
                    e.offset,
                    e.nbytes,
                    e.shape,
                    e.box.offsets if e.box is not None else (0,) * len(e.shape),
                    tensors[e.key][2],
                    where[e.key],
                    DTYPE_ITEMSIZE[e.wire or e.dtype],
                )
                for e in part.entries
                if e.nbytes
            ),
            key=lambda c: c.source,
        )
        for part in parts
    )
    starts = tuple(tuple(c.source for c in part) for part in copies)
    return Assembly(
        tuple(parts),
        schema,
        schema_bytes,
        layout_digest(schema_bytes),
        total,
        tuple(tuple(c) for c in copies),
        starts,
    )


def _check_tiling(
    name: str,
    whole: tuple[int, ...],
    held: list[tuple[tuple[int, ...], tuple[int, ...]]],
) -> None:
    """Refuse boxes that overlap, or leave some of the global tensor out."""
    if sum(math.prod(shape) for shape, _ in held) != math.prod(whole):
        raise FrameError(f"tensor {name!r}: its parts' boxes do not cover its shape {whole}")
    boxes = [(shape, offsets) for shape, offsets in held if math.prod(shape)]
    for (sa, oa), (sb, ob) in itertools.combinations(boxes, 2):
        if all(
            a0 < b0 + nb and b0 < a0 + na for a0, na, b0, nb in zip(oa, sa, ob, sb, strict=True)
        ):
            raise FrameError(f"tensor {name!r}: two parts' boxes overlap")


@dataclass(frozen=True, slots=True)
class Whole:
    """Every part of a version came: ``chunk`` is the whole version, as one chunk
    (``delta``: some parts came as deltas, patched over the version held)."""

    chunk: Chunk
    delta: bool = False


@dataclass(frozen=True, slots=True)
class Held:
    """Part ``part`` is of a version the receiver holds already: ack it to that part."""

    part: int


@dataclass(frozen=True, slots=True)
class Refused:
    """The parts of ``version`` do not make a whole version: refuse it, for ``reason``."""

    epoch: int
    version: int
    reason: str


@dataclass(frozen=True, slots=True)
class Lost:
    """Part ``part``'s stream broke (or never started): ask that part for it again."""

    part: int
    reason: str


@dataclass(frozen=True, slots=True)
class Placed:
    """Every part of a version was written in place (see :class:`PartGather`'s
    ``place``): ``chunk`` names it (its whole layout and schema; no bytes)."""

    chunk: Chunk
    delta: bool = False


@dataclass(frozen=True, slots=True)
class Skipped:
    """Part ``part`` came as a delta this worker cannot apply (it does not hold the
    version the delta patches, whole, where the gather can patch it): ask that part for
    the whole of it."""

    part: int
    reason: str


@dataclass(frozen=True, slots=True)
class Torn:
    """A version written in place will not complete (a part broke, a newer version
    began): the tensors hold parts of two versions. Ask every part for it again."""

    epoch: int
    version: int
    reason: str


GatherEvent = Whole | Held | Refused | Lost | Placed | Torn | Skipped

#: Where a version's global tensors are written, given its assembly: their bytes (as
#: :meth:`Assembly.views` shapes them), or None for the gather's own buffer.
Place = Callable[[Assembly], Sequence[np.ndarray] | None]


@dataclass(frozen=True, slots=True)
class _Kept:
    """The whole version a gather gave on last, which a delta may be patched over: in
    the gather's buffer (``buffered``), or written in place in the model's tensors."""

    key: tuple[int, int]  # (epoch, version)
    layouts: tuple[bytes, ...]  # its parts' layouts
    buffered: bool


class _Patches:
    """The stretches of each delta part of the version gathered, kept aside until every
    part is in and then patched over the version held all at once: a delta that breaks
    off leaves that version as it was. Bounded by the parts' streams (the codec keeps
    each chunk within its stream's total, and a delta's stretches come in order)."""

    def __init__(self, parts: int) -> None:
        #: Per part: its stretches so far, or None if it is not (yet) a delta.
        self._spans: list[list[tuple[int, bytes]] | None] = [None] * parts

    def start(self, part: int, delta: bool) -> None:
        """Part ``part`` begins (anew): as a delta, or whole."""
        self._spans[part] = [] if delta else None

    def is_delta(self, part: int) -> bool:
        return self._spans[part] is not None

    def any(self) -> bool:
        """Whether some part of the version came as a delta."""
        return any(s is not None for s in self._spans)

    def add(self, part: int, offset: int, payload: Buffer) -> None:
        """Keep a copy of a delta chunk's bytes (the transport may reuse its memory)."""
        spans = self._spans[part]
        assert spans is not None
        if len(payload):
            spans.append((offset, bytes(payload)))

    def write(self, assembly: Assembly, targets: Sequence[np.ndarray]) -> None:
        """Patch every delta part's stretches into ``targets`` (the version held)."""
        for part, spans in enumerate(self._spans):
            for offset, payload in spans or ():
                assembly.write(part, offset, payload, targets)

    def clear(self) -> None:
        self._spans = [None] * len(self._spans)


class PartGather:
    """The version a receiver gathers from ``parts`` streams, one per part (sans-IO).

    Each part's chunks are followed by a :class:`ChunkStream` of its own. Once every
    part's first chunk came (each carries its part's schema), the whole version's layout
    is known and each chunk's boxes are written straight into the whole stream's buffer;
    what came before that waits in a buffer of its part. When the last part is in, the
    whole stream is given on as one chunk. A part of a newer version drops the parts of
    an older one gathered so far; parts of two versions are never given on together.

    ``place``: asked once a version's layout is known where to write its tensors; it
    may give the model's own (the version is then written in place, and ends
    :class:`Placed`, or :class:`Torn` if it breaks off: it is then dropped whole).

    A part that comes as a delta is taken only if the version it patches is the one the
    receiver holds and the gather gave on last (still whole in its buffer, or in the
    model's tensors); else it is :class:`Skipped` (asked for whole). Its stretches are
    patched in once every part is in (see :class:`_Patches`).
    """

    def __init__(self, parts: int, gap: float, place: Place | None = None) -> None:
        self.parts = parts
        self._place = place
        #: Where the current version's tensors are written, once its layout is known;
        #: whether they are someone else's (in place).
        self._targets: Sequence[np.ndarray] = ()
        self._in_place = False
        self._streams = [ChunkStream(gap) for _ in range(parts)]
        self._early = [Staging() for _ in range(parts)]  # chunks before the layout
        self._received = [0] * parts  # bytes of each part in its early buffer
        self._schemas: list[WeightsSchema | None] = [None] * parts
        self._layouts = [b""] * parts
        self._done = [False] * parts
        self._first: Chunk | None = None  # part 0's first chunk: its metadata
        #: (epoch, version) gathered now, or None.
        self.current: tuple[int, int] | None = None
        self._assembly: Assembly | None = None  # the current version's, once known
        self._whole = Staging()
        self._assemblies: dict[tuple[bytes, ...], Assembly] = {}
        #: The version a delta may be patched over, if any (see :class:`_Kept`); whether
        #: the version gathered now is laid out over it in the buffer.
        self._kept: _Kept | None = None
        self._over_kept = False
        self._patches = _Patches(parts)
        #: Which parts wrote whole bytes into the targets in the version gathered now.
        self._wrote = [False] * parts
        #: The version laid out now, all deltas so far: where it is written is asked
        #: for once the last part is in (or a part comes whole).
        self._targets_due = False

    @property
    def active(self) -> bool:
        """Whether some part of a version is in and the version is not complete."""
        return self.current is not None

    def waiting(self) -> tuple[int, tuple[int, ...]]:
        """The version gathered now (0: none) and the parts of it not in yet."""
        if self.current is None:
            return 0, ()
        return self.current[1], tuple(p for p, done in enumerate(self._done) if not done)

    def feed(
        self, part: int, chunk: Chunk, now: float, held: tuple[int, int], whole: bool = False
    ) -> list[GatherEvent]:
        """What to do with ``chunk``, from part ``part``'s stream. ``held``: the
        receiver's (epoch, version); ``whole``: it takes a version it holds (a repair)."""
        events: list[GatherEvent] = []
        wanted = True
        if chunk.first:
            key = (chunk.epoch, chunk.version)
            schema = chunk.schema
            if schema is None or (schema.part, schema.parts) != (part, self.parts):
                got = "?" if schema is None else f"{schema.part} of {schema.parts}"
                raise FrameError(f"part {got} came on the stream of part {part} of {self.parts}")
            if key[0] == held[0] and key[1] <= held[1] and not (whole and key[1] == held[1]):
                wanted = False
                events.append(Held(part))
            elif self.current is not None and key[0] == self.current[0] and key < self.current:
                wanted = False  # older than the version gathered
            elif key == self.current and self._done[part]:
                wanted = False  # sent again (a repair): the part is in already
            elif chunk.base is not None and (why := self._unpatchable(part, chunk, held, whole)):
                wanted = False  # never a wrong version: the whole part is asked for
                events.append(Skipped(part, why))
            elif key != self.current or (
                self._assembly is not None and chunk.layout != self._layouts[part]
            ):
                if self._in_place and self.current is not None:
                    events.append(Torn(*self.current, f"version {key[1]} began"))
                self._reset(key)
        stream = self._streams[part]
        for event in stream.feed(chunk, now, wanted):
            if isinstance(event, Start):
                self._started(part, event.chunk, event.schema, events)
            elif isinstance(event, Apply) and self.current is not None:
                c = event.chunk
                if self._patches.is_delta(part):
                    self._patches.add(part, c.offset, c.payload)
                elif self._targets_due and not self._resolve(events):
                    break  # a whole part again, where the deltas cannot be patched
                elif self._assembly is not None:
                    self._wrote[part] = True
                    self._assembly.write(part, c.offset, c.payload, self._targets)
                else:
                    early = self._early[part]
                    if not self._received[part]:
                        early.start(c.total)
                    early.write(c.offset, c.payload)
                    self._received[part] = c.offset + len(c.payload)
                if c.last:
                    self._done[part] = True
                    events.extend(self._complete())
            elif isinstance(event, Broken) and (event.epoch, event.version) == self.current:
                events.append(self._lost(part, event.reason))
        return events

    def _unpatchable(self, part: int, chunk: Chunk, held: tuple[int, int], whole: bool) -> str:
        """Why the delta part ``chunk`` starts cannot be patched over the version held
        ("" if it can)."""
        assert chunk.base is not None
        kept = self._kept
        if whole:
            return "this worker takes whole versions only now (its model is torn)"
        if chunk.epoch != held[0] or not chunk.base <= held[1] < chunk.version:
            return f"it is against version {chunk.base}; this worker holds {held[1]}"
        if kept is None or kept.key != held:
            return "the version held is not whole where the parts are gathered"
        if chunk.layout != kept.layouts[part]:
            return "its layout is not the one of the version held"
        if (chunk.epoch, chunk.version) == self.current:
            if self._wrote[part] or (self._assembly is not None and not self._patching):
                return "the version is being gathered whole"
        elif self._in_place or (self._over_kept and any(self._wrote)):
            # The version under way has written over the version held (in the model:
            # it would be torn), which the delta's other parts could not be patched on.
            return "the version held is being written over"
        return ""

    @property
    def _patching(self) -> bool:
        """Whether the version laid out now is over the version held (its targets hold
        it, where no whole part wrote, or are still to be asked for): a delta part can
        be patched into them."""
        return self._targets_due or self._in_place or self._over_kept

    def _lost(self, part: int, reason: str) -> GatherEvent:
        """Part ``part`` of the current version broke off: asked for again, or, written
        in place, the whole version is dropped and the tensors are torn."""
        if not self._in_place or self.current is None:
            return Lost(part, reason)
        epoch, version = self.current
        for stream in self._streams:
            stream.abandon(reason)
        self._reset(self.current)
        self.current = None
        return Torn(epoch, version, f"part {part}: {reason}")

    def ready(self, part: int, now: float) -> None:
        """The receiver handled part ``part``'s last chunk: the gap to its next one
        counts from ``now`` (see :meth:`ChunkStream.ready`)."""
        self._streams[part].ready(now)

    def expire(self, now: float) -> list[GatherEvent]:
        """The parts whose next chunk is overdue: lost."""
        out: list[GatherEvent] = []
        for part, stream in enumerate(self._streams):
            broken = stream.expire(now)
            if broken is not None and (broken.epoch, broken.version) == self.current:
                out.append(self._lost(part, broken.reason))
        return out

    def _reset(self, key: tuple[int, int]) -> None:
        """Gather ``key`` from now on: the parts of another version are let go."""
        for stream in self._streams:
            stream.abandon(f"version {key[1]} (epoch {key[0]:#x}) began")
        self._done = [False] * self.parts
        self._schemas = [None] * self.parts
        self._layouts = [b""] * self.parts
        self._received = [0] * self.parts
        for early in self._early:
            early.release()
        if self._over_kept and any(self._wrote):
            self._kept = None  # the buffer holds parts of two versions now
        self._first = None
        self._assembly = None
        self._targets, self._in_place, self._over_kept = (), False, False
        self._targets_due = False
        self._patches.clear()
        self._wrote = [False] * self.parts
        self.current = key

    def _started(
        self, part: int, chunk: Chunk, schema: WeightsSchema, events: list[GatherEvent]
    ) -> None:
        """Part ``part`` of the current version begins (anew, if it broke before)."""
        self._schemas[part] = schema
        self._layouts[part] = chunk.layout
        self._done[part] = False
        self._received[part] = 0
        self._patches.start(part, chunk.base is not None)
        if part == 0:
            self._first = chunk
        if self._assembly is None and all(s is not None for s in self._schemas):
            self._lay_out(events)

    def _lay_out(self, events: list[GatherEvent]) -> None:
        """Every part's schema came: lay the whole version out, and write what came of
        each part so far into it."""
        assert self.current is not None
        key = tuple(self._layouts)
        assembly = self._assemblies.get(key)
        if assembly is None:
            try:
                assembly = assemble([s for s in self._schemas if s is not None])
            except FrameError as exc:
                epoch, version = self.current
                for stream in self._streams:
                    stream.abandon("refused")
                self._reset(self.current)
                self.current = None
                events.append(Refused(epoch, version, str(exc)))
                return
            if len(self._assemblies) >= _ASSEMBLIES:
                self._assemblies.pop(next(iter(self._assemblies)))
            self._assemblies[key] = assembly
        self._assembly = assembly
        if all(self._patches.is_delta(p) for p in range(self.parts)):
            # Only deltas so far: nothing is written before the last part is in, so the
            # targets are asked for then (a model written in place stays whole, and
            # unlocked, while the deltas come).
            self._targets_due = True
            return
        self._resolve(events)

    def _resolve(self, events: list[GatherEvent]) -> bool:
        """Where the version laid out now is written (the model's tensors, if ``place``
        gives them, else the gather's buffer, over the version kept there if it can),
        and what came of each part so far written there. False if the version's deltas
        cannot be patched there (every part is then asked for again, whole)."""
        assembly, key = self._assembly, tuple(self._layouts)
        assert assembly is not None and self.current is not None
        self._targets_due = False
        targets = None if self._place is None else self._place(assembly)
        self._in_place = targets is not None
        if targets is None:
            kept = self._kept
            self._over_kept = kept is not None and kept.buffered and kept.layouts == key
            if not self._over_kept:
                self._kept = None  # written over from here
                self._whole.start(assembly.total)
            targets = assembly.views(self._whole.array)
        elif self._kept is not None and self._kept.buffered:
            self._kept = None  # the model's tensors are the targets: not the buffer
        self._targets = targets
        if self._patches.any() and not self._patching:
            # The version a delta patches is nowhere to be patched: every part again,
            # whole (never a wrong version). (``place`` gave no targets, so nothing
            # holds the model's lock.)
            for stream in self._streams:
                stream.abandon("refused")
            self._reset(self.current)
            self.current = None
            why = "the version held is not where the parts are gathered"
            events.extend(Skipped(p, why) for p in range(self.parts))
            return False
        for part, early in enumerate(self._early):
            if self._received[part]:
                self._wrote[part] = True
                assembly.write(part, 0, early.array[: self._received[part]].data, targets)
            early.release()
        return True

    def _complete(self) -> list[GatherEvent]:
        if not all(self._done) or self._assembly is None:
            return []
        events: list[GatherEvent] = []
        if self._targets_due and not self._resolve(events):
            return events
        assert self.current is not None
        epoch, version = self.current
        assembly, in_place = self._assembly, self._in_place
        delta = self._patches.any()
        self._patches.write(assembly, self._targets)
        self._patches.clear()
        self.current, self._assembly = None, None
        self._targets, self._in_place, self._over_kept = (), False, False
        self._wrote = [False] * self.parts
        self._kept = _Kept((epoch, version), tuple(self._layouts), not in_place)
        first = self._first
        assert first is not None
        payload = b"" if in_place else self._whole.array.data
        chunk = Chunk(
            first.model_id,
            version,
            epoch,
            0,
            1,
            0,
            0 if in_place else assembly.total,
            assembly.layout,
            payload,
            assembly.schema,
            metadata=first.metadata,
            targets=first.targets,  # a relay forwards it to those behind it only
        )
        return [Placed(chunk, delta) if in_place else Whole(chunk, delta)]
