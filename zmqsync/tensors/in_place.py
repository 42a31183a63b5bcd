"""A received stream applied chunk by chunk straight into a model's tensors.

The tensors hold a mix of two versions until the last chunk: the receiver holds its lock
throughout, and marks the worker torn if the stream breaks. A chunk of thousands of small
tensors costs no Python step each: its views are made once, and one ``map`` copies them.
"""

from __future__ import annotations

import collections
import ctypes
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

import numpy as np
import torch

from zmqsync.chunking.copier import copier
from zmqsync.chunking.layout import MAX_REMEMBERED_CHUNKS, overlapping
from zmqsync.protocol import Buffer, WeightsSchema
from zmqsync.tensors.casts import CastPlan
from zmqsync.tensors.extract import KeyPath
from zmqsync.tensors.fit import TargetPlan
from zmqsync.tensors.views import address, read_view

__all__ = ["InPlace"]

#: A chunk with more pieces than this is applied through cached views and one ``map``
#: (fewer are cheaper to slice on the spot).
_MANY_PIECES: Final = 16


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
    #: The destinations that merged ones span (kept: their tensors own the memory).
    merged: list[np.ndarray] | None = None


def _merge(span: _Span) -> None:
    """Make one destination of pieces that lie back to back both in the chunk and in
    memory (tensors laid out as the stream, as lent tensors are): one copy for a run of
    thousands of small tensors, not one each."""
    dests: list[np.ndarray] = []
    starts: list[int] = []
    merged: list[np.ndarray] = []
    run: list[np.ndarray] = []
    run_at, run_bytes = 0, 0  # the run's first byte in memory, and its length
    for dest, start in zip(span.dests, span.starts, strict=True):
        at = address(dest)
        if run and start == starts[-1] + run_bytes and at == run_at + run_bytes:
            run.append(dest)
            run_bytes += dest.nbytes
            continue
        if run:
            dests.append(_joined(run, run_at, run_bytes, merged))
        run, run_at, run_bytes = [dest], at, dest.nbytes
        starts.append(start)
    dests.append(_joined(run, run_at, run_bytes, merged))
    if merged:
        span.dests, span.starts, span.merged = dests, starts, merged


def _joined(run: list[np.ndarray], at: int, n: int, merged: list[np.ndarray]) -> np.ndarray:
    """One writable byte array over ``run`` (``n`` bytes back to back in memory from
    ``at``); its arrays go to ``merged``, which the span keeps: they hold the tensors'
    memory alive."""
    if len(run) == 1:
        return run[0]
    merged.extend(run)
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(at))


class InPlace(TargetPlan):
    """Applies a stream's chunks straight into a target's tensors (see the module).

    Building it checks that the schema fits the target (nothing is written otherwise).
    """

    def __init__(
        self, schema: WeightsSchema, target: Mapping[KeyPath, torch.Tensor], strategy: str
    ) -> None:
        super().__init__(schema, target, strategy)
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
        #: Large pieces are split over the process's copy threads, where it has cores.
        self._copier = copier()
        self._devices = sorted(
            {t.device for t, _ in self._special.values()} - {torch.device("cpu")}, key=str
        )

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
        if len(span.dests) > 1:
            _merge(span)
        if len(span.dests) > _MANY_PIECES:
            if self._scratch is None or len(self._scratch) < length:
                self._scratch = np.empty(length, dtype=np.uint8)
                for s in self._spans.values():  # views of the old scratch are stale
                    if s.views is not None:
                        s.views = self._views(s)
            span.views = self._views(span)
        if len(self._spans) < MAX_REMEMBERED_CHUNKS:
            self._spans[(offset, length)] = span
        return span

    def _views(self, span: _Span) -> list[np.ndarray]:
        assert self._scratch is not None
        return [
            self._scratch[s : s + d.nbytes] for s, d in zip(span.starts, span.dests, strict=True)
        ]

    def apply(self, offset: int, payload: Buffer) -> None:
        """Write the chunk that starts at stream byte ``offset`` into the tensors."""
        if isinstance(payload, torch.Tensor):
            self._apply_tensor(offset, payload)
            return
        source = np.frombuffer(payload, dtype=np.uint8)
        span = self._span(offset, len(source))
        copy = self._copier.copy_function()
        if span.views is not None:
            assert self._scratch is not None
            copy(self._scratch[: len(source)], source)
            collections.deque(map(np.copyto, span.dests, span.views), maxlen=0)
        else:
            for dest, start in zip(span.dests, span.starts, strict=True):
                copy(dest, source[start : start + dest.nbytes])
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

    def _apply_tensor(self, offset: int, payload: torch.Tensor) -> None:
        """:meth:`apply` from a uint8 tensor (a device block the hub lends): one
        ``_foreach_copy_`` per chunk, device to device where the tensors are on its
        device, waited for in :meth:`finish`."""
        span = self._span(offset, len(payload))
        dests: list[torch.Tensor] = [torch.from_numpy(d) for d in span.dests]
        froms = [payload[s : s + d.nbytes] for s, d in zip(span.starts, span.dests, strict=True)]
        for i, at, start, n in span.others or ():
            dests.append(self._special[i][1][at : at + n])
            froms.append(payload[start : start + n])
        with torch.no_grad():
            if dests:
                torch._foreach_copy_(dests, froms, non_blocking=True)
            if self._cast is not None:
                self._cast.apply(payload, offset, copy=True)

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
