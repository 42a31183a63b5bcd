"""zmqsync's schemes as torchrl ``WeightSyncScheme`` subclasses, for torchrl collectors.

torchrl's collectors accept any ``torchrl.weight_update.WeightSyncScheme`` in
``weight_sync_schemes=``; this module offers zmqsync's under the same names and
arguments:

- :class:`ZMQWeightSyncScheme`: ZeroMQ (fan-out or addressed), for
  ``MultiSyncCollector`` / ``MultiAsyncCollector`` (and workers on other hosts).
- :class:`MultiProcessWeightSyncScheme`: one duplex pipe per worker process, for
  ``MultiSyncCollector`` / ``MultiAsyncCollector``.
- :class:`RayWeightSyncScheme`: Ray calls and Ray's object store, for
  ``torchrl.collectors.distributed.RayCollector``.

::

    from torchrl.collectors import MultiSyncCollector
    import zmqsync.torchrl

    collector = MultiSyncCollector(
        [make_env] * 2, policy, frames_per_batch=64, total_frames=-1,
        weight_sync_schemes={"policy": zmqsync.torchrl.MultiProcessWeightSyncScheme()},
    )
    ...train policy...
    collector.update_policy_weights_()                # every worker holds it on return
    collector.update_policy_weights_(worker_ids=[0])  # exactly worker 0

How a multiprocess collector drives a scheme, and what each step does here:

- learner, ``init_on_sender(model_id=, context=collector, ctx=)``, before any worker
  starts: ZMQ binds its sockets; the pipe scheme makes one duplex ``ctx.Pipe()`` per
  worker and serves the learner's ends. Both publish the policy's current weights
  as version 0 (kept as the late-joiner snapshot; no worker is waited for). A
  collector built from a ``policy_factory`` only has no weights to publish: its
  workers keep their own until the first explicit update (version 1).
- the scheme is pickled into each spawned worker: settings and the endpoint, and for
  the pipe scheme the workers' pipe ends (a connection pickles while a process is being
  spawned). No sockets, threads, model or CURVE secret key travel.
- worker, ``init_on_receiver(model=policy, worker_idx=i)`` then ``connect()``: torchrl
  ships the policy's structure on the ``meta`` device, so the policy is first given real
  (CPU) storage, then ``connect()`` returns with version 0 (or newer) copied into it,
  and a background thread applies every later version. A pipe worker keeps its own pipe
  end and closes its siblings' at once.
- learner, ``connect()`` (after every worker started): the pipe scheme closes its copies
  of the workers' ends, so a worker that dies is seen at once (end of file).
- learner, ``update_policy_weights_(worker_ids=...)`` -> ``send``: returns once every
  targeted worker applied the version, or raises :class:`zmqsync.SyncTimeout` naming
  those that did not (a killed worker, for one) after ``timeout`` seconds.

Unlike torchrl's own schemes, a worker never aliases the learner's memory: it holds its
own copy, changed only by a send. A forward pass of the worker's policy holds the
receiver's lock (forward hooks), so it never runs on half of a version.

:class:`RayWeightSyncScheme` under ``RayCollector``: ``init_on_sender(remote_collectors=)``
starts calling each remote collector actor; torchrl then ships the scheme to each actor
(``register_scheme_receiver``), where ``init_on_receiver`` registers a receiver and
returns at once. The learner's calls reach it through Ray's built-in ``__ray_call__``,
which every Ray actor has, so torchrl's collector classes need no method of zmqsync's
(a method added inside the actor later would be unknown to the learner's handle, and
``cascade_execute("_receiver_schemes[...]...")`` fails until torchrl has registered the
scheme there): each call hands its frames to the receiver registered in that process
(none yet: the call returns nothing), which applies a version and acks on the same
call. The actor joins (hello, snapshot) through those calls, and torchrl's lazy
``connect()`` on the learner returns once every actor holds the latest version.

Each class delegates to the zmqsync scheme of the same name (composition): the torchrl
class only adapts torchrl's calling conventions and bookkeeping.

Importing this module registers the classes with torchrl's backend registry (see
:data:`BACKENDS`): ``WeightSyncScheme.from_backend("zmq")`` builds
:class:`ZMQWeightSyncScheme`.
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
