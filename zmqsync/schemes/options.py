"""What a scheme takes from its caller: the sender's and receiver's options, the model,
and its workers' ends (``pipes=``, ``remote_collectors=``), by keyword or from a context."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any, Final, TypeVar

from zmqsync.sender import WeightSender

__all__ = [
    "RECEIVER_OPTIONS",
    "SENDER_OPTIONS",
    "check_sender_options",
    "model_from_context",
    "numbered",
    "receiver_options",
]

#: What a scheme passes to :class:`~zmqsync.WeightSender` itself; the rest of the
#: sender's keyword arguments are the options a scheme accepts (``**sender_options``).
_SET_BY_SCHEME: Final = frozenset(
    {
        "self",
        "hub",
        "model_id",
        "model",
        "strategy",
        "num_workers",
        "timeout",
        "mode",
        "part",
        "ranks",
    }
)
SENDER_OPTIONS: Final = (
    frozenset(inspect.signature(WeightSender.__init__).parameters) - _SET_BY_SCHEME
)
#: What a worker may choose in ``init_on_receiver`` (:class:`~zmqsync.WeightReceiver`'s
#: options).
RECEIVER_OPTIONS: Final = ("apply_mode", "chunk_timeout", "sink", "slices", "lend_tensors")

_T = TypeVar("_T")


def receiver_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Take the receiver options out of ``init_on_receiver``'s keyword arguments."""
    return {name: kwargs.pop(name) for name in RECEIVER_OPTIONS if name in kwargs}


def check_sender_options(owner: str, options: Mapping[str, Any]) -> None:
    """Refuse, when the scheme is built, an option that no part of it takes (it would
    otherwise fail later, in ``init_on_sender``, or never)."""
    unknown = sorted(set(options) - SENDER_OPTIONS)
    if unknown:
        raise TypeError(
            f"{owner} does not support the option(s) {', '.join(map(repr, unknown))}; it "
            f"takes, besides its own arguments, {', '.join(sorted(SENDER_OPTIONS))}"
        )


def model_from_context(context: Any, model_id: str) -> Any:
    """The context's model ``model_id``: ``context.get_model(model_id)``, or its attribute
    of that name (None without a context)."""
    if context is None:
        return None
    getter = getattr(context, "get_model", None)
    if callable(getter):
        return getter(model_id)
    return getattr(context, model_id, None)


def numbered(items: Sequence[_T] | Mapping[int, _T], first: int = 0) -> Mapping[int, _T]:
    """``{worker_idx: item}``: a mapping as it is, a list numbered from ``first``."""
    if isinstance(items, Mapping):
        return items
    return {first + i: item for i, item in enumerate(items)}
