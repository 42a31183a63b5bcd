"""``lend_tensors=True`` for Ray actors on the learner's host: each actor that reads the
Ray hub's blocks (proof that it is on this host) lends the memory its tensors live in,
and the learner writes each version straight into it. Real actors on the session's
local Ray cluster."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import _lent_workers
import pytest
import ray
import torch
from _faults import until
from _lent_workers import hub_blocks, in_lent_memory
from conftest import ACTOR_START_TIMEOUT, actors_started
from torch import nn

import zmqsync
from zmqsync.schemes.ray import RayWeightSyncScheme
from zmqsync.transport.ray import RayHub, WeightSyncActorMixin
from zmqsync.transport.shm.blocks import SHM_AVAILABLE

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("ray_cluster"),
    pytest.mark.skipif(not SHM_AVAILABLE, reason="memfd is Linux's"),
]

# This module is not importable in Ray's worker processes: ship its actor class by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
# ... and the helper it calls (``in_lent_memory``).
ray.cloudpickle.register_pickle_by_value(_lent_workers)

CALL_TIMEOUT = 60.0


def lent_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64))


@ray.remote(num_cpus=0)
class LendingActor(WeightSyncActorMixin):
    """A plain actor (as a collector is) that lends its model's tensors."""

    def __init__(self, seed: int) -> None:
        self.model = lent_model(seed)
        self.objects = [id(p) for p in self.model.parameters()]
        self.scheme: RayWeightSyncScheme | None = None

    def setup(self, scheme: RayWeightSyncScheme) -> int:
        self.scheme = scheme
        scheme.init_on_worker("policy", model=self.model, lend_tensors=True)
        return os.getpid()

    def pid(self) -> int:
        return os.getpid()

    def state(self) -> dict[str, Any]:
        assert self.scheme is not None
        with self.scheme.lock:
            receiver = self.scheme.get_receiver()
            params = list(self.model.parameters())
            return {
                "version": receiver.version,
                "checksum": zmqsync.checksum(self.model),
                "stats": {k: v for k, v in receiver.stats.items() if isinstance(v, int)},
                "same_objects": [id(p) for p in params] == self.objects,
                "lent": all(in_lent_memory(p) for p in params),
            }


@pytest.fixture
def learner(monkeypatch) -> Iterator[tuple[RayWeightSyncScheme, nn.Module, list[Any]]]:
    from zmqsync.sender import core

    # The model is 80 KB, which streams by default; and every go must count, even from
    # an actor slowed down by a loaded machine.
    monkeypatch.setattr(core, "LENT_MIN_BYTES", 0)
    monkeypatch.setattr(core, "LENT_GO_WAIT", 20.0)
    scheme = RayWeightSyncScheme(timeout=30.0, repair_after=60.0, lend_tensors=True)
    model = lent_model(0)
    actors = [LendingActor.remote(100 + i) for i in range(2)]
    try:
        actors_started(actors)
        ray.get([a.setup.remote(scheme) for a in actors], timeout=ACTOR_START_TIMEOUT)
        scheme.init_on_sender("policy", remote_collectors=actors, source_model=model)
        scheme.connect(timeout=CALL_TIMEOUT)
        yield scheme, model, actors
    finally:
        with contextlib.suppress(Exception):
            scheme.shutdown()
        for actor in actors:
            ray.kill(actor, no_restart=True)


@pytest.mark.timeout(300)
def test_actors_on_the_learners_host_take_each_version_into_their_lent_tensors(learner) -> None:
    scheme, model, actors = learner
    hub = scheme.get_sender().transport
    assert isinstance(hub, RayHub)
    until(lambda: hub.counters()["actors_sharing"] == len(actors), 60, "joining")
    for _ in range(6):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        scheme.send()
        version, checksum = scheme.get_sender().version, zmqsync.checksum(model)
        states = ray.get([a.state.remote() for a in actors], timeout=CALL_TIMEOUT)
        for state in states:  # send() returned: each actor holds exactly that version
            assert (state["version"], state["checksum"]) == (version, checksum)
            assert state["same_objects"]
    for state in ray.get([a.state.remote() for a in actors], timeout=CALL_TIMEOUT):
        # The first versions came as streams (an actor lends once it joined the hub's
        # memory and a version was whole); the rest were written into its tensors.
        assert state["lent"] and state["stats"]["lent_applied"] >= 3, state["stats"]
    counts = hub.counters()
    assert counts["lent_peers"] == 2 and counts["lent_writes"] >= 6, counts
    assert counts["bad_releases"] == 0, counts
    # Versions go only into lent tensors: the driver keeps no block a version was written
    # into, and the actors map none of its blocks.
    assert hub_blocks(os.getpid())[1] == 0
    pids = ray.get([a.pid.remote() for a in actors], timeout=CALL_TIMEOUT)
    assert all(hub_blocks(pid) == (0, 0) for pid in pids), [hub_blocks(p) for p in pids]
