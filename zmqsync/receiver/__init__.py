"""The worker's end: :class:`WeightReceiver` receives versions, checks them, applies them
whole or not at all, and acks them.

:mod:`.core` is the receiver and its loop; :mod:`.session` its conversation with the
sender (joining, heartbeats, acks, failover); :mod:`.applying` a version's chunks into
the model; :mod:`.lock` the lock a forward pass holds.
"""

from zmqsync.receiver.applying import APPLY_MODES, STAGED_MAX_BYTES
from zmqsync.receiver.core import WeightReceiver
from zmqsync.receiver.lock import WeightsLock
from zmqsync.receiver.session import FAILOVER_HEARTBEATS, FAILOVER_MIN_SECONDS

__all__ = [
    "APPLY_MODES",
    "FAILOVER_HEARTBEATS",
    "FAILOVER_MIN_SECONDS",
    "STAGED_MAX_BYTES",
    "WeightReceiver",
    "WeightsLock",
]
