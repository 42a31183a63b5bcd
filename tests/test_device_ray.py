"""Device lending to Ray actors: versions on the learner's GPU written once into device
blocks the Ray hub lends to the actors whose model lives on that GPU (CUDA IPC handles,
one per actor, in :class:`~zmqsync.transport.shm.records.DeviceGrant` records).

Real actors on the session's local Ray cluster. CI has no GPU, so the learner and the
actors stand CPU shared memory in for CUDA IPC (``tests/_device_standin.py``): every
part but the CUDA calls runs as it is (``tests/test_cuda.py`` runs those on a GPU).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

import _device_standin
import pytest
import ray
import torch
from _faults import until
from conftest import ACTOR_START_TIMEOUT, actors_started, kill_actor
from torch import nn

import zmqsync
from zmqsync.schemes.ray import RayWeightSyncScheme
from zmqsync.transport.ray import RayHub, WeightSyncActorMixin

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

# This module is not importable in Ray's worker processes: ship its actor classes by value,
# and the stand-in they install.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(_device_standin)

#: Generous bound for one Ray call on a loaded 2-core machine.
CALL_TIMEOUT = 60.0


def device_model(seed: int) -> nn.Module:
    """About 4 MiB of weights (one device chunk a version) and a buffer."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 16))
    model.register_buffer("steps", torch.zeros(4, dtype=torch.int64))
    return model


def _bump(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
        model.steps += 1  # type: ignore[operator]


@ray.remote(num_cpus=0)
class DeviceActor(WeightSyncActorMixin):
    """A plain actor whose model lives on "the learner's device" (the stand-in's), or,
    ``on_device=False``, on a device the learner lends nothing on; ``opens=False``: it
    names the device but cannot open its blocks."""

    def __init__(self, seed: int, on_device: bool = True, opens: bool = True) -> None:
        if on_device:
            _device_standin.install(_device_standin.CpuIpc(opens=opens))
        self.model = device_model(seed)
        self.scheme: RayWeightSyncScheme | None = None

    def setup(self, scheme: RayWeightSyncScheme) -> int:
        self.scheme = scheme
        scheme.init_on_worker("policy", model=self.model)
        return os.getpid()

    def state(self) -> dict[str, Any]:
        assert self.scheme is not None
        with self.scheme.lock:
            receiver = self.scheme.get_receiver()
            return {
                "version": receiver.version,
                "checksum": zmqsync.checksum(self.model),
                "stats": dict(receiver.stats),
                "transport": receiver.transport.counters(),
            }


class Learner:
    """The learner's scheme and model, and its actors (killed at the end)."""

    def __init__(self, timeout: float = 10.0, **options: Any) -> None:
        # No timed repairs unless asked for: a loaded machine must not send versions
        # the test did not.
        options.setdefault("repair_after", 60.0)
        self.scheme = RayWeightSyncScheme(timeout=timeout, **options)
        self.model = device_model(0)
        self.actors: list[Any] = []
        self.pids: list[int] = []

    def start(self, *kinds: dict[str, bool]) -> None:
        self.actors = [DeviceActor.remote(100 + i, **kind) for i, kind in enumerate(kinds)]
        actors_started(self.actors)
        self.pids = ray.get(
            [a.setup.remote(self.scheme) for a in self.actors], timeout=ACTOR_START_TIMEOUT
        )
        self.scheme.init_on_sender("policy", remote_collectors=self.actors, source_model=self.model)
        self.scheme.connect(timeout=CALL_TIMEOUT)
        until(lambda: self.hub.counters()["actors_sharing"] == len(self.actors), 60, "joining")

    @property
    def hub(self) -> RayHub:
        hub = self.scheme.get_sender().transport
        assert isinstance(hub, RayHub)
        return hub

    def send(self, workers: list[int] | None = None) -> tuple[int, str]:
        """A new version (to ``workers``, else all); returns (version, checksum)."""
        _bump(self.model)
        self.scheme.send(worker_ids=workers)
        return self.scheme.get_sender().version, zmqsync.checksum(self.model)

    def states(self, which: list[int]) -> list[dict[str, Any]]:
        return ray.get([self.actors[i].state.remote() for i in which], timeout=CALL_TIMEOUT)

    def exact(self, which: list[int], version: int, checksum: str) -> list[dict[str, Any]]:
        states = self.states(which)
        assert [(s["version"], s["checksum"]) for s in states] == [(version, checksum)] * len(which)
        return states

    def close(self) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.scheme.shutdown()
        for actor in self.actors:
            ray.kill(actor, no_restart=True)


@pytest.fixture
def learner(on_the_stand_in: None) -> Iterator[Learner]:
    made = Learner()
    try:
        yield made
    finally:
        made.close()


def _device_chunks(states: list[dict[str, Any]]) -> list[int]:
    return [s["stats"]["device_chunks"] for s in states]


@pytest.mark.timeout(300)
def test_versions_go_through_device_blocks_to_actors_on_the_learners_device(
    learner: Learner,
) -> None:
    learner.start({}, {})
    model_bytes = sum(t.nbytes for t in learner.model.state_dict().values())
    # The first version after both said where their model lives may still go through
    # the host (they say so in a reply): then each goes in one device chunk.
    version, checksum = learner.send()
    learner.exact([0, 1], version, checksum)
    before = _device_chunks(learner.states([0, 1]))
    # More versions than device blocks: each is lent again once released.
    for _ in range(6):
        version, checksum = learner.send()
        states = learner.exact([0, 1], version, checksum)
    assert [a - b for a, b in zip(_device_chunks(states), before, strict=True)] == [6, 6]
    counts = learner.hub.counters()
    assert counts["device_sends"] >= 12
    assert model_bytes <= counts["device_bytes"] <= 3 * (model_bytes + (1 << 20))
    assert counts["bad_releases"] == counts["peers_lost"] == 0
    # The learner changes its weights in place without sending: no actor sees it.
    _bump(learner.model)
    learner.exact([0, 1], version, checksum)


@pytest.mark.timeout(300)
def test_an_actor_off_the_device_gets_every_version_through_the_host(
    learner: Learner,
) -> None:
    """One actor's model is not on the learner's device: nobody is lent device blocks,
    every version goes through the host (streamed through its shared memory, or, once
    the actors lend their tensors, written into them), and every actor holds every
    version."""
    learner.start({}, {"on_device": False})
    for _ in range(3):
        version, checksum = learner.send()
        states = learner.exact([0, 1], version, checksum)
    assert _device_chunks(states) == [0, 0]
    counts = learner.hub.counters()
    assert counts["device_sends"] == 0
    assert counts["shared_sends"] + counts.get("lent_writes", 0) >= 6, counts


@pytest.mark.timeout(300)
def test_an_actor_that_cannot_open_a_device_block_is_repaired_through_the_host(
    on_the_stand_in: None,
) -> None:
    """An actor names the learner's device but cannot open its blocks: the version lent
    there is lost to it (its lease released), it tells the hub it takes none, and that
    version (repaired) and every later one reach it through the host; the other keeps
    exact."""
    learner = Learner(timeout=30.0, repair_after=1.0)
    try:
        learner.start({}, {"opens": False})
        for _ in range(3):
            version, checksum = learner.send()
            states = learner.exact([0, 1], version, checksum)
        assert states[1]["stats"]["device_chunks"] == 0
        assert states[1]["transport"]["unread_device"] >= 1
        counts = learner.hub.counters()
        assert counts["bad_releases"] == counts["peers_lost"] == 0
        # Its refusal was heard: no device block is lent to anyone any more.
        sends = counts["device_sends"]
        for _ in range(2):
            version, checksum = learner.send()
            learner.exact([0, 1], version, checksum)
        assert learner.hub.counters()["device_sends"] == sends
    finally:
        learner.close()


@pytest.mark.timeout(300)
def test_versions_go_through_the_host_when_no_device_memory_is_lent(
    on_the_stand_in: None,
) -> None:
    learner = Learner(device_memory=False)
    try:
        learner.start({}, {})
        for _ in range(3):
            version, checksum = learner.send()
            states = learner.exact([0, 1], version, checksum)
        assert _device_chunks(states) == [0, 0]
        assert "device_bytes" not in learner.hub.counters()
    finally:
        learner.close()


@pytest.mark.timeout(300)
def test_a_killed_actor_lets_go_of_its_device_blocks(learner: Learner) -> None:
    learner.start({}, {}, {})
    for _ in range(2):
        version, checksum = learner.send()
        learner.exact([0, 1, 2], version, checksum)
    os.kill(learner.pids[2], signal.SIGKILL)
    until(lambda: learner.hub.counters()["peers_lost"] == 1, 60, "the killed actor is lost")
    before = _device_chunks(learner.states([0, 1]))
    model_bytes = sum(t.nbytes for t in learner.model.state_dict().values())
    for _ in range(5):
        version, checksum = learner.send([0, 1])
        states = learner.exact([0, 1], version, checksum)
        # Its leases ended with it: the blocks are lent again, no more are made.
        assert learner.hub.counters()["device_bytes"] <= 3 * (model_bytes + (1 << 20))
    assert [a - b for a, b in zip(_device_chunks(states), before, strict=True)] == [5, 5]
    kill_actor(learner.actors[2], CALL_TIMEOUT)
