"""``wire_dtype``: floating tensors travel cast (bf16, fp16, fp8), chunk by chunk, and
every worker casts them back to its own dtype; other dtypes travel as they are.

The expected values are exact: what a worker holds is ``x.to(wire).to(x.dtype)``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from zmqsync import WeightReceiver, WeightSender, checksum
from zmqsync.chunking.layout import StreamLayout
from zmqsync.errors import FrameError
from zmqsync.protocol import Chunk, decode, encode_schema
from zmqsync.protocol.codec import digest
from zmqsync.tensors.device_reader import DeviceReader
from zmqsync.tensors.flatten import Flat, Flattener
from zmqsync.tensors.version_messages import version_messages
from zmqsync.transport.memory import MemoryHub, MemorySpoke
from zmqsync.transport.zmq_router import RouterHub, RouterSpoke

CHUNK = 64 * 1024


def _model(seed: int) -> dict[str, torch.Tensor]:
    """Floats of three dtypes (big ones across chunk edges, 300 small ones), ints, bools."""
    g = torch.Generator().manual_seed(seed)
    out = {
        "big": torch.randn(256, 1024, generator=g) * 100,  # 1 MiB: 16 chunks
        "mid": torch.randn(50_001, generator=g),  # odd length: its edge falls mid-chunk
        "f64": torch.randn(3000, generator=g, dtype=torch.float64),
        "half": torch.randn(20_000, generator=g).half(),
        "ints": torch.randint(-1000, 1000, (3000,), generator=g),
        "mask": torch.rand(777, generator=g) > 0.5,
        "tiny": torch.randn(1, generator=g),
    }
    for i in range(300):
        out[f"small.{i}"] = torch.randn(7, generator=g)
    return out


def _expected(model: dict[str, torch.Tensor], wire: torch.dtype) -> dict[str, torch.Tensor]:
    return {
        k: v.to(wire).to(v.dtype) if v.is_floating_point() and v.dtype != wire else v.clone()
        for k, v in model.items()
    }


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)), k


def _bump(model: dict[str, torch.Tensor]) -> None:
    for t in model.values():
        if t.dtype == torch.bool:
            t.logical_not_()
        else:
            t.add_(3)


def _pair(kind: str):  # type: ignore[no-untyped-def]
    if kind == "memory":
        hub = MemoryHub()
        return hub, lambda i: MemorySpoke(hub.endpoint)
    hub = RouterHub("tcp://127.0.0.1:*")
    return hub, lambda i: RouterSpoke(hub.endpoint, identity=str(i))


@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("mode", ["in_place", "staged"])
@pytest.mark.parametrize("kind", ["memory", "tcp"])
def test_floats_travel_cast_and_land_exactly_as_cast_back(wire, mode: str, kind: str) -> None:  # type: ignore[no-untyped-def]
    model = _model(0)
    hub, spoke = _pair(kind)
    sender = WeightSender(
        hub, model=model, strategy="state_dict", num_workers=1, timeout=20, chunk_bytes=CHUNK,
        wire_dtype=wire,
    )  # fmt: skip
    worker = _model(1)
    receiver = WeightReceiver(
        spoke(0), model=worker, strategy="state_dict", worker_idx=0, apply_mode=mode
    )
    try:
        receiver.connect(timeout=30)
        receiver.start()
        _same(worker, _expected(model, wire))  # version 0
        for version in (1, 2):
            _bump(model)
            sender.send()
            assert receiver.version == version
            _same(worker, _expected(model, wire))
            assert receiver.wire_dtype == str(wire).removeprefix("torch.")
        status = sender.status()
        assert status["wire_dtype"] == str(wire).removeprefix("torch.")
        # Bytes on the wire: the floats at the wire's size, the others at their own.
        wire_bytes = sum(
            v.numel() * wire.itemsize if v.is_floating_point() else v.nbytes for v in model.values()
        )
        own_bytes = sum(v.nbytes for v in model.values())
        per_version = receiver.stats["received_bytes"] / 3
        assert wire_bytes <= per_version <= wire_bytes * 1.01 + 8192
        assert per_version < own_bytes * (0.6 if wire.itemsize == 2 else 0.4)
    finally:
        receiver.close()
        sender.close()


def test_a_late_joiner_and_a_plain_receiver_get_the_cast_version() -> None:
    model = _model(0)
    hub, spoke = _pair("memory")
    sender = WeightSender(
        hub, model=model, strategy="state_dict", num_workers=0, timeout=20, chunk_bytes=CHUNK,
        wire_dtype=torch.bfloat16,
    )  # fmt: skip
    try:
        _bump(model)
        sender.send()  # nobody yet: kept as the snapshot, in the wire dtype
        worker = _model(5)
        late = WeightReceiver(spoke(0), model=worker, strategy="state_dict", worker_idx=0)
        bare = WeightReceiver(spoke(1), strategy="state_dict", worker_idx=1)  # no model
        try:
            late.connect(timeout=30)
            bare.connect(timeout=30)
            assert late.version == bare.version == 1
            expected = _expected(model, torch.bfloat16)
            _same(worker, expected)
            _same(bare.weights, expected)  # fresh tensors, each of its own dtype
            assert checksum(worker) == checksum(bare.weights) != checksum(model)
        finally:
            late.close()
            bare.close()
    finally:
        sender.close()


def test_a_device_reader_casts_the_same_chunks_as_the_host_path() -> None:
    """A GPU learner casts each chunk on the device as it copies it off: checked on CPU
    tensors standing where a GPU's would be (the reader takes any device)."""
    model = _model(0)
    flattener = Flattener("state_dict", wire_dtype=torch.bfloat16)
    flat = flattener.flatten(model)
    layout = StreamLayout(flat, CHUNK)
    host = layout.sources(flat)
    on_device = Flat(
        flat.schema,
        flat.schema_bytes,
        [
            b if i in flat.casts else torch.frombuffer(bytearray(b), dtype=torch.uint8)
            for i, b in enumerate(flat.buffers)
        ],
        flat.nbytes,
        [],
        on_device=True,
        casts=flat.casts,
    )
    reader = layout.sources(on_device)
    assert isinstance(reader, DeviceReader) and flat.casts
    for i in [*range(layout.count), 3, 0]:
        _, length = layout.span(i)
        want, got = np.empty(length, np.uint8), np.full(length, 7, np.uint8)
        layout.write(i, host, want)
        layout.write(i, reader, got)
        assert np.array_equal(got, want), i
    reader.close()


def test_options_that_cannot_cast_are_refused_or_reported() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        WeightSender(MemoryHub(), strategy="state_dict", chunk_bytes=CHUNK + 8,
                     wire_dtype=torch.bfloat16)  # fmt: skip
    with pytest.raises(ValueError, match="wire_dtype must be one of"):
        Flattener("state_dict", wire_dtype=torch.int8)
    hub = MemoryHub()
    sender = WeightSender(
        hub, model=_model(0), strategy="state_dict", num_workers=0, timeout=5,
        share_params=True, wire_dtype=torch.float16,
    )  # fmt: skip
    try:
        sender.send()
        assert "wire_dtype" in sender.status()["share_params"]
    finally:
        sender.close()


def _schema_with(entry: list) -> tuple[bytes, bytes]:  # type: ignore[type-arg]
    body = json.dumps({"strategy": "state_dict", "tensors": [entry]}).encode()
    return body, digest(body)


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ([["w"], "int32", [4], 0, 0, 8, "bfloat16"], "cannot travel"),  # ints are not cast
        ([["w"], "float32", [4], 0, 0, 8, "int16"], "cannot travel"),  # not a wire dtype
        ([["w"], "float32", [4], 0, 0, 8, "float32"], "cannot travel"),  # cast to itself
        ([["w"], "float32", [4], 0, 0, 16, "bfloat16"], "nbytes"),  # its own size
        ([["w"], "float32", [4], 0, 1, 8, "bfloat16"], "misaligned"),
    ],
)
def test_forged_wire_entries_are_frame_errors(entry: list, match: str) -> None:  # type: ignore[type-arg]
    frames = version_messages({"w": torch.zeros(4)}, strategy="state_dict")[0]
    body, layout = _schema_with(entry)
    chunk = decode([bytes(f) for f in frames])
    assert isinstance(chunk, Chunk)
    from zmqsync.protocol.codec import CHUNK_BODY, HEADER

    head = bytes(frames[0])
    fields = list(HEADER.unpack_from(head))
    fields[-1] = layout
    total = entry[4] + entry[5]
    forged = [
        HEADER.pack(*fields) + head[HEADER.size :],
        CHUNK_BODY.pack(0, 1, 0, total, 0) + body,
        b"\0" * total,
    ]
    with pytest.raises(FrameError, match=match):
        decode(forged)
    # The honest form of the same entry decodes.
    ok = encode_schema(chunk.schema)  # type: ignore[arg-type]
    assert b"bfloat16" not in ok
