"""The pipe transport and MultiProcessWeightSyncScheme: the contract, then the promises
end to end with real worker processes (spawn) on real pipes."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import struct
import time
import traceback
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from _workers import bump
from torch import nn

import zmqsync
from zmqsync import SyncTimeout
from zmqsync.errors import TransportError
from zmqsync.protocol import Chunk, decode
from zmqsync.schemes.multiprocess import MultiProcessWeightSyncScheme
from zmqsync.tensors.version_messages import version_messages
from zmqsync.testing import check_transport
from zmqsync.transport.base import Stream
from zmqsync.transport.pipe import PipeHub, PipeSpoke, peer_id
from zmqsync.transport.pipe.writer import Outgoing
from zmqsync.transport.shm.records import Release, encode

SPAWN = mp.get_context("spawn")


# --- the transport -----------------------------------------------------------------------


def _pipe_fleet(n: int, *, shared_memory: bool = True) -> tuple[PipeHub, list[PipeSpoke]]:
    pairs = [mp.Pipe() for _ in range(n)]
    hub = PipeHub([parent for parent, _ in pairs], shared_memory=shared_memory)
    return hub, [PipeSpoke(child) for _, child in pairs]


def _read_until(hub: PipeHub, done: Any, what: str, timeout: float = 10.0) -> None:
    """Let ``hub`` read what its workers wrote (releases) until ``done()``: a worker's
    thread writes them when it gets to it, which takes longer on a loaded machine."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout}s"
        assert hub.recv_frames(0.1) is None, "a message, where only releases were due"


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "socket"])
def test_pipe_transport_conformance(shared_memory: bool) -> None:
    check_transport(lambda n: _pipe_fleet(n, shared_memory=shared_memory))


def _weights_frames(version: int, nbytes: int) -> list[Any]:
    """One version of ``nbytes`` as a single chunk."""
    (frames,) = version_messages(
        {"w": torch.full((nbytes // 4,), float(version))},
        version=version,
        epoch=7,
        chunk_bytes=nbytes,
    )
    return frames


@pytest.mark.timeout(60)
def test_a_worker_that_does_not_read_never_blocks_the_hub() -> None:
    """Three 8 MiB versions to a worker that reads nothing: send_frames returns at once,
    a newer queued version replaces an older one, and close() does not wait."""
    hub, (spoke,) = _pipe_fleet(1)
    try:
        start = time.monotonic()
        for version in (1, 2, 3):
            hub.send_frames(_weights_frames(version, 8 << 20), stream=Stream.START)
        assert time.monotonic() - start < 1.0, "send_frames waited on a worker that does not read"
        versions = []
        while (frames := spoke.recv_frames(2.0)) is not None:
            message = decode(frames)
            assert isinstance(message, Chunk) and message.first and message.last
            versions.append(message.version)
        assert versions[-1] == 3, versions
        assert versions == sorted(versions) and len(versions) <= 2, versions
        assert hub.counters()["dropped_sends"] >= 1
        # Queue another big one the worker will never read, then close: no waiting.
        hub.send_frames(_weights_frames(4, 8 << 20), stream=Stream.START)
        start = time.monotonic()
        hub.close()
        assert time.monotonic() - start < 1.0
    finally:
        hub.close()
        spoke.close()


def test_the_pipe_tells_a_worker_its_index() -> None:
    pairs = [mp.Pipe() for _ in range(3)]
    hub = PipeHub({5: pairs[0][0], 6: pairs[1][0], 7: pairs[2][0]})
    spokes = [PipeSpoke(child) for _, child in pairs]
    try:
        assert [s.wait_index(5.0) for s in spokes] == [5, 6, 7]
        assert sorted(hub.reserved_workers()) == [5, 6, 7]
        # Messages that arrive while a worker waits for its index are kept, in order.
        hub.send_frames([b"first"], to=[peer_id(6)])
        assert spokes[1].recv_frames(5.0) == [b"first"]
    finally:
        hub.close()
        for s in spokes:
            s.close()


def test_a_worker_waiting_for_an_index_without_a_hub_gets_a_clear_error() -> None:
    _, child = mp.Pipe()
    spoke = PipeSpoke(child)
    try:
        with pytest.raises(TransportError, match="no worker index arrived"):
            spoke.wait_index(0.2)
    finally:
        spoke.close()


def test_a_broken_pipe_is_counted_not_raised() -> None:
    hub, spokes = _pipe_fleet(2)
    try:
        spokes[1].close()
        hub.send_frames([b"x"], to=[peer_id(1)])  # never raises
        deadline = time.monotonic() + 5
        while hub.counters()["peers_lost"] == 0:
            assert time.monotonic() < deadline, "the hub never noticed the closed pipe"
            hub.recv_frames(0.05)
        hub.send_frames([b"still-here"])
        assert spokes[0].recv_frames(5.0) == [b"still-here"]
        # The worker's side: the hub gone, sends are dropped and receives time out.
        hub.close()
        spokes[0].send_frames([b"into the void"])
        start = time.monotonic()
        assert spokes[0].recv_frames(0.2) is None
        assert spokes[0].recv_frames(0.2) is None
        assert time.monotonic() - start < 2.0
    finally:
        hub.close()
        for s in spokes:
            s.close()


@pytest.mark.timeout(30)
def test_a_worker_closing_after_its_goodbye_is_no_broken_pipe(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A receiver's close() says goodbye, then its pipe ends: on a collector's normal
    shutdown that is no warning per worker; a pipe that ends without a goodbye (a killed
    worker) still is one."""
    import logging

    from zmqsync import WeightReceiver, WeightSender

    hub, spokes = _pipe_fleet(2)
    sender = WeightSender(hub, model=nn.Linear(3, 2), strategy="state_dict", timeout=10)
    receiver = WeightReceiver(spokes[0], model=nn.Linear(3, 2), strategy="state_dict")
    try:
        receiver.connect()
        receiver.start()
        sender.send()
        with caplog.at_level(logging.DEBUG, logger="zmqsync"):
            receiver.close()  # says goodbye, then closes its pipe
            spokes[1].close()  # worker 1's pipe ends with no goodbye
            deadline = time.monotonic() + 10
            # Both pipes' ends counted and logged (the count moves just before the log).
            while (
                hub.counters()["peers_lost"] < 2
                or sum("pipe" in r.getMessage() for r in caplog.records) < 2
            ):
                assert time.monotonic() < deadline, "the hub never noticed the closed pipes"
                time.sleep(0.05)
        said = [(r.levelno, r.getMessage()) for r in caplog.records]
        warned = [m for level, m in said if level >= logging.WARNING and "pipe of" in m]
        # (why worker 1's pipe broke: an end of file or a reset, as the kernel has it)
        assert [m.split(" (")[0] for m in warned] == ["pipe of worker 1 broke"], said
        assert (logging.DEBUG, "worker 0 closed its pipe after its goodbye (end of file)") in said
    finally:
        receiver.close()
        sender.close()
        for s in spokes:
            s.close()


@pytest.mark.timeout(90)
def test_a_worker_process_that_returns_with_its_receiver_open_says_goodbye(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """torchrl's collector workers return without closing their receiver: the process's
    exit closes it, so its learner hears a goodbye and logs no broken pipe."""
    import logging

    from _workers import make_model, run_and_leave_open

    from zmqsync import WeightSender

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    sender = WeightSender(
        PipeHub([parent]), model=make_model(), strategy="state_dict", num_workers=1, timeout=30
    )
    worker = ctx.Process(target=run_and_leave_open, args=(child, 0), daemon=True)
    try:
        with caplog.at_level(logging.DEBUG, logger="zmqsync"):
            worker.start()
            child.close()
            worker.join(60)
            assert worker.exitcode == 0
            deadline = time.monotonic() + 10
            while sender.status()["totals"]["goodbyes"] < 1:
                assert time.monotonic() < deadline, "no goodbye from the exited worker"
                time.sleep(0.05)
        said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert not [m for m in said if "broke" in m], said
    finally:
        if worker.is_alive():
            worker.kill()
        sender.close()


def _lose_them_and_serve_worker_0(hub: PipeHub, good: PipeSpoke, lost: int, within: float) -> None:
    """The hub loses ``lost`` pipes within ``within`` seconds while worker 0's message
    reaches it, and serves worker 0 after."""
    good.send_frames([b"hello"])
    got = None
    deadline = time.monotonic() + within
    while hub.counters()["peers_lost"] < lost or got is None:
        assert time.monotonic() < deadline, hub.counters()
        incoming = hub.recv_frames(0.1)
        if incoming is not None:
            got = incoming
    assert got.peer == peer_id(0) and [bytes(f) for f in got.frames] == [b"hello"]
    hub.send_frames([b"still served"])
    assert good.recv_frames(5.0) == [b"still served"]


def test_bytes_that_are_not_ours_cost_only_that_pipe() -> None:
    """A worker writing garbage, or announcing a message over the hub's limit, loses its
    own pipe (counted, refused before anything is allocated); the others are served."""
    pairs = [mp.Pipe() for _ in range(3)]
    hub = PipeHub([parent for parent, _ in pairs], max_message_bytes=1 << 20)
    good = PipeSpoke(pairs[0][1])
    try:
        pairs[1][1].send_bytes(b"not a zmqsync pipe header")
        pairs[2][1].send_bytes(struct.pack("<4sI", b"ZSP2", 1))
        pairs[2][1].send_bytes(struct.pack("<Q", 1 << 40))  # a 1 TiB frame, never sent
        _lose_them_and_serve_worker_0(hub, good, lost=2, within=5.0)
    finally:
        hub.close()
        good.close()
        for _, child in pairs[1:]:
            child.close()


@pytest.mark.parametrize("cut", ["in-its-length", "in-its-bytes"])
def test_a_worker_that_stops_in_the_middle_of_a_record_costs_only_its_pipe(
    cut: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that writes part of a record and then nothing (stopped, or hostile)
    loses its own pipe once the stall bound passes: the hub never waits on it without a
    bound, and the others are served."""
    from zmqsync.transport.pipe import framing

    monkeypatch.setattr(framing, "STALL_SECONDS", 0.5)
    pairs = [mp.Pipe() for _ in range(2)]
    hub = PipeHub([parent for parent, _ in pairs])
    good = PipeSpoke(pairs[0][1])
    stuck = framing.socket_of(pairs[1][1], "the test's end")
    try:
        record = struct.pack("!i", 64) + b"x" * 10  # a 64-byte record, 10 bytes of it
        stuck.sendall(record[:2] if cut == "in-its-length" else record)
        _lose_them_and_serve_worker_0(hub, good, lost=1, within=10.0)
    finally:
        hub.close()
        good.close()
        stuck.close()
        pairs[1][1].close()


def _wire(frames: list[bytes]) -> bytes:
    """A message's bytes on a pipe, as a worker writes them: two records, then the frames."""
    from zmqsync.transport.pipe.framing import message_head

    head, table = message_head(frames)
    records = b"".join(struct.pack("!i", len(r)) + r for r in (head, table))
    return records + b"".join(frames)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cut", [2, 9, 14, 40, 1000])  # in each record, in the frames
def test_a_worker_that_wrote_part_of_a_message_holds_up_nobody_else(
    cut: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hub reads every worker on one thread. A worker that writes part of a message
    and pauses (stopped, slow) keeps its pipe and what it wrote, and the hub serves the
    others meanwhile: it never waits on the rest. Once the rest comes, the message is
    whole; a worker that never writes the rest loses its own pipe once ``STALL_SECONDS``
    pass without a byte."""
    from zmqsync.transport.pipe import framing

    monkeypatch.setattr(framing, "STALL_SECONDS", 3.0)
    pairs = [mp.Pipe() for _ in range(2)]
    hub = PipeHub([parent for parent, _ in pairs])
    good = PipeSpoke(pairs[0][1])
    slow = framing.socket_of(pairs[1][1], "the test's end")
    wire = _wire([b"a" * 7, bytes(range(256)) * 8, b""])
    assert len(wire) > 1000
    try:
        slow.sendall(wire[:cut])
        # Its bytes are there: the hub reads them, keeps them, and goes on.
        assert hub.recv_frames(0.2) is None
        for i in range(3):
            good.send_frames([b"hello %d" % i])
            got = hub.recv_frames(5.0)
            assert got is not None and got.peer == peer_id(0)
            assert [bytes(f) for f in got.frames] == [b"hello %d" % i]
        assert hub.counters()["peers_lost"] == 0
        # The rest, in two writes: the message arrives whole.
        slow.sendall(wire[cut : cut + 3])
        assert hub.recv_frames(0.1) is None
        slow.sendall(wire[cut + 3 :])
        got = hub.recv_frames(5.0)
        assert got is not None and got.peer == peer_id(1)
        assert [bytes(f) for f in got.frames] == [b"a" * 7, bytes(range(256)) * 8, b""]
        # Part of the next, and nothing more: only that pipe is given up.
        slow.sendall(wire[:cut])
        started = time.monotonic()
        _lose_them_and_serve_worker_0(hub, good, lost=1, within=15.0)
        assert time.monotonic() - started >= 2.5  # not before its bound (0.5 s of slack)
        assert hub.counters()["peers_lost"] == 1
    finally:
        hub.close()
        good.close()
        slow.close()
        pairs[1][1].close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cut", [2, 9, 14, 40, 1000])  # in each record, in the frames
def test_a_hub_that_wrote_part_of_a_message_is_waited_for_within_each_read(
    cut: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A learner stopped in the middle of writing a message (SIGSTOP, a debugger) and
    continued later costs its worker only the wait: each of the worker's reads returns
    at its own deadline meanwhile, the pipe is kept however long the pause (here past
    the hub's stall bound), and the message arrives whole."""
    from zmqsync.transport.pipe import framing

    monkeypatch.setattr(framing, "STALL_SECONDS", 0.3)
    parent, child = mp.Pipe()
    spoke = PipeSpoke(child)
    hub = framing.socket_of(parent, "the test's hub")
    frames = [b"a" * 7, bytes(range(256)) * 8, b""]
    wire = _wire(frames)
    try:
        assign = framing.HEADER.pack(framing.ASSIGN, 3)
        hub.sendall(struct.pack("!i", len(assign)) + assign + wire[:cut])
        for _ in range(3):  # 1.2 s in all: four times the bound
            started = time.monotonic()
            assert spoke.recv_frames(0.4) is None
            assert time.monotonic() - started < 5.0  # its own deadline, not a stall's
        assert spoke.peer_index == 3
        hub.sendall(wire[cut:])
        got = spoke.recv_frames(5.0)
        assert got is not None and [bytes(f) for f in got] == frames
    finally:
        spoke.close()
        hub.close()
        parent.close()


def _read_within(reader: Any, sock: Any, within: float) -> Any:
    """``reader``'s next unit, waiting on ``sock`` for its bytes (never past ``within``)."""
    import select

    deadline = time.monotonic() + within
    while (got := reader.read()) is None:
        left = deadline - time.monotonic()
        assert left > 0, "no unit came"
        select.select([sock], [], [], left)
    return got


def test_the_hub_reads_a_unit_that_comes_a_byte_at_a_time() -> None:
    """The hub's reader returns nothing until a unit is whole, whatever the cuts, and
    says since when the unit under way has waited; between units it waits for nothing.
    A message over the limit is refused from its table, before its bytes are taken; an
    end in the middle of a unit is no clean end."""
    import socket

    from zmqsync.transport.pipe.units import UnitReader

    here, there = socket.socketpair()
    try:
        reader = UnitReader(there, max_message_bytes=4096)
        frames = [b"x" * 5, bytes(range(200))]
        release = encode(Release((3, 4)))
        stream = _wire(frames) + struct.pack("!i", len(release)) + release
        units = []
        for byte in range(len(stream)):
            here.sendall(stream[byte : byte + 1])
            got = reader.read()
            if got is None:
                assert reader.since is not None
            else:
                units.append(got)
                assert reader.since is None
        assert [bytes(f) for f in units[0].frames or []] == frames
        assert units[1].release == Release((3, 4))
        assert len(units) == 2 and reader.read() is None and reader.since is None
        # Over the limit: refused once its table says so (the frames never sent).
        here.sendall(_wire([b"y" * 5000])[:-5000])
        with pytest.raises(OSError, match="exceeds the limit"):
            _read_within(reader, there, 10.0)
        # An end in the middle of a unit.
        other = UnitReader(here, max_message_bytes=None)
        there.sendall(struct.pack("!i", 64) + b"z" * 10)
        there.close()
        with pytest.raises(EOFError, match="middle of a record"):
            _read_within(other, here, 10.0)
    finally:
        here.close()
        there.close()


def test_only_duplex_pipe_ends_are_accepted() -> None:
    reader, writer = mp.Pipe(duplex=False)
    try:
        with pytest.raises(ValueError, match="duplex"):
            PipeHub([reader])
        with pytest.raises(ValueError, match="duplex"):
            PipeSpoke(writer)
    finally:
        reader.close()
        writer.close()


@pytest.mark.timeout(60)
def test_a_worker_left_out_of_a_targeted_send_stays_behind() -> None:
    """DESIGN: ``worker_ids`` changes exactly those workers, also after a few heartbeats."""
    hub, spokes = _pipe_fleet(2)
    sender = zmqsync.WeightSender(
        hub,
        model=nn.Linear(4, 4),
        strategy="state_dict",
        num_workers=2,
        timeout=10,
        heartbeat=0.1,
        repair_after=0.1,
    )
    receivers = [
        zmqsync.WeightReceiver(spoke, model=nn.Linear(4, 4), strategy="state_dict", worker_idx=i)
        for i, spoke in enumerate(spokes)
    ]
    try:
        for receiver in receivers:
            receiver.connect()
            receiver.start()
        sender.send()
        sender.send(worker_ids=[0])
        deadline = time.monotonic() + 1.0  # ten heartbeats
        while time.monotonic() < deadline:
            assert [r.version for r in receivers] == [2, 1]
            time.sleep(0.05)
    finally:
        for receiver in receivers:
            receiver.close()
        sender.close()


# --- the scheme's surface ------------------------------------------------------------------


def test_scheme_surface_before_and_after_init() -> None:
    scheme = MultiProcessWeightSyncScheme()
    assert scheme.strategy == "state_dict"
    with pytest.raises(RuntimeError, match="init_on_sender"):
        scheme.get_sender()
    with pytest.raises(RuntimeError, match="init_on_worker"):
        scheme.get_receiver()
    with pytest.raises(ValueError, match="pipes"):
        scheme.init_on_sender("policy", model=nn.Linear(2, 2))
    parent, child = mp.Pipe()
    with pytest.raises(ValueError, match="num_workers=2"):
        scheme.init_on_sender("policy", pipes=[parent], num_workers=2, model=nn.Linear(2, 2))
    weights = scheme.prepare_weights(nn.Linear(2, 3), "policy", "state_dict")
    assert set(weights) == {"weight", "bias"}
    hub = scheme.create_transport(parent)
    spoke = scheme.create_transport(child, role="spoke")
    try:
        assert isinstance(hub, PipeHub) and isinstance(spoke, PipeSpoke)
        assert spoke.wait_index(5.0) == 0
    finally:
        hub.close()
        spoke.close()


# --- end to end: worker processes ------------------------------------------------------------


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


def pipe_worker(
    scheme: MultiProcessWeightSyncScheme, pipe: Any, control: Any, seed: int, use_context: bool
) -> None:
    """A worker process: join over its pipe, apply versions in the background, and answer
    the test's questions on a separate control pipe (test harness only)."""
    try:
        model = make_model(seed)  # differs from the sender's
        if use_context:
            scheme.init_on_worker("policy", SimpleNamespace(pipe=pipe, policy=model))
        else:
            scheme.init_on_worker("policy", pipe=pipe, model=model)
        scheme.connect(timeout=60)
        scheme.start_receiver_thread()
        receiver = scheme.get_receiver()
        control.send(("ready", scheme.worker_idx))
        while True:
            if not control.poll(0.05):
                continue
            if control.recv() == "stop":
                break
            with scheme.lock:
                control.send((receiver.version, zmqsync.checksum(model, scheme.strategy)))
    except BaseException:  # report to the test, then exit
        control.send(("error", traceback.format_exc()))
    finally:
        scheme.shutdown()


class PipeFleet:
    """Worker processes, each with its weights pipe and a control pipe."""

    def __init__(self, n: int) -> None:
        self.pipes = [SPAWN.Pipe() for _ in range(n)]
        self.procs: dict[int, Any] = {}
        self.controls: dict[int, Any] = {}

    @property
    def sender_ends(self) -> list[Any]:
        return [parent for parent, _ in self.pipes]

    def start(
        self, scheme: MultiProcessWeightSyncScheme, i: int, *, use_context: bool = False
    ) -> None:
        control, child_control = SPAWN.Pipe()
        child = self.pipes[i][1]
        proc = SPAWN.Process(
            target=pipe_worker,
            args=(scheme, child, child_control, 100 + i, use_context),
            daemon=True,
        )
        proc.start()
        # The worker holds its end now: closing ours lets the sender see it die at once.
        child.close()
        child_control.close()
        self.procs[i], self.controls[i] = proc, control

    def ready(self, i: int, timeout: float = 90.0) -> int:
        reply = self._reply(i, timeout)
        assert reply[0] == "ready", reply
        return int(reply[1])

    def _reply(self, i: int, timeout: float) -> Any:
        if not self.controls[i].poll(timeout):
            raise TimeoutError(f"worker {i} did not answer in {timeout}s")
        reply = self.controls[i].recv()
        if reply[0] == "error":
            raise AssertionError(f"worker {i} failed:\n{reply[1]}")
        return reply

    def state(self, i: int) -> tuple[int, str]:
        self.controls[i].send("state")
        return self._reply(i, 30.0)  # type: ignore[no-any-return]

    def kill(self, i: int) -> None:
        os.kill(self.procs[i].pid, signal.SIGKILL)
        self.procs[i].join(10)

    def close(self) -> None:
        for i, proc in self.procs.items():
            if proc.is_alive():
                with contextlib.suppress(OSError):  # it may be dying right now
                    self.controls[i].send("stop")
        for proc in self.procs.values():
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


@pytest.fixture
def pipe_fleet() -> Iterator[Any]:
    fleets: list[PipeFleet] = []

    def make(n: int) -> PipeFleet:
        fleets.append(PipeFleet(n))
        return fleets[-1]

    yield make
    for fleet in fleets:
        fleet.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pipe_workers_exact_targeted_isolated_dead_named_late_and_restarted(pipe_fleet) -> None:  # type: ignore[no-untyped-def]
    """Pipes for four workers; three start (before the sender exists), one later. The
    promises in order, ending with a SIGKILLed worker restarted on a new pipe."""
    fleet = pipe_fleet(4)
    model = make_model(0)
    scheme = MultiProcessWeightSyncScheme(timeout=5)
    for i in range(3):
        fleet.start(scheme, i)
    # num_workers=None: send() targets the workers that have joined (3 is not there yet).
    scheme.init_on_sender("policy", pipes=fleet.sender_ends, model=model, num_workers=None)
    try:
        assert sorted(fleet.ready(i) for i in range(3)) == [0, 1, 2]  # indices came down the pipes

        # Every worker exact after send(), version after version.
        for version in (1, 2):
            bump(model)
            scheme.send()
            expected = zmqsync.checksum(model)
            assert [fleet.state(i) for i in range(3)] == [(version, expected)] * 3

        # worker_ids=[0] changes worker 0 and no other.
        v2 = zmqsync.checksum(model)
        bump(model)
        scheme.send(worker_ids=[0])
        v3 = zmqsync.checksum(model)
        assert fleet.state(0) == (3, v3)
        assert [fleet.state(i)[1] for i in (1, 2)] == [v2, v2]

        # The sender changing its weights without sending changes no worker.
        bump(model)
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:  # look for a (wrong) change for a while
            assert fleet.state(0)[1] == v3
            assert fleet.state(1)[1] == v2

        # A SIGKILLed worker is named at once: its pipe broke, so the sender does not
        # wait out the timeout for it.
        fleet.kill(2)
        start = time.monotonic()
        with pytest.raises(SyncTimeout) as info:
            scheme.send()
        took = time.monotonic() - start
        assert info.value.missing_workers == [2]
        assert info.value.transports == {2: "pipe"}
        assert "worker 2" in str(info.value) and "gone" in str(info.value)
        assert took < scheme.timeout, took
        assert scheme.status()["totals"]["peers_lost"] == 1

        # The next send to the living succeeds.
        bump(model)
        scheme.send(worker_ids=[0, 1])
        latest = (scheme.get_sender().version, zmqsync.checksum(model))
        assert [fleet.state(i) for i in (0, 1)] == [latest, latest]

        # A late joiner reaches the latest version on connect, without a resend to all.
        sent = scheme.status()["totals"]["versions_sent"]
        fleet.start(scheme, 3)
        assert fleet.ready(3) == 3
        assert fleet.state(3) == latest
        assert scheme.status()["totals"]["versions_sent"] == sent

        # The killed worker restarts on a new pipe and catches up the same way.
        parent, child = SPAWN.Pipe()
        fleet.pipes[2] = (parent, child)
        scheme.add_pipe(parent, 2)
        fleet.start(scheme, 2)
        assert fleet.ready(2) == 2
        assert fleet.state(2) == latest

        # And the whole fleet is served again.
        bump(model)
        scheme.send()
        latest = (scheme.get_sender().version, zmqsync.checksum(model))
        assert [fleet.state(i) for i in range(4)] == [latest] * 4
    finally:
        scheme.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_pipe_scheme_from_context_objects_tensordict(pipe_fleet) -> None:  # type: ignore[no-untyped-def]
    """The seed's other way in: a context providing pipes / num_workers / the model on the
    sender, and pipe / the model on each worker."""
    fleet = pipe_fleet(2)
    model = make_model(0)
    scheme = MultiProcessWeightSyncScheme("tensordict", timeout=20)
    scheme.init_on_sender(
        "policy", SimpleNamespace(pipes=fleet.sender_ends, num_workers=2, policy=model)
    )
    try:
        for i in range(2):
            fleet.start(scheme, i, use_context=True)
        assert sorted(fleet.ready(i) for i in range(2)) == [0, 1]
        # Joined with the sender's current weights (version 0: nothing sent yet).
        assert [fleet.state(i)[0] for i in range(2)] == [0, 0]
        for version in (1, 2, 3):
            bump(model)
            scheme.send()
            expected = zmqsync.checksum(model, "tensordict")
            assert [fleet.state(i) for i in range(2)] == [(version, expected)] * 2
        assert scheme.get_sender().transport.counters()["peers_lost"] == 0
    finally:
        scheme.shutdown()


def misfit_pipe_worker(scheme: MultiProcessWeightSyncScheme, pipe: Any, control: Any) -> None:
    """A worker process whose model is not the learner's (its last layer has 5 outputs,
    not 4): reports what connect() did and whether its model kept its weights, then, on
    "stop", how long shutting down took."""
    try:
        torch.manual_seed(5)
        model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 5))
        before = zmqsync.checksum(model)
        scheme.init_on_worker("policy", pipe=pipe, model=model)
        outcome: tuple[Any, ...]
        try:
            scheme.connect(timeout=60)
            outcome = ("returned", scheme.get_receiver().version)
        except zmqsync.SchemaMismatchError as exc:
            outcome = ("raised", str(exc), exc.key)
        control.send((outcome, zmqsync.checksum(model) == before))
        control.recv()
        start = time.monotonic()
        scheme.shutdown()
        control.send(("closed", time.monotonic() - start))
    except BaseException:  # report to the test, then exit
        control.send(("error", traceback.format_exc()))
    finally:
        scheme.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_pipe_worker_whose_model_does_not_fit_fails_connect(pipe_fleet) -> None:  # type: ignore[no-untyped-def]
    """Its connect() used to return as if synced while it kept its own weights."""
    fleet = pipe_fleet(2)
    model = make_model(0)
    scheme = MultiProcessWeightSyncScheme(timeout=20)
    scheme.init_on_sender("policy", pipes=fleet.sender_ends, model=model, num_workers=None)
    try:
        bump(model)
        scheme.send()  # version 1: nobody has joined yet, so it waits for nobody
        control, child_control = SPAWN.Pipe()
        proc = SPAWN.Process(
            target=misfit_pipe_worker, args=(scheme, fleet.pipes[1][1], child_control), daemon=True
        )
        proc.start()
        fleet.pipes[1][1].close()
        child_control.close()
        fleet.procs[1], fleet.controls[1] = proc, control
        outcome, unchanged = fleet._reply(1, 90.0)
        assert outcome[0] == "raised", outcome
        assert "'3.weight' has shape [4, 32] in the weights but [5, 32]" in outcome[1]
        assert outcome[2] == "3.weight" and unchanged

        # The learner counted the refusal, and serves a worker that fits as before.
        deadline = time.monotonic() + 30
        while not _rejections(scheme, 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "'3.weight' has shape" in _rejections(scheme, 1)[-1]
        fleet.start(scheme, 0)
        assert fleet.ready(0) == 0
        assert fleet.state(0) == (1, zmqsync.checksum(model))
        bump(model)
        scheme.send(worker_ids=[0])
        assert fleet.state(0) == (2, zmqsync.checksum(model))

        control.send("stop")
        closed, took = fleet._reply(1, 30.0)
        assert closed == "closed" and took < 5.0
    finally:
        scheme.shutdown()


def _rejections(scheme: MultiProcessWeightSyncScheme, worker: int) -> list[str]:
    status = {w["worker"]: w for w in scheme.status()["workers"]}
    return list(status.get(worker, {}).get("rejections", []))


def test_large_messages_reuse_buffers_only_once_nobody_holds_them() -> None:
    """Without shared memory, large messages go through the socket into pooled buffers."""
    import gc

    hub, (spoke,) = _pipe_fleet(1, shared_memory=False)
    try:
        spoke.wait_index(10)
        big = torch.arange(512 * 1024, dtype=torch.float32)  # 2 MiB
        header = b"h" * 46

        def send_and_receive(value: float) -> list[Any]:
            big.fill_(value)
            hub.send_frames([header, memoryview(big.numpy())])
            big.fill_(-1.0)  # the caller's memory changes at once: the hub copied it
            frames = spoke.recv_frames(10)
            assert frames is not None
            return frames

        first = send_and_receive(1.0)
        second = send_and_receive(2.0)  # first still held: a different buffer
        assert torch.frombuffer(bytearray(first[1]), dtype=torch.float32).eq(1.0).all()
        assert torch.frombuffer(bytearray(second[1]), dtype=torch.float32).eq(2.0).all()
        held = first[1]
        del first, second
        gc.collect()
        assert len(spoke._pool._free) == 1  # the second's buffer is back; the held one not
        # Written messages' copies are back too, once the hub's writer thread is done.
        deadline = time.monotonic() + 10
        while not hub._pool._free:
            assert time.monotonic() < deadline, "the hub's copies never came back"
            time.sleep(0.01)
        third = send_and_receive(3.0)  # reuses the second's buffer, never the held one
        assert spoke._pool._free == []
        assert torch.frombuffer(bytearray(held), dtype=torch.float32).eq(1.0).all()
        assert torch.frombuffer(bytearray(third[1]), dtype=torch.float32).eq(3.0).all()
    finally:
        spoke.close()
        hub.close()


def test_large_frames_travel_through_shared_memory_blocks_reused_once_released() -> None:
    """Large frames are written once into a shared block that the worker reads in place;
    a block comes back only once the worker let go of every frame in it."""
    import gc

    hub, (spoke,) = _pipe_fleet(1)
    try:
        spoke.wait_index(10)
        big = torch.arange(512 * 1024, dtype=torch.float32)  # 2 MiB

        def send_and_receive(value: float) -> list[Any]:
            big.fill_(value)
            hub.send_frames([b"h" * 46, memoryview(big.numpy())])
            big.fill_(-1.0)  # the caller's memory changes at once: the hub copied it
            frames = spoke.recv_frames(10)
            assert frames is not None
            return frames

        first = send_and_receive(1.0)
        assert isinstance(first[1], np.ndarray) and not first[1].flags.writeable
        assert hub.counters()["shm_bytes"] >= big.nbytes
        second = send_and_receive(2.0)
        held = first[1]
        del first
        second_block = hub._shm.locate(second[1]) if hub._shm else None  # the worker's view
        assert second_block is None  # mapped separately in the worker: not the hub's address
        del second
        gc.collect()

        # The worker's release reaches the hub when it next reads (it let go of the
        # frames on its reading thread, which takes the release along).
        def busy() -> list[Any]:
            return [b for b in hub._shm._blocks.values() if b.leases]  # type: ignore[union-attr]

        assert spoke.recv_frames(0) is None
        _read_until(hub, lambda: len(busy()) <= 1, "the worker's release reaching the hub")
        assert hub.recv_frames(0.2) is None
        assert hub.counters()["bad_releases"] == 0
        blocks = dict(hub._shm._blocks)  # type: ignore[union-attr]
        assert len(busy()) == 1, "only the block whose frame the worker still holds is busy"
        third = send_and_receive(3.0)
        assert (held.view(np.float32) == 1.0).all(), "a held block was reused"
        assert (third[1].view(np.float32) == 3.0).all()
        assert set(hub._shm._blocks) == set(blocks), "the released block was not reused"  # type: ignore[union-attr]

        # A read-only view of memory the hub lent is sent without another copy.
        lent = hub.lend(big.nbytes)
        assert lent is not None
        np.copyto(lent, big.numpy().view(np.uint8))
        before = hub.counters()["shm_bytes"]
        hub.send_frames([b"h" * 46, memoryview(lent).toreadonly()])
        got = spoke.recv_frames(10)
        assert got is not None and np.array_equal(got[1], lent)
        assert hub.counters()["shm_bytes"] == before

        # A worker that releases what it never held is counted, and nothing breaks.
        spoke._writer.put(Outgoing(None, record=encode(Release((999,)))))
        _read_until(hub, lambda: hub.counters()["bad_releases"] >= 1, "the bad release")
        assert hub.counters()["bad_releases"] == 1
        # ... as is one that releases a real block more often than it was sent it.
        writer = hub._peers[peer_id(0)].writer
        block = next(iter(hub._shm._blocks.values()))  # type: ignore[union-attr]
        for _ in range(block.leases.get(writer, 0) + 1):
            spoke._writer.put(Outgoing(None, record=encode(Release((block.id,)))))
        _read_until(hub, lambda: hub.counters()["bad_releases"] >= 2, "the extra release")
        assert hub.recv_frames(0.2) is None
        assert hub.counters()["bad_releases"] == 2
        del got, third, held
        assert send_and_receive(4.0)[1].view(np.float32)[0] == 4.0
    finally:
        spoke.close()
        hub.close()


def test_a_lost_worker_holds_no_shared_block() -> None:
    hub, (spoke, other) = _pipe_fleet(2)
    try:
        spoke.wait_index(10)
        other.wait_index(10)
        hub.send_frames([b"h" * 46, np.ones(1 << 20, dtype=np.uint8)])
        held = spoke.recv_frames(10)
        assert held is not None
        assert any(b.leases for b in hub._shm._blocks.values())  # type: ignore[union-attr]
        spoke.close()  # the worker goes, its frames still alive in this test process
        deadline = time.monotonic() + 10
        while not hub.lost_peers():
            assert time.monotonic() < deadline
            hub.recv_frames(0.1)
        readers = [dict(b.leases) for b in hub._shm._blocks.values()]  # type: ignore[union-attr]
        assert all(peer is not hub._peers[peer_id(0)].writer for r in readers for peer in r)
    finally:
        other.close()
        hub.close()


def test_the_releases_of_frames_let_go_of_together_reach_the_hub_as_one_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A version's chunks lie in one block, each a message with its lease: let go of
    together (the next version is in), their releases go to the hub in one record, not
    one each; more than a record may name go in several; and every lease is released."""
    import gc

    hub, (spoke,) = _pipe_fleet(1)
    try:
        spoke.wait_index(10)
        block = hub.lend(20 * 65536)
        assert block is not None
        block[:] = np.arange(block.nbytes, dtype=np.uint64).astype(np.uint8)

        def held() -> int:
            return sum(sum(b.leases.values()) for b in hub._shm._blocks.values())  # type: ignore[union-attr]

        # A thread switch in the middle of the 20 finalizers may split a record in two.
        for limit, records in ((None, range(1, 4)), (6, range(4, 7))):
            if limit is not None:
                monkeypatch.setattr("zmqsync.transport.pipe.spoke.MAX_LIVE", limit)
            before = spoke.counters()
            for i in range(20):
                view = memoryview(block[i * 65536 : (i + 1) * 65536]).toreadonly()
                hub.send_frames([b"h" * 46, view], stream=Stream.START if i == 0 else Stream.MORE)
            got = [spoke.recv_frames(10) for _ in range(20)]
            assert all(
                g is not None and np.array_equal(g[1], block[i * 65536 : (i + 1) * 65536])
                for i, g in enumerate(got)
            )  # type: ignore[index]
            assert held() == 20
            del got
            gc.collect()
            _read_until(hub, lambda: held() == 0, "every lease released")
            after = spoke.counters()
            assert after["releases"] - before["releases"] == 20
            assert after["release_records"] - before["release_records"] in records
            assert hub.counters()["bad_releases"] == 0
    finally:
        spoke.close()
        hub.close()


@pytest.mark.timeout(60)
def test_releases_made_on_the_reading_thread_go_with_its_next_ack_or_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker lets go of a version's frames on its reading thread just before its ack:
    the release waits for that thread's next write (the ack, ahead of it in one write)
    or read (which writes it itself), and wakes no writer thread. Frames let go of on
    any other thread (a sink's) are released at once, while the reading thread waits.
    The writer thread's idle tick is put out of reach here: nothing below arrives by
    it."""
    import gc
    import threading

    monkeypatch.setattr("zmqsync.transport.pipe.writer._IDLE_SECONDS", 600.0)
    hub, (spoke,) = _pipe_fleet(1)
    try:
        spoke.wait_index(10)
        assert hub.recv_frames(0) is None  # the wake-up of the pipe added at the start
        big = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: through a shared block

        def held() -> int:
            return sum(sum(b.leases.values()) for b in hub._shm._blocks.values())  # type: ignore[union-attr]

        def one_version() -> Any:
            hub.send_frames([b"h" * 46, memoryview(big)])
            got = spoke.recv_frames(10)
            assert got is not None and np.array_equal(got[1].view(np.float32), big)
            assert held() == 1
            return got

        # Let go of on the reading thread, then an ack: the hub reads the release first.
        got = one_version()
        del got
        gc.collect()
        assert len(spoke._releases) == 1 and spoke._release_queued  # made, not written
        spoke.send_frames([b"ack"], ack=True)
        assert held() == 1  # the hub has not read it yet
        incoming = hub.recv_frames(10)
        assert incoming is not None and [bytes(f) for f in incoming.frames] == [b"ack"]
        assert held() == 0, "the release did not go ahead of the ack"

        # Let go of on the reading thread, then a read that times out: it goes then,
        # written by the reading thread itself (nothing is left for the writer's thread).
        got = one_version()
        del got
        gc.collect()
        assert spoke.recv_frames(0) is None
        assert not spoke._writer._queue and not spoke._releases
        _read_until(hub, lambda: held() == 0, "the release written by the next read")

        # Let go of on another thread while the reading thread waits for a message.
        got = one_version()
        box = [got]
        del got
        waiting = threading.Thread(target=spoke.recv_frames, args=(5.0,))
        waiting.start()
        dropper = threading.Thread(target=box.clear)
        dropper.start()
        dropper.join(10)
        _read_until(hub, lambda: held() == 0, "the release made on another thread")
        waiting.join(10)
        assert not waiting.is_alive()
        assert hub.counters()["bad_releases"] == 0
    finally:
        spoke.close()
        hub.close()


@pytest.mark.parametrize("cut", ["after-header", "in-last-frame"])
def test_a_message_that_arrives_in_parts_is_read_whole(
    cut: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker reads a message's records and frames without waiting while they are
    there, and waits for the part still on its way: the rest written only once the
    worker has read what was there (its frame table, or the end of a large frame), as a
    peer on a busy machine writes it, ends up in the same message."""
    import threading

    from zmqsync.transport.pipe.framing import message_head, socket_of
    from zmqsync.transport.pipe.units import UnitReader
    from zmqsync.transport.pipe.writer import _framed

    waits = threading.Event()
    read = UnitReader.read

    def reading(reader: UnitReader) -> Any:
        got = read(reader)
        if got is None and reader.since is not None:
            waits.set()  # part of a unit read: the rest is waited for
        return got

    monkeypatch.setattr(UnitReader, "read", reading)
    hub_end, worker_end = mp.Pipe()
    spoke = PipeSpoke(worker_end)
    try:
        frames = [b"head", np.arange(1 << 16, dtype=np.int64).tobytes()]  # 512 KiB
        header, lengths = message_head(frames)
        data = b"".join((_framed(header), _framed(lengths), *frames))
        at = len(_framed(header)) if cut == "after-header" else len(data) - 1000
        raw = socket_of(hub_end, "the test's end")

        def write() -> None:
            raw.sendall(data[:at])
            waits.wait(10)  # the worker read what is there and waits for the rest
            raw.sendall(data[at:])

        writer = threading.Thread(target=write)
        writer.start()
        got = spoke.recv_frames(10)
        writer.join(10)
        assert waits.is_set(), "the worker never waited for the rest"
        assert got is not None
        assert [bytes(f) for f in got] == frames
        assert spoke.recv_frames(0) is None
    finally:
        spoke.close()
        hub_end.close()


def test_a_pipe_hub_is_waited_for_on_its_pipes_holding_nothing() -> None:
    """The sender's thread between sends waits on the hub's descriptors, not inside
    ``recv_frames``: they become readable when a worker writes and when a pipe is
    added (a late joiner), and ``has_input`` says whether anything waits."""
    import select

    from zmqsync.transport.base import Waitable

    hub, (spoke,) = _pipe_fleet(1)
    late: PipeSpoke | None = None
    try:
        assert isinstance(hub, Waitable)
        spoke.wait_index(10)
        assert hub.recv_frames(0) is None  # the wake-up of the pipe added at the start

        def readable(timeout_ms: int) -> bool:
            poller = select.poll()
            for fd in hub.wait_handles():
                poller.register(fd, select.POLLIN)
            return bool(poller.poll(timeout_ms))

        assert not hub.has_input() and not readable(0)
        spoke.send_frames([b"hello"])
        assert readable(10_000) and hub.has_input()
        incoming = hub.recv_frames(0)
        assert incoming is not None and [bytes(f) for f in incoming.frames] == [b"hello"]
        assert hub.recv_frames(0) is None
        assert not hub.has_input() and not readable(0)

        # A pipe added wakes whoever waits, so that it waits on the new pipe too.
        here, there = mp.Pipe()
        handles = len(hub.wait_handles())
        hub.add_pipe(here, 1)
        assert readable(10_000) and hub.has_input()
        assert hub.recv_frames(0) is None  # the wake-up, read
        assert len(hub.wait_handles()) == handles + 1
        late = PipeSpoke(there)
        assert late.wait_index(10) == 1
        late.send_frames([b"late"])
        assert readable(10_000)
        incoming = hub.recv_frames(0)
        assert incoming is not None and incoming.peer == peer_id(1)
        hub.close()
        assert hub.wait_handles() == [] and not hub.has_input()
    finally:
        spoke.close()
        if late is not None:
            late.close()
        hub.close()


def test_records_written_at_once_keep_their_order_with_a_peer_that_does_not_read() -> None:
    """``put_now`` writes a small record on the caller's thread, after the few control
    records queued before it: when the pipe is full it writes what fits and queues the
    rest, or nothing (the caller queues the record). Whatever mix of the two, the peer
    reads every record whole and in order once it reads, and the caller never waited."""
    import time

    from zmqsync.transport.pipe.framing import socket_of
    from zmqsync.transport.pipe.writer import Writer, close_end

    here, there = mp.Pipe()
    writer = Writer(here, socket_of(here, "test pipe"), "test")
    sent, now = [], 0
    started = time.monotonic()
    try:
        queued = 0
        while queued < 100:  # written at once until the pipe is full, then queued
            record = b"%06d" % len(sent) + bytes(1000)
            if writer.put_now(record):
                now += 1
            else:
                assert writer.put(Outgoing(None, record=record))
                queued += 1
            sent.append(record)
            assert len(sent) < 100_000, "the pipe never filled"
        assert time.monotonic() - started < 30  # it never blocked on the peer
        assert now > 10
        got = [there.recv_bytes() for _ in sent if there.poll(10)]
        assert got == sent
    finally:
        close_end(here, socket_of(here, "test pipe"), writer)
        there.close()


def test_small_messages_written_at_once_read_as_queued_ones() -> None:
    """A worker's small messages (acks) go out on its own thread (``message_now``), with
    the releases queued before them and not written yet (each release record made once,
    when written): the hub reads each message's frames and each release as it would
    have from the writer thread, in the order they were given. A message too large, or
    one behind a queued message, waits for the writer thread."""
    from zmqsync.transport.pipe.framing import socket_of
    from zmqsync.transport.pipe.units import UnitReader
    from zmqsync.transport.pipe.writer import Writer, close_end
    from zmqsync.transport.shm.records import Release, encode

    here, there = mp.Pipe()
    writer = Writer(here, socket_of(here, "test pipe"), "test")
    made: list[int] = []

    def release() -> bytes:
        made.append(len(made) + 1)
        return encode(Release((len(made),)))

    def message(i: int) -> list[bytes]:
        return [b"ack-%d" % i, np.arange(i, dtype=np.int32).tobytes()]

    try:
        # Holding the writer's condition keeps its thread from taking anything: what
        # goes out now is what this thread writes.
        with writer._cond:
            writer.put(Outgoing(None, make=release))
            writer.put(Outgoing(None, make=release))
            assert writer.message_now(message(0))  # the two releases go first, with it
            assert made == [1, 2]
            assert writer.message_now(message(1))
            writer.put(Outgoing(message(2)))  # a message queued: the next ones wait
            writer.put(Outgoing(None, make=release))
            assert not writer.message_now(message(3))
            writer.put(Outgoing(message(3)))
            assert made == [1, 2]  # the last release is made when the thread writes it
        assert not writer.message_now([bytes(64 * 1024)])  # too large: the caller queues it
        reader = UnitReader(socket_of(there, "test pipe"), None)  # as the hub reads
        got: list[Any] = []
        while len(got) < 7:
            assert there.poll(10), got
            unit = reader.read()
            if unit is None:
                continue  # the rest of a unit is on its way
            if unit.release is not None:
                got.append(unit.release.blocks)
            else:
                got.append([bytes(f) for f in unit.frames or []])
        assert got == [(1,), (2,), message(0), message(1), message(2), (3,), message(3)]
        assert made == [1, 2, 3]
    finally:
        close_end(here, socket_of(here, "test pipe"), writer)
        there.close()


def test_leases_go_out_on_the_sending_thread_and_in_order_when_the_pipe_fills() -> None:
    """Once a worker has a block, the hub writes a lease on it from the sending thread
    when the worker's writer is idle: it arrives while the writer's thread is held. A
    worker that does not read fills its pipe; the hub never waits on it, and once it
    reads, every message of the version arrives whole and in order, each lease
    released as before."""
    import gc

    hub, (spoke,) = _pipe_fleet(1)
    try:
        spoke.wait_index(10)
        n, size = 64, 65536
        block = hub.lend(n * size)
        assert block is not None
        block[:] = np.arange(block.nbytes, dtype=np.uint64).astype(np.uint8)

        def chunk(i: int) -> memoryview:
            return memoryview(block[i * size : (i + 1) * size]).toreadonly()

        hub.send_frames([b"h" * 46, chunk(0)], stream=Stream.START)  # the block's descriptor
        first = spoke.recv_frames(10)
        assert first is not None and np.array_equal(first[1], block[:size])
        writer = hub._peers[peer_id(0)].writer
        with writer._cond:  # its thread can take nothing now
            # once it is idle: the spoke may read the first message before the writer's
            # thread, done writing it, says so (a chunk put meanwhile would queue)
            idle = writer._cond.wait_for(lambda: not writer._writing and not writer._queue, 10)
            assert idle, "the writer's thread never finished the first message"
            hub.send_frames([b"h" * 46, chunk(1)], stream=Stream.MORE)
            got = spoke.recv_frames(10)
        assert got is not None and np.array_equal(got[1], block[size : 2 * size])
        del first, got
        gc.collect()

        def held() -> int:
            return sum(sum(b.leases.values()) for b in hub._shm._blocks.values())  # type: ignore[union-attr]

        _read_until(hub, lambda: held() == 0, "both leases released")
        # The worker stops reading: 1,024 leases with 2 KB headers (2 MB) fill its pipe,
        # and the rest waits in the writer's queue (which holds as many).
        started = time.monotonic()
        for round_ in range(16):
            for i in range(n):
                hub.send_frames(
                    [b"%046d" % (round_ * n + i) + bytes(2000), chunk(i)],
                    stream=Stream.START if (round_, i) == (0, 0) else Stream.MORE,
                )
        assert time.monotonic() - started < 30  # it never blocked on the worker
        seen = []
        while (frames := spoke.recv_frames(2)) is not None:
            k = int(bytes(frames[0][:46]))
            assert np.array_equal(frames[1], block[(k % n) * size : (k % n + 1) * size])
            seen.append(k)
            del frames
        assert seen == list(range(16 * n)), seen[-5:]
        gc.collect()
        _read_until(hub, lambda: held() == 0, "every lease released")
        assert hub.counters()["bad_releases"] == 0
    finally:
        spoke.close()
        hub.close()


def test_a_worker_whose_learner_does_not_read_queues_a_bounded_amount() -> None:
    """A learner that stopped reading: the worker's acks and heartbeats, written at
    once while the pipe had room, then queued, never grow its queue past the bound
    (each queued message an item; nothing merged into ever larger bytes)."""
    from zmqsync.transport.pipe.framing import socket_of
    from zmqsync.transport.pipe.writer import MAX_QUEUED, Writer, close_end

    here, there = mp.Pipe()
    writer = Writer(here, socket_of(here, "test pipe"), "test")
    try:
        now = dropped = 0
        for i in range(20_000):
            frames = [b"heartbeat-%08d" % i, bytes(200)]
            if writer.message_now(frames):
                now += 1
            elif not writer.put(Outgoing(list(frames))):
                dropped += 1
        assert now > 10 and dropped > 0  # the pipe filled, then the queue
        with writer._cond:
            queued = list(writer._queue)
        assert len(queued) <= MAX_QUEUED
        assert sum(len(m.raw) for m in queued) < 64 * 1024, "bytes merged while nobody read"
    finally:
        close_end(here, socket_of(here, "test pipe"), writer)
        there.close()
