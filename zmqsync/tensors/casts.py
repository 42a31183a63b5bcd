"""``wire_dtype``: floating tensors cast for the wire as they are read, and cast back.

:class:`WireCast` casts a sender's buffer into the chunks it writes; :class:`CastPlan`
casts a receiver's chunks back into its tensors. Both copy in pieces small enough that
torch does not wake its thread pool.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from typing import Any, Final

import torch

from zmqsync.chunking.layout import MAX_REMEMBERED_CHUNKS, overlapping
from zmqsync.errors import FrameError
from zmqsync.protocol import TensorEntry
from zmqsync.tensors.extract import KeyPath
from zmqsync.tensors.views import torch_dtype

__all__ = ["CAST_GRAIN", "CastPlan", "WireCast", "serial_pieces"]

#: torch runs an element-wise copy of at most this many elements in the calling thread
#: (its parallel grain). Casts are cut into pieces this size: a parallel region leaves
#: OpenMP's threads spinning for milliseconds afterwards, taking a core from the other
#: end of the stream on a small machine.
CAST_GRAIN: Final = 32768


def serial_pieces(
    dest: torch.Tensor, source: torch.Tensor, dests: list[torch.Tensor], sources: list[torch.Tensor]
) -> None:
    """Append ``dest`` and ``source`` (flat, of equal length) to the lists, cut into
    pieces a ``_foreach_copy_`` copies without waking torch's thread pool."""
    if dest.numel() <= CAST_GRAIN:
        dests.append(dest)
        sources.append(source)
    else:
        dests.extend(torch.split(dest, CAST_GRAIN))
        sources.extend(torch.split(source, CAST_GRAIN))


class WireCast:
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


#: A received chunk with at most this many cast tensors is cast straight from its bytes
#: (views made on the spot); more are cast from a buffer whose views are made once.
_FEW_CASTS: Final = 16


class CastPlan:
    """Tensors that travel cast (``wire_dtype``): copies the elements a stretch of the
    stream holds into them, cast back to each one's dtype.

    Applied to a chunk at a time (in place) or to a whole version (staged). The stretches
    seen are remembered with the views they need, so a chunk of thousands of small
    tensors is one ``_foreach_copy_``, not a Python step per tensor.
    """

    def __init__(self, entries: list[TensorEntry], target: Mapping[KeyPath, torch.Tensor]):
        self._entries = sorted((e for e in entries if e.nbytes), key=lambda e: e.offset)
        self._starts = [e.offset for e in self._entries]
        #: Where each entry's elements go: the tensor itself, flat, or (not contiguous,
        #: or on an accelerator) a contiguous CPU copy put in place by :meth:`finish`.
        self._flat: list[torch.Tensor] = []
        self._later: list[tuple[torch.Tensor, torch.Tensor]] = []
        for e in self._entries:
            dest = target[e.key]
            if dest.device.type == "cpu" and dest.is_contiguous():
                self._flat.append(dest.detach().view(-1))
            else:
                tmp = torch.empty(dest.numel(), dtype=dest.dtype)
                self._flat.append(tmp)
                self._later.append((dest, tmp))
        #: Views of one source's memory (the last seen), per stretch of the stream.
        self._source = (0, 0)
        self._spans: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._scratch: torch.Tensor | None = None
        #: Per stretch of a received stream: whether it holds few cast tensors.
        self._few: dict[tuple[int, int], bool] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def apply(self, source: torch.Tensor, offset: int, *, copy: bool = False) -> None:
        """Copy what ``source`` (uint8: stream bytes ``[offset, offset + len)``) holds.

        ``copy``: the source is memory that will not come again (a received chunk). A
        stretch of a few tensors is cast straight from it; one of many (small tensors) is
        first copied into a buffer of the plan's, whose views are made once.
        """
        length = int(source.numel())
        if copy:
            few = self._few.get((offset, length))
            if few is None:
                first = max(0, bisect.bisect_right(self._starts, offset) - 1)
                few = bisect.bisect_left(self._starts, offset + length) - first <= _FEW_CASTS
                if len(self._few) < MAX_REMEMBERED_CHUNKS:
                    self._few[(offset, length)] = few
            if few:
                dests, views = self._span(source, offset, length)
                if dests:
                    torch._foreach_copy_(dests, views)
                return
            if self._scratch is None or self._scratch.numel() < length:
                self._scratch = torch.empty(length, dtype=torch.uint8)
            self._scratch[:length].copy_(source)
            source = self._scratch[:length]
        where = (source.data_ptr(), int(source.untyped_storage().nbytes()))
        if where != self._source:  # views of other memory would keep it alive: let go
            self._source = where
            self._spans.clear()
        span = self._spans.get((offset, length))
        if span is None:
            span = self._span(source, offset, length)
            if len(self._spans) < MAX_REMEMBERED_CHUNKS:
                self._spans[(offset, length)] = span
        dests, views = span
        if dests:
            torch._foreach_copy_(dests, views)

    def _span(
        self, source: torch.Tensor, offset: int, length: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        dests: list[torch.Tensor] = []
        views: list[torch.Tensor] = []
        for i, e, lo, hi in overlapping(self._entries, self._starts, offset, length):
            wire = torch_dtype(e.wire)
            size = wire.itemsize
            if (lo - e.offset) % size or (hi - e.offset) % size or (lo - offset) % size:
                raise FrameError(f"a chunk edge splits an element of {e.dotted_key!r} ({e.wire})")
            first = (lo - e.offset) // size
            serial_pieces(
                self._flat[i][first : first + (hi - lo) // size],
                source[lo - offset : hi - offset].view(wire),
                dests,
                views,
            )
        return dests, views

    def finish(self) -> None:
        """Put the tensors copied aside in place."""
        for dest, tmp in self._later:
            dest.copy_(tmp.view(dest.shape))
