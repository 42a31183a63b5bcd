"""zmqsync's schemes as torchrl ``WeightSyncScheme`` subclasses, for torchrl collectors.

Under torchrl's names and arguments, for ``weight_sync_schemes=``:
:class:`ZMQWeightSyncScheme` (ZeroMQ, workers on any host) and
:class:`MultiProcessWeightSyncScheme` (a pipe per worker) for ``MultiSyncCollector`` /
``MultiAsyncCollector``, :class:`RayWeightSyncScheme` for ``RayCollector``. Each
delegates to the zmqsync scheme of the same name. Importing this module registers them
with torchrl (see :data:`BACKENDS`)::

    collector = MultiSyncCollector(
        [make_env] * 2, policy, frames_per_batch=64, total_frames=-1,
        weight_sync_schemes={"policy": zmqsync.torchrl.MultiProcessWeightSyncScheme()},
    )
    collector.update_policy_weights_()                # every worker holds it on return
    collector.update_policy_weights_(worker_ids=[0])  # exactly worker 0
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Final

try:
    from torchrl.weight_update import weight_sync_schemes as _torchrl_registry
except ImportError as exc:  # pragma: no cover - exercised only without torchrl
    raise ImportError(
        "zmqsync.torchrl needs torchrl, which is not installed (or failed to import: "
        f"{exc}). Install it with `pip install 'zmqsync[torchrl]'` (or `pip install torchrl`), "
        "or use zmqsync's schemes directly without torchrl's collectors."
    ) from exc

from zmqsync.torchrl._collector import _CollectorScheme
from zmqsync.torchrl._schemes import (
    MultiProcessWeightSyncScheme,
    RayWeightSyncScheme,
    ZMQWeightSyncScheme,
)

__all__ = [
    "BACKENDS",
    "MultiProcessWeightSyncScheme",
    "RayWeightSyncScheme",
    "ZMQWeightSyncScheme",
]


#: The names ``torchrl.weight_update.WeightSyncScheme.from_backend`` knows zmqsync's
#: schemes by once this module is imported. torchrl has no ZeroMQ backend, so "zmq" is
#: zmqsync's; the pipe and Ray schemes take prefixed names, leaving torchrl's own
#: "process" and "ray" to torchrl's schemes.
BACKENDS: Final[Mapping[str, type[_CollectorScheme]]] = types.MappingProxyType(
    {
        "zmq": ZMQWeightSyncScheme,
        "zmqsync-zmq": ZMQWeightSyncScheme,
        "zmqsync-pipe": MultiProcessWeightSyncScheme,
        "zmqsync-ray": RayWeightSyncScheme,
    }
)


def _register_backends() -> None:
    taken = getattr(_torchrl_registry, "_WEIGHT_SYNC_SCHEMES", {})
    for name, cls in BACKENDS.items():
        if name in taken and not issubclass(taken[name], _CollectorScheme):
            # A torchrl with a backend of that name keeps it: "zmqsync-zmq" still works.
            continue
        _torchrl_registry.register_weight_sync_backend(name)(cls)


_register_backends()
