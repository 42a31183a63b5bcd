"""``apply_mode="shared"``: workers on the learner's host share one read-only copy of
each version. Real spawned workers over ZeroMQ ``ipc://`` (both modes) and pipes."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from _faults import until
from _shared_workers import run_scheme_worker, run_shared_worker, shared_model
from torch import nn

import zmqsync
from zmqsync import SyncTimeout, WeightReceiver, WeightSender
from zmqsync.chunking.layout import MIN_CHUNK_BYTES
from zmqsync.fleet import core as fleet_core
from zmqsync.fleet import views as fleet_views
from zmqsync.status_types import SenderStatus
from zmqsync.transport._zmq import lending
from zmqsync.transport.pipe import PipeHub
from zmqsync.transport.zmq_pubsub import PubSubHub, PubSubSpoke
from zmqsync.transport.zmq_router import RouterHub
from zmqsync_cli._common import worker_state

SPAWN = mp.get_context("spawn")
KINDS = ["pubsub", "router", "pipe"]
DEADLINE = 60.0


@dataclass
class Fleet:
    """The learner (model, sender, hub) and its spawned workers' control pipes."""

    kind: str
    model: nn.Module
    sender: WeightSender
    hub: Any
    where: list[Any]  # what each worker connects to (endpoint, or its pipe end)
    procs: list[Any] = field(default_factory=list)
    conns: list[Any] = field(default_factory=list)

    def spawn(self, idx: int) -> None:
        """Start worker ``idx`` and wait until it joined."""
        parent, child = SPAWN.Pipe()
        proc = SPAWN.Process(
            target=run_shared_worker, args=(self.kind, self.where[idx], idx, child), daemon=True
        )
        proc.start()
        self.procs.append(proc)
        self.conns.append(parent)
        assert parent.poll(DEADLINE), f"worker {idx} did not start"
        assert parent.recv() == "ready"

    def ask(self, idx: int, command: str = "state") -> dict[str, Any]:
        self.conns[idx].send(command)
        assert self.conns[idx].poll(DEADLINE), f"worker {idx} did not answer"
        answer = self.conns[idx].recv()
        assert not (isinstance(answer, tuple) and answer[0] == "error"), answer
        return answer  # type: ignore[no-any-return]

    def wait_for(self, idx: int, version: int) -> dict[str, Any]:
        """Worker ``idx``'s state once it holds ``version`` (polled, with a deadline)."""
        deadline = time.monotonic() + DEADLINE
        while True:
            state = self.ask(idx)
            if state["version"] >= version:
                return state
            assert time.monotonic() < deadline, f"worker {idx} stuck at {state}"
            time.sleep(0.05)


def _bump(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
        model.steps += 1  # type: ignore[operator]


@pytest.fixture
def make_fleet(tmp_path: Any) -> Iterator[Callable[..., Fleet]]:
    fleets: list[Fleet] = []

    def make(kind: str, slots: int, timeout: float = 30, **options: Any) -> Fleet:
        if kind == "pipe":
            pairs = [SPAWN.Pipe() for _ in range(slots)]
            hub: Any = PipeHub([p for p, _ in pairs])
            where: list[Any] = [c for _, c in pairs]
        else:
            hub = (PubSubHub if kind == "pubsub" else RouterHub)(f"ipc://{tmp_path}/hub")
            where = [hub.endpoint] * slots
        model = shared_model(0)
        sender = WeightSender(hub, model=model, num_workers=None, timeout=timeout, **options)
        fleet = Fleet(kind, model, sender, hub, where)
        fleets.append(fleet)
        return fleet

    yield make
    for fleet in fleets:
        for conn, proc in zip(fleet.conns, fleet.procs, strict=True):
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGCONT)
                conn.send("stop")
        for proc in fleet.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        fleet.sender.close()


def _send(fleet: Fleet, workers: list[int]) -> str:
    """A new version to ``workers``; returns its checksum."""
    _bump(fleet.model)
    fleet.sender.send(worker_ids=workers)
    return zmqsync.checksum(fleet.model)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["dict", "nested", "tensordict"])
def test_a_dict_or_tensordict_model_is_mapped_where_the_user_reads_it(tmp_path, kind: str) -> None:  # type: ignore[no-untyped-def]
    """A worker's model given as a (nested) dict of tensors or a TensorDict: its own
    tensors are re-pointed, not only the aliases the strategy extracted from them.
    Before, the receiver mapped every version (``shared_mapped`` counted it) while the
    user's dict kept the weights it started with."""
    from tensordict import TensorDict

    def make(fill: float) -> Any:
        a, b = torch.full((256, 256), fill), torch.full((1000,), fill)
        if kind == "dict":
            return {"a": a, "b": b}
        if kind == "nested":
            return {"layer": {"a": a}, "b": b}
        return TensorDict({"layer": {"a": a}, "b": b}, batch_size=[])

    strategy = "tensordict" if kind == "tensordict" else "state_dict"
    learner, worker = make(0.0), make(-1.0)
    leaves = leaves_of(worker)
    hub = PubSubHub(f"ipc://{tmp_path}/dicts")
    sender = WeightSender(hub, model=learner, strategy=strategy, num_workers=1, timeout=10)
    receiver = WeightReceiver(
        PubSubSpoke(hub.endpoint, identity="0"),
        model=worker,
        strategy=strategy,
        apply_mode="shared",
        worker_idx=0,
    )
    try:
        receiver.connect(timeout=10)
        receiver.start()
        for version in (1, 2):
            for t in leaves_of(learner):
                t.add_(1.0)
            sender.send()
            with receiver.lock:
                assert zmqsync.checksum(worker) == zmqsync.checksum(learner)
                now = leaves_of(worker)
                assert all(x is y for x, y in zip(now, leaves, strict=True))
                assert all(float(t.flatten()[0]) == float(version) for t in now)
        # Both sends mapped (the version it joined on may have come through the socket).
        assert receiver.stats["shared_mapped"] >= 2
    finally:
        receiver.close()
        sender.close()


@pytest.mark.timeout(120)
def test_a_parameter_the_user_replaces_or_moves_between_versions_gets_the_next_one(
    tmp_path: Any,
) -> None:
    """The receiver remembers the model's tensors between versions (it re-points them
    itself, and says so, so it need not walk the model each version); a parameter the
    user replaced, or gave new storage, is still found and mapped at the next version."""
    learner, worker = shared_model(0), shared_model(1)
    hub = PubSubHub(f"ipc://{tmp_path}/replaced")
    sender = WeightSender(hub, model=learner, num_workers=1, timeout=10)
    receiver = WeightReceiver(
        PubSubSpoke(hub.endpoint, identity="0"), model=worker, apply_mode="shared", worker_idx=0
    )
    try:
        receiver.connect(timeout=10)
        receiver.start()

        def send_and_check() -> None:
            mapped = receiver.stats["shared_mapped"]
            _bump(learner)
            sender.send()
            with receiver.lock:
                assert zmqsync.checksum(worker) == zmqsync.checksum(learner)
            assert receiver.stats["shared_mapped"] == mapped + 1  # mapped, not copied

        send_and_check()
        send_and_check()
        first = next(worker.parameters())
        with receiver.lock:
            first.data = torch.zeros_like(first)  # new storage behind the same Parameter
        send_and_check()
        assert next(worker.parameters()) is first
        layer = next(m for m in worker.modules() if isinstance(m, nn.Linear))
        with receiver.lock:
            layer.weight = nn.Parameter(torch.zeros_like(layer.weight))  # replaced
        replaced = layer.weight
        send_and_check()
        assert layer.weight is replaced
    finally:
        receiver.close()
        sender.close()


def leaves_of(model: Any) -> list[torch.Tensor]:
    """A (nested) dict's or a TensorDict's tensors, depth first: the objects it holds."""
    if not isinstance(model, dict):
        return list(model.values(include_nested=True, leaves_only=True))
    out: list[torch.Tensor] = []
    for value in model.values():
        out += leaves_of(value) if isinstance(value, dict) else [value]
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", KINDS)
def test_workers_map_each_version_read_only_and_exact(
    kind: str, make_fleet: Callable[..., Fleet]
) -> None:
    fleet = make_fleet(kind, 4)
    fleet.sender.publish()
    for idx in range(3):
        fleet.spawn(idx)
    sums = {}
    for _ in range(4):
        sums[fleet.sender.version] = _send(fleet, [0, 1, 2])
        for idx in range(3):
            state = fleet.wait_for(idx, fleet.sender.version)
            assert state["version"] == fleet.sender.version
            assert state["checksum"] == sums[fleet.sender.version]
            assert state["same_objects"], "a parameter is no longer the object it was"
            assert state["read_only"], "the worker's weights are writable"
    # Every worker mapped versions: it copied none since it joined the lending.
    for idx in range(3):
        assert fleet.ask(idx)["stats"]["shared_mapped"] >= 2
    held = fleet.sender.version
    # The learner changes its weights in place without sending: no worker sees it.
    _bump(fleet.model)
    time.sleep(0.5)
    for idx in range(3):
        state = fleet.ask(idx)
        assert (state["version"], state["checksum"]) == (held, sums[held])
    # A late joiner gets the latest sent (not the learner's weights changed since),
    # and maps the next.
    fleet.spawn(3)
    late = fleet.wait_for(3, held)
    assert (late["version"], late["checksum"]) == (held, sums[held])
    sums[fleet.sender.version] = _send(fleet, [0, 1, 2, 3])
    late = fleet.wait_for(3, fleet.sender.version)
    assert late["checksum"] == sums[fleet.sender.version]
    assert late["stats"]["shared_mapped"] >= 1
    # Shared memory stays bounded: the hub's blocks, at most a few versions' worth.
    counts = fleet.hub.counters()
    assert counts["shm_bytes"] <= 4 * 2 * sum(t.nbytes for t in fleet.model.state_dict().values())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", KINDS)
def test_a_worker_that_writes_its_weights_dies_and_the_others_stay_exact(
    kind: str, make_fleet: Callable[..., Fleet]
) -> None:
    fleet = make_fleet(kind, 3)
    fleet.sender.publish()
    for idx in range(3):
        fleet.spawn(idx)
    version_sum = _send(fleet, [0, 1, 2])
    for idx in range(3):
        assert fleet.wait_for(idx, fleet.sender.version)["checksum"] == version_sum
    fleet.conns[0].send("write")
    assert fleet.conns[0].poll(DEADLINE) and fleet.conns[0].recv() == "writing"
    fleet.procs[0].join(DEADLINE)
    assert fleet.procs[0].exitcode in (-signal.SIGSEGV, -signal.SIGBUS)
    for idx in (1, 2):
        state = fleet.ask(idx)
        assert state["checksum"] == version_sum
    # The learner goes on with the others.
    next_sum = _send(fleet, [1, 2])
    for idx in (1, 2):
        assert fleet.wait_for(idx, fleet.sender.version)["checksum"] == next_sum


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["pubsub", "pipe"])
def test_a_stopped_worker_pins_its_version_and_catches_up(
    kind: str, make_fleet: Callable[..., Fleet], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lending, "LEASE_SECONDS", 2.0)  # the ZeroMQ hub's, shortened
    fleet = make_fleet(kind, 3)
    fleet.sender.publish()
    for idx in range(3):
        fleet.spawn(idx)
    pinned_sum = _send(fleet, [0, 1, 2])
    pinned = fleet.sender.version
    assert fleet.wait_for(2, pinned)["checksum"] == pinned_sum
    # Worker 1 holds its version (under its lock) while the learner sends others: the
    # memory it maps is never written over.
    fleet.conns[1].send("hold:3")
    for _ in range(4):
        _send(fleet, [0])
        fleet.wait_for(0, fleet.sender.version)
    assert fleet.conns[1].poll(DEADLINE)
    before, after = fleet.conns[1].recv()
    assert before["version"] == after["version"] == pinned
    assert before["checksum"] == after["checksum"] == pinned_sum
    os.kill(fleet.procs[2].pid, signal.SIGSTOP)
    model_bytes = sum(t.nbytes for t in fleet.model.state_dict().values())
    # Over ZeroMQ the hub stops counting a peer that held a block past its lease.
    end = time.monotonic() + 4.0
    sent = 0
    while time.monotonic() < end or sent < 6:
        version_sum = _send(fleet, [0, 1])
        sent += 1
        for idx in (0, 1):
            assert fleet.wait_for(idx, fleet.sender.version)["checksum"] == version_sum
        # Bounded: a few versions' blocks (a stopped worker pins one; the learner
        # takes others up to its bound, then copies).
        assert fleet.hub.counters()["shm_bytes"] <= 6 * 2 * model_bytes
        time.sleep(0.2)
    counts = fleet.hub.counters()
    if kind == "pubsub":
        assert counts["shm_expired"] >= 1  # said so: it then gets copies
    os.kill(fleet.procs[2].pid, signal.SIGCONT)
    latest_sum = _send(fleet, [0, 1, 2])
    state = fleet.wait_for(2, fleet.sender.version)
    assert state["checksum"] == latest_sum and state["version"] == fleet.sender.version


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["pubsub", "pipe"])
def test_versions_go_in_one_chunk_while_every_worker_keeps_its_version_mapped(
    kind: str, make_fleet: Callable[..., Fleet], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers that map copy nothing out of a chunk while the next is written: while
    every worker keeps its versions mapped (it says so at the first it maps: here the
    published version 0, before its ack), each version goes in one chunk, not in
    ``chunk_bytes`` (64 KiB here: the model takes six), and every worker maps it
    exactly. A stopped worker (sent copies over a pipe; over ZeroMQ dropped from the
    lending) brings small chunks back."""
    monkeypatch.setattr(lending, "LEASE_SECONDS", 2.0)  # the ZeroMQ hub's, shortened
    fleet = make_fleet(kind, 2, timeout=3.0, chunk_bytes=MIN_CHUNK_BYTES)
    model_bytes = sum(t.nbytes for t in fleet.model.state_dict().values())
    small = -(-model_bytes // MIN_CHUNK_BYTES)
    assert small >= 5
    fleet.sender.publish()
    for idx in range(2):
        fleet.spawn(idx)
        fleet.wait_for(idx, 0)

    def chunks_of_a_version(workers: list[int]) -> int:
        before = fleet.sender.status()["totals"]["chunks_sent"]
        version_sum = _send(fleet, workers)
        for idx in workers:
            state = fleet.wait_for(idx, fleet.sender.version)
            assert state["checksum"] == version_sum and state["read_only"]
        return int(fleet.sender.status()["totals"]["chunks_sent"] - before)

    chunks_of_a_version([0, 1])  # its acks come after what the workers said before
    assert [chunks_of_a_version([0, 1]) for _ in range(3)] == [1, 1, 1]
    for idx in range(2):
        assert fleet.ask(idx)["stats"]["shared_mapped"] >= 3
    os.kill(fleet.procs[1].pid, signal.SIGSTOP)
    try:
        counts: list[int] = []
        deadline = time.monotonic() + DEADLINE
        while not counts or counts[-1] < small:
            assert time.monotonic() < deadline, counts
            before = fleet.sender.status()["totals"]["chunks_sent"]
            _bump(fleet.model)
            try:
                fleet.sender.send()  # the stopped worker too
            except SyncTimeout as exc:
                assert set(exc.missing_workers) == {1}
            version_sum = zmqsync.checksum(fleet.model)
            assert fleet.wait_for(0, fleet.sender.version)["checksum"] == version_sum
            counts.append(int(fleet.sender.status()["totals"]["chunks_sent"] - before))
            # A training step between versions, longer than a pipe waits for a release
            # before it copies. (Not a readiness wait: sent back to back, versions fill
            # the stopped worker's pipe and its writer blocks in the middle of a write;
            # then it is never sent copies, and nothing brings small chunks back.)
            time.sleep(1.2)
    finally:
        os.kill(fleet.procs[1].pid, signal.SIGCONT)
    chunks_of_a_version([0, 1])  # it catches up, exact (checked in there)


def _rows(fleet: Fleet) -> dict[int, dict[str, Any]]:
    return {row["worker"]: row for row in fleet.sender.status()["workers"]}


def _three_mapping_then_stop_one(fleet: Fleet) -> None:
    """Workers 0-2 map two versions, none sent copies; then worker 2 is stopped."""
    fleet.sender.publish()
    for idx in range(3):
        fleet.spawn(idx)
    for _ in range(2):
        version_sum = _send(fleet, [0, 1, 2])
        for idx in range(3):
            assert fleet.wait_for(idx, fleet.sender.version)["checksum"] == version_sum
    assert not any("shm_copies" in row for row in _rows(fleet).values())
    os.kill(fleet.procs[2].pid, signal.SIGSTOP)


@pytest.mark.timeout(300)
def test_a_stopped_pipe_worker_is_sent_copies_and_the_others_keep_mapping(
    make_fleet: Callable[..., Fleet],
) -> None:
    """Versions sent to every worker while one is stopped: that one pins the blocks
    of at most two versions (the one it holds, the one it has not read) and is sent
    the next ones copied through its pipe, and status() says so; the others map every
    version (no block ever runs out for them), and the stopped one catches up."""
    fleet = make_fleet("pipe", 3, timeout=3.0)
    _three_mapping_then_stop_one(fleet)
    before = {idx: fleet.ask(idx)["stats"] for idx in (0, 1)}
    fallbacks = fleet.hub.counters()["shm_fallbacks"]
    sent = 4
    for _ in range(sent):
        _bump(fleet.model)
        try:
            # To every pipe: the stopped worker too (waited for while it counts as live).
            fleet.sender.send()
        except SyncTimeout as exc:
            assert set(exc.missing_workers) == {2}
        version_sum = zmqsync.checksum(fleet.model)
        for idx in (0, 1):
            assert fleet.wait_for(idx, fleet.sender.version)["checksum"] == version_sum
        time.sleep(1.2)  # a training step: longer than a pipe waits for a release
    for idx in (0, 1):
        stats = fleet.ask(idx)["stats"]
        assert stats["shared_copied"] == before[idx]["shared_copied"], "a worker got copies"
        assert stats["shared_mapped"] >= before[idx]["shared_mapped"] + sent
    assert fleet.hub.counters()["shm_fallbacks"] == fallbacks
    # status() names the worker sent copies, and what it pins; nobody else. (Checked
    # within the 30 s the learner keeps a silent worker's session.)
    until(lambda: "shm_copies" in _rows(fleet)[2], DEADLINE, "status shows the copies")
    rows = _rows(fleet)
    assert rows[2]["shm_copies"] is True
    assert 1 <= rows[2]["shm_pinned"] <= 2
    assert not any("shm_copies" in rows[idx] or "shm_pinned" in rows[idx] for idx in (0, 1))
    # What `zmqsync status` shows in that worker's state cell (from the same report).
    report = SenderStatus.from_dict(fleet.sender.status())
    cells = {w.worker: worker_state(w, report.version, None).plain for w in report.workers}
    assert "sent copies" in cells[2] and "blocks pinned" in cells[2]
    assert not any("copies" in cells[idx] for idx in (0, 1))
    totals = fleet.sender.status()["totals"]
    assert totals["shm_copying"] == 1
    assert totals["shm_pinned"] == rows[2]["shm_pinned"]
    assert 1 <= totals["shm_copies"] <= sent
    # Continued, it reads what was queued, then maps versions again.
    os.kill(fleet.procs[2].pid, signal.SIGCONT)
    for _ in range(2):
        version_sum = _send(fleet, [0, 1, 2])
        for idx in range(3):
            assert fleet.wait_for(idx, fleet.sender.version)["checksum"] == version_sum
    mapped = fleet.ask(2)["stats"]["shared_mapped"]
    version_sum = _send(fleet, [0, 1, 2])
    state = fleet.wait_for(2, fleet.sender.version)
    assert state["checksum"] == version_sum and state["read_only"]
    assert state["stats"]["shared_mapped"] == mapped + 1
    assert not any("shm_copies" in row for row in _rows(fleet).values())
    assert fleet.sender.status()["totals"]["shm_copying"] == 0


@pytest.mark.timeout(300)
def test_a_stopped_zeromq_worker_is_dropped_from_the_lending_and_status_says_so(
    make_fleet: Callable[..., Fleet], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over ZeroMQ, a worker that holds its block past the lease (stopped) is no longer
    counted: it is sent copies through the socket, and status() names it with the
    retired blocks it may still map; continued, it joins the lending again and maps."""
    monkeypatch.setattr(lending, "LEASE_SECONDS", 2.0)
    # The stopped worker's session must outlive the loop below (up to DEADLINE): expired,
    # it is no longer waited for, and a send would not time out (seen once in CI, on a
    # loaded 2-core machine, where its silence passed the 30 s expiry first).
    monkeypatch.setattr(fleet_core, "EXPIRE_MIN_SECONDS", 10 * DEADLINE)
    # And it must stay live (heard from within LIVE_HEARTBEATS heartbeats), or a fleet of
    # whoever is connected stops waiting for it: a send 3 s after the stop no longer
    # times out (seen in CI on a loaded machine, where the lease took longer than one
    # send to run out).
    monkeypatch.setattr(fleet_views, "LIVE_HEARTBEATS", 10 * DEADLINE)
    fleet = make_fleet("pubsub", 3, timeout=3.0)
    _three_mapping_then_stop_one(fleet)
    try:
        deadline = time.monotonic() + DEADLINE
        while "shm_copies" not in _rows(fleet)[2]:
            assert time.monotonic() < deadline, "the stopped worker was never dropped"
            _bump(fleet.model)
            with pytest.raises(SyncTimeout) as caught:
                fleet.sender.send()  # to every worker: the stopped one is waited for
            assert set(caught.value.missing_workers) == {2}
            version_sum = zmqsync.checksum(fleet.model)
            for idx in (0, 1):
                assert fleet.wait_for(idx, fleet.sender.version)["checksum"] == version_sum
        assert fleet.hub.counters()["shm_expired"] >= 1
        rows = _rows(fleet)
        assert rows[2]["shm_copies"] is True and rows[2]["shm_pinned"] >= 1
        assert not any("shm_copies" in rows[idx] or "shm_pinned" in rows[idx] for idx in (0, 1))
        report = SenderStatus.from_dict(fleet.sender.status())
        cells = {w.worker: worker_state(w, report.version, None).plain for w in report.workers}
        assert "sent copies" in cells[2]
        totals = fleet.sender.status()["totals"]
        assert totals["shm_copying"] == 1 and totals["shm_pinned"] == rows[2]["shm_pinned"]
    finally:
        os.kill(fleet.procs[2].pid, signal.SIGCONT)
    # Continued: it catches up, joins the lending again (offered at its next contact),
    # and maps the next version.
    version_sum = _send(fleet, [0, 1, 2])
    assert fleet.wait_for(2, fleet.sender.version)["checksum"] == version_sum
    until(lambda: "shm_copies" not in _rows(fleet)[2], DEADLINE, "it joins the lending again")
    assert fleet.sender.status()["totals"]["shm_copying"] == 0
    mapped = fleet.ask(2)["stats"]["shared_mapped"]
    version_sum = _send(fleet, [0, 1, 2])
    state = fleet.wait_for(2, fleet.sender.version)
    assert state["checksum"] == version_sum and state["read_only"]
    assert state["stats"]["shared_mapped"] == mapped + 1


@pytest.mark.timeout(300)
def test_workers_that_hold_a_version_past_the_lease_keep_mapping(
    make_fleet: Callable[..., Fleet], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A learner slower than the hub's lease: workers hold their version mapped the
    whole time, as they must, and are not dropped for it (they said they keep it)."""
    monkeypatch.setattr(lending, "LEASE_SECONDS", 1.0)
    fleet = make_fleet("pubsub", 2)
    fleet.sender.publish()
    for idx in range(2):
        fleet.spawn(idx)
    for _ in range(3):
        version_sum = _send(fleet, [0, 1])
        for idx in range(2):
            assert fleet.wait_for(idx, fleet.sender.version)["checksum"] == version_sum
        time.sleep(2.5)  # longer than the lease, between versions
    assert fleet.hub.counters().get("shm_expired", 0) == 0
    assert fleet.hub.counters()["shm_keeping"] == 2
    for idx in range(2):
        assert fleet.ask(idx)["stats"]["shared_copied"] <= 1  # (version 0, before joining)


@pytest.mark.timeout(300)
def test_the_pipe_scheme_passes_the_shared_mode_to_its_workers() -> None:
    scheme = zmqsync.MultiProcessWeightSyncScheme(timeout=30)
    pipes = [SPAWN.Pipe() for _ in range(2)]
    controls, procs = [], []
    for _, child in pipes:
        parent, worker_end = SPAWN.Pipe()
        proc = SPAWN.Process(target=run_scheme_worker, args=(scheme, child, worker_end))
        proc.daemon = True
        proc.start()
        controls.append(parent)
        procs.append(proc)
    model = shared_model(0)
    scheme.init_on_sender("policy", pipes=[p for p, _ in pipes], model=model, num_workers=2)
    try:
        for control in controls:
            assert control.poll(DEADLINE) and control.recv() == "ready"
        seen = [0, 0]
        for _ in range(3):
            _bump(model)
            scheme.send()  # returns once every worker applied it
            expected = zmqsync.checksum(model)
            for i, control in enumerate(controls):
                control.send("state")
                assert control.poll(DEADLINE)
                version, got, _ = control.recv()
                assert got == expected and version > seen[i]
                seen[i] = version
        for control in controls:
            control.send("state")
            assert control.poll(DEADLINE)
            assert control.recv()[2] >= 2  # mapped, not copied
    finally:
        for control in controls:
            control.send("stop")
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        scheme.shutdown()


@pytest.mark.timeout(60)
def test_shared_mode_needs_a_model() -> None:
    from zmqsync.transport.memory import MemoryHub, MemorySpoke

    hub = MemoryHub("memory://shared-needs-model")
    try:
        with pytest.raises(ValueError, match="shared"):
            WeightReceiver(MemorySpoke("memory://shared-needs-model"), apply_mode="shared")
    finally:
        hub.close()
