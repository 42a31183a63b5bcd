"""Versions streamed in chunks: whole on every transport and in both apply modes; a
broken in-place stream tears the model, refuses forward passes, and is repaired."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch
from _faults import until

from zmqsync import TornWeights, WeightReceiver, WeightSender, checksum
from zmqsync.chunking.layout import MIN_CHUNK_BYTES
from zmqsync.protocol import Chunk, decode
from zmqsync.receiver.observer import ReceiverObserver
from zmqsync.tensors.version_messages import version_messages
from zmqsync.transport.memory import MemoryHub, MemorySpoke
from zmqsync.transport.zmq_pubsub import PubSubHub, PubSubSpoke
from zmqsync.transport.zmq_router import RouterHub, RouterSpoke

CHUNK = MIN_CHUNK_BYTES  # 64 KiB: the model below is ~20 chunks


def _model(seed: int) -> dict[str, torch.Tensor]:
    """~1.3 MB: tensors larger than a chunk, smaller than one, and many tiny ones."""
    g = torch.Generator().manual_seed(seed)
    out = {
        "big": torch.randn(256, 1024, generator=g),  # 1 MiB: spans 16 chunks
        "mid": torch.randn(50_000, generator=g),  # 200 KB: straddles chunk edges
        "ints": torch.randint(0, 1000, (3000,), generator=g),
        "mask": torch.rand(777, generator=g) > 0.5,
    }
    for i in range(300):  # packed small tensors: many pieces in one chunk
        out[f"small.{i}"] = torch.randn(7, generator=g)
    return out


def _bump(model: dict[str, torch.Tensor]) -> None:
    for t in model.values():
        if t.dtype.is_floating_point:
            t.add_(1.0)
        elif t.dtype == torch.bool:
            t.logical_not_()
        else:
            t.add_(1)


def _pair(kind: str, tmp_path, name: str):  # type: ignore[no-untyped-def]
    if kind == "memory":
        hub = MemoryHub()
        return hub, lambda i: MemorySpoke(hub.endpoint)
    if kind == "ipc":
        hub = PubSubHub(f"ipc://{tmp_path}/{name}")
        return hub, lambda i: PubSubSpoke(hub.endpoint, identity=str(i))
    if kind == "ipc-socket":  # no shared memory: every chunk through the socket
        hub = PubSubHub(f"ipc://{tmp_path}/{name}", shared_memory=False)
        return hub, lambda i: PubSubSpoke(hub.endpoint, identity=str(i))
    hub = RouterHub("tcp://127.0.0.1:*")
    return hub, lambda i: RouterSpoke(hub.endpoint, identity=str(i))


@pytest.mark.parametrize("kind", ["memory", "ipc", "ipc-socket", "tcp"])
@pytest.mark.parametrize("mode", ["in_place", "staged", "auto"])
def test_multi_chunk_versions_arrive_whole(kind: str, mode: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = _model(0)
    hub, spoke = _pair(kind, tmp_path, f"whole-{mode}")
    sender = WeightSender(
        hub, model=model, strategy="state_dict", num_workers=2, timeout=10, chunk_bytes=CHUNK
    )
    workers = [_model(10 + i) for i in range(2)]
    receivers = [
        WeightReceiver(spoke(i), model=w, strategy="state_dict", worker_idx=i, apply_mode=mode)
        for i, w in enumerate(workers)
    ]
    try:
        for r in receivers:
            r.connect()
            r.start()
        assert all(checksum(w) == checksum(model) for w in workers)  # version 0, streamed
        for version in (1, 2, 3):
            _bump(model)
            sender.send()
            for r, w in zip(receivers, workers, strict=True):
                assert r.version == version and checksum(w) == checksum(model)
                assert not r.torn
        totals = sender.status()["totals"]
        count = -(-sum(t.nbytes for t in model.values()) // CHUNK)
        assert totals["chunks_sent"] >= 3 * count
        assert all(r.stats["chunks"] >= 3 * count for r in receivers)
        assert all(r.stats["broken_streams"] == 0 for r in receivers)
    finally:
        for r in receivers:
            r.close()
        sender.close()


@pytest.mark.parametrize("kind", ["memory", "ipc", "tcp"])
def test_without_a_snapshot_the_sender_streams_through_a_small_ring(kind: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``retain_snapshot=False``: nothing model-sized is made; chunks go through a few
    chunk-sized buffers (or, over ipc, blocks the hub lends and workers release)."""
    from zmqsync.sender import WINDOW

    model = _model(0)
    hub, spoke = _pair(kind, tmp_path, "ring")
    sender = WeightSender(
        hub,
        model=model,
        strategy="state_dict",
        num_workers=2,
        timeout=10,
        chunk_bytes=CHUNK,
        retain_snapshot=False,
    )
    workers = [_model(10 + i) for i in range(2)]
    receivers = [
        WeightReceiver(
            spoke(i), model=w, strategy="state_dict", worker_idx=i, apply_mode="in_place"
        )
        for i, w in enumerate(workers)
    ]
    try:
        for r in receivers:
            r.connect()
            r.start()
        for version in (1, 2, 3):
            _bump(model)
            sender.send()
            assert sender.snapshot is None
            for r, w in zip(receivers, workers, strict=True):
                assert r.version == version and checksum(w) == checksum(model)
        model_bytes = sum(t.nbytes for t in model.values())
        assert model_bytes > 16 * CHUNK
        assert sender._versions.ring.nbytes <= (WINDOW + 2) * CHUNK
        if kind == "ipc":
            assert sender._versions.ring.nbytes == 0  # the hub's blocks are the ring
            assert 0 < hub.counters()["shm_bytes"] <= 4 * CHUNK + 4096
    finally:
        for r in receivers:
            r.close()
        sender.close()


@pytest.mark.parametrize("mode", ["in_place", "staged"])
def test_forward_passes_never_see_two_versions(mode: str) -> None:
    """Every tensor moves by 1 per version; a forward pass under the lock must see all
    of them at the same version, whichever way chunks are applied."""
    model = _model(0)
    hub = MemoryHub()
    sender = WeightSender(
        hub, model=model, strategy="state_dict", num_workers=1, timeout=10, chunk_bytes=CHUNK
    )
    worker = _model(1)
    receiver = WeightReceiver(
        MemorySpoke(hub.endpoint), model=worker, strategy="state_dict", apply_mode=mode
    )
    floats = [k for k, t in model.items() if t.dtype.is_floating_point]
    seen: list[set[float]] = []
    stop = threading.Event()

    def forward() -> None:
        while not stop.is_set():
            with receiver.lock:
                seen.append({round(float(worker[k].flatten()[0] - base[k]), 3) for k in floats})

    try:
        receiver.connect()
        receiver.start()
        base = {k: float(model[k].flatten()[0]) for k in floats}
        thread = threading.Thread(target=forward, daemon=True)
        thread.start()
        for _ in range(15):
            _bump(model)
            sender.send()
    finally:
        stop.set()
        receiver.close()
        sender.close()
    thread.join(5)
    assert seen and all(len(s) == 1 for s in seen), "a forward pass saw a mix of versions"
    assert len({next(iter(s)) for s in seen}) > 1, "the forward passes saw only one version"


@pytest.fixture
def fed() -> Iterator[tuple[MemoryHub, WeightReceiver, dict[str, torch.Tensor]]]:
    """A receiver fed chunk messages by hand (no sender): streams can be cut anywhere."""
    hub = MemoryHub()
    worker = _model(1)
    receiver = WeightReceiver(
        MemorySpoke(hub.endpoint),
        model=worker,
        strategy="state_dict",
        apply_mode="in_place",
        chunk_timeout=0.3,
        timeout=0.2,
    )
    yield hub, receiver, worker
    receiver.close()
    hub.close()


def _deliver(hub: MemoryHub, receiver: WeightReceiver, messages) -> None:  # type: ignore[no-untyped-def]
    """Queue ``messages`` for the receiver, then let it handle them all (a poll handles
    what queued up and never waits for more)."""
    for frames in messages:
        hub.send_frames(frames)
    receiver.poll()


def _gap_passes(receiver: WeightReceiver) -> None:
    """No chunk for longer than the receiver's chunk_timeout; its next poll sees it."""
    assert receiver.lock.writing  # mid-version: forward passes wait meanwhile
    deadline = time.monotonic() + 10
    while not receiver.torn:  # each poll checks the gap; none waits
        assert time.monotonic() < deadline, "the broken stream was never noticed"
        receiver.poll()
        time.sleep(0.02)


def test_a_broken_in_place_stream_tears_the_model_until_a_whole_version_repairs_it(
    fed: tuple[MemoryHub, WeightReceiver, dict[str, torch.Tensor]],
) -> None:
    hub, receiver, worker = fed
    v1 = _model(5)
    _deliver(hub, receiver, version_messages(v1, version=1, epoch=7, chunk_bytes=CHUNK))
    assert receiver.version == 1 and checksum(worker) == checksum(v1) and not receiver.torn

    v2 = _model(6)
    messages = version_messages(v2, version=2, epoch=7, chunk_bytes=CHUNK)
    _deliver(hub, receiver, messages[:5])  # the sender dies after chunk 4
    _gap_passes(receiver)
    assert receiver.torn and receiver.version == 1
    assert receiver.stats["torn"] == 1 and receiver.stats["broken_streams"] == 1
    with pytest.raises(TornWeights, match="torn") as caught, receiver.lock:
        pass
    assert caught.value.version == 2 and "no chunk" in caught.value.reason
    # A forward pass waiting when the repair arrives goes on once it is whole.
    entered = threading.Event()

    def forward() -> None:
        receiver.lock.acquire(timeout=10)
        entered.set()
        receiver.lock.release()

    waiter = threading.Thread(target=forward, daemon=True)
    waiter.start()
    assert not entered.wait(0.05)  # it waits: the model is still torn
    _deliver(hub, receiver, messages)  # the repair: version 2 again, whole
    waiter.join(5)
    assert entered.is_set()
    assert not receiver.torn and receiver.version == 2 and checksum(worker) == checksum(v2)


def test_a_receiver_slow_to_apply_queued_chunks_does_not_break_their_stream(
    fed: tuple[MemoryHub, WeightReceiver, dict[str, torch.Tensor]],
) -> None:
    """The gap between two chunks is the stream's, not the receiver's own time: chunks
    that queued up while it applied the previous one (each taking longer than its
    chunk_timeout here, as on a loaded machine) came in time."""
    hub, receiver, _ = fed

    class Slow(ReceiverObserver):
        def chunk_arrived(self, chunk: Chunk) -> None:
            time.sleep(0.45)  # the fixture's chunk_timeout is 0.3 s

    receiver.add_observer(Slow())
    v1 = _model(5)
    messages = version_messages(v1, version=1, epoch=7, chunk_bytes=CHUNK)[:4]
    assert len(messages) == 4 and not decode(messages[-1]).last
    _deliver(hub, receiver, messages)
    assert receiver.stats["broken_streams"] == 0 and not receiver.torn
    assert receiver.lock.writing  # the version goes on: nothing queued, its gap not up
    _gap_passes(receiver)  # and a real gap still breaks it
    assert receiver.torn and receiver.stats["broken_streams"] == 1


def test_a_receiver_busy_with_queued_chunks_still_heartbeats() -> None:
    """A long version whose chunks queue up faster than the worker applies them: its
    heartbeats go on meanwhile (the sender, which goes by them, must not take it for
    a stopped worker, nor expire its session on a huge version)."""
    model = _model(0)
    hub = MemoryHub()
    sender = WeightSender(
        hub,
        model=model,
        strategy="state_dict",
        num_workers=1,
        timeout=60,
        chunk_bytes=CHUNK,
        heartbeat=0.2,
    )
    receiver = WeightReceiver(MemorySpoke(hub.endpoint), model=_model(1), strategy="state_dict")

    class Slow(ReceiverObserver):
        def chunk_arrived(self, chunk: Chunk) -> None:
            time.sleep(0.1)  # ~20 chunks: 2 s a version, ten heartbeats

    silences: list[float] = []
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.05):
            (row,) = sender.status()["workers"]
            silences.append(row["since_last_seen_s"])

    try:
        receiver.connect(timeout=30)
        receiver.add_observer(Slow())
        receiver.start()
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        _bump(model)
        sender.send()
        done.set()
        watcher.join(10)
        assert checksum(receiver.model) == checksum(model)
        assert len(silences) >= 10
        assert max(silences) < 1.5, f"silent for {max(silences):.2f}s while applying"
    finally:
        done.set()
        receiver.close()
        sender.close()


def test_a_broken_staged_stream_leaves_the_model_untouched(
    fed: tuple[MemoryHub, WeightReceiver, dict[str, torch.Tensor]],
) -> None:
    hub, receiver, worker = fed
    receiver.apply_mode = "staged"
    before = checksum(worker)
    messages = version_messages(_model(6), version=1, epoch=7, chunk_bytes=CHUNK)
    _deliver(hub, receiver, [*messages[:5], *messages[6:]])  # chunk 5 lost
    assert receiver.stats["broken_streams"] == 1 and not receiver.torn
    assert receiver.version == 0 and checksum(worker) == before
    with receiver.lock:  # nothing torn: forward passes go on with the old weights
        pass


def test_a_new_version_repairs_a_torn_model_and_no_ack_names_the_torn_one() -> None:
    """A learner that dies mid-version and restarts (a new epoch): the in-place worker is
    torn in between, never acks the broken version, and follows the new learner."""
    model = _model(0)
    hub = MemoryHub()
    sender = WeightSender(
        hub, model=model, strategy="state_dict", num_workers=1, timeout=5, chunk_bytes=CHUNK
    )
    worker = _model(1)
    receiver = WeightReceiver(
        MemorySpoke(hub.endpoint),
        model=worker,
        strategy="state_dict",
        apply_mode="in_place",
        chunk_timeout=0.3,
        timeout=0.2,
    )
    acks: list[int] = []
    try:
        receiver.connect(timeout=30)  # its own timeout (0.2 s) is for forward passes
        assert checksum(worker) == checksum(model)
        # The learner streams half of version 1 and dies.
        copy = sender._versions.copy_of(None, 1, model=sender.model)
        with sender._holding_baton():
            for i in range(copy.count // 2):
                frames, _ = copy.frames(i)
                hub.send_frames(frames)
                del frames
        receiver.poll()
        _gap_passes(receiver)
        assert receiver.torn and receiver.version == 0
        with pytest.raises(TornWeights), receiver.lock:
            pass
        epoch = sender.epoch
        sender.close()
        # The restarted learner (same endpoint, new epoch) sends its version 1.
        hub = MemoryHub(hub.endpoint)
        restarted = WeightSender(
            hub, model=model, strategy="state_dict", num_workers=1, timeout=5, chunk_bytes=CHUNK
        )
        assert restarted.epoch != epoch
        receiver.on_applied.append(lambda e, v: acks.append(v))
        receiver.start()
        _bump(model)
        restarted.send()
        assert receiver.epoch == restarted.epoch and receiver.version == 1
        assert not receiver.torn and checksum(worker) == checksum(model)
        with receiver.lock:
            pass
        assert acks[-1] == 1
        restarted.close()
    finally:
        receiver.close()
        sender.close()


def test_the_learner_sees_a_torn_worker_until_a_whole_version_repairs_it() -> None:
    """A torn worker says so in its heartbeats: ``status()`` marks it and ``zmqsync
    status`` names the problem, until a whole version is acked."""
    from _faults import until

    from zmqsync.tools.client import assess

    model = _model(0)
    hub = MemoryHub()
    sender = WeightSender(
        hub, strategy="state_dict", num_workers=1, timeout=5, chunk_bytes=CHUNK, heartbeat=0.1
    )
    worker = _model(1)
    receiver = WeightReceiver(
        MemorySpoke(hub.endpoint),
        model=worker,
        strategy="state_dict",
        apply_mode="in_place",
        chunk_timeout=0.3,
        timeout=0.2,
    )
    try:
        receiver.connect()  # nothing published: it keeps its own weights
        copy = sender._versions.copy_of(model, 1, model=sender.model)
        with sender._holding_baton():
            for i in range(3):  # three chunks of version 1, and the learner "dies"
                frames, _ = copy.frames(i)
                hub.send_frames(frames)
                del frames
        receiver.start()
        until(lambda: receiver.torn, 5, "the worker tore")

        def row() -> dict:  # type: ignore[type-arg]
            return sender.status()["workers"][0]  # type: ignore[no-any-return]

        until(lambda: row()["torn"], 5, "the learner heard that the worker is torn")
        assert "is torn" in assess(sender.status())[0]
        sender.send(model)
        assert receiver.version == 1 and checksum(worker) == checksum(model)
        assert not receiver.torn and not row()["torn"] and not assess(sender.status())
    finally:
        receiver.close()
        sender.close()


def test_a_scheme_passes_the_apply_mode_and_chunk_size_on(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``chunk_bytes`` is a scheme option (the sender's); ``apply_mode`` and
    ``chunk_timeout`` are chosen per worker in ``init_on_receiver``."""
    from zmqsync import ZMQWeightSyncScheme

    model = _model(0)
    learner = ZMQWeightSyncScheme(
        "state_dict", endpoint=f"ipc://{tmp_path}/scheme", timeout=10, chunk_bytes=CHUNK
    )
    learner.init_on_sender("policy", model=model, num_workers=1)
    worker = ZMQWeightSyncScheme("state_dict", endpoint=learner.endpoint, timeout=10)
    refused = ZMQWeightSyncScheme("state_dict", endpoint=learner.endpoint, timeout=10)
    local = _model(1)
    try:
        with pytest.raises(ValueError, match="apply_mode"):
            refused.init_on_receiver(model_id="policy", model=_model(2), apply_mode="sideways")
        worker.init_on_receiver(model_id="policy", model=local, worker_idx=0, apply_mode="staged")
        receiver = worker.get_receiver()
        assert receiver.apply_mode == "staged"
        worker.connect(worker_idx=0)
        receiver.start()
        _bump(model)
        learner.send()
        assert checksum(local) == checksum(model)
        assert learner.get_sender().chunk_bytes == CHUNK
        assert receiver.stats["chunks"] > 16
    finally:
        refused.shutdown()
        worker.shutdown()
        learner.shutdown()


def test_a_ring_buffer_is_no_larger_than_the_chunks_it_carries() -> None:
    """A model smaller than one chunk streams through buffers of its own size, not
    chunk-sized ones; a buffer is reused once nothing views it, and grown when a larger
    stream needs it."""
    import weakref

    from zmqsync.sender.transfers import RING_SLOTS, Ring

    ring = Ring(chunk_bytes=8 << 20)
    small = ring.take(1000)
    assert small is not None and small.nbytes == 1000
    assert ring.nbytes == 1000
    ring.hold(small, [weakref.ref(small)])
    again = ring.take(1000)  # the first is still viewed: a second buffer
    assert again is not None and ring.nbytes == 2000
    del small
    reused = ring.take(800)  # the first is free again: reused, not a third
    assert reused is not None and reused.nbytes == 800 and ring.nbytes == 2000
    del again, reused
    bigger = ring.take(5000)  # a free buffer too small for it is replaced
    assert bigger is not None and bigger.nbytes == 5000
    assert ring.nbytes == 5000 + 1000
    held = []
    while (buffer := ring.take(100)) is not None:
        ring.hold(buffer, [weakref.ref(buffer)])
        held.append(buffer)
    assert len(held) == RING_SLOTS  # bounded: every slot viewed, nothing more is made


@pytest.mark.parametrize("kind", ["ipc", "tcp"])
def test_without_a_snapshot_version_0_changed_in_place_is_never_sent(kind: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``retain_snapshot=False``: version 0 is the weights as of publish(), read again
    as a worker is served and checked chunk by chunk. Changed in place since, it is
    not sent: a worker that connects waits (never returning with its own weights, nor a
    mix) and gets the first send's version; publish() makes the changed weights
    version 0 for the workers that connect after it."""
    model = _model(0)
    hub, spoke = _pair(kind, tmp_path, "changed")
    sender = WeightSender(
        hub,
        model=model,
        strategy="state_dict",
        num_workers=None,
        timeout=10,
        chunk_bytes=CHUNK,
        retain_snapshot=False,
    )
    receivers: list[WeightReceiver] = []
    try:
        _bump(model)  # in place, after it was published
        own = _model(10)
        first = WeightReceiver(spoke(0), model=own, strategy="state_dict", worker_idx=0)
        receivers.append(first)
        errors: list[BaseException] = []

        def connect() -> None:
            try:
                first.connect(timeout=30)
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        joining = threading.Thread(target=connect)
        joining.start()
        until(lambda: sender.published_changed, 20, "the change was found")
        assert joining.is_alive()  # it waits for a version it can hold whole
        assert first.version == 0 and checksum(own) == checksum(_model(10))
        sender.send()
        joining.join(30)
        assert not joining.is_alive() and not errors
        assert first.version == 1 and checksum(own) == checksum(model)
        # Before a send, publish() after the change: a late worker holds it.
        sender2_model = _model(1)
        hub2, spoke2 = _pair(kind, tmp_path, "republished")
        sender2 = WeightSender(
            hub2,
            model=sender2_model,
            strategy="state_dict",
            num_workers=None,
            timeout=10,
            chunk_bytes=CHUNK,
            retain_snapshot=False,
        )
        try:
            _bump(sender2_model)
            sender2.publish()
            late = WeightReceiver(spoke2(1), model=_model(11), strategy="state_dict")
            receivers.append(late)
            late.connect(timeout=30)
            assert late.version == 0 and checksum(late.model) == checksum(sender2_model)
            assert not sender2.published_changed
        finally:
            sender2.close()
    finally:
        for r in receivers:
            r.close()
        sender.close()
