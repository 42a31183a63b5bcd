"""Per-version metadata: ``send(..., metadata={"step": 1234})`` tags a version, and every
worker that applies the version sees the tag (late joiners too, from the snapshot).

On the wire it rides in the version's first chunk, after the schema, so it never changes
the layout digest; a forged or oversized tag is refused and counted like any bad frame.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from zmqsync import WeightReceiver, WeightSender, checksum
from zmqsync.chunking.layout import MIN_CHUNK_BYTES
from zmqsync.errors import FrameError
from zmqsync.protocol import MAX_METADATA_BYTES, Chunk, decode, encode
from zmqsync.protocol.codec import FLAG_METADATA, HEADER, META_LEN
from zmqsync.tensors.version_messages import version_messages
from zmqsync.transport.memory import MemoryHub, MemorySpoke
from zmqsync.transport.zmq_router import RouterHub, RouterSpoke


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 512, generator=g), "b": torch.randn(512, generator=g)}


def _first_chunk(metadata: dict | None) -> list:  # type: ignore[type-arg]
    frames = version_messages(_model(0), chunk_bytes=MIN_CHUNK_BYTES)[0]
    chunk = decode([bytes(f) for f in frames])
    assert isinstance(chunk, Chunk)
    return encode(
        Chunk(
            chunk.model_id,
            chunk.version,
            chunk.epoch,
            0,
            chunk.count,
            0,
            chunk.total,
            chunk.layout,
            chunk.payload,
            chunk.schema,
            metadata=metadata,
        )
    )


def test_metadata_round_trips_in_the_first_chunk_without_changing_its_layout() -> None:
    tag = {"step": 1234, "loss": 0.5, "tags": ["a", "b"], "nested": {"ok": True}}
    plain, tagged = _first_chunk(None), _first_chunk(tag)
    decoded = decode([bytes(f) for f in tagged])
    assert isinstance(decoded, Chunk) and decoded.metadata == tag
    assert decoded.schema == decode([bytes(f) for f in plain]).schema  # type: ignore[union-attr]
    assert bytes(tagged[0])[-16:] == bytes(plain[0])[-16:]  # the same layout digest
    assert decode([bytes(f) for f in plain]).metadata is None  # type: ignore[union-attr]
    c = decode([bytes(f) for f in version_messages(_model(0), chunk_bytes=MIN_CHUNK_BYTES)[1]])
    assert isinstance(c, Chunk) and c.index == 1
    later = Chunk(c.model_id, 1, 1, 1, c.count, c.offset, c.total, c.layout, c.payload, metadata={})
    with pytest.raises(ValueError, match="only the first chunk"):
        encode(later)


@pytest.mark.parametrize(
    ("metadata", "error"),
    [
        ([1, 2], TypeError),
        ({1: "int key"}, TypeError),
        ({"tensor": torch.zeros(1)}, TypeError),
        ({"nan": math.nan}, ValueError),
        ({"big": "x" * MAX_METADATA_BYTES}, ValueError),
    ],
)
def test_metadata_that_cannot_travel_is_refused_before_any_work(metadata, error) -> None:  # type: ignore[no-untyped-def]
    hub = MemoryHub()
    sender = WeightSender(hub, model=_model(0), strategy="state_dict", num_workers=0, timeout=5)
    try:
        with pytest.raises(error):
            sender.send(metadata=metadata)
        assert sender.version == 0 and sender.status()["totals"]["versions_sent"] == 0
        sender.send(metadata={"step": 1})  # the sender stays usable
        assert sender.version == 1 and sender.status()["metadata"] == {"step": 1}
    finally:
        sender.close()


def _forged(tagged: list, body_tail: bytes, flags: int | None = None) -> list[bytes]:  # type: ignore[type-arg]
    """The tagged first chunk with its metadata (and length) replaced by ``body_tail``."""
    head, body, payload = (bytes(f) for f in tagged)
    (n,) = META_LEN.unpack_from(body, len(body) - META_LEN.size)
    body = body[: len(body) - META_LEN.size - n] + body_tail
    if flags is not None:
        fields = list(HEADER.unpack_from(head))
        fields[3] = flags
        head = HEADER.pack(*fields) + head[HEADER.size :]
    return [head, body, payload]


@pytest.mark.parametrize(
    ("tail", "match"),
    [
        (b"[1,2]" + META_LEN.pack(5), "JSON object"),
        (b"{nope" + META_LEN.pack(5), "not JSON"),
        (b"[" * 5000 + b"]" * 5000 + META_LEN.pack(10_000), "not JSON|JSON object"),
        (b"{}" + META_LEN.pack(MAX_METADATA_BYTES + 1), "over the limit"),
        (b"{}" + META_LEN.pack(1 << 31), "over the limit"),
        (b"", "metadata|schema"),
    ],
)
def test_forged_metadata_is_a_frame_error(tail: bytes, match: str) -> None:
    tagged = _first_chunk({"step": 1})
    with pytest.raises(FrameError, match=match):
        decode(_forged(tagged, tail))


def test_a_metadata_flag_on_a_later_chunk_is_a_frame_error() -> None:
    later = [bytes(f) for f in version_messages(_model(0), chunk_bytes=MIN_CHUNK_BYTES)[1]]
    fields = list(HEADER.unpack_from(later[0]))
    fields[3] |= FLAG_METADATA
    later[0] = HEADER.pack(*fields) + later[0][HEADER.size :]
    with pytest.raises(FrameError, match="flags"):
        decode(later)


@pytest.mark.parametrize("kind", ["memory", "tcp"])
def test_workers_and_late_joiners_see_each_versions_metadata(kind: str) -> None:
    if kind == "memory":
        hub = MemoryHub()

        def spoke(i: int):  # type: ignore[no-untyped-def]
            return MemorySpoke(hub.endpoint)
    else:
        hub = RouterHub("tcp://127.0.0.1:*")

        def spoke(i: int):  # type: ignore[no-untyped-def]
            return RouterSpoke(hub.endpoint, identity=str(i))

    model = _model(0)
    sender = WeightSender(
        hub, model=model, strategy="state_dict", num_workers=1, timeout=10, chunk_bytes=65536
    )
    workers = [_model(1), _model(2)]
    receivers = [
        WeightReceiver(spoke(i), model=w, strategy="state_dict", worker_idx=i)
        for i, w in enumerate(workers)
    ]
    try:
        receivers[0].connect(timeout=30)
        receivers[0].start()
        assert receivers[0].metadata is None  # version 0, published untagged
        for step in (100, 200):
            with torch.no_grad():
                model["w"].add_(1)
            sender.send(metadata={"step": step, "note": f"after step {step}"})
            assert receivers[0].metadata == {"step": step, "note": f"after step {step}"}
            assert sender.status()["metadata"] == {"step": step, "note": f"after step {step}"}
        sender.send()  # untagged: the worker's tag is not a stale one
        assert receivers[0].version == 3 and receivers[0].metadata is None
        sender.send(metadata={"step": 400})
        # A worker that joins later gets the latest version and its tag from the snapshot.
        receivers[1].connect(timeout=30)
        assert receivers[1].version == 4 and receivers[1].metadata == {"step": 400}
        assert checksum(workers[1]) == checksum(model) == checksum(workers[0])
        assert json.dumps(sender.status()["metadata"]) == '{"step": 400}'
    finally:
        for r in receivers:
            r.close()
        sender.close()
