"""Transport over Ray: the hub calls a method on each worker actor; replies come back as
the calls' results.

The driver's side is :class:`RayHub` (:mod:`.driver`); the actor's side, which never
imports Ray, is :class:`RaySpoke` and :func:`deliver` (:mod:`.actor`). The actor's class
provides the method the hub calls by inheriting :class:`WeightSyncActorMixin` (or by
defining a method that calls :func:`deliver`)::

    @ray.remote
    class Collector(WeightSyncActorMixin):
        def __init__(self, scheme):
            self.policy = make_policy()
            scheme.init_on_worker("policy", model=self.policy)   # registers a RaySpoke
"""

from zmqsync.transport.ray.actor import DELIVER_METHOD, RaySpoke, WeightSyncActorMixin, deliver
from zmqsync.transport.ray.driver import POLL_INTERVAL, RayHub, peer_id

__all__ = [
    "DELIVER_METHOD",
    "POLL_INTERVAL",
    "RayHub",
    "RaySpoke",
    "WeightSyncActorMixin",
    "deliver",
    "peer_id",
]
