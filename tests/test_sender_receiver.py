"""WeightSender / WeightReceiver semantics, in one process (memory and inproc transports)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from zmqsync import (
    SchemaMismatchError,
    SyncTimeout,
    WeightReceiver,
    WeightSender,
    WeightsRejected,
    checksum,
)
from zmqsync.protocol import Hello, SnapshotRequest, encode
from zmqsync.tensors.extract import extract
from zmqsync.tensors.flatten import Flattener
from zmqsync.tensors.version_messages import version_messages
from zmqsync.transport.memory import MemoryHub, MemorySpoke
from zmqsync.transport.zmq_pubsub import PubSubHub, PubSubSpoke


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))


class Rig:
    """A sender and receivers over the memory transport; receivers run in background."""

    def __init__(
        self, n: int = 2, *, num_workers: int | None = None, timeout: float = 3.0, **options
    ) -> None:  # type: ignore[no-untyped-def]
        self.model = _model(0)
        self.sender = WeightSender(
            MemoryHub(),
            model=self.model,
            strategy="state_dict",
            num_workers=num_workers,
            timeout=timeout,
            **options,
        )
        self.workers: list[tuple[WeightReceiver, nn.Module]] = []
        for i in range(n):
            self.add_worker(i)

    def add_worker(self, i: int, *, start: bool = True) -> tuple[WeightReceiver, nn.Module]:
        model = _model(100 + i)
        receiver = WeightReceiver(
            MemorySpoke(self.sender.endpoint),
            model=model,
            strategy="state_dict",
            worker_idx=i,
            timeout=5,
        )
        receiver.connect()
        if start:
            receiver.start()
        self.workers.append((receiver, model))
        return receiver, model

    def bump(self) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(1.0)

    def close(self) -> None:
        for receiver, _ in self.workers:
            receiver.close()
        self.sender.close()


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    yield r
    r.close()


def test_send_applies_everywhere_and_versions_count_up(rig: Rig) -> None:
    for version in (1, 2, 3):
        rig.bump()
        rig.sender.send()
        assert rig.sender.version == version
        for receiver, model in rig.workers:
            assert receiver.version == version
            assert checksum(model) == checksum(rig.model)


def test_send_async_and_wait_async_follow_the_seed(rig: Rig) -> None:
    with pytest.raises(RuntimeError, match="no send_async"):
        rig.sender.wait_async()
    rig.sender.send_async()
    with pytest.raises(RuntimeError, match="still pending"):
        rig.sender.send_async()
    with pytest.raises(RuntimeError, match="still pending"):
        rig.sender.send()
    rig.sender.wait_async()
    assert all(r.version == 1 for r, _ in rig.workers)
    rig.sender.update_weights(None)  # legacy name: send to all
    assert all(r.version == 2 for r, _ in rig.workers)


def test_timeout_names_missing_workers_and_sender_stays_usable() -> None:
    rig = Rig(2, num_workers=3, timeout=0.5)
    try:
        start = time.monotonic()
        with pytest.raises(SyncTimeout) as info:
            rig.sender.send()
        assert time.monotonic() - start < 1.5
        assert isinstance(info.value, TimeoutError)
        assert info.value.missing_workers == [2]
        assert "worker 2 never connected" in str(info.value)
        rig.sender.send(worker_ids=[0, 1])
        assert [r.version for r, _ in rig.workers] == [2, 2]
        assert rig.sender.status()["totals"]["timeouts"] == 1
    finally:
        rig.close()


def test_worker_ids_validation() -> None:
    rig = Rig(1, num_workers=1)
    try:
        with pytest.raises(ValueError, match="does not exist"):
            rig.sender.send(worker_ids=[5])
        with pytest.raises(ValueError, match="non-negative"):
            rig.sender.send(worker_ids=[-1])
        rig.sender.send(worker_ids=0)
    finally:
        rig.close()


def test_duplicates_and_stale_versions_are_ignored_and_counted(rig: Rig) -> None:
    rig.bump()
    rig.sender.send()
    rig.bump()
    rig.sender.send()
    receiver, model = rig.workers[0]
    before = checksum(model)
    # Replay version 1 (stale) and version 2 (duplicate) straight down the transport.
    for version in (1, 2):
        (frames,) = version_messages(_model(7), version=version, epoch=rig.sender.epoch)
        with rig.sender._holding_baton():
            rig.sender.transport.send_frames(frames)
    deadline = time.monotonic() + 5

    def ignored() -> int:
        return receiver.stats["duplicates"] + receiver.stats["stale"]

    while ignored() < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ignored() >= 2 and receiver.stats["duplicates"] >= 1
    assert receiver.version == 2
    assert checksum(model) == before


def test_a_late_repeat_of_a_workers_hello_neither_rewinds_it_nor_earns_a_resend() -> None:
    """A worker repeats its Hello until welcomed; over Ray those repeats can arrive after
    it acked newer versions. One from the same connect attempt must not be taken for a
    restart (which would resend the latest version to a worker that holds it).

    No timed repairs: on a loaded machine the stale request can arrive over a second
    after the version went out, and a timed repair would resend it for that reason
    alone (harmless: a duplicate), which is not what this test is about."""
    rig = Rig(1, repair_after=60.0)
    try:
        for _ in range(2):
            rig.bump()
            rig.sender.send()
        receiver, _ = rig.workers[0]
        # What the worker sent while connecting, delivered only now.
        upstream = receiver._upstream  # the receiver's session with its sender
        stale = [
            Hello("policy", 0, 0, 0, upstream.pid, upstream.host_name, upstream.attempt),
            SnapshotRequest("policy", 0, 0, 0, upstream.session),
        ]
        with upstream.io_lock:
            for message in stale:
                receiver.transport.send_frames(encode(message))
        rig.bump()
        rig.sender.send()  # its ack travels behind the stale messages: they were handled
        assert receiver.version == 3
        assert receiver.stats["duplicates"] == 0, "the sender resent a version it held"
        (worker,) = rig.sender.status()["workers"]
        assert worker["version"] == 3

        # A new connect attempt (a restarted worker, same process) still starts over:
        # a new session, and the latest version for a worker that says it holds nothing.
        old_session = upstream.session
        with upstream.io_lock:
            upstream.new_attempt()
            fresh = Hello("policy", 0, 0, 0, upstream.pid, upstream.host_name, upstream.attempt)
            receiver.transport.send_frames(encode(fresh))
        deadline = time.monotonic() + 5
        while not upstream.session and time.monotonic() < deadline:
            time.sleep(0.01)  # its background thread takes the Welcome
        assert upstream.session and upstream.session != old_session
        with upstream.io_lock:
            request = SnapshotRequest("policy", 0, 0, 0, upstream.session)
            receiver.transport.send_frames(encode(request))
        while receiver.stats["duplicates"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert receiver.stats["duplicates"] == 1, "a restarted worker did not get the latest"
    finally:
        rig.close()


def test_a_rejected_version_is_reported_with_its_reason() -> None:
    rig = Rig(1)
    try:
        with pytest.raises(WeightsRejected) as info:
            rig.sender.send({"not.in.the.model": torch.ones(3)})
        assert 0 in info.value.rejections
        assert "lack" in info.value.rejections[0] or "carry" in info.value.rejections[0]
        worker = rig.sender.status()["workers"][0]
        assert worker["rejections"], worker
        rig.sender.send()  # still fine afterwards
    finally:
        rig.close()


def _rejections_of(sender: WeightSender, worker: int, timeout: float = 10.0) -> list[str]:
    """The refusals ``sender`` counted for ``worker``, once there are any (acks travel
    on their own path: the one a worker sent last may still be on its way)."""
    deadline = time.monotonic() + timeout
    while True:
        status = {w["worker"]: w for w in sender.status()["workers"]}
        rejections: list[str] = status.get(worker, {}).get("rejections", [])
        if rejections or time.monotonic() >= deadline:
            return rejections
        time.sleep(0.01)


@pytest.mark.timeout(60)
def test_connect_raises_when_the_latest_version_does_not_fit_the_model() -> None:
    """The refusal used to end connect() as if caught up: the worker kept its initial
    weights and nothing said so. Now connect() names the key; asking again, or as a
    restarted worker with the same id, the sender answers afresh."""
    hub = MemoryHub()
    sender = WeightSender(hub, model=_model(0), strategy="state_dict", timeout=5)
    receivers: list[WeightReceiver] = []

    def worker(model: nn.Module) -> WeightReceiver:
        receivers.append(
            WeightReceiver(MemorySpoke(hub.endpoint), model=model, strategy="state_dict", timeout=5)
        )
        return receivers[-1]

    try:
        sender.send(worker_ids=[])  # version 1, for whoever joins
        wrong = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))  # 1.weight is [3, 8]
        before = checksum(wrong)
        receiver = worker(wrong)
        for _ in range(2):  # the second time the sender knows it was refused
            with pytest.raises(SchemaMismatchError, match=r"'1\.weight' has shape") as info:
                receiver.connect()
            assert info.value.key == "1.weight" and "version 1" in str(info.value)
            assert receiver.version == 0 and checksum(wrong) == before
        assert "'1.weight' has shape" in _rejections_of(sender, 0)[-1]
        start = time.monotonic()
        receiver.close()
        assert time.monotonic() - start < 1.0

        # The same worker id again, now with a model that fits: it gets version 1.
        right = _model(7)
        worker(right).connect()
        assert receivers[-1].version == 1 and checksum(right) == checksum(sender.model)
    finally:
        for r in receivers:
            r.close()
        sender.close()


def test_connect_before_any_weights_has_nothing_to_check() -> None:
    """A sender without a model has published nothing: a worker whose model does not
    fit joins, and the first send is where the refusal shows."""
    hub = MemoryHub()
    sender = WeightSender(hub, strategy="state_dict", num_workers=1, timeout=5)
    receiver = WeightReceiver(
        MemorySpoke(hub.endpoint), model=nn.Linear(4, 8), strategy="state_dict", timeout=5
    )
    try:
        receiver.connect()
        assert receiver.version == 0 and receiver.epoch == 0
        receiver.start()
        with pytest.raises(WeightsRejected, match="weights lack"):
            sender.send(_model(0))
    finally:
        receiver.close()
        sender.close()


def test_connect_is_a_rendez_vous_for_the_learners_weights() -> None:
    """Before any send, a worker's connect() returns holding the weights the learner
    started with (version 0), not its own initial ones; publish() updates them for
    workers that connect later; the first send is version 1."""
    learner = _model(0)
    hub = MemoryHub()
    sender = WeightSender(hub, model=learner, strategy="state_dict", num_workers=None)
    receivers = []
    try:
        first = WeightReceiver(
            MemorySpoke(hub.endpoint), model=_model(5), strategy="state_dict", worker_idx=None
        )
        receivers.append(first)
        first.connect()
        assert first.version == 0 and first.epoch == sender.epoch
        assert checksum(first.model) == checksum(learner)
        with torch.no_grad():
            learner[0].weight.add_(1.0)  # a checkpoint loaded, say, before training starts
        sender.publish()
        late = WeightReceiver(
            MemorySpoke(hub.endpoint), model=_model(6), strategy="state_dict", worker_idx=None
        )
        receivers.append(late)
        late.connect()
        assert checksum(late.model) == checksum(learner)
        for r in receivers:
            r.start()
        sender.send()
        assert sender.version == 1
        assert all(r.version == 1 and checksum(r.model) == checksum(learner) for r in receivers)
        with pytest.raises(RuntimeError, match="before the first send"):
            sender.publish()
    finally:
        for r in receivers:
            r.close()
        sender.close()


def test_a_worker_whose_model_does_not_fit_the_learners_first_weights_fails_connect() -> None:
    hub = MemoryHub()
    sender = WeightSender(hub, model=_model(0), strategy="state_dict", num_workers=1, timeout=5)
    receiver = WeightReceiver(
        MemorySpoke(hub.endpoint), model=nn.Linear(4, 8), strategy="state_dict", timeout=5
    )
    try:
        with pytest.raises(SchemaMismatchError, match=r"version 0\) do not fit"):
            receiver.connect()
    finally:
        receiver.close()
        sender.close()


def test_new_epoch_is_followed_and_old_epoch_frames_dropped() -> None:
    hub_name = "memory://epochs"
    model = _model(0)
    first = WeightSender(MemoryHub(hub_name), model=model, strategy="state_dict", num_workers=1)
    worker_model = _model(9)
    receiver = WeightReceiver(MemorySpoke(hub_name), model=worker_model, strategy="state_dict")
    try:
        receiver.connect()
        receiver.start()
        for _ in range(3):
            first.send()
        old_epoch = first.epoch
        (stale,) = version_messages(_model(3), version=99, epoch=old_epoch)
        first.close()
        second = WeightSender(
            MemoryHub(hub_name), model=_model(1), strategy="state_dict", num_workers=1, timeout=5
        )
        try:
            second.send()
            assert (receiver.epoch, receiver.version) == (second.epoch, 1)
            assert checksum(worker_model) == checksum(second.model)
            applied = receiver.stats["applied"]
            with second._holding_baton():
                second.transport.send_frames(stale)  # a late frame of the old life
            second.send()
            assert receiver.version == 2 and receiver.stats["applied"] == applied + 1
            assert checksum(worker_model) == checksum(second.model)
        finally:
            second.close()
    finally:
        receiver.close()


@pytest.mark.parametrize("retain", [True, False])
def test_late_joiner(retain: bool) -> None:
    rig = Rig(1, retain_snapshot=retain)
    try:
        for _ in range(3):
            rig.bump()
            rig.sender.send()
        late, late_model = rig.add_worker(5)
        if retain:
            assert late.version == 3
            assert checksum(late_model) == checksum(rig.model)
        else:
            assert late.version == 0  # nothing kept: it waits for the next send
            rig.bump()
            rig.sender.send()
            assert late.version == 4 and checksum(late_model) == checksum(rig.model)
    finally:
        rig.close()


def test_the_sender_rewrites_its_copy_only_once_no_transport_holds_it() -> None:
    """Every version is streamed from a copy the sender owns. Its memory is reused for a
    later version only once nobody holds it any more: a worker that still holds (or has
    yet to read) a version always reads that version's bytes, whole."""
    rig = Rig(1)
    try:
        rig.bump()
        rig.sender.send()

        def copy_pointer() -> int:
            snapshot = rig.sender.snapshot
            assert snapshot is not None
            return int(snapshot.data.ctypes.data)

        first = copy_pointer()
        rig.bump()
        rig.sender.send()
        assert copy_pointer() == first  # nobody holds the last copy: written over
        # A transport that still holds a version (a stopped worker's queue) is lent it:
        latest = rig.sender._latest()
        assert latest is not None
        lent, _ = latest.frames(0)
        kept = bytes(lent[2])
        rig.bump()
        rig.sender.send()
        second = copy_pointer()
        assert second != first  # fresh memory for the next version
        assert bytes(lent[2]) == kept  # what was lent is intact
        del lent  # let go: the memory is free again
        rig.bump()
        rig.sender.send()
        assert copy_pointer() == second
        assert checksum(rig.workers[0][1]) == checksum(rig.model)
    finally:
        rig.close()


def test_forward_pass_under_the_lock_never_sees_half_a_version() -> None:
    rig = Rig(1, timeout=10)
    receiver, model = rig.workers[0]
    seen: list[set[float]] = []
    stop = threading.Event()

    def forward() -> None:
        while not stop.is_set():
            with receiver.lock:
                seen.append(
                    {
                        float(p.detach().flatten()[0] - q.flatten()[0])
                        for p, q in zip(model.parameters(), rig_params, strict=True)
                    }
                )

    with torch.no_grad():
        for p in rig.model.parameters():
            p.zero_()
    rig.sender.send()
    rig_params = [p.detach().clone() for p in model.parameters()]
    thread = threading.Thread(target=forward)
    thread.start()
    try:
        for _ in range(20):
            rig.bump()  # every parameter moves by the same amount per version
            rig.sender.send()
    finally:
        stop.set()
        thread.join(5)
        rig.close()
    assert seen and all(len(s) == 1 for s in seen), "a forward pass saw a mix of versions"


def test_status_reports_the_fleet(rig: Rig) -> None:
    rig.bump()
    rig.sender.send()
    status = rig.sender.status()
    assert status["version"] == 1 and status["model_id"] == "policy"
    assert [w["worker"] for w in status["workers"]] == [0, 1]
    for w in status["workers"]:
        assert w["version"] == 1 and w["lag"] == 0 and w["pid"] > 0
        assert w["last_latency_s"] is not None and w["received_bytes"] > 0
    totals = status["totals"]
    assert totals["versions_sent"] == 1 and totals["latency_p50_s"] is not None


def _inproc_fleet(
    name: str, strategy: str, receivers: list[WeightReceiver]
) -> tuple[PubSubHub, WeightSender, nn.Module]:
    """A ZeroMQ sender over inproc and 2 background receivers (appended to
    ``receivers`` as they start, so the caller closes whatever started)."""
    hub = PubSubHub(f"inproc://{name}")
    model = _model(0)
    sender = WeightSender(hub, model=model, strategy=strategy, num_workers=2, timeout=5)
    try:
        for i in range(2):
            r = WeightReceiver(
                PubSubSpoke(hub.endpoint, identity=str(i)),
                model=_model(i + 1),
                strategy=strategy,
                worker_idx=i,
            )
            receivers.append(r)
            r.connect()
            r.start()
    except BaseException:
        sender.close()
        raise
    return hub, sender, model


def test_inproc_zmq_fleet_in_one_process() -> None:
    receivers: list[WeightReceiver] = []
    _, sender, model = _inproc_fleet("zmqsync-one-process", "tensordict", receivers)
    try:
        sender.send()
        assert all(checksum(r.model) == checksum(model) for r in receivers)
    finally:
        for r in receivers:
            r.close()
        sender.close()


@pytest.mark.timeout(30)
def test_a_state_dict_is_sent_to_a_tensordict_strategys_workers() -> None:
    """The tensordict strategy takes a module's flat state_dict as the nested keys its
    dots name (once refused: "weights lack '0.weight' that the model has")."""
    hub = MemoryHub()
    model, other = _model(0), _model(1)
    sender = WeightSender(hub, model=model, strategy="tensordict", num_workers=1, timeout=10)
    worker = _model(2)
    receiver = WeightReceiver(MemorySpoke(hub.endpoint), model=worker, strategy="tensordict")
    try:
        receiver.connect()
        receiver.start()
        sender.send(other.state_dict())
        assert checksum(worker) == checksum(other) != checksum(model)
    finally:
        receiver.close()
        sender.close()


def test_receive_without_a_model_returns_fresh_weights() -> None:
    hub = MemoryHub()
    model = _model(0)
    sender = WeightSender(hub, model=model, strategy="state_dict", num_workers=1)
    receiver = WeightReceiver(MemorySpoke(hub.endpoint), strategy="state_dict")
    try:
        receiver.connect()
        sender.send_async()
        weights = receiver.receive(timeout=5)
        sender.wait_async()
        assert isinstance(weights, dict) and checksum(weights) == checksum(model)
        assert weights["0.weight"].data_ptr() != model[0].weight.data_ptr()
        assert receiver.receive(timeout=0.05) is None
    finally:
        receiver.close()
        sender.close()


def test_close_is_idempotent_and_prompt(rig: Rig) -> None:
    start = time.monotonic()
    rig.close()
    rig.close()
    assert time.monotonic() - start < 5
    with pytest.raises(RuntimeError, match="shut down"):
        rig.sender.send()


def test_closing_during_connect_stops_it_and_says_goodbye() -> None:
    """A worker closed from another thread while its connect() waits (welcomed, its
    snapshot request unanswered) stops connecting and still tells the sender it left.

    The hub is played by hand. The goodbye used to be skipped because connect() held
    the spoke, so the sender waited out its timeout for a worker that was gone."""
    from zmqsync import ZMQSyncError
    from zmqsync.protocol import Goodbye, Probe, ProbeRequest, Welcome, decode

    hub = MemoryHub()
    receiver = WeightReceiver(
        MemorySpoke(hub.endpoint), model=_model(1), strategy="state_dict", worker_idx=0
    )
    raised: list[BaseException] = []

    def connect() -> None:
        try:
            receiver.connect(timeout=30)
        except BaseException as exc:  # what the test checks
            raised.append(exc)

    def next_message() -> tuple[object, bytes]:
        incoming = hub.recv_frames(5.0)
        assert incoming is not None, "the receiver said nothing"
        return decode(incoming.frames), incoming.peer

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    try:
        hello, peer = next_message()
        while not isinstance(hello, Hello):
            hello, peer = next_message()
        hub.send_frames(
            encode(
                Welcome(
                    "policy",
                    1,
                    7,
                    mode="memory",
                    strategy="state_dict",
                    worker=0,
                    session="s3cret",
                    attempt=hello.attempt,
                )
            ),
            to=[peer],
        )
        request, _ = next_message()
        while not isinstance(request, ProbeRequest):
            request, _ = next_message()
        hub.send_frames(encode(Probe("policy", 0, request.nonce)), to=[peer])
        request, _ = next_message()
        while not isinstance(request, SnapshotRequest):  # left unanswered
            request, _ = next_message()

        start = time.monotonic()
        receiver.close()
        assert time.monotonic() - start < 2.0
        thread.join(5.0)
        assert not thread.is_alive()
        assert len(raised) == 1 and isinstance(raised[0], ZMQSyncError)
        assert "closed" in str(raised[0])
        said = [decode(i.frames) for i in iter(lambda: hub.recv_frames(0.5), None)]
        goodbyes = [m for m in said if isinstance(m, Goodbye)]
        assert [(g.worker, g.session) for g in goodbyes] == [(0, "s3cret")]
    finally:
        receiver.close()
        hub.close()


def test_one_sender_serves_a_mixed_fleet(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Memory and ZeroMQ workers behind one sender: one version counter, one encode,
    unique worker ids, and a timeout that names missing workers with their transport."""
    from zmqsync import ZMQSyncError

    memory, zmq_hub = MemoryHub(), PubSubHub(f"ipc://{tmp_path}/mixed")
    model = _model(0)
    sender = WeightSender(
        [memory, zmq_hub], model=model, strategy="state_dict", num_workers=5, timeout=2.0
    )
    receivers: list[WeightReceiver] = []
    try:
        for i, spoke in enumerate(
            [
                MemorySpoke(memory.endpoint),
                MemorySpoke(memory.endpoint),
                PubSubSpoke(zmq_hub.endpoint, identity="2"),
                PubSubSpoke(zmq_hub.endpoint, identity="3"),
            ]
        ):
            r = WeightReceiver(spoke, model=_model(10 + i), strategy="state_dict", worker_idx=i)
            r.connect()
            r.start()
            receivers.append(r)
        # Worker ids are unique across the fleet: a second worker 1 on the other hub is refused.
        clash = WeightReceiver(
            PubSubSpoke(zmq_hub.endpoint, identity="1"),
            model=_model(9),
            strategy="state_dict",
            worker_idx=1,
        )
        with pytest.raises(ZMQSyncError, match="worker ids must be unique"):
            clash.connect(timeout=5)
        clash.close()

        with pytest.raises(SyncTimeout) as info:  # worker 4 never joined
            sender.send()
        assert info.value.missing_workers == [4]
        sender.num_workers = 4
        for _ in range(2):
            with torch.no_grad():
                model[0].weight.add_(1)
            sender.send()
            assert all(checksum(r.model) == checksum(model) for r in receivers)
        sender.send(worker_ids=[1, 2])  # targeting crosses transports
        assert [r.version for r in receivers] == [3, 4, 4, 3]
        transports = {w["worker"]: w["transport"] for w in sender.status()["workers"]}
        assert transports == {0: "memory", 1: "memory", 2: "zmq-pubsub", 3: "zmq-pubsub"}
        receivers[3].close()
        with pytest.raises(SyncTimeout) as info:
            sender.send()
        assert info.value.missing_workers == [3]
        assert info.value.transports == {3: "zmq-pubsub"}
        assert "zmq-pubsub" in str(info.value)
    finally:
        for r in receivers:
            r.close()
        sender.close()


def test_workers_without_ids_are_assigned_the_lowest_free_ones() -> None:
    hub = MemoryHub()
    # Heartbeats every 0.1 s: a worker unheard for 3 of them has left, and its id is free.
    sender = WeightSender(hub, model=_model(0), strategy="state_dict", timeout=5, heartbeat=0.1)
    receivers = [
        WeightReceiver(
            MemorySpoke(hub.endpoint), model=_model(i), strategy="state_dict", worker_idx=None
        )
        for i in range(3)
    ]
    try:
        for r in receivers:
            r.connect()
            r.start()
        assert sorted(r.worker_idx for r in receivers) == [0, 1, 2]  # type: ignore[type-var]
        sender.send()
        assert all(r.version == 1 for r in receivers)
        receivers[1].close()
        time.sleep(0.5)  # outlive the closed worker's liveness window (3 heartbeats)
        late = WeightReceiver(
            MemorySpoke(hub.endpoint), model=_model(7), strategy="state_dict", worker_idx=None
        )
        receivers.append(late)
        late.connect()
        assert late.worker_idx == receivers[1].worker_idx and late.version == 1
    finally:
        for r in receivers:
            r.close()
        sender.close()


def test_send_to_no_worker_publishes_for_late_joiners() -> None:
    """send(worker_ids=[]) versions the weights and waits for nobody (`zmqsync serve`
    publishes its first version this way); late joiners get it on connect."""
    hub = MemoryHub()
    model = _model(0)
    sender = WeightSender(hub, model=model, strategy="state_dict", timeout=5)
    try:
        start = time.monotonic()
        sender.send(worker_ids=[])
        assert sender.version == 1 and time.monotonic() - start < 1.0
        late = WeightReceiver(MemorySpoke(hub.endpoint), model=_model(3), strategy="state_dict")
        late.connect()
        assert late.version == 1 and checksum(late.model) == checksum(model)
        late.close()
    finally:
        sender.close()


def test_the_pump_waits_holding_nothing_and_sends_do_not_wake_it(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Over ZeroMQ the sender's pump waits on the sockets' descriptors without the hub:
    a send takes the hub at once and reads its own acks, so the pump sleeps through it.
    Requests still get answered at once, even one whose signal the sending thread
    consumed while it held the hub. The pump's tick is set to 30 s here, so only a real
    wake-up answers anything within the test's timeouts."""
    import zmqsync.sender.pump as sender_module
    from zmqsync.tools.client import query_status

    monkeypatch.setattr(sender_module, "PUMP_TICK", 30.0)
    receivers: list[WeightReceiver] = []
    hub, sender, model = _inproc_fleet("zmqsync-pump-waits", "state_dict", receivers)
    try:
        runner = sender._runners[0]
        assert runner._waiting, "a ZeroMQ hub's pump should wait on descriptors"
        # Each turn of the pump (it takes the baton) starts with the sender's
        # housekeeping, looked up on the sender every turn: count the calls for this hub.
        turns = 0
        housekeeping = sender._housekeeping

        def counting(r: sender_module.HubRunner) -> None:
            nonlocal turns
            if r is runner:
                turns += 1
            housekeeping(r)

        monkeypatch.setattr(sender, "_housekeeping", counting)
        # Idle: a request wakes the pump through the descriptors.
        assert query_status(hub.endpoint, timeout=3)["version"] == 0

        before = turns
        for _ in range(20):
            with torch.no_grad():
                model[0].weight.add_(1.0)
            sender.send()
        assert all(checksum(r.model) == checksum(model) for r in receivers)
        # 20 sends, 40 acks: the pump may have woken for a heartbeat, not for the sends.
        assert turns - before <= 4, f"the pump woke {turns - before} times"

        # A request that arrives while a sender holds the hub, and whose signal the
        # holder's own use of the sockets consumed, is answered once the hub is let go.
        # To make that race certain, the pump is made deaf to the sockets (it then wakes
        # only when poked, or on its 30 s tick).
        monkeypatch.setattr(hub, "wait_handles", lambda acks=True: [])
        before = turns
        runner._poke()  # one more turn, so the pump takes up the (empty) descriptors
        deadline = time.monotonic() + 5
        while turns == before:
            assert time.monotonic() < deadline, "a poke did not wake the pump"
            time.sleep(0.01)
        answer: dict[str, object] = {}
        asker = threading.Thread(
            target=lambda: answer.update(query_status(hub.endpoint, timeout=5)), daemon=True
        )
        with runner.holding():
            asker.start()
            while not hub.has_input(acks=False):  # reads the socket state: consumes the signal
                assert time.monotonic() < deadline + 5, "the status request never arrived"
                time.sleep(0.01)
        asker.join(6)
        assert answer.get("version") == 20, "a request that came while the hub was held was lost"

        start = time.monotonic()
        sender.close()
        assert time.monotonic() - start < 5, "closing waited out the pump's tick"
    finally:
        for r in receivers:
            r.close()
        sender.close()


def test_a_worker_holds_nothing_of_versions_read_from_shared_memory(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Over ipc with the snapshot, versions are read from the hub's shared blocks, which
    the hub reuses once released: a worker must not keep them past its ack, or every
    version would need a block of its own."""
    model = {"big": torch.randn(128, 1024)}
    hub = PubSubHub(f"ipc://{tmp_path}/lent")
    sender = WeightSender(hub, model=model, strategy="state_dict", num_workers=1, timeout=5)
    worker = {"big": torch.zeros(128, 1024)}
    receiver = WeightReceiver(
        PubSubSpoke(hub.endpoint, identity="0"), model=worker, strategy="state_dict", worker_idx=0
    )
    try:
        receiver.connect()
        receiver.start()
        for _ in range(3):
            model["big"].add_(1)
            sender.send()
            assert torch.equal(worker["big"], model["big"])
        shm_bytes = hub.counters().get("shm_bytes", 0)
        assert shm_bytes > 0, "the version did not go through shared memory"
        # The snapshot's block and at most one more (the next version, written while the
        # previous block is still released): never one block per version.
        assert shm_bytes <= 2 * (model["big"].nbytes + 4096), shm_bytes
    finally:
        receiver.close()
        sender.close()


def test_a_sender_that_packs_nothing_still_sends_whole_versions() -> None:
    """``pack_threshold=0``: no tensor is copied into a pack, each is a buffer of its own
    memory, which the stream then copies chunk by chunk."""
    model = _model(0)
    tensors = extract(model, "state_dict")
    flat = Flattener("state_dict", pack_threshold=0).flatten(tensors)
    assert len(flat.buffers) == len(tensors)
    assert sorted(memoryview(b).obj.ctypes.data for b in flat.buffers) == sorted(  # type: ignore[union-attr]
        t.data_ptr() for t in tensors.values()
    )

    hub = PubSubHub("tcp://127.0.0.1:*")
    sender = WeightSender(
        hub,
        model=model,
        strategy="state_dict",
        num_workers=1,
        timeout=5,
        pack_threshold=0,
        retain_snapshot=False,
    )
    target = _model(1)
    receiver = WeightReceiver(
        PubSubSpoke(hub.endpoint, identity="0"),
        model=target,
        strategy="state_dict",
        worker_idx=0,
        timeout=5,
    )
    try:
        receiver.connect()
        receiver.start()
        for version in (1, 2, 3):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            sender.send()
            assert receiver.version == version and checksum(target) == checksum(model)
    finally:
        receiver.close()
        sender.close()


def test_connected_workers_and_worker_versions_count_past_the_status_rows() -> None:
    """status() shows at most STATUS_ROWS workers; connected_workers() and
    worker_versions(), which a learner's connect() and the CLI's progress read, count
    them all."""
    from zmqsync.fleet import STATUS_ROWS
    from zmqsync.protocol import Hello

    n = STATUS_ROWS + 200
    hub = MemoryHub()
    sender = WeightSender(hub, strategy="state_dict", num_workers=None)
    spokes = [MemorySpoke(hub.endpoint) for _ in range(n)]
    try:
        for i, spoke in enumerate(spokes):
            spoke.send_frames(encode(Hello("policy", 0, 0, i, attempt="a")))
        deadline = time.monotonic() + 30
        while len(sender.connected_workers()) < n:
            assert time.monotonic() < deadline, "the hellos were not all handled"
            time.sleep(0.02)
        assert sender.connected_workers() == frozenset(range(n))
        assert len(sender.worker_versions()) == n
        assert len(sender.status()["workers"]) == STATUS_ROWS
    finally:
        for spoke in spokes:
            spoke.close()
        sender.close()


def test_a_version_applied_before_a_restarted_senders_welcome_is_acked(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A restarted sender (new epoch, same endpoint) fans versions out to a worker whose
    SUB reconnected before the worker has a session with it: the worker applies them,
    but those acks count for nothing. Once welcomed, the worker acks what it holds
    again, so a send waiting for it completes."""
    endpoint = f"ipc://{tmp_path}/restart"
    # Heartbeats of 2 s: the worker hears of the restart only at its next one.
    first = WeightSender(
        PubSubHub(endpoint, shared_memory=False),
        model=_model(0),
        strategy="state_dict",
        heartbeat=2.0,
    )
    receiver = WeightReceiver(
        PubSubSpoke(endpoint, identity="0"), model=_model(9), strategy="state_dict"
    )
    second = None
    try:
        receiver.connect()
        receiver.start()
        first.close()
        model = _model(1)
        second = WeightSender(
            PubSubHub(endpoint, shared_memory=False),
            model=model,
            strategy="state_dict",
            num_workers=None,
            timeout=10,
        )
        # Fan versions out (to nobody the sender knows) until the worker, resubscribed
        # but not yet welcomed, has applied one.
        deadline = time.monotonic() + 10
        while receiver.epoch != second.epoch:
            assert time.monotonic() < deadline, "the worker never resubscribed"
            second.send()
            time.sleep(0.02)
        assert not second.connected_workers(), "welcomed already: the race did not happen"
        second.num_workers = 1
        second.send()  # waits for worker 0's ack under its new session
        assert receiver.epoch == second.epoch and receiver.version == second.version
        assert checksum(receiver.model) == checksum(model)
    finally:
        receiver.close()
        if second is not None:
            second.close()


def test_waiting_less_than_a_millisecond_on_a_zeromq_hub_sleeps_not_spins(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A sender whose window is full waits 0.5 ms at a time for the transport. ZeroMQ
    waits whole milliseconds, and a wait that rounded down to none made each such wait a
    busy loop: on two cores the learner took a core from the workers it was feeding (a
    4 GiB send over tcp ran at 0.7x raw pyzmq). Measured in CPU time, which load lowers
    and never raises: the waiting thread uses a small part of the time it waits."""
    for endpoint in ("tcp://127.0.0.1:*", f"ipc://{tmp_path}/idle"):
        hub = PubSubHub(endpoint)
        try:
            wall, cpu = time.monotonic(), time.thread_time()
            for _ in range(200):
                assert hub.recv_frames(0.0005) is None
            wall, cpu = time.monotonic() - wall, time.thread_time() - cpu
            assert wall >= 200 * 0.0005
            assert cpu < 0.3 * wall, f"{endpoint}: {cpu:.3f} s of CPU in {wall:.3f} s of waits"
        finally:
            hub.close()
