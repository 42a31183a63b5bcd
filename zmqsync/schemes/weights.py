"""How a scheme takes weights from a model and puts them back.

:class:`WeightStrategy` is torchrl's name for the extraction (``"state_dict"`` or
``"tensordict"``); :func:`apply_to_model` writes weights into a model all-or-nothing,
checking they fit first.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from zmqsync.errors import SchemaMismatchError
from zmqsync.tensors.extract import extract
from zmqsync.tensors.fit import check_fits
from zmqsync.tensors.flatten import Flattener
from zmqsync.vocabulary import Strategy

__all__ = ["WeightStrategy", "apply_to_model"]


class WeightStrategy:
    """How weights are taken from a model: ``"state_dict"`` or ``"tensordict"``.

    torchrl passes one of these to ``prepare_weights``; zmqsync only needs its name.
    """

    def __init__(self, extract_as: Strategy = "tensordict") -> None:
        self.extract_as = extract_as

    def extract_weights(self, source: Any) -> Any:
        tensors = extract(source, self.extract_as)
        if self.extract_as == "state_dict":
            return {".".join(k): v for k, v in tensors.items()}
        return TensorDict(dict(tensors.items()), batch_size=[])


def apply_to_model(
    model: Any, weights: TensorDictBase | dict[str, Any], strategy: Strategy, *, inplace: bool
) -> None:
    """Write ``weights`` into ``model``, or nothing when they lack an entry or do not fit.

    ``inplace``: copy into the model's own tensors; otherwise give an ``nn.Module``
    clones of the weights as its new tensors.
    """
    target = extract(model, strategy)
    source = extract(weights, strategy)
    missing = target.keys() - source.keys()
    if missing:
        name = ".".join(sorted(missing)[0])
        raise SchemaMismatchError(f"weights lack {name!r} that the model has", key=name)
    check_fits(Flattener(strategy).flatten(source, stage=False).schema, target, strategy)
    with torch.no_grad():
        if inplace:
            for key, dest in target.items():
                dest.copy_(source[key])
        elif isinstance(model, torch.nn.Module):
            clones = {".".join(k): v.clone() for k, v in source.items()}
            if strategy == "state_dict":
                model.load_state_dict(clones, assign=True)
            else:
                TensorDict(dict(source.items()), batch_size=[]).clone().to_module(model)
        else:
            raise ValueError("inplace=False needs an nn.Module model")
