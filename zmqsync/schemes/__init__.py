"""The user-facing schemes, with torchrl's names."""

from zmqsync.schemes.base import WeightSyncScheme
from zmqsync.schemes.legacy import MultiProcessedRemoteWeightUpdate
from zmqsync.schemes.mixed import MixedWeightSyncScheme
from zmqsync.schemes.multiprocess import MultiProcessWeightSyncScheme
from zmqsync.schemes.noop import NoWeightSyncScheme
from zmqsync.schemes.ray import RayWeightSyncScheme, WeightSyncActorMixin
from zmqsync.schemes.weights import WeightStrategy
from zmqsync.schemes.zmq import ZMQWeightSyncScheme

__all__ = [
    "MixedWeightSyncScheme",
    "MultiProcessWeightSyncScheme",
    "MultiProcessedRemoteWeightUpdate",
    "NoWeightSyncScheme",
    "RayWeightSyncScheme",
    "WeightStrategy",
    "WeightSyncActorMixin",
    "WeightSyncScheme",
    "ZMQWeightSyncScheme",
]
