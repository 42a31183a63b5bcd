"""The sender's parts, each on its own with small fakes: the version store, the send
statistics, and a hub's pump with its stall clock."""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from _faults import until

from zmqsync.chunking.layout import MIN_CHUNK_BYTES
from zmqsync.protocol import Buffer, Chunk, decode
from zmqsync.sender import pump
from zmqsync.sender.pump import (
    READING_CHECK,
    STALL_MEMORY,
    WINDOW,
    HubRunner,
    InFlight,
    StallClock,
)
from zmqsync.sender.stats import LATENCY_BUCKETS, SendStats
from zmqsync.sender.transfers import Copy, Forwarded, Stamp, Transfer
from zmqsync.sender.versions import VersionStore
from zmqsync.transport.base import HubTransport, Incoming, PeerId, Recipients, Stream

CHUNK = MIN_CHUNK_BYTES


def _weights(chunks: int, value: float = 0.0) -> dict[str, torch.Tensor]:
    """Weights whose stream is ``chunks`` chunks long."""
    return {"w": torch.full((chunks * CHUNK // 4,), value, dtype=torch.float32)}


class FakeOutlet:
    """A hub as the version store sees it: it lends nothing, and streams what it is
    told it streams."""

    def __init__(self) -> None:
        self.streaming: list[Copy | Forwarded] = []
        self.held = 0

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        self.held += 1
        yield

    def lending(self) -> bool:
        return False

    def lend(self, nbytes: int) -> Any:
        return None

    def all_keep_versions(self) -> bool:
        return False

    def streams(self, copy: Copy | Forwarded) -> bool:
        return any(c is copy for c in self.streaming)


class LendingOutlet(FakeOutlet):
    """A hub that lends memory, whose peers may all keep each version mapped."""

    def __init__(self) -> None:
        super().__init__()
        self.keeping = False

    def lending(self) -> bool:
        return True

    def lend(self, nbytes: int) -> Any:
        return np.zeros(nbytes, dtype=np.uint8)

    def all_keep_versions(self) -> bool:
        return self.keeping


def _store(**options: Any) -> tuple[VersionStore, FakeOutlet, SendStats]:
    outlet, stats = FakeOutlet(), SendStats()
    store = VersionStore(
        [outlet],
        Stamp("policy", 7, checksums=False),
        strategy="state_dict",
        chunk_bytes=CHUNK,
        stats=stats,
        **options,
    )
    return store, outlet, stats


def _chunk(copy: Copy, index: int) -> Chunk:
    lent = copy.frames(index)
    assert lent is not None
    message = decode(lent.frames)
    assert isinstance(message, Chunk)
    return message


# --- the version store -------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_the_store_keeps_the_latest_whole_copy_as_its_snapshot_and_serves_it() -> None:
    store, _, _ = _store()
    weights = _weights(3, 1.0)
    copy = store.copy_of(weights, 1, model=None)
    assert store.snapshot is copy and copy.count == 3
    assert store.latest(1, None) is copy
    assert store.latest(2, None) is None  # an older snapshot is not the latest
    assert store.latest(2, None, held=True) is copy  # a relay serves what it holds
    first = _chunk(copy, 0)
    assert (first.model_id, first.epoch, first.version, first.count) == ("policy", 7, 1, 3)


@pytest.mark.timeout(60)
def test_the_store_writes_over_a_copy_only_once_nobody_reads_it() -> None:
    store, outlet, _ = _store()
    first = store.copy_of(_weights(2, 1.0), 1, model=None)
    first.write_through(first.count - 1)
    memory = first.data
    assert not store.still_read(first)
    second = store.copy_of(_weights(2, 2.0), 2, model=None)
    assert second.data is memory and second.holds == 1  # nobody held it: reused
    lent = second.frames(0)  # a transport holds a chunk of it
    assert lent is not None and store.still_read(second)
    third = store.copy_of(_weights(2, 3.0), 3, model=None)
    assert third.data is not memory  # fresh memory: the lent chunk stays intact
    assert bytes(lent.frames[2]) == bytes(torch.full((CHUNK // 4,), 2.0).numpy().data)
    del lent
    outlet.streaming.append(third)
    assert store.still_read(third)  # streamed still, though no chunk is lent


@pytest.mark.timeout(60)
def test_without_a_snapshot_the_store_streams_through_its_ring_and_keeps_nothing() -> None:
    store, _, _ = _store(retain_snapshot=False)
    copy = store.copy_of(_weights(3, 1.0), 1, model=None, whole=False)
    assert copy.data is None and copy.ring is store.ring and store.snapshot is None
    assert store.latest(1, copy) is copy  # the pending send's copy, while readable
    assert _chunk(copy, 2).index == 2
    copy.end()
    assert store.latest(1, copy) is None


@pytest.mark.timeout(60)
def test_versions_go_in_large_chunks_while_every_worker_keeps_its_version_mapped() -> None:
    """Workers that keep each version mapped (the shared mode) copy nothing out of a
    chunk while the next is written: a version written into lent memory then goes in
    chunks of up to KEPT_CHUNK_BYTES; once a worker copies again (it stopped keeping, or
    one that copies joined), in ``chunk_bytes`` again. The bytes are the same."""
    from zmqsync.sender.versions import KEPT_CHUNK_BYTES

    outlet = LendingOutlet()
    store = VersionStore(
        [outlet],
        Stamp("policy", 7, checksums=False),
        strategy="state_dict",
        chunk_bytes=CHUNK,
        stats=SendStats(),
    )
    weights = _weights(6, 1.0)
    copies = []
    for version, keeping in enumerate((False, True, True, False), start=1):
        outlet.keeping = keeping
        copy = store.copy_of(weights, version, model=None)
        assert copy.layout.chunk_bytes == (KEPT_CHUNK_BYTES if keeping else CHUNK)
        assert copy.layout.count == (1 if keeping else 6)
        copies.append(copy)
        store.serve(copy)
    assert copies[1].layout is copies[2].layout  # reused while the fleet keeps
    # Without a snapshot the chunks go through the ring's buffers: chunk_bytes.
    outlet.keeping = True
    assert store.copy_of(weights, 9, model=None, whole=False).layout.chunk_bytes == CHUNK


def test_a_new_life_stamps_new_copies_and_serves_nothing_of_the_old() -> None:
    store, _, _ = _store()
    old = store.copy_of(_weights(1), 1, model=None)
    store.new_life(99)
    assert store.snapshot is None and store.latest(1, None) is None
    served = store.whole(4, old.layout, old.data, metadata={"step": 4})  # type: ignore[arg-type]
    assert store.serve(served) is None and store.snapshot is served
    first = _chunk(served, 0)
    assert (first.epoch, first.version, first.metadata) == (99, 4, {"step": 4})


@pytest.mark.timeout(60)
def test_version_zero_read_at_each_serve_is_refused_once_the_weights_changed() -> None:
    store, _, _ = _store(retain_snapshot=False)
    weights = _weights(2, 1.0)
    copy = store.rendezvous(weights, None)
    assert copy.ring is not store.ring  # its own ring, let go of with it
    assert _chunk(copy, 0).version == 0
    weights["w"].add_(1)
    assert copy.frames(1) is None and copy.changed and not copy.readable


@pytest.mark.timeout(60)
def test_the_store_sends_deltas_to_peers_that_hold_their_base() -> None:
    store, _, _ = _store()
    weights = _weights(4, 1.0)
    v1 = store.copy_of(weights, 1, model=None)
    store.record(v1)
    weights["w"][CHUNK // 4 * 2] = 5.0  # one value in chunk 2
    v2 = store.copy_of(weights, 2, model=None)
    store.record(v2)
    holdings: list[tuple[PeerId, int | None]] = [(b"a", 1), (b"b", None)]
    delta, whole = store.delta_transfers(v2, holdings, False, fans_out=False, lending=False)
    assert (delta.to, delta.base, delta.count, delta.nbytes) == ([b"a"], 1, 1, CHUNK)
    assert whole.to == [b"b"] and whole.spans is None
    # One stream for every peer (a PUB socket): one delta, fanned out.
    (fanned,) = store.delta_transfers(v2, [(b"a", 1)], True, fans_out=True, lending=False)
    assert fanned.to is None and fanned.base == 1


@pytest.mark.timeout(60)
def test_share_params_without_a_lending_hub_moves_the_model_into_the_senders_own_memory() -> None:
    store, _, stats = _store(retain_snapshot=False, share_params=True)
    model = _weights(2, 1.0)
    tensor = model["w"]

    def lives_in(data: Any) -> bool:
        start = data.__array_interface__["data"][0]
        return start <= tensor.data_ptr() < start + data.nbytes

    copy = store.copy_of(None, 1, model=model, whole=False)
    assert copy.live and store.shares_own_memory and store.share_problem is None
    assert stats.totals["params_moved"] == 1
    assert model["w"] is tensor and lives_in(copy.data)  # the same tensor, moved
    assert bytes(_chunk(copy, 1).payload) == tensor.numpy().tobytes()[CHUNK:]
    # A transport still holds the first buffer when the send returns (a stopped
    # worker's queue): the tensors move on, and the next send goes from the new one.
    held = [copy.data[:8]]
    store.share(model)
    again = store.copy_of(None, 2, model=model, whole=False)
    assert again.live and again.data is not copy.data and lives_in(again.data)
    assert stats.totals["params_moved"] == 2
    # That one is held too: a third buffer is not made while the first is still held;
    # the tensors go back to memory of their own, and sends copy.
    held.append(again.data[:8])
    store.share(model)
    del copy, again
    assert store.share_problem is not None and "still holds" in store.share_problem
    assert not store.shares_own_memory and stats.totals["params_moved"] == 2
    assert not any(lives_in(h.base) for h in held)
    copied = store.copy_of(None, 3, model=model, whole=False)
    assert not copied.live and copied.ring is store.ring
    # Once the transport lets go, they move in again.
    del held, copied
    moved = store.copy_of(None, 4, model=model, whole=False)
    assert moved.live and store.share_problem is None and stats.totals["params_moved"] == 3
    store.copy_of(_weights(2), 5, model=model, whole=False)
    assert store.share_problem == "send() was given weights that are not the model's"


# --- the send statistics -----------------------------------------------------------------


@pytest.mark.timeout(60)
def test_the_statistics_count_versions_bytes_and_deltas() -> None:
    stats = SendStats()
    stats.version_sent(1, 1000, targets=3, deltas=None)
    stats.version_sent(2, 1000, targets=0, deltas=None)  # nobody: one copy's worth
    assert stats.totals["versions_sent"] == 2 and stats.totals["bytes_sent"] == 4000
    assert stats.last_delta is None
    stats.version_sent(3, 1000, targets=3, deltas={2: (2, 100)})
    assert stats.totals["bytes_sent"] == 4000 + 2 * 100 + 1000
    assert stats.totals["deltas_sent"] == 1
    assert stats.last_delta == {
        "version": 3,
        "bases": [{"base": 2, "workers": 2, "bytes": 100}],
        "whole_to": 1,
    }
    stats.add("stalls", 2)
    assert stats.totals["stalls"] == 2


@pytest.mark.timeout(60)
def test_the_statistics_report_latencies_as_percentiles_and_a_histogram() -> None:
    stats = SendStats()
    empty = stats.report({}, [], {})
    assert empty.latency_p50_s is None and empty.latency_histogram is not None
    assert empty.latency_histogram.counts == [0] * (len(LATENCY_BUCKETS) + 1)
    for seconds in (0.002, 0.002, 0.02, 100.0):
        stats.synced(seconds)
    totals = stats.report({"forged": 1}, ["a reason"], {"sent": 5})
    assert totals.latency_p50_s == 0.02 and totals.latency_p99_s == 100.0
    histogram = totals.latency_histogram
    assert histogram is not None and histogram.le == list(LATENCY_BUCKETS)
    assert histogram.counts[1] == 2 and histogram.counts[4] == 1 and histogram.counts[-1] == 1
    assert histogram.sum_s == pytest.approx(100.024)
    assert totals.forged == 1 and totals.rejections == ["a reason"]
    assert totals.transport == {"sent": 5}


# --- the pump and its stall clock --------------------------------------------------------


@pytest.mark.timeout(60)
def test_the_stall_clock_learns_release_times_and_remembers_a_stall() -> None:
    clock = StallClock()
    assert clock.limit(100.0) == 0.25  # chunks go fast: the floor
    for _ in range(50):
        clock.released_after(2.0)
    assert clock.limit(100.0) == 10.0  # slow releases: up to the ceiling
    clock.stalled(100.0)
    assert clock.limit(100.0 + STALL_MEMORY / 2) == pytest.approx(2 * clock.release_time)
    assert clock.limit(100.0 + STALL_MEMORY) == 10.0  # forgotten


class FakeHost:
    """What a pump's sender does, recorded."""

    def __init__(self) -> None:
        self.handled: list[Incoming] = []
        self.turns = 0
        self.failed: BaseException | None = None
        self.forwarded: int | None = None
        #: The peers the host is beginning to forward a version to (no transfer yet).
        self.starting: set[bytes] = set()
        self.explode = False
        #: Whether a worker the held chunk went to says it still reads (a slow link's);
        #: by default none does (a stopped peer's). The chunks asked about, in turn.
        self.still_reading = False
        self.asked: list[InFlight] = []
        #: The chunks given up on though workers said they read them, and whether it
        #: was because they went quiet (else: at STALL_MAX).
        self.read_stalled_on: list[InFlight] = []
        self.read_stalled_quiet: list[bool] = []

    def housekeeping(self, runner: HubRunner) -> None:
        self.turns += 1
        if self.explode:
            raise RuntimeError("boom")

    def handle(self, incoming: Incoming, runner: HubRunner) -> None:
        self.handled.append(incoming)

    def pump_failed(self, exc: BaseException) -> None:
        self.failed = exc

    def forwarded_version(self) -> int | None:
        return self.forwarded

    def forward_starting(self, runner: HubRunner, peer: bytes) -> bool:
        return peer in self.starting

    def reading(self, runner: HubRunner, chunk: InFlight, now: float) -> bool:
        self.asked.append(chunk)
        return self.still_reading

    def read_stalled(self, runner: HubRunner, chunk: InFlight, quiet: bool) -> None:
        self.read_stalled_on.append(chunk)
        self.read_stalled_quiet.append(quiet)


class KeepingHub(HubTransport):
    """A hub that holds every message it is sent (as a slow peer's queue does) until
    told to let go, and hands the pump what is put in its inbox."""

    name = "keeping"

    def __init__(self) -> None:
        self.kept: list[Sequence[Buffer]] = []
        self.sent = 0
        self.keep = True
        self.inbox: queue.Queue[Incoming | None] = queue.Queue()
        self._closed = False

    @property
    def endpoint(self) -> str:
        return "keeping://"

    @property
    def closed(self) -> bool:
        return self._closed

    def send_frames(
        self, frames: Sequence[Buffer], *, to: Recipients = None, stream: Stream | None = None
    ) -> None:
        self.sent += 1
        if self.keep:
            self.kept.append(frames)

    def recv_frames(self, timeout: float | None) -> Incoming | None:
        try:
            return self.inbox.get(timeout=timeout) if timeout else self.inbox.get_nowait()
        except queue.Empty:
            return None

    def wake(self) -> None:
        self.inbox.put(None)

    def close(self) -> None:
        self._closed = True


@contextlib.contextmanager
def _pump(
    clock: StallClock | None = None,
) -> Iterator[tuple[HubRunner, KeepingHub, FakeHost, SendStats]]:
    host, hub, stats = FakeHost(), KeepingHub(), SendStats()
    runner = HubRunner(host, hub, 0, stats=stats, clock=clock, name="policy")
    runner.start()
    try:
        yield runner, hub, host, stats
    finally:
        runner.stop()


def _copy(chunks: int) -> Copy:
    store, _, _ = _store()
    return store.copy_of(_weights(chunks, 1.0), 1, model=None)


@pytest.mark.timeout(60)
def test_the_pump_hands_its_host_each_message_and_tends_it_between() -> None:
    with _pump() as (_, hub, host, _):
        hub.inbox.put(Incoming([b"hello"], b"peer"))
        until(lambda: len(host.handled) == 1, 10, "the host handled the message")
        assert host.handled[0].peer == b"peer" and host.turns >= 1
        assert host.failed is None


@pytest.mark.timeout(60)
def test_a_pump_whose_host_fails_stops_and_says_why() -> None:
    with _pump() as (_, hub, host, _):
        host.explode = True
        hub.wake()
        until(lambda: host.failed is not None, 10, "the host was told the pump failed")
        assert isinstance(host.failed, RuntimeError)


@pytest.mark.timeout(60)
def test_the_window_holds_chunks_back_until_the_hub_lets_go_of_them() -> None:
    clock = StallClock()
    clock.release_time = 1.0  # no stall within this test: chunks may take 8 s
    copy = _copy(3 * WINDOW)
    with _pump(clock) as (runner, hub, _, stats):
        runner.begin(Transfer(copy, None))
        with runner.holding():
            assert hub.sent == WINDOW and len(runner.inflight) == WINDOW
        hub.keep = False
        hub.kept.clear()  # the peer read them: the views are gone
        until(lambda: hub.sent == copy.count, 10, "every chunk went")
        assert stats.totals["chunks_sent"] == copy.count
        assert stats.totals["stalls"] == 0
        until(lambda: not runner.transfers, 10, "the transfer ended")
        with runner.holding():
            assert runner.done[-1][:2] == (1, None)


@pytest.mark.timeout(60)
def test_a_chunk_held_past_the_stall_limit_is_given_up_on() -> None:
    copy = _copy(2 * WINDOW)
    with _pump() as (runner, hub, _, stats):
        started = time.monotonic()
        runner.begin(Transfer(copy, None))  # the hub keeps every chunk: a stopped peer
        until(lambda: hub.sent == copy.count, 20, "the window went on without the peer")
        stalls = stats.totals["stalls"]
        assert stalls >= 1 and runner.clock.last_stall >= started


@pytest.mark.timeout(60)
def test_a_chunk_a_slow_reader_still_reads_is_waited_for_up_to_stall_max(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past the clock's limit a held chunk is given up on unless a worker it went to
    says it still reads it (its sender says so): a slow link's worker is waited for, up
    to STALL_MAX, and what its late releases took teaches the clock nothing. The window
    asks about the chunk it waits for, which names itself as workers' notes do."""
    monkeypatch.setattr(pump, "STALL_MAX", 3.0)
    copy = _copy(2 * WINDOW)
    with _pump() as (runner, hub, host, stats):
        host.still_reading = True
        runner.begin(Transfer(copy, None))
        limit = runner.clock.limit(time.monotonic())
        time.sleep(limit + 0.5)  # past the limit on purpose: nothing may stall meanwhile
        assert hub.sent == WINDOW and stats.totals["stalls"] == 0
        assert host.asked and host.asked[0].read == (1, 0) and host.asked[0].to is None
        # Asked again at most every READING_CHECK, not at every turn of the pump.
        assert len(host.asked) <= (0.5 + 0.2) / READING_CHECK + 2
        hub.keep = False  # the slow reader has them at last
        hub.kept.clear()
        until(lambda: hub.sent == copy.count, 10, "the window went on")
        assert stats.totals["stalls"] == 0
        assert runner.clock.release_time == StallClock().release_time  # taught nothing
        assert host.read_stalled_on == []
    with _pump() as (runner, hub, host, stats):
        host.still_reading = True
        started = time.monotonic()
        runner.begin(Transfer(_copy(2 * WINDOW), None))  # kept for good, "read" for good
        until(lambda: stats.totals["stalls"] >= 1, 20, "the window gave up at STALL_MAX")
        assert time.monotonic() - started >= 3.0
        # The host hears whose word held it, so that it takes it no more.
        assert host.read_stalled_on[0].read == (1, 0)
        assert host.read_stalled_quiet[0] is False  # held to STALL_MAX, not quiet
    with _pump() as (runner, hub, host, stats):
        host.still_reading = True
        runner.begin(Transfer(_copy(2 * WINDOW), None))
        until(lambda: host.asked, 20, "the window, past its limit, waits on the workers' word")
        host.still_reading = False  # the workers went quiet: given up on before STALL_MAX
        until(lambda: stats.totals["stalls"] >= 1, 20, "the window gave up on quiet workers")
        assert host.read_stalled_on[0].read == (1, 0) and host.read_stalled_quiet[0] is True


@pytest.mark.timeout(60)
def test_a_repair_waits_while_the_version_is_on_its_way_to_that_peer() -> None:
    copy = _copy(2 * WINDOW)
    clock = StallClock()
    clock.release_time = 1.0
    with _pump(clock) as (runner, _, host, _):
        runner.begin(Transfer(copy, [b"a"]))
        with runner.holding():
            assert not runner.repair(copy, b"a")  # streaming to it already
            assert runner.repair(copy, b"b")
            now = time.monotonic()
            runner.done.append((5, [b"c"], now - 10, now))
            assert not runner.forwarding_to(b"c")  # the host forwards nothing
            host.forwarded = 5
            assert runner.forwarding_to(b"c")  # sent it just now: it may still read it
            assert not runner.forwarding_to(b"d")
            host.starting = {b"d"}  # the host begins a forward to it: no transfer yet
            assert runner.forwarding_to(b"d")
