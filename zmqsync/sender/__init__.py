"""The learner's end: :class:`WeightSender` versions one model's weights and gets them to
workers, acked.

:mod:`.core` is the sender and its send path; :mod:`.copying` the copies a version is
streamed from; :mod:`.transfers` those copies and the streams to each hub; :mod:`.pump` a
hub's pump thread and its window; :mod:`.handling` what the pumps do with workers'
messages; :mod:`.waiting` how a send waits for acks; :mod:`.reporting` its status.
"""

from zmqsync.sender.core import WeightSender, new_epoch
from zmqsync.sender.pump import PUMP_TICK, WINDOW
from zmqsync.sender.reporting import LATENCY_BUCKETS

__all__ = ["LATENCY_BUCKETS", "PUMP_TICK", "WINDOW", "WeightSender", "new_epoch"]
