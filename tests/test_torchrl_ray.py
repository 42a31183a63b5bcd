"""zmqsync.torchrl.RayWeightSyncScheme in torchrl's RayCollector, on a real local Ray
cluster with two real remote collectors (torchrl's own ``Collector`` class as Ray actors).

The environment and policy are test_torchrl's: tiny and deterministic, so every action a
remote collector produced can be checked against the weights it should have held.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import test_torchrl
import test_torchrl_factories
import torch
from conftest import kill_actor
from tensordict.nn import TensorDictModule
from test_torchrl import (
    NUM_WORKERS,
    UPDATES,
    check_targeting_and_isolation,
    current,
    from_weights,
    make_env,
    make_policy,
    per_worker,
    set_weights,
    snapshot,
    versions,
    wait_for,
)
from torchrl.collectors.distributed import RayCollector

import zmqsync
import zmqsync.torchrl

pytestmark = pytest.mark.slow

FRAMES_PER_BATCH = 16  # over both remote collectors (sync=True splits it evenly)


@pytest.fixture(scope="module", autouse=True)
def ray_for_collectors(ray_cluster: None) -> Iterator[None]:
    """conftest's session cluster; this module and test_torchrl (env, policy) travel to
    Ray's workers by value: they cannot import test modules."""
    for module in (sys.modules[__name__], test_torchrl, test_torchrl_factories):
        ray.cloudpickle.register_pickle_by_value(module)
    yield


def _pid(actor: Any) -> int:
    return os.getpid()


def ray_collector(policy: TensorDictModule, scheme: Any, **collector_kwargs: Any) -> RayCollector:
    return RayCollector(
        # Each remote collector's env stamps its index on every step.
        [functools.partial(make_env, i) for i in range(NUM_WORKERS)],
        policy,
        frames_per_batch=FRAMES_PER_BATCH,
        total_frames=1000 * FRAMES_PER_BATCH,  # RayCollector reads -1 as "none", not endless
        sync=True,
        # No CPU reservation: the 2-core test cluster must also fit other tests' actors.
        remote_configs={"num_cpus": 0},
        # quiet: no policy transform is needed
        collector_kwargs={"auto_register_policy_transforms": False, **collector_kwargs},
        weight_sync_schemes={"policy": scheme},
    )


@pytest.mark.timeout(180)
def test_raycollector_initial_weights_update_targeting_isolation_and_killed_actor() -> None:
    """One RayCollector (starting Ray actors that import torch is the slow part) for the
    whole story: join, update, targeting, isolation, then a killed actor."""
    policy = make_policy()
    scheme = zmqsync.torchrl.RayWeightSyncScheme(timeout=4)
    collector = ray_collector(policy, scheme)
    try:
        initial = snapshot(policy)
        # The actors join through the learner's calls as soon as torchrl hands them the
        # scheme: each holds version 0, the learner's weights when the collector was built.
        wait_for(lambda: current(scheme) == {0, 1}, 60, "both actors joining")
        # zmqsync's worker ids are RayCollector's worker indices.
        pids = {w["worker"]: w["pid"] for w in scheme.status()["workers"]}
        actor_pids = ray.get(
            [rc.__ray_call__.remote(_pid) for rc in collector.remote_collectors], timeout=60
        )
        assert pids == dict(enumerate(actor_pids))

        # First update: torchrl's lazy connect (every actor holds the latest version),
        # then version 1, applied by both actors when the call returns.
        set_weights(policy, (0.5, -2.0), 3.0)
        new = snapshot(policy)
        assert not torch.allclose(new[0], initial[0])
        collector.update_policy_weights_()
        assert versions(scheme) == {0: 1, 1: 1}
        batches = iter(collector)
        rows = per_worker(next(batches))
        assert from_weights(rows[0], new) and from_weights(rows[1], new)

        # RayCollector passes worker_ids on: remote collector 0 only, then isolation.
        check_targeting_and_isolation(collector, batches, policy, scheme, held=new)

        # A killed actor: the update raises, naming it, instead of hanging. (ray.kill is
        # asynchronous: wait until the actor is really gone, or it may still take the
        # update, which over shared memory takes milliseconds.)
        kill_actor(collector.remote_collectors[1])
        set_weights(policy, (1.0, 1.0), 1.0)
        start = time.monotonic()
        with pytest.raises(zmqsync.SyncTimeout) as info:
            collector.update_policy_weights_()
        took = time.monotonic() - start
        assert info.value.missing_workers == [1]
        assert "worker 1" in str(info.value)
        assert took <= scheme.timeout + 1.0, took
        assert scheme.status()["totals"]["peers_lost"] == 1  # Ray told us it died
        # The live actor did get it, and can still be updated alone.
        assert versions(scheme)[0] == 3
        collector.update_policy_weights_(worker_ids=[0])
        assert versions(scheme)[0] == 4
    finally:
        collector.shutdown()  # kills the actors, then shuts the scheme down
        scheme.shutdown()  # idempotent: for a failure before the collector got it


@pytest.mark.timeout(180)
def test_raycollector_tags_frames_and_saves_the_version_each_actor_applied() -> None:
    """track_policy_version=True: after two updates each remote collector's frames and
    state_dict() carry 2, torchrl's count of updates (what its own schemes give)."""
    policy = make_policy()
    scheme = zmqsync.torchrl.RayWeightSyncScheme(timeout=10)
    collector = ray_collector(policy, scheme, track_policy_version=True)
    try:
        wait_for(lambda: current(scheme) == {0, 1}, 60, "both actors joining")
        assert [int(s["policy_version"]) for s in collector.state_dict()] == [0, 0]
        for weight, bias in UPDATES:
            set_weights(policy, weight, bias)
            collector.update_policy_weights_()
        assert versions(scheme) == {0: 2, 1: 2}  # the learner's version: updates counted
        rows = per_worker(next(iter(collector)))
        for row in rows.values():
            assert from_weights(row, snapshot(policy))
            assert (row["next", "policy_version"] == len(UPDATES)).all()
        saved = [int(s["policy_version"]) for s in collector.state_dict()]
        assert saved == [len(UPDATES)] * NUM_WORKERS
    finally:
        collector.shutdown()
        scheme.shutdown()


@pytest.mark.timeout(60)
def test_actor_side_joins_without_blocking_torchrl_connect() -> None:
    """In a plain Ray actor, torchrl's receiver-side connect() (RayCollector runs it via
    cascade_execute) must return at once: the learner's calls that let the actor join
    run only after it returns. And receive() is a no-op there."""
    policy = make_policy()
    sender = zmqsync.torchrl.RayWeightSyncScheme(timeout=10, connect_timeout=30)

    @ray.remote(num_cpus=0)
    class Holder:
        """A plain (one call at a time) actor that is not a torchrl collector."""

        def __init__(self) -> None:
            self.policy = make_policy()
            with torch.no_grad():
                self.policy.module.weight.zero_()

        def register(self, scheme: Any) -> None:
            self.scheme = scheme
            scheme.init_on_receiver(model_id="policy", context=self, worker_idx=0)
            scheme.connect()  # returns at once
            assert scheme.receive() is None

        def weight(self) -> list[float]:
            with self.scheme.lock:
                return self.policy.module.weight.flatten().tolist()

        def stop(self) -> None:
            self.scheme.shutdown()

    holder = Holder.remote()
    try:
        sender.init_on_sender(model_id="policy", model=policy, remote_collectors=[holder])
        ray.get(holder.register.remote(sender), timeout=30)
        sender.connect()  # every actor holds the latest version on return
        assert current(sender) == {0}
        assert (
            ray.get(holder.weight.remote(), timeout=30) == policy.module.weight.flatten().tolist()
        )
        set_weights(policy, (0.5, -2.0), 3.0)
        sender.send()
        assert ray.get(holder.weight.remote(), timeout=30) == [0.5, -2.0]
        ray.get(holder.stop.remote(), timeout=30)
    finally:
        sender.shutdown()
        ray.kill(holder, no_restart=True)


@pytest.mark.timeout(180)
def test_raycollector_with_a_random_policy_has_nothing_to_sync() -> None:
    """A RandomPolicy has no weights: the scheme is a no-op that works (no sockets, no
    waiting), and the collector collects and takes updates as with torchrl's schemes."""
    from torchrl.collectors import RandomPolicy

    policy = RandomPolicy(make_env(0).action_spec)
    scheme = zmqsync.torchrl.RayWeightSyncScheme(timeout=5, connect_timeout=30)
    collector = ray_collector(policy, scheme)
    try:
        batches = iter(collector)
        first = next(batches)
        assert first.numel() > 0
        collector.update_policy_weights_()
        assert next(batches).numel() > 0
        assert scheme.worker_versions() == {}
        assert scheme.status()["weightless"] is True
    finally:
        collector.shutdown()


def ray_factory_collector(factory: Any, scheme: Any) -> RayCollector:
    return RayCollector(
        [functools.partial(make_env, i) for i in range(NUM_WORKERS)],
        policy_factory=factory,
        frames_per_batch=FRAMES_PER_BATCH,
        total_frames=1000 * FRAMES_PER_BATCH,
        sync=True,
        remote_configs={"num_cpus": 0},
        # One dict per collector: given one dict, torchrl 0.14 shares it between the
        # remote collectors and writes each one's policy_factory into it, so every
        # remote collector would build its policy with the last factory.
        collector_kwargs=[{"auto_register_policy_transforms": False} for _ in range(NUM_WORKERS)],
        weight_sync_schemes={"policy": scheme},
    )


@pytest.mark.timeout(240)
def test_factory_only_raycollector_takes_weights_from_the_first_update() -> None:
    """RayCollector from a policy_factory: the remote collectors do not exist when the
    learner's scheme starts, and there is no policy to take weights from. The first
    ``update_policy_weights_(weights)`` reaches every actor; distinct factories give
    each actor weights of its own, updated by worker."""
    from test_torchrl_factories import ConstantPolicy, actions_by_worker, constant

    scheme = zmqsync.torchrl.RayWeightSyncScheme(timeout=20)
    collector = ray_factory_collector(ConstantPolicy(3.0), scheme)
    try:
        collector.update_policy_weights_(constant(10.0))
        assert scheme.worker_versions() == {0: 1, 1: 1}
        assert actions_by_worker(next(iter(collector))) == {0: 10.0, 1: 10.0}
    finally:
        collector.shutdown()
        scheme.shutdown()

    scheme = zmqsync.torchrl.RayWeightSyncScheme(timeout=20)
    collector = ray_factory_collector([ConstantPolicy(0.0), ConstantPolicy(1.0)], scheme)
    try:
        assert actions_by_worker(next(iter(collector))) == {0: 0.0, 1: 1.0}
        collector.update_policy_weights_({1: constant(5.0)})
        assert scheme.per_worker_weights
        assert scheme.worker_versions() == {0: 0, 1: 1}
        assert actions_by_worker(next(iter(collector))) == {0: 0.0, 1: 5.0}
    finally:
        collector.shutdown()
        scheme.shutdown()


@pytest.mark.timeout(240)
def test_a_remote_multiprocess_collector_hands_each_update_to_its_own_workers() -> None:
    """A RayCollector whose remote collector is itself a MultiSyncCollector (with worker
    processes of its own), built from a policy_factory: the remote collector holds no
    policy, so the version is kept by its receiver and handed on to its workers
    (through torchrl's own scheme there) before the actor acks. The learner's update
    returns once the workers two levels down act with the new weights."""
    from test_torchrl_factories import ConstantPolicy, acts, constant
    from torchrl.collectors import MultiSyncCollector

    scheme = zmqsync.torchrl.RayWeightSyncScheme(timeout=60)
    collector = RayCollector(
        [make_env],
        policy_factory=ConstantPolicy(3.0),
        collector_class=MultiSyncCollector,
        frames_per_batch=FRAMES_PER_BATCH,
        total_frames=1000 * FRAMES_PER_BATCH,
        sync=True,
        remote_configs={"num_cpus": 0},
        collector_kwargs={"auto_register_policy_transforms": False},
        weight_sync_schemes={"policy": scheme},
    )
    try:
        batches = iter(collector)
        assert acts(next(batches), 3.0)  # the factory's, in the inner workers
        collector.update_policy_weights_(constant(10.0))
        assert scheme.worker_versions() == {0: 1}
        assert acts(next(batches), 10.0)
        collector.update_policy_weights_(constant(-4.0))
        assert acts(next(batches), -4.0)
    finally:
        collector.shutdown()
        scheme.shutdown()
