"""The user-facing schemes, with torchrl's names."""

from zmqsync.schemes.base import WeightStrategy, WeightSyncScheme
from zmqsync.schemes.noop import NoWeightSyncScheme
from zmqsync.schemes.zmq import ZMQWeightSyncScheme

__all__ = ["NoWeightSyncScheme", "WeightStrategy", "WeightSyncScheme", "ZMQWeightSyncScheme"]
