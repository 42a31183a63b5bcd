"""pytest plugin: run torchrl's own tests with zmqsync's schemes in place of torchrl's.

Not part of zmqsync's suite (its name does not start with ``test_``): ``run.sh`` loads
it (``-p zmqsync_subst``) into a run of torchrl's ``test/`` directory, before torchrl's
test modules import the scheme names. ``ZMQSYNC_SUBST`` picks the substitution:

- ``zmq``:  torchrl's ``SharedMemWeightSyncScheme`` and ``MultiProcessWeightSyncScheme``
  (the multiprocess collectors' defaults too) become ``zmqsync.torchrl.ZMQWeightSyncScheme``;
- ``pipe``: the same two become ``zmqsync.torchrl.MultiProcessWeightSyncScheme``;
- ``ray``:  torchrl's ``RayWeightSyncScheme`` (RayCollector's default) becomes
  ``zmqsync.torchrl.RayWeightSyncScheme``;
- ``none``: torchrl's own schemes (the baseline).
"""

from __future__ import annotations

import os

import torchrl.collectors._multi_base as _multi_base
import torchrl.collectors.distributed.ray as _ray_collector
import torchrl.weight_update as _weight_update

import zmqsync.torchrl as _zt

MODE = os.environ.get("ZMQSYNC_SUBST", "none")
if MODE not in ("none", "zmq", "pipe", "ray"):
    raise ValueError(f"ZMQSYNC_SUBST must be none, zmq, pipe or ray; got {MODE!r}")

if MODE in ("zmq", "pipe"):
    _ours = _zt.ZMQWeightSyncScheme if MODE == "zmq" else _zt.MultiProcessWeightSyncScheme
    for _name in ("SharedMemWeightSyncScheme", "MultiProcessWeightSyncScheme"):
        setattr(_weight_update, _name, _ours)
        if hasattr(_multi_base, _name):
            setattr(_multi_base, _name, _ours)
elif MODE == "ray":
    _weight_update.RayWeightSyncScheme = _zt.RayWeightSyncScheme  # type: ignore[misc]
    if hasattr(_ray_collector, "RayWeightSyncScheme"):
        _ray_collector.RayWeightSyncScheme = _zt.RayWeightSyncScheme  # type: ignore[misc]

# torchrl's Ray tests reserve one CPU per remote collector, plus other actors: on a
# 2-core machine they would wait forever for a third. Offer 16 logical CPUs, to
# torchrl's schemes and zmqsync's alike.
_ray_collector.DEFAULT_RAY_INIT_CONFIG["num_cpus"] = 16
_ray_collector.DEFAULT_RAY_INIT_CONFIG["include_dashboard"] = False
