"""zmqsync: versioned neural-network weights from a learner to a fleet of workers.

torchrl's weight-sync API (``WeightSyncScheme``, ``WeightSender``, ``WeightReceiver``)
over a ZeroMQ message bus::

    import zmqsync
    scheme = zmqsync.ZMQWeightSyncScheme()
    scheme.init_on_sender("policy", model=policy, num_workers=4)
    scheme.send()   # returns when all 4 workers hold the new version

Names load lazily (PEP 562): ``import zmqsync`` costs nothing until a name that needs
torch is used, so the CLI's ``zmqsync status`` starts in a fraction of a second.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "CheckpointError": "zmqsync.errors",
    "EndpointError": "zmqsync.errors",
    "FactoryError": "zmqsync.errors",
    "FrameError": "zmqsync.errors",
    "MixedWeightSyncScheme": "zmqsync.schemes.mixed",
    "MultiProcessWeightSyncScheme": "zmqsync.schemes.multiprocess",
    "MultiProcessedRemoteWeightUpdate": "zmqsync.schemes.legacy",
    "NoWeightSyncScheme": "zmqsync.schemes.noop",
    "RayWeightSyncScheme": "zmqsync.schemes.ray",
    "Relay": "zmqsync.relay",
    "SchemaMismatchError": "zmqsync.errors",
    "SenderStatus": "zmqsync.status_types",
    "SyncTimeout": "zmqsync.errors",
    "TornWeights": "zmqsync.errors",
    "TransportClosed": "zmqsync.errors",
    "TransportError": "zmqsync.errors",
    "WeightReceiver": "zmqsync.receiver",
    "WeightSender": "zmqsync.sender",
    "WeightStrategy": "zmqsync.schemes.weights",
    "WeightSyncActorMixin": "zmqsync.schemes.ray",
    "WeightSyncScheme": "zmqsync.schemes.base",
    "WeightsRejected": "zmqsync.errors",
    "WorkerStatus": "zmqsync.status_types",
    "ZMQSyncError": "zmqsync.errors",
    "ZMQWeightSyncScheme": "zmqsync.schemes.zmq",
    "checksum": "zmqsync.tensors.extract",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'zmqsync' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # next time, no lookup
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:
    from zmqsync.errors import (
        CheckpointError,
        EndpointError,
        FactoryError,
        FrameError,
        SchemaMismatchError,
        SyncTimeout,
        TornWeights,
        TransportClosed,
        TransportError,
        WeightsRejected,
        ZMQSyncError,
    )
    from zmqsync.receiver import WeightReceiver
    from zmqsync.relay import Relay
    from zmqsync.schemes.base import WeightSyncScheme
    from zmqsync.schemes.legacy import MultiProcessedRemoteWeightUpdate
    from zmqsync.schemes.mixed import MixedWeightSyncScheme
    from zmqsync.schemes.multiprocess import MultiProcessWeightSyncScheme
    from zmqsync.schemes.noop import NoWeightSyncScheme
    from zmqsync.schemes.ray import RayWeightSyncScheme, WeightSyncActorMixin
    from zmqsync.schemes.weights import WeightStrategy
    from zmqsync.schemes.zmq import ZMQWeightSyncScheme
    from zmqsync.sender import WeightSender
    from zmqsync.status_types import SenderStatus, WorkerStatus
    from zmqsync.tensors.extract import checksum
