"""MixedWeightSyncScheme: one sender serving pipe, ZeroMQ and Ray workers at the same
time: one version counter, unique worker ids, exact targeting across transports, and a
timeout that names every missing worker with its transport."""

from __future__ import annotations

import pickle
import sys
import time
from typing import Any

import _workers
import pytest
import ray
import torch
from conftest import SPAWN, Fleet, kill_actor

import zmqsync
from zmqsync import (
    MixedWeightSyncScheme,
    MultiProcessWeightSyncScheme,
    RayWeightSyncScheme,
    SyncTimeout,
    ZMQSyncError,
    ZMQWeightSyncScheme,
)
from zmqsync.transport.ray import WeightSyncActorMixin

# Ray's workers cannot import the test modules: ship them by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(_workers)

#: Generous bound for one Ray call or one worker's start on a loaded 2-core machine.
CALL_TIMEOUT = 60.0


def _bump(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))


# --- in one process: the scheme's rules ------------------------------------------------------


def _pipe_worker(member: MultiProcessWeightSyncScheme, pipe: Any, seed: int) -> Any:
    """A pipe worker in this process: its own copy of the member, as if pickled to it."""
    scheme = pickle.loads(pickle.dumps(member))
    scheme.init_on_worker("policy", pipe=pipe, model=_workers.make_model(seed=seed))
    return scheme


def test_mixed_scheme_in_one_process_numbers_workers_and_refuses_clashes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = _workers.make_model(seed=0)
    pipes = [SPAWN.Pipe() for _ in range(2)]
    pipe_member = MultiProcessWeightSyncScheme("tensordict")
    zmq_member = ZMQWeightSyncScheme("tensordict", endpoint=f"ipc://{tmp_path}/mixed")
    mixed = MixedWeightSyncScheme(pipe_member, zmq_member, timeout=5)
    mixed.init_on_sender("policy", model=model, num_workers=3, pipes=[p for p, _ in pipes])
    workers: list[Any] = []
    try:
        assert sorted(mixed.sender_transports) == [0, 1]  # the pipes' ids, reserved
        # A ZeroMQ worker without an id gets the lowest id no pipe holds, even before
        # the pipe workers first speak.
        auto = pickle.loads(pickle.dumps(zmq_member))
        auto.init_on_receiver(model_id="policy", model=_workers.make_model(seed=3))
        workers.append(auto)
        auto.connect(timeout=10)
        assert auto.worker_idx == 2
        for i, (_, child) in enumerate(pipes):
            workers.append(_pipe_worker(pipe_member, child, seed=10 + i))
            workers[-1].connect(timeout=10)
        # A ZeroMQ worker claiming a pipe's id is refused, clearly.
        clash = pickle.loads(pickle.dumps(zmq_member))
        clash.init_on_receiver(model_id="policy", model=_workers.make_model(seed=4), worker_idx=0)
        with pytest.raises(ZMQSyncError, match="worker id 0 is already taken: a pipe worker holds"):
            clash.connect(timeout=5)
        clash.shutdown()
        for w in workers:
            w.start_receiver_thread()

        _bump(model)
        mixed.send()
        assert {w.worker_idx: zmqsync.checksum(w.model) for w in workers} == {
            i: zmqsync.checksum(model) for i in range(3)
        }
        version = mixed.get_sender().version
        assert [w.get_receiver().version for w in workers] == [version] * 3
        assert mixed.worker_versions() == dict.fromkeys(range(3), version)
        transports = {w["worker"]: w["transport"] for w in mixed.status()["workers"]}
        assert transports == {0: "pipe", 1: "pipe", 2: "zmq-pubsub"}
        # The ZeroMQ member pickles into its workers with the address the sender bound.
        assert pickle.loads(pickle.dumps(zmq_member)).endpoint == mixed.endpoint
    finally:
        for w in workers:
            w.shutdown()
        mixed.shutdown()
        mixed.shutdown()  # idempotent


@pytest.mark.timeout(120)
def test_mixed_fleet_workers_whose_model_does_not_fit_fail_connect(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A pipe worker whose model has a layer more and a ZeroMQ worker whose model is
    float64: each connect() used to return as if synced. The learner, serving both
    transports from one sender, counts both refusals and goes on serving a worker that
    fits."""
    model = _workers.make_model(seed=0)
    pipes = [SPAWN.Pipe() for _ in range(2)]
    pipe_member = MultiProcessWeightSyncScheme("state_dict")
    zmq_member = ZMQWeightSyncScheme("state_dict", mode="router", endpoint=f"ipc://{tmp_path}/m")
    mixed = MixedWeightSyncScheme(pipe_member, zmq_member, timeout=10)
    mixed.init_on_sender("policy", model=model, num_workers=None, pipes=[p for p, _ in pipes])
    workers: list[Any] = []
    try:
        _bump(model)
        mixed.send()  # version 1: nobody has joined yet, so it waits for nobody

        longer = torch.nn.Sequential(*_workers.make_model(seed=1), torch.nn.Linear(4, 2))
        wider = _workers.make_model(seed=2).double()
        misfits = [
            (pickle.loads(pickle.dumps(pipe_member)), {"pipe": pipes[0][1]}, longer, "4.weight"),
            (pickle.loads(pickle.dumps(zmq_member)), {"worker_idx": 2}, wider, "0.weight"),
        ]
        says = {
            "4.weight": "weights lack '4.weight' (and 1 more) that the model has",
            "0.weight": "'0.weight' is float32 in the weights but float64 in the model",
        }
        for scheme, options, net, key in misfits:
            workers.append(scheme)
            before = zmqsync.checksum(net)
            scheme.init_on_worker("policy", model=net, **options)
            with pytest.raises(zmqsync.SchemaMismatchError) as info:
                scheme.connect(timeout=10)
            assert info.value.key == key and says[key] in str(info.value)
            assert zmqsync.checksum(net) == before and scheme.get_receiver().version == 0

        def rejections() -> dict[int, list[str]]:
            return {w["worker"]: w["rejections"] for w in mixed.status()["workers"]}

        deadline = time.monotonic() + 10
        while not all(rejections().get(w) for w in (0, 2)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert says["4.weight"] in rejections()[0][-1]
        assert says["0.weight"] in rejections()[2][-1]

        good = _pipe_worker(pipe_member, pipes[1][1], seed=3)
        workers.append(good)
        good.connect(timeout=10)
        assert good.get_receiver().version == 1
        assert zmqsync.checksum(good.model) == zmqsync.checksum(model)
        good.start_receiver_thread()
        _bump(model)
        mixed.send(worker_ids=[1])
        assert good.get_receiver().version == 2
        assert zmqsync.checksum(good.model) == zmqsync.checksum(model)
        start = time.monotonic()
        for scheme, *_ in misfits:
            scheme.shutdown()
        assert time.monotonic() - start < 5.0
    finally:
        for w in workers:
            w.shutdown()
        mixed.shutdown()
        for parent, child in pipes:
            parent.close()
            child.close()


def test_mixed_scheme_says_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="share one strategy"):
        MixedWeightSyncScheme(
            MultiProcessWeightSyncScheme("state_dict"), ZMQWeightSyncScheme("tensordict")
        )
    with pytest.raises(ValueError, match="at least one"):
        MixedWeightSyncScheme()
    with pytest.raises(TypeError, match="moves no weights"):
        MixedWeightSyncScheme(zmqsync.NoWeightSyncScheme())
    member = ZMQWeightSyncScheme("state_dict")
    with pytest.raises(ValueError, match="twice"):
        MixedWeightSyncScheme(member, member)

    model = _workers.make_model(seed=0)
    mixed = MixedWeightSyncScheme(ZMQWeightSyncScheme("state_dict"))
    with pytest.raises(ValueError, match="no member scheme takes them"):
        mixed.init_on_sender("policy", model=model, pipes=[])
    with pytest.raises(RuntimeError, match="init_on_worker on the member"):
        mixed.init_on_receiver(model_id="policy", model=model)
    with pytest.raises(RuntimeError, match="init_on_sender"):
        mixed.get_sender()

    # Two transports cannot both hold worker 0 (here both pipe members read the same
    # context's pipes).
    a = SPAWN.Pipe()

    class Context:
        pipes = {0: a[0]}

    clash = MixedWeightSyncScheme(MultiProcessWeightSyncScheme(), MultiProcessWeightSyncScheme())
    try:
        with pytest.raises(ValueError, match="unique across the fleet"):
            clash.init_on_sender("policy", Context(), model=model)
    finally:
        for end in a:
            end.close()


# --- processes and actors: pipe + ZeroMQ + Ray at once ---------------------------------------


@ray.remote(num_cpus=0)
class MixedActor(WeightSyncActorMixin):
    """A Ray actor with its own copy of the test model."""

    def __init__(self, seed: int) -> None:
        self.model = _workers.make_model(seed=seed)
        self.scheme: RayWeightSyncScheme | None = None

    def setup(self, scheme: RayWeightSyncScheme) -> None:
        self.scheme = scheme
        scheme.init_on_worker("policy", model=self.model)

    def state(self) -> tuple[int | None, int, str]:
        assert self.scheme is not None
        with self.scheme.lock:
            receiver = self.scheme.get_receiver()
            digest = zmqsync.checksum(self.model, "state_dict")
            return self.scheme.worker_idx, receiver.version, digest


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_one_scheme_serves_pipe_zmq_and_ray_workers_at_once(
    fleet: Fleet, ray_cluster: None, tmp_path: Any
) -> None:
    """2 pipe workers (0, 1), 2 Ray actors (2, 3) and 2 ZeroMQ worker processes (5 given,
    4 numbered by the sender) behind one MixedWeightSyncScheme."""
    model = _workers.make_model(seed=0)
    pipe_member = MultiProcessWeightSyncScheme("state_dict")
    ray_member = RayWeightSyncScheme("state_dict")
    zmq_member = ZMQWeightSyncScheme("state_dict", mode="pubsub", endpoint=f"ipc://{tmp_path}/hub")
    mixed = MixedWeightSyncScheme(pipe_member, ray_member, zmq_member, timeout=5)
    pipes = [SPAWN.Pipe() for _ in range(2)]
    actors = [MixedActor.remote(100 + i) for i in range(2)]
    try:
        ray.get([a.setup.remote(ray_member) for a in actors], timeout=CALL_TIMEOUT)
        mixed.init_on_sender(
            "policy",
            model=model,
            num_workers=6,
            pipes=[parent for parent, _ in pipes],
            remote_collectors=actors,
        )
        for i, (_, child) in enumerate(pipes):
            fleet.start(pipe_member, i, init_kwargs={"pipe": child, "worker_idx": None})
            child.close()  # the worker holds it now: its death breaks the pipe at once
        # Worker 5 names itself; the other asks the sender, which gives the lowest id
        # that neither a pipe, an actor nor a live worker holds: 4.
        fleet.start(zmq_member, 5)
        fleet.start(zmq_member, 4, init_kwargs={"worker_idx": None})
        for i in (0, 1, 4, 5):
            fleet.wait_ready(i, timeout=CALL_TIMEOUT)
        mixed.connect(timeout=CALL_TIMEOUT)  # all six joined

        def states() -> dict[int, tuple[int, str]]:
            """worker id (as the worker itself knows it) -> (version, checksum)."""
            out = {}
            for i in (0, 1, 4, 5):
                if fleet.procs[i].is_alive():
                    s = fleet.ask(i, "state")
                    out[s["worker_idx"]] = (s["version"], s["checksum"])
            for actor in actors:
                try:
                    idx, version, digest = ray.get(actor.state.remote(), timeout=CALL_TIMEOUT)
                except ray.exceptions.RayActorError:
                    continue
                out[idx] = (version, digest)
            return out

        def latest() -> tuple[int, str]:
            return mixed.get_sender().version, zmqsync.checksum(model, "state_dict")

        # connect() is a rendez-vous on every transport: before any send, every worker
        # (each built from a seed of its own) holds the learner's weights, version 0.
        assert states() == {i: latest() for i in range(6)}
        assert latest()[0] == 0

        # Every worker on every transport exact after each send(), one version counter.
        for _ in range(2):
            _bump(model)
            mixed.send()
            assert states() == {i: latest() for i in range(6)}
        transports = {w["worker"]: w["transport"] for w in mixed.status()["workers"]}
        assert transports == {
            0: "pipe",
            1: "pipe",
            2: "ray",
            3: "ray",
            4: "zmq-pubsub",
            5: "zmq-pubsub",
        }

        # Targeting crosses transports: exactly workers 1, 3 and 5 change.
        before = states()
        _bump(model)
        mixed.send(worker_ids=[1, 3, 5])
        after = states()
        assert {i for i in range(6) if after[i] != before[i]} == {1, 3, 5}
        assert all(after[i] == latest() for i in (1, 3, 5))

        # A dead pipe worker and a dead actor: the timeout names both, with transports.
        fleet.kill(0)
        kill_actor(actors[0], CALL_TIMEOUT)
        start = time.monotonic()
        with pytest.raises(SyncTimeout) as info:
            mixed.send()
        took = time.monotonic() - start
        assert info.value.missing_workers == [0, 2]
        assert info.value.transports == {0: "pipe", 2: "ray"}
        # Both transports know their worker is gone: no waiting out the timeout.
        assert took < mixed.timeout, took
        assert str(info.value).count("its transport says it is gone") == 2

        # The living, on all three transports, still get the next version.
        _bump(model)
        mixed.send(worker_ids=[1, 3, 4, 5])
        assert states() == {i: latest() for i in (1, 3, 4, 5)}
    finally:
        mixed.shutdown()
        fleet.close()
        for actor in actors:
            ray.kill(actor, no_restart=True)
        for parent, child in pipes:
            parent.close()
            child.close()
