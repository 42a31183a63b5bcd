"""Sharded learners: parts of a version on the wire, gathered by workers into whole
versions; and an FSDP2 learner over gloo whose every rank sends its own shard."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from typing import Any

import numpy as np
import pytest
from _faults import until
from _sharded_fixtures import (
    DyingHub,
    Processes,
    RowsPart,
    answer,
    answers,
    ask,
    close_all,
    collective,
    fake_parts,
    fake_tensors,
    first_chunk,
    gathered_arrays,
    ipc_endpoints,
    part_stream,
    rank_senders,
    send_all,
    sends,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from zmqsync.chunking.parts import (
    Held,
    Lost,
    PartGather,
    Placed,
    Refused,
    Torn,
    Whole,
    assemble,
)
from zmqsync.errors import FrameError
from zmqsync.protocol import (
    MAX_PARTS,
    Box,
    Chunk,
    TensorEntry,
    WeightsSchema,
    Welcome,
    decode,
    encode,
    encode_schema,
    layout_digest,
)

# --- parts on the wire ------------------------------------------------------------------


def _boxed(key: str, shape: tuple[int, ...], whole: tuple[int, ...], at: tuple[int, ...]) -> Any:
    return TensorEntry((key,), "float32", shape, 0, 0, 4 * math.prod(shape), "", Box(whole, at))


@pytest.mark.timeout(30)
def test_a_plain_schema_is_encoded_as_before() -> None:
    entry = TensorEntry(("w",), "float32", (2,), 0, 0, 8)
    assert encode_schema(WeightsSchema("state_dict", (entry,))) == (
        b'{"strategy":"state_dict","tensors":[[["w"],"float32",[2],0,0,8]]}'
    )
    welcome = Welcome("p", 1, 2, mode="m", strategy="state_dict")
    assert b"ranks" not in encode(welcome)[1]


@pytest.mark.timeout(30)
def test_a_part_round_trips_and_its_digest_differs_per_part() -> None:
    entry = _boxed("w", (2, 3), (5, 3), (3, 0))
    first = WeightsSchema("state_dict", (entry,), 1, 2)
    other = dataclasses.replace(first, part=0)
    chunk = first_chunk(first, bytes(24))
    decoded = decode(encode(chunk))
    assert isinstance(decoded, Chunk) and decoded.schema == first
    assert layout_digest(encode_schema(first)) != layout_digest(encode_schema(other))


@pytest.mark.timeout(30)
def test_a_welcome_names_the_ranks() -> None:
    welcome = Welcome("p", 1, 2, mode="m", strategy="s", ranks=("ipc:///a", "ipc:///b"))
    assert decode(encode(welcome)) == welcome


@pytest.mark.timeout(30)
def test_a_heartbeat_says_which_parts_it_waits_for_and_a_plain_one_is_unchanged() -> None:
    from zmqsync.protocol import SnapshotRequest

    plain = SnapshotRequest("p", 1, 2, 3, "s")
    assert b"gathering" not in bytes(encode(plain)[1])  # the bytes of an unsharded worker
    waiting = SnapshotRequest("p", 1, 2, 3, "s", gathering=4, waiting=(0, 2))
    assert decode(encode(waiting)) == waiting


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "waiting", [[1, 1], [2, 1], [-1], [1024], [True], ["1"], [1.0], list(range(1025)), {}]
)
def test_a_heartbeats_waiting_parts_are_checked_strictly(waiting: Any) -> None:
    from zmqsync.protocol import SnapshotRequest

    head, body = encode(SnapshotRequest("p", 1, 2, 3, "s", gathering=4, waiting=(0,)))
    bad = bytes(body).replace(b'"waiting":[0]', b'"waiting":' + json.dumps(waiting).encode())
    assert bad != bytes(body)
    with pytest.raises(FrameError, match="waiting"):
        decode([head, bad])


def _schema_json(entries: list[Any], part: Any = None) -> bytes:
    doc: dict[str, Any] = {"strategy": "state_dict", "tensors": entries}
    if part is not None:
        doc["part"] = part
    return json.dumps(doc).encode()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("entry", "part"),
    [
        ([["w"], "float32", [2, 3], 0, 0, 24, "", [[5, 3], [4, 0]]], [0, 2]),  # past the end
        ([["w"], "float32", [2, 3], 0, 0, 24, "", [[5], [0]]], [0, 2]),  # another rank
        ([["w"], "float32", [2, 3], 0, 0, 24, "", [[5, 3], [0]]], [0, 2]),
        ([["w"], "float32", [2, 3], 0, 0, 24, "", [[5, 3], [-1, 0]]], [0, 2]),
        ([["w"], "float32", [2, 3], 0, 0, 24, "", [[1 << 40, 3], [0, 0]]], [0, 2]),  # huge
        ([["w"], "float32", [2, 3], 0, 0, 24, "", [[5, 3], [0, 0.5]]], [0, 2]),
        ([["w"], "float32", [2, 3], 0, 0, 24, "", [[5, 3]]], [0, 2]),
        ([["w"], "float32", [2, 3], 0, 0, 24, "", [[5, 3], [0, 0]]], None),  # a box, no part
        ([["w"], "float32", [2, 3], 0, 0, 24, 0, [[5, 3], [0, 0]]], [0, 2]),  # wire not str
        ([["w"], "float32", [2, 3], 0, 0, 24], [2, 2]),
        ([["w"], "float32", [2, 3], 0, 0, 24], [0, 1]),  # one part says nothing
        ([["w"], "float32", [2, 3], 0, 0, 24], [0, MAX_PARTS + 1]),
        ([["w"], "float32", [2, 3], 0, 0, 24], [True, 2]),
        ([["w"], "float32", [2, 3], 0, 0, 24], "0/2"),
    ],
)
def test_a_bad_box_or_part_is_refused(entry: list[Any], part: Any) -> None:
    from zmqsync.protocol.schemas import decode_schema

    body = _schema_json([entry], part)
    with pytest.raises(FrameError):
        decode_schema(body, layout_digest(body), 24)


dims = st.integers(0, 4)


@st.composite
def boxes(draw: Any) -> tuple[list[int], list[int], list[int]]:
    whole = draw(st.lists(dims, min_size=0, max_size=3))
    offsets = [draw(st.integers(0, d)) for d in whole]
    shape = [draw(st.integers(0, d - o)) for d, o in zip(whole, offsets, strict=True)]
    return whole, offsets, shape


@pytest.mark.timeout(30)
@settings(max_examples=200)
@given(boxes(), st.integers(0, 3), st.lists(st.integers(-3, 6), max_size=3))
def test_boxes_decode_within_their_global_tensor_or_raise(
    box: tuple[list[int], list[int], list[int]], part: int, noise: list[int]
) -> None:
    from zmqsync.protocol.schemas import decode_schema

    whole, offsets, shape = box
    for i, n in enumerate(noise):  # hostile edits: offsets moved, shapes grown
        if whole:
            offsets[i % len(whole)] += n
    nbytes = 4 * math.prod(shape)
    body = _schema_json(
        [[["w"], "float32", shape, 0, 0, nbytes, "", [whole, offsets]]], [part % 2, 2]
    )
    try:
        schema = decode_schema(body, layout_digest(body), nbytes)
    except FrameError:
        return
    (e,) = schema.entries
    assert e.box is not None and len(e.box.shape) == len(e.shape) == len(e.box.offsets)
    for d, o, n in zip(e.box.shape, e.box.offsets, e.shape, strict=True):
        assert o >= 0 and o + n <= d


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 1 << 41) | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4),
    max_leaves=12,
)


@pytest.mark.timeout(30)
@settings(max_examples=300)
@given(json_values, json_values)
def test_any_part_or_box_decodes_as_announced_or_raises(part: Any, box: Any) -> None:
    """Whatever a peer puts in ``part`` and in an entry's box: a schema, or FrameError."""
    from zmqsync.protocol.schemas import decode_schema

    body = _schema_json([[["w"], "float32", [2, 3], 0, 0, 24, "", box]], part)
    try:
        schema = decode_schema(body, layout_digest(body), 24)
    except FrameError:
        return
    assert 0 <= schema.part < schema.parts <= MAX_PARTS and schema.parts > 1
    (e,) = schema.entries
    assert e.box is not None
    assert all(
        o >= 0 and o + n <= d for d, o, n in zip(e.box.shape, e.box.offsets, e.shape, strict=True)
    )


# --- gathering parts (fakes: the parts as a learner's ranks would cut them) ---------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("cuts", [2, 3, 4, 9])
def test_parts_gather_into_the_whole_version(cuts: int) -> None:
    tensors = fake_tensors(cuts)
    schemas = fake_parts(tensors, cuts)
    gather = PartGather(cuts, gap=10.0)
    events: list[Any] = []
    for p in reversed(range(cuts)):  # in any order
        events += gather.feed(
            p, first_chunk(schemas[p], part_stream(schemas[p], tensors)), 0, (0, 0)
        )
    (whole,) = events
    assert isinstance(whole, Whole) and whole.chunk.count == 1
    assert whole.chunk.schema is not None and whole.chunk.schema.parts == 1
    got = gathered_arrays(whole.chunk)
    for key, t in tensors.items():
        np.testing.assert_array_equal(got[key], t)


@pytest.mark.timeout(30)
@settings(max_examples=200)
@given(st.data())
def test_a_box_written_in_pieces_lands_where_it_belongs(data: Any) -> None:
    """A box's bytes cut anywhere (mid-element too) land at their strided place."""
    from zmqsync.chunking.parts import _write_range

    whole = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    offsets = [data.draw(st.integers(0, d - 1)) for d in whole]
    shape = [data.draw(st.integers(1, d - o)) for d, o in zip(whole, offsets, strict=True)]
    itemsize = data.draw(st.sampled_from([1, 2, 4]))
    box = tuple(slice(o, o + n) for o, n in zip(offsets, shape, strict=True))
    src = np.arange(math.prod(shape) * itemsize, dtype=np.uint64).astype(np.uint8) + 1
    out = np.zeros((*whole, itemsize), dtype=np.uint8)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(src)), max_size=5)))
    for lo, hi in itertools.pairwise([0, *cuts, len(src)]):
        if lo < hi:
            _write_range(out[box], src[lo:hi], lo, hi)
    expected = np.zeros_like(out)
    expected[box] = src.reshape(*shape, itemsize)
    np.testing.assert_array_equal(out, expected)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_parts_in_chunks_gather_into_the_whole_version(chunk: int) -> None:
    """Parts cut into small chunks, interleaved: boxes written as their bytes come."""
    tensors = fake_tensors(11)
    schemas = fake_parts(tensors, 3)
    pieces = []
    for schema in schemas:
        stream = part_stream(schema, tensors)
        layout = layout_digest(encode_schema(schema))
        count = max(1, -(-len(stream) // chunk))
        pieces.append(
            [
                Chunk(
                    "p",
                    1,
                    7,
                    i,
                    count,
                    i * chunk,
                    len(stream),
                    layout,
                    stream[i * chunk : (i + 1) * chunk],
                    schema if i == 0 else None,
                )
                for i in range(count)
            ]
        )
    gather = PartGather(3, gap=10.0)
    events: list[Any] = []
    for row in itertools.zip_longest(*pieces):
        for p, c in enumerate(row):
            if c is not None:
                events += gather.feed(p, c, 0, (0, 0))
    (whole,) = events
    assert isinstance(whole, Whole)
    for key, t in tensors.items():
        np.testing.assert_array_equal(gathered_arrays(whole.chunk)[key], t)


def _placed_gather(out: dict[str, np.ndarray]) -> PartGather:
    """A gather that writes in place, into ``out`` (what a model's tensors would be)."""

    def place(assembly: Any) -> list[np.ndarray]:
        return [
            out[e.key[0]].reshape(-1).view(np.uint8).reshape(*e.shape, 4)
            for e in assembly.schema.entries
        ]

    return PartGather(2, gap=1.0, place=place)


@pytest.mark.timeout(30)
def test_parts_written_in_place_land_in_the_tensors_as_they_come() -> None:
    tensors = fake_tensors(21)
    out = {k: np.zeros_like(t) for k, t in tensors.items()}
    schemas = fake_parts(tensors, 2)
    gather = _placed_gather(out)
    events: list[Any] = []
    for p in (1, 0):
        events += gather.feed(
            p, first_chunk(schemas[p], part_stream(schemas[p], tensors)), 0, (0, 0)
        )
    (placed,) = events
    assert isinstance(placed, Placed) and placed.chunk.version == 1 and not placed.chunk.payload
    for key, t in tensors.items():
        np.testing.assert_array_equal(out[key], t)


@pytest.mark.timeout(30)
def test_a_version_written_in_place_that_breaks_off_is_torn_and_dropped() -> None:
    tensors = fake_tensors(22)
    schemas = fake_parts(tensors, 2)
    gather = _placed_gather({k: np.zeros_like(t) for k, t in tensors.items()})
    stream = part_stream(schemas[1], tensors)
    layout = layout_digest(encode_schema(schemas[1]))
    head = Chunk("p", 1, 7, 0, 2, 0, len(stream), layout, stream[:8], schemas[1])
    assert gather.feed(1, head, 0.0, (0, 0)) == []
    assert (
        gather.feed(0, first_chunk(schemas[0], part_stream(schemas[0], tensors)), 0.0, (0, 0)) == []
    )
    (torn,) = gather.expire(5.0)  # part 1's next chunk never came
    assert isinstance(torn, Torn) and (torn.epoch, torn.version) == (7, 1)
    assert not gather.active and gather.expire(10.0) == []
    # A newer version while one is written in place: the older is torn.
    assert gather.feed(1, head, 20.0, (0, 0)) == []
    assert (
        gather.feed(0, first_chunk(schemas[0], part_stream(schemas[0], tensors)), 20.0, (0, 0))
        == []
    )
    newer = first_chunk(schemas[0], part_stream(schemas[0], tensors), version=2)
    assert [type(e) for e in gather.feed(0, newer, 20.0, (0, 0))] == [Torn]


@pytest.mark.timeout(30)
def test_a_newer_part_drops_the_older_version_and_parts_never_mix() -> None:
    old, new = fake_tensors(1), fake_tensors(2)
    schemas = fake_parts(old, 2)
    gather = PartGather(2, gap=10.0)
    assert gather.feed(0, first_chunk(schemas[0], part_stream(schemas[0], old), 1), 0, (0, 0)) == []
    assert gather.feed(0, first_chunk(schemas[0], part_stream(schemas[0], new), 2), 0, (0, 0)) == []
    # Part 1 of version 1 is older than the version gathered: dropped.
    assert gather.feed(1, first_chunk(schemas[1], part_stream(schemas[1], old), 1), 0, (0, 0)) == []
    # Part 0 of version 2 sent again (a repair) while part 1 is awaited: kept once.
    assert gather.feed(0, first_chunk(schemas[0], part_stream(schemas[0], old), 2), 0, (0, 0)) == []
    (whole,) = gather.feed(1, first_chunk(schemas[1], part_stream(schemas[1], new), 2), 0, (0, 0))
    assert isinstance(whole, Whole) and whole.chunk.version == 2
    for key, t in new.items():
        np.testing.assert_array_equal(gathered_arrays(whole.chunk)[key], t)


@pytest.mark.timeout(30)
def test_a_part_of_a_version_held_is_acked_to_its_rank() -> None:
    tensors = fake_tensors(3)
    schemas = fake_parts(tensors, 2)
    gather = PartGather(2, gap=10.0)
    chunk = first_chunk(schemas[1], part_stream(schemas[1], tensors), version=3)
    assert gather.feed(1, chunk, 0, (7, 3)) == [Held(1)]
    assert gather.feed(1, chunk, 0, (7, 3), whole=True) == []  # a repair: taken


@pytest.mark.timeout(30)
def test_a_part_on_another_ranks_stream_is_refused() -> None:
    tensors = fake_tensors(4)
    schemas = fake_parts(tensors, 2)
    gather = PartGather(2, gap=10.0)
    with pytest.raises(FrameError):
        gather.feed(0, first_chunk(schemas[1], part_stream(schemas[1], tensors)), 0, (0, 0))


@pytest.mark.timeout(30)
def test_a_stalled_part_is_lost() -> None:
    tensors = fake_tensors(5)
    (schema, _) = fake_parts(tensors, 2)
    stream = part_stream(schema, tensors)
    layout = layout_digest(encode_schema(schema))
    head = Chunk("p", 1, 7, 0, 2, 0, len(stream), layout, stream[:4], schema)
    gather = PartGather(2, gap=1.0)
    assert gather.feed(0, head, 0.0, (0, 0)) == []
    (lost,) = gather.expire(5.0)
    assert isinstance(lost, Lost) and lost.part == 0
    assert gather.expire(5.0) == []  # told once


@pytest.mark.timeout(30)
def test_a_gather_says_which_parts_it_still_waits_for() -> None:
    """What a worker's heartbeats tell each rank: the version under way and the parts
    not in yet, a part that broke off mid-stream included; nothing once it is whole."""
    tensors = fake_tensors(5)
    schemas = fake_parts(tensors, 2)
    gather = PartGather(2, gap=1.0)
    assert gather.waiting() == (0, ())
    streams = [part_stream(schema, tensors) for schema in schemas]
    layouts = [layout_digest(encode_schema(schema)) for schema in schemas]
    head = Chunk("p", 1, 7, 0, 2, 0, len(streams[1]), layouts[1], streams[1][:4], schemas[1])
    gather.feed(1, head, 0.0, (0, 0))
    assert gather.waiting() == (1, (0, 1))
    whole = Chunk("p", 1, 7, 0, 1, 0, len(streams[0]), layouts[0], streams[0], schemas[0])
    gather.feed(0, whole, 0.0, (0, 0))
    assert gather.waiting() == (1, (1,))
    (lost,) = gather.expire(5.0)  # part 1 broke off mid-stream: still waited for
    assert isinstance(lost, Lost) and gather.waiting() == (1, (1,))
    again = Chunk("p", 1, 7, 0, 1, 0, len(streams[1]), layouts[1], streams[1], schemas[1])
    (done,) = gather.feed(1, again, 6.0, (0, 0))
    assert isinstance(done, Whole) and gather.waiting() == (0, ())


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "edit",
    ["overlap", "gap", "dtype", "global shape", "scalar twice"],
)
def test_parts_that_do_not_tile_are_refused(edit: str) -> None:
    tensors = fake_tensors(6)
    schemas = fake_parts(tensors, 2)
    first = list(schemas[1].entries)
    e = first[0]
    assert e.box is not None
    if edit == "overlap":
        first[0] = dataclasses.replace(e, box=Box(e.box.shape, (0, e.box.offsets[1] - 1)))
    elif edit == "gap":
        first[0] = dataclasses.replace(e, box=Box(e.box.shape, (0, e.box.offsets[1] + 1)))
        first[0] = dataclasses.replace(first[0], shape=(3, e.shape[1] - 1))
    elif edit == "dtype":
        first[0] = dataclasses.replace(e, dtype="int32")
    elif edit == "global shape":
        first[0] = dataclasses.replace(e, box=Box((3, 6), e.box.offsets))
    else:
        first.append(TensorEntry(("s",), "float32", (), 0, 1024, 4))
    with pytest.raises(FrameError):
        assemble([schemas[0], dataclasses.replace(schemas[1], entries=tuple(first))])
    gather = PartGather(2, gap=10.0)
    bad = dataclasses.replace(schemas[1], entries=tuple(first))
    end = max(x.offset + x.nbytes for x in bad.entries)
    gather.feed(0, first_chunk(schemas[0], part_stream(schemas[0], tensors)), 0, (0, 0))
    (refused,) = gather.feed(1, first_chunk(bad, bytes(end)), 0, (0, 0))
    assert isinstance(refused, Refused)


class _FakeMesh:
    def __init__(self, coordinate: list[int] | None) -> None:
        self.coordinate = coordinate

    def get_coordinate(self) -> list[int] | None:
        return self.coordinate


class _FakeDTensor:
    """What a rank's part reads of a DTensor before its shard: its mesh and placements."""

    def __init__(self, placements: list[Any], coordinate: list[int] | None) -> None:
        self.device_mesh = _FakeMesh(coordinate)
        self.placements = placements
        self.shape = (4, 4)


@pytest.mark.timeout(30)
def test_a_rank_sends_a_replica_only_at_coordinate_0_and_refuses_what_is_no_box() -> None:
    from torch.distributed.tensor import Partial, Replicate
    from torch.distributed.tensor.placement_types import _StridedShard

    from zmqsync.tensors.dtensor import _local_box

    assert _local_box(_FakeDTensor([Replicate()], [1])) is None  # rank 0 sends it
    assert _local_box(_FakeDTensor([Replicate()], None)) is None  # not in its mesh
    with pytest.raises(ValueError, match="Partial"):
        _local_box(_FakeDTensor([Partial()], [0]))
    with pytest.raises(ValueError, match="cannot be sent as boxes"):
        _local_box(_FakeDTensor([_StridedShard(0, split_factor=2)], [0]))


# --- ranks as senders and a worker gathering them, in one process (fakes) --------------


def _ranks_and_workers(
    prefix: str,
    learner: dict[str, Any],
    *,
    ranks: int,
    workers: int = 2,
    hubs: dict[int, Any] | None = None,
    worker_options: Any = None,
    **sender_options: Any,
) -> tuple[list[Any], list[Any], list[dict[str, Any]]]:
    """In-process ranks of a learner holding ``learner`` (each a ``RowsPart`` over a
    memory hub, ``hubs[r]`` where given) and workers with zeroed models reaching them:
    ``(senders, receivers, models)``, none connected yet. ``worker_options(i)``: more
    arguments for worker ``i``'s receiver."""
    import torch

    from zmqsync import WeightReceiver
    from zmqsync.transport.memory import MemorySpoke

    names = [f"memory://{prefix}-{r}" for r in range(ranks)]
    options = {"num_workers": workers, "timeout": 20, "epoch": 7, **sender_options}
    senders = rank_senders(names, learner, hubs=hubs, **options)
    models = [{k: torch.zeros_like(t) for k, t in learner.items()} for _ in range(workers)]
    receivers = [
        WeightReceiver(
            MemorySpoke(names[0]),
            model=models[i],
            strategy="state_dict",
            worker_idx=i,
            timeout=20,
            connect_rank=MemorySpoke,
            **(worker_options(i) if worker_options else {}),
        )
        for i in range(workers)
    ]
    return senders, receivers, models


@pytest.mark.timeout(60)
@pytest.mark.parametrize("second", ["in place", "streamed in place", "staged", "sink", "weights"])
def test_ranks_as_senders_and_workers_that_gather_their_parts(second: str) -> None:
    """Worker 0 applies in place (one whole chunk: ``"auto"``); worker 1 as ``second``
    says: each box written into its model as it comes (``"in_place"``), staged, a sink,
    or without a model (its weights kept)."""
    import torch

    from zmqsync import WeightReceiver, checksum
    from zmqsync.transport.memory import MemorySpoke

    torch.manual_seed(0)
    learner = {"w": torch.randn(5, 3), "v": torch.randn(3, 2, 2), "b": torch.randn(4)}
    names = [f"memory://sharded-{second}-{r}" for r in range(3)]
    senders = rank_senders(names, learner, num_workers=2, timeout=20, epoch=99)
    got: dict[str, Any] = {}

    def keep(tensors: list[tuple[str, Any]]) -> None:
        got.update({k: t.clone() for k, t in tensors})

    models = [{k: torch.zeros_like(t) for k, t in learner.items()} for _ in range(2)]
    receivers = [
        WeightReceiver(
            MemorySpoke(names[0]),
            model=models[i] if i == 0 or "place" in second or second == "staged" else None,
            sink=keep if i == 1 and second == "sink" else None,
            apply_mode={"staged": "staged", "streamed in place": "in_place"}.get(second, "auto")
            if i == 1
            else "auto",
            strategy="state_dict",
            worker_idx=i,
            timeout=20,
            connect_rank=MemorySpoke,
        )
        for i in range(2)
    ]

    def second_holds() -> Any:
        if second == "sink":
            return got
        if second == "weights":
            return receivers[1].weights
        return models[1]

    try:
        for r in receivers:
            r.connect()
            assert r.version == 0 and r.epoch == 99
            r.start()
        for version in (1, 2):
            with torch.no_grad():
                for t in learner.values():
                    t.add_(1.0)
            send_all(senders)
            assert all(s.version == version for s in senders)
            assert all(r.version == version for r in receivers)
            assert checksum(models[0], "state_dict") == checksum(learner, "state_dict")
            assert checksum(second_holds(), "state_dict") == checksum(learner, "state_dict")
            # Streamed in place, no version was gathered in a buffer and fed whole.
            assert (receivers[1].stats["chunks"] == 0) == (second == "streamed in place")
        # Each rank sent its own part only: together, no more than the whole model (and
        # its alignment) per worker and version.
        whole = sum(t.nbytes for t in learner.values())
        sent = sum(s.status()["totals"]["bytes_sent"] for s in senders)
        assert sent <= 3 * 2 * (whole + 3 * 64)
        # A late joiner gets every rank's part of the latest version from its snapshot.
        late = {k: torch.zeros_like(t) for k, t in learner.items()}
        receivers.append(
            WeightReceiver(
                MemorySpoke(names[0]),
                model=late,
                strategy="state_dict",
                worker_idx=2,
                timeout=20,
                connect_rank=MemorySpoke,
            )
        )
        receivers[-1].connect()
        assert receivers[-1].version == 2
        assert checksum(late, "state_dict") == checksum(learner, "state_dict")
        # worker_ids: every rank sends version 3 to worker 0 alone.
        with torch.no_grad():
            learner["w"].add_(1.0)
        send_all(senders, worker_ids=[0])
        assert [r.version for r in receivers] == [3, 2, 2]
        assert checksum(models[0], "state_dict") == checksum(learner, "state_dict")
    finally:
        close_all(receivers, senders)


@pytest.mark.timeout(60)
def test_ranks_without_snapshots_stream_their_parts_from_the_weights() -> None:
    """retain_snapshot=False: each rank reads its part from its tensors as it streams
    (version 0 at connect, then each send), nothing model-sized kept."""
    import torch

    from zmqsync import WeightReceiver, checksum
    from zmqsync.transport.memory import MemorySpoke

    learner = {"w": torch.randn(6, 4), "b": torch.randn(3)}
    names = ["memory://unkept-0", "memory://unkept-1"]
    senders = rank_senders(
        names, learner, num_workers=1, timeout=20, epoch=5, retain_snapshot=False
    )
    model = {k: torch.zeros_like(t) for k, t in learner.items()}
    receiver = WeightReceiver(
        MemorySpoke(names[0]),
        model=model,
        strategy="state_dict",
        timeout=20,
        connect_rank=MemorySpoke,
    )
    try:
        receiver.connect()
        assert checksum(model, "state_dict") == checksum(learner, "state_dict")
        assert all(s.snapshot is None or s.snapshot.data is None for s in senders)
        receiver.start()
        with torch.no_grad():
            learner["w"].mul_(2.0)
        send_all(senders)
        assert receiver.version == 1
        assert checksum(model, "state_dict") == checksum(learner, "state_dict")
    finally:
        receiver.close()
        for s in senders:
            s.close()


@pytest.mark.timeout(60)
def test_every_rank_sends_async_from_one_thread_and_waits_for_the_acks_after() -> None:
    """send_async() returns before the acks: one thread can start every rank's part of a
    version (nothing waits for another rank), then wait_async() on each returns once the
    workers applied the whole version."""
    import torch

    from zmqsync import checksum

    learner = {"w": torch.randn(6, 4), "v": torch.randn(4, 3), "b": torch.randn(3)}
    senders, receivers, models = _ranks_and_workers("async", learner, ranks=2)
    try:
        for r in receivers:
            r.connect()
            r.start()
        for version in (1, 2, 3):
            with torch.no_grad():
                learner["w"].add_(1.0)
                learner["b"].mul_(-1.0)
            for s in senders:
                s.send_async()
            for s in senders:
                s.wait_async()
            assert [s.version for s in senders] == [version, version]
            assert [r.version for r in receivers] == [version, version]
            for m in models:
                assert checksum(m, "state_dict") == checksum(learner, "state_dict")
    finally:
        close_all(receivers, senders)


@pytest.mark.timeout(30)
def test_a_part_alone_is_never_applied() -> None:
    """A rank whose Welcome names no other ranks (or a receiver that cannot reach them):
    its part never reaches the model, and connect() says why it did not catch up."""
    import torch

    from zmqsync import SyncTimeout, WeightReceiver, WeightSender, ZMQSyncError
    from zmqsync.transport.memory import MemoryHub, MemorySpoke

    learner = {"w": torch.ones(4, 3)}
    names = ["memory://alone-0", "memory://alone-1"]
    sender = WeightSender(
        MemoryHub(names[0]),
        model=learner,
        strategy="state_dict",
        part=RowsPart(0, 2),  # type: ignore[arg-type]
    )
    named = WeightSender(
        MemoryHub(names[1]),
        model=learner,
        strategy="state_dict",
        part=RowsPart(0, 2),  # type: ignore[arg-type]
        ranks=names,
    )
    model = {"w": torch.zeros(4, 3)}
    plain = WeightReceiver(MemorySpoke(names[0]), model=model, strategy="state_dict")
    unreachable = WeightReceiver(MemorySpoke(names[1]), model=model, strategy="state_dict")
    try:
        with pytest.raises(SyncTimeout):
            plain.connect(timeout=1.0)
        assert plain.version == 0 and plain.stats["stale"] > 0
        assert not model["w"].any()
        with pytest.raises(ZMQSyncError, match="sharded over 2 ranks"):
            unreachable.connect(timeout=5.0)
    finally:
        plain.close()
        unreachable.close()
        sender.close()
        named.close()


@pytest.mark.timeout(60)
def test_the_ranks_that_sent_raise_naming_the_rank_that_did_not() -> None:
    """Rank 1 of 3 does not send version 2: ranks 0 and 2 raise within their timeout,
    naming rank 1 (``missing_ranks``) and every worker; no worker applies the partial
    version. Rank 1's late send completes version 2 everywhere; version 3 goes as ever."""
    import time

    import torch

    from zmqsync import SyncTimeout, checksum

    torch.manual_seed(0)
    learner = {"w": torch.randn(5, 3), "b": torch.randn(4)}
    senders, receivers, models = _ranks_and_workers("ranks-missing", learner, ranks=3, timeout=3)
    try:
        for r in receivers:
            r.connect()
            r.start()
        with torch.no_grad():
            learner["w"].add_(1.0)
        send_all(senders)
        first = checksum(learner, "state_dict")
        with torch.no_grad():
            learner["w"].add_(1.0)
        started = time.monotonic()
        errors = sends([senders[i] for i in (0, 2)])
        assert time.monotonic() - started < 3 + 5
        assert len(errors) == 2 and all(isinstance(e, SyncTimeout) for e in errors), errors
        for e in errors:
            assert isinstance(e, SyncTimeout)
            assert e.missing_workers == [0, 1] and e.missing_ranks == [1], e
            assert e.version == 2 and "missing rank(s) 1" in str(e), e
        for r, model in zip(receivers, models, strict=True):
            assert r.version == 1 and checksum(model, "state_dict") == first
        senders[1].send()  # late: the version is whole now, on every worker
        for r, model in zip(receivers, models, strict=True):
            assert r.version == 2
            assert checksum(model, "state_dict") == checksum(learner, "state_dict")
        with torch.no_grad():
            learner["b"].add_(1.0)
        send_all(senders)
        for r, model in zip(receivers, models, strict=True):
            assert r.version == 3
            assert checksum(model, "state_dict") == checksum(learner, "state_dict")
    finally:
        close_all(receivers, senders)


@pytest.mark.timeout(60)
def test_a_rank_that_dies_mid_stream_is_named_and_its_next_send_repairs_all() -> None:
    """Rank 1 of 3 dies after the first chunk of its part of version 2: every rank's
    send raises naming rank 1; no worker applies version 2 (the one that writes in
    place is torn, and says so). Back, the ranks' version 3 repairs every worker."""
    import torch

    from zmqsync import SyncTimeout, checksum

    torch.manual_seed(0)
    # Each rank's part of ``w`` is three chunks of the smallest size.
    learner = {"w": torch.randn(3 * 96, 512), "b": torch.randn(4)}
    dying = DyingHub("memory://ranks-dying-1")
    senders, receivers, models = _ranks_and_workers(
        "ranks-dying",
        learner,
        ranks=3,
        hubs={1: dying},
        timeout=3,
        chunk_bytes=64 * 1024,
        worker_options=lambda i: {
            "apply_mode": "in_place" if i else "staged",
            "chunk_timeout": 1.0,  # a part broken off is given up on before send() raises
        },
    )
    try:
        for r in receivers:
            r.connect()
            r.start()
        with torch.no_grad():
            learner["w"].add_(1.0)
        send_all(senders)
        first = checksum(learner, "state_dict")
        with torch.no_grad():
            learner["w"].add_(1.0)
        dying.die(after=2)  # to each of 2 workers, the first chunk of its part
        errors = sends(senders)
        assert len(errors) == 3 and all(isinstance(e, SyncTimeout) for e in errors), errors
        for e in errors:
            assert isinstance(e, SyncTimeout)
            assert e.missing_workers == [0, 1] and e.missing_ranks == [1], e
        # The staged worker holds version 1 whole; the one writing in place gave up on
        # version 2 and says it is torn (no forward pass runs on it: its lock was held
        # while the parts came) until a whole version repairs it.
        assert receivers[0].version == 1 and checksum(models[0], "state_dict") == first
        assert receivers[1].version == 1 and receivers[1].torn
        dying.revive()
        with torch.no_grad():
            learner["b"].add_(1.0)
        send_all(senders)
        for r, model in zip(receivers, models, strict=True):
            assert r.version == 3 and not r.torn
            assert checksum(model, "state_dict") == checksum(learner, "state_dict")
    finally:
        close_all(receivers, senders)


# --- an FSDP2 learner over gloo, in spawned processes ----------------------------------


def _learner_and_workers(tmp_path: Any, ranks: int, mode: str, versions: int) -> None:
    from _sharded import run_plain_worker, run_rank
    from conftest import free_port

    endpoints = ipc_endpoints(tmp_path, ranks)
    with Processes() as procs:
        learners = procs.ranks(run_rank, free_port(), endpoints, (mode,))
        epochs = {a[1] for a in answers(learners, "ready")}
        assert len(epochs) == 1  # the ranks agreed on rank 0's epoch
        workers = [
            # Worker 2 writes each box into its model as it comes.
            procs.start(
                run_plain_worker, endpoints[0], w, after=(mode, "in_place" if w == 2 else "auto")
            )
            for w in range(3)
        ]
        connected = collective(learners, "connect")
        for c in workers:
            assert answer(c, "ready") == "ready"
        expected = connected[0][2]
        assert all(a[2] == expected for a in connected)  # the gathered model, on every rank
        for c in workers:
            assert ask(c, "state") == (0, expected)
        for version in range(1, versions + 1):
            # Collective: every rank sends its part of this version.
            sent = collective(learners, "send")
            assert {a[1] for a in sent} == {version}
            expected = sent[0][2]
            # send() returned on every rank: every worker acked, holding the whole version.
            for c in workers:
                assert ask(c, "state") == (version, expected)


@pytest.mark.timeout(120)
def test_a_rank_whose_peers_never_join_raises_in_time(tmp_path: Any) -> None:
    """Rank 1 never calls init_on_sender: rank 0's raises within its connect_timeout,
    not the process group's half hour."""
    from _sharded import run_rank
    from conftest import free_port

    port = free_port()
    endpoints = ipc_endpoints(tmp_path, 2)
    with Processes() as procs:
        conns = [
            procs.start(run_rank, r, 2, port, endpoints[r], after=("pubsub", r == 0, 2.0))
            for r in range(2)
        ]
        assert answer(conns[1], "ready")[0] == "ready"
        with pytest.raises(AssertionError, match="called init_on_sender within 2s"):
            answer(conns[0], "ready", timeout=60)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["pubsub", "router"])
def test_fsdp2_learner_of_two_ranks_and_three_plain_workers(tmp_path: Any, mode: str) -> None:
    _learner_and_workers(tmp_path, 2, mode, versions=3)


@pytest.mark.timeout(300)
def test_fsdp2_learner_of_four_ranks(tmp_path: Any) -> None:
    _learner_and_workers(tmp_path, 4, "pubsub", versions=2)


# --- one version across ranks: a rank that dies or stops ------------------------------

#: What a rank's send() waits in the fault tests before it raises.
_FAULT_TIMEOUT = 4.0


def _start_learner(procs: Processes, endpoints: list[str], mode: str) -> list[Any]:
    """The ranks of a new learner job (a new process group, a new epoch), ready."""
    from _sharded import run_rank
    from conftest import free_port

    after = (mode, True, 120.0, _FAULT_TIMEOUT)
    conns = procs.ranks(run_rank, free_port(), endpoints, after)
    answers(conns, "ready")
    return conns


def _whole_states(workers: list[Any], known: dict[int, str], last: dict[int, int]) -> None:
    """Every worker holds a whole version (the checksum of the gathered model of that
    version), never older than what it held before."""
    for w, c in enumerate(workers):
        version, digest = ask(c, "state")
        assert known.get(version) == digest, f"worker {w} holds a version never gathered"
        assert version >= last.get(w, 0), f"worker {w} went back to version {version}"
        last[w] = version


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
@pytest.mark.parametrize("dead", [1, 0])
def test_a_rank_that_dies_or_stops_makes_the_others_send_raise_naming_it(
    tmp_path: Any, fault: str, dead: int
) -> None:
    """Rank ``dead`` of 2 is killed (or stopped) while version 2 is on its way: the
    other's send() raises within its timeout, naming the dead rank and the workers; no
    worker applies the partial version. Back (SIGCONT), or the job restarted, the next
    send repairs all. Rank 0 is the one the workers were given, and may die too."""
    import os
    import signal
    import time

    from _faults import stop
    from _sharded import run_plain_worker

    endpoints = ipc_endpoints(tmp_path, 2)
    with Processes() as procs:
        learners = _start_learner(procs, endpoints, "pubsub")
        victim, alive = procs.procs[dead], 1 - dead
        # Worker 2 writes each box into its model as it comes: still nothing of a
        # version whose parts are not all in.
        workers = [
            procs.start(run_plain_worker, endpoints[0], w, after=("pubsub", mode))
            for w, mode in enumerate(["auto", "auto", "in_place"])
        ]
        known = {0: collective(learners, "connect")[0][2]}
        for c in workers:
            assert answer(c, "ready") == "ready"
        last: dict[int, int] = {}
        known[1] = collective(learners, "send")[0][2]
        _whole_states(workers, known, last)
        assert last == {0: 1, 1: 1, 2: 1}
        # Version 2's weights, on both ranks (a collective).
        known[2] = collective(learners, "bump")[0][2]

        if fault == "SIGKILL":
            os.kill(victim.pid, signal.SIGKILL)
            victim.join(10)
        else:
            stop(victim.pid)
        started = time.monotonic()
        reply = ask(learners[alive], "push")
        assert time.monotonic() - started < _FAULT_TIMEOUT + 10
        kind, version, missing_workers, missing_ranks, message, waited = reply
        assert (kind, version) == ("timeout", 2), reply
        assert waited < _FAULT_TIMEOUT + 2
        assert missing_workers == [0, 1, 2] and missing_ranks == [dead], message
        assert f"missing rank(s) {dead}" in message and "worker 0" in message, message
        _whole_states(workers, known, last)  # the partial version 2 applied nowhere
        assert last == {0: 1, 1: 1, 2: 1}

        if fault == "SIGSTOP":
            os.kill(victim.pid, signal.SIGCONT)
            # Back, it sends its part of version 2: every worker gathers it whole.
            assert ask(learners[dead], "push")[:2] == ("push", 2)
            for w, c in enumerate(workers):
                until(lambda c=c: ask(c, "state")[0] == 2, 30, f"worker {w} holds version 2")
            _whole_states(workers, known, last)
            sent = collective(learners, "send")  # the next version goes as ever, on every rank
            known[3] = sent[0][2]
            assert sent[1][:2] == ("send", 3)
            _whole_states(workers, known, last)
            assert last == {0: 3, 1: 3, 2: 3}
        else:
            # The job restarts: every rank anew (a new epoch), its version 1 sent whole.
            learners[alive].send("stop")
            procs.procs[alive].join(30)
            learners = _start_learner(procs, endpoints, "pubsub")
            collective(learners, "connect")
            sent = collective(learners, "send")
            restarted = sent[0][2]
            assert sent[1][:2] == ("send", 1)
            for c in workers:
                assert ask(c, "state") == (1, restarted)
