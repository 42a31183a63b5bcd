"""Slices of a version for workers that hold one box of each tensor (tensor-parallel
inference workers), without torch.

A rank of a sharded learner cuts its part's whole stream for such a worker (:func:`cut`):
each of its boxes narrowed to where it meets the worker's slice, laid out as a stream
of its own (a part whose entries are boxes of the global tensors, as any part's are),
and nothing outside the slice. The worker rebases each part's schema onto its slices
(:func:`rebase`: each box then a box of the worker's tensor), so that the gather of the
parts (:mod:`zmqsync.chunking.parts`) checks that they tile its slices exactly and
assembles tensors of the slices' shape, as it assembles whole ones for other workers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

import numpy as np

from zmqsync.chunking.layout import STREAM_ALIGN
from zmqsync.errors import FrameError
from zmqsync.protocol import DTYPE_ITEMSIZE, Box, Chunk, Slice, TensorEntry, WeightsSchema

__all__ = ["Cut", "Rebaser", "cut", "meet", "rebase"]

#: Schemas a worker keeps rebased (by layout digest): one per rank's layout in use, and
#: a few more while a layout changes.
_REBASED: Final = 16

Key = tuple[str, ...]


def meet(
    a_offsets: tuple[int, ...],
    a_shape: tuple[int, ...],
    b_offsets: tuple[int, ...],
    b_shape: tuple[int, ...],
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Where two boxes of one tensor meet: the offsets and shape of their intersection,
    or None if it holds no element."""
    lo = tuple(max(a, b) for a, b in zip(a_offsets, b_offsets, strict=True))
    hi = tuple(
        min(a + n, b + m) for a, n, b, m in zip(a_offsets, a_shape, b_offsets, b_shape, strict=True)
    )
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi, strict=True))


def _where(e: TensorEntry) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """An entry's global tensor shape and the offsets of its box in it."""
    if e.box is None:
        return e.shape, (0,) * len(e.shape)
    return e.box.shape, e.box.offsets


def _aligned(n: int) -> int:
    return -(-n // STREAM_ALIGN) * STREAM_ALIGN


@dataclass(frozen=True, slots=True)
class Cut:
    """A part's stream cut for one worker's slices: its ``schema`` (each entry a box of
    a global tensor) and its bytes, ``data``."""

    schema: WeightsSchema
    data: np.ndarray


def cut(schema: WeightsSchema, data: np.ndarray, slices: Mapping[Key, Slice]) -> Cut:
    """The bytes of ``data`` (a whole stream laid out as ``schema``, a part's) that lie
    in ``slices``, as a stream of their own. A tensor the worker holds no slice of goes
    whole (its part's box of it); one whose global shape is not the slice's goes whole
    too, for the worker to refuse."""
    pieces: list[tuple[TensorEntry, TensorEntry, tuple[slice, ...] | None]] = []
    pos = 0
    for e in schema.entries:
        whole, offsets = _where(e)
        s = slices.get(e.key)
        index: tuple[slice, ...] | None = None
        shape, box = e.shape, e.box
        if s is not None and s.shape == whole:
            met = meet(offsets, e.shape, s.offsets, s.extent)
            if met is None:
                continue  # none of this box is in the worker's slice
            at, shape = met
            index = tuple(
                slice(a - o, a - o + n) for a, o, n in zip(at, offsets, shape, strict=True)
            )
            box = Box(whole, at)
        nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPE_ITEMSIZE[e.wire or e.dtype]
        pos = _aligned(pos)
        pieces.append((TensorEntry(e.key, e.dtype, shape, 0, pos, nbytes, e.wire, box), e, index))
        pos += nbytes
    total = max((e.offset + e.nbytes for e, _, _ in pieces if e.nbytes), default=0)
    out = np.zeros(total, dtype=np.uint8)  # alignment gaps are zeros, as in any stream
    for entry, source, index in pieces:
        if not entry.nbytes:
            continue
        src = data[source.offset : source.offset + source.nbytes]
        dest = out[entry.offset : entry.offset + entry.nbytes]
        if index is None:
            dest[:] = src
        else:
            itemsize = DTYPE_ITEMSIZE[source.wire or source.dtype]
            piece = src.reshape(*source.shape, itemsize)[index]
            dest.reshape(piece.shape)[...] = piece
    entries = tuple(e for e, _, _ in pieces)
    return Cut(WeightsSchema(schema.strategy, entries, schema.part, schema.parts), out)


def rebase(schema: WeightsSchema, slices: Mapping[Key, Slice]) -> WeightsSchema:
    """A part's ``schema`` as boxes of the worker's tensors: each entry of a sliced
    tensor a box of the slice (the gather then assembles tensors of the slice's shape).
    Raises :class:`FrameError` for an entry of another global shape than its slice's,
    or with bytes outside it: a rank that did not cut its part for this worker."""
    entries = []
    for e in schema.entries:
        s = slices.get(e.key)
        if s is None:
            entries.append(e)
            continue
        whole, offsets = _where(e)
        if whole != s.shape:
            raise FrameError(
                f"tensor {e.dotted_key!r} is of shape {whole} at the learner; this worker "
                f"holds a slice of a tensor of shape {s.shape}"
            )
        inside = meet(offsets, e.shape, s.offsets, s.extent) == (offsets, e.shape)
        if not inside and 0 not in e.shape:
            raise FrameError(
                f"tensor {e.dotted_key!r}: part {schema.part} sent a box at {offsets} of "
                f"shape {e.shape}, not inside this worker's slice at {s.offsets} of {s.extent}"
            )
        inner = tuple(o - so for o, so in zip(offsets, s.offsets, strict=True))
        entries.append(
            TensorEntry(
                e.key, e.dtype, e.shape, e.buffer, e.offset, e.nbytes, e.wire, Box(s.extent, inner)
            )
        )
    return WeightsSchema(schema.strategy, tuple(entries), schema.part, schema.parts)


class Rebaser:
    """A worker's slices, and each part's first chunk rebased onto them (:func:`rebase`),
    remembered by layout: a rank sends one layout over and over."""

    def __init__(self, slices: Mapping[Key, Slice]) -> None:
        self.slices = dict(slices)
        self._rebased: dict[bytes, WeightsSchema] = {}

    def chunk(self, chunk: Chunk) -> Chunk:
        """``chunk`` with its schema rebased (a first chunk), else as it is."""
        if chunk.schema is None:
            return chunk
        schema = self._rebased.get(chunk.layout)
        if schema is None:
            schema = rebase(chunk.schema, self.slices)
            if len(self._rebased) >= _REBASED:
                self._rebased.pop(next(iter(self._rebased)))
            self._rebased[chunk.layout] = schema
        return dataclasses.replace(chunk, schema=schema)
