"""ZeroMQ addressed sends: the ROUTER sends each version to each worker by its id.

Every message is addressed, so ``to=[...]`` costs nothing extra and a worker that is
gone is known at once (``ROUTER_MANDATORY``). Fan-out (``to=None``) reaches every
worker the sender admitted (welcomed), never a connection that merely spoke.
"""

from __future__ import annotations

from collections.abc import Sequence

from zmqsync.protocol import Buffer
from zmqsync.transport._zmq.hub import ZMQHub
from zmqsync.transport._zmq.spoke import ZMQSpoke

__all__ = ["RouterHub", "RouterSpoke"]


class RouterHub(ZMQHub):
    """Sender end of the ``router`` mode: ROUTER for everything, PULL for acks."""

    name = "zmq-router"

    def _fan_out(self, frames: Sequence[Buffer]) -> None:
        for peer in list(self._peers):
            self._send_to(peer, frames)


class RouterSpoke(ZMQSpoke):
    """Worker end of the ``router`` mode."""

    name = "zmq-router"
