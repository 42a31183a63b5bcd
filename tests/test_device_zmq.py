"""Device lending over ZeroMQ ``ipc://``: versions on the learner's GPU written once into
device blocks the hub lends to the workers (among those that joined its shared-memory
lending) whose model lives on that GPU. Each worker gets a CUDA IPC handle of each block
once, in a :class:`~zmqsync.transport.shm.records.DeviceGrant` record on the ROUTER,
ahead of the lease that names it on the same socket.

Real worker processes on real ``ipc://`` sockets, in both modes. CI has no GPU, so the
learner and the workers stand CPU shared memory in for CUDA IPC
(``tests/_device_standin.py``): every part but the CUDA calls runs as it is.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from _device_standin import (
    run_worker_on_the_device,
    run_worker_that_cannot_open,
    run_worker_whose_device_refuses_once,
)
from _workers import bump, make_model

import zmqsync
from zmqsync import SyncTimeout
from zmqsync.schemes.zmq import ZMQWeightSyncScheme

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MODES = ["pubsub", "router"]
#: The "big" model (32 MiB) and a few blocks of it: the device pool's bound.
BLOCKS_BOUND = 3 * (33 << 20)


def _over_ipc(fleet, model, targets, tmp_path: Path, mode: str, **options: Any):  # type: ignore[no-untyped-def]
    """A ``ZMQWeightSyncScheme`` over ``ipc://`` to one worker per entry point of
    ``targets``, ready when it returns (every worker joined the hub's lending)."""
    options.setdefault("timeout", 30.0)
    # The state_dict strategy: the harness checks checksums of the model's state_dict.
    scheme = ZMQWeightSyncScheme(
        "state_dict", mode=mode, endpoint=f"ipc://{tmp_path}/learner", **options
    )
    scheme.init_on_sender("policy", model=model, num_workers=len(targets))
    try:
        for i, target in enumerate(targets):
            fleet.start(scheme, i, kind="big", target=target)
        for i in range(len(targets)):
            fleet.wait_ready(i, timeout=120)
        hub = scheme.get_sender().transport
        deadline = time.monotonic() + 60
        while hub.counters().get("shm_peers", 0) < len(targets):
            assert time.monotonic() < deadline, hub.counters()
            time.sleep(0.05)
    except BaseException:
        scheme.shutdown()
        raise
    return scheme


def _versions(fleet, scheme, model, workers: int, count: int) -> list:  # type: ignore[no-untyped-def]
    """Bump ``model`` and send it ``count`` times: after each send every worker holds
    exactly that version. Returns the workers' last states."""
    states: list = []
    for _ in range(count):
        bump(model)
        scheme.send()
        want = (scheme.get_sender().version, zmqsync.checksum(model))
        states = [fleet.ask(i, "state") for i in range(workers)]
        assert [(s["version"], s["checksum"]) for s in states] == [want] * workers
    return states


def _chunks(fleet, workers: int) -> list[int]:  # type: ignore[no-untyped-def]
    return [fleet.ask(i, "state")["stats"]["device_chunks"] for i in range(workers)]


@pytest.mark.parametrize("mode", MODES)
def test_versions_go_through_device_blocks_to_ipc_workers_on_the_learners_device(
    fleet,  # type: ignore[no-untyped-def]
    on_the_stand_in: None,
    tmp_path: Path,
    mode: str,
) -> None:
    model = make_model("big", seed=0)
    scheme = _over_ipc(fleet, model, [run_worker_on_the_device] * 2, tmp_path, mode)
    try:
        # The first version after both said where their model lives may still go
        # through the host (they say so once joined): then each goes as a device chunk.
        _versions(fleet, scheme, model, 2, 1)
        before = _chunks(fleet, 2)
        # More versions than device blocks: each is lent again once released.
        states = _versions(fleet, scheme, model, 2, 6)
        lent = [s["stats"]["device_chunks"] - b for s, b in zip(states, before, strict=True)]
        assert lent == [6, 6]
        counters = scheme.get_sender().transport.counters()
        assert 32 << 20 <= counters["device_bytes"] <= BLOCKS_BOUND
        assert counters.get("shm_bad_records", 0) == 0
        bump(model)  # not sent: no worker sees it
        assert [fleet.ask(i, "state")["checksum"] for i in range(2)] == [
            s["checksum"] for s in states
        ]
    finally:
        scheme.shutdown()


def test_an_ipc_worker_that_cannot_open_a_device_block_is_repaired_through_the_host(
    fleet,  # type: ignore[no-untyped-def]
    on_the_stand_in: None,
    tmp_path: Path,
) -> None:
    """A worker names the learner's device but cannot open its blocks: the message that
    lay in one is lost to it (its lease ends once it says it saw it), it tells the hub
    it takes none, and that version (repaired) and every later one reach it through the
    host; the other worker keeps exact."""
    model = make_model("big", seed=0)
    targets = [run_worker_on_the_device, run_worker_that_cannot_open]
    scheme = _over_ipc(fleet, model, targets, tmp_path, "pubsub")
    try:
        for version in range(1, 4):
            bump(model)
            scheme.send()
            fleet.all_hold(2, (version, zmqsync.checksum(model)))
        confused = fleet.ask(1, "state")
        assert confused["stats"]["device_chunks"] == 0
        assert confused["transport"]["shm_device_refused"] == 1
        counters = scheme.get_sender().transport.counters()
        assert counters.get("shm_bad_records", 0) == 0
    finally:
        scheme.shutdown()


def test_an_ipc_worker_whose_device_refuses_a_block_once_is_given_the_handles_anew(
    fleet,  # type: ignore[no-untyped-def]
    on_the_stand_in: None,
    tmp_path: Path,
) -> None:
    """A worker's device refuses to open one block (as CUDA may for memory freed
    meanwhile): the message in it is lost (repaired through the host), the worker says
    its GPU again and the hub gives it every handle anew; the next versions come device
    to device. It is never lost for good to device lending (three refusals in a row
    would be)."""
    model = make_model("big", seed=0)
    targets = [run_worker_on_the_device, run_worker_whose_device_refuses_once]
    scheme = _over_ipc(fleet, model, targets, tmp_path, "pubsub", repair_after=0.5)
    try:
        for version in range(1, 3):
            bump(model)
            scheme.send()
            fleet.all_hold(2, (version, zmqsync.checksum(model)))
        before = _chunks(fleet, 2)
        _versions(fleet, scheme, model, 2, 3)
        assert [a - b for a, b in zip(_chunks(fleet, 2), before, strict=True)] == [3, 3]
        flaky = fleet.ask(1, "state")["transport"]
        assert flaky["shm_device_gone"] == 1 and flaky["shm_unread_device"] >= 1
        assert "shm_device_refused" not in flaky
    finally:
        scheme.shutdown()


def test_a_killed_ipc_worker_pins_a_bounded_number_of_device_blocks(
    fleet,  # type: ignore[no-untyped-def]
    on_the_stand_in: None,
    tmp_path: Path,
) -> None:
    """A worker SIGKILLed while it is lent device blocks never says it let go of them
    (over ZeroMQ nothing breaks: it is a stopped worker until its lease runs out): the
    pool lends no more than its bound, versions then go through the host, and the
    living worker holds every version whole."""
    model = make_model("big", seed=0)
    scheme = _over_ipc(
        fleet, model, [run_worker_on_the_device] * 2, tmp_path, "pubsub", timeout=10.0
    )
    try:
        _versions(fleet, scheme, model, 2, 2)
        fleet.kill(1)
        bump(model)
        with pytest.raises(SyncTimeout) as missed:
            scheme.send()
        assert missed.value.missing_workers == [1]
        for _ in range(6):  # more versions than device blocks
            bump(model)
            scheme.send(worker_ids=[0])
            want = (scheme.get_sender().version, zmqsync.checksum(model))
            state = fleet.ask(0, "state")
            assert (state["version"], state["checksum"]) == want
            assert scheme.get_sender().transport.counters()["device_bytes"] <= BLOCKS_BOUND
    finally:
        scheme.shutdown()


def test_a_stopped_ipc_worker_pins_device_blocks_until_its_lease_runs_out(
    fleet,  # type: ignore[no-untyped-def]
    on_the_stand_in: None,
    tmp_path: Path,
) -> None:
    """A worker SIGSTOPped while versions keep coming holds the device blocks it was
    leased: the pool lends no more than its bound (then versions go through the host),
    the hub drops the worker once its lease runs out (its blocks retired, never
    rewritten), the other worker holds every version whole, and once continued the
    stopped one joins the lending again and catches up with the latest."""
    model = make_model("big", seed=0)
    scheme = _over_ipc(
        fleet, model, [run_worker_on_the_device] * 2, tmp_path, "pubsub", timeout=3.0
    )
    hub = scheme.get_sender().transport
    try:
        _versions(fleet, scheme, model, 2, 2)
        os.kill(fleet.procs[1].pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 60
            while hub.counters().get("shm_expired", 0) < 1:  # its lease ran out
                assert time.monotonic() < deadline, hub.counters()
                bump(model)
                with pytest.raises(SyncTimeout) as missed:
                    scheme.send()
                assert missed.value.missing_workers == [1]
                fleet.all_hold(1, (scheme.get_sender().version, zmqsync.checksum(model)))
                assert hub.counters().get("device_bytes", 0) <= BLOCKS_BOUND
        finally:
            os.kill(fleet.procs[1].pid, signal.SIGCONT)
        bump(model)
        scheme.send()
        fleet.all_hold(2, (scheme.get_sender().version, zmqsync.checksum(model)))
        # It joins the lending again and is lent device blocks once more.
        before = _chunks(fleet, 2)
        deadline = time.monotonic() + 60
        while True:
            states = _versions(fleet, scheme, model, 2, 1)
            if all(s["stats"]["device_chunks"] > b for s, b in zip(states, before, strict=True)):
                break
            assert time.monotonic() < deadline, hub.counters()
        assert hub.counters().get("device_bytes", 0) <= BLOCKS_BOUND
    finally:
        scheme.shutdown()
