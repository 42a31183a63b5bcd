"""A fleet that no fault or hostile peer can fool: real processes, real sockets.

Each test is one way the promises broke before the fleet core and sessions: a stopped
worker applying a torn version, forged messages on the ack channel, a learner that
rebound its ports, state grown by strangers, two processes holding one worker id, and
weights messages thrown at the learner's control socket.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import zmq
from _faults import raw_sockets, rss_bytes, squatter, stopped, until
from _workers import bump, make_model

import zmqsync
from zmqsync import SyncTimeout, WeightReceiver, WeightSender, ZMQWeightSyncScheme
from zmqsync.errors import FrameError
from zmqsync.protocol import (
    MAX_BODY_BYTES,
    Ack,
    Chunk,
    Goodbye,
    ProbeRequest,
    SnapshotRequest,
    StatusReply,
    TensorEntry,
    WeightsSchema,
    decode,
    encode,
    encode_schema,
    layout_digest,
)
from zmqsync.transport import resolve
from zmqsync.transport._zmq import SPOKE_PREFIX

pytestmark = pytest.mark.slow


def _start(fleet: Any, scheme: Any, workers: range, **kw: Any) -> None:
    for i in workers:
        fleet.start(scheme, i, **kw)
    for i in workers:
        fleet.wait_ready(i)


def _send_recording(scheme: Any, model: Any, sent: dict[int, str], **kw: Any) -> None:
    """Send the model as it is now, recording what this version's bytes are."""
    checksum = zmqsync.checksum(model)
    sender = scheme.get_sender()
    try:
        scheme.send(**kw)
    finally:
        sent[sender.version] = checksum


def _applied_exactly(fleet: Any, worker: int, sent: dict[int, str]) -> list[int]:
    """Every version ``worker`` applied had the bytes the learner sent for it, and
    versions only went up. Returns the versions applied."""
    versions = []
    for _epoch, version, checksum in fleet.ask(worker, "applied"):
        assert version in sent, f"worker {worker} applied version {version}, never sent"
        assert checksum == sent[version], f"worker {worker} applied a torn version {version}"
        versions.append(version)
    assert versions == sorted(set(versions)), f"worker {worker} went backwards: {versions}"
    return versions


def _flood(sock: zmq.Socket[Any], messages: list[Any]) -> None:
    for message in messages:
        sock.send_multipart(encode(message))


# --- 1. torn versions ---------------------------------------------------------------


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("mode", "transport", "options"),
    [
        ("pubsub", "tcp", {"retain_snapshot": False}),
        ("pubsub", "tcp", {"retain_snapshot": True}),
        ("router", "tcp", {"retain_snapshot": False}),
        ("pubsub", "ipc", {"retain_snapshot": False}),
        # Chunks sent from the model's own memory: what a stopped worker's queue holds
        # of it stays its own, and the model's tensors move on.
        ("pubsub", "tcp", {"share_params": True}),
        ("router", "tcp", {"share_params": True}),
    ],
    ids=[
        "pubsub-tcp",
        "pubsub-tcp-retain",
        "router-tcp",
        "pubsub-ipc",
        "pubsub-tcp-share",
        "router-tcp-share",
    ],
)
def test_a_stopped_worker_never_applies_a_torn_version(
    fleet: Any, tmp_path: Any, mode: str, transport: str, options: dict[str, Any]
) -> None:
    """A worker stopped with a version queued for it (the model exceeds the kernel's
    socket buffers) is left behind by timed-out sends and then by sends that no longer
    count it; the learner changes its tensors in place meanwhile. When it resumes,
    every version it applies holds exactly the bytes sent for that version."""
    endpoint = "tcp://127.0.0.1:*" if transport == "tcp" else f"ipc://{tmp_path}/torn"
    model = make_model("big", seed=0)
    scheme = ZMQWeightSyncScheme("state_dict", mode=mode, endpoint=endpoint, timeout=1.5, **options)
    scheme.init_on_sender("policy", model=model, num_workers=None)
    sender = scheme.get_sender()
    sent: dict[int, str] = {0: zmqsync.checksum(model)}  # version 0: what it started with
    try:
        _start(fleet, scheme, range(2), kind="big")
        bump(model)
        _send_recording(scheme, model, sent)
        with stopped(fleet.procs[0].pid):
            for step in range(4):
                bump(model)
                try:
                    # A targeted send to the stopped worker, then sends to everyone.
                    kw = {"worker_ids": [0, 1]} if step == 0 else {}
                    _send_recording(scheme, model, sent, **kw)
                except SyncTimeout as exc:
                    assert exc.missing_workers == [0]
                bump(model)  # the next training step, in place, sent by nobody
        bump(model)
        # The resumed worker drains what was queued for it first: on a loaded 2-core
        # machine that can take longer than the 1.5 s that left it behind.
        sender.timeout = 30.0
        _send_recording(scheme, model, sent)
        until(
            lambda: fleet.ask(0, "state")["version"] == sender.version,
            60,
            "the resumed worker caught up",
        )
        for worker in range(2):
            versions = _applied_exactly(fleet, worker, sent)
            assert versions[-1] == sender.version
        if options.get("share_params"):
            status = sender.status()
            # Moved in at the first send, and on at least once while the stopped
            # worker's queue held their memory; sent from the model's own again now.
            assert status["totals"]["params_moved"] >= 2, status["totals"]
            sender.timeout = 30.0
            bump(model)
            _send_recording(scheme, model, sent)
            assert sender.status()["share_params"] == "on"
            for worker in range(2):
                assert _applied_exactly(fleet, worker, sent)[-1] == sender.version
    finally:
        scheme.shutdown()


# --- 2. the ack channel -------------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["pubsub", "router"])
def test_forgeries_on_the_ack_channel_change_nothing(fleet: Any, mode: str) -> None:
    """From a PUSH socket with no keys: fresh-id snapshot requests, a goodbye for a live
    worker and an ack of version 2**64-1 for a stopped one. No worker is sent anything,
    nobody is marked gone, and a send still waits for the stopped worker."""
    model = make_model(seed=0)
    scheme = ZMQWeightSyncScheme("state_dict", mode=mode, endpoint="tcp://127.0.0.1:*", timeout=2)
    scheme.init_on_sender("policy", model=model, num_workers=None)
    sender = scheme.get_sender()
    sent: dict[int, str] = {0: zmqsync.checksum(model)}  # version 0: what it started with
    try:
        _start(fleet, scheme, range(2))
        _send_recording(scheme, model, sent)
        before = [fleet.ask(i, "state")["stats"]["received_bytes"] for i in range(2)]
        bytes_sent = sender.status()["totals"]["bytes_sent"]
        ack_endpoint = sender.transport.announce()["ack_endpoint"]
        with raw_sockets((zmq.PUSH, ack_endpoint), (zmq.DEALER, sender.endpoint)) as (push, dealer):
            requests = [SnapshotRequest("policy", 0, 0, 1000 + i) for i in range(300)]
            _flood(push, requests)
            _flood(push, [Goodbye("policy", 1, sender.epoch, 1, "0" * 32)])
            # The same over the identified connection, without a session: refused too.
            _flood(
                dealer, [SnapshotRequest("policy", 0, 0, 5000), ProbeRequest("policy", 777, "x")]
            )
            until(
                lambda: sender.status()["totals"]["forged"] >= 303,
                10,
                "the forgeries were counted",
            )
            status = sender.status()
            assert [w["worker"] for w in status["workers"]] == [0, 1]
            assert all(w["live"] and not w["left"] for w in status["workers"])
            assert status["totals"]["bytes_sent"] == bytes_sent
            after = [fleet.ask(i, "state")["stats"]["received_bytes"] for i in range(2)]
            assert after == before, "a forged request made the learner send to workers"

            with stopped(fleet.procs[1].pid):
                bump(model)
                forged = Ack("policy", 2**64 - 1, sender.epoch, 1, True, session="f" * 32)
                _flood(push, [forged] * 5)
                with pytest.raises(SyncTimeout) as info:
                    _send_recording(scheme, model, sent, worker_ids=[1])
                assert info.value.missing_workers == [1]
                row = next(w for w in sender.status()["workers"] if w["worker"] == 1)
                assert row["version"] < 2**63
        bump(model)
        _send_recording(scheme, model, sent)  # both answer: nobody left, nobody lost
        for worker in range(2):
            _applied_exactly(fleet, worker, sent)
            assert fleet.ask(worker, "state")["checksum"] == zmqsync.checksum(model)
    finally:
        scheme.shutdown()


# --- 3. listening sockets are bound once --------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["pubsub", "router"])
def test_no_port_is_ever_free_for_a_squatter(fleet: Any, mode: str) -> None:
    """A send that times out on a stopped worker leaves every listening socket bound:
    a second process binding the learner's ports throughout never gets one."""
    model = make_model("big", seed=0)
    scheme = ZMQWeightSyncScheme("state_dict", mode=mode, endpoint="tcp://127.0.0.1:*", timeout=1)
    scheme.init_on_sender("policy", model=model, num_workers=1)
    sender = scheme.get_sender()
    sent: dict[int, str] = {0: zmqsync.checksum(model)}  # version 0: what it started with
    addresses = [sender.endpoint, *sender.transport.announce().values()]
    try:
        _start(fleet, scheme, range(1), kind="big")
        _send_recording(scheme, model, sent)
        with squatter(addresses) as squatted:
            with stopped(fleet.procs[0].pid):
                for _ in range(3):
                    bump(model)
                    with pytest.raises(SyncTimeout):
                        _send_recording(scheme, model, sent)
            bump(model)
            _send_recording(scheme, model, sent)
        assert not squatted, f"another process bound {squatted} while the learner lived"
        assert "purges" not in sender.status()["totals"]
        _applied_exactly(fleet, 0, sent)
    finally:
        scheme.shutdown()


# --- 4. state from strangers ----------------------------------------------------------


@pytest.mark.timeout(180)
def test_strangers_grow_no_state_and_status_stays_bounded(fleet: Any) -> None:
    """Forged rejecting acks for thousands of ids and a probe for worker 777 create no
    record: status keeps its two rows, and a dynamic fleet's send does not wait for 777."""
    model = make_model(seed=0)
    scheme = ZMQWeightSyncScheme("state_dict", endpoint="tcp://127.0.0.1:*", timeout=5)
    scheme.init_on_sender("policy", model=model, num_workers=None)
    sender = scheme.get_sender()
    sent: dict[int, str] = {0: zmqsync.checksum(model)}  # version 0: what it started with
    try:
        _start(fleet, scheme, range(2))
        ack_endpoint = sender.transport.announce()["ack_endpoint"]
        with raw_sockets((zmq.PUSH, ack_endpoint), (zmq.DEALER, sender.endpoint)) as (push, dealer):
            reason = "r" * 4000
            _flood(push, [Ack("policy", 1, 1, 10 + i, False, reason) for i in range(3000)])
            _flood(dealer, [ProbeRequest("policy", 777, "nonce")])
            until(
                lambda: sender.status()["totals"]["forged"] >= 3001,
                20,
                "the forgeries were counted",
            )
        status = sender.status()
        assert [w["worker"] for w in status["workers"]] == [0, 1]
        assert status["workers_total"] == 2
        reply = encode(StatusReply("policy", sender.version, sender.epoch, status))
        assert len(reply[1]) < 64 * 1024, "forged reasons blew up the status reply"
        bump(model)
        start = time.monotonic()
        _send_recording(scheme, model, sent)  # waits for 0 and 1 only
        assert time.monotonic() - start < 5
        for worker in range(2):
            _applied_exactly(fleet, worker, sent)
    finally:
        scheme.shutdown()


#: Connections under a worker's routing id that each send one junk message and never
#: say hello; opened in batches (a ZeroMQ context holds at most 1023 sockets).
STRANGERS = 3000
STRANGER_BATCH = 500


def _replies(sock: zmq.Socket[Any]) -> list[str]:
    """What a stranger was sent: each message's type, once its first one came."""
    got: list[str] = []
    deadline = time.monotonic() + 20
    while not got or sock.poll(0):
        assert time.monotonic() < deadline, "a stranger's junk was never answered"
        if sock.poll(50):
            frames = sock.recv_multipart(zmq.NOBLOCK)
            try:
                got.append(type(decode(frames)).__name__)
            except FrameError:
                got.append("not a zmqsync message")
    return got


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("mode", "transport"), [("router", "tcp"), ("pubsub", "ipc")])
def test_strangers_that_never_say_hello_leave_nothing_in_the_hub(
    mode: str, transport: str, tmp_path: Any
) -> None:
    """Thousands of connections under a spoke's routing id, each sending one junk
    message and never a hello: the hub keeps nothing for them (its ``peers`` count is
    its workers'), sends them nothing but the refusal (no version, no shared-memory
    offer), and a worker that connects after them joins and gets each version exactly."""
    endpoint = "tcp://127.0.0.1:*" if transport == "tcp" else f"ipc://{tmp_path}/hub"
    hub_cls, spoke_cls = resolve(f"zmq-{mode}")
    hub = hub_cls(endpoint)
    model = make_model("wide", seed=0)  # large enough for shared memory over ipc
    sender = WeightSender(hub, model=model, strategy="state_dict", num_workers=None, timeout=30)
    workers: list[tuple[WeightReceiver, Any]] = []

    def totals() -> dict[str, Any]:
        return sender.status()["totals"]

    def read_junk(count: int) -> None:
        until(lambda: totals()["rejected_frames"] >= count, 60, f"{count} junk messages read")

    def join(worker: int) -> None:
        target = make_model("wide", seed=100 + worker)
        spoke = spoke_cls(hub.endpoint, identity=f"w{worker}")
        receiver = WeightReceiver(spoke, model=target, strategy="state_dict", worker_idx=worker)
        workers.append((receiver, target))
        receiver.connect(timeout=30)
        receiver.start()

    context: zmq.Context[Any] = zmq.Context()
    strangers: list[zmq.Socket[Any]] = []
    try:
        join(0)
        until(lambda: totals()["peers"] == 1, 10, "the hub counted its worker")
        rejected = totals()["rejected_frames"]
        for first in range(0, STRANGERS, STRANGER_BATCH):
            for sock in strangers:
                sock.close(linger=0)
            strangers = []
            for i in range(first, first + STRANGER_BATCH):
                sock = context.socket(zmq.DEALER)
                sock.linger = 0
                sock.routing_id = SPOKE_PREFIX + b"stranger-%d" % i
                sock.connect(hub.endpoint)
                sock.send(b"junk", zmq.NOBLOCK)  # queued until connected
                strangers.append(sock)
            rejected += STRANGER_BATCH
            read_junk(rejected)
        # The last batch stays connected: a fan-out could still reach it.
        assert totals()["peers"] == 1, "the hub keeps peers that never said hello"
        join(1)  # a worker that connects after them
        until(lambda: totals()["peers"] == 2, 10, "the hub counted its new worker")
        for _ in range(2):
            bump(model)
            sender.send()  # waits for both workers' acks
            for _receiver, target in workers:
                assert zmqsync.checksum(target) == zmqsync.checksum(model)
        assert totals()["peers"] == 2
        for sock in strangers:
            assert _replies(sock) == ["ErrorMessage"], "a stranger was sent more than a refusal"
        workers[1][0].close()  # its goodbye: the hub forgets it
        until(lambda: totals()["peers"] == 1, 10, "the hub forgot a worker that left")
    finally:
        for sock in strangers:
            sock.close(linger=0)
        context.term()
        for receiver, _target in workers:
            receiver.close()
        sender.close()


def test_status_stays_bounded_for_thousands_of_workers() -> None:
    """The fleet core keeps thousands of sessions, and status shows a bounded number of
    rows (furthest behind first) with counts, far below the protocol's body limit."""
    from zmqsync.fleet import STATUS_ROWS, Fleet, Origin
    from zmqsync.protocol import Hello

    core = Fleet("policy", 7, mode="zmq", strategy="state_dict", transports=["zmq"])
    for i in range(5000):
        effects = core.handle(
            Hello("policy", 0, 0, i, attempt="a"), Origin(0, f"peer-{i}".encode()), 0.0
        )
        assert effects, "a hello is answered"
    rows, counts = core.status_rows(0.1)
    assert counts["workers_total"] == 5000 and len(rows) == STATUS_ROWS
    reply = encode(StatusReply("policy", 0, 7, {"workers": [r.as_dict() for r in rows], **counts}))
    assert len(reply[1]) < MAX_BODY_BYTES // 4


# --- 5. one id, one process -------------------------------------------------------------


@pytest.mark.timeout(240)
def test_a_paused_worker_keeps_its_id(fleet: Any) -> None:
    """A worker paused for several heartbeats keeps its id: a new replica is assigned
    another, an explicit claim on it is refused while it is live, and a send to it
    returns only once that very process applied the version."""
    model = make_model(seed=0)
    scheme = ZMQWeightSyncScheme(
        "state_dict", endpoint="tcp://127.0.0.1:*", timeout=3, heartbeat=0.2
    )
    scheme.init_on_sender("policy", model=model, num_workers=None)
    sender = scheme.get_sender()
    sent: dict[int, str] = {0: zmqsync.checksum(model)}  # version 0: what it started with
    try:
        fleet.start(scheme, 0, init_kwargs={"worker_idx": None})
        fleet.wait_ready(0)
        assert fleet.ask(0, "state")["worker_idx"] == 0
        with stopped(fleet.procs[0].pid):
            until(  # a few heartbeats missed: no longer live, still holding its id
                lambda: not next(w for w in sender.status()["workers"] if w["worker"] == 0)["live"],
                10,
                "the stopped worker no longer counts as live",
            )
            fleet.start(scheme, 1, init_kwargs={"worker_idx": None})
            fleet.wait_ready(1)
            assert fleet.ask(1, "state")["worker_idx"] == 1
        until(
            lambda: next(w for w in sender.status()["workers"] if w["worker"] == 0)["live"],
            10,
            "the resumed worker is live again",
        )
        # Claiming a live worker's id is refused: connect() says so.
        fleet.start(scheme, 2, init_kwargs={"worker_idx": 0}, connect_timeout=10)
        with pytest.raises(AssertionError, match="already taken"):
            fleet.wait_ready(2)
        bump(model)
        _send_recording(scheme, model, sent, worker_ids=[0])
        assert fleet.ask(0, "state")["checksum"] == zmqsync.checksum(model)
        rows = {w["worker"]: w for w in sender.status()["workers"]}
        assert rows[0]["pid"] == fleet.procs[0].pid
        assert rows[1]["pid"] == fleet.procs[1].pid
        for worker in range(2):
            _applied_exactly(fleet, worker, sent)
    finally:
        scheme.shutdown()


# --- 6. weights thrown at the learner -------------------------------------------------


@pytest.mark.timeout(120)
def test_weights_sent_to_the_learner_are_refused_unread(fleet: Any) -> None:
    """Weights messages at the learner's control socket, each with a large schema, are
    refused before they are decoded and nothing of them is kept; larger ones are cut off
    by the socket's size limit. Status answers at once throughout."""
    entries = tuple(TensorEntry((f"t{i}",), "float32", (1,), 0, 4 * i, 4) for i in range(20_000))
    schema = WeightsSchema("state_dict", entries)
    layout = layout_digest(encode_schema(schema))
    hostile = Chunk("policy", 1, 1, 0, 1, 0, 80_000, layout, bytes(80_000), schema)
    frames = encode(hostile)
    assert 700_000 < sum(len(f) for f in frames) < 1024 * 1024  # under the control limit
    model = make_model(seed=0)
    scheme = ZMQWeightSyncScheme("state_dict", endpoint="tcp://127.0.0.1:*", timeout=5)
    scheme.init_on_sender("policy", model=model, num_workers=1)
    sender = scheme.get_sender()
    sent: dict[int, str] = {0: zmqsync.checksum(model)}  # version 0: what it started with
    try:
        _start(fleet, scheme, range(1))
        rejected = sender.status()["totals"]["rejected_frames"]
        rss = rss_bytes()
        with raw_sockets((zmq.DEALER, sender.endpoint)) as (dealer,):
            for _ in range(40):
                dealer.send_multipart(frames)
            dealer.send_multipart([b"x" * (2 * 1024 * 1024)])  # over the limit: cut off
            until(
                lambda: sender.status()["totals"]["rejected_frames"] >= rejected + 40,
                20,
                "the weights messages were refused",
            )
        start = time.monotonic()
        sender.status()
        assert time.monotonic() - start < 1.0
        assert rss_bytes() - rss < 100 * 1024 * 1024
        bump(model)
        _send_recording(scheme, model, sent)
        _applied_exactly(fleet, 0, sent)
    finally:
        scheme.shutdown()


def test_a_worker_welcome_carries_a_secret_that_differs_per_session() -> None:
    """Sessions are unguessable and per worker: two workers' secrets differ, and a
    worker that says hello again (a new attempt) gets a new one."""
    from zmqsync.fleet import Fleet, Origin, Reply
    from zmqsync.protocol import Hello, Welcome

    core = Fleet("policy", 7, mode="zmq", strategy="state_dict", transports=["zmq"])

    def welcome(worker: int, peer: bytes, attempt: str) -> Welcome:
        _admit, effect = core.handle(
            Hello("policy", 0, 0, worker, attempt=attempt), Origin(0, peer), 0
        )
        assert isinstance(effect, Reply) and isinstance(effect.message, Welcome)
        return effect.message

    a, b = welcome(0, b"a", "1"), welcome(1, b"b", "1")
    assert a.session != b.session and len(a.session) == 32
    assert welcome(0, b"a", "1").session == a.session  # a repeat of the same attempt
    assert welcome(0, b"a", "2").session != a.session  # a new attempt: a new session
