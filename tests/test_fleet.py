"""The fleet core (sans-IO), driven by hypothesis with real and forged messages.

A model of the workers (who said hello from where, which secret each was welcomed
with, which versions each applied) runs beside :class:`zmqsync.fleet.Fleet`; every
interleaving of hellos, acks, requests, goodbyes, sends, forgeries and time passing
must keep the invariants:

- a send completes only on acks carrying the secret of a session it targeted;
- what the sender believes a worker holds never exceeds what that worker applied, and
  never goes backwards while its session lives;
- no message from the ack channel or without a session creates a record;
- a snapshot or a probe answers only its asker (no request fans out to the fleet);
- state stays bounded: at most one session per connection and per worker id.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from zmqsync.fleet import (
    EXPIRE_HEARTBEATS,
    EXPIRE_MIN_SECONDS,
    READ_GAP_MAX,
    REPAIR_RETRY,
    Admit,
    FanOut,
    Fleet,
    Forget,
    Origin,
    Reply,
    SendLatest,
)
from zmqsync.protocol import (
    AUTO_WORKER,
    Ack,
    ErrorMessage,
    Goodbye,
    Hello,
    Probe,
    ProbeRequest,
    Reading,
    SnapshotRequest,
    UpToDate,
    Welcome,
)

EPOCH = 99
PEERS = [f"peer-{i}".encode() for i in range(4)]
IDS = st.integers(0, 3)


@dataclass
class Worker:
    """A well-behaved worker as the test sees it: its connection and what it holds."""

    peer: bytes
    worker: int
    secret: str
    attempt: str
    applied: int = 0  # the newest version it really applied
    acked: set[int] = field(default_factory=set)


class FleetMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.core = Fleet(
            "policy",
            EPOCH,
            mode="zmq",
            strategy="state_dict",
            transports=["zmq"],
            heartbeat=1.0,
            repair_after=0.5,
            max_sessions=8,
        )
        self.workers: dict[bytes, Worker] = {}  # by connection
        self.attempts = 0

    # --- helpers -------------------------------------------------------------------

    def _handle(self, message, origin):  # type: ignore[no-untyped-def]
        effects = self.core.handle(message, origin, self.now)
        for e in effects:
            if isinstance(e, Reply | SendLatest):
                # Answers go to the asker, never to anyone else.
                assert e.origin == origin or isinstance(e.origin, Origin)
                assert e.origin.peer is not None
            if isinstance(e, FanOut):
                assert isinstance(e.message, Probe)
        # A hub keeps a peer only once admitted: exactly the connections welcomed, each
        # admitted before its Welcome (so what the hub offers it arrives first).
        admitted = [e.origin for e in effects if isinstance(e, Admit)]
        welcomed = [
            e.origin for e in effects if isinstance(e, Reply) and isinstance(e.message, Welcome)
        ]
        assert admitted == welcomed, effects
        for e in effects:
            if isinstance(e, Admit):
                after = effects[effects.index(e) + 1]
                assert isinstance(after, Reply) and isinstance(after.message, Welcome)
        return effects

    def _welcomes(self, effects):  # type: ignore[no-untyped-def]
        return [
            e.message for e in effects if isinstance(e, Reply) and isinstance(e.message, Welcome)
        ]

    # --- real workers ---------------------------------------------------------------

    @rule(peer=st.sampled_from(PEERS), worker=st.one_of(IDS, st.just(AUTO_WORKER)))
    def hello(self, peer: bytes, worker: int) -> None:
        self.attempts += 1
        attempt = f"a{self.attempts}"
        effects = self._handle(Hello("policy", 0, 0, worker, attempt=attempt), Origin(0, peer))
        welcomes = self._welcomes(effects)
        errors = [
            e.message
            for e in effects
            if isinstance(e, Reply) and isinstance(e.message, ErrorMessage)
        ]
        if welcomes:
            (welcome,) = welcomes
            assert welcome.attempt == attempt
            if worker != AUTO_WORKER:
                assert welcome.worker == worker
            # Whoever held that id or this connection before is no one now.
            for p, w in list(self.workers.items()):
                if p == peer or w.worker == welcome.worker:
                    del self.workers[p]
            self.workers[peer] = Worker(peer, welcome.worker, welcome.session, attempt)
        else:
            assert errors and errors[0].code in ("duplicate-worker", "fleet-full")

    @rule(data=st.data())
    @precondition(lambda self: self.workers)
    def apply_and_ack(self, data) -> None:  # type: ignore[no-untyped-def]
        w = data.draw(st.sampled_from(sorted(self.workers.values(), key=lambda w: w.peer)))
        if self.core.version == 0:
            return
        version = data.draw(st.integers(max(1, w.applied), self.core.version))
        w.applied = version
        origin = Origin(0, data.draw(st.sampled_from([None, w.peer])))
        ack = Ack("policy", version, EPOCH, w.worker, True, session=w.secret)
        self._handle(ack, origin)
        w.acked.add(version)

    @rule(data=st.data())
    @precondition(lambda self: self.workers)
    def heartbeat(self, data) -> None:  # type: ignore[no-untyped-def]
        w = data.draw(st.sampled_from(sorted(self.workers.values(), key=lambda w: w.peer)))
        request = SnapshotRequest(
            "policy", w.applied, EPOCH if w.applied else 0, w.worker, w.secret
        )
        effects = self._handle(request, Origin(0, w.peer))
        assert effects and all(e.origin == Origin(0, w.peer) for e in effects)  # type: ignore[union-attr]
        assert all(isinstance(e, Reply | SendLatest) for e in effects)

    @rule(data=st.data())
    @precondition(lambda self: self.workers)
    def probe(self, data) -> None:  # type: ignore[no-untyped-def]
        w = data.draw(st.sampled_from(sorted(self.workers.values(), key=lambda w: w.peer)))
        effects = self._handle(
            ProbeRequest("policy", w.worker, "n", session=w.secret), Origin(0, w.peer)
        )
        assert len(effects) <= 1
        for e in effects:
            assert isinstance(e, FanOut) and e.message.worker == w.worker  # type: ignore[attr-defined]

    @rule(data=st.data())
    @precondition(lambda self: self.workers)
    def goodbye(self, data) -> None:  # type: ignore[no-untyped-def]
        w = data.draw(st.sampled_from(sorted(self.workers.values(), key=lambda w: w.peer)))
        effects = self._handle(
            Goodbye("policy", w.applied, EPOCH, w.worker, w.secret), Origin(0, w.peer)
        )
        assert effects == [Forget(Origin(0, w.peer))]
        del self.workers[w.peer]

    # --- the learner ----------------------------------------------------------------

    @rule(ids=st.one_of(st.none(), st.lists(IDS, min_size=1, max_size=3, unique=True)))
    def send(self, ids) -> None:  # type: ignore[no-untyped-def]
        _send, peers = self.core.begin_send(ids, self.now, 5.0)
        for hub_peers in peers.values():
            assert set(hub_peers) <= set(PEERS)

    @rule(seconds=st.sampled_from([0.1, 1.0, 3.5, EXPIRE_MIN_SECONDS + 1]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds
        for e in self.core.expire(self.now):
            assert isinstance(e, Forget)
        for peer in list(self.workers):
            if peer not in {s.origin.peer for s in self.core.workers.values()}:
                del self.workers[peer]  # expired: it must say hello again

    # --- hostile peers --------------------------------------------------------------

    @rule(
        worker=IDS,
        version=st.integers(0, 2**64 - 1),
        secret=st.sampled_from(["", "0" * 32, "x"]),
        peer=st.sampled_from([None, *PEERS, b"stranger"]),
    )
    def forged_ack(self, worker: int, version: int, secret: str, peer: bytes | None) -> None:
        before = {w: (s.version, s.last_seen) for w, s in self.core.workers.items()}
        acked = set(self.core.pending.acked) if self.core.pending else set()
        self._handle(Ack("policy", version, EPOCH, worker, True, session=secret), Origin(0, peer))
        assert {w: (s.version, s.last_seen) for w, s in self.core.workers.items()} == before
        assert (set(self.core.pending.acked) if self.core.pending else set()) == acked

    @rule(
        worker=IDS,
        peer=st.sampled_from([None, *PEERS, b"stranger"]),
        kind=st.sampled_from(["snapshot", "probe", "goodbye"]),
    )
    def forged_request(self, worker: int, peer: bytes | None, kind: str) -> None:
        sessions = dict(self.core.workers)
        message = {
            "snapshot": SnapshotRequest("policy", 0, 0, worker, "0" * 32),
            "probe": ProbeRequest("policy", worker, "n", session="0" * 32),
            "goodbye": Goodbye("policy", 0, 0, worker, "0" * 32),
        }[kind]
        effects = self._handle(message, Origin(0, peer))
        assert dict(self.core.workers) == sessions
        assert all(isinstance(e, Reply) and isinstance(e.message, ErrorMessage) for e in effects)
        if kind == "goodbye":  # a leaving worker is not answered: nobody may be there
            assert effects == []
        assert all(s.left is None or w in sessions for w, s in self.core.workers.items())

    @rule(data=st.data())
    @precondition(lambda self: self.workers)
    def stolen_secret_elsewhere(self, data) -> None:  # type: ignore[no-untyped-def]
        """A right secret from another connection (a sniffed ack replayed) changes nothing
        but an ack, which may come over the ack channel."""
        w = data.draw(st.sampled_from(sorted(self.workers.values(), key=lambda w: w.peer)))
        other = b"stranger"
        effects = self._handle(Goodbye("policy", 0, 0, w.worker, w.secret), Origin(0, other))
        assert self.core.workers[w.worker].left is None and effects == []

    # --- invariants -----------------------------------------------------------------

    @invariant()
    def bounded(self) -> None:
        assert len(self.core.workers) <= self.core.max_sessions
        live = [s for s in self.core.workers.values() if s.left is None]
        assert len({s.origin for s in live}) == len(live), "a connection speaks for two workers"

    @invariant()
    def beliefs_never_exceed_facts(self) -> None:
        by_worker = {w.worker: w for w in self.workers.values()}
        for worker, s in self.core.workers.items():
            if s.left is not None:
                continue
            real = by_worker.get(worker)
            assert real is not None, f"a session for worker {worker} nobody holds"
            assert s.secret == real.secret
            # Acks and heartbeats only raise what the sender believes to what was applied.
            assert s.version <= max(real.applied, 0) or s.version == 0

    @invariant()
    def a_send_completes_only_on_targeted_sessions(self) -> None:
        p = self.core.pending
        if p is None:
            return
        assert p.acked <= p.targets
        by_worker = {w.worker: w for w in self.workers.values()}
        for worker in p.acked:
            real = by_worker.get(worker)
            # A worker that acked and then left or was replaced may be gone from the model.
            if real is not None and worker in self.core.workers:
                assert any(v >= p.version for v in real.acked) or real.applied >= p.version


TestFleet = FleetMachine.TestCase
TestFleet.settings = settings(
    max_examples=400,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_expiry_floor_and_heartbeats() -> None:
    """A session expires after EXPIRE_HEARTBEATS heartbeats, never before the floor."""
    core = Fleet("policy", 1, mode="zmq", strategy="state_dict", transports=["zmq"], heartbeat=0.1)
    core.handle(Hello("policy", 0, 0, 0, attempt="a"), Origin(0, b"p"), 0.0)
    assert core.expire(EXPIRE_HEARTBEATS * 0.1 + 0.1) == []
    assert core.expire(EXPIRE_MIN_SECONDS + 0.1) == [Forget(Origin(0, b"p"))]
    assert core.workers == {} and core.free_worker_id() == 0


def test_an_up_to_date_worker_is_told_so() -> None:
    core = Fleet("policy", 1, mode="zmq", strategy="state_dict", transports=["zmq"])
    _admit, welcome = core.handle(Hello("policy", 0, 0, 0, attempt="a"), Origin(0, b"p"), 0.0)
    secret = welcome.message.session  # type: ignore[union-attr]
    (effect,) = core.handle(SnapshotRequest("policy", 0, 0, 0, secret), Origin(0, b"p"), 0.0)
    assert isinstance(effect, Reply) and isinstance(effect.message, UpToDate)


@pytest.mark.parametrize("peer", [None, b"p"])
def test_nothing_but_acks_on_the_ack_channel(peer: bytes | None) -> None:
    core = Fleet("policy", 1, mode="zmq", strategy="state_dict", transports=["zmq"])
    effects = core.handle(Hello("policy", 0, 0, 0, attempt="a"), Origin(0, peer), 0.0)
    assert bool(core.workers) == (peer is not None)
    assert (effects == []) == (peer is None)


def test_a_relay_restarts_the_forward_of_a_version_streamed_again() -> None:
    """The version a relay forwards, streamed again by its upstream (a repair that came
    mid-stream), restarts that forward: the same send goes on (what was answered still
    counts) and those it waits for count as sent to now. Any other version is no
    restart, and starting that version as a new forward still raises."""
    core = Fleet("policy", 1, mode="zmq", strategy="state_dict", transports=["zmq"])
    secrets = {}
    for w, peer in ((0, b"p"), (1, b"q")):
        _admit, welcome = core.handle(Hello("policy", 0, 0, w, attempt="a"), Origin(0, peer), 0.0)
        secrets[w] = welcome.message.session  # type: ignore[union-attr]
    upstream = 7  # the upstream's epoch, which the relay's fleet follows
    send = core.begin_forward(3, upstream, 1.0, 10.0)
    assert send.targets == {0, 1}
    core.handle(Ack("policy", 3, upstream, 0, True, session=secrets[0]), Origin(0, b"p"), 1.5)
    assert core.restart_forward(3, upstream, 2.0) is send
    assert send.acked == {0} and send.missing == {1}
    assert core.workers[1].last_repair == 2.0  # streamed to it anew: no repair meanwhile
    assert core.workers[0].last_repair == 1.0
    assert core.restart_forward(4, upstream, 2.0) is None  # a newer version: a new forward
    assert core.restart_forward(3, upstream + 1, 2.0) is None  # another upstream life
    with pytest.raises(ValueError, match="forwarded after"):
        core.begin_forward(3, upstream, 2.0, 10.0)
    assert core.settled(3, upstream, send, 2.0) is False
    core.handle(Ack("policy", 3, upstream, 1, True, session=secrets[1]), Origin(0, b"q"), 2.5)
    assert core.settled(3, upstream, send, 3.0) is True


def test_a_ranks_fleet_keeps_which_parts_each_worker_waits_for() -> None:
    """A sharded learner's rank hears from each worker's heartbeats which parts of the
    version under way it still lacks; it names them for that version only, and a later
    heartbeat (the version whole, or another under way) replaces what it said."""
    core = Fleet("policy", 1, mode="zmq", strategy="state_dict", transports=["zmq"])
    secrets = {}
    for w, peer in ((0, b"p"), (1, b"q"), (2, b"r")):
        _admit, welcome = core.handle(Hello("policy", 0, 0, w, attempt="a"), Origin(0, peer), 0.0)
        secrets[w] = welcome.message.session  # type: ignore[union-attr]

    def beat(w: int, peer: bytes, gathering: int, waiting: tuple[int, ...]) -> None:
        request = SnapshotRequest(
            "policy", 1, 1, w, secrets[w], gathering=gathering, waiting=waiting
        )
        core.handle(request, Origin(0, peer), 2.0)

    beat(0, b"p", 2, (1, 3))
    beat(1, b"q", 2, (3,))
    beat(2, b"r", 1, (2,))  # an older version's: not this send's
    assert core.waiting_for([0, 1, 2, 9], 2) == {0: (1, 3), 1: (3,)}
    beat(0, b"p", 0, ())  # it gathers nothing now
    assert core.waiting_for([0, 1, 2], 2) == {1: (3,)}
    assert core.waiting_for([0, 1, 2], 3) == {}


def test_a_repair_the_sender_turned_down_holds_back_the_next_ask_a_second_at_most() -> None:
    """The sender turns a repair down while the version's last chunks are still queued
    for the worker; the worker's next ask, REPAIR_RETRY later, is served (not a whole
    repair_after later), and one within REPAIR_RETRY is not."""
    core = Fleet(
        "policy", 1, mode="zmq", strategy="state_dict", transports=["zmq"], repair_after=60.0
    )
    origin = Origin(0, b"p")
    _admit, welcome = core.handle(Hello("policy", 0, 0, 0, attempt="a"), origin, 0.0)
    secret = welcome.message.session  # type: ignore[union-attr]
    core.begin_send(None, 1.0, 10.0)
    asks = [SnapshotRequest("policy", 0, 1, 0, secret)]  # it holds version 0 of epoch 1
    assert [type(e) for e in core.handle(asks[0], origin, 61.0)] == [SendLatest]
    assert [type(e) for e in core.handle(asks[0], origin, 62.0)] == [Reply]  # counted
    core.repair_turned_down(origin, 62.5)  # (the first: on its way after all)
    assert [type(e) for e in core.handle(asks[0], origin, 62.5 + REPAIR_RETRY / 2)] == [Reply]
    assert [type(e) for e in core.handle(asks[0], origin, 62.5 + REPAIR_RETRY)] == [SendLatest]
    core.repair_turned_down(Origin(0, b"stranger"), 70.0)  # nobody's: nothing to do


def test_a_rank_does_not_resend_its_part_to_a_worker_that_waits_only_for_others() -> None:
    """A sharded learner's rank: a worker behind that gathers the latest version and
    has this rank's part in (it waits for other ranks') is told the version is on its
    way, not sent this part again; one that still waits for this part is repaired."""
    ranks = ["tcp://a:1", "tcp://b:1"]
    core = Fleet(
        "policy", 1, mode="zmq", strategy="state_dict", transports=["zmq"], ranks=ranks, part=0
    )
    core.published = True
    origin = Origin(0, b"p")
    _admit, welcome = core.handle(Hello("policy", 0, 0, 0, attempt="a"), origin, 0.0)
    session = welcome.message.session  # type: ignore[union-attr]
    core.begin_send(None, 1.0, 10.0)  # version 1, to everyone
    waits_for_other = SnapshotRequest("policy", 0, 1, 0, session, gathering=1, waiting=(1,))
    (effect,) = core.handle(waits_for_other, origin, 5.0)
    assert isinstance(effect, Reply) and isinstance(effect.message, UpToDate)
    assert effect.message.in_flight
    waits_for_this = SnapshotRequest("policy", 0, 1, 0, session, gathering=1, waiting=(0, 1))
    assert [type(e) for e in core.handle(waits_for_this, origin, 6.0)] == [SendLatest]
    # A plain (unsharded) sender's fleet repairs as before.
    plain = Fleet("policy", 1, mode="zmq", strategy="state_dict", transports=["zmq"])
    plain.published = True
    _admit, welcome = plain.handle(Hello("policy", 0, 0, 0, attempt="a"), origin, 0.0)
    session = welcome.message.session  # type: ignore[union-attr]
    plain.begin_send(None, 1.0, 10.0)
    request = SnapshotRequest("policy", 0, 1, 0, session, gathering=1, waiting=(1,))
    assert [type(e) for e in plain.handle(request, origin, 5.0)] == [SendLatest]


def test_reading_names_a_slow_reader_that_may_hold_a_chunk_and_still_reads() -> None:
    """What the sender's window asks before giving up on a chunk held past the stall
    limit: whether a worker it went to (of that hub, among its addressees) that has not
    said it read that chunk says it reads slowly, and was heard from within two of its
    gaps. A stopped worker goes quiet; one that read the chunk, left, or notes from
    another life of the sender, does not count; a claimed gap counts for 10 s at most.
    Given up on for quiet, a worker is believed again once it read that chunk, once."""
    core = Fleet("policy", 7, mode="zmq", strategy="state_dict", transports=["zmq", "zmq"])
    a, b, c = Origin(0, b"a"), Origin(0, b"b"), Origin(1, b"c")
    sessions: dict[Origin, str] = {}
    for i, origin in enumerate((a, b, c)):
        _admit, welcome = core.handle(Hello("policy", 0, 0, i, attempt="x"), origin, 0.0)
        sessions[origin] = welcome.message.session  # type: ignore[union-attr]
    chunk = (3, 2)  # version 3's chunk 2, sent at 10.0
    assert not core.reading(0, None, chunk, 10.0, 10.3)  # nobody said it reads slowly
    # a reads version 3 slowly: chunk 1 of it, 0.5 s after chunk 0.
    assert core.handle(Reading("policy", 3, 7, 0, sessions[a], 1, 0.5), a, 10.2) == []
    assert core.reading(0, None, chunk, 10.0, 10.9)  # heard 0.7 s ago, within 2 gaps
    assert core.reading(0, [b"a"], chunk, 10.0, 10.9)
    assert not core.reading(0, [b"b"], chunk, 10.0, 10.9)  # b said nothing
    assert not core.reading(1, None, chunk, 10.0, 10.9)  # a is of hub 0
    assert not core.reading(0, None, chunk, 10.0, 11.3)  # quiet for 1.1 s: stopped
    # A note counts from when the chunk was sent, not before: chunk 4, sent at 11.0.
    assert core.reading(0, None, (3, 4), 11.0, 11.9)
    # Once a says it read chunk 2, it holds it no more.
    core.handle(Reading("policy", 3, 7, 0, sessions[a], 2, 0.5), a, 11.5)
    assert not core.reading(0, None, chunk, 10.0, 11.6)
    assert core.reading(0, None, (3, 3), 10.0, 11.6)
    # Its pace back (a fast gap): it counts as reading for two of those gaps only.
    core.handle(Reading("policy", 3, 7, 0, sessions[a], 3, 0.001), a, 12.0)
    assert not core.reading(0, None, (3, 5), 12.0, 12.1)
    # A claim of a huge gap counts for READ_GAP_MAX; one of another life not at all.
    core.handle(Reading("policy", 4, 7, 0, sessions[a], 0, 1e9), a, 20.0)
    assert core.workers[0].read_gap == READ_GAP_MAX
    assert core.reading(0, None, (4, 1), 20.0, 20.0 + 2 * READ_GAP_MAX - 1)
    core.handle(Reading("policy", 9, 8, 1, sessions[b], 0, 5.0), b, 21.0)
    assert core.workers[1].read_gap == 0.0 and core.workers[1].read == (0, -1)
    # A forged note (not the session's secret) is refused and counted.
    forged = core.handle(Reading("policy", 4, 7, 1, "not-the-secret", 0, 5.0), b, 21.0)
    assert core.counters["forged"] == 1 and [type(e) for e in forged] == [Reply]
    # b says it reads, and held a chunk as long as any is waited for: its word on that
    # chunk, and from then on, counts no more; a's word (it read the chunk) still does.
    core.handle(Reading("policy", 4, 7, 1, sessions[b], 0, 0.5), b, 21.0)
    core.handle(Reading("policy", 4, 7, 0, sessions[a], 1, 0.5), a, 21.0)
    assert core.reading(0, [b"b"], (4, 1), 20.0, 21.5)
    core.read_stalled(0, None, (4, 1))
    assert core.workers[1].read_doubted and not core.workers[0].read_doubted
    core.handle(Reading("policy", 4, 7, 1, sessions[b], 1, 0.5), b, 22.0)
    assert not core.reading(0, [b"b"], (4, 2), 22.0, 22.1)
    assert core.reading(0, [b"a"], (4, 2), 21.0, 21.5)
    # Gone: it holds nothing.
    core.handle(Goodbye("policy", 4, 7, 0, sessions[a]), a, 21.0)
    assert not core.reading(0, None, (4, 2), 20.0, 21.5)
    # c went quiet while it held chunk 2 (its link slowed past the pace it told): given
    # up on for that version's chunks; its word counts again for the next version's, at
    # the pace it told meanwhile, once in its session.
    core.handle(Reading("policy", 4, 7, 2, sessions[c], 1, 0.2), c, 30.0)
    assert core.reading(1, None, (4, 2), 30.0, 30.3)
    assert not core.reading(1, None, (4, 2), 30.0, 30.5)  # quiet for two of its gaps
    core.read_stalled(1, None, (4, 2), quiet=True)
    assert not core.workers[2].read_doubted
    core.handle(Reading("policy", 4, 7, 2, sessions[c], 5, 0.9), c, 31.0)  # slower now
    assert not core.reading(1, None, (4, 6), 31.0, 31.1)  # not for version 4's chunks
    assert core.reading(1, None, (5, 0), 31.2, 32.5)  # version 5's, within two 0.9 s gaps
    # Its heartbeats say it lives, not that it reads: two gaps after its last note (or
    # the chunk), it is quiet (it may wait for a chunk it read, unsaid).
    core.handle(SnapshotRequest("policy", 4, 7, 2, sessions[c]), c, 32.9)
    assert not core.reading(1, None, (5, 0), 31.2, 33.1)
    core.read_stalled(1, None, (5, 0), quiet=True)  # quiet again: not believed again
    assert core.workers[2].read_doubted
    core.handle(Reading("policy", 6, 7, 2, sessions[c], 0, 0.9), c, 34.0)
    assert not core.reading(1, None, (6, 1), 34.0, 34.1)
