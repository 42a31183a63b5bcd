"""``share_params=True``: the learner's tensors live in shared memory that workers copy
from, once; every version arrives whole, even to a worker still reading when the
learner moves on."""

from __future__ import annotations

import multiprocessing as mp
import threading

import pytest
import torch
from _faults import until
from torch import nn

from zmqsync import SyncTimeout, WeightReceiver, WeightSender, checksum
from zmqsync.chunking.layout import MIN_CHUNK_BYTES
from zmqsync.transport.pipe import PipeHub, PipeSpoke
from zmqsync.transport.zmq_pubsub import PubSubHub, PubSubSpoke

CHUNK = MIN_CHUNK_BYTES


def _model(seed: int) -> nn.Module:
    """~1.2 MB over many chunks: two large layers, a buffer and many small ones."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 64))
    model.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
    for i in range(100):
        model.register_buffer(f"small{i}", torch.randn(5))
    return model


def _pair(kind: str, tmp_path, workers: int):  # type: ignore[no-untyped-def]
    if kind == "pipe":
        pairs = [mp.Pipe() for _ in range(workers)]
        return PipeHub([p for p, _ in pairs]), [PipeSpoke(c) for _, c in pairs]
    endpoint = "tcp://127.0.0.1:*" if kind == "tcp" else f"ipc://{tmp_path}/share"
    hub = PubSubHub(endpoint)
    return hub, [PubSubSpoke(hub.endpoint, identity=str(i)) for i in range(workers)]


@pytest.fixture(params=["pipe", "ipc", "tcp"])
def fleet(request, tmp_path):  # type: ignore[no-untyped-def]
    learner = _model(0)
    hub, spokes = _pair(request.param, tmp_path, 2)
    sender = WeightSender(
        hub,
        model=learner,
        strategy="state_dict",
        num_workers=2,
        timeout=5,
        chunk_bytes=CHUNK,
        share_params=True,
    )
    workers = [_model(10 + i) for i in range(2)]
    receivers = [
        WeightReceiver(s, model=w, strategy="state_dict", worker_idx=i)
        for i, (s, w) in enumerate(zip(spokes, workers, strict=True))
    ]
    for r in receivers:
        r.connect()
        r.start()
    try:
        yield learner, sender, workers, receivers
    finally:
        for r in receivers:
            r.close()
        sender.close()


def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model[0](torch.randn(8, 512)).sum().backward()
    optimizer.step()
    model.steps += 1  # type: ignore[operator]


def test_workers_copy_the_learners_own_tensors_and_each_version_is_exact(fleet) -> None:  # type: ignore[no-untyped-def]
    learner, sender, workers, _ = fleet
    weight = learner[0].weight
    optimizer = torch.optim.SGD(learner.parameters(), lr=0.1)
    for version in range(1, 6):
        _step(learner, optimizer)
        sender.send()
        for w in workers:
            assert checksum(w) == checksum(learner), f"version {version} not exact"
    # The tensors moved once, into shared memory, and stayed themselves: the optimizer
    # built before the first send still updates what is sent.
    assert learner[0].weight is weight
    status = sender.status()
    assert status["share_params"] == "on"
    assert status["totals"]["params_moved"] == 1
    assert status["totals"]["chunks_sent"] >= 5 * 18
    # Workers read it; they own what they hold.
    for w in workers:
        assert all(t.data_ptr() != weight.data_ptr() for t in w.state_dict().values())


def test_a_worker_still_reading_when_send_returns_reads_one_whole_version(fleet) -> None:  # type: ignore[no-untyped-def]
    learner, sender, workers, receivers = fleet
    sender.timeout = 1.0
    sent = {}
    with torch.no_grad():
        learner[0].weight.add_(1.0)
    sent[1] = checksum(learner)
    # Worker 1 cannot apply while its lock is held: it has not read chunk 0 when the
    # send gives up on it.
    lock = receivers[1].lock
    lock.acquire()
    try:
        with pytest.raises(SyncTimeout):
            sender.send()
        # The learner's tensors moved before send() returned, if a transport still held
        # them (over tcp the version is in the socket buffers already, and nothing
        # moves); changing them now does not touch what worker 1 is about to read.
        tcp = sender.status()["endpoint"].startswith("tcp://")
        assert sender.status()["totals"]["params_moved"] == (1 if tcp else 2)
        with torch.no_grad():
            for p in learner.parameters():
                p.mul_(-3.0)
    finally:
        lock.release()
    until(lambda: receivers[1].version == 1, 10, "worker 1 applied version 1")
    assert checksum(workers[1]) == sent[1]
    assert checksum(workers[0]) == sent[1]
    sender.timeout = 5.0
    sender.send()
    assert all(checksum(w) == checksum(learner) for w in workers)
    assert sender.status()["totals"]["params_moved"] == (1 if tcp else 2)  # no copy again


def test_a_model_whose_tensors_cannot_move_is_sent_by_copy_and_status_says_why(
    tmp_path,
) -> None:  # type: ignore[no-untyped-def]
    learner = _model(0)
    learner[2].weight = nn.Parameter(learner[0].weight.data[:64])  # tied: one storage
    hub, spokes = _pair("pipe", tmp_path, 1)
    sender = WeightSender(
        hub, model=learner, strategy="state_dict", num_workers=1, timeout=5, share_params=True
    )
    worker = _model(1)
    receiver = WeightReceiver(spokes[0], model=worker, strategy="state_dict", worker_idx=0)
    receiver.connect()
    receiver.start()
    try:
        with torch.no_grad():
            learner[0].weight.add_(1.0)
        sender.send()
        assert checksum(worker) == checksum(learner)
        status = sender.status()
        assert status["share_params"].startswith("unavailable:")
        assert "tied" in status["share_params"] or "shares" in status["share_params"]
        assert status["totals"]["params_moved"] == 0
    finally:
        receiver.close()
        sender.close()


def test_a_parameter_replaced_between_sends_moves_in_too(fleet) -> None:  # type: ignore[no-untyped-def]
    learner, sender, workers, _ = fleet
    sender.send()
    learner[2].weight = nn.Parameter(torch.full_like(learner[2].weight, 7.0))
    sender.send()
    assert sender.status()["totals"]["params_moved"] == 2
    assert all(checksum(w) == checksum(learner) for w in workers)
    assert all(bool((w[2].weight == 7.0).all()) for w in workers)


def test_send_async_copies_as_without_it(fleet) -> None:  # type: ignore[no-untyped-def]
    learner, sender, workers, _ = fleet
    sender.send()
    with torch.no_grad():
        learner[0].bias.add_(2.0)
    expected = checksum(learner)
    sender.send_async()
    with torch.no_grad():
        learner[0].bias.add_(5.0)  # after send_async returned: not in that version
    sender.wait_async()
    assert all(checksum(w) == expected for w in workers)


def test_forward_passes_on_workers_never_see_two_versions(fleet) -> None:  # type: ignore[no-untyped-def]
    learner, sender, workers, receivers = fleet
    stop = threading.Event()
    seen: list[float] = []

    def forward() -> None:
        while not stop.is_set():
            with receivers[0].lock:
                w = workers[0][0].weight.detach()
                seen.append(float(w[0, 0] - w[-1, -1]))

    with torch.no_grad():
        learner[0].weight.fill_(0.0)
    sender.send()
    thread = threading.Thread(target=forward)
    thread.start()
    try:
        for v in range(1, 6):
            with torch.no_grad():
                learner[0].weight.fill_(float(v))
            sender.send()
    finally:
        stop.set()
        thread.join(10)
    assert seen and all(d == 0.0 for d in seen)


def test_weights_other_than_the_model_are_sent_by_copy(fleet) -> None:  # type: ignore[no-untyped-def]
    learner, sender, workers, _ = fleet
    other = _model(5)
    sender.send(weights=other)
    assert all(checksum(w) == checksum(other) for w in workers)
    assert "not the model's" in sender.status()["share_params"]
    sender.send()
    assert sender.status()["share_params"] == "on"
    assert all(checksum(w) == checksum(learner) for w in workers)
