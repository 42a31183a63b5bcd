"""Whether received weights fit a model's tensors: every key, dtype and shape.

Checked before the first byte moves, so that a version that does not fit changes
nothing; a :class:`TargetPlan` checks once for one layout and one set of tensors.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from zmqsync.errors import SchemaMismatchError
from zmqsync.protocol import WeightsSchema
from zmqsync.tensors.extract import KeyPath
from zmqsync.tensors.views import dtype_name

__all__ = ["TargetPlan", "check_fits"]


def check_fits(
    schema: WeightsSchema, target: Mapping[KeyPath, torch.Tensor], strategy: str
) -> None:
    """Raise :class:`SchemaMismatchError` unless ``schema`` fits ``target`` exactly."""
    if schema.strategy != strategy:
        raise SchemaMismatchError(
            f"weights were sent with strategy {schema.strategy!r} but this receiver uses "
            f"{strategy!r}; give both sides the same strategy"
        )
    sent = {e.key for e in schema.entries}
    missing = [k for k in target if k not in sent]
    if missing:
        key = ".".join(missing[0])
        # A flat dotted key and a nested one print alike: say which the model has.
        nested = f" (the nested key {missing[0]!r})" if len(missing[0]) > 1 else ""
        raise SchemaMismatchError(
            f"weights lack {key!r}{nested} (and {len(missing) - 1} more) that the model has",
            key=key,
        )
    for e in schema.entries:
        dest = target.get(e.key)
        if dest is None:
            raise SchemaMismatchError(
                f"weights carry {e.dotted_key!r}, which the model lacks", key=e.dotted_key
            )
        if dtype_name(dest.dtype) != e.dtype:
            raise SchemaMismatchError(
                f"{e.dotted_key!r} is {e.dtype} in the weights but {dtype_name(dest.dtype)} "
                "in the model",
                key=e.dotted_key,
            )
        if tuple(dest.shape) != e.shape:
            raise SchemaMismatchError(
                f"{e.dotted_key!r} has shape {list(e.shape)} in the weights but "
                f"{list(dest.shape)} in the model",
                key=e.dotted_key,
            )


class TargetPlan:
    """How one schema's bytes land in one target's tensors; building it checks that the
    schema fits (:func:`check_fits`), and nothing is copied when it does not."""

    def __init__(
        self, schema: WeightsSchema, target: Mapping[KeyPath, torch.Tensor], strategy: str
    ) -> None:
        check_fits(schema, target, strategy)
        self.schema = schema
        self.target = target

    def fits(self, schema: WeightsSchema, target: Mapping[KeyPath, torch.Tensor]) -> bool:
        """Whether this plan serves ``schema`` into ``target`` (the very same objects)."""
        return schema is self.schema and target is self.target
