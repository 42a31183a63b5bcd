"""Run as a script (its own Ray cluster, not the test session's): a learner sends to two
actors, calls ``ray.shutdown()`` while its scheme is still open, and then uses and closes
the scheme. Prints what it saw as one JSON line.

The sender's thread polls idle actors every 0.25 s; a Ray call after the shutdown would
start a new local cluster (Ray connects on first use) with none of these actors in it.
"""

from __future__ import annotations

import json
import logging
import time

import ray
import torch
from torch import nn

from zmqsync.schemes.ray import RayWeightSyncScheme
from zmqsync.transport.ray import WeightSyncActorMixin

#: Seconds for the cluster's and the actors' start on a loaded machine (set-up only).
SETUP_SECONDS = 180
#: Bound for the sender to find both actors lost: a few polls.
LOST_SECONDS = 20


@ray.remote(num_cpus=0)
class Actor(WeightSyncActorMixin):
    def __init__(self) -> None:
        self.model = nn.Linear(64, 64)

    def setup(self, scheme: RayWeightSyncScheme) -> None:
        self.scheme = scheme
        scheme.init_on_worker("policy", model=self.model)


def main() -> None:
    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level=logging.WARNING)
    model = nn.Linear(64, 64)
    scheme = RayWeightSyncScheme(timeout=5)
    fleet = [Actor.remote() for _ in range(2)]
    ray.get([a.setup.remote(scheme) for a in fleet], timeout=SETUP_SECONDS)
    scheme.init_on_sender("policy", remote_collectors=fleet, source_model=model)
    scheme.connect(timeout=SETUP_SECONDS)
    scheme.send()
    ray.shutdown()
    out: dict[str, object] = {}
    deadline = time.monotonic() + LOST_SECONDS
    while time.monotonic() < deadline and scheme.status()["totals"]["peers_lost"] < 2:
        time.sleep(0.05)
    out["lost"] = scheme.status()["totals"]["peers_lost"]
    out["ray_after_polls"] = ray.is_initialized()
    with torch.no_grad():
        model.weight.add_(1)
    try:
        scheme.send()
        out["send"] = "returned"
    except Exception as exc:
        out["send"] = f"{type(exc).__name__}: {exc}"
    scheme.shutdown()
    out["ray_at_end"] = ray.is_initialized()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
