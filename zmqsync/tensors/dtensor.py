"""A sharded learner's rank: the part of the model it sends, as boxes of the global
tensors, read from its DTensors' local shards without gathering anything.

A ``Shard(d)`` tensor (any ``d``, uneven shards too) is sent as each rank's local box;
a replicated one, or a plain tensor every rank holds, by one rank only (the lowest
that holds it), so that no byte is sent twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from zmqsync.protocol import Box
from zmqsync.tensors.extract import KeyPath

__all__ = ["LocalPart", "distributed", "is_sharded"]


def _dtensor_type() -> type | None:
    if not distributed():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def distributed() -> bool:
    """Whether torch.distributed is initialised here: DTensors cannot exist otherwise
    (asked first, so that a plain learner never imports DTensor's modules)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def is_sharded(tensors: Mapping[KeyPath, torch.Tensor]) -> bool:
    """Whether some of ``tensors`` are DTensors (a sharded learner's)."""
    dtensor = _dtensor_type()
    return dtensor is not None and any(isinstance(t, dtensor) for t in tensors.values())


class LocalPart:
    """What rank ``part`` of ``parts`` sends of a sharded model: its local tensors, and
    the box of the global tensor each one is (:attr:`boxes`; a tensor sent whole has
    none). Worked out again only when it is given another mapping of tensors."""

    def __init__(self, part: int, parts: int) -> None:
        if not 0 <= part < parts:
            raise ValueError(f"part {part} of {parts}: out of range")
        self.part = part
        self.parts = parts
        self.boxes: dict[KeyPath, Box] = {}
        self._source: Mapping[KeyPath, torch.Tensor] | None = None
        self._local: dict[KeyPath, torch.Tensor] = {}

    def local(self, tensors: Mapping[KeyPath, torch.Tensor]) -> dict[KeyPath, torch.Tensor]:
        """The tensors this rank sends, of ``tensors`` (views: nothing is copied)."""
        if tensors is self._source:
            return self._local
        dtensor = _dtensor_type()
        local: dict[KeyPath, torch.Tensor] = {}
        boxes: dict[KeyPath, Box] = {}
        for path, t in tensors.items():
            if dtensor is not None and isinstance(t, dtensor):
                found = _local_box(t)
                if found is None:
                    continue  # another rank sends it
                local[path], box = found
                if box is not None:
                    boxes[path] = box
            elif self.part == 0:
                local[path] = t  # every rank holds it: the first sends it
        self._source, self._local = tensors, local
        if boxes != self.boxes:
            self.boxes = boxes
        return local


def _local_box(t: Any) -> tuple[torch.Tensor, Box | None] | None:
    """A DTensor's local shard and its box (None: it is the whole tensor), or None if
    another rank sends it (this one is not the first holding its replica, or holds none)."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = t.device_mesh, t.placements
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None  # not in the tensor's mesh
    for dim, placement in enumerate(placements):
        if isinstance(placement, Partial):
            raise ValueError(
                "a DTensor with a Partial placement holds no values of its own: reduce it "
                "(redistribute to Shard or Replicate) before sending"
            )
        # A strided shard (FSDP2 over tensor parallel on one dim) is not one box of
        # the global tensor but several; some torch versions make it a Shard.
        if "Strided" in type(placement).__name__ or not isinstance(placement, Shard | Replicate):
            raise ValueError(
                f"a DTensor placed as {placement} cannot be sent as boxes yet: Shard(d) and "
                "Replicate() only (redistribute it first)"
            )
        if isinstance(placement, Replicate) and coordinate[dim] != 0:
            return None  # the replica at coordinate 0 sends it
    whole = tuple(t.shape)
    shape, offsets = compute_local_shape_and_global_offset(whole, mesh, placements)
    local = t.to_local().detach()
    if tuple(local.shape) != tuple(shape):
        raise ValueError(
            f"a DTensor's local shard has shape {tuple(local.shape)}, not {tuple(shape)} as "
            "its placements say (padded shards are not supported)"
        )
    if tuple(shape) == whole:
        return local, None
    return local, Box(whole, tuple(offsets))
