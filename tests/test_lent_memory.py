"""Memory a worker lends the learner (zmqsync.transport.shm.lent, zmqsync.receiver.lent):
a real second process lends it, this one maps it through /proc and writes; what the
worker says of it is checked, and anything but a sealed memfd of the version's size is
refused; a model's tensors move into it, stay the objects they were, take the learner's
writes, and are taken back."""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import numpy as np
import pytest
import torch

from zmqsync.chunking.layout import MIN_CHUNK_BYTES, StreamLayout
from zmqsync.errors import SchemaMismatchError
from zmqsync.receiver.lent import LentTensors, stream_bytes
from zmqsync.sender.lent import FAN_OUT_BLOCK, LentPlan, LentTarget
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
    plan = LentPlan(layout.schema)
    assert plan.hi > plan.lo and plan._stretch.numel() == 0  # no memory until it writes
    target = LentTarget(mapped, plan)
    target.write(plan.gather(extract(learner, "state_dict")))
    assert plan._stretch.numel() == plan.hi - plan.lo
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
    target.write(plan.gather(extract(learner, "state_dict")))
    for key, value in worker.state_dict().items():
        assert torch.equal(value, held[key]), key
    assert all(a is b for a, b in zip(params, worker.parameters(), strict=True))
    with pytest.raises(ValueError, match="taken back"):
        lent.where()


def test_a_worker_says_where_its_tensors_lie_again_once_a_second_or_after_a_refusal() -> None:
    """After each streamed version a worker may tell the hub again where its lent
    tensors lie (a hub that forgot it learns it back): within RETELL_SECONDS of the last
    time it does not (checking thousands of tensors each version cost as much as the
    copy), unless the hub's ask was refused since (the tensors moved: lent anew)."""
    from zmqsync.receiver import lent as receiver_lent
    from zmqsync.receiver.lent import LentVersions

    learner, worker = _model(1), _model(2)
    layout = _stream(learner)
    digest = b"layout-1"
    versions = LentVersions({})
    now = time.monotonic()
    assert not versions.said_lately(digest, now)  # nothing lent yet
    lent = versions.lend(layout.schema, digest, worker, extract(worker, "state_dict"))
    assert lent is not None and lent[1]  # moved now
    assert versions.said_lately(digest, time.monotonic())
    assert not versions.said_lately(b"layout-2", time.monotonic())  # another layout
    assert not versions.said_lately(digest, time.monotonic() + receiver_lent.RETELL_SECONDS)
    # The user gives a tensor new storage: the hub's ask is refused, and the next whole
    # version lends the tensors anew at once.
    with torch.no_grad():
        worker[0].weight.data = worker[0].weight.data.clone()
    assert not versions.may_write(digest)
    assert not versions.said_lately(digest, time.monotonic())
    again = versions.lend(layout.schema, digest, worker, extract(worker, "state_dict"))
    assert again is not None and again[1]
    assert versions.said_lately(digest, time.monotonic())
    versions.take_back()
    assert not versions.said_lately(digest, time.monotonic())


def _lent_descriptors() -> int:
    """How many of this process's descriptors open lent memory."""
    links = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            links += os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:zmqsync-lent")
        except OSError:  # the directory's own descriptor, closed once listed
            continue
    return links


def test_lent_memory_is_closed_to_everyone_once_the_hub_wrote_into_it() -> None:
    """The hub's mapping keeps no descriptor, and the worker closes its own once the hub
    wrote a version in: nobody opens the memory through /proc/PID/fd after that, a
    hub included. Told again after a streamed version, the hub hears of the same memory
    (one that still maps it keeps writing it). Once a hub says it cannot use it (one
    that forgot it), the next lending moves the tensors into fresh memory, the same
    objects with their values, and what the old hub still writes into the old memory
    reaches none of them."""
    from zmqsync.receiver.lent import LentVersions

    learner, worker = _model(1), _model(2)
    params = list(worker.parameters())
    layout = _stream(learner)
    digest, stats = b"layout-1", dict[str, int]()
    versions = LentVersions(stats)
    before = _lent_descriptors()
    lent = versions.lend(layout.schema, digest, worker, extract(worker, "state_dict"))
    assert lent is not None and lent[1]
    where = lent[0]
    assert _lent_descriptors() == before + 1  # the worker's, until the hub has mapped it
    mapped = map_lent(where, layout.total)
    assert _lent_descriptors() == before + 1  # the hub's mapping holds none
    plan = LentPlan(layout.schema)
    LentTarget(mapped, plan).write(plan.gather(extract(learner, "state_dict")))
    versions.written()
    assert _lent_descriptors() == before
    with pytest.raises((OSError, ValueError)):  # gone, or its number names another file
        map_lent(where, layout.total)
    x = torch.randn(5, 64)
    assert torch.equal(worker(x), learner(x))

    # A streamed version (the worker missed its go, say): the same memory, told again.
    again = versions.lend(layout.schema, digest, worker, extract(worker, "state_dict"))
    assert again is not None and not again[1] and again[0] == where
    versions.unusable()  # a hub answered a go so
    assert not versions.said_lately(digest, time.monotonic())
    # The next whole version: the tensors move to fresh memory, lent anew.
    renewed = versions.lend(layout.schema, digest, worker, extract(worker, "state_dict"))
    assert renewed is not None and renewed[1] and stats["lent_renewed"] == 1
    assert renewed[0].inode != where.inode and _lent_descriptors() == before + 1
    assert all(a is b for a, b in zip(params, worker.parameters(), strict=True))
    assert torch.equal(worker(x), learner(x))
    mapped[:] = 0  # the old memory: the hub's mapping of it lives on, and reaches nothing
    assert torch.equal(worker(x), learner(x))
    # Said again while its descriptor is open: it stays where it is.
    again = versions.lend(layout.schema, digest, worker, extract(worker, "state_dict"))
    assert again is not None and not again[1] and again[0] == renewed[0]
    assert stats["lent_renewed"] == 1
    versions.take_back()
    assert _lent_descriptors() == before


def _shared_kib() -> int:
    """This process's resident shared memory (RssShmem), KiB."""
    with open("/proc/self/status") as status:
        line = next(x for x in status if x.startswith("RssShmem:"))
    return int(line.split()[1])


def test_a_pool_keeps_no_written_block_once_versions_go_into_lent_tensors() -> None:
    """The hub's pool reuses a block a version was written into (fresh memory costs a
    page fault per page), until a version goes only into the workers' lent tensors
    (``unwritten``): then every free block written before is retired, its memory given
    back, and a block that never held a version is kept (it costs nothing) and lent
    first. A block reused for such a version is retired once free."""
    from zmqsync.transport.shm.blocks import BlockPool

    n = 16 << 20
    pool = BlockPool()
    try:
        before = _shared_kib()
        a = pool.lend(n)
        assert a is not None
        a[1][:] = 1  # a streamed version, written
        first = a[0].id
        del a
        b = pool.lend(n)  # streaming: the same block again
        assert b is not None and b[0].id == first
        b[1][:] = 2
        assert _shared_kib() - before >= n // 1024 * 9 // 10
        pool.unwritten(b[1])  # this one went only into lent tensors
        del b
        assert pool.live_ids() == [first]  # not free when told: retired at the next lend
        c = pool.lend(n)
        assert c is not None and c[0].id != first and pool.live_ids() == [c[0].id]
        assert _shared_kib() - before < 1024  # the written block's memory is back
        fresh = c[0].id
        pool.unwritten(c[1])
        del c
        d = pool.lend(n)  # the fresh block, kept
        assert d is not None and d[0].id == fresh
        other = pool.lend(n)  # a second one while d is lent (a stream, say)
        assert other is not None
        other[1][:] = 3
        del other
        pool.unwritten(d[1])  # the free, written one goes now
        assert pool.live_ids() == [fresh]
        del d
        e = pool.lend(n)
        assert e is not None and e[0].id == fresh
        assert _shared_kib() - before < 1024
        del e
    finally:
        pool.close()


def test_only_tensors_that_can_lie_in_the_stream_are_lent() -> None:
    learner, worker = _model(1), _model(2)
    flattener = Flattener("state_dict", wire_dtype=torch.bfloat16)
    flat = flattener.flatten(extract(learner, "state_dict"))
    cast = StreamLayout(flat, MIN_CHUNK_BYTES).schema
    with pytest.raises(SchemaMismatchError, match="wire_dtype"):
        LentTensors(cast, worker, extract(worker, "state_dict"))


@pytest.mark.parametrize("piecewise", [False, True], ids=["in-one-call", "piecewise"])
def test_workers_written_together_get_what_one_written_alone_gets(monkeypatch, piecewise) -> None:
    """Several workers that said go together are written block by block (each block of
    the model read once, copied to every worker): each gets exactly the version, the
    tensors larger than a block (one not a whole number of blocks), those under one and
    the small ones' stretch alike. A version large enough is written piecewise into one
    worker too (2 MiB pieces here), and the sender is called back between pieces, where
    it tells the workers it is still writing; a smaller one goes in with no call back."""
    from zmqsync.sender import lent

    if piecewise:
        monkeypatch.setattr(lent, "PIECEWISE_BYTES", FAN_OUT_BLOCK // 2)
    calls = {"alone": 0, "together": 0}

    def still_writing(which: str) -> Callable[[], None]:
        def note() -> None:
            calls[which] += 1

        return note

    torch.manual_seed(3)
    rows = 2 * FAN_OUT_BLOCK // (4 * 700) + 3  # a weight of 2 blocks and a bit
    learner = torch.nn.Sequential(
        torch.nn.Linear(700, rows), torch.nn.LayerNorm(rows), torch.nn.Linear(rows, 9)
    )
    assert learner[0].weight.nbytes > 2 * FAN_OUT_BLOCK
    assert learner[0].weight.nbytes % FAN_OUT_BLOCK
    layout = _stream(learner)
    plan = LentPlan(layout.schema)
    assert plan.hi > plan.lo  # a stretch of small tensors too
    gathered = plan.gather(extract(learner, "state_dict"))
    alone = LentTarget(np.zeros(layout.total, dtype=np.uint8), plan)
    alone.write(gathered, still_writing("alone"))
    together = [LentTarget(np.full(layout.total, i, dtype=np.uint8), plan) for i in range(3)]
    LentTarget.write_all(together, gathered, still_writing("together"))
    if piecewise:  # the big weight alone is 4 pieces and a bit, 2 blocks and a bit
        assert calls["alone"] >= 5 and calls["together"] >= 3, calls
    else:
        assert calls == {"alone": 0, "together": 0}
    # Every tensor's bytes are the model's, where the stream puts them (the padding
    # between them is no one's).
    tensors = extract(learner, "state_dict")
    for entry in layout.schema.entries:
        want = tensors[entry.key].detach().reshape(-1).view(torch.uint8).numpy()
        for target in [alone, *together]:
            got = target.memory[entry.offset : entry.offset + entry.nbytes]
            assert np.array_equal(got, want), entry.dotted_key


def test_the_learner_writes_only_memory_that_fits_the_version() -> None:
    layout = _stream(_model(1))
    plan = LentPlan(layout.schema)
    with pytest.raises(ValueError, match="lent memory of"):
        LentTarget(np.zeros(layout.total - 4, dtype=np.uint8), plan)
    read_only = np.zeros(layout.total, dtype=np.uint8)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="lent memory of"):
        LentTarget(read_only, plan)


@pytest.mark.parametrize(
    "record",
    [
        records.LentAt(4321, 7, 99, 1 << 20, bytes(range(16))),
        records.LentAt(4321, 7, 99, 0, bytes(16)),
        records.Ask(3, 2, b"L" * 16),
        records.Go(3, 2, True),
        records.Go(3, 2, False),
        records.Written(3, 2, True, b'{"step": 3}'),
        records.Written(3, 2, False),
        records.Written(3, 2, False, unusable=True),
    ],
)
def test_the_lent_tensors_records_round_trip(record: records.Record) -> None:
    frame = records.encode(record)
    assert records.is_record([frame])
    assert records.decode(frame) == record


@pytest.mark.parametrize(
    "frame",
    [
        records.encode(records.LentAt(4321, 7, 99, 64, bytes(16)))[:-1],  # short
        records.encode(records.LentAt(0, 7, 99, 64, bytes(16))),  # no such process
        records.encode(records.LentAt(4321, -1, 99, 64, bytes(16))),  # no descriptor
        records.encode(records.Ask(3, 2, bytes(16))) + b"x",  # long
        records.encode(records.Go(3, 2, True))[:-1] + b"\x02",  # a flag that is neither
        records.encode(records.Written(3, 2, True)) + b"m" * (records.MAX_WRITTEN_METADATA + 1),
        records.encode(records.Written(3, 2, True))[:-2],
        records.encode(records.Written(3, 2, True))[:-1] + b"\x03",  # ok and unusable
    ],
)
def test_malformed_lent_tensors_records_are_refused(frame: bytes) -> None:
    with pytest.raises(records.RecordError):
        records.decode(frame)


def _spoke_lender(conn: Connection, how: str) -> None:
    """A worker on a real pipe: lends 4 KiB (sealed, or not), answers the hub's asks
    (yes, or no with ``how == "refuses"``), and once a version is written sends back
    what its memory holds."""
    from zmqsync.transport.pipe.spoke import PipeSpoke
    from zmqsync.transport.shm.records import Ask, decode

    spoke = PipeSpoke(conn)
    spoke.wait_index(WAIT_S)
    if how == "unsealed":
        fd = os.memfd_create("not-sealed", os.MFD_CLOEXEC)
        os.ftruncate(fd, 4096)
        spoke.lend_tensors(Where(os.getpid(), fd, os.fstat(fd).st_ino, 4096), b"L" * 16)
        memory = None
    else:
        lent = LentMemory(4096)
        spoke.lend_tensors(lent.where(), b"L" * 16)
        memory = lent.array
    try:
        for _ in range(int(WAIT_S / 0.2)):
            frames = spoke.recv_frames(0.2)
            if frames is None:
                if not spoke.lends_tensors():
                    return  # the hub is gone
                continue
            record = decode(frames[0])
            if isinstance(record, Ask):
                spoke.answer(record.version, record.epoch, how != "refuses")
            elif isinstance(record, records.Written):
                held = b"" if memory is None else bytes(memory[:4])
                spoke.send_frames([b"%d" % record.version, record.metadata, held])
    finally:
        spoke.close()


@pytest.fixture
def pipe_hub():
    from zmqsync.transport.pipe.hub import PipeHub

    ctx = mp.get_context("spawn")
    made: list[tuple[mp.process.BaseProcess, object]] = []

    def start(how: str):
        here, there = ctx.Pipe()
        proc = ctx.Process(target=_spoke_lender, args=(there, how), daemon=True)
        proc.start()
        hub = PipeHub([here])
        made.append((proc, hub))
        return hub

    yield start
    for proc, hub in made:
        hub.close()
        proc.join(WAIT_S)
        if proc.is_alive():
            proc.kill()


def _until(hub, what, timeout: float = WAIT_S):
    """Read the hub until ``what()`` is true; what it said meanwhile."""
    import time

    deadline = time.monotonic() + timeout
    heard = []
    while not what():
        assert time.monotonic() < deadline, "the worker did not answer"
        got = hub.recv_frames(0.2)
        if got is not None:
            heard.append(got)
    return heard


def test_the_pipe_hub_writes_into_a_workers_lent_tensors_after_its_go(pipe_hub) -> None:
    hub = pipe_hub("lends")
    layout = b"L" * 16
    _until(hub, lambda: hub.lent_peers(layout))
    (peer,) = hub.lent_peers(layout)
    assert hub.lent_peers(b"M" * 16) == []  # only for the layout it lent for
    hub.ask_lent(peer, 5, 1, layout)
    gos: list = []
    _until(hub, lambda: gos.extend(hub.take_gos()) or gos)
    assert gos == [(peer, 5, 1, True)]
    memory = hub.lent_memory(peer, 4096)
    assert memory is not None and hub.lent_memory(peer, 4096) is memory  # mapped once
    memory[:4] = [9, 8, 7, 6]
    hub.written(peer, 5, 1, True, b'{"step": 5}')
    heard: list = []
    _until(hub, lambda: heard.append(hub.recv_frames(0.2)) or any(heard))
    (reply,) = [h for h in heard if h is not None]
    assert [bytes(f) for f in reply.frames] == [b"5", b'{"step": 5}', bytes([9, 8, 7, 6])]
    assert hub.counters()["lent_peers"] == 1


def test_a_worker_may_refuse_and_memory_that_could_shrink_is_not_written(pipe_hub) -> None:
    layout = b"L" * 16
    refuses = pipe_hub("refuses")
    _until(refuses, lambda: refuses.lent_peers(layout))
    (peer,) = refuses.lent_peers(layout)
    refuses.ask_lent(peer, 2, 1, layout)
    gos: list = []
    _until(refuses, lambda: gos.extend(refuses.take_gos()) or gos)
    assert gos == [(peer, 2, 1, False)]

    unsealed = pipe_hub("unsealed")
    _until(unsealed, lambda: unsealed.lent_peers(layout))
    (peer,) = unsealed.lent_peers(layout)
    assert unsealed.lent_memory(peer, 4096) is None
    assert unsealed.lent_peers(layout) == []  # not asked again until it lends anew
    assert unsealed.counters()["lent_refused"] == 1


def _pump(hub, spokes, what, timeout: float = WAIT_S) -> list:
    """Read the hub and ``spokes`` until ``what(heard)`` holds; ``heard``: what the
    spokes received meanwhile (each message's frames, as bytes)."""
    import time

    deadline = time.monotonic() + timeout
    heard: list = []
    while not what(heard):
        assert time.monotonic() < deadline, "nothing came"
        hub.recv_frames(0.02)
        for spoke in spokes:
            got = spoke.recv_frames(0.02)
            if got is not None:
                heard.append([bytes(f) for f in got])
    return heard


def test_the_zmq_hub_believes_lent_memory_only_from_a_spoke_that_joined(tmp_path) -> None:
    """Over ``ipc://`` a spoke proves it is on the learner's host by opening the hub's
    probe through /proc (it joins the lending); where it says its tensors lie is
    believed from no other peer: not a stranger, not an admitted spoke that has not
    joined. Each such claim is a bad record, counted, and nobody is asked."""
    import zmq

    from zmqsync.transport._zmq.sockets import SPOKE_PREFIX
    from zmqsync.transport.zmq_router import RouterHub, RouterSpoke

    endpoint = f"ipc://{tmp_path}/hub"
    hub = RouterHub(endpoint)
    spoke = RouterSpoke(endpoint)
    memory = LentMemory(4096)
    layout = b"L" * 16
    claim = records.encode(records.LentAt(*memory.where(), layout))
    context = zmq.Context.instance()
    strangers = []
    try:
        for name in (b"stranger", b"admitted"):
            dealer = context.socket(zmq.DEALER)
            dealer.routing_id = SPOKE_PREFIX + name
            dealer.linger = 0
            dealer.connect(endpoint)
            strangers.append(dealer)
        # Each says something first (a worker's hello), so that the ROUTER knows it.
        spoke.send_frames([b"hello"])
        for dealer in strangers:
            dealer.send(b"hello")
        hellos = 0
        while hellos < 3:
            hellos += hub.recv_frames(WAIT_S) is not None
        hub.peer_joined(SPOKE_PREFIX + b"admitted")  # the sender admitted it; it never joins
        hub.peer_joined(spoke.peer_id)
        assert not spoke.lends_tensors()  # not joined yet: it says nothing of its memory
        _pump(hub, [spoke], lambda _: spoke.lends_tensors())
        for dealer in strangers:
            dealer.send(claim)
            dealer.send(records.encode(records.Go(1, 1, True)))
        _pump(hub, [], lambda _: hub.counters().get("shm_bad_records", 0) >= 4)
        assert hub.lent_peers(layout) == [] and hub.take_gos() == []

        # The spoke that joined: believed, asked, answered, written.
        spoke.lend_tensors(memory.where(), layout)
        _pump(hub, [], lambda _: hub.lent_peers(layout))
        assert hub.lent_peers(layout) == [spoke.peer_id]
        assert hub.lent_peers(b"M" * 16) == []  # only for the layout it lent for
        hub.ask_lent(spoke.peer_id, 7, 1, layout)
        (ask,) = _pump(hub, [spoke], len)
        assert ask == [records.encode(records.Ask(7, 1, layout))]
        spoke.answer(7, 1, True)
        gos: list = []
        _pump(hub, [], lambda _: gos.extend(hub.take_gos()) or gos)
        assert gos == [(spoke.peer_id, 7, 1, True)]
        mapped = hub.lent_memory(spoke.peer_id, 4096)
        assert mapped is not None and hub.lent_memory(spoke.peer_id, 4096) is mapped
        mapped[:4] = [9, 8, 7, 6]
        hub.written(spoke.peer_id, 7, 1, True, b'{"step": 7}')
        (written,) = _pump(hub, [spoke], len)
        assert written == [records.encode(records.Written(7, 1, True, b'{"step": 7}'))]
        assert bytes(memory.array[:4]) == bytes([9, 8, 7, 6])  # its own memory, no copy
        counts = hub.counters()
        assert counts["lent_peers"] == 1 and counts["lent_writes"] == 1, counts
        hub.peer_left(spoke.peer_id)  # the sender forgot it: so does the table
        assert hub.lent_peers(layout) == []
    finally:
        for dealer in strangers:
            dealer.close(0)
        spoke.close()
        hub.close()
        memory.close()


def test_a_hubs_table_of_lent_memory_maps_once_and_refuses_once(lend) -> None:
    """LentPeers, what every hub keeps: a claim said again keeps its mapping (no map per
    version), a refused claim said again stays refused (no map nor warning per
    version) until the peer names other memory, a peer that lends nothing or is
    forgotten is asked no more, and answers are bounded."""
    from zmqsync.transport.shm.lent import MAX_GOS, LentPeers

    layout = b"L" * 16
    table = LentPeers()
    sealed, conn = lend("sealed")
    good = records.LentAt(*sealed, layout)
    table.said(b"a", good)
    mapped = table.memory(b"a", NBYTES)
    assert mapped is not None
    table.said(b"a", good)  # said again after a streamed version: the same mapping
    assert table.memory(b"a", NBYTES) is mapped
    assert table.peers(layout) == [b"a"] and table.peers(b"M" * 16) == []

    unsealed, other = lend("unsealed")
    bad = records.LentAt(*unsealed, layout)
    table.said(b"b", bad)
    assert table.memory(b"b", NBYTES) is None
    table.said(b"b", bad)  # the same claim again: refused without another look
    assert table.peers(layout) == [b"a"] and table.memory(b"b", NBYTES) is None
    assert table.counts()["lent_refused"] == 1
    table.said(b"b", records.LentAt(*sealed, layout))
    assert sorted(table.peers(layout)) == [b"a", b"b"]  # other memory: looked at anew

    table.said(b"a", records.LentAt(os.getpid(), 0, 0, 0, bytes(16)))  # lends none now
    table.forget(b"b")
    assert table.peers(layout) == [] and table.counts()["lent_peers"] == 0
    for i in range(MAX_GOS + 10):
        table.answered(b"a", records.Go(i, 1, True))
    assert len(table.take_gos()) == MAX_GOS and table.take_gos() == []
    _report(conn)
    _report(other)
