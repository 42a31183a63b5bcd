"""Memory a worker lends the learner (zmqsync.transport.shm.lent, zmqsync.receiver.lent):
a real second process lends it, this one maps it through /proc and writes; what the
worker says of it is checked, and anything but a sealed memfd of the version's size is
refused; a model's tensors move into it, stay the objects they were, take the learner's
writes, and are taken back."""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
from multiprocessing.connection import Connection

import numpy as np
import pytest
import torch

from zmqsync.chunking.layout import MIN_CHUNK_BYTES, StreamLayout
from zmqsync.errors import SchemaMismatchError
from zmqsync.receiver.lent import LentTensors, stream_bytes
from zmqsync.sender.lent import LentTarget
from zmqsync.tensors.extract import extract
from zmqsync.tensors.flatten import Flattener
from zmqsync.transport.shm import records
from zmqsync.transport.shm.blocks import SHM_AVAILABLE
from zmqsync.transport.shm.lent import LentMemory, Where, map_lent

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not SHM_AVAILABLE, reason="memfd is Linux's"),
]

NBYTES = 1 << 20
WAIT_S = 20.0


def _lender(conn: Connection, how: str) -> None:
    """Lend ``NBYTES`` (or something else, by ``how``), say where, then report what the
    memory holds once told to, and whether it could shrink it."""
    keep: list[object] = []
    if how == "sealed":
        lent = LentMemory(NBYTES)
        keep.append(lent)
        where, array = lent.where(), lent.array
    elif how == "unsealed":
        fd = os.memfd_create("not-sealed", os.MFD_CLOEXEC)
        os.ftruncate(fd, NBYTES)
        where, array = Where(os.getpid(), fd, os.fstat(fd).st_ino, NBYTES), None
    elif how == "file":
        f = tempfile.TemporaryFile()  # noqa: SIM115  # kept open while it is lent
        f.truncate(NBYTES)
        keep.append(f)
        where, array = Where(os.getpid(), f.fileno(), os.fstat(f.fileno()).st_ino, NBYTES), None
    else:
        raise ValueError(how)
    conn.send(tuple(where))
    if not conn.poll(WAIT_S):
        return
    conn.recv()
    shrunk = "no"
    if array is not None:
        try:
            os.ftruncate(where.fd, NBYTES // 2)
            shrunk = "yes"
        except PermissionError:
            shrunk = "refused"
    conn.send((None if array is None else bytes(array[:8]), shrunk))


@pytest.fixture
def lend():
    ctx = mp.get_context("spawn")
    started: list[tuple[mp.process.BaseProcess, Connection]] = []

    def start(how: str) -> tuple[Where, Connection]:
        here, there = ctx.Pipe()
        proc = ctx.Process(target=_lender, args=(there, how), daemon=True)
        proc.start()
        started.append((proc, here))
        assert here.poll(WAIT_S), "the lender said nothing"
        return Where(*here.recv()), here

    yield start
    for proc, _ in started:
        proc.join(WAIT_S)
        if proc.is_alive():
            proc.kill()
            proc.join(WAIT_S)


def _report(conn: Connection) -> tuple[bytes | None, str]:
    conn.send("report")
    assert conn.poll(WAIT_S), "the lender did not report"
    return conn.recv()


def test_the_learner_writes_into_memory_a_worker_lends(lend) -> None:
    where, conn = lend("sealed")
    mapped = map_lent(where, NBYTES)
    assert mapped.flags.writeable and mapped.nbytes == NBYTES
    mapped[:8] = np.arange(1, 9, dtype=np.uint8)
    held, shrunk = _report(conn)
    assert held == bytes(range(1, 9))  # the worker's own memory changed, no copy
    assert shrunk == "refused"  # nor can the worker shrink it under the learner


@pytest.mark.parametrize("how", ["unsealed", "file"])
def test_memory_that_could_shrink_under_the_learner_is_refused(lend, how: str) -> None:
    where, conn = lend(how)
    with pytest.raises(ValueError, match=r"sealed memfd|shrink or grow"):
        map_lent(where, NBYTES)
    _report(conn)


def test_what_the_worker_says_of_its_memory_is_checked(lend) -> None:
    where, conn = lend("sealed")
    with pytest.raises(ValueError, match="not 2097152"):
        map_lent(where, 2 * NBYTES)  # another size than the version's
    with pytest.raises(ValueError, match="not 2097152"):
        map_lent(where._replace(nbytes=2 * NBYTES), 2 * NBYTES)  # a size it does not have
    with pytest.raises(ValueError, match="not the memory it lent"):
        map_lent(where._replace(inode=where.inode + 1), NBYTES)  # another file
    with pytest.raises(OSError):
        map_lent(where._replace(fd=where.fd + 100), NBYTES)  # nothing there
    with pytest.raises(ValueError):
        map_lent(where._replace(pid=0), NBYTES)
    assert map_lent(where, NBYTES).nbytes == NBYTES  # the true claim still maps
    _report(conn)


def test_memory_no_longer_lent_cannot_be_opened() -> None:
    lent = LentMemory(4096)
    where = lent.where()
    assert map_lent(where, 4096).nbytes == 4096
    lent.array[:4] = 7
    lent.close()
    with pytest.raises(ValueError, match="no longer lent"):
        lent.where()
    with pytest.raises((OSError, ValueError)):  # gone, or its number now names another file
        map_lent(where, 4096)
    assert bytes(lent.array[:4]) == b"\x07" * 4  # the mapping lives with its views


def _stream(model: torch.nn.Module) -> StreamLayout:
    flat = Flattener("state_dict").flatten(extract(model, "state_dict"))
    return StreamLayout(flat, MIN_CHUNK_BYTES)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 300), torch.nn.LayerNorm(300), torch.nn.Linear(300, 7)
    )


def test_a_workers_tensors_move_into_lent_memory_and_the_learner_writes_them() -> None:
    learner, worker = _model(1), _model(2)
    params = list(worker.parameters())
    before = {k: v.clone() for k, v in worker.state_dict().items()}
    optimizer = torch.optim.SGD(worker.parameters(), lr=0.1)
    layout = _stream(learner)
    lent = LentTensors(layout.schema, worker, extract(worker, "state_dict"))
    assert stream_bytes(layout.schema) == layout.total
    # The same objects, with their own values, now in the lent memory.
    assert all(a is b for a, b in zip(params, worker.parameters(), strict=True))
    for key, value in worker.state_dict().items():
        assert torch.equal(value, before[key]), key
    base = lent.memory.array.__array_interface__["data"][0]  # type: ignore[union-attr]
    assert all(base <= p.data_ptr() < base + layout.total for p in params)

    # The learner writes a version into the worker's own tensors: nothing copies it out.
    mapped = map_lent(lent.where(), layout.total)
    target = LentTarget(mapped, layout.schema)
    target.write(extract(learner, "state_dict"))
    x = torch.randn(5, 64)
    assert torch.equal(worker(x), learner(x))
    # Still the worker's private, writable tensors: its optimizer built before updates them.
    worker(x).sum().backward()
    optimizer.step()
    assert not torch.equal(worker[0].weight, learner[0].weight)

    # Taken back: what the learner writes later reaches no tensor of the worker.
    held = {k: v.clone() for k, v in worker.state_dict().items()}
    lent.take_back()
    assert not lent.lent
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(1.0)
    target.write(extract(learner, "state_dict"))
    for key, value in worker.state_dict().items():
        assert torch.equal(value, held[key]), key
    assert all(a is b for a, b in zip(params, worker.parameters(), strict=True))
    with pytest.raises(ValueError, match="taken back"):
        lent.where()


def test_only_tensors_that_can_lie_in_the_stream_are_lent() -> None:
    learner, worker = _model(1), _model(2)
    flattener = Flattener("state_dict", wire_dtype=torch.bfloat16)
    flat = flattener.flatten(extract(learner, "state_dict"))
    cast = StreamLayout(flat, MIN_CHUNK_BYTES).schema
    with pytest.raises(SchemaMismatchError, match="wire_dtype"):
        LentTensors(cast, worker, extract(worker, "state_dict"))


def test_the_learner_writes_only_memory_that_fits_the_version() -> None:
    layout = _stream(_model(1))
    with pytest.raises(ValueError, match="lent memory of"):
        LentTarget(np.zeros(layout.total - 4, dtype=np.uint8), layout.schema)
    read_only = np.zeros(layout.total, dtype=np.uint8)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="lent memory of"):
        LentTarget(read_only, layout.schema)


@pytest.mark.parametrize(
    "record",
    [
        records.Lends(4321, 7, 99, 1 << 20, bytes(range(16))),
        records.Lends(4321, 7, 99, 0, bytes(16)),
        records.Ask(3, 2, b"L" * 16),
        records.Go(3, 2, True),
        records.Go(3, 2, False),
        records.Written(3, 2, True, b'{"step": 3}'),
        records.Written(3, 2, False),
    ],
)
def test_the_lent_tensors_records_round_trip(record: records.Record) -> None:
    frame = records.encode(record)
    assert records.is_record([frame])
    assert records.decode(frame) == record


@pytest.mark.parametrize(
    "frame",
    [
        records.encode(records.Lends(4321, 7, 99, 64, bytes(16)))[:-1],  # short
        records.encode(records.Lends(0, 7, 99, 64, bytes(16))),  # no such process
        records.encode(records.Lends(4321, -1, 99, 64, bytes(16))),  # no descriptor
        records.encode(records.Ask(3, 2, bytes(16))) + b"x",  # long
        records.encode(records.Go(3, 2, True))[:-1] + b"\x02",  # a flag that is neither
        records.encode(records.Written(3, 2, True)) + b"m" * (records.MAX_WRITTEN_METADATA + 1),
        records.encode(records.Written(3, 2, True))[:-2],
    ],
)
def test_malformed_lent_tensors_records_are_refused(frame: bytes) -> None:
    with pytest.raises(records.RecordError):
        records.decode(frame)
