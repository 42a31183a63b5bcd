"""ZeroMQ fan-out: one PUB sends each version once per subscriber, zero-copy.

Targeted sends (``to=[...]``) and replies go over the ROUTER instead, so they reach
exactly their peers. PUB drops messages for a subscriber whose queue is full rather than
block the sender; the worker's heartbeat then asks for the latest version (see
``zmqsync.receiver``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zmq

from zmqsync.endpoints import derive_endpoint
from zmqsync.protocol import Buffer
from zmqsync.transport._zmq.hub import ZMQHub
from zmqsync.transport._zmq.sockets import CONTROL_MAX_MESSAGE, DATA_HWM, bind, send_parts
from zmqsync.transport._zmq.spoke import ZMQSpoke
from zmqsync.transport.shm.records import FAN_OUT

__all__ = ["PubSubHub", "PubSubSpoke"]


class PubSubHub(ZMQHub):
    """Sender end of the ``pubsub`` mode: PUB for fan-out, ROUTER, PULL for acks."""

    name = "zmq-pubsub"
    fans_out = True

    def __init__(self, endpoint: str | None = None, *, data_endpoint: str | None = None, **kw: Any):
        self._data_request = data_endpoint
        super().__init__(endpoint, **kw)

    def _new_pub(self) -> zmq.Socket[Any]:
        pub = self._socks.add(zmq.PUB, poll=False, hwm=DATA_HWM)
        pub.maxmsgsize = CONTROL_MAX_MESSAGE  # a PUB reads only subscriptions
        pub.copy_threshold = self._zero_copy_min
        self._monitor(pub)
        return pub

    def _bind_data(self, endpoint: str) -> None:
        self._pub = self._new_pub()
        self._data_bound_as = self._data_request or derive_endpoint(endpoint, "data", 1)
        self._data_endpoint = bind(self._pub, self._data_bound_as)

    def _data_sockets(self) -> list[zmq.Socket[Any]]:
        return [*super()._data_sockets(), self._pub]

    def announce(self) -> dict[str, Any]:
        return {**super().announce(), "data_endpoint": self._data_endpoint}

    def _fan_out(self, frames: Sequence[Buffer]) -> None:
        # PUB never blocks: a subscriber at its high-water mark simply misses this one.
        send_parts(self._pub, frames)

    def _fan_out_channel(self) -> int:
        return FAN_OUT


class PubSubSpoke(ZMQSpoke):
    """Worker end of the ``pubsub`` mode."""

    name = "zmq-pubsub"
