"""What a tensor-parallel worker declares it holds: a slice (a box of the global tensor)
of each of its model's tensors, worked out from its own tensors' names and shapes."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias

import torch

from zmqsync.protocol import Box, Slice
from zmqsync.tensors.extract import extract

__all__ = ["SliceSpec", "declare_slices", "dtensor_slices"]

#: What ``WeightReceiver(slices=)`` takes: a callable from a tensor's name and its shape
#: at the worker (its slice's extent) to the box its slice is of the global tensor
#: (``Box(global shape, offsets)``; None: the whole tensor); or a mapping from names to
#: such boxes, or to ``(box, extent)`` where the worker has no model (a sink).
SliceSpec: TypeAlias = (
    Callable[[str, tuple[int, ...]], Box | None] | Mapping[str, Box | tuple[Box, Sequence[int]]]
)


def declare_slices(spec: SliceSpec, model: Any, strategy: str) -> tuple[Slice, ...]:
    """The slices ``spec`` says the worker holds, checked against its ``model``'s
    tensors (None: a sink's, given wholly by a mapping). Raises ``ValueError`` for a
    slice that does not fit its global tensor or the worker's tensor."""
    if model is None:
        if not isinstance(spec, Mapping):
            raise ValueError(
                "slices= without a model (a sink) is a mapping {name: (Box, extent)}: "
                "there are no tensors to call it with"
            )
        return tuple(
            _slice(
                name, value, None, (name,) if strategy == "state_dict" else tuple(name.split("."))
            )
            for name, value in spec.items()
        )
    out = []
    for path, t in extract(model, strategy).items():
        name, shape = ".".join(path), tuple(t.shape)
        box = spec(name, shape) if callable(spec) else spec.get(name)
        if box is not None:
            out.append(_slice(name, box, shape, path))
    if isinstance(spec, Mapping):
        unknown = set(spec) - {".".join(p) for p in extract(model, strategy)}
        if unknown:
            raise ValueError(f"slices= names tensors the model does not have: {sorted(unknown)}")
    return tuple(out)


def _slice(
    name: str,
    value: Box | tuple[Box, Sequence[int]],
    shape: tuple[int, ...] | None,
    path: tuple[str, ...],
) -> Slice:
    """One tensor's slice: its box and extent (given, or the worker tensor's shape)."""
    box, extent = (value, shape) if isinstance(value, Box) else (value[0], tuple(value[1]))
    if extent is None:
        raise ValueError(f"slice of {name!r}: without a model, give (Box, extent)")
    if shape is not None and tuple(extent) != shape:
        raise ValueError(f"slice of {name!r}: extent {tuple(extent)}, but the tensor is {shape}")
    if not (len(box.shape) == len(box.offsets) == len(extent)) or any(
        o < 0 or n < 0 or o + n > d for d, o, n in zip(box.shape, box.offsets, extent, strict=True)
    ):
        raise ValueError(
            f"slice of {name!r}: extent {tuple(extent)} at offsets {box.offsets} does not fit "
            f"in the global shape {box.shape}"
        )
    return Slice(path, tuple(box.shape), tuple(box.offsets), tuple(extent))


def dtensor_slices(
    model: Any, strategy: str = "state_dict"
) -> tuple[dict[str, torch.Tensor], dict[str, Box]]:
    """A worker's model of DTensors (a tensor-parallel worker with torch.distributed of
    its own) as a sliced receiver takes it: each tensor's local shard, by name (a view:
    what is written into it lands in the DTensor), and the box of the global tensor
    each sharded one is (a replicated or plain tensor is held whole). Pass them as
    ``model=`` and ``slices=``.

    Raises ``ValueError`` for a placement that is not one box (``Partial``, strided)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local: dict[str, torch.Tensor] = {}
    boxes: dict[str, Box] = {}
    for path, t in extract(model, strategy).items():
        name = ".".join(path)
        if not isinstance(t, DTensor):
            local[name] = t
            continue
        for placement in t.placements:
            if "Strided" in type(placement).__name__ or isinstance(placement, Partial):
                raise ValueError(f"tensor {name!r} is placed as {placement}: not one box")
            if not isinstance(placement, Shard | Replicate):
                raise ValueError(f"tensor {name!r} is placed as {placement}: not one box")
        whole = tuple(t.shape)
        shape, offsets = compute_local_shape_and_global_offset(whole, t.device_mesh, t.placements)
        local[name] = t.to_local()
        if tuple(local[name].shape) != tuple(shape):
            raise ValueError(f"tensor {name!r}: its local shard is padded, not one box")
        if tuple(shape) != whole:
            boxes[name] = Box(whole, tuple(offsets))
    return local, boxes
