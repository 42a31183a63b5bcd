"""A sharded learner with ``delta=True``, ``wire_dtype=`` and metadata: each rank digests
and casts its own part, and workers gather the parts (deltas patched over the version
they hold, an unchanged rank's part one empty chunk) into one whole version.

The in-process tests run every rank as a :class:`WeightSender` over its own memory hub
(``RowsPart``: rank ``p`` of ``M`` holds rows ``[p*n//M, (p+1)*n//M)`` of each matrix)
and count each rank's bytes with its own counter; the gather's tests feed it chunks
(sans-IO, hypothesis among them); the last ones run an FSDP2 learner of two ranks in
spawned processes over gloo.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from _faults import until
from _sharded_fixtures import (
    DyingHub,
    Processes,
    RowsPart,
    answer,
    answers,
    ask,
    below_of,
    close_all,
    collective,
    fake_parts,
    fake_tensors,
    first_chunk,
    gathered_arrays,
    ipc_endpoints,
    on_every_rank,
    part_stream,
    rank_senders,
    send_all,
    sends,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from zmqsync import WeightReceiver, WeightSender, checksum
from zmqsync.chunking.parts import Held, Lost, PartGather, Placed, Skipped, Torn, Whole
from zmqsync.protocol import Chunk, WeightsSchema, encode_schema, layout_digest
from zmqsync.schemes.sharded import check_options
from zmqsync.transport.memory import MemoryHub, MemorySpoke

#: Chunks (and so digest blocks) of 64 KiB: a change of one row moves one block.
CHUNK = 64 * 1024


def _learner() -> dict[str, torch.Tensor]:
    """``w``: 64 rows of 16 KiB (each rank's half: 8 blocks); ``v``: 32 rows of 8 KiB;
    ``b``: a vector part 0 sends whole."""
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(64, 4096, generator=g),
        "v": torch.randn(32, 2048, generator=g),
        "b": torch.randn(100, generator=g),
    }


def _senders(
    model: Any, names: list[str], workers: int | None, **options: Any
) -> list[WeightSender]:
    """One sender per rank (rank ``r`` binds ``names[r]``), of one learner life."""
    return rank_senders(
        names, model, num_workers=workers, timeout=20, epoch=41, chunk_bytes=CHUNK, **options
    )


def _receiver(name: str, worker: int, **options: Any) -> WeightReceiver:
    """A worker given rank 0's endpoint alone, that reaches the other ranks itself."""
    return WeightReceiver(
        MemorySpoke(name),
        strategy="state_dict",
        worker_idx=worker,
        timeout=20,
        connect_rank=MemorySpoke,
        **options,
    )


def _sent(senders: list[WeightSender]) -> list[int]:
    """Every rank's bytes sent so far (its chunks' payloads, to every worker)."""
    return [int(s.status()["totals"]["bytes_sent"]) for s in senders]


# --- delta=True: what each rank sends, and what each worker ends with -------------------


@pytest.mark.timeout(120)
def test_each_rank_sends_only_the_changed_blocks_of_its_own_part() -> None:
    """Five workers (in place as parts come, staged, ``"auto"``, a sink, no model): a
    version that changes one row of rank 1's part moves one block from rank 1 and
    nothing from rank 0 (its one empty chunk completes the version), and every worker
    ends with the learner's weights, having applied it as a delta."""
    learner = _learner()
    names = ["memory://sd-bytes-0", "memory://sd-bytes-1"]
    senders = _senders(learner, names, 5, delta=True)
    models = [{k: torch.zeros_like(t) for k, t in learner.items()} for _ in range(3)]
    got: dict[str, torch.Tensor] = {}

    def keep(tensors: list[tuple[str, Any]]) -> None:
        got.update({k: t.clone() for k, t in tensors})

    receivers = [
        _receiver(names[0], 0, model=models[0], apply_mode="in_place"),
        _receiver(names[0], 1, model=models[1], apply_mode="staged"),
        _receiver(names[0], 2, model=models[2]),
        _receiver(names[0], 3, sink=keep),
        _receiver(names[0], 4),  # no model: its weights kept
    ]
    holds = [*models, got, None]
    workers = len(receivers)
    # Each rank's part: its rows of w and v (rank 0: and b).
    part = [(32 * 4096 + 16 * 2048) * 4 + (100 * 4 if r == 0 else 0) for r in range(len(names))]
    try:
        for r in receivers:
            r.connect(timeout=30)
            r.start()
        with torch.no_grad():
            for t in learner.values():
                t.add_(1.0)  # every block changed: each rank sends its part whole
        before = _sent(senders)
        send_all(senders)
        after = _sent(senders)
        assert [a - b for a, b in zip(after, before, strict=True)] == [workers * n for n in part]
        steps: list[tuple[str, int, int]] = [("w", 40, 1), ("w", 3, 0), ("v", 20, 1)]
        for version, (key, row, owner) in enumerate(steps, start=2):
            with torch.no_grad():
                learner[key][row, 5:9].add_(0.25)  # one row of one rank's part
            before = _sent(senders)
            send_all(senders)
            moved = [a - b for a, b in zip(_sent(senders), before, strict=True)]
            # The owner moved the one block that row lies in, to each worker: a tenth of
            # its part; the other rank moved nothing.
            assert moved[owner] == workers * CHUNK, moved
            assert moved[1 - owner] == 0, moved
            assert moved[owner] <= workers * part[owner] / 9
            assert all(r.version == version for r in receivers)
            expected = checksum(learner, "state_dict")
            assert checksum(receivers[4].weights, "state_dict") == expected
            for held in holds[:4]:
                assert checksum(held, "state_dict") == expected
        for r in receivers:
            assert r.stats["deltas"] == len(steps)
            assert r.stats["deltas_skipped"] == 0 and r.torn is False
        status = senders[1].status()["delta"]
        assert status["bases"] == [{"base": 3, "workers": workers, "bytes": CHUNK}]
    finally:
        close_all(receivers, senders)


@pytest.mark.timeout(120)
def test_a_worker_behind_or_late_gets_what_it_lacks_and_ends_exact() -> None:
    """Worker 1 misses version 2 (``worker_ids=[0]``): version 3 patches over the
    version 1 it holds. A worker that joins late gets every rank's part whole from its
    snapshot, then deltas like the others."""
    learner = _learner()
    names = ["memory://sd-late-0", "memory://sd-late-1", "memory://sd-late-2"]
    senders = _senders(learner, names, 2, delta=True)
    models = [{k: torch.zeros_like(t) for k, t in learner.items()} for _ in range(3)]
    receivers = [
        _receiver(names[0], 0, model=models[0]),
        _receiver(names[0], 1, model=models[1], apply_mode="staged"),
    ]
    try:
        for r in receivers:
            r.connect(timeout=30)
            r.start()
        send_all(senders)  # version 1: nothing changed, three empty parts
        assert [r.stats["deltas"] for r in receivers] == [1, 1]
        with torch.no_grad():
            learner["w"][10].add_(1.0)
        send_all(senders, worker_ids=[0])
        assert [r.version for r in receivers] == [2, 1]
        with torch.no_grad():
            learner["w"][50].add_(1.0)
        before = _sent(senders)
        send_all(senders)
        moved = [a - b for a, b in zip(_sent(senders), before, strict=True)]
        # Row 10 (part 0, changed in version 2) goes to worker 1 alone, which lacks it;
        # row 50 (part 2) to both; part 1 did not change. One block each time: a delta
        # per base held, each against the worker's own version.
        assert moved == [CHUNK, 0, 2 * CHUNK]
        expected = checksum(learner, "state_dict")
        assert [r.version for r in receivers] == [3, 3]
        assert [checksum(m, "state_dict") for m in models[:2]] == [expected, expected]
        late = _receiver(names[0], 2, model=models[2])
        receivers.append(late)
        late.connect(timeout=30)
        assert late.version == 3 and checksum(models[2], "state_dict") == expected
        assert late.stats["deltas"] == 0
        late.start()
        for s in senders:
            s.num_workers = 3
        with torch.no_grad():
            learner["v"][1].add_(1.0)
        send_all(senders)
        expected = checksum(learner, "state_dict")
        assert all(r.version == 4 for r in receivers)
        assert [checksum(m, "state_dict") for m in models] == [expected] * 3
        assert late.stats["deltas"] == 1
    finally:
        close_all(receivers, senders)


@pytest.mark.timeout(90)
def test_a_rank_that_dies_mid_delta_leaves_every_worker_whole_and_the_next_send_repairs() -> None:
    """Rank 1 dies after the first chunk of its delta of version 2: every rank's send
    raises naming rank 1; no worker applies version 2, and none is torn (a version of
    deltas is written only once every part is in, in place too). Back, version 3 comes
    as deltas against version 1 and every worker ends exact."""
    from zmqsync import SyncTimeout

    learner = _learner()
    names = ["memory://sd-dying-0", "memory://sd-dying-1"]
    dying = DyingHub(names[1])
    senders = rank_senders(
        names,
        learner,
        hubs={1: dying},
        num_workers=2,
        timeout=3,
        epoch=43,
        chunk_bytes=CHUNK,
        delta=True,
    )
    models = [{k: torch.zeros_like(t) for k, t in learner.items()} for _ in range(2)]
    receivers = [
        # A part broken off is given up on before send() raises.
        _receiver(names[0], i, model=models[i], apply_mode=mode, chunk_timeout=1.0)
        for i, mode in enumerate(["staged", "in_place"])
    ]
    try:
        for r in receivers:
            r.connect(timeout=30)
            r.start()
        with torch.no_grad():
            learner["w"][0].add_(1.0)
        send_all(senders)  # version 1: a delta of rank 0, an empty one of rank 1
        first = checksum(learner, "state_dict")
        with torch.no_grad():
            for row in (33, 45, 60):  # three blocks apart in rank 1's part: three chunks
                learner["w"][row].add_(1.0)
        dying.die(after=1)
        errors = sends(senders)
        assert len(errors) == 2 and all(isinstance(e, SyncTimeout) for e in errors), errors
        for e in errors:
            assert isinstance(e, SyncTimeout) and e.missing_ranks == [1], e
        for r, model in zip(receivers, models, strict=True):
            assert r.version == 1 and not r.torn
            assert checksum(model, "state_dict") == first
        dying.revive()
        with torch.no_grad():
            learner["b"].add_(1.0)  # rank 0's
        before = _sent(senders)
        send_all(senders)
        moved = [a - b for a, b in zip(_sent(senders), before, strict=True)]
        # Rank 1: its three blocks again (against version 1), to each worker.
        assert moved[1] == 2 * 3 * CHUNK and 0 < moved[0] <= 2 * CHUNK, moved
        for r, model in zip(receivers, models, strict=True):
            assert r.version == 3 and not r.torn and r.stats["deltas"] == 2
            assert checksum(model, "state_dict") == checksum(learner, "state_dict")
    finally:
        close_all(receivers, senders)


@pytest.mark.timeout(60)
def test_send_async_on_every_rank_with_delta() -> None:
    """``send_async`` on every rank returns once its part is copied (the weights may
    change then); ``wait_async`` on every rank completes the version, as a delta."""
    learner = _learner()
    names = ["memory://sd-async-0", "memory://sd-async-1"]
    senders = _senders(learner, names, 1, delta=True)
    model = {k: torch.zeros_like(t) for k, t in learner.items()}
    receivers = [_receiver(names[0], 0, model=model)]
    try:
        receivers[0].connect(timeout=30)
        receivers[0].start()
        for step in (1, 2):
            with torch.no_grad():
                learner["w"][10 * step].add_(1.0)  # rank 0's part
                learner["v"][16 + step].add_(1.0)  # rank 1's
            expected = checksum(learner, "state_dict")
            for s in senders:
                s.send_async()
            saved = learner["w"].clone()
            with torch.no_grad():
                learner["w"].add_(5.0)  # after the copies: not part of the version
            on_every_rank(senders, lambda rank, sender: sender.wait_async())
            assert receivers[0].version == step
            assert checksum(model, "state_dict") == expected
            with torch.no_grad():
                learner["w"].copy_(saved)
        assert receivers[0].stats["deltas"] == 2
    finally:
        close_all(receivers, senders)


@pytest.mark.timeout(120)
def test_a_relay_gathers_delta_parts_and_each_rank_sends_its_changed_blocks_once() -> None:
    """Two ranks with ``delta=True``, a relay (their one worker) and two workers below
    it (staged, in place): the relay patches each version's delta parts over the
    version it holds and sends the whole version on; each rank's egress is its changed
    blocks, once (to the relay alone), and every worker below ends exact."""
    from zmqsync.relay import Relay

    learner = _learner()
    names = ["memory://sd-relay-0", "memory://sd-relay-1"]
    senders = _senders(learner, names, None, delta=True)  # every live worker: the relay
    relay = Relay(
        MemorySpoke(names[0]),
        MemoryHub("memory://sd-relay-below"),
        strategy="state_dict",
        worker_idx=9,
        timeout=20,
        chunk_bytes=CHUNK,
        connect_rank=MemorySpoke,
    )
    models = [{k: torch.zeros_like(t) for k, t in learner.items()} for _ in range(2)]
    leaves: list[WeightReceiver] = []
    try:
        relay.connect()
        relay.start()
        for i, mode in enumerate(["staged", "in_place"]):
            leaves.append(
                WeightReceiver(
                    MemorySpoke("memory://sd-relay-below"),
                    model=models[i],
                    strategy="state_dict",
                    worker_idx=i,
                    timeout=20,
                    apply_mode=mode,
                )
            )
            leaves[-1].connect(timeout=30)
            leaves[-1].start()
        for s in senders:
            until(lambda s=s: {0, 1} <= below_of(s, 9), 20, "the relay claimed 0 and 1")
        for version, (row, owner) in enumerate([(3, 0), (50, 1)], start=1):
            with torch.no_grad():
                learner["w"][row, :8].add_(1.0)
            before = _sent(senders)
            send_all(senders)
            moved = [a - b for a, b in zip(_sent(senders), before, strict=True)]
            assert moved[owner] == CHUNK and moved[1 - owner] == 0, moved  # to the relay
            assert [leaf.version for leaf in leaves] == [version] * 2
            expected = checksum(learner, "state_dict")
            assert [checksum(m, "state_dict") for m in models] == [expected] * 2
        assert relay.receiver.stats["deltas"] == 2
    finally:
        for leaf in leaves:
            leaf.close()
        relay.close()
        for s in senders:
            s.close()


# --- wire_dtype: each rank casts its own part -------------------------------------------


def _mixed() -> dict[str, torch.Tensor]:
    """Floats of three dtypes split by rows, integers and a vector sent whole."""
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(256, 1024, generator=g) * 100,
        "d": torch.randn(9, 700, generator=g, dtype=torch.float64),
        "h": torch.randn(5, 300, generator=g).half(),
        "ints": torch.randint(-1000, 1000, (7, 11), generator=g),
        "b": torch.randn(333, generator=g),
    }


def _cast(model: dict[str, torch.Tensor], wire: torch.dtype) -> dict[str, torch.Tensor]:
    """What a worker holds of ``model`` sent as ``wire``: each float cast and back."""
    return {
        k: v.to(wire).to(v.dtype) if v.is_floating_point() and v.dtype != wire else v.clone()
        for k, v in model.items()
    }


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("delta", [False, True])
@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_parts_cast_by_each_rank_land_exactly_as_cast_back(wire: torch.dtype, delta: bool) -> None:
    """Each rank casts its own boxes to ``wire``; workers (in place, staged, a sink)
    assemble the cast parts and cast them back to their own dtypes, exactly as a plain
    learner's workers do; integers travel as they are, and the bytes moved are the
    floats at the wire's size."""
    learner = _mixed()
    names = ["memory://sd-wire-0", "memory://sd-wire-1"]
    senders = _senders(learner, names, 3, wire_dtype=wire, delta=delta)
    models = [{k: torch.zeros_like(t) for k, t in learner.items()} for _ in range(2)]
    got: dict[str, torch.Tensor] = {}

    def keep(tensors: list[tuple[str, Any]]) -> None:
        got.update({k: t.clone() for k, t in tensors})

    receivers = [
        _receiver(names[0], 0, model=models[0], apply_mode="in_place"),
        _receiver(names[0], 1, model=models[1], apply_mode="staged"),
        _receiver(names[0], 2, sink=keep),
    ]
    wire_bytes = sum(
        v.numel() * wire.itemsize if v.is_floating_point() else v.nbytes for v in learner.values()
    )
    try:
        for r in receivers:
            r.connect(timeout=30)
            r.start()
        for m in models:
            _same(m, _cast(learner, wire))  # version 0
        for version in (1, 2, 3):
            with torch.no_grad():
                if version == 3:
                    learner["w"][200].add_(1.0)  # rank 1's rows only
                else:
                    for t in learner.values():
                        t.add_(3)
            before = _sent(senders)
            send_all(senders)
            moved = sum(_sent(senders)) - sum(before)
            if version < 3 or not delta:
                # Every part whole, cast: the floats at the wire's size (and alignment).
                assert 3 * wire_bytes <= moved <= 3 * (wire_bytes + 2 * 64 * len(learner))
            else:
                # One block of rank 1's cast part (of five), to each worker.
                assert 3 * 1024 * wire.itemsize <= moved <= 3 * CHUNK
            expected = _cast(learner, wire)
            for r in receivers:
                assert r.version == version
                assert r.wire_dtype == str(wire).removeprefix("torch.")
            for held in (*models, got):
                _same(held, expected)
        assert all(s.status()["wire_dtype"] == str(wire).removeprefix("torch.") for s in senders)
        assert [r.stats["deltas"] for r in receivers] == [1 if delta else 0] * 3
    finally:
        close_all(receivers, senders)


# --- metadata -------------------------------------------------------------------------


def _send_tagged(senders: list[WeightSender], step: int) -> None:
    """One collective send, each rank tagging it with its own rank."""
    on_every_rank(senders, lambda rank, s: s.send(metadata={"step": step, "rank": rank}))


@pytest.mark.timeout(60)
def test_a_sharded_versions_metadata_is_rank_0s() -> None:
    """Every rank's send may carry metadata; a version's is rank 0's (the rank whose
    first chunk the gather keeps), seen by workers and late joiners alike."""
    learner = _learner()
    names = ["memory://sd-meta-0", "memory://sd-meta-1"]
    senders = _senders(learner, names, 1, delta=True)
    models = [{k: torch.zeros_like(t) for k, t in learner.items()} for _ in range(2)]
    receivers = [_receiver(names[0], 0, model=models[0])]
    try:
        receivers[0].connect(timeout=30)
        receivers[0].start()
        for step in (10, 20):
            with torch.no_grad():
                learner["w"][step + 30].add_(1.0)  # rank 1's part: rank 0's is empty
            _send_tagged(senders, step)
            assert receivers[0].metadata == {"step": step, "rank": 0}
            assert senders[0].status()["metadata"] == {"step": step, "rank": 0}
        send_all(senders)  # untagged: no stale tag
        assert receivers[0].version == 3 and receivers[0].metadata is None
        _send_tagged(senders, 40)
        late = _receiver(names[0], 1, model=models[1])
        receivers.append(late)
        late.connect(timeout=30)
        assert late.version == 4 and late.metadata == {"step": 40, "rank": 0}
        assert checksum(models[1], "state_dict") == checksum(learner, "state_dict")
    finally:
        close_all(receivers, senders)


# --- the gather of delta parts, sans-IO -------------------------------------------------


def _delta(
    schema: WeightsSchema,
    stream: bytes,
    spans: list[tuple[int, int]],
    version: int,
    base: int,
    epoch: int = 7,
) -> list[Chunk]:
    """A part's delta: stretches ``spans`` of its stream, a chunk each (one empty chunk
    if none), as a rank's ``delta=True`` sends it."""
    layout = layout_digest(encode_schema(schema))
    spans = spans or [(0, 0)]
    return [
        Chunk(
            "p",
            version,
            epoch,
            i,
            len(spans),
            offset,
            len(stream),
            layout,
            stream[offset : offset + n],
            schema if i == 0 else None,
            base=base,
        )
        for i, (offset, n) in enumerate(spans)
    ]


def _feed(gather: PartGather, part: int, chunks: list[Chunk], held: Any, **kw: Any) -> list[Any]:
    events: list[Any] = []
    for c in chunks:
        events += gather.feed(part, c, 0.0, held, **kw)
    return events


def _gather_whole(
    gather: PartGather, schemas: list[WeightsSchema], tensors: dict[str, np.ndarray]
) -> list[Any]:
    """Version 1 of epoch 7, every part whole, into ``gather``: its events."""
    events: list[Any] = []
    for p, schema in enumerate(schemas):
        events += gather.feed(p, first_chunk(schema, part_stream(schema, tensors)), 0, (0, 0))
    return events


def _versions() -> list[dict[str, np.ndarray]]:
    """Versions 1..4 of ``_tensors``' model, each changing a little of one part or two
    (``a``'s columns 0-1 are part 0's, 2-4 part 1's; ``b``'s 0-2 part 0's; ``s`` part 0's)."""
    v1 = fake_tensors(5)
    v2 = {k: t.copy() for k, t in v1.items()}
    v2["a"][1, 3] += 1  # part 1 only
    v3 = {k: t.copy() for k, t in v2.items()}
    v3["a"][0, 0] += 1  # part 0
    v3["b"][6] += 1  # part 1
    v4 = {k: t.copy() for k, t in v3.items()}
    v4["a"][2, 4] += 1  # part 1
    return [{}, v1, v2, v3, v4]


def _part_deltas(
    schemas: list[WeightsSchema], old: dict[str, np.ndarray], new: dict[str, np.ndarray]
) -> list[tuple[bytes, list[tuple[int, int]]]]:
    """Each part's stream of ``new`` and the 4-byte stretches that differ from ``old``."""
    out = []
    for schema in schemas:
        before, after = part_stream(schema, old), part_stream(schema, new)
        spans = [(i, 4) for i in range(0, len(after), 4) if before[i : i + 4] != after[i : i + 4]]
        out.append((after, spans))
    return out


@pytest.mark.timeout(30)
def test_delta_parts_patch_the_version_gathered_last_whole_or_not_at_all() -> None:
    """Version 2: part 0 unchanged (one empty chunk), part 1 one stretch. Version 3 has
    part 1 break off after its first stretch: nothing is given on, and its delta sent
    again completes it. Version 4 breaks off and version 5 (against 3) comes instead."""
    versions = _versions()
    schemas = fake_parts(versions[1], 2)
    gather = PartGather(2, gap=1.0)
    (whole,) = _gather_whole(gather, schemas, versions[1])
    assert isinstance(whole, Whole) and not whole.delta
    held = (7, 1)
    parts = _part_deltas(schemas, versions[1], versions[2])
    assert parts[0][1] == [] and len(parts[1][1]) == 1
    assert _feed(gather, 0, _delta(schemas[0], *parts[0], version=2, base=1), held) == []
    (whole,) = _feed(gather, 1, _delta(schemas[1], *parts[1], version=2, base=1), held)
    assert isinstance(whole, Whole) and whole.delta and whole.chunk.version == 2
    for key, t in gathered_arrays(whole.chunk).items():
        np.testing.assert_array_equal(t, versions[2][key])
    held = (7, 2)
    parts = _part_deltas(schemas, versions[2], versions[3])
    assert all(len(spans) == 1 for _, spans in parts)
    assert _feed(gather, 0, _delta(schemas[0], *parts[0], version=3, base=2), held) == []
    # Part 1's stretch of b, then a made-up second one that never comes.
    stream, spans = parts[1]
    broken = _delta(schemas[1], stream, [*spans, (len(stream) - 4, 4)], version=3, base=2)
    assert gather.feed(1, broken[0], 0.0, held) == []
    (lost,) = gather.expire(5.0)
    assert isinstance(lost, Lost) and lost.part == 1
    (whole,) = _feed(gather, 1, _delta(schemas[1], *parts[1], version=3, base=2), held)
    assert whole.delta and whole.chunk.version == 3
    for key, t in gathered_arrays(whole.chunk).items():
        np.testing.assert_array_equal(t, versions[3][key])
    held = (7, 3)
    parts = _part_deltas(schemas, versions[3], versions[4])
    assert _feed(gather, 0, _delta(schemas[0], *parts[0], version=4, base=3), held) == []
    stream, spans = parts[1]
    assert gather.feed(1, _delta(schemas[1], stream, [*spans, (0, 4)], 4, 3)[0], 0.0, held) == []
    # Version 5 (version 4's weights) begins: version 4's patches are dropped unwritten.
    assert _feed(gather, 1, _delta(schemas[1], *parts[1], version=5, base=3), held) == []
    (whole,) = _feed(gather, 0, _delta(schemas[0], *parts[0], version=5, base=3), held)
    assert whole.delta and whole.chunk.version == 5
    for key, t in gathered_arrays(whole.chunk).items():
        np.testing.assert_array_equal(t, versions[4][key])


@pytest.mark.timeout(30)
def test_a_delta_part_the_gather_cannot_patch_is_skipped() -> None:
    """Skipped (the whole part asked for), never applied: nothing gathered whole yet;
    a delta against a version the receiver lacks, or of another epoch; a receiver that
    wants whole versions (its model is torn); a layout other than the version held's;
    a receiver that does not hold the version the gather gave on last."""
    versions = _versions()
    schemas = fake_parts(versions[1], 2)
    part0 = _delta(schemas[0], part_stream(schemas[0], versions[2]), [], version=2, base=1)
    fresh = PartGather(2, gap=1.0)
    (skipped,) = _feed(fresh, 0, part0, (7, 1))
    assert isinstance(skipped, Skipped) and skipped.part == 0 and "not whole" in skipped.reason
    gather = PartGather(2, gap=1.0)
    _gather_whole(gather, schemas, versions[1])
    (held,) = _feed(gather, 0, part0, (7, 2))
    assert isinstance(held, Held)  # a delta of a version held: acked
    cases = [
        (_delta(schemas[0], b"\0" * 40, [], version=3, base=2), (7, 1), False, "against"),
        (_delta(schemas[0], b"\0" * 40, [], version=3, base=1, epoch=8), (7, 1), False, "against"),
        (part0, (7, 1), True, "torn"),
        (part0, (7, 0), False, "against"),
    ]
    for chunks, at, whole, why in cases:
        (skipped,) = _feed(gather, 0, chunks, at, whole=whole)
        assert isinstance(skipped, Skipped) and why in skipped.reason
    other = fake_parts({**versions[1], "a": np.zeros((3, 6), np.float32)}, 2)
    (skipped,) = _feed(gather, 0, _delta(other[0], b"\0" * 48, [], 2, 1), (7, 1))
    assert isinstance(skipped, Skipped) and "layout" in skipped.reason
    # A receiver that refused version 1 (it still holds version 0): a delta against 0
    # is not patched over the version 1 gathered.
    (skipped,) = _feed(gather, 0, _delta(schemas[0], b"\0" * 40, [], 2, 0), (7, 0))
    assert isinstance(skipped, Skipped) and "not whole" in skipped.reason
    assert not gather.active


@pytest.mark.timeout(30)
def test_delta_parts_in_place_land_only_once_every_part_is_in() -> None:
    """Written in place: a version of deltas asks where to write (the receiver then
    locks its model) only once its last part is in, and lands then, whole; one whose
    part breaks off is never written, so the model is not torn, and the part is asked
    for again. A part that comes whole lands as it comes."""
    versions = _versions()
    schemas = fake_parts(versions[1], 2)
    out = {k: np.zeros_like(t) for k, t in versions[1].items()}
    asked: list[int] = []

    def place(assembly: Any) -> list[np.ndarray]:
        asked.append(1)
        return [
            out[e.key[0]].reshape(-1).view(np.uint8).reshape(*e.shape, 4)
            for e in assembly.schema.entries
        ]

    gather = PartGather(2, gap=1.0, place=place)
    assert [type(e) for e in _gather_whole(gather, schemas, versions[1])] == [Placed]
    held = (7, 1)  # version 3, against version 1: both parts changed
    parts = _part_deltas(schemas, versions[1], versions[3])
    deltas = [_delta(schemas[p], *parts[p], version=3, base=1) for p in (0, 1)]
    # Part 1 breaks off after part 0 is in: nothing written, nothing torn.
    assert _feed(gather, 0, deltas[0], held) == []
    stream, spans = parts[1]
    broken = _delta(schemas[1], stream, [*spans, (len(stream) - 4, 4)], version=3, base=1)
    assert gather.feed(1, broken[0], 0.0, held) == [] and len(asked) == 1
    (lost,) = gather.expire(5.0)
    assert isinstance(lost, Lost) and lost.part == 1
    for key, t in out.items():
        np.testing.assert_array_equal(t, versions[1][key])
    (placed,) = _feed(gather, 1, deltas[1], held)
    assert isinstance(placed, Placed) and placed.delta and len(asked) == 2
    for key, t in out.items():
        np.testing.assert_array_equal(t, versions[3][key])
    # Version 4: part 1's delta, then part 0 whole (it lands as it comes, in place).
    held = (7, 3)
    parts = _part_deltas(schemas, versions[3], versions[4])
    assert _feed(gather, 1, _delta(schemas[1], *parts[1], version=4, base=3), held) == []
    whole0 = first_chunk(schemas[0], part_stream(schemas[0], versions[4]), version=4)
    (placed,) = gather.feed(0, whole0, 0.0, held)
    assert isinstance(placed, Placed) and placed.delta and len(asked) == 3
    for key, t in out.items():
        np.testing.assert_array_equal(t, versions[4][key])
    # Version 5 written in place, part 0 in: a delta of version 6 (against 4, the
    # version held) would be patched over a model version 5 half wrote: skipped.
    whole0 = first_chunk(schemas[0], part_stream(schemas[0], versions[1]), version=5)
    assert gather.feed(0, whole0, 0.0, (7, 4)) == [] and len(asked) == 3  # not laid out
    whole1 = part_stream(schemas[1], versions[1])
    layout1 = layout_digest(encode_schema(schemas[1]))
    head = Chunk("p", 5, 7, 0, 2, 0, len(whole1), layout1, whole1[:8], schemas[1])
    assert gather.feed(1, head, 0.0, (7, 4)) == [] and len(asked) == 4  # written in place
    (skipped,) = _feed(gather, 0, _delta(schemas[0], whole0.payload, [], 6, 4), (7, 4))
    assert isinstance(skipped, Skipped) and "written over" in skipped.reason


def _runs(before: bytes, after: bytes) -> list[tuple[int, int]]:
    """The 4-byte elements that differ, merged into runs: a delta's stretches."""
    runs: list[tuple[int, int]] = []
    for i in range(0, len(after), 4):
        if before[i : i + 4] != after[i : i + 4]:
            if runs and runs[-1][0] + runs[-1][1] == i:
                runs[-1] = (runs[-1][0], runs[-1][1] + 4)
            else:
                runs.append((i, 4))
    return runs


class _Worker:
    """A worker's side of the gather, simulated: what it holds, and every version
    given on; a part lost or skipped is sent again whole, as the worker asks."""

    def __init__(self, schemas: list[WeightsSchema], model: dict[str, np.ndarray] | None) -> None:
        self.schemas = schemas
        #: With a model, every version is written in place into its arrays.
        self.model = model
        self.gather = PartGather(len(schemas), gap=1.0, place=None if model is None else self.place)
        self.held, self.held_streams = (0, 0), [b""] * len(schemas)
        self.torn = False
        self.now = 0.0
        self.given_on: list[Whole | Placed] = []

    def place(self, assembly: Any) -> list[np.ndarray]:
        assert self.model is not None
        return [
            self.model[e.key[0]].reshape(-1).view(np.uint8).reshape(*e.shape, 4)
            for e in assembly.schema.entries
        ]

    def send(self, p: int, how: str, broken: bool, version: int, streams: list[bytes]) -> None:
        """Part ``p`` of ``version``: ``"whole"``, a ``"delta"`` against the version
        held, or one of another learner life (``"foreign"``: it cannot be patched)."""
        schema, stream = self.schemas[p], streams[p]
        if how == "whole":
            half = max(4, len(stream) // 2 // 4 * 4)
            spans = [(0, half), (half, len(stream) - half)]
            chunks = [
                dataclasses.replace(c, base=None) for c in _delta(schema, stream, spans, version, 0)
            ]
        elif how == "delta":
            runs = _runs(self.held_streams[p], stream)
            chunks = _delta(schema, stream, runs, version, self.held[1])
        else:
            chunks = _delta(schema, stream, [(0, 4)], version, self.held[1], epoch=8)
        if broken and len(chunks) > 1:
            chunks = chunks[:-1]
        events: list[Any] = []
        for c in chunks:
            events += self.gather.feed(p, c, self.now, self.held, whole=self.torn)
        if broken and self.gather.active:
            self.now += 5.0
            events += self.gather.expire(self.now)
        self.now += 0.01
        for e in events:
            if isinstance(e, Whole | Placed):
                self.given_on.append(e)
                self.torn = False
            elif isinstance(e, Lost | Skipped):
                self.send(e.part, "whole", False, version, streams)
            elif isinstance(e, Torn):
                self.torn = True  # every part again, whole
                for q in range(len(self.schemas)):
                    self.send(q, "whole", False, version, streams)
            else:
                assert isinstance(e, Held), e


@pytest.mark.timeout(120)
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_any_mix_of_whole_and_delta_parts_gives_on_exact_versions_only(data: Any) -> None:
    """Versions of random changes, each part sent whole or as a delta (against the
    version held, or one of another learner life), in any order, some breaking off
    before their last chunk and asked for again whole (every part, if the model written
    in place was torn): each version is given on once, exact, in a buffer or in place."""
    parts = data.draw(st.integers(2, 3), label="parts")
    current = fake_tensors(9)
    in_place = data.draw(st.booleans(), label="in place")
    model = {k: np.zeros_like(t) for k, t in current.items()} if in_place else None
    worker = _Worker(fake_parts(current, parts), model)
    for version in range(1, 5):
        new = {k: t.copy() for k, t in current.items()}
        for key, t in new.items():
            flat = t.reshape(-1)
            picks = data.draw(st.sets(st.integers(0, flat.size - 1), max_size=3), label=key)
            flat[sorted(picks)] += 1.0
        streams = [part_stream(schema, new) for schema in worker.schemas]
        worker.given_on = []
        for p in data.draw(st.permutations(range(parts)), label="order"):
            how = data.draw(
                st.sampled_from(["whole", "delta", "foreign"] if version > 1 else ["whole"])
            )
            worker.send(p, how, data.draw(st.booleans(), label="broken"), version, streams)
        (done,) = worker.given_on
        assert done.chunk.version == version and not worker.torn
        got = gathered_arrays(done.chunk) if model is None else model
        for key, t in got.items():
            np.testing.assert_array_equal(t, new[key])
        worker.held, worker.held_streams, current = (7, version), streams, new


def test_share_params_stays_refused_and_says_why() -> None:
    check_options({"delta": True, "wire_dtype": torch.bfloat16})  # supported
    with pytest.raises(ValueError, match="share_params= is not supported by a sharded"):
        check_options({"share_params": True})
    hub = MemoryHub("memory://sd-share")
    try:
        with pytest.raises(ValueError, match="share_params=True cannot serve a sharded"):
            WeightSender(
                hub,
                model=_learner(),
                strategy="state_dict",
                share_params=True,
                part=RowsPart(0, 2),  # type: ignore[arg-type]
                ranks=["memory://sd-share", "memory://sd-share-1"],
            )
    finally:
        hub.close()


# --- an FSDP2 learner of two ranks over gloo, in spawned processes ---------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["router", "pubsub"])
def test_fsdp2_learner_with_delta_and_a_wire_dtype(tmp_path: Any, mode: str) -> None:
    """Two FSDP2 ranks with ``delta=True`` and ``wire_dtype=bfloat16`` and two plain
    workers (one writes in place): each version ends on both workers with the gathered
    model cast to bfloat16 and back; a version that changes one row of one rank's shard
    moves one block from that rank and nothing from the other (over PUB/SUB, one
    delta reaches both workers)."""
    from _sharded import run_delta_rank, run_wide_worker
    from conftest import free_port

    endpoints = ipc_endpoints(tmp_path, 2)
    with Processes() as procs:
        learners = procs.ranks(run_delta_rank, free_port(), endpoints, (mode, "bfloat16"))
        assert len({a[1] for a in answers(learners, "ready")}) == 1
        workers = [
            procs.start(run_wide_worker, endpoints[0], w, after=(mode, apply_mode))
            for w, apply_mode in enumerate(["auto", "in_place"])
        ]
        replies = collective(learners, "connect")
        for c in workers:
            assert answer(c, "ready") == "ready"
            assert ask(c, "state")[:2] == (0, replies[0][2])
        sent = [a[3] for a in replies]
        # Version 1: every value changes (whole parts); then one row of rank 1's shard,
        # then one of rank 0's.
        for version, who in [(1, -1), (2, 1), (3, 0)]:
            replies = collective(learners, ("send", who))
            assert {a[1] for a in replies} == {version}
            assert replies[0][2] == replies[1][2]  # the gathered model, on every rank
            moved = [a[3] - s for a, s in zip(replies, sent, strict=True)]
            sent = [a[3] for a in replies]
            if who >= 0:
                # One row of 1024 bfloat16s: one 64 KiB block (two if it straddles
                # blocks), to each of the two workers; the other rank sends nothing.
                assert 0 < moved[who] <= 2 * 2 * CHUNK and moved[1 - who] == 0, moved
            else:
                assert all(m > 2 * 2 * CHUNK for m in moved), moved  # its part, whole
            for c in workers:
                state = ask(c, "state")
                assert state[:2] == (version, replies[0][2])
                assert state[2] == version - 1 and state[3] == "bfloat16"
