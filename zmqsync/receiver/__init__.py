"""The worker's end: :class:`WeightReceiver` receives versions, checks them, applies them
whole or not at all, and acks them.

:mod:`.core` is the receiver and its loop, holding two parts: :mod:`.session` its
conversation with the sender (hellos, heartbeats, acks, failover) and :mod:`.applying` a
version's chunks into the model, which share its counts (:mod:`.stats`) and the
messages it refused (:mod:`.rejections`); :mod:`.observer` what it tells those who watch
it take versions (a relay); :mod:`.lock` the lock a forward pass holds.
"""

from zmqsync.receiver.applying import APPLY_MODES, KEEPS, STAGED_MAX_BYTES, Keep
from zmqsync.receiver.core import WeightReceiver
from zmqsync.receiver.lock import WeightsLock
from zmqsync.receiver.observer import PendingAck, ReceiverObserver
from zmqsync.receiver.session import FAILOVER_HEARTBEATS, FAILOVER_MIN_SECONDS

__all__ = [
    "APPLY_MODES",
    "FAILOVER_HEARTBEATS",
    "FAILOVER_MIN_SECONDS",
    "KEEPS",
    "STAGED_MAX_BYTES",
    "Keep",
    "PendingAck",
    "ReceiverObserver",
    "WeightReceiver",
    "WeightsLock",
]
