"""Following one version's chunks as they arrive: sans-IO, like the codec.

A receiver feeds every decoded :class:`~zmqsync.protocol.messages.Chunk` to a
:class:`ChunkStream` and gets back what to do with it: start a version, apply a piece,
or give up on the version in progress because its stream broke. Which versions are worth
receiving (newer than the one held, of an epoch not left) is the caller's call:
:meth:`ChunkStream.feed` takes it as ``wanted``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from zmqsync.protocol.messages import Chunk, WeightsSchema

__all__ = ["Apply", "Broken", "ChunkStream", "Event", "Ignored", "Start"]

#: Seconds a receiver waits for the next chunk of a version in progress before it
#: calls the stream broken (a sender that died mid-version, a chunk dropped).
DEFAULT_GAP: Final = 10.0


@dataclass(frozen=True, slots=True)
class Start:
    """A new version begins: prepare to receive ``total`` bytes laid out as ``schema``."""

    chunk: Chunk
    schema: WeightsSchema


@dataclass(frozen=True, slots=True)
class Apply:
    """``chunk`` is the next piece of the version in progress (``chunk.last``: the end)."""

    chunk: Chunk


@dataclass(frozen=True, slots=True)
class Broken:
    """The version in progress will not complete: ``reason`` says why."""

    epoch: int
    version: int
    reason: str


@dataclass(frozen=True, slots=True)
class Ignored:
    """A chunk of no version in progress (its start was missed or not wanted)."""

    chunk: Chunk
    reason: str


Event = Start | Apply | Broken | Ignored


@dataclass(slots=True)
class _Progress:
    epoch: int
    version: int
    layout: bytes
    count: int
    total: int
    next_index: int
    next_offset: int
    last_seen: float
    base: int | None


class ChunkStream:
    """The version a receiver is gathering, if any, and whether its chunks follow on.

    It never looks at tensors or locks; it only checks that chunks follow each other: the
    same epoch, version, layout, count, total and base, each index once and in order,
    each starting where the previous one ended (or, in a delta, anywhere after it), none
    later than ``gap`` seconds after the previous one.
    """

    def __init__(self, gap: float = DEFAULT_GAP) -> None:
        self.gap = gap
        self._progress: _Progress | None = None

    @property
    def active(self) -> bool:
        """Whether a version is in progress (its first chunk came, its last not yet)."""
        return self._progress is not None

    @property
    def in_progress(self) -> tuple[int, int] | None:
        """``(epoch, version)`` of the version in progress, or None."""
        p = self._progress
        return None if p is None else (p.epoch, p.version)

    def feed(self, chunk: Chunk, now: float, wanted: bool = True) -> list[Event]:
        """What to do with ``chunk``. ``wanted``: whether the caller would take the
        version ``chunk`` belongs to, if it starts with it."""
        events: list[Event] = []
        p = self._progress
        if p is not None and now - p.last_seen > self.gap:
            events.append(
                self._break(f"no chunk for {now - p.last_seen:.3g}s (limit {self.gap:g}s)")
            )
            p = None
        if chunk.first:
            if p is not None:
                events.append(
                    self._break(
                        f"chunk {p.next_index} of {p.count} never came: version "
                        f"{chunk.version} (epoch {chunk.epoch:#x}) started"
                    )
                )
            if not wanted:
                events.append(Ignored(chunk, "not wanted"))
                return events
            assert chunk.schema is not None  # the codec guarantees it on a first chunk
            events.append(Start(chunk, chunk.schema))
            self._progress = _Progress(
                chunk.epoch,
                chunk.version,
                chunk.layout,
                chunk.count,
                chunk.total,
                0,
                chunk.offset,
                now,
                chunk.base,
            )
            p = self._progress
        if p is None:
            events.append(Ignored(chunk, "no version in progress"))
            return events
        if (chunk.epoch, chunk.version) != (p.epoch, p.version):
            # A chunk of another version, its start missed: the one in progress goes on
            # unless this says a newer one is under way (its first chunk was lost).
            events.append(
                self._break(
                    f"a chunk of version {chunk.version} (epoch {chunk.epoch:#x}) came in the "
                    f"middle of version {p.version}"
                )
            )
            events.append(Ignored(chunk, "its version's first chunk was missed"))
            return events
        mismatch = self._mismatch(p, chunk)
        if mismatch:
            events.append(self._break(mismatch))
            events.append(Ignored(chunk, mismatch))
            return events
        p.next_index += 1
        p.next_offset = chunk.offset + len(chunk.payload)
        p.last_seen = now
        if chunk.last:
            self._progress = None
        events.append(Apply(chunk))
        return events

    def _mismatch(self, p: _Progress, chunk: Chunk) -> str:
        if (
            chunk.layout != p.layout
            or chunk.count != p.count
            or chunk.total != p.total
            or chunk.base != p.base
        ):
            return f"chunk {chunk.index} of version {p.version} does not match its first chunk"
        if chunk.index != p.next_index:
            return f"chunk {p.next_index} of {p.count} of version {p.version} never came"
        if p.base is None and chunk.offset != p.next_offset:
            return f"chunk {chunk.index} starts at byte {chunk.offset}, not {p.next_offset}"
        if chunk.offset < p.next_offset:  # a delta's stretches come in order, apart
            return f"chunk {chunk.index} starts at byte {chunk.offset}, before {p.next_offset}"
        return ""

    def ready(self, now: float) -> None:
        """The receiver is ready for the next chunk from ``now`` on (it applied the last
        one): the gap to it counts from here."""
        if self._progress is not None:
            self._progress.last_seen = now

    def expire(self, now: float) -> Broken | None:
        """The version in progress, broken if its next chunk is overdue; else None."""
        p = self._progress
        if p is not None and now - p.last_seen > self.gap:
            return self._break(f"no chunk for {now - p.last_seen:.3g}s (limit {self.gap:g}s)")
        return None

    def abandon(self, reason: str) -> Broken | None:
        """Give up the version in progress (the receiver refused it, or closes)."""
        return self._break(reason) if self._progress is not None else None

    def _break(self, reason: str) -> Broken:
        p = self._progress
        assert p is not None
        self._progress = None
        return Broken(p.epoch, p.version, reason)
