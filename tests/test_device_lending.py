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
import os
import signal
from multiprocessing.connection import Connection

import numpy as np
import pytest
import torch
from _device_standin import CpuIpc, run_worker_on_the_device, run_worker_that_cannot_open
from _workers import bump, make_model

import zmqsync
from zmqsync import SyncTimeout
from zmqsync.chunking.layout import StreamLayout
from zmqsync.schemes.multiprocess import MultiProcessWeightSyncScheme
from zmqsync.tensors.device_reader import DeviceReader
from zmqsync.tensors.flatten import Flattener
from zmqsync.tensors.in_place import InPlace
from zmqsync.transport.cuda import DEVICE_IDS, DeviceHandle, DevicePool, handles
from zmqsync.transport.cuda.handles import IPC, MAX_HANDLE_BYTES
from zmqsync.transport.pipe import PipeSpoke
from zmqsync.transport.pipe.framing import DEVICE, HEADER, socket_of, write_lease, write_message
from zmqsync.transport.shm.records import (
    MAX_DEVICE_HANDLE,
    NO_DEVICE,
    DeviceGrant,
    Entry,
    Lease,
    Leave,
    RecordError,
    Release,
    TakesDevice,
    decode,
    encode,
    is_record,
)

pytestmark = pytest.mark.timeout(60)

SPAWN = mp.get_context("spawn")


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


def test_a_device_blocks_handle_for_one_peer_is_a_bounded_record() -> None:
    """Where no pipe passes a device block's handle on its own (Ray calls), it travels
    as a record: the block, the hub's pid and the encoded handle, bounded."""
    raw = _handle().encode()
    assert DeviceHandle.max_size() <= MAX_DEVICE_HANDLE
    grant = DeviceGrant(DEVICE_IDS + 2, 4321, raw)
    assert decode(encode(grant)) == grant
    assert is_record([encode(grant)])
    frame = encode(grant)
    for bad in (frame[:20], frame[: -len(raw)], frame + b"x" * MAX_DEVICE_HANDLE):
        with pytest.raises(RecordError):
            decode(bad)


def test_a_worker_names_its_gpu_in_a_record_of_fixed_size() -> None:
    record = TakesDevice(bytes(range(16)))
    assert decode(encode(record)) == record
    with pytest.raises(RecordError):
        decode(encode(record) + b"x")
    # Only GPUs are lent through their handles.
    assert not IPC.lendable("cpu") and not IPC.lendable(None) and IPC.lendable("cuda:0")


def _record(conn: Connection) -> object:
    assert conn.poll(5), "nothing came from the worker"
    return decode(conn.recv_bytes())


@pytest.mark.parametrize("handle", [b"not a handle", _handle().encode()])
def test_a_worker_refuses_a_device_block_it_cannot_open(
    handle: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """A handle record that is malformed, or of a GPU this process does not see: the
    worker logs it, tells its hub it takes no device blocks, releases the lease of a
    message that lies in that block (the message is lost, its version repaired), and
    its pipe goes on working."""
    hub_end, worker_end = mp.Pipe()
    spoke = PipeSpoke(worker_end)
    try:
        hub_end.send_bytes(HEADER.pack(DEVICE, DEVICE_IDS))
        hub_end.send_bytes(handle)
        entry = Entry(DEVICE_IDS, size=1 << 20, offset=0, length=4096)
        write_lease(hub_end, Lease(0, (entry,), live=(DEVICE_IDS,)))
        with caplog.at_level(logging.WARNING, logger="zmqsync.transport.pipe"):
            assert spoke.recv_frames(1.0) is None
        assert "cannot be opened here" in caplog.text
        assert _record(hub_end) == TakesDevice(NO_DEVICE)
        assert _record(hub_end) == Release((DEVICE_IDS,))
        assert spoke.counters()["unread_device"] == 1
        write_message(hub_end, [b"still", b"here"])
        raw = socket_of(hub_end, "the hub's end")
        raw.sendall(b"stillhere")  # a message's frames follow its records raw
        raw.close()
        assert [bytes(f) for f in spoke.recv_frames(5.0) or []] == [b"still", b"here"]
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


# --- end to end, with CPU shared memory standing in for CUDA IPC ---------------------


def _over_pipes(fleet, model, targets, timeout: float = 30.0, **options):  # type: ignore[no-untyped-def]
    """A ``MultiProcessWeightSyncScheme`` to one pipe worker per entry point of
    ``targets`` (each a 32 MiB model), ready when it returns."""
    pipes = [SPAWN.Pipe() for _ in targets]
    scheme = MultiProcessWeightSyncScheme(timeout=timeout, **options)
    scheme.init_on_sender(
        "policy", pipes=[p for p, _ in pipes], model=model, num_workers=len(targets)
    )
    try:
        for i, ((_, child), target) in enumerate(zip(pipes, targets, strict=True)):
            kwargs = {"pipe": child, "worker_idx": None}
            fleet.start(scheme, i, kind="big", init_kwargs=kwargs, target=target)
            child.close()
        for i in range(len(targets)):
            fleet.wait_ready(i, timeout=120)
    except BaseException:
        scheme.shutdown()
        raise
    return scheme


def _chunks(fleet, workers: int) -> list[int]:  # type: ignore[no-untyped-def]
    return [fleet.ask(i, "state")["stats"]["device_chunks"] for i in range(workers)]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_versions_go_through_device_blocks_to_workers_on_the_learners_device(
    fleet, on_the_stand_in: None
) -> None:  # type: ignore[no-untyped-def]
    model = make_model("big", seed=0)
    scheme = _over_pipes(fleet, model, [run_worker_on_the_device] * 2)
    try:
        before = _chunks(fleet, 2)
        # More versions than device blocks: each is lent again once released.
        states = fleet.each_version_exact(scheme, model, workers=2, versions=6)
        lent = [s["stats"]["device_chunks"] - b for s, b in zip(states, before, strict=True)]
        assert lent == [6, 6]  # each version one chunk, lent on the device
        counters = scheme.get_sender().transport.counters()
        assert 32 << 20 <= counters["device_bytes"] <= 3 * (33 << 20)
        assert counters["bad_releases"] == counters["peers_lost"] == 0
        bump(model)  # not sent: no worker sees it
        assert [fleet.ask(i, "state")["checksum"] for i in range(2)] == [
            s["checksum"] for s in states
        ]
    finally:
        scheme.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_worker_off_the_device_joins_and_is_sent_host_bytes(fleet, on_the_stand_in: None) -> None:  # type: ignore[no-untyped-def]
    """A worker whose model is not on the learner's device joins late: it is sent the
    latest version, held in a device block, as host bytes; then every version goes
    through the host's shared memory, to every worker, whole."""
    model = make_model("big", seed=0)
    scheme = _over_pipes(fleet, model, [run_worker_on_the_device] * 2)
    try:
        fleet.each_version_exact(scheme, model, workers=2, versions=2)
        hub_end, child = SPAWN.Pipe()
        fleet.start(scheme, 2, kind="big", init_kwargs={"pipe": child, "worker_idx": None})
        child.close()
        scheme.add_pipe(hub_end, 2)
        fleet.wait_ready(2, timeout=120)
        late = fleet.all_hold(3, (2, zmqsync.checksum(model)))[2]
        assert late["stats"]["device_chunks"] == 0
        before = _chunks(fleet, 3)
        bump(model)
        scheme.send()
        fleet.all_hold(3, (3, zmqsync.checksum(model)))
        assert _chunks(fleet, 3) == before
        assert scheme.get_sender().transport.counters()["bad_releases"] == 0
    finally:
        scheme.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_worker_that_cannot_open_the_blocks_gets_every_version_through_the_host(
    fleet, on_the_stand_in: None
) -> None:  # type: ignore[no-untyped-def]
    """A worker that names the learner's device but cannot open its blocks (a confused
    peer): it loses the message that lay in one, says it takes none, is repaired
    through the host, and so is every later version; the other worker keeps its own."""
    model = make_model("big", seed=0)
    scheme = _over_pipes(fleet, model, [run_worker_on_the_device, run_worker_that_cannot_open])
    try:
        for version in range(1, 4):
            bump(model)
            scheme.send()
            fleet.all_hold(2, (version, zmqsync.checksum(model)))
        confused = fleet.ask(1, "state")
        assert confused["stats"]["device_chunks"] == 0
        assert confused["transport"]["unread_device"] >= 1
        counters = scheme.get_sender().transport.counters()
        assert counters["peers_lost"] == 0 and counters["bad_releases"] == 0
    finally:
        scheme.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_stopped_worker_pins_a_bounded_number_of_device_blocks(
    fleet, on_the_stand_in: None
) -> None:  # type: ignore[no-untyped-def]
    """A worker stopped (SIGSTOP) while versions keep coming holds the device blocks it
    was leased: the pool lends no more than its bound (then versions go through the
    host's shared memory), the others hold every version whole, and once continued the
    stopped one catches up with the latest."""
    model = make_model("big", seed=0)
    scheme = _over_pipes(fleet, model, [run_worker_on_the_device] * 3, timeout=3.0)
    try:
        fleet.each_version_exact(scheme, model, workers=3, versions=1)
        os.kill(fleet.procs[2].pid, signal.SIGSTOP)
        try:
            for version in range(2, 7):
                bump(model)
                with pytest.raises(SyncTimeout) as missed:
                    scheme.send()
                assert set(missed.value.missing_workers) == {2}
                fleet.all_hold(2, (version, zmqsync.checksum(model)))
                counters = scheme.get_sender().transport.counters()
                assert counters["device_bytes"] <= 3 * (33 << 20)  # the pool's bound
        finally:
            os.kill(fleet.procs[2].pid, signal.SIGCONT)
        bump(model)
        scheme.send()
        fleet.all_hold(3, (7, zmqsync.checksum(model)))
        counters = scheme.get_sender().transport.counters()
        assert counters["peers_lost"] == 0 and counters["bad_releases"] == 0
    finally:
        scheme.shutdown()


class _NoRoom(CpuIpc):
    """A device with no room left for a block."""

    def allocate(self, nbytes: int, device: torch.device) -> torch.Tensor:
        raise torch.OutOfMemoryError("out of memory (the stand-in's)")


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("why", ["turned off", "no room"])
def test_versions_go_through_the_host_when_no_device_memory_is_lent(
    why: str,
    fleet,  # type: ignore[no-untyped-def]
    on_the_stand_in: None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``device_memory=False``, or a device with no room for a block (the learner's own
    work comes first): every version goes through the host, whole, and the hub says
    why."""
    options = {"device_memory": False} if why == "turned off" else {}
    if why == "no room":
        monkeypatch.setattr(handles, "IPC", _NoRoom())
    model = make_model("big", seed=0)
    scheme = _over_pipes(fleet, model, [run_worker_on_the_device] * 2, **options)
    try:
        with caplog.at_level(logging.WARNING, logger="zmqsync.transport.cuda"):
            states = fleet.each_version_exact(scheme, model, workers=2, versions=3)
        assert [s["stats"]["device_chunks"] for s in states] == [0, 0]
        counters = scheme.get_sender().transport.counters()
        if why == "turned off":
            assert "device_bytes" not in counters
        else:
            assert counters["device_bytes"] == 0 and counters["device_refused"] >= 3
            assert caplog.text.count("no device block") == 1  # said once
    finally:
        scheme.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_killed_worker_lets_go_of_its_device_blocks(fleet, on_the_stand_in: None) -> None:  # type: ignore[no-untyped-def]
    """A worker SIGKILLed while it is lent device blocks: its pipe breaks, the hub
    forgets its leases (its blocks are lent again), and the living worker keeps
    getting every version through device memory."""
    model = make_model("big", seed=0)
    scheme = _over_pipes(fleet, model, [run_worker_on_the_device] * 2, timeout=10.0)
    try:
        fleet.each_version_exact(scheme, model, workers=2, versions=2)
        fleet.kill(1)
        bump(model)
        with pytest.raises(SyncTimeout) as missed:
            scheme.send()
        assert missed.value.missing_workers == [1]
        before = fleet.ask(0, "state")["stats"]["device_chunks"]
        for version in range(4, 10):  # more versions than device blocks
            bump(model)
            scheme.send(worker_ids=[0])
            state = fleet.ask(0, "state")
            assert (state["version"], state["checksum"]) == (version, zmqsync.checksum(model))
        assert fleet.ask(0, "state")["stats"]["device_chunks"] - before == 6
        counters = scheme.get_sender().transport.counters()
        assert counters["peers_lost"] == 1 and counters["device_bytes"] <= 3 * (33 << 20)
    finally:
        scheme.shutdown()


def test_a_ray_hubs_lending_believes_a_gpu_only_from_its_actor_and_grants_once(
    on_the_stand_in: None,
) -> None:
    """The Ray hub's lending, alone: an actor's GPU as it said (forgotten when it
    answers an offer anew, or says it takes none), a handle of each device block given
    to each actor once, and records only a hub sends counted, not believed."""
    from zmqsync.transport.ray.lending import ActorLending

    lending = ActorLending()
    try:
        device = torch.device("cpu")
        lending.on_reply(0, encode(TakesDevice(b"another gpu 1234")))
        assert not lending.takes(0, device)  # another GPU
        lending.on_reply(0, encode(TakesDevice(handles.IPC.uuid_of(device))))
        assert lending.takes(0, device)
        block = lending.lend_device(1 << 20, device)
        assert block is not None
        payload = lending.payload([b"head", block])
        assert payload is not None and payload.device == handles.IPC.uuid_of(device)
        del block
        first = lending.grants(0, payload)
        assert len(first) == 1 and isinstance(decode(first[0][0]), DeviceGrant)
        assert lending.grants(0, payload) == []  # once per actor
        assert len(lending.grants(1, payload)) == 1  # each actor its own handle
        lending.on_reply(0, encode(DeviceGrant(DEVICE_IDS, 1, b"h" * 8)))  # a hub's record
        assert lending.bad_releases == 1
        lending.on_reply(0, encode(TakesDevice(NO_DEVICE)))
        assert not lending.takes(0, device)
        lending.on_reply(1, encode(TakesDevice(handles.IPC.uuid_of(device))))
        lending.on_reply(1, encode(Leave()))  # it answers an offer anew: it starts afresh
        assert not lending.takes(1, device)
        assert len(lending.grants(1, payload)) == 1
    finally:
        lending.close()
