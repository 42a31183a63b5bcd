"""What a relay says about the workers below it is a claim, not a session.

Hostile and broken peers against a learner with relays, over real ZeroMQ sockets: a
heartbeat no parser expected, rogue sessions claiming other relays' workers, a flood
of claims, refusals behind a relay, and a relay that died while its workers moved on.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
import zmq
from _faults import raw_sockets, rss_bytes, until

from zmqsync import Relay, SyncTimeout, WeightReceiver, WeightSender, WeightsRejected, checksum
from zmqsync.fleet import MAX_CLAIMS
from zmqsync.protocol import (
    MAX_BELOW,
    Ack,
    Hello,
    SnapshotRequest,
    StatusReply,
    StatusRequest,
    Welcome,
    decode,
    encode,
)
from zmqsync.status_types import STATUS_BELOW
from zmqsync.transport.zmq_pubsub import PubSubHub, PubSubSpoke

BEAT = 0.2


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4096, generator=g), "b": torch.randn(16, generator=g)}


def _bump(model: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for t in model.values():
            t.add_(1.0)


def _hub() -> PubSubHub:
    return PubSubHub("tcp://127.0.0.1:*", insecure=True)


def _learner(model: dict[str, torch.Tensor], **kw: Any) -> WeightSender:
    options: dict[str, Any] = {"num_workers": None, "timeout": 5, "heartbeat": BEAT}
    options.update(kw)
    return WeightSender(_hub(), model=model, strategy="state_dict", **options)


def _relay(upstream: str, idx: int) -> Relay:
    relay = Relay(
        PubSubSpoke(upstream, identity=f"relay{idx}"),
        _hub(),
        strategy="state_dict",
        worker_idx=idx,
        heartbeat=BEAT,
    )
    relay.connect(timeout=30)
    relay.start()
    return relay


def _below_of(learner: WeightSender, relay: int) -> set[int]:
    """The workers whose claim by ``relay`` stands, as the learner's status shows them."""
    for row in learner.status()["workers"]:
        if row["worker"] == relay:
            return {int(w) for w in row.get("below") or {}}
    return set()


def _leaf(upstream: str, idx: int, **kw: Any) -> tuple[WeightReceiver, dict[str, torch.Tensor]]:
    model = {k: torch.zeros_like(v) for k, v in _model().items()}
    receiver = WeightReceiver(
        PubSubSpoke(upstream, identity=f"leaf{idx}"),
        model=None if "sink" in kw else model,
        strategy="state_dict",
        worker_idx=idx,
        **kw,
    )
    receiver.connect(timeout=30)
    receiver.start()
    return receiver, model


class Rogue:
    """A peer with a real session (hello, Welcome, secret) over a raw DEALER, that says
    in its heartbeats whatever it is told to, and acks every version it is asked to."""

    def __init__(self, learner: WeightSender, worker: int, sockets: list[Any]) -> None:
        self.learner = learner
        self.worker = worker
        self.dealer, self.push = sockets
        self.dealer.send_multipart(encode(Hello("policy", 0, 0, worker, attempt="rogue")))
        self.session = ""
        deadline = time.monotonic() + 10
        while not self.session:
            assert time.monotonic() < deadline, "no Welcome"
            if self.dealer.poll(100):
                message = decode(self.dealer.recv_multipart())
                if isinstance(message, Welcome):
                    self.session = message.session
                    self.epoch = message.epoch

    def heartbeat(self, below: dict[str, Any]) -> None:
        request = SnapshotRequest(
            "policy", 0, self.epoch, self.worker, session=self.session, below=below
        )
        self.dealer.send_multipart(encode(request))

    def ack(self, version: int) -> None:
        ack = Ack("policy", version, self.epoch, self.worker, True, session=self.session)
        self.push.send_multipart(encode(ack))

    def drain(self) -> None:
        while self.dealer.poll(0):
            self.dealer.recv_multipart()


@contextlib.contextmanager
def _rogues(learner: WeightSender, ids: list[int]) -> Iterator[list[Rogue]]:
    ack_endpoint = learner.transport.announce()["ack_endpoint"]  # type: ignore[attr-defined]
    targets = []
    for _ in ids:
        targets += [(zmq.DEALER, learner.endpoint), (zmq.PUSH, ack_endpoint)]
    with raw_sockets(*targets) as socks:
        yield [Rogue(learner, w, socks[2 * i : 2 * i + 2]) for i, w in enumerate(ids)]


@contextlib.contextmanager
def _beating(rogues: list[Rogue], below: dict[str, Any], ack: bool = False) -> Iterator[list[int]]:
    """Heartbeats (and, with ``ack``, acks of the learner's latest version) from every
    rogue until the block ends: they stay live, and keep claiming. Yields the count of
    rounds sent so far."""
    stop = threading.Event()
    rounds = [0]

    def beat() -> None:
        while not stop.is_set():
            for rogue in rogues:
                rogue.heartbeat(below)
                if ack:
                    rogue.ack(rogue.learner.version)
                rogue.drain()
            rounds[0] += 1
            stop.wait(BEAT / 4)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield rounds
    finally:
        stop.set()
        thread.join(10)


@pytest.mark.timeout(60)
def test_no_heartbeat_stops_the_pump() -> None:
    """A claim no parser expected ("²" passes str.isdigit, then int() raises), ids and
    versions past the wire's integer range: refused as malformed and counted; then a
    handler that fails for a reason nobody foresaw is counted and logged, and in both
    cases the learner goes on sending and answering."""
    model = _model()
    learner = _learner(model)
    leaf = None
    try:
        leaf, held = _leaf(learner.endpoint, 0)
        with _rogues(learner, [7]) as (rogue,):
            for below in ({"²": 1}, {"5": 2**70}, {"9" * 25: 1}, {"-1": 1}):
                rogue.heartbeat(below)
            until(
                lambda: learner.status()["totals"]["rejected_frames"] >= 4,
                10,
                "the four heartbeats were refused",
            )
            _bump(model)
            learner.send(worker_ids=[0])
            assert checksum(held) == checksum(model)
            assert learner.status()["workers_total"] == 2

            real = learner.fleet.handle
            calls = []

            def fails_once(*args: Any, **kw: Any) -> Any:
                if not calls:
                    calls.append(1)
                    raise RuntimeError("a bug nobody foresaw")
                return real(*args, **kw)

            learner.fleet.handle = fails_once  # type: ignore[method-assign]
            rogue.heartbeat({})
            until(lambda: calls == [1], 10, "the handler ran")
            _bump(model)
            learner.send(worker_ids=[0])
            assert checksum(held) == checksum(model)
            assert learner.status()["totals"]["message_errors"] == 1
    finally:
        if leaf is not None:
            leaf.close()
        learner.close()


@pytest.mark.timeout(60)
def test_a_rogue_session_cannot_claim_a_worker_a_live_relay_holds() -> None:
    """Worker 5 is behind relay 1. A rogue session (which acks everything) claims it
    too: the claim is refused while relay 1 is live, a targeted send still goes through
    relay 1 and returns only once worker 5 holds the version, and the rogue's ack of it
    settles nothing."""
    model = _model()
    learner = _learner(model)
    relay = _relay(learner.endpoint, 1)
    leaf = None
    try:
        leaf, held = _leaf(relay.endpoint, 5)
        until(lambda: _below_of(learner, 1) == {5}, 10, "relay 1 claimed worker 5")
        with _rogues(learner, [9]) as rogues, _beating(rogues, {"5": 0}, ack=True) as rounds:
            until(lambda: rounds[0] >= 8, 10, "the rogue claimed worker 5 in 8 heartbeats")
            for _ in range(3):
                _bump(model)
                learner.send(worker_ids=[5])
                assert checksum(held) == checksum(model)
            assert learner.status()["totals"]["refused_claims"] >= 8
            rows = {row["worker"]: row for row in learner.status()["workers"]}
            assert rows[9]["below"] is None and list(rows[1]["below"]) == ["5"]
    finally:
        if leaf is not None:
            leaf.close()
        relay.close()
        learner.close()


@pytest.mark.timeout(90)
def test_claims_are_bounded_and_status_stays_cheap_and_off_the_send_path() -> None:
    """300 sessions each naming MAX_BELOW workers at the wire's largest version: the
    fleet keeps at most MAX_CLAIMS claims, a status reply names at most STATUS_BELOW
    workers per relay, and status requests sent during a send never make it overrun
    its timeout."""
    model = _model()
    # The rogues stay live without a beat each; a send may take 2 s.
    learner = _learner(model, heartbeat=5.0, timeout=2)
    leaf = None
    rss = rss_bytes()
    try:
        leaf, held = _leaf(learner.endpoint, 0)
        with _rogues(learner, list(range(1000, 1300))) as rogues:
            for r, rogue in enumerate(rogues):
                first = 10_000 + r * MAX_BELOW
                rogue.heartbeat({str(first + i): 2**64 - 1 for i in range(MAX_BELOW)})
            until(
                lambda: (
                    learner.status()["totals"]["refused_claims"] >= 300 * MAX_BELOW - MAX_CLAIMS
                ),
                60,
                "every heartbeat was handled",
            )
            with raw_sockets(*[(zmq.DEALER, learner.endpoint)] * 3) as askers:
                for asker in askers:
                    asker.send_multipart(encode(StatusRequest("policy", 0, 0)))
                _bump(model)
                start = time.monotonic()
                learner.send(worker_ids=[0])
                assert time.monotonic() - start < 2.5
                assert checksum(held) == checksum(model)
                for asker in askers:
                    assert asker.poll(20_000), "a status request went unanswered"
                    reply = asker.recv_multipart()
                    assert len(reply[1]) < 4 << 20
                    status = decode(reply)
                    assert isinstance(status, StatusReply)
                    assert status.status["workers_total"] == 301
            rows = learner.status()["workers"]
            assert max(len(row["below"] or {}) for row in rows) == STATUS_BELOW
            assert sum(row["below_total"] for row in rows if row["connected"]) == MAX_CLAIMS
        assert rss_bytes() - rss < 200 << 20
    finally:
        if leaf is not None:
            leaf.close()
        learner.close()


@pytest.mark.timeout(60)
def test_a_refusal_behind_a_relay_reaches_the_learner_and_names_the_worker() -> None:
    """A raising sink behind a relay refuses a version: the learner's send raises
    WeightsRejected naming the worker behind the relay and its reason, as it would for a
    worker of its own; the next version goes through."""
    model = _model()
    learner = _learner(model)
    relay = _relay(learner.endpoint, 1)
    fail = threading.Event()
    got: dict[str, torch.Tensor] = {}

    def sink(weights: list[tuple[str, torch.Tensor]]) -> None:
        if fail.is_set():
            raise RuntimeError("engine out of KV-cache memory")
        got.update((name, t.clone()) for name, t in weights)

    leaf = None
    try:
        leaf, _ = _leaf(relay.endpoint, 5, sink=sink)
        fail.set()
        _bump(model)
        with pytest.raises(WeightsRejected) as caught:
            learner.send()
        message = str(caught.value)
        assert "worker 5 (behind relay 1)" in message and "engine out of KV" in message, message
        assert list(caught.value.rejections) == [1]
        fail.clear()
        _bump(model)
        learner.send()
        assert checksum(got) == checksum(model)
    finally:
        if leaf is not None:
            leaf.close()
        relay.close()
        learner.close()


@pytest.mark.timeout(60)
def test_a_targeted_send_follows_a_worker_from_a_dead_relay_to_a_live_one() -> None:
    """Relay 2 dies without a word; its worker 5 fails over to relay 1. As soon as
    relay 2 is no longer live its route is not used, relay 1's claim stands, and
    ``send(worker_ids=[5])`` reaches worker 5 through relay 1, long before relay 2's
    session expires."""
    model = _model()
    learner = _learner(model)
    backup = _relay(learner.endpoint, 1)  # a session older than the dying relay's
    dying = _relay(learner.endpoint, 2)
    leaf = None
    try:
        leaf, held = _leaf(
            dying.endpoint,
            5,
            failover=[lambda: PubSubSpoke(backup.endpoint, identity="moved")],
        )
        until(lambda: _below_of(learner, 2) == {5}, 10, "relay 2 claimed worker 5")
        died = time.monotonic()
        dying._stop.set()  # dies as a SIGKILL leaves it: no goodbye
        assert dying._thread is not None
        dying._thread.join(10)
        dying.receiver.transport.close()
        dying.sender.close()
        until(lambda: _below_of(learner, 1) == {5}, 20, "relay 1 claimed worker 5")
        _bump(model)
        learner.send(worker_ids=[5])
        assert checksum(held) == checksum(model)
        assert time.monotonic() - died < 20  # a session expires only after 30 s
    finally:
        if leaf is not None:
            leaf.close()
        backup.close()
        learner.close()


@pytest.mark.timeout(90)
def test_with_curve_only_relay_keys_may_claim_workers() -> None:
    """Under CURVE, the learner takes the word of a relay whose key it was given as a
    relay's for the workers below it; a client with a valid key that is not a relay's
    forwards versions all the same, but its claims are refused: a targeted send to a
    worker behind it names that worker in its timeout."""
    from zmqsync.security import CurveClient, CurveServer, generate_keypair

    server_public, server_secret = generate_keypair()
    relay_keys, other_keys = generate_keypair(), generate_keypair()
    curve = CurveServer(server_public, server_secret).with_relays({relay_keys[0]})
    model = _model()
    learner = WeightSender(
        PubSubHub("tcp://127.0.0.1:*", curve=curve),
        model=model,
        strategy="state_dict",
        num_workers=None,
        timeout=2,
        heartbeat=BEAT,
    )
    relays: list[Relay] = []
    leaves: list[WeightReceiver] = []
    try:
        for idx, (public, secret) in ((1, relay_keys), (2, other_keys)):
            relay = Relay.over_zmq(
                learner.endpoint,
                curve_client=CurveClient(public, secret, server_public),
                strategy="state_dict",
                worker_idx=idx,
                heartbeat=BEAT,
            )
            relays.append(relay)
            relay.connect(timeout=30)
            relay.start()
        held: dict[int, dict[str, torch.Tensor]] = {}
        for relay, worker in zip(relays, (5, 6), strict=True):
            leaf, held[worker] = _leaf(relay.endpoint, worker)
            leaves.append(leaf)
        until(lambda: _below_of(learner, 1) == {5}, 10, "relay 1 claimed worker 5")
        until(
            lambda: learner.status()["totals"]["refused_claims"] >= 3,
            10,
            "the other client's claims were refused, heartbeat after heartbeat",
        )
        assert _below_of(learner, 2) == set()
        _bump(model)
        learner.send(worker_ids=[5])
        assert checksum(held[5]) == checksum(model)
        _bump(model)
        with pytest.raises(SyncTimeout) as caught:
            learner.send(worker_ids=[6])
        assert list(caught.value.missing_workers) == [6]
        assert checksum(held[6]) != checksum(model)
        _bump(model)
        learner.send()  # every version still reaches every worker, through both
        assert checksum(held[5]) == checksum(held[6]) == checksum(model)
    finally:
        for leaf in leaves:
            leaf.close()
        for relay in relays:
            relay.close()
        learner.close()


@pytest.mark.timeout(60)
def test_status_answers_while_a_send_waits_on_a_missing_worker() -> None:
    """Status requests during a send are answered with one report a second at most,
    never not at all: `zmqsync status` is what one runs while a send waits on a worker
    that is not there."""
    model = _model()
    learner = _learner(model, num_workers=2, timeout=10)
    leaf = None
    try:
        leaf, held = _leaf(learner.endpoint, 0)
        _bump(model)
        with (
            ThreadPoolExecutor(1) as pool,
            raw_sockets((zmq.DEALER, learner.endpoint)) as (asker,),
        ):
            sending = pool.submit(learner.send)  # waits for worker 1, which never came
            until(lambda: checksum(held) == checksum(model), 10, "worker 0 applied it")
            for _ in range(2):
                asker.send_multipart(encode(StatusRequest("policy", 0, 0)))
                assert asker.poll(5000), "no status while the send waits"
                reply = decode(asker.recv_multipart())
                assert isinstance(reply, StatusReply)
                assert reply.status["version"] == learner.version
            assert not sending.done()  # still waiting for worker 1
            with pytest.raises(SyncTimeout):
                sending.result(timeout=30)
    finally:
        if leaf is not None:
            leaf.close()
        learner.close()
