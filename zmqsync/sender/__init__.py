"""The learner's end: :class:`WeightSender` versions one model's weights and gets them to
workers, acked.

:mod:`.core` is the sender: its send path, and what it does with workers' messages as
the fleet core decides. It holds its parts, each with its own state: :mod:`.versions`
the copies a version is streamed from and the snapshot; :mod:`.stats` its counts and
latencies; :mod:`.pump` a hub's pump thread, its window and stall clock. :mod:`.transfers`
holds what they pass around: a copy, a forwarded version, a stream to one hub.
"""

from zmqsync.sender.core import WeightSender, new_epoch
from zmqsync.sender.pump import PUMP_TICK, WINDOW
from zmqsync.sender.stats import LATENCY_BUCKETS

__all__ = ["LATENCY_BUCKETS", "PUMP_TICK", "WINDOW", "WeightSender", "new_epoch"]
