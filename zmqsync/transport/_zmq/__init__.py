"""What the ZeroMQ adapters (:mod:`~zmqsync.transport.zmq_pubsub`,
:mod:`~zmqsync.transport.zmq_router`) are made of.

- :mod:`.sockets`: socket options, lean sends and receives, polling, errors.
- :mod:`.hub` and :mod:`.spoke`: the two ends.
- :mod:`.lending` and :mod:`.borrowing`: shared memory for peers on the hub's host.
"""

from zmqsync.transport._zmq.hub import ZMQHub
from zmqsync.transport._zmq.sockets import HANDSHAKE_SECONDS, SPOKE_PREFIX, translated
from zmqsync.transport._zmq.spoke import ZMQSpoke

__all__ = [
    "HANDSHAKE_SECONDS",
    "SPOKE_PREFIX",
    "ZMQHub",
    "ZMQSpoke",
    "translated",
]
