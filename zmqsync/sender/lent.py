"""The learner's side of lent tensors: a worker's lent memory, written from the model.

A worker on the learner's host may lend the memory its tensors live in (see
:mod:`zmqsync.receiver.lent`); the hub maps it (``map_lent``) and the learner writes each
version straight into it, one ``torch._foreach_copy_`` from its own tensors: on the
thread pool its last torch op left hot, one copy per worker and none of its own.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from zmqsync.protocol import WeightsSchema
from zmqsync.tensors.extract import KeyPath
from zmqsync.tensors.views import torch_dtype

__all__ = ["LentTarget"]


class LentTarget:
    """A worker's lent memory (``mapped``, exactly a version of ``schema``'s bytes) as one
    tensor per entry of ``schema``, at the entry's place in the stream."""

    def __init__(self, mapped: np.ndarray, schema: WeightsSchema) -> None:
        total = max((e.offset + e.nbytes for e in schema.entries), default=0)
        if mapped.dtype != np.uint8 or mapped.nbytes != total or not mapped.flags.writeable:
            raise ValueError(f"lent memory of {mapped.nbytes} bytes for a {total}-byte version")
        flat = torch.from_numpy(mapped)
        self.schema = schema
        #: The memory written into (the hub's mapping of what the worker lent).
        self.memory = mapped
        self._keys = [e.key for e in schema.entries]
        self._views = []
        for e in schema.entries:
            if e.wire or e.buffer != 0:
                raise ValueError(f"{e.dotted_key} is not written as it is, in one stream")
            dtype = torch_dtype(e.dtype)
            piece = flat[e.offset : e.offset + e.nbytes]
            self._views.append(piece.view(dtype).view(tuple(int(n) for n in e.shape)))

    def write(self, tensors: Mapping[KeyPath, torch.Tensor]) -> None:
        """Copy ``tensors`` (the model's, by key, as the schema was made of them) in."""
        with torch.no_grad():
            torch._foreach_copy_(self._views, [tensors[k] for k in self._keys])
