"""Workers that hold a slice of each tensor (tensor-parallel inference workers) of a
sharded learner: the slices they declare, strictly decoded; each rank's part cut to
them and nothing else sent; the slices gathered whole at the worker; and an FSDP2
learner over gloo serving a sliced worker."""

from __future__ import annotations

import itertools
import json
import threading
from typing import Any

import numpy as np
import pytest
from _faults import until
from _sharded_fixtures import (
    Processes,
    answer,
    answers,
    ask,
    close_all,
    collective,
    ipc_endpoints,
    rank_senders,
    send_all,
    sends,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from zmqsync.chunking.layout import StreamLayout
from zmqsync.chunking.parts import PartGather, Whole
from zmqsync.chunking.slices import Rebaser, cut, meet, rebase
from zmqsync.errors import FrameError
from zmqsync.protocol import (
    MAX_SLICES,
    Box,
    Chunk,
    ErrorMessage,
    Hello,
    Kind,
    Slice,
    TensorEntry,
    WeightsSchema,
    decode,
    encode,
    peek_kind,
)
from zmqsync.transport.memory import MemoryHub, MemorySpoke

# --- the declaration on the wire --------------------------------------------------------


def _hello(slices: tuple[Slice, ...] = ()) -> Hello:
    return Hello("p", 0, 0, 3, 1, "h", "a", slices)


@pytest.mark.timeout(30)
def test_a_hello_carries_its_slices_and_a_plain_one_is_unchanged() -> None:
    plain = encode(_hello())
    assert b"slices" not in bytes(plain[1])  # the bytes of a worker that holds no slice
    sliced = _hello((Slice(("qkv",), (8, 6), (4, 0), (4, 6)), Slice(("b",), (8,), (0,), (4,))))
    assert decode(encode(sliced)) == sliced


def _with_slices(raw: Any) -> list[Any]:
    """A Hello's frames whose slices are ``raw``, as a hostile worker may write them."""
    head, body = encode(_hello((Slice(("w",), (2,), (0,), (1,)),)))
    doc = json.loads(bytes(body))
    doc["slices"] = raw
    return [head, json.dumps(doc).encode()]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "raw",
    [
        [[["w"], [4, 6], [3, 0], [2, 6]]],  # past the end of dim 0
        [[["w"], [4, 6], [-1, 0], [2, 6]]],
        [[["w"], [4, 6], [0, 0], [2]]],  # another rank
        [[["w"], [4, 6], [0, 0]]],
        [[["w"], [4, 6], [0, 0.5], [2, 6]]],
        [[["w"], [4, True], [0, 0], [2, 1]]],
        [[["w"], [1 << 41, 6], [0, 0], [1, 6]]],  # a global tensor no one may hold
        [[[], [4], [0], [2]]],
        [[["w", 3], [4], [0], [2]]],
        [[["w"], [4], [0], [2]], [["w"], [4], [2], [2]]],  # one tensor twice
        [[["w"], [2] * 65, [0] * 65, [1] * 65]],  # more dimensions than torch has
        {"w": [4]},
        "w",
        [[[f"w{i}"], [2], [0], [1]] for i in range(MAX_SLICES + 1)],  # too many
    ],
)
def test_a_bad_declaration_is_refused_by_the_decoder(raw: Any) -> None:
    with pytest.raises(FrameError, match="slice"):
        decode(_with_slices(raw))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 1 << 41) | st.floats() | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=4),
    max_leaves=16,
)


@pytest.mark.timeout(60)
@settings(max_examples=300)
@given(json_values)
def test_any_declaration_decodes_into_boxes_inside_their_tensors_or_raises(raw: Any) -> None:
    try:
        hello = decode(_with_slices(raw))
    except FrameError:
        return
    assert isinstance(hello, Hello) and len(hello.slices) <= MAX_SLICES
    for s in hello.slices:
        assert len(s.shape) == len(s.offsets) == len(s.extent)
        assert all(
            o >= 0 and o + n <= d for d, o, n in zip(s.shape, s.offsets, s.extent, strict=True)
        )


# --- cut at the rank, rebased and gathered at the worker ---------------------------------


def _part(global_tensors: dict[str, np.ndarray], part: int, parts: int) -> tuple[Any, Any]:
    """Rank ``part``'s schema and whole stream: rows of each 2-D tensor, uneven, and the
    1-D ones whole at part 0."""
    entries, chunks, pos = [], [], 0
    for name, t in global_tensors.items():
        if t.ndim == 1:
            if part:
                continue
            local, box = t, None
        else:
            lo, hi = part * len(t) // parts, (part + 1) * len(t) // parts
            local, box = t[lo:hi], Box(t.shape, (lo, 0))
        pos = -(-pos // 64) * 64
        entries.append(TensorEntry((name,), "float32", local.shape, 0, pos, local.nbytes, "", box))
        chunks.append((pos, np.ascontiguousarray(local).view(np.uint8).reshape(-1)))
        pos += local.nbytes
    data = np.zeros(pos, dtype=np.uint8)
    for at, raw in chunks:
        data[at : at + len(raw)] = raw
    return WeightsSchema("state_dict", tuple(entries), part, parts), data


def _gather(streams: list[tuple[WeightsSchema, np.ndarray]], rebaser: Rebaser) -> dict[str, Any]:
    """Every part's cut stream, in chunks of 256 bytes, gathered as a worker does."""
    gather = PartGather(len(streams), 30.0)
    events: list[Any] = []
    for part, (schema, data) in enumerate(streams):
        layout = StreamLayout.received(schema, 256)
        for i in range(layout.count):
            at, n = layout.span(i)
            chunk = Chunk(
                "p", 1, 7, i, layout.count, at, layout.total, layout.layout,
                data[at : at + n].tobytes(), schema if i == 0 else None,
            )  # fmt: skip
            events += gather.feed(part, rebaser.chunk(chunk), 0.0, (7, 0))
    (whole,) = [e for e in events if isinstance(e, Whole)]
    out = {}
    stream = np.frombuffer(whole.chunk.payload, dtype=np.uint8)
    for e in whole.chunk.schema.entries:  # type: ignore[union-attr]
        raw = stream[e.offset : e.offset + e.nbytes]
        out[e.dotted_key] = raw.view(np.float32).reshape(e.shape)
    return out


sizes = st.integers(1, 9)


@pytest.mark.timeout(60)
@settings(max_examples=100, deadline=None)
@given(sizes, sizes, st.integers(1, 4), st.data())
def test_the_cuts_of_every_part_tile_the_slice_and_hold_nothing_else(
    rows: int, cols: int, parts: int, data: Any
) -> None:
    rng = np.random.default_rng(rows * 100 + cols * 10 + parts)
    tensors = {
        "m": rng.standard_normal((rows, cols), dtype=np.float32),
        "v": rng.standard_normal(cols, dtype=np.float32),
    }
    r0 = data.draw(st.integers(0, rows - 1))
    c0 = data.draw(st.integers(0, cols - 1))
    extent = (data.draw(st.integers(1, rows - r0)), data.draw(st.integers(1, cols - c0)))
    v0 = data.draw(st.integers(0, cols - 1))
    slices: dict[tuple[str, ...], Slice] = {
        ("m",): Slice(("m",), (rows, cols), (r0, c0), extent),
        ("v",): Slice(("v",), (cols,), (v0,), (cols - v0,)),
    }
    streams = [cut(*_part(tensors, p, parts), slices) for p in range(parts)]
    inside = extent[0] * extent[1] * 4 + (cols - v0) * 4
    # Only the slices' bytes travel (and alignment gaps between a part's pieces).
    assert sum(s.data.nbytes for s in streams) <= inside + 2 * 64 * parts
    got = _gather([(s.schema, s.data) for s in streams], Rebaser(slices))
    assert np.array_equal(got["m"], tensors["m"][r0 : r0 + extent[0], c0 : c0 + extent[1]])
    assert np.array_equal(got["v"], tensors["v"][v0:])


@pytest.mark.timeout(30)
def test_a_part_not_cut_for_the_worker_is_refused() -> None:
    tensors = {"m": np.ones((4, 6), dtype=np.float32)}
    slices: dict[tuple[str, ...], Slice] = {("m",): Slice(("m",), (4, 6), (0, 0), (4, 3))}
    schema, _ = _part(tensors, 0, 2)  # rows 0-2, every column: outside the slice
    with pytest.raises(FrameError, match="not inside this worker's slice"):
        rebase(schema, slices)
    other: dict[tuple[str, ...], Slice] = {("m",): Slice(("m",), (4, 7), (0, 0), (4, 3))}
    with pytest.raises(FrameError, match="of shape"):
        rebase(schema, other)
    assert meet((0, 0), (2, 6), (2, 0), (2, 6)) is None  # rows 0-2 and 2-4 do not meet


# --- ranks and workers, in this process ---------------------------------------------------


class _CountingSpoke(MemorySpoke):
    """A memory spoke that counts the bytes of weights it receives (the chunks' payloads)."""

    def __init__(self, endpoint: str, counts: list[int]) -> None:
        super().__init__(endpoint)
        self._counts = counts

    def recv_frames(self, timeout: float | None) -> Any:
        frames = super().recv_frames(timeout)
        if frames is not None and len(frames) > 2 and peek_kind(frames[0]) is Kind.WEIGHTS:
            self._counts[0] += memoryview(frames[2]).nbytes
        return frames


def _tp_half(half: int) -> Any:
    """What tensor-parallel worker ``half`` of 2 holds: rows of ``qkv`` and of its bias
    (column-parallel), columns of ``proj`` (row-parallel), ``norm`` whole."""

    def slices(name: str, shape: tuple[int, ...]) -> Box | None:
        if name == "qkv":
            return Box((64, 32), (32 * half, 0))
        if name == "qkv_bias":
            return Box((64,), (32 * half,))
        if name == "proj":
            return Box((32, 64), (0, 32 * half))
        return None

    return slices


def _slice_of(learner: dict[str, Any], name: str, half: int) -> Any:
    t = learner[name]
    if name in ("qkv", "qkv_bias"):
        return t[32 * half : 32 * half + 32]
    if name == "proj":
        return t[:, 32 * half : 32 * half + 32]
    return t


def _sliced_model() -> dict[str, Any]:
    """A tensor-parallel worker's model: its halves of ``qkv``, ``qkv_bias`` and
    ``proj``, and ``norm`` whole (either half: they are of one shape)."""
    import torch

    return {
        "qkv": torch.zeros(32, 32),
        "qkv_bias": torch.zeros(32),
        "proj": torch.zeros(32, 32),
        "norm": torch.zeros(32),
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("second", ["auto", "staged", "in_place", "sink"])
def test_sliced_workers_get_their_slices_only_and_a_plain_one_the_whole_model(
    second: str,
) -> None:
    """Three ranks (uneven rows); workers 0 and 1 hold the two halves of a
    tensor-parallel split (worker 1 applying as ``second`` says), worker 2 the whole
    model. Each sliced worker receives about its slice's bytes, not the model's."""
    import torch

    from zmqsync import WeightReceiver, checksum

    torch.manual_seed(0)
    learner = {
        "qkv": torch.randn(64, 32),
        "qkv_bias": torch.randn(64),
        "proj": torch.randn(32, 64),
        "norm": torch.randn(32),
    }
    names = [f"memory://slices-{second}-{r}" for r in range(3)]
    senders = rank_senders(names, learner, num_workers=3, timeout=30, epoch=11)
    got: dict[str, Any] = {}

    def keep(tensors: list[tuple[str, Any]]) -> None:
        got.update({k: t.clone() for k, t in tensors})

    models = [
        _sliced_model(),
        _sliced_model(),
        {k: torch.zeros_like(t) for k, t in learner.items()},
    ]
    sink_slices = {
        "qkv": (Box((64, 32), (32, 0)), (32, 32)),
        "qkv_bias": (Box((64,), (32,)), (32,)),
        "proj": (Box((32, 64), (0, 32)), (32, 32)),
    }
    counts = [[0] for _ in range(4)]
    receivers: list[Any] = []

    def receiver(i: int, half: int | None, model: Any, **options: Any) -> Any:
        return WeightReceiver(
            _CountingSpoke(names[0], counts[i]),
            model=model,
            strategy="state_dict",
            worker_idx=i,
            timeout=30,
            connect_rank=lambda e: _CountingSpoke(e, counts[i]),
            slices=None if half is None else options.pop("slices", _tp_half(half)),
            **options,
        )

    def second_holds() -> Any:
        return got if second == "sink" else models[1]

    try:
        receivers.append(receiver(0, 0, models[0]))
        if second == "sink":
            receivers.append(receiver(1, 1, None, sink=keep, slices=sink_slices))
        else:
            receivers.append(receiver(1, 1, models[1], apply_mode=second))
        receivers.append(receiver(2, None, models[2]))
        for r in receivers:
            r.connect()
            assert r.version == 0
            r.start()
        for c in counts:
            c[0] = 0
        for version in (1, 2):
            with torch.no_grad():
                for t in learner.values():
                    t.add_(1.0)
            send_all(senders)
            assert [r.version for r in receivers] == [version] * 3
            for name in learner:
                assert torch.equal(models[0][name], _slice_of(learner, name, 0)), name
                if second != "sink" or name != "norm":  # the sink is given what it declared
                    assert torch.equal(second_holds()[name], _slice_of(learner, name, 1)), name
            assert checksum(models[2], "state_dict") == checksum(learner, "state_dict")
        model_bytes = sum(t.nbytes for t in learner.values())
        slice_bytes = sum(t.nbytes for t in models[0].values())
        slack = 3 * 4 * 64  # each rank's pieces start on 64-byte boundaries
        for i in (0, 1):
            # Two versions of its slices came, and nothing of the rest of the model.
            assert 2 * slice_bytes <= counts[i][0] <= 2 * (slice_bytes + slack), counts
        assert counts[2][0] >= 2 * model_bytes
        assert counts[0][0] < 0.6 * counts[2][0]
        # A late sliced joiner is served its cut of the latest version by every rank.
        late = _sliced_model()
        receivers.append(receiver(3, 0, late, apply_mode="staged"))
        receivers[-1].connect()
        assert receivers[-1].version == 2
        for name in learner:
            assert torch.equal(late[name], _slice_of(learner, name, 0)), name
        # worker_ids: every rank sends version 3 to sliced worker 1 alone.
        with torch.no_grad():
            learner["proj"].mul_(2.0)
        send_all(senders, worker_ids=[1])
        until(lambda: receivers[1].version == 3, 30, "worker 1 holds version 3")
        assert [r.version for r in receivers] == [2, 3, 2, 2]
        assert torch.equal(second_holds()["proj"], _slice_of(learner, "proj", 1))
    finally:
        close_all(receivers, senders)


@pytest.mark.timeout(90)
def test_a_rank_that_does_not_send_leaves_sliced_workers_with_their_last_whole_slices() -> None:
    """Rank 1 of 3 does not send version 2: the others raise naming it, and neither
    sliced worker (one staged, one writing in place) holds a partial version: both keep
    version 1's slices (without rank 1's first chunk the layout is unknown, so nothing
    was written in place). Rank 1's late send completes version 2 on both."""
    import torch

    from zmqsync import SyncTimeout, WeightReceiver

    torch.manual_seed(1)
    learner = {"qkv": torch.randn(64, 32), "proj": torch.randn(32, 64)}
    names = [f"memory://slices-missing-{r}" for r in range(3)]
    senders = rank_senders(names, learner, num_workers=2, timeout=3, epoch=7)
    models = [{"qkv": torch.zeros(32, 32), "proj": torch.zeros(32, 32)} for _ in range(2)]
    receivers = [
        WeightReceiver(
            MemorySpoke(names[0]),
            model=models[half],
            strategy="state_dict",
            worker_idx=half,
            timeout=20,
            apply_mode="staged" if half == 0 else "in_place",
            connect_rank=MemorySpoke,
            slices=_tp_half(half),
        )
        for half in range(2)
    ]

    def holds_slices(half: int) -> bool:
        return all(
            torch.equal(models[half][name], _slice_of(learner, name, half)) for name in learner
        )

    try:
        for r in receivers:
            r.connect()
            r.start()
        with torch.no_grad():
            learner["qkv"].add_(1.0)
        send_all(senders)
        assert all(holds_slices(h) for h in (0, 1))
        first = {k: t.clone() for k, t in learner.items()}
        with torch.no_grad():
            for t in learner.values():
                t.add_(1.0)
        errors = sends([senders[i] for i in (0, 2)])
        assert len(errors) == 2 and all(isinstance(e, SyncTimeout) for e in errors), errors
        for e in errors:
            assert isinstance(e, SyncTimeout) and e.missing_ranks == [1], e
        assert [r.version for r in receivers] == [1, 1]
        for half, name in itertools.product((0, 1), learner):
            assert torch.equal(models[half][name], _slice_of(first, name, half)), name
        assert not receivers[1].torn
        senders[1].send()  # late: version 2 is whole now, on both
        until(lambda: [r.version for r in receivers] == [2, 2], 30, "both hold version 2")
        assert all(holds_slices(h) for h in (0, 1)) and not receivers[1].torn
    finally:
        close_all(receivers, senders)


@pytest.mark.timeout(60)
def test_a_declaration_the_learner_cannot_serve_is_refused_and_counted() -> None:
    """A well-formed Hello whose slice is of a tensor of another shape, and one with
    more slices than any worker may declare: each rank refuses them (counted, the
    worker told why), and no session is opened."""
    import torch

    from zmqsync import SyncTimeout, WeightReceiver

    learner = {"m": torch.randn(6, 4), "v": torch.randn(4)}
    names = [f"memory://slices-refused-{r}" for r in range(2)]
    senders = rank_senders(names, learner, timeout=10)
    spoke = MemorySpoke(names[0])
    try:
        before = senders[0].status()["totals"]["rejected_frames"]
        spoke.send_frames(encode(_hello((Slice(("m",), (6, 5), (0, 0), (3, 5)),))))
        spoke.send_frames(_with_slices([[[f"w{i}"], [2], [0], [1]] for i in range(MAX_SLICES + 1)]))
        replies: list[Any] = []

        def refused_twice() -> bool:
            frames = spoke.recv_frames(0.05)
            if frames is not None:
                replies.append(decode(frames))
            return len(replies) >= 2

        until(refused_twice, 30, "both hellos are refused")
        assert all(isinstance(m, ErrorMessage) and m.code == "malformed" for m in replies)
        assert "of shape (6, 4) at the learner" in replies[0].message
        assert "at most" in replies[1].message
        assert senders[0].status()["totals"]["rejected_frames"] == before + 2
        assert senders[0].connected_workers() == frozenset()
        # A receiver declaring such a slice is told why, and its connect raises in time.
        wrong = WeightReceiver(
            MemorySpoke(names[0]),
            model={"m": torch.zeros(3, 5), "v": torch.zeros(4)},
            strategy="state_dict",
            worker_idx=0,
            connect_rank=MemorySpoke,
            slices={"m": Box((6, 5), (0, 0))},
        )
        try:
            with pytest.raises(SyncTimeout):
                wrong.connect(timeout=3)
            assert any("Hello.slices refused" in r for r in wrong.rejections)
        finally:
            wrong.close()
    finally:
        spoke.close()
        for s in senders:
            s.close()


@pytest.mark.timeout(60)
def test_a_plain_learner_refuses_a_sliced_worker_saying_why() -> None:
    """A learner of one process holds whole tensors and cuts nothing: a worker that
    declares slices is told it needs a sharded learner, and its connect raises."""
    import torch

    from zmqsync import SyncTimeout, WeightReceiver, WeightSender

    sender = WeightSender(
        MemoryHub("memory://slices-plain"), model={"m": torch.randn(6, 4)}, strategy="state_dict"
    )
    worker = WeightReceiver(
        MemorySpoke("memory://slices-plain"),
        model={"m": torch.zeros(3, 4)},
        strategy="state_dict",
        worker_idx=0,
        slices={"m": Box((6, 4), (3, 0))},
    )
    try:
        with pytest.raises(SyncTimeout):
            worker.connect(timeout=3)
        assert any("no rank of a sharded learner" in r for r in worker.rejections)
        assert sender.status()["totals"]["rejected_frames"] >= 1
    finally:
        worker.close()
        sender.close()


@pytest.mark.timeout(30)
def test_a_rank_serves_a_bounded_number_of_sliced_workers() -> None:
    from zmqsync.sender.slices import MAX_DECLARATIONS, MAX_SLICED_WORKERS, SlicedWorkers

    table = SlicedWorkers(1 << 16, lambda *a: None)  # type: ignore[arg-type]
    one = (Slice(("m",), (6, 4), (0, 0), (3, 4)),)
    for peer in range(MAX_SLICED_WORKERS):
        assert table.declare(0, b"%d" % peer, one, None) is None
    assert "at most" in (table.declare(0, b"one more", one, None) or "")
    assert table.refused == 1 and len(table) == MAX_SLICED_WORKERS
    assert table.declare(0, b"5", one, None) is None  # a worker saying hello again
    table.forget(0, b"7")
    assert table.declare(0, b"one more", one, None) is None
    assert table.declare(0, b"3", (), None) is None and len(table) == MAX_SLICED_WORKERS - 1
    # Distinct slicings are bounded apart: each costs the rank a cut of every version.
    table = SlicedWorkers(1 << 16, lambda *a: None)  # type: ignore[arg-type]
    for i in range(MAX_DECLARATIONS):
        assert table.declare(0, b"%d" % i, (Slice(("m",), (64,), (i,), (1,)),), None) is None
    other = (Slice(("m",), (64,), (63,), (1,)),)
    assert "distinct" in (table.declare(0, b"new", other, None) or "")
    assert table.declare(0, b"0", other, None) is None  # worker 0 changes its slice
    assert table.refused == 1 and len(table) == MAX_DECLARATIONS


# --- an FSDP2 learner over gloo, and sliced workers in processes of their own -------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["pubsub", "router"])
def test_fsdp2_learner_of_two_ranks_and_two_sliced_workers(tmp_path: Any, mode: str) -> None:
    """Two ranks of FSDP2 (uneven shards, a ``Shard(1)`` DTensor, a replica and a
    buffer) and two tensor-parallel workers, each holding half of the model's matrices
    (rows of one, columns of others, uneven): after each version their slices are those
    of the whole model, which a plain worker in this process holds whole (equal to the
    learner's gathered model)."""
    import torch
    from _sharded import Net, run_rank, run_sliced_worker, sliced_half
    from conftest import free_port

    import zmqsync

    port = free_port()
    endpoints = ipc_endpoints(tmp_path, 2)
    scheme = None
    with Processes() as procs:
        try:
            learners = procs.ranks(run_rank, port, endpoints, (mode,))
            answers(learners, "ready")
            workers = [
                procs.start(run_sliced_worker, endpoints[0], w, after=(mode,)) for w in range(2)
            ]
            scheme = zmqsync.ZMQWeightSyncScheme("state_dict", mode=mode, endpoint=endpoints[0])
            whole = Net()
            scheme.init_on_receiver(model_id="policy", model=whole, worker_idx=2)
            connecting = threading.Thread(target=scheme.connect, kwargs={"timeout": 120})
            connecting.start()
            replies = collective(learners, "connect")
            connecting.join(120)
            for c in workers:
                assert answer(c, "ready") == "ready"
            scheme.start_receiver_thread()
            receiver = scheme.get_receiver()
            for version in range(0, 3):
                if version:
                    replies = collective(learners, "send")
                expected = replies[0][2]
                with scheme.lock:
                    assert receiver.version == version
                    assert zmqsync.checksum(whole, "state_dict") == expected
                    full = {k: t.detach().clone() for k, t in whole.state_dict().items()}
                for half, c in enumerate(workers):
                    held, tensors = ask(c, "state")
                    assert held == version
                    assert set(tensors) == set(full)
                    for name, t in tensors.items():
                        assert torch.equal(torch.from_numpy(t), sliced_half(full, name, half)), name
        finally:
            if scheme is not None:
                scheme.shutdown()


@pytest.mark.timeout(300)
def test_fsdp2_learner_and_a_tensor_parallel_worker_of_dtensors(tmp_path: Any) -> None:
    """A worker that is itself tensor-parallel over gloo (two ranks, each a worker) with
    a model of DTensors declares their local boxes (``dtensor_slices``): after each
    version the model it gathers is the learner's gathered model, as is a plain
    worker's."""
    from _sharded import run_dtensor_worker, run_plain_worker, run_rank
    from conftest import free_port

    learner_port, worker_port = free_port(), free_port()
    endpoints = ipc_endpoints(tmp_path, 2)
    with Processes() as procs:
        learners = procs.ranks(run_rank, learner_port, endpoints, ("pubsub",))
        answers(learners, "ready")
        workers = [
            procs.start(run_dtensor_worker, r, 2, worker_port, endpoints[0], after=("pubsub",))
            for r in range(2)
        ]
        workers.append(procs.start(run_plain_worker, endpoints[0], 2, after=("pubsub",)))
        replies = collective(learners, "connect")
        for c in workers:
            assert answer(c, "ready") == "ready"
        for version in range(0, 3):
            if version:
                replies = collective(learners, "send")
            expected = replies[0][2]
            # The tensor-parallel worker's ranks gather together.
            assert collective(workers, "state") == [(version, expected)] * 3
