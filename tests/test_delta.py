"""``delta=True``: a version moves only the blocks that changed since what each worker
holds, and a worker that cannot apply a delta gets the whole version, never a wrong one.

Every case checks each worker's checksum against the learner's, and the bytes moved
against the sender's own counters.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch
from _faults import stop, until
from conftest import Fleet

from zmqsync import WeightReceiver, WeightSender, ZMQWeightSyncScheme, checksum
from zmqsync.chunking.delta import DeltaTracker
from zmqsync.chunking.layout import StreamLayout
from zmqsync.errors import FrameError
from zmqsync.fleet import Fleet as FleetCore
from zmqsync.fleet import Origin, SendLatest
from zmqsync.protocol import Chunk, Hello, SnapshotRequest, UpToDate, decode, encode
from zmqsync.protocol.stream import Apply, Broken, ChunkStream, Ignored, Start
from zmqsync.tensors.flatten import Flattener
from zmqsync.transport.memory import MemoryHub, MemorySpoke
from zmqsync.transport.zmq_pubsub import PubSubHub, PubSubSpoke
from zmqsync.transport.zmq_router import RouterHub, RouterSpoke

MIB = 1 << 20
CHUNK = 256 * 1024


def _model() -> dict[str, torch.Tensor]:
    """16 tensors of 1 MiB each (and a few small ones between them)."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for i in range(16):
        out[f"layer{i}.weight"] = torch.randn(MIB // 4, generator=g)
        out[f"layer{i}.bias"] = torch.randn(16, generator=g)
    return out


def _hub(kind: str):  # type: ignore[no-untyped-def]
    if kind == "pubsub":
        hub = PubSubHub("tcp://127.0.0.1:*")
        return hub, lambda i: PubSubSpoke(hub.endpoint, identity=f"w{i}")
    hub = RouterHub("tcp://127.0.0.1:*")
    return hub, lambda i: RouterSpoke(hub.endpoint, identity=f"w{i}")


def _bytes(sender: WeightSender) -> int:
    return int(sender.status()["totals"]["bytes_sent"])


# --- what travels --------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["pubsub", "router"])
def test_one_tensor_of_16_changed_moves_a_sixteenth_and_every_worker_is_exact(kind: str) -> None:
    model = _model()
    hub, spoke = _hub(kind)
    sender = WeightSender(
        hub, model=model, strategy="state_dict", num_workers=3, delta=True, timeout=30
    )
    # In place, staged into a model, and with no model at all (receive() returns copies).
    targets = [{k: torch.zeros_like(v) for k, v in model.items()} for _ in range(2)]
    receivers = [
        WeightReceiver(
            spoke(0), model=targets[0], strategy="state_dict", worker_idx=0, apply_mode="in_place"
        ),
        WeightReceiver(
            spoke(1), model=targets[1], strategy="state_dict", worker_idx=1, apply_mode="staged"
        ),
        WeightReceiver(spoke(2), strategy="state_dict", worker_idx=2),
    ]
    try:
        for r in receivers:
            r.connect(timeout=30)
            r.start()

        def held() -> list[str]:
            return [checksum(targets[0]), checksum(targets[1]), checksum(receivers[2].weights)]

        sender.send()  # whatever each worker's record said when it joined: now all hold v1
        full = model["layer0.weight"].numel() * 4 * 16
        for step in range(2, 6):
            with torch.no_grad():
                model[f"layer{step}.weight"].mul_(-1.5)  # 1 of 16 big tensors changes
            before = _bytes(sender)
            sender.send()
            moved = _bytes(sender) - before
            status = sender.status()["delta"]
            assert status["version"] == step and status["whole_to"] == 0, status
            assert sum(b["workers"] for b in status["bases"]) == 3
            # A sixteenth of the model per worker, give or take the blocks at its edges.
            assert full / 16 * 3 <= moved <= (full / 16 + 2 * MIB) * 3, moved
            assert held() == [checksum(model)] * 3
        assert all(r.stats["deltas"] >= 4 for r in receivers)
        assert sender.status()["totals"]["deltas_sent"] >= 4
    finally:
        for r in receivers:
            r.close()
        sender.close()


@pytest.mark.timeout(60)
def test_nothing_changed_is_one_empty_chunk_and_a_new_version() -> None:
    model = _model()
    hub, spoke = _hub("router")
    sender = WeightSender(hub, model=model, strategy="state_dict", delta=True, timeout=30)
    target = {k: torch.zeros_like(v) for k, v in model.items()}
    receiver = WeightReceiver(spoke(0), model=target, strategy="state_dict", worker_idx=0)
    try:
        receiver.connect(timeout=30)
        receiver.start()
        sender.send(metadata={"step": 1})
        before = _bytes(sender)
        sender.send(metadata={"step": 2})
        assert _bytes(sender) == before  # no byte of weights moved
        until(lambda: receiver.metadata == {"step": 2}, 10, "the metadata came with it")
        assert receiver.version == 2 and checksum(target) == checksum(model)
    finally:
        receiver.close()
        sender.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16])
def test_a_delta_with_wire_dtype_lands_exactly_as_cast_back(wire: torch.dtype) -> None:
    model = _model()
    model["ints"] = torch.arange(5000)
    hub, spoke = _hub("router")
    sender = WeightSender(
        hub, model=model, strategy="state_dict", delta=True, wire_dtype=wire, chunk_bytes=CHUNK
    )
    target = {k: torch.zeros_like(v) for k, v in model.items()}
    receiver = WeightReceiver(spoke(0), model=target, strategy="state_dict", worker_idx=0)
    try:
        receiver.connect(timeout=30)
        receiver.start()
        for step in range(1, 4):
            with torch.no_grad():
                model[f"layer{step}.weight"][1000:3000].add_(0.37)
                model["ints"][step] += 7
            before = _bytes(sender)
            sender.send()
            if step > 1:  # the digest is of the wire bytes: a few blocks, at half size
                assert _bytes(sender) - before <= 3 * CHUNK
        for k, v in model.items():
            expected = v.to(wire).to(v.dtype) if v.is_floating_point() else v
            assert torch.equal(target[k], expected), k
        assert receiver.stats["deltas"] >= 2
    finally:
        receiver.close()
        sender.close()


@pytest.mark.timeout(60)
def test_a_sink_is_given_only_the_tensors_a_delta_touches() -> None:
    model = _model()
    hub, spoke = _hub("router")
    sender = WeightSender(hub, model=model, strategy="state_dict", delta=True)
    engine: dict[str, torch.Tensor] = {}
    calls: list[list[str]] = []

    def load_weights(weights: list[tuple[str, torch.Tensor]]) -> None:
        calls.append([name for name, _ in weights])
        for name, tensor in weights:
            engine[name] = tensor.clone()

    receiver = WeightReceiver(spoke(0), sink=load_weights, strategy="state_dict", worker_idx=0)
    try:
        receiver.connect(timeout=30)
        receiver.start()
        sender.send()
        calls.clear()
        with torch.no_grad():
            model["layer7.weight"].add_(1)
        sender.send()
        given = [name for call in calls for name in call]
        assert "layer7.weight" in given and len(given) <= 3, given  # and its neighbours
        assert receiver.stats["deltas"] >= 1
        for name, tensor in model.items():
            assert torch.equal(engine[name], tensor), name
    finally:
        receiver.close()
        sender.close()


# --- who cannot apply a delta gets the whole version ----------------------------------


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["pubsub", "router"])
def test_a_worker_left_behind_or_restarted_ends_exact(kind: str) -> None:
    model = _model()
    hub, spoke = _hub(kind)
    sender = WeightSender(
        hub,
        model=model,
        strategy="state_dict",
        num_workers=2,
        delta=True,
        timeout=30,
        chunk_bytes=CHUNK,
    )
    targets = [{k: torch.zeros_like(v) for k, v in model.items()} for _ in range(2)]
    receivers = [
        WeightReceiver(spoke(i), model=targets[i], strategy="state_dict", worker_idx=i)
        for i in range(2)
    ]
    try:
        for r in receivers:
            r.connect(timeout=30)
            r.start()
        sender.send()
        # Worker 1 misses versions 2 and 3 (sends meant for worker 0 alone).
        for step in (2, 3):
            with torch.no_grad():
                model[f"layer{step}.weight"].add_(1)
            sender.send(worker_ids=[0])
        assert receivers[1].version == 1
        with torch.no_grad():
            model["layer9.weight"].add_(1)
        sender.send()
        bases = {b["base"]: b["workers"] for b in sender.status()["delta"]["bases"]}
        # One delta against the oldest version over PUB/SUB; one per worker otherwise.
        assert bases == ({1: 2} if kind == "pubsub" else {1: 1, 3: 1}), bases
        assert [checksum(t) for t in targets] == [checksum(model)] * 2
        # Worker 1 restarts: it holds nothing, so the next version is whole to it.
        receivers[1].close()
        targets[1] = {k: torch.zeros_like(v) for k, v in model.items()}
        receivers[1] = WeightReceiver(
            spoke(1), model=targets[1], strategy="state_dict", worker_idx=1
        )
        receivers[1].connect(timeout=30)
        receivers[1].start()
        assert checksum(targets[1]) == checksum(model)  # connect() brought the snapshot
        with torch.no_grad():
            model["layer10.weight"].add_(1)
        sender.send()
        assert [checksum(t) for t in targets] == [checksum(model)] * 2
    finally:
        for r in receivers:
            r.close()
        sender.close()


@pytest.mark.timeout(60)
def test_a_delta_against_a_version_the_worker_lacks_is_skipped_and_asked_for_whole() -> None:
    model = {"w": torch.arange(64 * 1024, dtype=torch.float32), "b": torch.ones(10)}
    hub = MemoryHub()
    sender = WeightSender(hub, model=model, strategy="state_dict", delta=True, chunk_bytes=CHUNK)
    target = {k: torch.zeros_like(v) for k, v in model.items()}
    receiver = WeightReceiver(
        MemorySpoke(hub.endpoint), model=target, strategy="state_dict", worker_idx=0
    )
    try:
        receiver.connect(timeout=30)
        receiver.start()
        with torch.no_grad():
            model["w"].add_(1)
        sender.send()
        assert receiver.version == 1 and checksum(target) == checksum(model)
        # Version 3 as a delta against 2, which this worker never had (a forgery, or a
        # fan-out it was not counted in): applying it would make a wrong version.
        layout = sender._versions.layout
        assert layout is not None
        poisoned = Chunk(
            "policy", 3, sender.epoch, 0, 1, 0, layout.total, layout.layout, b"\xff" * 1024, base=2
        )
        peer = sender.fleet.workers[0].origin.peer
        with sender._runners[0].holding():
            hub.send_frames(encode(poisoned, schema_bytes=layout.schema_bytes), to=[peer])
        until(lambda: receiver.stats["deltas_skipped"] == 1, 10, "the delta was skipped")
        until(lambda: sender.fleet.workers[0].asked_whole == 1, 10, "it asked for the whole")
        assert receiver.version == 1 and checksum(target) == checksum(model)  # untouched
        assert not receiver.torn
    finally:
        receiver.close()
        sender.close()


def test_the_fleet_answers_a_request_for_the_whole_version_at_once_and_once() -> None:
    fleet = FleetCore("policy", 5, mode="memory", strategy="state_dict", transports=["memory"])
    origin = Origin(0, b"peer")
    _admit, welcome = fleet.handle(Hello("policy", 0, 0, 3), origin, 0.0, {})
    secret = welcome.message.session
    fleet.published = True
    fleet.begin_send(None, 0.0, 10.0)  # version 1: sent to worker 3 just now
    ask = SnapshotRequest("policy", 0, 5, 3, secret)
    (plain,) = fleet.handle(ask, origin, 0.1, {})
    assert isinstance(plain, type(welcome)) and isinstance(plain.message, UpToDate)
    assert plain.message.in_flight  # within repair_after: on its way
    whole = SnapshotRequest("policy", 0, 5, 3, secret, whole=True)
    (first,) = fleet.handle(whole, origin, 0.2, {})
    assert isinstance(first, SendLatest)  # a delta it could not apply: now
    (again,) = fleet.handle(whole, origin, 0.3, {})
    assert not isinstance(again, SendLatest)  # once per version: no flood of whole sends


# --- under faults, with real worker processes ------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", ["sigstop", "sigkill"])
@pytest.mark.parametrize("mode", ["pubsub", "router"])
def test_worker_processes_under_faults_apply_only_whole_versions(
    fault: str, mode: str, fleet: Fleet
) -> None:
    from _workers import make_model

    model = make_model("big", seed=0)
    scheme = ZMQWeightSyncScheme(
        "state_dict",
        mode=mode,
        endpoint="tcp://127.0.0.1:*",
        timeout=2.0,
        heartbeat=0.5,
        delta=True,
        chunk_bytes=CHUNK,
    )
    scheme.init_on_sender("policy", model=model, num_workers=2)
    sender = scheme.get_sender()
    sent = {0: checksum(model)}

    def send() -> bool:
        with torch.no_grad():  # a step that changes a part of the model
            model[1].weight.add_(torch.randn_like(model[1].weight))
            model[0].weight[: 64 + sender.version % 64].add_(1.0)
        try:
            scheme.send()
            return True
        except TimeoutError:
            return False
        finally:
            sent[sender.version] = checksum(model)

    try:
        for i in range(2):
            fleet.start(scheme, i, kind="big")
        for i in range(2):
            fleet.wait_ready(i)
        assert send()
        if fault == "sigstop":
            stop(fleet.procs[1].pid)  # type: ignore[arg-type]
            try:
                send()
                send()
            finally:
                os.kill(fleet.procs[1].pid, signal.SIGCONT)  # type: ignore[arg-type]
        else:
            fleet.kill(1)
            send()
            fleet.start(scheme, 1, kind="big")
            fleet.wait_ready(1)
        deadline = time.monotonic() + 60
        while not send():
            assert time.monotonic() < deadline, "the workers never converged"
        assert sender.status()["totals"]["deltas_sent"] >= 2
        for i in range(2):
            applied = fleet.ask(i, "applied")
            versions = [v for _, v, _ in applied]
            assert versions == sorted(set(versions)), f"worker {i} went backwards"
            for _, version, digest in applied:
                assert digest == sent[version], f"worker {i} applied a wrong version {version}"
            assert versions[-1] == sender.version
    finally:
        scheme.shutdown()


# --- the wire and the tracker ---------------------------------------------------------


def _delta_chunk(**kw):  # type: ignore[no-untyped-def]
    fields = dict(
        model_id="m",
        version=5,
        epoch=1,
        index=0,
        count=2,
        offset=4096,
        total=1 << 20,
        layout=bytes(16),
        payload=b"x" * 100,
        base=3,
    )
    fields.update(kw)
    return Chunk(**fields)  # type: ignore[arg-type]


def test_delta_chunks_round_trip_and_forged_ones_are_refused() -> None:
    layout = StreamLayout(Flattener("state_dict").flatten({"w": torch.zeros(1 << 18)}), CHUNK)
    first = _delta_chunk(layout=layout.layout, total=layout.total, metadata={"step": 5})
    got = decode(encode(first, schema_bytes=layout.schema_bytes))
    assert isinstance(got, Chunk)
    assert (got.base, got.offset, got.metadata) == (3, 4096, {"step": 5})
    second = _delta_chunk(index=1, offset=900_000, layout=layout.layout, total=layout.total)
    got = decode(encode(second))
    assert isinstance(got, Chunk) and got.base == 3 and got.last
    with pytest.raises(ValueError, match="against"):
        encode(_delta_chunk(index=1, base=5))
    # A base at or after its own version, and a delta flag with no base, are forged.
    frames = encode(_delta_chunk(index=1, base=4))
    body = bytearray(frames[1])
    body[-8:] = (9).to_bytes(8, "big")
    with pytest.raises(FrameError, match="against"):
        decode([frames[0], bytes(body), frames[2]])
    with pytest.raises(FrameError, match="no base"):
        decode([frames[0], bytes(body[:-8]), frames[2]])


def test_a_delta_stream_takes_stretches_in_order_and_breaks_on_anything_else() -> None:
    stream = ChunkStream(gap=10)
    first = _delta_chunk(schema=object(), count=3)
    events = stream.feed(first, 0.0)
    assert [type(e) for e in events] == [Start, Apply]
    assert [type(e) for e in stream.feed(_delta_chunk(index=1, count=3, offset=9000), 0.1)] == [
        Apply
    ]
    # Going back, or changing base mid-stream, breaks the delta.
    events = stream.feed(_delta_chunk(index=2, count=3, offset=5000), 0.2)
    assert [type(e) for e in events] == [Broken, Ignored]
    stream.feed(_delta_chunk(schema=object(), count=3), 1.0)
    events = stream.feed(_delta_chunk(index=1, count=3, offset=9000, base=2), 1.1)
    assert [type(e) for e in events] == [Broken, Ignored]


def test_the_tracker_marks_changed_blocks_and_cuts_stretches() -> None:
    flat = Flattener("state_dict").flatten({"w": torch.zeros(1 << 20)})  # 4 MiB
    layout = StreamLayout(flat, MIB)
    tracker = DeltaTracker(layout, block=256 * 1024)
    data = np.zeros(layout.total, dtype=np.uint8)
    view = memoryview(data)

    def read(lo: int, hi: int) -> list[memoryview]:
        return [view[lo:hi]]

    assert tracker.record(1, read) == 16  # all new
    assert tracker.spans(1, MIB) == [(0, 0)]  # nothing changed since 1
    assert tracker.spans(0, MIB) is None  # before anything recorded: unknown
    data[300_000] = 1  # block 1
    data[2 * MIB : 2 * MIB + 5] = 1  # block 8
    data[2 * MIB + 256 * 1024] = 1  # block 9: one run with 8
    assert tracker.record(2, read) == 3
    assert tracker.spans(1, MIB) == [(256 * 1024, 256 * 1024), (2 * MIB, 512 * 1024)]
    assert tracker.chunks_changed(2) == [0, 2]  # the 1 MiB chunks that hold them
    assert tracker.spans(1, 300 * 1024) == [
        (256 * 1024, 256 * 1024),
        (2 * MIB, 300 * 1024),
        (2 * MIB + 300 * 1024, 212 * 1024),
    ]
    data[:] = 7  # everything: a delta would be the whole version
    tracker.record(3, read)
    assert tracker.spans(2, MIB) is None
    with pytest.raises(ValueError):
        tracker.record(2, read)
    # The same version again (weights published twice as version 0): no delta is known
    # against it, since workers may hold either.
    data[:] = 8
    tracker.record(3, read)
    assert tracker.spans(3, MIB) is None


def test_delta_needs_the_snapshot() -> None:
    for bad in ({"retain_snapshot": False}, {"share_params": True}):
        with pytest.raises(ValueError, match="retain_snapshot"):
            WeightSender(MemoryHub(), delta=True, **bad)  # type: ignore[arg-type]
