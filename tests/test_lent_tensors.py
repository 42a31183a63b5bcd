"""Lent tensors end to end: real pipe workers move their tensors into memory they lend
the learner's hub, and the learner writes each version straight into them (one copy
per worker); every applied version's checksum is the learner's, versions never go back,
and a worker that does not lend is streamed to as before, in the same send."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from typing import Any

import pytest
from _lent_workers import LENT, hub_blocks
from _prom import one, scrape
from _workers import bump, make_model

import zmqsync
from zmqsync import WeightSender
from zmqsync.status_types import SenderStatus
from zmqsync.tools.metrics import serve_metrics
from zmqsync.transport.pipe import PipeHub
from zmqsync.transport.shm.blocks import SHM_AVAILABLE
from zmqsync.transport.zmq_pubsub import PubSubHub
from zmqsync.transport.zmq_router import RouterHub
from zmqsync_cli._common import status_header

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not SHM_AVAILABLE, reason="memfd is Linux's"),
]

WAIT_S = 60.0


def _lent_links(pid: int) -> tuple[int, int]:
    """How many of process ``pid``'s descriptors open its lent memory, and how many of its
    writable mappings lie in it."""
    fds = 0
    for name in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed while listed
            fds += os.readlink(f"/proc/{pid}/fd/{name}").startswith(LENT)
    with open(f"/proc/{pid}/maps") as maps:
        mapped = sum(1 for line in maps if LENT in line and line.split()[1].startswith("rw"))
    return fds, mapped


def _sends(sender: WeightSender) -> tuple[Callable[[], None], dict[int, str]]:
    """A send of a new version of ``sender``'s model (bumped first), and the checksum of
    each version sent, by version."""
    sent: dict[int, str] = {}

    def send() -> None:
        bump(sender.model)
        sender.send()
        sent[sender.fleet.version] = zmqsync.checksum(sender.model, "state_dict")

    return send, sent


def _ask(control: Any) -> tuple[list[tuple[int, str, Any]], dict[str, Any], bool]:
    control.send("report")
    assert control.poll(WAIT_S), "the worker did not answer"
    what, applied, stats, same = control.recv()
    assert what == "ok", applied
    return applied, stats, same


@pytest.fixture
def fleet(monkeypatch, tmp_path):
    from _lent_workers import run_lending_worker

    from zmqsync.sender import core

    # The counts below are of versions written into lent tensors: a worker slowed down
    # by a loaded machine must not miss its turn (a send still waits no longer than its
    # own timeout for a go).
    monkeypatch.setattr(core, "LENT_GO_WAIT", 20.0)
    # The test's model is small (70 KB), which is streamed by default: lend it anyway.
    monkeypatch.setattr(core, "LENT_MIN_BYTES", 0)

    ctx = mp.get_context("spawn")
    made: dict[str, Any] = {}

    def start(
        lends: list[bool | None],
        chunk_timeout: float = 5.0,
        late: tuple[int, ...] = (),
        expected: int | None = None,
        zmq: str = "",
        kind: str = "wide",
        sender_lends: bool | None = True,
    ) -> tuple[WeightSender, list[Any]]:
        controls = [ctx.Pipe() for _ in lends]
        model = make_model(kind, seed=1)
        if zmq:  # "pubsub" or "router", over ipc://
            endpoint = f"ipc://{tmp_path}/lent"
            hub: Any = (PubSubHub if zmq == "pubsub" else RouterHub)(endpoint)
            ends: list[Any] = [(zmq, endpoint)] * len(lends)
        else:
            pipes = [ctx.Pipe() for _ in lends]
            hub, ends = PipeHub([p for p, _ in pipes]), [end for _, end in pipes]
        sender = WeightSender(
            hub,
            model=model,
            strategy="state_dict",
            num_workers=len(lends) if expected is None else expected,
            timeout=30,
            **({} if sender_lends is None else {"lend_tensors": sender_lends}),
        )
        made.update(
            sender=sender,
            procs=[None] * len(lends),
            controls=[c for c, _ in controls],
            args=[
                (ends[i], controls[i][1], i, lend, chunk_timeout, kind)
                for i, lend in enumerate(lends)
            ],
        )
        for i in range(len(lends)):
            if i not in late:
                spawn(i)
        return sender, made["controls"]

    def spawn(i: int) -> None:
        """Start worker ``i`` (one of those ``late``)."""
        proc = ctx.Process(target=run_lending_worker, args=made["args"][i], daemon=True)
        proc.start()
        made["procs"][i] = proc

    start.procs = lambda: made["procs"]  # type: ignore[attr-defined]
    start.spawn = spawn  # type: ignore[attr-defined]

    yield start
    for control in made.get("controls", []):
        with contextlib.suppress(OSError):
            control.send("stop")
    for proc in made.get("procs", []):
        if proc is None:
            continue
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    if "sender" in made:
        made["sender"].close()


@pytest.mark.parametrize("transport", ["pipe", "pubsub", "router"])
def test_versions_are_written_into_the_workers_lent_tensors(fleet, transport: str) -> None:
    """Over pipes, or ZeroMQ over ``ipc://`` (in pubsub mode the version goes to the
    worker that does not lend by the ROUTER, addressed, as the others are left out)."""
    sender, controls = fleet([True, True, False], zmq="" if transport == "pipe" else transport)
    model = sender.model
    sent: dict[int, str] = {}
    for step in range(1, 7):
        bump(model)
        sender.send(metadata={"step": step})
        sent[sender.fleet.version] = zmqsync.checksum(model, "state_dict")
    for i, control in enumerate(controls):
        applied, stats, same = _ask(control)
        versions = [v for v, _, _ in applied]
        assert versions == sorted(versions) and versions[-1] == max(sent), versions
        for version, digest, metadata in applied:
            if version in sent:  # every version it applied is the one the learner sent
                assert digest == sent[version], (i, version)
                assert metadata == {"step": version}, (i, version, metadata)
        assert same  # the model's parameters are the objects they were
        if i < 2:
            # The first version came as a stream (the tensors are laid out after it);
            # from then on, each was written into the lent tensors.
            assert stats["lent_applied"] >= 4, stats
        else:
            assert stats.get("lent_applied", 0) == 0, stats
    totals = sender.status()["totals"]  # the hub's counters among them
    assert totals["lent_peers"] == 2 and totals["lent_writes"] >= 8, totals
    # The learner mapped what the lending workers lent, and they closed its descriptor
    # after the first write: nobody else opens it through /proc/PID/fd any more.
    links = [_lent_links(proc.pid) for proc in fleet.procs()]
    assert links[0] == (0, 1) and links[1] == (0, 1) and links[2] == (0, 0), links
    # What a scraper reads of it: the workers lending, the versions written into them,
    # the shared memory the hub holds (the non-lending worker's stream went through it).
    server = serve_metrics(sender, 0)
    try:
        top = scrape(server.port)
    finally:
        server.close()
    assert one(top, "zmqsync_lent_workers") == 2
    assert one(top, "zmqsync_lent_writes_total") == totals["lent_writes"]
    assert one(top, "zmqsync_lent_go_missed_total") == 0
    assert one(top, "zmqsync_shm_bytes") == totals["shm_bytes"] > 0
    assert one(top, "zmqsync_dropped_sends_total") == totals["dropped_sends"]
    # And what `zmqsync status` (and `watch`, `demo`) says of it, from the same report.
    header = status_header(SenderStatus.from_dict(sender.status())).plain
    assert (
        f"on this host: 2 workers lend their tensors, {totals['lent_writes']} versions "
        "written into them, 0 streamed for want of a go; shared memory "
    ) in header, header


@pytest.mark.parametrize("kind", ["big", "wide"])
def test_workers_on_the_learners_host_lend_by_default_from_4_mib_up(
    fleet, monkeypatch, kind: str
) -> None:
    """Neither side given ``lend_tensors``: a 32 MiB model's versions are written into
    the workers' lent tensors; a 70 KB model's stream, and its workers lend nothing (their
    tensors stay where they were)."""
    from zmqsync.sender import core
    from zmqsync.transport.shm.lent import LENT_MIN_BYTES

    monkeypatch.setattr(core, "LENT_MIN_BYTES", LENT_MIN_BYTES)  # the fixture lowered it
    sender, controls = fleet([None, None], kind=kind, sender_lends=None)
    assert sender.lend_tensors
    model = sender.model
    sent: dict[int, str] = {}
    for _ in range(4):
        bump(model)
        sender.send()
        sent[sender.fleet.version] = zmqsync.checksum(model, "state_dict")
    totals = sender.status()["totals"]
    for control in controls:
        applied, stats, same = _ask(control)
        _check(applied, sent)
        assert applied[-1][0] == max(sent) and same
        if kind == "big":  # the first version streamed; the later ones were written
            assert stats["lent_applied"] >= 2, stats
        else:
            assert stats.get("lent_applied", 0) == 0, stats
    if kind == "big":
        assert totals["lent_peers"] == 2 and totals["lent_writes"] >= 4, totals
    else:
        assert totals.get("lent_peers", 0) == 0 and totals.get("lent_writes", 0) == 0, totals


def _check(applied: list[tuple[int, str, Any]], sent: dict[int, str]) -> None:
    """Versions only go forward, and each one applied is the learner's."""
    versions = [v for v, _, _ in applied]
    assert versions == sorted(versions), versions
    for version, digest, _ in applied:
        if version in sent:
            assert digest == sent[version], version


def test_a_learner_quiet_mid_write_writes_nothing_the_worker_keeps(fleet, monkeypatch) -> None:
    """The learner stalls between a worker's go and its word that the version is in,
    past the worker's chunk timeout: the worker takes its tensors back (one copy), is
    torn until the version comes as a stream, and what the learner then writes into the
    memory it had lent reaches no tensor of it."""
    from zmqsync.sender import lent

    sender, (control,) = fleet([True], chunk_timeout=0.5)
    send, sent = _sends(sender)

    for _ in range(3):
        send()
    assert _ask(control)[1]["lent_applied"] >= 1
    real_write = lent.LentTarget.write
    stalled: list[int] = []

    def stall_once(self: Any, *args: Any) -> None:
        if not stalled:
            stalled.append(sender.fleet.version)
            time.sleep(2.0)  # the worker gives up after 0.5 s
        real_write(self, *args)

    monkeypatch.setattr(lent.LentTarget, "write", stall_once)
    send()  # repaired through the stream within the send: it is acked all the same
    for _ in range(3):
        send()
    applied, stats, same = _ask(control)
    _check(applied, sent)
    assert applied[-1][0] == max(sent) and stalled
    assert stats["lent_taken_back"] == 1 and same, stats
    assert stats["lent_applied"] >= 3, stats  # lent again once a whole version was in


@pytest.mark.parametrize("notes", [True, False], ids=["asked-again", "not-asked-again"])
def test_a_write_longer_than_the_chunk_timeout_goes_in_whole(fleet, monkeypatch, notes) -> None:
    """A learner alive but slow to write a version into two workers' lent tensors (each
    piece of the write takes 0.05 s, 0.8 s in all, past their 0.5 s chunk timeout): it
    asks them again as it writes, so they hold their locks and the version goes in whole,
    every time. Without those asks (the case that shows the write is long enough), the
    workers take their tensors back mid-write and are repaired by a stream: slower, and
    still exact."""
    from zmqsync.sender import lent

    sender, controls = fleet([True, True], chunk_timeout=0.5)
    send, sent = _sends(sender)
    for _ in range(2):  # the first version streams; each worker lends once it holds one
        send()
    assert all(_ask(c)[1]["lent_applied"] >= 1 for c in controls)

    # The model's two 64 KiB weights go in 8 KiB pieces (16 in all, to both workers).
    monkeypatch.setattr(lent, "FAN_OUT_BLOCK", 8192)
    monkeypatch.setattr(lent, "PIECEWISE_BYTES", 8192)
    if not notes:
        monkeypatch.setattr(lent, "LENT_NOTE_SECONDS", 1e9)
    real_copy = lent._copy_in_blocks
    pieces: list[float] = []

    def slowly(dests: Any, sources: Any, between: Callable[[], object], block: int) -> None:
        def slow_between() -> None:
            time.sleep(0.05)
            pieces.append(time.monotonic())
            between()

        real_copy(dests, sources, slow_between, block)

    monkeypatch.setattr(lent, "_copy_in_blocks", slowly)
    before = [_ask(c)[1] for c in controls]
    rounds = 3 if notes else 2
    for _ in range(rounds):
        send()
    assert len(pieces) >= 16 * rounds, len(pieces)  # every write took 0.8 s at least
    for control, was in zip(controls, before, strict=True):
        applied, stats, same = _ask(control)
        _check(applied, sent)
        assert applied[-1][0] == max(sent) and same
        if notes:
            assert stats["lent_taken_back"] == was["lent_taken_back"], stats
            assert stats["lent_applied"] - was["lent_applied"] == rounds, stats
            assert stats["lent_still_writing"] > was["lent_still_writing"], stats
        else:
            assert stats["lent_taken_back"] > was["lent_taken_back"], stats
            assert stats["lent_still_writing"] == was["lent_still_writing"], stats


def test_a_worker_that_moved_its_tensors_is_streamed_to_and_lends_again(fleet) -> None:
    sender, (control,) = fleet([True])
    model = sender.model
    sent: dict[int, str] = {}
    for step in range(6):
        if step == 3:
            control.send("move")  # p.data = ...: its tensors leave the lent memory
        bump(model)
        sender.send()
        sent[sender.fleet.version] = zmqsync.checksum(model, "state_dict")
    applied, stats, _ = _ask(control)
    _check(applied, sent)
    assert applied[-1][0] == max(sent)
    assert stats["lent_refused"] >= 1 and stats["lent_applied"] >= 3, stats


@pytest.mark.parametrize("transport", ["pipe", "router"])
def test_versions_only_in_lent_tensors_leave_no_block_in_memory(fleet, transport: str) -> None:
    """Once every worker takes each version into its lent tensors, the learner keeps no
    shared-memory block that a version was written into (it would hold a model copy
    nobody reads), and the workers map none: the block the first versions streamed
    through goes back to the system. A worker that gives its tensors new storage is
    streamed to through a block again, and that block goes too once it lends again."""
    sender, controls = fleet([True, True], zmq="" if transport == "pipe" else transport)
    send, sent = _sends(sender)

    send()  # streamed: the workers lend their tensors after it
    assert hub_blocks(os.getpid())[1] > 0  # the learner wrote it into a block
    for _ in range(3):
        send()
    pids = [os.getpid()] + [proc.pid for proc in fleet.procs()]
    learner, *workers = (hub_blocks(pid) for pid in pids)
    assert learner[1] == 0 and all(w == (0, 0) for w in workers), (learner, workers)

    controls[0].send("move")  # p.data = ...: its tensors leave the lent memory
    _ask(controls[0])
    send()  # refused by worker 0, streamed to it through a block
    assert hub_blocks(os.getpid())[1] > 0
    send()  # worker 0 lent its tensors again after the stream: every worker takes it
    send()
    learner, *workers = (hub_blocks(pid) for pid in pids)
    assert learner[1] == 0 and all(w == (0, 0) for w in workers), (learner, workers)
    for control in controls:
        applied, stats, same = _ask(control)
        _check(applied, sent)
        assert applied[-1][0] == max(sent) and same and stats["lent_applied"] >= 4, stats


@pytest.mark.parametrize("signal_name", ["SIGSTOP", "SIGKILL"])
def test_a_stopped_or_killed_lending_worker_holds_nobody_back(fleet, signal_name: str) -> None:
    """One of three lending workers stops (or dies): a send waits for its go at most
    half a second, then streams to it (a stopped worker's stream waits in its pipe and
    the send times out on it, as without lending), and later sends stream to it without
    asking until it acked a version; the others keep taking every version through their
    lent tensors. A stopped worker, continued, answers the ask it missed, is told
    nothing was written, catches up by the stream, and is asked again."""
    import os
    import signal

    from zmqsync.errors import SyncTimeout

    sender, controls = fleet([True, True, True])
    model = sender.model
    sent: dict[int, str] = {}

    def send() -> None:
        bump(model)
        try:
            sender.send()
        except SyncTimeout as exc:
            assert exc.missing_workers == [2], exc
        sent[sender.fleet.version] = zmqsync.checksum(model, "state_dict")

    send()
    send()
    sender.timeout = 2.0  # every worker connected: a send waits for a stopped one that long
    victim = fleet.procs()[2]
    os.kill(victim.pid, getattr(signal, signal_name))
    for _ in range(3):
        send()
    if signal_name == "SIGSTOP":
        os.kill(victim.pid, signal.SIGCONT)
    send()
    send()
    for i, control in enumerate(controls):
        if i == 2 and signal_name == "SIGKILL":
            continue
        applied, stats, same = _ask(control)
        _check(applied, sent)
        assert same  # its parameters are the objects they were
        if i < 2:
            assert applied[-1][0] == max(sent) and stats["lent_applied"] >= 5, stats
        else:  # continued: it caught up, whole versions only
            deadline = time.monotonic() + 20
            while applied[-1][0] != max(sent):
                assert time.monotonic() < deadline, applied[-1]
                time.sleep(0.2)
                applied, stats, _ = _ask(control)
                _check(applied, sent)
    totals = sender.status()["totals"]
    assert totals["lent_writes"] >= 10 and totals["timeouts"] >= 3, totals
    if signal_name == "SIGKILL":
        return
    # Asked once while stopped: the sends after the one it missed streamed to it unasked.
    assert totals["lent_go_missed"] == 1, totals
    # Caught up, it is asked again and takes versions into its lent tensors once more.
    _, before, _ = _ask(controls[2])
    sender.timeout = 30.0
    send()
    send()
    applied, after, _ = _ask(controls[2])
    _check(applied, sent)
    assert applied[-1][0] == max(sent), applied[-1]
    assert after["lent_applied"] > before["lent_applied"], (before, after)
    # The learner kept its memory mapped while it streamed to it: told the same memory
    # again, it wrote into it, and no tensor moved (the descriptor is closed all along).
    assert after["lent_renewed"] == 0, after


def test_a_restarted_learner_is_lent_fresh_memory(fleet, tmp_path) -> None:
    """Lent memory's descriptor is closed once the learner mapped it, so a learner made
    anew on the same ``ipc://`` path (a restart) cannot open it: told of it after the
    first version it streams, it answers the worker's go that the memory is unusable,
    and after the version it then streams the worker's tensors move into fresh memory
    (one copy, ``lent_renewed``), which the new learner writes the next versions into."""
    sender, controls = fleet([True, True], zmq="router")
    model, endpoint = sender.model, f"ipc://{tmp_path}/lent"  # the fleet's
    for _ in range(3):
        bump(model)
        sender.send()
    before = [_ask(control)[1] for control in controls]
    assert all(s["lent_applied"] >= 2 and s["lent_renewed"] == 0 for s in before), before
    assert [_lent_links(proc.pid) for proc in fleet.procs()] == [(0, 1), (0, 1)]
    sender.close()
    restarted = WeightSender(
        RouterHub(endpoint), model=model, strategy="state_dict", num_workers=2, timeout=30
    )
    try:
        for _ in range(4):
            bump(model)
            restarted.send()  # returns once both workers acked it
        digest = zmqsync.checksum(model, "state_dict")
        assert restarted.status()["totals"]["lent_writes"] >= 2
        for control, was in zip(controls, before, strict=True):
            applied, stats, same = _ask(control)
            assert applied[-1][1] == digest and same
            assert stats["lent_renewed"] == 1, stats
            assert stats["lent_applied"] >= was["lent_applied"] + 1, (was, stats)
        # The old memory is gone from the workers; the new one is mapped, its door shut.
        assert [_lent_links(proc.pid) for proc in fleet.procs()] == [(0, 1), (0, 1)]
    finally:
        restarted.close()


@pytest.mark.parametrize("what", ["small model", "small tensors"])
def test_a_small_model_streams_as_usual(fleet, monkeypatch, what: str) -> None:
    """Under LENT_MIN_BYTES of large tensors the ask and the go cost more than the copy
    they save: the version streams, to lending workers too, and is applied all the
    same; so does a version as large as that whose bytes lie mostly in small tensors."""
    from zmqsync.sender import core, lent

    sender, (control,) = fleet([True])
    limit = 4 * 1024 * 1024
    if what == "small tensors":
        sizes = [t.numel() * t.element_size() for t in sender.model.state_dict().values()]
        limit = sum(n for n in sizes if n >= lent.SMALL_BYTES) + 1
        assert sum(sizes) >= limit  # the version is large enough; its large tensors are not
    monkeypatch.setattr(core, "LENT_MIN_BYTES", limit)
    sent: dict[int, str] = {}
    for _ in range(3):
        bump(sender.model)
        sender.send()
        sent[sender.fleet.version] = zmqsync.checksum(sender.model, "state_dict")
    applied, stats, _ = _ask(control)
    _check(applied, sent)
    assert applied[-1][0] == max(sent) and stats["lent_applied"] == 0, stats
    assert sender.status()["totals"].get("lent_writes", 0) == 0


def test_a_late_joiner_gets_the_latest_unless_every_worker_held_it(fleet) -> None:
    """A worker the learner expects and that has not joined yet: each version is still
    written into the snapshot (as well as into the others' lent tensors), and it joins
    to the latest. Once every expected worker holds a version in its lent tensors, no
    snapshot is written: a worker added to the fleet then (or one that left and came
    back) joins to nothing, and gets the next version."""
    sender, controls = fleet([True] * 4, late=(2, 3), expected=3)
    model = sender.model
    sent: dict[int, str] = {}

    def send(worker_ids: list[int] | None = None) -> None:
        bump(model)
        sender.send(worker_ids=worker_ids)
        sent[sender.fleet.version] = zmqsync.checksum(model, "state_dict")

    for _ in range(4):
        send([0, 1])
    assert _ask(controls[0])[1]["lent_applied"] >= 2  # written into their lent tensors
    latest = max(sent)
    fleet.spawn(2)  # type: ignore[attr-defined]
    applied, _, _ = _ask(controls[2])
    assert [v for v, _, _ in applied] == [latest], applied  # connect() returned with it
    assert applied[0][1] == sent[latest]
    for _ in range(3):
        send()  # workers 0..2, all present: the version lives only in their tensors
    for control in controls[:3]:
        applied, stats, _ = _ask(control)
        _check(applied, sent)
        assert applied[-1][0] == max(sent) and stats["lent_applied"] >= 2, stats
    # No snapshot of the latest version was written: worker 3, added to the fleet now,
    # is told it is up to date with nothing applied, and the next send brings it a
    # whole version (streamed, then lent).
    sender.num_workers = 4
    fleet.spawn(3)  # type: ignore[attr-defined]
    applied, _, _ = _ask(controls[3])
    assert applied == [], applied
    send()
    send()
    applied, stats, same = _ask(controls[3])
    _check(applied, sent)
    assert [v for v, _, _ in applied] == [max(sent) - 1, max(sent)] and same, applied
    assert stats["lent_applied"] == 1, stats
