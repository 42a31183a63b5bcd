"""Weights that live on a GPU, end to end: a CUDA learner, CUDA workers, and both mixed
with CPU ones, over every transport that runs in a single host.

These tests need a CUDA device; where there is none (CI's machines) they are skipped,
since nothing can stand in for a GPU. The CPU paths they share are covered everywhere.
"""

from __future__ import annotations

import multiprocessing
import time

import numpy as np
import pytest
import torch
from _wire import through_the_wire
from _workers import bump, make_model
from test_tensors import ALL_DTYPES

import zmqsync
from zmqsync import ZMQWeightSyncScheme
from zmqsync.errors import SchemaMismatchError
from zmqsync.protocol import Weights
from zmqsync.tensors.apply import ApplyPlan
from zmqsync.tensors.flatten import Flattener

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.cuda,
]


def _weights(device: str) -> dict[tuple[str, ...], torch.Tensor]:
    """Every dtype, 0-d, empty and non-contiguous tensors, 300 small ones and big ones."""
    g = torch.Generator().manual_seed(0)
    out: dict[tuple[str, ...], torch.Tensor] = {}
    for i, dtype in enumerate(ALL_DTYPES):
        raw = torch.randint(0, 256, (37 + i, 3), dtype=torch.uint8, generator=g)
        size = torch.empty((), dtype=dtype).element_size()
        out[("dtype", str(dtype))] = raw.view(-1)[: (raw.numel() // size) * size].view(dtype)
    out[("scalar",)] = torch.tensor(3.5)
    out[("empty",)] = torch.empty(0, 4)
    out[("transposed",)] = torch.randn(64, 48, generator=g).t()  # non-contiguous
    for i in range(300):
        out[("small", str(i))] = torch.randn(17, generator=g)
    out[("big", "a")] = torch.randn(512, 256, generator=g)  # 512 KB: a frame of its own
    out[("big", "b")] = torch.randn(300, 300, generator=g).to(torch.bfloat16)
    return {k: v.to(device) for k, v in out.items()}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, as a view."""
    return t.view(-1).view(torch.uint8)


def _wire(flat) -> Weights:  # type: ignore[no-untyped-def]
    return through_the_wire(flat)


def _apply(message: Weights, dest: dict) -> None:  # type: ignore[type-arg]
    """Apply ``message`` as a worker does: planned from the schema it came with (the
    stream's layout, not the learner's flat buffers)."""
    ApplyPlan(message.schema, dest, "state_dict").apply(message)


def _equal(a: dict, b: dict) -> None:  # type: ignore[type-arg]
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k].cpu(), b[k].cpu()
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert torch.equal(
            x.contiguous().view(-1).view(torch.uint8), y.contiguous().view(-1).view(torch.uint8)
        ), k


@pytest.mark.parametrize("source", ["cuda", "cpu"])
@pytest.mark.parametrize("target", ["cuda", "cpu"])
def test_flatten_and_apply_across_devices(source: str, target: str) -> None:
    sent = _weights(source)
    flat = Flattener("state_dict").flatten(sent)
    # From a GPU the Flat is a private host copy: no second copy for the snapshot.
    assert flat.owned is (source == "cuda")
    if flat.owned:
        assert all(isinstance(b, memoryview) and b.readonly for b in flat.buffers)
    dest = {k: torch.zeros_like(v, device=target) for k, v in _weights(target).items()}
    dest[("transposed",)] = torch.zeros(64, 48, device=target).t()  # non-contiguous target
    _apply(_wire(flat), dest)
    _equal(dest, sent)


@pytest.mark.parametrize("chunk_bytes", [4096, 1 << 20])
def test_a_sender_reads_chunks_off_the_gpu_with_the_same_bytes(chunk_bytes: int) -> None:
    """What a CUDA learner sends: each chunk copied off the GPU as it is written (pinned
    slots, a copy stream), the same bytes as staging the whole version first."""
    from zmqsync.chunking.layout import StreamLayout
    from zmqsync.tensors.device_reader import DeviceReader

    sent = _weights("cuda")
    flattener = Flattener("state_dict")
    staged = flattener.flatten(sent)
    lazy = flattener.flatten(sent, stage=False)
    assert lazy.on_device and all(b.device.type == "cuda" for b in lazy.buffers)
    layout = StreamLayout(staged, chunk_bytes)
    assert StreamLayout(lazy, chunk_bytes).schema == layout.schema
    host, reader = layout.sources(staged), layout.sources(lazy)
    assert isinstance(reader, DeviceReader)
    for i in range(layout.count):
        _, length = layout.span(i)
        want, got = np.empty(length, np.uint8), np.empty(length, np.uint8)
        layout.write(i, host, want)
        layout.write(i, reader, got)
        assert np.array_equal(got, want), i
    reader.close()
    assert reader.nbytes <= 2 * chunk_bytes


def test_a_staged_flat_does_not_follow_later_changes() -> None:
    sent = _weights("cuda")
    flattener = Flattener("state_dict")
    flat = flattener.flatten(sent)
    before = {k: v.clone() for k, v in sent.items()}
    for v in sent.values():
        if v.numel() and v.dtype != torch.bool and v.is_contiguous():
            _bytes(v).add_(1)  # bytewise: some dtypes (float8) have no add on CUDA
    dest = {k: torch.zeros_like(v) for k, v in sent.items()}
    _apply(_wire(flat), dest)
    _equal(dest, before)
    # The next flatten (same mapping, layout cached) reads the new values.
    _apply(_wire(flattener.flatten(sent)), dest)
    _equal(dest, sent)


def test_a_mismatch_on_the_gpu_copies_nothing() -> None:
    sent = _weights("cpu")
    flat = Flattener("state_dict").flatten(sent)
    dest = {k: torch.zeros_like(v, device="cuda") for k, v in sent.items()}
    dest[("big", "a")] = torch.zeros(256, 512, device="cuda")  # wrong shape
    with pytest.raises(SchemaMismatchError, match=r"big\.a"):
        ApplyPlan(flat.schema, dest, "state_dict")
    assert all(not _bytes(v.contiguous()).any() for v in dest.values())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["pubsub", "router"])
def test_cuda_learner_and_workers_over_zeromq(fleet, ipc_endpoint, mode) -> None:  # type: ignore[no-untyped-def]
    """A CUDA learner, two CUDA workers and one CPU worker: exact after every send,
    targeting, no aliasing, and a late CUDA joiner served from the snapshot."""
    model = make_model("mlp@cuda", seed=0)
    scheme = ZMQWeightSyncScheme("state_dict", mode=mode, endpoint=ipc_endpoint, timeout=30)
    scheme.init_on_sender("policy", model=model)
    kinds = {0: "mlp@cuda", 1: "mlp@cuda", 2: "mlp"}
    try:
        for i, kind in kinds.items():
            fleet.start(scheme, i, kind=kind)
        for i in kinds:
            fleet.wait_ready(i, timeout=120)
        for version in (1, 2, 3):
            bump(model)
            scheme.send()
            expected = zmqsync.checksum(model)
            for i, kind in kinds.items():
                state = fleet.ask(i, "state")
                assert (state["version"], state["checksum"]) == (version, expected), i
                assert state["devices"] == (["cuda:0"] if kind.endswith("cuda") else ["cpu"])

        bump(model)
        scheme.send(worker_ids=[0])
        v4 = zmqsync.checksum(model)
        assert fleet.ask(0, "checksum") == v4
        assert fleet.ask(1, "checksum") == expected

        bump(model)  # changed on the GPU, not sent: nobody sees it, late joiners neither
        assert fleet.ask(0, "checksum") == v4
        fleet.start(scheme, 3, kind="mlp@cuda")
        fleet.wait_ready(3, timeout=120)
        assert fleet.ask(3, "state")["version"] == 4
        assert fleet.ask(3, "checksum") == v4
    finally:
        scheme.shutdown()


@pytest.mark.timeout(240)
def test_cuda_workers_on_the_learners_gpu_copy_each_version_device_to_device(fleet) -> None:  # type: ignore[no-untyped-def]
    """Over pipes, workers whose model lives on the learner's GPU get each version from
    device memory the hub lends through CUDA IPC: written once on the device, copied
    device to device by each worker, nothing through the host."""
    model = make_model("big@cuda", seed=0)
    scheme = fleet.over_pipes(model, "big@cuda", workers=2)
    try:
        before = [fleet.ask(i, "state")["stats"]["device_chunks"] for i in range(2)]
        # More versions than device blocks: each block is lent again once released.
        states = fleet.each_version_exact(scheme, model, workers=2, versions=6)
        assert [s["devices"] for s in states] == [["cuda:0"]] * 2
        # Each version (32 MiB) came as one chunk lent on the device, to each worker.
        lent = [s["stats"]["device_chunks"] - b for s, b in zip(states, before, strict=True)]
        assert lent == [6, 6]
        counters = scheme.get_sender().transport.counters()
        assert counters["device_bytes"] >= 32 << 20
        assert counters["bad_releases"] == 0
        # A later change on the learner reaches no worker until it is sent.
        bump(model)
        torch.cuda.synchronize()
        assert [fleet.ask(i, "state")["checksum"] for i in range(2)] == [
            s["checksum"] for s in states
        ]
    finally:
        scheme.shutdown()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["pubsub", "router"])
def test_cuda_workers_over_ipc_on_the_learners_gpu_copy_device_to_device(
    fleet,  # type: ignore[no-untyped-def]
    ipc_endpoint: str,
    mode: str,
) -> None:
    """Over ZeroMQ's ipc://, workers whose model lives on the learner's GPU get each
    version from device memory the hub lends (a handle each, on the ROUTER)."""
    model = make_model("big@cuda", seed=0)
    scheme = ZMQWeightSyncScheme("state_dict", mode=mode, endpoint=ipc_endpoint, timeout=30)
    scheme.init_on_sender("policy", model=model, num_workers=2)
    try:
        for i in range(2):
            fleet.start(scheme, i, kind="big@cuda")
        for i in range(2):
            fleet.wait_ready(i, timeout=120)
        hub = scheme.get_sender().transport
        deadline = time.monotonic() + 60
        while hub.counters().get("shm_peers", 0) < 2:  # both joined the hub's lending
            assert time.monotonic() < deadline, hub.counters()
            time.sleep(0.05)
        bump(model)  # the first version may still go through the host (see the docs)
        scheme.send()
        before = [fleet.ask(i, "state")["stats"]["device_chunks"] for i in range(2)]
        for _ in range(6):  # more versions than device blocks
            bump(model)
            scheme.send()
            want = (scheme.get_sender().version, zmqsync.checksum(model))
            states = [fleet.ask(i, "state") for i in range(2)]
            assert [(s["version"], s["checksum"]) for s in states] == [want] * 2
        lent = [s["stats"]["device_chunks"] - b for s, b in zip(states, before, strict=True)]
        assert lent == [6, 6]
        assert 32 << 20 <= hub.counters()["device_bytes"] <= 3 * (33 << 20)
    finally:
        scheme.shutdown()


@pytest.mark.timeout(240)
def test_a_cpu_worker_joins_a_fleet_lent_device_memory(fleet) -> None:  # type: ignore[no-untyped-def]
    """A CPU worker that joins late is served the latest version, held in device memory,
    as host bytes; while it is there the versions go through the host's shared memory
    to everyone, and every worker holds each whole."""
    model = make_model("big@cuda", seed=0)
    scheme = fleet.over_pipes(model, "big@cuda", workers=2)
    try:
        fleet.each_version_exact(scheme, model, workers=2, versions=2)
        hub_end, child = multiprocessing.get_context("spawn").Pipe()
        fleet.start(scheme, 2, kind="big", init_kwargs={"pipe": child, "worker_idx": None})
        child.close()
        scheme.add_pipe(hub_end, 2)
        fleet.wait_ready(2, timeout=120)
        late = fleet.ask(2, "state")
        assert (late["version"], late["checksum"]) == (2, zmqsync.checksum(model))
        assert late["devices"] == ["cpu"] and late["stats"]["device_chunks"] == 0
        before = [fleet.ask(i, "state")["stats"]["device_chunks"] for i in range(3)]
        bump(model)
        scheme.send()
        want = (3, zmqsync.checksum(model))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            states = [fleet.ask(i, "state") for i in range(3)]
            if all((s["version"], s["checksum"]) == want for s in states):
                break
            time.sleep(0.1)
        assert [(s["version"], s["checksum"]) for s in states] == [want] * 3
        assert [s["stats"]["device_chunks"] for s in states] == before  # through the host
    finally:
        scheme.shutdown()


def test_background_receiver_applies_whole_versions_on_the_gpu(ipc_endpoint) -> None:
    """Forward passes under the lock see one version, never a mix, on the GPU."""
    sender_model = torch.nn.Linear(256, 256).cuda()
    worker_model = torch.nn.Linear(256, 256).cuda()
    sender = ZMQWeightSyncScheme("state_dict", endpoint=ipc_endpoint, timeout=20)
    worker = ZMQWeightSyncScheme("state_dict", endpoint=ipc_endpoint, timeout=20)
    try:
        sender.init_on_sender(model_id="policy", model=sender_model, num_workers=1)
        worker.init_on_receiver(model_id="policy", model=worker_model, worker_idx=0)
        worker.connect(timeout=30)
        worker.start_receiver_thread()
        x = torch.ones(1, 256, device="cuda")
        for v in range(1, 21):
            with torch.no_grad():
                sender_model.weight.fill_(float(v))
                sender_model.bias.fill_(float(v))
            sender.send()
            with worker.lock, torch.no_grad():
                out = worker_model(x)
            # every output is 256 * w + b for one single v
            assert torch.all(out == 257.0 * v).item(), v
    finally:
        worker.shutdown()
        sender.shutdown()
