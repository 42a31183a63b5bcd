"""zmqsync.torchrl in real torchrl collectors (spawned workers, real ZeroMQ sockets and
pipes). The Ray scheme under RayCollector is in test_torchrl_ray.py.

The environment and the policy are tiny and deterministic, so every action a worker
produced can be checked against the weights it should have held:
``action = observation @ W.T + b``.
"""

from __future__ import annotations

import os
import pickle
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

# CI installs the torchrl extra (`.ci/setup`): a missing torchrl is an error, not a skip.
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.collectors import MultiAsyncCollector, MultiSyncCollector
from torchrl.data import Composite, Unbounded
from torchrl.envs import EnvBase
from torchrl.envs.llm.transforms import PolicyVersion
from torchrl.weight_update import MultiProcessWeightSyncScheme as TorchRLPipeScheme

import zmqsync
import zmqsync.torchrl

NUM_WORKERS = 2
FRAMES_PER_BATCH = 16  # over both workers
EPISODE_STEPS = 4


class CounterEnv(EnvBase):
    """A 2-d observation ``[t, 1 - t/4]`` that counts steps; a 1-d action; 4-step episodes.

    Deterministic and independent of the action, so the action at every step is a known
    function of the policy's weights. ``worker`` (not seen by the policy) tells which
    collector worker produced a step.
    """

    def __init__(self, worker: int = 0) -> None:
        super().__init__(batch_size=torch.Size([]))
        self.observation_spec = Composite(
            observation=Unbounded(shape=(2,)),
            worker=Unbounded(shape=(1,), dtype=torch.int64),
            shape=(),
        )
        self.worker = worker
        self.action_spec = Unbounded(shape=(1,))
        self.reward_spec = Unbounded(shape=(1,))
        self._t = 0

    def _observation(self) -> torch.Tensor:
        return torch.tensor([float(self._t), 1.0 - self._t / EPISODE_STEPS])

    def _reset(self, tensordict: TensorDictBase | None, **kwargs: Any) -> TensorDictBase:
        self._t = 0
        return TensorDict(
            {
                "observation": self._observation(),
                "worker": torch.tensor([self.worker]),
                "done": torch.zeros(1, dtype=torch.bool),
                "terminated": torch.zeros(1, dtype=torch.bool),
            },
            batch_size=[],
        )

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        self._t += 1
        done = torch.tensor([self._t >= EPISODE_STEPS])
        return TensorDict(
            {
                "observation": self._observation(),
                "worker": torch.tensor([self.worker]),
                "reward": tensordict["action"].detach().clone(),
                "done": done,
                "terminated": done.clone(),
            },
            batch_size=[],
        )

    def _set_seed(self, seed: int | None) -> None:
        return None


def make_env(worker: int = 0) -> EnvBase:
    """Env factory (module level: spawned workers import it by name)."""
    return CounterEnv(worker)


def make_policy() -> TensorDictModule:
    torch.manual_seed(0)
    return TensorDictModule(nn.Linear(2, 1), in_keys=["observation"], out_keys=["action"])


def set_weights(policy: TensorDictModule, weight: tuple[float, float], bias: float) -> None:
    linear = policy.module
    with torch.no_grad():
        linear.weight.copy_(torch.tensor([weight]))
        linear.bias.fill_(bias)


def expected_actions(
    batch: TensorDictBase, weight: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    return batch["observation"] @ weight.T + bias


def from_weights(batch: TensorDictBase, policy_or_wb: Any) -> bool:
    """True if every action in ``batch`` is what these weights give."""
    if isinstance(policy_or_wb, nn.Module):
        weight, bias = policy_or_wb.module.weight.detach(), policy_or_wb.module.bias.detach()
    else:
        weight, bias = policy_or_wb
    return torch.allclose(batch["action"], expected_actions(batch, weight, bias), atol=1e-5)


def per_worker(batch: TensorDictBase) -> dict[int, TensorDictBase]:
    """Split a stacked MultiSyncCollector batch by the worker that produced each row."""
    assert batch.ndim == 2 and batch.shape[0] == NUM_WORKERS, batch.shape
    rows = {}
    for row in batch.unbind(0):
        rows[worker_of(row)] = row
    assert sorted(rows) == list(range(NUM_WORKERS))
    return rows


def worker_of(batch: TensorDictBase) -> int:
    """Which worker produced a batch (its env stamps every step)."""
    workers = batch["worker"].unique()
    assert workers.numel() == 1, f"a batch mixes workers {workers.tolist()}"
    return int(workers.item())


def close(collector: Any, scheme: Any, *, raise_on_error: bool = True) -> None:
    """Stop the workers, then the scheme (torchrl's shutdown leaves schemes open)."""
    try:
        collector.shutdown(raise_on_error=raise_on_error)
    finally:
        scheme.shutdown()


def snapshot(policy: TensorDictModule) -> tuple[torch.Tensor, torch.Tensor]:
    return policy.module.weight.detach().clone(), policy.module.bias.detach().clone()


@pytest.fixture
def policy() -> TensorDictModule:
    return make_policy()


def async_collector(policy: nn.Module, scheme: Any, **kwargs: Any) -> MultiAsyncCollector:
    return MultiAsyncCollector(
        [make_env] * NUM_WORKERS,
        policy,
        frames_per_batch=FRAMES_PER_BATCH // NUM_WORKERS,
        total_frames=-1,
        create_env_kwargs=[{"worker": i} for i in range(NUM_WORKERS)],
        weight_sync_schemes={"policy": scheme},
        **kwargs,
    )


def sync_collector(policy: nn.Module, scheme: Any, **kwargs: Any) -> MultiSyncCollector:
    return MultiSyncCollector(
        [make_env] * NUM_WORKERS,
        policy,
        frames_per_batch=FRAMES_PER_BATCH,
        total_frames=-1,
        cat_results="stack",
        create_env_kwargs=[{"worker": i} for i in range(NUM_WORKERS)],
        weight_sync_schemes={"policy": scheme},
        **kwargs,
    )


def versions(scheme: Any) -> dict[int, int]:
    return {w["worker"]: w["version"] for w in scheme.status()["workers"]}


def current(scheme: Any) -> set[int]:
    """The workers that acked the learner's latest version (0 included, which
    :func:`versions` cannot tell from "never joined")."""
    return set(scheme.get_sender().current_workers())


def check_targeting_and_isolation(
    collector: Any,
    batches: Iterator[TensorDictBase],
    policy: TensorDictModule,
    scheme: Any,
    *,
    held: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """With every worker at version 1 holding ``held``: ``worker_ids=[0]`` changes
    exactly worker 0, and the learner changing its weights without sending changes no
    worker (none aliases the learner's memory)."""
    set_weights(policy, (-1.0, 4.0), -0.25)
    newest = snapshot(policy)
    collector.update_policy_weights_(worker_ids=[0])
    assert versions(scheme) == {0: 2, 1: 1}
    assert scheme.worker_versions() == {0: 2, 1: 1}  # what each worker acked
    rows = per_worker(next(batches))
    assert from_weights(rows[0], newest)
    assert from_weights(rows[1], held)

    set_weights(policy, (7.0, 7.0), 7.0)
    rows = per_worker(next(batches))
    assert from_weights(rows[0], newest)
    assert from_weights(rows[1], held)


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    """Poll ``predicate`` until it holds; fail saying ``what`` did not happen."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout}s")
        time.sleep(0.02)


def make_scheme(transport: str, *, timeout: float) -> Any:
    """A zmqsync.torchrl scheme over ``transport``: ZeroMQ fan-out or addressed, or pipes."""
    if transport == "zmq-pubsub":
        return zmqsync.torchrl.ZMQWeightSyncScheme(mode="pubsub", timeout=timeout)
    if transport == "zmq-router":
        return zmqsync.torchrl.ZMQWeightSyncScheme(mode="router", timeout=timeout)
    if transport == "pipe":
        return zmqsync.torchrl.MultiProcessWeightSyncScheme(timeout=timeout)
    raise ValueError(transport)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["zmq-pubsub", "pipe"])
def test_multisync_initial_weights_update_targeting_isolation(
    policy: TensorDictModule, transport: str
) -> None:
    scheme = make_scheme(transport, timeout=10)
    collector = sync_collector(policy, scheme)
    try:
        batches = iter(collector)
        # Workers got the policy on the meta device: their first actions already come
        # from the learner's real initial weights.
        initial = snapshot(policy)
        first = next(batches)
        assert first.shape[0] == NUM_WORKERS
        assert from_weights(first, initial)
        # The zmqsync worker ids are torchrl's worker indices.
        pids = {w["worker"]: w["pid"] for w in scheme.status()["workers"]}
        assert pids == {i: proc.pid for i, proc in enumerate(collector.procs)}

        set_weights(policy, (0.5, -2.0), 3.0)
        new = snapshot(policy)
        assert not torch.allclose(new[0], initial[0])
        collector.update_policy_weights_()
        # Acked by every worker when the call returns.
        assert versions(scheme) == {0: 1, 1: 1}
        assert scheme.worker_versions() == {0: 1, 1: 1}
        batch = next(batches)
        assert from_weights(batch, new)

        check_targeting_and_isolation(collector, batches, policy, scheme, held=new)

        # Weights given as the policy's state_dict (flat dotted keys) under the default
        # tensordict strategy: the keys name the policy's nested ones.
        changed = snapshot(policy)
        collector.update_policy_weights_(policy.state_dict())
        assert versions(scheme) == {0: 3, 1: 3}
        assert all(from_weights(row, changed) for row in per_worker(next(batches)).values())
    finally:
        close(collector, scheme)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["zmq-router", "pipe"])
def test_multiasync_update_reaches_every_worker(policy: TensorDictModule, transport: str) -> None:
    scheme = make_scheme(transport, timeout=10)
    collector = async_collector(policy, scheme)
    try:
        batches = iter(collector)
        initial = snapshot(policy)
        first = next(batches)
        assert from_weights(first, initial)

        set_weights(policy, (0.5, -2.0), 3.0)
        new = snapshot(policy)
        collector.update_policy_weights_()
        assert versions(scheme) == {0: 1, 1: 1}
        # Async workers run ahead: a batch each may have been (partly) collected before
        # the update landed. After that, every batch comes from the new weights.
        seen_new: dict[int, bool] = {}
        for _ in range(12):
            batch = next(batches)
            worker = worker_of(batch)
            # Step by step (frames are in time order): each action comes whole from the
            # old or the new version, and once a worker acts on the new one it never
            # goes back.
            for step in batch.unbind(0):
                if from_weights(step, new):
                    seen_new[worker] = True
                else:
                    assert from_weights(step, initial), "an action from neither version"
                    assert not seen_new.get(worker), f"worker {worker} went back to old weights"
            if len(seen_new) == NUM_WORKERS:
                break
        assert sorted(seen_new) == list(range(NUM_WORKERS))
    finally:
        close(collector, scheme)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["zmq-pubsub", "pipe"])
def test_killed_worker_makes_the_update_raise(policy: TensorDictModule, transport: str) -> None:
    scheme = make_scheme(transport, timeout=3)
    collector = sync_collector(policy, scheme)
    try:
        batches = iter(collector)
        next(batches)
        victim = collector.procs[1]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        assert not victim.is_alive()

        set_weights(policy, (0.5, -2.0), 3.0)
        start = time.monotonic()
        with pytest.raises(zmqsync.SyncTimeout) as info:
            collector.update_policy_weights_()
        took = time.monotonic() - start
        assert set(info.value.missing_workers) == {1}
        assert "worker 1" in str(info.value)
        assert took <= scheme.timeout + 1.0, took
        if transport == "pipe":
            # The learner saw the pipe end: no other process (the learner, the sibling
            # worker) kept a copy of the dead worker's end open.
            assert scheme.status()["totals"]["peers_lost"] == 1
        # The live worker did get it, and can still be updated alone.
        assert versions(scheme)[0] == 1
        set_weights(policy, (1.0, 1.0), 1.0)
        collector.update_policy_weights_(worker_ids=[0])
        assert versions(scheme)[0] == 2
    finally:
        close(collector, scheme, raise_on_error=False)  # a worker is dead: expected


@pytest.mark.timeout(60)
def test_import_without_torchrl_says_what_to_install() -> None:
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torchrl'] = None\n"
        "try:\n    import zmqsync.torchrl\n"
        "except ImportError as exc:\n    print('IMPORT-ERROR:', exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    assert "IMPORT-ERROR:" in out.stdout
    assert "pip install" in out.stdout and "torchrl" in out.stdout


@pytest.mark.timeout(30)
def test_scheme_is_a_torchrl_scheme_with_zmqsync_arguments() -> None:
    from torchrl.weight_update import WeightSyncScheme

    scheme = zmqsync.torchrl.ZMQWeightSyncScheme("tensordict", mode="router", timeout=4)
    assert isinstance(scheme, WeightSyncScheme)
    assert (scheme.mode, scheme.timeout, scheme.endpoint) == ("router", 4.0, None)
    with pytest.raises(ValueError, match="retain_snapshot"):
        zmqsync.torchrl.ZMQWeightSyncScheme(retain_snapshot=False)
    with pytest.raises(RuntimeError, match="init_on_sender"):
        scheme.get_sender()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["MultiProcessWeightSyncScheme", "RayWeightSyncScheme"])
def test_pipe_and_ray_schemes_are_torchrl_schemes_with_zmqsync_arguments(name: str) -> None:
    import warnings

    from torchrl.weight_update import WeightSyncScheme

    cls = getattr(zmqsync.torchrl, name)
    with warnings.catch_warnings():
        # torchrl warns about ITS experimental state_dict strategy; zmqsync's is its own.
        warnings.simplefilter("error")
        scheme = cls(timeout=4, repair_after=0.5)
    assert isinstance(scheme, WeightSyncScheme)
    assert isinstance(scheme.zmqsync_scheme, getattr(zmqsync, name))
    assert (scheme.strategy_str, scheme.timeout) == ("tensordict", 4.0)  # torchrl's default
    assert scheme.zmqsync_scheme.sender_options == {"repair_after": 0.5}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cls("state_dict").strategy_str == "state_dict"
    with pytest.raises(ValueError, match="retain_snapshot"):
        cls(retain_snapshot=False)
    with pytest.raises(RuntimeError, match="init_on_sender"):
        scheme.get_sender()
    with pytest.raises(RuntimeError, match="init_on_receiver"):
        scheme.receive()


@pytest.mark.timeout(60)
def test_pipe_worker_side_in_process_own_end_meta_policy_targeting(
    policy: TensorDictModule,
) -> None:
    """The pipe scheme's worker steps without a collector. ``copy.copy`` stands in for
    the pickling into a spawned worker (the same state, the ends shared rather than
    duplicated: enough in one process; the collector tests spawn for real)."""
    import copy

    sender = zmqsync.torchrl.MultiProcessWeightSyncScheme(timeout=10, connect_timeout=20)
    sender.init_on_sender(model_id="policy", model=policy, num_workers=2)
    worker = copy.copy(sender)
    try:
        local = make_policy()
        local.module.to("meta")  # what torchrl ships to workers
        worker.init_on_receiver(model_id="policy", model=local, worker_idx=1)
        worker.connect(worker_idx=1)
        assert torch.equal(local.module.weight, policy.module.weight)
        # Joined as worker 1, on its own pipe (its ack of version 0 is on its way).
        wait_for(lambda: current(sender) == {1}, 20, "worker 1's ack")

        # (No sender.connect() here: in one process it would close the worker's end.)
        set_weights(policy, (0.5, -2.0), 3.0)
        sender.send(worker_ids=[1])
        assert versions(sender) == {0: 0, 1: 1}
        assert torch.equal(local.module.weight, policy.module.weight)
    finally:
        worker.shutdown()
        sender.shutdown()

    lone = zmqsync.torchrl.MultiProcessWeightSyncScheme(timeout=10)
    lone.init_on_sender(model_id="policy", model=policy, num_workers=1)
    stray = copy.copy(lone)
    try:
        with pytest.raises(RuntimeError, match=r"no pipe end for worker 5 .*workers \[0\]"):
            stray.init_on_receiver(model_id="policy", model=make_policy(), worker_idx=5)
    finally:
        stray.shutdown()
        lone.shutdown()


@pytest.mark.timeout(60)
def test_worker_side_in_process_meta_policy_lock_and_model_swap(policy: TensorDictModule) -> None:
    """The worker's steps without a collector: a pickled scheme, a meta policy, the
    forward lock, and torchrl re-pointing the scheme at a copied policy."""
    import copy
    import pickle

    sender = zmqsync.torchrl.ZMQWeightSyncScheme(timeout=10, connect_timeout=20)
    sender.init_on_sender(model_id="policy", model=policy, num_workers=1)
    worker = pickle.loads(pickle.dumps(sender))  # what spawn does
    try:
        assert worker.endpoint == sender.endpoint and not worker.initialized_on_sender
        local = make_policy()
        local.module.to("meta")  # what torchrl ships to workers
        worker.init_on_receiver(model_id="policy", model=local, worker_idx=0)
        worker.connect(worker_idx=0)
        assert not local.module.weight.is_meta
        assert torch.equal(local.module.weight, policy.module.weight)

        receiver = worker.get_receiver()
        held: list[bool] = []
        local.register_forward_pre_hook(lambda m, a: held.append(receiver.lock._is_owned()))
        local(TensorDict({"observation": torch.zeros(2)}, batch_size=[]))
        assert held == [True]  # a forward pass holds the lock: no half-applied version
        assert worker.receive() is None  # the background thread receives

        # torchrl's worker swaps in the collector's (copied) policy after connect.
        swapped = copy.deepcopy(local)
        worker.model = swapped
        set_weights(policy, (0.5, -2.0), 3.0)
        sender.connect()
        sender.send()
        assert torch.equal(swapped.module.weight, policy.module.weight)
        assert not torch.equal(local.module.weight, policy.module.weight)
    finally:
        worker.shutdown()
        sender.shutdown()


# --- per-frame policy versions (track_policy_version=True) ---------------------------

#: The two updates of the policy-version tests: (weight, bias) of each, in order.
UPDATES = (((0.5, -2.0), 3.0), ((-1.0, 4.0), -0.25))


def version_of_action(
    step: TensorDictBase, weights: list[tuple[torch.Tensor, torch.Tensor]]
) -> int:
    """Which of ``weights`` (listed by torchrl's version number) produced ``step``."""
    matches = [v for v, wb in enumerate(weights) if from_weights(step, wb)]
    assert len(matches) == 1, f"the action matches versions {matches}"
    return matches[0]


def collect_around_two_updates(
    collector: Any, policy: TensorDictModule, *, exact: bool
) -> tuple[dict[int, list[TensorDictBase]], list[int]]:
    """Collect a batch, update the policy twice, then collect until every worker has
    produced a batch wholly from the second update.

    Returns the batches collected after the updates, by worker, and the policy version
    ``collector.state_dict()`` saved for each worker. ``exact``: also check every frame
    is tagged with at least the version its action came from (zmqsync sets the tag
    under the receiver's lock, before a forward pass can see the new weights).
    """
    batches = iter(collector)
    weights = [snapshot(policy)]
    first = next(batches)
    assert (first["next", "policy_version"] == 0).all()  # torchrl: the initial weights are 0
    for weight, bias in UPDATES:
        set_weights(policy, weight, bias)
        weights.append(snapshot(policy))
        collector.update_policy_weights_()
    after: dict[int, list[TensorDictBase]] = {}
    caught_up: set[int] = set()
    for _ in range(16):
        batch = next(batches)
        for rows in per_worker(batch).values() if batch.ndim == 2 else [batch]:
            worker = worker_of(rows)
            after.setdefault(worker, []).append(rows)
            if from_weights(rows, weights[-1]):
                caught_up.add(worker)
        if len(caught_up) == NUM_WORKERS:
            break
    assert sorted(caught_up) == list(range(NUM_WORKERS)), "not every worker took the updates"
    if exact:
        for rows in after.values():
            for step in torch.cat(rows).unbind(0):
                produced = version_of_action(step, weights)
                assert produced <= int(step["next", "policy_version"]) <= len(UPDATES)
    state = collector.state_dict()
    saved = [int(state[f"worker{i}"]["policy_version"]) for i in range(NUM_WORKERS)]
    return after, saved


@pytest.fixture(scope="module")
def torchrl_reference() -> tuple[dict[int, list[TensorDictBase]], list[int]]:
    """What torchrl's own pipe scheme gives in MultiSyncCollector for the same steps."""
    policy = make_policy()
    scheme = TorchRLPipeScheme()
    collector = sync_collector(policy, scheme, track_policy_version=True)
    try:
        return collect_around_two_updates(collector, policy, exact=False)
    finally:
        close(collector, scheme)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["zmq-pubsub", "pipe"])
def test_multisync_tags_frames_and_saves_versions_like_torchrl(
    policy: TensorDictModule,
    transport: str,
    torchrl_reference: tuple[dict[int, list[TensorDictBase]], list[int]],
) -> None:
    scheme = make_scheme(transport, timeout=10)
    collector = sync_collector(policy, scheme, track_policy_version=True)
    try:
        after, saved = collect_around_two_updates(collector, policy, exact=True)
    finally:
        close(collector, scheme)
    reference, reference_saved = torchrl_reference
    assert saved == reference_saved == [len(UPDATES)] * NUM_WORKERS
    for worker in range(NUM_WORKERS):
        # Workers are idle during the updates: the batch after them is wholly the
        # second update's (the root key lags one step, in torchrl's as in ours).
        (ours,), (theirs,) = after[worker], reference[worker]
        assert (ours["next", "policy_version"] == len(UPDATES)).all()
        for key in ("policy_version", ("next", "policy_version")):
            assert torch.equal(ours[key], theirs[key]), key


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["zmq-router", "pipe"])
def test_multiasync_tags_frames_with_the_version_applied_in_the_background(
    policy: TensorDictModule, transport: str
) -> None:
    scheme = make_scheme(transport, timeout=10)
    collector = async_collector(policy, scheme, track_policy_version=True)
    try:
        # Async workers collect while the background thread applies the updates.
        after, saved = collect_around_two_updates(collector, policy, exact=True)
    finally:
        close(collector, scheme)
    assert saved == [len(UPDATES)] * NUM_WORKERS  # what torchrl's own pipe scheme saves
    for batches in after.values():
        assert (batches[-1]["next", "policy_version"] == len(UPDATES)).all()


class _Collector:
    """Stands in for the collector torchrl hands a worker's scheme (weakly held)."""

    def __init__(self, tracker: PolicyVersion) -> None:
        self.policy_version_tracker = tracker


@pytest.mark.timeout(60)
def test_version_applied_at_a_late_join_and_in_the_background_reaches_the_tracker(
    policy: TensorDictModule,
) -> None:
    """A torchrl worker connects before its collector exists, then hands the collector
    over: the tracker gets the version taken at connect (here a late joiner's), and
    then each one the background thread applies."""
    sender = zmqsync.torchrl.ZMQWeightSyncScheme(timeout=10, connect_timeout=20)
    sender.init_on_sender(model_id="policy", model=policy, num_workers=1)  # version 0
    worker = pickle.loads(pickle.dumps(sender))  # what spawn does
    try:
        set_weights(policy, *UPDATES[0])
        sender.send(worker_ids=[])  # version 1, before the worker joins
        local = make_policy()
        worker.init_on_receiver(model_id="policy", model=local, worker_idx=0)
        worker.connect(worker_idx=0)
        assert worker.get_receiver().version == 1
        collector = _Collector(PolicyVersion())
        worker.context = collector
        assert collector.policy_version_tracker.version == 1  # torchrl's count: 1 update

        set_weights(policy, *UPDATES[1])
        sender.connect()
        sender.send()  # applied (and the tracker set) by the background thread
        assert collector.policy_version_tracker.version == 2

        # A uuid tracker gets one new id per version, not one per handing over.
        uuids = _Collector(PolicyVersion("uuid"))
        worker.context = uuids
        first = uuids.policy_version_tracker.version
        worker.context = uuids
        assert uuids.policy_version_tracker.version == first
        sender.send()
        assert uuids.policy_version_tracker.version != first
    finally:
        worker.shutdown()
        sender.shutdown()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "name", ["ZMQWeightSyncScheme", "MultiProcessWeightSyncScheme", "RayWeightSyncScheme"]
)
def test_connect_timeout_is_the_zmqsync_schemes_own(name: str) -> None:
    """One setting: what the torchrl class waits is what its zmqsync scheme waits (and
    what a worker's copy of it waits)."""
    import pickle

    cls = getattr(zmqsync.torchrl, name)
    assert cls().connect_timeout == cls().zmqsync_scheme.connect_timeout == 120.0
    scheme = cls(timeout=3, connect_timeout=7)
    assert (scheme.timeout, scheme.connect_timeout) == (3.0, 7.0)
    assert scheme.zmqsync_scheme.connect_timeout == 7.0
    worker = pickle.loads(pickle.dumps(scheme))
    assert worker.connect_timeout == worker.zmqsync_scheme.connect_timeout == 7.0


@pytest.mark.timeout(30)
def test_torchrl_builds_zmqsync_schemes_by_backend_name() -> None:
    """``from_backend`` knows zmqsync's schemes once zmqsync.torchrl is imported, and
    torchrl's own names still give torchrl's schemes."""
    import torchrl.weight_update as trl

    for name, cls in [
        ("zmq", zmqsync.torchrl.ZMQWeightSyncScheme),
        ("zmqsync-zmq", zmqsync.torchrl.ZMQWeightSyncScheme),
        ("zmqsync-pipe", zmqsync.torchrl.MultiProcessWeightSyncScheme),
        ("zmqsync-ray", zmqsync.torchrl.RayWeightSyncScheme),
    ]:
        scheme = trl.WeightSyncScheme.from_backend(name, timeout=4, connect_timeout=9)
        assert type(scheme) is cls, name
        assert (scheme.timeout, scheme.connect_timeout) == (4.0, 9.0)
        assert zmqsync.torchrl.BACKENDS[name] is cls
    router = trl.WeightSyncScheme.from_backend("zmq", mode="router")
    assert router.mode == "router"

    for name, torchrl_cls in [
        ("process", trl.MultiProcessWeightSyncScheme),
        ("multiprocessing", trl.MultiProcessWeightSyncScheme),
        ("ray", trl.RayWeightSyncScheme),
        ("shared", trl.SharedMemWeightSyncScheme),
        ("none", trl.NoWeightSyncScheme),
    ]:
        assert type(trl.WeightSyncScheme.from_backend(name)) is torchrl_cls, name
