"""zmqsync: versioned neural-network weights from a learner to a fleet of workers.

torchrl's weight-sync API (``WeightSyncScheme``, ``WeightSender``, ``WeightReceiver``)
over a ZeroMQ message bus::

    import zmqsync
    scheme = zmqsync.ZMQWeightSyncScheme()
    scheme.init_on_sender("policy", model=policy, num_workers=4)
    scheme.send()   # returns when all 4 workers hold the new version
"""

from zmqsync.errors import (
    EndpointError,
    FrameError,
    SchemaMismatchError,
    SyncTimeout,
    TransportClosed,
    TransportError,
    WeightsRejected,
    ZMQSyncError,
)
from zmqsync.receiver import WeightReceiver
from zmqsync.schemes import (
    NoWeightSyncScheme,
    WeightStrategy,
    WeightSyncScheme,
    ZMQWeightSyncScheme,
)
from zmqsync.sender import WeightSender
from zmqsync.tensors import checksum

__version__ = "0.1.0"

__all__ = [
    "EndpointError",
    "FrameError",
    "NoWeightSyncScheme",
    "SchemaMismatchError",
    "SyncTimeout",
    "TransportClosed",
    "TransportError",
    "WeightReceiver",
    "WeightSender",
    "WeightStrategy",
    "WeightSyncScheme",
    "WeightsRejected",
    "ZMQSyncError",
    "ZMQWeightSyncScheme",
    "__version__",
    "checksum",
]
