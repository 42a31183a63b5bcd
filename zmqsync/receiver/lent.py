"""A worker's tensors in memory it lends the learner's hub (one copy per worker).

The model's tensors move, once, into one :class:`~zmqsync.transport.shm.lent.LentMemory`
laid out as the version's stream (each tensor at its entry's offset), the way
``apply_mode="shared"`` re-points them at a hub's block: every tensor stays the object
it was (``tensor.set_``), keeps its values, and stays this worker's own, writable and
private (no other worker maps it). The hub then writes each version straight into it,
while this worker holds its lock.

A worker that stops trusting the hub to be done with the memory (the hub went quiet in
the middle of a write) moves its tensors away again (:meth:`LentTensors.take_back`: one
copy into private memory), so nothing the hub writes later reaches them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from zmqsync.protocol import WeightsSchema
from zmqsync.receiver.shared import Placements, check_shareable, owned_tensors
from zmqsync.tensors.extract import KeyPath
from zmqsync.transport.shm.lent import LentMemory, Where

__all__ = ["LentTensors", "stream_bytes"]


def stream_bytes(schema: WeightsSchema) -> int:
    """The bytes of a version of ``schema``: where its last tensor ends."""
    return max((e.offset + e.nbytes for e in schema.entries), default=0)


class LentTensors:
    """``model``'s tensors (and ``target``'s, its walk) moved into memory lent to the hub,
    each where a version of ``schema`` puts its bytes.

    Raises :class:`~zmqsync.errors.SchemaMismatchError` when a tensor cannot lie there
    (the conditions of ``apply_mode="shared"``: CPU, the model's own dtypes on the wire,
    aligned, not an inference tensor)."""

    def __init__(
        self, schema: WeightsSchema, model: Any, target: Mapping[KeyPath, torch.Tensor]
    ) -> None:
        check_shareable(schema, target, schema.strategy)
        nbytes = stream_bytes(schema)
        if nbytes <= 0:
            raise ValueError("a version with no bytes has nothing to lend")
        self.schema = schema
        self._placed = Placements(schema, owned_tensors(model, target))
        self.memory: LentMemory | None = LentMemory(nbytes)
        self._move_onto(self.memory.array)

    def where(self) -> Where:
        """What the hub is told of the memory (it maps it with ``map_lent``)."""
        if self.memory is None:
            raise ValueError("the tensors were taken back: nothing is lent")
        return self.memory.where()

    @property
    def lent(self) -> bool:
        return self.memory is not None

    def take_back(self) -> None:
        """Move every tensor into private memory (their values copied once) and lend
        nothing more: what the hub may still write lands where no tensor reads."""
        memory, self.memory = self.memory, None
        if memory is None:
            return
        memory.close()
        self._move_onto(memory.array.copy())

    def _move_onto(self, array: np.ndarray) -> None:
        """Copy each tensor's values to its place in ``array``, then re-point it there."""
        storage = torch.from_numpy(array).untyped_storage()
        with torch.no_grad():
            for tensor, offset, shape, strides in self._placed.moves:
                view = torch.empty(0, dtype=tensor.dtype).set_(storage, offset, shape, strides)
                if view.data_ptr() != tensor.data_ptr():
                    view.copy_(tensor)
            for tensor, offset, shape, strides in self._placed.moves:
                tensor.set_(storage, offset, shape, strides)
