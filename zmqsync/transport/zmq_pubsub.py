"""ZeroMQ fan-out: one PUB sends each version once per subscriber, zero-copy.

Targeted sends (``to=[...]``) and replies go over the ROUTER instead, so they reach
exactly their peers. PUB drops messages for a subscriber whose queue is full rather than
block the sender; the worker's heartbeat then asks for the latest version (see
``zmqsync.receiver``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Final

import zmq

from zmqsync.protocol import Buffer
from zmqsync.transport._zmq import (
    CONTROL_MAX_MESSAGE,
    DATA_HWM,
    ZMQHub,
    ZMQSpoke,
    _bind,
    derive_endpoint,
    send_parts,
)
from zmqsync.transport._zmq_shm import ADDRESSED, FAN_OUT

__all__ = ["PubSubHub", "PubSubSpoke"]

#: After the PUB is rebound, fan-out goes over the ROUTER this long: subscribers reconnect
#: after ZeroMQ's reconnect interval (100 ms) and resubscribe.
RESUBSCRIBE_GRACE: Final = 1.0


class PubSubHub(ZMQHub):
    """Sender end of the ``pubsub`` mode: PUB for fan-out, ROUTER, PULL for acks."""

    name = "zmq-pubsub"

    def __init__(self, endpoint: str | None = None, *, data_endpoint: str | None = None, **kw: Any):
        self._data_request = data_endpoint
        self._resubscribe_until = 0.0
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
        self._data_endpoint = _bind(self._pub, self._data_bound_as)

    def _data_sockets(self) -> list[zmq.Socket[Any]]:
        return [*super()._data_sockets(), self._pub]

    def announce(self) -> dict[str, Any]:
        return {**super().announce(), "data_endpoint": self._data_endpoint}

    def _fan_out(self, frames: Sequence[Buffer]) -> None:
        if time.monotonic() < self._resubscribe_until:
            # The PUB was just rebound and subscribers are still reconnecting: reach every
            # known worker over the ROUTER instead, which stayed connected.
            for peer in list(self._peers):
                self._send_to(peer, frames)
            return
        # PUB never blocks: a subscriber at its high-water mark simply misses this one.
        send_parts(self._pub, frames)

    def _fan_out_channel(self) -> int:
        return ADDRESSED if time.monotonic() < self._resubscribe_until else FAN_OUT

    def _rebind_data(self) -> None:
        """Close and rebind the PUB: drops messages queued for slow or stuck workers.

        Subscribers reconnect and resubscribe by themselves.
        """
        self._unmonitor(self._pub)
        self._socks.discard(self._pub)
        self._bind_data_again()
        self._resubscribe_until = time.monotonic() + RESUBSCRIBE_GRACE

    def _bind_data_again(self) -> None:
        self._pub = self._new_pub()
        self._data_endpoint = _bind(self._pub, self._data_endpoint)


class PubSubSpoke(ZMQSpoke):
    """Worker end of the ``pubsub`` mode."""

    name = "zmq-pubsub"
