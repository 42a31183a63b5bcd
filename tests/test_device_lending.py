"""The parts of device lending (zmqsync.transport.cuda) that run without a GPU.

Versions written once into device memory and lent to workers on the learner's GPU
through CUDA IPC are tested end to end in ``tests/test_cuda.py`` (a GPU machine). Here:
the handle record and its bounds, the record a worker names its GPU with, a hub's
malformed handle refused by the worker, the device pool's lending rules (on CPU
tensors: the pool knows no device type), a chunk written device to device and one
applied from a tensor.
"""

from __future__ import annotations

import logging
import multiprocessing as mp

import numpy as np
import pytest
import torch

from zmqsync.chunking.layout import StreamLayout
from zmqsync.tensors.device_reader import DeviceReader
from zmqsync.tensors.flatten import Flattener
from zmqsync.tensors.in_place import InPlace
from zmqsync.transport.cuda import DEVICE_IDS, DeviceHandle, DevicePool
from zmqsync.transport.cuda.handles import MAX_HANDLE_BYTES, lendable
from zmqsync.transport.pipe import PipeSpoke
from zmqsync.transport.pipe.framing import DEVICE, HEADER
from zmqsync.transport.shm.records import RecordError, TakesDevice, decode, encode

pytestmark = pytest.mark.timeout(60)


def _handle(**change: object) -> DeviceHandle:
    fields: dict[str, object] = {
        "uuid": bytes(range(16)),
        "handle": b"h" * 64,
        "size": 1 << 20,
        "offset": 4096,
        "ref_handle": b"/torch_123_456",
        "ref_offset": 7,
        "event_handle": b"e" * 64,
        "event_sync": True,
    }
    fields.update(change)
    return DeviceHandle(**fields)  # type: ignore[arg-type]


def test_a_handle_travels_as_bytes_and_malformed_ones_are_refused() -> None:
    for handle in (_handle(), _handle(event_handle=b"", event_sync=False)):
        raw = handle.encode()
        assert len(raw) <= DeviceHandle.max_size()
        assert DeviceHandle.decode(raw) == handle
    raw = _handle().encode()
    for bad in (raw[:10], raw[:-1], raw + b"x"):
        with pytest.raises(ValueError):
            DeviceHandle.decode(bad)
    with pytest.raises(ValueError, match="limits"):
        DeviceHandle.decode(_handle(handle=b"h" * (MAX_HANDLE_BYTES + 1)).encode())


def test_a_worker_names_its_gpu_in_a_record_of_fixed_size() -> None:
    record = TakesDevice(bytes(range(16)))
    assert decode(encode(record)) == record
    with pytest.raises(RecordError):
        decode(encode(record) + b"x")
    # Only GPUs are lent through their handles.
    assert not lendable("cpu") and not lendable(None) and lendable("cuda:0")


def test_a_worker_refuses_a_device_block_it_cannot_open(caplog: pytest.LogCaptureFixture) -> None:
    """A hub's handle record that is malformed (or names a GPU the worker does not see)
    ends that pipe on the worker's side: logged, nothing raised, nothing received."""
    hub_end, worker_end = mp.Pipe()
    spoke = PipeSpoke(worker_end)
    try:
        hub_end.send_bytes(HEADER.pack(DEVICE, DEVICE_IDS))
        hub_end.send_bytes(b"not a handle")
        with caplog.at_level(logging.WARNING, logger="zmqsync.transport.pipe"):
            assert spoke.recv_frames(1.0) is None
        assert "cannot be opened" in caplog.text
        # A well-formed handle of a GPU this process does not have: refused alike.
        hub_end2, worker_end2 = mp.Pipe()
        spoke2 = PipeSpoke(worker_end2)
        try:
            hub_end2.send_bytes(HEADER.pack(DEVICE, DEVICE_IDS))
            hub_end2.send_bytes(_handle().encode())
            assert spoke2.recv_frames(1.0) is None
        finally:
            spoke2.close()
            hub_end2.close()
    finally:
        spoke.close()
        hub_end.close()


def test_the_device_pool_lends_each_block_again_only_once_free() -> None:
    pool = DevicePool(max_blocks=2, keep_free=1)
    try:
        lent = pool.lend_on(1000, torch.device("cpu"))
        assert lent is not None
        block, view = lent
        assert block.id >= DEVICE_IDS and view.numel() == 1000
        assert pool.locate(view[10:20]) == (block, 10)
        assert pool.locate(torch.empty(10, dtype=torch.uint8)) is None
        assert not block.free()  # the view is alive
        second = pool.lend_on(1000, torch.device("cpu"))
        assert second is not None and second[0] is not block
        assert pool.lend_on(1000, torch.device("cpu")) is None  # both busy, at the bound
        assert pool.fallbacks == 1
        del second
        peer = object()
        assert pool.lease(block, peer)
        del view, lent
        assert not block.free()  # leased
        assert pool.release(block.id, peer) and block.free()
        again = pool.lend_on(900, torch.device("cpu"))
        assert again is not None and again[0] is block  # reused: it fits
        pool.forget(peer)
    finally:
        pool.close()


def _tensors() -> dict[tuple[str, ...], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {("small", str(i)): torch.randn(7, generator=g) for i in range(40)}
    out[("big",)] = torch.randn(300, 200, generator=g)
    out[("half",)] = torch.randn(128, 64, generator=g).to(torch.bfloat16)
    return out


def test_a_chunk_written_device_to_device_has_the_stream_bytes() -> None:
    """The learner's write into device memory (here, CPU tensors: the reader knows no
    device type) gives each chunk the same bytes as the write into host memory."""
    flat = Flattener("state_dict").flatten(_tensors())
    layout = StreamLayout(flat, 20_000)
    host = layout.sources(flat)
    buffers = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in flat.buffers]
    reader = DeviceReader(layout, buffers)
    for i in range(layout.count):
        _, length = layout.span(i)
        want = np.empty(length, np.uint8)
        layout.write(i, host, want)
        got = torch.full((length,), 255, dtype=torch.uint8)  # gaps are zeroed
        layout.write(i, reader, got)
        assert np.array_equal(got.numpy(), want), i


def test_a_worker_applies_chunks_lent_as_tensors() -> None:
    sent = _tensors()
    flat = Flattener("state_dict").flatten(sent)
    layout = StreamLayout(flat, 20_000)
    stream = np.empty(layout.total, np.uint8)
    sources = layout.sources(flat)
    for i in range(layout.count):
        offset, length = layout.span(i)
        layout.write(i, sources, stream[offset : offset + length])
    target = {k: torch.zeros_like(v) for k, v in sent.items()}
    target[("big",)] = torch.zeros(200, 300).t()  # not contiguous
    plan = InPlace(layout.schema, target, "state_dict")
    device_stream = torch.from_numpy(stream)
    for i in range(layout.count):
        offset, length = layout.span(i)
        plan.apply(offset, device_stream[offset : offset + length])
    plan.finish()
    for key, value in sent.items():
        assert torch.equal(target[key], value), key
