"""A model's parameters moved into one shared buffer laid out as its version stream.

With ``share_params=True`` a sender on the workers' host keeps each of the model's tensors
in a shared-memory block at its stream offset (:class:`~zmqsync.chunking.layout.
StreamLayout`): a version is then the block itself, which workers copy from directly.
Over a hub that lends no memory (tcp) the buffer is the sender's own, and its chunks go
to the socket without a copy.
Tensors move as with ``Tensor.share_memory_()``: each keeps its identity (an optimizer
still updates it) and only its storage changes (``tensor.data = view``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from zmqsync.chunking.layout import StreamLayout
from zmqsync.tensors.extract import KeyPath
from zmqsync.tensors.flatten import Flat

__all__ = ["SharedParams", "why_not_shared"]


def why_not_shared(
    tensors: dict[KeyPath, torch.Tensor], owners: Sequence[torch.Tensor] | None
) -> str | None:
    """Why these tensors cannot live in one shared buffer, or None if they can.

    Each must be a contiguous CPU tensor held by the model itself (so it can be moved),
    and no two may share memory (each key has its own place in the stream).
    """
    if owners is None:
        return "the model is neither an nn.Module nor a dict of tensors"
    by_ptr: dict[int, torch.Tensor] = {}
    for t in owners:
        if t.numel():
            by_ptr.setdefault(t.data_ptr(), t)
    seen: set[int] = set()
    for key, t in tensors.items():
        if not t.numel():
            continue
        name = ".".join(key)
        if t.device.type != "cpu":
            return f"{name!r} is on {t.device}, not the CPU"
        if not t.is_contiguous():
            return f"{name!r} is not contiguous"
        ptr = t.data_ptr()
        if ptr in seen:
            return f"{name!r} shares its memory with another entry (tied weights)"
        seen.add(ptr)
        owner = by_ptr.get(ptr)
        if owner is None or owner.shape != t.shape or owner.dtype != t.dtype:
            return f"{name!r} is not a parameter, buffer or value the model holds"
    return None


class SharedParams:
    """The model's tensors, moved into ``data`` at their stream offsets (see module)."""

    def __init__(
        self,
        tensors: dict[KeyPath, torch.Tensor],
        owners: Sequence[torch.Tensor],
        flat: Flat,
        layout: StreamLayout,
        data: np.ndarray,
    ) -> None:
        """Copy ``tensors``' values into ``data`` (``layout.total`` bytes) and move every
        owner tensor there. Check :func:`why_not_shared` first."""
        self.layout = layout
        self.data = data
        sources = layout.sources(flat)
        for index in range(layout.count):
            offset, length = layout.span(index)
            layout.write(index, sources, data[offset : offset + length])
        del sources
        by_ptr: dict[int, list[torch.Tensor]] = {}
        for t in owners:
            if t.numel():
                by_ptr.setdefault(t.data_ptr(), []).append(t)
        self._places: dict[KeyPath, int] = {}
        for entry in layout.schema.entries:
            t = tensors[entry.key]
            if not t.numel():
                continue
            region = data[entry.offset : entry.offset + entry.nbytes]
            view = torch.from_numpy(region).view(t.dtype).view(t.shape)
            for owner in by_ptr.get(t.data_ptr(), ()):
                owner.data = view
            self._places[entry.key] = view.data_ptr()
        self._checked: dict[KeyPath, torch.Tensor] | None = None

    def holds(self, tensors: dict[KeyPath, torch.Tensor]) -> bool:
        """Whether ``tensors`` (the model's, extracted again) still all live here."""
        if tensors is self._checked:
            return True
        places = self._places
        if sum(1 for t in tensors.values() if t.numel()) != len(places):
            return False
        for key, t in tensors.items():
            if t.numel() and places.get(key) != t.data_ptr():
                return False
        self._checked = tensors
        return True

    def release(self, owners: Sequence[torch.Tensor], private: bool) -> None:
        """Forget the buffer; ``private``: first move the owners into memory of their
        own (a copy), so that nothing the model holds views ``data`` any more."""
        if private:
            start = self.data.__array_interface__["data"][0]
            end = start + self.data.nbytes
            for t in owners:
                if t.numel() and start <= t.data_ptr() < end:
                    t.data = t.data.clone()
        self._checked = None
        self.data = None  # type: ignore[assignment]
