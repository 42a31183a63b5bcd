"""The receiver's parts on their own, with a fake host: the apply machinery fed chunk
messages, the session speaking to an in-memory hub; and a receiver's observers."""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from _faults import until

from zmqsync import SyncTimeout, WeightSender, checksum
from zmqsync.chunking.layout import MIN_CHUNK_BYTES
from zmqsync.errors import SchemaMismatchError
from zmqsync.protocol import (
    Ack,
    Chunk,
    ErrorMessage,
    Goodbye,
    Hello,
    Message,
    SnapshotRequest,
    UpToDate,
    WeightsSchema,
    Welcome,
    decode,
)
from zmqsync.protocol.stream import Broken
from zmqsync.receiver import PendingAck, ReceiverObserver, WeightReceiver
from zmqsync.receiver.applying import Applier, Keep
from zmqsync.receiver.observer import Observers
from zmqsync.receiver.pace import ReadPace
from zmqsync.receiver.rejections import Rejections
from zmqsync.receiver.session import FAILOVER_MIN_SECONDS, SpokeLock, UpstreamSession
from zmqsync.receiver.stats import new_stats
from zmqsync.tensors.version_messages import version_messages
from zmqsync.testing import memory_fleet
from zmqsync.transport.base import HubTransport, SpokeTransport
from zmqsync.transport.memory import MemoryHub, MemorySpoke

pytestmark = pytest.mark.timeout(60)


def _model(seed: int) -> dict[str, torch.Tensor]:
    """About 300 KB: five chunks of MIN_CHUNK_BYTES."""
    g = torch.Generator().manual_seed(seed)
    return {"big": torch.randn(256, 256, generator=g), "small": torch.randn(10, generator=g)}


def _chunks(weights: Any, version: int = 1, epoch: int = 7) -> list[Chunk]:
    messages = version_messages(weights, version=version, epoch=epoch, chunk_bytes=MIN_CHUNK_BYTES)
    out = []
    for frames in messages:
        chunk = decode([bytes(f) for f in frames])
        assert isinstance(chunk, Chunk)
        out.append(chunk)
    return out


@dataclass
class Watcher(ReceiverObserver):
    """An observer that writes down what it is told (and may hold acks back)."""

    seen: list[tuple[str, Any]] = field(default_factory=list)
    hold_acks: bool = False
    refuse_start: bool = False
    resend: bool = False

    def version_starting(self, chunk: Chunk) -> None:
        self.seen.append(("starting", chunk.version))

    def version_started(self, chunk: Chunk) -> None:
        self.seen.append(("started", chunk.version))
        if self.refuse_start:
            raise RuntimeError("cannot take it")

    def chunk_arrived(self, chunk: Chunk) -> None:
        self.seen.append(("chunk", chunk.index))

    def version_completed(self, chunk: Chunk, schema: WeightsSchema) -> None:
        self.seen.append(("completed", chunk.version))

    def version_broken(self, broken: Broken) -> None:
        self.seen.append(("broken", broken.version))

    def review_ack(self, ack: PendingAck) -> PendingAck | None:
        self.seen.append(("ack", ack.applied))
        return None if self.hold_acks else ack

    def below(self) -> dict[str, Any]:
        return {"9": 3}

    def wants_resend(self) -> bool:
        return self.resend


# --- the apply machinery ------------------------------------------------------------


@dataclass
class ApplyHostFake:
    """What an Applier asks of its receiver: who it is, its spoke, a request upstream."""

    worker_idx: int | None = 4
    transport: SpokeTransport = field(default_factory=lambda: MemorySpoke("inproc://none"))
    requests: list[bool] = field(default_factory=list)

    def request_latest(self, *, whole: bool = False) -> None:
        self.requests.append(whole)


def _applier(
    model: Any = None,
    *,
    apply_mode: str = "staged",
    keep: Keep = "weights",
    watcher: Watcher | None = None,
    chunk_timeout: float = 10.0,
) -> tuple[Applier, ApplyHostFake, Watcher, dict[str, Any]]:
    host, watcher = ApplyHostFake(), watcher or Watcher()
    observers = Observers()
    observers.add(watcher)
    stats = new_stats()
    applier = Applier(
        host,
        model_id="policy",
        model=model,
        strategy="state_dict",
        apply_mode=apply_mode,
        sink=None,
        keep=keep,
        chunk_timeout=chunk_timeout,
        timeout=1.0,
        stats=stats,
        rejections=Rejections(stats),
        observer=observers,
        retired_epochs=4,
    )
    return applier, host, watcher, stats


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["staged", "in_place"])
def test_the_applier_writes_a_whole_version_into_the_model_and_says_so(mode: str) -> None:
    source, model = _model(0), _model(1)
    applier, _, watcher, stats = _applier(model, apply_mode=mode)
    applied: list[tuple[int, int]] = []
    applier.on_applied.append(lambda epoch, version: applied.append((epoch, version)))
    chunks = _chunks(source, version=3)
    acks = []
    for i, chunk in enumerate(chunks):
        acks.append(applier.feed(chunk))
        if i < len(chunks) - 1:
            assert applier.active
            # In place, the model holds part of the version: forward passes wait.
            assert applier.lock.writing == (mode == "in_place")
    assert acks[:-1] == [None] * (len(chunks) - 1)
    assert acks[-1] == PendingAck(applied=True)
    assert (applier.epoch, applier.version) == (7, 3) and applied == [(7, 3)]
    assert checksum(model) == checksum(source) and not applier.active
    assert stats["applied"] == 1 and stats["chunks"] == len(chunks)
    assert watcher.seen == [
        ("starting", 3),
        ("started", 3),
        *(("chunk", i) for i in range(len(chunks))),
        ("completed", 3),
    ]
    # The same version again is a duplicate: acked as held, not taken.
    assert applier.feed(chunks[0]) == PendingAck(applied=True)
    assert stats["duplicates"] == 1 and not applier.active
    assert watcher.seen[-1] == ("completed", 3)


@pytest.mark.timeout(60)
def test_a_broken_in_place_stream_tears_the_model_until_a_whole_version_mends_it() -> None:
    source, model = _model(0), _model(1)
    applier, host, watcher, stats = _applier(model, apply_mode="in_place", chunk_timeout=0.5)
    chunks = _chunks(source, version=1)
    for chunk in chunks[:2]:
        applier.feed(chunk)
    assert not applier.expire(time.monotonic())  # within the gap
    assert applier.expire(time.monotonic() + 1.0)  # its next chunk is overdue
    assert applier.torn and applier.needs_whole() and not applier.lock.writing
    assert stats["broken_streams"] == 1 and stats["torn"] == 1
    assert host.requests == [False]  # asked for the latest, which repairs it
    assert watcher.seen[-1] == ("broken", 1)
    # A repair: the whole version, even one it would hold, is taken.
    for chunk in chunks:
        applier.feed(chunk)
    assert not applier.torn and applier.version == 1
    assert checksum(model) == checksum(source)


@pytest.mark.timeout(60)
def test_without_a_model_the_applier_keeps_weights_bytes_or_nothing() -> None:
    source = _model(0)
    chunks = _chunks(source)
    total = chunks[0].total

    weights, _, _, _ = _applier(keep="weights")
    for chunk in chunks:
        weights.feed(chunk)
    assert checksum(weights.weights) == checksum(source)

    staged, _, _, _ = _applier(keep="bytes")
    for chunk in chunks:
        staged.feed(chunk)
    assert staged.weights is None and staged.staging.nbytes == total
    assert bytes(staged.staging.array) == b"".join(bytes(c.payload) for c in chunks)

    passing, _, watcher, _ = _applier(keep="nothing")
    for chunk in chunks:
        passing.feed(chunk)
    assert passing.version == 1 and passing.staging.nbytes == 0
    assert watcher.seen.count(("completed", 1)) == 1


def _many_dtypes(seed: int, view_of: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Tensors of every kind a model may hold: several dtypes, a scalar, an empty one,
    and (``view_of`` given) one that is a view of a tensor outside the dict."""
    g = torch.Generator().manual_seed(seed)
    row = view_of[1] if view_of is not None else torch.randn(64, generator=g)
    return {
        "half": torch.randn(5, 7, generator=g).half(),
        "bf16": torch.randn(33, generator=g).bfloat16(),
        "int8": torch.randint(-100, 100, (17,), generator=g, dtype=torch.int8),
        "mask": torch.rand(9, generator=g) > 0.5,
        "scalar": torch.tensor(float(seed), dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "steps": torch.arange(3) + seed,
        "row": row,
        "big": torch.randn(256, 256, generator=g),
    }


@pytest.mark.timeout(60)
def test_the_shared_mode_moves_tensors_of_every_dtype_to_each_version() -> None:
    """``apply_mode="shared"`` gives each tensor the version's memory (here a read-only
    private copy: chunks this fake host hands over are not lent), each at its place:
    every dtype, a scalar, an empty tensor and a view of another tensor, each the object
    it was, with its dtype and shape; version after version."""
    outside = torch.zeros(4, 64)
    model = _many_dtypes(0, view_of=outside)
    objects = {k: (v, v.dtype, v.shape) for k, v in model.items()}
    applier, _, _, stats = _applier(model, apply_mode="shared")
    for version in (1, 2):
        source = _many_dtypes(version)
        for chunk in _chunks(source, version=version):
            applier.feed(chunk)
        assert applier.version == version and applier.mismatch is None
        assert checksum(model) == checksum(source)
        for key, (tensor, dtype, shape) in objects.items():
            assert model[key] is tensor and tensor.dtype == dtype and tensor.shape == shape
            assert torch.equal(tensor, source[key])
    assert stats["shared_copied"] == 2
    assert not outside.any()  # the view moved to the version; the tensor it viewed did not


def _linear(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))


@pytest.mark.timeout(60)
def test_the_shared_mode_moves_every_tensor_and_view_at_once_after_the_first_version() -> None:
    """From the second version on, the shared mode moves the one storage every tensor
    lies in rather than each tensor: the parameters stay the objects they were and read
    each version, a view taken of one after the first version reads the new one too, a
    backward pass through a graph saved before the move raises (torch counts the move
    as an in-place change), and a parameter the user replaced between versions is
    found and moved with the rest."""
    model = _linear(1)
    weight = model[0].weight
    applier, _, _, _ = _applier(model, apply_mode="shared")
    for chunk in _chunks(_linear(10), version=1):
        applier.feed(chunk)
    assert checksum(model) == checksum(_linear(10))
    row = model[0].weight.detach()[1]  # a view, after the first version
    x = torch.randn(3, 8)
    saved = model(x).sum()  # saves the weights of version 1 for backward
    for version in (2, 3):
        source = _linear(10 + version)
        for chunk in _chunks(source, version=version):
            applier.feed(chunk)
        assert applier.version == version and applier.mismatch is None
        assert model[0].weight is weight and checksum(model) == checksum(source)
        assert torch.equal(row, source[0].weight[1])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()
    # The user swaps in a parameter of their own: the next version reaches it too.
    model[1].weight = torch.nn.Parameter(torch.zeros(2, 4))
    source = _linear(14)
    for chunk in _chunks(source, version=4):
        applier.feed(chunk)
    assert applier.version == 4 and checksum(model) == checksum(source)
    assert torch.equal(model(x), source(x))


@pytest.mark.timeout(60)
def test_the_shared_mode_refuses_a_tensor_not_aligned_for_its_dtype() -> None:
    """A schema (from a broken or forged learner) that puts a float32 tensor at an odd
    byte: its bytes cannot be viewed where they lie, so the version is refused at its
    first chunk, counted, and the model kept."""
    model = _model(1)
    before = checksum(model)
    applier, _, _, stats = _applier(model, apply_mode="shared")
    chunks = _chunks(_model(0), version=1)
    schema = chunks[0].schema
    assert schema is not None
    entries = tuple(
        dataclasses.replace(e, offset=e.offset + 1) if e.key == ("small",) else e
        for e in schema.entries
    )
    forged = dataclasses.replace(chunks[0], schema=dataclasses.replace(schema, entries=entries))
    ack = applier.feed(forged)
    assert ack is not None and not ack.applied
    assert applier.mismatch is not None and "not aligned" in str(applier.mismatch[1])
    assert stats["rejected_frames"] == 1
    assert checksum(model) == before and applier.version == 0


@pytest.mark.timeout(60)
def test_the_shared_mode_refuses_inference_tensors_and_keeps_the_model() -> None:
    """Tensors made under ``torch.inference_mode`` cannot be given new storage: the
    version is refused at its first chunk with a reason that says so (before, the
    tensors were re-pointed anyway and every later forward pass raised)."""
    with torch.inference_mode():
        model = _model(1)
    before = checksum(model)
    applier, _, _, _ = _applier(model, apply_mode="shared")
    ack = applier.feed(_chunks(_model(0), version=1)[0])
    assert ack is not None and not ack.applied
    assert applier.mismatch is not None and "inference_mode" in str(applier.mismatch[1])
    assert checksum(model) == before and applier.version == 0


@pytest.mark.timeout(60)
def test_a_version_that_does_not_fit_is_refused_and_the_model_kept() -> None:
    model = _model(1)
    before = checksum(model)
    applier, _, watcher, stats = _applier(model)
    ack = applier.feed(_chunks({"other": torch.zeros(3)}, version=2)[0])
    assert ack is not None and not ack.applied and ack.version == 2 and ack.epoch == 7
    assert applier.mismatch is not None and applier.mismatch[0] == 2
    assert isinstance(applier.mismatch[1], SchemaMismatchError)
    assert stats["rejected_frames"] == 1 and applier.version == 0
    assert checksum(model) == before and not applier.active
    assert watcher.seen == [("starting", 2)]  # seen starting, never taken


@pytest.mark.timeout(60)
def test_an_observer_that_refuses_a_start_drops_the_version_whole() -> None:
    model = _model(1)
    watcher = Watcher(refuse_start=True)
    applier, _, _, _ = _applier(model, apply_mode="in_place", watcher=watcher)
    chunks = _chunks(_model(0), version=1)
    with pytest.raises(RuntimeError, match="cannot take it"):
        applier.feed(chunks[0])
    # Nothing of it was written, and forward passes are not held up.
    assert not applier.active and not applier.lock.writing and not applier.torn
    for chunk in chunks[1:]:
        assert applier.feed(chunk) is None  # chunks of no version in progress
    assert applier.version == 0
    watcher.refuse_start = False
    for chunk in chunks:
        applier.feed(chunk)
    assert applier.version == 1 and checksum(model) == checksum(_model(0))


@pytest.mark.timeout(60)
def test_an_observer_that_wants_a_resend_makes_the_applier_take_the_version_held() -> None:
    watcher = Watcher()
    applier, _, _, stats = _applier(keep="bytes", watcher=watcher)
    chunks = _chunks(_model(0), version=1)
    for chunk in chunks:
        applier.feed(chunk)
    applier.feed(chunks[0])
    assert stats["duplicates"] == 1 and not applier.active
    watcher.resend = True
    assert applier.needs_whole() and not applier.torn
    applier.feed(chunks[0])
    assert applier.active and stats["duplicates"] == 1


# --- the session --------------------------------------------------------------------


@dataclass
class SessionHostFake:
    """What an UpstreamSession asks of its receiver: what it holds."""

    version: int = 0
    epoch: int = 0
    torn: bool = False


def _session(
    spoke: SpokeTransport,
    *,
    host: SessionHostFake | None = None,
    watcher: Watcher | None = None,
    worker_idx: int | None = 2,
    failover: list[Any] | None = None,
) -> tuple[UpstreamSession, SessionHostFake, Watcher, dict[str, Any]]:
    host, watcher = host or SessionHostFake(), watcher or Watcher()
    observers = Observers()
    observers.add(watcher)
    stats = new_stats()
    session = UpstreamSession(
        host,
        spoke,
        model_id="policy",
        strategy="state_dict",
        worker_idx=worker_idx,
        failover=failover or [],
        stats=stats,
        rejections=Rejections(stats),
        observer=observers,
    )
    return session, host, watcher, stats


def _heard(hub: HubTransport) -> tuple[Message, Any]:
    """The next message the hub received, and whom to answer."""
    incoming = hub.recv_frames(5.0)
    assert incoming is not None, "the hub heard nothing"
    return decode([bytes(f) for f in incoming.frames]), incoming.peer


def _nothing_heard(hub: HubTransport) -> None:
    assert hub.recv_frames(0.05) is None


def _welcome(session: UpstreamSession, epoch: int = 7, **fields: Any) -> Welcome:
    welcome = Welcome(
        "policy",
        0,
        epoch,
        mode="pubsub",
        strategy="state_dict",
        heartbeat_seconds=0.5,
        worker=2,
        session="s3cret",
        attempt=session.attempt,
    )
    return dataclasses.replace(welcome, **fields)


@pytest.mark.timeout(60)
def test_the_session_joins_on_its_attempts_welcome_and_acks_what_it_holds() -> None:
    hub, (spoke,) = memory_fleet(1)
    session, _, _, stats = _session(spoke, host=SessionHostFake(version=3, epoch=7))
    try:
        session.new_attempt()
        session.send_hello()
        hello, _ = _heard(hub)
        assert isinstance(hello, Hello)
        assert (hello.version, hello.epoch, hello.worker) == (3, 7, 2)
        assert hello.attempt == session.attempt and hello.pid == session.pid
        # The answer to an earlier attempt is stale.
        session.on_control(_welcome(session, attempt="an-earlier-one"))
        assert not session.welcomed and stats["stale"] == 1
        session.on_control(_welcome(session))
        assert session.welcomed and session.session == "s3cret" and session.heartbeat == 0.5
        ack, _ = _heard(hub)  # what it holds of this sender, acked anew
        assert isinstance(ack, Ack) and ack.applied and (ack.version, ack.epoch) == (3, 7)
        assert ack.session == "s3cret" and ack.worker == 2
        # A welcome with another strategy is noted, not obeyed.
        session.new_attempt()
        session.on_control(_welcome(session, strategy="tensordict"))
        assert stats["rejected_frames"] == 1
    finally:
        spoke.close()
        hub.close()


@pytest.mark.timeout(60)
def test_a_refusal_before_the_welcome_is_sent_once_welcomed() -> None:
    hub, (spoke,) = memory_fleet(1)
    session, _, _, _ = _session(spoke)
    try:
        session.new_attempt()
        session.ack(PendingAck(False, "does not fit", version=5, epoch=7))
        _nothing_heard(hub)  # no session yet: no ack counts
        session.on_control(_welcome(session, epoch=8))
        ack, _ = _heard(hub)
        assert isinstance(ack, Ack) and not ack.applied
        assert (ack.version, ack.epoch, ack.reason) == (5, 7, "does not fit")
        _nothing_heard(hub)  # only the refusal: the version held is of another epoch
    finally:
        spoke.close()
        hub.close()


@pytest.mark.timeout(60)
def test_heartbeats_are_due_a_heartbeat_apart_and_name_the_workers_below() -> None:
    hub, (spoke,) = memory_fleet(1)
    session, host, _, _ = _session(spoke, host=SessionHostFake(version=3, epoch=7))
    try:
        session.new_attempt()
        session.on_control(_welcome(session))
        _heard(hub)  # its ack
        now = time.monotonic()
        session.joined(now)
        session.beat(now + 0.1)
        _nothing_heard(hub)
        host.torn = True
        session.beat(now + 0.6)
        request, _ = _heard(hub)
        assert isinstance(request, SnapshotRequest)
        assert (request.version, request.epoch, request.session) == (3, 7, "s3cret")
        assert request.torn and not request.whole and request.below == {"9": 3}
        session.beat(now + 0.7)
        _nothing_heard(hub)
        session.ask_again(whole=True)  # out of turn
        request, _ = _heard(hub)
        assert isinstance(request, SnapshotRequest) and request.whole
    finally:
        spoke.close()
        hub.close()


@pytest.mark.timeout(60)
def test_observers_review_acks_and_may_hold_them_back() -> None:
    hub, (spoke,) = memory_fleet(1)
    watcher = Watcher(hold_acks=True)
    session, _, _, _ = _session(spoke, watcher=watcher)
    try:
        session.new_attempt()
        session.on_control(_welcome(session, epoch=1))  # holds nothing of epoch 7
        session.ack(PendingAck(applied=True))
        assert watcher.seen == [("ack", True)]
        _nothing_heard(hub)
        watcher.hold_acks = False
        session.ack(PendingAck(applied=True))
        ack, _ = _heard(hub)
        assert isinstance(ack, Ack) and ack.applied
    finally:
        spoke.close()
        hub.close()


@pytest.mark.timeout(60)
def test_a_silent_upstream_is_left_for_the_next_in_the_failover_list() -> None:
    first, second = MemoryHub(), MemoryHub()
    spoke = MemorySpoke(first.endpoint)
    made: list[SpokeTransport] = []

    def make() -> SpokeTransport:
        if not made:
            made.append(MemorySpoke(second.endpoint))
            raise OSError("not yet")  # a bad address: tried again later
        made.append(MemorySpoke(second.endpoint))
        return made[-1]

    session, _, _, stats = _session(spoke, failover=[make])
    try:
        session.new_attempt()
        session.on_control(_welcome(session, epoch=1))
        now = time.monotonic()
        session.heard(now)
        assert not session.upstream_silent(now + 1.0)
        assert session.upstream_silent(now + FAILOVER_MIN_SECONDS + 0.1)
        assert not session.fail_over() and session.spoke is spoke and session.welcomed
        assert session.fail_over() and session.spoke is made[-1]
        assert spoke.closed and not session.welcomed and stats["failovers"] == 1
        hello, _ = _heard(second)
        assert isinstance(hello, Hello) and hello.attempt == session.attempt
    finally:
        session.spoke.close()
        spoke.close()
        first.close()
        second.close()


@pytest.mark.timeout(60)
def test_the_sender_may_give_a_worker_that_asked_for_an_id_another_one() -> None:
    hub, (auto, fixed) = memory_fleet(2)
    chosen, _, _, _ = _session(auto, worker_idx=None)
    named, _, _, _ = _session(fixed)
    try:
        chosen.new_attempt()
        chosen.on_control(_welcome(chosen, epoch=1))
        assert chosen.worker_idx == 2  # assigned by the sender
        taken = ErrorMessage("policy", "duplicate-worker", "worker 2 is someone else")
        chosen.on_control(taken)
        hello, _ = _heard(hub)
        assert isinstance(hello, Hello) and chosen.worker_idx is None and not chosen.session
        named.new_attempt()
        named.on_control(_welcome(named, epoch=1))
        named.on_control(taken)
        assert named.take_refusal() == "worker 2 is someone else"
        assert named.take_refusal() == ""
    finally:
        auto.close()
        fixed.close()
        hub.close()


@pytest.mark.timeout(60)
def test_a_restarted_sender_is_greeted_again_and_up_to_date_means_caught_up() -> None:
    hub, (spoke,) = memory_fleet(1)
    session, _, _, _ = _session(spoke)
    try:
        session.new_attempt()
        session.on_control(_welcome(session, epoch=1))
        attempt = session.attempt
        session.on_control(UpToDate("policy", 0, 1, in_flight=True))
        assert not session.caught_up  # the latest is on its way: wait for it
        _nothing_heard(hub)
        session.on_control(UpToDate("policy", 0, 9))
        assert session.caught_up and session.sender_epoch == 9
        hello, _ = _heard(hub)
        assert isinstance(hello, Hello) and hello.attempt == session.attempt != attempt
    finally:
        spoke.close()
        hub.close()


@pytest.mark.timeout(60)
def test_a_welcomed_session_says_goodbye_once() -> None:
    hub, (spoke,) = memory_fleet(1)
    session, _, _, _ = _session(spoke, host=SessionHostFake(version=3, epoch=1))
    try:
        session.say_goodbye()
        _nothing_heard(hub)  # never welcomed: nobody waits for it
        session.new_attempt()
        session.on_control(_welcome(session, epoch=2))
        session.say_goodbye()
        goodbye, _ = _heard(hub)
        assert isinstance(goodbye, Goodbye) and goodbye.session == "s3cret"
    finally:
        spoke.close()
        hub.close()


def test_a_slow_reader_notes_its_pace_and_a_fast_one_says_once_that_it_is_back() -> None:
    pace = ReadPace()
    # A fast link: chunks 10 ms apart say nothing.
    assert [pace.chunk(i == 0, i == 3, 1.0 + 0.01 * i) for i in range(4)] == [None] * 4
    # A slow one: 0.7 s a chunk, and a small last chunk right after the one before. Every
    # chunk but the last is noted with the longest gap; the last says nothing.
    times = [10.0, 10.7, 11.4, 12.1, 12.15]
    notes = [pace.chunk(i == 0, i == 4, t) for i, t in enumerate(times)]
    assert notes[0] is None  # no gap known yet: the version before came fast
    assert notes[1:4] == pytest.approx([0.7, 0.7, 0.7]) and notes[4] is None
    # The next version's first chunk still says the slow pace (not the last small gap).
    assert pace.chunk(True, False, 20.0) == pytest.approx(0.7)
    assert pace.chunk(False, False, 20.01) is None  # at most one note every NOTE_GAP
    assert pace.chunk(False, True, 20.02) is None
    # Two fast versions on: the pace is back, said once, then nothing.
    assert pace.chunk(True, False, 30.0) == pytest.approx(0.01)
    assert pace.chunk(False, True, 30.01) is None
    assert pace.chunk(True, False, 40.0) is None
    assert pace.chunk(False, True, 40.01) is None


# --- observers, through a receiver --------------------------------------------------


@pytest.mark.timeout(60)
def test_a_receivers_observer_sees_each_version_and_settles_its_acks() -> None:
    """The contract as a relay uses it: an ack held back goes with send_ack() once the
    observer lets it go; heartbeats name the workers it speaks for."""
    model = _model(0)
    hub = MemoryHub()
    sender = WeightSender(
        hub,
        model=model,
        strategy="state_dict",
        num_workers=1,
        timeout=1.0,
        chunk_bytes=MIN_CHUNK_BYTES,
    )
    receiver = WeightReceiver(MemorySpoke(hub.endpoint), strategy="state_dict", keep="bytes")
    watcher = Watcher(hold_acks=True)
    receiver.add_observer(watcher)
    try:
        receiver.connect(10)  # caught up with the latest version, though its ack is held
        count = _chunks(model)[0].count
        assert watcher.seen[:2] == [("starting", 0), ("started", 0)]
        assert watcher.seen[2 : 2 + count] == [("chunk", i) for i in range(count)]
        assert ("completed", 0) in watcher.seen and ("ack", True) in watcher.seen
        assert receiver.staging.nbytes == _chunks(model)[0].total and receiver.weights is None
        receiver.start()
        with torch.no_grad():
            model["small"].add_(1)
        with pytest.raises(SyncTimeout):
            sender.send()  # its worker holds version 1, but says so only when let
        assert receiver.version == 1
        watcher.hold_acks = False
        receiver.send_ack()
        until(lambda: sender.status()["workers"][0]["version"] == 1, 10, "the ack came")
        until(
            lambda: sender.status()["workers"][0]["below"] == {"9": 3},
            10,
            "a heartbeat named the worker below",
        )
    finally:
        receiver.close()
        sender.close()


# --- the spoke's lock ---------------------------------------------------------------


def test_the_spoke_lock_hands_a_looping_thread_s_next_turn_to_a_thread_that_asked() -> None:
    """A thread that loops over the spoke (the background receiver) gives way between two
    turns: one that asked meanwhile waits for one turn of the loop at most. A plain lock
    let the loop take it back again and again (an ack waited seconds)."""
    lock = SpokeLock()
    stop = threading.Event()
    turns = 0

    def loop() -> None:
        nonlocal turns
        while not stop.is_set():
            with lock:
                turns += 1
                time.sleep(0.002)
            lock.give_way()

    looper = threading.Thread(target=loop, daemon=True)
    looper.start()
    try:
        until(lambda: turns > 3, timeout=10, what="the loop's turns")
        for _ in range(50):
            before = turns
            assert lock.acquire(timeout=10)
            taken = turns - before
            lock.release()
            assert taken <= 2, f"the loop took {taken} turns while this thread asked"
    finally:
        stop.set()
        looper.join(10)
    with lock, lock:  # reentrant; giving way while holding it does not wait for itself
        lock.give_way(timeout=10)


@pytest.mark.timeout(60)
def test_a_version_applied_in_place_lets_the_staging_buffer_go() -> None:
    """The default mode stages a version that comes in several chunks (through a
    socket) and applies one that needs no buffer in place (one chunk, or read in a
    hub's block). Once a version came in place the staging buffer holds nothing: it is
    let go of, and the apply plan's views of it with it (they kept it alive)."""
    import gc
    import weakref

    model = _model(1)
    applier, _, _, _ = _applier(model, apply_mode="auto")
    staged = _model(2)
    for chunk in _chunks(staged, version=1):  # five chunks: gathered, then applied
        applier.feed(chunk)
    assert applier.version == 1 and checksum(model) == checksum(staged)
    assert applier.staging.nbytes == _chunks(staged)[0].total
    buffer = weakref.ref(applier.staging.array)
    whole = _model(3)
    (frames,) = version_messages(whole, version=2, epoch=7, chunk_bytes=1 << 20)
    chunk = decode([bytes(f) for f in frames])
    assert isinstance(chunk, Chunk) and chunk.count == 1
    applier.feed(chunk)  # one chunk: straight into the model
    assert applier.version == 2 and checksum(model) == checksum(whole)
    assert applier.staging.nbytes == 0
    gc.collect()
    assert buffer() is None, "something still holds the staging buffer"
    for chunk in _chunks(staged, version=3):  # staged again: a buffer anew
        applier.feed(chunk)
    assert applier.version == 3 and checksum(model) == checksum(staged)
