"""Transports: adapters that move lists of byte buffers between a hub and its spokes.

The contract every adapter keeps, and the abilities some have beyond it, are in
:mod:`zmqsync.transport.base`. Adapters are registered by alias and imported lazily, so
an optional backend (Ray) loads only when used::

    hub_cls, spoke_cls = zmqsync.transport.resolve("zmq-pubsub")
"""

from __future__ import annotations

import difflib
import importlib
from typing import Final

from zmqsync.transport.base import HubTransport, Incoming, PeerId, SpokeTransport, Stream

__all__ = ["ALIASES", "HubTransport", "Incoming", "PeerId", "SpokeTransport", "Stream", "resolve"]

#: alias -> "module:HubClass,SpokeClass"
ALIASES: Final[dict[str, str]] = {
    "memory": "zmqsync.transport.memory:MemoryHub,MemorySpoke",
    "pipe": "zmqsync.transport.pipe:PipeHub,PipeSpoke",
    "ray": "zmqsync.transport.ray:RayHub,RaySpoke",
    "zmq-pubsub": "zmqsync.transport.zmq_pubsub:PubSubHub,PubSubSpoke",
    "zmq-router": "zmqsync.transport.zmq_router:RouterHub,RouterSpoke",
}


def resolve(alias: str) -> tuple[type[HubTransport], type[SpokeTransport]]:
    """The (hub, spoke) classes registered under ``alias``."""
    try:
        target = ALIASES[alias]
    except KeyError:
        close = difflib.get_close_matches(alias, ALIASES, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"unknown transport {alias!r}; known: {', '.join(sorted(ALIASES))}.{hint}"
        ) from None
    module_name, _, names = target.partition(":")
    module = importlib.import_module(module_name)
    hub_name, spoke_name = names.split(",")
    return getattr(module, hub_name), getattr(module, spoke_name)
