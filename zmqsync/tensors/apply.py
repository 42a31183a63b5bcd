"""A received version copied into a model's tensors in place, all or nothing.

An :class:`ApplyPlan` checks once per layout that the weights fit, and works out how
their bytes land in the tensors; applying a version is then a few bulk copies.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

import numpy as np
import torch

from zmqsync.protocol import TensorEntry, Weights, WeightsSchema
from zmqsync.tensors.casts import CastPlan
from zmqsync.tensors.extract import KeyPath
from zmqsync.tensors.fit import TargetPlan
from zmqsync.tensors.views import (
    byte_view,
    read_view,
    source_views,
    synchronize,
    torch_dtype,
    word_spans,
    word_view,
    word_width,
)

__all__ = ["SERIAL_COPY_BYTES", "ApplyPlan", "apply_weights", "materialize"]


def _entry_bytes(views: list[torch.Tensor | None], entry: TensorEntry) -> torch.Tensor:
    view = views[entry.buffer]
    assert view is not None
    return view[entry.offset : entry.offset + entry.nbytes]


#: Versions up to this many bytes are copied into a worker's tensors by one memcpy per
#: tensor on the receiving thread; larger ones by torch's (parallel) ``_foreach_copy_``.
SERIAL_COPY_BYTES: Final = 64 * 1024 * 1024


@dataclass
class _Split:
    """Where a buffer's bytes land in some of its tensors, as one ``split`` of its first
    ``total`` bytes viewed as words of ``width`` bytes."""

    width: int = 1
    sizes: list[int] = field(default_factory=list)  # consecutive pieces, in words
    take: list[int] = field(default_factory=list)  # which pieces land in a tensor
    dests: list[torch.Tensor] = field(default_factory=list)  # those tensors, as words
    total: int = 0  # bytes

    def add(self, offset: int, nbytes: int, dest: torch.Tensor) -> None:
        """The tensor ``dest`` (flat ``uint8``) takes bytes ``[offset, offset + nbytes)``;
        the bytes up to it that no tensor here takes are a piece nobody takes."""
        if offset > self.total:
            self.sizes.append((offset - self.total) // self.width)
        self.take.append(len(self.sizes))
        self.sizes.append(nbytes // self.width)
        self.dests.append(word_view(dest, self.width))
        self.total = offset + nbytes

    def pieces(self, view: torch.Tensor) -> list[torch.Tensor]:
        """The pieces of ``view`` (the buffer, flat ``uint8``) the tensors take."""
        if not self.dests:
            return []
        chunks = torch.split(word_view(view[: self.total], self.width), self.sizes)
        return [chunks[i] for i in self.take]


@dataclass
class _BufferPlan:
    every: _Split  # every tensor, byte by byte (for a frame at an odd address)
    #: The same tensors in two splits: those whose bytes start and end on 8-byte words
    #: (copied as ``int64``: torch copies ``uint8`` 10-20% slower), and the rest.
    words: _Split = field(default_factory=lambda: _Split(8))
    rest: _Split = field(default_factory=_Split)
    offsets: list[int] = field(default_factory=list)  # where each dest's bytes start
    arrays: list[np.ndarray] = field(default_factory=list)  # dests, as numpy byte arrays
    #: The source buffer (address, length) ``views`` slice, and those slices.
    source: tuple[int, int] = (0, 0)
    views: list[np.ndarray] = field(default_factory=list, repr=False)

    def add(self, offset: int, nbytes: int, dest: torch.Tensor) -> None:
        self.every.add(offset, nbytes, dest)
        wide = word_width(offset, nbytes, *word_spans(dest)) >= self.words.width
        (self.words if wide else self.rest).add(offset, nbytes, dest)
        self.offsets.append(offset)
        self.arrays.append(dest.detach().numpy())

    def pieces(self, view: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The pieces of ``view`` (the received buffer) and the tensors they go to."""
        address, offset, _ = word_spans(view)  # its length: only what the splits take
        if word_width(address, offset, self.words.width) < self.words.width:
            return self.every.pieces(view), self.every.dests
        return (
            self.words.pieces(view) + self.rest.pieces(view),
            self.words.dests + self.rest.dests,
        )


class _DevicePlan:
    """One received buffer's tensors on one accelerator: the bytes they need cross to
    the device in one copy, and one ``_foreach_copy_`` there puts each in place."""

    def __init__(self, entries: list[TensorEntry], dests: list[torch.Tensor]) -> None:
        order = sorted(range(len(entries)), key=lambda i: entries[i].offset)
        self.start = entries[order[0]].offset
        self.end = max(e.offset + e.nbytes for e in entries)
        self.dests = [dests[i] for i in order]
        # Consecutive chunk sizes from start to end (padding included) and which of them
        # land in a tensor: one split, whatever the number of tensors.
        self.sizes: list[int] | None = []
        self.take: list[int] = []
        pos = self.start
        for i in order:
            e = entries[i]
            if e.offset < pos:  # overlapping entries: slice each one instead
                self.sizes = None
                break
            if e.offset > pos:
                self.sizes.append(e.offset - pos)
            self.take.append(len(self.sizes))
            self.sizes.append(e.nbytes)
            pos = e.offset + e.nbytes
        self.spans = [(entries[i].offset - self.start, entries[i].nbytes) for i in order]

    def apply(self, view: torch.Tensor | None) -> None:
        assert view is not None
        if len(self.dests) == 1:
            self.dests[0].copy_(view[self.start : self.end], non_blocking=True)
            return
        staged = view[self.start : self.end].to(self.dests[0].device, non_blocking=True)
        if self.sizes is not None:
            chunks = torch.split(staged, self.sizes)
            sources = [chunks[i] for i in self.take]
        else:
            sources = [staged[o : o + n] for o, n in self.spans]
        torch._foreach_copy_(self.dests, sources)


class ApplyPlan(TargetPlan):
    """How one schema's bytes land in one target's tensors, worked out once.

    Building it checks that the schema fits (all-or-nothing: nothing is copied when it
    does not). Applying is then one ``split`` per buffer and one ``_foreach_copy_``: a
    worker receiving 2,000 small tensors per version does no per-tensor Python work.
    """

    def __init__(
        self, schema: WeightsSchema, target: Mapping[KeyPath, torch.Tensor], strategy: str
    ) -> None:
        super().__init__(schema, target, strategy)
        self._buffers: dict[int, _BufferPlan] = {}
        self._slow: list[tuple[TensorEntry, torch.Tensor]] = []
        # Tensors on an accelerator, per (buffer, device): the buffer's bytes cross to the
        # device once, and one _foreach_copy_ there scatters them into the tensors.
        self._device: dict[tuple[int, torch.device], list[TensorEntry]] = {}
        by_buffer: dict[int, list[TensorEntry]] = {}
        cast = [e for e in schema.entries if e.wire]
        #: Tensors that travel cast, per buffer.
        self._casts = {
            b: CastPlan([e for e in cast if e.buffer == b], target)
            for b in {e.buffer for e in cast}
        }
        for e in schema.entries:
            if e.nbytes == 0 or e.wire:
                continue
            dest = target[e.key]
            if not dest.is_contiguous():
                self._slow.append((e, dest))
            elif dest.device.type == "cpu":
                by_buffer.setdefault(e.buffer, []).append(e)
            else:
                self._device.setdefault((e.buffer, dest.device), []).append(e)
        self._devices = sorted(
            {d for _, d in self._device}
            | {dest.device for _, dest in self._slow if dest.device.type != "cpu"},
            key=str,
        )
        self._device_plans = [
            (index, _DevicePlan(entries, [byte_view(target[e.key]) for e in entries]))
            for (index, _), entries in self._device.items()
        ]
        for index, entries in by_buffer.items():
            entries.sort(key=lambda e: e.offset)
            plan = _BufferPlan(_Split())
            for e in entries:
                if e.offset < plan.every.total:  # overlapping entries: copy those one by one
                    self._slow.append((e, target[e.key]))
                    continue
                plan.add(e.offset, e.nbytes, byte_view(target[e.key]))
            self._buffers[index] = plan
        self.nbytes = sum(e.nbytes for e in schema.entries)
        # Below this size a plain memcpy per tensor beats torch's parallel copy: waking
        # torch's intra-op threads costs milliseconds on a busy machine, more than the
        # whole copy.
        self.serial = self.nbytes <= SERIAL_COPY_BYTES

    def forget_source(self) -> None:
        """Let go of the views of the buffer last applied (they keep its memory alive)."""
        for plan in self._buffers.values():
            plan.source = (0, 0)
            plan.views = []

    def apply(self, message: Weights) -> None:
        # torch views of the frames, for the paths that copy with torch (making them
        # costs more than a small version's serial copies)
        views = source_views(message) if not self.serial or self._device_plans or self._slow else []
        with torch.no_grad():
            if self.serial:
                for index, plan in self._buffers.items():
                    source = np.frombuffer(message.buffers[index], dtype=np.uint8)
                    # The same memory as last time (a worker's staging buffer): views
                    # made once, and one map in C, not a Python step per tensor.
                    where = (source.__array_interface__["data"][0], source.nbytes)
                    if plan.source != where:
                        plan.source = where
                        plan.views = [
                            source[o : o + a.nbytes]
                            for a, o in zip(plan.arrays, plan.offsets, strict=True)
                        ]
                    collections.deque(map(np.copyto, plan.arrays, plan.views), maxlen=0)
            else:
                dst: list[torch.Tensor] = []
                src: list[torch.Tensor] = []
                for index, plan in self._buffers.items():
                    view = views[index]
                    assert view is not None
                    pieces, dests = plan.pieces(view)
                    src.extend(pieces)
                    dst.extend(dests)
                if dst:
                    torch._foreach_copy_(dst, src)
            for index, device_plan in self._device_plans:
                device_plan.apply(views[index])
            for index, cast_plan in self._casts.items():
                view = read_view(message.buffers[index])
                if view is not None:
                    cast_plan.apply(view, 0)
                    cast_plan.finish()
            for e, dest in self._slow:
                data = _entry_bytes(views, e)
                dest.copy_(data.clone().view(dest.dtype).reshape(dest.shape))
            # Done before the caller acks: an acked version is in the tensors, and the
            # received frames may be freed.
            synchronize(self._devices)


def apply_weights(message: Weights, target: Mapping[KeyPath, torch.Tensor], strategy: str) -> None:
    """Copy ``message`` into ``target``'s tensors in place, all or nothing.

    Every key, dtype and shape is checked first; :class:`SchemaMismatchError` names the
    first that does not fit, and then nothing has been copied. (Receivers keep an
    :class:`ApplyPlan` instead, to check a layout once.)
    """
    ApplyPlan(message.schema, target, strategy).apply(message)


def materialize(message: Weights) -> dict[KeyPath, torch.Tensor]:
    """Fresh tensors holding a message's weights (they alias nothing)."""
    views = source_views(message)
    out: dict[KeyPath, torch.Tensor] = {}
    for e in message.schema.entries:
        tensor = torch.empty(e.shape, dtype=torch_dtype(e.dtype))
        if e.nbytes and e.wire:
            tensor.view(-1).copy_(_entry_bytes(views, e).view(torch_dtype(e.wire)))
        elif e.nbytes:
            byte_view(tensor).copy_(_entry_bytes(views, e))
        out[e.key] = tensor
    return out
