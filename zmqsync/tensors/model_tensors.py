"""The tensors of the model a side syncs, remembered between versions.

:class:`ModelTensors` keeps :func:`~zmqsync.tensors.extract.extract`'s result and walks
the model again only when that result could be stale.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from typing import Any, Final

import torch
from tensordict import TensorDictBase

from zmqsync.tensors.extract import KeyPath, check_strategy, extract

__all__ = ["ModelTensors"]


class ModelTensors:
    """``extract(model)`` remembered between versions, for the model a side syncs.

    Walking a large module tree (``state_dict()``) costs milliseconds per version; this
    keeps the result and re-walks only when it could be stale: a module added or removed,
    a parameter or buffer replaced, or a tensor given new storage (``p.data = ...``) or
    a new shape. Checking that is a dict lookup and two compares per tensor, in C loops
    (``map``), so thousands of tensors cost no Python step each. The same holds for a
    (nested) dict of tensors.
    """

    def __init__(self, strategy: str) -> None:
        check_strategy(strategy)
        self.strategy = strategy
        self._model: Any = None
        self._modules: list[torch.nn.Module] = []
        self._owners = _Owners([])
        self._tensors: dict[KeyPath, torch.Tensor] = {}
        self._sizes: dict[int, tuple[Any, int]] = {}

    def get(self, model: Any) -> dict[KeyPath, torch.Tensor]:
        if isinstance(model, Mapping) and not isinstance(model, TensorDictBase):
            return self._get_mapping(model)
        if not isinstance(model, torch.nn.Module):
            return extract(model, self.strategy)
        if model is not self._model or not self._still_valid(model):
            self._tensors = extract(model, self.strategy)
            self._modules = list(model.modules())
            self._owners = _Owners(
                [
                    (table, name, t)
                    for module in self._modules
                    for table in (module._parameters, module._buffers)
                    for name, t in table.items()
                    if t is not None
                ]
            )
            self._model = model
        return self._tensors

    def storage_moved(self) -> None:
        """The caller gave the tensors :meth:`get` last returned new storage of the same
        shapes (the shared mode moves them onto each version's bytes) right after that
        call: remember where they are now, so the next :meth:`get` need not walk the
        model again."""
        self._owners.moved()

    def owners(self, model: Any) -> list[torch.Tensor] | None:
        """The tensor objects ``model`` itself holds (its parameters and buffers, or its
        dict's values), as :meth:`get` last walked them; None if not known."""
        if model is not self._model:
            return None
        return list(self._owners.tensors)

    def _get_mapping(self, model: Mapping[Any, Any]) -> dict[KeyPath, torch.Tensor]:
        """A dict of tensors (nested dicts too): the same check, per key."""
        if model is self._model and self._mapping_still_valid():
            return self._tensors
        tensors = extract(model, self.strategy)
        owners = list(_walk_owners(model))
        if any(not isinstance(value, torch.Tensor) for _, _, value in owners):
            self._model = None  # not all tensors (converted on extract): nothing to keep
            return tensors
        self._tensors = tensors
        self._modules = []
        self._owners = _Owners(owners)
        self._sizes = {id(table): (table, len(table)) for table, _, _ in owners}
        self._model = model
        return tensors

    def _mapping_still_valid(self) -> bool:
        return (
            all(len(table) == n for table, n in self._sizes.values()) and self._owners.unchanged()
        )

    def _still_valid(self, model: torch.nn.Module) -> bool:
        modules = list(model.modules())
        if len(modules) != len(self._modules) or any(
            a is not b for a, b in zip(modules, self._modules, strict=True)
        ):
            return False
        count = sum(
            t is not None
            for m in modules
            for table in (m._parameters, m._buffers)
            for t in table.values()
        )
        return count == len(self._owners.tensors) and self._owners.unchanged()


class _Owners:
    """Where each of a model's tensors is held (container and key), and its storage and
    shape when it was walked; :meth:`unchanged` compares them all in C loops."""

    __slots__ = ("keys", "ptrs", "shapes", "tables", "tensors")

    def __init__(self, owners: list[tuple[Any, Any, torch.Tensor]]) -> None:
        self.tables = [table for table, _, _ in owners]
        self.keys = [key for _, key, _ in owners]
        self.tensors = [t for _, _, t in owners]
        self.ptrs: list[int] = []
        self.shapes: list[torch.Size] = []
        self.remember()

    def remember(self) -> None:
        """Take each tensor's storage and shape as they are now."""
        self.moved()
        self.shapes = list(map(_SHAPE_OF, self.tensors))

    def moved(self) -> None:
        """Take each tensor's storage as it is now (its shape is as it was)."""
        self.ptrs = list(map(torch.Tensor.data_ptr, self.tensors))

    def unchanged(self) -> bool:
        """Whether every container still holds the same tensor, in the same storage, of
        the same shape."""
        try:
            held = map(operator.getitem, self.tables, self.keys)
            # Compared one by one, each shape let go of at once: a list of thousands of
            # ``torch.Size`` objects (tuples, which the garbage collector tracks) lived
            # through the young collections it set off, was promoted, and brought on a
            # full collection of the heap now and then.
            return (
                all(map(operator.is_, held, self.tensors))
                and all(map(operator.eq, map(torch.Tensor.data_ptr, self.tensors), self.ptrs))
                and all(map(operator.eq, map(_SHAPE_OF, self.tensors), self.shapes))
            )
        except KeyError:
            return False


_SHAPE_OF: Final = operator.attrgetter("shape")


def _walk_owners(mapping: Mapping[Any, Any]) -> Iterable[tuple[Any, Any, Any]]:
    """``(container, key, leaf)`` for every leaf of a nested mapping."""
    for key, value in mapping.items():
        if isinstance(value, Mapping) and not isinstance(value, TensorDictBase):
            yield from _walk_owners(value)
        else:
            yield mapping, key, value
