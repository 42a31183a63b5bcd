"""Weights as ``{key_path: tensor}``: taken from a model, and given back as weights.

:func:`extract` takes them from an ``nn.Module``, a ``TensorDict`` or a ``dict`` of tensors
for a strategy: ``"state_dict"`` (flat dotted names, as ``module.state_dict()``) or
``"tensordict"`` (nested keys, as ``TensorDict.from_module``; non-persistent buffers too).
A ``dict`` given for the tensordict strategy may be nested or flat: a dotted key
(``"0.weight"``, as ``module.state_dict()`` has them) is the nested key it names, since a
module's own names never hold a dot.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any, TypeAlias

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from zmqsync.protocol import STRATEGIES
from zmqsync.tensors.views import byte_view, dtype_name

__all__ = ["KeyPath", "as_weights_object", "check_strategy", "checksum", "extract"]

KeyPath: TypeAlias = tuple[str, ...]


def check_strategy(strategy: str) -> None:
    """Raise ValueError unless ``strategy`` is one the protocol knows."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}; got {strategy!r}")


def extract(weights: Any, strategy: str, *, model: Any = None) -> dict[KeyPath, torch.Tensor]:
    """``{key_path: tensor}`` of ``weights`` (or of ``model`` when ``weights`` is None).

    Tensors are detached views of the originals: nothing is copied.
    """
    check_strategy(strategy)
    source = model if weights is None else weights
    if source is None:
        raise ValueError(
            "no weights to send: pass weights=, or give the scheme a model "
            "(init_on_sender(model_id, model=...))"
        )
    if isinstance(source, torch.nn.Module):
        if strategy == "state_dict":
            return {(k,): v.detach() for k, v in source.state_dict(keep_vars=True).items()}
        source = TensorDict.from_module(source)
    if isinstance(source, TensorDictBase):
        if strategy == "state_dict":
            source = source.flatten_keys(".")
        out: dict[KeyPath, torch.Tensor] = {}
        for key, value in source.items(include_nested=True, leaves_only=True):
            path = (key,) if isinstance(key, str) else tuple(key)
            out[path] = _as_tensor(path, value)
        return out
    if isinstance(source, Mapping):
        if strategy == "state_dict":
            return {(".".join(p),): _as_tensor(p, v) for p, v in _walk(source, ())}
        return {_nested(p): _as_tensor(p, v) for p, v in _walk(source, ())}
    raise TypeError(
        f"cannot take weights from a {type(source).__name__}; pass an nn.Module, a TensorDict "
        "or a dict of tensors"
    )


def _walk(mapping: Mapping[Any, Any], prefix: KeyPath) -> Iterable[tuple[KeyPath, Any]]:
    for key, value in mapping.items():
        path = (*prefix, str(key))
        if isinstance(value, Mapping | TensorDictBase):
            yield from _walk(value, path)
        else:
            yield path, value


def _nested(path: KeyPath) -> KeyPath:
    """The nested key of a dict's key path, its dotted parts split: ``("0.weight",)`` is
    ``("0", "weight")``."""
    return tuple(part for key in path for part in key.split("."))


def _as_tensor(path: KeyPath, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"weights entry {'.'.join(path)!r} is a {type(value).__name__}, not a tensor"
        )
    return value.detach()


def as_weights_object(tensors: Mapping[KeyPath, torch.Tensor], strategy: str) -> Any:
    """What ``receive()`` returns: a state_dict-like ``dict`` or a nested ``TensorDict``."""
    if strategy == "state_dict":
        return {".".join(k): v for k, v in tensors.items()}
    return TensorDict({k: v for k, v in tensors.items()}, batch_size=[])


def checksum(weights: Any, strategy: str = "state_dict") -> str:
    """A hex digest of weights' keys, dtypes, shapes and bytes (for tests and status)."""
    h = hashlib.blake2b(digest_size=16)
    for path, tensor in sorted(extract(weights, strategy).items()):
        t = tensor.detach().cpu().contiguous()
        h.update(repr((path, dtype_name(t.dtype), tuple(t.shape))).encode())
        if t.numel():
            h.update(np.ascontiguousarray(byte_view(t).numpy()).tobytes())
    return h.hexdigest()
