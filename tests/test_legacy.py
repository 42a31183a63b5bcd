"""MultiProcessedRemoteWeightUpdate (seed 004): torchrl's legacy updater on zmqsync."""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.multiprocessing as tmp
from tensordict import TensorDict
from torch import nn

import zmqsync
from zmqsync import WeightsRejected
from zmqsync.schemes.legacy import MultiProcessedRemoteWeightUpdate

CPU = torch.device("cpu")


def _td(module: nn.Module) -> TensorDict:
    return TensorDict.from_module(module).data


def _bump(module: nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p))


def _sum(weights: Any) -> str:
    return zmqsync.checksum(weights, "tensordict")


@pytest.fixture
def setup() -> Iterator[tuple[nn.Module, dict[Any, TensorDict], MultiProcessedRemoteWeightUpdate]]:
    torch.manual_seed(0)
    server = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    # Each worker's own weights, different from the server's until a push.
    workers: dict[Any, TensorDict] = {w: _td(server).clone().zero_() for w in (CPU, 1, 2)}
    updater = MultiProcessedRemoteWeightUpdate(lambda: TensorDict.from_module(server), workers)
    try:
        yield server, workers, updater
    finally:
        updater.close()


def test_push_makes_every_worker_exact(setup) -> None:  # type: ignore[no-untyped-def]
    server, workers, updater = setup
    assert updater.all_worker_ids() == [CPU, 1, 2]
    updater.push_weights()
    assert [_sum(w) for w in workers.values()] == [_sum(_td(server))] * 3
    assert updater.version == 1
    assert [w["version"] for w in updater.status()["workers"]] == [1, 1, 1]
    _bump(server)
    updater()  # __call__ is push_weights
    assert [_sum(w) for w in workers.values()] == [_sum(_td(server))] * 3


def test_targeting_changes_only_the_named_workers(setup) -> None:  # type: ignore[no-untyped-def]
    server, workers, updater = setup
    updater.push_weights()
    before = _sum(_td(server))
    _bump(server)
    updater.push_weights(worker_ids=CPU)
    assert [_sum(w) for w in workers.values()] == [_sum(_td(server)), before, before]
    _bump(server)
    updater.push_weights(worker_ids=[1, 2])
    assert _sum(workers[1]) == _sum(workers[2]) == _sum(_td(server)) != _sum(workers[CPU])
    with pytest.raises(ValueError, match="unknown worker"):
        updater.push_weights(worker_ids=[7])


def test_workers_never_alias_the_server(setup) -> None:  # type: ignore[no-untyped-def]
    server, workers, updater = setup
    updater.push_weights()
    held = [_sum(w) for w in workers.values()]
    _bump(server)  # changed, not pushed
    assert [_sum(w) for w in workers.values()] == held


def test_sync_with_one_worker_and_the_seed_hooks(setup) -> None:  # type: ignore[no-untyped-def]
    server, workers, updater = setup
    weights = updater._get_server_weights()
    assert isinstance(weights, TensorDict) and not weights.requires_grad
    assert updater._maybe_map_weights(weights) is weights
    updater._sync_weights_with_worker(worker_id=2, server_weights=weights)
    assert _sum(workers[2]) == _sum(_td(server))
    assert _sum(workers[1]) != _sum(_td(server))
    updater._sync_weights_with_worker(worker_id=1, server_weights=None)  # nothing to sync
    assert updater.version == 1


def test_no_getter_and_no_weights_is_a_no_op() -> None:
    workers = {0: TensorDict({"w": torch.zeros(3)}, batch_size=[])}
    with MultiProcessedRemoteWeightUpdate(None, workers) as updater:
        assert updater._get_server_weights() is None
        updater.push_weights()
        assert updater.version == 0
        updater.push_weights(TensorDict({"w": torch.ones(3)}, batch_size=[]))
        assert torch.equal(workers[0]["w"], torch.ones(3))


def test_register_collector_once(setup) -> None:  # type: ignore[no-untyped-def]
    _, _, updater = setup

    class Collector:
        pass

    collector = Collector()
    assert updater.collector is None
    updater.register_collector(collector)
    assert updater.collector is collector
    with pytest.raises(RuntimeError, match="already registered"):
        updater.register_collector(Collector())


def test_weights_that_do_not_fit_change_nothing(setup) -> None:  # type: ignore[no-untyped-def]
    _, workers, updater = setup
    held = [_sum(w) for w in workers.values()]
    wrong = TensorDict.from_module(
        nn.Sequential(nn.Linear(8, 17), nn.ReLU(), nn.Linear(17, 2))
    ).data
    with pytest.raises(WeightsRejected) as info:
        updater.push_weights(wrong)
    assert sorted(info.value.rejections) == [0, 1, 2]
    assert "shape" in info.value.rejections[0]
    assert [_sum(w) for w in workers.values()] == held


def test_post_hooks_and_a_subclass_syncing_per_worker(setup) -> None:  # type: ignore[no-untyped-def]
    server, workers, _ = setup
    calls: list[Any] = []

    class PerWorker(MultiProcessedRemoteWeightUpdate):
        def _sync_weights_with_worker(
            self, worker_id: Any = None, server_weights: Any = None
        ) -> None:
            calls.append(worker_id)
            super()._sync_weights_with_worker(worker_id=worker_id, server_weights=server_weights)

    hooked: list[int] = []
    with PerWorker(lambda: TensorDict.from_module(server), workers) as updater:
        updater.register_post_hook(lambda: hooked.append(updater.version))
        updater.push_weights(worker_ids=[1, 2])
        assert calls == [1, 2]
        assert hooked == [2]  # one version per worker, then the hook once
        assert _sum(workers[1]) == _sum(workers[2]) == _sum(_td(server))


def _shared_reader(weights: TensorDict, conn: Any) -> None:
    """A collector worker process: reads the shared weights whenever asked."""
    try:
        while conn.poll(60):
            if conn.recv() == "stop":
                return
            conn.send(_sum(weights))
    except BaseException:  # report to the test
        conn.send("error: " + traceback.format_exc())


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_worker_process_reading_shared_weights_sees_each_push(setup) -> None:  # type: ignore[no-untyped-def]
    """torchrl's use: policy_weights live in shared memory that worker processes read."""
    server, _, _ = setup
    ctx = tmp.get_context("spawn")
    shared = _td(server).clone().zero_().share_memory_()
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_shared_reader, args=(shared, child), daemon=True)
    proc.start()
    try:
        with MultiProcessedRemoteWeightUpdate(
            lambda: TensorDict.from_module(server), {0: shared}
        ) as updater:
            for _ in range(2):
                _bump(server)
                updater.push_weights()
                parent.send("checksum")
                assert parent.poll(90), "the worker process did not answer"
                assert parent.recv() == _sum(_td(server))
        parent.send("stop")
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
