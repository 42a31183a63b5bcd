"""The tensors a received stream's first bytes complete, for a receiver with a sink.

A sink is given each tensor as soon as its bytes have come, while the rest of the
version is still arriving.
"""

from __future__ import annotations

import bisect

import torch

from zmqsync.chunking.staging import Staging
from zmqsync.protocol import WeightsSchema
from zmqsync.tensors.views import torch_dtype

__all__ = ["SinkFeed"]


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
