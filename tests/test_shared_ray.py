"""``apply_mode="shared"`` for Ray actors on the learner's host: their weights become
read-only views of the blocks the Ray hub lends. Real actors on the session's local Ray
cluster (every actor is on the learner's host here)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

import _shared_workers
import pytest
import ray
import torch
from _faults import until
from _shared_workers import _read_only
from conftest import ACTOR_START_TIMEOUT, actors_started, kill_actor
from torch import nn

import zmqsync
from zmqsync import SyncTimeout
from zmqsync.chunking.layout import MIN_CHUNK_BYTES
from zmqsync.schemes.ray import RayWeightSyncScheme
from zmqsync.transport.ray import RayHub, WeightSyncActorMixin

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

# This module is not importable in Ray's worker processes: ship its actor classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
# ... and the shared-mode test helpers they call (``_read_only``).
ray.cloudpickle.register_pickle_by_value(_shared_workers)

#: Generous bound for one Ray call on a loaded 2-core machine.
CALL_TIMEOUT = 60.0


def shared_model(seed: int) -> nn.Module:
    """About 330 KB of weights (large enough for the hub's blocks) and a buffer."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64))
    model.register_buffer("steps", torch.zeros(4, dtype=torch.int64))
    return model


def _bump(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
        model.steps += 1  # type: ignore[operator]


@ray.remote(num_cpus=0)
class SharedActor(WeightSyncActorMixin):
    """A plain actor (as a collector is) whose model maps the learner's versions."""

    def __init__(self, seed: int) -> None:
        self.model = shared_model(seed)
        self.objects = [id(t) for t in self._tensors()]
        self.scheme: RayWeightSyncScheme | None = None

    def _tensors(self) -> list[torch.Tensor]:
        return list(self.model.parameters()) + list(self.model.buffers())

    def setup(self, scheme: RayWeightSyncScheme) -> int:
        """Join in the shared mode; returns this actor's pid (to stop it)."""
        self.scheme = scheme
        scheme.init_on_worker("policy", model=self.model, apply_mode="shared")
        return os.getpid()

    def state(self) -> dict[str, Any]:
        assert self.scheme is not None
        with self.scheme.lock:
            receiver = self.scheme.get_receiver()
            tensors = self._tensors()
            return {
                "version": receiver.version,
                "checksum": zmqsync.checksum(self.model),
                "stats": dict(receiver.stats),
                "same_objects": [id(t) for t in tensors] == self.objects,
                "read_only": all(_read_only(t) for t in tensors),
                "transport": receiver.transport.counters(),
            }

    def write(self) -> None:
        """Change the weights in place: a fault, the mapping is read-only."""
        with torch.no_grad():
            self.model[0].weight.add_(1.0)


class Learner:
    """The learner's scheme and model, and its actors (killed at the end)."""

    def __init__(self, timeout: float = 10.0, **options: Any) -> None:
        # No timed repairs: a loaded machine must not send versions the test did not.
        self.scheme = RayWeightSyncScheme(timeout=timeout, repair_after=60.0, **options)
        self.model = shared_model(0)
        self.actors: list[Any] = []
        self.pids: list[int] = []

    def start(self, count: int) -> None:
        self.actors = [SharedActor.remote(100 + i) for i in range(count)]
        actors_started(self.actors)
        self.pids = ray.get(
            [a.setup.remote(self.scheme) for a in self.actors], timeout=ACTOR_START_TIMEOUT
        )
        self.scheme.init_on_sender("policy", remote_collectors=self.actors, source_model=self.model)
        self.scheme.connect(timeout=CALL_TIMEOUT)

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

    def wait_joined_lending(self) -> None:
        """Until every actor answered the hub's offer (it can read the hub's blocks)."""
        until(lambda: self.hub.counters()["actors_sharing"] == len(self.actors), 60, "joining")

    def close(self) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.scheme.shutdown()
        for actor in self.actors:
            ray.kill(actor, no_restart=True)


def _exact(state: dict[str, Any], version: int, checksum: str) -> None:
    assert (state["version"], state["checksum"]) == (version, checksum)
    assert state["same_objects"], "a parameter is no longer the object it was"
    assert state["read_only"], "the actor's weights are writable"


@pytest.fixture
def learner() -> Iterator[Learner]:
    made = Learner()
    try:
        yield made
    finally:
        made.close()


@pytest.mark.timeout(300)
def test_actors_map_each_version_read_only_and_exact_and_a_late_joiner_maps_the_latest(
    learner: Learner,
) -> None:
    learner.start(3)
    learner.wait_joined_lending()
    for _ in range(4):
        version, checksum = learner.send()
        for state in learner.states([0, 1, 2]):
            _exact(state, version, checksum)
    for state in learner.states([0, 1, 2]):
        assert state["stats"]["shared_mapped"] >= 3  # mapped, not copied
        assert state["transport"]["shared_frames"] >= 3
    # The learner changes its weights in place without sending: no actor sees it.
    held = (version, checksum)
    _bump(learner.model)
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        assert [(s["version"], s["checksum"]) for s in learner.states([0, 1, 2])] == [held] * 3
    # A late joiner maps the latest version sent (not the learner's weights since), then
    # the next.
    late = SharedActor.remote(200)
    learner.actors.append(late)
    actors_started([late])
    learner.pids.append(ray.get(late.setup.remote(learner.scheme), timeout=ACTOR_START_TIMEOUT))
    assert learner.scheme.add_remote_collector(late) == 3
    until(lambda: learner.states([3])[0]["version"] == held[0], 60, "the late joiner caught up")
    _exact(learner.states([3])[0], *held)
    version, checksum = learner.send()
    for state in learner.states([0, 1, 2, 3]):
        _exact(state, version, checksum)
    assert learner.states([3])[0]["stats"]["shared_mapped"] >= 1
    # Shared memory stays bounded: the hub's blocks, a few versions' worth at most.
    model_bytes = sum(t.nbytes for t in learner.model.state_dict().values())
    counts = learner.hub.counters()
    assert counts["shm_bytes"] <= 4 * 2 * model_bytes
    assert counts["bad_releases"] == 0 and counts["actors_not_sharing"] == 0


@pytest.mark.timeout(300)
def test_actors_that_keep_their_versions_mapped_get_each_in_one_chunk() -> None:
    """Once every actor said it keeps its versions mapped (at the first it maps), each
    version goes in one chunk, not in ``chunk_bytes`` (64 KiB: the model takes six),
    and every actor maps it exactly."""
    learner = Learner(chunk_bytes=MIN_CHUNK_BYTES)
    try:
        learner.start(2)
        learner.wait_joined_lending()
        model_bytes = sum(t.nbytes for t in learner.model.state_dict().values())
        assert -(-model_bytes // MIN_CHUNK_BYTES) >= 5
        counts = []
        for _ in range(4):
            sender = learner.scheme.get_sender()
            before = sender.status()["totals"]["chunks_sent"]
            version, checksum = learner.send()
            for state in learner.states([0, 1]):
                _exact(state, version, checksum)
            counts.append(sender.status()["totals"]["chunks_sent"] - before)
        # An actor says it keeps versions in a call's reply, at the first it maps.
        assert counts[-2:] == [1, 1], counts
        for state in learner.states([0, 1]):
            # (Chunks this small travel inside the call, copied: the first versions.)
            assert state["stats"]["shared_mapped"] >= 2
    finally:
        learner.close()


@pytest.mark.timeout(300)
def test_without_the_hubs_blocks_an_actor_copies_each_version_read_only() -> None:
    """What an actor on another node gets: versions through Ray's object store, copied
    once into private memory made read-only, never the store's pages mapped."""
    learner = Learner(shared_memory=False)
    try:
        learner.start(2)
        for _ in range(2):
            version, checksum = learner.send()
            for state in learner.states([0, 1]):
                _exact(state, version, checksum)
        for state in learner.states([0, 1]):
            assert state["stats"]["shared_mapped"] == 0
            assert state["stats"]["shared_copied"] >= 2
        assert learner.hub.counters()["object_store_puts"] >= 2
    finally:
        learner.close()


@pytest.mark.timeout(300)
def test_an_actor_that_writes_its_weights_dies_and_the_others_stay_exact(
    learner: Learner,
) -> None:
    learner.start(3)
    learner.wait_joined_lending()
    version, checksum = learner.send()
    for state in learner.states([0, 1, 2]):
        _exact(state, version, checksum)
        assert state["stats"]["shared_mapped"] >= 1
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(learner.actors[0].write.remote(), timeout=CALL_TIMEOUT)
    for state in learner.states([1, 2]):
        assert (state["version"], state["checksum"]) == (version, checksum)
    # The learner goes on with the others.
    version, checksum = learner.send([1, 2])
    for state in learner.states([1, 2]):
        _exact(state, version, checksum)
    kill_actor(learner.actors[0], CALL_TIMEOUT)


@pytest.mark.timeout(300)
def test_a_stopped_actor_pins_its_version_and_catches_up() -> None:
    learner = Learner(timeout=3.0)
    try:
        learner.start(3)
        learner.wait_joined_lending()
        pinned = learner.send()
        for state in learner.states([0, 1, 2]):
            _exact(state, *pinned)
        os.kill(learner.pids[2], signal.SIGSTOP)
        model_bytes = sum(t.nbytes for t in learner.model.state_dict().values())
        mapped_before = [s["stats"]["shared_mapped"] for s in learner.states([0, 1])]
        for _ in range(5):
            version, checksum = learner.send([0, 1])
            for state in learner.states([0, 1]):
                _exact(state, version, checksum)
            # Bounded: the stopped actor pins one block, the others take turns.
            assert learner.hub.counters()["shm_bytes"] <= 4 * 2 * model_bytes
        mapped_after = [s["stats"]["shared_mapped"] for s in learner.states([0, 1])]
        assert all(a - b >= 4 for a, b in zip(mapped_after, mapped_before, strict=True))
        # Sent to all, versions wait in the stopped actor's calls: one more block is
        # leased to it, then it gets copies through the object store, and the others
        # keep mapping every version.
        for _ in range(3):
            _bump(learner.model)
            with pytest.raises(SyncTimeout) as info:
                learner.scheme.send()
            assert info.value.missing_workers == [2]
            latest = (learner.scheme.get_sender().version, zmqsync.checksum(learner.model))
            for state in learner.states([0, 1]):
                _exact(state, *latest)
            assert learner.hub.counters()["shm_bytes"] <= 4 * 2 * model_bytes
        counts = learner.hub.counters()
        assert counts["behind_sends"] >= 2 and counts["object_store_puts"] >= 2
        mapped_last = [s["stats"]["shared_mapped"] for s in learner.states([0, 1])]
        assert all(a - b == 3 for a, b in zip(mapped_last, mapped_after, strict=True))
        os.kill(learner.pids[2], signal.SIGCONT)
        # Resumed, it catches up with the latest version (it was sent copies), then maps
        # again.
        seen = []
        for _ in range(2):
            version, checksum = learner.send()
            states = learner.states([0, 1, 2])
            for state in states:
                _exact(state, version, checksum)
            seen.append(states[2]["stats"])
        assert seen[0]["shared_copied"] >= 2  # (version 0, before joining; then copies)
        assert seen[1]["shared_mapped"] == seen[0]["shared_mapped"] + 1
    finally:
        learner.close()
