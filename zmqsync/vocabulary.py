"""The words a learner and its workers agree on, defined once.

Callers pass plain strings (``"state_dict"``, ``"pubsub"``); the ``Literal`` aliases
let mypy check them, and :func:`as_strategy` / :func:`as_mode` check strings that come
from elsewhere (a config file, the command line) at run time.
"""

from __future__ import annotations

from typing import Any, Final, Literal, TypeAlias, cast, get_args

__all__ = [
    "MODES",
    "STRATEGIES",
    "Metadata",
    "Mode",
    "Strategy",
    "WorkerIds",
    "as_mode",
    "as_strategy",
]

#: How weights are named: ``"state_dict"`` (flat dotted names, as
#: ``nn.Module.state_dict()`` gives them) or ``"tensordict"`` (nested keys).
Strategy = Literal["state_dict", "tensordict"]
#: How a ZeroMQ sender reaches its workers: ``"pubsub"`` fans one send out to all,
#: ``"router"`` addresses each worker.
Mode = Literal["pubsub", "router"]
#: Which workers a send is for: ``None`` (every worker), one worker id, or a list of them.
WorkerIds: TypeAlias = int | list[int] | None
#: What the learner attaches to a version (a small JSON-able dict, e.g. the optimizer
#: step); its workers see it as ``receiver.metadata``.
Metadata: TypeAlias = dict[str, Any]

STRATEGIES: Final[tuple[Strategy, ...]] = get_args(Strategy)
MODES: Final[tuple[Mode, ...]] = get_args(Mode)


def _either(values: tuple[str, ...]) -> str:
    return " or ".join(map(repr, values))


def as_strategy(value: str) -> Strategy:
    """``value`` as a :data:`Strategy`; ``ValueError`` when it is none."""
    if value not in STRATEGIES:
        raise ValueError(f"strategy must be {_either(STRATEGIES)}; got {value!r}")
    return cast(Strategy, value)


def as_mode(value: str) -> Mode:
    """``value`` as a :data:`Mode`; ``ValueError`` when it is none."""
    if value not in MODES:
        raise ValueError(f"mode must be {_either(MODES)}; got {value!r}")
    return cast(Mode, value)
