"""The seeds' scheme surface: names, aliases, errors, properties, pickling."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal

import cloudpickle
import pytest
import torch
from _workers import bump, make_model
from conftest import SPAWN, Fleet
from tensordict import TensorDict
from torch import nn

import zmqsync
from zmqsync import (
    NoWeightSyncScheme,
    SchemaMismatchError,
    WeightSyncScheme,
    ZMQWeightSyncScheme,
    checksum,
)


def test_public_names_are_pinned() -> None:
    assert sorted(zmqsync.__all__) == zmqsync.__all__
    assert {
        "WeightSyncScheme",
        "ZMQWeightSyncScheme",
        "NoWeightSyncScheme",
        "WeightSender",
        "WeightReceiver",
        "SyncTimeout",
        "FrameError",
    } <= set(zmqsync.__all__)
    for name in zmqsync.__all__:
        assert hasattr(zmqsync, name), name


def test_error_tree() -> None:
    assert issubclass(zmqsync.SyncTimeout, TimeoutError)
    assert issubclass(zmqsync.FrameError, ValueError)
    assert issubclass(zmqsync.SchemaMismatchError, ValueError)
    assert issubclass(zmqsync.TransportClosed, zmqsync.TransportError)
    for err in (
        zmqsync.SyncTimeout,
        zmqsync.FrameError,
        zmqsync.TransportError,
        zmqsync.WeightsRejected,
        zmqsync.EndpointError,
    ):
        assert issubclass(err, zmqsync.ZMQSyncError)


def test_getters_before_init_raise_runtime_error() -> None:
    scheme = ZMQWeightSyncScheme()
    with pytest.raises(RuntimeError, match="init_on_sender"):
        scheme.get_sender()
    with pytest.raises(RuntimeError, match="init_on_receiver"):
        scheme.get_receiver()
    with pytest.raises(RuntimeError, match="init_on_sender"):
        scheme.send()
    with pytest.raises(RuntimeError, match="no endpoint"):
        scheme.init_on_receiver(model_id="policy")
    with pytest.raises(RuntimeError, match="first"):
        scheme.connect()
    assert scheme.model_id is None and scheme.worker_idx is None and scheme.weights is None
    assert scheme.shared_transport is None and scheme.receiver_transport is None
    assert scheme.sender_transports == {}


def test_bad_arguments_are_explained() -> None:
    with pytest.raises(ValueError, match="mode"):
        ZMQWeightSyncScheme(mode="broadcast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="strategy"):
        ZMQWeightSyncScheme("pickle")  # type: ignore[arg-type]
    with pytest.raises(zmqsync.EndpointError, match="tcp://HOST:PORT"):
        ZMQWeightSyncScheme(endpoint="localhost:5555").init_on_sender(
            "policy", model=nn.Linear(1, 1)
        )
    with pytest.raises(zmqsync.EndpointError, match="needs a host and a port"):
        ZMQWeightSyncScheme(endpoint="tcp://localhost").init_on_sender(
            "policy", model=nn.Linear(1, 1)
        )


@pytest.mark.parametrize("dumps", [pickle.dumps, cloudpickle.dumps])
def test_sender_scheme_pickles_into_a_worker_and_syncs(dumps) -> None:  # type: ignore[no-untyped-def]
    model = nn.Linear(3, 2)
    scheme = ZMQWeightSyncScheme("state_dict", mode="router", timeout=5)
    scheme.init_on_sender("policy", context=None, model=model, num_workers=1)
    worker = pickle.loads(dumps(scheme))
    try:
        assert worker.endpoint == scheme.endpoint and worker.model is None
        local = nn.Linear(3, 2)
        worker.init_on_worker("policy", model=local, worker_idx=0)  # older name
        worker.connect(worker_idx=0)
        assert scheme.shared_transport is not None and worker.receiver_transport is not None
        scheme.connect(timeout=5)  # sender side: every expected worker has connected
        scheme.send_async()
        assert worker.receive(timeout=5) is local
        scheme.wait_async()
        assert checksum(local) == checksum(model)
        assert worker.get_receiver().version == 1 and worker.worker_idx == 0
        assert scheme.status()["workers"][0]["version"] == 1
    finally:
        worker.shutdown()
        scheme.shutdown()
        scheme.shutdown()  # idempotent


def test_context_provides_model_and_num_workers() -> None:
    class Collector:
        num_workers = 1

        def __init__(self) -> None:
            self.policy = nn.Linear(2, 2)

        def get_model(self, model_id: str) -> nn.Module:
            return getattr(self, model_id)

    collector = Collector()
    with ZMQWeightSyncScheme(endpoint="memory://ctx") as scheme:
        scheme.init_on_sender("policy", context=collector)
        assert scheme.model is collector.policy and scheme.context is collector
        assert scheme.get_sender().num_workers == 1
        assert isinstance(scheme.weights, TensorDict)


def test_prepare_and_apply_weights() -> None:
    src, dst = nn.Linear(3, 2), nn.Linear(3, 2)
    scheme = ZMQWeightSyncScheme("state_dict")
    scheme._model = dst
    prepared = scheme.prepare_weights(src, "policy", zmqsync.WeightStrategy("state_dict"))
    assert set(prepared) == {"weight", "bias"}
    ptr = dst.weight.data_ptr()
    scheme.apply_weights(prepared)
    assert checksum(dst) == checksum(src) and dst.weight.data_ptr() == ptr
    with pytest.raises(SchemaMismatchError, match="bias"):
        scheme.apply_weights({"weight": torch.zeros(2, 3)})
    other = nn.Linear(3, 2)
    scheme.apply_weights(other.state_dict(), inplace=False)
    assert checksum(dst) == checksum(other)


def test_no_weight_sync_scheme_does_nothing() -> None:
    scheme = NoWeightSyncScheme()
    assert scheme.strategy == "tensordict"
    model = nn.Linear(2, 2)
    scheme.init_on_sender("policy", model=model)
    scheme.send()
    scheme.send_async()
    scheme.wait_async()
    scheme.connect(worker_idx=0)
    assert scheme.receive(timeout=0.1) is None
    assert scheme.model_id == "policy" and scheme.model is model
    assert scheme.create_transport().name == "none"
    scheme.shutdown()
    scheme.shutdown()


def _rejections_of(scheme: ZMQWeightSyncScheme, worker: int, timeout: float = 10.0) -> list[str]:
    """The refusals the learner counted for ``worker``, once there are any (the ack
    travels on its own socket and may still be on its way)."""
    deadline = time.monotonic() + timeout
    while True:
        status = {w["worker"]: w for w in scheme.status()["workers"]}
        rejections: list[str] = status.get(worker, {}).get("rejections", [])
        if rejections or time.monotonic() >= deadline:
            return rejections
        time.sleep(0.01)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["pubsub", "router"])
@pytest.mark.parametrize(
    ("make_model", "key", "says"),
    [
        (lambda: nn.Linear(4, 5), "weight", "'weight' has shape [3, 4] in the weights but [5, 4]"),
        (
            lambda: nn.Linear(4, 3, bias=False),
            "bias",
            "weights carry 'bias', which the model lacks",
        ),
    ],
    ids=["shape", "key"],
)
def test_a_worker_whose_model_does_not_fit_fails_connect(
    tmp_path: Path,
    mode: Literal["pubsub", "router"],
    make_model: Callable[[], nn.Module],
    key: str,
    says: str,
) -> None:
    """connect() used to return as if synced while the worker kept its own weights."""
    learner = ZMQWeightSyncScheme(
        "state_dict", mode=mode, endpoint=f"ipc://{tmp_path}/learner", timeout=10
    )
    model = nn.Linear(4, 3)
    learner.init_on_sender("policy", model=model, num_workers=None)
    workers: list[ZMQWeightSyncScheme] = []
    try:
        learner.send()  # version 1; nobody has joined yet, so it waits for nobody
        wrong = make_model()
        before = checksum(wrong, "state_dict")
        bad = pickle.loads(pickle.dumps(learner))
        workers.append(bad)
        bad.init_on_receiver(model_id="policy", model=wrong, worker_idx=1)
        with pytest.raises(SchemaMismatchError) as info:
            bad.connect(timeout=10)
        assert says in str(info.value) and f"at {learner.endpoint} " in str(info.value)
        assert info.value.key == key
        assert checksum(wrong, "state_dict") == before
        assert bad.get_receiver().version == 0
        # The learner was told, and counted it.
        assert says in _rejections_of(learner, 1)[-1]
        start = time.monotonic()
        bad.shutdown()
        assert time.monotonic() - start < 2.0

        # The learner serves a worker that fits, on connect and on the next send.
        good = pickle.loads(pickle.dumps(learner))
        workers.append(good)
        right = nn.Linear(4, 3)
        good.init_on_receiver(model_id="policy", model=right, worker_idx=0)
        good.connect(timeout=10)
        assert checksum(right, "state_dict") == checksum(model, "state_dict")
        good.start_receiver_thread()
        with torch.no_grad():
            model.weight.add_(1.0)
        learner.send(worker_ids=[0])
        assert good.get_receiver().version == 2
        assert checksum(right, "state_dict") == checksum(model, "state_dict")
    finally:
        for w in workers:
            w.shutdown()
        learner.shutdown()


# --- connecting is not syncing: connect_timeout ------------------------------------------


def test_a_worker_waits_connect_timeout_for_the_sender_not_the_send_timeout(
    tmp_path: Path,
) -> None:
    """The send timeout is kept short to see dead workers quickly; joining got it too."""
    learner = ZMQWeightSyncScheme(endpoint=f"ipc://{tmp_path}/nobody", timeout=0.2)
    assert learner.connect_timeout == zmqsync.schemes.base.DEFAULT_CONNECT_TIMEOUT == 120.0
    learner.connect_timeout = 1.5
    worker = pickle.loads(pickle.dumps(learner))  # what spawn does
    assert (worker.timeout, worker.connect_timeout) == (0.2, 1.5)
    worker.init_on_receiver(model_id="policy", model=nn.Linear(2, 2), worker_idx=0)
    try:
        start = time.monotonic()
        with pytest.raises(zmqsync.SyncTimeout, match=r"within 1\.5s"):
            worker.connect()  # nobody is bound there
        assert 1.4 <= time.monotonic() - start < 5.0
        start = time.monotonic()
        with pytest.raises(zmqsync.SyncTimeout, match=r"within 0\.3s"):
            worker.connect(timeout=0.3)  # an explicit timeout still wins
        assert time.monotonic() - start < 1.2
    finally:
        worker.shutdown()


def _pipe_learner(scheme: WeightSyncScheme, model: nn.Module) -> list[Connection]:
    """A pipe learner for one worker that never starts; returns the ends to close."""
    parent, child = mp.Pipe()
    scheme.init_on_sender("policy", model=model, pipes=[parent])
    return [child]


def _mixed_learner(scheme: WeightSyncScheme, model: nn.Module) -> list[Connection]:
    parent, child = mp.Pipe()
    scheme.init_on_sender("policy", model=model, pipes=[parent], num_workers=2)
    return [child]


def _zmq_learner(scheme: WeightSyncScheme, model: nn.Module) -> list[Connection]:
    scheme.init_on_sender("policy", model=model, num_workers=1)
    return []


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("make", "start"),
    [
        (lambda: ZMQWeightSyncScheme(mode="pubsub", timeout=10, connect_timeout=0.5), _zmq_learner),
        (lambda: ZMQWeightSyncScheme(mode="router", timeout=10, connect_timeout=0.5), _zmq_learner),
        (
            lambda: zmqsync.MultiProcessWeightSyncScheme(timeout=10, connect_timeout=0.5),
            _pipe_learner,
        ),
        (
            lambda: zmqsync.MixedWeightSyncScheme(
                zmqsync.MultiProcessWeightSyncScheme(timeout=10, connect_timeout=0.5),
                ZMQWeightSyncScheme("state_dict", timeout=10, connect_timeout=0.25),
            ),
            _mixed_learner,
        ),
    ],
    ids=["zmq-pubsub", "zmq-router", "pipe", "mixed"],
)
def test_a_learner_waits_connect_timeout_for_its_workers(
    make: Callable[[], WeightSyncScheme],
    start: Callable[[WeightSyncScheme, nn.Module], list[Connection]],
) -> None:
    """With nobody joining, the learner's connect() gives up after connect_timeout
    (a mixed scheme: its members' longest), not after the send timeout."""
    scheme = make()
    assert (scheme.timeout, scheme.connect_timeout) == (10.0, 0.5)
    ends = start(scheme, nn.Linear(2, 2))
    try:
        begun = time.monotonic()
        with pytest.raises(zmqsync.SyncTimeout, match=r"did not connect within 0\.5s"):
            scheme.connect()
        assert 0.4 <= time.monotonic() - begun < 5.0
    finally:
        scheme.shutdown()
        for end in ends:
            end.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_spawned_workers_join_within_connect_timeout_and_sends_keep_the_short_timeout(
    fleet: Fleet, tmp_path: Path
) -> None:
    """timeout=2 to see a dead worker within 2 s; joining 4 spawned workers that import
    torch takes longer than that (the last one here starts after 2.5 s), so the
    learner's connect() must wait with connect_timeout."""
    scheme = ZMQWeightSyncScheme("state_dict", endpoint=f"ipc://{tmp_path}/learner", timeout=2)
    model = make_model()
    scheme.init_on_sender("policy", model=model, num_workers=4)
    late = threading.Timer(2.5, fleet.start, (scheme, 3))  # a worker slow to start
    try:
        for i in range(3):
            fleet.start(scheme, i)  # the scheme pickles into each, connect_timeout too
        late.start()
        begun = time.monotonic()
        scheme.connect()
        assert time.monotonic() - begun > scheme.timeout
        late.join(10)
        for i in range(4):
            fleet.wait_ready(i)

        bump(model)
        scheme.send()
        assert all(fleet.ask(i, "state")["version"] == 1 for i in range(4))

        fleet.kill(3)
        bump(model)
        begun = time.monotonic()
        with pytest.raises(zmqsync.SyncTimeout) as info:
            scheme.send()
        took = time.monotonic() - begun
        assert set(info.value.missing_workers) == {3}
        assert 1.5 <= took < scheme.timeout + 1.5, took
    finally:
        late.cancel()
        late.join(10)
        scheme.shutdown()


# --- which version each worker acked ---------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["zmq", "pipe"])
def test_worker_versions_say_what_each_worker_acked(
    fleet: Fleet, tmp_path: Path, transport: str
) -> None:
    model = make_model()
    ends: list[Connection] = []
    scheme: WeightSyncScheme
    if transport == "zmq":
        scheme = ZMQWeightSyncScheme("state_dict", endpoint=f"ipc://{tmp_path}/learner", timeout=20)
        scheme.init_on_sender("policy", model=model, num_workers=2)
        init_kwargs: list[dict[str, Any] | None] = [None, None]
    else:
        pipes = [SPAWN.Pipe() for _ in range(2)]
        ends = [child for _, child in pipes]
        scheme = zmqsync.MultiProcessWeightSyncScheme(timeout=20)
        scheme.init_on_sender("policy", model=model, pipes=[parent for parent, _ in pipes])
        init_kwargs = [{"pipe": child} for child in ends]
    try:
        assert scheme.worker_versions() == {0: 0, 1: 0}  # expected, not connected yet
        for i in range(2):
            fleet.start(scheme, i, init_kwargs=init_kwargs[i])
        for end in ends:
            end.close()  # the worker holds it now
        scheme.connect()
        for i in range(2):
            fleet.wait_ready(i)

        bump(model)
        scheme.send()
        assert scheme.worker_versions() == {0: 1, 1: 1}
        bump(model)
        scheme.send(worker_ids=[0])
        assert scheme.worker_versions() == {0: 2, 1: 1}
        assert scheme.get_sender().worker_versions() == {0: 2, 1: 1}

        # A worker that left holds nothing the learner knows of (its goodbye is on its way).
        fleet.stop(1)
        deadline = time.monotonic() + 20
        while scheme.worker_versions() != {0: 2, 1: 0}:
            assert time.monotonic() < deadline, scheme.worker_versions()
            time.sleep(0.02)
    finally:
        scheme.shutdown()
        for end in ends:
            end.close()
