"""A stream's chunks read out of tensors left on an accelerator, a chunk at a time.

What a sender writes its chunks from when its flattened weights stay on their device
(``Flattener.flatten(..., stage=False)``): each chunk crosses to the host as it is sent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Final

import numpy as np
import torch

from zmqsync.chunking.layout import StreamLayout
from zmqsync.tensors.casts import WireCast

__all__ = ["DeviceReader"]

#: Chunk-sized host buffers a reader copies through: one is sent while the next fills.
_SLOTS: Final = 2


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
        self._buffers: list[torch.Tensor | WireCast] = [
            WireCast(b, casts[i]) if casts and i in casts else b for i, b in enumerate(buffers)
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
            for _ in range(_SLOTS if self.layout.count > 1 else 1):
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
            if isinstance(source, WireCast):
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

    def write_device(self, index: int, out: torch.Tensor) -> None:
        """Fill ``out`` (device memory, the chunk's length) with chunk ``index``, device
        to device, and wait until it is there (a worker may read it once this returns)."""
        with torch.no_grad(), contextlib.ExitStack() as on:
            if self._stream is not None:
                on.enter_context(torch.cuda.stream(self._stream))
            pos = 0
            for p in self.layout.pieces(index):
                if p.at > pos:
                    out[pos : p.at].zero_()
                end = p.at + p.stop - p.start
                source = self._buffers[p.buffer]
                if isinstance(source, WireCast):
                    source.write(p.start, p.stop, out[p.at : end])
                else:
                    out[p.at : end].copy_(source[p.start : p.stop], non_blocking=True)
                pos = end
            if len(out) > pos:
                out[pos:].zero_()
            if self._stream is not None:
                self._stream.synchronize()

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
